//! Training curves from records' `metrics.jsonl`: each iteration's loss or accuracy as the last
//! stage's ranks reported it ([`curve`]), smoothed as TensorBoard smooths ([`Smoothing`]), and
//! when a curve first reached a figure (`--time-to`, [`time_to`]), PipeDream's time to accuracy.
//! The plots draw them (`plot`); the table shows the time to a target.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The metrics lines of a record's `metrics.jsonl`, in order; `None` when it has no such file.
/// Lines that are not metrics lines (a file cut short or edited, or a newer runtime's events)
/// are left out, and said once per file.
pub(super) fn events(dir: &Path) -> Option<Vec<stagehand_contract::Event>> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).ok()?;
    let mut events = Vec::new();
    let mut unread = Vec::new();
    for (i, line) in text.lines().enumerate() {
        match stagehand_contract::Event::parse_line(line) {
            Some(event) => events.push(event),
            None if line.trim().is_empty() => {}
            None => unread.push(i + 1),
        }
    }
    if let Some(first) = unread.first() {
        static SAID: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());
        if SAID.lock().expect("not poisoned").insert(path.clone()) {
            stderr_line!(
                "warning: {} of {}'s lines are not metrics lines this driver reads (the first is \
                 line {first}); the curves leave them out",
                unread.len(),
                path.display()
            );
        }
    }
    Some(events)
}

/// The iteration lines of a record's `metrics.jsonl`, in order; `None` when it has no such file.
pub(super) fn iterations(dir: &Path) -> Option<Vec<stagehand_contract::Iteration>> {
    Some(iterations_of(&events(dir)?))
}

/// The iteration lines among `events`, in order.
fn iterations_of(events: &[stagehand_contract::Event]) -> Vec<stagehand_contract::Iteration> {
    events
        .iter()
        .filter_map(|event| match event {
            stagehand_contract::Event::Iteration(it) => Some(it.clone()),
            _ => None,
        })
        .collect()
}

/// [`curve`] from a record's metrics lines already read.
pub(super) fn curve_in(events: &[stagehand_contract::Event], metric: Metric) -> Option<Curve> {
    match metric.of_validation() {
        true => validation_curve(events, metric),
        false => curve_of(&iterations_of(events), metric),
    }
}

/// What the last stage reports that a curve follows: on its iteration lines (the training
/// samples'), or on its validation lines (`validate_every`: the held-out split's, a point per
/// pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    Loss,
    /// Top-1 accuracy.
    Accuracy,
    AccuracyTop5,
    /// The validation passes' loss.
    ValLoss,
    /// The validation passes' top-1 accuracy.
    ValAccuracy,
    ValAccuracyTop5,
}

impl Metric {
    /// The metric as the command line names it.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::Accuracy => "accuracy",
            Metric::AccuracyTop5 => "top5",
            Metric::ValLoss => "val_loss",
            Metric::ValAccuracy => "val_accuracy",
            Metric::ValAccuracyTop5 => "val_top5",
        }
    }

    fn example(self) -> &'static str {
        match self {
            Metric::Loss => "loss=0.5",
            Metric::Accuracy => "accuracy=90%",
            Metric::AccuracyTop5 => "top5=99%",
            Metric::ValLoss => "val_loss=0.5",
            Metric::ValAccuracy => "val_accuracy=90%",
            Metric::ValAccuracyTop5 => "val_top5=99%",
        }
    }

    /// Whether the validation passes report it (rather than the iterations).
    fn of_validation(self) -> bool {
        matches!(
            self,
            Metric::ValLoss | Metric::ValAccuracy | Metric::ValAccuracyTop5
        )
    }

    /// Whether reaching it means coming down to it (a loss) rather than up.
    fn falls(self) -> bool {
        matches!(self, Metric::Loss | Metric::ValLoss)
    }

    fn of(self, it: &stagehand_contract::Iteration) -> Option<f64> {
        match self {
            Metric::Loss => it.loss,
            Metric::Accuracy => it.accuracy,
            Metric::AccuracyTop5 => it.accuracy_top5,
            Metric::ValLoss | Metric::ValAccuracy | Metric::ValAccuracyTop5 => None,
        }
    }

    /// Its figure of a validation pass; `None` for a training metric.
    fn of_pass(self, figures: &stagehand_contract::ValidationFigures) -> Option<f64> {
        match self {
            Metric::ValLoss => Some(figures.loss),
            Metric::ValAccuracy => Some(figures.accuracy),
            Metric::ValAccuracyTop5 => figures.accuracy_top5,
            Metric::Loss | Metric::Accuracy | Metric::AccuracyTop5 => None,
        }
    }
}

/// How much a training-curve plot smooths its lines (`--smooth`): the weight of an exponential
/// moving average, debiased as TensorBoard's smoothing slider is, so that the line starts at the
/// first value rather than rising from zero. 0 draws the raw values alone; above it each line is
/// drawn smoothed, over its raw values drawn faint, and `--time-to` reads the smoothed curve.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Smoothing(f64);

impl Smoothing {
    /// No smoothing: the raw values.
    pub const NONE: Smoothing = Smoothing(0.0);

    /// A smoothing weight, which must be at least 0 and below 1 (at 1 the line would never
    /// leave its first value).
    pub fn new(weight: f64) -> Result<Smoothing, String> {
        match (0.0..1.0).contains(&weight) {
            true => Ok(Smoothing(weight)),
            false => Err(format!(
                "{weight} is not a smoothing weight: give one from 0 (raw values) up to, not \
                 including, 1 (TensorBoard's default is 0.6)"
            )),
        }
    }

    /// The moving average's weight.
    pub fn weight(self) -> f64 {
        self.0
    }

    /// `values` smoothed: each the debiased moving average of the values up to it,
    /// `(w * last + (1 - w) * v) / (1 - w^n)` for the n-th value with `last` starting at 0.
    pub fn apply(self, values: &[f64]) -> Vec<f64> {
        let w = self.0;
        let mut last = 0.0;
        let mut debias = 1.0;
        values
            .iter()
            .map(|v| {
                last = w * last + (1.0 - w) * v;
                debias *= w;
                last / (1.0 - debias)
            })
            .collect()
    }

    /// The caption's note of the smoothing, empty for none.
    pub(super) fn note(self) -> String {
        match self == Smoothing::NONE {
            true => String::new(),
            false => format!(", smoothed ({})", self.weight()),
        }
    }
}

/// One point of a training curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurvePoint {
    pub iteration: u64,
    /// Seconds of training up to the end of this iteration.
    pub seconds: f64,
    /// The mean of what the last stage's ranks reported for it.
    pub value: f64,
}

/// A training curve: a point per iteration, in order.
pub type Curve = Vec<CurvePoint>;

/// A record's `metric` per iteration from its `metrics.jsonl`: for each iteration, the mean of
/// what its last-stage ranks reported (data-parallel replicas each report their own share's),
/// each rank's last report counting (a restarted run reports resumed iterations again); `None`
/// when no iteration has the metric. A validation metric has a point per pass instead
/// ([`validation_curve`]).
pub fn curve(dir: &Path, metric: Metric) -> Option<Curve> {
    curve_in(&events(dir)?, metric)
}

/// A validation metric's curve: a point per pass, at the iteration it followed and the seconds
/// of training up to the end of that iteration (the loss curve's; a pass's own time is no
/// training). Every last-stage rank reports the whole pass's figures; a restarted run's later
/// report of a pass replaces the earlier.
fn validation_curve(events: &[stagehand_contract::Event], metric: Metric) -> Option<Curve> {
    let mut passes: BTreeMap<u64, f64> = BTreeMap::new();
    for event in events {
        if let stagehand_contract::Event::Validation(v) = event {
            if let Some(value) = metric.of_pass(&v.figures).filter(|v| v.is_finite()) {
                passes.insert(v.iteration, value);
            }
        }
    }
    let seconds: BTreeMap<u64, f64> = curve_of(&iterations_of(events), Metric::Loss)?
        .into_iter()
        .map(|p| (p.iteration, p.seconds))
        .collect();
    let points: Curve = passes
        .into_iter()
        .filter_map(|(iteration, value)| {
            Some(CurvePoint {
                iteration,
                seconds: *seconds.get(&iteration)?,
                value,
            })
        })
        .collect();
    (!points.is_empty()).then_some(points)
}

/// [`curve`] from a record's iteration lines already read.
fn curve_of(iterations: &[stagehand_contract::Iteration], metric: Metric) -> Option<Curve> {
    // iteration -> rank -> (value, seconds)
    let mut reports: BTreeMap<u64, BTreeMap<usize, (f64, f64)>> = BTreeMap::new();
    for it in iterations {
        if let Some(value) = metric.of(it).filter(|v| v.is_finite()) {
            reports
                .entry(it.iteration)
                .or_default()
                .insert(it.rank, (value, it.time_s));
        }
    }
    let mut seconds = 0.0;
    let points: Curve = reports
        .into_iter()
        .map(|(iteration, ranks)| {
            let n = ranks.len() as f64;
            seconds += ranks.values().map(|(_, t)| t).sum::<f64>() / n;
            CurvePoint {
                iteration,
                seconds,
                value: ranks.values().map(|(v, _)| v).sum::<f64>() / n,
            }
        })
        .collect();
    (!points.is_empty()).then_some(points)
}

/// `--time-to METRIC=TARGET`: a figure each run's training curve is to reach (a loss at or
/// below, an accuracy at or above it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    pub metric: Metric,
    /// A loss, or an accuracy as a fraction.
    pub value: f64,
}

impl Target {
    /// `loss=0.5`, `accuracy=0.9` or `accuracy=90%`, `top5=99%`; errors say what to give.
    pub fn parse(text: &str) -> Result<Target, String> {
        let Some((name, value)) = text.split_once('=') else {
            return Err(format!(
                "`{text}` is not METRIC=TARGET; give one such as accuracy=90% or loss=0.5"
            ));
        };
        let metric = match name.trim() {
            "loss" => Metric::Loss,
            "accuracy" | "acc" | "top1" | "top-1" => Metric::Accuracy,
            "top5" | "top-5" | "accuracy_top5" => Metric::AccuracyTop5,
            "val_loss" | "validation_loss" => Metric::ValLoss,
            "val_accuracy" | "val_acc" | "val_top1" | "validation_accuracy" => Metric::ValAccuracy,
            "val_top5" | "validation_accuracy_top5" => Metric::ValAccuracyTop5,
            other => {
                return Err(format!(
                    "unknown metric `{other}`; use loss, accuracy (top-1) or top5 (the training \
                     samples'), or val_loss, val_accuracy or val_top5 (the validation passes')"
                ))
            }
        };
        let value = value.trim();
        let (number, percent) = match value.strip_suffix('%') {
            Some(number) => (number, true),
            None => (value, false),
        };
        let number: f64 = number.trim().parse().map_err(|_| {
            format!(
                "`{value}` is not a number; give a target such as {}",
                metric.example()
            )
        })?;
        let value = if percent { number / 100.0 } else { number };
        let fits = match metric.falls() {
            true => !percent && value.is_finite() && value > 0.0,
            false => value > 0.0 && value <= 1.0,
        };
        match fits {
            true => Ok(Target { metric, value }),
            false => Err(format!(
                "{} is not a target for {}: {}",
                text.trim(),
                metric.name(),
                match metric.falls() {
                    true => "give a positive loss, such as loss=0.5",
                    false => "give a fraction above 0 and up to 1 (0.9) or a percentage (90%)",
                }
            )),
        }
    }

    /// Whether `value` is as good as the target or better.
    fn reached_by(self, value: f64) -> bool {
        match self.metric.falls() {
            true => value <= self.value,
            false => value >= self.value,
        }
    }

    /// The table's column header: `to accuracy ≥ 90%`, `to loss ≤ 0.5`.
    pub fn header(self) -> String {
        match self.metric {
            metric if metric.falls() => format!("to {} ≤ {}", metric.name(), self.value),
            // As a percentage the fraction is rounded (29% is 0.29, which times 100 is
            // 28.999999999999996).
            metric => format!("to {} ≥ {}%", metric.name(), figure_text(self.value * 100.0)),
        }
    }
}

/// A figure as text (an axis label, a target): at most 4 decimals, trailing zeros dropped, in
/// scientific notation when large or small.
pub(super) fn figure_text(v: f64) -> String {
    match v.abs() {
        0.0 => "0".to_string(),
        a if !(1e-3..1e4).contains(&a) => format!("{v:.2e}"),
        _ => {
            let text = format!("{v:.4}");
            text.trim_end_matches('0').trim_end_matches('.').to_string()
        }
    }
}

/// When a run's curve first reached a [`Target`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TimeTo {
    /// At this iteration, after this many seconds of training (the iterations' own times).
    Reached { iteration: u64, seconds: f64 },
    /// Not in any of the iterations the run reported.
    NotReached { iterations: usize },
}

impl TimeTo {
    /// The seconds of training it took, when it was reached.
    pub fn seconds(self) -> Option<f64> {
        match self {
            TimeTo::Reached { seconds, .. } => Some(seconds),
            TimeTo::NotReached { .. } => None,
        }
    }
}

/// When the record's curve of the target's metric, smoothed by `smoothing`, first reached the
/// target; `None` when the record reports no such curve. A validation metric's passes are read
/// as they are: each is already a mean over the held-out split, not one minibatch's luck, and
/// the plots draw them unsmoothed.
pub fn time_to(dir: &Path, target: Target, smoothing: Smoothing) -> Option<TimeTo> {
    let curve = curve(dir, target.metric)?;
    let smoothing = match target.metric.of_validation() {
        true => Smoothing::NONE,
        false => smoothing,
    };
    let values: Vec<f64> = curve.iter().map(|p| p.value).collect();
    let reached = smoothing
        .apply(&values)
        .into_iter()
        .zip(&curve)
        .find(|(value, _)| target.reached_by(*value));
    Some(match reached {
        Some((_, point)) => TimeTo::Reached {
            iteration: point.iteration,
            seconds: point.seconds,
        },
        None => TimeTo::NotReached {
            iterations: curve.len(),
        },
    })
}
