//! `summary.json`: the record's verdict, converted from in-memory state and versioned.

use serde::{Deserialize, Serialize};

use stagehand_contract::ValidationFigures;

use super::stats::{StageShares, Throughput};
use super::{read_versioned, VersionedError};
use crate::events::{LeftContainer, PlanFacts, SlurmJob, Status, StopCause, TracesFacts};

/// Version of `summary.json`; bumped when a field changes meaning.
pub const FORMAT_VERSION: u32 = 1;

/// Where a rank is, as far as the driver saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankState {
    /// Not started yet.
    Pending,
    /// Started, not seen to end.
    Running,
    /// Seen to exit (`exit_code` says how).
    Exited,
    /// Seen to exit by the driver's stop, after it began stopping every rank (for another
    /// rank's failure, a lost host or an interrupt): `exit_code` is the stop's (143 for SIGTERM,
    /// 137 for SIGKILL) or `null`. Not a failure of its own.
    Stopped,
    /// Its container was removed before it was seen to exit (the driver stopping it).
    Removed,
    /// Its host stopped answering before it was seen to exit; it may still run.
    Lost,
    /// Not seen to exit, and its container could not be removed: see `containers_not_removed`.
    NotRemoved,
}

/// How each rank ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankOutcome {
    /// Global rank.
    pub rank: usize,
    /// Host it ran on.
    pub host: String,
    /// Container or process id.
    pub handle: Option<String>,
    /// Exit code, only once seen to exit (`null` while running, when killed without one, or
    /// when its exit was never seen).
    pub exit_code: Option<i64>,
    /// Whether it was seen to exit.
    pub exited: bool,
    /// Where it is (absent in records written before rank states were kept).
    #[serde(default)]
    pub state: Option<RankState>,
}

impl RankOutcome {
    /// A rank of the plan, not started yet.
    pub fn pending(rank: usize, host: String) -> RankOutcome {
        RankOutcome {
            rank,
            host,
            handle: None,
            exit_code: None,
            exited: false,
            state: Some(RankState::Pending),
        }
    }

    /// Takes in what the driver saw of this rank; an exit once seen stays.
    pub fn saw(&mut self, state: RankState, exit_code: Option<i64>) {
        if self.exited {
            return;
        }
        self.state = Some(state);
        if matches!(state, RankState::Exited | RankState::Stopped) {
            self.exited = true;
            self.exit_code = exit_code;
        }
    }
}

/// What went wrong, for a failed or interrupted run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Failure {
    /// What made the driver stop.
    pub cause: StopCause,
    /// The last lines the failing rank printed (empty for a host loss or an interrupt).
    pub last_lines: Vec<String>,
}

/// One failure after which the ranks were started again (`max_restarts`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Restart {
    /// RFC 3339 UTC, when the ranks were started again.
    pub at: String,
    /// What made the driver stop the ranks, and the failing rank's last lines.
    pub failure: Failure,
    /// Iterations every rank of the last stage had finished by then (over every start so far).
    pub iterations_done: u64,
    /// Iterations done of the checkpoint the ranks resumed from; `null` when they started as
    /// they first did (no checkpoint written in the run).
    pub resume_from: Option<u64>,
}

/// A validation pass, as the record keeps its last.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LastValidation {
    /// The training iteration the pass followed (from 0).
    pub iteration: u64,
    /// Loss, top-1 and top-5 accuracy over the pass's samples, and how many.
    #[serde(flatten)]
    pub figures: ValidationFigures,
}

/// The whole file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// See [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Experiment id (the record folder's name, also the containers' label).
    pub id: String,
    /// Experiment name.
    pub name: String,
    /// `running` while the run goes, then `succeeded`, `failed` or `interrupted`.
    pub status: Status,
    /// RFC 3339 UTC.
    pub started_at: String,
    /// RFC 3339 UTC, once finished.
    pub ended_at: Option<String>,
    /// Seconds from start to end (or to now while running).
    pub duration_s: f64,
    /// `docker` or `process`.
    pub backend: String,
    /// Number of ranks.
    pub world_size: usize,
    /// Iterations every rank of the last stage finished.
    pub iterations_done: u64,
    /// The first iteration the ranks ran, where they resumed from a checkpoint written before
    /// this run (`resume:`): its figures cover only the iterations from there. Absent for a run
    /// from the start (and from drivers before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_at: Option<u64>,
    /// Job samples/s, mean and spread, once an iteration completed.
    pub throughput: Option<Throughput>,
    /// With fp16: the iterations whose step the gradient scaler skipped (inf/nan gradients);
    /// absent in other arithmetics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    /// The loss of the last iteration every last-stage rank finished, the mean over those ranks
    /// (absent before the first, or from drivers before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_loss: Option<f64>,
    /// The top-1 accuracy of that iteration's training samples, as `final_loss` (absent too from
    /// runtimes that do not report it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_accuracy: Option<f64>,
    /// The top-5 accuracy, as `final_accuracy`, of models with class logits (absent for the
    /// transformer, whose tokens report top-1 alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_accuracy_top5: Option<f64>,
    /// The last validation pass (`validate_every`): the iteration it followed and what it
    /// measured on the held-out split (absent without passes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<LastValidation>,
    /// Where each stage's time went.
    pub stages: Vec<StageShares>,
    /// How each rank ended.
    pub ranks: Vec<RankOutcome>,
    /// Why the run stopped early, if it did.
    pub failure: Option<Failure>,
    /// Each failure after which the ranks were started again (`max_restarts`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restarts: Vec<Restart>,
    /// Why a run that allowed restarts got none after its last failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_restarted: Option<String>,
    /// Containers the driver could not remove: host, name, id, ranks, why, and the command that
    /// removes each by hand.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers_not_removed: Vec<LeftContainer>,
    /// The stage config planned at launch and its prediction (`config_file: auto` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanFacts>,
    /// The Slurm job the ranks ran in, and its nodes (the Slurm backend only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm_job: Option<SlurmJob>,
    /// The ranks' profiler traces in the record (`profiler_trace: true`): the folder in the
    /// record, the ranks whose trace it holds, and why each other rank's is missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traces: Option<TracesFacts>,
    /// The driver writing the record: a record still `running` whose driver is gone was left so
    /// by a driver killed outright (absent in records of drivers before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverProcess>,
}

/// A driver process: its machine, process ID and start time, which together name it even once
/// its ID is another process's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverProcess {
    pub host: String,
    pub pid: u32,
    /// When it started, in clock ticks since the machine booted (`/proc/PID/stat`'s 22nd field).
    pub started: u64,
}

impl DriverProcess {
    /// This process; `None` where `/proc` cannot say when it started.
    pub fn this() -> Option<DriverProcess> {
        let pid = std::process::id();
        Some(DriverProcess {
            host: crate::experiment::host_name()?,
            pid,
            started: start_time(pid)?,
        })
    }

    /// Whether it is known to have ended: it ran on this machine, and no process of its ID and
    /// start time is there now. `false` where that cannot be told (another machine).
    pub fn gone(&self) -> bool {
        crate::experiment::host_name().as_deref() == Some(self.host.as_str())
            && start_time(self.pid) != Some(self.started)
    }
}

/// When process `pid` started, in clock ticks since boot; `None` where there is no such process.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (field 2) is in parentheses and may hold spaces; field 22 is the 20th after it.
    let (_, after) = stat.rsplit_once(')')?;
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Reads a record's summary, refusing another format version with a message saying so.
pub fn read_summary(dir: &std::path::Path) -> Result<Summary, String> {
    read_versioned(&dir.join("summary.json"), FORMAT_VERSION).map_err(|e| match e {
        VersionedError::Read(e) => format!("cannot read summary.json: {e}"),
        VersionedError::NotVersioned(e) => format!("summary.json is not a record summary: {e}"),
        VersionedError::Version(found) => {
            let age = if found > FORMAT_VERSION {
                "a newer"
            } else {
                "an older"
            };
            format!(
                "summary.json has format_version {found}, written by {age} driver; this driver reads \
                 version {FORMAT_VERSION}; read it with the driver that wrote it"
            )
        }
        VersionedError::Parse(e) => format!("summary.json: {e}"),
    })
}

#[cfg(test)]
mod driver_tests {
    use super::DriverProcess;

    /// This process is named by its ID and start time: itself is not gone; the same ID with
    /// another start time (the ID taken by another process since) is, and so is an ID of no
    /// process; another machine's is never said to be.
    #[test]
    fn a_driver_is_gone_once_no_process_of_its_id_and_start_time_is_here() {
        let this = DriverProcess::this().expect("/proc says when this process started");
        assert!(!this.gone());
        let reused = DriverProcess {
            started: this.started + 1,
            ..this.clone()
        };
        assert!(reused.gone());
        let ended = DriverProcess {
            pid: u32::MAX,
            ..this.clone()
        };
        assert!(ended.gone());
        let elsewhere = DriverProcess {
            host: format!("{}-elsewhere", this.host),
            ..ended
        };
        assert!(!elsewhere.gone());
    }
}
