//! The experiment record format, in one place: the record folder
//! `<log_directory>/<UTC timestamp>_<name>/` ([`Record`]), its files ([`files`]), its verdict
//! `summary.json` ([`summary`]) with throughput ([`stats`]), the resolved configuration
//! `config.resolved.json` ([`Resolved`]) and a sweep's index `sweep.json` ([`index`]). The record
//! reporter, sweeps and runs write it; `driver results` reads it; this module imports none of them.

pub mod files;
pub mod index;
pub mod stats;
pub mod summary;

use std::path::{Path, PathBuf};

use jiff::Timestamp;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::config::{ExperimentFile, Loaded};
use crate::experiment::Experiment;

/// The resolved configuration's file name in a record.
pub const RESOLVED_FILE: &str = "config.resolved.json";

/// `config.resolved.json`: the experiment file as read and the experiment as resolved for
/// launch. Written with `P = &Experiment`; read back with a view of the parts the reader needs
/// (`P = ResolvedRanks` for `driver results`).
#[derive(Debug, Serialize, Deserialize)]
pub struct Resolved<E, P> {
    /// The experiment file, defaults not filled in.
    pub experiment: E,
    /// The resolved experiment: hosts, ranks and their command lines.
    pub plan: P,
}

/// What `driver results` reads of a resolved experiment.
#[derive(Debug, Deserialize)]
pub struct ResolvedRanks {
    /// Each rank's stage, in rank order.
    pub ranks: Vec<ResolvedRank>,
    /// The minibatch size, when the file left it to the runtime's default.
    pub batch_size: Option<u32>,
}

/// One rank of [`ResolvedRanks`].
#[derive(Debug, Deserialize)]
pub struct ResolvedRank {
    /// The rank's stage; `None` without a stage config.
    pub stage: Option<usize>,
    /// The rank's command line.
    #[serde(default)]
    pub argv: Vec<String>,
}

/// Reads a record's `config.resolved.json`.
pub fn read_resolved(dir: &Path) -> Result<Resolved<ExperimentFile, ResolvedRanks>, String> {
    let text = std::fs::read_to_string(dir.join(RESOLVED_FILE))
        .map_err(|e| format!("cannot read {RESOLVED_FILE}: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("{RESOLVED_FILE}: {e}"))
}

/// Why a versioned JSON file (a summary, a sweep index) could not be read.
#[derive(Debug)]
pub enum VersionedError {
    /// The file could not be read.
    Read(std::io::Error),
    /// It is not JSON with a `format_version`.
    NotVersioned(String),
    /// It has another version.
    Version(u32),
    /// It has the version but not the content.
    Parse(String),
}

/// Reads a JSON file whose `format_version` must be `expected`; the version is read first, so
/// a file of another version gets its own message rather than a parse error.
pub fn read_versioned<T: DeserializeOwned>(path: &Path, expected: u32) -> Result<T, VersionedError> {
    #[derive(Deserialize)]
    struct Versioned {
        format_version: u32,
    }
    let text = std::fs::read_to_string(path).map_err(VersionedError::Read)?;
    let version: Versioned =
        serde_json::from_str(&text).map_err(|e| VersionedError::NotVersioned(e.to_string()))?;
    if version.format_version != expected {
        return Err(VersionedError::Version(version.format_version));
    }
    serde_json::from_str(&text).map_err(|e| VersionedError::Parse(e.to_string()))
}

/// A record file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot create record folder {}; check --output-dir or log_directory", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write record file {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A created record folder.
#[derive(Debug, Clone)]
pub struct Record {
    /// The folder.
    pub dir: PathBuf,
    /// Its name, also the experiment id used in container labels.
    pub id: String,
    /// When the run started.
    pub started: Timestamp,
}

impl Record {
    /// Creates a fresh folder under `parent` named by the UTC time and `name`.
    pub fn create(parent: &Path, name: &str) -> Result<Record, RecordError> {
        let started = Timestamp::now();
        let stamp = started.strftime("%Y%m%dT%H%M%SZ").to_string();
        std::fs::create_dir_all(parent).map_err(|source| RecordError::CreateDir {
            path: parent.to_path_buf(),
            source,
        })?;
        for n in 0.. {
            let id = if n == 0 {
                format!("{stamp}_{name}")
            } else {
                format!("{stamp}_{name}-{n}")
            };
            let dir = parent.join(&id);
            match std::fs::create_dir(&dir) {
                Ok(()) => return Ok(Record { dir, id, started }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(source) => return Err(RecordError::CreateDir { path: dir, source }),
            }
        }
        unreachable!("some suffix is free")
    }

    /// Writes what is known before launch: the configs and the git state.
    pub fn write_setup(&self, loaded: &Loaded, plan: &Experiment) -> Result<(), RecordError> {
        files::write_atomic(&self.dir.join("config.given.yml"), loaded.text.as_bytes())?;
        let resolved = Resolved {
            experiment: &loaded.file,
            plan,
        };
        files::write_json(&self.dir.join(RESOLVED_FILE), &resolved)?;
        let (git, diff) = files::git_state();
        files::write_json(&self.dir.join("git.json"), &git)?;
        files::write_atomic(&self.dir.join("git.diff"), diff.as_bytes())
    }
}
