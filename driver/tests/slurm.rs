//! The Slurm backend against a real Slurm: the one-node cluster `scripts/slurm-cluster up` starts
//! on this machine (slurmctld, slurmd and munged as root, found through SLURM_CONF), real srun,
//! scancel and squeue, and the real runtime as the job's tasks. Each test checks with squeue that
//! nothing of its job is queued or running afterwards, and in /proc that no rank is left.
//!
//! The cluster has this machine's CPUs, so tests that run at the same time queue behind each
//! other in Slurm, as jobs on a busy cluster do; the deadlines allow for it. Where cgroup v1's
//! controllers are mounted it holds each job to its memory (task/cgroup), as real clusters do.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::experiments::{
    assert_every_trace_kept, assert_ranks_traced_steps_1_and_2, assert_restarted_once_from_a_checkpoint,
    wait_for_a_checkpoint_of_both_ranks, KILLABLE_AFTER_A_CHECKPOINT,
};
use crate::util::{
    assert_rank_0_killed_for_memory, interrupt, kill_hard, runtime, wait_for_record, wait_for_recorded_run,
    wait_with_deadline, workspace, Harness,
};

/// Stops the test cluster as this test binary exits: registered where [`slurm_conf`] started
/// it. Under `scripts/test`, which starts the cluster before the tests and stops it after them,
/// it is already up and left to the script.
extern "C" fn stop_the_cluster_started_here() {
    let _ = Command::new(workspace().join("scripts/slurm-cluster"))
        .arg("down")
        .output();
}

/// SLURM_CONF of the test cluster, started (idempotently) on first use; a cluster started here
/// is stopped when the tests are done.
fn slurm_conf() -> &'static str {
    static CONF: OnceLock<String> = OnceLock::new();
    CONF.get_or_init(|| {
        let script = workspace().join("scripts/slurm-cluster");
        let was_up = Command::new(&script)
            .arg("status")
            .output()
            .is_ok_and(|out| out.status.success());
        let up = Command::new(&script)
            .arg("up")
            .output()
            .expect("run scripts/slurm-cluster");
        assert!(
            up.status.success(),
            "the Slurm backend's tests need the one-node cluster, and `scripts/slurm-cluster up` \
             failed (it needs root and Debian's slurm-wlm and munge):\n{}",
            String::from_utf8_lossy(&up.stderr)
        );
        if !was_up {
            // SAFETY: registers a plain function to run at exit; it touches no state of ours.
            unsafe { nix::libc::atexit(stop_the_cluster_started_here) };
        }
        let env = Command::new(&script)
            .arg("env")
            .output()
            .expect("slurm-cluster env");
        let line = String::from_utf8(env.stdout).unwrap();
        line.trim()
            .strip_prefix("SLURM_CONF=")
            .expect("SLURM_CONF=...")
            .to_string()
    })
}

fn slurm_env() -> [(&'static str, &'static str); 1] {
    [("SLURM_CONF", slurm_conf())]
}

/// Runs a Slurm command of the test cluster and returns its stdout.
fn slurm(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .env("SLURM_CONF", slurm_conf())
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Jobs Slurm still lists for the record in `record` (its job is `stagehand-<record id>`).
fn jobs_left(record: &Path) -> String {
    let id = record.file_name().unwrap().to_string_lossy();
    slurm(
        "squeue",
        &["--noheader", &format!("--name=stagehand-{id}"), "--format=%i %T"],
    )
    .trim()
    .to_string()
}

/// An MLP trained by `tasks` ranks on one node for `iterations`, with more `slurm:` lines.
fn mlp(h: &Harness, iterations: u64, slurm_extra: &str) -> PathBuf {
    h.config(&format!(
        "backend: slurm\nslurm:\n  nodes: 1\n  tasks_per_node: 2\n{slurm_extra}module: mlp\nbatch_size: 16\n\
         iterations: {iterations}\nthreads: 1\ndevice: cpu\nenv:\n  OMP_NUM_THREADS: '1'\n"
    ))
}

/// Runs the driver to its end within `deadline`.
fn run(h: &Harness, config: &Path, deadline: Duration) -> (i32, String) {
    let child = h.spawn_with_env(config, &[], &slurm_env());
    let out = wait_with_deadline(child, deadline);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until the record's metrics show `n` iterations (the ranks are training).
fn wait_for_iterations(record: &Path, n: usize, timeout: Duration) {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(record.join("metrics.jsonl")).unwrap_or_default();
        if text.lines().filter(|l| l.contains("\"iteration\"")).count() >= n {
            return;
        }
        assert!(start.elapsed() < timeout, "no {n} iterations in {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pid of the runtime that runs as task `rank` of this harness's job.
fn task_pid(h: &Harness, rank: usize) -> Option<u32> {
    let marker = format!("{}={}", crate::util::MARKER, h.name);
    let procid = format!("SLURM_PROCID={rank}");
    h.processes().into_iter().map(|(pid, _)| pid).find(|pid| {
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            return false;
        };
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        let has = |v: &str| vars.contains(&v.as_bytes());
        has(&marker) && has(&procid) && vars.iter().any(|v| v.starts_with(b"SLURM_JOB_ID="))
    })
}

fn host_name() -> String {
    let out = Command::new("hostname").arg("-s").output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn the_shipped_experiment_runs_on_slurm_and_its_record_names_the_job_and_nodes() {
    runtime();
    let h = Harness::new("slurm-ok");
    let shipped = workspace().join("driver_configs/mlp_slurm.yml");
    let (code, stderr) = run(&h, &shipped, Duration::from_secs(240));
    assert_eq!(code, 0, "{stderr}");
    let (record, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["backend"], "slurm");
    let node = host_name();
    let job = &summary["slurm_job"];
    let job_id = job["job_id"].as_u64().expect("a job id");
    assert_eq!(job["nodes"], serde_json::json!([node]), "{summary}");
    assert!(
        stderr.contains(&format!("Slurm job {job_id} started on {node}")),
        "{stderr}"
    );
    for (rank, r) in summary["ranks"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["exit_code"], 0, "{r}");
        assert_eq!(r["host"], node.as_str(), "{r}");
        assert_eq!(r["handle"], format!("Slurm job {job_id} task {rank}"), "{r}");
    }
    // Every rank's metrics arrived, prefixed by its task label and sorted to its rank.
    let metrics = std::fs::read_to_string(record.join("metrics.jsonl")).unwrap();
    for rank in 0..2 {
        let mine: Vec<Value> = metrics
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["event"] == "iteration" && e["rank"] == rank)
            .collect();
        assert_eq!(mine.len(), 20, "rank {rank}'s iterations");
        let log = std::fs::read_to_string(record.join(format!("rank-{rank}.log"))).unwrap();
        assert!(log.contains(&format!("rank {rank} of 2")), "{log}");
    }
    // The two data-parallel replicas agree on the loss: they are one job's ranks, not two jobs.
    assert!(summary["throughput"]["samples_per_sec_mean"].as_f64().unwrap() > 0.0);
    let slurm_log = std::fs::read_to_string(record.join("slurm.log")).unwrap();
    assert!(
        slurm_log.contains("srun --test-only") || slurm_log.contains("to start at"),
        "{slurm_log}"
    );
    assert_eq!(jobs_left(&record), "");
    h.assert_no_processes();
}

/// `profiler_trace: true` on Slurm: the tasks write their traces straight into the record, which
/// the node sees at the driver's path (the one node here is this machine).
#[test]
fn slurms_tasks_write_their_profiler_traces_into_the_record() {
    runtime();
    let h = Harness::new("slurm-traced");
    let config = mlp(&h, 3, "");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}profiler_trace: true\n")).unwrap();
    let (code, stderr) = run(&h, &config, Duration::from_secs(240));
    assert_eq!(code, 0, "{stderr}");
    let (record, summary) = h.summary();
    assert_eq!(summary["traces"]["dir"], "traces", "{summary}");
    assert_every_trace_kept(&summary, &stderr, 2);
    assert_ranks_traced_steps_1_and_2(&record, 2);
    assert_eq!(jobs_left(&record), "");
    h.assert_no_processes();
}

#[test]
fn a_failing_rank_cancels_the_job_and_is_recorded() {
    runtime();
    let h = Harness::new("slurm-fail");
    let config = mlp(&h, 100_000, "");
    let child = h.spawn_with_env(&config, &[], &slurm_env());
    let record = wait_for_record(&h.records(), Duration::from_secs(60));
    wait_for_iterations(&record, 4, Duration::from_secs(180));
    // Rank 1 dies as the OOM killer would end it.
    kill_hard(&task_pid(&h, 1).expect("task 1's runtime").to_string());
    let since = Instant::now();
    let out = wait_with_deadline(child, Duration::from_secs(90));
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        since.elapsed() < Duration::from_secs(60),
        "stopping took {:?}",
        since.elapsed()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Slurm's own words reach the user: srun names the task that ended first, the one killed or
    // rank 0 failing on its lost peer a moment before srun saw the kill (a busy machine).
    assert!(
        stderr.contains("srun: error:")
            && (stderr.contains("task 1: Killed") || stderr.contains("task 0: Exited with exit code")),
        "{stderr}"
    );
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "failed");
    // Rank 0 fails too, on its own (its peer is gone) or by the job's cancellation; whichever
    // Slurm reports first is the cause.
    let cause = &summary["failure"]["cause"];
    assert_eq!(cause["kind"], "rank_failed", "{summary}");
    assert!(stderr.contains(&format!("rank {} on", cause["rank"])), "{stderr}");
    assert_eq!(summary["ranks"][1]["exit_code"], 137, "{summary}");
    assert_eq!(summary["ranks"][0]["exited"], true, "{summary}");
    assert_ne!(summary["ranks"][0]["exit_code"], 0, "{summary}");
    assert_eq!(jobs_left(&record), "");
    h.assert_no_processes();
}

/// A rank the kernel kills because its job ran out of the memory it asked for is reported as such,
/// end to end: the test cluster's task/cgroup holds the job to `--mem`, the kernel's OOM killer
/// ends the rank, srun says "Out Of Memory", and the driver records and says why.
#[test]
fn a_rank_killed_for_want_of_its_jobs_memory_is_reported_as_such() {
    let config = slurm("scontrol", &["show", "config"]);
    if !config
        .lines()
        .any(|l| l.starts_with("TaskPlugin ") && l.contains("task/cgroup"))
    {
        eprintln!(
            "SKIPPED a_rank_killed_for_want_of_its_jobs_memory_is_reported_as_such: the test \
             cluster holds no job to its memory (task/cgroup needs cgroup v1's memory and \
             freezer controllers; `scripts/slurm-cluster status` says which plugin runs)"
        );
        return;
    }
    runtime();
    let h = Harness::new("slurm-oom");
    // VGG16's parameters alone weigh 553 MB: the rank cannot even build its model in 384 MiB.
    let config = h.config(
        "backend: slurm\nslurm:\n  nodes: 1\n  tasks_per_node: 1\n  options: [--mem=384M]\n\
         module: vgg16\nbatch_size: 4\niterations: 1\nthreads: 1\ndevice: cpu\n",
    );
    let (code, stderr) = run(&h, &config, Duration::from_secs(120));
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("exited with code 137: the kernel killed it for lack of memory"),
        "{stderr}"
    );
    // Slurm's own word for it, shown and kept in the record (the run ends with its only rank).
    assert!(
        stderr.contains("srun: error: ") && stderr.contains("task 0: Out Of Memory"),
        "{stderr}"
    );
    let (record, summary) = h.summary();
    let slurm_log = std::fs::read_to_string(record.join("slurm.log")).unwrap();
    assert!(slurm_log.contains("task 0: Out Of Memory"), "{slurm_log}");
    assert_rank_0_killed_for_memory(&summary, "");
    assert_eq!(jobs_left(&record), "");
    h.assert_no_processes();
}

/// With `max_restarts`, a task killed after a checkpoint ends its job as above, and a second
/// job's tasks resume from the checkpoints: the run succeeds, both jobs are gone, and the record
/// keeps the first job's failure and names the second job.
#[test]
fn a_killed_task_restarts_as_a_new_job_from_its_checkpoint() {
    runtime();
    let h = Harness::new("slurm-restart");
    let config = mlp(&h, 30, "");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}{KILLABLE_AFTER_A_CHECKPOINT}")).unwrap();
    let child = h.spawn_with_env(&config, &[], &slurm_env());
    let record = wait_for_record(&h.records(), Duration::from_secs(60));
    wait_for_a_checkpoint_of_both_ranks(&record, Duration::from_secs(180));
    let first_job = h.summary().1["slurm_job"]["job_id"]
        .as_u64()
        .expect("the first job");
    kill_hard(&task_pid(&h, 1).expect("task 1's runtime").to_string());
    let out = wait_for_recorded_run(child, Duration::from_secs(240), &record);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let (_, summary) = h.summary();
    assert_restarted_once_from_a_checkpoint(&summary, 30);
    let second_job = summary["slurm_job"]["job_id"].as_u64().unwrap();
    assert_ne!(second_job, first_job, "{summary}");
    assert!(
        stderr.contains(&format!("Slurm job {second_job} started on")),
        "{stderr}"
    );
    assert_eq!(jobs_left(&record), "");
    h.assert_no_processes();
}

#[test]
fn ctrl_c_cancels_the_job_and_leaves_nothing() {
    runtime();
    let h = Harness::new("slurm-int");
    let config = mlp(&h, 100_000, "");
    let child = h.spawn_with_env(&config, &[], &slurm_env());
    let record = wait_for_record(&h.records(), Duration::from_secs(60));
    wait_for_iterations(&record, 4, Duration::from_secs(180));
    let running = task_pid(&h, 0).expect("task 0's runtime");
    let sent = Instant::now();
    interrupt(&child);
    let (_, summary) = h.expect_stop(child, sent, Duration::from_secs(40), 130);
    assert_eq!(summary["status"], "interrupted");
    assert_eq!(summary["failure"]["cause"]["kind"], "interrupted");
    for r in summary["ranks"].as_array().unwrap() {
        assert_eq!(r["exited"], true, "{r}");
    }
    assert!(
        !Path::new(&format!("/proc/{running}")).exists(),
        "task 0 still runs"
    );
    assert_eq!(jobs_left(&record), "");
    h.assert_no_processes();
}

/// A driver ended outright (SIGKILL, as the kernel's OOM killer ends it) cannot scancel its job;
/// the kernel sends its srun SIGTERM as it dies, and srun ends the job step and gives the
/// allocation back, so the job does not hold the nodes until its time limit.
#[test]
fn a_driver_killed_outright_leaves_no_job_behind() {
    runtime();
    let h = Harness::new("slurm-driver-killed");
    let config = mlp(&h, 100_000, "");
    let mut child = h.spawn_with_env(&config, &[], &slurm_env());
    let record = wait_for_record(&h.records(), Duration::from_secs(60));
    wait_for_iterations(&record, 4, Duration::from_secs(180));
    let running = task_pid(&h, 0).expect("task 0's runtime");
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    while !jobs_left(&record).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the job outlived its driver: {}",
            jobs_left(&record)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        !Path::new(&format!("/proc/{running}")).exists(),
        "task 0 still runs"
    );
    h.assert_no_processes();
}

#[test]
fn a_job_still_queued_at_its_deadline_is_cancelled_with_slurms_reason() {
    let h = Harness::new("slurm-queued");
    // Held in the queue for an hour: it can only leave by being cancelled.
    let config = mlp(&h, 5, "  start_timeout_s: 2\n  options: ['--begin=now+3600']\n");
    let (code, stderr) = run(&h, &config, Duration::from_secs(120));
    assert_eq!(code, 1, "{stderr}");
    let (record, summary) = h.summary();
    assert_eq!(summary["status"], "failed");
    let cause = &summary["failure"]["cause"];
    assert_eq!(cause["kind"], "slurm_job", "{summary}");
    let reason = cause["reason"].as_str().unwrap();
    assert!(
        reason.contains("PENDING") && reason.contains("BeginTime"),
        "{reason}"
    );
    assert!(reason.contains("start_timeout_s"), "{reason}");
    let job_id = summary["slurm_job"]["job_id"]
        .as_u64()
        .expect("the queued job's id");
    assert!(
        stderr.contains(&format!("Slurm job {job_id} did not start: still PENDING")),
        "{stderr}"
    );
    for r in summary["ranks"].as_array().unwrap() {
        assert_eq!(r["state"], "removed", "{r}");
    }
    assert_eq!(jobs_left(&record), "");
    h.assert_no_processes();
}

#[test]
fn a_request_slurm_cannot_hold_fails_preflight_with_slurms_words() {
    let h = Harness::new("slurm-refused");
    let config = mlp(&h, 5, "  partition: no_such_partition\n");
    let (code, stderr) = run(&h, &config, Duration::from_secs(60));
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("Slurm refuses the job"), "{stderr}");
    assert!(stderr.contains("no_such_partition"), "{stderr}");
    assert!(stderr.to_lowercase().contains("invalid partition"), "{stderr}");
    // More ranks than the cluster has CPUs.
    let h = Harness::new("slurm-too-big");
    let cpus = slurm("sinfo", &["--noheader", "--format=%c"])
        .trim()
        .parse::<u32>()
        .unwrap();
    let config = h.config(&format!(
        "backend: slurm\nslurm: {{tasks_per_node: {}}}\nmodule: mlp\niterations: 1\nbatch_size: {}\n",
        cpus + 1,
        4 * (cpus + 1)
    ));
    let (code, stderr) = run(&h, &config, Duration::from_secs(60));
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("Slurm refuses the job"), "{stderr}");
    assert!(!h.records().exists(), "a refused job writes no record");
}

#[test]
fn a_sweep_of_planned_experiments_runs_each_point_as_slurm_jobs() {
    runtime();
    let h = Harness::new("slurm-sweep-auto");
    // Each point profiles on a one-task job, plans two stages or replicas, and runs the plan.
    let config = h.config(
        "backend: slurm\nslurm: {tasks_per_node: 2}\nmodule: mlp\nlayers: 4\nhidden: 128\n\
         config_file: auto\nplanner: {intra_host_gbps: 2}\nschedule: 1f1b\niterations: 3\n\
         threads: 1\ndevice: cpu\nenv:\n  OMP_NUM_THREADS: '1'\n",
    );
    let records = h.records();
    let args: Vec<&std::ffi::OsStr> = [
        "sweep",
        "-c",
        config.to_str().unwrap(),
        "--output-dir",
        records.to_str().unwrap(),
        "--grid",
        "batch_size=16,32",
    ]
    .into_iter()
    .map(std::ffi::OsStr::new)
    .collect();
    let run = h.driver_with_env(&args, &slurm_env(), Duration::from_secs(300));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let dir = h.sweep_dir();
    let mut points: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("summary.json").is_file())
        .collect();
    points.sort();
    assert_eq!(points.len(), 2, "{points:?}");
    let mut jobs = Vec::new();
    for point in &points {
        let text = std::fs::read_to_string(point.join("summary.json")).unwrap();
        let summary: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(summary["status"], "succeeded", "{summary}");
        assert_eq!(summary["backend"], "slurm", "{summary}");
        assert!(summary["plan"].is_object(), "the point was planned: {summary}");
        jobs.push(summary["slurm_job"]["job_id"].as_u64().expect("a job id"));
        assert_eq!(jobs_left(point), "");
    }
    assert_ne!(jobs[0], jobs[1], "each point is a job of its own");
    assert!(
        run.stderr().matches("profiling mlp").count() == 2,
        "each point profiled: {}",
        run.stderr()
    );
    h.assert_no_processes();
}
