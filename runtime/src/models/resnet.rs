//! ResNet-50/101/152 (bottleneck blocks, stride on the 3x3 convolution as in torchvision's v1.5),
//! laid out as torchvision's `resnet50` etc.: `conv1`, `bn1`, `layerL.B.*`, `fc`
//! (25,557,032 parameters for resnet50 with 1000 classes).
//!
//! Modules: `conv1` (conv, bn, ReLU), `maxpool`, one per bottleneck block `layerL.B`, `avgpool`
//! (global average and flatten), `fc`.
//!
//! Initialised as torchvision's `ResNet.__init__`: convolutions Kaiming normal (fan-out, ReLU),
//! batch norms weight 1 and bias 0 (the last one of each block too: `zero_init_residual` is off
//! by default), and `fc` left at torch.nn.Linear's default.

use tch::nn::{self, ModuleT};
use tch::Tensor;

use super::layers::{batch_norm2d, conv2d, linear};
use super::{InputKind, Loss, ModelOptions, ModuleDef};

const EXPANSION: i64 = 4;

pub fn resnet(o: &ModelOptions, blocks: [usize; 4]) -> (Vec<ModuleDef>, Loss, InputKind) {
    let mut modules = vec![
        ModuleDef::new("conv1", |p: &nn::Path| {
            let conv = conv2d(p / "conv1", 3, 64, 7, 2, 3, false);
            let bn = batch_norm2d(p / "bn1", 64);
            nn::func_t(move |xs, train| xs.apply(&conv).apply_t(&bn, train).relu_())
        }),
        ModuleDef::new("maxpool", |_p: &nn::Path| {
            nn::func_t(|xs, _| xs.max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false))
        }),
    ];
    let mut c_in = 64;
    for (layer, (&count, width)) in blocks.iter().zip([64i64, 128, 256, 512]).enumerate() {
        for block in 0..count {
            let stride = if block == 0 && layer > 0 { 2 } else { 1 };
            let name = format!("layer{}.{block}", layer + 1);
            let path = name.clone();
            modules.push(ModuleDef::new(name, move |p: &nn::Path| {
                let mut bp = p.clone();
                for part in path.split('.') {
                    bp = &bp / part;
                }
                Bottleneck::new(&bp, c_in, width, stride)
            }));
            c_in = width * EXPANSION;
        }
    }
    modules.push(ModuleDef::new("avgpool", |_p: &nn::Path| {
        nn::func_t(|xs, _| xs.adaptive_avg_pool2d([1, 1]).flatten(1, -1))
    }));
    let classes = o.num_classes;
    modules.push(ModuleDef::new("fc", move |p: &nn::Path| {
        linear(p / "fc", 512 * EXPANSION, classes)
    }));
    (
        modules,
        Loss::CrossEntropy,
        InputKind::Image {
            size: o.image_size,
            classes: o.num_classes,
        },
    )
}

#[derive(Debug)]
struct Bottleneck {
    conv1: nn::Conv2D,
    bn1: nn::BatchNorm,
    conv2: nn::Conv2D,
    bn2: nn::BatchNorm,
    conv3: nn::Conv2D,
    bn3: nn::BatchNorm,
    downsample: Option<(nn::Conv2D, nn::BatchNorm)>,
}

impl Bottleneck {
    fn new(p: &nn::Path, c_in: i64, width: i64, stride: i64) -> Bottleneck {
        let c_out = width * EXPANSION;
        let downsample = (stride != 1 || c_in != c_out).then(|| {
            let d = p / "downsample";
            (
                conv2d(&d / "0", c_in, c_out, 1, stride, 0, false),
                batch_norm2d(&d / "1", c_out),
            )
        });
        Bottleneck {
            conv1: conv2d(p / "conv1", c_in, width, 1, 1, 0, false),
            bn1: batch_norm2d(p / "bn1", width),
            conv2: conv2d(p / "conv2", width, width, 3, stride, 1, false),
            bn2: batch_norm2d(p / "bn2", width),
            conv3: conv2d(p / "conv3", width, c_out, 1, 1, 0, false),
            bn3: batch_norm2d(p / "bn3", c_out),
            downsample,
        }
    }
}

impl ModuleT for Bottleneck {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        // In place where torchvision is (ReLU(inplace=True), `out += identity`): every tensor
        // changed is a fresh batch-norm output, which no backward needs.
        let mut ys = xs
            .apply(&self.conv1)
            .apply_t(&self.bn1, train)
            .relu_()
            .apply(&self.conv2)
            .apply_t(&self.bn2, train)
            .relu_()
            .apply(&self.conv3)
            .apply_t(&self.bn3, train);
        match &self.downsample {
            Some((conv, bn)) => ys += xs.apply(conv).apply_t(bn, train),
            None => ys += xs,
        }
        ys.relu_()
    }
}
