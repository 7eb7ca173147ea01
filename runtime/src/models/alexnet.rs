//! AlexNet laid out as torchvision's `alexnet` (the one-GPU variant PipeDream also trains):
//! parameters `features.N.*` and `classifier.N.*` with torchvision's indices, so counts and
//! weights line up (61,100,840 parameters with 1000 classes).
//!
//! Modules: one per convolution (conv, ReLU), one per max-pool, `avgpool` (adaptive 6x6 and
//! flatten), then `classifier.1` and `classifier.4` (dropout, linear, ReLU) and `classifier.6`.
//!
//! Initialised as torchvision leaves it: PyTorch's default for convolutions and linear layers.

use tch::nn;

use super::layers::{conv2d_default, dropout, linear};
use super::{InputKind, Loss, ModelOptions, ModuleDef};

/// A convolution's `(in, out, kernel, stride, padding)`.
type Conv = (i64, i64, i64, i64, i64);

/// Each feature module's torchvision index with its convolution, `None` for a 3x3 max-pool of
/// stride 2.
const FEATURES: [(usize, Option<Conv>); 8] = [
    (0, Some((3, 64, 11, 4, 2))),
    (2, None),
    (3, Some((64, 192, 5, 1, 2))),
    (5, None),
    (6, Some((192, 384, 3, 1, 1))),
    (8, Some((384, 256, 3, 1, 1))),
    (10, Some((256, 256, 3, 1, 1))),
    (12, None),
];

pub fn alexnet(o: &ModelOptions) -> (Vec<ModuleDef>, Loss, InputKind) {
    let mut modules = Vec::new();
    for (index, conv) in FEATURES {
        let name = format!("features.{index}");
        modules.push(match conv {
            Some((c_in, c_out, kernel, stride, padding)) => ModuleDef::new(name, move |p: &nn::Path| {
                let conv = conv2d_default(p / "features" / index, c_in, c_out, kernel, stride, padding);
                nn::func_t(move |xs, _| xs.apply(&conv).relu_())
            }),
            None => ModuleDef::new(name, |_p: &nn::Path| {
                nn::func_t(|xs, _| xs.max_pool2d([3, 3], [2, 2], [0, 0], [1, 1], false))
            }),
        });
    }
    modules.push(ModuleDef::new("avgpool", |_p: &nn::Path| {
        nn::func_t(|xs, _| xs.adaptive_avg_pool2d([6, 6]).flatten(1, -1))
    }));
    let p_drop = o.dropout;
    for (index, (d_in, d_out)) in [
        (1usize, (256 * 6 * 6, 4096)),
        (4, (4096, 4096)),
        (6, (4096, o.num_classes)),
    ] {
        let last = index == 6;
        modules.push(ModuleDef::new(
            format!("classifier.{index}"),
            move |p: &nn::Path| {
                let linear = linear(p / "classifier" / index, d_in, d_out);
                nn::func_t(move |xs, train| {
                    if last {
                        xs.apply(&linear)
                    } else {
                        dropout(xs.shallow_clone(), p_drop, train).apply(&linear).relu_()
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
