//! `sweep.json`: the sweep folder's index of points, each with its settings, its status and the
//! record folder that holds its run. Rewritten atomically after every change, so a reader (or a
//! `--resume`) always sees a whole file.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::Axis;
use crate::reporters::record::files;
use crate::reporters::record::RecordError;

/// Version of `sweep.json`; bumped when a field changes meaning.
pub const INDEX_VERSION: u32 = 1;
/// The index's file name inside a sweep folder.
pub const INDEX_FILE: &str = "sweep.json";

/// Where a point stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PointStatus {
    /// Not run yet.
    Pending,
    /// Running now (or the driver died while it ran).
    Running,
    /// Its record succeeded.
    Succeeded,
    /// Its run failed (its record, or `error`, says why).
    Failed,
    /// Interrupted by the user.
    Interrupted,
}

/// One point of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointEntry {
    /// Position in the sweep, from 0.
    pub index: usize,
    /// The axes' keys and this point's values, in axis order.
    pub settings: Vec<(String, serde_json::Value)>,
    /// Repetition, from 0.
    pub repeat: u32,
    /// The point's experiment name (its record folder ends with it).
    pub name: String,
    /// Where it stands.
    pub status: PointStatus,
    /// Its latest record folder, relative to the sweep folder.
    pub record: Option<String>,
    /// Why it failed when no record tells (it failed before its ranks started).
    pub error: Option<String>,
    /// Record folders of earlier tries, before a `--resume` ran it again.
    #[serde(default)]
    pub earlier_records: Vec<String>,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// See [`INDEX_VERSION`].
    pub format_version: u32,
    /// The experiment's name.
    pub name: String,
    /// The experiment file, absolute; `--resume` reads it again from there.
    pub config_file: PathBuf,
    /// The grid, in axis order.
    pub axes: Vec<Axis>,
    /// Runs per point.
    pub repeat: u32,
    /// RFC 3339 UTC.
    pub started_at: String,
    /// Every point, in order.
    pub points: Vec<PointEntry>,
}

/// The index could not be read.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("cannot read {}; is this a sweep folder?", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a sweep index: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error(
        "{} has format_version {found}, but this driver reads version {INDEX_VERSION}; use the driver \
         that wrote it",
        path.display()
    )]
    Version { path: PathBuf, found: u32 },
}

/// Only the version, read first so another version gets its own message.
#[derive(Deserialize)]
struct Versioned {
    format_version: u32,
}

impl Index {
    /// Reads `dir/sweep.json`.
    pub fn read(dir: &Path) -> Result<Index, IndexError> {
        let path = dir.join(INDEX_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| IndexError::Read {
            path: path.clone(),
            source,
        })?;
        let parse = |e: serde_json::Error| IndexError::Parse {
            path: path.clone(),
            message: e.to_string(),
        };
        let version: Versioned = serde_json::from_str(&text).map_err(parse)?;
        if version.format_version != INDEX_VERSION {
            return Err(IndexError::Version {
                path,
                found: version.format_version,
            });
        }
        serde_json::from_str(&text).map_err(parse)
    }

    /// Replaces `dir/sweep.json` atomically.
    pub fn write(&self, dir: &Path) -> Result<(), RecordError> {
        files::write_json(&dir.join(INDEX_FILE), self)
    }
}

/// A point's settings as one label: `batch_size=32 schedule=gpipe`, with `#2` for a repetition
/// after the first.
pub fn label(settings: &[(String, serde_json::Value)], repeat: u32) -> String {
    let mut parts: Vec<String> = settings
        .iter()
        .map(|(k, v)| format!("{k}={}", crate::config::value_text(v)))
        .collect();
    if repeat > 0 {
        parts.push(format!("#{}", repeat + 1));
    }
    parts.join(" ")
}
