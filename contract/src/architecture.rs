//! What each of the runtime's modules holds, layer by layer, for the models PipeDream also
//! trains (AlexNet, VGG-16, ResNet-50/101/152): the driver matches PipeDream's generated stage
//! modules against it without building the model. Only the layers that fix where a cut can fall
//! are listed: convolutions, linear layers, batch norms and max-pools (activations, dropout,
//! flattening and adaptive pooling hold nothing and move freely). The runtime's tests check
//! every model here against the modules it builds, parameter for parameter.

use std::fmt;

/// One layer, as torchvision's constructor describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layer {
    Conv {
        c_in: u32,
        c_out: u32,
        kernel: u32,
        bias: bool,
    },
    Linear {
        d_in: u32,
        d_out: u32,
    },
    BatchNorm {
        channels: u32,
    },
    MaxPool,
}

impl Layer {
    /// Parameters the layer holds.
    pub fn params(&self) -> u64 {
        match *self {
            Layer::Conv {
                c_in,
                c_out,
                kernel,
                bias,
            } => {
                u64::from(c_in) * u64::from(c_out) * u64::from(kernel) * u64::from(kernel)
                    + if bias { u64::from(c_out) } else { 0 }
            }
            Layer::Linear { d_in, d_out } => u64::from(d_in) * u64::from(d_out) + u64::from(d_out),
            Layer::BatchNorm { channels } => 2 * u64::from(channels),
            Layer::MaxPool => 0,
        }
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Layer::Conv {
                c_in,
                c_out,
                kernel,
                bias,
            } => write!(
                f,
                "Conv2d({c_in}, {c_out}, kernel_size={kernel}{})",
                if bias { "" } else { ", bias=False" }
            ),
            Layer::Linear { d_in, d_out } => write!(f, "Linear({d_in}, {d_out})"),
            Layer::BatchNorm { channels } => write!(f, "BatchNorm2d({channels})"),
            Layer::MaxPool => write!(f, "MaxPool2d"),
        }
    }
}

/// The layers of each of the runtime's modules of `model` (the loss, last, excluded) with
/// `classes` outputs; `None` for a model PipeDream has no counterpart of.
pub fn module_layers(model: &str, classes: u32) -> Option<Vec<Vec<Layer>>> {
    match model {
        "alexnet" => Some(alexnet(classes)),
        "vgg16" => Some(vgg16(classes, false)),
        "vgg16_bn" => Some(vgg16(classes, true)),
        "resnet50" => Some(resnet([3, 4, 6, 3], classes)),
        "resnet101" => Some(resnet([3, 4, 23, 3], classes)),
        "resnet152" => Some(resnet([3, 8, 36, 3], classes)),
        _ => None,
    }
}

fn conv(c_in: u32, c_out: u32, kernel: u32, bias: bool) -> Layer {
    Layer::Conv {
        c_in,
        c_out,
        kernel,
        bias,
    }
}

fn classifier(dims: &[(u32, u32)]) -> Vec<Vec<Layer>> {
    dims.iter()
        .map(|&(d_in, d_out)| vec![Layer::Linear { d_in, d_out }])
        .collect()
}

fn alexnet(classes: u32) -> Vec<Vec<Layer>> {
    let mut modules = vec![
        vec![conv(3, 64, 11, true)],
        vec![Layer::MaxPool],
        vec![conv(64, 192, 5, true)],
        vec![Layer::MaxPool],
        vec![conv(192, 384, 3, true)],
        vec![conv(384, 256, 3, true)],
        vec![conv(256, 256, 3, true)],
        vec![Layer::MaxPool],
        vec![],
    ];
    modules.extend(classifier(&[(256 * 6 * 6, 4096), (4096, 4096), (4096, classes)]));
    modules
}

fn vgg16(classes: u32, batch_norm: bool) -> Vec<Vec<Layer>> {
    let mut modules = Vec::new();
    let mut c_in = 3;
    for entry in [
        64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
    ] {
        if entry == 0 {
            modules.push(vec![Layer::MaxPool]);
            continue;
        }
        let mut layers = vec![conv(c_in, entry, 3, true)];
        if batch_norm {
            layers.push(Layer::BatchNorm { channels: entry });
        }
        modules.push(layers);
        c_in = entry;
    }
    modules.push(vec![]);
    modules.extend(classifier(&[(512 * 7 * 7, 4096), (4096, 4096), (4096, classes)]));
    modules
}

fn resnet(blocks: [u32; 4], classes: u32) -> Vec<Vec<Layer>> {
    let bn = |channels| Layer::BatchNorm { channels };
    let mut modules = vec![vec![conv(3, 64, 7, false), bn(64)], vec![Layer::MaxPool]];
    let mut c_in = 64;
    for (stage, &count) in blocks.iter().enumerate() {
        let width = 64 << stage;
        let c_out = width * 4;
        for block in 0..count {
            let mut layers = vec![
                conv(c_in, width, 1, false),
                bn(width),
                conv(width, width, 3, false),
                bn(width),
                conv(width, c_out, 1, false),
                bn(c_out),
            ];
            if block == 0 {
                layers.extend([conv(c_in, c_out, 1, false), bn(c_out)]);
            }
            modules.push(layers);
            c_in = c_out;
        }
    }
    modules.push(vec![]);
    modules.extend(classifier(&[(2048, classes)]));
    modules
}
