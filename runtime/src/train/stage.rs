//! A stage: a contiguous slice of the model's modules with its own parameters. A single-process
//! run is one stage holding every module, the loss included.

use std::ops::Range;

use tch::nn;
use tch::{Device, Tensor};

use crate::models::{count_params, Loss, ModelDef};

pub struct Stage {
    layers: Vec<Box<dyn nn::ModuleT>>,
    /// The loss, when the stage ends the model.
    loss: Option<Loss>,
    vs: nn::VarStore,
}

impl Stage {
    /// Builds modules `range` of `model` on `device`, their initial values drawn on the CPU from
    /// `seed` and each module's index: the same on every device and in every split.
    pub fn build(model: &ModelDef, range: Range<usize>, seed: u64, device: Device) -> Stage {
        let vs = nn::VarStore::new(device);
        let layers = model.build(&vs.root(), range.clone(), seed);
        let loss = (range.end == model.num_modules()).then_some(model.loss);
        Stage { layers, loss, vs }
    }

    /// Parameters this stage holds.
    pub fn num_params(&self) -> u64 {
        count_params(&self.vs)
    }

    /// The trainable parameters, in the var store's creation order (the same on every replica).
    pub fn params(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    /// Writes the stage's parameters and buffers (torchvision/BERT names) as safetensors.
    pub fn save(&self, path: &std::path::Path) -> Result<(), tch::TchError> {
        self.vs.save(path)
    }

    /// Runs the stage's layers (not the loss) on `input`.
    pub fn forward(&self, input: &Tensor, train: bool) -> Tensor {
        self.layers
            .iter()
            .fold(input.shallow_clone(), |xs, layer| layer.forward_t(&xs, train))
    }

    /// The loss of `output` against `target`; `None` if this stage does not end the model.
    pub fn loss(&self, output: &Tensor, target: &Tensor) -> Option<Result<Tensor, tch::TchError>> {
        self.loss.map(|loss| loss.compute(output, target))
    }
}
