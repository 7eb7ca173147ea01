//! The replicas' gradient all-reduce started during the backward pass (`--overlap-reduce on`,
//! DDP's buckets) trains exactly as the same all-reduce after the backward, for any bucket size,
//! and really starts buckets before the backward ends.
//!
//! What is promised, and so asserted bit for bit: with the same `--bucket-mb` both ways run the
//! same collectives (same buckets, same order) on the same flat buffers, and c10d's sums are
//! deterministic, so any number of replicas gets identical parameters. Across bucket sizes the
//! buffers differ, which can change the order Gloo adds the replicas' contributions to an element;
//! with two replicas there is only one sum, a + b, and IEEE addition is commutative, so two
//! replicas also agree bit for bit across bucket sizes. (With more replicas the order is the
//! algorithm's, a difference of at most (replicas - 1) roundings of the sum.)

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use crate::util::{read_params, run_ranks_ok, words, Run};

const LIMIT: Duration = Duration::from_secs(180);

/// The MLP: its layers' weights are 48 KiB and 16 KiB, its head's 2.5 KiB.
pub(crate) const MLP: &str = "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --threads 1 \
                   --seed 3 --iterations 4 --lr 0.05";

/// A convolutional model with batch norm, small images: 25.6M parameters in 161 tensors.
const RESNET: &str = "--model resnet50 --image-size 32 --num-classes 10 --batch-size 8 --threads 1 \
                      --seed 1 --iterations 2 --lr 0.01";

/// Runs `world` ranks of `base` plus `extra`, saving parameters under `dir`; all must succeed.
fn train(world: usize, base: &str, extra: &[&str], dir: &Path) -> Vec<Run> {
    let mut args = words(base);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--save-params", dir.to_str().unwrap()]);
    run_ranks_ok(world, &args, LIMIT, &format!("{extra:?}"))
}

/// Losses of every rank that knows them, per iteration, as their bits.
fn loss_bits(runs: &[Run]) -> Vec<Vec<u64>> {
    runs.iter()
        .map(|r| {
            r.iterations()
                .iter()
                .filter_map(|i| i.loss)
                .map(f64::to_bits)
                .collect()
        })
        .collect()
}

/// Every rank's saved parameters and buffers (batch norm's running statistics differ between
/// replicas) in `ours` equal those in `theirs`, bit for bit.
fn assert_identical(what: &str, ours: &Path, theirs: &Path) {
    let mut files: Vec<_> = std::fs::read_dir(theirs)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{what}");
    for file in files {
        let load = |dir: &Path| -> BTreeMap<String, tch::Tensor> {
            tch::Tensor::read_safetensors(dir.join(&file))
                .unwrap()
                .into_iter()
                .collect()
        };
        let (ours, theirs) = (load(ours), load(theirs));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{what}: {file:?}"
        );
        for (name, tensor) in &ours {
            assert!(
                tensor.equal(&theirs[name]),
                "{what}: {file:?}: {name} differs by {}",
                (tensor - &theirs[name]).abs().max().double_value(&[])
            );
        }
    }
}

/// Trains `base` on `world` ranks after the backward (25 MiB buckets) and then overlapped with
/// each of `buckets` (MiB) plus once more after the backward with the smallest, and asserts every
/// run ends with the reference's parameters and losses, bit for bit.
pub(crate) fn overlap_matches_after_backward(
    what: &str,
    world: usize,
    base: &str,
    split: &[&str],
    buckets: &[&str],
) {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("after");
    let off = [split, &["--overlap-reduce", "off"]].concat();
    let expected = loss_bits(&train(world, base, &off, &reference));
    assert!(
        !expected.iter().all(Vec::is_empty),
        "{what}: some rank reports losses"
    );
    let mut variants: Vec<(String, Vec<&str>)> = buckets
        .iter()
        .map(|mb| {
            (
                format!("{what}, overlapped, {mb} MiB buckets"),
                [split, &["--overlap-reduce", "on", "--bucket-mb", mb]].concat(),
            )
        })
        .collect();
    variants.push((
        format!("{what}, after the backward, {} MiB buckets", buckets[0]),
        [split, &["--overlap-reduce", "off", "--bucket-mb", buckets[0]]].concat(),
    ));
    for (i, (name, extra)) in variants.iter().enumerate() {
        let dir = tmp.path().join(i.to_string());
        let runs = train(world, base, extra, &dir);
        assert_eq!(loss_bits(&runs), expected, "{name}: losses");
        assert_identical(name, &dir, &reference);
    }
}

#[test]
fn an_overlapped_all_reduce_trains_an_mlp_as_one_after_the_backward() {
    // 0.01 MiB is smaller than every weight but the head's: buckets of one tensor each.
    let buckets = ["0.01", "0.05", "25"];
    let dp = ["--schedule", "gpipe", "--microbatches", "4"];
    overlap_matches_after_backward("mlp, 2 replicas, gpipe", 2, MLP, &dp, &buckets);
    // PipeDream steps after every backward and averages the replicas in each bucket.
    let pipedream = ["--schedule", "pipedream", "--microbatches", "4"];
    overlap_matches_after_backward("mlp, 2 replicas, pipedream", 2, MLP, &pipedream, &buckets[..1]);
    // A hybrid: the first stage replicated, the second alone, 1F1B.
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("2-1.json");
    std::fs::write(
        &config,
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1], "1": [2]}}"#,
    )
    .unwrap();
    let hybrid = [
        "--stage-config",
        config.to_str().unwrap(),
        "--schedule",
        "1f1b",
        "--microbatches",
        "4",
    ];
    overlap_matches_after_backward("mlp, stage 0 on 2 replicas, 1f1b", 3, MLP, &hybrid, &buckets[..1]);
}

#[test]
fn an_overlapped_all_reduce_trains_a_resnet_as_one_after_the_backward() {
    // 0.1 MiB is smaller than most of resnet50's convolutions (the largest is 9 MiB).
    let dp = ["--schedule", "1f1b", "--microbatches", "2"];
    overlap_matches_after_backward("resnet50, 2 replicas", 2, RESNET, &dp, &["0.1", "25"]);
}

#[test]
fn buckets_start_before_the_backward_ends_only_when_overlapped() {
    let tmp = tempfile::tempdir().unwrap();
    // 16 bytes is below every tensor: one bucket per parameter tensor.
    let dp = [
        "--schedule",
        "gpipe",
        "--microbatches",
        "2",
        "--bucket-mb",
        "0.00001526",
    ];
    let on_args = [&dp[..], &["--overlap-reduce", "on"]].concat();
    let on = train(2, MLP, &on_args, &tmp.path().join("on"));
    // On CPUs the default is off.
    let off_args = &dp[..];
    let off = train(2, MLP, off_args, &tmp.path().join("off"));
    let tensors = read_params(&tmp.path().join("on")).len() as u64;
    assert!(
        tensors >= 10,
        "mlp --layers 4 has a weight and a bias per layer and head"
    );
    for run in &on {
        assert!(run.start().config.overlap_reduce);
        for it in run.iterations() {
            let r = &it.reduce;
            assert_eq!(r.buckets, tensors, "one bucket per tensor: {it:?}");
            assert_eq!(
                r.buckets_early, r.buckets,
                "every gradient comes from the backward: {it:?}"
            );
            assert!(
                r.overlap_s > 0.0,
                "the first bucket started before the backward ended: {it:?}"
            );
            assert!(r.wait_s > 0.0 && r.wait_s <= it.comm_wait_s + 1e-9, "{it:?}");
        }
    }
    for run in &off {
        let config = &run.start().config;
        assert!(!config.overlap_reduce);
        assert!(
            (config.bucket_mb - 0.00001526).abs() <= 1.0 / (1 << 20) as f64,
            "{config:?}"
        );
        for it in run.iterations() {
            let r = &it.reduce;
            assert_eq!(
                (r.buckets, r.buckets_early, r.overlap_s),
                (tensors, 0, 0.0),
                "{it:?}"
            );
            assert!(r.wait_s > 0.0, "{it:?}");
        }
    }
    // A single process has no replicas and no all-reduce.
    let single = train(1, MLP, &[], &tmp.path().join("single"));
    for it in single[0].iterations() {
        assert_eq!(it.reduce, Default::default(), "{it:?}");
    }
}

/// Replicas whose convolution weights are channels_last all-reduce gradients in that layout (each
/// a view into its bucket with its weight's strides, which the fused optimizer step requires of
/// it) and train as one process does in that layout, bit for bit: each replica runs one of the
/// minibatch's two microbatches as the process runs it, and the all-reduce's one sum, a + b, is the
/// process's accumulation of the two gradients (IEEE addition commutes). resnet50 at this learning
/// rate turns any difference into a large one: the default layout's float32 rounding alone moves
/// its second loss by 2%. Batch norm's running statistics differ (each replica sees its own
/// microbatch), so the losses are compared, not the saved buffers.
#[test]
fn channels_last_replicas_train_as_one_channels_last_process() {
    let tmp = tempfile::tempdir().unwrap();
    let args = ["--schedule", "gpipe", "--microbatches", "2", "--channels-last"];
    let single = loss_bits(&train(1, RESNET, &args, &tmp.path().join("single")));
    assert_eq!(single[0].len(), 2, "{single:?}");
    let replicas = train(2, RESNET, &args, &tmp.path().join("replicas"));
    for (rank, run) in replicas.iter().enumerate() {
        assert!(run.start().config.channels_last);
        assert_eq!(loss_bits(std::slice::from_ref(run)), single, "replica {rank}");
    }
}
