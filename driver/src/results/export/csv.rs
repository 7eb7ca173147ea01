//! CSV: one header line, one line per row, plain numbers (shares as fractions), quoted as RFC 4180
//! asks.

use super::{Export, Extra, Groups};
use crate::results::curves::TimeTo;
use crate::results::read::Row;

/// `--format csv`.
pub struct CsvExport;

const HEADER: [&str; 21] = [
    "group",
    "run",
    "name",
    "id",
    "model",
    "stages",
    "replicas",
    "schedule",
    "microbatches",
    "batch",
    "samples_per_sec",
    "samples_per_sec_std",
    "predicted_samples_per_sec",
    "speedup",
    "loss",
    "accuracy",
    "accuracy_top5",
    "idle_share",
    "comm_share",
    "status",
    "note",
];

fn quote(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

/// The columns after `accuracy_top5` where a time to a target was asked for.
const TIME_TO: [&str; 3] = ["time_to_s", "time_to_iteration", "time_to_reached"];

/// The columns after those where some row has a validation pass: the last pass's.
const VALIDATION: [&str; 5] = [
    "validation_iteration",
    "validation_loss",
    "validation_accuracy",
    "validation_accuracy_top5",
    "validation_samples",
];

/// Where [`TIME_TO`] go: after `accuracy_top5`.
fn time_to_at() -> usize {
    1 + HEADER
        .iter()
        .position(|h| *h == "accuracy_top5")
        .expect("an accuracy_top5 column")
}

fn fields(group: &str, row: &Row, extra: Extra) -> Vec<String> {
    let (time_to, validation) = (extra.time_to.is_some(), extra.validation);
    let opt = |x: Option<String>| x.unwrap_or_default();
    let replicas: Vec<String> = row.replicas.iter().map(usize::to_string).collect();
    let mut fields = vec![
        group.to_string(),
        row.label(),
        row.name.clone(),
        opt(row.id.clone()),
        opt(row.model.clone()),
        opt(row.stages.map(|s| s.to_string())),
        replicas.join(" "),
        opt(row.schedule.clone()),
        opt(row.microbatches.map(|v| v.to_string())),
        opt(row.batch.map(|v| v.to_string())),
        opt(row
            .throughput
            .as_ref()
            .map(|t| t.samples_per_sec_mean.to_string())),
        opt(row.throughput.as_ref().map(|t| t.samples_per_sec_std.to_string())),
        opt(row.predicted.map(|v| v.to_string())),
        opt(row.speedup.map(|v| v.to_string())),
        opt(row.loss.map(|v| v.to_string())),
        opt(row.accuracy.map(|v| v.to_string())),
        opt(row.top5.map(|v| v.to_string())),
        opt(row.idle_share.map(|v| v.to_string())),
        opt(row.comm_share.map(|v| v.to_string())),
        row.status.as_str().to_string(),
        opt(row.note.clone()),
    ];
    if time_to {
        let (seconds, iteration, reached) = match row.time_to {
            Some(TimeTo::Reached { iteration, seconds }) => {
                (seconds.to_string(), iteration.to_string(), "true")
            }
            Some(TimeTo::NotReached { .. }) => (String::new(), String::new(), "false"),
            None => (String::new(), String::new(), ""),
        };
        let at = time_to_at();
        fields.splice(at..at, [seconds, iteration, reached.to_string()]);
    }
    if validation {
        let v = row.validation;
        let at = time_to_at() + if time_to { TIME_TO.len() } else { 0 };
        let cells = [
            opt(v.map(|v| v.iteration.to_string())),
            opt(v.map(|v| v.figures.loss.to_string())),
            opt(v.map(|v| v.figures.accuracy.to_string())),
            opt(v.and_then(|v| v.figures.accuracy_top5).map(|a| a.to_string())),
            opt(v.map(|v| v.figures.samples.to_string())),
        ];
        fields.splice(at..at, cells);
    }
    fields
}

impl Export for CsvExport {
    fn render(&self, rows: &Groups) -> String {
        let mut header = HEADER.to_vec();
        let mut at = time_to_at();
        if rows.extra.time_to.is_some() {
            header.splice(at..at, TIME_TO);
            at += TIME_TO.len();
        }
        if rows.extra.validation {
            header.splice(at..at, VALIDATION);
        }
        let mut out = header.join(",") + "\n";
        for (group, members) in rows.groups {
            for row in members {
                let line: Vec<String> = fields(group, row, rows.extra).iter().map(|f| quote(f)).collect();
                out.push_str(&line.join(","));
                out.push('\n');
            }
        }
        out
    }
}
