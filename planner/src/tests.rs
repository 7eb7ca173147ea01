//! The planner against brute force, on hand-made profiles, and its errors.

use std::ops::Range;

use crate::*;

/// A small deterministic generator (xorshift), so tests need no crates.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % 10_000) as f64 / 10_000.0
    }
}

fn layer(compute_s: f64, activation_bytes: f64, param_bytes: f64) -> LayerCost {
    LayerCost {
        compute_s,
        activation_bytes,
        output_bytes: activation_bytes,
        param_bytes,
        optimizer_s: 0.0,
    }
}

/// Every composition of `total` into `parts` positive parts.
fn compositions(total: usize, parts: usize) -> Vec<Vec<usize>> {
    if parts == 1 {
        return vec![vec![total]];
    }
    (1..total)
        .flat_map(|first| {
            compositions(total - first, parts - 1)
                .into_iter()
                .map(move |mut rest| {
                    rest.insert(0, first);
                    rest
                })
        })
        .filter(|c| c.len() == parts)
        .collect()
}

thread_local! {
    /// The best objective of each shape (replicas per stage) the last brute force saw.
    static BY_SHAPE: std::cell::RefCell<std::collections::HashMap<Vec<usize>, f64>> = Default::default();
}

/// The best time over every split and replica assignment.
fn brute_force(model: &CostModel, workers: usize, straight: bool) -> Option<f64> {
    let n = model.len();
    BY_SHAPE.with(|m| m.borrow_mut().clear());
    let mut best: Option<f64> = None;
    for mask in 0..(1u32 << (n - 1)) {
        let mut stages: Vec<Range<usize>> = Vec::new();
        let mut start = 0;
        for cut in 1..n {
            if mask & (1 << (cut - 1)) != 0 {
                stages.push(start..cut);
                start = cut;
            }
        }
        stages.push(start..n);
        if stages.len() > workers {
            continue;
        }
        for replicas in compositions(workers, stages.len()) {
            if straight && replicas.iter().any(|&r| r > 1) {
                continue;
            }
            let (mut time, mut worker, mut fits) = (0.0f64, 0, true);
            for (s, (range, &r)) in stages.iter().zip(&replicas).enumerate() {
                fits &= model.fits(range, r, workers - worker) && model.replicas_allowed(r);
                let here = worker..worker + r;
                time = time.max(model.stage_time(range, &here));
                if s + 1 < stages.len() {
                    let next = here.end..here.end + replicas[s + 1];
                    time = time.max(model.boundary_time(range.end - 1, &here, &next));
                }
                worker += r;
            }
            let split: Vec<(Range<usize>, usize)> =
                stages.iter().cloned().zip(replicas.iter().copied()).collect();
            assert_eq!(time, model.evaluate(&split));
            let objective = model.objective(&split);
            if fits && best.is_none_or(|b| objective < b) {
                best = Some(objective);
            }
            if fits {
                BY_SHAPE.with(|m| {
                    let mut m = m.borrow_mut();
                    let e = m.entry(replicas.clone()).or_insert(f64::INFINITY);
                    *e = e.min(objective);
                });
            }
        }
    }
    best
}

#[test]
fn the_program_finds_the_brute_force_optimum() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let mut checked = 0;
    for case in 0..300 {
        let modules = 1 + (rng.next() * 6.0) as usize;
        let workers = 1 + (rng.next() * 5.0) as usize;
        let layers: Vec<LayerCost> = (0..modules)
            .map(|_| LayerCost {
                optimizer_s: 0.01 * rng.next(),
                ..layer(0.01 + rng.next(), 1e6 * rng.next(), 1e8 * rng.next() * rng.next())
            })
            .collect();
        let network = match case % 3 {
            0 => Network::flat(workers, 1e9),
            1 => Network {
                levels: vec![(2, 1e10), (workers, 1e8)],
            },
            _ => Network {
                levels: vec![(2, 1e10), (3, 1e9), (workers, 1e8)],
            },
        };
        let memory = (case % 4 == 0).then(|| 3e8 + 3e8 * rng.next());
        let schedule = match case % 5 {
            0 | 1 => Schedule::Steady,
            2 | 3 => Schedule::Flushing {
                microbatches: 1 + case % 7,
            },
            _ => Schedule::PipeDream { microbatches: 4 },
        };
        let model = CostModel::new(&layers, network, memory).with_schedule(schedule);
        for straight in [false, true] {
            let expected = brute_force(&model, workers, straight);
            match plan(&model, workers, straight) {
                Ok(p) => {
                    let e = expected.expect("brute force finds a plan too");
                    let got = p.objective;
                    assert!(
                        (got - e).abs() <= 1e-12 * e.max(1.0),
                        "case {case} {schedule:?}: {got} vs {e}"
                    );
                    assert_eq!(p.stages.iter().map(|s| s.replicas).sum::<usize>(), workers);
                    assert_eq!(p.stages.last().unwrap().modules.end, modules);
                    checked += 1;
                }
                Err(PlanError::TooFewModules { .. }) => assert!(straight && modules < workers),
                Err(PlanError::NothingFits { .. } | PlanError::NoDividingSplit { .. }) => {
                    assert_eq!(expected, None, "case {case}")
                }
                Err(e) => panic!("case {case}: {e}"),
            }
        }
    }
    assert!(checked > 300, "only {checked} plans compared");
}

/// Under PipeDream a stage's replicas must divide the microbatches: four workers, four
/// microbatches and one heavy layer before three light ones would otherwise give the heavy
/// layer three replicas.
#[test]
fn pipedreams_replica_counts_divide_its_microbatches() {
    let layers = [layer(3.0, 1e3, 1e3), layer(1.0, 1e3, 1e3), layer(0.0, 1e3, 1e3)];
    let net = || Network::flat(4, 1e12);
    let counts = |microbatches: usize| -> Vec<usize> {
        let model = CostModel::new(&layers, net(), None).with_schedule(Schedule::PipeDream { microbatches });
        let p = plan(&model, 4, false).unwrap();
        p.stages.iter().map(|s| s.replicas).collect()
    };
    assert_eq!(
        counts(6),
        [3, 1],
        "three replicas of the heavy layer where they divide 6"
    );
    let divided = counts(4);
    assert!(divided.iter().all(|r| 4 % r == 0), "{divided:?}");
    assert_eq!(divided.iter().sum::<usize>(), 4);
    // One module on three workers: three replicas, which do not divide 4.
    let model = CostModel::new(&layers[..1], Network::flat(3, 1e12), None)
        .with_schedule(Schedule::PipeDream { microbatches: 4 });
    let e = plan(&model, 3, false).unwrap_err();
    assert!(
        matches!(
            e,
            PlanError::NoDividingSplit {
                workers: 3,
                microbatches: 4
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("set microbatches to a multiple of 3"),
        "{e}"
    );
}

#[test]
fn a_flushing_schedule_weighs_fill_and_drain_and_pipedream_updates_per_microbatch() {
    // Four equal layers on four workers, cheap transfers, tiny weights: in steady state four
    // stages and data parallelism tie, so nothing but the schedule decides.
    let layers: Vec<LayerCost> = (0..4).map(|_| layer(1.0, 1e3, 1e3)).collect();
    let flushing = CostModel::new(&layers, Network::flat(4, 1e12), None)
        .with_schedule(Schedule::Flushing { microbatches: 2 });
    // Fill and drain: four stages cost (2 + 3) / 2 of their steady 1 s; one stage, 4 / 4 = 1 s.
    let p = plan(&flushing, 4, false).unwrap();
    assert_eq!(p.stages.len(), 1, "{p:?}");
    assert!((p.objective - 1.0).abs() < 1e-6, "{p:?}");
    // PipeDream updates after each microbatch: 8 microbatches over 4 replicas is 2 all-reduces
    // each per minibatch, against one for a flushing schedule.
    let heavy: Vec<LayerCost> = (0..4).map(|_| layer(1.0, 1e3, 1e9)).collect();
    let net = Network::flat(4, 1e9);
    let once =
        CostModel::new(&heavy, net.clone(), None).with_schedule(Schedule::Flushing { microbatches: 8 });
    let each = CostModel::new(&heavy, net, None).with_schedule(Schedule::PipeDream { microbatches: 8 });
    let all = 0..4;
    let (a, b) = (once.stage_parts(&all, &(0..4)), each.stage_parts(&all, &(0..4)));
    assert!(
        (b.allreduce_s - 2.0 * a.allreduce_s).abs() < 1e-9 * b.allreduce_s,
        "{a:?} {b:?}"
    );
}

#[test]
fn fill_and_drain_stretch_a_stages_compute_but_not_its_update() {
    // Two layers of 1 s compute and 1 s optimizer step each, weights too small to all-reduce at
    // any cost. At 2 microbatches, two stages take 1 s of compute stretched over 3 slots, 1.5 s,
    // then their own 1 s step: 2.5 s. Data parallelism shares the compute (1 s) and steps both
    // layers (2 s): 3 s. Stretching the whole stage, update included, would make it (1 + 1) x 1.5
    // = 3 s, a tie, and hide the pipeline's gain.
    let layers: Vec<LayerCost> = (0..2)
        .map(|_| LayerCost {
            optimizer_s: 1.0,
            ..layer(1.0, 1e3, 1.0)
        })
        .collect();
    let model = CostModel::new(&layers, Network::flat(2, 1e15), None)
        .with_schedule(Schedule::Flushing { microbatches: 2 });
    let p = plan(&model, 2, false).unwrap();
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert_eq!(p.stages.len(), 2, "{p:?}");
    assert!(close(p.objective, 2.5), "{p:?}");
    assert!(close(p.flushing_time(2), 2.5), "{p:?}");
    assert!(close(p.time_per_minibatch, 2.0), "{p:?}");
    assert!(close(p.data_parallel_time.unwrap(), 3.0), "{p:?}");
    assert!(close(p.speedup().unwrap(), 3.0 / 2.5), "{p:?}");
    // More microbatches shrink fill and drain but not the step: at 8, 1 x 9/8 + 1.
    assert!(close(p.flushing_time(8), 2.125), "{p:?}");
}

#[test]
fn a_heavy_layer_gets_its_own_stage_or_replicas() {
    // Five light layers and one ten times heavier, small activations, few parameters.
    let mut layers: Vec<LayerCost> = (0..6).map(|_| layer(1.0, 1e3, 1e3)).collect();
    layers[3].compute_s = 10.0;
    let model = CostModel::new(&layers, Network::flat(4, 1e9), None);
    let p = plan(&model, 4, false).unwrap();
    let heavy = p.stages.iter().find(|s| s.modules.contains(&3)).unwrap();
    assert!(heavy.modules == (3..4) || heavy.replicas > 1, "{p:?}");
    // Straight: the heavy layer stands alone, and it is the bottleneck.
    let s = plan(&model, 4, true).unwrap();
    assert!(s.stages.iter().all(|st| st.replicas == 1));
    assert_eq!(s.stages.len(), 4);
    assert!(s.stages.iter().any(|st| st.modules == (3..4)), "{s:?}");
    assert_eq!(s.time_per_minibatch, 10.0);
}

#[test]
fn big_weights_favour_pipelines_and_small_ones_data_parallelism() {
    // VGG-like: most parameters in the last layers, all-reduce expensive on a slow network.
    let mut layers: Vec<LayerCost> = (0..8).map(|_| layer(1.0, 1e6, 1e5)).collect();
    layers[6].param_bytes = 4e8;
    layers[7].param_bytes = 6e7;
    // About a 1 Gb/s network.
    let model = CostModel::new(&layers, Network::flat(4, 1.25e8), None);
    let p = plan(&model, 4, false).unwrap();
    assert!(p.stages.len() > 1, "{p:?}");
    assert!(p.speedup().unwrap() > 1.5, "{p:?}");
    // Tiny weights, big activations: data parallelism wins and the plan is one replicated stage.
    let layers: Vec<LayerCost> = (0..8).map(|_| layer(1.0, 1e10, 1e3)).collect();
    let model = CostModel::new(&layers, Network::flat(4, 1e9), None);
    let p = plan(&model, 4, false).unwrap();
    assert_eq!(p.stages.len(), 1);
    assert_eq!(p.stages[0].replicas, 4);
    assert!((p.speedup().unwrap() - 1.0).abs() < 1e-12);
}

#[test]
fn the_stage_config_is_pipedreams_and_validates() {
    let layers: Vec<LayerCost> = (0..6).map(|i| layer(1.0 + i as f64, 1e3, 1e3)).collect();
    let model = CostModel::new(&layers, Network::flat(5, 1e9), None);
    let p = plan(&model, 5, false).unwrap();
    let config = p.stage_config();
    let validated = config.validate(6, 5).unwrap();
    assert_eq!(validated.stages.len(), p.stages.len());
    for (planned, stage) in p.stages.iter().zip(&validated.stages) {
        assert_eq!(planned.modules, stage.modules);
        assert_eq!(planned.replicas, stage.ranks.len());
    }
    assert!(p.flushing_time(4) >= p.time_per_minibatch);
}

#[test]
fn memory_limits_and_bad_requests_are_clear_errors() {
    let layers = vec![layer(1.0, 1e6, 1e9), layer(1.0, 1e6, 1e9)];
    let tight = CostModel::new(&layers, Network::flat(2, 1e9), Some(1e9));
    let err = plan(&tight, 2, false).unwrap_err();
    assert_eq!(
        err.to_string(),
        "no split fits in 0.93 GiB per worker; raise --memory or add workers"
    );
    let model = CostModel::new(&layers, Network::flat(3, 1e9), None);
    assert_eq!(
        plan(&model, 3, true).unwrap_err(),
        PlanError::TooFewModules {
            workers: 3,
            modules: 2
        }
    );
    assert_eq!(plan(&model, 0, false).unwrap_err(), PlanError::NoWorkers);
}

/// Costs that are not finite numbers would plan as NaN (a NaN compute time hides as 0 in the
/// prefix sums; a NaN transfer makes every comparison false): refused, naming the module and
/// the field. So are bandwidths that are not finite numbers above 0.
#[test]
fn costs_and_bandwidths_that_are_not_finite_are_refused() {
    let good = vec![layer(1.0, 1e6, 1e6), layer(1.0, 1e6, 1e6), layer(1.0, 1e6, 1e6)];
    for (field, bad) in [("compute_s", f64::NAN), ("output_bytes", f64::INFINITY)] {
        let mut layers = good.clone();
        match field {
            "compute_s" => layers[1].compute_s = bad,
            _ => layers[1].output_bytes = bad,
        }
        let model = CostModel::new(&layers, Network::flat(2, 1e9), None);
        let err = plan(&model, 2, false).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("module 1's {field} is {bad}; the planner needs finite measurements")
        );
    }
    for bandwidth in [0.0, f64::NAN, f64::INFINITY] {
        let model = CostModel::new(&good, Network::flat(2, bandwidth), None);
        let err = plan(&model, 2, false).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("network level 0's bandwidth is {bandwidth} bytes/s; it must be a finite number above 0")
        );
    }
    let model = CostModel::new(&good, Network::flat(2, 1e9), Some(f64::NAN));
    assert_eq!(
        plan(&model, 2, false).unwrap_err(),
        PlanError::Invalid("the memory limit is NaN".into())
    );
    plan(&CostModel::new(&good, Network::flat(2, 1e9), None), 2, false).unwrap();
}

/// The program's tables grow as workers^3 and modules x workers^2 (x stage counts for a
/// flushing schedule): 10000 workers asked for 8 TB and aborted. Refused up front instead,
/// saying how many workers would do; so is a request that fits in memory but would run for
/// hours.
#[test]
fn requests_too_large_to_plan_are_refused_with_how_many_workers_would_do() {
    let layers: Vec<LayerCost> = (0..5).map(|_| layer(1.0, 1e6, 1e6)).collect();
    let model = CostModel::new(&layers, Network::flat(10_000, 1e9), None);
    let err = plan(&model, 10_000, false).unwrap_err();
    let PlanError::TooMuchMemory { gib, fits, .. } = err.clone() else {
        panic!("{err:?}")
    };
    assert!(gib > 7000.0, "{err}");
    assert!((1..10_000).contains(&fits), "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "planning 5 modules on 10000 workers needs {gib:.2} GiB for the planner's tables, over its \
             limit of 1 GiB; lower --workers (up to {fits} stay within the limits)"
        )
    );
    // The suggestion is the most that would do: one more is refused too, quickly.
    let started = std::time::Instant::now();
    let one_more = plan(&model, fits + 1, false).unwrap_err();
    assert!(
        matches!(one_more, PlanError::TooMuchWork { fits: f, .. } | PlanError::TooMuchMemory { fits: f, .. } if f == fits),
        "{one_more:?}"
    );
    assert!(started.elapsed().as_secs() < 10, "{:?}", started.elapsed());

    // 400 workers' tables fit in memory, but computing the boundaries' costs alone takes
    // about 6e10 steps (workers^5 / 200): minutes to hours.
    let err = plan(&model, 400, false).unwrap_err();
    let PlanError::TooMuchWork { steps, fits, .. } = err.clone() else {
        panic!("{err:?}")
    };
    assert!(steps > MAX_STEPS && fits < 400, "{err}");
    assert!(
        err.to_string().starts_with(&format!(
            "planning 5 modules on 400 workers takes about {steps:.1e} steps of the planner's program, over \
             its limit of 1e10 (about a minute); lower --workers (up to {fits} stay within the limits)"
        )),
        "{err}"
    );
    // A flushing schedule runs the program once per stage count, its tables as many times as
    // large: 64 stages over 200 modules need 2.84 GiB, refused before they are allocated.
    let layers: Vec<LayerCost> = (0..200).map(|_| layer(1.0, 1e6, 1e6)).collect();
    let model = CostModel::new(&layers, Network::flat(64, 1e9), None)
        .with_schedule(Schedule::Flushing { microbatches: 4 });
    let err = plan(&model, 64, true).unwrap_err();
    let PlanError::TooMuchMemory { stages, fits, .. } = err.clone() else {
        panic!("{err:?}")
    };
    assert_eq!(stages, Some(64), "{err}");
    assert!((1..64).contains(&fits), "{err}");
    assert!(
        err.to_string().starts_with(
            "planning 200 modules on 64 workers in 64 stages (a flushing --schedule plans each stage count \
             on its own) needs 2.84 GiB for the planner's tables"
        ),
        "{err}"
    );
    // Within the limits, planning goes ahead.
    plan(&model, 8, true).unwrap();
}

#[test]
fn bandwidth_is_that_of_the_innermost_level_holding_the_workers() {
    let net = Network {
        levels: vec![(4, 100.0), (16, 10.0)],
    };
    assert_eq!(net.bandwidth(&(0..4)), 100.0);
    assert_eq!(net.bandwidth(&(3..5)), 10.0);
    assert_eq!(net.bandwidth(&(4..8)), 100.0);
    assert_eq!(net.bandwidth(&(0..16)), 10.0);
}

#[test]
fn the_stages_parts_and_transfers_account_for_the_predicted_time() {
    let mut rng = Rng(7);
    for workers in [2, 3, 5] {
        let layers: Vec<LayerCost> = (0..8)
            .map(|_| layer(0.01 + rng.next(), 1e6 * rng.next(), 4e6 * rng.next()))
            .collect();
        let network = Network {
            levels: vec![(2, 1e9), (workers, 1e8)],
        };
        let model = CostModel::new(&layers, network, None);
        let plan = plan(&model, workers, false).unwrap();
        let mut slowest: f64 = 0.0;
        for (i, s) in plan.stages.iter().enumerate() {
            assert_eq!(s.time_s, s.parts.total());
            assert!(s.parts.compute_s > 0.0 && s.parts.optimizer_s >= 0.0);
            assert_eq!(s.parts.allreduce_s == 0.0, s.replicas == 1, "stage {i}: {s:?}");
            assert_eq!(
                s.transfer_s.is_none(),
                i + 1 == plan.stages.len(),
                "stage {i}: {s:?}"
            );
            slowest = slowest.max(s.time_s).max(s.transfer_s.unwrap_or(0.0));
        }
        assert_eq!(plan.time_per_minibatch, slowest, "{workers} workers: {plan:?}");
    }
}

#[test]
fn a_boundary_charges_each_pair_of_replicas_at_the_level_between_them() {
    // Four machines of four workers: 10 GB/s inside one, 1.25 GB/s between.
    let net = Network {
        levels: vec![(4, 10e9), (16, 1.25e9)],
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b;
    // One worker to the next, inside a machine and across machines: the bytes both ways.
    assert!(close(net.boundary_seconds_per_byte(&(0..1), &(1..2)), 2.0 / 10e9));
    assert!(close(
        net.boundary_seconds_per_byte(&(3..4), &(4..5)),
        2.0 / 1.25e9
    ));
    // Four replicas on workers 2..6 (two machines) feed worker 6: it receives a quarter from
    // each, half of it over the slow link. Charged at the link between workers 5 and 6 alone, as
    // before, this was 2 / 10e9.
    let straddling = net.boundary_seconds_per_byte(&(2..6), &(6..7));
    assert!(
        close(straddling, 2.0 * (0.25 / 1.25e9 * 2.0 + 0.25 / 10e9 * 2.0)),
        "{straddling}"
    );
    // Kept inside one machine (4..8 feeding 8) only the receiver's own link is slow.
    let aligned = net.boundary_seconds_per_byte(&(4..8), &(8..9));
    assert!(close(aligned, 2.0 * 4.0 * 0.25 / 1.25e9), "{aligned}");
    // Two replicas feeding three: six pairs over a period of six microbatches; every worker's
    // share adds up to its part of the traffic.
    let flat = Network::flat(5, 1e9);
    assert!(close(
        flat.boundary_seconds_per_byte(&(0..2), &(2..5)),
        2.0 * 0.5 / 1e9
    ));
}

/// A VGG-16-shaped model on `batch` images: thirteen 3x3 convolutions with their pooling, then
/// three fully connected layers; compute from the arithmetic, one TFLOP/s per worker.
fn vgg16_like(batch: f64) -> Vec<LayerCost> {
    let mut layers = Vec::new();
    let (mut side, mut channels) = (224.0f64, 3.0);
    for (out, pool) in [
        (64.0, false),
        (64.0, true),
        (128.0, false),
        (128.0, true),
        (256.0, false),
        (256.0, false),
        (256.0, true),
        (512.0, false),
        (512.0, false),
        (512.0, true),
        (512.0, false),
        (512.0, false),
        (512.0, true),
    ] {
        let flops = 3.0 * 2.0 * 9.0 * channels * out * side * side * batch;
        if pool {
            side /= 2.0;
        }
        let output = 4.0 * out * side * side * batch;
        layers.push(layer(flops / 1e12, output, 4.0 * (9.0 * channels * out + out)));
        channels = out;
    }
    for (inputs, outputs) in [(25088.0, 4096.0), (4096.0, 4096.0), (4096.0, 1000.0)] {
        let flops = 3.0 * 2.0 * inputs * outputs * batch;
        layers.push(layer(
            flops / 1e12,
            4.0 * outputs * batch,
            4.0 * (inputs * outputs + outputs),
        ));
    }
    layers
}

#[test]
fn on_two_levels_the_plan_is_never_worse_than_a_flat_networks_plan() {
    // Four machines of four workers, as in PipeDream's examples.
    let two_level = Network {
        levels: vec![(4, 10e9), (16, 1.25e9)],
    };
    for batch in [16.0, 64.0, 256.0] {
        let layers = vgg16_like(batch);
        let model = CostModel::new(&layers, two_level.clone(), None);
        let chosen = plan(&model, 16, false).unwrap();
        assert_eq!(chosen.stages.iter().map(|s| s.replicas).sum::<usize>(), 16);
        let judged = model.evaluate(&split(&chosen));
        assert!((judged - chosen.time_per_minibatch).abs() <= 1e-12 * judged);
        for bandwidth in [10e9, 1.25e9] {
            let flat = CostModel::new(&layers, Network::flat(16, bandwidth), None);
            let flat_plan = plan(&flat, 16, false).unwrap();
            let flat_judged = model.evaluate(&split(&flat_plan));
            assert!(
                chosen.time_per_minibatch <= flat_judged * (1.0 + 1e-12),
                "batch {batch}, flat at {bandwidth}: {} > {flat_judged}\n{chosen:?}\n{flat_plan:?}",
                chosen.time_per_minibatch
            );
        }
    }
}

fn split(plan: &Plan) -> Vec<(Range<usize>, usize)> {
    plan.stages
        .iter()
        .map(|s| (s.modules.clone(), s.replicas))
        .collect()
}

/// A node line of PipeDream's format.
fn node(id: &str, description: &str, ms: f64, activation: f64, params: f64) -> String {
    format!(
        "{id} -- {description} -- forward_compute_time={ms:.3}, backward_compute_time={:.3}, activation_size={activation:.3}, parameter_size={params:.3}\n",
        2.0 * ms
    )
}

/// A residual network's shape in PipeDream's format: an input, a stem, then `blocks` blocks of
/// two convolutions whose sum with the block's input feeds the next, then a pooled classifier,
/// with PyTorch's Size/View pair before it as PipeDream's profiler records it.
fn residual_graph(blocks: usize) -> String {
    let mut nodes = node("node1", "Input", 1.0, 6e8, 0.0);
    nodes += &node("node2", "Conv2d(3, 64)", 5.0, 8e8, 1e4);
    let mut edges = String::from("\tnode1 -- node2\n");
    let mut input = 2;
    let mut next = 3;
    for b in 0..blocks {
        let (a, c, add) = (next, next + 1, next + 2);
        nodes += &node(&format!("node{a}"), "Conv2d(64, 64)", 3.0 + b as f64, 8e8, 1e5);
        nodes += &node(&format!("node{c}"), "Conv2d(64, 64)", 3.0, 8e8, 1e5);
        nodes += &node(&format!("node{add}"), "Add(inplace)", 0.2, 8e8, 0.0);
        for (x, y) in [(input, a), (a, c), (c, add), (input, add)] {
            edges += &format!("\tnode{x} -- node{y}\n");
        }
        input = add;
        next += 3;
    }
    let (pool, size, view, linear) = (next, next + 1, next + 2, next + 3);
    nodes += &node(&format!("node{pool}"), "AdaptiveAvgPool2d", 0.5, 1e6, 0.0);
    nodes += &node(&format!("node{size}"), "Size(0)", 0.0, 4.0, 0.0);
    nodes += &node(&format!("node{view}"), "View(-1)", 0.0, 1e6, 0.0);
    nodes += &node(&format!("node{linear}"), "Linear(64, 1000)", 0.4, 5e5, 2.6e5);
    for (x, y) in [
        (input, pool),
        (pool, size),
        (pool, view),
        (size, view),
        (view, linear),
    ] {
        edges += &format!("\tnode{x} -- node{y}\n");
    }
    nodes + &edges
}

#[test]
fn a_pipedream_graph_is_cut_only_where_one_tensor_crosses() {
    let graph = Graph::parse(&residual_graph(3)).unwrap();
    assert_eq!(graph.nodes.len(), 2 + 3 * 3 + 4);
    let chain = graph.chain().unwrap();
    let ids = |s: &Segment| {
        s.nodes
            .iter()
            .map(|&i| graph.nodes[i].id.as_str())
            .collect::<Vec<_>>()
    };
    let segments: Vec<Vec<&str>> = chain.iter().map(ids).collect();
    // Input, stem, each block whole (its input crosses until its sum), the pooling (Size and
    // View both read it, so Size's output never crosses alone), View, the classifier.
    assert_eq!(
        segments,
        vec![
            vec!["node1"],
            vec!["node2"],
            vec!["node3", "node4", "node5"],
            vec!["node6", "node7", "node8"],
            vec!["node9", "node10", "node11"],
            vec!["node12"],
            vec!["node13", "node14"],
            vec!["node15"],
        ]
    );
    // Times sum (forward and the profiler's 2x backward, milliseconds to seconds), the block's
    // activations add for memory, and the cut after it carries the sum's output alone.
    let block = &chain[2].cost;
    assert!((block.compute_s - 3.0 * (3.0 + 3.0 + 0.2) / 1e3).abs() < 1e-15);
    assert_eq!(block.activation_bytes, 3.0 * 8e8);
    assert_eq!(block.output_bytes, 8e8);
    assert_eq!(block.param_bytes, 2e5);
    assert_eq!(chain[5].cost.output_bytes, 1e6);
    // The planner runs over the chain.
    let layers: Vec<LayerCost> = chain.iter().map(|s| s.cost.clone()).collect();
    let model = CostModel::new(&layers, Network::flat(3, 1e9), None);
    let p = plan(&model, 3, true).unwrap();
    assert_eq!(p.stages.len(), 3);
}

#[test]
fn a_partitioned_graph_round_trips_with_its_stages() {
    let graph = Graph::parse(&residual_graph(2)).unwrap();
    let stages: Vec<usize> = (0..graph.nodes.len()).map(|i| usize::from(i >= 5)).collect();
    let text = graph.with_stages(&stages);
    let back = Graph::parse(&text).unwrap();
    assert_eq!(back.edges, graph.edges);
    for ((a, b), s) in back.nodes.iter().zip(&graph.nodes).zip(&stages) {
        assert_eq!(a.stage_id, Some(*s));
        assert_eq!((&a.id, &a.description), (&b.id, &b.description));
        assert!((a.forward_ms - b.forward_ms).abs() < 1e-3);
        assert_eq!(a.activation_bytes, b.activation_bytes);
    }
}

#[test]
fn a_graph_that_cannot_be_read_names_the_line() {
    let good = node("node1", "Input", 1.0, 10.0, 0.0) + &node("node2", "ReLU", 1.0, 10.0, 0.0);
    let cases = [
        (
            good.clone() + "\tnode1 -- node3\n",
            "line 3: the edge names node3, which no node line declares",
        ),
        (
            good.replace("=1.000,", "=fast,"),
            "line 1: forward_compute_time: `fast` is not a number",
        ),
        (
            good.replace(", parameter_size=0.000", ""),
            "line 1: the node has no parameter_size",
        ),
        (
            "node1 -- Input\n".to_string(),
            "line 1: a node needs its measurements",
        ),
        (good.clone() + &good, "line 3: node1 is declared twice"),
        (
            good.clone() + "\tnode1 node2\n",
            "line 3: an edge line is `\\t<node> -- <node>`",
        ),
        (
            good.clone() + "\tnode1 -- node2\n\tnode2 -- node1\n",
            "the graph has a cycle through node1",
        ),
        ("\n".to_string(), "the graph has no nodes"),
        // Measurements that are no measurements: what is allowed is said.
        (
            good.replacen("=1.000,", "=-1.000,", 1),
            "line 1: forward_compute_time is `-1.000`; it must be a finite number of milliseconds from 0 to 1e9",
        ),
        (
            good.replacen("=1.000,", "=NaN,", 1),
            "line 1: forward_compute_time is `NaN`; it must be a finite number of milliseconds",
        ),
        (
            good.replacen("=1.000,", "=inf,", 1),
            "line 1: forward_compute_time is `inf`; it must be a finite number of milliseconds",
        ),
        (
            good.replacen("=2.000,", "=2e12,", 1),
            "line 1: backward_compute_time is `2e12`; it must be a finite number of milliseconds",
        ),
        (
            good.replacen("activation_size=10.000", "activation_size=1e300", 1),
            "line 1: activation_size is `1e300`; it must be a finite number of bytes from 0 to 2^50 (a pebibyte)",
        ),
    ];
    for (text, expected) in cases {
        let result = Graph::parse(&text).and_then(|g| g.chain().map(|_| g));
        let message = result.expect_err(expected).to_string();
        assert!(
            message.starts_with(expected),
            "{message:?} does not start with {expected:?}"
        );
    }
}

#[test]
fn a_residual_graph_on_two_levels_is_planned_no_worse_than_flat() {
    let graph = Graph::parse(&residual_graph(16)).unwrap();
    let layers: Vec<LayerCost> = graph.chain().unwrap().into_iter().map(|s| s.cost).collect();
    let two_level = Network {
        levels: vec![(4, 10e9), (16, 1.25e9)],
    };
    let model = CostModel::new(&layers, two_level, None);
    let chosen = plan(&model, 16, false).unwrap();
    for bandwidth in [10e9, 1.25e9] {
        let flat = plan(
            &CostModel::new(&layers, Network::flat(16, bandwidth), None),
            16,
            false,
        )
        .unwrap();
        assert!(chosen.time_per_minibatch <= model.evaluate(&split(&flat)) * (1.0 + 1e-12));
    }
}

#[test]
fn each_shapes_best_split_matches_brute_force_and_the_runner_ups_are_not_faster() {
    let mut rng = Rng(0x5eed);
    for case in 0..60 {
        let modules = 2 + (rng.next() * 5.0) as usize;
        let workers = 1 + (rng.next() * 5.0) as usize;
        let layers: Vec<LayerCost> = (0..modules)
            .map(|_| layer(0.01 + rng.next(), 1e6 * rng.next(), 1e8 * rng.next() * rng.next()))
            .collect();
        let network = Network {
            levels: vec![(2, 1e10), (workers, 1e8)],
        };
        let schedule = match case % 2 {
            0 => Schedule::Steady,
            _ => Schedule::Flushing {
                microbatches: 1 + case % 5,
            },
        };
        let model = CostModel::new(&layers, network, None).with_schedule(schedule);
        let chosen = plan(&model, workers, false).unwrap();
        // The chosen plan's own shape gives its time back.
        let same = plan_for_shape(
            &model,
            &chosen.stages.iter().map(|s| s.replicas).collect::<Vec<_>>(),
        )
        .unwrap();
        assert!((same.objective - chosen.objective).abs() <= 1e-12 * chosen.objective);
        let others = alternatives(&model, workers, &chosen, usize::MAX);
        for other in &others {
            assert!(other.objective >= chosen.objective * (1.0 - 1e-12), "case {case}");
            assert!(
                (model.evaluate(&split(other)) - other.time_per_minibatch).abs()
                    <= 1e-12 * other.time_per_minibatch
            );
            assert!((model.objective(&split(other)) - other.objective).abs() <= 1e-12 * other.objective);
            assert_eq!(other.stages.iter().map(|s| s.replicas).sum::<usize>(), workers);
        }
        assert!(others.windows(2).all(|w| w[0].objective <= w[1].objective));
        // Each shape's split is the best brute force finds for that shape.
        brute_force(&model, workers, false);
        for other in &others {
            let shape: Vec<usize> = other.stages.iter().map(|s| s.replicas).collect();
            let expected = BY_SHAPE.with(|m| m.borrow()[&shape]);
            assert!(
                (other.objective - expected).abs() <= 1e-12 * expected,
                "case {case} {shape:?}"
            );
        }
        // Every shape with no more stages than modules has a plan: 2^(w-1) shapes less the chosen.
        let shapes = (0..1u32 << (workers - 1))
            .filter(|c| (c.count_ones() as usize) < modules)
            .count();
        assert_eq!(others.len(), shapes - 1, "case {case}");
    }
}
