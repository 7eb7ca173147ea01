//! `driver sweep`: one experiment per point of a configuration grid, each a record folder inside
//! one sweep folder with `sweep.json` (the index, rewritten after every point), `sweep.svg` (the
//! throughput plot), `loss.svg` and `accuracy.svg` (the training curves) and `config.given.yml`. A failing point is recorded and the sweep goes on; `--resume`
//! runs only the points without a succeeded record.

pub mod grid;

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use self::grid::{GridError, Point};
use crate::check::{self, CheckError};
use crate::config::{self, ConfigError, Loaded};
use crate::exit_codes;
use crate::experiment::Experiment;
use crate::options::{Options, Verbosity};
use crate::records::index::{self, Index, IndexError, PointEntry, PointStatus, INDEX_VERSION};
use crate::records::{files, Record, RecordError};
use crate::reporters::progress;
use crate::results;
use crate::run;
use crate::signals::StopSignals;

/// What `driver sweep` was asked to do.
#[derive(Debug, Clone)]
pub enum SweepSource {
    /// A new sweep of this file, its `sweep:` section combined with these `--grid` axes.
    New {
        /// The experiment YAML.
        config_file: PathBuf,
        /// `--grid` axes: key and values as typed.
        grid: Vec<(String, Vec<String>)>,
        /// Runs per point.
        repeat: u32,
    },
    /// Continue the sweep in this folder.
    Resume(PathBuf),
}

/// A validated `driver sweep` request.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// How each point runs; its `config_file` is the experiment file (with `--resume`, set from
    /// the sweep folder's index) and `output_dir` where the sweep folder goes.
    pub run: Options,
    /// New or resumed.
    pub source: SweepSource,
}

/// Why a sweep could not run; a point that fails is not one of these (it is recorded).
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("invalid experiment file")]
    Config(#[from] ConfigError),
    #[error("invalid grid {at}; nothing was run")]
    Grid {
        /// Where the grid is wrong: `at FILE:LINE` (its `sweep:` section), `given with --grid`,
        /// or `in FILE`.
        at: String,
        #[source]
        source: GridError,
    },
    #[error("point {label} is invalid: {message}; nothing was run")]
    Point { label: String, message: String },
    #[error(
        "point {label} is in the grid twice (a value given twice); drop one (`--repeat N` runs each \
         point N times); nothing was run"
    )]
    Twice { label: String },
    #[error(
        "points {first} and {second} would run the same ranks the same way: {} {} nothing they \
         run{}; drop {} from the grid (`--repeat N` runs each point N times); nothing was run",
        quoted(.keys),
        if .keys.len() == 1 { "changes" } else { "change" },
        if *.command { " (the ranks run `command:`, which the runtime's keys never reach)" } else { "" },
        if .keys.len() == 1 { "it" } else { "them" }
    )]
    Same {
        first: String,
        second: String,
        /// The grid keys whose values differ between the two.
        keys: Vec<String>,
        /// Whether the ranks run `command:`.
        command: bool,
    },
    #[error("cannot resume")]
    Index(#[from] IndexError),
    #[error(
        "cannot resume: the sweep's experiment file {} is not there; the sweep folder keeps it as \
         the sweep started, in {}: copy it back to {0}, or start a new sweep",
        file.display(),
        copy.display()
    )]
    Moved {
        file: PathBuf,
        copy: PathBuf,
        #[source]
        source: ConfigError,
    },
    #[error("cannot write the sweep folder")]
    Record(#[from] RecordError),
    #[error("cannot install the Ctrl-C handler")]
    Signals(#[source] std::io::Error),
}

impl SweepError {
    /// The documented exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            SweepError::Config(_)
            | SweepError::Grid { .. }
            | SweepError::Point { .. }
            | SweepError::Same { .. }
            | SweepError::Twice { .. }
            | SweepError::Index(_)
            | SweepError::Moved { .. } => exit_codes::INVALID_CONFIG,
            SweepError::Record(_) => exit_codes::RECORD_FAILED,
            SweepError::Signals(_) => exit_codes::PREFLIGHT_FAILED,
        }
    }
}

/// Runs (or resumes) a sweep; returns the exit code ([`exit_code`]): 0 when every point
/// succeeded, 1 when some failed, 4 when some left containers behind, 130 when interrupted.
pub async fn run(options: SweepOptions) -> Result<i32, SweepError> {
    let interrupted = StopSignals::install().map_err(SweepError::Signals)?.into_flag();
    // Every point's file parses and plans before the sweep folder is made and the first runs.
    let (dir, mut index, points) = match &options.source {
        SweepSource::New {
            config_file,
            grid,
            repeat,
        } => {
            let (parent, mut index, loaded) = new_index(&options.run, config_file, grid, *repeat)?;
            // Checked before the folder is made, as they will run once it has its name.
            points(&loaded, &index, &options.run, NEW_SWEEP)?;
            let dir = create(&parent, &mut index, &loaded)?;
            let points = index
                .points
                .iter()
                .map(|entry| {
                    config::with_overrides(&loaded, &entry.name, &folder_name(&dir), &entry.settings)
                })
                .collect::<Result<Vec<_>, _>>()?;
            (dir, index, points)
        }
        SweepSource::Resume(dir) => {
            let (index, loaded) = resume(dir)?;
            let points = points(&loaded, &index, &options.run, &folder_name(dir))?;
            (dir.clone(), index, points)
        }
    };
    let mut run_options = options.run.clone();
    run_options.config_file = index.config_file.clone();
    run_options.output_dir = Some(dir.clone());

    let todo: Vec<usize> = index
        .points
        .iter()
        .enumerate()
        .filter(|(_, e)| !succeeded(&dir, e))
        .map(|(i, _)| i)
        .collect();
    let quiet = options.run.verbosity == Verbosity::Quiet;
    if !quiet {
        stderr_line!(
            "driver: sweep {} of {} point(s), {} to run; folder {}",
            index.name,
            index.points.len(),
            todo.len(),
            dir.display()
        );
    }
    let (bars, bar) = progress::sweep_bars(options.run.progress, todo.len() as u64);
    let mut stopped = false;
    // Points whose containers could not all be removed (each said so, with the command).
    let mut left: Vec<String> = Vec::new();
    // Points that share a model, batch and first machine share one profile (`config_file: auto`).
    let profiles = crate::auto_partition::ProfileCache::default();
    for &i in &todo {
        if interrupted.load(Ordering::SeqCst) {
            stopped = true;
            break;
        }
        let label = index::label(&index.points[i].settings, index.points[i].repeat);
        bar.set_message(label.clone());
        let entry = &mut index.points[i];
        if let Some(old) = entry.record.take() {
            entry.earlier_records.push(old);
        }
        entry.status = PointStatus::Running;
        entry.error = None;
        index.write(&dir)?;

        let result = run::run_loaded(&points[i], &run_options, Some(&bars), &profiles).await;
        let entry = &mut index.points[i];
        let record_name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
        match &result {
            Ok(record) => {
                entry.status = PointStatus::Succeeded;
                entry.record = record_name(record);
            }
            Err(e) => {
                entry.status = match e.exit_code() {
                    exit_codes::INTERRUPTED => PointStatus::Interrupted,
                    _ => PointStatus::Failed,
                };
                entry.record = e.record_dir().and_then(record_name);
                entry.error = Some(crate::error::error_chain(e));
                if e.exit_code() == exit_codes::CLEANUP_FAILED {
                    left.push(label.clone());
                }
                if entry.status == PointStatus::Failed {
                    bar.suspend(|| {
                        stderr_line!("driver: point {label} failed: {}", crate::error::error_chain(e))
                    });
                }
            }
        }
        index.write(&dir)?;
        bar.inc(1);
        if matches!(&result, Err(e) if e.exit_code() == exit_codes::INTERRUPTED) {
            stopped = true;
            break;
        }
    }
    bar.finish_and_clear();

    write_plots(&dir);
    print_table(&dir);
    let failed = index
        .points
        .iter()
        .filter(|e| e.status != PointStatus::Succeeded)
        .count();
    if !left.is_empty() {
        stderr_line!(
            "driver: containers of point(s) {} could not all be removed; their errors above say \
             which and how to remove them",
            left.join(", ")
        );
    }
    let code = if stopped {
        stderr_line!(
            "driver: sweep interrupted; `driver sweep --resume {}` runs the {failed} point(s) left",
            dir.display()
        );
        exit_code(true, failed, !left.is_empty())
    } else if failed > 0 {
        stderr_line!(
            "driver: {failed} of {} point(s) failed; the table shows which; `driver sweep --resume {}` \
             runs them again",
            index.points.len(),
            dir.display()
        );
        exit_code(false, failed, !left.is_empty())
    } else {
        if !quiet {
            stderr_line!("driver: every point succeeded; sweep folder {}", dir.display());
        }
        exit_code(false, 0, false)
    };
    Ok(code)
}

/// A sweep's exit code: interrupted (130), else containers of a point left behind (4, as a run
/// that left some exits), else a point failed (1), else 0.
fn exit_code(stopped: bool, failed: usize, left: bool) -> i32 {
    match (stopped, failed, left) {
        (true, _, _) => exit_codes::INTERRUPTED,
        (false, _, true) => exit_codes::CLEANUP_FAILED,
        (false, 0, false) => exit_codes::SUCCESS,
        (false, _, false) => exit_codes::EXPERIMENT_FAILED,
    }
}

/// The index of a new sweep (not written yet) and the folder its sweep folder goes into.
fn new_index(
    options: &Options,
    config_file: &Path,
    grid: &[(String, Vec<String>)],
    repeat: u32,
) -> Result<(PathBuf, Index, Loaded), SweepError> {
    let loaded = config::load(config_file)?;
    let file_axes = loaded
        .file
        .sweep
        .as_ref()
        .map(|s| s.axes.clone())
        .unwrap_or_default();
    let axes = grid::combine(&file_axes, grid)
        .and_then(|axes| grid::check(&axes).map(|()| axes))
        .map_err(|source| grid_error(&loaded, grid, source))?;
    let name = crate::experiment::experiment_name(&loaded);
    let points: Vec<Point> = grid::expand(&axes, repeat);
    let width = (points.len().saturating_sub(1)).to_string().len();
    let parent = crate::experiment::log_directory(&loaded, options);
    let config_file = std::path::absolute(config_file).unwrap_or_else(|_| config_file.to_path_buf());
    let index = Index {
        format_version: INDEX_VERSION,
        name: name.clone(),
        config_file,
        axes,
        repeat,
        started_at: String::new(),
        points: points
            .into_iter()
            .map(|p| PointEntry {
                index: p.index,
                name: format!("{name}-p{:0width$}", p.index),
                settings: p.settings,
                repeat: p.repeat,
                status: PointStatus::Pending,
                record: None,
                error: None,
                earlier_records: Vec::new(),
            })
            .collect(),
    };
    Ok((parent, index, loaded))
}

/// A grid error, said where its key is given: with `--grid` (a value as typed there, not as
/// read: `1e3`, not `1000.0`), or at its line in the file's `sweep:` section.
fn grid_error(loaded: &Loaded, grid: &[(String, Vec<String>)], source: GridError) -> SweepError {
    let path = loaded.path.display();
    let key = match &source {
        GridError::Key { key, .. } | GridError::Value { key, .. } => config::canonical_key(key).to_string(),
        GridError::Empty | GridError::TooLarge { .. } => {
            return SweepError::Grid {
                at: format!("in {path}"),
                source,
            }
        }
    };
    let given = grid.iter().find(|(k, _)| config::canonical_key(k) == key);
    let (at, source) = match (given, source) {
        (Some((_, typed)), GridError::Value { key, value, message }) => {
            let typed = typed
                .iter()
                .find(|t| config::value_text(&config::parse_scalar(t)) == value)
                .cloned()
                .unwrap_or(value);
            let source = GridError::Value {
                key,
                value: typed,
                message,
            };
            ("given with --grid".to_string(), source)
        }
        (Some(_), source) => ("given with --grid".to_string(), source),
        (None, source) => match config::locate_sweep_key(&loaded.text, &key) {
            Some(line) => (format!("at {path}:{}", line.line), source),
            None => (format!("in {path}"), source),
        },
    };
    SweepError::Grid { at, source }
}

/// The name a new sweep's points are checked under before its folder has one (it is part of
/// their checkpoint folders, which only a runtime's resume reads).
const NEW_SWEEP: &str = "new-sweep";

/// A sweep folder's name, which its points' checkpoint folders are under.
fn folder_name(dir: &Path) -> String {
    dir.file_name()
        .map_or_else(|| NEW_SWEEP.to_string(), |n| n.to_string_lossy().into_owned())
}

/// Every point's experiment file (`sweep`: the sweep folder's name), each parsed, planned and its
/// request checked, so a bad point stops the sweep before anything runs; an error names the first
/// point refused.
fn points(loaded: &Loaded, index: &Index, options: &Options, sweep: &str) -> Result<Vec<Loaded>, SweepError> {
    let resolved = index
        .points
        .iter()
        .map(|entry| {
            config::with_overrides(loaded, &entry.name, sweep, &entry.settings)
                .and_then(|p| crate::experiment::resolve(&p, options, 0).map(|plan| (p, plan)))
                .map_err(|e| SweepError::Point {
                    label: index::label(&entry.settings, entry.repeat),
                    message: match e {
                        ConfigError::Invalid { message, .. } => message,
                        other => crate::error::error_chain(&other),
                    },
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some((first, second)) = same_pair(&resolved, index) {
        let (a, b) = (&index.points[first], &index.points[second]);
        if a.settings == b.settings {
            return Err(SweepError::Twice {
                label: index::label(&a.settings, a.repeat),
            });
        }
        let keys = a
            .settings
            .iter()
            .zip(&b.settings)
            .filter(|((_, x), (_, y))| x != y)
            .map(|((key, _), _)| key.clone())
            .collect();
        return Err(SweepError::Same {
            first: index::label(&a.settings, a.repeat),
            second: index::label(&b.settings, b.repeat),
            keys,
            command: loaded.file.command.is_some(),
        });
    }
    if let Some((i, message)) = first_refused(&resolved, options) {
        let entry = &index.points[i];
        return Err(SweepError::Point {
            label: index::label(&entry.settings, entry.repeat),
            message,
        });
    }
    Ok(resolved.into_iter().map(|(point, _)| point).collect())
}

/// The first two points of one repeat that would run the same: every rank's program, arguments
/// and environment, on the same hosts, in the same image, the same way, their names aside (a
/// point's name is in its checkpoint folder). A grid key that reaches none of it (`seed` when the
/// ranks run `command:`) would only repeat a point under another label.
fn same_pair(points: &[(Loaded, Experiment)], index: &Index) -> Option<(usize, usize)> {
    let mut seen: HashMap<(u32, String), usize> = HashMap::new();
    for (i, ((_, plan), entry)) in points.iter().zip(&index.points).enumerate() {
        let mut runs = serde_json::to_value(plan).ok()?;
        runs.as_object_mut()?.remove("name");
        let runs = runs.to_string().replace(&entry.name, "<point>");
        match seen.entry((entry.repeat, runs)) {
            Entry::Occupied(first) => return Some((*first.get(), i)),
            Entry::Vacant(slot) => {
                slot.insert(i);
            }
        }
    }
    None
}

/// `a`, `b` and `c`, each in backquotes.
fn quoted(keys: &[String]) -> String {
    let keys: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
    match keys.as_slice() {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// The first point whose training request the runtime here refuses, and why: every point's
/// request (rank 0's, as a run's preflight asks) is checked, several at once, so a point that
/// would fail in its turn stops the sweep before anything runs. Points asking the same are asked
/// once; points the runtime here cannot judge (no runtime, `command:`, `config_file: auto`) are
/// left to their runs.
fn first_refused(points: &[(Loaded, Experiment)], options: &Options) -> Option<(usize, String)> {
    let mut seen = HashSet::new();
    let distinct: Vec<usize> = (0..points.len())
        .filter(|&i| seen.insert((&points[i].1.ranks[0].argv, &points[i].1.ranks[0].env)))
        .collect();
    // About a quarter of a second each (libtorch loads in every check), on every core at once.
    if distinct.len() > 16 && options.verbosity != Verbosity::Quiet {
        stderr_line!(
            "driver: checking the training requests of {} points with the runtime before any runs",
            distinct.len()
        );
    }
    let next = AtomicUsize::new(0);
    let refused: Mutex<Option<(usize, String)>> = Mutex::new(None);
    let unchecked = AtomicBool::new(false);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(distinct.len());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some(&i) = distinct.get(next.fetch_add(1, Ordering::SeqCst)) {
                    // Points are handed out in order: once one is refused, those after it need
                    // no asking, and those before it are already being asked.
                    if refused
                        .lock()
                        .unwrap()
                        .as_ref()
                        .is_some_and(|(first, _)| *first < i)
                    {
                        break;
                    }
                    let (loaded, plan) = &points[i];
                    let why = match check::runtime_check(loaded, plan, options, false) {
                        Err(CheckError::Refused { reason, at, .. }) => {
                            format!("the runtime refuses its training request: {reason}{at}")
                        }
                        Err(CheckError::Config(e)) => crate::error::error_chain(&e),
                        Err(CheckError::Profile { reason }) => reason,
                        Err(e @ CheckError::CheckpointDir { .. }) => e.to_string(),
                        Ok(check::RuntimeCheck::NoRuntime) => {
                            // Said once, by the first worker to find it.
                            if !unchecked.swap(true, Ordering::SeqCst)
                                && options.verbosity != Verbosity::Quiet
                            {
                                stderr_line!(
                                    "driver: warning: the points' training requests are not checked \
                                     before the sweep runs: {}; each point's run checks its own",
                                    check::NO_RUNTIME
                                );
                            }
                            continue;
                        }
                        Ok(_) | Err(CheckError::Runtime { .. }) => continue,
                    };
                    let mut refused = refused.lock().unwrap();
                    if refused.as_ref().is_none_or(|(first, _)| i < *first) {
                        *refused = Some((i, why));
                    }
                }
            });
        }
    });
    refused.into_inner().unwrap()
}

/// Creates the sweep folder `<parent>/<UTC>_<name>-sweep/` with the experiment file as given
/// and the index; returns the folder.
fn create(parent: &Path, index: &mut Index, loaded: &Loaded) -> Result<PathBuf, SweepError> {
    let folder = Record::create(parent, &format!("{}-sweep", index.name))?;
    files::write_atomic(&folder.dir.join("config.given.yml"), loaded.text.as_bytes())?;
    index.started_at = folder.started.to_string();
    index.write(&folder.dir)?;
    Ok(folder.dir)
}

/// Record folders in the sweep folder that its index does not list, each added to its point's
/// `earlier_records` (oldest first): a point whose driver was killed outright never got its record
/// into the index, but the record is there, with what it ran.
fn adopt_unlisted(dir: &Path, index: &mut Index) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut folders: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    folders.sort();
    for folder in folders {
        let listed = index
            .points
            .iter()
            .any(|p| p.record.as_deref() == Some(folder.as_str()) || p.earlier_records.contains(&folder));
        if listed {
            continue;
        }
        let Ok(summary) = crate::records::summary::read_summary(&dir.join(&folder)) else {
            continue;
        };
        if let Some(point) = index.points.iter_mut().find(|p| p.name == summary.name) {
            point.earlier_records.push(folder);
            // Record folders start with their UTC start time: by name is oldest first.
            point.earlier_records.sort();
        }
    }
}

/// Reads a sweep folder's index and its experiment file again.
fn resume(dir: &Path) -> Result<(Index, Loaded), SweepError> {
    let mut index = Index::read(dir)?;
    adopt_unlisted(dir, &mut index);
    let loaded = config::load(&index.config_file).map_err(|e| match e {
        ConfigError::Read { .. } => SweepError::Moved {
            file: index.config_file.clone(),
            copy: dir.join("config.given.yml"),
            source: e,
        },
        e => SweepError::Config(e),
    })?;
    let given = std::fs::read_to_string(dir.join("config.given.yml")).unwrap_or_default();
    if given != loaded.text {
        stderr_line!(
            "warning: {} changed since the sweep started; the points left run with its settings as \
             they are now, over the points the sweep started with (its sweep.json: a changed grid \
             is a new sweep, run without --resume); the sweep's config.given.yml has the text it \
             started with",
            index.config_file.display()
        );
    }
    Ok((index, loaded))
}

/// Whether the point's record says it succeeded (the index alone is not trusted: the driver may
/// have died between the two).
fn succeeded(dir: &Path, entry: &PointEntry) -> bool {
    entry.status == PointStatus::Succeeded
        && entry
            .record
            .as_ref()
            .is_some_and(|r| results::record_succeeded(&dir.join(r)))
}

/// Writes `sweep.svg`, and `loss.svg` and `accuracy.svg` where the records report those; a plot
/// that cannot be drawn is a warning, the records are what matter.
fn write_plots(dir: &Path) {
    let drawn = [
        results::plot_sweep(dir, &dir.join("sweep.svg")),
        results::plot_sweep_curves(dir),
    ];
    for e in drawn.iter().filter_map(|d| d.as_ref().err()) {
        stderr_line!(
            "warning: no plot in {}: {}",
            dir.display(),
            crate::error::error_chain(e)
        );
    }
}

/// Prints the sweep's results table on stdout.
fn print_table(dir: &Path) {
    match results::table_of(dir) {
        Ok(table) => stdout_line!("{table}"),
        Err(e) => stderr_line!(
            "warning: cannot show the results: {}",
            crate::error::error_chain(&e)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_whose_point_left_containers_exits_as_such_a_run_does() {
        assert_eq!(exit_code(false, 0, false), exit_codes::SUCCESS);
        assert_eq!(exit_code(false, 2, false), exit_codes::EXPERIMENT_FAILED);
        assert_eq!(exit_code(false, 1, true), exit_codes::CLEANUP_FAILED);
        assert_eq!(exit_code(true, 1, true), exit_codes::INTERRUPTED);
    }
}
