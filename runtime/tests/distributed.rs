//! Several ranks as local processes over gloo on loopback: every schedule and split trains the
//! same model as one process does, PipeDream stashes weights, and failures end every rank.

use std::path::Path;
use std::time::{Duration, Instant};

use stagehand_contract::Event;

use crate::util::{
    free_port, read_params, run_ok, run_ranks, run_ranks_each, runtime, trace_events, trace_steps,
    two_stages, words, write_image_folder, Run,
};

pub(crate) const LIMIT: Duration = Duration::from_secs(120);

/// A small MLP (modules layers.0..3, head, loss), without --iterations and --lr.
const MLP_BASE: &str =
    "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --threads 1 --seed 3";

/// The MLP for 5 iterations at lr 0.05: the synthetic data cycles through a pool of 4 batches,
/// so the fifth iteration sees the first one's batch again and their losses show learning.
pub(crate) const MLP: &str = "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --threads 1 --seed 3 --iterations 5 --lr 0.05";

pub(crate) fn write(dir: &Path, name: &str, json: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, json).unwrap();
    path.to_str().unwrap().to_string()
}

pub(crate) fn args<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

/// Losses the last stage reported, per iteration (every replica of it reports the same).
fn last_stage_losses(runs: &[Run]) -> Vec<f64> {
    for (rank, run) in runs.iter().enumerate() {
        assert!(
            run.output.status.success(),
            "rank {rank} failed:\n{}",
            run.stderr()
        );
    }
    let last = runs.iter().max_by_key(|r| r.start().stage).unwrap();
    last.losses()
}

/// Top-1 and top-5 accuracies of a split run against one process's, per iteration, from the
/// last stage's every rank (GPipe and 1F1B: each reports the whole minibatch's). Each is a share
/// of the minibatch's 16 samples taken from logits that match one process's to float32 rounding;
/// a sample whose target's logit is within rounding of the one it must beat may go either way,
/// so one sample's share, 1/16, is allowed and no more. Summing the replicas' shares without
/// dividing, or dividing by the wrong count, scales the whole figure instead.
fn assert_accuracies(what: &str, runs: &[Run], reference: &Reference) {
    let last = runs.iter().map(|r| r.start().stage).max().unwrap();
    for run in runs.iter().filter(|r| r.start().stage == last) {
        for (k, ours, theirs) in [
            (1, run.accuracies(), &reference.accuracies),
            (
                5,
                run.top5_accuracies(),
                &reference.top5.iter().flatten().copied().collect(),
            ),
        ] {
            assert_eq!(ours.len(), theirs.len(), "{what}");
            for (a, b) in ours.iter().zip(theirs) {
                assert!(
                    (a - b).abs() <= 1.0 / 16.0 + 1e-12,
                    "{what}: top-{k} accuracies {ours:?} vs {theirs:?}"
                );
            }
        }
    }
    for run in runs.iter().filter(|r| r.start().stage != last) {
        assert!(
            run.iterations()
                .iter()
                .all(|i| i.accuracy.is_none() && i.accuracy_top5.is_none()),
            "{what}: only the last stage knows the accuracy"
        );
    }
}

/// Losses of a split run against one process's. Each loss is a mean over the minibatch that
/// the split computes as a sum of microbatch means, in another order: float32 rounding (about
/// 1e-7 relative per operation) moves it far less than the 1e-4 relative allowed here, while a
/// lost, doubled or misrouted microbatch moves it by a whole microbatch's share.
pub(crate) fn assert_close(what: &str, ours: &[f64], reference: &[f64]) {
    assert_eq!(ours.len(), reference.len(), "{what}");
    for (a, b) in ours.iter().zip(reference) {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs().max(1e-3),
            "{what}: {ours:?} vs {reference:?}"
        );
    }
}

/// One process with the whole model: the reference every split must reproduce.
struct Reference {
    losses: Vec<f64>,
    accuracies: Vec<f64>,
    /// Top-5 accuracies, of a model with class logits.
    top5: Vec<Option<f64>>,
    /// `--save-params` of the same arguments with no iteration run.
    initial: std::path::PathBuf,
    /// `--save-params` after training.
    trained: std::path::PathBuf,
}

/// Trains `base` (which has `--iterations`) in one process, keeping its parameters before and
/// after training under `dir`.
fn reference(base: &[&str], dir: &Path) -> Reference {
    let initial = dir.join("initial");
    let trained = dir.join("trained");
    let untrained = with_value(base, "--iterations", "0");
    run_ok(&args(&untrained, &["--save-params", initial.to_str().unwrap()]));
    let run = run_ok(&args(base, &["--save-params", trained.to_str().unwrap()]));
    Reference {
        losses: run.losses(),
        accuracies: run.accuracies(),
        top5: run.iterations().iter().map(|i| i.accuracy_top5).collect(),
        initial,
        trained,
    }
}

/// `base` with `flag`'s value replaced.
pub(crate) fn with_value<'a>(base: &[&'a str], flag: &str, value: &'a str) -> Vec<&'a str> {
    let mut out = base.to_vec();
    let at = out.iter().position(|w| *w == flag).expect("the flag is there");
    out[at + 1] = value;
    out
}

/// Parameters a split trained against the ones one process trained from the same start.
///
/// Both apply the same SGD updates to the same initial parameters; only the order in which
/// microbatch and replica gradients are summed differs. In float32 that changes each gradient by
/// a few units of roundoff (u = 2^-24) relative to the magnitudes summed, times the at most 64
/// terms of these small models' reductions: a few 1e-6. Over a handful of small steps the
/// difference that feeds back through the model stays a small multiple of that. So per tensor
///
///   ‖ours − theirs‖ ≤ 1e-3 · (‖theirs − initial‖ + rms · √n) + 8u · ‖theirs‖
///
/// where `rms` is the root-mean-square update of one element over the whole model and n the
/// tensor's elements. The first term covers tensors with real gradients, two orders of magnitude
/// above rounding on any x86-64 CPU's kernels; the second covers gradients that are zero in exact
/// arithmetic (an attention key's bias: softmax ignores a constant added to every key), which
/// come out as rounding noise whose size is set by the terms summed, i.e. by the model's other
/// gradients; the third is the rounding of the parameters themselves. A pipeline mistake (a
/// dropped, doubled or stale microbatch) changes real updates by a microbatch's share, 1/4 here,
/// far beyond this.
/// (Adam would not do here: it divides each gradient by its own running magnitude, so elements
/// whose gradient is at rounding level get updates of the order of the learning rate either way.)
fn assert_same_params(what: &str, dir: &Path, reference: &Reference) {
    let ours = read_params(dir);
    let theirs = read_params(&reference.trained);
    let initial = read_params(&reference.initial);
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "{what}"
    );
    const U: f64 = 1.0 / (1u64 << 24) as f64;
    let norm = |t: &tch::Tensor| t.to_kind(tch::Kind::Double).norm().double_value(&[]);
    let (mut squares, mut elements) = (0.0, 0.0);
    for (name, t) in &theirs {
        squares += norm(&(t - &initial[name])).powi(2);
        elements += t.numel() as f64;
    }
    let rms = (squares / elements).sqrt();
    for (name, tensor) in &ours {
        let theirs = &theirs[name];
        let difference = norm(&(tensor - theirs));
        let update = norm(&(theirs - &initial[name]));
        let bound = 1e-3 * (update + rms * (tensor.numel() as f64).sqrt()) + 8.0 * U * norm(theirs);
        assert!(
            difference <= bound,
            "{what}: parameter {name} differs by {difference:e} (allowed {bound:e}; its update was {update:e})"
        );
    }
}

#[test]
fn gpipe_and_1f1b_match_single_process_training_for_every_split() {
    let tmp = tempfile::tempdir().unwrap();
    let single = reference(&words(MLP), &tmp.path().join("single"));
    let expected = &single.losses;
    assert!(
        expected[4] < expected[0],
        "the reference learns (iterations 0 and 4 see the same batch): {expected:?}"
    );
    // Two samples' share or more somewhere, so an accuracy scaled by 2 or more shows.
    assert!(
        single.accuracies.iter().any(|&a| a >= 2.0 / 16.0),
        "the reference classifies some samples: {:?}",
        single.accuracies
    );

    let two = two_stages(tmp.path());
    let three = write(
        tmp.path(),
        "three.json",
        r#"{"module_to_stage_map": [0,0,1,1,2,2], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2]}}"#,
    );
    let first_replicated = write(
        tmp.path(),
        "2-1.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1], "1": [2]}}"#,
    );
    let last_replicated = write(
        tmp.path(),
        "1-2.json",
        r#"{"module_to_stage_map": [0,0,0,0,1,1], "stage_to_rank_map": {"0": [0], "1": [1,2]}}"#,
    );
    // Four microbatches on three replicas: each iteration's owners differ from a global
    // round-robin, so a rank that followed the global numbering would wait forever.
    let uneven_replicas = write(
        tmp.path(),
        "3-1.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1,2], "1": [3]}}"#,
    );
    let splits: Vec<(&str, usize, Vec<&str>)> = vec![
        ("2 stages", 2, vec!["--stage-config", &two]),
        ("3 stages", 3, vec!["--stage-config", &three]),
        (
            "stage 0 on 2 replicas",
            3,
            vec!["--stage-config", &first_replicated],
        ),
        (
            "stage 1 on 2 replicas",
            3,
            vec!["--stage-config", &last_replicated],
        ),
        (
            "stage 0 on 3 replicas, 4 microbatches",
            4,
            vec!["--stage-config", &uneven_replicas],
        ),
        ("data parallel on 2 ranks", 2, vec![]),
    ];
    // The messages between stages on one group per direction over every rank (Gloo's default),
    // and, for 1F1B, on a group per pair of neighbouring ranks and direction (NCCL's).
    let modes = [("gpipe", "world"), ("1f1b", "world"), ("1f1b", "pairs")];
    for (name, world, split) in &splits {
        for (schedule, groups) in modes {
            let what = format!("{name}, {schedule}, {groups} groups");
            let params = tmp.path().join(what.replace([' ', ','], "_"));
            let extra = [
                &split[..],
                &[
                    "--schedule",
                    schedule,
                    "--p2p-groups",
                    groups,
                    "--microbatches",
                    "4",
                    "--save-params",
                    params.to_str().unwrap(),
                ],
            ]
            .concat();
            let runs = run_ranks(*world, &args(&words(MLP), &extra), LIMIT);
            for run in &runs {
                assert_eq!(run.start().config.p2p_groups.as_deref(), Some(groups), "{what}");
            }
            assert_close(&what, &last_stage_losses(&runs), expected);
            assert_accuracies(&what, &runs, &single);
            assert_same_params(&what, &params, &single);
            assert_time_accounted(&what, &runs, 5);
        }
    }
}

/// Replicas of the first stage on an image folder decode only their own microbatches' rows, yet
/// train as one process on the whole minibatches does: with the replicas of pure data
/// parallelism, and with three replicas taking four microbatches (one of them two) before a
/// second stage. A replica that got another's rows, or rows left undecoded, would train on other
/// images or on zeros and move the losses by a microbatch's share.
#[test]
fn replicas_on_an_image_folder_decode_their_own_rows_and_train_as_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    write_image_folder(&images, 4, 5);
    let data = [
        "--data",
        images.to_str().unwrap(),
        "--data-workers",
        "2",
        "--microbatches",
        "4",
    ];
    let base = args(&words(MLP), &data);
    let single = reference(&base, &tmp.path().join("single"));
    let three = write(
        tmp.path(),
        "3-1.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1,2], "1": [3]}}"#,
    );
    for (what, world, split) in [
        ("data parallel on 2 ranks", 2, vec![]),
        (
            "stage 0 on 3 replicas, 4 microbatches",
            4,
            vec!["--stage-config", three.as_str()],
        ),
    ] {
        let params = tmp.path().join(what.replace([' ', ','], "_"));
        let extra = [&split[..], &["--save-params", params.to_str().unwrap()]].concat();
        let runs = run_ranks(world, &args(&base, &extra), LIMIT);
        assert_close(what, &last_stage_losses(&runs), &single.losses);
        assert_same_params(what, &params, &single);
    }
}

/// Every rank reports every iteration, and where its time went agrees with the split. Compute
/// and communication are timed separately, in spans inside the iteration's wall-clock span, so
/// together they fit in it (booking something twice, or booking time that did not pass, breaks
/// that); only the replicas of a stage all-reduce gradients, and the all-reduce's exposed wait is
/// a part of the communication wait. (Idle is the rest, by definition, so it has nothing of its
/// own to check.)
fn assert_time_accounted(what: &str, runs: &[Run], iterations: usize) {
    // Sums of a few float seconds, each rounded from whole nanoseconds.
    const ROUNDING: f64 = 1e-9;
    let replicas = |stage: usize| runs.iter().filter(|r| r.start().stage == stage).count();
    for run in runs {
        let stage = run.start().stage;
        let reports = run.iterations();
        assert_eq!(reports.len(), iterations, "{what}");
        for it in reports {
            assert!(it.compute_s > 0.0 && it.comm_wait_s >= 0.0, "{what}: {it:?}");
            assert!(
                it.compute_s + it.comm_wait_s <= it.time_s + ROUNDING,
                "{what}: compute and communication take more than the iteration: {it:?}"
            );
            if replicas(stage) > 1 {
                assert!(
                    it.reduce.buckets > 0,
                    "{what}: stage {stage}'s replicas all-reduce: {it:?}"
                );
                assert!(
                    it.reduce.wait_s <= it.comm_wait_s + ROUNDING
                        && it.reduce.overlap_s <= it.compute_s + ROUNDING,
                    "{what}: the all-reduce's wait is communication, its overlap compute: {it:?}"
                );
            } else {
                assert_eq!(
                    it.reduce,
                    Default::default(),
                    "{what}: stage {stage} has one rank"
                );
            }
        }
    }
}

#[test]
fn a_transformer_pipeline_learns_its_boundary_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let base = [
        "--model",
        "transformer",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--seq-len",
        "8",
        "--vocab-size",
        "50",
        "--dropout",
        "0",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--batch-size",
        "8",
        "--iterations",
        "3",
        "--threads",
        "1",
    ];
    let single = reference(&base, &tmp.path().join("single"));
    // embeddings | encoder.layer.0, encoder.layer.1 | cls, loss: activations [2, 8, 32] and token targets [2, 8].
    let config = write(
        tmp.path(),
        "t.json",
        r#"{"module_to_stage_map": [0,1,1,2,2], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2]}}"#,
    );
    let params = tmp.path().join("pipe");
    let extra = [
        "--stage-config",
        config.as_str(),
        "--schedule",
        "gpipe",
        "--microbatches",
        "4",
        "--save-params",
        params.to_str().unwrap(),
    ];
    let runs = run_ranks(3, &args(&base, &extra), LIMIT);
    assert_close("transformer", &last_stage_losses(&runs), &single.losses);
    assert_same_params("transformer", &params, &single);
}

#[test]
fn pipedream_with_one_microbatch_in_flight_is_synchronous_training() {
    let tmp = tempfile::tempdir().unwrap();
    let sync = args(&words(MLP), &["--schedule", "pipedream", "--microbatches", "4"]);
    let single = reference(&sync, &tmp.path().join("single"));
    let config = write(
        tmp.path(),
        "depth1.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}, "stage_to_depth_map": {"0": 1, "1": 1}}"#,
    );
    let params = tmp.path().join("pipe");
    let extra = [
        "--stage-config",
        config.as_str(),
        "--schedule",
        "pipedream",
        "--microbatches",
        "4",
        "--save-params",
        params.to_str().unwrap(),
    ];
    let runs = run_ranks(2, &args(&words(MLP), &extra), LIMIT);
    assert_close("pipedream depth 1", &last_stage_losses(&runs), &single.losses);
    assert_accuracies("pipedream depth 1", &runs, &single);
    assert_same_params("pipedream depth 1", &params, &single);
}

#[test]
fn pipedream_backward_uses_the_weights_its_forward_used() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_stages(tmp.path());
    let extra = [
        "--stage-config",
        config.as_str(),
        "--schedule",
        "pipedream",
        "--microbatches",
        "4",
        "--trace",
        "--iterations",
        "8",
        "--lr",
        "0.01",
    ];
    let runs = run_ranks(2, &args(&words(MLP_BASE), &extra), LIMIT);
    let losses = last_stage_losses(&runs);
    // Two passes over the pool of 4 batches: the second's mean loss is lower.
    let pass = |i: usize| losses[4 * i..4 * i + 4].iter().sum::<f64>();
    assert!(pass(1) < pass(0), "pipedream learns: {losses:?}");
    // The same run on a group per pair of ranks and direction: the same arithmetic in the same
    // order, so the same losses bit for bit.
    let pairs = run_ranks(
        2,
        &args(
            &words(MLP_BASE),
            &[&extra[..], &["--p2p-groups", "pairs"]].concat(),
        ),
        LIMIT,
    );
    assert_eq!(last_stage_losses(&pairs), losses, "pipedream on pair groups");
    let traces: Vec<_> = runs[0]
        .events
        .iter()
        .filter_map(|e| {
            if let Event::Trace(t) = e {
                Some(t.clone())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(traces.len(), 32, "one trace per microbatch of stage 0");
    let stepped_between = traces
        .iter()
        .filter(|t| t.steps_at_backward > t.forward_version)
        .count();
    assert!(
        stepped_between > 0,
        "stage 0 has several microbatches in flight, so it steps between forward and backward"
    );
    for t in &traces {
        assert_eq!(
            t.forward_checksum, t.backward_checksum,
            "microbatch {} ran backward on other weights",
            t.microbatch
        );
    }
}

#[test]
fn an_inconsistent_stage_config_is_rejected_before_rendezvous() {
    let tmp = tempfile::tempdir().unwrap();
    let config = write(
        tmp.path(),
        "bad.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [0]}}"#,
    );
    let started = Instant::now();
    let port = free_port().to_string();
    let out = runtime()
        .args(words(MLP))
        .args([
            "--stage-config",
            &config,
            "--world-size",
            "2",
            "--rank",
            "1",
            "--master-port",
            &port,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 0 appears in both stage 0 and stage 1"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "no waiting for peers"
    );
}

#[test]
fn a_missing_peer_fails_the_rendezvous_within_the_timeout() {
    let port = free_port().to_string();
    let started = Instant::now();
    let out = runtime()
        .args(words(MLP))
        .args([
            "--world-size",
            "2",
            "--rank",
            "1",
            "--master-port",
            &port,
            "--comm-timeout",
            "3",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{port}")),
        "names the master: {stderr}"
    );
    // One line says why; c10d's own warnings, each with a C++ stack trace, are not shown.
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn killing_one_rank_ends_the_others_within_the_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_stages(tmp.path());
    let port = free_port().to_string();
    let spawn = |rank: &str| {
        runtime()
            .args(words(MLP_BASE))
            .args([
                "--lr",
                "0.01",
                "--iterations",
                "100000",
                "--stage-config",
                &config,
                "--world-size",
                "2",
                "--rank",
                rank,
            ])
            .args(["--master-port", &port, "--comm-timeout", "10"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = spawn("0");
    let mut second = spawn("1");
    // Let them train a little, then kill rank 1 outright.
    let stdout = second.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let mut seen = 0;
    while seen < 3 {
        let line = lines.next().expect("rank 1 trains").unwrap();
        seen += usize::from(line.contains(r#""event":"iteration""#));
    }
    second.kill().unwrap();
    second.wait().unwrap();
    let killed = Instant::now();
    let status = exit_within(&mut first, killed, Duration::from_secs(30), "after its peer died");
    assert!(!status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut first.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("rank 1"), "names the peer: {stderr}");
    assert!(
        killed.elapsed() < Duration::from_secs(15),
        "took {:?}",
        killed.elapsed()
    );
}

/// Waits for rank 0's process `child` to exit, failing the test if it still runs `limit` after
/// `since` (`after` says what happened then).
fn exit_within(
    child: &mut std::process::Child,
    since: Instant,
    limit: Duration,
    after: &str,
) -> std::process::ExitStatus {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            since.elapsed() < limit,
            "rank 0 still running {:?} {after}",
            since.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs two ranks with `args` (each given its rank and a port), stops rank 1 once it has done
/// three iterations (SIGSTOP: hung, not dead, its sockets open), and returns how rank 0 ended,
/// how long after the stop, and its stderr; rank 0 failing to end within `limit` fails the test.
fn hang_rank_1(args: &[&str], limit: Duration, what: &str) -> (std::process::ExitStatus, Duration, String) {
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let port = free_port().to_string();
    let spawn = |rank: &str| {
        let child = runtime()
            .args(args)
            .args(["--world-size", "2", "--rank", rank, "--master-port", &port])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Reaped(child)
    };
    let mut first = spawn("0");
    let mut second = spawn("1");
    let stdout = second.0.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    let mut seen = 0;
    while seen < 3 {
        let line = lines.next().expect("rank 1 trains").unwrap();
        seen += usize::from(line.contains(r#""event":"iteration""#));
    }
    let pid = second.0.id().to_string();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(stopped.success(), "kill -STOP {pid}");
    let hung = Instant::now();
    let status = exit_within(&mut first.0, hung, limit, &format!("after rank 1 hung ({what})"));
    let took = hung.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut first.0.stderr.take().unwrap(), &mut stderr).unwrap();
    (status, took, stderr)
}

/// A replica that hangs (stopped, not dead: its sockets stay open) ends the other within about one
/// `--comm-timeout`, not one per gradient bucket in flight: the buckets started after the one that
/// timed out fail at once, as Gloo closes its connection to the hung peer at the first timeout.
/// Eleven buckets (0.5 MiB at most, a 1 MiB weight in one of its own): a wait of its own for each
/// would take nearly a minute. Measured on 2 cores: 5.1 s, overlapped or not.
#[test]
fn a_hung_replica_ends_the_others_within_one_timeout_not_one_per_bucket() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("replicas.json");
    std::fs::write(
        &config,
        r#"{"module_to_stage_map": [0,0,0,0,0,0,0,0], "stage_to_rank_map": {"0": [0,1]}}"#,
    )
    .unwrap();
    let base = "--model mlp --layers 6 --hidden 512 --image-size 8 --batch-size 16 --threads 1 --seed 3 \
                --lr 0.01 --iterations 100000 --comm-timeout 5 --bucket-mb 0.5";
    for overlap in ["off", "on"] {
        let args = [
            &words(base)[..],
            &[
                "--stage-config",
                config.to_str().unwrap(),
                "--overlap-reduce",
                overlap,
            ],
        ]
        .concat();
        let what = format!("--overlap-reduce {overlap}");
        let (status, took, stderr) = hang_rank_1(&args, Duration::from_secs(40), &what);
        assert!(!status.success(), "{stderr}");
        // The first bucket waited for says why it failed: the timeout itself, or the closed
        // connection another bucket's timeout left ("application timeout caused pair closure").
        assert!(
            stderr.contains("all_reduce_sum failed") && stderr.contains("(timeout 5s)"),
            "{stderr}"
        );
        // One timeout, plus the time the peer took to stop and a busy machine's slack; one wait per
        // bucket would be 11 timeouts.
        assert!(took < Duration::from_secs(15), "{what}: took {took:?}: {stderr}");
    }
}

/// A pipeline stage that hangs ends the stage before it within about one `--comm-timeout`: its
/// receive times out, and its sends still pending, which a stopped peer never asks for, are let
/// go at once (each was waited for a whole timeout more: 16.1 s with a timeout of 8 s, measured
/// on 2 cores; 8.1 s now).
#[test]
fn a_hung_pipeline_stage_ends_the_one_before_it_within_one_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_stages(tmp.path());
    let pipeline = [
        "--stage-config",
        &config,
        "--schedule",
        "gpipe",
        "--microbatches",
        "8",
    ];
    let rest = ["--lr", "0.01", "--iterations", "100000", "--comm-timeout", "10"];
    let args = [&words(MLP_BASE)[..], &pipeline, &rest].concat();
    let (status, took, stderr) = hang_rank_1(&args, Duration::from_secs(60), "stage 1");
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("with rank 1 failed") && stderr.contains("(timeout 10s)"),
        "{stderr}"
    );
    // One timeout and a busy machine's slack; two timeouts would be 20 s.
    assert!(took < Duration::from_secs(16), "took {took:?}: {stderr}");
}

/// `--slowdown 1=10` on two data-parallel ranks: rank 1's compute is stretched tenfold (each
/// compute span is followed by a sleep of nine times its length, booked as compute), rank 0's is
/// not, and rank 0 waits for rank 1 at every gradient all-reduce.
///
/// Each rank's compute is the wall-clock time of its own work, which other processes on the
/// machine stretch on either rank, so the two ranks are compared with wide margins, over an MLP
/// large enough (about 1.5 ms of compute per iteration) that a few preemptions even out. Measured
/// on a 2-core machine with two busy loops beside the ranks (28 runs with and 28 without): without
/// slowdown the ranks' computes differed by at most 1.9x; with it rank 1's was 6.1x to 19x rank
/// 0's, rank 0 waited 3x to 13x as long as rank 1, and rank 0's wait was 0.8x to 1.6x rank 1's
/// extra compute. The bounds below (3x, more than rank 1, half) sit between those and what a
/// slowdown that did nothing (about 1x, equal waits) or slowed rank 0 (0.1x) gives.
#[test]
fn slowdown_stretches_one_ranks_compute() {
    let base = "--model mlp --layers 4 --hidden 256 --image-size 8 --batch-size 32 --threads 1 --seed 3 --iterations 8 --lr 0.05";
    let extra = ["--slowdown", "1=10", "--microbatches", "2"];
    let runs = run_ranks(2, &args(&words(base), &extra), LIMIT);
    for run in &runs {
        assert!(run.output.status.success(), "{}", run.stderr());
    }
    // Within each rank, deterministically: the stretch was slept, not only booked.
    assert_time_accounted("--slowdown 1=10", &runs, 8);
    // The first iteration, with its allocations, is left out.
    let total = |run: &Run, field: fn(&stagehand_contract::Iteration) -> f64| {
        run.iterations().iter().skip(1).map(|i| field(i)).sum::<f64>()
    };
    let compute = |run: &Run| total(run, |i| i.compute_s);
    let waited = |run: &Run| total(run, |i| i.comm_wait_s);
    let (fast, slow) = (compute(&runs[0]), compute(&runs[1]));
    assert!(
        slow > 3.0 * fast,
        "rank 1 slowed 10x: compute {slow:.4}s vs rank 0's {fast:.4}s"
    );
    // Its data-parallel peer waits for it at every all-reduce, and it hardly waits for its peer.
    let (patient, straggler) = (waited(&runs[0]), waited(&runs[1]));
    assert!(
        patient > straggler && patient > 0.5 * (slow - fast),
        "rank 0 waited {patient:.4}s, rank 1 {straggler:.4}s; rank 1 computed {:.4}s longer",
        slow - fast
    );
}

/// `--profiler-trace` across ranks: `{rank}` gives each rank its own file, and each marks its
/// microbatches' forwards and backwards, its step, and the waits for its peer's messages
/// (`receive`: activations and targets on the last stage, gradients on the first).
#[test]
fn each_rank_traces_its_parts_and_its_waits_for_peers() {
    let tmp = tempfile::tempdir().unwrap();
    let two = two_stages(tmp.path());
    let template = tmp.path().join("rank-{rank}.json");
    let template = template.to_str().unwrap();
    let base = words(
        "--model mlp --batch-size 8 --threads 1 --iterations 3 --warmup 1 --microbatches 2 --schedule 1f1b",
    );
    let extra = ["--stage-config", two.as_str(), "--profiler-trace", template];
    let runs = run_ranks(2, &args(&base, &extra), LIMIT);
    for (rank, run) in runs.iter().enumerate() {
        assert!(run.output.status.success(), "rank {rank}: {}", run.stderr());
        let path = tmp.path().join(format!("rank-{rank}.json"));
        assert_eq!(run.start().config.profiler_trace.as_deref(), Some(path.as_path()));
        let events = trace_events(&path);
        assert_eq!(
            trace_steps(&events),
            ["ProfilerStep#1", "ProfilerStep#2"],
            "rank {rank}"
        );
        let scopes = |name: &str| {
            events
                .iter()
                .filter(|e| e["cat"] == "user_annotation" && e["name"] == name)
                .count()
        };
        // Two traced iterations of two microbatches each.
        assert_eq!(scopes("forward"), 4, "rank {rank}");
        assert_eq!(scopes("backward"), 4, "rank {rank}");
        assert_eq!(scopes("step"), 2, "rank {rank}");
        assert!(
            scopes("receive") >= 4,
            "rank {rank}: {} receives",
            scopes("receive")
        );
    }
}

/// A trace that stops mid-run, with the next iteration's receives already posted and sends still
/// going: no profiler record is left open across the stop. Before the bridge kept c10d's
/// operations out of the profiler, every such run left "gloo:recv" open (PyTorch warned of it
/// from collection.cpp as it wrote the trace), and its end, after the profiler had freed what it
/// pointed into, corrupted the heap: 2 runs in 60 died of "malloc(): ... corrupted" right after
/// writing their trace.
#[test]
fn a_trace_stopped_mid_run_leaves_no_profiler_record_open() {
    let tmp = tempfile::tempdir().unwrap();
    let two = two_stages(tmp.path());
    let template = tmp.path().join("rank-{rank}.json");
    let template = template.to_str().unwrap();
    for schedule in ["gpipe", "1f1b", "pipedream"] {
        let line = format!(
            "--model mlp --batch-size 8 --threads 1 --iterations 6 --warmup 1 --microbatches 2 \
             --schedule {schedule} --profiler-steps 2"
        );
        let base = words(&line);
        let extra = ["--stage-config", two.as_str(), "--profiler-trace", template];
        let runs = run_ranks(2, &args(&base, &extra), LIMIT);
        for (rank, run) in runs.iter().enumerate() {
            let stderr = run.stderr();
            assert!(run.output.status.success(), "{schedule}, rank {rank}: {stderr}");
            assert!(
                !stderr.contains("collection.cpp") && !stderr.contains("gloo:"),
                "{schedule}, rank {rank} left a profiler record open: {stderr}"
            );
            let events = trace_events(&tmp.path().join(format!("rank-{rank}.json")));
            assert_eq!(
                trace_steps(&events),
                ["ProfilerStep#1", "ProfilerStep#2"],
                "{schedule}, rank {rank}"
            );
        }
    }
}

/// Ranks started with different training requests are refused on every rank alike, naming the
/// rank and what differs, before any group forms: a batch size of its own (which rank 1 used to
/// train on without a word, reporting twice the samples) and `--compress auto` on one rank only
/// (whose framed message aborted the other through Gloo). What is a rank's own may differ.
#[test]
fn ranks_given_different_requests_are_refused_alike_and_their_own_settings_may_differ() {
    let dir = tempfile::tempdir().unwrap();
    let config = two_stages(dir.path());
    // MLP_BASE, its batch size and threads as given.
    let base = |batch: &str, threads: &str, extra: &[&str]| -> Vec<String> {
        let mut args = with_value(
            &with_value(&words(MLP_BASE), "--batch-size", batch),
            "--threads",
            threads,
        );
        args.extend(["--iterations", "2", "--stage-config", &config]);
        args.extend(extra);
        args.iter().map(|s| s.to_string()).collect()
    };
    let cases: [(&str, &[&str], &str); 2] = [
        ("32", &[], "--batch-size is 32 there, 16 on rank 0"),
        (
            "16",
            &["--compress", "auto"],
            "--compress is true there, false on rank 0",
        ),
    ];
    for (batch, extra, expected) in cases {
        let runs = run_ranks_each(
            2,
            |rank| match rank {
                0 => base("16", "1", &[]),
                _ => base(batch, "1", extra),
            },
            LIMIT,
        );
        for (rank, run) in runs.iter().enumerate() {
            let stderr = run.stderr();
            assert_eq!(
                run.output.status.code(),
                Some(2),
                "{batch} {extra:?}: rank {rank}: {stderr}"
            );
            assert!(
                stderr.contains("rank 1 was started with another training request than rank 0")
                    && stderr.contains(expected),
                "{extra:?}: rank {rank}: {stderr}"
            );
            assert!(run.events.is_empty(), "{extra:?}: rank {rank} trained: {stderr}");
        }
    }
    // Threads and the slowdown are each rank's own.
    let own = |rank: usize| base("16", if rank == 0 { "1" } else { "2" }, &["--slowdown", "1=1.5"]);
    for (rank, run) in run_ranks_each(2, own, LIMIT).iter().enumerate() {
        assert!(run.output.status.success(), "rank {rank}: {}", run.stderr());
    }
}

/// Two runs given one master port (a port typed twice): with their run ids, a rank of the other
/// run that reaches this run's store first meets none of its keys, so this run trains as if alone
/// (the losses of a run on a port of its own), and the stray rank fails on its own timeout.
/// Without ids both ranks 1 would post the same keys, and the runs would cross.
#[test]
fn a_rank_of_another_run_on_the_same_port_stays_out_of_this_one() {
    let port = free_port().to_string();
    let spawn = |rank: &str, id: &str, timeout: &str| {
        runtime()
            .args(MLP.split_whitespace())
            .args(["--world-size", "2", "--rank", rank, "--master-port", &port])
            .args(["--comm-timeout", timeout, "--run-id", id])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let finish = |child: std::process::Child| {
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let events = stdout.lines().filter_map(Event::parse_line).collect();
        Run { output, events }
    };
    let rank0 = spawn("0", "run-a", "30");
    // The other run's rank 1 reaches the store before this run's.
    std::thread::sleep(Duration::from_millis(700));
    let stray = spawn("1", "run-b", "4");
    std::thread::sleep(Duration::from_millis(700));
    let rank1 = spawn("1", "run-a", "30");
    let (rank0, rank1, stray) = (finish(rank0), finish(rank1), finish(stray));
    for (rank, run) in [(0, &rank0), (1, &rank1)] {
        assert!(run.output.status.success(), "rank {rank}: {}", run.stderr());
    }
    assert!(!stray.output.status.success(), "{}", stray.stderr());
    let alone = run_ranks(2, &words(MLP), LIMIT);
    assert_eq!(rank0.losses(), alone[0].losses(), "as a run on a port of its own");
    assert_eq!(rank0.losses().len(), 5);
}
