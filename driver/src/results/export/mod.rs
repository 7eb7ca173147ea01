//! Rendering rows: one module per format behind [`Export`].

mod csv;
mod json;
mod table;

use super::curves::{Target, TimeTo};
use super::read::Row;
use super::Format;

/// Rows, in groups when `--group-by` was given (one group with no name otherwise).
pub struct Groups<'a> {
    /// The `--group-by` key.
    pub key: Option<&'a str>,
    /// The optional columns these rows have.
    pub extra: Extra,
    /// Each group's value and rows.
    pub groups: &'a [(String, Vec<Row>)],
}

impl<'a> Groups<'a> {
    /// The groups' view, with the validation columns where some row has a pass.
    pub fn new(key: Option<&'a str>, time_to: Option<Target>, groups: &'a [(String, Vec<Row>)]) -> Self {
        let validation = groups
            .iter()
            .flat_map(|(_, rows)| rows)
            .any(|r| r.validation.is_some());
        Groups {
            key,
            extra: Extra { time_to, validation },
            groups,
        }
    }
}

/// The columns a table has only when asked for or when some row has them.
#[derive(Debug, Clone, Copy)]
pub struct Extra {
    /// The `--time-to` target, whose column the rows then have.
    pub time_to: Option<Target>,
    /// Some row has a validation pass: the rows then have its columns.
    pub validation: bool,
}

/// One output format.
pub trait Export {
    /// The whole output, ending with a newline.
    fn render(&self, rows: &Groups) -> String;
}

/// The exporter for a format.
pub fn exporter(format: Format) -> Box<dyn Export> {
    match format {
        Format::Table => Box::new(table::TableExport { markdown: false }),
        Format::Markdown => Box::new(table::TableExport { markdown: true }),
        Format::Csv => Box::new(csv::CsvExport),
        Format::Json => Box::new(json::JsonExport),
    }
}

/// Column headers for people, in order, with the time to the target after the accuracies when
/// there is one, then the last validation pass's loss and top-1 when some row has one; `note` is
/// the last.
fn headers(extra: Extra) -> Vec<String> {
    let mut headers: Vec<String> = HEADERS.iter().map(|h| h.to_string()).collect();
    let mut at = extra_column();
    if let Some(target) = extra.time_to {
        headers.insert(at, target.header());
        at += 1;
    }
    if extra.validation {
        headers.splice(at..at, VALIDATION.map(String::from));
    }
    headers
}

/// The validation columns' headers.
const VALIDATION: [&str; 2] = ["val loss", "val top-1"];

/// Where the optional columns go: after the top-5 accuracy.
fn extra_column() -> usize {
    1 + HEADERS
        .iter()
        .position(|h| *h == "top-5")
        .expect("a top-5 column")
}

/// The columns without a time to a target.
const HEADERS: [&str; 16] = [
    "run",
    "model",
    "stages x replicas",
    "schedule",
    "microbatches",
    "batch",
    "samples/s",
    "predicted",
    "speedup",
    "loss",
    "accuracy",
    "top-5",
    "idle",
    "comm",
    "status",
    "note",
];

/// A row's cells for people (with `extra`'s columns): numbers rounded, shares as percentages,
/// `-` for unknown.
fn cells(row: &Row, extra: Extra) -> Vec<String> {
    let dash = || "-".to_string();
    let pct = |x: Option<f64>| x.map_or_else(dash, |v| format!("{:.1}%", v * 100.0));
    let mut cells = vec![
        row.label(),
        row.model_cell().unwrap_or_else(dash),
        row.layout().unwrap_or_else(dash),
        row.schedule.clone().unwrap_or_else(dash),
        row.microbatches.map_or_else(dash, |v| v.to_string()),
        row.batch.map_or_else(dash, |v| v.to_string()),
        row.throughput.as_ref().map_or_else(dash, |t| {
            format!("{:.1} ± {:.1}", t.samples_per_sec_mean, t.samples_per_sec_std)
        }),
        row.predicted.map_or_else(dash, |p| format!("{p:.1}")),
        row.speedup.map_or_else(dash, |s| format!("{s:.2}x")),
        row.loss.map_or_else(dash, |l| format!("{l:.4}")),
        pct(row.accuracy),
        pct(row.top5),
        pct(row.idle_share),
        pct(row.comm_share),
        row.status.as_str().to_string(),
        row.note.clone().unwrap_or_default(),
    ];
    let mut at = extra_column();
    if extra.time_to.is_some() {
        cells.insert(at, row.time_to.map_or_else(dash, time_to_text));
        at += 1;
    }
    if extra.validation {
        let figures = row.validation.map(|v| v.figures);
        let loss = figures.map_or_else(dash, |f| format!("{:.4}", f.loss));
        cells.splice(at..at, [loss, pct(figures.map(|f| f.accuracy))]);
    }
    cells
}

/// When a run reached the target: `12.3 s, it 140`, or `not in 200 its`.
fn time_to_text(time_to: TimeTo) -> String {
    match time_to {
        TimeTo::Reached { iteration, seconds } => format!("{} s, it {iteration}", seconds_text(seconds)),
        TimeTo::NotReached { iterations } => format!("not in {iterations} its"),
    }
}

/// Seconds with two decimals under 10, one under 100, and none above.
fn seconds_text(seconds: f64) -> String {
    match seconds {
        s if s < 10.0 => format!("{s:.2}"),
        s if s < 100.0 => format!("{s:.1}"),
        s => format!("{s:.0}"),
    }
}
