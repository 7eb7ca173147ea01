//! Writing record files: whole files atomically (temp file + rename in the same folder), and the
//! git state of the working tree.

use std::io::Write;
use std::path::Path;
use std::process::Command;

use serde::Serialize;

use super::RecordError;

/// Replaces `path` with `bytes` so a reader never sees a half-written file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RecordError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let fail = |source| RecordError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(fail)?;
    tmp.write_all(bytes).map_err(fail)?;
    tmp.as_file().sync_data().map_err(fail)?;
    tmp.persist(path).map_err(|e| fail(e.error))?;
    Ok(())
}

/// Writes a value as pretty JSON, atomically.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<(), RecordError> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("record types always serialize");
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

/// The commit and whether the tree differs from it.
#[derive(Debug, Serialize)]
pub struct GitState {
    /// `git rev-parse HEAD`, if this is a git checkout.
    pub commit: Option<String>,
    /// Whether `git diff HEAD` is non-empty (the diff itself is in `git.diff`).
    pub dirty: bool,
}

/// Reads the commit and the diff of the working tree against it.
pub fn git_state() -> (GitState, String) {
    let run = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let commit = run(&["rev-parse", "HEAD"]).map(|s| s.trim().to_string());
    let diff = if commit.is_some() {
        run(&["diff", "HEAD"]).unwrap_or_default()
    } else {
        String::new()
    };
    (
        GitState {
            commit,
            dirty: !diff.is_empty(),
        },
        diff,
    )
}
