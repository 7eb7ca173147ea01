//! A build context as a tar stream, made deterministic (sorted entries, fixed owners and times) so
//! that its hash names the image and an unchanged context is never rebuilt.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// A context that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read build context {}; `container: {{build: DIR}}` must name a folder with a Dockerfile", path.display())]
pub struct ContextError {
    /// The file or folder that failed.
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// The context as the engine receives it.
#[derive(Debug)]
pub struct Context {
    /// The tar bytes.
    pub tar: Vec<u8>,
    /// First 16 hex digits of the tar's SHA-256.
    pub hash: String,
}

/// Tars `dir` (regular files and folders; symlinks are followed).
pub fn pack(dir: &Path) -> Result<Context, ContextError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ContextError { path, source }
    };
    if !dir.join("Dockerfile").is_file() {
        return Err(ContextError {
            path: dir.join("Dockerfile"),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no Dockerfile"),
        });
    }
    let mut files = Vec::new();
    collect(dir, dir, &mut files)?;
    files.sort();
    let mut builder = tar::Builder::new(Vec::new());
    for rel in &files {
        let full = dir.join(rel);
        let data = std::fs::read(&full).map_err(err(&full))?;
        let mode = {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(&full).map_err(err(&full))?.permissions().mode() & 0o777
        };
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(mode);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, rel, data.as_slice())
            .map_err(err(&full))?;
    }
    let tar = builder.into_inner().map_err(err(dir))?;
    let digest = Sha256::digest(&tar);
    let hash = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    Ok(Context { tar, hash })
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), ContextError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ContextError {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries {
        let entry = entry.map_err(|source| ContextError {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        let meta = std::fs::metadata(&path).map_err(|source| ContextError {
            path: path.clone(),
            source,
        })?;
        if meta.is_dir() {
            collect(root, &path, out)?;
        } else if meta.is_file() {
            out.push(path.strip_prefix(root).expect("inside root").to_path_buf());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_follows_content_not_timestamps() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("Dockerfile"), "FROM scratch\n").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a.txt"), "a").unwrap();
        let first = pack(dir.path()).unwrap().hash;
        std::fs::write(dir.path().join("sub/a.txt"), "a").unwrap();
        assert_eq!(pack(dir.path()).unwrap().hash, first);
        std::fs::write(dir.path().join("sub/a.txt"), "b").unwrap();
        assert_ne!(pack(dir.path()).unwrap().hash, first);
    }

    #[test]
    fn a_folder_without_dockerfile_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = pack(dir.path()).unwrap_err();
        assert!(err.path.ends_with("Dockerfile"));
    }
}
