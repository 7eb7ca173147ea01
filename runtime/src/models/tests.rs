//! Parameter counts, module chaining and per-module seeding for every model family.

use tch::nn;

use super::*;

fn options(name: &str) -> ModelOptions {
    let mut o = ModelOptions {
        num_classes: 1000,
        image_size: 32,
        layers: 2,
        hidden: 64,
        heads: 4,
        seq_len: 16,
        vocab_size: 100,
        dropout: 0.0,
        active_units: 4,
    };
    if name.ends_with("mlp") {
        o.num_classes = 10;
    }
    if name == "alexnet" {
        // The smallest image its convolutions and pools leave a pixel of.
        o.image_size = 63;
    }
    o
}

fn total_params(name: &str, o: &ModelOptions) -> u64 {
    ModelDef::named(name, o).unwrap().param_counts().iter().sum()
}

#[test]
fn torchvision_parameter_counts_line_up() {
    let o = options("vgg16");
    assert_eq!(total_params("vgg16", &o), 138_357_544);
    assert_eq!(total_params("alexnet", &o), 61_100_840);
    assert_eq!(total_params("vgg16_bn", &o), 138_365_992);
    assert_eq!(total_params("resnet50", &o), 25_557_032);
    assert_eq!(total_params("resnet101", &o), 44_549_160);
    assert_eq!(total_params("resnet152", &o), 60_192_808);
}

/// The contract's layer lists, which the driver matches PipeDream's stage modules against, are
/// the modules this runtime builds: one list per module, parameter for parameter.
#[test]
fn the_contracts_layer_lists_are_the_modules_built() {
    for name in [
        "alexnet",
        "vgg16",
        "vgg16_bn",
        "resnet50",
        "resnet101",
        "resnet152",
    ] {
        let o = options(name);
        let def = ModelDef::named(name, &o).unwrap();
        let layers = stagehand_contract::architecture::module_layers(name, o.num_classes as u32).unwrap();
        let counts = def.param_counts();
        assert_eq!(
            layers.len() + 1,
            counts.len(),
            "{name}: one list per module, the loss aside"
        );
        for (i, (module, &count)) in layers.iter().zip(&counts).enumerate() {
            let listed: u64 = module.iter().map(|l| l.params()).sum();
            assert_eq!(
                listed,
                count,
                "{name} module {i} ({}): {module:?}",
                def.module_name(i)
            );
        }
    }
    assert!(stagehand_contract::architecture::module_layers("mlp", 10).is_none());
}

#[test]
fn bert_base_layout_has_bert_parameter_count() {
    let o = ModelOptions {
        layers: 12,
        hidden: 768,
        heads: 12,
        seq_len: 512,
        vocab_size: 30522,
        ..options("transformer")
    };
    // BertForMaskedLM (bert-base-uncased) has 109,514,298 parameters with the decoder tied to the
    // word embeddings; ours is untied, which adds one vocab x hidden matrix.
    assert_eq!(total_params("transformer", &o), 109_514_298 + 30522 * 768);
}

#[test]
fn every_model_chains_its_modules_to_the_loss() {
    for name in MODEL_NAMES {
        let o = options(name);
        let def = ModelDef::named(name, &o).unwrap();
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let modules = def.build(&vs.root(), 0..def.num_modules(), 1);
        assert_eq!(modules.len() + 1, def.num_modules(), "{name}");
        let out = tch::no_grad(|| {
            modules
                .iter()
                .fold(def.example_input(2), |xs, m| m.forward_t(&xs, false))
        });
        let target = match def.input {
            InputKind::Image { .. } => tch::Tensor::zeros([2], (tch::Kind::Int64, tch::Device::Cpu)),
            InputKind::Tokens { seq_len, .. } => {
                tch::Tensor::zeros([2, seq_len], (tch::Kind::Int64, tch::Device::Cpu))
            }
        };
        let loss = def.loss.compute(&out, &target).unwrap();
        assert!(loss.double_value(&[]).is_finite(), "{name}");
        assert_eq!(def.module_name(def.num_modules() - 1), "loss");
    }
}

/// The layers a stage runs (`build_layers`) hold, for every model and several slices, the
/// parameters `build` gives module by module, and compute what its modules compute one after
/// another; only vgg16 fuses, each block's last convolution with the pool after it (the one
/// module of `features` without parameters), and only where a slice holds both.
#[test]
fn a_stages_layers_hold_and_compute_what_the_modules_do() {
    for name in MODEL_NAMES {
        let o = options(name);
        let def = ModelDef::named(name, &o).unwrap();
        let all = def.num_modules() - 1;
        let pools: Vec<usize> = match *name {
            "vgg16" => (1..all)
                .filter(|&i| def.module_name(i).starts_with("features."))
                .filter(|&i| {
                    let vs = nn::VarStore::new(tch::Device::Cpu);
                    def.build(&vs.root(), i..i + 1, 0);
                    vs.variables().is_empty()
                })
                .collect(),
            _ => vec![],
        };
        for range in [0..all.min(8), 0..2, 1..all.min(4), 2..all.min(9)] {
            let modules_vs = nn::VarStore::new(tch::Device::Cpu);
            let modules = def.build(&modules_vs.root(), range.clone(), 5);
            let layers_vs = nn::VarStore::new(tch::Device::Cpu);
            let layers = def.build_layers(&layers_vs.root(), range.clone(), 5);
            let (ours, theirs) = (layers_vs.variables(), modules_vs.variables());
            assert_eq!(ours.len(), theirs.len(), "{name} {range:?}");
            for (var, tensor) in &theirs {
                assert!(tensor.equal(&ours[var]), "{name} {range:?}: {var}");
            }
            let fused = pools
                .iter()
                .filter(|&&i| range.start < i && i < range.end)
                .count();
            assert_eq!(layers.len(), modules.len() - fused, "{name} {range:?}");
            if range.start == 0 {
                // sparse_mlp hands on sparse tensors, which compare dense.
                let run = |list: &[Box<dyn nn::ModuleT>]| {
                    let out = tch::no_grad(|| {
                        list.iter()
                            .fold(def.example_input(2), |xs, m| m.forward_t(&xs, false))
                    });
                    if out.is_sparse() {
                        out.to_dense(None, false)
                    } else {
                        out
                    }
                };
                assert!(run(&modules).equal(&run(&layers)), "{name} {range:?}");
            }
        }
    }
}

#[test]
fn a_slice_gets_the_same_parameters_as_the_whole_model() {
    let o = options("mlp");
    let def = ModelDef::named("mlp", &o).unwrap();
    let whole = nn::VarStore::new(tch::Device::Cpu);
    def.build(&whole.root(), 0..def.num_modules(), 7);
    let slice = nn::VarStore::new(tch::Device::Cpu);
    def.build(&slice.root(), 1..3, 7);
    let whole_vars = whole.variables();
    let slice_vars = slice.variables();
    assert_eq!(slice_vars.len(), 4, "{:?}", slice_vars.keys());
    for (name, tensor) in slice_vars {
        assert!(
            tensor.equal(&whole_vars[&name]),
            "{name} differs between slice and whole model"
        );
    }
}

/// A module's parameters depend on the seed and its index only: built alone they equal what it
/// gets after the modules before it, for every family (the module chosen is cheap to build).
#[test]
fn every_family_initialises_a_module_alone_as_after_the_others() {
    for (name, index) in [("vgg16_bn", 3), ("resnet50", 4), ("transformer", 2)] {
        let def = ModelDef::named(name, &options(name)).unwrap();
        let after = nn::VarStore::new(tch::Device::Cpu);
        def.build(&after.root(), 0..index + 1, 11);
        let alone = nn::VarStore::new(tch::Device::Cpu);
        def.build(&alone.root(), index..index + 1, 11);
        let after_vars = after.variables();
        let alone_vars = alone.variables();
        assert!(!alone_vars.is_empty(), "{name}: module {index} has parameters");
        for (var, tensor) in alone_vars {
            assert!(
                tensor.equal(&after_vars[&var]),
                "{name}: {var} depends on the modules before it"
            );
        }
    }
}

/// Values are drawn on the CPU and copied: a module built on a GPU holds the CPU's values.
#[test]
fn a_module_built_on_a_gpu_holds_the_cpus_values() {
    let Some(gpu) = crate::cuda::test_gpu("a_module_built_on_a_gpu_holds_the_cpus_values") else {
        return;
    };
    let def = ModelDef::named("resnet50", &options("resnet50")).unwrap();
    let cpu = nn::VarStore::new(tch::Device::Cpu);
    def.build(&cpu.root(), 0..5, 2);
    let cuda = nn::VarStore::new(gpu);
    def.build(&cuda.root(), 0..5, 2);
    let cuda_vars = cuda.variables();
    for (var, tensor) in cpu.variables() {
        let on_gpu = &cuda_vars[&var];
        assert_eq!(on_gpu.device(), gpu, "{var}");
        assert!(
            tensor.equal(&on_gpu.to_device(tch::Device::Cpu)),
            "{var} differs on the GPU"
        );
    }
}

#[test]
fn unknown_model_lists_known_ones() {
    let err = ModelDef::named("inception_v3", &options("mlp")).err().unwrap();
    assert_eq!(
        err.to_string(),
        "unknown model \"inception_v3\"; known models: mlp, sparse_mlp, alexnet, vgg16, vgg16_bn, resnet50, resnet101, resnet152, transformer"
    );
}

/// `sparse_mlp` is `mlp` with k-winners-take-all activations handed on as sparse COO tensors:
/// the same parameters, at most `active_units` entries per sample, and the same outputs and
/// gradients as the dense network with its activations masked alike (within the rounding of
/// sums taken in another order: a COO product adds only the stored entries).
#[test]
fn sparse_mlp_hands_on_coo_activations_and_computes_what_the_masked_dense_network_does() {
    let o = options("sparse_mlp");
    let sparse = ModelDef::named("sparse_mlp", &o).unwrap();
    let dense = ModelDef::named("mlp", &o).unwrap();
    let (svs, dvs) = (
        nn::VarStore::new(tch::Device::Cpu),
        nn::VarStore::new(tch::Device::Cpu),
    );
    let sparse_modules = sparse.build(&svs.root(), 0..sparse.num_modules(), 3);
    let dense_modules = dense.build(&dvs.root(), 0..dense.num_modules(), 3);
    let dense_vars = dvs.variables();
    for (name, tensor) in svs.variables() {
        assert!(tensor.equal(&dense_vars[&name]), "{name}");
    }
    let x = seeded(4, || {
        tch::Tensor::randn([5, 3, 32, 32], (tch::Kind::Float, tch::Device::Cpu))
    });
    // Sparse: every hidden activation is COO with at most 4 entries per row.
    let mut h = x.shallow_clone();
    for (i, m) in sparse_modules.iter().enumerate() {
        h = m.forward_t(&h, true);
        if i + 1 < sparse_modules.len() {
            assert!(h.is_sparse(), "layers.{i}");
            assert_eq!(h.size(), [5, 64]);
            let rows = h.coalesce().internal_indices().get(0);
            let per_row = rows.bincount(None::<tch::Tensor>, 5);
            assert!(per_row.max().int64_value(&[]) <= 4, "{per_row}");
        }
    }
    let sparse_out = h;
    // Dense: the same layers, each hidden output masked to its row's 4 largest.
    let mut h = x.shallow_clone();
    for (i, m) in dense_modules.iter().enumerate() {
        h = m.forward_t(&h, true);
        if i + 1 < dense_modules.len() {
            let kth = h.topk(4, 1, true, true).0.narrow(1, 3, 1);
            h = &h * h.ge_tensor(&kth);
        }
    }
    let close = |a: &tch::Tensor, b: &tch::Tensor| {
        let scale = b.abs().max().double_value(&[]).max(1e-6);
        (a - b).abs().max().double_value(&[]) <= 1e-5 * scale
    };
    assert!(close(&sparse_out, &h), "outputs differ");
    let target = tch::Tensor::from_slice(&[0i64, 3, 9, 1, 2]);
    sparse.loss.compute(&sparse_out, &target).unwrap().backward();
    dense.loss.compute(&h, &target).unwrap().backward();
    for (name, tensor) in svs.variables() {
        assert!(
            close(&tensor.grad(), &dense_vars[&name].grad()),
            "{name}'s gradient differs"
        );
    }
}

/// Top-1 accuracy counts the targets whose class has the highest logit, or shares it, over the
/// targets the loss counts (not -100), for class logits and per-token logits alike; class logits
/// also count the targets with fewer than five logits above theirs (top-5). The shares are
/// ratios of small integers, which double division gives exactly, so they are compared exactly.
#[test]
fn accuracy_is_the_share_of_counted_targets_whose_class_has_the_highest_logit() {
    let logits = Tensor::from_slice(&[
        0.1f32, 2.0, -1.0, // class 1
        3.0, 3.0, 0.0, // a tie of 0 and 1: either is right
        0.0, 0.0, 5.0, // class 2
        1.0, 0.0, 0.0, // class 0
    ])
    .reshape([4, 3]);
    let accuracy = |loss: Loss, logits: &Tensor, target: &[i64], shape: &[i64]| {
        let target = Tensor::from_slice(target).reshape(shape);
        let value = loss.accuracy(logits, &target).unwrap();
        assert_eq!(value.kind(), Kind::Double);
        Vec::<f64>::try_from(&value).unwrap()
    };
    // Three classes: every target is in the top five.
    let classes = |target: &[i64]| accuracy(Loss::CrossEntropy, &logits, target, &[4]);
    assert_eq!(classes(&[1, 0, 2, 0]), [1.0, 1.0]);
    assert_eq!(
        classes(&[1, 1, 2, 2]),
        [0.75, 1.0],
        "a share of the highest logit is right"
    );
    assert_eq!(classes(&[1, 2, 2, 2]), [0.5, 1.0]);
    assert_eq!(classes(&[0, 2, 1, 1]), [0.0, 1.0]);
    assert_eq!(
        classes(&[1, -100, 0, 0]),
        [2.0 / 3.0, 1.0],
        "an ignored target is not counted"
    );
    assert_eq!(classes(&[-100, -100, -100, -100]), [0.0, 0.0], "none counted");

    // Seven classes: what counts is how many logits are above the target's (0 for top-1, at most
    // 4 for top-5).
    let ranked = Tensor::from_slice(&[
        6.0f32, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0, // class c has c above it
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, // class c has 6 - c above it
        6.0, 5.0, 4.0, 3.0, 2.0, 2.0, 0.0, // classes 4 and 5 tie for the fifth place
    ])
    .reshape([3, 7]);
    let top = |target: &[i64]| accuracy(Loss::CrossEntropy, &ranked, target, &[3]);
    assert_eq!(top(&[0, 6, 0]), [1.0, 1.0]);
    assert_eq!(
        top(&[4, 2, 1]),
        [0.0, 1.0],
        "4, 4 and 1 logits above: in the top five"
    );
    assert_eq!(
        top(&[5, 1, 2]),
        [0.0, 1.0 / 3.0],
        "5, 5 and 2 above: only the last is in"
    );
    assert_eq!(
        top(&[0, 0, 5]),
        [1.0 / 3.0, 2.0 / 3.0],
        "a tie for fifth place is in"
    );
    assert_eq!(top(&[6, 0, 6]), [0.0, 0.0], "six above is out");
    assert_eq!(top(&[3, -100, 5]), [0.0, 1.0], "an ignored target is not counted");

    // The same three-class logits as two sequences of two tokens: top-1 alone.
    let tokens = logits.reshape([2, 2, 3]);
    let per_token = |target: &[i64]| accuracy(Loss::TokenCrossEntropy, &tokens, target, &[2, 2]);
    assert_eq!(per_token(&[1, 0, 2, 0]), [1.0]);
    assert_eq!(per_token(&[1, 0, 0, -100]), [2.0 / 3.0]);
    assert_eq!(per_token(&[-100, 2, 2, 1]), [1.0 / 3.0]);
}

/// `has_convolutions` (which says whether `--channels-last` does anything) names exactly the
/// models that build a 4-dimensional weight.
#[test]
fn the_models_said_to_have_convolutions_are_those_that_build_them() {
    for &name in MODEL_NAMES {
        let def = ModelDef::named(name, &options(name)).unwrap();
        let vs = nn::VarStore::new(tch::Device::Cpu);
        tch::no_grad(|| drop(def.build(&vs.root(), 0..def.num_modules(), 0)));
        let built = vs.variables().values().any(|t| t.dim() == 4);
        assert_eq!(has_convolutions(name), built, "{name}");
    }
}

/// `size_flags` names what each model is built from: changing a size it does not name builds
/// the same parameters and input (so a checkpoint need not agree on it, and giving it does
/// nothing), and changing one it names changes either, but for those that change the arithmetic
/// alone (dropout, attention heads, sparse_mlp's active units).
#[test]
fn each_model_is_built_from_the_sizes_it_names_and_no_other() {
    type Change = fn(&mut ModelOptions);
    let changed: [(&str, Change); 8] = [
        ("--num-classes", |o| o.num_classes += 2),
        ("--image-size", |o| o.image_size *= 2),
        ("--layers", |o| o.layers += 1),
        ("--hidden", |o| o.hidden *= 2),
        ("--heads", |o| o.heads *= 2),
        ("--seq-len", |o| o.seq_len *= 2),
        ("--vocab-size", |o| o.vocab_size *= 2),
        ("--active-units", |o| o.active_units *= 2),
    ];
    for name in MODEL_NAMES {
        let o = options(name);
        let built = |o: &ModelOptions| {
            let def = ModelDef::named(name, o).unwrap();
            (def.param_counts(), def.input)
        };
        let base = built(&o);
        for flag in size_flags(name) {
            assert!(o.value_of(flag).is_some(), "{name}: {flag} has no value");
        }
        for (flag, change) in changed {
            let mut other = o.clone();
            change(&mut other);
            let (named, differs) = (size_flags(name).contains(&flag), built(&other) != base);
            assert!(
                named || !differs,
                "{name}: {flag} changes the model but is not named"
            );
            // Heads and active units change the arithmetic alone, as dropout does.
            let shapes = !["--heads", "--active-units"].contains(&flag);
            assert!(
                !(named && shapes) || differs,
                "{name}: {flag} is named but changes nothing"
            );
        }
    }
}
