//! The record folder written from a scripted sequence of events.

use std::path::Path;

use serde_json::Value;

use super::*;
use crate::config::Loaded;
use crate::events::{LeftContainer, Stream};
use crate::options::{ContainerMode, Options, Progress, Verbosity};

fn plan(dir: &Path) -> (Loaded, Experiment) {
    let path = dir.join("exp.yml");
    std::fs::write(
        &path,
        "name: rec\nbackend: process\nmachines: [localhost, localhost]\ncommand: [/bin/true]\n",
    )
    .unwrap();
    let loaded = crate::config::load(&path).unwrap();
    let options = Options {
        config_file: path,
        container_mode: ContainerMode::PerRank,
        output_dir: None,
        backend: None,
        runtime: Some("/nonexistent/runtime".into()),
        source: None,
        torch_venv: "/nonexistent/venv".into(),
        mount_directories: Vec::new(),
        master_port: None,
        max_restarts: None,
        ssh_config: None,
        verbosity: Verbosity::Quiet,
        progress: Progress::Off,
    };
    let plan = crate::experiment::resolve(&loaded, &options, 29500).unwrap();
    (loaded, plan)
}

fn metrics(line: &str) -> Event {
    let event = stagehand_contract::Event::parse_line(line).unwrap();
    let rank = match &event {
        stagehand_contract::Event::Iteration(i) => i.rank,
        _ => 0,
    };
    Event::Metrics {
        rank,
        line: line.to_string(),
        event: Box::new(event),
    }
}

fn iteration(i: u64, rank: usize) -> Event {
    metrics(&format!(
        r#"{{"event":"iteration","iteration":{i},"rank":{rank},"stage":0,"loss":1.0,"samples":8,"time_s":0.1,"samples_per_sec":80.0,"compute_s":0.08,"comm_wait_s":0.02,"idle_s":0.0,"peak_mem_bytes":null}}"#
    ))
}

/// A reporter of a new record of `plan` under `parent`, and the record's folder.
fn reporter(parent: &Path, plan: &Experiment) -> (RecordReporter, std::path::PathBuf) {
    let record = Record::create(parent, &plan.name).unwrap();
    let dir = record.dir.clone();
    (RecordReporter::new(record, plan).unwrap(), dir)
}

/// Both ranks of the plan started, on localhost.
fn start_both(r: &mut RecordReporter) {
    for rank in 0..2 {
        r.report(&Event::RankStarted {
            rank,
            host: "localhost".into(),
            handle: format!("c{rank}"),
        })
        .unwrap();
    }
}

fn summary(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn folders_are_named_by_utc_time_and_never_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let a = Record::create(tmp.path(), "exp").unwrap();
    let b = Record::create(tmp.path(), "exp").unwrap();
    assert_ne!(a.dir, b.dir);
    let (stamp, name) = a.id.split_once('_').unwrap();
    assert_eq!(name, "exp");
    assert_eq!(stamp.len(), "20261122T093000Z".len(), "{stamp}");
    assert!(stamp.ends_with('Z') && stamp.as_bytes()[8] == b'T', "{stamp}");
}

#[test]
fn a_failed_run_is_recorded_as_it_goes() {
    let tmp = tempfile::tempdir().unwrap();
    let (loaded, plan) = plan(tmp.path());
    let record = Record::create(&tmp.path().join("records"), &plan.name).unwrap();
    record.write_setup(&loaded, &plan).unwrap();
    let dir = record.dir.clone();
    let mut r = RecordReporter::new(record, &plan).unwrap();
    assert_eq!(
        summary(&dir)["status"],
        "running",
        "a summary exists before any rank starts"
    );
    assert_eq!(summary(&dir)["format_version"], FORMAT_VERSION);

    r.report(&Event::RankStarted {
        rank: 0,
        host: "localhost".into(),
        handle: "pid 1".into(),
    })
    .unwrap();
    r.report(&Event::RankStarted {
        rank: 1,
        host: "localhost".into(),
        handle: "pid 2".into(),
    })
    .unwrap();
    for i in 0..3 {
        r.report(&iteration(i, 0)).unwrap();
        r.report(&iteration(i, 1)).unwrap();
    }
    r.report(&Event::LineLogged {
        rank: 1,
        stream: Stream::Stderr,
        line: "out of memory".into(),
    })
    .unwrap();
    r.report(&Event::RankExited {
        rank: 1,
        exit_code: Some(9),
        out_of_memory: true,
    })
    .unwrap();
    assert_eq!(
        summary(&dir)["ranks"][1]["exit_code"],
        9,
        "exits are written when they happen"
    );
    let cause = StopCause::RankFailed {
        rank: 1,
        host: "localhost".into(),
        exit_code: Some(9),
        out_of_memory: true,
        silent_peer: None,
    };
    r.report(&Event::Stopping(cause)).unwrap();
    r.report(&Event::RankExited {
        rank: 0,
        exit_code: Some(143),
        out_of_memory: false,
    })
    .unwrap();
    r.report(&Event::Finished {
        status: Status::Failed,
    })
    .unwrap();

    let s = summary(&dir);
    assert_eq!(s["status"], "failed");
    assert!(s["ended_at"].is_string());
    assert_eq!(s["iterations_done"], 3);
    assert_eq!(
        s["throughput"]["samples_per_sec_mean"], 80.0,
        "each data-parallel rank reports the whole minibatch's rate; the job's is their mean"
    );
    assert_eq!(s["throughput"]["iterations_measured"], 2);
    assert!((s["stages"][0]["compute_share"].as_f64().unwrap() - 0.8).abs() < 1e-9);
    assert_eq!(s["failure"]["cause"]["rank"], 1);
    assert_eq!(s["failure"]["cause"]["out_of_memory"], true);
    assert_eq!(s["failure"]["last_lines"], serde_json::json!(["out of memory"]));
    assert_eq!(
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        6
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("rank-1.log"))
            .unwrap()
            .lines()
            .count(),
        4
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("config.given.yml")).unwrap(),
        loaded.text
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.given.yml",
            "config.resolved.json",
            "git.diff",
            "git.json",
            "metrics.jsonl",
            "rank-0.log",
            "rank-1.log",
            "summary.json"
        ],
        "no temporary files are left from atomic writes"
    );
}

#[test]
fn a_rank_on_a_lost_host_is_never_recorded_as_exited_and_its_container_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, plan) = plan(tmp.path());
    let (mut r, dir) = reporter(&tmp.path().join("records"), &plan);
    assert_eq!(summary(&dir)["ranks"][1]["state"], "pending");
    start_both(&mut r);
    assert_eq!(summary(&dir)["ranks"][1]["state"], "running");
    let reason = "connection reset".to_string();
    r.report(&Event::HostLost {
        host: "th2".into(),
        reason: reason.clone(),
    })
    .unwrap();
    r.report(&Event::RankLost {
        rank: 1,
        host: "th2".into(),
        reason,
    })
    .unwrap();
    let s = summary(&dir);
    assert_eq!(s["ranks"][1]["state"], "lost");
    assert_eq!(s["ranks"][1]["exited"], false);
    assert!(s["ranks"][1]["exit_code"].is_null());
    // Rank 0 exited before its container was removed; a later report does not undo what was seen.
    r.report(&Event::RankExited {
        rank: 0,
        exit_code: Some(143),
        out_of_memory: false,
    })
    .unwrap();
    r.report(&Event::RankRemoved { rank: 0 }).unwrap();
    let left = LeftContainer {
        host: "th2".into(),
        name: "exp-r1".into(),
        id: "0123456789abcdef".into(),
        ranks: vec![1],
        error: "cannot open an SSH connection to th2".into(),
        remove_by_hand: "ssh th2 docker rm -f exp-r1".into(),
    };
    r.report(&Event::ContainersLeft(vec![left])).unwrap();
    r.report(&Event::Finished {
        status: Status::Failed,
    })
    .unwrap();

    let s = summary(&dir);
    assert_eq!(s["ranks"][0]["state"], "exited");
    assert_eq!(s["ranks"][0]["exit_code"], 143);
    assert_eq!(s["ranks"][1]["state"], "not_removed");
    assert_eq!(s["ranks"][1]["exited"], false);
    assert!(s["ranks"][1]["exit_code"].is_null());
    let left = &s["containers_not_removed"];
    assert_eq!(left.as_array().unwrap().len(), 1, "{left}");
    assert_eq!(left[0]["host"], "th2");
    assert_eq!(left[0]["name"], "exp-r1");
    assert_eq!(left[0]["id"], "0123456789abcdef");
    assert_eq!(left[0]["ranks"], serde_json::json!([1]));
    assert_eq!(left[0]["remove_by_hand"], "ssh th2 docker rm -f exp-r1");
}

#[test]
fn a_summary_without_rank_states_or_left_containers_still_reads() {
    let old = r#"{"rank":0,"host":"localhost","handle":null,"exit_code":0,"exited":true}"#;
    let outcome: RankOutcome = serde_json::from_str(old).unwrap();
    assert_eq!(outcome.state, None);
    assert!(outcome.exited);
}

#[test]
fn ranks_the_driver_stops_are_recorded_as_stopped_not_as_failures_of_their_own() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, plan) = plan(tmp.path());
    let (mut r, dir) = reporter(&tmp.path().join("records"), &plan);
    let exit = |rank, exit_code, out_of_memory| Event::RankExited {
        rank,
        exit_code,
        out_of_memory,
    };
    let state = |rank: usize| {
        summary(&dir)["ranks"][rank]["state"]
            .as_str()
            .unwrap()
            .to_string()
    };
    start_both(&mut r);
    // Before the driver stops anything, a SIGKILL's code is the rank's own failure.
    r.report(&exit(1, Some(137), false)).unwrap();
    assert_eq!(state(1), "exited");
    let cause = StopCause::RankFailed {
        rank: 1,
        host: "localhost".into(),
        exit_code: Some(137),
        out_of_memory: false,
        silent_peer: None,
    };
    r.report(&Event::Stopping(cause.clone())).unwrap();
    r.report(&exit(0, Some(143), false)).unwrap();
    let s = summary(&dir);
    assert_eq!(s["ranks"][0]["state"], "stopped");
    assert_eq!(s["ranks"][0]["exit_code"], 143);
    assert_eq!(s["ranks"][0]["exited"], true);
    assert_eq!(
        s["ranks"][1]["state"], "exited",
        "the failure stays the failing rank's"
    );

    // Started again: nothing is being stopped until the next failure.
    r.report(&Event::Restarting {
        restart: 1,
        max: 2,
        cause,
        resume_from: None,
    })
    .unwrap();
    start_both(&mut r);
    r.report(&exit(0, None, false)).unwrap();
    assert_eq!(state(0), "exited");
    r.report(&Event::Stopping(StopCause::Interrupted)).unwrap();
    // A rank killed for memory, or failing with its own code, while the others are stopped is
    // not the stop's doing.
    r.report(&exit(1, Some(137), true)).unwrap();
    assert_eq!(state(1), "exited");
    let (mut r2, dir2) = reporter(&tmp.path().join("records2"), &plan);
    start_both(&mut r2);
    r2.report(&Event::Stopping(StopCause::Interrupted)).unwrap();
    r2.report(&exit(0, Some(1), false)).unwrap();
    r2.report(&exit(1, None, false)).unwrap();
    let s = summary(&dir2);
    assert_eq!(s["ranks"][0]["state"], "exited");
    assert_eq!(s["ranks"][1]["state"], "stopped");
    assert!(s["ranks"][1]["exit_code"].is_null());
}
