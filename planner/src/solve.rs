//! The dynamic program over suffixes of the module list, and the plan it yields.

use std::collections::BTreeMap;
use std::ops::Range;

use stagehand_contract::StageConfig;

use crate::cost::{CostModel, StageParts};

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
        }
    }
}

#[derive(Clone, Copy)]
struct Best {
    time: f64,
    /// The first stage ends before this module...
    end: usize,
    /// ...and runs on this many workers.
    replicas: usize,
}

/// Solves the partitioning for `workers` workers; `straight` allows no replication.
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
    // best[i][m]: modules i.. on the last m workers; None where impossible.
    let mut best: Vec<Vec<Option<Best>>> = vec![vec![None; workers + 1]; modules + 1];
    best[modules][0] = Some(Best {
        time: 0.0,
        end: modules,
        replicas: 0,
    });
    for start in (0..modules).rev() {
        for m in 1..=workers {
            let first_worker = workers - m;
            let mut choice: Option<Best> = None;
            for (end, after_row) in best.iter().enumerate().skip(start + 1) {
                let max_replicas = if straight { 1 } else { m };
                for replicas in 1..=max_replicas {
                    let rest = m - replicas;
                    if (end == modules) != (rest == 0) {
                        continue;
                    }
                    let stage = start..end;
                    if !model.fits(&stage, replicas, m) {
                        continue;
                    }
                    let mut time = model.stage_time(&stage, &(first_worker..first_worker + replicas));
                    if end < modules {
                        let Some(after) = after_row[rest] else { continue };
                        time = time
                            .max(model.boundary_time(end - 1, first_worker + replicas))
                            .max(after.time);
                    }
                    if choice.is_none_or(|c| time < c.time) {
                        choice = Some(Best { time, end, replicas });
                    }
                }
            }
            best[start][m] = choice;
        }
    }
    let Some(root) = best[0][workers] else {
        return Err(PlanError::NothingFits {
            limit_gib: model.memory_limit.unwrap_or(0.0) / (1u64 << 30) as f64,
        });
    };
    let mut stages = Vec::new();
    let (mut start, mut m) = (0, workers);
    while start < modules {
        let b = best[start][m].expect("the chosen path exists");
        let first_worker = workers - m;
        let range = start..b.end;
        let parts = model.stage_parts(&range, &(first_worker..first_worker + b.replicas));
        stages.push(PlannedStage {
            time_s: parts.total(),
            parts,
            transfer_s: (b.end < modules).then(|| model.boundary_time(b.end - 1, first_worker + b.replicas)),
            memory_bytes: model.stage_memory(&range, b.replicas, m),
            modules: range,
            replicas: b.replicas,
        });
        start = b.end;
        m -= b.replicas;
    }
    let whole = 0..modules;
    let data_parallel_time = model
        .fits(&whole, workers, workers)
        .then(|| model.stage_time(&whole, &(0..workers)));
    Ok(Plan {
        stages,
        time_per_minibatch: root.time,
        data_parallel_time,
    })
}
