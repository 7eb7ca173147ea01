//! The optimizer against torch.optim's own results (fixtures written by
//! runtime/tests/fixtures/optim/generate.py), and the properties weight stashing relies on.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Deserialize;
use tch::{Device, Kind, Tensor};

use super::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/optim");

/// The fixtures where this crate was built, else under the current folder: scripts/gpu-checks
/// runs the test binary from the root of a copy of the checkout on another machine.
fn fixtures_dir() -> PathBuf {
    let built_here = PathBuf::from(FIXTURES);
    match built_here.is_dir() {
        true => built_here,
        false => PathBuf::from("runtime/tests/fixtures/optim"),
    }
}

/// cases.json.
#[derive(Deserialize)]
struct Meta {
    steps: usize,
    shapes: Vec<Vec<i64>>,
    betas: (f64, f64),
    eps: f64,
    /// Float32 roundings per step the tolerance allows (the generator explains the figure).
    ulps_per_step: f64,
    cases: Vec<Case>,
    amp: Amp,
}

/// cases.json's `amp`: the gradients given a bad value, and the scale torch's scaler ends at.
#[derive(Deserialize)]
struct Amp {
    bad: Vec<Bad>,
    final_scale: f64,
}

#[derive(Deserialize)]
struct Bad {
    step: usize,
    param: usize,
    /// "inf" or "nan".
    value: String,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    optimizer: String,
    lr: f64,
    #[serde(default)]
    momentum: f64,
    weight_decay: f64,
    #[serde(default)]
    nesterov: bool,
}

impl Case {
    fn kind(&self) -> OptimizerKind {
        let weight_decay = self.weight_decay;
        match self.optimizer.as_str() {
            "sgd" => OptimizerKind::Sgd {
                momentum: self.momentum,
                weight_decay,
                nesterov: self.nesterov,
            },
            "adam" => OptimizerKind::Adam { weight_decay },
            "adamw" => OptimizerKind::AdamW { weight_decay },
            other => panic!("cases.json: unknown optimizer {other:?}"),
        }
    }
}

struct Fixtures {
    meta: Meta,
    tensors: HashMap<String, Tensor>,
}

impl Fixtures {
    fn load() -> Fixtures {
        let dir = fixtures_dir();
        let meta: Meta = serde_json::from_str(
            &std::fs::read_to_string(dir.join("cases.json")).expect("reading cases.json"),
        )
        .expect("parsing cases.json");
        assert_eq!(meta.betas, ADAM_BETAS, "the fixtures' Adam betas are ours");
        assert_eq!(meta.eps, ADAM_EPS, "the fixtures' Adam eps is ours");
        let tensors = Tensor::read_npz(dir.join("tensors.npz"))
            .expect("reading tensors.npz")
            .into_iter()
            .collect();
        Fixtures { meta, tensors }
    }

    fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("tensors.npz has no {name}"))
    }

    /// The fixture's initial parameters, on `device`.
    fn params(&self, device: Device) -> Vec<Tensor> {
        (0..self.meta.shapes.len())
            .map(|i| {
                self.get(&format!("param{i}"))
                    .to_device(device)
                    .copy()
                    .set_requires_grad(true)
            })
            .collect()
    }

    /// Our parameters after the fixture's steps with `kind` on `device`, back on the CPU.
    fn run(&self, kind: OptimizerKind, lr: f64, device: Device) -> Vec<Tensor> {
        let params = self.params(device);
        let mut opt = Optimizer::new(kind, lr, params.iter().map(Tensor::shallow_clone).collect());
        for t in 0..self.meta.steps {
            opt.zero_grad();
            for (i, p) in params.iter().enumerate() {
                // d/dp sum(p * g) is exactly g.
                (p * self.grad(i, t, false).to_device(device))
                    .sum(Kind::Float)
                    .backward();
            }
            opt.step().unwrap();
        }
        params.iter().map(|p| p.detach().to_device(Device::Cpu)).collect()
    }

    /// The gradient of parameter `i` at step `t`, with the fixture's bad value put in at the
    /// steps of `amp.bad` when `bad`.
    fn grad(&self, i: usize, t: usize, bad: bool) -> Tensor {
        let grad = self.get(&format!("grad{i}_{t}")).copy();
        for b in self
            .meta
            .amp
            .bad
            .iter()
            .filter(|b| bad && b.step == t && b.param == i)
        {
            let value: f64 = b.value.parse().expect("amp.bad holds inf or nan");
            let _ = grad.view([-1]).get(0).fill_(value);
        }
        grad
    }

    /// Our parameters (back on the CPU) after the fixture's steps on `device` behind fp16's
    /// gradient scaler (the loss scaled, the bad steps' flags on the device), and the scaler's
    /// final scale. `honour_flag: false` steps regardless of it (the check that the parity test
    /// can fail).
    fn run_amp(&self, kind: OptimizerKind, lr: f64, honour_flag: bool, device: Device) -> (Vec<Tensor>, f64) {
        let params = self.params(device);
        let mut opt = Optimizer::new(kind, lr, params.iter().map(Tensor::shallow_clone).collect());
        let mut scaler = crate::stage::GradScaler::new(device, crate::config::DEFAULT_FP16_INIT_SCALE);
        for t in 0..self.meta.steps {
            opt.zero_grad();
            let loss = params
                .iter()
                .enumerate()
                .map(|(i, p)| (p * self.grad(i, t, true).to_device(device)).sum(Kind::Float))
                .reduce(|a, b| a + b)
                .expect("parameters");
            scaler.scale_loss(&loss).backward();
            scaler.unscale(&opt.grads()).unwrap();
            let flag = scaler.step_flag().unwrap().shallow_clone();
            match honour_flag {
                true => opt.step_unless(&flag).unwrap(),
                false => opt.step().unwrap(),
            }
            scaler.update().unwrap();
        }
        let scale = scaler.report().scale;
        (
            params.iter().map(|p| p.detach().to_device(Device::Cpu)).collect(),
            scale,
        )
    }

    /// How far `ours` is from torch's result `{case}_{path}{i}`: the largest absolute difference,
    /// the largest relative to the parameter's scale, and the largest as a fraction of the
    /// tolerance (above 1 fails).
    fn compare(&self, case: &str, path: &str, ours: &[Tensor]) -> Difference {
        let mut d = Difference::default();
        for (i, ours) in ours.iter().enumerate() {
            let theirs = self.get(&format!("{case}_{path}{i}"));
            let scale = self.get(&format!("{case}_scale{i}")).double_value(&[]);
            let tolerance = self.meta.steps as f64 * self.meta.ulps_per_step * f32::EPSILON as f64 * scale;
            let abs = (ours - theirs).abs().max().double_value(&[]);
            // f64::max passes over a NaN: a parameter gone NaN is infinitely far.
            let abs = if abs.is_nan() { f64::INFINITY } else { abs };
            d.abs = d.abs.max(abs);
            d.rel = d.rel.max(abs / scale);
            d.of_tolerance = d.of_tolerance.max(abs / tolerance);
        }
        d
    }
}

#[derive(Debug, Default)]
struct Difference {
    abs: f64,
    rel: f64,
    of_tolerance: f64,
}

/// Every case stepped on `device` ends where torch.optim's foreach and fused paths (on the CPU)
/// do, within the tolerance the rounding allows (the same bound on any device: each kernel's
/// operations round once each, in whatever order).
fn every_case_matches_torch_on(device: Device) {
    let fixtures = Fixtures::load();
    assert_eq!(fixtures.meta.cases.len(), 8);
    for case in &fixtures.meta.cases {
        let ours = fixtures.run(case.kind(), case.lr, device);
        for path in ["foreach", "fused"] {
            let d = fixtures.compare(&case.name, path, &ours);
            println!(
                "{:<26} on {device:?} vs torch {path:<7}: max |diff| {:.3e}, relative to scale {:.3e} ({:.4} of the tolerance)",
                case.name, d.abs, d.rel, d.of_tolerance
            );
            assert!(
                d.of_tolerance <= 1.0,
                "{} on {device:?} differs from torch's {path} path: {d:?}",
                case.name
            );
        }
    }
}

/// fp16 on `device`: behind the gradient scaler, with an inf at the first step and a nan at a
/// later one, every case ends where torch.amp.GradScaler with torch.optim's foreach path does (the
/// whole step skipped, torch's reference), the scale halved twice; stepping regardless of the
/// flag is far off.
fn every_case_behind_the_gradient_scaler_matches_torch_on(device: Device) {
    let fixtures = Fixtures::load();
    assert!(
        fixtures.meta.amp.bad.iter().any(|b| b.step == 0),
        "a skipped first step is covered"
    );
    for case in &fixtures.meta.cases {
        let (ours, scale) = fixtures.run_amp(case.kind(), case.lr, true, device);
        assert_eq!(
            scale, fixtures.meta.amp.final_scale,
            "{} on {device:?}",
            case.name
        );
        let d = fixtures.compare(&case.name, "amp", &ours);
        println!(
            "{:<26} on {device:?} vs torch amp     : max |diff| {:.3e}, relative to scale {:.3e} ({:.4} of the tolerance)",
            case.name, d.abs, d.rel, d.of_tolerance
        );
        assert!(
            d.of_tolerance <= 1.0,
            "{} on {device:?} behind the scaler: {d:?}",
            case.name
        );
        let (unflagged, _) = fixtures.run_amp(case.kind(), case.lr, false, device);
        let d = fixtures.compare(&case.name, "amp", &unflagged);
        assert!(
            d.of_tolerance > 1.0,
            "{} on {device:?} passed with the flag ignored: {d:?}",
            case.name
        );
    }
}

#[test]
fn every_case_matches_torch_foreach_and_fused() {
    every_case_matches_torch_on(Device::Cpu);
}

#[test]
fn every_case_behind_the_gradient_scaler_matches_torch() {
    every_case_behind_the_gradient_scaler_matches_torch_on(Device::Cpu);
}

/// On a GPU, PyTorch's CUDA kernels behind the same calls (the fused multi-tensor steps, the
/// scaler's unscale and update) end where torch.optim does, every case, with and without the
/// scaler. Skips loudly without a GPU.
#[test]
fn gpu_every_case_matches_torch_on_a_gpu() {
    let Some(gpu) = crate::cuda::test_gpu("gpu_every_case_matches_torch_on_a_gpu") else {
        return;
    };
    every_case_matches_torch_on(gpu);
    every_case_behind_the_gradient_scaler_matches_torch_on(gpu);
}

#[test]
fn a_wrong_option_fails_the_parity_check() {
    let fixtures = Fixtures::load();
    let case = |name: &str| {
        fixtures
            .meta
            .cases
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("cases.json has no {name}"))
    };
    let wrong = [
        (
            "sgd_nesterov",
            OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: false,
            },
        ),
        (
            "sgd_momentum",
            OptimizerKind::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
            },
        ),
        (
            "sgd_momentum_weight_decay",
            OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: false,
            },
        ),
        ("adam_weight_decay", OptimizerKind::AdamW { weight_decay: 0.1 }),
        ("adamw_weight_decay", OptimizerKind::Adam { weight_decay: 0.1 }),
    ];
    for (name, kind) in wrong {
        let ours = fixtures.run(kind, case(name).lr, Device::Cpu);
        let d = fixtures.compare(name, "fused", &ours);
        println!(
            "{name} run as {kind:?}: {:.1} times the tolerance",
            d.of_tolerance
        );
        assert!(d.of_tolerance > 1.0, "{name} passed as {kind:?}: {d:?}");
    }
}

fn cpu_float() -> (Kind, Device) {
    (Kind::Float, Device::Cpu)
}

const KINDS: [OptimizerKind; 4] = [
    OptimizerKind::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    },
    OptimizerKind::Sgd {
        momentum: 0.9,
        weight_decay: 0.01,
        nesterov: true,
    },
    OptimizerKind::Adam { weight_decay: 0.01 },
    OptimizerKind::AdamW { weight_decay: 0.01 },
];

#[test]
fn steps_do_not_bump_autograd_versions() {
    // A graph that saved the weight still runs backward after a step (weight stashing needs this).
    for kind in KINDS {
        let w = Tensor::ones([2, 2], cpu_float()).set_requires_grad(true);
        let x = Tensor::ones([1, 2], cpu_float()).set_requires_grad(true);
        let mut opt = Optimizer::new(kind, 0.5, vec![w.shallow_clone()]);
        let first = x.matmul(&w).sum(Kind::Float);
        let second = x.matmul(&w).sum(Kind::Float);
        first.backward();
        opt.step().unwrap();
        opt.step().unwrap(); // the second step of momentum and Adam takes the other branch of the kernels
                             // Fails with "modified by an inplace operation" if a step bumped the weight's version.
        second.f_backward().unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert!(w.grad().defined());
    }
    // Plain SGD's two steps with the gradient of ones at lr 0.5: 1 - 2 * 0.5 = 0.
    let w = Tensor::ones([2, 2], cpu_float()).set_requires_grad(true);
    let mut opt = Optimizer::new(KINDS[0], 0.5, vec![w.shallow_clone()]);
    w.sum(Kind::Float).backward();
    opt.step().unwrap();
    opt.step().unwrap();
    assert!(w.allclose(&Tensor::zeros([2, 2], cpu_float()), 0.0, 0.0, false));
}

#[test]
fn a_parameter_without_a_gradient_is_left_alone_until_it_has_one() {
    // `late` takes no part in the first two steps; its state starts at its own first step, so it
    // ends where an optimizer over it alone, started then, leaves it (Adam's bias correction
    // counts its own steps).
    for kind in KINDS {
        // Held, so that other tests' seeded draws stay theirs.
        let _generator = crate::models::hold_seeded(1);
        let early = Tensor::randn([3, 4], cpu_float()).set_requires_grad(true);
        let late = Tensor::randn([5], cpu_float()).set_requires_grad(true);
        let alone = late.detach().copy().set_requires_grad(true);
        let late_start = late.detach().copy();
        let mut both = Optimizer::new(kind, 0.1, vec![early.shallow_clone(), late.shallow_clone()]);
        let mut single = Optimizer::new(kind, 0.1, vec![alone.shallow_clone()]);
        for t in 0..5 {
            both.zero_grad();
            (&early * (t as f64 + 1.0)).sum(Kind::Float).backward();
            if t >= 2 {
                let g = Tensor::randn([5], cpu_float());
                (&late * &g).sum(Kind::Float).backward();
                single.zero_grad();
                (&alone * &g).sum(Kind::Float).backward();
                single.step().unwrap();
            }
            both.step().unwrap();
            if t < 2 {
                assert!(late.equal(&late_start), "{kind:?}: moved without a gradient");
            }
        }
        assert!(late.equal(&alone), "{kind:?}: {late} vs {alone}");
    }
}

#[test]
fn a_channels_last_parameter_steps_like_a_contiguous_one() {
    // The kernels walk parameter, gradient and state as flat arrays; a parameter with another
    // memory layout (channels last) must get the same elementwise update.
    for kind in KINDS {
        // Held, so that other tests' seeded draws stay theirs.
        let _generator = crate::models::hold_seeded(2);
        let nhwc = Tensor::randn([4, 2, 2, 3], cpu_float());
        let strided = nhwc.permute([0, 3, 1, 2]).detach().set_requires_grad(true);
        assert!(!strided.is_contiguous());
        let plain = strided.detach().contiguous().set_requires_grad(true);
        let mut a = Optimizer::new(kind, 0.1, vec![strided.shallow_clone()]);
        let mut b = Optimizer::new(kind, 0.1, vec![plain.shallow_clone()]);
        for _ in 0..3 {
            let g = Tensor::randn([4, 3, 2, 2], cpu_float());
            a.zero_grad();
            b.zero_grad();
            (&strided * &g).sum(Kind::Float).backward();
            (&plain * &g).sum(Kind::Float).backward();
            a.step().unwrap();
            b.step().unwrap();
        }
        assert!(strided.equal(&plain), "{kind:?}");
    }
}

#[test]
fn a_bad_call_is_an_error_not_a_crash() {
    let p = Tensor::ones([3], cpu_float()).set_requires_grad(true);
    p.sum(Kind::Float).backward();
    let hyper = SgdHyper {
        lr: fused::Lr::Value(0.1),
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
    };
    let wrong_shape = Tensor::zeros([4], cpu_float());
    let err = fused::sgd_step(&[&p], &[&wrong_shape], hyper, None).unwrap_err();
    assert!(err.contains("differs from its parameter"), "{err}");
    let err = fused::sgd_step(&[&p], &[], hyper, None).unwrap_err();
    assert!(err.contains("0 momentum buffers for 1 parameters"), "{err}");
    let no_grad = Tensor::ones([3], cpu_float()).set_requires_grad(true);
    let err = fused::sgd_step(
        &[&no_grad],
        &[],
        SgdHyper {
            momentum: 0.0,
            ..hyper
        },
        None,
    )
    .unwrap_err();
    assert!(err.contains("without a gradient"), "{err}");
    let double_lr = Tensor::from(0.1f64);
    let err = fused::sgd_step(
        &[&p],
        &[&Tensor::zeros([3], cpu_float())],
        SgdHyper {
            lr: fused::Lr::Tensor(&double_lr),
            ..hyper
        },
        None,
    )
    .unwrap_err();
    assert!(err.contains("0-dim float32 tensor"), "{err}");
}

/// A step flagged by fp16's scaler changes nothing, not even the optimizer's state made for it:
/// the next step is, bit for bit, a fresh optimizer's first (momentum blended into zeros, Adam's
/// step count back at 0); a flag of 0 steps as no flag does.
#[test]
fn a_flagged_step_changes_nothing_and_the_next_is_a_first_step() {
    let (skip, go) = (Tensor::ones([1], cpu_float()), Tensor::zeros([1], cpu_float()));
    for kind in KINDS {
        // Held, so that other tests' seeded draws stay theirs.
        let _generator = crate::models::hold_seeded(5);
        let start = Tensor::randn([6, 2], cpu_float());
        let (a, b, c) = (
            start.copy().set_requires_grad(true),
            start.copy().set_requires_grad(true),
            start.copy().set_requires_grad(true),
        );
        let mut flagged = Optimizer::new(kind, 0.1, vec![a.shallow_clone()]);
        let mut fresh = Optimizer::new(kind, 0.1, vec![b.shallow_clone()]);
        let mut plain = Optimizer::new(kind, 0.1, vec![c.shallow_clone()]);
        (&a * Tensor::randn([6, 2], cpu_float()))
            .sum(Kind::Float)
            .backward();
        flagged.step_unless(&skip).unwrap();
        assert!(a.equal(&start), "{kind:?}: a skipped step moved the parameter");
        for _ in 0..2 {
            let g = Tensor::randn([6, 2], cpu_float());
            for (p, opt) in [(&a, &mut flagged), (&b, &mut fresh), (&c, &mut plain)] {
                opt.zero_grad();
                (p * &g).sum(Kind::Float).backward();
            }
            flagged.step_unless(&go).unwrap();
            fresh.step_unless(&go).unwrap();
            plain.step().unwrap();
        }
        assert!(!a.equal(&start), "{kind:?}: nothing stepped");
        assert!(a.equal(&b), "{kind:?}: {a} vs {b}");
        assert!(b.equal(&c), "{kind:?}: a flag of 0 stepped otherwise: {b} vs {c}");
    }
}

/// A learning rate kept on the device (what a step captured in a CUDA graph reads) steps exactly
/// as the same rate given as a number, rounded to float32 as the tensor holds it; and a rate
/// written between steps is the one the next step takes.
#[test]
fn a_learning_rate_kept_on_the_device_steps_as_its_value() {
    for kind in KINDS {
        // Held, so that other tests' seeded draws stay theirs.
        let _generator = crate::models::hold_seeded(4);
        let start = Tensor::randn([5, 3], cpu_float());
        let (a, b) = (
            start.copy().set_requires_grad(true),
            start.copy().set_requires_grad(true),
        );
        let rates = [0.1, 0.03, 0.07];
        let f32_rounded = |lr: f64| lr as f32 as f64;
        let mut kept = Optimizer::new(kind, rates[0], vec![a.shallow_clone()]);
        kept.keep_lr_on_device(Device::Cpu).unwrap();
        let mut plain = Optimizer::new(kind, f32_rounded(rates[0]), vec![b.shallow_clone()]);
        for &lr in &rates {
            let g = Tensor::randn([5, 3], cpu_float());
            kept.zero_grad();
            plain.zero_grad();
            (&a * &g).sum(Kind::Float).backward();
            (&b * &g).sum(Kind::Float).backward();
            kept.set_lr(lr);
            kept.write_lr();
            plain.set_lr(f32_rounded(lr));
            kept.step().unwrap();
            plain.step().unwrap();
        }
        assert!(a.equal(&b), "{kind:?}: {a} vs {b}");
        assert!(!a.equal(&start), "{kind:?}: the steps moved nothing");
    }
}
