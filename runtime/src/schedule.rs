//! Pipeline schedules as per-rank action lists.
//!
//! Every rank derives the lists of *all* ranks by simulating the whole pipeline in unit time
//! steps under the schedule's policy, then runs its own list in order. Since the simulation ran
//! every list to completion respecting each action's inputs, running them for real with blocking
//! receives cannot deadlock; a plan that could is rejected before any process talks to another.
//!
//! Microbatches are numbered globally (`0..iterations * microbatches` for PipeDream, which never
//! flushes; `0..microbatches` per iteration for GPipe and 1F1B). At stage `s` with replica ranks
//! `R_s`, microbatch `g` runs on replica `g % |R_s|` (PipeDream's round-robin).

use std::collections::{btree_map, BTreeMap};
use std::fmt;

use stagehand_contract::StagePlan;

/// `--schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// All forwards, then all backwards, then one optimizer step (a flush every iteration).
    GPipe,
    /// Warm-up forwards, then one forward one backward, then a flush: GPipe's update with
    /// bounded activation memory.
    OneFOneB,
    /// PipeDream's asynchronous 1F1B: no flush; each stage steps after every backward, and a
    /// microbatch's backward uses the weights its forward used (weight stashing).
    PipeDream,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::PipeDream => "pipedream",
        })
    }
}

/// One thing a rank does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Forward of microbatch `g` through this rank's stage.
    Forward(usize),
    /// Backward of microbatch `g`.
    Backward(usize),
    /// All-reduce gradients among the stage's replicas (if any), then apply the optimizer.
    Step,
}

impl Action {
    /// The same action on the microbatch `by` further on (a later iteration's, or a later
    /// segment's, of a list derived from microbatch 0).
    pub fn shifted(self, by: usize) -> Action {
        match self {
            Action::Forward(g) => Action::Forward(g + by),
            Action::Backward(g) => Action::Backward(g + by),
            Action::Step => Action::Step,
        }
    }
}

/// A plan that cannot be scheduled; the message says what to change.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScheduleError {
    #[error(
        "stage {stage} has {replicas} replicas but there are only {microbatches} microbatches per iteration; \
         use --microbatches {replicas} or more so every replica has work"
    )]
    TooFewMicrobatches {
        stage: usize,
        replicas: usize,
        microbatches: usize,
    },
    #[error(
        "pipedream needs --microbatches to be a multiple of every stage's replica count \
         (stage {stage} has {replicas}), so replicas step together"
    )]
    UnevenReplicas { stage: usize, replicas: usize },
    #[error("stage_to_depth_map gives stage {stage} depth 0; depths must be at least 1")]
    ZeroDepth { stage: usize },
    #[error("internal error: the {schedule} schedule deadlocks on this plan at step {step}")]
    Deadlock { schedule: Schedule, step: usize },
}

/// The action lists of every rank, in the order each rank runs them.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Global microbatches the lists cover.
    pub microbatches: usize,
    /// For each rank, its actions.
    pub actions: Vec<Vec<Action>>,
}

/// How many microbatches a stage admits before its first backward: the config's depth, else the
/// number of stages from here to the end (the classic 1F1B warm-up plus one).
pub fn depth(plan: &StagePlan, stage: usize) -> usize {
    plan.stages[stage].depth.unwrap_or(plan.stages.len() - stage)
}

/// The replica rank that runs microbatch `g` at `stage`.
pub fn rank_for(plan: &StagePlan, stage: usize, g: usize) -> usize {
    let ranks = &plan.stages[stage].ranks;
    ranks[g % ranks.len()]
}

/// Checks that `schedule` can run `plan` with `microbatches` per iteration.
pub fn validate(plan: &StagePlan, schedule: Schedule, microbatches: usize) -> Result<(), ScheduleError> {
    for stage in &plan.stages {
        let replicas = stage.ranks.len();
        if microbatches < replicas {
            return Err(ScheduleError::TooFewMicrobatches {
                stage: stage.id,
                replicas,
                microbatches,
            });
        }
        if schedule == Schedule::PipeDream && !microbatches.is_multiple_of(replicas) {
            return Err(ScheduleError::UnevenReplicas {
                stage: stage.id,
                replicas,
            });
        }
        if stage.depth == Some(0) {
            return Err(ScheduleError::ZeroDepth { stage: stage.id });
        }
    }
    Ok(())
}

/// Iterations a chunk of GPipe's or 1F1B's actions spans ([`RankActions`]).
pub const CHUNK_ITERATIONS: usize = 64;

/// One rank's actions over a run, handed out a chunk at a time, each chunk drained (every
/// microbatch it starts ends in it, and it ends with a step), so that what a rank holds of its
/// schedule is bounded by a chunk and not by the run's length. GPipe and 1F1B flush every
/// iteration, so one iteration's list repeats with microbatch numbers shifted, `chunk`
/// iterations a chunk. PipeDream runs one long stream, or, when it checkpoints, one stream per
/// `segment` iterations (`--checkpoint-every`; the whole run without it), each drained at its
/// end, so that a checkpoint, written only at those ends, holds no microbatch in flight and no
/// stashed weights, and a resumed run replays the same streams: a chunk is a segment.
#[derive(Debug, Clone)]
pub struct RankActions {
    microbatches: usize,
    /// The first iteration of the next chunk.
    next: usize,
    /// One past the run's last iteration.
    end: usize,
    source: Source,
}

#[derive(Debug, Clone)]
enum Source {
    /// One iteration's list, from microbatch 0, and the iterations of a chunk.
    Repeat { one: Vec<Action>, chunk: usize },
    /// The segment's length, and this rank's list for each length of segment the run has (at
    /// most three: a resumed run's first, the whole ones, the last), from microbatch 0, all
    /// derived up front so that a plan a segment cannot run fails before training.
    Segments {
        segment: usize,
        by_length: BTreeMap<usize, Vec<Action>>,
    },
}

impl RankActions {
    /// `rank`'s actions from iteration `first` to `iterations` of `plan` under `schedule`, with
    /// `microbatches` per iteration; `segment` is PipeDream's (the whole run when `None`) and
    /// `chunk` GPipe's and 1F1B's ([`CHUNK_ITERATIONS`] in a run).
    pub fn new(
        plan: &StagePlan,
        schedule: Schedule,
        rank: usize,
        microbatches: usize,
        (first, iterations): (usize, usize),
        segment: Option<usize>,
        chunk: usize,
    ) -> Result<RankActions, ScheduleError> {
        let source = match schedule {
            Schedule::PipeDream => {
                let segment = segment.unwrap_or(iterations).max(1);
                // The first segment, the second (whole, or the last), and the last: every
                // segment between them is whole.
                let last = iterations.saturating_sub(1) / segment * segment;
                let second = segment_end(first, segment, iterations);
                let mut by_length = BTreeMap::new();
                for start in [first, second, last] {
                    if start < iterations && start >= first {
                        let length = segment_end(start, segment, iterations) - start;
                        if let btree_map::Entry::Vacant(slot) = by_length.entry(length) {
                            let timeline = timeline(plan, schedule, microbatches * length)?;
                            slot.insert(timeline.actions[rank].clone());
                        }
                    }
                }
                Source::Segments { segment, by_length }
            }
            Schedule::GPipe | Schedule::OneFOneB => Source::Repeat {
                one: timeline(plan, schedule, microbatches)?.actions[rank].clone(),
                chunk: chunk.max(1),
            },
        };
        Ok(RankActions {
            microbatches,
            next: first.min(iterations),
            end: iterations,
            source,
        })
    }
}

/// Where the segment holding iteration `start` ends: at the next multiple of `segment`, or the
/// run's end.
fn segment_end(start: usize, segment: usize, iterations: usize) -> usize {
    ((start / segment + 1) * segment).min(iterations)
}

impl Iterator for RankActions {
    type Item = Vec<Action>;

    /// The next chunk, microbatches numbered globally.
    fn next(&mut self) -> Option<Vec<Action>> {
        if self.next >= self.end {
            return None;
        }
        let start = self.next;
        let m = self.microbatches;
        let chunk = match &self.source {
            Source::Repeat { one, chunk } => {
                self.next = (start + chunk).min(self.end);
                (start..self.next)
                    .flat_map(|it| one.iter().map(move |a| a.shifted(it * m)))
                    .collect()
            }
            Source::Segments { segment, by_length } => {
                self.next = segment_end(start, *segment, self.end);
                let list = &by_length[&(self.next - start)];
                list.iter().map(|a| a.shifted(start * m)).collect()
            }
        };
        Some(chunk)
    }
}

/// Per-rank state during the simulation.
struct RankSim {
    stage: usize,
    /// This rank's microbatches, in order.
    mine: Vec<usize>,
    forwards: usize,
    backwards: usize,
    /// Steps taken (PipeDream steps after each backward).
    steps: usize,
    /// A step is owed after the last backward (PipeDream).
    step_due: bool,
    actions: Vec<Action>,
}

/// Simulates `schedule` over `microbatches` global microbatches and returns every rank's list.
/// GPipe and 1F1B lists end with one `Step`; PipeDream lists have a `Step` after every backward.
pub fn timeline(
    plan: &StagePlan,
    schedule: Schedule,
    microbatches: usize,
) -> Result<Timeline, ScheduleError> {
    let stages = plan.stages.len();
    let mut sims: Vec<RankSim> = (0..plan.world_size)
        .map(|rank| {
            let stage = plan.stage_of_rank(rank).id;
            let mine = (0..microbatches)
                .filter(|&g| rank_for(plan, stage, g) == rank)
                .collect();
            RankSim {
                stage,
                mine,
                forwards: 0,
                backwards: 0,
                steps: 0,
                step_due: false,
                actions: Vec::new(),
            }
        })
        .collect();
    // Completion time of each (stage, microbatch) forward and backward.
    let mut fwd_done: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let mut bwd_done: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let done = |sims: &[RankSim]| sims.iter().all(|r| r.backwards == r.mine.len() && !r.step_due);

    let mut time = 0usize;
    while !done(&sims) {
        let mut progressed = false;
        // Ranks owing a PipeDream step wait until every replica of their stage owes the same step.
        let mut step_ready: BTreeMap<(usize, usize), bool> = BTreeMap::new();
        for r in &sims {
            let entry = step_ready.entry((r.stage, r.steps)).or_insert(true);
            *entry &= r.step_due;
        }
        let mut finished = Vec::new();
        for r in sims.iter_mut() {
            let s = r.stage;
            if r.step_due {
                if step_ready[&(s, r.steps)] {
                    r.actions.push(Action::Step);
                    r.steps += 1;
                    r.step_due = false;
                    progressed = true;
                }
                continue;
            }
            let next_fwd = r.mine.get(r.forwards).copied();
            let next_bwd = r
                .mine
                .get(r.backwards)
                .copied()
                .filter(|_| r.backwards < r.forwards);
            let fwd_ready =
                next_fwd.filter(|&g| s == 0 || fwd_done.get(&(s - 1, g)).is_some_and(|&t| t < time));
            let bwd_ready = next_bwd.filter(|&g| {
                let own = fwd_done.get(&(s, g)).is_some_and(|&t| t < time);
                own && (s + 1 == stages || bwd_done.get(&(s + 1, g)).is_some_and(|&t| t < time))
            });
            let in_flight = r.forwards - r.backwards;
            let choice = match schedule {
                Schedule::GPipe => {
                    if next_fwd.is_some() {
                        fwd_ready.map(Action::Forward)
                    } else {
                        bwd_ready.map(Action::Backward)
                    }
                }
                Schedule::OneFOneB | Schedule::PipeDream => {
                    let may_forward = in_flight < depth(plan, s);
                    match (fwd_ready.filter(|_| may_forward), bwd_ready) {
                        (Some(g), _) if in_flight == 0 || bwd_ready.is_none() => Some(Action::Forward(g)),
                        (_, Some(g)) => Some(Action::Backward(g)),
                        (f, None) => f.map(Action::Forward),
                    }
                }
            };
            match choice {
                Some(Action::Forward(g)) => {
                    r.forwards += 1;
                    finished.push((true, s, g));
                }
                Some(Action::Backward(g)) => {
                    r.backwards += 1;
                    r.step_due = schedule == Schedule::PipeDream;
                    finished.push((false, s, g));
                }
                Some(Action::Step) | None => continue,
            }
            r.actions.push(choice.expect("matched above"));
            progressed = true;
        }
        for (forward, s, g) in finished {
            if forward {
                fwd_done.insert((s, g), time);
            } else {
                bwd_done.insert((s, g), time);
            }
        }
        if !progressed {
            return Err(ScheduleError::Deadlock { schedule, step: time });
        }
        time += 1;
    }
    if schedule != Schedule::PipeDream {
        for r in &mut sims {
            r.actions.push(Action::Step);
        }
    }
    Ok(Timeline {
        microbatches,
        actions: sims.into_iter().map(|r| r.actions).collect(),
    })
}

#[cfg(test)]
pub(crate) mod tests;
