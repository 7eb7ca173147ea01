//! `sweep.json`: the sweep folder's index of points, each with its settings, its status and the
//! record folder that holds its run. Rewritten atomically after every change, so a reader (or a
//! `--resume`) always sees a whole file.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{files, read_versioned, RecordError, VersionedError};
use crate::config::Axis;

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

impl Index {
    /// Reads `dir/sweep.json`.
    pub fn read(dir: &Path) -> Result<Index, IndexError> {
        let path = dir.join(INDEX_FILE);
        read_versioned(&path, INDEX_VERSION).map_err(|e| match e {
            VersionedError::Read(source) => IndexError::Read { path, source },
            VersionedError::NotVersioned(message) | VersionedError::Parse(message) => {
                IndexError::Parse { path, message }
            }
            VersionedError::Version(found) => IndexError::Version { path, found },
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> Index {
        Index {
            format_version: INDEX_VERSION,
            name: "mlp".into(),
            config_file: "/x/mlp.yml".into(),
            axes: vec![Axis {
                key: "batch_size".into(),
                values: vec![serde_json::json!(32)],
            }],
            repeat: 2,
            started_at: "2026-11-22T09:00:00Z".into(),
            points: vec![PointEntry {
                index: 0,
                settings: vec![("batch_size".into(), serde_json::json!(32))],
                repeat: 1,
                name: "mlp-p0".into(),
                status: PointStatus::Failed,
                record: Some("20261122T090000Z_mlp-p0".into()),
                error: Some("rank 0 failed".into()),
                earlier_records: vec!["20261122T080000Z_mlp-p0".into()],
            }],
        }
    }

    #[test]
    fn the_index_round_trips_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        index().write(dir.path()).unwrap();
        assert_eq!(Index::read(dir.path()).unwrap(), index());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [INDEX_FILE]);
        assert_eq!(label(&index().points[0].settings, 1), "batch_size=32 #2");
    }

    #[test]
    fn another_version_or_no_index_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let e = Index::read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("is this a sweep folder?"), "{e}");
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"format_version": 7, "points": 3}"#,
        )
        .unwrap();
        let e = Index::read(dir.path()).unwrap_err();
        assert!(matches!(e, IndexError::Version { found: 7, .. }), "{e}");
        assert!(e.to_string().contains("this driver reads version 1"), "{e}");
    }
}
