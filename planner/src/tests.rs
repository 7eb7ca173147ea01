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

/// The best time over every split and replica assignment.
fn brute_force(model: &CostModel, workers: usize, straight: bool) -> Option<f64> {
    let n = model.len();
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
                fits &= model.fits(range, r, workers - worker);
                time = time.max(model.stage_time(range, &(worker..worker + r)));
                if s + 1 < stages.len() {
                    time = time.max(model.boundary_time(range.end - 1, worker + r));
                }
                worker += r;
            }
            if fits && best.is_none_or(|b| time < b) {
                best = Some(time);
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
        let network = if case % 2 == 0 {
            Network::flat(workers, 1e9)
        } else {
            Network {
                levels: vec![(2, 1e10), (workers, 1e8)],
            }
        };
        let memory = (case % 3 == 0).then(|| 3e8 + 3e8 * rng.next());
        let model = CostModel::new(&layers, network, memory);
        for straight in [false, true] {
            let expected = brute_force(&model, workers, straight);
            match plan(&model, workers, straight) {
                Ok(p) => {
                    let e = expected.expect("brute force finds a plan too");
                    assert!(
                        (p.time_per_minibatch - e).abs() <= 1e-12 * e.max(1.0),
                        "case {case}: {} vs {e}",
                        p.time_per_minibatch
                    );
                    assert_eq!(p.stages.iter().map(|s| s.replicas).sum::<usize>(), workers);
                    assert_eq!(p.stages.last().unwrap().modules.end, modules);
                    checked += 1;
                }
                Err(PlanError::TooFewModules { .. }) => assert!(straight && modules < workers),
                Err(PlanError::NothingFits { .. }) => assert_eq!(expected, None, "case {case}"),
                Err(e) => panic!("case {case}: {e}"),
            }
        }
    }
    assert!(checked > 300, "only {checked} plans compared");
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
