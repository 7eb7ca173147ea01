//! Starting the ranks again after a failure (`max_restarts`, as torchrun's `--max-restarts`):
//! which failures are worth another start, and where the next start begins. A run in which every
//! rank wrote a checkpoint resumes (`--resume=auto`) from the newest iteration every rank holds
//! one of, which the ranks agree on among themselves too (a rank stopped while checkpointing is
//! one behind the others, who keep the one before their latest); a run in which some rank wrote
//! none starts as it first did, with the experiment's own `resume:` setting, so a checkpoint left
//! in the folder by an earlier run is never taken for this one's (a run started afresh sets those
//! aside).

use std::collections::BTreeMap;

use crate::events::{Event, StopCause};

/// The runtime's exit code for a request it refuses: the same refusal would end every start.
const REFUSED: i64 = stagehand_contract::exit_codes::REFUSED as i64;

/// How far the ranks said they got in this run, over every start of the ranks: the checkpoints
/// each wrote whole (`checkpointed` on its iteration lines, printed only once the checkpoint is on
/// disk) and the iterations each finished.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The most iterations done of a checkpoint each rank said it wrote.
    checkpointed: BTreeMap<usize, u64>,
    /// The most iterations done each rank reported.
    furthest: BTreeMap<usize, u64>,
}

impl Progress {
    /// Takes in what `event` says of the ranks' progress, if anything.
    pub fn saw(&mut self, event: &Event) {
        if let Event::Metrics { event, .. } = event {
            if let stagehand_contract::Event::Iteration(it) = event.as_ref() {
                let done = it.iteration + 1;
                let most = |map: &mut BTreeMap<usize, u64>| {
                    let most = map.entry(it.rank).or_default();
                    *most = (*most).max(done);
                };
                most(&mut self.furthest);
                if it.checkpointed {
                    most(&mut self.checkpointed);
                }
            }
        }
    }

    /// The iterations done of the checkpoint the runtime's `world_size` ranks resume from, as
    /// they agree on it: the newest every rank holds, which is the oldest of the ranks' latest
    /// (each keeps the one before its latest, and a rank is at most one checkpoint behind the
    /// others). `None` while some rank has written none in this run: they start as first started.
    pub fn resume_from(&self, world_size: usize) -> Option<u64> {
        (self.checkpointed.len() == world_size)
            .then(|| self.checkpointed.values().copied().min())
            .flatten()
    }

    /// The most iterations `rank` finished in this run (0 before it finished one).
    pub fn furthest(&self, rank: usize) -> u64 {
        self.furthest.get(&rank).copied().unwrap_or(0)
    }

    /// Whether any rank reported an iteration in this run.
    pub fn reported(&self) -> bool {
        !self.furthest.is_empty()
    }
}

/// A rank's failure the ranks were started again after, as [`decide`] compares the next with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub cause: StopCause,
    /// [`Progress::furthest`] of the rank that failed, when it failed; `None` where progress is
    /// not measured (a `command:` that prints no iteration lines), so a failure that looks the
    /// same is not taken for one at the same place.
    pub furthest: Option<u64>,
}

impl Failure {
    /// The failure `cause`, with how far its rank had got; `measured`: whether the ranks report
    /// their iterations (they run the runtime, or some rank reported one).
    pub fn new(cause: &StopCause, progress: &Progress, measured: bool) -> Failure {
        let furthest = match cause {
            StopCause::RankFailed { rank, .. } => progress.furthest(*rank),
            _ => 0,
        };
        let furthest = (measured || progress.reported()).then_some(furthest);
        Failure {
            cause: cause.clone(),
            furthest,
        }
    }
}

/// What the driver does after the ranks failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Start the ranks again; `resume_from` the iterations done of the checkpoint the ranks
    /// resume from ([`Progress::resume_from`]), `None` when they start as they first did.
    Restart { resume_from: Option<u64> },
    /// End the run; `why` says why a run allowed restarts does not get one (`None` when
    /// restarts were not asked for, or it was interrupted).
    Stop { why: Option<String> },
}

/// Whether the `world_size` ranks stopped for `cause` start again, after `done` restarts of at
/// most `max`, the last of them after `previous`. A rank that fails as it did before (the same
/// rank, exit code and kill for memory) having got no further than then fails where it will fail
/// again: a deterministic failure (a bug, a batch too large for the memory) uses one restart, not
/// all.
pub fn decide(
    cause: &StopCause,
    (done, max): (u32, u32),
    world_size: usize,
    progress: &Progress,
    previous: Option<&Failure>,
) -> Decision {
    let not = |why: String| Decision::Stop { why: Some(why) };
    if max == 0 {
        return Decision::Stop { why: None };
    }
    match cause {
        StopCause::Interrupted => Decision::Stop { why: None },
        _ if done >= max => not(format!(
            "the {max} restart(s) allowed (max_restarts: {max}) are used up; raise max_restarts, or \
             --max-restarts, for more"
        )),
        StopCause::RankFailed {
            exit_code: Some(REFUSED),
            ..
        } => not("the rank refused its request (exit code 2), which it would refuse again".into()),
        StopCause::RankFailed { rank, host, .. }
            if previous.is_some_and(|p| {
                p.cause == *cause && p.furthest.is_some_and(|f| f >= progress.furthest(*rank))
            }) =>
        {
            not(format!(
                "rank {rank} on {host} failed as it did before the last restart, having got no \
                 further ({} iteration(s) done): another start would fail the same way",
                progress.furthest(*rank)
            ))
        }
        StopCause::SlurmJob {
            never_started: true,
            reason,
            ..
        } => not(format!(
            "the Slurm job never started ({reason}): another submission would wait or be refused \
             the same way"
        )),
        StopCause::RankFailed { .. } | StopCause::HostLost { .. } | StopCause::SlurmJob { .. } => {
            Decision::Restart {
                resume_from: progress.resume_from(world_size),
            }
        }
        StopCause::ProfileFailed { .. } | StopCause::PlanFailed { .. } | StopCause::LaunchFailed { .. } => {
            not("the ranks never started".into())
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
            silent_peer: None,
        }
    }

    /// The ranks resume from the newest checkpoint every one of them holds: the oldest of their
    /// latest (a rank killed while writing one is a checkpoint behind), and none while a rank has
    /// written none.
    #[test]
    fn the_ranks_resume_from_the_oldest_of_their_latest_checkpoints() {
        let mut seen = Progress::default();
        for event in [iteration(0, 0, false), iteration(1, 0, false)] {
            seen.saw(&event);
        }
        assert_eq!(seen.resume_from(2), None, "no line said checkpointed");
        seen.saw(&iteration(0, 3, true));
        assert_eq!(seen.resume_from(2), None, "rank 1 holds none");
        assert_eq!(seen.resume_from(1), Some(4), "alone, rank 0 resumes its own");
        for event in [iteration(1, 3, true), iteration(0, 7, true)] {
            seen.saw(&event);
        }
        assert_eq!(seen.resume_from(2), Some(4), "rank 1 was killed writing 8");
        seen.saw(&iteration(1, 7, true));
        assert_eq!(seen.resume_from(2), Some(8));
        // A later start that resumed from an earlier checkpoint does not move it back.
        seen.saw(&iteration(1, 3, true));
        assert_eq!(seen.resume_from(2), Some(8));
    }

    #[test]
    fn a_failed_rank_restarts_from_the_latest_checkpoint_or_as_first_started() {
        let mut seen = Progress::default();
        let restart = |seen: &Progress| decide(&failed(Some(137)), (0, 1), 2, seen, None);
        assert_eq!(restart(&seen), Decision::Restart { resume_from: None });
        seen.saw(&iteration(0, 3, true));
        seen.saw(&iteration(1, 3, true));
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
                never_started: false,
            },
        ] {
            assert!(
                matches!(decide(&cause, (0, 1), 2, &seen, None), Decision::Restart { .. }),
                "{cause:?}"
            );
        }
    }

    #[test]
    fn restarts_stop_when_used_up_interrupted_or_refused() {
        let seen = Progress::default();
        assert_eq!(
            decide(&failed(Some(1)), (0, 0), 2, &seen, None),
            Decision::Stop { why: None }
        );
        // Used up, the run says so, and how to allow more.
        let Decision::Stop { why: Some(why) } = decide(&failed(Some(1)), (2, 2), 2, &seen, None) else {
            panic!("two restarts of two allowed are used up");
        };
        assert!(why.contains("(max_restarts: 2) are used up"), "{why}");
        assert!(why.contains("--max-restarts"), "{why}");
        assert_eq!(
            decide(&StopCause::Interrupted, (0, 3), 2, &seen, None),
            Decision::Stop { why: None }
        );
        let Decision::Stop { why: Some(why) } = decide(&failed(Some(2)), (0, 3), 2, &seen, None) else {
            panic!("a refusal is not restarted");
        };
        assert!(why.contains("exit code 2"), "{why}");
        // A Slurm job that never got its nodes (refused, or queued past start_timeout_s) would
        // wait at the back of the queue, or be refused, again.
        let queued = StopCause::SlurmJob {
            job_id: Some(7),
            reason: "did not start: still PENDING (reason: Resources) after 60 s".into(),
            never_started: true,
        };
        let Decision::Stop { why: Some(why) } = decide(&queued, (0, 3), 2, &seen, None) else {
            panic!("a job that never started is not submitted again");
        };
        assert!(
            why.contains("never started (did not start: still PENDING"),
            "{why}"
        );
    }

    #[test]
    fn the_same_failure_with_no_progress_since_is_not_restarted_again() {
        let mut seen = Progress::default();
        seen.saw(&iteration(1, 4, false));
        let before = Failure::new(&failed(Some(1)), &seen, false);
        assert_eq!(before.furthest, Some(5));
        // Started again from the beginning, it failed as before, at the same place; another rank
        // getting further does not count.
        seen.saw(&iteration(1, 2, false));
        seen.saw(&iteration(0, 7, false));
        let Decision::Stop { why: Some(why) } = decide(&failed(Some(1)), (1, 3), 2, &seen, Some(&before))
        else {
            panic!("the same failure, no further: not restarted");
        };
        assert!(why.contains("rank 1 on localhost failed as it did"), "{why}");
        assert!(why.contains("(5 iteration(s) done)"), "{why}");
        // Another exit code, or the same one further on, is worth another start.
        assert!(matches!(
            decide(&failed(Some(137)), (1, 3), 2, &seen, Some(&before)),
            Decision::Restart { .. }
        ));
        seen.saw(&iteration(1, 5, false));
        assert!(matches!(
            decide(&failed(Some(1)), (1, 3), 2, &seen, Some(&before)),
            Decision::Restart { .. }
        ));
        // A host lost twice is not a rank's failure: it may be back for good.
        let lost = StopCause::HostLost {
            host: "th1".into(),
            reason: "gone".into(),
        };
        let before = Failure::new(&lost, &seen, false);
        assert!(matches!(
            decide(&lost, (1, 3), 2, &seen, Some(&before)),
            Decision::Restart { .. }
        ));
    }

    /// A `command:` that prints no iteration lines says nothing of how far it got: failing the
    /// same way again is no sign it fails at the same place, so it gets every restart allowed.
    /// The runtime's ranks are measured from their start, so one failing before its first
    /// iteration twice is not started a third time.
    #[test]
    fn a_failure_repeated_where_progress_is_not_measured_is_restarted_as_allowed() {
        let silent = Progress::default();
        let before = Failure::new(&failed(Some(3)), &silent, false);
        assert_eq!(before.furthest, None);
        assert!(matches!(
            decide(&failed(Some(3)), (1, 3), 2, &silent, Some(&before)),
            Decision::Restart { .. }
        ));
        let before = Failure::new(&failed(Some(3)), &silent, true);
        assert_eq!(before.furthest, Some(0));
        assert!(matches!(
            decide(&failed(Some(3)), (1, 3), 2, &silent, Some(&before)),
            Decision::Stop { why: Some(_) }
        ));
    }
}
