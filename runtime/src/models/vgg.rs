//! VGG-16 (configuration D), with or without batch norm, laid out as torchvision's `vgg16` and
//! `vgg16_bn`: parameters `features.N.*` and `classifier.N.*` with torchvision's indices, so
//! counts and weights line up (138,357,544 parameters with 1000 classes).
//!
//! Modules: one per convolution (conv, \[bn,\] ReLU), one per max-pool, `avgpool` (adaptive 7x7 and
//! flatten), then `classifier.0`, `classifier.3`, `classifier.6`.
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
    for entry in CONFIG_D {
        match entry {
            Some(c_out) => {
                let conv_index = index;
                let name = format!("features.{conv_index}");
                modules.push(ModuleDef::new(name, move |p: &nn::Path| {
                    conv_block(p, conv_index, c_in, c_out, batch_norm)
                }));
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

fn conv_block(p: &nn::Path, index: usize, c_in: i64, c_out: i64, batch_norm: bool) -> impl ModuleT {
    let features = p / "features";
    let conv = conv2d(&features / index, c_in, c_out, 3, STRIDE, PADDING, true);
    let bn = batch_norm.then(|| batch_norm2d(&features / (index + 1), c_out));
    nn::func_t(move |xs, train| match &bn {
        Some(bn) => xs.apply(&conv).apply_t(bn, train).relu_(),
        None => {
            let bias = conv.bs.as_ref().expect("vgg's convolutions have a bias");
            fusions::conv_bias_relu(xs, &conv.ws, bias, STRIDE, PADDING)
        }
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    /// The skipped pool computes what torchvision's does, forward and backward, for the 7x7
    /// features of a 224x224 image in either memory layout; other sizes still pool.
    #[test]
    fn the_pool_of_7x7_features_is_skipped_with_the_same_values_and_gradients() {
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
}
