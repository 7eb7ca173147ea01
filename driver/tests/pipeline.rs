//! The real runtime as a 2-stage CPU pipeline (gloo over loopback), end to end, with the process
//! backend. (The same pipeline in both container modes is in `docker_runtime`.)

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::experiments::*;
use crate::util::*;

#[test]
fn a_two_stage_pipeline_runs_as_processes() {
    let runtime = runtime();
    let h = Harness::new("pipe-proc");
    let run = h.run(
        &two_stage_mlp(&h, "process"),
        &["--runtime", runtime.to_str().unwrap()],
    );
    check_pipeline_run(&h, &run);
    h.assert_no_processes();
}

/// `profiler_trace: true`: each local rank writes its trace straight into the record.
#[test]
fn a_pipelines_profiler_traces_are_kept_in_its_record() {
    let runtime = runtime();
    let h = Harness::new("pipe-proc-traced");
    let config = traced(&two_stage_mlp(&h, "process"));
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    check_traces_kept(&h, &run);
    h.assert_no_processes();

    // A run with no iteration after the warm-up has nothing to trace: refused before it starts.
    let h = Harness::new("pipe-proc-traced-short");
    let config = traced(&two_stage_mlp(&h, "process"));
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("iterations: 3", "iterations: 1")).unwrap();
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(
        run.stderr().contains("--profiler-trace") && run.stderr().contains("raise --iterations"),
        "{}",
        run.stderr()
    );
    assert!(!h.records().exists(), "nothing started, so no record");
}

/// A rank killed after the traced iterations fails the run, which keeps both ranks' traces.
#[test]
fn a_failed_pipelines_traces_are_kept_in_its_record() {
    let h = Harness::new("pipe-proc-traced-failed");
    a_failed_runs_traces_are_kept(&h, "process", |handle| {
        kill_hard(handle.strip_prefix("pid ").expect("a process rank's handle"));
    });
    h.assert_no_processes();
}

/// A PipeDream experiment, keys and partitioned model folder as PipeDream writes them, runs
/// unchanged: the runtime's AlexNet split as PipeDream's stage files split it, for the epochs
/// PipeDream's keys ask.
#[test]
fn a_pipedream_experiment_runs_as_written() {
    let runtime = runtime();
    let h = Harness::new("pipedream-alexnet");
    let config = pipedream_alexnet(&h, "process");
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    // Two epochs of 4 samples in batches of 4.
    assert_eq!(summary["iterations_done"], 2);
    let mut starts = BTreeMap::new();
    let mut rates = Vec::new();
    for line in lines(&dir.join("metrics.jsonl")) {
        let event: Value = serde_json::from_str(&line).unwrap();
        match event["event"].as_str() {
            Some("start") => {
                starts.insert(
                    event["rank"].as_u64().unwrap(),
                    (
                        event["first_module"].as_u64().unwrap(),
                        event["end_module"].as_u64().unwrap(),
                    ),
                );
                assert_eq!(event["config"]["model"], "alexnet");
                assert_eq!(event["config"]["lr_policy"], "step");
            }
            Some("iteration") => rates.push(event["lr"].as_f64().unwrap()),
            _ => {}
        }
    }
    // features.0, .2, .3, .5 on rank 0; the other convolutions, the pool, avgpool, the
    // classifier and the loss (13 modules in all) on rank 1.
    assert_eq!(starts, BTreeMap::from([(0, (0, 4)), (1, (4, 13))]));
    assert!(rates.iter().all(|&r| r == 0.01), "{rates:?}");
    // print_frequency: 1 shows each iteration's loss line.
    for i in [1, 2] {
        assert!(
            run.stderr().contains(&format!("r1] iteration {i}: loss ")),
            "{}",
            run.stderr()
        );
    }
    h.assert_no_processes();
}

/// A run stopped after its checkpoint resumes where it was: the second record has only the
/// iterations left, and every rank's checkpoint folder moved on to the end, keeping the one it
/// resumed from (a rank killed while checkpointing leaves the others one to step back to). Both
/// runs say `resume: auto`: the first, with no checkpoint yet, starts afresh.
#[test]
fn a_pipeline_resumes_from_its_checkpoints() {
    let runtime = runtime();
    let h = Harness::new("pipe-resume");
    let first = two_stage_mlp(&h, "process");
    let text = std::fs::read_to_string(&first).unwrap();
    std::fs::write(&first, format!("{text}checkpoint_dir: ckpt\nresume: auto\n")).unwrap();
    let run = h.run(&first, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let ckpt = h.dir.path().join("ckpt");
    for rank in 0..2 {
        assert!(ckpt.join(format!("rank-{rank}/iter-3")).is_dir(), "rank {rank}");
    }
    let first_record = h.summary().0;
    assert!(
        lines(&first_record.join("metrics.jsonl"))
            .iter()
            .any(|l| l.contains("\"event\":\"iteration\"") && l.contains("\"iteration\":0,")),
        "the first run started afresh"
    );
    let resumed = text.replace("iterations: 3", "iterations: 5");
    std::fs::write(&first, format!("{resumed}checkpoint_dir: ckpt\nresume: auto\n")).unwrap();
    let run = h.run(&first, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let second_record = std::fs::read_dir(h.records())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| *p != first_record)
        .expect("a second record");
    let mut iterations = std::collections::BTreeSet::new();
    for line in lines(&second_record.join("metrics.jsonl")) {
        let event: Value = serde_json::from_str(&line).unwrap();
        if event["event"] == "iteration" {
            iterations.insert(event["iteration"].as_u64().unwrap());
        }
    }
    assert_eq!(iterations.into_iter().collect::<Vec<_>>(), [3, 4]);
    for rank in 0..2 {
        let mut held: Vec<String> = std::fs::read_dir(ckpt.join(format!("rank-{rank}")))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("iter-"))
            .collect();
        held.sort();
        assert_eq!(held, ["iter-3", "iter-5"], "rank {rank}");
    }
    h.assert_no_processes();
}

#[test]
fn an_interrupted_pipeline_of_processes_checkpoints_every_rank_and_resumes() {
    let h = Harness::new("pipe-term");
    an_interrupted_run_checkpoints_every_rank_and_resumes(&h, "process", &[]);
    h.assert_no_processes();
}

/// A second Ctrl-C stops the ranks at once: here rank 1 is frozen (SIGSTOP, as a host cut off
/// holds a rank in a collective), so the checkpoint the first Ctrl-C asked for never comes, and
/// the driver would wait out the whole checkpoint grace (60 s).
#[test]
fn a_second_interrupt_stops_the_ranks_without_waiting_for_their_checkpoint() {
    let runtime = runtime();
    let h = Harness::new("pipe-int-twice");
    let config = two_stage_mlp(&h, "process");
    let text = std::fs::read_to_string(&config).unwrap();
    let long = text.replace("iterations: 3", "iterations: 1000000");
    std::fs::write(&config, format!("{long}checkpoint_dir: ckpt\n")).unwrap();
    let child = h.spawn(&config, &["--runtime", runtime.to_str().unwrap()]);
    let record = wait_for_record(&h.records(), Duration::from_secs(120));
    let start = Instant::now();
    let pid = loop {
        let summary: Option<Value> = std::fs::read_to_string(record.join("summary.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let handle = summary
            .as_ref()
            .and_then(|s| s["ranks"][1]["handle"].as_str().map(String::from));
        let iterations = lines(&record.join("metrics.jsonl"))
            .iter()
            .filter(|l| l.contains("\"iteration\"") && l.contains("\"rank\":1"))
            .count();
        if let (Some(handle), true) = (handle, iterations >= 2) {
            break handle
                .strip_prefix("pid ")
                .expect("a process rank's handle")
                .to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "rank 1 ran no two iterations"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let frozen = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(frozen.success());
    interrupt(&child);
    std::thread::sleep(Duration::from_secs(2));
    let again = Instant::now();
    interrupt(&child);
    let out = wait_with_deadline(child, Duration::from_secs(90));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        again.elapsed() < Duration::from_secs(25),
        "took {:?}: {stderr}",
        again.elapsed()
    );
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("driver: interrupted again: stopping every rank now"),
        "{stderr}"
    );
    h.assert_no_processes();
}

#[test]
fn a_killed_rank_of_processes_restarts_from_its_checkpoint() {
    let h = Harness::new("pipe-restart");
    a_killed_rank_restarts_from_its_checkpoint(&h, "process", |handle| {
        kill_hard(handle.strip_prefix("pid ").expect("a process rank's handle"));
    });
    h.assert_no_processes();
}
