//! A stage: a contiguous slice of the model's modules with its own parameters, and what
//! training them takes on one rank: the optimizer (`optim/`), autograd beyond tch's `backward()`
//! (`autograd.rs`), mixed precision and channels_last (`amp.rs`). A single-process run is one
//! stage holding every module, the loss included. Nothing here talks to other ranks.

mod amp;
mod autograd;
pub mod checkpoint;
mod optim;
pub mod placement;
mod torch_save;
pub mod weights;

use std::ops::Range;

use tch::nn;
use tch::{Device, Tensor};

use crate::config::Precision;
use crate::models::{count_params, Loss, ModelDef};

pub use amp::{GradScaler, ScalerReport};
pub use autograd::{backward_with_grad, set_grad, set_grad_ready_hook, GradReadyFn};
pub use optim::Optimizer;

/// The modules one device holds.
struct Part {
    /// The modules as built to run ([`ModelDef::build_layers`]): a pair the model fuses is one.
    layers: Vec<Box<dyn nn::ModuleT>>,
    vs: nn::VarStore,
    device: Device,
}

pub struct Stage {
    /// The stage's modules in order, split over its devices (one part on one device).
    parts: Vec<Part>,
    /// The loss, when the stage ends the model; computed on the last part's device.
    loss: Option<Loss>,
    /// Autocast around the forward and the loss.
    precision: Precision,
    /// Image inputs go in channels_last layout (the parameters are converted once).
    channels_last: bool,
}

impl Stage {
    /// Builds modules `range` of `model` on `device`, their initial values drawn on the CPU from
    /// `seed` and each module's index: the same on every device and in every split.
    pub fn build(model: &ModelDef, range: Range<usize>, seed: u64, device: Device) -> Stage {
        Stage::build_placed(model, &[(range, device)], seed)
    }

    /// Builds the stage's modules split over devices: each `(modules, device)` a contiguous run,
    /// the runs in order. Initial values are those of [`Stage::build`], whatever the split.
    pub fn build_placed(model: &ModelDef, parts: &[(Range<usize>, Device)], seed: u64) -> Stage {
        assert!(!parts.is_empty(), "a stage has at least one part");
        let end = parts.last().expect("checked above").0.end;
        let parts = parts
            .iter()
            .map(|(range, device)| {
                let vs = nn::VarStore::new(*device);
                let layers = model.build_layers(&vs.root(), range.clone(), seed);
                Part {
                    layers,
                    vs,
                    device: *device,
                }
            })
            .collect();
        Stage {
            parts,
            loss: (end == model.num_modules()).then_some(model.loss),
            precision: Precision::Fp32,
            channels_last: false,
        }
    }

    /// Runs forward passes and the loss under PyTorch's autocast to `precision`, and puts
    /// 4-dimensional parameters and inputs in channels_last layout when asked.
    pub fn set_arithmetic(&mut self, precision: Precision, channels_last: bool) -> Result<(), String> {
        self.precision = precision;
        self.channels_last = channels_last;
        if channels_last {
            let mut params = self.params();
            tch::no_grad(|| amp::params_to_channels_last(&mut params))?;
        }
        Ok(())
    }

    /// Parameters this stage holds.
    pub fn num_params(&self) -> u64 {
        self.parts.iter().map(|p| count_params(&p.vs)).sum()
    }

    /// The trainable parameters, in the modules' order (the same on every replica and in every
    /// split over devices).
    pub fn params(&self) -> Vec<Tensor> {
        self.parts
            .iter()
            .flat_map(|p| p.vs.trainable_variables())
            .collect()
    }

    /// Every parameter and buffer by name, sorted by name.
    pub fn variables(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self.parts.iter().flat_map(|p| p.vs.variables()).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The devices the stage's parts are on, in order (one entry per part).
    pub fn devices(&self) -> Vec<Device> {
        self.parts.iter().map(|p| p.device).collect()
    }

    /// Writes the stage's parameters and buffers (torchvision/BERT names) as safetensors, or in
    /// libtorch's format for another extension, as tch's var store does; in the plain contiguous
    /// layout whatever the tensors' own (channels_last, say), as the files hold it.
    pub fn save(&self, path: &std::path::Path) -> Result<(), tch::TchError> {
        let named: Vec<(String, Tensor)> = self
            .variables()
            .into_iter()
            .map(|(name, t)| (name, t.to_device(Device::Cpu).contiguous()))
            .collect();
        match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => Tensor::write_safetensors(&named, path),
            _ => Tensor::save_multi(&named, path),
        }
    }

    /// Reads parameters and buffers [`Stage::save`] wrote, into the existing tensors.
    pub fn load(&mut self, path: &std::path::Path) -> Result<(), String> {
        let named = weights::read(path)?;
        self.copy_named(&named)
            .map(drop)
            .map_err(|misfit| misfit.to_string())
    }

    /// Runs the stage's layers (not the loss) on `input`, each part on its device: the
    /// activation moves to the next part's device between them (autograd moves its gradient back).
    pub fn forward(&self, input: &Tensor, train: bool) -> Tensor {
        let mut xs = if self.channels_last && input.dim() == 4 {
            amp::channels_last(input).expect("a 4-dimensional tensor has a channels_last layout")
        } else {
            input.shallow_clone()
        };
        for part in &self.parts {
            if xs.device() != part.device {
                xs = xs.to_device(part.device);
            }
            let _autocast = self.autocast(part.device);
            xs = part
                .layers
                .iter()
                .fold(xs, |xs, layer| layer.forward_t(&xs, train));
        }
        xs
    }

    /// The loss of `output` against `target`; `None` if this stage does not end the model.
    pub fn loss(&self, output: &Tensor, target: &Tensor) -> Option<Result<Tensor, tch::TchError>> {
        let loss = self.loss?;
        let _autocast = self.autocast(output.device());
        Some(loss.compute(output, &on_device_of(output, target)))
    }

    /// The loss of `output` against `target`, as [`Self::loss`], and its accuracies
    /// (`Loss::accuracy`, outside autograd), with `target` moved to `output`'s device once for
    /// both; `None` if this stage does not end the model.
    pub fn loss_and_accuracy(
        &self,
        output: &Tensor,
        target: &Tensor,
    ) -> Option<Result<(Tensor, Tensor), tch::TchError>> {
        let loss = self.loss?;
        let target = on_device_of(output, target);
        let value = {
            let _autocast = self.autocast(output.device());
            loss.compute(output, &target)
        };
        Some(value.and_then(|value| Ok((value, tch::no_grad(|| loss.accuracy(output, &target))?))))
    }

    fn autocast(&self, device: Device) -> amp::Autocast {
        // Entering autocast only sets thread-local flags; it fails only on an unknown dtype code.
        amp::Autocast::enter(self.precision, device).expect("autocast to a known dtype")
    }
}

/// `target` on `output`'s device (itself when it is there already).
fn on_device_of(output: &Tensor, target: &Tensor) -> Tensor {
    match output.device() {
        device if device == target.device() => target.shallow_clone(),
        device => target.to_device(device),
    }
}
