//! VGG-16 (configuration D), with or without batch norm, laid out as torchvision's `vgg16` and
//! `vgg16_bn`: parameters `features.N.*` and `classifier.N.*` with torchvision's indices, so
//! counts and weights line up (138,357,544 parameters with 1000 classes).
//!
//! Modules: one per convolution (conv, \[bn,\] ReLU), one per max-pool, `avgpool` (adaptive 7x7 and
//! flatten), then `classifier.0`, `classifier.3`, `classifier.6`. Without batch norm, a stage
//! holding a block's last convolution and the pool after it runs the two as one layer
//! ([`fusions::conv_bias_relu_pool`]: one kernel each way on a GPU with `--fused-kernels`).
//!
//! Initialised as torchvision's `VGG.__init__`: convolutions Kaiming normal (fan-out, ReLU) with
//! bias 0, batch norms weight 1 and bias 0, linear layers N(0, 0.01) with bias 0.

use tch::nn::{self, ModuleT};
use tch::Tensor;

use super::layers::{batch_norm2d, conv2d, dropout, linear_normal};
use super::{InputKind, Loss, ModelOptions, ModuleDef};
use crate::cuda::fusions;

/// Standard deviation of torchvision's VGG classifier weights.
const LINEAR_STD: f64 = 0.01;

/// Output channels per convolution, `None` for a max-pool.
const CONFIG_D: [Option<i64>; 18] = [
    Some(64),
    Some(64),
    None,
    Some(128),
    Some(128),
    None,
    Some(256),
    Some(256),
    Some(256),
    None,
    Some(512),
    Some(512),
    Some(512),
    None,
    Some(512),
    Some(512),
    Some(512),
    None,
];

/// torchvision's `AdaptiveAvgPool2d((7, 7))`, then flattened. The features of a 224x224 image are
/// already 7x7, where each output averages one input: the pool is the identity, and is skipped.
/// The values are the same; what is spared is a kernel each way and, under `--deterministic`,
/// a refusal, since CUDA's backward of the adaptive pool accumulates with atomics and has no
/// deterministic version (other image sizes still take it, and fail there naming it).
fn avgpool(xs: &Tensor) -> Tensor {
    let pooled = match xs.size()[2..] {
        [7, 7] => xs.shallow_clone(),
        _ => xs.adaptive_avg_pool2d([7, 7]),
    };
    pooled.flatten(1, -1)
}

pub fn vgg16(o: &ModelOptions, batch_norm: bool) -> (Vec<ModuleDef>, Loss, InputKind) {
    let mut modules = Vec::new();
    let mut index = 0usize; // torchvision's index inside `features`
    let mut c_in = 3i64;
    for (at, entry) in CONFIG_D.into_iter().enumerate() {
        match entry {
            Some(c_out) => {
                let conv_index = index;
                let name = format!("features.{conv_index}");
                let mut module = ModuleDef::new(name, move |p: &nn::Path| {
                    conv_block(p, conv_index, c_in, c_out, batch_norm)
                });
                if !batch_norm && CONFIG_D.get(at + 1) == Some(&None) {
                    module = module
                        .fused_with_next(move |p: &nn::Path| conv_pool_block(p, conv_index, c_in, c_out));
                }
                modules.push(module);
                index += if batch_norm { 3 } else { 2 };
                c_in = c_out;
            }
            None => {
                modules.push(ModuleDef::new(format!("features.{index}"), |_p: &nn::Path| {
                    nn::func_t(|xs, _| fusions::max_pool2x2(xs))
                }));
                index += 1;
            }
        }
    }
    modules.push(ModuleDef::new("avgpool", |_p: &nn::Path| {
        nn::func_t(|xs, _| avgpool(xs))
    }));
    let p_drop = o.dropout;
    let classes = o.num_classes;
    for (index, (d_in, d_out)) in [
        (0usize, (512 * 7 * 7, 4096)),
        (3, (4096, 4096)),
        (6, (4096, classes)),
    ] {
        let last = index == 6;
        modules.push(ModuleDef::new(
            format!("classifier.{index}"),
            move |p: &nn::Path| {
                let linear = linear_normal(p / "classifier" / index, d_in, d_out, LINEAR_STD, true);
                nn::func_t(move |xs, train| {
                    let mut ys = xs.apply(&linear);
                    if last {
                        ys
                    } else {
                        dropout(ys.relu_(), p_drop, train)
                    }
                })
            },
        ));
    }
    (
        modules,
        Loss::CrossEntropy,
        InputKind::Image {
            size: o.image_size,
            classes: o.num_classes,
        },
    )
}

/// The 3x3 convolutions' stride and padding (the output keeps the input's size).
const STRIDE: i64 = 1;
const PADDING: i64 = 1;

/// The 3x3 convolution `features.{index}`.
fn conv3x3(p: &nn::Path, index: usize, c_in: i64, c_out: i64) -> nn::Conv2D {
    conv2d(p / "features" / index, c_in, c_out, 3, STRIDE, PADDING, true)
}

fn conv_block(p: &nn::Path, index: usize, c_in: i64, c_out: i64, batch_norm: bool) -> impl ModuleT {
    let conv = conv3x3(p, index, c_in, c_out);
    let bn = batch_norm.then(|| batch_norm2d(p / "features" / (index + 1), c_out));
    nn::func_t(move |xs, train| match &bn {
        Some(bn) => xs.apply(&conv).apply_t(bn, train).relu_(),
        None => {
            let bias = conv.bs.as_ref().expect("vgg's convolutions have a bias");
            fusions::conv_bias_relu(xs, &conv.ws, bias, STRIDE, PADDING)
        }
    })
}

/// A block's last convolution (no batch norm) and the max-pool after it as one layer: the
/// convolution's parameters as [`conv_block`] makes them, and what it and the pool compute, with
/// the bias, the ReLU and the pool one kernel each way on a GPU.
fn conv_pool_block(p: &nn::Path, index: usize, c_in: i64, c_out: i64) -> impl ModuleT {
    let conv = conv3x3(p, index, c_in, c_out);
    nn::func_t(move |xs, _| {
        let bias = conv.bs.as_ref().expect("vgg's convolutions have a bias");
        fusions::conv_bias_relu_pool(xs, &conv.ws, bias, STRIDE, PADDING)
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    /// The skipped pool computes what torchvision's does, forward and backward, for the 7x7
    /// features of a 224x224 image in either memory layout; other sizes still pool.
    #[test]
    fn the_pool_of_7x7_features_is_skipped_with_the_same_values_and_gradients() {
        // Held, so that other tests' seeded draws stay theirs.
        let _generator = crate::models::hold_seeded(1);
        for channels_last in [false, true] {
            let mut x = Tensor::randn([2, 512, 7, 7], (Kind::Float, Device::Cpu));
            if channels_last {
                x = x.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2]);
                assert_eq!(x.stride()[1], 1, "channels_last strides");
            }
            let ours_in = x.detach().set_requires_grad(true);
            let theirs_in = x.detach().set_requires_grad(true);
            let ours = super::avgpool(&ours_in);
            let theirs = theirs_in.adaptive_avg_pool2d([7, 7]).flatten(1, -1);
            assert!(ours.equal(&theirs), "channels_last {channels_last}");
            let weights = Tensor::randn([2, 512 * 49], (Kind::Float, Device::Cpu));
            (&ours * &weights).sum(Kind::Float).backward();
            (&theirs * &weights).sum(Kind::Float).backward();
            assert!(
                ours_in.grad().equal(&theirs_in.grad()),
                "channels_last {channels_last}"
            );
        }
        let small = Tensor::randn([2, 512, 1, 1], (Kind::Float, Device::Cpu));
        let pooled = super::avgpool(&small);
        assert_eq!(pooled.size(), [2, 512 * 49]);
        assert!(pooled.equal(&small.adaptive_avg_pool2d([7, 7]).flatten(1, -1)));
    }

    /// vgg16's first block (two convolutions, then a pool) as a training stage runs it with
    /// `--fused-kernels`, in bf16 autocast over float32 parameters and channels_last, the CPU
    /// standing in for the GPU (the kernels themselves run there): the last convolution and the
    /// pool are one layer, one kernel each way after the convolution, and every parameter gets
    /// what ATen's operations give in the GPU's arithmetic (each bias added after its convolution). The
    /// pooled activations and the weights' gradients bit for bit; the biases', float sums of
    /// bf16 terms in another order, within 2^-7 of their terms' magnitudes.
    #[test]
    fn vgg16s_first_block_trains_through_the_fused_operations_as_atens_do() {
        use crate::config::Precision;
        use crate::models::{ModelDef, ModelOptions};
        use crate::stage::Stage;

        let Ok(cuda) = crate::cuda::cuda() else {
            eprintln!(
                "SKIPPED vgg16s_first_block_trains_through_the_fused_operations_as_atens_do: \
                 no CUDA bridge in this build"
            );
            return;
        };
        let options = ModelOptions {
            num_classes: 10,
            image_size: 16,
            layers: 0,
            hidden: 0,
            heads: 0,
            seq_len: 0,
            vocab_size: 0,
            dropout: 0.0,
            active_units: 0,
        };
        let model = ModelDef::named("vgg16", &options).unwrap();
        assert_eq!(model.module_name(2), "features.4");
        let mut stage = Stage::build(&model, 0..3, 5, Device::Cpu);
        stage.set_arithmetic(Precision::Bf16, true).unwrap();
        let (x, k) = crate::models::seeded(6, || {
            (
                Tensor::randn([2, 3, 16, 16], (Kind::Float, Device::Cpu)),
                Tensor::randn([2, 64, 8, 8], (Kind::Float, Device::Cpu)),
            )
        });
        let out = {
            let _cpu = cuda.cpu_stand_in();
            stage.forward(&x, true)
        };
        let name = cuda.grad_fn_name(&out);
        assert!(name.contains("BiasReluPool"), "{name}");
        (out.to_kind(Kind::Float) * &k).sum(Kind::Float).backward();

        // ATen's operations on copies of the same (channels_last) parameters, cast to bf16 as
        // autocast casts them, on the input in channels_last as the stage lays it out.
        let vars: std::collections::HashMap<String, Tensor> = stage.variables().into_iter().collect();
        let names = [
            "features.0.weight",
            "features.0.bias",
            "features.2.weight",
            "features.2.bias",
        ];
        let [w0, b0, w2, b2] = names.map(|name| vars[name].detach().copy().set_requires_grad(true));
        let bf16 = |t: &Tensor| t.to_kind(Kind::BFloat16);
        let conv = |xs: &Tensor, w: &Tensor| xs.conv2d(&bf16(w), None::<&Tensor>, [1, 1], [1, 1], [1, 1], 1);
        let bias_relu = |c: &Tensor, b: &Tensor| (c + bf16(b).view([1, -1, 1, 1])).relu();
        let x_cl = bf16(&x.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2]));
        let c0 = conv(&x_cl, &w0);
        let c2 = conv(&bias_relu(&c0, &b0), &w2);
        let pooled = bias_relu(&c2, &b2).max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
        assert!(pooled.equal(&out), "the pooled activations differ from ATen's");
        let loss = (pooled.to_kind(Kind::Float) * &k).sum(Kind::Float);
        // The convolutions' outputs' gradients: the bias gradients' terms.
        let terms = Tensor::run_backward(&[&loss], &[&c0, &c2], true, false);
        loss.backward();

        for (name, aten) in names.iter().zip([&w0, &b0, &w2, &b2]) {
            let ours = vars[*name].grad();
            assert!(ours.defined() && aten.grad().defined(), "{name}: no gradient");
            if name.ends_with("weight") {
                assert!(
                    ours.equal(&aten.grad()),
                    "{name}: the gradient differs from ATen's"
                );
            } else {
                let g = &terms[usize::from(*name == "features.2.bias")];
                super::fusions::assert_bias_gradient_close(
                    &ours,
                    &aten.grad(),
                    &super::fusions::channel_magnitudes(g),
                    name,
                );
            }
        }
    }
}
