//! Reading record folders and sweep folders into rows, through the types that wrote them. A
//! record that cannot be read becomes a row that says why; nothing is skipped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::curves::TimeTo;
use super::ResultsError;
use crate::events::{command_note, memory_note, Status, StopCause};
use crate::records::index::{self, Index, PointEntry, PointStatus, INDEX_FILE};
use crate::records::stats::{StageShares, Throughput};
use crate::records::summary::{read_summary, LastValidation, Summary};
use crate::records::{read_resolved, ResolvedRank};

/// Where a row's run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowStatus {
    Succeeded,
    Failed,
    Interrupted,
    /// The record says it is still running (or its driver died).
    Running,
    /// A sweep point that has no record yet.
    NotRun,
    /// The record could not be read; the note says why.
    Unreadable,
}

impl RowStatus {
    /// As the table shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            RowStatus::Succeeded => "succeeded",
            RowStatus::Failed => "failed",
            RowStatus::Interrupted => "interrupted",
            RowStatus::Running => "running",
            RowStatus::NotRun => "not run",
            RowStatus::Unreadable => "unreadable",
        }
    }
}

/// A sweep point's place in its sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct PointOf {
    /// The sweep's name.
    pub sweep: String,
    /// The sweep's axis keys, in order.
    pub axes: Vec<String>,
    /// The point's settings, in axis order.
    pub settings: Vec<(String, serde_json::Value)>,
    /// Repetition, from 0.
    pub repeat: u32,
}

/// One record (or sweep point) as the table sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The record folder (or, for a point not run, the sweep folder).
    pub dir: PathBuf,
    /// The record folder's name (the experiment id), if there is a record.
    pub id: Option<String>,
    /// The experiment's name.
    pub name: String,
    /// The sweep point, when the row comes from a sweep folder.
    pub point: Option<PointOf>,
    /// The model the runtime built.
    pub model: Option<String>,
    /// Number of pipeline stages.
    pub stages: Option<usize>,
    /// Ranks per stage.
    pub replicas: Vec<usize>,
    /// Pipeline schedule.
    pub schedule: Option<String>,
    /// Microbatches per minibatch.
    pub microbatches: Option<u32>,
    /// Samples per iteration.
    pub batch: Option<u32>,
    /// Samples/s after warm-up.
    pub throughput: Option<Throughput>,
    /// Samples/s the plan predicted (`config_file: auto`).
    pub predicted: Option<f64>,
    /// Against the baseline row, once chosen.
    pub speedup: Option<f64>,
    /// Training loss of the last complete iteration (the record's `final_loss`).
    pub loss: Option<f64>,
    /// Top-1 accuracy of that iteration's training samples (`final_accuracy`).
    pub accuracy: Option<f64>,
    /// Top-5 accuracy, of models with class logits (`final_accuracy_top5`).
    pub top5: Option<f64>,
    /// When the training curve reached `--time-to`'s target, once asked.
    pub time_to: Option<TimeTo>,
    /// The last validation pass over the held-out split (`validate_every`).
    pub validation: Option<LastValidation>,
    /// Mean idle (bubble) share over the stages.
    pub idle_share: Option<f64>,
    /// Mean communication share over the stages.
    pub comm_share: Option<f64>,
    /// With fp16: steps the gradient scaler skipped.
    pub skipped_steps: Option<u64>,
    /// Times the ranks were started again after a failure (`max_restarts`), for a record.
    pub restarts: Option<u64>,
    /// Where the run stands.
    pub status: RowStatus,
    /// Why it failed, or why it could not be read.
    pub note: Option<String>,
    /// The experiment file as recorded, for filtering on any key.
    pub experiment: BTreeMap<String, serde_json::Value>,
}

impl Row {
    /// The model as the table shows it: with its arithmetic when that is not plain fp32
    /// (`resnet50 (bf16, channels_last)`), so runs of one model in two arithmetics tell apart.
    pub fn model_cell(&self) -> Option<String> {
        let model = self.model.clone()?;
        let mut arithmetic = Vec::new();
        match self.experiment.get("precision").and_then(|p| p.as_str()) {
            Some("fp32") | None => {}
            Some(precision) => arithmetic.push(precision),
        }
        if self.experiment.get("channels_last") == Some(&serde_json::Value::Bool(true)) {
            arithmetic.push("channels_last");
        }
        Some(match arithmetic.is_empty() {
            true => model,
            false => format!("{model} ({})", arithmetic.join(", ")),
        })
    }

    /// The label the table's first column shows: the point's settings, or the name.
    pub fn label(&self) -> String {
        match &self.point {
            Some(p) => index::label(&p.settings, p.repeat),
            None => self.name.clone(),
        }
    }

    /// `stages x replicas`, e.g. `2x1`, or `2x(3,1)` when stages differ.
    pub fn layout(&self) -> Option<String> {
        let stages = self.stages?;
        let first = *self.replicas.first()?;
        Some(if self.replicas.iter().all(|&r| r == first) {
            format!("{stages}x{first}")
        } else {
            let each: Vec<String> = self.replicas.iter().map(usize::to_string).collect();
            format!("{stages}x({})", each.join(","))
        })
    }

    pub(super) fn empty(dir: &Path, name: String, status: RowStatus, note: Option<String>) -> Row {
        Row {
            dir: dir.to_path_buf(),
            id: None,
            name,
            point: None,
            model: None,
            stages: None,
            replicas: Vec::new(),
            schedule: None,
            microbatches: None,
            batch: None,
            throughput: None,
            predicted: None,
            speedup: None,
            loss: None,
            accuracy: None,
            top5: None,
            validation: None,
            time_to: None,
            idle_share: None,
            comm_share: None,
            skipped_steps: None,
            restarts: None,
            status,
            note,
            experiment: BTreeMap::new(),
        }
    }
}

/// What kind of folder a path is.
enum Folder {
    Record,
    Sweep,
    Other,
}

fn kind(dir: &Path) -> Folder {
    if dir.join(INDEX_FILE).is_file() {
        Folder::Sweep
    } else if dir.join("summary.json").exists() || dir.join("config.given.yml").exists() {
        Folder::Record
    } else {
        Folder::Other
    }
}

/// Rows for every path: a record, a sweep folder, or a folder of them (its subfolders in name
/// order, which is time order).
pub fn collect(paths: &[PathBuf]) -> Result<Vec<Row>, ResultsError> {
    let mut rows = Vec::new();
    for path in paths {
        if !path.is_dir() {
            return Err(ResultsError::Missing { path: path.clone() });
        }
        match kind(path) {
            Folder::Record => rows.push(record(path)),
            Folder::Sweep => rows.extend(sweep(path)),
            Folder::Other => {
                let mut children: Vec<PathBuf> = std::fs::read_dir(path)
                    .map_err(|source| ResultsError::List {
                        path: path.clone(),
                        source,
                    })?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.is_dir())
                    .collect();
                children.sort();
                for child in children {
                    match kind(&child) {
                        Folder::Record => rows.push(record(&child)),
                        Folder::Sweep => rows.extend(sweep(&child)),
                        Folder::Other => rows.push(Row::empty(
                            &child,
                            folder_name(&child),
                            RowStatus::Unreadable,
                            Some("not a record or sweep folder: no summary.json or sweep.json".into()),
                        )),
                    }
                }
            }
        }
    }
    Ok(rows)
}

/// A folder's own name (a record folder's is its experiment id).
pub(super) fn folder_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

/// One record folder as a row.
pub fn record(dir: &Path) -> Row {
    let id = folder_name(dir);
    let summary = match read_summary(dir) {
        Ok(s) => s,
        Err(reason) => {
            let mut row = Row::empty(dir, id.clone(), RowStatus::Unreadable, Some(reason));
            row.id = Some(id);
            return row;
        }
    };
    let resolved = match read_resolved(dir) {
        Ok(r) => r,
        Err(reason) => {
            let mut row = Row::empty(dir, summary.name, RowStatus::Unreadable, Some(reason));
            row.id = Some(id);
            return row;
        }
    };
    let status = match summary.status {
        Status::Running => RowStatus::Running,
        Status::Succeeded => RowStatus::Succeeded,
        Status::Failed => RowStatus::Failed,
        Status::Interrupted => RowStatus::Interrupted,
    };
    let (stages, replicas) = layout(&resolved.plan.ranks);
    let mean = |f: fn(&StageShares) -> f64| {
        (!summary.stages.is_empty())
            .then(|| summary.stages.iter().map(f).sum::<f64>() / summary.stages.len() as f64)
    };
    let experiment = match serde_json::to_value(&resolved.experiment) {
        Ok(serde_json::Value::Object(map)) => map.into_iter().collect(),
        _ => BTreeMap::new(),
    };
    let file = resolved.experiment;
    let batch = file.batch_size.or(resolved.plan.batch_size);
    let plan = summary.plan.as_ref();
    Row {
        dir: dir.to_path_buf(),
        id: Some(id),
        name: summary.name.clone(),
        point: None,
        model: file.module.clone(),
        stages: Some(stages),
        replicas,
        schedule: file.schedule.map(|s| s.as_arg().to_string()),
        microbatches: file
            .microbatches
            .or(plan.map(|p| p.microbatches))
            .or_else(|| microbatches_run(dir)),
        batch,
        throughput: summary.throughput.clone(),
        predicted: plan
            .zip(batch)
            .map(|(p, b)| f64::from(b) / p.predicted_time_per_iteration_s),
        speedup: None,
        loss: summary.final_loss,
        accuracy: summary.final_accuracy,
        top5: summary.final_accuracy_top5,
        validation: summary.validation,
        time_to: None,
        idle_share: mean(|s| s.idle_share),
        comm_share: mean(|s| s.comm_share),
        skipped_steps: summary.skipped_steps,
        restarts: Some(summary.restarts.len() as u64),
        status,
        note: note(&summary, checkpoint_dir(&resolved.plan.ranks)),
        experiment,
    }
}

/// The folder the runtime's ranks checkpoint in (`--checkpoint-dir`), if they do.
fn checkpoint_dir(ranks: &[ResolvedRank]) -> Option<&str> {
    crate::experiment::flag_value(&ranks.first()?.argv, "--checkpoint-dir")
}

/// The microbatches the ranks split each minibatch into where the file left them to the driver
/// or the runtime, as the first line of the record's `metrics.jsonl` (a rank's `start`) says;
/// none where no runtime rank started (a `command:` prints no `start`).
fn microbatches_run(dir: &Path) -> Option<u32> {
    let file = std::fs::File::open(dir.join("metrics.jsonl")).ok()?;
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(file), &mut first).ok()?;
    match stagehand_contract::Event::parse_line(&first)? {
        stagehand_contract::Event::Start(start) => u32::try_from(start.config.microbatches).ok(),
        _ => None,
    }
}

/// Stages and ranks per stage; without a stage config, one stage replicated on every rank.
fn layout(ranks: &[ResolvedRank]) -> (usize, Vec<usize>) {
    let mut per_stage: BTreeMap<usize, usize> = BTreeMap::new();
    for r in ranks {
        *per_stage.entry(r.stage.unwrap_or(0)).or_default() += 1;
    }
    (per_stage.len(), per_stage.into_values().collect())
}

/// Why the run failed, how often its ranks were started again and after what, and how many of
/// its steps fp16's gradient scaler skipped (a run whose steps were mostly skipped trained
/// little, however fast it went).
fn note(summary: &Summary, checkpoints: Option<&str>) -> Option<String> {
    let skipped = summary.skipped_steps.filter(|&n| n > 0).map(|n| {
        format!(
            "fp16 skipped {n} of {} steps (inf/nan gradients)",
            summary.iterations_done
        )
    });
    // The status column says it was interrupted; the note, how far it got and how to go on.
    let failure = summary.failure.as_ref().map(|f| match f.cause {
        StopCause::Interrupted => {
            let n = summary.iterations_done;
            let how_far = match n {
                1 => "after 1 iteration".to_string(),
                n => format!("after {n} iterations"),
            };
            match checkpoints {
                Some(dir) => format!("{how_far}; `resume: true` goes on from its checkpoints in {dir}"),
                None => how_far,
            }
        }
        _ => cause_text(&f.cause),
    });
    // A run that failed in the end says how often it was started again; one that went on to
    // succeed, after what.
    let restarts = match (summary.restarts.as_slice(), &failure) {
        ([], _) => None,
        ([_], Some(_)) => Some("after 1 restart".to_string()),
        (all, Some(_)) => Some(format!("after {} restarts", all.len())),
        ([one], None) => Some(format!(
            "restarted once, after: {}",
            cause_text(&one.failure.cause)
        )),
        ([.., last], None) => Some(format!(
            "restarted {} times, last after: {}",
            summary.restarts.len(),
            cause_text(&last.failure.cause)
        )),
    };
    let resumed = summary.resumed_at.map(|first| match summary.iterations_done {
        0 => format!(
            "resumed at iteration {first} from an earlier run's checkpoint, where the run ends: \
             nothing was left to run"
        ),
        done => format!(
            "resumed at iteration {first} from an earlier run's checkpoint: its figures cover \
             iterations {first} to {}",
            first + done - 1
        ),
    });
    // Still `running`, with its driver gone: nobody will close the record.
    let abandoned = summary
        .driver
        .as_ref()
        .filter(|d| summary.status == Status::Running && d.gone())
        .map(|d| {
            format!(
                "its driver (pid {} on {}) is gone: the run ended without closing its record (the \
                 driver killed outright?); the figures are what it wrote until then",
                d.pid, d.host
            )
        });
    let notes: Vec<String> = [abandoned, resumed, failure, restarts, skipped]
        .into_iter()
        .flatten()
        .collect();
    (!notes.is_empty()).then(|| notes.join("; "))
}

pub(super) fn cause_text(cause: &StopCause) -> String {
    match cause {
        StopCause::RankFailed {
            rank,
            host,
            exit_code,
            out_of_memory,
            silent_peer,
        } => {
            let ended = match exit_code {
                Some(code) => format!(
                    "exited with code {code}{}{}",
                    memory_note(*out_of_memory),
                    command_note(*exit_code)
                ),
                None => "was killed".into(),
            };
            match silent_peer {
                // The rank to look at first.
                Some(peer) => format!("{}; rank {rank} on {host} {ended}", peer.describe(*rank)),
                None => format!("rank {rank} on {host} {ended}"),
            }
        }
        StopCause::HostLost { host, reason } => format!("host {host} was lost: {reason}"),
        StopCause::Interrupted => "interrupted".into(),
        StopCause::ProfileFailed {
            host,
            exit_code,
            out_of_memory,
        } => match exit_code {
            Some(code) => format!(
                "profiling on {host} failed with exit code {code}{}{}",
                memory_note(*out_of_memory),
                command_note(*exit_code)
            ),
            None => format!("profiling on {host} was killed"),
        },
        StopCause::PlanFailed { reason } => format!("planning failed: {reason}"),
        StopCause::LaunchFailed { reason } => format!("the ranks could not start: {reason}"),
        StopCause::SlurmJob { job_id, reason, .. } => {
            format!("{} {reason}", crate::events::slurm_job(*job_id))
        }
    }
}

/// Whether a record folder's summary says it succeeded.
pub fn record_succeeded(dir: &Path) -> bool {
    read_summary(dir).is_ok_and(|s| s.status == Status::Succeeded)
}

/// A sweep folder: one row per point, in order, from its latest record.
pub fn sweep(dir: &Path) -> Vec<Row> {
    let index = match Index::read(dir) {
        Ok(i) => i,
        Err(e) => {
            return vec![Row::empty(
                dir,
                folder_name(dir),
                RowStatus::Unreadable,
                Some(crate::error::error_chain(&e)),
            )]
        }
    };
    let axes: Vec<String> = index.axes.iter().map(|a| a.key.clone()).collect();
    let base = given_settings(dir);
    index
        .points
        .iter()
        .map(|entry| point_row(dir, &index, &axes, &base, entry))
        .collect()
}

/// The top-level settings of the experiment file a sweep started with (`config.given.yml`), as
/// the sweep's points' `settings` hold theirs; empty where it cannot be read.
fn given_settings(dir: &Path) -> Vec<(String, serde_json::Value)> {
    let text = std::fs::read_to_string(dir.join("config.given.yml")).unwrap_or_default();
    let Ok(serde_json::Value::Object(file)) = serde_norway::from_str::<serde_json::Value>(&text) else {
        return Vec::new();
    };
    file.into_iter().collect()
}

/// A point's row: its record's, or, for a point that has none (it never ran, or failed before
/// its ranks started), what it would have run with: the sweep's experiment file (`base`) with
/// the point's own settings over it.
fn point_row(
    dir: &Path,
    index: &Index,
    axes: &[String],
    base: &[(String, serde_json::Value)],
    entry: &PointEntry,
) -> Row {
    let mut row = match &entry.record {
        Some(record_dir) => record(&dir.join(record_dir)),
        None => {
            let status = match entry.status {
                PointStatus::Failed => RowStatus::Failed,
                PointStatus::Interrupted => RowStatus::Interrupted,
                PointStatus::Pending | PointStatus::Running | PointStatus::Succeeded => RowStatus::NotRun,
            };
            let note = entry
                .error
                .as_ref()
                .map(|e| e.lines().next().unwrap_or("").to_string());
            let mut row = Row::empty(dir, entry.name.clone(), status, note);
            // What the point would have run with, as far as the file and its settings tell.
            for (key, value) in base.iter().chain(&entry.settings) {
                let key = crate::config::canonical_key(key);
                row.experiment.insert(key.to_string(), value.clone());
                let text = crate::config::value_text(value);
                match key {
                    "module" => row.model = Some(text),
                    "schedule" => row.schedule = Some(text),
                    "microbatches" => row.microbatches = value.as_u64().map(|v| v as u32),
                    "batch_size" => row.batch = value.as_u64().map(|v| v as u32),
                    _ => {}
                }
            }
            row
        }
    };
    if row.status == RowStatus::Succeeded && entry.status != PointStatus::Succeeded {
        // The run finished but the index was not updated (the driver died in between).
        row.note
            .get_or_insert_with(|| "the sweep index did not record this run's end".into());
    }
    row.point = Some(PointOf {
        sweep: index.name.clone(),
        axes: axes.to_vec(),
        settings: entry.settings.clone(),
        repeat: entry.repeat,
    });
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run whose file gives no microbatches shows what its ranks ran, as their `start` line
    /// says; a record with no `start` first (a `command:`'s, or none written) shows none.
    #[test]
    fn microbatches_are_what_the_ranks_ran() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(microbatches_run(dir.path()), None, "no metrics.jsonl");
        let start = |microbatches: usize| {
            format!(
                r#"{{"event":"start","schema_version":1,"rank":0,"world_size":2,"stage":0,"num_stages":1,"num_modules":6,"num_params":10,"first_module":0,"end_module":6,"stage_params":10,"config":{{"model":"mlp","batch_size":8,"iterations":2,"lr":0.1,"optimizer":"sgd","seed":0,"data":"synthetic","device":"cpu","threads":1,"microbatches":{microbatches}}}}}"#
            )
        };
        for microbatches in [2, 3, 8] {
            std::fs::write(dir.path().join("metrics.jsonl"), start(microbatches) + "\n").unwrap();
            assert_eq!(microbatches_run(dir.path()), Some(microbatches as u32));
        }
        std::fs::write(dir.path().join("metrics.jsonl"), "step 1 loss 0.5\n").unwrap();
        assert_eq!(microbatches_run(dir.path()), None, "a command's own lines");
    }

    fn summary(status: &str, iterations_done: u64, extra: serde_json::Value) -> Summary {
        let mut value = serde_json::json!({
            "format_version": crate::records::summary::FORMAT_VERSION,
            "id": "20261207T000000Z_x",
            "name": "x",
            "status": status,
            "started_at": "2026-12-07T00:00:00Z",
            "ended_at": null,
            "duration_s": 1.0,
            "backend": "process",
            "world_size": 2,
            "iterations_done": iterations_done,
            "stages": [],
            "ranks": [],
        });
        value
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(value).unwrap()
    }

    /// An interrupted record says how far it got and, where it checkpoints, how to go on; a run
    /// resumed where it ends says nothing was left to run.
    #[test]
    fn interrupted_and_finished_resumes_say_where_they_stand() {
        let interrupted = summary(
            "interrupted",
            7,
            serde_json::json!({"failure": {"cause": {"kind": "interrupted"}, "last_lines": []}}),
        );
        assert_eq!(note(&interrupted, None).as_deref(), Some("after 7 iterations"));
        assert_eq!(
            note(&interrupted, Some("/ck")).as_deref(),
            Some("after 7 iterations; `resume: true` goes on from its checkpoints in /ck")
        );
        let nothing = summary("succeeded", 0, serde_json::json!({"resumed_at": 20}));
        assert_eq!(
            note(&nothing, None).as_deref(),
            Some(
                "resumed at iteration 20 from an earlier run's checkpoint, where the run ends: \
                 nothing was left to run"
            )
        );
        let some = summary("succeeded", 5, serde_json::json!({"resumed_at": 20}));
        assert!(note(&some, None).unwrap().ends_with("iterations 20 to 24"));
    }
}
