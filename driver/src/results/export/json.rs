//! JSON: an array of objects with every column as a typed value (`null` when unknown).

use serde::Serialize;

use super::{Export, Groups};
use crate::records::summary::LastValidation;
use crate::results::curves::{Target, TimeTo};
use crate::results::read::Row;

/// `--format json`.
pub struct JsonExport;

#[derive(Serialize)]
struct JsonRow<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<&'a str>,
    run: String,
    name: &'a str,
    id: Option<&'a str>,
    sweep: Option<&'a str>,
    point: Option<serde_json::Map<String, serde_json::Value>>,
    model: Option<&'a str>,
    stages: Option<usize>,
    replicas: &'a [usize],
    schedule: Option<&'a str>,
    microbatches: Option<u32>,
    batch: Option<u32>,
    samples_per_sec: Option<f64>,
    samples_per_sec_std: Option<f64>,
    iterations_measured: Option<usize>,
    predicted_samples_per_sec: Option<f64>,
    speedup: Option<f64>,
    loss: Option<f64>,
    accuracy: Option<f64>,
    accuracy_top5: Option<f64>,
    /// Only where a time to a target was asked for; `null` for a record without the curve.
    #[serde(skip_serializing_if = "Option::is_none")]
    time_to: Option<Option<JsonTimeTo>>,
    /// Only for a record with a validation pass: the last one's iteration and figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    validation: Option<LastValidation>,
    idle_share: Option<f64>,
    comm_share: Option<f64>,
    skipped_steps: Option<u64>,
    restarts: Option<u64>,
    status: &'static str,
    note: Option<&'a str>,
    dir: String,
}

/// When a record's curve reached the target.
#[derive(Serialize)]
struct JsonTimeTo {
    metric: &'static str,
    target: f64,
    reached: bool,
    /// Seconds of training to the first iteration that reached it; `null` if none did.
    seconds: Option<f64>,
    iteration: Option<u64>,
    /// Iterations the record reported.
    iterations_run: Option<usize>,
}

fn json_time_to(target: Target, time_to: TimeTo) -> JsonTimeTo {
    let (reached, seconds, iteration, iterations_run) = match time_to {
        TimeTo::Reached { iteration, seconds } => (true, Some(seconds), Some(iteration), None),
        TimeTo::NotReached { iterations } => (false, None, None, Some(iterations)),
    };
    JsonTimeTo {
        metric: target.metric.name(),
        target: target.value,
        reached,
        seconds,
        iteration,
        iterations_run,
    }
}

fn json_row<'a>(group: Option<&'a str>, row: &'a Row, time_to: Option<Target>) -> JsonRow<'a> {
    JsonRow {
        group,
        run: row.label(),
        name: &row.name,
        id: row.id.as_deref(),
        sweep: row.point.as_ref().map(|p| p.sweep.as_str()),
        point: row.point.as_ref().map(|p| p.settings.iter().cloned().collect()),
        model: row.model.as_deref(),
        stages: row.stages,
        replicas: &row.replicas,
        schedule: row.schedule.as_deref(),
        microbatches: row.microbatches,
        batch: row.batch,
        samples_per_sec: row.throughput.as_ref().map(|t| t.samples_per_sec_mean),
        samples_per_sec_std: row.throughput.as_ref().map(|t| t.samples_per_sec_std),
        iterations_measured: row.throughput.as_ref().map(|t| t.iterations_measured),
        predicted_samples_per_sec: row.predicted,
        speedup: row.speedup,
        loss: row.loss,
        accuracy: row.accuracy,
        accuracy_top5: row.top5,
        time_to: time_to.map(|target| row.time_to.map(|t| json_time_to(target, t))),
        validation: row.validation,
        idle_share: row.idle_share,
        comm_share: row.comm_share,
        skipped_steps: row.skipped_steps,
        restarts: row.restarts,
        status: row.status.as_str(),
        note: row.note.as_deref(),
        dir: row.dir.display().to_string(),
    }
}

impl Export for JsonExport {
    fn render(&self, rows: &Groups) -> String {
        let all: Vec<JsonRow> = rows
            .groups
            .iter()
            .flat_map(|(g, members)| {
                members
                    .iter()
                    .map(move |r| json_row(rows.key.map(|_| g.as_str()), r, rows.extra.time_to))
            })
            .collect();
        serde_json::to_string_pretty(&all).expect("rows serialize") + "\n"
    }
}
