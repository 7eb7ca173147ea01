//! What happens during a run, as the launchers report it. Reporters match these exhaustively, so a
//! new kind of event makes each of them decide what to do with it.

use serde::{Deserialize, Serialize};

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
    /// Whether the image was built in this run (false: it already existed).
    pub image_built: bool,
    /// Files the host lacked, copied into the containers through the Docker API.
    pub copied_in: Vec<String>,
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

/// Why the driver stopped the ranks early.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum StopCause {
    /// A rank exited non-zero (or was killed).
    RankFailed {
        rank: usize,
        host: String,
        exit_code: Option<i64>,
    },
    /// A host's engine or connection stopped answering.
    HostLost { host: String, reason: String },
    /// SIGINT (Ctrl-C) or SIGTERM.
    Interrupted,
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
        event: stagehand_contract::Event,
    },
    /// A rank ended; `exit_code` is `None` when it was killed without one.
    RankExited { rank: usize, exit_code: Option<i64> },
    /// A host could not be reached any more.
    HostLost { host: String, reason: String },
    /// The driver is stopping every rank.
    Stopping(StopCause),
    /// Every rank is gone and every container removed.
    Finished { status: Status },
}
