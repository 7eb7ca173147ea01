//! The ranks' profiler traces (`profiler_trace: true`), gathered into the record once the ranks
//! ended (all of them well, or some failed after others had written theirs): copied out of each container before it is removed (the engine's archive API, so hosts
//! need no shared filesystem), or found where local processes and Slurm's tasks wrote them,
//! straight into the record.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use crate::events::{MissingTrace, TracesFacts};
use crate::experiment::{trace_file, Experiment};
use crate::records::files;

/// Why a rank that left no trace left none, as far as the driver can tell.
const WROTE_NONE: &str =
    "the rank wrote none: a rank writes its trace once it has run the iterations it records \
     (`profiler_steps` after the warm-up)";

/// What a container's copy of the trace folder held for its ranks: each rank's trace, or why
/// there is none.
pub type Copied = BTreeMap<usize, Result<(), String>>;

/// The record's account of the traces in `dir` after the ranks ended: every rank whose trace
/// is there, and why each other one's is not (`copied`: what copying out of containers said).
pub fn account(plan: &Experiment, dir: &Path, copied: Option<Copied>) -> TracesFacts {
    let mut facts = TracesFacts {
        dir: dir.to_path_buf(),
        ranks: Vec::new(),
        missing: Vec::new(),
    };
    for rank in &plan.ranks {
        let said = copied.as_ref().and_then(|c| c.get(&rank.rank));
        let reason = match said {
            _ if written(&trace_file(dir, rank.rank)) => None,
            Some(Err(reason)) => Some(reason.clone()),
            Some(Ok(())) => Some("its copy is not in the record".to_string()),
            None if plan.slurm.is_some() => Some(format!(
                "{WROTE_NONE}; a rank that ran every iteration on a node that does not share this \
                 machine's filesystem at {} wrote it on that node",
                dir.display()
            )),
            None => Some(WROTE_NONE.to_string()),
        };
        match reason {
            None => facts.ranks.push(rank.rank),
            Some(reason) => facts.missing.push(MissingTrace {
                rank: rank.rank,
                reason,
            }),
        }
    }
    facts
}

/// Whether `path` holds a trace (the runtime leaves no file, or an empty one, when it wrote none).
fn written(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() > 0)
}

/// Unpacks the traces of `ranks` from `tar` (a container's trace folder, as the engine's archive
/// API sends it) into `dir`: each rank's `rank-N.json`, written whole or not at all.
pub fn unpack(tar: &[u8], ranks: &[usize], dir: &Path) -> Copied {
    let mut copied: Copied = ranks.iter().map(|&r| (r, Err(WROTE_NONE.to_string()))).collect();
    let mut archive = tar::Archive::new(tar);
    let entries = match archive.entries() {
        Ok(entries) => entries,
        Err(e) => {
            return fail_all(
                ranks,
                format!("cannot read the copy of its container's traces: {e}"),
            )
        }
    };
    for entry in entries {
        let mut entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                let reason = format!("cannot read the copy of its container's traces: {e}");
                for result in copied.values_mut().filter(|r| r.is_err()) {
                    *result = Err(reason.clone());
                }
                break;
            }
        };
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let Some(rank) = entry
            .path()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .and_then(|name| rank_of(&name))
            .filter(|rank| copied.contains_key(rank))
        else {
            continue;
        };
        let mut text = Vec::new();
        let result = match entry.read_to_end(&mut text) {
            Err(e) => Err(format!("cannot read its trace from the container's copy: {e}")),
            Ok(_) if text.is_empty() => Err(WROTE_NONE.to_string()),
            Ok(_) => keep(&trace_file(dir, rank), &text),
        };
        copied.insert(rank, result);
    }
    copied
}

/// Every rank in `ranks` failed for `reason`.
pub fn fail_all(ranks: &[usize], reason: String) -> Copied {
    ranks.iter().map(|&r| (r, Err(reason.clone()))).collect()
}

/// The rank a trace file is named for (`rank-N.json`).
fn rank_of(name: &str) -> Option<usize> {
    name.strip_prefix("rank-")?.strip_suffix(".json")?.parse().ok()
}

/// Writes a rank's trace into the record's folder, whole or not at all.
fn keep(path: &Path, bytes: &[u8]) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("cannot make {}: {e}", parent.display()))?;
    }
    files::write_atomic(path, bytes).map_err(|e| crate::error::error_chain(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        let mut dir = tar::Header::new_gnu();
        dir.set_entry_type(tar::EntryType::Directory);
        dir.set_mode(0o755);
        dir.set_size(0);
        builder
            .append_data(&mut dir, "stagehand-traces/", std::io::empty())
            .unwrap();
        for (name, bytes) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o644);
            builder
                .append_data(&mut header, format!("stagehand-traces/{name}"), *bytes)
                .unwrap();
        }
        builder.into_inner().unwrap()
    }

    #[test]
    fn a_containers_traces_are_unpacked_for_its_own_ranks_only() {
        let dir = tempfile::tempdir().unwrap();
        let tar = tar_of(&[
            ("rank-2.json", b"{\"traceEvents\": []}"),
            ("rank-3.json", b""),
            // Another container's rank, and files that are not traces, stay out of the record.
            ("rank-7.json", b"{}"),
            ("notes.txt", b"x"),
        ]);
        let copied = unpack(&tar, &[2, 3, 4], dir.path());
        assert_eq!(copied[&2], Ok(()));
        assert!(
            copied[&3].as_ref().unwrap_err().contains("wrote none"),
            "{copied:?}"
        );
        assert!(
            copied[&4].as_ref().unwrap_err().contains("wrote none"),
            "{copied:?}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("rank-2.json")).unwrap(),
            "{\"traceEvents\": []}"
        );
        let mut kept: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        kept.sort();
        assert_eq!(kept, ["rank-2.json"]);
    }

    #[test]
    fn a_broken_copy_is_each_ranks_reason() {
        let dir = tempfile::tempdir().unwrap();
        let mut tar = tar_of(&[("rank-0.json", &[b'x'; 2048])]);
        tar.truncate(700);
        let copied = unpack(&tar, &[0, 1], dir.path());
        for rank in [0, 1] {
            let reason = copied[&rank].as_ref().unwrap_err();
            assert!(reason.starts_with("cannot read"), "{rank}: {reason}");
        }
        assert!(!dir.path().join("rank-0.json").exists());
    }

    /// Two process ranks tracing into `dir` (as a record's would).
    fn plan(dir: &Path) -> Experiment {
        let file = dir.join("exp.yml");
        std::fs::write(
            &file,
            "backend: process\nmachines: [localhost, localhost]\nmodule: mlp\nprofiler_trace: true\n",
        )
        .unwrap();
        let loaded = crate::config::load(&file).unwrap();
        let options = crate::experiment::tests::options(None, crate::options::ContainerMode::PerRank);
        let mut plan = crate::experiment::resolve(&loaded, &options, 29500).unwrap();
        plan.keep_traces_in(dir);
        plan
    }

    #[test]
    fn the_account_names_each_rank_without_a_trace_and_why() {
        let record = tempfile::tempdir().unwrap();
        let plan = plan(record.path());
        let dir = record.path().join("traces");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rank-0.json"), "{}").unwrap();
        // The runtime's empty placeholder of a trace it never wrote counts as none.
        std::fs::write(dir.join("rank-1.json"), "").unwrap();
        let facts = account(&plan, &dir, None);
        assert_eq!(facts.ranks, [0]);
        assert_eq!(facts.missing.len(), 1);
        assert_eq!(facts.missing[0].rank, 1);
        assert!(facts.missing[0].reason.contains("wrote none"), "{facts:?}");
        // What copying said stands for a rank whose trace is not there (rank 0's copy came in
        // before, say, the rest were interrupted).
        let copied = Copied::from([
            (0, Err("interrupted".to_string())),
            (1, Err("cannot copy".to_string())),
        ]);
        let facts = account(&plan, &dir, Some(copied));
        assert_eq!(facts.ranks, [0]);
        let reasons: Vec<&str> = facts.missing.iter().map(|m| m.reason.as_str()).collect();
        assert_eq!(reasons, ["cannot copy"]);
    }

    #[test]
    fn trace_files_are_named_for_their_rank() {
        assert_eq!(rank_of("rank-12.json"), Some(12));
        assert_eq!(rank_of("rank-12.json.part"), None);
        assert_eq!(rank_of("rank-.json"), None);
        assert_eq!(rank_of("trace.json"), None);
    }
}
