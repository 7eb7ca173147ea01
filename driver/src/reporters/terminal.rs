//! Terminal lines: each rank's output prefixed with host and rank, and what the driver is doing.
//! [`TerminalReporter::render`] decides the text (snapshot-tested); printing goes around the
//! progress bar so the two do not garble each other.

use std::collections::{BTreeMap, BTreeSet};

use indicatif::ProgressBar;

use super::Reporter;
use crate::events::{
    command_note, ended_by_stop, memory_note, slurm_job, Event, SlurmEvent, StopCause, StopNow, Stream,
    LEASE_EXPIRED_EXIT_CODE,
};
use crate::options::Verbosity;
use crate::records::RecordError;

/// Prints events for a person watching.
pub struct TerminalReporter {
    verbosity: Verbosity,
    bar: ProgressBar,
    hosts: BTreeMap<usize, String>,
    lost: BTreeSet<String>,
    intervals: Intervals,
    /// The rank whose losses the interval lines show (the first seen to report one).
    loss_rank: Option<usize>,
    /// Whether the driver is stopping every rank (since [`Event::Stopping`], until the ranks
    /// start again): an exit with the stop's code is then the stop's doing, not a failure.
    stopping: bool,
}

/// How often iterations are shown at normal verbosity (PipeDream's `print_frequency` and
/// `verbose_frequency`); `None` or 0 for never. metrics.jsonl always has every iteration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Intervals {
    /// Every N iterations, one line with the last stage's loss, throughput and learning rate.
    pub print_every: Option<u64>,
    /// Every N iterations, every rank's metrics line, as `-v` shows them all.
    pub verbose_every: Option<u64>,
}

/// Whether iteration `i` (from 0) ends an interval of `every`.
fn due(every: Option<u64>, i: u64) -> bool {
    every.is_some_and(|n| n > 0 && (i + 1).is_multiple_of(n))
}

impl TerminalReporter {
    /// Prints at `verbosity`, suspending `bar` while printing.
    pub fn new(verbosity: Verbosity, bar: ProgressBar, hosts: BTreeMap<usize, String>) -> TerminalReporter {
        TerminalReporter {
            verbosity,
            bar,
            hosts,
            lost: BTreeSet::new(),
            intervals: Intervals::default(),
            loss_rank: None,
            stopping: false,
        }
    }

    /// Also shows iterations at `intervals`.
    pub fn with_intervals(mut self, intervals: Intervals) -> TerminalReporter {
        self.intervals = intervals;
        self
    }

    fn prefix(&self, rank: usize) -> String {
        let host = self.hosts.get(&rank).map(String::as_str).unwrap_or("?");
        format!("[{host} r{rank}]")
    }

    /// The line an event shows, and on which stream, at this verbosity.
    pub fn render(&mut self, event: &Event) -> Option<(Stream, String)> {
        let normal = self.verbosity != Verbosity::Quiet;
        let verbose = self.verbosity == Verbosity::Verbose;
        let err = |text: String| Some((Stream::Stderr, text));
        match event {
            Event::HostReady(facts) => verbose.then(|| {
                let image = facts.image.as_deref().unwrap_or("-");
                let built = match (&facts.image_received_from, facts.image_built) {
                    (Some(from), _) => format!(" (received from {from} in {:.1} s)", facts.image_seconds),
                    (None, true) => format!(" (built in {:.0} s)", facts.image_seconds),
                    (None, false) => String::new(),
                };
                let copied = match facts.copied_in.len() {
                    0 => String::new(),
                    n => format!(", {n} file(s) copied in"),
                };
                let infiniband = match facts.infiniband {
                    true => ", InfiniBand devices given to its containers",
                    false => "",
                };
                (
                    Stream::Stderr,
                    format!("driver: host {} ready, image {image}{built}{copied}{infiniband}", facts.host),
                )
            }),
            Event::RankStarted { rank, host, handle } => {
                // Where the rank really runs (Slurm picks its nodes) prefixes its lines.
                self.hosts.insert(*rank, host.clone());
                verbose.then(|| {
                    (
                        Stream::Stderr,
                        format!("driver: rank {rank} started on {host} ({handle})"),
                    )
                })
            }
            Event::LineLogged { rank, stream, line } => {
                normal.then(|| (*stream, format!("{} {line}", self.prefix(*rank))))
            }
            Event::Metrics { rank, line, event } => {
                let iteration = match event.as_ref() {
                    stagehand_contract::Event::Iteration(it) => Some(it),
                    _ => None,
                };
                let every_line = iteration.is_some_and(|it| due(self.intervals.verbose_every, it.iteration));
                if verbose || (normal && every_line) {
                    return Some((Stream::Stdout, format!("{} {line}", self.prefix(*rank))));
                }
                // A step fp16's scaler skipped is shown between print intervals too.
                let skipped = iteration.is_some_and(|it| it.step_skipped == Some(true));
                let it = iteration
                    .filter(|it| normal && (skipped || due(self.intervals.print_every, it.iteration)))?;
                // The last stage knows the loss; one line per iteration, from its first rank.
                let loss = it.loss?;
                if *self.loss_rank.get_or_insert(*rank) != *rank {
                    return None;
                }
                let top5 = it
                    .accuracy_top5
                    .map_or(String::new(), |a| format!(" (top-5 {:.1}%)", a * 100.0));
                let accuracy = it
                    .accuracy
                    .map_or(String::new(), |a| format!(", accuracy {:.1}%{top5}", a * 100.0));
                let lr = it.lr.map_or(String::new(), |lr| format!(", lr {lr:.3e}"));
                let scale = it.loss_scale.map_or(String::new(), |s| format!(", loss scale {s}"));
                let skip = match skipped {
                    true => " (step skipped: fp16 gradients held an inf or a nan)",
                    false => "",
                };
                Some((
                    Stream::Stderr,
                    format!(
                        "{} iteration {}: loss {loss:.4}{accuracy}, {:.1} samples/s{lr}{scale}{skip}",
                        self.prefix(*rank),
                        it.iteration + 1,
                        it.samples_per_sec
                    ),
                ))
            }
            Event::RankExited {
                rank,
                exit_code,
                out_of_memory,
            } => {
                if self.stopping && ended_by_stop(*exit_code, *out_of_memory) {
                    let code = exit_code.map_or("killed, no exit code".to_string(), |c| format!("exit code {c}"));
                    return verbose.then(|| {
                        (
                            Stream::Stderr,
                            format!("{} stopped by the driver ({code})", self.prefix(*rank)),
                        )
                    });
                }
                let failed = *exit_code != Some(0);
                let code = match exit_code {
                    None => "none (killed)".to_string(),
                    Some(c) if *c == LEASE_EXPIRED_EXIT_CODE => {
                        format!("{c} (its lease guard's code: the driver's lease on it expired)")
                    }
                    Some(c) => c.to_string(),
                };
                (failed || verbose).then(|| {
                    (
                        Stream::Stderr,
                        format!(
                            "{} exited with code {code}{}{}",
                            self.prefix(*rank),
                            memory_note(*out_of_memory),
                            command_note(*exit_code)
                        ),
                    )
                })
            }
            Event::RankRemoved { rank } => {
                verbose.then(|| (Stream::Stderr, format!("{} removed", self.prefix(*rank))))
            }
            Event::RankLost { rank, host, .. } => err(format!(
                "{} was not seen to exit: {host} stopped answering",
                self.prefix(*rank)
            )),
            // The run's error lists them, with the commands that remove them.
            Event::ContainersLeft(_) => None,
            Event::HostLost { host, reason } => {
                if !self.lost.insert(host.clone()) {
                    return None;
                }
                err(format!(
                    "driver: lost {host}: {reason}"
                ))
            }
            Event::Stopping(cause) => {
                self.stopping = true;
                let why = match cause {
                    StopCause::RankFailed {
                        rank,
                        host,
                        exit_code,
                        out_of_memory,
                        silent_peer,
                    } => {
                        let code = exit_code.map_or("no exit code".to_string(), |c| format!("exit code {c}"));
                        let oom = match out_of_memory {
                            true => " (killed for lack of memory)",
                            false => "",
                        };
                        let failed = format!("rank {rank} on {host} failed with {code}{oom}");
                        match silent_peer {
                            // The rank to look at first.
                            Some(peer) => format!("{}; {failed}", peer.describe(*rank)),
                            None => failed,
                        }
                    }
                    StopCause::HostLost { host, .. } => format!("host {host} was lost"),
                    StopCause::Interrupted => "interrupted".to_string(),
                    StopCause::ProfileFailed {
                        host,
                        exit_code,
                        out_of_memory,
                    } => {
                        let code = exit_code.map_or("no exit code".to_string(), |c| format!("exit code {c}"));
                        return err(format!(
                            "driver: profiling the model on {host} failed with {code}{}{}; no rank was started",
                            memory_note(*out_of_memory),
                            command_note(*exit_code)
                        ));
                    }
                    StopCause::PlanFailed { reason } => {
                        return err(format!("driver: cannot plan the stages: {reason}; no rank was started"))
                    }
                    // The run's error says it, with its causes, as the driver exits.
                    StopCause::LaunchFailed { .. } => return None,
                    StopCause::SlurmJob { job_id, reason, .. } => {
                        return err(format!("driver: {} {reason}; stopping every rank", slurm_job(*job_id)))
                    }
                };
                err(format!("driver: {why}; stopping every rank"))
            }
            Event::Profiling {
                model,
                host,
                device,
                batch_size,
            } => normal.then(|| {
                (
                    Stream::Stderr,
                    format!("driver: profiling {model} at batch {batch_size} on {host} ({device}) to plan the stages"),
                )
            }),
            Event::ProfileLine { host, line } => normal.then(|| (Stream::Stderr, format!("[{host} profile] {line}"))),
            Event::Planned(facts) => normal.then(|| {
                let mut text = format!("driver: planned from the profile of {}:\n", facts.profiled_on);
                for line in facts.table.lines() {
                    text.push_str("  ");
                    text.push_str(line);
                    text.push('\n');
                }
                (Stream::Stderr, text.trim_end().to_string())
            }),
            Event::Slurm(slurm) => match slurm {
                SlurmEvent::Queued { job_id } => normal.then(|| {
                    (
                        Stream::Stderr,
                        format!("driver: Slurm job {job_id} is queued, waiting for resources"),
                    )
                }),
                SlurmEvent::Started(job) => normal.then(|| {
                    (
                        Stream::Stderr,
                        format!("driver: Slurm job {} started on {}", job.job_id, job.nodes.join(", ")),
                    )
                }),
                SlurmEvent::Line { line, important } => {
                    ((*important && normal) || verbose).then(|| (Stream::Stderr, line.clone()))
                }
                // The stop it causes says why.
                SlurmEvent::Stopped { .. } => None,
            },
            Event::Restarting {
                restart,
                max,
                resume_from,
                ..
            } => {
                self.stopping = false;
                let from = match resume_from {
                    Some(done) => format!("from their checkpoints of {done} iterations done"),
                    None => "as they first started (no checkpoint was written in this run)".to_string(),
                };
                err(format!("driver: starting every rank again, {from}; restart {restart} of {max}"))
            }
            Event::NotRestarted { why } => err(format!("driver: no restart: {why}")),
            Event::StoppingNow(StopNow::InterruptedAgain) => err(
                "driver: interrupted again: stopping every rank now, without waiting for their \
                 checkpoints (the last one written stays)"
                    .to_string(),
            ),
            Event::StoppingNow(StopNow::HostLost { host }) => err(format!(
                "driver: {host} was lost while the ranks write their checkpoints, and a checkpoint \
                 needs every rank: stopping every rank now, without waiting for theirs (the last \
                 checkpoint every rank wrote stays)"
            )),
            Event::TracesGathered(facts) => {
                let mut lines = Vec::new();
                if normal && !facts.ranks.is_empty() {
                    let ranks: Vec<String> = facts.ranks.iter().map(|r| format!("rank-{r}.json")).collect();
                    lines.push(format!(
                        "driver: profiler traces {} in {} (open one in ui.perfetto.dev, or tabulate \
                         them per step with bench/trace_table.py)",
                        ranks.join(", "),
                        facts.dir.display()
                    ));
                }
                // Said at any verbosity (the run was asked for them), once per reason.
                let mut by_reason: Vec<(&str, Vec<String>)> = Vec::new();
                for missing in &facts.missing {
                    let rank = missing.rank.to_string();
                    match by_reason.iter_mut().find(|(reason, _)| *reason == missing.reason) {
                        Some((_, ranks)) => ranks.push(rank),
                        None => by_reason.push((&missing.reason, vec![rank])),
                    }
                }
                for (reason, ranks) in by_reason {
                    let which = match ranks.len() {
                        1 => format!("rank {}", ranks[0]),
                        _ => format!("ranks {}", ranks.join(", ")),
                    };
                    lines.push(format!("driver: warning: no profiler trace from {which}: {reason}"));
                }
                (!lines.is_empty()).then(|| (Stream::Stderr, lines.join("\n")))
            }
            Event::Finished { .. } => None,
        }
    }
}

impl Reporter for TerminalReporter {
    fn report(&mut self, event: &Event) -> Result<(), RecordError> {
        match self.render(event) {
            Some((Stream::Stdout, text)) => self.bar.suspend(|| stdout_line!("{text}")),
            Some((Stream::Stderr, text)) => self.bar.suspend(|| stderr_line!("{text}")),
            None => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{HostFacts, Status};

    fn events() -> Vec<Event> {
        let start = r#"{"event":"iteration","iteration":0,"rank":1,"stage":0,"loss":null,"samples":8,"time_s":0.1,"samples_per_sec":80.0,"compute_s":0.1,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null}"#;
        vec![
            Event::HostReady(HostFacts {
                host: "node1".into(),
                docker_version: Some("20.10.24".into()),
                gpus: vec![],
                image_id: Some("sha256:abc".into()),
                image: Some("stagehand-local:0123".into()),
                image_built: true,
                image_received_from: None,
                image_seconds: 1.0,
                copied_in: vec!["/opt/runtime".into()],
                infiniband: false,
            }),
            Event::Profiling {
                model: "mlp".into(),
                host: "node1".into(),
                device: "cuda:0".into(),
                batch_size: 16,
            },
            Event::ProfileLine {
                host: "node1".into(),
                line: "runtime: warning: slow GPU".into(),
            },
            Event::Planned(crate::events::PlanFacts {
                model: "mlp".into(),
                profiled_on: "node1 (cuda:0)".into(),
                microbatches: 4,
                micro_batch_size: 16,
                stage_starts: vec![0, 3],
                replicas: vec![1, 1],
                predicted_time_per_iteration_s: 0.05,
                data_parallel_time_s: None,
                table: "stage 0: modules 0..3\nstage 1: modules 3..6\n".into(),
            }),
            Event::RankStarted {
                rank: 0,
                host: "localhost".into(),
                handle: "pid 42".into(),
            },
            Event::RankStarted {
                rank: 1,
                host: "node1".into(),
                handle: "3c2b7efebcf9".into(),
            },
            Event::LineLogged {
                rank: 0,
                stream: Stream::Stderr,
                line: "runtime: training mlp".into(),
            },
            Event::Metrics {
                rank: 1,
                line: start.into(),
                event: Box::new(stagehand_contract::Event::parse_line(start).unwrap()),
            },
            Event::RankExited {
                rank: 0,
                exit_code: Some(0),
                out_of_memory: false,
            },
            Event::HostLost {
                host: "node1".into(),
                reason: "connection reset".into(),
            },
            Event::HostLost {
                host: "node1".into(),
                reason: "connection reset again".into(),
            },
            Event::Stopping(StopCause::HostLost {
                host: "node1".into(),
                reason: "connection reset".into(),
            }),
            Event::RankExited {
                rank: 1,
                exit_code: None,
                out_of_memory: false,
            },
            Event::RankExited {
                rank: 1,
                exit_code: Some(137),
                out_of_memory: true,
            },
            Event::RankExited {
                rank: 0,
                exit_code: Some(127),
                out_of_memory: false,
            },
            Event::Stopping(StopCause::RankFailed {
                rank: 1,
                host: "node1".into(),
                exit_code: Some(137),
                out_of_memory: true,
                silent_peer: None,
            }),
            Event::Stopping(StopCause::Interrupted),
            Event::StoppingNow(StopNow::HostLost { host: "node1".into() }),
            Event::StoppingNow(StopNow::InterruptedAgain),
            Event::Stopping(StopCause::ProfileFailed {
                host: "node1".into(),
                exit_code: Some(2),
                out_of_memory: false,
            }),
            Event::Stopping(StopCause::PlanFailed {
                reason: "does not fit in memory".into(),
            }),
            Event::TracesGathered(crate::events::TracesFacts {
                dir: "experiments/20261127T000000Z_mlp/traces".into(),
                ranks: vec![0, 4],
                missing: ["the rank wrote none", "cannot copy it", "the rank wrote none"]
                    .iter()
                    .enumerate()
                    .map(|(i, reason)| crate::events::MissingTrace {
                        rank: i + 1,
                        reason: reason.to_string(),
                    })
                    .collect(),
            }),
            Event::Finished {
                status: Status::Failed,
            },
        ]
    }

    fn transcript(verbosity: Verbosity) -> String {
        let hosts = BTreeMap::from([(0, "localhost".to_string()), (1, "node1".to_string())]);
        let mut r = TerminalReporter::new(verbosity, ProgressBar::hidden(), hosts);
        events()
            .iter()
            .filter_map(|e| r.render(e))
            .map(|(stream, text)| format!("{}: {text}", if stream == Stream::Stdout { "out" } else { "err" }))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// An iteration's metrics line from `rank`, with a loss and accuracies when it is the last
    /// stage's.
    fn iteration(rank: usize, i: u64, loss: Option<f64>) -> Event {
        let (accuracy, top5) = if loss.is_some() {
            ("0.625", "0.875")
        } else {
            ("null", "null")
        };
        let loss = loss.map_or("null".to_string(), |l| l.to_string());
        let line = format!(
            r#"{{"event":"iteration","iteration":{i},"rank":{rank},"stage":{rank},"loss":{loss},"accuracy":{accuracy},"accuracy_top5":{top5},"lr":0.01,"samples":8,"time_s":0.1,"samples_per_sec":80.0,"compute_s":0.1,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null}}"#
        );
        metrics(rank, line)
    }

    /// `line` from `rank`, as the driver hands it to reporters.
    fn metrics(rank: usize, line: String) -> Event {
        let event = stagehand_contract::Event::parse_line(&line).unwrap();
        Event::Metrics {
            rank,
            line,
            event: Box::new(event),
        }
    }

    #[test]
    fn print_and_verbose_frequency_show_every_nth_iteration() {
        let hosts = BTreeMap::from([(0, "a".to_string()), (1, "b".to_string()), (2, "c".to_string())]);
        let intervals = Intervals {
            print_every: Some(2),
            verbose_every: Some(4),
        };
        let mut r = TerminalReporter::new(Verbosity::Normal, ProgressBar::hidden(), hosts.clone())
            .with_intervals(intervals);
        let mut shown = Vec::new();
        for i in 0..4 {
            // Rank 0 runs stage 0 (no loss); ranks 1 and 2 are the last stage's replicas.
            for (rank, loss) in [(0, None), (1, Some(2.5 - i as f64 * 0.5)), (2, Some(2.0))] {
                shown.extend(r.render(&iteration(rank, i, loss)).map(|(_, text)| text));
            }
        }
        // Iteration 2 ends a print interval: the first last-stage rank's line. Iteration 4 ends
        // a verbose one as well: every rank's metrics line, which has the loss too.
        assert_eq!(
            shown[0],
            "[b r1] iteration 2: loss 2.0000, accuracy 62.5% (top-5 87.5%), 80.0 samples/s, lr 1.000e-2"
        );
        assert_eq!(shown.len(), 4, "{shown:#?}");
        for (line, rank) in shown[1..].iter().zip(["[a r0]", "[b r1]", "[c r2]"]) {
            assert!(
                line.starts_with(rank) && line.contains(r#""iteration":3"#),
                "{shown:#?}"
            );
        }
        // Quiet shows none of them; with no intervals, normal shows none either.
        let mut quiet = TerminalReporter::new(Verbosity::Quiet, ProgressBar::hidden(), hosts.clone())
            .with_intervals(intervals);
        let mut plain = TerminalReporter::new(Verbosity::Normal, ProgressBar::hidden(), hosts);
        for i in 0..4 {
            assert_eq!(quiet.render(&iteration(1, i, Some(1.0))), None);
            assert_eq!(plain.render(&iteration(1, i, Some(1.0))), None);
        }
    }

    /// An fp16 iteration's line, its scaler's figures put into [`iteration`]'s.
    fn fp16_iteration(rank: usize, i: u64, scale: f64, skipped: bool) -> Event {
        let Event::Metrics { line, .. } = iteration(rank, i, Some(2.0)) else {
            unreachable!()
        };
        let line = line.replace(
            r#""peak_mem_bytes":null"#,
            &format!(r#""peak_mem_bytes":null,"loss_scale":{scale},"step_skipped":{skipped}"#),
        );
        metrics(rank, line)
    }

    #[test]
    fn an_fp16_step_skipped_shows_between_print_intervals_with_the_loss_scale() {
        let hosts = BTreeMap::from([(0, "a".to_string())]);
        let intervals = Intervals {
            print_every: Some(4),
            verbose_every: None,
        };
        let mut r = TerminalReporter::new(Verbosity::Normal, ProgressBar::hidden(), hosts.clone())
            .with_intervals(intervals);
        let shown: Vec<String> = [
            (0, 65536.0, false),
            (1, 32768.0, true),
            (2, 32768.0, false),
            (3, 32768.0, false),
        ]
        .into_iter()
        .filter_map(|(i, scale, skipped)| r.render(&fp16_iteration(0, i, scale, skipped)))
        .map(|(_, text)| text)
        .collect();
        assert_eq!(
            shown,
            [
                "[a r0] iteration 2: loss 2.0000, accuracy 62.5% (top-5 87.5%), 80.0 samples/s, lr 1.000e-2, loss scale 32768 (step skipped: fp16 gradients held an inf or a nan)",
                "[a r0] iteration 4: loss 2.0000, accuracy 62.5% (top-5 87.5%), 80.0 samples/s, lr 1.000e-2, loss scale 32768",
            ]
        );
        let mut quiet = TerminalReporter::new(Verbosity::Quiet, ProgressBar::hidden(), hosts);
        assert_eq!(quiet.render(&fp16_iteration(0, 1, 32768.0, true)), None);
    }

    #[test]
    fn each_verbosity_shows_what_it_promises() {
        insta::assert_snapshot!("quiet", transcript(Verbosity::Quiet));
        insta::assert_snapshot!("normal", transcript(Verbosity::Normal));
        insta::assert_snapshot!("verbose", transcript(Verbosity::Verbose));
    }
}
