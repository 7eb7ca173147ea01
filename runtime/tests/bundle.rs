//! Bundle-style hybrids (the stage config's `bundles`): a replicated stage reduces its gradients
//! to each bundle's master, the masters all-reduce, and send the sum back.
//!
//! What is promised, and so asserted:
//! - Bundles with one rank of a stage each make the masters every replica: the same all-reduce
//!   over the same ranks as without bundles, so the parameters are the same bit for bit.
//! - Shape 4,2 (two bundles of two fronts and a rear) sums the same four gradients as the flat
//!   all-reduce in another order. Float32 sums of the same terms in two orders differ by a few
//!   ulps of the sum of their magnitudes (about 1e-7 relative); through two SGD steps at lr 0.05
//!   that moves a parameter by well under 1e-6, while a gradient lost or counted twice moves it by
//!   lr x |gradient| (about 1e-3 here). Parameters must agree within 1e-5.
//! - The bytes each rank reports sending for the reduce are the bundle's: a member sends its
//!   gradients once; a master sends the sum to each member plus its share of the masters' ring.

use std::path::Path;
use std::time::Duration;

use crate::util::{rank_params, refused, run_ranks_ok, words, Run};

const LIMIT: Duration = Duration::from_secs(180);

const MLP: &str = "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 24 --threads 1 \
                   --seed 5 --lr 0.05 --optimizer sgd --iterations 2";

/// Runs `world` ranks with the stage config `json`, saving parameters under `dir`.
fn train(world: usize, json: &str, extra: &[&str], dir: &Path) -> Vec<Run> {
    std::fs::create_dir_all(dir).unwrap();
    let config = dir.join("stages.json");
    std::fs::write(&config, json).unwrap();
    let params = dir.join("params");
    let mut args = words(MLP);
    args.extend_from_slice(&["--stage-config", config.to_str().unwrap()]);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--save-params", params.to_str().unwrap()]);
    run_ranks_ok(world, &args, LIMIT, json)
}

/// The largest difference between two runs' parameters, over every rank.
fn largest_difference(a: &Path, b: &Path, world: usize) -> f64 {
    let mut largest = 0f64;
    for rank in 0..world {
        let (x, y) = (
            rank_params(&a.join("params"), rank),
            rank_params(&b.join("params"), rank),
        );
        assert_eq!(
            x.keys().collect::<Vec<_>>(),
            y.keys().collect::<Vec<_>>(),
            "rank {rank}"
        );
        for (name, t) in &x {
            let d = (t - &y[name]).abs().max().double_value(&[]);
            largest = largest.max(d);
        }
    }
    largest
}

const TWO_BY_TWO: &str =
    r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1], "1": [2,3]}"#;
const FOUR_TWO: &str =
    r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1,2,3], "1": [4,5]}"#;

#[test]
fn bundles_of_one_rank_per_stage_are_the_all_reduce() {
    let tmp = tempfile::tempdir().unwrap();
    let (flat, bundled) = (tmp.path().join("flat"), tmp.path().join("bundled"));
    train(4, &format!("{TWO_BY_TWO}}}"), &[], &flat);
    train(
        4,
        &format!(r#"{TWO_BY_TWO}, "bundles": [[0,2],[1,3]]}}"#),
        &[],
        &bundled,
    );
    for rank in 0..4 {
        let (a, b) = (
            rank_params(&flat.join("params"), rank),
            rank_params(&bundled.join("params"), rank),
        );
        for (name, t) in &a {
            assert!(
                t.equal(&b[name]),
                "rank {rank}: {name} differs from the flat all-reduce"
            );
        }
    }
}

#[test]
fn a_4_2_bundle_trains_as_the_flat_all_reduce_and_sends_what_bundles_send() {
    let tmp = tempfile::tempdir().unwrap();
    let (flat, bundled) = (tmp.path().join("flat"), tmp.path().join("bundled"));
    let microbatches = ["--microbatches", "4"];
    let flat_runs = train(6, &format!("{FOUR_TWO}}}"), &microbatches, &flat);
    let runs = train(
        6,
        &format!(r#"{FOUR_TWO}, "bundles": [[0,2,4],[1,3,5]]}}"#),
        &microbatches,
        &bundled,
    );
    let difference = largest_difference(&flat, &bundled, 6);
    assert!(
        difference <= 1e-5,
        "bundled parameters differ from the flat all-reduce's by {difference}"
    );
    // The first iteration's losses come before any reduce: the same bits.
    let first = |runs: &[Run]| runs[4].iterations()[0].loss.unwrap().to_bits();
    assert_eq!(first(&flat_runs), first(&runs));
    let bytes = |runs: &[Run], rank: usize| runs[rank].start().stage_params * 4;
    for (rank, run) in runs.iter().enumerate() {
        let g = bytes(&runs, rank);
        let expected = match rank {
            // Masters of stage 0: the sum to their one member, and half the ring of two masters.
            0 | 1 => g + g,
            // Members of stage 0: their gradients, once.
            2 | 3 => g,
            // Stage 1: alone in their bundles, masters of a ring of two.
            _ => g,
        };
        for it in run.iterations() {
            assert_eq!(
                it.reduce.sent_bytes, expected,
                "rank {rank} iteration {}",
                it.iteration
            );
        }
        // Flat: every rank's share of a ring all-reduce of its stage's replicas.
        let replicas = if rank < 4 { 4 } else { 2 };
        let flat_sent = flat_runs[rank].iterations()[0].reduce.sent_bytes;
        assert_eq!(flat_sent, 2 * (replicas - 1) * g / replicas, "flat rank {rank}");
    }
}

#[test]
fn bundles_that_cross_or_meet_a_partial_reduce_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (format!(r#"{FOUR_TWO}, "bundles": [[0,1,4],[2,3,5]]}}"#), "6", "from rank 1 (stage 0, bundle 0) to rank 5"),
        (
            r#"{"module_to_stage_map": [0,0,0,0,0,0], "stage_to_rank_map": {"0": [0,1,2,3]}, "bundles": [[0,1],[2,3]]}"#
                .to_string(),
            "4",
            "two ways of grouping replicas",
        ),
    ];
    for (i, (json, world, expected)) in cases.iter().enumerate() {
        let config = tmp.path().join(format!("{i}.json"));
        std::fs::write(&config, json).unwrap();
        let mut args = words(MLP);
        let config = config.to_str().unwrap();
        args.extend_from_slice(&["--stage-config", config, "--world-size", world, "--rank", "0"]);
        args.extend_from_slice(&["--reduce", "partial:2", "--check"]);
        let all = refused(&args);
        assert!(all.contains(expected), "{json}: {all}");
    }
}
