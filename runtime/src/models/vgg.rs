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

use super::layers::{batch_norm2d, conv2d, dropout, linear_normal};
use super::{InputKind, Loss, ModelOptions, ModuleDef};

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
                    nn::func_t(|xs, _| xs.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false))
                }));
                index += 1;
            }
        }
    }
    modules.push(ModuleDef::new("avgpool", |_p: &nn::Path| {
        nn::func_t(|xs, _| xs.adaptive_avg_pool2d([7, 7]).flatten(1, -1))
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

fn conv_block(p: &nn::Path, index: usize, c_in: i64, c_out: i64, batch_norm: bool) -> impl ModuleT {
    let features = p / "features";
    let conv = conv2d(&features / index, c_in, c_out, 3, 1, 1, true);
    let bn = batch_norm.then(|| batch_norm2d(&features / (index + 1), c_out));
    nn::func_t(move |xs, train| {
        let ys = xs.apply(&conv);
        let mut ys = match &bn {
            Some(bn) => ys.apply_t(bn, train),
            None => ys,
        };
        ys.relu_()
    })
}
