//! Learning-rate schedules over epochs: PipeDream's policies (step, polynomial and exponential
//! decay) after its linear warm-up, so PipeDream's experiments keep their meaning and ours can use
//! them too.
//!
//! With `E` epochs in all, `L` iterations per epoch, base rate `b`, iteration `i` of epoch
//! `e = i / L` (step `s = i % L` within it) runs at:
//!
//! - during `W` warm-up epochs (`e < W`): `b * (1 + s + e * L) / (W * L)`, rising linearly to `b`;
//! - `constant`: `b`;
//! - `step`: `b * factor^(e / every)` (PipeDream: factor 0.1 every 30 epochs);
//! - `polynomial`: `b * (1 - e / E)^power` (PipeDream: power 2);
//! - `exponential`: `b * rate^(e / E)` (PipeDream's `exponential_decay`: rate 0.97).
//!
//! PipeDream changes the rate per epoch, and during warm-up per iteration; so does this.

/// How the rate decays after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrPolicy {
    Constant,
    Step { every_epochs: u64, factor: f64 },
    Polynomial { power: f64 },
    Exponential { rate: f64 },
}

impl LrPolicy {
    /// The policy's name as `--lr-policy` takes it.
    pub fn name(&self) -> &'static str {
        match self {
            LrPolicy::Constant => "constant",
            LrPolicy::Step { .. } => "step",
            LrPolicy::Polynomial { .. } => "polynomial",
            LrPolicy::Exponential { .. } => "exponential",
        }
    }
}

/// A learning rate for every iteration of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub base: f64,
    pub policy: LrPolicy,
    /// Epochs of linear warm-up (PipeDream's `--lr_warmup`: 5).
    pub warmup_epochs: u64,
    /// Iterations per epoch.
    pub epoch_iterations: u64,
    /// The run's length in epochs (fractional when the run is not a whole number of them).
    pub epochs: f64,
}

impl LrSchedule {
    /// `base` throughout.
    pub fn constant(base: f64) -> LrSchedule {
        LrSchedule {
            base,
            policy: LrPolicy::Constant,
            warmup_epochs: 0,
            epoch_iterations: 1,
            epochs: 1.0,
        }
    }

    /// Whether the rate ever differs from `base`.
    pub fn varies(&self) -> bool {
        self.policy != LrPolicy::Constant || self.warmup_epochs > 0
    }

    /// The rate of iteration `i`, counted from 0.
    pub fn at(&self, i: u64) -> f64 {
        let len = self.epoch_iterations.max(1);
        let (epoch, step) = (i / len, i % len);
        if epoch < self.warmup_epochs {
            return self.base * (1 + step + epoch * len) as f64 / (self.warmup_epochs * len) as f64;
        }
        let progress = epoch as f64 / self.epochs.max(f64::MIN_POSITIVE);
        match self.policy {
            LrPolicy::Constant => self.base,
            LrPolicy::Step { every_epochs, factor } => {
                self.base * factor.powf((epoch / every_epochs.max(1)) as f64)
            }
            LrPolicy::Polynomial { power } => self.base * (1.0 - progress).max(0.0).powf(power),
            LrPolicy::Exponential { rate } => self.base * rate.powf(progress),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(policy: LrPolicy, warmup_epochs: u64) -> LrSchedule {
        LrSchedule {
            base: 0.1,
            policy,
            warmup_epochs,
            epoch_iterations: 4,
            epochs: 10.0,
        }
    }

    #[test]
    fn pipedreams_policies_per_epoch() {
        // Four iterations an epoch: iterations 0..4 are epoch 0, 4..8 epoch 1, ...
        let step = schedule(
            LrPolicy::Step {
                every_epochs: 3,
                factor: 0.1,
            },
            0,
        );
        assert_eq!(step.at(0), 0.1);
        assert_eq!(step.at(11), 0.1, "epoch 2");
        assert!((step.at(12) - 0.01).abs() < 1e-15, "epoch 3");
        assert!((step.at(24) - 0.001).abs() < 1e-15, "epoch 6");
        let poly = schedule(LrPolicy::Polynomial { power: 2.0 }, 0);
        assert_eq!(poly.at(3), 0.1);
        assert!((poly.at(4) - 0.1 * 0.9f64.powi(2)).abs() < 1e-15, "epoch 1 of 10");
        assert!((poly.at(20) - 0.1 * 0.25).abs() < 1e-15, "epoch 5 of 10");
        assert_eq!(poly.at(400), 0.0, "past the end it stays at 0");
        let exp = schedule(LrPolicy::Exponential { rate: 0.97 }, 0);
        assert!(
            (exp.at(8) - 0.1 * 0.97f64.powf(0.2)).abs() < 1e-15,
            "epoch 2 of 10"
        );
        let constant = schedule(LrPolicy::Constant, 0);
        assert!((0..50).all(|i| constant.at(i) == 0.1));
        assert!(!LrSchedule::constant(0.1).varies() && poly.varies());
    }

    #[test]
    fn the_warm_up_rises_linearly_to_the_base_then_the_policy_takes_over() {
        let s = schedule(LrPolicy::Polynomial { power: 2.0 }, 2);
        // (1 + i) / 8 of the base over the first two epochs of four iterations.
        for i in 0..8 {
            assert!(
                (s.at(i) - 0.1 * (1 + i) as f64 / 8.0).abs() < 1e-15,
                "iteration {i}"
            );
        }
        assert!((s.at(7) - 0.1).abs() < 1e-15);
        // Epoch 2 of 10: the polynomial's own value, not the base.
        assert!((s.at(8) - 0.1 * 0.8f64.powi(2)).abs() < 1e-15);
        assert!(s.varies());
    }
}
