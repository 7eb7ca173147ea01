//! The dynamic program over suffixes of the module list, and the plan it yields.

use std::collections::BTreeMap;
use std::ops::Range;

use stagehand_contract::StageConfig;

use crate::cost::{fill_and_drain, CostModel, Schedule, StageParts};

/// One stage of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedStage {
    /// Module indices (the loss is in the last stage).
    pub modules: Range<usize>,
    /// Workers running it.
    pub replicas: usize,
    /// Predicted seconds per minibatch of its compute and all-reduce.
    pub time_s: f64,
    /// [`PlannedStage::time_s`] in its parts.
    pub parts: StageParts,
    /// Seconds per minibatch to send its output to the next stage and the gradient back
    /// (`None` for the last stage).
    pub transfer_s: Option<f64>,
    /// Predicted bytes per worker.
    pub memory_bytes: f64,
}

/// A partition of the model over the workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub stages: Vec<PlannedStage>,
    /// Predicted seconds per minibatch in steady state: the slowest stage or boundary.
    pub time_per_minibatch: f64,
    /// Predicted seconds per minibatch under the schedule planned for, what the planner minimised
    /// ([`CostModel::objective`]): [`Plan::time_per_minibatch`] but for a flushing schedule.
    pub objective: f64,
    /// Predicted seconds per minibatch of pure data parallelism on the same workers, if it fits.
    pub data_parallel_time: Option<f64>,
}

/// Why no plan could be made; the message says what to change.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("the profile has no modules")]
    NoModules,
    #[error("--workers must be at least 1")]
    NoWorkers,
    #[error("a straight pipeline of {workers} workers needs at least {workers} modules, the model has {modules}; use fewer workers or allow replication")]
    TooFewModules { workers: usize, modules: usize },
    #[error("no split fits in {limit_gib:.2} GiB per worker; raise --memory or add workers")]
    NothingFits { limit_gib: f64 },
    #[error("under PipeDream's schedule a stage's replicas take the {microbatches} microbatches in turn, so their count must divide it, and no split of the modules over {workers} workers gives every stage such a count; set microbatches to a multiple of {workers}, or plan a straight pipeline")]
    NoDividingSplit { workers: usize, microbatches: usize },
    /// The costs or the network hold what no plan can be made of ([`CostModel::invalid`]).
    #[error("{0}")]
    Invalid(String),
    /// The program's tables would not fit the planner's memory budget ([`MAX_TABLE_BYTES`]).
    #[error(
        "planning {modules} modules on {workers} workers{} needs {gib:.2} GiB for the planner's tables, \
         over its limit of {} GiB; {}",
        in_stages(*.stages),
        MAX_TABLE_BYTES >> 30,
        lower_workers(*.fits)
    )]
    TooMuchMemory {
        modules: usize,
        workers: usize,
        /// The stage count the program was to run for (a flushing schedule runs it per count).
        stages: Option<usize>,
        gib: f64,
        /// The most workers that stay within the limits (0: not even one).
        fits: usize,
    },
    /// The program would take longer than the planner allows ([`MAX_STEPS`]).
    #[error(
        "planning {modules} modules on {workers} workers{} takes about {steps:.1e} steps of the planner's \
         program, over its limit of {MAX_STEPS:.0e} (about a minute); {}",
        in_stages(*.stages),
        lower_workers(*.fits)
    )]
    TooMuchWork {
        modules: usize,
        workers: usize,
        stages: Option<usize>,
        steps: f64,
        fits: usize,
    },
}

fn in_stages(stages: Option<usize>) -> String {
    stages.map_or_else(String::new, |s| {
        format!(" in {s} stages (a flushing --schedule plans each stage count on its own)")
    })
}

fn lower_workers(fits: usize) -> String {
    match fits {
        0 => "even one worker is too many: the profile has too many modules to plan over".into(),
        n => format!("lower --workers (up to {n} stay within the limits)"),
    }
}

/// The most bytes [`plan`]'s tables may take at once: 1 GiB. The program's tables grow as
/// workers^3 (the boundaries' costs) and as modules x workers^2 x stage counts (its states), so
/// without a bound a large `--workers` asks for terabytes and aborts.
pub const MAX_TABLE_BYTES: u128 = 1 << 30;

/// The most steps (innermost iterations) one run of [`plan`]'s program may take, counted as an
/// upper bound before it runs: 1e10, about a minute at the 5 to 10 ns a step takes on a
/// present-day core. The boundaries' costs alone take about workers^5 / 160 steps, so this
/// stops near 270 workers instead of running for hours.
pub const MAX_STEPS: f64 = 1e10;

/// What one run of the program takes: bytes held at once, and steps.
struct Footprint {
    bytes: u128,
    steps: u128,
}

/// An upper bound of what [`Program::solve_stretched`] with `buckets` stage counts kept apart
/// takes over `modules` modules on `workers` workers, with the table of the boundaries' costs it
/// reads (computing that table counted in `steps` only `with_boundaries`). It follows the loops
/// of [`plan`] and [`Program::solve_stretched`]; saturating, so absurd requests compare as huge.
fn footprint(
    modules: usize,
    workers: usize,
    straight: bool,
    buckets: usize,
    with_boundaries: bool,
) -> Footprint {
    let (m, n, b) = (modules as u128, workers as u128, buckets as u128);
    let w = n.saturating_add(1);
    let cells = |dims: &[u128]| dims.iter().fold(1u128, |acc, &d| acc.saturating_mul(d));
    let per_byte = cells(&[w, w, w, std::mem::size_of::<f64>() as u128]);
    let entry = (std::mem::size_of::<Option<Best>>() + std::mem::size_of::<Option<(f64, usize)>>()) as u128;
    let bytes = per_byte.saturating_add(cells(&[m + 1, w, w, b, entry]));
    if bytes > MAX_TABLE_BYTES {
        // Beyond the memory budget: the steps are never needed (nor cheap to count).
        return Footprint {
            bytes,
            steps: u128::MAX,
        };
    }
    // Replica counts tried over every worker count (`m` workers: 1..=m, or 1 when straight),
    // and over every count of the workers behind a stage, weighted by the stage's choices.
    let replicas = if straight { n } else { n * (n + 1) / 2 };
    let behind = if straight {
        n * n.saturating_sub(1) / 2
    } else {
        n.saturating_sub(1) * n * (n + 1) / 6
    };
    // For each first module, worker count, replicas and stage count, every end; then for each
    // start after the first, the continuations.
    let mut steps = cells(&[replicas, b, m * (m + 1) / 2]) + cells(&[m.saturating_sub(1), b, behind]);
    if with_boundaries {
        // A boundary from `r` workers to `next` behind them costs lcm(r, next) steps, for every
        // count of workers behind that leaves room for both.
        for r in 1..workers {
            let most = if straight { 1 } else { workers - r };
            for next in 1..=most {
                let rests = (workers - r + 1 - next) as u128;
                steps += crate::cost::lcm(r, next) as u128 * rests;
            }
        }
    }
    Footprint { bytes, steps }
}

/// Whether planning stays within [`MAX_TABLE_BYTES`] and [`MAX_STEPS`]: the program up front
/// (`stages` `None`: the boundaries' costs and a run that keeps no stage counts apart), or its
/// run for `stages` stages under a flushing schedule. `fits` says how many workers would.
fn within_limits(
    modules: usize,
    workers: usize,
    straight: bool,
    stages: Option<usize>,
    fits: impl FnOnce() -> usize,
) -> Result<(), PlanError> {
    let need = footprint(modules, workers, straight, stages.unwrap_or(1), stages.is_none());
    if need.bytes > MAX_TABLE_BYTES {
        return Err(PlanError::TooMuchMemory {
            modules,
            workers,
            stages,
            gib: need.bytes as f64 / (1u64 << 30) as f64,
            fits: fits(),
        });
    }
    if need.steps as f64 > MAX_STEPS {
        return Err(PlanError::TooMuchWork {
            modules,
            workers,
            stages,
            steps: need.steps as f64,
            fits: fits(),
        });
    }
    Ok(())
}

/// The most workers, below `workers`, on which [`plan`] stays within its limits for `modules`
/// modules: up front, and for a flushing schedule (`flushing`) at the most stages it may try.
fn most_workers_within_limits(modules: usize, workers: usize, straight: bool, flushing: bool) -> usize {
    let fits = |n: usize| {
        let most_stages = if straight { n } else { n.min(modules) };
        let within = |stages| within_limits(modules, n, straight, stages, || 0).is_ok();
        within(None) && (!flushing || within(Some(most_stages)))
    };
    // The largest `n` in 0..workers that fits (`workers` does not; 0 stands for none): what
    // the program takes grows with the workers.
    let (mut low, mut high) = (0, workers);
    while high - low > 1 {
        let mid = low + (high - low) / 2;
        match fits(mid) {
            true => low = mid,
            false => high = mid,
        }
    }
    low
}

impl Plan {
    /// Predicted speedup over pure data parallelism, when that fits in memory, under the schedule
    /// planned for.
    pub fn speedup(&self) -> Option<f64> {
        self.data_parallel_time.map(|dp| dp / self.objective)
    }

    /// Seconds per minibatch of a flushing schedule (GPipe, 1F1B) with `microbatches`: each
    /// stage's compute and transfer stretched by [`fill_and_drain`], its update once, and the
    /// slowest of those. [`Plan::objective`] when planned for that schedule.
    pub fn flushing_time(&self, microbatches: usize) -> f64 {
        let stretch = fill_and_drain(microbatches, self.stages.len());
        self.stages
            .iter()
            .map(|s| {
                s.parts
                    .stretched(stretch)
                    .max(stretch * s.transfer_s.unwrap_or(0.0))
            })
            .fold(0.0, f64::max)
    }

    /// The plan as PipeDream's stage config, ranks assigned to stages in order.
    pub fn stage_config(&self) -> StageConfig {
        let mut module_to_stage_map = Vec::new();
        let mut stage_to_rank_map = BTreeMap::new();
        let mut next_rank = 0;
        for (id, stage) in self.stages.iter().enumerate() {
            module_to_stage_map.extend(stage.modules.clone().map(|_| id));
            stage_to_rank_map.insert(id.to_string(), (next_rank..next_rank + stage.replicas).collect());
            next_rank += stage.replicas;
        }
        StageConfig {
            module_to_stage_map,
            stage_to_rank_map,
            stage_to_depth_map: None,
            module_to_device_map: None,
            bundles: None,
        }
    }
}

#[derive(Clone, Copy)]
struct Best {
    time: f64,
    /// The first stage ends before this module...
    end: usize,
    /// ...and the next stage runs on this many workers (0 for none).
    next_replicas: usize,
}

/// A split: module ranges with their replica counts, workers assigned in order.
type Split = Vec<(Range<usize>, usize)>;

/// Solves the partitioning for `workers` workers; `straight` allows no replication.
///
/// `best(i, m, r, k)` is the lowest time for modules `i..` on the last `m` workers with the first
/// stage on `r` of them. Its boundary with the next stage depends on both stages' replicas and
/// where they sit, so the state carries `r` and the choice of the next stage's replicas is made
/// with that boundary in view: the program is exact for the cost model, on networks of any number
/// of levels. A flushing schedule stretches every stage by a factor that grows with the number
/// of stages ([`CostModel::stretch`]), so the program runs once per stage count `S`, with `k`
/// counting the stages from `i` on; otherwise it runs once and `k` is always 0.
pub fn plan(model: &CostModel, workers: usize, straight: bool) -> Result<Plan, PlanError> {
    let modules = model.len();
    if modules == 0 {
        return Err(PlanError::NoModules);
    }
    if workers == 0 {
        return Err(PlanError::NoWorkers);
    }
    if straight && modules < workers {
        return Err(PlanError::TooFewModules { workers, modules });
    }
    if let Some(problem) = model.invalid() {
        return Err(PlanError::Invalid(problem));
    }
    let flushing = matches!(model.schedule, Schedule::Flushing { .. });
    let fits = || most_workers_within_limits(modules, workers, straight, flushing);
    within_limits(modules, workers, straight, None, fits)?;
    let max_replicas = |m: usize| if straight { 1.min(m) } else { m };
    let w = workers + 1;
    // The boundary's seconds per byte from a stage on `r` workers to one on `next` workers
    // behind it, the `rest` workers after the first being the next stage's and beyond.
    let mut per_byte = vec![0.0; w * w * w];
    for rest in 1..workers {
        for r in 1..=workers - rest {
            for next in 1..=max_replicas(rest) {
                let from = workers - rest - r..workers - rest;
                let to = from.end..from.end + next;
                per_byte[(rest * w + r) * w + next] = model.network.boundary_seconds_per_byte(&from, &to);
            }
        }
    }
    let program = Program {
        model,
        workers,
        straight,
        per_byte,
    };
    let best = match model.schedule {
        Schedule::Flushing { .. } => {
            // A straight pipeline has a stage per worker. Otherwise, fewest stages first: `S`
            // stages take at least the compute and the optimizer steps shared by every worker
            // (a worker's mean time), compute stretched for `S`, so once that reaches the best
            // plan so far no larger count can beat it.
            let counts = match straight {
                true => workers..=workers,
                false => 1..=workers.min(modules),
            };
            let shared = model.stage_parts(&(0..modules), &(0..workers));
            let floor = |stages: usize| {
                shared.compute_s * model.stretch(stages) + shared.optimizer_s / workers as f64
            };
            // For each count, first the best split for its stretch with the stages left
            // uncounted (a cheaper program), judged by its own count: it bounds the counted
            // program, as a stage that costs more than the best plan so far cannot be in a
            // better one.
            let mut best: Option<(f64, Split)> = None;
            let keep = |found: Option<(f64, Split)>, best: &mut Option<(f64, Split)>| {
                if let Some((time, split)) = found {
                    if best.as_ref().is_none_or(|(t, _)| time < *t) {
                        *best = Some((time, split));
                    }
                }
            };
            let bound = |best: &Option<(f64, Split)>| best.as_ref().map_or(f64::INFINITY, |(t, _)| *t);
            for stages in counts.clone() {
                if floor(stages) >= bound(&best) {
                    break;
                }
                // Each count's program keeps the counts apart: its tables grow with it.
                within_limits(modules, workers, straight, Some(stages), fits)?;
                let found = program
                    .solve_stretched(None, model.stretch(stages), bound(&best))
                    .map(|(_, split)| (model.objective(&split), split))
                    .filter(|(_, split)| counts.contains(&split.len()));
                keep(found, &mut best);
                keep(program.solve(Some(stages), bound(&best)), &mut best);
            }
            best
        }
        Schedule::Steady | Schedule::PipeDream { .. } => program.solve(None, f64::INFINITY),
    };
    let Some((_, split)) = best else {
        // Without a memory limit, only the schedule's replica counts can leave no plan.
        return Err(match (model.memory_limit, model.schedule) {
            (None, Schedule::PipeDream { microbatches }) => PlanError::NoDividingSplit {
                workers,
                microbatches,
            },
            _ => PlanError::NothingFits {
                limit_gib: model.memory_limit.unwrap_or(0.0) / (1u64 << 30) as f64,
            },
        });
    };
    Ok(assemble(model, &split))
}

/// The dynamic program of [`plan`] for one request.
struct Program<'a> {
    model: &'a CostModel,
    workers: usize,
    straight: bool,
    /// `[(rest * w + r) * w + next]`: seconds per byte across the boundary from a stage on `r`
    /// workers to one on `next` behind it, `rest` workers from there to the end (`w` = workers + 1).
    per_byte: Vec<f64>,
}

impl Program<'_> {
    /// The best split of exactly `stages` stages (any number for `None`) and what it costs, if
    /// one costs at most `bound`.
    fn solve(&self, stages: Option<usize>, bound: f64) -> Option<(f64, Split)> {
        let stretch = stages.map_or(1.0, |s| self.model.stretch(s));
        self.solve_stretched(stages, stretch, bound)
    }

    /// [`Program::solve`] with compute and transfers stretched by `stretch`.
    fn solve_stretched(&self, stages: Option<usize>, stretch: f64, bound: f64) -> Option<(f64, Split)> {
        let (model, workers, modules) = (self.model, self.workers, self.model.len());
        let max_replicas = |m: usize| if self.straight { 1.min(m) } else { m };
        // Stage counts kept apart: 1..=buckets stages from a module on, at index count - 1.
        let buckets = stages.unwrap_or(1);
        let counted = stages.is_some();
        let w = workers + 1;
        let at = |start: usize, m: usize, r: usize, k: usize| ((start * w + m) * w + r) * buckets + k;
        let mut best: Vec<Option<Best>> = vec![None; (modules + 1) * w * w * buckets];
        // after[end, rest, r, k]: the best continuation of k (bucket) stages from module `end` on
        // the last `rest` workers, behind a stage on `r` workers, its boundary included.
        let mut after: Vec<Option<(f64, usize)>> = vec![None; (modules + 1) * w * w * buckets];
        for start in (0..modules).rev() {
            for m in 1..=workers {
                let first_worker = workers - m;
                for r in 1..=max_replicas(m) {
                    // A count the schedule refuses is no stage: nothing continues from it.
                    if !model.replicas_allowed(r) {
                        continue;
                    }
                    let rest = m - r;
                    let stage_workers = first_worker..first_worker + r;
                    // k + 1 stages from here need as many workers and modules.
                    for k in 0..buckets.min(m).min(modules - start) {
                        let mut choice: Option<Best> = None;
                        for end in start + 1..=modules {
                            if (end == modules) != (rest == 0) {
                                continue;
                            }
                            // A counted last stage is a count of one; one more stage per boundary.
                            let continuation = match (counted, end == modules) {
                                (true, true) if k != 0 => continue,
                                (true, false) if k == 0 => continue,
                                (true, false) => Some(k - 1),
                                (false, false) => Some(0),
                                (_, true) => None,
                            };
                            // A longer stage holds and costs no less: none after this fits.
                            let stage = start..end;
                            if !model.fits(&stage, r, m) {
                                break;
                            }
                            let mut time = model.stage_parts(&stage, &stage_workers).stretched(stretch);
                            if time > bound {
                                break;
                            }
                            let mut next_replicas = 0;
                            if let Some(bucket) = continuation {
                                let Some((then, next)) = after[at(end, rest, r, bucket)] else {
                                    continue;
                                };
                                time = time.max(then);
                                next_replicas = next;
                            }
                            if choice.is_none_or(|c| time < c.time) {
                                choice = Some(Best {
                                    time,
                                    end,
                                    next_replicas,
                                });
                            }
                        }
                        best[at(start, m, r, k)] = choice;
                    }
                }
            }
            // The continuations that start at `start`, for the stages before it.
            if start > 0 {
                let bytes = stretch * model.output_bytes(start - 1);
                for rest in 1..workers {
                    for r in 1..=workers - rest {
                        for k in 0..buckets {
                            after[at(start, rest, r, k)] = (1..=max_replicas(rest))
                                .filter_map(|next| {
                                    let b = best[at(start, rest, next, k)]?;
                                    let boundary = bytes * self.per_byte[(rest * w + r) * w + next];
                                    Some((b.time.max(boundary), next))
                                })
                                .fold(None, |acc: Option<(f64, usize)>, c| match acc {
                                    Some(a) if a.0 <= c.0 => Some(a),
                                    _ => Some(c),
                                });
                        }
                    }
                }
            }
        }
        // The whole model on every worker, in exactly `stages` stages where counted.
        let last = buckets - 1;
        let (time, first_replicas) = (1..=max_replicas(workers))
            .filter_map(|r| Some((best[at(0, workers, r, last)]?.time, r)))
            .fold(None, |acc: Option<(f64, usize)>, c| match acc {
                Some(a) if a.0 <= c.0 => Some(a),
                _ => Some(c),
            })?;
        let mut split = Vec::new();
        let (mut start, mut m, mut r, mut k) = (0, workers, first_replicas, last);
        while start < modules {
            let b = best[at(start, m, r, k)].expect("the chosen path exists");
            split.push((start..b.end, r));
            start = b.end;
            m -= r;
            r = b.next_replicas;
            k = k.saturating_sub(1);
        }
        Some((time, split))
    }
}

/// The plan of `split` (module ranges with their replica counts, workers in order): its times,
/// each stage's parts, transfer and memory, and data parallelism's time for comparison.
fn assemble(model: &CostModel, split: &[(Range<usize>, usize)]) -> Plan {
    let workers: usize = split.iter().map(|(_, replicas)| replicas).sum();
    let mut first_worker = 0;
    let stages = split
        .iter()
        .enumerate()
        .map(|(i, (modules, replicas))| {
            let here = first_worker..first_worker + replicas;
            first_worker = here.end;
            let parts = model.stage_parts(modules, &here);
            PlannedStage {
                time_s: parts.total(),
                parts,
                transfer_s: split.get(i + 1).map(|(_, next)| {
                    model.boundary_time(modules.end - 1, &here, &(here.end..here.end + next))
                }),
                memory_bytes: model.stage_memory(modules, *replicas, workers - here.start),
                modules: modules.clone(),
                replicas: *replicas,
            }
        })
        .collect();
    let whole = 0..model.len();
    Plan {
        stages,
        time_per_minibatch: model.evaluate(split),
        objective: model.objective(split),
        data_parallel_time: model
            .fits(&whole, workers, workers)
            .then(|| model.stage_time(&whole, &(0..workers))),
    }
}

/// The best split of the modules into stages with exactly `replicas[k]` workers for stage `k`
/// (workers in order), judged by the same model as [`plan`]; `None` if no split fits in memory
/// or there are fewer modules than stages. A program over (stage, first module).
pub fn plan_for_shape(model: &CostModel, replicas: &[usize]) -> Option<Plan> {
    let (modules, stages) = (model.len(), replicas.len());
    if stages == 0 || modules < stages || replicas.contains(&0) {
        return None;
    }
    let workers: usize = replicas.iter().sum();
    let mut first_worker = vec![0; stages + 1];
    for k in 0..stages {
        first_worker[k + 1] = first_worker[k] + replicas[k];
    }
    let range = |k: usize| first_worker[k]..first_worker[k + 1];
    let stretch = model.stretch(stages);
    // best[k][i]: the lowest time for stages k.. over modules i.., with the end of stage k.
    let mut best = vec![vec![None::<(f64, usize)>; modules + 1]; stages + 1];
    best[stages][modules] = Some((0.0, modules));
    for k in (0..stages).rev() {
        let remaining = stages - k;
        for start in k..=modules - remaining {
            let mut choice: Option<(f64, usize)> = None;
            let last_end = if k + 1 == stages {
                modules
            } else {
                modules - (remaining - 1)
            };
            for (end, then) in best[k + 1].iter().enumerate().take(last_end + 1).skip(start + 1) {
                if k + 1 == stages && end != modules {
                    continue;
                }
                let Some((after, _)) = *then else {
                    continue;
                };
                if !model.fits(&(start..end), replicas[k], workers - first_worker[k]) {
                    continue;
                }
                let mut time = model
                    .stage_parts(&(start..end), &range(k))
                    .stretched(stretch)
                    .max(after);
                if k + 1 < stages {
                    time = time.max(stretch * model.boundary_time(end - 1, &range(k), &range(k + 1)));
                }
                if choice.is_none_or(|(t, _)| time < t) {
                    choice = Some((time, end));
                }
            }
            best[k][start] = choice;
        }
    }
    best[0][0]?;
    let mut split = Vec::new();
    let mut start = 0;
    for (k, &r) in replicas.iter().enumerate() {
        let (_, end) = best[k][start].expect("the chosen path exists");
        split.push((start..end, r));
        start = end;
    }
    Some(assemble(model, &split))
}

/// The most workers [`alternatives`] enumerates every stage shape for (2^(workers-1) of them).
pub const MAX_ALTERNATIVE_WORKERS: usize = 12;

/// The best plan of every other stage shape (replicas per stage) on `workers`, fastest first (by
/// [`Plan::objective`]), at most `count` of them: what the planner passed over, and by how much. Empty beyond
/// [`MAX_ALTERNATIVE_WORKERS`] workers.
pub fn alternatives(model: &CostModel, workers: usize, chosen: &Plan, count: usize) -> Vec<Plan> {
    if workers == 0 || workers > MAX_ALTERNATIVE_WORKERS {
        return Vec::new();
    }
    let shape = |p: &Plan| p.stages.iter().map(|s| s.replicas).collect::<Vec<_>>();
    let chosen_shape = shape(chosen);
    let mut found: Vec<Plan> = (0..1u32 << (workers - 1))
        .map(|cuts| {
            // Bit b set: a stage boundary after worker b.
            let mut replicas = vec![1];
            for b in 0..workers - 1 {
                if cuts & (1 << b) != 0 {
                    replicas.push(1);
                } else {
                    *replicas.last_mut().expect("starts with one") += 1;
                }
            }
            replicas
        })
        .filter(|replicas| *replicas != chosen_shape)
        .filter_map(|replicas| plan_for_shape(model, &replicas))
        .collect();
    found.sort_by(|a, b| a.objective.total_cmp(&b.objective));
    found.truncate(count);
    found
}
