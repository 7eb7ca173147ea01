//! A stage: a contiguous slice of the model's modules with its own parameters and optimizer. A
//! single-process run is one stage holding every module, the loss included.

use std::ops::Range;

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Tensor};

use crate::config::OptimizerKind;
use crate::models::{count_params, Loss, ModelDef};

pub struct Stage {
    layers: Vec<Box<dyn nn::ModuleT>>,
    /// The loss, when the stage ends the model.
    loss: Option<Loss>,
    vs: nn::VarStore,
    optimizer: nn::Optimizer,
}

impl Stage {
    /// Builds modules `range` of `model` on `device` with an optimizer over their parameters.
    pub fn build(
        model: &ModelDef,
        range: Range<usize>,
        seed: u64,
        device: Device,
        optimizer: OptimizerKind,
        lr: f64,
    ) -> Result<Stage, tch::TchError> {
        let vs = nn::VarStore::new(device);
        let layers = model.build(&vs.root(), range.clone(), seed);
        let loss = (range.end == model.num_modules()).then_some(model.loss);
        let optimizer = match optimizer {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
            } => nn::Sgd {
                momentum,
                dampening: 0.0,
                wd: weight_decay,
                nesterov: false,
            }
            .build(&vs, lr)?,
            OptimizerKind::Adam { weight_decay } => nn::Adam {
                wd: weight_decay,
                ..Default::default()
            }
            .build(&vs, lr)?,
        };
        Ok(Stage {
            layers,
            loss,
            vs,
            optimizer,
        })
    }

    /// Parameters this stage holds.
    pub fn num_params(&self) -> u64 {
        count_params(&self.vs)
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

    /// Drops the gradients of the last step (set to none, as PyTorch does by default).
    pub fn zero_grad(&mut self) {
        self.optimizer.zero_grad();
    }

    /// Applies the optimizer to the accumulated gradients.
    pub fn step(&mut self) {
        self.optimizer.step();
    }
}
