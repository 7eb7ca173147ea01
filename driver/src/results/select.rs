//! Choosing and ordering rows: `KEY=VALUE` filters, `--sort`, `--group-by` and the `--baseline`
//! row speedups are measured against. A key is a column or any experiment key.

use std::cmp::Ordering;

use super::read::Row;
use super::ResultsError;

/// The columns' keys, in table order, as `--sort`, `--group-by` and filters name them.
pub const COLUMN_KEYS: [&str; 20] = [
    "run",
    "model",
    "layout",
    "schedule",
    "microbatches",
    "batch",
    "samples_per_sec",
    "spread",
    "predicted",
    "speedup",
    "loss",
    "accuracy",
    "top5",
    "time_to",
    "val_loss",
    "val_accuracy",
    "idle",
    "comm",
    "status",
    "note",
];

/// Whether a `--sort` or `--group-by` key (`KEY` or `KEY:desc`) is the time to a target.
pub fn is_time_to(spec: &str) -> bool {
    canonical(spec.split(':').next().unwrap_or(spec)) == "time_to"
}

/// Other names a key goes by.
fn canonical(key: &str) -> &str {
    match key {
        "batch_size" => "batch",
        "module" => "model",
        "stages" | "stages_x_replicas" => "layout",
        "throughput" | "samples/s" => "samples_per_sec",
        "idle_share" | "bubble" => "idle",
        "comm_share" => "comm",
        "final_loss" => "loss",
        "final_accuracy" | "acc" => "accuracy",
        "final_accuracy_top5" | "accuracy_top5" | "top-5" => "top5",
        "point" => "run",
        "validation_loss" | "val loss" => "val_loss",
        "validation_accuracy" | "val top-1" | "val_acc" => "val_accuracy",
        "predicted_samples_per_sec" => "predicted",
        other => other,
    }
}

/// A row's value for a key, as text (numbers as written, fractions as fractions).
pub fn value(row: &Row, key: &str) -> Option<String> {
    let num = |x: Option<f64>| x.map(|v| v.to_string());
    match canonical(key) {
        "run" => Some(row.label()),
        "name" => Some(row.name.clone()),
        "id" => row.id.clone(),
        "sweep" => row.point.as_ref().map(|p| p.sweep.clone()),
        "model" => row.model.clone(),
        "layout" => row.layout(),
        "schedule" => row.schedule.clone(),
        "microbatches" => row.microbatches.map(|v| v.to_string()),
        "batch" => row.batch.map(|v| v.to_string()),
        "samples_per_sec" => num(row.throughput.as_ref().map(|t| t.samples_per_sec_mean)),
        "spread" => num(row.throughput.as_ref().map(|t| t.samples_per_sec_std)),
        "predicted" => num(row.predicted),
        "speedup" => num(row.speedup),
        "loss" => num(row.loss),
        "accuracy" => num(row.accuracy),
        "top5" => num(row.top5),
        "time_to" => num(row.time_to.and_then(|t| t.seconds())),
        "val_loss" => num(row.validation.map(|v| v.figures.loss)),
        "val_accuracy" => num(row.validation.map(|v| v.figures.accuracy)),
        "idle" => num(row.idle_share),
        "comm" => num(row.comm_share),
        "skipped_steps" => row.skipped_steps.map(|n| n.to_string()),
        "restarts" => row.restarts.map(|n| n.to_string()),
        "status" => Some(row.status.as_str().to_string()),
        "note" => row.note.clone(),
        other => {
            let from_point = row.point.as_ref().and_then(|p| {
                p.settings
                    .iter()
                    .find(|(k, _)| crate::config::canonical_key(k) == crate::config::canonical_key(other))
                    .map(|(_, v)| crate::config::value_text(v))
            });
            from_point.or_else(|| {
                row.experiment
                    .get(crate::config::canonical_key(other))
                    .filter(|v| !v.is_null())
                    .map(crate::config::value_text)
            })
        }
    }
}

/// Whether any row knows the key (so a typo is an error, not an empty table).
fn known<R: std::borrow::Borrow<Row>>(rows: &[R], key: &str) -> bool {
    COLUMN_KEYS.contains(&canonical(key))
        || ["name", "id", "sweep", "skipped_steps", "restarts"].contains(&key)
        || rows.iter().any(|r| value(r.borrow(), key).is_some())
}

/// Refuses a `key` that is neither a column nor a setting any of `rows` has.
pub fn check_key<R: std::borrow::Borrow<Row>>(rows: &[R], key: &str) -> Result<(), ResultsError> {
    if rows.is_empty() || known(rows, key) {
        Ok(())
    } else {
        Err(ResultsError::UnknownKey { key: key.to_string() })
    }
}

/// Keeps the rows that match every key filtered on: a key given more than once (`model=mlp
/// model=vgg16`) keeps the rows with any of its values.
pub fn filter(rows: Vec<Row>, filters: &[(String, String)]) -> Result<Vec<Row>, ResultsError> {
    for (key, _) in filters {
        check_key(&rows, key)?;
    }
    let matches = |row: &Row| {
        filters.iter().all(|(key, _)| {
            filters
                .iter()
                .filter(|(k, _)| canonical(k) == canonical(key))
                .any(|(k, v)| value(row, k).as_deref() == Some(v.as_str()))
        })
    };
    Ok(rows.into_iter().filter(|row| matches(row)).collect())
}

/// Numbers compare as numbers, text as text, a missing value last.
fn compare(a: &Option<String>, b: &Option<String>) -> Ordering {
    match (a, b) {
        (Some(a), Some(b)) => match (a.parse::<f64>(), b.parse::<f64>()) {
            (Ok(x), Ok(y)) => x.partial_cmp(&y).unwrap_or(Ordering::Equal),
            _ => a.cmp(b),
        },
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

/// Sorts by `KEY` (ascending) or `KEY:desc`, stably; rows without a value last either way.
pub fn sort(rows: &mut [Row], spec: &str) -> Result<(), ResultsError> {
    let (key, descending) = match spec.rsplit_once(':') {
        Some((key, "desc")) => (key, true),
        Some((key, "asc")) => (key, false),
        Some((_, direction)) => {
            return Err(ResultsError::SortDirection {
                spec: spec.to_string(),
                direction: direction.to_string(),
            })
        }
        _ => (spec, false),
    };
    check_key(rows, key)?;
    rows.sort_by(|a, b| {
        let (a, b) = (value(a, key), value(b, key));
        let order = compare(&a, &b);
        if descending && a.is_some() && b.is_some() {
            order.reverse()
        } else {
            order
        }
    });
    Ok(())
}

/// Splits rows into groups by a key's value, in order of first appearance.
pub fn group(rows: Vec<Row>, key: &str) -> Result<Vec<(String, Vec<Row>)>, ResultsError> {
    check_key(&rows, key)?;
    let mut groups: Vec<(String, Vec<Row>)> = Vec::new();
    for row in rows {
        let v = value(&row, key).unwrap_or_else(|| "-".into());
        match groups.iter_mut().find(|(g, _)| *g == v) {
            Some((_, members)) => members.push(row),
            None => groups.push((v, vec![row])),
        }
    }
    Ok(groups)
}

/// Sets every row's speedup against the baseline: the first row matching `selector`
/// (`KEY=VALUE[,KEY=VALUE]`, or a name, record id or run label), or by default the first row
/// with a throughput.
pub fn speedups(rows: &mut [Row], selector: Option<&str>) -> Result<(), ResultsError> {
    let base = match selector {
        None => rows.iter().find(|r| r.throughput.is_some()),
        Some(sel) if sel.contains('=') => {
            let pairs: Vec<(&str, &str)> = sel.split(',').filter_map(|p| p.split_once('=')).collect();
            for (k, _) in &pairs {
                check_key(rows, k)?;
            }
            rows.iter()
                .find(|r| pairs.iter().all(|(k, v)| value(r, k).as_deref() == Some(*v)))
        }
        Some(sel) => rows
            .iter()
            .find(|r| r.name == sel || r.id.as_deref() == Some(sel) || r.label() == sel),
    };
    let base = match (selector, base) {
        (Some(sel), None) => {
            return Err(ResultsError::Baseline {
                selector: sel.to_string(),
            })
        }
        (_, b) => b
            .and_then(|b| b.throughput.as_ref())
            .map(|t| t.samples_per_sec_mean),
    };
    for row in rows.iter_mut() {
        row.speedup = match (base, &row.throughput) {
            (Some(b), Some(t)) if b > 0.0 => Some(t.samples_per_sec_mean / b),
            _ => None,
        };
    }
    Ok(())
}
