//! The docker backend against the machine's real engine, on the local base image
//! (scripts/base-image.sh), with the fake rank and the real runtime bind-mounted in.

use std::time::{Duration, Instant};

use crate::util::*;

fn fake_rank_config(h: &Harness, args: &str) -> std::path::PathBuf {
    base_image();
    h.config(&format!(
        "machines: [localhost, localhost]\ncontainer: {{build: '{}'}}\ncommand: ['{FAKE_RANK}', {args}]\n",
        local_context().display()
    ))
}

fn hosts_json(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("hosts.json")).expect("hosts.json")).unwrap()
}

#[test]
fn one_container_per_rank_succeeds_and_leaves_nothing() {
    let h = Harness::new("dk-rank");
    let config = fake_rank_config(&h, "--iterations, '3'");
    let run = h.run(&config, &["-v"]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["backend"], "docker");
    assert_eq!(summary["iterations_done"], 3);
    let hosts = hosts_json(&dir);
    assert_eq!(hosts[0]["host"], "localhost");
    assert!(
        hosts[0]["docker_version"]
            .as_str()
            .unwrap()
            .starts_with(char::is_numeric),
        "{hosts}"
    );
    assert!(
        hosts[0]["image_id"].as_str().unwrap().starts_with("sha256:"),
        "{hosts}"
    );
    let log = std::fs::read_to_string(dir.join("rank-1.log")).unwrap();
    assert!(log.contains("fake-rank 1/2 master 127.0.0.1:"), "{log}");
    // Two distinct containers ran, one per rank.
    let handles: Vec<&str> = summary["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["handle"].as_str().unwrap())
        .collect();
    assert_ne!(handles[0], handles[1]);
    h.assert_no_containers();
}

#[test]
fn one_container_per_host_runs_every_rank_inside_it() {
    let h = Harness::new("dk-host");
    let config = fake_rank_config(&h, "--iterations, '3'");
    let run = h.run(&config, &["--launch-single-container"]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    let handles: Vec<String> = summary["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["handle"]
                .as_str()
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(handles[0], handles[1], "both ranks in one container");
    assert!(std::fs::read_to_string(dir.join("rank-0.log"))
        .unwrap()
        .contains("local_rank 0"));
    assert!(std::fs::read_to_string(dir.join("rank-1.log"))
        .unwrap()
        .contains("local_rank 1"));
    h.assert_no_containers();
}

#[test]
fn an_unchanged_context_is_not_rebuilt() {
    base_image();
    let h = Harness::new("dk-cache");
    let ctx = h.dir.path().join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(
        ctx.join("Dockerfile"),
        format!("FROM stagehand-base:bookworm\nLABEL test={}\n", h.name),
    )
    .unwrap();
    let config = h.config(&format!(
        "machines: [localhost]\ncontainer: {{build: ctx}}\ncommand: ['{FAKE_RANK}', --iterations, '1']\n"
    ));
    /// Removes the test's image however the test ends.
    struct RemoveImage(String);
    impl Drop for RemoveImage {
        fn drop(&mut self) {
            let _ = std::process::Command::new("docker")
                .args(["rmi", &self.0])
                .output();
        }
    }
    let context_hash_tag = |run: &str| {
        let dir = std::fs::read_dir(h.dir.path().join(run))
            .ok()?
            .next()?
            .ok()?
            .path();
        hosts_json(&dir)[0]["image"].as_str().map(str::to_string)
    };
    let first = h.run_into(&config, &h.dir.path().join("a"), &[]);
    let _cleanup = context_hash_tag("a").map(RemoveImage);
    assert_eq!(first.code(), 0, "{}", first.stderr());
    let second = h.run_into(&config, &h.dir.path().join("b"), &[]);
    assert_eq!(second.code(), 0, "{}", second.stderr());
    let built = |sub: &str| {
        let dir = std::fs::read_dir(h.dir.path().join(sub))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        hosts_json(&dir)[0].clone()
    };
    let (a, b) = (built("a"), built("b"));
    assert_eq!(a["image_built"], true, "{a}");
    assert_eq!(b["image_built"], false, "{b}");
    assert_eq!(a["image_id"], b["image_id"]);
    let tag = a["image"].as_str().unwrap();
    assert!(
        tag.starts_with("stagehand-ctx:"),
        "tagged by the context hash: {tag}"
    );
    h.assert_no_containers();
    docker(&["rmi", tag]);
}

#[test]
fn a_killed_container_fails_the_run_and_everything_is_removed() {
    let h = Harness::new("dk-kill");
    let config = fake_rank_config(&h, "--iterations, '100000', --sleep-ms, '50'");
    let child = h.spawn(&config, &[]);
    h.wait_for_running(2, Duration::from_secs(60));
    let victim = containers_with_label("stagehand.rank=1")
        .into_iter()
        .find(|id| h.containers().contains(id));
    let victim = victim.expect("rank 1's container carries its rank label");
    let killed_at = Instant::now();
    docker(&["kill", &victim]);
    let (_, summary) = h.expect_stop(child, killed_at, Duration::from_secs(10), 1);
    assert_eq!(summary["status"], "failed");
    assert_eq!(summary["failure"]["cause"]["rank"], 1);
    assert_eq!(summary["failure"]["cause"]["exit_code"], 137);
    // Killed, but not for memory: nothing claims it was.
    assert!(
        summary["failure"]["cause"].get("out_of_memory").is_none(),
        "{summary}"
    );
    h.assert_no_containers();
}

/// A rank the kernel kills for lack of memory is reported as such, not as a bare exit code 137:
/// the engine says so (Docker's OOMKilled) when the rank's own container exits; a rank exec'd
/// into a per-host container, which runs on, is judged by the OOM kills its container's cgroup
/// counts. The rank here waits until the test has capped its container's memory (`docker
/// update`, as a host short of memory would leave it), then holds more than the cap.
#[test]
fn a_rank_killed_for_lack_of_memory_is_reported_as_such() {
    base_image();
    let script = "limit() { cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null | head -n 1; }\n\
                  n=0\n\
                  while [ \"$(limit)\" = max ] || [ \"$(limit)\" -gt 100000000 ]; do\n\
                  n=$((n + 1)); [ \"$n\" -gt 600 ] && exit 3; sleep 0.1\n\
                  done\n\
                  held=$(head -c 400000000 /dev/zero | tr '\\0' x)\n\
                  echo \"held ${#held} bytes\"\n";
    for (test, mode) in [
        ("dk-oom", &[][..]),
        ("dk-oom-host", &["--launch-single-container"][..]),
    ] {
        let h = Harness::new(test);
        let config = h.config(&format!(
            "machines: [localhost]\ncontainer: {{build: '{}'}}\ncommand: [sh, -c, {}]\n",
            local_context().display(),
            serde_json::to_string(script).unwrap()
        ));
        let child = h.spawn(&config, mode);
        let container = h.wait_for_running(1, Duration::from_secs(60)).remove(0);
        let capped_at = Instant::now();
        docker(&["update", "--memory", "32m", "--memory-swap", "32m", &container]);
        let (dir, summary) = h.expect_stop(child, capped_at, Duration::from_secs(60), 1);
        assert_rank_0_killed_for_memory(&summary, &format!("{mode:?}: "));
        let shown = h.driver(
            &[
                "results".as_ref(),
                "--format".as_ref(),
                "json".as_ref(),
                dir.as_os_str(),
            ],
            Duration::from_secs(60),
        );
        assert!(
            shown.stdout().contains("the kernel killed it for lack of memory"),
            "{mode:?}: {}",
            shown.stdout()
        );
        h.assert_no_containers();
    }
}

/// An image the driver did not build, here one holding a single file: no `/bin/sh` for the
/// lease guard every container starts its ranks with. Removed when dropped.
struct ShellLessImage(String);

impl ShellLessImage {
    fn import(h: &Harness) -> ShellLessImage {
        let dir = h.dir.path().join("shell-less");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hello"), "hello\n").unwrap();
        let tar = h.dir.path().join("shell-less.tar");
        let packed = std::process::Command::new("tar")
            .arg("-cf")
            .arg(&tar)
            .arg("-C")
            .arg(&dir)
            .arg("hello")
            .status()
            .unwrap();
        assert!(packed.success());
        let name = format!("stagehand-test-no-shell:{}", h.name);
        docker(&["import", tar.to_str().unwrap(), &name]);
        ShellLessImage(name)
    }
}

impl Drop for ShellLessImage {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker")
            .args(["rmi", "-f", &self.0])
            .output();
    }
}

/// An image without `/bin/sh` cannot run ranks: in either container mode the run fails with
/// the reason (a command not found, the image's own last line) and leaves nothing behind. With
/// one container per host, the engine refuses the ranks' execs, or runs and fails them, as the
/// container's guard dies; either way the container's end is reported.
#[test]
fn an_image_without_a_shell_fails_with_the_reason_in_either_container_mode() {
    let h = Harness::new("dk-noshell");
    let image = ShellLessImage::import(&h);
    let config = h.config(&format!(
        "machines: [localhost]\ncontainer: {{image: '{}'}}\ncommand: [/hello]\n",
        image.0
    ));
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert!(run.stderr().contains("exec /bin/sh failed"), "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("exited with code 127: a command was not found (a container needs /bin/sh"),
        "{}",
        run.stderr()
    );
    let (_, summary) = h.summary();
    assert_eq!(summary["failure"]["cause"]["exit_code"], 127, "{summary}");
    h.assert_no_containers();

    let h = Harness::new("dk-noshell-host");
    let config = h.config(&format!(
        "machines: [localhost, localhost]\ncontainer: {{image: '{}'}}\ncommand: [/hello]\n",
        image.0
    ));
    let run = h.run(&config, &["--launch-single-container"]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    let said = "the container for the ranks on localhost exited with code 127 before they could \
                start: a command was not found (a container needs /bin/sh";
    assert!(run.stderr().contains(said), "{}", run.stderr());
    assert!(
        run.stderr().contains("its last line: [FATAL tini"),
        "{}",
        run.stderr()
    );
    // The record says it too: as why the launch failed, or in the failed rank's last lines.
    let (_, summary) = h.summary();
    let failure = &summary["failure"];
    let recorded = failure["cause"]["reason"]
        .as_str()
        .is_some_and(|r| r.contains(said))
        || failure["last_lines"]
            .as_array()
            .is_some_and(|lines| lines.iter().any(|l| l.as_str().unwrap_or("").contains(said)));
    assert!(recorded, "{summary}");
    h.assert_no_containers();
}

#[test]
fn sigint_removes_every_container_and_records_interrupted() {
    let h = Harness::new("dk-int");
    let config = fake_rank_config(&h, "--iterations, '1', --hang");
    let child = h.spawn(&config, &["--launch-single-container"]);
    h.wait_for_running(1, Duration::from_secs(60));
    let record = wait_for_record(&h.records(), Duration::from_secs(10));
    wait_for_text(&record.join("rank-1.log"), "hanging", Duration::from_secs(20));
    let sent = Instant::now();
    interrupt(&child);
    let (_, summary) = h.expect_stop(child, sent, Duration::from_secs(10), 130);
    assert_eq!(summary["status"], "interrupted");
    h.assert_no_containers();
}

#[test]
fn a_terminal_that_went_away_removes_every_container_and_records_interrupted() {
    // An SSH session to the driver's machine drops: the driver's output goes nowhere and the
    // kernel sends it SIGHUP.
    let h = Harness::new("dk-hup");
    let config = fake_rank_config(&h, "--iterations, '1', --hang");
    let mut child = h.spawn(&config, &["-v"]);
    h.wait_for_running(2, Duration::from_secs(60));
    let record = wait_for_record(&h.records(), Duration::from_secs(10));
    wait_for_text(&record.join("rank-1.log"), "hanging", Duration::from_secs(20));
    drop(child.stdout.take());
    drop(child.stderr.take());
    let sent = Instant::now();
    send_signal(&child, "HUP");
    let (_, summary) = h.expect_stop(child, sent, Duration::from_secs(10), 130);
    assert_eq!(summary["status"], "interrupted");
    h.assert_no_containers();
}

#[test]
fn only_the_experiments_own_containers_are_touched() {
    base_image();
    let h = Harness::new("dk-bystander");
    let bystander_label = format!("stagehand.test-bystander={}", h.name);
    let bystander = docker(&[
        "run",
        "-d",
        "--label",
        &bystander_label,
        "--label",
        "stagehand.experiment=someone-else",
        "stagehand-base:bookworm",
        "sleep",
        "300",
    ]);
    let bystander = bystander.trim().to_string();
    let config = fake_rank_config(&h, "--iterations, '100', --fail-rank, '0', --fail-at, '1'");
    let run = h.run(&config, &[]);
    let survived = docker(&["inspect", "-f", "{{.State.Running}}", &bystander]);
    docker(&["rm", "-f", &bystander]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert_eq!(survived.trim(), "true", "an unrelated container was stopped");
    h.assert_no_containers();
}

/// A run restarted in containers, one per rank or one per host, gets new containers for its
/// second start and leaves none of either start behind.
#[test]
fn a_restarted_run_starts_new_containers_and_leaves_none() {
    for mode in [&[][..], &["--launch-single-container"][..]] {
        let h = Harness::new("dk-restart");
        let config = fake_rank_config(&h, "--iterations, '100', --fail-rank, '1', --fail-at, '1'");
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, format!("{text}max_restarts: 1\n")).unwrap();
        let run = h.run(&config, mode);
        assert_eq!(run.code(), 1, "{mode:?}: {}", run.stderr());
        let (dir, summary) = h.summary();
        assert_eq!(
            summary["restarts"].as_array().map(Vec::len),
            Some(1),
            "{mode:?}: {summary}"
        );
        assert_eq!(summary["failure"]["cause"]["exit_code"], 3, "{mode:?}: {summary}");
        let log = std::fs::read_to_string(dir.join("rank-1.log")).unwrap();
        assert_eq!(log.matches("failing on purpose").count(), 2, "{mode:?}: {log}");
        h.assert_no_containers();
    }
}

/// A host with InfiniBand verbs device files (a stand-in folder here, through
/// STAGEHAND_INFINIBAND_DIR, holding one character device) gives its containers the devices,
/// IPC_LOCK and unlimited locked memory, as NCCL's transport needs; an engine that may not raise
/// the locked-memory limit (this machine's: runc fails "setting rlimit type 8") gets a warning
/// that says how to fix it, and its containers run without (NCCL then talks TCP). `rdma: off`
/// gives nothing and warns of nothing.
#[test]
fn a_host_with_infiniband_gives_its_containers_the_devices_or_says_why_not() {
    base_image();
    let h = Harness::new("dk-rdma");
    let ib = h.dir.path().join("infiniband");
    std::fs::create_dir(&ib).unwrap();
    let made = std::process::Command::new("mknod")
        .args([ib.join("uverbs0").to_str().unwrap(), "c", "231", "192"])
        .status()
        .unwrap();
    assert!(made.success(), "mknod (the tests run as root)");
    let probe = "ls /dev/infiniband 2>&1; echo memlock $(ulimit -l); grep CapEff /proc/self/status";
    for setting in ["", "rdma: off\n"] {
        let config = h.config(&format!(
            "machines: [localhost]\ncontainer: {{build: '{}'}}\ncommand: [/bin/sh, -c, '{probe}']\n{setting}",
            local_context().display()
        ));
        let child = h.spawn_with_env(
            &config,
            &["-v"],
            &[("STAGEHAND_INFINIBAND_DIR", ib.to_str().unwrap())],
        );
        let out = wait_with_deadline(child, Duration::from_secs(120));
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{setting:?}: {stderr}");
        let (dir, _) = h.summary();
        let log = std::fs::read_to_string(dir.join("rank-0.log")).unwrap();
        let hosts = hosts_json(&dir);
        let caps = log
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .map(|c| u64::from_str_radix(c.trim(), 16).unwrap())
            .expect("the probe's CapEff line");
        const IPC_LOCK: u64 = 1 << 14;
        let refused = stderr.contains("cannot give its containers unlimited locked memory");
        if setting.is_empty() && !refused {
            // An engine that may: the container has the device, the capability, no limit.
            assert!(log.contains("uverbs0"), "{log}");
            assert!(log.contains("memlock unlimited"), "{log}");
            assert_ne!(caps & IPC_LOCK, 0, "{log}");
            assert_eq!(hosts[0]["infiniband"], true, "{hosts}");
            assert!(
                stderr.contains("InfiniBand devices given to its containers"),
                "{stderr}"
            );
        } else {
            if setting.is_empty() {
                assert!(
                    stderr.contains("LimitMEMLOCK=infinity") && stderr.contains("`rdma: off`"),
                    "{stderr}"
                );
            } else {
                assert!(!refused && !stderr.contains("InfiniBand"), "{stderr}");
            }
            assert!(!log.contains("uverbs0") && log.contains("No such file"), "{log}");
            assert!(!log.contains("memlock unlimited"), "{log}");
            assert_eq!(caps & IPC_LOCK, 0, "{log}");
            assert_eq!(hosts[0]["infiniband"], false, "{hosts}");
        }
        std::fs::remove_dir_all(h.records()).unwrap();
    }
    h.assert_no_containers();
}

#[test]
fn preflight_failures_name_the_host_and_start_nothing() {
    base_image();
    let h = Harness::new("dk-preflight");
    let cases = [
        (
            "machines: [localhost]\ncontainer: no-such-image:1\ncommand: [/bin/true]\n",
            "image no-such-image:1 does not exist on localhost",
        ),
        (
            "machines: [localhost, 127.0.0.9]\ncontainer: {build: ctx}\ncommand: [/bin/true]\n",
            "cannot open an SSH connection to 127.0.0.9",
        ),
    ];
    // A host without an NVIDIA driver is refused for the GPUs named on it before any image is
    // built (on a machine with one, the engine decides, as the next case shows).
    let cases: Vec<(&str, &str)> = match std::path::Path::new("/proc/driver/nvidia/version").exists() {
        true => cases.to_vec(),
        false => [
            &cases[..],
            &[(
                "machines: ['localhost:0']\ncontainer: {build: ctx}\ncommand: [/bin/true]\n",
                "`machines` gives the ranks on localhost GPUs [0], but localhost has no NVIDIA driver \
                 loaded (/proc/driver/nvidia/version is missing there); name it without GPU indices \
                 (`localhost` rather than `localhost:0`)",
            )],
        ]
        .concat(),
    };
    std::fs::create_dir(h.dir.path().join("ctx")).unwrap();
    std::fs::write(
        h.dir.path().join("ctx/Dockerfile"),
        "FROM stagehand-base:bookworm\n",
    )
    .unwrap();
    for (body, expected) in cases {
        let config = h.config(body);
        let run = h.run(&config, &[]);
        assert_eq!(run.code(), 3, "{body}: {}", run.stderr());
        assert!(run.stderr().contains(expected), "{body}: {}", run.stderr());
        assert!(run.stderr().contains("nothing was started"), "{}", run.stderr());
        assert!(!h.records().exists(), "no record when nothing started");
        h.assert_no_containers();
    }
}

#[test]
fn the_quickstart_trains_the_real_runtime_in_a_container() {
    runtime();
    base_image();
    let h = Harness::new("dk-quickstart");
    let run = h.run(&workspace().join("driver_configs/quickstart.yml"), &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["name"], "quickstart");
    assert_eq!(summary["world_size"], 2, "two data-parallel ranks");
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 20);
    assert!(summary["throughput"]["samples_per_sec_mean"].as_f64().unwrap() > 0.0);
    let metrics = lines(&dir.join("metrics.jsonl"));
    assert!(metrics[0].contains(r#""model":"mlp""#), "{metrics:?}");
    let id = summary["id"].as_str().unwrap();
    assert!(containers_with_label(&format!("stagehand.experiment={id}")).is_empty());
}

/// Waits until none of `h`'s containers runs; returns how long that took.
fn wait_until_none_runs(h: &Harness, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let running = h.running();
        if running.is_empty() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "containers of {} still running after {limit:?}: {running:?}",
            h.name
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_container_whose_driver_was_killed_stops_itself_when_its_lease_expires() {
    // One run per container mode, side by side: per rank (the guard runs the rank) and per host
    // (the guard is the idle process the ranks are exec'd into).
    let runs: Vec<(Harness, &[&str])> = vec![
        (Harness::new("dk-lease-rank"), &[]),
        (Harness::new("dk-lease-host"), &["--launch-single-container"]),
    ];
    let mut drivers = Vec::new();
    for (h, args) in &runs {
        let config = fake_rank_config(h, "--iterations, '1', --hang");
        drivers.push(h.spawn(&config, args));
    }
    let mut containers = Vec::new();
    for ((h, _), n) in runs.iter().zip([2, 1]) {
        containers.extend(h.wait_for_running(n, Duration::from_secs(60)));
    }
    // The driver renews each lease through the Docker API: the file's content changes.
    let lease = |id: &str| docker(&["exec", id, "cat", "/.stagehand-lease"]);
    let start = Instant::now();
    let first: Vec<String> = loop {
        let seen: Vec<Option<String>> = containers
            .iter()
            .map(|id| {
                let out = std::process::Command::new("docker")
                    .args(["exec", id, "cat", "/.stagehand-lease"])
                    .output()
                    .unwrap();
                out.status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
            })
            .collect();
        if seen.iter().all(Option::is_some) {
            break seen.into_iter().flatten().collect();
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "no lease written: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    std::thread::sleep(Duration::from_secs(6));
    for (id, before) in containers.iter().zip(&first) {
        assert_ne!(&lease(id), before, "the lease of {id} was not renewed");
    }

    for driver in &mut drivers {
        driver.kill().unwrap();
        driver.wait().unwrap();
    }
    let killed = Instant::now();
    for (h, _) in &runs {
        wait_until_none_runs(h, Duration::from_secs(45));
    }
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_secs(20),
        "the containers stopped {took:?} after the driver died, well before the lease's 30 s"
    );
    for id in &containers {
        let code = docker(&["inspect", "-f", "{{.State.ExitCode}}", id]);
        assert_eq!(code.trim(), "86", "container {id} did not stop for its lease");
        let logs = std::process::Command::new("docker")
            .args(["logs", id])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&logs.stderr);
        assert!(
            stderr.contains("stagehand-guard: the driver has not renewed this container's lease for 30 s"),
            "{id}: {stderr}"
        );
    }
    // The harnesses remove the stopped containers when dropped.
}

/// When the engine says a container was created and when its process started.
fn created_and_started(id: &str) -> (jiff::Timestamp, jiff::Timestamp) {
    let out = docker(&["inspect", "-f", "{{.Created}} {{.State.StartedAt}}", id]);
    let (created, started) = out.trim().split_once(' ').expect("two times");
    (created.parse().unwrap(), started.parse().unwrap())
}

#[test]
fn the_ranks_containers_are_created_and_started_concurrently() {
    base_image();
    let h = Harness::new("dk-concurrent");
    let config = h.config(&format!(
        "machines: [localhost, localhost, localhost, localhost]\ncontainer: {{build: '{}'}}\n\
         command: ['{FAKE_RANK}', --iterations, '1', --hang]\n",
        local_context().display()
    ));
    let child = h.spawn(&config, &[]);
    let ids = h.wait_for_running(4, Duration::from_secs(60));
    assert_eq!(ids.len(), 4, "one container per rank");
    // Each rank's launch is the interval from its container's creation to its process starting,
    // as the engine recorded them. Launched one after another, the intervals would not overlap
    // and the whole launch would span at least their sum; launched together they overlap, so the
    // span is shorter than the sum. Both sides are measured in the same launch, so a slow or busy
    // machine stretches them alike; no absolute time is assumed.
    let launches: Vec<_> = ids.iter().map(|id| created_and_started(id)).collect();
    let sum: f64 = launches
        .iter()
        .map(|(c, s)| s.duration_since(*c).as_secs_f64())
        .sum();
    let first = launches.iter().map(|(c, _)| *c).min().unwrap();
    let last = launches.iter().map(|(_, s)| *s).max().unwrap();
    let span = last.duration_since(first).as_secs_f64();
    eprintln!("launch span {span:.3} s, sum of the launches {sum:.3} s");
    let sent = Instant::now();
    interrupt(&child);
    let (_, summary) = h.expect_stop(child, sent, Duration::from_secs(15), 130);
    assert_eq!(summary["status"], "interrupted");
    assert!(
        span < sum,
        "the launches did not overlap: span {span:.3} s, sum of launches {sum:.3} s: {launches:?}"
    );
    h.assert_no_containers();
}

#[test]
fn a_dry_run_creates_no_container_and_no_record() {
    let h = Harness::new("dk-dry");
    let config = fake_rank_config(&h, "--iterations, '1'");
    let since = jiff::Timestamp::now();
    let run = h.run(&config, &["--dry-run"]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(
        run.stdout().contains("docker containers, one per rank"),
        "{}",
        run.stdout()
    );
    assert!(!h.records().exists(), "no record folder");
    // Not even a container created and removed again: the engine's event log has nothing of it.
    let until = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(1);
    let events = docker(&[
        "events",
        "--since",
        &since.as_second().to_string(),
        "--until",
        &until.as_second().to_string(),
        "--filter",
        &format!("label=stagehand.name={}", h.name),
    ]);
    assert!(events.trim().is_empty(), "{events}");
    h.assert_no_containers();
}
