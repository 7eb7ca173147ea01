//! The integration tests' harness: a scratch folder per test, the driver binary run on a YAML
//! written there, its record read back, and independent witnesses of what it left: the Docker
//! engine (through the docker CLI) for the test's containers, `/proc` for its processes.
//!
//! Both test binaries use it. The `local` binary's tests must run without a Docker engine, so its
//! crate root sets `USES_DOCKER = false` and every docker helper here refuses to run there.

#![allow(dead_code)]

pub mod experiments;
pub mod sshd;
pub mod testbed;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The driver under test.
pub const DRIVER: &str = env!("CARGO_BIN_EXE_driver");
/// The stand-in rank program.
pub const FAKE_RANK: &str = env!("CARGO_BIN_EXE_fake-rank");
/// Set on every driver the harness starts, to the harness's name, and so inherited by every
/// process the driver starts (ranks, profiles, checks): how the harness finds what was left.
pub const MARKER: &str = "STAGEHAND_TEST_HARNESS";

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The real runtime, built by `cargo build --release -p stagehand-runtime` (scripts/setup.sh).
pub fn runtime() -> PathBuf {
    let path = std::env::var_os("STAGEHAND_RUNTIME")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/release/runtime"));
    assert!(
        path.exists(),
        "the end-to-end tests need the real runtime at {}; build it with scripts/setup.sh \
         (cargo build --release -p stagehand-runtime)",
        path.display()
    );
    path
}

/// Makes sure the local base image exists (scripts/base-image.sh is idempotent), once per run.
pub fn base_image() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let status = Command::new(workspace().join("scripts/base-image.sh"))
            .status()
            .expect("run base-image.sh");
        assert!(status.success(), "scripts/base-image.sh failed");
    });
}

/// The local CPU build context.
pub fn local_context() -> PathBuf {
    workspace().join("docker/local")
}

/// One test's scratch space and experiment name.
pub struct Harness {
    /// Scratch folder (YAML files, records).
    pub dir: tempfile::TempDir,
    /// Unique experiment name; containers carry it in the `stagehand.name` label.
    pub name: String,
}

/// What a finished driver run left.
pub struct Run {
    pub output: Output,
    pub elapsed: Duration,
}

impl Run {
    pub fn code(&self) -> i32 {
        self.output.status.code().unwrap_or(-1)
    }

    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }

    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }
}

impl Harness {
    pub fn new(test: &str) -> Harness {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        Harness {
            dir: tempfile::tempdir().expect("scratch dir"),
            name: format!("t-{test}-{}-{n}", std::process::id()),
        }
    }

    /// Writes the experiment file, with `name:` set to this harness's name.
    pub fn config(&self, body: &str) -> PathBuf {
        let path = self.dir.path().join("exp.yml");
        std::fs::write(&path, format!("name: {}\n{body}", self.name)).unwrap();
        path
    }

    /// The record folder parent.
    pub fn records(&self) -> PathBuf {
        self.dir.path().join("records")
    }

    fn command(&self, config: &Path, args: &[&str]) -> Command {
        self.command_into(config, &self.records(), args)
    }

    fn command_into(&self, config: &Path, records: &Path, args: &[&str]) -> Command {
        let mut cmd = self.driver_command(&[]);
        cmd.arg("--config-file")
            .arg(config)
            .arg("--output-dir")
            .arg(records)
            .args(args);
        cmd
    }

    /// Runs the driver to completion (at most 120 s).
    pub fn run(&self, config: &Path, args: &[&str]) -> Run {
        let start = Instant::now();
        let child = self.command(config, args).spawn().expect("start driver");
        let output = wait_with_deadline(child, Duration::from_secs(120));
        Run {
            output,
            elapsed: start.elapsed(),
        }
    }

    /// Runs the driver to completion (at most 120 s) inside the cgroup whose member list is
    /// `procs`: a shell joins it (the path as a positional parameter), then becomes the driver.
    pub fn run_in_cgroup(&self, procs: &Path, config: &Path, args: &[&str]) -> Run {
        let driver = self.command(config, args);
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "echo $$ >\"$1\" && shift && exec \"$@\"", "sh"])
            .arg(procs)
            .arg(driver.get_program())
            .args(driver.get_args())
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, value) in driver.get_envs() {
            match value {
                Some(value) => cmd.env(key, value),
                None => cmd.env_remove(key),
            };
        }
        let start = Instant::now();
        let output = wait_with_deadline(cmd.spawn().expect("start driver"), Duration::from_secs(120));
        Run {
            output,
            elapsed: start.elapsed(),
        }
    }

    /// Runs the driver to completion (at most `deadline`) without `--runtime`: the ranks run the
    /// runtime image built from the workspace's source.
    pub fn run_image_mode(&self, config: &Path, args: &[&str], deadline: Duration) -> Run {
        let start = Instant::now();
        let output = wait_with_deadline(self.spawn_image_mode(config, args), deadline);
        Run {
            output,
            elapsed: start.elapsed(),
        }
    }

    /// Starts the driver without `--runtime`, as [`Harness::run_image_mode`] runs it, and
    /// returns it running.
    pub fn spawn_image_mode(&self, config: &Path, args: &[&str]) -> Child {
        self.command(config, args)
            .env_remove("STAGEHAND_RUNTIME")
            .spawn()
            .expect("start driver")
    }

    /// Runs the driver to completion with its record under `records`.
    pub fn run_into(&self, config: &Path, records: &Path, args: &[&str]) -> Run {
        let start = Instant::now();
        let child = self
            .command_into(config, records, args)
            .spawn()
            .expect("start driver");
        let output = wait_with_deadline(child, Duration::from_secs(120));
        Run {
            output,
            elapsed: start.elapsed(),
        }
    }

    /// Starts the driver and returns it running.
    pub fn spawn(&self, config: &Path, args: &[&str]) -> Child {
        self.command(config, args).spawn().expect("start driver")
    }

    /// [`Harness::spawn`] with SIGHUP ignored in the driver, as `nohup` starts a program.
    pub fn spawn_ignoring_hangups(&self, config: &Path, args: &[&str]) -> Child {
        use std::os::unix::process::CommandExt;
        let mut cmd = self.command(config, args);
        // SAFETY: between fork and exec only the async-signal-safe sigaction runs; it runs after
        // `driver_command`'s, so hang-ups end up ignored.
        unsafe {
            cmd.pre_exec(|| set_hangups(nix::sys::signal::SigHandler::SigIgn));
        }
        cmd.spawn().expect("start driver")
    }

    /// [`Harness::spawn`] with these variables added to the driver's environment.
    pub fn spawn_with_env(&self, config: &Path, args: &[&str], env: &[(&str, &str)]) -> Child {
        let mut cmd = self.command(config, args);
        cmd.envs(env.iter().copied());
        cmd.spawn().expect("start driver")
    }

    /// Waits for a driver that a fault or a signal at `since` must stop: it exits with `code`
    /// within `limit` of `since`. Returns the record folder and its summary.
    pub fn expect_stop(&self, child: Child, since: Instant, limit: Duration, code: i32) -> (PathBuf, Value) {
        let out = wait_with_deadline(child, limit + Duration::from_secs(20));
        assert!(since.elapsed() < limit, "stopping took {:?}", since.elapsed());
        assert_eq!(
            out.status.code(),
            Some(code),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.summary()
    }

    /// The only record folder written so far, and its summary.
    pub fn summary(&self) -> (PathBuf, Value) {
        let dirs: Vec<PathBuf> = std::fs::read_dir(self.records())
            .expect("records folder")
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(dirs.len(), 1, "expected one record folder, found {dirs:?}");
        let text = std::fs::read_to_string(dirs[0].join("summary.json")).expect("summary.json");
        (
            dirs[0].clone(),
            serde_json::from_str(&text).expect("summary.json is JSON"),
        )
    }

    /// Ids of the containers (running or not) labelled with this test's experiment name, or with
    /// one of its sweep points' names (`<name>-p<N>`).
    pub fn containers(&self) -> Vec<String> {
        let point = format!("{}-p", self.name);
        docker(&[
            "ps",
            "-a",
            "--filter",
            "label=stagehand.name",
            "--format",
            "{{.ID}} {{.Label \"stagehand.name\"}}",
        ])
        .lines()
        .filter_map(|line| line.split_once(' '))
        .filter(|(_, name)| *name == self.name || name.starts_with(&point))
        .map(|(id, _)| id.to_string())
        .collect()
    }

    /// Runs the driver with exactly these arguments (a subcommand and its flags) in the scratch
    /// folder, killing it past `deadline`.
    pub fn driver(&self, args: &[&std::ffi::OsStr], deadline: Duration) -> Run {
        let start = Instant::now();
        let child = self.driver_command(args).spawn().expect("start driver");
        let output = wait_with_deadline(child, deadline);
        Run {
            output,
            elapsed: start.elapsed(),
        }
    }

    /// [`Harness::driver`] with these variables added to the driver's environment.
    pub fn driver_with_env(
        &self,
        args: &[&std::ffi::OsStr],
        env: &[(&str, &str)],
        deadline: Duration,
    ) -> Run {
        let start = Instant::now();
        let mut cmd = self.driver_command(args);
        cmd.envs(env.iter().copied());
        let output = wait_with_deadline(cmd.spawn().expect("start driver"), deadline);
        Run {
            output,
            elapsed: start.elapsed(),
        }
    }

    /// Starts the driver with exactly these arguments and returns it running.
    pub fn spawn_driver(&self, args: &[&std::ffi::OsStr]) -> Child {
        self.driver_command(args).spawn().expect("start driver")
    }

    /// The driver with SIGHUP at its default, as a terminal starts it, whatever this test process
    /// inherited: under `nohup scripts/test` every child would otherwise start with hang-ups
    /// ignored, and a driver so started rightly runs on through one (the tests that send it
    /// SIGHUP would fail). [`Harness::spawn_ignoring_hangups`] ignores them again on purpose.
    fn driver_command(&self, args: &[&std::ffi::OsStr]) -> Command {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(DRIVER);
        // SAFETY: between fork and exec only the async-signal-safe sigaction runs.
        unsafe {
            cmd.pre_exec(|| set_hangups(nix::sys::signal::SigHandler::SigDfl));
        }
        if !crate::USES_DOCKER {
            // The `local` binary's tests prove on every run that they need no engine.
            cmd.env("DOCKER_HOST", "unix:///nonexistent.sock");
        }
        cmd.args(args)
            .env("STAGEHAND_RUNTIME", runtime_or_placeholder())
            .env(MARKER, &self.name)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// The only sweep folder under the records folder.
    pub fn sweep_dir(&self) -> PathBuf {
        let dirs: Vec<PathBuf> = std::fs::read_dir(self.records())
            .expect("records folder")
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(dirs.len(), 1, "expected one sweep folder, found {dirs:?}");
        assert!(
            dirs[0].join("sweep.json").is_file(),
            "{} has no sweep.json",
            dirs[0].display()
        );
        dirs[0].clone()
    }

    /// Asserts that the engine holds none of this test's containers.
    pub fn assert_no_containers(&self) {
        let left = self.containers();
        assert!(left.is_empty(), "containers left behind: {left:?}");
    }

    /// Live processes started by this test's drivers (they carry [`MARKER`] set to this
    /// harness's name in their environment), each as its pid and command line. The drivers
    /// themselves are included while they run.
    pub fn processes(&self) -> Vec<(u32, String)> {
        let marker = format!("{MARKER}={}", self.name);
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                // A zombie's (or a vanished process's) environment reads as empty: not live.
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == marker.as_bytes()))
            })
            .map(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                (pid, String::from_utf8_lossy(&cmdline).replace('\0', " "))
            })
            .collect()
    }

    /// Asserts that no process this test's drivers started is left. Call it once every driver
    /// of the test has exited. A rank the driver stopped may take a moment to be gone after the
    /// driver exits (its SIGKILL is asynchronous), so the check waits up to 10 s for them to go;
    /// a leaked rank (a process backend that forgot one, or a `--hang` rank) never goes.
    pub fn assert_no_processes(&self) {
        let start = Instant::now();
        loop {
            let left = self.processes();
            if left.is_empty() {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "processes left behind: {left:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Ids of this test's running containers on the machine's engine.
    pub fn running(&self) -> Vec<String> {
        let filter = format!("label=stagehand.name={}", self.name);
        docker(&["ps", "-q", "--filter", &filter])
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Waits until `n` containers of this test are running.
    pub fn wait_for_running(&self, n: usize, timeout: Duration) -> Vec<String> {
        let start = Instant::now();
        loop {
            let ids = self.running();
            if ids.len() >= n {
                return ids;
            }
            assert!(
                start.elapsed() < timeout,
                "only {} of {n} containers running",
                ids.len()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // A failed assertion must not leak processes or containers into the next test run.
        for (pid, _) in self.processes() {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).output();
        }
        if crate::USES_DOCKER {
            for id in self.containers() {
                let _ = Command::new("docker").args(["rm", "-f", &id]).output();
            }
        }
    }
}

fn runtime_or_placeholder() -> PathBuf {
    std::env::var_os("STAGEHAND_RUNTIME")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/release/runtime"))
}

/// Runs the docker CLI and returns its stdout.
pub fn docker(args: &[&str]) -> String {
    if !crate::USES_DOCKER {
        panic!(
            "docker {args:?} from a test of the `local` binary, which must run without a Docker \
         engine; move the test to the `integration` binary (tests.rs)"
        );
    }
    let out = Command::new("docker").args(args).output().expect("docker CLI");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn containers_with_label(label: &str) -> Vec<String> {
    docker(&["ps", "-aq", "--filter", &format!("label={label}")])
        .lines()
        .map(str::to_string)
        .collect()
}

/// How long a driver past its deadline has to stop after a Ctrl-C before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(60);

/// Waits for a child; past the deadline it is interrupted (killed if that does not stop it) and
/// the test fails.
pub fn wait_with_deadline(child: Child, deadline: Duration) -> Output {
    wait_or_explain(child, |waited| {
        (waited > deadline).then(|| format!("did not finish within {deadline:?}"))
    })
}

/// How long [`wait_for_recorded_run`] waits for a run that keeps reporting.
const CRAWL_LIMIT: Duration = Duration::from_secs(900);

/// Waits for the driver of the run recorded in `record`, for as long as its ranks keep writing
/// metrics: it gives up (as [`wait_with_deadline`] does) once `metrics.jsonl` has been quiet for
/// `quiet`, or after [`CRAWL_LIMIT`]. A run that hangs fails as soon as it goes quiet, while one
/// that only crawls on a busy machine (a `slowdown:` factor stretches every stall the scheduler
/// adds to a rank's compute) is let finish. The failure says how far each rank got and when it
/// last reported.
pub fn wait_for_recorded_run(child: Child, quiet: Duration, record: &Path) -> Output {
    let metrics = record.join("metrics.jsonl");
    wait_or_explain(child, |waited| {
        let silent = quiet_for(&metrics).map_or(waited, |since| since.min(waited));
        let why = if silent > quiet {
            format!("went quiet: no metrics for {quiet:?}")
        } else if waited > CRAWL_LIMIT {
            format!("did not finish within {CRAWL_LIMIT:?}")
        } else {
            return None;
        };
        Some(format!("{why}{}", progress(record)))
    })
}

/// Each rank's starts and last iteration in the record's metrics.jsonl, and how long ago the
/// file was last written.
fn progress(record: &Path) -> String {
    let metrics = record.join("metrics.jsonl");
    let mut ranks: BTreeMap<u64, (usize, Option<u64>)> = BTreeMap::new();
    for line in lines(&metrics) {
        let Ok(event) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let (Some(rank), Some(kind)) = (event["rank"].as_u64(), event["event"].as_str()) else {
            continue;
        };
        let seen = ranks.entry(rank).or_default();
        match kind {
            "start" => seen.0 += 1,
            "iteration" => seen.1 = event["iteration"].as_u64(),
            _ => {}
        }
    }
    let said: Vec<String> = ranks
        .iter()
        .map(|(rank, (starts, last))| match last {
            Some(i) => format!("rank {rank}: {starts} start(s), last at iteration {i}"),
            None => format!("rank {rank}: {starts} start(s), no iteration"),
        })
        .collect();
    let quiet = quiet_for(&metrics).map_or("never written".to_string(), |d| {
        format!("last written {d:.0?} ago")
    });
    format!(
        " (the ranks' progress: {}; metrics.jsonl {quiet})",
        said.join("; ")
    )
}

/// How long ago `file` was last written; `None` if it was never written.
fn quiet_for(file: &Path) -> Option<Duration> {
    std::fs::metadata(file)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
}

/// Waits for `child` until `overdue`, given how long it has waited, says why it gives up; then
/// the child is interrupted (killed if that does not stop it) and the test fails with the reason.
fn wait_or_explain(mut child: Child, overdue: impl Fn(Duration) -> Option<String>) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if let Some(why) = overdue(start.elapsed()) {
            // Ctrl-C first, so the driver stops its ranks, cancels its Slurm job and writes its
            // record: a hung run must not leave work behind that holds up the tests after it
            // (Slurm's one node), and its stderr then says how far it got.
            interrupt(&child);
            let interrupted = Instant::now();
            while child.try_wait().expect("wait").is_none() && interrupted.elapsed() < STOP_GRACE {
                std::thread::sleep(Duration::from_millis(50));
            }
            let stopped = match child.try_wait().expect("wait") {
                Some(_) => "it then stopped on Ctrl-C".to_string(),
                None => {
                    let _ = child.kill();
                    format!("nor within {STOP_GRACE:?} of a Ctrl-C, so it was killed")
                }
            };
            let out = child.wait_with_output().expect("output");
            panic!(
                "driver {why}; {stopped}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sets this process's SIGHUP disposition (in a child between fork and exec).
fn set_hangups(handler: nix::sys::signal::SigHandler) -> std::io::Result<()> {
    // SAFETY: SIG_DFL and SIG_IGN install no handler code.
    unsafe { nix::sys::signal::signal(nix::sys::signal::Signal::SIGHUP, handler) }
        .map(|_| ())
        .map_err(std::io::Error::from)
}

/// Kills process `pid` with SIGKILL, as the kernel's OOM killer would end it.
pub fn kill_hard(pid: &str) {
    let killed = Command::new("kill").args(["-KILL", pid]).status().unwrap();
    assert!(killed.success(), "kill -KILL {pid}");
}

/// Sends SIGINT to a child, as Ctrl-C would.
pub fn interrupt(child: &Child) {
    send_signal(child, "INT");
}

/// Sends the signal named `name` (`INT`, `TERM`, `HUP`) to a child.
pub fn send_signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Waits until `path` contains `needle` (a log the driver writes as the run goes).
pub fn wait_for_text(path: &Path, needle: &str, timeout: Duration) {
    let start = Instant::now();
    loop {
        if std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)) {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{} never contained {needle:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The record folder of a run still going (created before the ranks start).
pub fn wait_for_record(records: &Path, timeout: Duration) -> PathBuf {
    let start = Instant::now();
    loop {
        if let Some(Ok(entry)) = std::fs::read_dir(records).ok().and_then(|mut d| d.next()) {
            return entry.path();
        }
        assert!(
            start.elapsed() < timeout,
            "no record folder appeared in {}",
            records.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that a run's summary records rank 0 as its failure, killed by the kernel for lack of
/// memory (exit code 137, `out_of_memory`); `what` prefixes the message.
pub fn assert_rank_0_killed_for_memory(summary: &Value, what: &str) {
    let cause = &summary["failure"]["cause"];
    assert_eq!(
        (cause["rank"].as_u64(), cause["exit_code"].as_i64()),
        (Some(0), Some(137)),
        "{what}{summary}"
    );
    assert_eq!(cause["out_of_memory"], true, "{what}{summary}");
}

/// A sweep folder's index.
pub fn sweep_index(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("sweep.json")).expect("sweep.json"))
        .expect("sweep.json is JSON")
}

/// Each point's status in a sweep folder's index.
pub fn point_statuses(dir: &Path) -> Vec<String> {
    sweep_index(dir)["points"]
        .as_array()
        .expect("points")
        .iter()
        .map(|p| p["status"].as_str().unwrap().to_string())
        .collect()
}

/// The record folders inside a sweep folder.
pub fn point_records(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("sweep folder")
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Lines of a text file.
pub fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}
