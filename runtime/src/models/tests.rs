//! Parameter counts and module chaining for every model family.

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
    };
    if name == "mlp" {
        o.num_classes = 10;
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
    assert_eq!(total_params("vgg16_bn", &o), 138_365_992);
    assert_eq!(total_params("resnet50", &o), 25_557_032);
    assert_eq!(total_params("resnet101", &o), 44_549_160);
    assert_eq!(total_params("resnet152", &o), 60_192_808);
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

#[test]
fn unknown_model_lists_known_ones() {
    let err = ModelDef::named("alexnet", &options("mlp")).err().unwrap();
    assert_eq!(
        err.to_string(),
        "unknown model \"alexnet\"; known models: mlp, vgg16, vgg16_bn, resnet50, resnet101, resnet152, transformer"
    );
}
