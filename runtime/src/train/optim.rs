//! SGD (with momentum and weight decay) and Adam, with `torch.optim`'s update rules.
//!
//! Our own rather than libtorch's C++ optimizers because updates go through `Tensor::data()`, an
//! alias that does not bump autograd's version counters: PipeDream's weight stashing steps the
//! parameters while other microbatches' graphs, which saved them, are still waiting for their
//! backward. Each update is one fused kernel per tensor where torch has one (`addcmul_` with a
//! scalar tensor stands in for `add_(…, alpha=…)`, which tch does not expose).

use tch::Tensor;

use super::autograd::grad_to_none;

use crate::config::OptimizerKind;

const ADAM_BETAS: (f64, f64) = (0.9, 0.999);
const ADAM_EPS: f64 = 1e-8;

pub struct Optimizer {
    kind: OptimizerKind,
    lr: f64,
    params: Vec<Tensor>,
    /// SGD: momentum buffers. Adam: first moments.
    first: Vec<Option<Tensor>>,
    /// Adam: second moments.
    second: Vec<Option<Tensor>>,
    steps: u64,
}

impl Optimizer {
    pub fn new(kind: OptimizerKind, lr: f64, params: Vec<Tensor>) -> Optimizer {
        let n = params.len();
        let none = || (0..n).map(|_| None).collect();
        Optimizer {
            kind,
            lr,
            params,
            first: none(),
            second: none(),
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

    /// Steps taken so far: the version of the weights.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Drops gradients before the next accumulation (set to none, as PyTorch does by default).
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            grad_to_none(p).expect("resetting a parameter's gradient cannot fail");
        }
    }

    /// Applies one update from the accumulated gradients.
    pub fn step(&mut self) {
        self.steps += 1;
        let lr = self.lr;
        tch::no_grad(|| {
            for (i, p) in self.params.iter().enumerate() {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                let mut data = p.data();
                match self.kind {
                    OptimizerKind::Sgd {
                        momentum,
                        weight_decay,
                    } => {
                        let g = if weight_decay != 0.0 {
                            &grad + &data * weight_decay
                        } else {
                            grad
                        };
                        let update = if momentum != 0.0 {
                            match &mut self.first[i] {
                                Some(buf) => {
                                    let _ = buf.g_mul_scalar_(momentum).g_add_(&g);
                                    buf.shallow_clone()
                                }
                                slot @ None => slot.insert(g.copy()).shallow_clone(),
                            }
                        } else {
                            g
                        };
                        let _ = data.addcmul_(&update, &scalar(-lr, &data));
                    }
                    OptimizerKind::Adam { weight_decay } => {
                        let (b1, b2) = ADAM_BETAS;
                        let g = if weight_decay != 0.0 {
                            &grad + &data * weight_decay
                        } else {
                            grad
                        };
                        let m = self.first[i].get_or_insert_with(|| data.zeros_like());
                        let v = self.second[i].get_or_insert_with(|| data.zeros_like());
                        let _ = m.g_mul_scalar_(b1).addcmul_(&g, &scalar(1.0 - b1, &g));
                        let _ = v.g_mul_scalar_(b2).addcmul_(&g, &(&g * (1.0 - b2)));
                        let t = self.steps as i32;
                        let bias1 = 1.0 - b1.powi(t);
                        let bias2_sqrt = (1.0 - b2.powi(t)).sqrt();
                        // p -= lr/bias1 * m / (sqrt(v)/bias2_sqrt + eps), folding the step size
                        // into the denominator since tch's addcdiv_ takes no scale.
                        let step_size = lr / bias1;
                        let denom = (v.sqrt() / bias2_sqrt + ADAM_EPS) / (-step_size);
                        let _ = data.addcdiv_(m, &denom);
                    }
                }
            }
        });
    }
}

fn scalar(value: f64, like: &Tensor) -> Tensor {
    Tensor::from(value).to_kind(like.kind()).to_device(like.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{self, OptimizerConfig};
    use tch::Kind;

    /// Our updates match libtorch's own optimizers (which follow torch.optim) step for step.
    fn matches_libtorch(kind: OptimizerKind) {
        tch::manual_seed(0);
        let ours = Tensor::randn([5, 3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let theirs = vs.root().var_copy("w", &ours.detach());
        let mut reference = match kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
            } => nn::Sgd {
                momentum,
                wd: weight_decay,
                ..Default::default()
            }
            .build(&vs, 0.1)
            .unwrap(),
            OptimizerKind::Adam { weight_decay } => nn::Adam {
                wd: weight_decay,
                ..Default::default()
            }
            .build(&vs, 0.1)
            .unwrap(),
        };
        let mut opt = Optimizer::new(kind, 0.1, vec![ours.shallow_clone()]);
        for step in 0..4 {
            let target = Tensor::full([5, 3], step as f64, (Kind::Float, tch::Device::Cpu));
            opt.zero_grad();
            (&ours - &target).pow_tensor_scalar(2).sum(Kind::Float).backward();
            opt.step();
            reference.zero_grad();
            (&theirs - &target)
                .pow_tensor_scalar(2)
                .sum(Kind::Float)
                .backward();
            reference.step();
            assert!(
                ours.allclose(&theirs, 1e-5, 1e-6, false),
                "{kind:?} differs at step {step}"
            );
        }
    }

    #[test]
    fn sgd_matches_libtorch() {
        matches_libtorch(OptimizerKind::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
        });
        matches_libtorch(OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 0.01,
        });
    }

    #[test]
    fn adam_matches_libtorch() {
        matches_libtorch(OptimizerKind::Adam { weight_decay: 0.0 });
        matches_libtorch(OptimizerKind::Adam { weight_decay: 0.01 });
    }

    #[test]
    fn steps_do_not_bump_autograd_versions() {
        // A graph that saved the weight still runs backward after a step (weight stashing needs this).
        let w = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let x = Tensor::ones([1, 2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let mut opt = Optimizer::new(
            OptimizerKind::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
            },
            0.5,
            vec![w.shallow_clone()],
        );
        let first = x.matmul(&w).sum(Kind::Float);
        let second = x.matmul(&w).sum(Kind::Float);
        first.backward();
        opt.step();
        second.backward(); // would fail with "modified by an inplace operation" if the step bumped the version
        assert!(w.allclose(
            &Tensor::full([2, 2], 0.5, (Kind::Float, tch::Device::Cpu)),
            1e-6,
            1e-6,
            false
        ));
    }
}
