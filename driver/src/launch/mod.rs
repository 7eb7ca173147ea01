//! Launching ranks and supervising them: the backends start ranks and turn their output into
//! events; [`supervise`] watches the events, stops every rank when one fails or the user
//! interrupts, and decides the run's status.

pub mod cleanup;
pub mod docker;
pub mod lease;
mod lines;
pub mod process;
pub mod reach;

use std::path::PathBuf;
use std::time::Duration;

use tokio::signal::unix::Signal;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::events::{Event, LeftContainer, Status, StopCause, Stream};
use crate::hosts::context::ContextError;
use crate::plan::Plan;
use crate::reporters::Reporters;

/// How long ranks get to report their exit after being stopped before the driver gives up on them.
const EXIT_DEADLINE: Duration = Duration::from_secs(15);

/// Failures while preparing hosts or starting ranks.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot start rank {rank}: `{program}`; check that it exists and is executable (build the runtime with `cargo build --release -p stagehand-runtime`, or pass --runtime)")]
    Spawn {
        rank: usize,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("program {} for the ranks does not exist; build the runtime with `cargo build --release -p stagehand-runtime`, pass --runtime, or set `command:`", path.display())]
    ProgramMissing { path: PathBuf },
    #[error("cannot reach the Docker engine on {host}; is it running, and may this user use its socket? (or use --backend process)")]
    Connect {
        host: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error(transparent)]
    Ssh(#[from] crate::hosts::ssh::SshError),
    #[error("docker on {host} could not {action}")]
    Docker {
        host: String,
        action: &'static str,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("host {host} has GPUs {gpus:?} requested but its engine has no nvidia runtime or CDI devices; install nvidia-container-toolkit there or use CPU machines")]
    NoGpuRuntime { host: String, gpus: Vec<u32> },
    #[error("{} does not exist on {host}; create it there, or drop it from data_dir, mounts or --mount-directories", path.display())]
    MountMissing { host: String, path: PathBuf },
    #[error("cannot pack {} to copy it into the containers on {host}", path.display())]
    Pack {
        host: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the runtime cannot start on {host}: {reason}; the image must hold what the runtime needs (see `runtime info`)")]
    SelfCheck { host: String, reason: String },
    #[error("host {host} should give its ranks GPUs {gpus:?}, but the runtime sees {seen} CUDA device(s) there ({why}); check the GPU indices and that the host's NVIDIA driver can run the image's CUDA")]
    GpusMissing {
        host: String,
        gpus: Vec<u32>,
        seen: usize,
        why: String,
    },
    #[error("{} cannot reach the master port at {addr}:{port} ({reason}); open that port to the other hosts on {first}, or set `master_addr:` to an address they reach it at", hosts.join(", "))]
    MasterUnreachable {
        hosts: Vec<String>,
        first: String,
        addr: String,
        port: u16,
        reason: String,
    },
    #[error("the runtime refuses the experiment's training request: {reason}; change the experiment file (`runtime --check` with a rank's arguments says the same)")]
    RequestRefused { reason: String },
    #[error("the engine on {host} cannot give a container GPUs {gpus:?}: {message}; check that these GPU indices exist there (`nvidia-smi -L`) and that the NVIDIA container toolkit is installed")]
    GpusUnavailable {
        host: String,
        gpus: Vec<u32>,
        message: String,
    },
    #[error("master port {port} is in use on {host}; pass another with --master-port, or leave it out to get a free one")]
    PortInUse { host: String, port: u16 },
    #[error("image {image} does not exist on {host}; build it there, or name a build context with `container: {{build: DIR}}`")]
    ImageMissing { host: String, image: String },
    #[error("building the image from {} on {host} failed: {message}", context.display())]
    ImageBuild {
        host: String,
        context: PathBuf,
        message: String,
    },
    #[error("sending image {image} from {from} to {to} failed: {message}")]
    ImageTransfer {
        from: String,
        to: String,
        image: String,
        message: String,
    },
    #[error(transparent)]
    Context {
        #[from]
        source: ContextError,
    },
    #[error("removing the experiment's containers on {host} took longer than {seconds} s")]
    CleanupTimeout { host: String, seconds: u64 },
    #[error("{} could not be removed, tried for {grace_s} s: {}; each stops itself once its lease has not been renewed for {ttl_s} s, but stays listed until removed: once its host answers, run {}", count(.left.len()), describe(.left), by_hand(.left), ttl_s = lease::LEASE_TTL.as_secs())]
    ContainersLeft { left: Vec<LeftContainer>, grace_s: u64 },
    #[error("interrupted before the ranks started")]
    Interrupted,
}

fn count(n: usize) -> String {
    match n {
        1 => "1 container of the experiment".to_string(),
        n => format!("{n} containers of the experiment"),
    }
}

/// `NAME (id ID, rank(s) R) on HOST: why`, for each container left.
fn describe(left: &[LeftContainer]) -> String {
    let one = |c: &LeftContainer| {
        let ranks: Vec<String> = c.ranks.iter().map(|r| r.to_string()).collect();
        let id: String = c.id.chars().take(12).collect();
        format!(
            "{} (id {id}, rank {}) on {}: {}",
            c.name,
            ranks.join(","),
            c.host,
            c.error
        )
    };
    left.iter().map(one).collect::<Vec<_>>().join("; ")
}

/// The commands that remove the containers left, each in backquotes.
fn by_hand(left: &[LeftContainer]) -> String {
    let commands: Vec<String> = left.iter().map(|c| format!("`{}`", c.remove_by_hand)).collect();
    commands.join(", ")
}

/// Turns an output line into an event: metrics lines on stdout become [`Event::Metrics`].
pub fn classify_line(rank: usize, stream: Stream, line: String) -> Event {
    if stream == Stream::Stdout {
        if let Some(event) = stagehand_contract::Event::parse_line(&line) {
            return Event::Metrics { rank, line, event };
        }
    }
    Event::LineLogged { rank, stream, line }
}

/// A started backend.
pub enum Launcher {
    /// Local processes.
    Process(process::ProcessLauncher),
    /// Docker containers.
    Docker(docker::DockerLauncher),
}

impl Launcher {
    /// Stops every rank (and removes every container) this launcher started.
    pub async fn stop_all(&self) {
        match self {
            Launcher::Process(p) => p.stop_all().await,
            // One quick try: what it leaves is tried again, and reported, when the run ends.
            Launcher::Docker(d) => {
                let _ = d.remove_all(std::time::Duration::ZERO).await;
            }
        }
    }
}

/// Signals that stop a run: SIGINT (Ctrl-C) and SIGTERM.
pub struct StopSignals {
    /// SIGINT.
    pub int: Signal,
    /// SIGTERM.
    pub term: Signal,
}

impl StopSignals {
    /// Installs the handlers; from now on these signals are the driver's to act on.
    pub fn install() -> std::io::Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(StopSignals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
        })
    }

    /// Resolves when either signal arrives.
    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}

/// Feeds events to the reporters until every rank has exited; stops all ranks on the first failure
/// or signal. Returns the run's status.
pub async fn supervise(
    plan: &Plan,
    launcher: &Launcher,
    mut events: UnboundedReceiver<Event>,
    reporters: &mut Reporters,
    signals: &mut StopSignals,
) -> Status {
    // Ranks seen to exit, removed, or lost with their host: no more to hear from them.
    let mut ended = 0;
    let mut cause: Option<StopCause> = None;
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let until_deadline = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            e = events.recv() => match e {
                Some(e) => e,
                None => break,
            },
            _ = signals.recv(), if cause.is_none() => {
                let c = StopCause::Interrupted;
                cause = Some(c.clone());
                deadline = Some(tokio::time::Instant::now() + EXIT_DEADLINE);
                reporters.report(&Event::Stopping(c));
                launcher.stop_all().await;
                continue;
            }
            _ = until_deadline => break,
        };
        reporters.report(&event);
        let stop = match &event {
            Event::RankExited { rank, exit_code } => {
                ended += 1;
                (*exit_code != Some(0)).then(|| StopCause::RankFailed {
                    rank: *rank,
                    host: plan.host_of(*rank).name.clone(),
                    exit_code: *exit_code,
                })
            }
            // Removed by the driver while stopping, or by someone else: then the rank failed.
            Event::RankRemoved { rank } => {
                ended += 1;
                Some(StopCause::RankFailed {
                    rank: *rank,
                    host: plan.host_of(*rank).name.clone(),
                    exit_code: None,
                })
            }
            Event::HostLost { host, reason } | Event::RankLost { host, reason, .. } => {
                if matches!(event, Event::RankLost { .. }) {
                    ended += 1;
                }
                Some(StopCause::HostLost {
                    host: host.clone(),
                    reason: reason.clone(),
                })
            }
            Event::HostReady(_)
            | Event::RankStarted { .. }
            | Event::LineLogged { .. }
            | Event::Metrics { .. }
            | Event::Profiling { .. }
            | Event::ProfileLine { .. }
            | Event::Planned(_)
            | Event::Stopping(_)
            | Event::ContainersLeft(_)
            | Event::Finished { .. } => None,
        };
        if let (Some(c), None) = (stop, &cause) {
            cause = Some(c.clone());
            deadline = Some(tokio::time::Instant::now() + EXIT_DEADLINE);
            reporters.report(&Event::Stopping(c));
            launcher.stop_all().await;
        }
        if ended == plan.world_size() {
            break;
        }
    }
    match cause {
        None => Status::Succeeded,
        Some(StopCause::Interrupted) => Status::Interrupted,
        Some(
            StopCause::RankFailed { .. }
            | StopCause::HostLost { .. }
            | StopCause::ProfileFailed { .. }
            | StopCause::PlanFailed { .. },
        ) => Status::Failed,
    }
}
