//! A build context as the engine receives it: the files git tracks (and new files git does not
//! ignore) under the context folder, or every file when the folder is not in a git work tree, less
//! what `.dockerignore` leaves out. It is listed and hashed first (each file read once, never all
//! at once), so that the hash names the image and an unchanged context is never rebuilt; then
//! streamed to the engine as a tar made on the fly, with fixed owners and times so the same files
//! always make the same tar.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use bytes::Bytes;
use futures_util::Stream;
use sha2::{Digest, Sha256};

use super::dockerignore::Ignore;

/// A context that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read build context {}: {reason}", path.display())]
pub struct ContextError {
    /// The file or folder that failed.
    pub path: PathBuf,
    /// What went wrong, and what to change.
    pub reason: String,
}

/// One file of the context.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    /// Path relative to the context root, `/`-separated.
    rel: String,
    /// Permission bits.
    mode: u32,
    /// A symlink's target, or `None` for a regular file.
    link: Option<PathBuf>,
}

/// A listed context: which files, and the hash that names it.
#[derive(Debug, Clone)]
pub struct Context {
    /// The context folder.
    pub root: PathBuf,
    entries: Vec<Entry>,
    /// Bytes of file content the tar will carry.
    pub bytes: u64,
    /// Hex SHA-256 over every entry's path, mode and content (and `extra`).
    pub hash: String,
}

impl Context {
    /// Number of files.
    pub fn file_count(&self) -> usize {
        self.entries.len()
    }

    /// The relative paths of its files, in tar order.
    #[cfg(test)]
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.rel.as_str())
    }
}

/// Lists `root` as a context whose Dockerfile is `dockerfile` (relative to `root`); `extra` is
/// hashed too (the build arguments, the Dockerfile's name), so that it names the image as well.
pub fn list(root: &Path, dockerfile: &str, extra: &str) -> Result<Context, ContextError> {
    let fail = |path: &Path, reason: String| ContextError {
        path: path.to_path_buf(),
        reason,
    };
    if !root.join(dockerfile).is_file() {
        return Err(fail(
            &root.join(dockerfile),
            "there is no Dockerfile here; `container: {build: DIR}` must name a folder with a \
             Dockerfile (or give `dockerfile:` relative to it)"
                .into(),
        ));
    }
    let ignore = match std::fs::read_to_string(root.join(".dockerignore")) {
        Ok(text) => Ignore::parse(&text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ignore::default(),
        Err(e) => return Err(fail(&root.join(".dockerignore"), e.to_string())),
    };
    let candidates = match git_files(root) {
        Some(files) => files,
        None => {
            let mut files = Vec::new();
            walk(root, root, &mut files)?;
            files
        }
    };
    let mut entries = Vec::new();
    for rel in candidates {
        // The Dockerfile is always sent: the engine needs it even where .dockerignore names it.
        if rel != dockerfile && (rel == ".git" || rel.starts_with(".git/") || ignore.excludes(&rel)) {
            continue;
        }
        let full = root.join(&rel);
        // Tracked files deleted in the work tree are not part of what is built.
        let Ok(meta) = std::fs::symlink_metadata(&full) else {
            continue;
        };
        let mode = {
            use std::os::unix::fs::PermissionsExt;
            meta.permissions().mode() & 0o777
        };
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&full).map_err(|e| fail(&full, e.to_string()))?;
            entries.push(Entry {
                rel,
                mode,
                link: Some(target),
            });
        } else if meta.is_file() {
            entries.push(Entry {
                rel,
                mode,
                link: None,
            });
        }
    }
    entries.sort_by(|a, b| a.rel.cmp(&b.rel));
    entries.dedup();

    let mut hasher = Sha256::new();
    hasher.update(extra.as_bytes());
    let mut bytes = 0;
    for e in &entries {
        hasher.update(e.rel.as_bytes());
        hasher.update([0]);
        hasher.update(e.mode.to_le_bytes());
        match &e.link {
            Some(target) => hasher.update(target.as_os_str().as_encoded_bytes()),
            None => {
                let full = root.join(&e.rel);
                let n = hash_file(&full, &mut hasher).map_err(|err| fail(&full, err.to_string()))?;
                hasher.update(n.to_le_bytes());
                bytes += n;
            }
        }
    }
    let hash = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Context {
        root: root.to_path_buf(),
        entries,
        bytes,
        hash,
    })
}

/// Feeds a file to the hasher a block at a time; returns its length.
fn hash_file(path: &Path, hasher: &mut Sha256) -> std::io::Result<u64> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut block = vec![0u8; 64 * 1024];
    let mut n = 0u64;
    loop {
        let got = file.read(&mut block)?;
        if got == 0 {
            return Ok(n);
        }
        hasher.update(&block[..got]);
        n += got as u64;
    }
}

/// The files git would commit under `root` (tracked, and untracked ones it does not ignore), or
/// `None` when `root` is not in a git work tree or git is not installed.
fn git_files(root: &Path) -> Option<Vec<String>> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
            "--",
            ".",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    Some(
        text.split('\0')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
    )
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), ContextError> {
    let read = std::fs::read_dir(dir).map_err(|e| ContextError {
        path: dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    for entry in read {
        let entry = entry.map_err(|e| ContextError {
            path: dir.to_path_buf(),
            reason: e.to_string(),
        })?;
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| ContextError {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if kind.is_dir() {
            walk(root, &path, out)?;
        } else {
            let rel = path.strip_prefix(root).expect("inside root");
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    Ok(())
}

/// Size of the chunks the tar is sent in.
const CHUNK: usize = 256 * 1024;

/// The context as a tar stream, made by a blocking thread a chunk at a time (a few chunks in
/// flight), so the whole context is never in memory. A file that cannot be read ends the stream
/// with that error.
pub fn stream(context: &Context) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let root = context.root.clone();
    let entries = context.entries.clone();
    std::thread::spawn(move || {
        let writer = ChunkWriter {
            tx: tx.clone(),
            buf: Vec::with_capacity(CHUNK),
        };
        let mut builder = tar::Builder::new(writer);
        let result = (|| -> std::io::Result<()> {
            for e in &entries {
                let mut header = tar::Header::new_gnu();
                header.set_mode(e.mode);
                header.set_mtime(0);
                header.set_uid(0);
                header.set_gid(0);
                match &e.link {
                    Some(target) => {
                        header.set_entry_type(tar::EntryType::Symlink);
                        header.set_size(0);
                        builder.append_link(&mut header, &e.rel, target)?;
                    }
                    None => {
                        let full = root.join(&e.rel);
                        let file = std::fs::File::open(&full).map_err(|err| {
                            std::io::Error::new(err.kind(), format!("{}: {err}", full.display()))
                        })?;
                        header.set_size(file.metadata()?.len());
                        header.set_entry_type(tar::EntryType::Regular);
                        builder.append_data(&mut header, &e.rel, file)?;
                    }
                }
            }
            builder.into_inner()?.flush()
        })();
        if let Err(e) = result {
            let _ = tx.blocking_send(Err(e));
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
}

/// Sends what the tar builder writes as chunks over a channel.
struct ChunkWriter {
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx.blocking_send(Ok(chunk)).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the engine stopped reading the context",
            )
        })
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn write(dir: &Path, rel: &str, text: &str) {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    async fn untar(context: &Context) -> Vec<(String, Vec<u8>)> {
        let mut bytes = Vec::new();
        let mut s = Box::pin(stream(context));
        while let Some(chunk) = s.next().await {
            bytes.extend_from_slice(&chunk.unwrap());
        }
        let mut archive = tar::Archive::new(bytes.as_slice());
        archive
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = e.path().unwrap().display().to_string();
                let mut content = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut content).unwrap();
                (path, content)
            })
            .collect()
    }

    #[test]
    fn the_hash_follows_content_and_arguments_not_timestamps() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "Dockerfile", "FROM scratch\n");
        write(dir.path(), "sub/a.txt", "a");
        let first = list(dir.path(), "Dockerfile", "").unwrap().hash;
        write(dir.path(), "sub/a.txt", "a");
        assert_eq!(list(dir.path(), "Dockerfile", "").unwrap().hash, first);
        assert_ne!(list(dir.path(), "Dockerfile", "ARG=1").unwrap().hash, first);
        write(dir.path(), "sub/a.txt", "b");
        assert_ne!(list(dir.path(), "Dockerfile", "").unwrap().hash, first);
    }

    #[test]
    fn a_folder_without_dockerfile_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = list(dir.path(), "Dockerfile", "").unwrap_err();
        assert!(err.path.ends_with("Dockerfile"));
        assert!(err.reason.contains("no Dockerfile"), "{err}");
    }

    #[tokio::test]
    async fn git_decides_what_is_sent_and_dockerignore_narrows_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let git = |args: &[&str]| {
            let out = Command::new("git")
                .arg("-C")
                .arg(root)
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "git {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        git(&["init", "-q"]);
        write(root, ".gitignore", "target/\n");
        write(root, ".dockerignore", "docs\n**/*.tmp\n");
        write(root, "docker/Dockerfile", "FROM scratch\n");
        write(root, "src/main.rs", "fn main() {}\n");
        write(root, "src/new.rs", "// not added yet\n");
        write(root, "src/x.tmp", "tmp");
        write(root, "docs/a.md", "docs");
        write(root, "target/release/big", "build output");
        git(&[
            "add",
            ".gitignore",
            ".dockerignore",
            "docker",
            "src/main.rs",
            "src/x.tmp",
            "docs",
        ]);
        let ctx = list(root, "docker/Dockerfile", "").unwrap();
        let paths: Vec<&str> = ctx.paths().collect();
        assert_eq!(
            paths,
            [
                ".dockerignore",
                ".gitignore",
                "docker/Dockerfile",
                "src/main.rs",
                "src/new.rs"
            ]
        );
        let files = untar(&ctx).await;
        let names: Vec<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, paths);
        assert_eq!(files[3].1, b"fn main() {}\n");
        assert_eq!(ctx.bytes, files.iter().map(|(_, c)| c.len() as u64).sum::<u64>());
    }

    #[tokio::test]
    async fn a_context_larger_than_a_chunk_streams_whole() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "Dockerfile", "FROM scratch\n");
        let big: String = (0..3 * CHUNK)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        write(dir.path(), "big.txt", &big);
        let ctx = list(dir.path(), "Dockerfile", "").unwrap();
        let files = untar(&ctx).await;
        assert_eq!(files[1].0, "big.txt");
        assert_eq!(files[1].1, big.as_bytes());
    }
}
