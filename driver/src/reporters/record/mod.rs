//! The record folder `<log_directory>/<UTC timestamp>_<name>/`: configs, hosts, git state, rank
//! logs, `metrics.jsonl` and `summary.json`, written as the run goes so a crash keeps what was
//! gathered. Whole files are replaced atomically; logs and metrics are appended line by line.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use jiff::Timestamp;

use super::Reporter;
use crate::events::{ended_by_stop, Event, HostFacts, SlurmEvent, SlurmJob, Status, StopCause, TracesFacts};
use crate::experiment::Experiment;
use crate::records::stats::Stats;
use crate::records::summary::{
    DriverProcess, Failure, LastValidation, RankOutcome, RankState, Restart, Summary, FORMAT_VERSION,
};
use crate::records::{files, Record, RecordError};

/// Lines kept per rank for the failure report.
const LAST_LINES: usize = 20;
/// How often `summary.json` is rewritten while only metrics arrive.
const SUMMARY_EVERY: Duration = Duration::from_secs(1);

/// Writes the record as events arrive.
pub struct RecordReporter {
    record: Record,
    summary: Summary,
    hosts: Vec<HostFacts>,
    logs: BTreeMap<usize, File>,
    metrics: Option<File>,
    last_lines: BTreeMap<usize, VecDeque<String>>,
    profile_log: Option<File>,
    profile_lines: VecDeque<String>,
    slurm_log: Option<File>,
    slurm_lines: VecDeque<String>,
    stats: Stats,
    last_write: Instant,
}

impl RecordReporter {
    /// Starts the record for `plan` in `record`, writing an initial `summary.json`.
    pub fn new(record: Record, plan: &Experiment) -> Result<RecordReporter, RecordError> {
        let summary = Summary {
            format_version: FORMAT_VERSION,
            id: record.id.clone(),
            name: plan.name.clone(),
            status: Status::Running,
            started_at: record.started.to_string(),
            ended_at: None,
            duration_s: 0.0,
            backend: format!("{:?}", plan.backend).to_lowercase(),
            world_size: plan.world_size(),
            iterations_done: 0,
            resumed_at: None,
            throughput: None,
            skipped_steps: None,
            final_loss: None,
            final_accuracy: None,
            final_accuracy_top5: None,
            validation: None,
            stages: Vec::new(),
            ranks: plan
                .ranks
                .iter()
                .map(|r| RankOutcome::pending(r.rank, plan.hosts[r.host].name.clone()))
                .collect(),
            failure: None,
            restarts: Vec::new(),
            not_restarted: None,
            containers_not_removed: Vec::new(),
            plan: None,
            slurm_job: None,
            traces: None,
            driver: DriverProcess::this(),
        };
        let mut reporter = RecordReporter {
            record,
            summary,
            hosts: Vec::new(),
            logs: BTreeMap::new(),
            metrics: None,
            last_lines: BTreeMap::new(),
            profile_log: None,
            profile_lines: VecDeque::new(),
            slurm_log: None,
            slurm_lines: VecDeque::new(),
            stats: Stats::default(),
            last_write: Instant::now(),
        };
        reporter.write_summary()?;
        Ok(reporter)
    }

    fn append(file: &mut File, path: &Path, line: &str) -> Result<(), RecordError> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        file.write_all(&bytes).map_err(|source| RecordError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    fn open_append(path: &Path) -> Result<File, RecordError> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| RecordError::Write {
                path: path.to_path_buf(),
                source,
            })
    }

    /// Keeps a human log line for the failure report (metrics lines are in `metrics.jsonl`).
    fn keep_line(&mut self, rank: usize, line: &str) {
        let kept = self.last_lines.entry(rank).or_default();
        if kept.len() == LAST_LINES {
            kept.pop_front();
        }
        kept.push_back(line.to_string());
    }

    fn log_line(&mut self, rank: usize, line: &str) -> Result<(), RecordError> {
        let path = self.record.dir.join(format!("rank-{rank}.log"));
        let file = match self.logs.entry(rank) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(Self::open_append(&path)?),
        };
        Self::append(file, &path, line)
    }

    fn write_summary(&mut self) -> Result<(), RecordError> {
        let now = Timestamp::now();
        self.summary.duration_s = now.duration_since(self.record.started).as_secs_f64();
        self.summary.iterations_done = self.stats.iterations_done();
        self.summary.resumed_at = self.stats.resumed_at();
        self.summary.throughput = self.stats.throughput();
        self.summary.skipped_steps = self.stats.skipped_steps();
        let fit = self.stats.fit();
        self.summary.final_loss = fit.and_then(|f| f.loss);
        self.summary.final_accuracy = fit.and_then(|f| f.accuracy);
        self.summary.final_accuracy_top5 = fit.and_then(|f| f.accuracy_top5);
        self.summary.validation = self
            .stats
            .validation()
            .map(|(iteration, figures)| LastValidation { iteration, figures });
        self.summary.stages = self.stats.stage_shares();
        self.last_write = Instant::now();
        files::write_json(&self.record.dir.join("summary.json"), &self.summary)
    }
}

impl Reporter for RecordReporter {
    fn report(&mut self, event: &Event) -> Result<(), RecordError> {
        match event {
            Event::HostReady(facts) => {
                self.hosts.push(facts.clone());
                files::write_json(&self.record.dir.join("hosts.json"), &self.hosts)?;
            }
            Event::RankStarted { rank, host, handle } => {
                if let Some(r) = self.summary.ranks.get_mut(*rank) {
                    r.host = host.clone();
                    r.handle = Some(handle.clone());
                    r.saw(RankState::Running, None);
                }
                self.write_summary()?;
            }
            Event::LineLogged { rank, line, .. } => {
                self.keep_line(*rank, line);
                self.log_line(*rank, line)?;
            }
            Event::Metrics { rank, line, event } => {
                self.log_line(*rank, line)?;
                self.stats.record(event);
                let path = self.record.dir.join("metrics.jsonl");
                if self.metrics.is_none() {
                    self.metrics = Some(Self::open_append(&path)?);
                }
                Self::append(self.metrics.as_mut().expect("opened above"), &path, line)?;
                if self.last_write.elapsed() >= SUMMARY_EVERY {
                    self.write_summary()?;
                }
            }
            Event::RankExited {
                rank,
                exit_code,
                out_of_memory,
            } => {
                // The driver is stopping every rank once the record has the failure.
                let state = match self.summary.failure.is_some() && ended_by_stop(*exit_code, *out_of_memory)
                {
                    true => RankState::Stopped,
                    false => RankState::Exited,
                };
                if let Some(r) = self.summary.ranks.get_mut(*rank) {
                    r.saw(state, *exit_code);
                }
                self.write_summary()?;
            }
            Event::RankRemoved { rank } | Event::RankLost { rank, .. } => {
                let state = match event {
                    Event::RankRemoved { .. } => RankState::Removed,
                    _ => RankState::Lost,
                };
                if let Some(r) = self.summary.ranks.get_mut(*rank) {
                    r.saw(state, None);
                }
                self.write_summary()?;
            }
            Event::ContainersLeft(left) => {
                for container in left {
                    for rank in &container.ranks {
                        if let Some(r) = self.summary.ranks.get_mut(*rank) {
                            r.saw(RankState::NotRemoved, None);
                        }
                    }
                }
                self.summary.containers_not_removed.extend(left.iter().cloned());
                self.write_summary()?;
            }
            Event::HostLost { .. } | Event::Profiling { .. } => {}
            Event::ProfileLine { line, .. } => {
                if self.profile_lines.len() == LAST_LINES {
                    self.profile_lines.pop_front();
                }
                self.profile_lines.push_back(line.clone());
                let path = self.record.dir.join("profile.log");
                if self.profile_log.is_none() {
                    self.profile_log = Some(Self::open_append(&path)?);
                }
                Self::append(self.profile_log.as_mut().expect("opened above"), &path, line)?;
            }
            Event::Planned(facts) => {
                self.summary.plan = Some(facts.clone());
                self.write_summary()?;
            }
            Event::Stopping(cause) => {
                if self.summary.failure.is_none() {
                    let last_lines = match cause {
                        StopCause::RankFailed { rank, .. } => self
                            .last_lines
                            .get(rank)
                            .map(|l| l.iter().cloned().collect())
                            .unwrap_or_default(),
                        StopCause::ProfileFailed { .. } => self.profile_lines.iter().cloned().collect(),
                        StopCause::SlurmJob { .. } => self.slurm_lines.iter().cloned().collect(),
                        StopCause::HostLost { .. }
                        | StopCause::Interrupted
                        | StopCause::PlanFailed { .. }
                        | StopCause::LaunchFailed { .. } => Vec::new(),
                    };
                    self.summary.failure = Some(Failure {
                        cause: cause.clone(),
                        last_lines,
                    });
                }
                self.write_summary()?;
            }
            Event::Slurm(slurm) => match slurm {
                SlurmEvent::Queued { job_id } => {
                    self.summary.slurm_job = Some(SlurmJob {
                        job_id: *job_id,
                        nodes: Vec::new(),
                    });
                    self.write_summary()?;
                }
                SlurmEvent::Started(job) => {
                    self.summary.slurm_job = Some(job.clone());
                    self.write_summary()?;
                }
                SlurmEvent::Line { line, important } => {
                    if *important {
                        if self.slurm_lines.len() == LAST_LINES {
                            self.slurm_lines.pop_front();
                        }
                        self.slurm_lines.push_back(line.clone());
                    }
                    let path = self.record.dir.join("slurm.log");
                    if self.slurm_log.is_none() {
                        self.slurm_log = Some(Self::open_append(&path)?);
                    }
                    Self::append(self.slurm_log.as_mut().expect("opened above"), &path, line)?;
                }
                SlurmEvent::Stopped { .. } => {}
            },
            Event::Restarting {
                restart,
                max,
                cause,
                resume_from,
            } => {
                let failure = self.summary.failure.take().unwrap_or_else(|| Failure {
                    cause: cause.clone(),
                    last_lines: Vec::new(),
                });
                self.summary.restarts.push(Restart {
                    at: Timestamp::now().to_string(),
                    failure,
                    iterations_done: self.stats.iterations_done(),
                    resume_from: *resume_from,
                });
                self.stats.restarted();
                self.last_lines.clear();
                let from = match resume_from {
                    Some(done) => format!("from the checkpoints of {done} iterations done"),
                    None => "as first started".to_string(),
                };
                let mark =
                    format!("--- driver: every rank started again, {from} (restart {restart} of {max}) ---");
                for rank in self.summary.ranks.iter_mut() {
                    *rank = RankOutcome::pending(rank.rank, rank.host.clone());
                }
                let ranks: Vec<usize> = self.summary.ranks.iter().map(|r| r.rank).collect();
                for rank in ranks {
                    self.log_line(rank, &mark)?;
                }
                self.write_summary()?;
            }
            Event::TracesGathered(facts) => {
                // Named in the record as the folder in it, so the record can move.
                let record = crate::experiment::absolute(&self.record.dir);
                let dir = facts.dir.strip_prefix(&record).unwrap_or(&facts.dir);
                self.summary.traces = Some(TracesFacts {
                    dir: dir.to_path_buf(),
                    ..facts.clone()
                });
                self.write_summary()?;
            }
            Event::NotRestarted { why } => {
                self.summary.not_restarted = Some(why.clone());
                self.write_summary()?;
            }
            // The cause stays the interrupt the record already has.
            Event::StoppingNow(_) => {}
            Event::Finished { status } => {
                self.summary.status = *status;
                self.summary.ended_at = Some(Timestamp::now().to_string());
                self.write_summary()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
