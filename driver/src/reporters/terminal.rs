//! Terminal lines: each rank's output prefixed with host and rank, and what the driver is doing.
//! Printed around the progress bar so the two do not garble each other.

use std::collections::{BTreeMap, BTreeSet};

use indicatif::ProgressBar;

use super::record::RecordError;
use super::Reporter;
use crate::cli::Verbosity;
use crate::events::{Event, StopCause, Stream};

/// Prints events for a person watching.
pub struct TerminalReporter {
    verbosity: Verbosity,
    bar: ProgressBar,
    hosts: BTreeMap<usize, String>,
    lost: BTreeSet<String>,
}

impl TerminalReporter {
    /// Prints at `verbosity`, suspending `bar` while printing.
    pub fn new(verbosity: Verbosity, bar: ProgressBar, hosts: BTreeMap<usize, String>) -> TerminalReporter {
        TerminalReporter {
            verbosity,
            bar,
            hosts,
            lost: BTreeSet::new(),
        }
    }

    fn prefix(&self, rank: usize) -> String {
        let host = self.hosts.get(&rank).map(String::as_str).unwrap_or("?");
        format!("[{host} r{rank}]")
    }

    fn out(&self, text: String) {
        self.bar.suspend(|| println!("{text}"));
    }

    fn err(&self, text: String) {
        self.bar.suspend(|| eprintln!("{text}"));
    }
}

impl Reporter for TerminalReporter {
    fn report(&mut self, event: &Event) -> Result<(), RecordError> {
        let normal = self.verbosity != Verbosity::Quiet;
        let verbose = self.verbosity == Verbosity::Verbose;
        match event {
            Event::HostReady(facts) => {
                if verbose {
                    let image = facts.image.as_deref().unwrap_or("-");
                    let built = if facts.image_built { " (built)" } else { "" };
                    self.err(format!("driver: host {} ready, image {image}{built}", facts.host));
                }
            }
            Event::RankStarted { rank, host, handle } => {
                if verbose {
                    self.err(format!("driver: rank {rank} started on {host} ({handle})"));
                }
            }
            Event::LineLogged { rank, stream, line } => {
                if normal {
                    let text = format!("{} {line}", self.prefix(*rank));
                    match stream {
                        Stream::Stdout => self.out(text),
                        Stream::Stderr => self.err(text),
                    }
                }
            }
            Event::Metrics { rank, line, .. } => {
                if verbose {
                    self.out(format!("{} {line}", self.prefix(*rank)));
                }
            }
            Event::RankExited { rank, exit_code } => {
                let failed = *exit_code != Some(0);
                if failed || verbose {
                    let code = exit_code.map_or("none (killed)".to_string(), |c| c.to_string());
                    self.err(format!("{} exited with code {code}", self.prefix(*rank)));
                }
            }
            Event::HostLost { host, reason } => {
                if self.lost.insert(host.clone()) {
                    self.err(format!(
                        "driver: lost the connection to {host}'s Docker engine: {reason}"
                    ));
                }
            }
            Event::Stopping(cause) => {
                let why = match cause {
                    StopCause::RankFailed {
                        rank,
                        host,
                        exit_code,
                    } => {
                        let code = exit_code.map_or("no exit code".to_string(), |c| format!("exit code {c}"));
                        format!("rank {rank} on {host} failed with {code}")
                    }
                    StopCause::HostLost { host, .. } => format!("host {host} was lost"),
                    StopCause::Interrupted => "interrupted".to_string(),
                };
                self.err(format!("driver: {why}; stopping every rank"));
            }
            Event::Finished { .. } => {}
        }
        Ok(())
    }
}
