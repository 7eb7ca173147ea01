//! A stage: a contiguous slice of the model's modules with its own parameters, and what
//! training them takes on one rank: the optimizer (`optim/`), autograd beyond tch's `backward()`
//! (`autograd.rs`), mixed precision and channels_last (`amp.rs`). A single-process run is one
//! stage holding every module, the loss included. Nothing here talks to other ranks.

mod amp;
mod autograd;
pub mod checkpoint;
mod optim;

use std::ops::Range;

use tch::nn;
use tch::{Device, Tensor};

use crate::config::Precision;
use crate::models::{count_params, Loss, ModelDef};

pub use amp::GradScaler;
pub use autograd::{backward_with_grad, set_grad_ready_hook, GradReadyFn};
pub use optim::Optimizer;

pub struct Stage {
    layers: Vec<Box<dyn nn::ModuleT>>,
    /// The loss, when the stage ends the model.
    loss: Option<Loss>,
    vs: nn::VarStore,
    /// Autocast around the forward and the loss.
    precision: Precision,
    /// Image inputs go in channels_last layout (the parameters are converted once).
    channels_last: bool,
    device: Device,
}

impl Stage {
    /// Builds modules `range` of `model` on `device`, their initial values drawn on the CPU from
    /// `seed` and each module's index: the same on every device and in every split.
    pub fn build(model: &ModelDef, range: Range<usize>, seed: u64, device: Device) -> Stage {
        let vs = nn::VarStore::new(device);
        let layers = model.build(&vs.root(), range.clone(), seed);
        let loss = (range.end == model.num_modules()).then_some(model.loss);
        Stage {
            layers,
            loss,
            vs,
            precision: Precision::Fp32,
            channels_last: false,
            device,
        }
    }

    /// Runs forward passes and the loss under PyTorch's autocast to `precision`, and puts
    /// 4-dimensional parameters and inputs in channels_last layout when asked.
    pub fn set_arithmetic(&mut self, precision: Precision, channels_last: bool) -> Result<(), String> {
        self.precision = precision;
        self.channels_last = channels_last;
        if channels_last {
            let mut params = self.vs.trainable_variables();
            tch::no_grad(|| amp::params_to_channels_last(&mut params))?;
        }
        Ok(())
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

    /// Reads parameters and buffers [`Stage::save`] wrote, into the existing tensors.
    pub fn load(&mut self, path: &std::path::Path) -> Result<(), tch::TchError> {
        self.vs.load(path)
    }

    /// Runs the stage's layers (not the loss) on `input`.
    pub fn forward(&self, input: &Tensor, train: bool) -> Tensor {
        let input = if self.channels_last && input.dim() == 4 {
            amp::channels_last(input).expect("a 4-dimensional tensor has a channels_last layout")
        } else {
            input.shallow_clone()
        };
        let _autocast = self.autocast();
        self.layers
            .iter()
            .fold(input, |xs, layer| layer.forward_t(&xs, train))
    }

    /// The loss of `output` against `target`; `None` if this stage does not end the model.
    pub fn loss(&self, output: &Tensor, target: &Tensor) -> Option<Result<Tensor, tch::TchError>> {
        let _autocast = self.autocast();
        self.loss.map(|loss| loss.compute(output, target))
    }

    fn autocast(&self) -> amp::Autocast {
        // Entering autocast only sets thread-local flags; it fails only on an unknown dtype code.
        amp::Autocast::enter(self.precision, self.device).expect("autocast to a known dtype")
    }
}
