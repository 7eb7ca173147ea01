//! What happens during a run, as the launchers report it. Reporters match these exhaustively, so a
//! new kind of event makes each of them decide what to do with it.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The exit code of a container whose lease guard stopped it: the driver stopped renewing its
/// lease (`launch::lease`).
pub const LEASE_EXPIRED_EXIT_CODE: i64 = 86;

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Facts about a host gathered at preflight.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostFacts {
    /// Host name as in the experiment file.
    pub host: String,
    /// Docker server version, when the docker backend is used.
    pub docker_version: Option<String>,
    /// GPUs the host's engine reports, when known.
    pub gpus: Vec<String>,
    /// Image id the containers run, when the docker backend is used.
    pub image_id: Option<String>,
    /// Image tag the containers run.
    pub image: Option<String>,
    /// Whether the image was built on this host in this run (false: it had it, or received it).
    pub image_built: bool,
    /// The host the image was streamed from in this run, when it was.
    pub image_received_from: Option<String>,
    /// Seconds this host spent getting the image in this run (building or receiving it).
    pub image_seconds: f64,
    /// Files the host lacked, copied into the containers through the Docker API.
    pub copied_in: Vec<String>,
    /// Whether the host has InfiniBand/RoCE verbs devices (`/dev/infiniband`), which its
    /// containers get unless the experiment says `rdma: off`.
    pub infiniband: bool,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Still going (only ever seen in a summary written mid-run).
    Running,
    /// Every rank exited 0.
    Succeeded,
    /// A rank exited non-zero or a host was lost.
    Failed,
    /// The user interrupted the run.
    Interrupted,
}

/// How ranks ended: a run's final [`Status`], never `Running`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every rank exited 0.
    Succeeded,
    /// A rank exited non-zero or a host was lost.
    Failed,
    /// The user interrupted the run.
    Interrupted,
}

impl From<Ended> for Status {
    fn from(ended: Ended) -> Status {
        match ended {
            Ended::Succeeded => Status::Succeeded,
            Ended::Failed => Status::Failed,
            Ended::Interrupted => Status::Interrupted,
        }
    }
}

/// Why the driver stops ranks it gave the time to checkpoint without waiting for their
/// checkpoint ([`Event::StoppingNow`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopNow {
    /// The user interrupted the driver again.
    InterruptedAgain,
    /// `host` was lost meanwhile: its ranks cannot be seen to write their part of the checkpoint,
    /// which needs every rank.
    HostLost { host: String },
}

/// A rank that did not answer a point-to-point operation of another within the run's
/// `comm_timeout`, though still running: stuck, or itself waiting on yet another rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SilentPeer {
    pub rank: usize,
    pub host: String,
    /// The operation that waited for it: `send` or `recv`.
    pub op: stagehand_contract::P2pOp,
    /// How long it waited, in seconds.
    pub timeout_s: f64,
}

impl SilentPeer {
    /// `rank 1 on HOST did not answer rank 0's recv for 8 s (comm_timeout), though still running:
    /// stuck, or itself waiting on another rank`.
    pub fn describe(&self, waiting: usize) -> String {
        format!(
            "rank {} on {} did not answer rank {waiting}'s {} for {} s (comm_timeout), though still \
             running: stuck, or itself waiting on another rank",
            self.rank,
            self.host,
            self.op.as_str(),
            self.timeout_s
        )
    }
}

/// Why the driver stopped the ranks early.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum StopCause {
    /// A rank exited non-zero (or was killed).
    RankFailed {
        rank: usize,
        host: String,
        exit_code: Option<i64>,
        /// The kernel is known to have killed it for memory ([`Event::RankExited`]).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        out_of_memory: bool,
        /// The peer it failed waiting for (its `peer_silent` line), still running then: the
        /// rank to look at.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        silent_peer: Option<SilentPeer>,
    },
    /// A host's engine or connection stopped answering.
    HostLost { host: String, reason: String },
    /// SIGINT (Ctrl-C), SIGTERM or SIGHUP.
    Interrupted,
    /// Profiling the model for `config_file: auto` failed on this host.
    ProfileFailed {
        host: String,
        exit_code: Option<i64>,
        /// The kernel is known to have killed it for memory.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        out_of_memory: bool,
    },
    /// No stage config could be planned for `config_file: auto`.
    PlanFailed { reason: String },
    /// The ranks could not be started (a container or an exec refused, a host unreachable);
    /// `reason` is the error with its causes.
    LaunchFailed { reason: String },
    /// Slurm ended the job, or it did not start in time: `reason` says which (`did not start:
    /// ...`, `reached its time limit ...`), `never_started` that the job never got its nodes.
    SlurmJob {
        job_id: Option<u64>,
        reason: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        never_started: bool,
    },
}

/// Whether a rank seen to exit with `exit_code` after the driver began stopping every rank ended
/// by that stop: with the code of the SIGTERM (143) or SIGKILL (137) the driver sends, or with
/// none (killed without one); not when the kernel is known to have killed it for memory.
pub fn ended_by_stop(exit_code: Option<i64>, out_of_memory: bool) -> bool {
    !out_of_memory && matches!(exit_code, None | Some(137 | 143))
}

/// What a failure adds when the kernel is known to have killed the rank for memory (empty
/// otherwise), after its exit code.
pub fn memory_note(out_of_memory: bool) -> &'static str {
    match out_of_memory {
        true => {
            ": the kernel killed it for lack of memory (an OOM kill); give it more memory, or hold \
                 less (smaller batch_size, more stages)"
        }
        false => "",
    }
}

/// What a failure adds for the exit codes shells give commands they could not run (empty for any
/// other), after the code. Every container starts its rank through `/bin/sh` (the lease guard),
/// so an image without one fails this way too.
pub fn command_note(exit_code: Option<i64>) -> &'static str {
    match exit_code {
        Some(127) => {
            ": a command was not found (a container needs /bin/sh, with which the driver starts each \
             rank, and the rank's program on its PATH)"
        }
        Some(126) => {
            ": a command was found but could not run (not executable, or built for another platform)"
        }
        _ => "",
    }
}

/// How a stop cause names the Slurm job: by id once Slurm gave one.
pub fn slurm_job(job_id: Option<u64>) -> String {
    job_id.map_or("the Slurm job".to_string(), |id| format!("Slurm job {id}"))
}

/// A Slurm job that started: its id and nodes, for the record and for `scancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlurmJob {
    /// Slurm's job id.
    pub job_id: u64,
    /// The job's nodes in order (rank 0 on the first).
    pub nodes: Vec<String>,
}

/// What Slurm said about the experiment's job (the Slurm backend).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlurmEvent {
    /// Submitted, waiting in the queue for resources.
    Queued { job_id: u64 },
    /// Given its nodes.
    Started(SlurmJob),
    /// A line of srun's own, not a rank's: `important` for its errors and warnings, the rest
    /// is srun's `-v` chatter.
    Line { line: String, important: bool },
    /// The job will not run its ranks to their end: refused, still queued at the deadline,
    /// at its time limit, preempted, or cancelled by someone else; `never_started` when it
    /// never got its nodes (refused, or still queued).
    Stopped {
        job_id: Option<u64>,
        reason: String,
        never_started: bool,
    },
}

/// A container the driver could not remove: where it is, and how to remove it by hand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeftContainer {
    /// Host name as in the experiment file.
    pub host: String,
    /// Container name.
    pub name: String,
    /// Full container id.
    pub id: String,
    /// The ranks it ran.
    pub ranks: Vec<usize>,
    /// Why it could not be removed (the last try's error).
    pub error: String,
    /// The shell command that removes it, for the user to run once the host answers.
    pub remove_by_hand: String,
}

/// The ranks' profiler traces the record keeps (`profiler_trace: true`), gathered once the
/// ranks ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TracesFacts {
    /// The record's folder of traces, one `rank-N.json` per rank.
    pub dir: PathBuf,
    /// The ranks whose trace it holds.
    pub ranks: Vec<usize>,
    /// The ranks whose trace it lacks, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<MissingTrace>,
}

/// A rank's profiler trace the record lacks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MissingTrace {
    pub rank: usize,
    pub reason: String,
}

/// A stage config planned at launch (`config_file: auto`), and what it predicts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanFacts {
    /// The model profiled.
    pub model: String,
    /// Where the profile came from: `HOST (DEVICE)`, or the profile file given.
    pub profiled_on: String,
    /// Microbatches per minibatch.
    pub microbatches: u32,
    /// Samples per microbatch (the profile's batch size).
    pub micro_batch_size: u32,
    /// First module of each stage.
    pub stage_starts: Vec<usize>,
    /// Ranks of each stage.
    pub replicas: Vec<usize>,
    /// Predicted seconds per iteration for the schedule the run uses.
    pub predicted_time_per_iteration_s: f64,
    /// Predicted seconds per iteration of pure data parallelism on the same ranks, if it fits.
    pub data_parallel_time_s: Option<f64>,
    /// The plan as a table for people (not kept in the summary).
    #[serde(skip)]
    pub table: String,
}

/// One thing that happened.
#[derive(Debug, Clone)]
pub enum Event {
    /// A host passed preflight.
    HostReady(HostFacts),
    /// A rank's process or container started.
    RankStarted {
        rank: usize,
        host: String,
        /// Container id or process id, for the user to find it.
        handle: String,
    },
    /// A line a rank printed that is not a metrics event.
    LineLogged {
        rank: usize,
        stream: Stream,
        line: String,
    },
    /// A metrics line a rank printed on stdout.
    Metrics {
        rank: usize,
        line: String,
        /// Boxed: an iteration's metrics outweigh every other event.
        event: Box<stagehand_contract::Event>,
    },
    /// A rank was seen to end; `exit_code` is `None` when it was killed without one.
    /// `out_of_memory`: the kernel is known to have killed it (or a process of its container) for
    /// lack of memory: Docker's `OOMKilled` or the container's cgroup count, for a process rank
    /// the count of the driver's memory cgroup (launch/oom.rs), srun's "Out Of Memory"; false
    /// where nothing says so.
    RankExited {
        rank: usize,
        exit_code: Option<i64>,
        out_of_memory: bool,
    },
    /// A rank's container was removed before it was seen to exit (by the driver while stopping).
    RankRemoved { rank: usize },
    /// A rank's host stopped answering before the rank was seen to exit: it may still run.
    RankLost {
        rank: usize,
        host: String,
        reason: String,
    },
    /// A host could not be reached any more.
    HostLost { host: String, reason: String },
    /// `config_file: auto` is profiling the model on rank 0's host and device.
    Profiling {
        model: String,
        host: String,
        device: String,
        batch_size: u32,
    },
    /// A line the profiling run printed on stderr.
    ProfileLine { host: String, line: String },
    /// `config_file: auto` planned the stages.
    Planned(PlanFacts),
    /// The driver is stopping every rank.
    Stopping(StopCause),
    /// The ranks were given the time to write a checkpoint after an interrupt, and the driver
    /// stops them now, without waiting for it.
    StoppingNow(StopNow),
    /// Containers the driver could not remove, after retrying for its grace period.
    ContainersLeft(Vec<LeftContainer>),
    /// What Slurm said about the job.
    Slurm(SlurmEvent),
    /// The ranks failed, every one was stopped and removed, and they are started again
    /// (`max_restarts`): this is restart `restart` of at most `max`, after `cause`; from the
    /// checkpoint of `resume_from` iterations done, or as first started (`None`).
    Restarting {
        restart: u32,
        max: u32,
        cause: StopCause,
        resume_from: Option<u64>,
    },
    /// The ranks failed and the run allowed restarts, but gets none: `why`.
    NotRestarted { why: String },
    /// The ranks' profiler traces, gathered into the record once they ended.
    TracesGathered(TracesFacts),
    /// The run is over: every rank ended and every container removed, or reported left.
    Finished { status: Status },
}
