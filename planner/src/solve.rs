//! The dynamic program over suffixes of the module list, and the plan it yields.

use std::collections::BTreeMap;
use std::ops::Range;

use stagehand_contract::StageConfig;

use crate::cost::{CostModel, Schedule, StageParts};

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
    /// Predicted seconds per minibatch of pure data parallelism on the same workers, if it fits.
    pub data_parallel_time: Option<f64>,
}

/// Why no plan could be made; the message says what to change.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("the profile has no modules")]
    NoModules,
    #[error("--workers must be at least 1")]
    NoWorkers,
    #[error("a straight pipeline of {workers} workers needs at least {workers} modules, the model has {modules}; use fewer workers or allow replication")]
    TooFewModules { workers: usize, modules: usize },
    #[error("no split fits in {limit_gib:.2} GiB per worker; raise --memory or add workers")]
    NothingFits { limit_gib: f64 },
}

impl Plan {
    /// Predicted speedup over pure data parallelism, when that fits in memory.
    pub fn speedup(&self) -> Option<f64> {
        self.data_parallel_time.map(|dp| dp / self.time_per_minibatch)
    }

    /// Seconds per minibatch of a flushing schedule (GPipe, 1F1B) with `microbatches`: the
    /// bottleneck's work plus the pipeline's fill and drain, `(stages - 1)` microbatch slots.
    pub fn flushing_time(&self, microbatches: usize) -> f64 {
        let m = microbatches.max(1) as f64;
        self.time_per_minibatch * (m + self.stages.len() as f64 - 1.0) / m
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

/// Solves the partitioning for `workers` workers; `straight` allows no replication.
///
/// `best(i, m, r, k)` is the lowest steady-state time for modules `i..` on the last `m` workers
/// with the first stage on `r` of them. Its boundary with the next stage depends on both stages'
/// replicas and where they sit, so the state carries `r` and the choice of the next stage's
/// replicas is made with that boundary in view: the program is exact for the cost model, on
/// networks of any number of levels. For a flushing schedule, whose fill and drain grow with the
/// number of stages, `k` counts the stages from `i` on and the root weighs each count's best by
/// [`CostModel::objective`]; otherwise `k` is always 0.
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
    let counted = matches!(model.schedule, Schedule::Flushing { .. });
    // Stage counts kept apart: 1..=buckets stages, at index count - 1.
    let buckets = if counted { workers.min(modules) } else { 1 };
    let max_replicas = |m: usize| if straight { 1.min(m) } else { m };
    let w = workers + 1;
    let at = |start: usize, m: usize, r: usize, k: usize| ((start * w + m) * w + r) * buckets + k;
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
    let mut best: Vec<Option<Best>> = vec![None; (modules + 1) * w * w * buckets];
    // after[end, rest, r, k]: the best continuation of k (bucket) stages from module `end` on the
    // last `rest` workers, behind a stage on `r` workers, its boundary included.
    let mut after: Vec<Option<(f64, usize)>> = vec![None; (modules + 1) * w * w * buckets];
    for start in (0..modules).rev() {
        for m in 1..=workers {
            let first_worker = workers - m;
            for r in 1..=max_replicas(m) {
                let rest = m - r;
                let stage_workers = first_worker..first_worker + r;
                for k in 0..buckets {
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
                        let stage = start..end;
                        if !model.fits(&stage, r, m) {
                            continue;
                        }
                        let mut time = model.stage_time(&stage, &stage_workers);
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
            let bytes = model.output_bytes(start - 1);
            for rest in 1..workers {
                for r in 1..=workers - rest {
                    for k in 0..buckets {
                        after[at(start, rest, r, k)] = (1..=max_replicas(rest))
                            .filter_map(|next| {
                                let b = best[at(start, rest, next, k)]?;
                                let boundary = bytes * per_byte[(rest * w + r) * w + next];
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
    let mut root: Option<(f64, Best, usize, usize)> = None;
    for r in 1..=max_replicas(workers) {
        for k in 0..buckets {
            let Some(b) = best[at(0, workers, r, k)] else {
                continue;
            };
            let objective = model.objective(b.time, k + 1);
            if root.is_none_or(|(o, ..)| objective < o) {
                root = Some((objective, b, r, k));
            }
        }
    }
    let Some((_, root, first_replicas, first_bucket)) = root else {
        return Err(PlanError::NothingFits {
            limit_gib: model.memory_limit.unwrap_or(0.0) / (1u64 << 30) as f64,
        });
    };
    let mut split = Vec::new();
    let (mut start, mut m, mut r, mut k) = (0, workers, first_replicas, first_bucket);
    while start < modules {
        let b = best[at(start, m, r, k)].expect("the chosen path exists");
        split.push((start..b.end, r));
        start = b.end;
        m -= r;
        r = b.next_replicas;
        k = k.saturating_sub(1);
    }
    Ok(assemble(model, &split, root.time))
}

/// The plan of `split` (module ranges with their replica counts, workers in order) whose
/// steady-state time is `time`: each stage's parts, transfer and memory, and data parallelism's
/// time for comparison.
fn assemble(model: &CostModel, split: &[(Range<usize>, usize)], time: f64) -> Plan {
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
        time_per_minibatch: time,
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
                let mut time = model.stage_time(&(start..end), &range(k)).max(after);
                if k + 1 < stages {
                    time = time.max(model.boundary_time(end - 1, &range(k), &range(k + 1)));
                }
                if choice.is_none_or(|(t, _)| time < t) {
                    choice = Some((time, end));
                }
            }
            best[k][start] = choice;
        }
    }
    let (time, _) = best[0][0]?;
    let mut split = Vec::new();
    let mut start = 0;
    for (k, &r) in replicas.iter().enumerate() {
        let (_, end) = best[k][start].expect("the chosen path exists");
        split.push((start..end, r));
        start = end;
    }
    Some(assemble(model, &split, time))
}

/// The most workers [`alternatives`] enumerates every stage shape for (2^(workers-1) of them).
pub const MAX_ALTERNATIVE_WORKERS: usize = 12;

/// The best plan of every other stage shape (replicas per stage) on `workers`, fastest first (by
/// [`CostModel::objective`]), at
/// most `count` of them: what the planner passed over, and by how much. Empty beyond
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
    let objective = |p: &Plan| model.objective(p.time_per_minibatch, p.stages.len());
    found.sort_by(|a, b| objective(a).total_cmp(&objective(b)));
    found.truncate(count);
    found
}
