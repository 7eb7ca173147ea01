//! The process backend: ranks as local child processes, each in its own process group so the
//! driver alone decides when they stop (a terminal Ctrl-C reaches only the driver).

use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::AsyncRead;
use tokio::process::Command;
use tokio::sync::mpsc::UnboundedSender;

use super::lines::for_each_line;
use super::{classify_line, oom, LaunchError};
use crate::events::{Event, Stream};
use crate::experiment::Experiment;

/// Time between SIGTERM and SIGKILL when stopping ranks.
const GRACE: Duration = Duration::from_secs(3);
/// How long a rank's output may go on after it exited: what it wrote before is read within
/// milliseconds, so output still open after this is held by a process it left behind.
const DRAIN: Duration = Duration::from_secs(5);
/// How often [`ProcessLauncher::finish`] looks for what is left of the ranks' process groups.
const POLL: Duration = Duration::from_millis(50);

/// Running child processes.
pub struct ProcessLauncher {
    groups: Vec<Pid>,
    /// Set once the driver sends its ranks SIGKILL, after which a SIGKILL death is its own doing.
    killing: Arc<AtomicBool>,
}

impl ProcessLauncher {
    /// Starts every rank; events go to `tx`.
    pub fn start(plan: &Experiment, tx: UnboundedSender<Event>) -> Result<ProcessLauncher, LaunchError> {
        let mut launcher = ProcessLauncher {
            groups: Vec::new(),
            killing: Arc::new(AtomicBool::new(false)),
        };
        // The ranks share the driver's memory cgroup: a kill counted there while they run, with a
        // rank dead of SIGKILL the driver did not send, is the kernel's OOM killer.
        let kills_before = oom::kills();
        for rank in &plan.ranks {
            let program = &rank.argv[0];
            let mut cmd = Command::new(program);
            cmd.args(&rank.argv[1..])
                .envs(&rank.env)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .kill_on_drop(true);
            super::ends_with_the_driver(&mut cmd);
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(source) => {
                    launcher.kill_now();
                    return Err(LaunchError::Spawn {
                        rank: rank.rank,
                        program: program.clone(),
                        source,
                    });
                }
            };
            let pid = child.id().expect("a just-spawned child has a pid");
            launcher.groups.push(Pid::from_raw(pid as i32));
            let _ = tx.send(Event::RankStarted {
                rank: rank.rank,
                host: plan.host_of(rank.rank).name.clone(),
                handle: format!("pid {pid}"),
            });
            let out = tokio::spawn(forward(
                child.stdout.take().expect("piped"),
                rank.rank,
                Stream::Stdout,
                tx.clone(),
            ));
            let err = tokio::spawn(forward(
                child.stderr.take().expect("piped"),
                rank.rank,
                Stream::Stderr,
                tx.clone(),
            ));
            let tx = tx.clone();
            let r = rank.rank;
            let killing = launcher.killing.clone();
            let group = Pid::from_raw(pid as i32);
            tokio::spawn(async move {
                let exit_code = match child.wait().await {
                    Ok(status) => exit_code(status),
                    Err(_) => None,
                };
                // Its output is read to the end before its exit is told (the failure's last lines).
                // A process it left behind that holds the output open would hold that back for
                // ever: after DRAIN its group is killed, which closes the output.
                let aborts = [out.abort_handle(), err.abort_handle()];
                let mut readers = futures_util::future::join(out, err);
                if tokio::time::timeout(DRAIN, &mut readers).await.is_err() {
                    let _ = killpg(group, Signal::SIGKILL);
                    if tokio::time::timeout(DRAIN, &mut readers).await.is_err() {
                        aborts.iter().for_each(tokio::task::AbortHandle::abort);
                    }
                }
                let out_of_memory = exit_code == Some(oom::SIGKILLED)
                    && !killing.load(Ordering::SeqCst)
                    && kills_before
                        .zip(oom::kills())
                        .is_some_and(|(before, now)| now > before);
                let _ = tx.send(Event::RankExited {
                    rank: r,
                    exit_code,
                    out_of_memory,
                });
            });
        }
        Ok(launcher)
    }

    /// Asks every rank's process group to stop, then kills what is left after a grace period.
    pub async fn stop_all(&self) {
        self.stop_all_within(GRACE).await;
    }

    /// [`ProcessLauncher::stop_all`] with a grace of `grace` (long enough for a checkpoint).
    pub async fn stop_all_within(&self, grace: Duration) {
        self.signal_all(Signal::SIGTERM);
        let groups = self.groups.clone();
        let killing = self.killing.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            killing.store(true, Ordering::SeqCst);
            for g in groups {
                let _ = killpg(g, Signal::SIGKILL);
            }
        });
    }

    /// Stops what is left of the ranks' process groups once the ranks have exited (processes
    /// they started): SIGTERM, then SIGKILL to what is still there after [`GRACE`]. Returns once
    /// every group is gone or killed, so nothing outlives the driver.
    pub async fn finish(&self) {
        self.signal_all(Signal::SIGTERM);
        let deadline = tokio::time::Instant::now() + GRACE;
        // Signal 0 only asks whether the group still has a process.
        while self.groups.iter().any(|&g| killpg(g, None).is_ok()) {
            if tokio::time::Instant::now() >= deadline {
                self.kill_now();
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn kill_now(&self) {
        self.killing.store(true, Ordering::SeqCst);
        self.signal_all(Signal::SIGKILL);
    }

    fn signal_all(&self, signal: Signal) {
        for &g in &self.groups {
            // ESRCH just means the group is already gone.
            let _ = killpg(g, signal);
        }
    }
}

/// Exit code as a shell reports it: 128 + signal for a killed process.
fn exit_code(status: std::process::ExitStatus) -> Option<i64> {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .map(i64::from)
        .or_else(|| status.signal().map(|s| 128 + i64::from(s)))
}

async fn forward(stream: impl AsyncRead + Unpin, rank: usize, kind: Stream, tx: UnboundedSender<Event>) {
    for_each_line(stream, |line| {
        let _ = tx.send(classify_line(rank, kind, line));
    })
    .await;
}
