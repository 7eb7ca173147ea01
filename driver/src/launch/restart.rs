//! Starting the ranks again after a failure (`max_restarts`, as torchrun's `--max-restarts`):
//! which failures are worth another start, and where the next start begins. A run that wrote a
//! checkpoint resumes from the ranks' latest (`--resume`: every rank's must be there, of one
//! iteration, which the runtime checks); a run that wrote none starts as it first did, with the
//! experiment's own `resume:` setting, so a checkpoint left in the folder by an earlier run is
//! never taken for this one's.

use crate::events::{Event, StopCause};

/// The runtime's exit code for a request it refuses (arguments, a plan that cannot run): the same
/// refusal would end every start.
const REFUSED: i64 = 2;

/// The checkpoints the ranks said they wrote whole in this run (`checkpointed` on their iteration
/// lines, printed only once the checkpoint is on disk), over every start of the ranks.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Checkpoints {
    /// The most iterations done of any checkpoint a rank said it wrote.
    latest: Option<u64>,
}

impl Checkpoints {
    /// Takes in what `event` says of a checkpoint, if anything.
    pub fn saw(&mut self, event: &Event) {
        if let Event::Metrics { event, .. } = event {
            if let stagehand_contract::Event::Iteration(it) = event.as_ref() {
                if it.checkpointed {
                    self.latest = self.latest.max(Some(it.iteration + 1));
                }
            }
        }
    }

    /// The iterations done of the latest checkpoint a rank wrote in this run, if any did.
    pub fn latest(&self) -> Option<u64> {
        self.latest
    }
}

/// What the driver does after the ranks failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Start the ranks again; `resume_from` the iterations done of the checkpoint the ranks
    /// resume from (the latest the driver saw written; the runtime takes each rank's latest on
    /// disk), `None` when they start as they first did.
    Restart { resume_from: Option<u64> },
    /// End the run; `why` says why a run allowed restarts does not get one (`None` when
    /// restarts were not asked for, or are used up).
    Stop { why: Option<String> },
}

/// Whether ranks stopped for `cause` start again, after `done` restarts of at most `max`.
pub fn decide(cause: &StopCause, done: u32, max: u32, checkpoints: &Checkpoints) -> Decision {
    if done >= max {
        return Decision::Stop { why: None };
    }
    let not = |why: &str| Decision::Stop {
        why: Some(why.to_string()),
    };
    match cause {
        StopCause::RankFailed {
            exit_code: Some(REFUSED),
            ..
        } => not("the rank refused its request (exit code 2), which it would refuse again"),
        StopCause::RankFailed { .. } | StopCause::HostLost { .. } | StopCause::SlurmJob { .. } => {
            Decision::Restart {
                resume_from: checkpoints.latest(),
            }
        }
        StopCause::Interrupted => Decision::Stop { why: None },
        StopCause::ProfileFailed { .. } | StopCause::PlanFailed { .. } | StopCause::LaunchFailed { .. } => {
            not("the ranks never started")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iteration(rank: usize, i: u64, checkpointed: bool) -> Event {
        let mark = if checkpointed {
            r#","checkpointed":true"#
        } else {
            ""
        };
        let line = format!(
            r#"{{"event":"iteration","iteration":{i},"rank":{rank},"stage":0,"loss":null,"samples":8,"time_s":0.1,"samples_per_sec":80.0,"compute_s":0.1,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null{mark}}}"#
        );
        Event::Metrics {
            rank,
            event: Box::new(stagehand_contract::Event::parse_line(&line).unwrap()),
            line,
        }
    }

    fn failed(exit_code: Option<i64>) -> StopCause {
        StopCause::RankFailed {
            rank: 1,
            host: "localhost".into(),
            exit_code,
            out_of_memory: false,
        }
    }

    #[test]
    fn the_latest_checkpoint_is_the_one_written_last_on_any_rank() {
        let mut seen = Checkpoints::default();
        for event in [iteration(0, 0, false), iteration(1, 0, false)] {
            seen.saw(&event);
        }
        assert_eq!(seen.latest(), None, "no line said checkpointed");
        for event in [
            iteration(0, 3, true),
            iteration(1, 3, true),
            iteration(0, 7, true),
        ] {
            seen.saw(&event);
        }
        assert_eq!(seen.latest(), Some(8));
        // A later start that resumed from an earlier checkpoint does not move it back.
        seen.saw(&iteration(1, 3, true));
        assert_eq!(seen.latest(), Some(8));
    }

    #[test]
    fn a_failed_rank_restarts_from_the_latest_checkpoint_or_as_first_started() {
        let mut seen = Checkpoints::default();
        let restart = |seen: &Checkpoints| decide(&failed(Some(137)), 0, 1, seen);
        assert_eq!(restart(&seen), Decision::Restart { resume_from: None });
        seen.saw(&iteration(0, 3, true));
        assert_eq!(restart(&seen), Decision::Restart { resume_from: Some(4) });
        for cause in [
            failed(None),
            StopCause::HostLost {
                host: "th1".into(),
                reason: "gone".into(),
            },
            StopCause::SlurmJob {
                job_id: Some(7),
                reason: "preempted".into(),
            },
        ] {
            assert!(
                matches!(decide(&cause, 0, 1, &seen), Decision::Restart { .. }),
                "{cause:?}"
            );
        }
    }

    #[test]
    fn restarts_stop_when_used_up_interrupted_or_refused() {
        let seen = Checkpoints::default();
        assert_eq!(
            decide(&failed(Some(1)), 0, 0, &seen),
            Decision::Stop { why: None }
        );
        assert_eq!(
            decide(&failed(Some(1)), 2, 2, &seen),
            Decision::Stop { why: None }
        );
        assert_eq!(
            decide(&StopCause::Interrupted, 0, 3, &seen),
            Decision::Stop { why: None }
        );
        let Decision::Stop { why: Some(why) } = decide(&failed(Some(2)), 0, 3, &seen) else {
            panic!("a refusal is not restarted");
        };
        assert!(why.contains("exit code 2"), "{why}");
    }
}
