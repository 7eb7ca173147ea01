//! Launching ranks and supervising them: the backends start ranks and turn their output into
//! events; [`supervise`] watches the events, stops every rank when one fails or the user
//! interrupts, and decides the run's status.

pub mod cleanup;
pub mod docker;
mod labels;
pub mod lease;
mod lines;
mod oom;
pub mod process;
pub mod reach;
pub mod restart;
pub mod slurm;
#[cfg(test)]
mod test_engine;
pub mod traces;

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::events::{Ended, Event, LeftContainer, SlurmEvent, StopCause, StopNow, Stream};
use crate::experiment::Experiment;
use crate::hosts::{Host, HostError, SshOptions};
use crate::reporters::Reporters;
use crate::signals::StopSignals;

/// How long ranks get to report their exit after being stopped before the driver gives up on them.
const EXIT_DEADLINE: Duration = Duration::from_secs(15);
/// How long ranks that checkpoint have, once interrupted, to write the checkpoint of the
/// iteration they are in and exit (SIGTERM; SIGKILL after it).
pub const CHECKPOINT_GRACE: Duration = Duration::from_secs(60);

/// Has the process `cmd` starts (a rank, srun) get SIGTERM when the driver dies, as it would if
/// the driver stopped it: a driver ended outright (SIGKILL, the kernel's OOM killer) leaves no
/// rank, and no srun holding a Slurm job, running on without it. The kernel sends the signal when
/// the thread that started the process ends; the driver starts them from its main thread or its
/// runtime's worker threads, which last as long as it does (never from `spawn_blocking`, whose
/// threads end when idle).
fn ends_with_the_driver(cmd: &mut tokio::process::Command) {
    let driver = nix::unistd::getpid();
    // SAFETY: between fork and exec this calls only prctl and getppid, which are async-signal-safe,
    // and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)?;
            // The driver died before that took hold: no signal would come.
            if nix::unistd::getppid() != driver {
                return Err(nix::errno::Errno::ESRCH.into());
            }
            Ok(())
        });
    }
}

/// Failures while preparing hosts or starting ranks.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("cannot start rank {rank}: `{program}`; check that it exists and is executable (build the runtime with `cargo build --release -p stagehand-runtime`, or pass --runtime)")]
    Spawn {
        rank: usize,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("program {} for the ranks does not exist; build the runtime with `cargo build --release -p stagehand-runtime`, pass --runtime, or set `command:`", path.display())]
    ProgramMissing { path: PathBuf },
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
    #[error("{} cannot resolve the master address {addr} ({reason}); set `master_addr:` to an IP address of {first}, or a name every host resolves (the ranks use it as given, on every host)", hosts.join(", "))]
    MasterUnresolved {
        hosts: Vec<String>,
        first: String,
        addr: String,
        reason: String,
    },
    #[error("the runtime refuses the experiment's training request: {reason}; change the experiment file (`runtime --check` with a rank's arguments says the same)")]
    RequestRefused { reason: String },
    #[error("{reason}; change the experiment file")]
    SettingRefused { reason: String },
    #[error("the engine on {host} cannot give a container GPUs {gpus:?}: {message}; check that these GPU indices exist there (`nvidia-smi -L`) and that the NVIDIA container toolkit is installed")]
    GpusUnavailable {
        host: String,
        gpus: Vec<u32>,
        message: String,
    },
    #[error("the container for the ranks on {host} exited with code {code} before they could start{}{}", crate::events::command_note(Some(*.code)), last_words(.last))]
    ContainerExited { host: String, code: i64, last: String },
    #[error("master port {port} is in use on {host}; pass another with --master-port, or leave it out to get a free one")]
    PortInUse { host: String, port: u16 },
    #[error("removing the experiment's containers on {host} took longer than {}", seconds(*.wait))]
    CleanupTimeout { host: String, wait: Duration },
    #[error(
        "the engine on {host} was already removing a container, and it was still there {seconds} s later"
    )]
    RemovalInProgress { host: String, seconds: u64 },
    #[error("{} could not be removed, tried for {grace_s} s: {}; each stops itself once its lease has not been renewed for {ttl_s} s, but stays listed until removed: once its host answers, run {}", count(.left.len()), describe(.left), by_hand(.left), ttl_s = lease::LEASE_TTL.as_secs())]
    ContainersLeft { left: Vec<LeftContainer>, grace_s: u64 },
    #[error("interrupted before the ranks started")]
    Interrupted,
    /// The ranks could not start (`start`), and removing what was started left containers
    /// (`left`, a [`LaunchError::ContainersLeft`]).
    #[error("{}", crate::error::error_line(.start.as_ref()))]
    StartLeft {
        start: Box<LaunchError>,
        left: Box<LaunchError>,
    },
    #[error("cannot run `{program}`: the slurm backend runs where Slurm's commands are (a cluster's login node), with SLURM_CONF set where the cluster's configuration is not in /etc/slurm; `scripts/slurm-cluster up` starts a one-node cluster here")]
    SlurmMissing {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("Slurm refuses the job ({request}): {reason}; change the experiment file's `slurm:` settings (`sinfo` shows the partitions, their nodes and limits)")]
    SlurmRefused { request: String, reason: String },
    #[error("Slurm job {job} is still listed ({state}) after the driver cancelled it; once Slurm answers, run `{cancel}`")]
    SlurmJobLeft {
        job: String,
        state: String,
        cancel: String,
    },
}

/// A container's last log line after `; its last line: `, when it left one.
fn last_words(last: &str) -> String {
    match last.trim() {
        "" => String::new(),
        line => format!("; its last line: {line}"),
    }
}

/// `wait` as people read it: `10 s`, or `0.4 s` under a second (a last try in what was left of a
/// grace period).
fn seconds(wait: Duration) -> String {
    match wait.as_secs() {
        0 => format!("{:.1} s", wait.as_secs_f64()),
        whole => format!("{whole} s"),
    }
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
            return Event::Metrics {
                rank,
                line,
                event: Box::new(event),
            };
        }
    }
    Event::LineLogged { rank, stream, line }
}

/// Where a launch's ranks run.
#[derive(Clone)]
pub enum Target {
    /// Local child processes.
    Processes,
    /// Containers on these hosts (from preflight, in the experiment's host order), labelled with
    /// experiment id `id`.
    Containers {
        hosts: Vec<Host>,
        id: String,
        ssh: SshOptions,
    },
    /// Tasks of one Slurm job named `job_name`, asking for `settings`.
    Slurm {
        settings: crate::config::SlurmSettings,
        job_name: String,
    },
}

/// A started backend.
pub enum Launcher {
    /// Local processes.
    Process(process::ProcessLauncher),
    /// Docker containers.
    Docker(docker::DockerLauncher),
    /// A Slurm job.
    Slurm(slurm::SlurmLauncher),
}

impl Launcher {
    /// Starts every rank of `plan` on `target`; events go to `tx`. A start that fails removes
    /// what it started; what could not be removed makes the error a [`LaunchError::StartLeft`].
    pub async fn start(
        target: Target,
        plan: &Experiment,
        tx: UnboundedSender<Event>,
    ) -> Result<Launcher, LaunchError> {
        match target {
            Target::Processes => process::ProcessLauncher::start(plan, tx).map(Launcher::Process),
            Target::Slurm { settings, job_name } => {
                slurm::SlurmLauncher::start(plan, &settings, job_name, tx).map(Launcher::Slurm)
            }
            Target::Containers { hosts, id, ssh } => {
                let docker = docker::DockerLauncher::new(hosts, id, ssh);
                match docker.start(plan, tx).await {
                    Ok(()) => Ok(Launcher::Docker(docker)),
                    Err(e) => match docker.remove_all(cleanup::REMOVAL_GRACE).await {
                        Err(left @ LaunchError::ContainersLeft { .. }) => Err(LaunchError::StartLeft {
                            start: Box::new(e),
                            left: Box::new(left),
                        }),
                        _ => Err(e),
                    },
                }
            }
        }
    }

    /// Asks every rank to stop after the checkpoint of the iteration it is in (SIGTERM, which
    /// a checkpointing runtime turns into a checkpoint and exit 143), killing what is left after
    /// [`CHECKPOINT_GRACE`]. A container shared by a host's ranks passes the signal to the ranks
    /// exec'd into it (see [`lease::GUARD_SCRIPT`]).
    pub async fn stop_for_checkpoint(&self) {
        match self {
            Launcher::Process(p) => p.stop_all_within(CHECKPOINT_GRACE).await,
            Launcher::Docker(d) => d.terminate_all().await,
            // scancel sends SIGTERM and, after Slurm's KillWait, SIGKILL.
            Launcher::Slurm(_) => self.stop_all().await,
        }
    }

    /// Stops every rank after `plan`'s ranks failed: as [`Launcher::stop_all`], except that
    /// containers whose ranks trace are killed, not removed, so that the traces already written
    /// in them can be copied out before [`Launcher::finish`] removes them.
    pub async fn stop_failed(&self, plan: &Experiment) {
        match self {
            Launcher::Docker(d) if plan.traces_dir.is_some() => d.kill_all().await,
            _ => self.stop_all().await,
        }
    }

    /// Stops every rank (and removes every container) this launcher started.
    pub async fn stop_all(&self) {
        match self {
            Launcher::Process(p) => p.stop_all().await,
            // One quick try: what it leaves is tried again, and reported, by `finish`.
            Launcher::Docker(d) => {
                let _ = d.remove_all(Duration::ZERO).await;
            }
            Launcher::Slurm(s) => s.stop_all().await,
        }
    }

    /// Stops whatever still runs and removes every container, trying for
    /// [`cleanup::REMOVAL_GRACE`]; an error names what is left.
    pub async fn finish(&self) -> Result<(), LaunchError> {
        match self {
            Launcher::Process(p) => {
                p.finish().await;
                Ok(())
            }
            Launcher::Docker(d) => d.remove_all(cleanup::REMOVAL_GRACE).await,
            Launcher::Slurm(s) => s.finish().await,
        }
    }
}

/// What a caller of [`run_ranks`] makes of the ranks' events: what the reporters see of each,
/// and which cause stops the run when a rank fails.
pub trait Watch {
    /// The event the reporters see for `event`, if any.
    fn show(&mut self, event: Event) -> Option<Event>;

    /// Why the run stops when `rank` on `host` exits with `exit_code` (not 0), or is removed
    /// (`None`); `out_of_memory` when its engine says it was killed for memory.
    fn failed(&self, rank: usize, host: String, exit_code: Option<i64>, out_of_memory: bool) -> StopCause {
        StopCause::RankFailed {
            rank,
            host,
            exit_code,
            out_of_memory,
            silent_peer: None,
        }
    }
}

/// An experiment's ranks: the reporters see every event; how far the ranks say they got (the
/// checkpoints they wrote, the iterations they finished) is kept, over every start of the ranks,
/// for a restart to resume from and to judge by.
#[derive(Debug, Default)]
pub struct Ranks {
    pub progress: restart::Progress,
}

impl Watch for Ranks {
    fn show(&mut self, event: Event) -> Option<Event> {
        self.progress.saw(&event);
        Some(event)
    }
}

/// How [`run_ranks`] ended once the ranks started.
pub struct Outcome {
    /// Why the driver stopped the ranks early, if it did.
    pub cause: Option<StopCause>,
    /// Removing what was started; an error names what is left (already reported).
    pub cleanup: Result<(), LaunchError>,
}

impl Outcome {
    /// How the ranks ended: as the cause they were stopped for says, if any.
    pub fn status(&self) -> Ended {
        match &self.cause {
            None => Ended::Succeeded,
            Some(StopCause::Interrupted) => Ended::Interrupted,
            Some(
                StopCause::RankFailed { .. }
                | StopCause::HostLost { .. }
                | StopCause::ProfileFailed { .. }
                | StopCause::PlanFailed { .. }
                | StopCause::LaunchFailed { .. }
                | StopCause::SlurmJob { .. },
            ) => Ended::Failed,
        }
    }
}

/// Starts `plan`'s ranks on `target`, supervises them until they have all ended (stopping all on
/// the first failure or a signal) and removes what was started. Containers that could not be
/// removed are reported as [`Event::ContainersLeft`]. An error means the ranks could not start.
pub async fn run_ranks(
    target: Target,
    plan: &Experiment,
    reporters: &mut Reporters,
    signals: &mut StopSignals,
    watch: &mut dyn Watch,
) -> Result<Outcome, LaunchError> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let launcher = match Launcher::start(target, plan, tx).await {
        Ok(l) => l,
        Err(e) => {
            if let LaunchError::StartLeft { left, .. } = &e {
                if let LaunchError::ContainersLeft { left, .. } = left.as_ref() {
                    reporters.report(&Event::ContainersLeft(left.clone()));
                }
            }
            return Err(e);
        }
    };
    let cause = supervise(plan, &launcher, rx, reporters, signals, watch).await;
    // Ranks write their traces once they have run the iterations traced, which a run that
    // failed later has done: its traces are gathered too (but not from a host that was lost,
    // nor after Ctrl-C, which asks the driver to be done).
    let gather = matches!(cause, None | Some(StopCause::RankFailed { .. }));
    if let (Some(dir), true) = (&plan.traces_dir, gather) {
        let copied = match &launcher {
            // Ctrl-C ends the copy (the ranks are done; their containers still go).
            Launcher::Docker(d) => Some(tokio::select! {
                copied = d.copy_traces(dir) => copied,
                _ = signals.recv() => {
                    let ranks: Vec<usize> = plan.ranks.iter().map(|r| r.rank).collect();
                    traces::fail_all(&ranks, "its copy was interrupted (Ctrl-C)".into())
                }
            }),
            Launcher::Process(_) | Launcher::Slurm(_) => None,
        };
        let facts = traces::account(plan, dir, copied);
        // A failed run that kept none has its failure to tell, not every rank's missing trace
        // (nor, when it is started again, that of each start).
        if cause.is_none() || !facts.ranks.is_empty() {
            reporters.report(&Event::TracesGathered(facts));
        }
    }
    let cleanup = launcher.finish().await;
    if let Err(LaunchError::ContainersLeft { left, .. }) = &cleanup {
        reporters.report(&Event::ContainersLeft(left.clone()));
    }
    Ok(Outcome { cause, cleanup })
}

/// What [`supervise`] asks of the ranks it watches: the [`Launcher`]'s ways of stopping them (a
/// stand-in that notes each call, in tests).
trait Stoppable {
    async fn stop_for_checkpoint(&self);
    async fn stop_all(&self);
    async fn stop_failed(&self, plan: &Experiment);
}

impl Stoppable for Launcher {
    async fn stop_for_checkpoint(&self) {
        Launcher::stop_for_checkpoint(self).await
    }
    async fn stop_all(&self) {
        Launcher::stop_all(self).await
    }
    async fn stop_failed(&self, plan: &Experiment) {
        Launcher::stop_failed(self, plan).await
    }
}

/// Where [`supervise`] hears the user ask the driver to stop: [`StopSignals`] (a channel, in
/// tests).
trait Interrupts {
    async fn interrupted(&mut self);
}

impl Interrupts for StopSignals {
    async fn interrupted(&mut self) {
        self.recv().await
    }
}

/// Feeds events to the reporters until every rank has exited; stops all ranks on the first failure
/// or signal. Returns why it stopped them, if it did.
///
/// Interrupted, ranks that checkpoint are given [`CHECKPOINT_GRACE`] to write the checkpoint of
/// the iteration they are in. That wait is cut short by a second interrupt, and by a host lost
/// meanwhile: a checkpoint needs every rank, a lost host's ranks can no longer be seen to write
/// theirs, and the ranks elsewhere would wait for them in a collective until its timeout.
async fn supervise(
    plan: &Experiment,
    launcher: &impl Stoppable,
    mut events: UnboundedReceiver<Event>,
    reporters: &mut Reporters,
    signals: &mut impl Interrupts,
    watch: &mut dyn Watch,
) -> Option<StopCause> {
    // Ranks seen to exit, removed, or lost with their host: no more to hear from them.
    let mut ended = 0;
    let mut cause: Option<StopCause> = None;
    let mut deadline: Option<tokio::time::Instant> = None;
    // Whether the ranks are being given the time to checkpoint after an interrupt, which a
    // second interrupt cuts short.
    let mut checkpointing = false;
    // Where each rank was seen to start (Slurm picks the nodes), else where the plan put it.
    let mut started_on: std::collections::BTreeMap<usize, String> = std::collections::BTreeMap::new();
    let host_of = |started_on: &std::collections::BTreeMap<usize, String>, rank: usize| {
        started_on
            .get(&rank)
            .cloned()
            .unwrap_or_else(|| plan.host_of(rank).name.clone())
    };
    // Each rank's `peer_silent` line, and the ranks seen to end: a rank that fails waiting for a
    // peer still running names that peer.
    let mut silent: std::collections::BTreeMap<usize, stagehand_contract::PeerSilent> =
        std::collections::BTreeMap::new();
    let mut gone: std::collections::BTreeSet<usize> = std::collections::BTreeSet::new();
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
            _ = signals.interrupted(), if cause.is_none() || checkpointing => {
                // Interrupted again (a host cut off keeps a rank in a collective until its
                // timeout, so the checkpoint may never come): stop them now.
                if checkpointing {
                    checkpointing = false;
                    deadline = Some(stop_now(StopNow::InterruptedAgain, launcher, reporters).await);
                    continue;
                }
                let c = StopCause::Interrupted;
                cause = Some(c.clone());
                reporters.report(&Event::Stopping(c));
                // Ranks that checkpoint get the time to write one of the iteration they are in.
                if plan.checkpoints() {
                    checkpointing = true;
                    deadline = Some(tokio::time::Instant::now() + CHECKPOINT_GRACE + EXIT_DEADLINE);
                    launcher.stop_for_checkpoint().await;
                } else {
                    deadline = Some(tokio::time::Instant::now() + EXIT_DEADLINE);
                    launcher.stop_all().await;
                }
                continue;
            }
            _ = until_deadline => break,
        };
        if let Event::Metrics {
            rank, event: line, ..
        } = &event
        {
            if let stagehand_contract::Event::PeerSilent(said) = line.as_ref() {
                silent.insert(*rank, said.clone());
            }
        }
        let stop = match &event {
            Event::RankExited {
                rank,
                exit_code,
                out_of_memory,
            } => {
                ended += 1;
                gone.insert(*rank);
                (*exit_code != Some(0))
                    .then(|| watch.failed(*rank, host_of(&started_on, *rank), *exit_code, *out_of_memory))
            }
            // Removed by the driver while stopping, or by someone else: then the rank failed.
            Event::RankRemoved { rank } => {
                ended += 1;
                gone.insert(*rank);
                Some(watch.failed(*rank, host_of(&started_on, *rank), None, false))
            }
            Event::RankStarted { rank, host, .. } => {
                started_on.insert(*rank, host.clone());
                None
            }
            Event::Slurm(SlurmEvent::Stopped {
                job_id,
                reason,
                never_started,
            }) => Some(StopCause::SlurmJob {
                job_id: *job_id,
                reason: reason.clone(),
                never_started: *never_started,
            }),
            Event::HostLost { host, reason } | Event::RankLost { host, reason, .. } => {
                if let Event::RankLost { rank, .. } = &event {
                    ended += 1;
                    gone.insert(*rank);
                }
                Some(StopCause::HostLost {
                    host: host.clone(),
                    reason: reason.clone(),
                })
            }
            Event::HostReady(_)
            | Event::Slurm(_)
            | Event::LineLogged { .. }
            | Event::Metrics { .. }
            | Event::Profiling { .. }
            | Event::ProfileLine { .. }
            | Event::Planned(_)
            | Event::Stopping(_)
            | Event::StoppingNow(_)
            | Event::ContainersLeft(_)
            | Event::Restarting { .. }
            | Event::NotRestarted { .. }
            | Event::TracesGathered(_)
            | Event::Finished { .. } => None,
        };
        let stop = stop.map(|cause| blame_silent(cause, &silent, &gone, |rank| host_of(&started_on, rank)));
        if let Some(shown) = watch.show(event) {
            reporters.report(&shown);
        }
        if let (true, Some(StopCause::HostLost { host, .. })) = (checkpointing, &stop) {
            checkpointing = false;
            let why = StopNow::HostLost { host: host.clone() };
            deadline = Some(stop_now(why, launcher, reporters).await);
        }
        if let (Some(c), None) = (stop, &cause) {
            cause = Some(c.clone());
            deadline = Some(tokio::time::Instant::now() + EXIT_DEADLINE);
            reporters.report(&Event::Stopping(c));
            launcher.stop_failed(plan).await;
        }
        if ended == plan.world_size() {
            break;
        }
    }
    cause
}

/// A rank failed waiting for a peer (its `peer_silent` line) that has not ended: the cause
/// names that peer, the rank to look at. A peer that ended failed itself, and says so.
fn blame_silent(
    cause: StopCause,
    silent: &std::collections::BTreeMap<usize, stagehand_contract::PeerSilent>,
    gone: &std::collections::BTreeSet<usize>,
    host_of: impl Fn(usize) -> String,
) -> StopCause {
    match cause {
        StopCause::RankFailed {
            rank,
            host,
            exit_code,
            out_of_memory,
            silent_peer: None,
        } => {
            let silent_peer = silent
                .get(&rank)
                .filter(|said| !gone.contains(&said.peer))
                .map(|said| crate::events::SilentPeer {
                    rank: said.peer,
                    host: host_of(said.peer),
                    op: said.op,
                    timeout_s: said.timeout_s,
                });
            StopCause::RankFailed {
                rank,
                host,
                exit_code,
                out_of_memory,
                silent_peer,
            }
        }
        other => other,
    }
}

/// Stops ranks that were given the time to checkpoint without waiting for it any longer, saying
/// `why`; returns the deadline for them to be seen to exit.
async fn stop_now(
    why: StopNow,
    launcher: &impl Stoppable,
    reporters: &mut Reporters,
) -> tokio::time::Instant {
    reporters.report(&Event::StoppingNow(why));
    let deadline = tokio::time::Instant::now() + EXIT_DEADLINE;
    launcher.stop_all().await;
    deadline
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
    use tokio::time::{sleep, Instant};

    /// Notes each way it is asked to stop the ranks.
    #[derive(Default)]
    struct Noted(Mutex<Vec<&'static str>>);

    impl Stoppable for Noted {
        async fn stop_for_checkpoint(&self) {
            self.0.lock().unwrap().push("for checkpoint");
        }
        async fn stop_all(&self) {
            self.0.lock().unwrap().push("all");
        }
        async fn stop_failed(&self, _: &Experiment) {
            self.0.lock().unwrap().push("failed");
        }
    }

    /// Interrupts sent down a channel.
    struct Sent(UnboundedReceiver<()>);

    impl Interrupts for Sent {
        async fn interrupted(&mut self) {
            if self.0.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Keeps every event reported.
    struct Kept(Arc<Mutex<Vec<Event>>>);

    impl crate::reporters::Reporter for Kept {
        fn report(&mut self, event: &Event) -> Result<(), crate::records::RecordError> {
            self.0.lock().unwrap().push(event.clone());
            Ok(())
        }
    }

    /// Two process ranks on two hosts' worth of names; checkpointing when `checkpoints`.
    fn plan(checkpoints: bool) -> Experiment {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("exp.yml");
        let checkpoint = if checkpoints { "checkpoint_dir: ckpt\n" } else { "" };
        std::fs::write(
            &file,
            format!("backend: process\nmachines: [localhost, localhost]\nmodule: mlp\n{checkpoint}"),
        )
        .unwrap();
        let loaded = crate::config::load(&file).unwrap();
        let options = crate::experiment::tests::options(None, crate::options::ContainerMode::PerRank);
        let plan = crate::experiment::resolve(&loaded, &options, 29500).unwrap();
        assert_eq!(plan.checkpoints(), checkpoints);
        plan
    }

    /// What [`supervise`] did with what `script` sent it (events, and interrupts as `()`), on
    /// tokio's paused clock: why it stopped the ranks, how it stopped them, what it reported,
    /// and how long it took.
    async fn supervised<F>(
        plan: &Experiment,
        script: impl FnOnce(UnboundedSender<Event>, UnboundedSender<()>) -> F,
    ) -> (Option<StopCause>, Vec<&'static str>, Vec<Event>, Duration)
    where
        F: std::future::Future<Output = (UnboundedSender<Event>, UnboundedSender<()>)>,
    {
        let (tx, events) = unbounded_channel();
        let (interrupt, interrupts) = unbounded_channel();
        let kept = Arc::new(Mutex::new(Vec::new()));
        let mut reporters = Reporters::new(vec![Box::new(Kept(kept.clone()))]);
        let noted = Noted::default();
        let mut interrupts = Sent(interrupts);
        let mut watch = Ranks::default();
        let start = Instant::now();
        // The script hands its senders back, so that the events do not end with it.
        let (cause, _senders) = tokio::join!(
            supervise(plan, &noted, events, &mut reporters, &mut interrupts, &mut watch),
            script(tx, interrupt)
        );
        let elapsed = start.elapsed();
        let reported = kept.lock().unwrap().clone();
        (cause, noted.0.into_inner().unwrap(), reported, elapsed)
    }

    /// A rank that failed waiting for a peer names the peer while it runs; not one that ended
    /// (it failed itself), nor a rank that said nothing of a peer.
    #[test]
    fn a_failure_waiting_for_a_running_peer_names_the_peer() {
        let failed = |rank| StopCause::RankFailed {
            rank,
            host: "a".into(),
            exit_code: Some(1),
            out_of_memory: false,
            silent_peer: None,
        };
        let said = stagehand_contract::PeerSilent {
            rank: 0,
            peer: 2,
            op: stagehand_contract::P2pOp::Send,
            timeout_s: 60.0,
        };
        let silent = [(0, said)].into_iter().collect();
        let host_of = |rank: usize| format!("h{rank}");
        let blamed = blame_silent(failed(0), &silent, &Default::default(), host_of);
        let StopCause::RankFailed {
            silent_peer: Some(peer),
            ..
        } = &blamed
        else {
            panic!("{blamed:?}");
        };
        assert_eq!((peer.rank, peer.host.as_str(), peer.timeout_s), (2, "h2", 60.0));
        assert_eq!(
            peer.describe(0),
            "rank 2 on h2 did not answer rank 0's send for 60 s (comm_timeout), though still running: \
             stuck, or itself waiting on another rank"
        );
        let gone = [2].into_iter().collect();
        assert_eq!(blame_silent(failed(0), &silent, &gone, host_of), failed(0));
        assert_eq!(
            blame_silent(failed(1), &silent, &Default::default(), host_of),
            failed(1)
        );
    }

    fn lost(host: &str, rank: usize) -> [Event; 2] {
        let reason = "ssh: Connection timed out".to_string();
        [
            Event::HostLost {
                host: host.into(),
                reason: reason.clone(),
            },
            Event::RankLost {
                rank,
                host: host.into(),
                reason,
            },
        ]
    }

    fn exited(rank: usize, code: i64) -> Event {
        Event::RankExited {
            rank,
            exit_code: Some(code),
            out_of_memory: false,
        }
    }

    fn stopping_now(reported: &[Event]) -> Vec<StopNow> {
        reported
            .iter()
            .filter_map(|e| match e {
                Event::StoppingNow(why) => Some(why.clone()),
                _ => None,
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn interrupted_ranks_that_checkpoint_are_waited_for_until_they_exit() {
        let plan = plan(true);
        let (cause, stops, reported, elapsed) = supervised(&plan, |tx, interrupt| async move {
            sleep(Duration::from_secs(1)).await;
            interrupt.send(()).unwrap();
            // Each writes its checkpoint and exits 143, the second 30 s on.
            sleep(Duration::from_secs(10)).await;
            tx.send(exited(1, 143)).unwrap();
            sleep(Duration::from_secs(20)).await;
            tx.send(exited(0, 143)).unwrap();
            (tx, interrupt)
        })
        .await;
        assert_eq!(cause, Some(StopCause::Interrupted));
        assert_eq!(stops, ["for checkpoint"]);
        assert!(stopping_now(&reported).is_empty(), "{reported:?}");
        assert_eq!(elapsed, Duration::from_secs(31));
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_interrupt_stops_ranks_still_checkpointing_now() {
        let plan = plan(true);
        let (cause, stops, reported, elapsed) = supervised(&plan, |tx, interrupt| async move {
            sleep(Duration::from_secs(1)).await;
            interrupt.send(()).unwrap();
            sleep(Duration::from_secs(5)).await;
            interrupt.send(()).unwrap();
            (tx, interrupt)
        })
        .await;
        assert_eq!(cause, Some(StopCause::Interrupted));
        assert_eq!(stops, ["for checkpoint", "all"]);
        assert_eq!(stopping_now(&reported), [StopNow::InterruptedAgain]);
        // No rank reports its exit: the driver gives up on them EXIT_DEADLINE after stopping them.
        assert_eq!(elapsed, Duration::from_secs(6) + EXIT_DEADLINE);
    }

    /// A host lost while the ranks checkpoint: its ranks' part of the checkpoint cannot come, and
    /// the others would wait for them in a collective until its timeout, so the driver stops every
    /// rank at once rather than wait out the checkpoint grace.
    #[tokio::test(start_paused = true)]
    async fn a_host_lost_while_the_ranks_checkpoint_stops_every_rank_now() {
        let plan = plan(true);
        let (cause, stops, reported, elapsed) = supervised(&plan, |tx, interrupt| async move {
            sleep(Duration::from_secs(1)).await;
            interrupt.send(()).unwrap();
            sleep(Duration::from_secs(20)).await;
            for event in lost("th2", 1) {
                tx.send(event).unwrap();
            }
            (tx, interrupt)
        })
        .await;
        // The run is still the interrupted one the user asked for.
        assert_eq!(cause, Some(StopCause::Interrupted));
        assert_eq!(stops, ["for checkpoint", "all"]);
        assert_eq!(
            stopping_now(&reported),
            [StopNow::HostLost { host: "th2".into() }]
        );
        assert_eq!(elapsed, Duration::from_secs(21) + EXIT_DEADLINE);
        assert!(elapsed < CHECKPOINT_GRACE);
    }

    /// Lost before any interrupt, a host fails the run; an interrupt after it changes nothing.
    #[tokio::test(start_paused = true)]
    async fn a_host_lost_while_the_ranks_train_fails_the_run() {
        let plan = plan(true);
        let (cause, stops, reported, elapsed) = supervised(&plan, |tx, interrupt| async move {
            sleep(Duration::from_secs(1)).await;
            for event in lost("th2", 1) {
                tx.send(event).unwrap();
            }
            sleep(Duration::from_secs(1)).await;
            interrupt.send(()).unwrap();
            sleep(Duration::from_secs(1)).await;
            tx.send(exited(0, 137)).unwrap();
            (tx, interrupt)
        })
        .await;
        assert!(
            matches!(&cause, Some(StopCause::HostLost { host, .. }) if host == "th2"),
            "{cause:?}"
        );
        assert_eq!(stops, ["failed"]);
        assert!(stopping_now(&reported).is_empty(), "{reported:?}");
        assert_eq!(elapsed, Duration::from_secs(3));
    }

    /// Ranks that do not checkpoint are stopped outright on the first interrupt; a host lost
    /// afterwards changes nothing.
    #[tokio::test(start_paused = true)]
    async fn ranks_that_do_not_checkpoint_are_stopped_at_the_first_interrupt() {
        let plan = plan(false);
        let (cause, stops, reported, _) = supervised(&plan, |tx, interrupt| async move {
            sleep(Duration::from_secs(1)).await;
            interrupt.send(()).unwrap();
            sleep(Duration::from_secs(1)).await;
            for event in lost("th2", 1) {
                tx.send(event).unwrap();
            }
            tx.send(exited(0, 143)).unwrap();
            (tx, interrupt)
        })
        .await;
        assert_eq!(cause, Some(StopCause::Interrupted));
        assert_eq!(stops, ["all"]);
        assert!(stopping_now(&reported).is_empty(), "{reported:?}");
    }
}
