//! All indicatif setup: one bar per experiment showing iterations done and live samples/s, and a
//! sweep's bar over its points above it.

use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::Reporter;
use crate::events::{Event, SlurmEvent};
use crate::options::Progress;
use crate::records::stats::Stats;
use crate::records::RecordError;

/// Creates the bar (hidden when off or when stderr is not a terminal), below a sweep's bar when
/// `under` is given.
pub fn bar(progress: Progress, iterations: Option<u64>, under: Option<&MultiProgress>) -> ProgressBar {
    let target = match progress {
        Progress::Auto => ProgressDrawTarget::stderr(),
        Progress::Off => ProgressDrawTarget::hidden(),
    };
    let bar = ProgressBar::with_draw_target(iterations, target);
    let bar = match (progress, under) {
        (Progress::Auto, Some(multi)) => multi.add(bar),
        (Progress::Auto | Progress::Off, _) => bar,
    };
    let template = match iterations {
        Some(_) => "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} iterations {msg}",
        None => "{spinner} [{elapsed_precise}] {pos} iterations {msg}",
    };
    bar.set_style(ProgressStyle::with_template(template).expect("template is valid"));
    bar.set_message("starting");
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// The bars of a sweep: one over its points, each point's experiment bar below it. Hidden when
/// off or when stderr is not a terminal.
pub fn sweep_bars(progress: Progress, points: u64) -> (MultiProgress, ProgressBar) {
    let multi = match progress {
        Progress::Auto => MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
        Progress::Off => MultiProgress::with_draw_target(ProgressDrawTarget::hidden()),
    };
    let bar = multi.add(ProgressBar::new(points));
    let template = "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} points {msg}";
    bar.set_style(ProgressStyle::with_template(template).expect("template is valid"));
    bar.enable_steady_tick(Duration::from_millis(200));
    (multi, bar)
}

/// Moves the bar as metrics arrive.
pub struct ProgressReporter {
    bar: ProgressBar,
    stats: Stats,
    started: usize,
}

impl ProgressReporter {
    /// Drives `bar`.
    pub fn new(bar: ProgressBar) -> ProgressReporter {
        ProgressReporter {
            bar,
            stats: Stats::default(),
            started: 0,
        }
    }
}

impl Reporter for ProgressReporter {
    fn report(&mut self, event: &Event) -> Result<(), RecordError> {
        match event {
            Event::HostReady(_)
            | Event::LineLogged { .. }
            | Event::RankExited { .. }
            | Event::RankRemoved { .. }
            | Event::RankLost { .. }
            | Event::ContainersLeft(_)
            | Event::HostLost { .. }
            | Event::Slurm(SlurmEvent::Line { .. } | SlurmEvent::Stopped { .. }) => {}
            Event::Slurm(SlurmEvent::Queued { job_id }) => {
                self.bar.set_message(format!("Slurm job {job_id} queued"))
            }
            Event::Slurm(SlurmEvent::Started(job)) => {
                self.bar.set_message(format!("Slurm job {} started", job.job_id))
            }
            Event::RankStarted { .. } => {
                self.started += 1;
                self.bar.set_message(format!("{} ranks running", self.started));
            }
            Event::Metrics { event, .. } => {
                self.stats.record(event);
                self.bar.set_position(self.stats.iterations_done());
                if let Some(sps) = self.stats.latest_samples_per_sec() {
                    self.bar.set_message(format!("{sps:.1} samples/s"));
                }
            }
            Event::Profiling { .. } | Event::ProfileLine { .. } => self.bar.set_message("profiling"),
            Event::Planned(facts) => self
                .bar
                .set_message(format!("planned {} stage(s)", facts.replicas.len())),
            Event::Stopping(_) => self.bar.set_message("stopping"),
            Event::StoppingNow(_) => self.bar.set_message("stopping now"),
            Event::Restarting { .. } => {
                self.stats.restarted();
                self.started = 0;
                self.bar.set_message("restarting");
            }
            Event::NotRestarted { .. } | Event::TracesGathered(_) => {}
            Event::Finished { .. } => self.bar.finish_and_clear(),
        }
        Ok(())
    }
}
