//! Partial reduce (`--reduce partial:K`, SD-PIPE's): groups of the first K replicas ready, formed
//! at run time through the store, every `--sync-every`-th group all live replicas.
//!
//! What is promised, and so asserted:
//! - K = the replicas is `--reduce all` bit for bit (every group is every replica, so only the
//!   gradients are all-reduced, with the all-reduce's own buckets on the replicas' group).
//! - With K below the replicas, every group is reported alike by all its members and by them
//!   only, groups are at most K replicas (all live ones at a full group), and a straggler's
//!   peers form groups without it.
//! - The bound of pipeline/partial.rs: a member's distance from its group's mean is at most twice
//!   the sum of the largest per-parameter updates of every step of the groups after the last full
//!   one, its own group's included. The float32 arithmetic of the mean and of the distance adds a few ulps of the
//!   parameters' magnitude (well below 1e-6 for these weights, all below 10 in magnitude).
//! - A replica killed mid-run costs the others at most the liveness timeout: they finish every
//!   iteration without it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use stagehand_contract::{Event, Iteration, PartialGroup};

use crate::util::{free_port, rank_params, refused, run_ranks_ok, runtime, words, Run};

const LIMIT: Duration = Duration::from_secs(180);

/// About a millisecond of compute per step on one thread, so a slowed replica really lags.
const MLP: &str = "--model mlp --layers 4 --hidden 256 --image-size 8 --batch-size 48 --threads 1 \
                   --seed 3 --lr 0.05 --optimizer sgd";

fn train(world: usize, extra: &[&str], dir: &Path) -> Vec<Run> {
    let mut args = words(MLP);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--save-params", dir.to_str().unwrap()]);
    run_ranks_ok(world, &args, LIMIT, &format!("{extra:?}"))
}

/// Every (rank, group) a rank's iterations report.
fn groups_of(rank: usize, iterations: &[&Iteration]) -> Vec<(usize, PartialGroup)> {
    iterations
        .iter()
        .map(|i| {
            let group = i
                .partial_reduce
                .clone()
                .unwrap_or_else(|| panic!("rank {rank} iteration {} reports no group", i.iteration));
            (rank, group)
        })
        .collect()
}

/// Checks the groups every rank reported: each index reported by exactly its members, alike;
/// indices 0.. without gaps; sizes; and the drift bound. Returns the groups by index.
fn check_groups(
    reports: &[(usize, PartialGroup)],
    replicas: usize,
    k: usize,
    sync_every: u64,
) -> BTreeMap<u64, Vec<usize>> {
    let mut by_index: BTreeMap<u64, Vec<&(usize, PartialGroup)>> = BTreeMap::new();
    for report in reports {
        by_index.entry(report.1.index).or_default().push(report);
    }
    let last = *by_index.keys().last().unwrap();
    assert_eq!(
        by_index.len() as u64,
        last + 1,
        "group indices have gaps: {:?}",
        by_index.keys()
    );
    let mut members = BTreeMap::new();
    for (&index, reports) in &by_index {
        let group = &reports[0].1;
        let reporters: BTreeSet<usize> = reports.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            reporters,
            group.members.iter().copied().collect(),
            "group {index}: reported by {reporters:?}, members {:?}",
            group.members
        );
        for (rank, other) in reports {
            assert_eq!(
                other.members, group.members,
                "group {index} as rank {rank} saw it"
            );
            assert_eq!(other.full, group.full, "group {index} as rank {rank} saw it");
        }
        if (index + 1) % sync_every == 0 {
            assert!(group.full, "group {index} is every {sync_every}th, a full one");
        }
        let most = if group.full { replicas } else { k };
        assert!(
            !group.members.is_empty() && group.members.len() <= most,
            "group {index} is {:?}",
            group.members
        );
        members.insert(index, group.members.clone());
    }
    // The bound: the updates of the steps of the groups after the last full one (or from the
    // start), this group's own included.
    let slack = 1e-6;
    let mut since_full = 0.0;
    for (&index, reports) in &by_index {
        since_full += reports.iter().map(|(_, r)| r.update).sum::<f64>();
        for (rank, report) in reports {
            assert!(
                report.drift <= 2.0 * since_full + slack,
                "group {index}: rank {rank} drifted {} from the mean, above twice the {since_full} \
                 the steps since the last full group can add",
                report.drift
            );
        }
        if reports[0].1.full {
            since_full = 0.0;
        }
    }
    members
}

/// K = every replica: the groups are every replica, one model, and the parameters are those of
/// `--reduce all`, bit for bit (same buckets, same group, same sums).
#[test]
fn partial_with_k_equal_to_the_replicas_is_the_all_reduce() {
    let tmp = tempfile::tempdir().unwrap();
    let (all, partial) = (tmp.path().join("all"), tmp.path().join("partial"));
    train(3, &["--iterations", "4", "--reduce", "all"], &all);
    let runs = train(3, &["--iterations", "4", "--reduce", "partial:3"], &partial);
    for rank in 0..3 {
        let (a, p) = (rank_params(&all, rank), rank_params(&partial, rank));
        assert_eq!(a.keys().collect::<Vec<_>>(), p.keys().collect::<Vec<_>>());
        for (name, t) in &a {
            assert!(t.equal(&p[name]), "rank {rank}: {name} differs from --reduce all");
        }
    }
    let reports: Vec<_> = runs
        .iter()
        .enumerate()
        .flat_map(|(rank, run)| groups_of(rank, &run.iterations()))
        .collect();
    let groups = check_groups(&reports, 3, 3, 10);
    assert_eq!(groups.len(), 4, "{groups:?}");
    for (index, members) in &groups {
        assert_eq!(members, &vec![0, 1, 2], "group {index}");
    }
    assert!(
        reports.iter().all(|(_, g)| g.drift == 0.0),
        "one model: {reports:?}"
    );
    assert_eq!(runs[0].start().config.reduce, "partial:3");
}

/// Three replicas, K = 2, rank 2 four times slower: ranks 0 and 1 group without it, every group
/// is at most two (three at each third, full one), and the drift stays within the bound.
#[test]
fn partial_groups_go_on_without_a_straggler_within_the_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let runs = train(
        3,
        &[
            "--iterations",
            "12",
            "--reduce",
            "partial:2",
            "--sync-every",
            "3",
            "--slowdown",
            "2=4",
        ],
        tmp.path(),
    );
    let reports: Vec<_> = runs
        .iter()
        .enumerate()
        .flat_map(|(rank, run)| {
            assert_eq!(run.iterations().len(), 12, "rank {rank}");
            groups_of(rank, &run.iterations())
        })
        .collect();
    let groups = check_groups(&reports, 3, 2, 3);
    let without_straggler = groups.values().filter(|m| *m == &vec![0, 1]).count();
    assert!(
        without_straggler > 0,
        "ranks 0 and 1 never grouped without rank 2: {groups:?}"
    );
    assert!(
        groups.values().any(|m| m.len() == 3),
        "no full group of every replica: {groups:?}"
    );
    // Members of a group of fewer than every replica step on their own data before averaging,
    // so they differ from their mean: the drift is not zero.
    assert!(
        reports.iter().any(|(_, g)| !g.full && g.drift > 0.0),
        "no partial group's members ever differed: {reports:?}"
    );
    // A group's members leave it as one model (they average after their steps), and replicas
    // that last met in different groups hold different models. Which groups the replicas last
    // met in depends on the timing (a replica starved of CPU on a busy machine is a straggler
    // too), so the groups reported say which models must be equal.
    let models: Vec<_> = (0..3).map(|r| rank_params(tmp.path(), r)).collect();
    let last_group = |rank: usize| {
        reports
            .iter()
            .filter(|(r, _)| *r == rank)
            .map(|(_, g)| g.index)
            .max()
    };
    for (a, b) in [(0, 1), (0, 2), (1, 2)] {
        let same = models[a].iter().all(|(name, t)| t.equal(&models[b][name]));
        let (ga, gb) = (last_group(a), last_group(b));
        assert_eq!(
            same,
            ga == gb,
            "ranks {a} and {b} last met in groups {ga:?} and {gb:?}, yet their models are {}",
            if same { "one" } else { "different" }
        );
    }
    for run in &runs {
        let losses: Vec<f64> = run.iterations().iter().filter_map(|i| i.loss).collect();
        assert_eq!(
            losses.len(),
            12,
            "every replica reports its own microbatches' loss"
        );
        assert!(losses.iter().all(|l| l.is_finite()));
    }
}

/// A replica killed while it computes: the two others finish all their iterations in groups
/// without it, rank 0 (the store's host) waits out its heartbeat, and both say what happened.
#[test]
fn a_dead_replica_does_not_hang_the_others() {
    let port = free_port().to_string();
    let spawn = |rank: usize| {
        let mut args = words(MLP);
        args.extend_from_slice(&["--iterations", "10", "--reduce", "partial:2", "--sync-every", "3"]);
        runtime()
            .args(&args)
            .args([
                "--world-size",
                "3",
                "--rank",
                &rank.to_string(),
                "--master-port",
                &port,
            ])
            .args(["--comm-timeout", "60", "--slowdown", "2=30"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut children: Vec<_> = (0..3).map(spawn).collect();
    // Rank 2 is thirty times slower: once it reports its first step it is computing its second
    // for a long while, in no group. Kill it there.
    let stdout = children[2].stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    loop {
        let line = lines.next().expect("rank 2 reports an iteration").unwrap();
        if line.contains(r#""event":"iteration""#) {
            break;
        }
    }
    children[2].kill().unwrap();
    children[2].wait().unwrap();
    let killed = Instant::now();
    let mut said = String::new();
    for (rank, mut child) in children.into_iter().enumerate().take(2) {
        let output = loop {
            if child.try_wait().unwrap().is_some() {
                break child.wait_with_output().unwrap();
            }
            assert!(
                killed.elapsed() < Duration::from_secs(120),
                "rank {rank} still running {:?} after rank 2 died",
                killed.elapsed()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "rank {rank} failed:\n{stderr}");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let groups: Vec<PartialGroup> = stdout
            .lines()
            .filter_map(Event::parse_line)
            .filter_map(|e| match e {
                Event::Iteration(i) => i.partial_reduce,
                _ => None,
            })
            .collect();
        assert_eq!(groups.len(), 10, "rank {rank} trained every iteration:\n{stderr}");
        // After a full group that went ahead without it, rank 2 is in no group.
        let first_without = groups
            .iter()
            .position(|g| g.full && !g.members.contains(&2))
            .unwrap_or_else(|| panic!("rank {rank}: no full group without rank 2: {groups:?}"));
        assert!(
            groups[first_without..].iter().all(|g| !g.members.contains(&2)),
            "rank {rank}: {groups:?}"
        );
        said.push_str(&stderr);
    }
    // Whichever rank sealed the full group without rank 2 says why.
    assert!(
        said.contains("replica rank 2 has shown no heartbeat"),
        "neither rank says why rank 2 was left out:\n{said}"
    );
}

/// What a partial reduce cannot do is refused before any rank connects, naming what to change.
#[test]
fn partial_reduce_refuses_what_needs_every_replica_at_one_step() {
    let cases: [(&[&str], &str); 8] = [
        (
            &["--reduce", "partial:2", "--schedule", "pipedream"],
            "--schedule",
        ),
        (
            &["--reduce", "partial:2", "--microbatches", "4"],
            "4 is not a multiple of the 3 replicas",
        ),
        (&["--reduce", "partial:0"], "with K at least 1"),
        (&["--reduce", "some"], "neither `all` nor `partial:K`"),
        (&["--reduce", "partial:4"], "more replicas than a stage has"),
        (&["--reduce", "partial:2", "--precision", "fp16"], "--precision"),
        (
            &["--reduce", "partial:2", "--overlap-reduce", "on"],
            "--overlap-reduce",
        ),
        (
            &["--reduce", "partial:2", "--checkpoint-dir", "/tmp/x"],
            "--checkpoint-dir",
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("hybrid.json");
    std::fs::write(
        &config,
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#,
    )
    .unwrap();
    let pipeline = [
        "--reduce",
        "partial:1",
        "--stage-config",
        config.to_str().unwrap(),
    ];
    let cases = cases.into_iter().chain([(&pipeline[..], "not on a pipeline")]);
    for (extra, expected) in cases {
        let mut args = words(MLP);
        args.extend_from_slice(&["--iterations", "2", "--world-size", "3", "--rank", "0", "--check"]);
        args.extend_from_slice(extra);
        let all = refused(&args);
        assert!(all.contains(expected), "{extra:?}: {all}");
    }
}
