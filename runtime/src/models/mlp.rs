//! A multi-layer perceptron over flattened images: `layers.N` (linear and ReLU, the first one
//! flattening its input) for each hidden layer, then `head`; every linear layer initialised as
//! torch.nn.Linear's default.

use tch::nn;

use super::layers::linear;
use super::{InputKind, Loss, ModelOptions, ModuleDef};

pub fn modules(o: &ModelOptions) -> (Vec<ModuleDef>, Loss, InputKind) {
    let input = 3 * o.image_size * o.image_size;
    let mut modules = Vec::new();
    let mut d_in = input;
    for index in 0..o.layers {
        let d_out = o.hidden;
        modules.push(ModuleDef::new(format!("layers.{index}"), move |p: &nn::Path| {
            let layer = linear(p / "layers" / index, d_in, d_out);
            nn::func_t(move |xs, _| xs.flatten(1, -1).apply(&layer).relu())
        }));
        d_in = d_out;
    }
    let classes = o.num_classes;
    modules.push(ModuleDef::new("head", move |p: &nn::Path| {
        let layer = linear(p / "head", d_in, classes);
        nn::func_t(move |xs, _| xs.flatten(1, -1).apply(&layer))
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
