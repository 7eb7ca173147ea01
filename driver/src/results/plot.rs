//! SVG plots with plotters: throughput against one key, a line per value of the other keys (a
//! sweep's plot); for one record, each stage's compute, communication and idle time per
//! iteration as stacked bars; and every record's training loss (`--plot-loss`) or accuracy
//! (`--plot-accuracy`) against iterations or seconds, to compare how runs converge, raw or
//! smoothed (`--smooth`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use super::curves::{curve_in, events, figure_text, iterations, Curve, CurvePoint, Metric, Smoothing};
use super::read::Row;
use super::select::value;

/// A plot that cannot be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("no row has a throughput to plot")]
    NoThroughput,
    #[error("no x axis: give --plot-x KEY (a column or experiment key)")]
    NoAxis,
    #[error("{} has no metrics to plot per stage", dir.display())]
    NoMetrics { dir: PathBuf },
    #[error(
        "no record has a loss to plot (the last stage's `loss` on its iteration lines in metrics.jsonl)"
    )]
    NoLoss,
    #[error(
        "no record has an accuracy to plot (the last stage's `accuracy` on its iteration lines in \
         metrics.jsonl; runtimes from before it report none)"
    )]
    NoAccuracy,
    #[error("cannot draw {}: {message}", path.display())]
    Draw { path: PathBuf, message: String },
}

const SIZE: (u32, u32) = (900, 560);

/// A drawing error as [`PlotError::Draw`], without plotters' wrapping of the I/O error that is
/// the reason (`backend error: Drawing backend error: No such file or directory`).
fn draw_error(path: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError::Draw {
        path: path.to_path_buf(),
        message: message
            .trim_start_matches("backend error: ")
            .trim_start_matches("Drawing backend error: ")
            .to_string(),
    }
}

/// The grid keys of the first of `rows` that is a sweep's point (none where none is).
fn sweep_axes(rows: &[&Row]) -> Vec<String> {
    rows.iter()
        .find_map(|r| r.point.as_ref().map(|p| p.axes.clone()))
        .unwrap_or_default()
}

/// The throughput plot's x axis: `x`, else the first grid key of the rows' sweep;
/// [`PlotError::NoAxis`] where there is neither (records that are no sweep's points).
pub fn x_axis(rows: &[&Row], x: Option<&str>) -> Result<String, PlotError> {
    match x {
        Some(k) => Ok(k.to_string()),
        None => sweep_axes(rows).first().cloned().ok_or(PlotError::NoAxis),
    }
}

/// Throughput against `x` (default: the first axis of the rows' sweep), a line per combination
/// of the sweep's other keys; repetitions of a point are averaged.
pub fn throughput(rows: &[Row], x: Option<&str>, path: &Path) -> Result<(), PlotError> {
    let measured: Vec<&Row> = rows.iter().filter(|r| r.throughput.is_some()).collect();
    if measured.is_empty() {
        return Err(PlotError::NoThroughput);
    }
    let axes = sweep_axes(&measured);
    let x_key = x_axis(&measured, x)?;
    let others: Vec<&String> = axes
        .iter()
        .filter(|k| crate::config::canonical_key(k) != crate::config::canonical_key(&x_key))
        .collect();

    // x positions: the distinct values, numerically ordered when they are all numbers.
    let mut xs: Vec<String> = Vec::new();
    for r in &measured {
        let v = value(r, &x_key).unwrap_or_else(|| "-".into());
        if !xs.contains(&v) {
            xs.push(v);
        }
    }
    if xs.iter().all(|v| v.parse::<f64>().is_ok()) {
        xs.sort_by(|a, b| a.parse::<f64>().unwrap().total_cmp(&b.parse::<f64>().unwrap()));
    }
    // line label -> x position -> samples/s of each repetition
    let mut lines: Vec<(String, BTreeMap<usize, Vec<f64>>)> = Vec::new();
    for r in &measured {
        let label: Vec<String> = others
            .iter()
            .map(|k| format!("{k}={}", value(r, k).unwrap_or_else(|| "-".into())))
            .collect();
        let label = if label.is_empty() {
            "samples/s".to_string()
        } else {
            label.join(" ")
        };
        let xv = value(r, &x_key).unwrap_or_else(|| "-".into());
        let at = xs.iter().position(|v| *v == xv).expect("collected above");
        let sps = r.throughput.as_ref().expect("filtered").samples_per_sec_mean;
        let line = match lines.iter().position(|(l, _)| *l == label) {
            Some(i) => &mut lines[i].1,
            None => {
                lines.push((label, BTreeMap::new()));
                &mut lines.last_mut().expect("pushed").1
            }
        };
        line.entry(at).or_default().push(sps);
    }
    let top = measured
        .iter()
        .map(|r| r.throughput.as_ref().expect("filtered").samples_per_sec_mean)
        .fold(0.0f64, f64::max);

    let fail = draw_error(path);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("throughput against {x_key}"), ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(xs.len() as f64 - 0.5), 0.0f64..(top * 1.15).max(1.0))
        .map_err(|e| fail(e.to_string()))?;
    let label_of = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 {
            xs.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_labels(xs.len().max(2) * 2 + 1)
        .x_label_formatter(&label_of)
        .x_desc(x_key.as_str())
        .y_desc("samples/s")
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    for (i, (label, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let series: Vec<(f64, f64)> = points
            .iter()
            .map(|(&at, v)| (at as f64, v.iter().sum::<f64>() / v.len() as f64))
            .collect();
        chart
            .draw_series(LineSeries::new(series, color.stroke_width(2)).point_size(4))
            .map_err(|e| fail(e.to_string()))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    legend_and_present(&mut chart, &root, SeriesLabelPosition::LowerRight, path)
}

/// Seconds per iteration each stage spent computing, waiting on communication and idle,
/// averaged over the stage's ranks, from the record's `metrics.jsonl`.
pub fn stage_times(dir: &Path) -> Result<Vec<(usize, [f64; 3])>, PlotError> {
    let iterations = iterations(dir).ok_or_else(|| PlotError::NoMetrics {
        dir: dir.to_path_buf(),
    })?;
    // stage -> (sums, iteration reports)
    let mut sums: BTreeMap<usize, ([f64; 3], usize)> = BTreeMap::new();
    for it in iterations {
        let entry = sums.entry(it.stage).or_insert(([0.0; 3], 0));
        entry.0[0] += it.compute_s;
        entry.0[1] += it.comm_wait_s;
        entry.0[2] += it.idle_s;
        entry.1 += 1;
    }
    if sums.is_empty() {
        return Err(PlotError::NoMetrics {
            dir: dir.to_path_buf(),
        });
    }
    Ok(sums
        .into_iter()
        .map(|(stage, (s, n))| (stage, s.map(|x| x / n as f64)))
        .collect())
}

/// One record's per-stage compute, communication and idle time as stacked bars.
pub fn stages(row: &Row, path: &Path) -> Result<(), PlotError> {
    let times = stage_times(&row.dir)?;
    let top = times
        .iter()
        .map(|(_, t)| t.iter().sum::<f64>())
        .fold(0.0f64, f64::max);
    let fail = draw_error(path);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let n = times.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{}: time per iteration by stage", row.label()),
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0.0f64..(top * 1.4 * 1e3).max(1e-3))
        .map_err(|e| fail(e.to_string()))?;
    let label_of = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
            format!("stage {}", times[i as usize].0)
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_labels(n.max(2) * 2 + 1)
        .disable_x_mesh()
        .x_label_formatter(&label_of)
        .y_desc("ms per iteration")
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    let parts = [
        ("compute", BLUE.mix(0.7)),
        ("communication", RED.mix(0.7)),
        ("idle", RGBColor(150, 150, 150).mix(0.7)),
    ];
    for (p, (name, color)) in parts.iter().enumerate() {
        let bars = times.iter().enumerate().map(|(i, (_, t))| {
            let below: f64 = t[..p].iter().sum::<f64>() * 1e3;
            let x = i as f64;
            Rectangle::new([(x - 0.3, below), (x + 0.3, below + t[p] * 1e3)], color.filled())
        });
        let color = *color;
        chart
            .draw_series(bars)
            .map_err(|e| fail(e.to_string()))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    legend_and_present(&mut chart, &root, SeriesLabelPosition::UpperRight, path)
}

/// What the x axis of a training-curve plot (`--plot-loss`, `--plot-accuracy`) counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CurveX {
    /// Iterations (optimizer steps).
    #[default]
    Iteration,
    /// Seconds of training: the iterations' own times added up, so time spent starting ranks
    /// (or starting them again) is left out.
    Seconds,
}

impl CurveX {
    /// The axis' description.
    fn desc(self) -> &'static str {
        match self {
            CurveX::Iteration => "iteration",
            CurveX::Seconds => "seconds of training",
        }
    }

    fn of(self, p: &CurvePoint) -> f64 {
        match self {
            CurveX::Iteration => p.iteration as f64,
            CurveX::Seconds => p.seconds,
        }
    }
}

/// The legend label of each row: its table label, with its record folder where labels repeat.
fn row_labels(rows: &[&Row]) -> Vec<String> {
    let labels: Vec<String> = rows.iter().map(|r| r.label()).collect();
    labels
        .iter()
        .zip(rows)
        .map(
            |(label, row)| match labels.iter().filter(|l| *l == label).count() {
                1 => label.clone(),
                _ => format!("{label} ({})", super::read::folder_name(&row.dir)),
            },
        )
        .collect()
}

/// A line of a curve plot, its points already in the chart's coordinates.
struct Line {
    label: String,
    points: Vec<(f64, f64)>,
    /// The raw values where `points` are smoothed, drawn faint beneath; empty where not.
    raw: Vec<(f64, f64)>,
    color: RGBAColor,
    dashed: bool,
    /// Each point marked with a dot (a validation curve's passes, few and far apart).
    marked: bool,
}

impl Line {
    /// The line of `curve` against `x`, its values through `y` into the chart's coordinates,
    /// smoothed by `smoothing` (in values, before `y`, as TensorBoard smooths a log-scale plot).
    fn of(
        curve: &[CurvePoint],
        x: CurveX,
        y: impl Fn(f64) -> f64,
        smoothing: Smoothing,
        label: String,
        color: RGBAColor,
        dashed: bool,
    ) -> Line {
        let xs = curve.iter().map(|p| x.of(p));
        let values: Vec<f64> = curve.iter().map(|p| p.value).collect();
        let at = |values: &[f64]| xs.clone().zip(values.iter().map(|&v| y(v))).collect();
        let (points, raw) = match smoothing == Smoothing::NONE {
            true => (at(&values), Vec::new()),
            false => (at(&smoothing.apply(&values)), at(&values)),
        };
        Line {
            label,
            points,
            raw,
            color,
            dashed,
            marked: false,
        }
    }

    /// The line of a record's validation passes: a dot on each, never smoothed (each pass is
    /// already a mean over the held-out split).
    fn passes(
        curve: &[CurvePoint],
        x: CurveX,
        y: impl Fn(f64) -> f64,
        label: String,
        color: RGBAColor,
    ) -> Line {
        Line {
            marked: true,
            ..Line::of(curve, x, y, Smoothing::NONE, label, color, false)
        }
    }
}

/// What a curve plot's caption says it shows: its validation passes too where any row has some.
fn curves_shown(any_validation: bool) -> &'static str {
    match any_validation {
        true => "training and validation",
        false => "training",
    }
}

/// The radius of a marked line's dots, in pixels.
const MARK: i32 = 4;

/// How faint a smoothed line's raw values are drawn (the alpha of its colour).
const RAW_ALPHA: f64 = 0.25;

/// How a curve plot's axes read.
struct Axes<'a> {
    caption: String,
    x: CurveX,
    x_end: f64,
    y: std::ops::Range<f64>,
    y_desc: &'a str,
    y_label: &'a dyn Fn(&f64) -> String,
    legend: SeriesLabelPosition,
}

/// Draws `lines` on `axes` and writes the plot to `path`.
fn draw_lines(path: &Path, axes: Axes, lines: Vec<Line>) -> Result<(), PlotError> {
    // At least one iteration wide; in seconds, as long as the longest run, however short.
    let x_end = match axes.x {
        CurveX::Iteration => axes.x_end.max(1.0),
        CurveX::Seconds if axes.x_end > 0.0 => axes.x_end,
        CurveX::Seconds => 1.0,
    };
    let fail = draw_error(path);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(axes.caption, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0f64..x_end, axes.y)
        .map_err(|e| fail(e.to_string()))?;
    let x_label = |v: &f64| match axes.x {
        CurveX::Iteration => format!("{v:.0}"),
        CurveX::Seconds => figure_text(*v),
    };
    chart
        .configure_mesh()
        .x_desc(axes.x.desc())
        .x_label_formatter(&x_label)
        .y_desc(axes.y_desc)
        .y_label_formatter(axes.y_label)
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    // Raw values beneath every smoothed line, so that no row's raw values hide another's line.
    for line in &lines {
        let raw = line.color.mix(RAW_ALPHA).stroke_width(1);
        let points = line.raw.iter().copied();
        match line.dashed {
            false => chart.draw_series(LineSeries::new(points, raw)),
            true => chart.draw_series(DashedLineSeries::new(points, DASH, DASH, raw)),
        }
        .map_err(|e| fail(e.to_string()))?;
    }
    for line in lines {
        let style = line.color.stroke_width(2);
        if line.marked {
            let dots = line
                .points
                .iter()
                .map(|&p| Circle::new(p, MARK, line.color.filled()));
            chart.draw_series(dots).map_err(|e| fail(e.to_string()))?;
        }
        let marked = line.marked;
        let drawn = match line.dashed {
            false => chart.draw_series(LineSeries::new(line.points, style)),
            true => chart.draw_series(DashedLineSeries::new(line.points, DASH, DASH, style)),
        };
        drawn
            .map_err(|e| fail(e.to_string()))?
            .label(line.label)
            .legend(move |(x, y)| {
                // The sample line in two pieces, end to end for a solid line, apart for a dashed one.
                let piece = |from: i32, to: i32| PathElement::new(vec![(from, 0), (to, 0)], style);
                let (first, second) = match line.dashed {
                    false => ((0, 9), (9, 18)),
                    true => ((0, 7), (11, 18)),
                };
                let sample = EmptyElement::at((x, y)) + piece(first.0, first.1) + piece(second.0, second.1);
                // A marked line's sample carries a dot at its middle.
                let dot = Circle::new((9, 0), if marked { MARK } else { 0 }, style.color.filled());
                sample + dot
            });
    }
    legend_and_present(&mut chart, &root, axes.legend, path)
}

/// Length of a dashed line's dashes and of the gaps between them, in pixels.
const DASH: u32 = 6;

/// Every row's loss curve against `x`, a line per row (labelled as its row, with its record
/// folder where labels repeat), smoothed by `smoothing`; where a row ran validation passes, their
/// loss as a line through a dot per pass in the same colour (not smoothed: each is already a mean
/// over the held-out split); rows without losses are left out.
pub fn losses(rows: &[Row], x: CurveX, smoothing: Smoothing, path: &Path) -> Result<(), PlotError> {
    // (row, training loss, validation loss)
    let curves: Vec<(&Row, Curve, Option<Curve>)> = rows
        .iter()
        .filter_map(|r| {
            // Each record's lines are read once for both curves.
            let lines = events(&r.dir)?;
            let training = curve_in(&lines, Metric::Loss)?;
            Some((r, training, curve_in(&lines, Metric::ValLoss)))
        })
        .collect();
    if curves.is_empty() {
        return Err(PlotError::NoLoss);
    }
    let (mut x_end, mut low, mut high) = (0.0f64, f64::INFINITY, f64::NEG_INFINITY);
    let every_point = curves
        .iter()
        .flat_map(|(_, training, validation)| training.iter().chain(validation.iter().flatten()));
    for p in every_point {
        x_end = x_end.max(x.of(p));
        low = low.min(p.value);
        high = high.max(p.value);
    }
    // Losses over orders of magnitude (a run that diverged beside ones that did not) are drawn
    // on a log scale, so that every curve stays readable: the y axis holds log10 of the loss.
    let log = low > 0.0 && high / low > LOG_SCALE_SPAN;
    let y = |loss: f64| if log { loss.log10() } else { loss };
    let (low, high) = (y(low), y(high));
    let pad = ((high - low) * 0.05).max(1e-6);
    let y_label = |v: &f64| match log {
        true => figure_text(10f64.powf(*v)),
        false => figure_text(*v),
    };
    let labels = row_labels(&curves.iter().map(|(r, ..)| *r).collect::<Vec<_>>());
    let mut lines = Vec::new();
    for (i, ((_, training, validation), label)) in curves.iter().zip(labels).enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let training_label = match validation {
            None => label.clone(),
            Some(_) => format!("{label} training"),
        };
        lines.push(Line::of(training, x, y, smoothing, training_label, color, false));
        if let Some(validation) = validation {
            lines.push(Line::passes(
                validation,
                x,
                y,
                format!("{label} validation"),
                color,
            ));
        }
    }
    let axes = Axes {
        caption: format!(
            "{} loss against {}{}",
            curves_shown(curves.iter().any(|(.., validation)| validation.is_some())),
            x.desc(),
            smoothing.note()
        ),
        x,
        x_end,
        y: (low - pad)..(high + pad),
        y_desc: if log { "loss (log scale)" } else { "loss" },
        y_label: &y_label,
        legend: SeriesLabelPosition::UpperRight,
    };
    draw_lines(path, axes, lines)
}

/// Every row's training accuracy against `x`: top-1 a solid line per row (labelled as its row,
/// with its record folder where labels repeat), top-5 a dashed one in the same colour where the
/// row reports it, and where it ran validation passes their top-1 as a line through a dot per
/// pass, in the same colour; on a fixed 0-100% scale, so plots compare; the training curves
/// smoothed by `smoothing` (a few passes are not). Rows without accuracies are left out.
pub fn accuracies(rows: &[Row], x: CurveX, smoothing: Smoothing, path: &Path) -> Result<(), PlotError> {
    // (row, top-1, top-5, validation top-1)
    type Curves<'r> = (&'r Row, Curve, Option<Curve>, Option<Curve>);
    let curves: Vec<Curves> = rows
        .iter()
        .filter_map(|r| {
            // Each record's lines are read once for all its curves.
            let lines = events(&r.dir)?;
            let top1 = curve_in(&lines, Metric::Accuracy)?;
            let top5 = curve_in(&lines, Metric::AccuracyTop5);
            Some((r, top1, top5, curve_in(&lines, Metric::ValAccuracy)))
        })
        .collect();
    if curves.is_empty() {
        return Err(PlotError::NoAccuracy);
    }
    let x_end = curves
        .iter()
        .flat_map(|(_, top1, top5, _)| top1.iter().chain(top5.iter().flatten()))
        .map(|p| x.of(p))
        .fold(0.0f64, f64::max);
    let labels = row_labels(&curves.iter().map(|(r, ..)| *r).collect::<Vec<_>>());
    let line = |c: &[CurvePoint], label: String, color: RGBAColor, dashed: bool| {
        Line::of(c, x, |v| v, smoothing, label, color, dashed)
    };
    let mut lines = Vec::new();
    for (i, ((_, top1, top5, validation), label)) in curves.iter().zip(labels).enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let top1_label = match (top5, validation) {
            (None, None) => label.clone(),
            _ => format!("{label} top-1"),
        };
        lines.push(line(top1, top1_label, color, false));
        if let Some(top5) = top5 {
            lines.push(line(top5, format!("{label} top-5"), color, true));
        }
        if let Some(validation) = validation {
            let label = format!("{label} validation top-1");
            lines.push(Line::passes(validation, x, |v| v, label, color));
        }
    }
    let y_label = |v: &f64| format!("{:.0}%", v * 100.0);
    let axes = Axes {
        caption: format!(
            "{} accuracy against {}{}",
            curves_shown(curves.iter().any(|(.., validation)| validation.is_some())),
            x.desc(),
            smoothing.note()
        ),
        x,
        x_end,
        y: -0.02..1.02,
        y_desc: "accuracy",
        y_label: &y_label,
        legend: SeriesLabelPosition::LowerRight,
    };
    draw_lines(path, axes, lines)
}

/// Draws the series' legend at `position` and writes the plot to `path`.
fn legend_and_present<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    root: &DrawingArea<SVGBackend<'a>, Shift>,
    position: SeriesLabelPosition,
    path: &Path,
) -> Result<(), PlotError> {
    let fail = draw_error(path);
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(position)
        .draw()
        .map_err(|e| fail(e.to_string()))?;
    root.present().map_err(|e| fail(e.to_string()))
}

/// How far apart the largest and smallest loss must be for a log scale.
const LOG_SCALE_SPAN: f64 = 100.0;
