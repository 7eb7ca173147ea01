//! `driver results`: reads record folders (one experiment, a sweep folder, or a folder of them)
//! into rows (`read`), filters, sorts and groups them (`select`), and renders a table, Markdown,
//! CSV or JSON (`export`) or an SVG plot (`plot`).

mod curves;
mod export;
mod plot;
mod read;
mod select;

use std::path::{Path, PathBuf};

pub use self::curves::{Smoothing, Target};
pub use self::plot::{CurveX, PlotError};
pub use self::read::record_succeeded;

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A table for a terminal.
    Table,
    /// A Markdown table.
    Markdown,
    /// Comma-separated values, plain numbers.
    Csv,
    /// An array of objects.
    Json,
}

/// A validated `driver results` request.
#[derive(Debug, Clone)]
pub struct ResultsOptions {
    /// Records, sweep folders, or folders of them.
    pub paths: Vec<PathBuf>,
    /// Output format.
    pub format: Format,
    /// `KEY` or `KEY:desc` to sort by.
    pub sort: Option<String>,
    /// One table per value of this key.
    pub group_by: Option<String>,
    /// `KEY=VALUE` filters: a row must match one value of each key given.
    pub filters: Vec<(String, String)>,
    /// Selects the baseline row for speedups (default: the first row with a throughput, in the
    /// records' order, before any sort).
    pub baseline: Option<String>,
    /// Where to write an SVG plot, if anywhere.
    pub plot: Option<PathBuf>,
    /// The plot's x axis key (default: the sweep's first grid key).
    pub plot_x: Option<String>,
    /// Where to write an SVG plot of every record's loss curve, if anywhere.
    pub plot_loss: Option<PathBuf>,
    /// Where to write an SVG plot of every record's accuracy curves, if anywhere.
    pub plot_accuracy: Option<PathBuf>,
    /// What the loss and accuracy plots' x axis counts.
    pub curve_x: CurveX,
    /// How much the loss and accuracy plots smooth their lines, and the curve `time_to` reads.
    pub smoothing: Smoothing,
    /// A figure each record's training curve is to reach: a column says when it did.
    pub time_to: Option<Target>,
}

impl ResultsOptions {
    /// `paths` in `format`, unsorted, ungrouped, unfiltered, without baseline or plots.
    pub fn plain(paths: Vec<PathBuf>, format: Format) -> ResultsOptions {
        ResultsOptions {
            paths,
            format,
            sort: None,
            group_by: None,
            filters: Vec::new(),
            baseline: None,
            plot: None,
            plot_x: None,
            plot_loss: None,
            plot_accuracy: None,
            curve_x: CurveX::Iteration,
            smoothing: Smoothing::NONE,
            time_to: None,
        }
    }
}

/// Why results could not be shown; each says what to change.
#[derive(Debug, thiserror::Error)]
pub enum ResultsError {
    #[error("{} is not a folder; give a record folder, a sweep folder or a folder of them", path.display())]
    Missing { path: PathBuf },
    #[error("cannot list {}", path.display())]
    List {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "unknown key `{key}`; use a column ({}) or an experiment key such as batch_size",
        select::COLUMN_KEYS.join(", ")
    )]
    UnknownKey { key: String },
    #[error("no row matches --baseline {selector}; give KEY=VALUE, a name, a record id or a run label")]
    Baseline { selector: String },
    #[error("--sort {spec}: `{direction}` is not a direction; give KEY, KEY:asc or KEY:desc")]
    SortDirection { spec: String, direction: String },
    #[error("{key}: the time to a target needs the target; add --time-to METRIC=TARGET (e.g. accuracy=90%)")]
    TimeToWithoutTarget { key: String },
    #[error("{flag} {}: plots are written as SVG; give a file ending in .svg", path.display())]
    NotSvg { flag: &'static str, path: PathBuf },
    #[error("cannot write the plot")]
    Plot(#[from] PlotError),
}

impl ResultsError {
    /// The documented exit code: every one of these is the command line's to fix, except a plot
    /// that cannot be written.
    pub fn exit_code(&self) -> i32 {
        match self {
            ResultsError::Missing { .. }
            | ResultsError::List { .. }
            | ResultsError::UnknownKey { .. }
            | ResultsError::Baseline { .. }
            | ResultsError::SortDirection { .. }
            | ResultsError::TimeToWithoutTarget { .. }
            | ResultsError::NotSvg { .. }
            | ResultsError::Plot(PlotError::NoAxis) => crate::exit_codes::INVALID_CONFIG,
            ResultsError::Plot(_) => crate::exit_codes::RECORD_FAILED,
        }
    }
}

/// Whether `path` names an SVG file (`.svg`, in any case).
fn is_svg(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg"))
}

/// Rows after filters, times to the target, sort and baseline, split into groups.
fn select(options: &ResultsOptions) -> Result<Vec<(String, Vec<read::Row>)>, ResultsError> {
    let rows = read::collect(&options.paths)?;
    let mut rows = select::filter(rows, &options.filters)?;
    if let Some(target) = options.time_to {
        for row in rows.iter_mut().filter(|r| r.id.is_some()) {
            row.time_to = curves::time_to(&row.dir, target, options.smoothing);
        }
    }
    // `time_to` has values only with the target they are times to.
    let needs_target = [options.sort.as_deref(), options.group_by.as_deref()]
        .into_iter()
        .flatten()
        .find(|key| select::is_time_to(key));
    if let (Some(key), None) = (needs_target, options.time_to) {
        return Err(ResultsError::TimeToWithoutTarget { key: key.to_string() });
    }
    // The baseline is chosen in the records' order, so that sorting does not move it.
    select::speedups(&mut rows, options.baseline.as_deref())?;
    if let Some(key) = &options.sort {
        select::sort(&mut rows, key)?;
    }
    match &options.group_by {
        Some(key) => select::group(rows, key),
        None => Ok(vec![(String::new(), rows)]),
    }
}

/// The rendered output for `options`.
pub fn render(options: &ResultsOptions) -> Result<String, ResultsError> {
    Ok(rendered(options, &select(options)?))
}

/// `groups`, selected for `options`, in its format.
fn rendered(options: &ResultsOptions, groups: &[(String, Vec<read::Row>)]) -> String {
    let view = export::Groups::new(options.group_by.as_deref(), options.time_to, groups);
    export::exporter(options.format).render(&view)
}

/// Runs `driver results`: prints the output and writes the plot, if asked.
pub fn run(options: &ResultsOptions) -> Result<(), ResultsError> {
    let plots = [
        ("--plot", &options.plot),
        ("--plot-loss", &options.plot_loss),
        ("--plot-accuracy", &options.plot_accuracy),
    ];
    for (flag, path) in plots {
        if let Some(path) = path.as_ref().filter(|p| !is_svg(p)) {
            return Err(ResultsError::NotSvg {
                flag,
                path: path.clone(),
            });
        }
    }
    let groups = select(options)?;
    let rows: Vec<&read::Row> = groups.iter().flat_map(|(_, r)| r).collect();
    // What the command line gets wrong is said before the table, not after it.
    if let Some(x) = &options.plot_x {
        select::check_key(&rows, x)?;
    }
    if options.plot.is_some() && !matches!(rows.as_slice(), [one] if one.point.is_none()) {
        plot::x_axis(&rows, options.plot_x.as_deref())?;
    }
    stdout_text!("{}", rendered(options, &groups));
    let rows: Vec<read::Row> = groups.into_iter().flat_map(|(_, r)| r).collect();
    if rows.is_empty() {
        let paths: Vec<String> = options.paths.iter().map(|p| p.display().to_string()).collect();
        match options.filters.as_slice() {
            [] => stderr_line!("driver: no experiment records in {}", paths.join(", ")),
            filters => {
                let filters: Vec<String> = filters.iter().map(|(k, v)| format!("{k}={v}")).collect();
                stderr_line!("driver: no record matches {}", filters.join(" "));
            }
        }
    }
    if let Some(path) = &options.plot {
        match rows.as_slice() {
            [one] if one.point.is_none() => plot::stages(one, path)?,
            _ => plot::throughput(&rows, options.plot_x.as_deref(), path)?,
        }
        stderr_line!("driver: plot written to {}", path.display());
    }
    if let Some(path) = &options.plot_loss {
        plot::losses(&rows, options.curve_x, options.smoothing, path)?;
        stderr_line!("driver: loss plot written to {}", path.display());
    }
    if let Some(path) = &options.plot_accuracy {
        plot::accuracies(&rows, options.curve_x, options.smoothing, path)?;
        stderr_line!("driver: accuracy plot written to {}", path.display());
    }
    Ok(())
}

/// A sweep folder's table, as `driver results DIR` prints it.
pub fn table_of(dir: &Path) -> Result<String, ResultsError> {
    render(&ResultsOptions::plain(vec![dir.to_path_buf()], Format::Table))
}

/// Writes a sweep folder's throughput plot to `path`.
pub fn plot_sweep(dir: &Path, path: &Path) -> Result<(), PlotError> {
    plot::throughput(&read::sweep(dir), None, path)
}

/// Writes a sweep folder's training curves against iterations, `loss.svg` and `accuracy.svg`,
/// each where the points' records report that figure, unsmoothed.
pub fn plot_sweep_curves(dir: &Path) -> Result<(), PlotError> {
    type Draw = fn(&[read::Row], CurveX, Smoothing, &Path) -> Result<(), PlotError>;
    let rows = read::sweep(dir);
    for (name, draw) in [
        ("loss.svg", plot::losses as Draw),
        ("accuracy.svg", plot::accuracies),
    ] {
        match draw(&rows, CurveX::Iteration, Smoothing::NONE, &dir.join(name)) {
            Ok(()) | Err(PlotError::NoLoss | PlotError::NoAccuracy) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
