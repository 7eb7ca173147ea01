//! Pipeline schedules as per-rank action lists.
//!
//! Every rank derives its list by simulating the whole pipeline, every rank of it, in unit time
//! steps under the schedule's policy, then runs its own list in order. Since the simulation runs
//! every list respecting each action's inputs, running them for real with blocking receives
//! cannot deadlock. GPipe and 1F1B simulate one iteration before training and repeat it;
//! PipeDream's stream is simulated as the rank runs it, a chunk ahead ([`RankActions`]), holding
//! only what is in flight. Plans a schedule cannot run are rejected by [`validate`] before any
//! process talks to another; a simulation that finds itself stuck is an internal error.
//!
//! Microbatches are numbered globally (`0..iterations * microbatches` for PipeDream, which never
//! flushes; `0..microbatches` per iteration for GPipe and 1F1B). At stage `s` with replica ranks
//! `R_s`, microbatch `g` runs on replica `g % |R_s|` (PipeDream's round-robin).

use std::collections::{BTreeSet, HashMap, VecDeque};
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

/// Iterations a chunk spans ([`RankActions`]): GPipe's and 1F1B's exactly; a PipeDream chunk
/// holds that many iterations' forwards of the rank (fewer at a segment's end).
pub const CHUNK_ITERATIONS: usize = 64;

/// A stretch of one rank's actions, as the executor runs them.
///
/// A chunk ends right after a forward, or where its stream drains (every microbatch it started
/// ended, and a step came last). So a backward is never parted from the step after it, and
/// the route's program (`Route::program` in the pipeline) run chunk by chunk issues the same
/// operations in the same order as over the whole stream: the receives of the next chunk's
/// first forward, posted as that chunk starts, would have been posted right after this chunk's
/// last forward.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    pub actions: Vec<Action>,
    /// The chunk's forwards whose backward comes after a step of this rank (in this chunk or a
    /// later one): they keep the weights they ran with for their backward (weight stashing).
    pub stashed: BTreeSet<usize>,
}

impl Chunk {
    /// A chunk of a drained list: every microbatch it starts ends in it.
    fn drained(actions: Vec<Action>) -> Chunk {
        let stashed = stashed(&actions);
        Chunk { actions, stashed }
    }
}

/// The forwards of a drained list whose microbatch is open (forward run, backward not yet) at a
/// step.
fn stashed(actions: &[Action]) -> BTreeSet<usize> {
    let mut open = BTreeSet::new();
    let mut stashed = BTreeSet::new();
    for action in actions {
        match action {
            Action::Forward(g) => drop(open.insert(*g)),
            Action::Backward(g) => drop(open.remove(g)),
            Action::Step => stashed.extend(open.iter().copied()),
        }
    }
    stashed
}

/// One rank's actions over a run, handed out a [`Chunk`] at a time as they are derived, so that
/// what a rank holds of its schedule is bounded by a chunk and not by the run's length.
///
/// GPipe and 1F1B flush every iteration, so one iteration's list repeats with microbatch numbers
/// shifted, `chunk` iterations a chunk (and a chunk ends at each multiple of `segment`). PipeDream
/// runs one long stream, or, when it checkpoints or validates, one stream per `segment`
/// iterations (`--checkpoint-every`, `--validate-every`), each drained at its end, so that a
/// checkpoint, written only at those ends, holds no microbatch in flight and no stashed weights,
/// and a resumed run replays the same streams. A stream is simulated as it is handed out and cut
/// into chunks of about `chunk` iterations. Either way a segment's end is a chunk's: nothing of
/// the next iteration is received ahead across it, so a validation pass can run there.
#[derive(Debug, Clone)]
pub struct RankActions {
    microbatches: usize,
    /// The first iteration of the next chunk (or segment).
    next: usize,
    /// One past the run's last iteration.
    end: usize,
    chunk: usize,
    source: Source,
}

#[derive(Debug, Clone)]
enum Source {
    /// One iteration's list, from microbatch 0, and where chunks must end (multiples of it).
    Repeat(Vec<Action>, Option<usize>),
    /// PipeDream's stream of the current segment (none before the first and after the last),
    /// and the segment's length (the whole run when it does not checkpoint).
    Segments {
        plan: StagePlan,
        rank: usize,
        segment: usize,
        stream: Option<Box<Stream>>,
    },
}

impl RankActions {
    /// `rank`'s actions from iteration `first` to `iterations` of `plan` under `schedule`, with
    /// `microbatches` per iteration; `segment` the iterations between drained ends (PipeDream's
    /// streams; the whole run when `None`), and `chunk` the iterations a chunk spans
    /// ([`CHUNK_ITERATIONS`] in a run).
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
            Schedule::PipeDream => Source::Segments {
                plan: plan.clone(),
                rank,
                segment: segment.unwrap_or(iterations).max(1),
                stream: None,
            },
            Schedule::GPipe | Schedule::OneFOneB => {
                let one = timeline(plan, schedule, microbatches)?.actions[rank].clone();
                Source::Repeat(one, segment.map(|s| s.max(1)))
            }
        };
        Ok(RankActions {
            microbatches,
            next: first.min(iterations),
            end: iterations,
            chunk: chunk.max(1),
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
    type Item = Result<Chunk, ScheduleError>;

    /// The next chunk, microbatches numbered globally; an error (and nothing after it) where the
    /// simulation finds the schedule stuck.
    fn next(&mut self) -> Option<Self::Item> {
        let m = self.microbatches;
        match &mut self.source {
            Source::Repeat(one, segment) => {
                if self.next >= self.end {
                    return None;
                }
                let start = self.next;
                self.next = (start + self.chunk).min(self.end);
                if let Some(segment) = *segment {
                    self.next = self.next.min(segment_end(start, segment, self.end));
                }
                let actions = (start..self.next)
                    .flat_map(|it| one.iter().map(move |a| a.shifted(it * m)))
                    .collect();
                Some(Ok(Chunk::drained(actions)))
            }
            Source::Segments {
                plan,
                rank,
                segment,
                stream,
            } => loop {
                if let Some(s) = stream {
                    match s.next_chunk() {
                        Ok(Some(chunk)) => return Some(Ok(chunk)),
                        Ok(None) => *stream = None,
                        Err(e) => {
                            self.next = self.end;
                            *stream = None;
                            return Some(Err(e));
                        }
                    }
                }
                if self.next >= self.end {
                    return None;
                }
                let start = self.next;
                self.next = segment_end(start, *segment, self.end);
                let simulation = Simulation::new(
                    plan.clone(),
                    Schedule::PipeDream,
                    m * (self.next - start),
                    &[*rank],
                );
                let per_iteration = m / plan.stage_of_rank(*rank).ranks.len();
                *stream = Some(Box::new(Stream::new(
                    simulation,
                    *rank,
                    start * m,
                    self.chunk * per_iteration,
                )));
            },
        }
    }
}

/// One rank's actions of a drained stream, as its simulation derives them, cut into chunks.
#[derive(Debug, Clone)]
struct Stream {
    simulation: Simulation,
    rank: usize,
    /// Added to every microbatch number (the stream's first global microbatch).
    offset: usize,
    /// The forwards a chunk holds before it is handed out (at least).
    target: usize,
    /// Actions derived and not handed out yet, microbatches not offset.
    buffer: Vec<Action>,
    /// The buffer's forwards whose backward has not come yet: where they are in the buffer, and
    /// whether a step came after them.
    open: VecDeque<(usize, bool)>,
    /// One past the buffer's last forward whose backward came: where the next chunk may end
    /// (the forwards before it resolved too, as a rank runs backwards in its forwards' order).
    cut: usize,
    /// How many forwards the buffer holds before `cut`.
    resolved: usize,
    /// The resolved forwards that stash, offset.
    stashed: BTreeSet<usize>,
}

impl Stream {
    fn new(simulation: Simulation, rank: usize, offset: usize, target: usize) -> Stream {
        Stream {
            simulation,
            rank,
            offset,
            target: target.max(1),
            buffer: Vec::new(),
            open: VecDeque::new(),
            cut: 0,
            resolved: 0,
            stashed: BTreeSet::new(),
        }
    }

    /// The next chunk, or `None` once the stream has been handed out whole. A chunk holds
    /// `target` resolved forwards, or, once the rank's last backward came, the stream's rest.
    fn next_chunk(&mut self) -> Result<Option<Chunk>, ScheduleError> {
        loop {
            let rank = &self.simulation.ranks[self.rank];
            if rank.finished() || self.resolved >= self.target && rank.backwards < rank.count {
                break;
            }
            self.simulation.advance()?;
            for action in self.simulation.take(self.rank) {
                let at = self.buffer.len();
                self.buffer.push(action);
                match action {
                    Action::Forward(_) => self.open.push_back((at, false)),
                    Action::Step => self.open.iter_mut().for_each(|(_, stepped)| *stepped = true),
                    Action::Backward(g) => {
                        let (at, stepped) = self.open.pop_front().expect("a backward follows its forward");
                        if stepped {
                            self.stashed.insert(g + self.offset);
                        }
                        self.cut = at + 1;
                        self.resolved += 1;
                    }
                }
            }
        }
        let cut = if self.simulation.ranks[self.rank].finished() {
            self.buffer.len()
        } else {
            self.cut
        };
        if cut == 0 {
            return Ok(None);
        }
        let offset = self.offset;
        let actions = self.buffer.drain(..cut).map(|a| a.shifted(offset)).collect();
        for (at, _) in &mut self.open {
            *at -= cut;
        }
        (self.cut, self.resolved) = (0, 0);
        Ok(Some(Chunk {
            actions,
            stashed: std::mem::take(&mut self.stashed),
        }))
    }
}

/// Per-rank state during the simulation.
#[derive(Debug, Clone)]
struct RankSim {
    stage: usize,
    /// This rank's place among its stage's replicas, and their number: it runs microbatches
    /// `replica`, `replica + replicas`, and so on.
    replica: usize,
    replicas: usize,
    /// How many microbatches it runs.
    count: usize,
    forwards: usize,
    backwards: usize,
    /// A step is owed after the last backward (PipeDream).
    step_due: bool,
    /// This rank's actions not taken yet, when they are kept.
    actions: Option<Vec<Action>>,
}

impl RankSim {
    /// Whether the rank took all its actions.
    fn finished(&self) -> bool {
        self.backwards == self.count && !self.step_due
    }

    /// The microbatch of this rank's `k`-th forward (and backward), if it has that many.
    fn nth(&self, k: usize) -> Option<usize> {
        (k < self.count).then(|| self.replica + k * self.replicas)
    }
}

/// The whole pipeline advancing in unit time steps under a schedule's policy, over `microbatches`
/// global microbatches. It holds what is in flight, not what has been: a finished microbatch's
/// completion times are dropped once no action can ask for them.
#[derive(Debug, Clone)]
struct Simulation {
    plan: StagePlan,
    schedule: Schedule,
    ranks: Vec<RankSim>,
    /// Completion time of each (stage, microbatch) forward, until that stage's backward of it.
    fwd_done: HashMap<(usize, usize), usize>,
    /// Completion time of each (stage, microbatch) backward, until the previous stage's.
    bwd_done: HashMap<(usize, usize), usize>,
    time: usize,
}

impl Simulation {
    /// A simulation keeping the actions of `kept` ranks.
    fn new(plan: StagePlan, schedule: Schedule, microbatches: usize, kept: &[usize]) -> Simulation {
        let ranks = (0..plan.world_size)
            .map(|rank| {
                let stage = plan.stage_of_rank(rank);
                let replicas = stage.ranks.len();
                let replica = stage
                    .ranks
                    .iter()
                    .position(|&r| r == rank)
                    .expect("a rank is among its stage's");
                RankSim {
                    stage: stage.id,
                    replica,
                    replicas,
                    count: microbatches.saturating_sub(replica).div_ceil(replicas),
                    forwards: 0,
                    backwards: 0,
                    step_due: false,
                    actions: kept.contains(&rank).then(Vec::new),
                }
            })
            .collect();
        Simulation {
            plan,
            schedule,
            ranks,
            fwd_done: HashMap::new(),
            bwd_done: HashMap::new(),
            time: 0,
        }
    }

    fn done(&self) -> bool {
        self.ranks.iter().all(RankSim::finished)
    }

    /// The actions `rank` took since last asked (none unless it is kept).
    fn take(&mut self, rank: usize) -> Vec<Action> {
        self.ranks[rank]
            .actions
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// One time step: every rank takes the action its policy picks among those whose inputs
    /// completed in an earlier step, if any; under PipeDream, a rank that ran a backward steps
    /// next, with its stage's replicas.
    fn advance(&mut self) -> Result<(), ScheduleError> {
        let (plan, schedule, time) = (&self.plan, self.schedule, self.time);
        let stages = plan.stages.len();
        let mut progressed = false;
        // A PipeDream step is a collective among a stage's replicas: per stage, whether every
        // replica owes one (`validate` gives them equal shares, so they step in lockstep).
        let stage_steps: Vec<bool> = plan
            .stages
            .iter()
            .map(|stage| stage.ranks.iter().all(|&q| self.ranks[q].step_due))
            .collect();
        let mut finished = Vec::new();
        for r in self.ranks.iter_mut() {
            let s = r.stage;
            if r.step_due {
                if stage_steps[s] {
                    if let Some(actions) = &mut r.actions {
                        actions.push(Action::Step);
                    }
                    r.step_due = false;
                    progressed = true;
                }
                continue;
            }
            let next_fwd = r.nth(r.forwards);
            let next_bwd = r.nth(r.backwards).filter(|_| r.backwards < r.forwards);
            let fwd_done = &self.fwd_done;
            let bwd_done = &self.bwd_done;
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
            let Some(action) = choice else { continue };
            match action {
                Action::Forward(_) => r.forwards += 1,
                Action::Backward(_) => {
                    r.backwards += 1;
                    r.step_due = schedule == Schedule::PipeDream;
                }
                Action::Step => unreachable!("steps are taken above"),
            }
            if let Some(actions) = &mut r.actions {
                actions.push(action);
            }
            finished.push((s, action));
            progressed = true;
        }
        for (s, action) in finished {
            match action {
                Action::Forward(g) => drop(self.fwd_done.insert((s, g), time)),
                Action::Backward(g) => {
                    // Only this backward read its forward's time, and the next stage's backward
                    // time; only the previous stage's backward will read this one's.
                    self.fwd_done.remove(&(s, g));
                    self.bwd_done.remove(&(s + 1, g));
                    if s > 0 {
                        self.bwd_done.insert((s, g), time);
                    }
                }
                Action::Step => {}
            }
        }
        if !progressed {
            return Err(ScheduleError::Deadlock { schedule, step: time });
        }
        self.time += 1;
        Ok(())
    }
}

/// Simulates `schedule` over `microbatches` global microbatches and returns every rank's list.
/// GPipe and 1F1B lists end with one `Step`; PipeDream lists have a `Step` after every backward.
pub fn timeline(
    plan: &StagePlan,
    schedule: Schedule,
    microbatches: usize,
) -> Result<Timeline, ScheduleError> {
    let all: Vec<usize> = (0..plan.world_size).collect();
    let mut simulation = Simulation::new(plan.clone(), schedule, microbatches, &all);
    while !simulation.done() {
        simulation.advance()?;
    }
    Ok(Timeline {
        microbatches,
        actions: all
            .iter()
            .map(|&rank| {
                let mut actions = simulation.take(rank);
                if schedule != Schedule::PipeDream {
                    actions.push(Action::Step);
                }
                actions
            })
            .collect(),
    })
}

#[cfg(test)]
pub(crate) mod tests;
