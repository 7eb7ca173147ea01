//! Multi-layer perceptrons over flattened images: `layers.N` (linear and ReLU, the first one
//! flattening its input) for each hidden layer, then `head`; every linear layer initialised as
//! torch.nn.Linear's default.
//!
//! `sparse_mlp` is the same network with sparse activations, as the sparse models SparsePipedream
//! trains: each hidden layer keeps only its `active_units` largest outputs per sample
//! (k-winners-take-all after the ReLU) and hands them on as a sparse COO tensor, which the next
//! layer multiplies as such (`torch.sparse.mm`, whose gradient for the sparse input is sparse
//! too). Cut between layers, the pipeline's activations and their gradients are COO tensors.

use tch::{nn, Tensor};

use super::layers::linear;
use super::{InputKind, Loss, ModelOptions, ModuleDef};

/// How a hidden layer hands on its activations.
#[derive(Clone, Copy)]
enum Activations {
    Dense,
    /// Sparse COO, the `active` largest per sample.
    Sparse {
        active: i64,
    },
}

pub fn modules(o: &ModelOptions) -> (Vec<ModuleDef>, Loss, InputKind) {
    build(o, Activations::Dense)
}

pub fn sparse_modules(o: &ModelOptions) -> (Vec<ModuleDef>, Loss, InputKind) {
    build(
        o,
        Activations::Sparse {
            active: o.active_units,
        },
    )
}

fn build(o: &ModelOptions, activations: Activations) -> (Vec<ModuleDef>, Loss, InputKind) {
    let input = 3 * o.image_size * o.image_size;
    let mut modules = Vec::new();
    let mut d_in = input;
    for index in 0..o.layers {
        let d_out = o.hidden;
        let sparse_input = index > 0 && matches!(activations, Activations::Sparse { .. });
        modules.push(ModuleDef::new(format!("layers.{index}"), move |p: &nn::Path| {
            let layer = linear(p / "layers" / index, d_in, d_out);
            nn::func_t(move |xs, _| {
                let h = apply_linear(&layer, xs, sparse_input).relu();
                match activations {
                    Activations::Dense => h,
                    Activations::Sparse { active } => winners(&h, active).to_sparse_sparse_dim(2),
                }
            })
        }));
        d_in = d_out;
    }
    let classes = o.num_classes;
    let sparse_input = o.layers > 0 && matches!(activations, Activations::Sparse { .. });
    modules.push(ModuleDef::new("head", move |p: &nn::Path| {
        let layer = linear(p / "head", d_in, classes);
        nn::func_t(move |xs, _| apply_linear(&layer, xs, sparse_input))
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

/// `xs W^T + b`: a sparse COO input through `torch.sparse.mm` (sparse gradient for the input)
/// in the input's kind (autocast does not reach sparse products: under bf16 or fp16 the input
/// comes in that kind, and the parameters are cast to it as autocast casts them for a dense
/// linear layer), a dense one flattened first.
fn apply_linear(layer: &nn::Linear, xs: &Tensor, sparse_input: bool) -> Tensor {
    let bias = layer.bs.as_ref().expect("the mlp's linear layers have biases");
    match sparse_input {
        true => {
            let kind = xs.kind();
            Tensor::internal_sparse_mm(xs, &layer.ws.tr().to_kind(kind)) + bias.to_kind(kind)
        }
        false => xs.flatten(1, -1).apply(layer),
    }
}

/// k-winners-take-all: each row's `k` largest values (and any tied with the k-th), zeros elsewhere.
fn winners(h: &Tensor, k: i64) -> Tensor {
    let k = k.min(h.size()[1]);
    let (top, _) = h.topk(k, 1, true, true);
    let kth = top.narrow(1, k - 1, 1);
    h * h.ge_tensor(&kth)
}
