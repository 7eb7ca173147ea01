//! `summary.json`: the record's verdict, converted from in-memory state and versioned.

use serde::{Deserialize, Serialize};

use crate::events::{PlanFacts, Status, StopCause};
use crate::reporters::stats::{StageShares, Throughput};

/// Version of `summary.json`; bumped when a field changes meaning.
pub const FORMAT_VERSION: u32 = 1;

/// How each rank ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankOutcome {
    /// Global rank.
    pub rank: usize,
    /// Host it ran on.
    pub host: String,
    /// Container or process id.
    pub handle: Option<String>,
    /// Exit code, once exited (`null` while running or when killed without one).
    pub exit_code: Option<i64>,
    /// Whether it has exited.
    pub exited: bool,
}

/// What went wrong, for a failed or interrupted run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Failure {
    /// What made the driver stop.
    pub cause: StopCause,
    /// The last lines the failing rank printed (empty for a host loss or an interrupt).
    pub last_lines: Vec<String>,
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
    /// Job samples/s, mean and spread, once an iteration completed.
    pub throughput: Option<Throughput>,
    /// Where each stage's time went.
    pub stages: Vec<StageShares>,
    /// How each rank ended.
    pub ranks: Vec<RankOutcome>,
    /// Why the run stopped early, if it did.
    pub failure: Option<Failure>,
    /// The stage config planned at launch and its prediction (`config_file: auto` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanFacts>,
}
