//! The process backend: ranks as local child processes.

use std::time::Duration;

use crate::util::*;

#[test]
fn two_ranks_succeed_and_the_record_has_everything() {
    let h = Harness::new("proc-ok");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\niterations: 4\n\
         env: {{EXTRA: 'x'}}\ncommand: ['{FAKE_RANK}', --iterations, '4', --sleep-ms, '30']\n"
    ));
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["format_version"], 1);
    assert_eq!(summary["world_size"], 2);
    assert_eq!(summary["iterations_done"], 4);
    let mean = summary["throughput"]["samples_per_sec_mean"].as_f64().unwrap();
    assert!(mean > 100.0, "two ranks of 8 samples per ~30 ms: {mean}");
    assert!(summary["stages"][0]["compute_share"].as_f64().unwrap() > 0.5);
    assert!(summary["ended_at"].is_string());
    for file in [
        "config.given.yml",
        "config.resolved.json",
        "hosts.json",
        "git.json",
        "git.diff",
        "rank-0.log",
        "rank-1.log",
    ] {
        assert!(dir.join(file).exists(), "{file} missing");
    }
    // start + 4 iterations + summary, for each rank.
    assert_eq!(lines(&dir.join("metrics.jsonl")).len(), 12);
    let log = std::fs::read_to_string(dir.join("rank-1.log")).unwrap();
    assert!(log.contains("fake-rank 1/2 master 127.0.0.1:"), "{log}");
    assert!(log.contains("local_rank 1"), "{log}");
    // Every rank is given the run's id (its record's, and the driver's process), which keeps the
    // run's keys apart on the rendezvous store.
    let id = dir.file_name().unwrap().to_string_lossy().into_owned();
    for rank in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("rank-{rank}.log"))).unwrap();
        assert!(log.contains(&format!(" run {id}-")), "{id}: {log}");
    }
    // Terminal lines are prefixed by host and rank.
    assert!(
        run.stderr()
            .contains("[localhost r1] fake-rank 1: iteration 3 done"),
        "{}",
        run.stderr()
    );
    h.assert_no_processes();
}

/// Container settings do nothing with the process backend, and a run says so, with where the
/// file writes them.
#[test]
fn container_settings_are_said_to_be_ignored_with_the_process_backend() {
    let h = Harness::new("proc-container");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost]\ncontainer: some-image:1\n\
         command: ['{FAKE_RANK}', --iterations, '1']\n"
    ));
    let run = h.run(&config, &["--launch-single-container"]);
    let stderr = run.stderr();
    assert_eq!(run.code(), 0, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "warning: `container:` ({}:4) is ignored with the process backend",
            config.display()
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("warning: --launch-single-container is ignored with the process backend"),
        "{stderr}"
    );
    h.assert_no_processes();
}

#[test]
fn quiet_prints_only_the_outcome() {
    let h = Harness::new("proc-quiet");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost]\ncommand: ['{FAKE_RANK}', --iterations, '2']\n"
    ));
    let run = h.run(&config, &["-q"]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(!run.stderr().contains("[localhost r0]"), "{}", run.stderr());
    assert!(run.stdout().is_empty(), "{}", run.stdout());
    h.assert_no_processes();
}

#[test]
fn a_failing_rank_stops_the_others_and_is_recorded() {
    let h = Harness::new("proc-fail");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\n\
         command: ['{FAKE_RANK}', --iterations, '1000', --sleep-ms, '50', --fail-rank, '1', --fail-at, '3', --exit-code, '7']\n"
    ));
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert!(run.elapsed < Duration::from_secs(20), "took {:?}", run.elapsed);
    assert!(
        run.stderr()
            .contains("rank 1 on localhost failed with exit code 7"),
        "{}",
        run.stderr()
    );
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "failed");
    let cause = &summary["failure"]["cause"];
    assert_eq!(cause["kind"], "rank_failed");
    assert_eq!(cause["rank"], 1);
    assert_eq!(cause["exit_code"], 7);
    let last = summary["failure"]["last_lines"].as_array().unwrap();
    assert!(
        last.last()
            .unwrap()
            .as_str()
            .unwrap()
            .contains("failing on purpose"),
        "{last:?}"
    );
    // Rank 0 was stopped by the driver (SIGTERM), not left running, and is not recorded as a
    // failure of its own; the failing rank's exit stays its own.
    assert_eq!(summary["ranks"][0]["exited"], true);
    assert_eq!(summary["ranks"][0]["exit_code"], 143);
    assert_eq!(summary["ranks"][0]["state"], "stopped");
    assert_eq!(summary["ranks"][1]["state"], "exited");
    assert!(
        !run.stderr().contains("[localhost r0] exited with code"),
        "the stopped rank's exit is not shown as a failure: {}",
        run.stderr()
    );
    h.assert_no_processes();
}

/// A memory cgroup of the test's own, under the one this process is in, capped at `limit`
/// bytes with no swap; removed when dropped (once its processes are gone).
struct MemoryCgroup(std::path::PathBuf);

impl MemoryCgroup {
    /// `Err` says why one cannot be made here (no permission, a layout this does not know).
    fn create(name: &str, limit: u64) -> Result<MemoryCgroup, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let root = std::path::Path::new("/sys/fs/cgroup");
        let mut v2 = None;
        for line in own.lines() {
            let fields: Vec<&str> = line.splitn(3, ':').collect();
            let [_, controllers, path] = fields[..] else {
                continue;
            };
            let path = path.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "memory") {
                let dir = root.join("memory").join(path).join(name);
                return MemoryCgroup::make(
                    dir,
                    &[
                        ("memory.limit_in_bytes", limit),
                        ("memory.memsw.limit_in_bytes", limit),
                    ],
                );
            }
            if controllers.is_empty() {
                v2 = Some(root.join(path).join(name));
            }
        }
        let dir = v2.ok_or("no memory cgroup in /proc/self/cgroup")?;
        MemoryCgroup::make(dir, &[("memory.max", limit), ("memory.swap.max", 0)])
    }

    /// Makes `dir` and writes each setting it has (swap's may be missing).
    fn make(dir: std::path::PathBuf, settings: &[(&str, u64)]) -> Result<MemoryCgroup, String> {
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        let cgroup = MemoryCgroup(dir);
        for (i, (file, value)) in settings.iter().enumerate() {
            let path = cgroup.0.join(file);
            if i > 0 && !path.exists() {
                continue;
            }
            std::fs::write(&path, value.to_string())
                .map_err(|e| format!("cannot set {}: {e}", path.display()))?;
        }
        Ok(cgroup)
    }

    fn procs(&self) -> std::path::PathBuf {
        self.0.join("cgroup.procs")
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A process rank the kernel kills for lack of memory is reported as such, as a container's
/// is: the driver (and with it its ranks) runs in a memory cgroup of its own capped at 256 MiB,
/// and the rank holds 1 GB. A rank killed by SIGKILL for another reason is not said to be.
#[test]
fn a_process_rank_killed_for_lack_of_memory_is_reported_as_such() {
    let h = Harness::new("proc-oom");
    let cgroup = match MemoryCgroup::create(&h.name, 256 << 20) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED a_process_rank_killed_for_lack_of_memory_is_reported_as_such: {why} (needs root and a memory cgroup)");
            return;
        }
    };
    let killed = h.config("backend: process\nmachines: [localhost]\ncommand: [sh, -c, 'kill -9 $$']\n");
    let run = h.run_in_cgroup(&cgroup.procs(), &killed, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    let (_, summary) = h.summary();
    assert_eq!(summary["failure"]["cause"]["exit_code"], 137, "{summary}");
    assert!(
        summary["failure"]["cause"].get("out_of_memory").is_none(),
        "{summary}"
    );

    let h = Harness::new("proc-oom-held");
    let held = h.config(
        "backend: process\nmachines: [localhost]\n\
         command: [python3, -c, \"held = b'x' * 1_000_000_000; print(len(held))\"]\n",
    );
    let run = h.run_in_cgroup(&cgroup.procs(), &held, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("exited with code 137: the kernel killed it for lack of memory"),
        "{}",
        run.stderr()
    );
    let (_, summary) = h.summary();
    assert_rank_0_killed_for_memory(&summary, "");
    h.assert_no_processes();
}

#[test]
fn sigint_stops_every_rank_and_records_interrupted() {
    let h = Harness::new("proc-int");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\ncommand: ['{FAKE_RANK}', --iterations, '1', --hang]\n"
    ));
    let child = h.spawn(&config, &[]);
    let record = wait_for_record(&h.records(), Duration::from_secs(20));
    wait_for_text(&record.join("rank-1.log"), "hanging", Duration::from_secs(20));
    wait_for_text(&record.join("rank-0.log"), "hanging", Duration::from_secs(20));
    // The record is written as the run goes, not at the end.
    let running: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(record.join("summary.json")).unwrap()).unwrap();
    assert_eq!(running["status"], "running");
    assert!(
        running["ranks"][1]["handle"]
            .as_str()
            .unwrap()
            .starts_with("pid "),
        "{running}"
    );
    // The harness's witness of leftovers sees both ranks while they run.
    let seen: Vec<u32> = h.processes().iter().map(|(pid, _)| *pid).collect();
    for rank in running["ranks"].as_array().unwrap() {
        let pid: u32 = rank["handle"].as_str().unwrap()["pid ".len()..].parse().unwrap();
        assert!(seen.contains(&pid), "rank {rank} not among {seen:?}");
    }
    // stdout and stderr are read separately, so wait for the metrics rather than assume an order.
    let start = std::time::Instant::now();
    while lines(&record.join("metrics.jsonl")).len() < 4 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "metrics.jsonl: start + 1 iteration per rank"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = std::time::Instant::now();
    interrupt(&child);
    let (_, summary) = h.expect_stop(child, sent, Duration::from_secs(15), 130);
    assert_eq!(summary["status"], "interrupted");
    assert_eq!(summary["failure"]["cause"]["kind"], "interrupted");
    for rank in summary["ranks"].as_array().unwrap() {
        assert_eq!(rank["exited"], true, "{rank}");
        assert_eq!(rank["state"], "stopped", "{rank}");
        let pid = rank["handle"].as_str().unwrap().trim_start_matches("pid ");
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "rank process {pid} still exists"
        );
    }
    h.assert_no_processes();
}

/// A driver ended outright (SIGKILL, as the kernel's OOM killer ends it) cannot stop its ranks;
/// the kernel sends them SIGTERM as it dies, so ranks that print nothing (and so never find their
/// output gone) do not run on without it.
/// What a rank leaves behind ends with the run. A process that keeps the rank's output open
/// (started in the background by a shell) no longer holds the run up once the rank exited: its
/// group is killed after a short drain, and the rank's own lines are in its log. One that had
/// its output elsewhere and ignores SIGTERM is killed before the driver exits.
#[test]
fn what_a_rank_leaves_behind_neither_holds_the_run_up_nor_outlives_it() {
    for (name, script) in [
        (
            "proc-left-holding",
            "(trap '' TERM; exec sleep 600) & echo started",
        ),
        (
            "proc-left-deaf",
            "(trap '' TERM; exec sleep 600) >/dev/null 2>&1 & echo started",
        ),
    ] {
        let h = Harness::new(name);
        let config = h.config(&format!(
            "backend: process\nmachines: [localhost]\ncommand: [sh, -c, \"{script}\"]\n"
        ));
        let run = h.run(&config, &[]);
        assert_eq!(run.code(), 0, "{name}: {}", run.stderr());
        let (record, _) = h.summary();
        let log = std::fs::read_to_string(record.join("rank-0.log")).unwrap();
        assert!(log.contains("started"), "{name}: {log}");
        h.assert_no_processes();
    }
}

#[test]
fn the_ranks_of_a_driver_killed_outright_end_with_it() {
    let h = Harness::new("proc-driver-killed");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\ncommand: ['{FAKE_RANK}', --iterations, '1', --hang]\n"
    ));
    let mut child = h.spawn(&config, &[]);
    let record = wait_for_record(&h.records(), Duration::from_secs(20));
    for rank in 0..2 {
        wait_for_text(
            &record.join(format!("rank-{rank}.log")),
            "hanging",
            Duration::from_secs(20),
        );
    }
    // Its record names it while it runs, so `driver results` can tell it gone afterwards.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(record.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["driver"]["pid"], child.id(), "{summary}");
    let results = |h: &Harness| h.driver(&["results".as_ref(), record.as_os_str()], Duration::from_secs(30));
    let running = results(&h);
    assert!(!running.stdout().contains("is gone"), "{}", running.stdout());
    child.kill().unwrap();
    child.wait().unwrap();
    h.assert_no_processes();
    let left = results(&h);
    assert_eq!(left.code(), 0, "{}", left.stderr());
    assert!(
        left.stdout()
            .contains(&format!("its driver (pid {} on", child.id())),
        "{}",
        left.stdout()
    );
}

/// A rank that stops answering (stopped with SIGSTOP, as a rank stuck in a kernel or on a dead
/// mount would be) is named as the one to look at, not the healthy rank whose receive timed out
/// waiting for it: on the terminal, in the record and in `driver results`.
#[test]
fn a_rank_that_stops_answering_is_named_not_the_rank_that_waited_for_it() {
    let runtime = runtime();
    let h = Harness::new("proc-silent");
    std::fs::write(
        h.dir.path().join("two.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    let config = h.config(
        "backend: process\nmachines: [localhost, localhost]\nmodule: mlp\nconfig_file: two.json\n\
         schedule: 1f1b\nbatch_size: 8\niterations: 1000000\nthreads: 1\ncomm_timeout: 3\n",
    );
    let child = h.spawn(&config, &["--runtime", runtime.to_str().unwrap()]);
    let record = wait_for_record(&h.records(), Duration::from_secs(30));
    wait_for_text(
        &record.join("metrics.jsonl"),
        r#""rank":1,"#,
        Duration::from_secs(60),
    );
    let rank_1 = h
        .processes()
        .into_iter()
        .find(|(_, cmdline)| cmdline.contains(" --rank 1 "))
        .unwrap_or_else(|| panic!("no rank 1 among {:?}", h.processes()));
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &rank_1.0.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let run = wait_with_deadline(child, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_ne!(run.status.code(), Some(0), "{stderr}");
    let blamed = "rank 1 on localhost did not answer rank 0's ";
    assert!(
        stderr.contains(blamed) && stderr.contains(" for 3 s (comm_timeout), though still running"),
        "{stderr}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(record.join("summary.json")).unwrap()).unwrap();
    let cause = &summary["failure"]["cause"];
    assert_eq!(cause["rank"], 0, "{summary}");
    assert_eq!(cause["silent_peer"]["rank"], 1, "{summary}");
    assert_eq!(cause["silent_peer"]["timeout_s"], 3.0, "{summary}");
    let results = h.driver(&["results".as_ref(), record.as_os_str()], Duration::from_secs(30));
    assert!(results.stdout().contains(blamed), "{}", results.stdout());
    h.assert_no_processes();
}

#[test]
fn the_real_runtime_trains_as_a_process() {
    let runtime = runtime();
    let h = Harness::new("proc-runtime");
    let config = h.config(
        "backend: process\nmachines: [localhost]\nmodule: mlp\nbatch_size: 16\niterations: 3\nthreads: 1\n",
    );
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 3);
    let metrics = lines(&dir.join("metrics.jsonl"));
    assert!(metrics[0].contains(r#""model":"mlp""#), "{metrics:?}");
    assert!(metrics.last().unwrap().contains(r#""event":"summary""#));
    // The record's throughput is the rank's own figures: the same iterations, the same spread.
    let rank: serde_json::Value = serde_json::from_str(metrics.last().unwrap()).unwrap();
    let job = &summary["throughput"];
    for key in ["samples_per_sec_mean", "samples_per_sec_std"] {
        let (a, b) = (job[key].as_f64().unwrap(), rank[key].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-9 * b.abs().max(1.0),
            "{key}: {a} against the rank's {b}"
        );
    }
    h.assert_no_processes();
}

/// Validation passes on two data-parallel ranks, end to end: the ranks' validation lines reach
/// the record's `metrics.jsonl`, its summary keeps the last pass, and `driver results` shows it
/// and reads the time to a validation target from the passes.
#[test]
fn validation_passes_reach_the_record_and_the_results() {
    let runtime = runtime();
    let h = Harness::new("proc-validation");
    let config = h.config(
        "backend: process\nmachines: [localhost, localhost]\nmodule: mlp\nbatch_size: 16\n\
         iterations: 4\nthreads: 1\nvalidate_every: 2\nvalidation_batches: 2\n",
    );
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    let metrics = lines(&dir.join("metrics.jsonl"));
    let passes: Vec<serde_json::Value> = metrics
        .iter()
        .filter(|l| l.contains(r#""event":"validation""#))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // After iterations 2 and 4 done, from both ranks (data parallelism: both are the last stage).
    assert_eq!(passes.len(), 4, "{metrics:?}");
    assert!(passes.iter().all(|p| p["samples"] == 32), "{passes:?}");
    let last = &summary["validation"];
    assert_eq!(last["iteration"], 3, "{summary}");
    assert_eq!(last["samples"], 32, "{summary}");
    assert_eq!(last["accuracy"], passes[3]["accuracy"], "{summary}");
    let shown = h.driver(
        &[
            "results".as_ref(),
            "--format".as_ref(),
            "json".as_ref(),
            "--time-to".as_ref(),
            "val_loss=1000".as_ref(),
            h.records().as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(shown.code(), 0, "{}", shown.stderr());
    let rows: serde_json::Value = serde_json::from_str(&shown.stdout()).unwrap();
    assert_eq!(rows[0]["validation"]["loss"], last["loss"], "{rows}");
    // Any loss is below 1000: reached at the first pass, after iteration 1.
    assert_eq!(rows[0]["time_to"]["iteration"], 1, "{rows}");
    assert_eq!(rows[0]["time_to"]["metric"], "val_loss", "{rows}");
    h.assert_no_processes();
}

/// fp16 runs whose gradient scaler skipped steps say so: the summary counts each skipped
/// iteration once (both replicas skip it), and `driver results` shows it beside the throughput,
/// which alone would not tell that the run trained on none of its steps.
#[test]
fn skipped_fp16_steps_are_recorded_and_shown_in_the_results() {
    let runtime = runtime();
    let h = Harness::new("proc-fp16-skips");
    // A first loss scale no float16 gradient survives: every step of the three is skipped.
    let config = h.config(
        "backend: process\nmachines: [localhost, localhost]\nmodule: mlp\nbatch_size: 16\n\
         iterations: 3\nthreads: 1\nprecision: fp16\nfp16_init_scale: 1.0e30\n",
    );
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (_, summary) = h.summary();
    assert_eq!(summary["skipped_steps"], 3, "{summary}");
    let shown = h.driver(
        &[
            "results".as_ref(),
            "--format".as_ref(),
            "json".as_ref(),
            h.records().as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(shown.code(), 0, "{}", shown.stderr());
    let rows: serde_json::Value = serde_json::from_str(&shown.stdout()).unwrap();
    assert_eq!(rows[0]["skipped_steps"], 3, "{rows}");
    assert_eq!(
        rows[0]["note"], "fp16 skipped 3 of 3 steps (inf/nan gradients)",
        "{rows}"
    );
    h.assert_no_processes();
}

#[test]
fn a_missing_program_fails_preflight() {
    let h = Harness::new("proc-missing");
    let config = h.config("backend: process\nmachines: [localhost]\ncommand: [no-such-program-here, --x]\n");
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("program no-such-program-here for the ranks does not exist"),
        "{}",
        run.stderr()
    );
    assert!(!h.records().exists());
    h.assert_no_processes();
}

#[test]
fn a_master_port_in_use_fails_preflight() {
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let h = Harness::new("proc-port");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost]\ncommand: ['{FAKE_RANK}']\n"
    ));
    let run = h.run(&config, &["--master-port", &port]);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains(&format!("master port {port} is in use on localhost")),
        "{}",
        run.stderr()
    );
    assert!(!h.records().exists());
    h.assert_no_processes();
}

/// A driver that one of its stop signals (SIGTERM, SIGHUP: a terminal that went away) reaches while
/// its rank hangs stops it and records the run as interrupted, as Ctrl-C does.
fn stopped_by(signal: &str) {
    let h = Harness::new(&format!("proc-{}", signal.to_lowercase()));
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost]\ncommand: ['{FAKE_RANK}', --iterations, '1', --hang]\n"
    ));
    let child = h.spawn(&config, &[]);
    let record = wait_for_record(&h.records(), Duration::from_secs(20));
    wait_for_text(&record.join("rank-0.log"), "hanging", Duration::from_secs(20));
    let sent = std::time::Instant::now();
    send_signal(&child, signal);
    let (_, summary) = h.expect_stop(child, sent, Duration::from_secs(15), 130);
    assert_eq!(summary["status"], "interrupted");
    assert_eq!(summary["ranks"][0]["exited"], true, "{summary}");
    h.assert_no_processes();
}

#[test]
fn sigterm_is_handled_like_ctrl_c() {
    stopped_by("TERM");
}

#[test]
fn a_hang_up_is_handled_like_ctrl_c() {
    stopped_by("HUP");
}

#[test]
fn a_driver_started_with_hang_ups_ignored_runs_on_through_one() {
    let h = Harness::new("proc-nohup");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost]\niterations: 30\n\
         command: ['{FAKE_RANK}', --iterations, '30', --sleep-ms, '100']\n"
    ));
    let child = h.spawn_ignoring_hangups(&config, &[]);
    let record = wait_for_record(&h.records(), Duration::from_secs(20));
    wait_for_text(
        &record.join("metrics.jsonl"),
        "\"iteration\":1,",
        Duration::from_secs(20),
    );
    send_signal(&child, "HUP");
    let out = wait_with_deadline(child, Duration::from_secs(60));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 30);
    h.assert_no_processes();
}

#[test]
fn a_driver_whose_output_went_away_runs_on_to_the_end_and_records_it_all() {
    // `driver ... | head` or a `tee` that was killed: the pipes close while the ranks train, and
    // every line the driver prints after that fails to be written.
    let h = Harness::new("proc-pipe");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\niterations: 30\n\
         command: ['{FAKE_RANK}', --iterations, '30', --sleep-ms, '100']\n"
    ));
    let mut child = h.spawn(&config, &["-v"]);
    let record = wait_for_record(&h.records(), Duration::from_secs(20));
    wait_for_text(
        &record.join("metrics.jsonl"),
        "\"iteration\":1,",
        Duration::from_secs(20),
    );
    drop(child.stdout.take());
    drop(child.stderr.take());
    let out = wait_with_deadline(child, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(0), "the driver went on: {:?}", out.status);
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 30);
    // start + 30 iterations + summary, for each rank.
    assert_eq!(lines(&record.join("metrics.jsonl")).len(), 64);
    h.assert_no_processes();
}

/// A rank that fails on every start, a little further on each, is started again `max_restarts`
/// times and no more: the run fails with the last start's failure, and the record lists the
/// earlier ones.
#[test]
fn a_rank_that_keeps_failing_is_restarted_as_often_as_allowed() {
    let h = Harness::new("proc-restarts");
    let starts = h.dir.path().join("starts");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\nmax_restarts: 2\n\
         command: ['{FAKE_RANK}', --iterations, '1000', --sleep-ms, '20', --fail-rank, '1', --fail-at, '2', --exit-code, '7', \
         --later-each-start, '{}']\n",
        starts.display()
    ));
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    let stderr = run.stderr();
    for restart in ["restart 1 of 2", "restart 2 of 2"] {
        assert!(
            stderr.contains(&format!(
                "driver: starting every rank again, as they first started (no checkpoint was written in this run); {restart}"
            )),
            "{stderr}"
        );
    }
    assert_eq!(
        stderr
            .matches("rank 1 on localhost failed with exit code 7")
            .count(),
        3,
        "{stderr}"
    );
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "failed");
    assert_eq!(summary["failure"]["cause"]["exit_code"], 7);
    let restarts = summary["restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 2, "{summary}");
    for restart in restarts {
        assert_eq!(restart["failure"]["cause"]["exit_code"], 7, "{restart}");
        assert!(restart["resume_from"].is_null(), "{restart}");
        let last = restart["failure"]["last_lines"].as_array().unwrap();
        assert!(
            last.iter()
                .any(|l| l.as_str().unwrap().contains("failing on purpose")),
            "{last:?}"
        );
    }
    let why = summary["not_restarted"].as_str().unwrap_or_default();
    assert!(
        why.contains("the 2 restart(s) allowed (max_restarts: 2) are used up"),
        "used up, and the record says so: {summary}"
    );
    assert!(stderr.contains(why), "the terminal says it too: {stderr}");
    // Each start's rank 1 logged its start line; the restarts are marked between them.
    let log = std::fs::read_to_string(dir.join("rank-1.log")).unwrap();
    assert_eq!(log.matches("fake-rank 1/2").count(), 3, "{log}");
    assert_eq!(
        log.matches("--- driver: every rank started again, as first started")
            .count(),
        2,
        "{log}"
    );
    // `driver results` says so beside the failure.
    let results = h.driver(&["results".as_ref(), dir.as_os_str()], Duration::from_secs(30));
    assert!(
        results
            .stdout()
            .contains("rank 1 on localhost exited with code 7; after 2 restarts"),
        "{}",
        results.stdout()
    );
    h.assert_no_processes();
}

/// A rank that fails the same way at the same place again would fail so on every start: one
/// restart, not all of them, and the record says why there was no other.
#[test]
fn the_same_failure_at_the_same_place_twice_is_not_restarted_again() {
    let h = Harness::new("proc-same-failure");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\nmax_restarts: 5\n\
         command: ['{FAKE_RANK}', --iterations, '1000', --sleep-ms, '20', --fail-rank, '1', --fail-at, '2', --exit-code, '7']\n"
    ));
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    let stderr = run.stderr();
    assert!(stderr.contains("restart 1 of 5"), "{stderr}");
    assert!(!stderr.contains("restart 2 of 5"), "{stderr}");
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "failed");
    assert_eq!(summary["restarts"].as_array().unwrap().len(), 1, "{summary}");
    let why = summary["not_restarted"].as_str().unwrap_or_default();
    assert!(
        why.contains("rank 1 on localhost failed as it did before the last restart")
            && why.contains("(2 iteration(s) done)"),
        "{summary}"
    );
    assert!(stderr.contains(why), "the terminal says it too: {stderr}");
    h.assert_no_processes();
}

/// A rank that refuses its request (exit 2) would refuse it again: no restart, and the record
/// says why.
#[test]
fn a_refusal_is_not_restarted() {
    let h = Harness::new("proc-no-restart");
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\nmax_restarts: 3\n\
         command: ['{FAKE_RANK}', --iterations, '1000', --fail-rank, '0', --fail-at, '0', --exit-code, '2']\n"
    ));
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("driver: no restart: the rank refused its request (exit code 2)"),
        "{}",
        run.stderr()
    );
    let (_, summary) = h.summary();
    assert!(summary["restarts"].is_null(), "{summary}");
    assert!(
        summary["not_restarted"].as_str().unwrap().contains("exit code 2"),
        "{summary}"
    );
    h.assert_no_processes();
}
