//! Checkpoints that resume exactly. Each rank writes its own, under `DIR/rank-R/`: after
//! iteration `K` (counted from 1) the stage's parameters and buffers and its optimizer's state
//! go into `iter-K/`, then its description (`iter-K/checkpoint.json`, which marks it whole), then
//! `latest` is replaced (write and rename) to name it, then checkpoints older than the one before
//! it are removed. A rank stopped at any point leaves `latest` naming a whole one.
//!
//! Two generations stay: ranks checkpoint one after another, so a rank stopped while writing
//! `iter-K` may leave the others' `latest` at `K` and its own at the one before. Resuming takes
//! the newest iteration every rank holds ([`Latest::held`], agreed on over the ranks), and a rank a
//! generation ahead steps back to it ([`step_back`]).
//!
//! Resuming loads them, skips the `K` minibatches the data stream already gave, and runs
//! iterations `K..`: the same numbers, in the same order, as a run that was never stopped. A
//! checkpoint records what it must agree with ([`Identity`]); resuming into another model,
//! split, optimizer or batch is refused with what differs.
//!
//! The description records each file's length and CRC-32 as written ([`Written`]); a resume
//! checks them before it loads anything, and a rank whose latest checkpoint is damaged (a disk
//! or a copy that changed or cut a file) offers the one before it instead ([`whole_or_before`]).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

use super::{GradScaler, Optimizer, Stage};

/// The checkpoint format's version.
pub const FORMAT_VERSION: u32 = 1;

/// What a checkpoint must agree with to be resumed: the run that wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    pub model: String,
    pub world_size: usize,
    pub rank: usize,
    pub first_module: usize,
    pub end_module: usize,
    pub optimizer: String,
    pub batch_size: usize,
    pub microbatches: usize,
    pub schedule: String,
    pub seed: u64,
    pub data: String,
    /// The model's sizes, by flag (`--hidden`: 1024; [`crate::models::size_flags`]); absent in
    /// checkpoints written before they were recorded, which are then not checked against them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sizes: BTreeMap<String, serde_json::Value>,
    /// What the steps are taken with, by flag (`--lr`: 0.1): not part of what must agree, since
    /// a run may go on with another rate, but a resume that changes one says so
    /// ([`Identity::changed_settings`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, serde_json::Value>,
}

impl Identity {
    /// The first thing that differs from `other`, as `name is ours there, theirs here`: a size
    /// first (another `--layers` also moves the stage's modules, but the size says why).
    fn difference(&self, other: &Identity) -> Option<String> {
        let said = |name: &str, there: &serde_json::Value, here: Option<&serde_json::Value>| {
            (Some(there) != here).then(|| {
                format!(
                    "{name} is {there} there, {} here",
                    here.cloned().unwrap_or_default()
                )
            })
        };
        let size = self
            .sizes
            .iter()
            .find_map(|(flag, there)| said(flag, there, other.sizes.get(flag)));
        if size.is_some() {
            return size;
        }
        let (a, b) = (
            serde_json::to_value(self).ok()?,
            serde_json::to_value(other).ok()?,
        );
        let (a, b) = (a.as_object()?, b.as_object()?);
        // What a user sets before what follows from it: another world size also changes the
        // microbatches derived from the replicas, and the modules of a rank's stage.
        const ORDER: [&str; 11] = [
            "model",
            "world_size",
            "rank",
            "optimizer",
            "batch_size",
            "schedule",
            "seed",
            "data",
            "microbatches",
            "first_module",
            "end_module",
        ];
        let rest = a.keys().filter(|k| !ORDER.contains(&k.as_str()));
        ORDER
            .iter()
            .copied()
            .chain(rest.map(String::as_str))
            .filter(|k| !["sizes", "settings"].contains(k))
            .find_map(|k| said(k, a.get(k)?, b.get(k)))
    }

    /// Each setting `here` takes its steps with that differs from this checkpoint's, as a
    /// warning; a setting the checkpoint does not record is not compared.
    pub fn changed_settings(&self, here: &Identity) -> Vec<String> {
        self.settings
            .iter()
            .filter_map(|(flag, there)| {
                let now = here.settings.get(flag).filter(|now| *now != there)?;
                let shown = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
                let (now, there) = (shown(now), shown(there));
                Some(format!(
                    "resuming with {flag} {now}, where the checkpoint was written with {there}: \
                     the iterations from here on step with {now}, so the run is not the one it \
                     would have been unstopped"
                ))
            })
            .collect()
    }
}

/// `latest`: the checkpoint to resume.
#[derive(Debug, Serialize, Deserialize)]
pub struct Latest {
    format_version: u32,
    /// Iterations done when it was written.
    pub iterations_done: u64,
    /// Optimizer steps taken (more than iterations under PipeDream's schedule).
    steps: u64,
    identity: Identity,
    /// The iterations done of the checkpoint this one followed in the same run, kept beside it
    /// (absent in checkpoints written before two generations were kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<u64>,
    /// Each file of the checkpoint, by name, as written (absent in checkpoints written before
    /// files were summed, whose files are then loaded unchecked).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    files: BTreeMap<String, Written>,
}

/// A checkpoint file as written: its length and CRC-32 (which any change of up to 32 bits, and
/// all but one in 2^32 of larger ones, alters).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Written {
    bytes: u64,
    crc32: u32,
}

impl Written {
    /// What `path` holds now.
    fn of(path: &Path) -> std::io::Result<Written> {
        let mut file = std::fs::File::open(path)?;
        let mut hasher = crc32fast::Hasher::new();
        let mut buffer = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file.read(&mut buffer)?;
            if n == 0 {
                break;
            }
            hasher.update(&buffer[..n]);
            bytes += n as u64;
        }
        Ok(Written {
            bytes,
            crc32: hasher.finalize(),
        })
    }
}

impl Latest {
    /// The settings `here` takes its steps with that differ from this checkpoint's, each as a
    /// warning ([`Identity::changed_settings`]).
    pub fn changed_settings(&self, here: &Identity) -> Vec<String> {
        self.identity.changed_settings(here)
    }

    /// The iterations done of the checkpoints this rank holds: this one and the one before.
    pub fn held(&self) -> impl Iterator<Item = u64> {
        std::iter::once(self.iterations_done).chain(self.previous)
    }
}

/// A checkpoint's description, inside its folder.
const DESCRIPTION: &str = "checkpoint.json";

/// This rank's checkpoint folder.
pub fn rank_dir(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}"))
}

fn iteration_dir(dir: &Path, rank: usize, done: u64) -> PathBuf {
    rank_dir(dir, rank).join(format!("iter-{done}"))
}

fn io(what: &str, path: &Path, e: &dyn std::fmt::Display) -> String {
    format!("checkpoint: cannot {what} {}: {e}", path.display())
}

/// Writes `latest` as `path`'s content: a temporary file renamed over it.
fn write_description(path: &Path, latest: &Latest) -> Result<(), String> {
    let temporary = path.with_extension("tmp");
    let text = serde_json::to_string_pretty(latest).expect("a checkpoint's description serializes") + "\n";
    std::fs::write(&temporary, text).map_err(|e| io("write", &temporary, &e))?;
    std::fs::rename(&temporary, path).map_err(|e| io("replace", path, &e))
}

/// Removes this rank's checkpoints of iterations for which `remove` holds.
fn remove_where(dir: &Path, rank: usize, remove: impl Fn(u64) -> bool) -> Result<(), String> {
    let rank_dir = rank_dir(dir, rank);
    let entries = std::fs::read_dir(&rank_dir).map_err(|e| io("list", &rank_dir, &e))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let iteration = name.strip_prefix("iter-").and_then(|k| k.parse::<u64>().ok());
        if iteration.is_some_and(&remove) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    Ok(())
}

/// Writes the checkpoint after `done` iterations; `keep`, the one before it in this run (written
/// or resumed from), stays beside it, and every other one of this rank is removed.
pub fn save(
    dir: &Path,
    identity: &Identity,
    done: u64,
    keep: Option<u64>,
    stage: &Stage,
    optimizer: &Optimizer,
    scaler: Option<&GradScaler>,
) -> Result<(), String> {
    let here = iteration_dir(dir, identity.rank, done);
    // What a rank stopped while writing this iteration before left of it.
    if here.exists() {
        std::fs::remove_dir_all(&here).map_err(|e| io("remove", &here, &e))?;
    }
    std::fs::create_dir_all(&here).map_err(|e| io("create", &here, &e))?;
    let mut files = BTreeMap::new();
    let mut summed = |path: &Path| -> Result<(), String> {
        let written = Written::of(path).map_err(|e| io("read back", path, &e))?;
        let name = path.file_name().expect("a checkpoint file has a name");
        files.insert(name.to_string_lossy().into_owned(), written);
        Ok(())
    };
    let params = here.join(PARAMS_FILE);
    stage.save(&params).map_err(|e| io("write", &params, &e))?;
    summed(&params)?;
    let (named, steps) = optimizer.state_tensors();
    // Contiguous, as safetensors holds them (a channels_last parameter's buffers are not); loading
    // puts them back in their parameter's layout.
    let on_cpu: Vec<(String, Tensor)> = named
        .into_iter()
        .map(|(n, t)| (n, t.to_device(Device::Cpu).contiguous()))
        .collect();
    let state = here.join(OPTIMIZER_FILE);
    Tensor::write_safetensors(&on_cpu, &state).map_err(|e| io("write", &state, &e))?;
    summed(&state)?;
    if let Some(scaler) = scaler {
        let path = here.join(SCALER_FILE);
        let named: Vec<(String, Tensor)> = scaler
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (n.to_string(), t.to_device(Device::Cpu)))
            .collect();
        Tensor::write_safetensors(&named, &path).map_err(|e| io("write", &path, &e))?;
        summed(&path)?;
    }
    let latest = Latest {
        format_version: FORMAT_VERSION,
        iterations_done: done,
        steps,
        identity: identity.clone(),
        previous: keep.filter(|&k| k != done),
        files,
    };
    write_description(&here.join(DESCRIPTION), &latest)?;
    write_description(&rank_dir(dir, identity.rank).join("latest"), &latest)?;
    // The rest are named by neither `latest` nor the checkpoint before it.
    remove_where(dir, identity.rank, |k| k != done && Some(k) != latest.previous)
}

/// Makes `to`, a checkpoint this rank holds from before its latest, the latest again, and
/// removes the newer ones: the ranks resume from `to`, and the run writes them anew.
pub fn step_back(dir: &Path, to: &Latest) -> Result<(), String> {
    let rank = to.identity.rank;
    write_description(&rank_dir(dir, rank).join("latest"), to)?;
    remove_where(dir, rank, |k| k > to.iterations_done)
}

/// Sets aside this rank's checkpoints for a run that starts afresh: `latest` goes (the data stays
/// until this run's first checkpoint replaces it), so that no later `--resume` of this run takes
/// an earlier run's checkpoint for its own. Returns what was set aside, in words.
pub fn set_aside(dir: &Path, rank: usize) -> Result<Option<String>, String> {
    let path = rank_dir(dir, rank).join("latest");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let what = match serde_json::from_str::<Latest>(&text) {
        Ok(latest) => format!("the checkpoint of iteration {}", latest.iterations_done),
        Err(_) => format!("{}, which names no checkpoint", path.display()),
    };
    std::fs::remove_file(&path).map_err(|e| io("remove", &path, &e))?;
    Ok(Some(what))
}

/// Refuses a run that starts afresh where `dir` holds this rank's checkpoint of another run (a
/// `difference` in [`Identity`]: another model, size, seed, world...): setting it aside would
/// remove it at this run's first checkpoint, and it is not this run's to remove. The same run's
/// (started again without `--resume`) is, as is a `latest` that names no checkpoint.
pub fn check_afresh(dir: &Path, identity: &Identity) -> Result<(), String> {
    let path = rank_dir(dir, identity.rank).join("latest");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let Ok(latest) = serde_json::from_str::<Latest>(&text) else {
        return Ok(());
    };
    match latest.identity.difference(identity) {
        None => Ok(()),
        Some(difference) => Err(format!(
            "--checkpoint-dir: {} holds the checkpoint of iteration {} of another run ({difference}), \
             which this run would remove at its first checkpoint; give this run a folder of its own, \
             resume that run with the arguments it was written with, or remove its checkpoints \
             ({}) to reuse the folder",
            dir.display(),
            latest.iterations_done,
            rank_dir(dir, identity.rank).display()
        )),
    }
}

/// The checkpoint of this rank after `done` iterations, the one before `latest` (its description
/// inside its folder), after checking it belongs to this run.
pub fn read_held(dir: &Path, identity: &Identity, done: u64) -> Result<Latest, String> {
    let path = iteration_dir(dir, identity.rank, done).join(DESCRIPTION);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "--resume: rank {}'s checkpoint of iteration {done} is not whole ({}: {e})",
            identity.rank,
            path.display()
        )
    })?;
    parse(&path, &text, dir, identity)
}

/// The checkpoint description `text` read from `path`, after checking it belongs to this run.
fn parse(path: &Path, text: &str, dir: &Path, identity: &Identity) -> Result<Latest, String> {
    let latest: Latest = serde_json::from_str(text)
        .map_err(|e| format!("--resume: {} is not a checkpoint: {e}", path.display()))?;
    if latest.format_version != FORMAT_VERSION {
        return Err(format!(
            "--resume: {} is checkpoint format {}, this runtime reads {FORMAT_VERSION}",
            path.display(),
            latest.format_version
        ));
    }
    if let Some(difference) = latest.identity.difference(identity) {
        return Err(format!(
            "--resume: the checkpoint in {} is of another run: {difference}; resume with the \
             arguments it was written with, or start afresh without --resume",
            dir.display()
        ));
    }
    Ok(latest)
}

/// The checkpoint `dir` holds for this rank, after checking it belongs to this run.
pub fn read_latest(dir: &Path, identity: &Identity) -> Result<Latest, String> {
    let path = rank_dir(dir, identity.rank).join("latest");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "--resume: no checkpoint of rank {} in {} ({}: {e}); run without --resume to start afresh",
            identity.rank,
            dir.display(),
            path.display()
        )
    })?;
    parse(&path, &text, dir, identity)
}

/// [`read_latest`] when `dir` holds a checkpoint of this rank, `None` when it holds none yet
/// (`--resume=auto`); one of another run is still refused.
pub fn read_latest_if_any(dir: &Path, identity: &Identity) -> Result<Option<Latest>, String> {
    match rank_dir(dir, identity.rank).join("latest").try_exists() {
        Ok(false) => Ok(None),
        Ok(true) | Err(_) => read_latest(dir, identity).map(Some),
    }
}

/// The stage's parameters and buffers, in a checkpoint.
const PARAMS_FILE: &str = "params.safetensors";
/// The optimizer's state, in a checkpoint.
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// fp16's gradient scaler (its scale and growth tracker), in a checkpoint written with one.
const SCALER_FILE: &str = "scaler.safetensors";

/// How the checkpoint `latest` describes differs from what was written, in words: the first file
/// missing, of another length, or of another CRC-32; `None` when every file is as written.
fn damage(dir: &Path, latest: &Latest) -> Option<String> {
    let here = iteration_dir(dir, latest.identity.rank, latest.iterations_done);
    latest.files.iter().find_map(|(name, written)| {
        let path = here.join(name);
        match Written::of(&path) {
            Err(e) => Some(format!("cannot read {}: {e}", path.display())),
            Ok(now) if now.bytes != written.bytes => Some(format!(
                "{} is {} bytes, {} when it was written",
                path.display(),
                now.bytes,
                written.bytes
            )),
            Ok(now) if now.crc32 != written.crc32 => Some(format!(
                "{} holds other bytes than were written (CRC-32 {:08x}, {:08x} when written)",
                path.display(),
                now.crc32,
                written.crc32
            )),
            Ok(_) => None,
        }
    })
}

/// `latest` (read by [`read_latest`]) when its files are as written; when they are not, the
/// checkpoint before it if that one is whole, said in a line on stderr (the ranks then agree on
/// it, and the damaged one is removed when this rank steps back to it); else why neither is.
pub fn whole_or_before(dir: &Path, identity: &Identity, latest: Latest) -> Result<Latest, String> {
    let Some(damaged) = damage(dir, &latest) else {
        return Ok(latest);
    };
    let rank = identity.rank;
    let done = latest.iterations_done;
    let Some(previous) = latest.previous else {
        return Err(format!(
            "--resume: rank {rank}'s checkpoint of iteration {done} is damaged ({damaged}), and it \
             holds none before it; restore the file, or start afresh without --resume"
        ));
    };
    let before = match read_held(dir, identity, previous) {
        Ok(before) => damage(dir, &before).map_or(Ok(before), Err),
        Err(e) => Err(e.trim_start_matches("--resume: ").to_string()),
    };
    match before {
        Ok(before) => {
            eprintln!(
                "runtime: rank {rank}: warning: the checkpoint of iteration {done} is damaged \
                 ({damaged}); this rank resumes from the one before it, of iteration {previous}"
            );
            Ok(before)
        }
        Err(also) => Err(format!(
            "--resume: rank {rank}'s checkpoint of iteration {done} is damaged ({damaged}), and so \
             is the one before it, of iteration {previous} ({also}); restore the files, or start \
             afresh without --resume"
        )),
    }
}

/// Loads the checkpoint `latest` names ([`read_latest`]) into `stage`, `optimizer` and, with
/// fp16, the gradient `scaler` (a checkpoint with a scaler resumes only with one, and back).
pub fn load(
    dir: &Path,
    latest: &Latest,
    stage: &mut Stage,
    optimizer: &mut Optimizer,
    scaler: Option<&mut GradScaler>,
) -> Result<(), String> {
    let here = iteration_dir(dir, latest.identity.rank, latest.iterations_done);
    let params = here.join(PARAMS_FILE);
    stage
        .load(&params)
        .map_err(|e| format!("--resume: cannot read {}: {e}", params.display()))?;
    let state = here.join(OPTIMIZER_FILE);
    let named = Tensor::read_safetensors(&state)
        .map_err(|e| format!("--resume: cannot read {}: {e}", state.display()))?;
    optimizer
        .load_state(named, latest.steps)
        .map_err(|e| format!("--resume: {}: {e}", state.display()))?;
    let saved = here.join(SCALER_FILE);
    match (scaler, saved.is_file()) {
        (Some(scaler), true) => {
            let named = Tensor::read_safetensors(&saved)
                .map_err(|e| format!("--resume: cannot read {}: {e}", saved.display()))?;
            scaler
                .load_state(named)
                .map_err(|e| format!("--resume: {}: {e}", saved.display()))
        }
        (None, false) => Ok(()),
        (Some(_), false) => Err(format!(
            "--resume: the checkpoint in {} was written without fp16's gradient scaler; resume \
             with the --precision it was written with",
            here.display()
        )),
        (None, true) => Err(format!(
            "--resume: the checkpoint in {} holds fp16's gradient scaler; resume with --precision fp16",
            here.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CheckpointConfig;

    fn identity() -> Identity {
        Identity {
            model: "mlp".into(),
            world_size: 2,
            rank: 1,
            first_module: 3,
            end_module: 6,
            optimizer: "sgd".into(),
            batch_size: 16,
            microbatches: 4,
            schedule: "1f1b".into(),
            seed: 0,
            data: "synthetic".into(),
            sizes: [("--hidden", 64), ("--layers", 4)]
                .into_iter()
                .map(|(flag, v)| (flag.to_string(), v.into()))
                .collect(),
            settings: [("--lr", 0.1), ("--momentum", 0.9)]
                .into_iter()
                .map(|(flag, v)| (flag.to_string(), v.into()))
                .collect(),
        }
    }

    #[test]
    fn a_difference_names_the_first_field_that_differs() {
        let ours = identity();
        assert_eq!(ours.difference(&ours), None);
        let theirs = Identity {
            end_module: 5,
            ..identity()
        };
        assert_eq!(
            ours.difference(&theirs).as_deref(),
            Some("end_module is 6 there, 5 here")
        );
        // A size is named before the modules it moves.
        let mut theirs = Identity {
            end_module: 5,
            ..identity()
        };
        theirs.sizes.insert("--layers".into(), 3.into());
        assert_eq!(
            ours.difference(&theirs).as_deref(),
            Some("--layers is 4 there, 3 here")
        );
        // Another world size is named, not the microbatches and modules that follow from it.
        let theirs = Identity {
            world_size: 4,
            microbatches: 2,
            first_module: 2,
            ..identity()
        };
        assert_eq!(
            ours.difference(&theirs).as_deref(),
            Some("world_size is 2 there, 4 here")
        );
        // A checkpoint written before sizes were recorded is not checked against them; the
        // settings are never part of what must agree.
        let old = Identity {
            sizes: BTreeMap::new(),
            ..identity()
        };
        let mut here = identity();
        here.settings.insert("--lr".into(), 0.5.into());
        assert_eq!(old.difference(&here), None);
        assert_eq!(ours.difference(&here), None);
    }

    #[test]
    fn a_changed_setting_is_warned_of_and_one_not_recorded_is_not() {
        let ours = identity();
        assert!(ours.changed_settings(&ours).is_empty());
        let mut here = identity();
        here.settings.insert("--lr".into(), 0.5.into());
        here.settings.insert("--weight-decay".into(), 0.01.into());
        let said = ours.changed_settings(&here);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].starts_with("resuming with --lr 0.5, where the checkpoint was written with 0.1"),
            "{said:?}"
        );
    }

    #[test]
    fn checkpoints_fall_due_every_n_iterations_and_at_the_end() {
        let every = |n| CheckpointConfig {
            dir: "ckpt".into(),
            every: n,
            resume: crate::config::Resume::No,
        };
        let due = |c: &CheckpointConfig| (1..=7).filter(|&d| c.due(d, 7)).collect::<Vec<u64>>();
        assert_eq!(due(&every(None)), [7]);
        assert_eq!(due(&every(Some(3))), [3, 6, 7]);
        assert_eq!(due(&every(Some(1))), [1, 2, 3, 4, 5, 6, 7]);
    }
}
