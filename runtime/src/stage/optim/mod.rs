//! SGD (momentum, Nesterov, weight decay), Adam and AdamW as `torch.optim`'s fused
//! implementations: one multi-tensor kernel launch per step over all of a stage's parameters
//! (`fused.rs`, `csrc/optim.cpp`), with hyper-parameters passed as numbers, so a step neither
//! copies anything to the device nor waits for it.
//!
//! The kernels update the parameters through `.data`-style aliases, which do not bump autograd's
//! version counters: PipeDream's weight stashing steps the parameters while other microbatches'
//! graphs, which saved them, are still waiting for their backward.
//!
//! fp16's gradient scaler skips a step on the device ([`Optimizer::step_unless`]): the kernels
//! read its inf/nan flag and leave parameters and state as they were, as `torch.optim`'s fused
//! path does, so the host never waits to learn whether a step was taken. A momentum buffer
//! starts at zeros rather than at its first gradient (blending into zeros is the same arithmetic),
//! so a skipped first step leaves nothing half-made; torch's own fused SGD starts the buffers
//! uninitialised and blends that into the next step after a skipped first one.

mod fused;
#[cfg(test)]
mod tests;

use tch::{Device, Kind, Tensor};

use super::autograd::grad_to_none;
use crate::config::OptimizerKind;
use fused::{AdamHyper, Lr, SgdHyper};

const ADAM_BETAS: (f64, f64) = (0.9, 0.999);
const ADAM_EPS: f64 = 1e-8;

/// A parameter's optimizer state, made at its first step with a gradient (torch.optim's
/// `state[p]`).
enum State {
    /// SGD with momentum.
    Momentum { buffer: Tensor },
    /// Adam and AdamW: the moments and the step count (0-dim float32 on the parameter's device,
    /// which the kernel increments, as in torch's fused path).
    Adam {
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        step: Tensor,
    },
}

pub struct Optimizer {
    kind: OptimizerKind,
    lr: f64,
    /// With [`Optimizer::keep_lr_on_device`]: the learning rate the steps read, on the device.
    lr_tensor: Option<Tensor>,
    params: Vec<Tensor>,
    /// Per parameter, in `params` order; `None` before its first step (and always for SGD
    /// without momentum).
    state: Vec<Option<State>>,
    steps: u64,
}

impl Optimizer {
    pub fn new(kind: OptimizerKind, lr: f64, params: Vec<Tensor>) -> Optimizer {
        let state = params.iter().map(|_| None).collect();
        Optimizer {
            kind,
            lr,
            lr_tensor: None,
            params,
            state,
            steps: 0,
        }
    }

    /// The parameters, in a fixed order (the var store's), for all-reduce and stashing.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Gradients of every parameter, in `params` order. A parameter that took no part in any
    /// backward gets a zero gradient first, so replicas all-reduce lists of the same shape.
    pub fn grads(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| {
                if !p.grad().defined() {
                    (p.sum(p.kind()) * 0.0).backward();
                }
                p.grad()
            })
            .collect()
    }

    /// Steps taken so far, fp16's skipped ones included: the version of the weights.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Drops gradients before the next accumulation (set to none, as PyTorch does by default).
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            grad_to_none(p).expect("resetting a parameter's gradient cannot fail");
        }
    }

    /// The state to checkpoint: each parameter's buffers by `state.<index>.<name>`, and the
    /// steps taken.
    pub fn state_tensors(&self) -> (Vec<(String, Tensor)>, u64) {
        let mut named = Vec::new();
        for (i, state) in self.state.iter().enumerate() {
            match state {
                None => {}
                Some(State::Momentum { buffer }) => {
                    named.push((format!("state.{i}.buffer"), buffer.shallow_clone()))
                }
                Some(State::Adam {
                    exp_avg,
                    exp_avg_sq,
                    step,
                }) => {
                    named.push((format!("state.{i}.exp_avg"), exp_avg.shallow_clone()));
                    named.push((format!("state.{i}.exp_avg_sq"), exp_avg_sq.shallow_clone()));
                    named.push((format!("state.{i}.step"), step.shallow_clone()));
                }
            }
        }
        (named, self.steps)
    }

    /// Restores what [`Optimizer::state_tensors`] gave, onto the parameters' devices, each buffer
    /// in its parameter's memory layout (channels_last, say), as the fused kernels want it.
    pub fn load_state(&mut self, named: Vec<(String, Tensor)>, steps: u64) -> Result<(), String> {
        let mut by_param: Vec<std::collections::BTreeMap<String, Tensor>> =
            self.params.iter().map(|_| Default::default()).collect();
        for (name, tensor) in named {
            let mut parts = name.splitn(3, '.');
            let (Some("state"), Some(index), Some(field)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format!("unexpected optimizer state `{name}`"));
            };
            let index: usize = index
                .parse()
                .ok()
                .filter(|i| *i < self.params.len())
                .ok_or_else(|| format!("optimizer state `{name}` names no parameter of this stage"))?;
            let device = self.params[index].device();
            by_param[index].insert(field.to_string(), tensor.to_device(device));
        }
        for (i, mut fields) in by_param.into_iter().enumerate() {
            let param = &self.params[i];
            let like_param = |name: &str, saved: Option<Tensor>| -> Result<Option<Tensor>, String> {
                let Some(saved) = saved else { return Ok(None) };
                if saved.size() != param.size() || saved.kind() != param.kind() {
                    return Err(format!(
                        "optimizer state `state.{i}.{name}` is {:?} {:?}, its parameter {:?} {:?}",
                        saved.kind(),
                        saved.size(),
                        param.kind(),
                        param.size()
                    ));
                }
                let mut restored = param.zeros_like();
                tch::no_grad(|| restored.f_copy_(&saved)).map_err(|e| e.to_string())?;
                Ok(Some(restored))
            };
            self.state[i] = match (
                like_param("buffer", fields.remove("buffer"))?,
                like_param("exp_avg", fields.remove("exp_avg"))?,
                like_param("exp_avg_sq", fields.remove("exp_avg_sq"))?,
                fields.remove("step"),
            ) {
                (None, None, None, None) => None,
                (Some(buffer), None, None, None) => Some(State::Momentum { buffer }),
                (None, Some(exp_avg), Some(exp_avg_sq), Some(step)) => Some(State::Adam {
                    exp_avg,
                    exp_avg_sq,
                    step,
                }),
                _ => return Err(format!("parameter {i}'s optimizer state is incomplete")),
            };
        }
        self.steps = steps;
        Ok(())
    }

    /// The learning rate of the steps from now on (with the rate kept on the device, of the
    /// steps after the next [`Optimizer::write_lr`]).
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// From now on the steps read the learning rate from a float32 tensor on `device` (where all
    /// the parameters must be), which [`Optimizer::write_lr`] sets: what a step captured once in a
    /// CUDA graph and replayed needs, as the number a kernel is launched with is fixed at capture.
    /// (float32, as the CUDA kernels compute float32 parameters' updates in it anyway.)
    pub fn keep_lr_on_device(&mut self, device: Device) -> Result<(), String> {
        if let Some(p) = self.params.iter().find(|p| p.device() != device) {
            return Err(format!(
                "a parameter is on {:?}, not on {device:?} where the learning rate is kept",
                p.device()
            ));
        }
        self.lr_tensor = Some(Tensor::full([], self.lr, (Kind::Float, device)));
        Ok(())
    }

    /// Writes the current learning rate into the tensor the steps read (a kernel on the current
    /// stream; nothing waits for it). Does nothing unless the rate is kept on the device.
    pub fn write_lr(&mut self) {
        if let Some(lr) = &mut self.lr_tensor {
            let _ = lr.fill_(self.lr);
        }
    }

    /// Applies one update from the accumulated gradients; parameters without a gradient keep
    /// their values and state, as in torch.optim. Fails only where the kernels do (out of device
    /// memory for the optimizer's state, a device lost).
    pub fn step(&mut self) -> Result<(), String> {
        self.steps += 1;
        self.try_step(None)
    }

    /// [`Optimizer::step`], skipped on the device where `found_inf` (a one-element float32 tensor,
    /// on any of the parameters' devices) holds exactly 1.0: parameters, momentum buffers, Adam's
    /// moments and step counts stay as they were. Nothing waits for the flag on the host.
    pub fn step_unless(&mut self, found_inf: &Tensor) -> Result<(), String> {
        self.steps += 1;
        self.try_step(Some(found_inf))
    }

    /// Counts a step that ran without this optimizer: replayed from a CUDA graph that captured
    /// one of its steps.
    pub fn count_replayed_step(&mut self) {
        self.steps += 1;
    }

    fn try_step(&mut self, found_inf: Option<&Tensor>) -> Result<(), String> {
        let live: Vec<usize> = (0..self.params.len())
            .filter(|&i| self.params[i].grad().defined())
            .collect();
        // The multi-tensor kernels take tensors of one device: a stage spread over several
        // devices steps each device's parameters in a call of their own (as torch.optim groups
        // them); each parameter's update is the same either way.
        let mut groups: Vec<(Device, Vec<usize>)> = Vec::new();
        for i in live {
            let device = self.params[i].device();
            match groups.iter_mut().find(|(d, _)| *d == device) {
                Some((_, group)) => group.push(i),
                None => groups.push((device, vec![i])),
            }
        }
        for (_, group) in groups {
            self.step_group(group, found_inf)?;
        }
        Ok(())
    }

    /// One step of the parameters `live`, all on one device.
    fn step_group(&mut self, live: Vec<usize>, found_inf: Option<&Tensor>) -> Result<(), String> {
        if live.is_empty() {
            return Ok(());
        }
        // The learning rate as the kernels take it (the tensor's handle, apart from `self`).
        let lr_tensor = self.lr_tensor.as_ref().map(Tensor::shallow_clone);
        let lr = match &lr_tensor {
            Some(t) => Lr::Tensor(t),
            None => Lr::Value(self.lr),
        };
        match self.kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                let hyper = SgdHyper {
                    lr,
                    momentum,
                    weight_decay,
                    nesterov,
                };
                if momentum == 0.0 {
                    return fused::sgd_step(&self.pick(&live), &[], hyper, found_inf);
                }
                // A new buffer is zeros: momentum * 0 + g is exactly g, torch's first step, and a
                // step skipped on the device leaves it as if it never began.
                for &i in &live {
                    if self.state[i].is_none() {
                        self.state[i] = Some(State::Momentum {
                            buffer: self.params[i].zeros_like(),
                        });
                    }
                }
                let buffers = self.momentum_buffers(&live);
                fused::sgd_step(&self.pick(&live), &buffers, hyper, found_inf)
            }
            OptimizerKind::Adam { weight_decay } | OptimizerKind::AdamW { weight_decay } => {
                for &i in &live {
                    if self.state[i].is_none() {
                        let p = &self.params[i];
                        self.state[i] = Some(State::Adam {
                            exp_avg: p.zeros_like(),
                            exp_avg_sq: p.zeros_like(),
                            step: Tensor::zeros([], (Kind::Float, p.device())),
                        });
                    }
                }
                let mut moments = (Vec::new(), Vec::new(), Vec::new());
                for &i in &live {
                    if let Some(State::Adam {
                        exp_avg,
                        exp_avg_sq,
                        step,
                    }) = &self.state[i]
                    {
                        moments.0.push(exp_avg);
                        moments.1.push(exp_avg_sq);
                        moments.2.push(step);
                    }
                }
                let hyper = AdamHyper {
                    lr,
                    betas: ADAM_BETAS,
                    eps: ADAM_EPS,
                    weight_decay,
                    decoupled: matches!(self.kind, OptimizerKind::AdamW { .. }),
                };
                fused::adam_step(
                    &self.pick(&live),
                    &moments.0,
                    &moments.1,
                    &moments.2,
                    hyper,
                    found_inf,
                )
            }
        }
    }

    fn pick(&self, indices: &[usize]) -> Vec<&Tensor> {
        indices.iter().map(|&i| &self.params[i]).collect()
    }

    fn momentum_buffers(&self, indices: &[usize]) -> Vec<&Tensor> {
        indices
            .iter()
            .filter_map(|&i| match &self.state[i] {
                Some(State::Momentum { buffer }) => Some(buffer),
                _ => None,
            })
            .collect()
    }
}
