//! All indicatif setup: one bar per experiment showing iterations done and live samples/s.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::record::RecordError;
use super::stats::Stats;
use super::Reporter;
use crate::cli::Progress;
use crate::events::Event;

/// Creates the bar (hidden when off or when stderr is not a terminal).
pub fn bar(progress: Progress, iterations: Option<u64>) -> ProgressBar {
    let target = match progress {
        Progress::Auto => ProgressDrawTarget::stderr(),
        Progress::Off => ProgressDrawTarget::hidden(),
    };
    let bar = ProgressBar::with_draw_target(iterations, target);
    let template = match iterations {
        Some(_) => "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} iterations {msg}",
        None => "{spinner} [{elapsed_precise}] {pos} iterations {msg}",
    };
    bar.set_style(ProgressStyle::with_template(template).expect("template is valid"));
    bar.set_message("starting");
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
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
            | Event::HostLost { .. } => {}
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
            Event::Stopping(_) => self.bar.set_message("stopping"),
            Event::Finished { .. } => self.bar.finish_and_clear(),
        }
        Ok(())
    }
}
