//! The cost model: what one stage and one boundary cost, and what a stage holds in memory.

use std::ops::Range;

/// The most seconds one module's forward plus backward (or optimizer step) may take for one
/// microbatch in a profile: 1e6 s, eleven and a half days. A layer measured slower than that is
/// not a measurement (wrong units, a corrupt file), and the bound keeps every sum the planner
/// forms finite and meaningful: even 2^32 modules at 2^64 microbatches per minibatch total under
/// 1e35 s, far below f64's 1.8e308, and a microsecond layer beside the slowest still counts
/// (f64 keeps 15 digits).
pub const MAX_LAYER_SECONDS: f64 = 1e6;

/// The most bytes one module's output or parameters may weigh in a profile: 2^50, a pebibyte,
/// more than any device holds. As for [`MAX_LAYER_SECONDS`], a larger size is a corrupt file,
/// and the bound keeps the planner's sums (times microbatches, in-flight copies and workers)
/// finite.
pub const MAX_LAYER_BYTES: f64 = (1u64 << 50) as f64;

/// One module's measurements (from `runtime profile`).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCost {
    /// Seconds of forward plus backward for one minibatch.
    pub compute_s: f64,
    /// Bytes the module keeps for its backward pass, per minibatch (its output, for the runtime's
    /// modules; everything its layers keep, for a merged span of a PipeDream graph).
    pub activation_bytes: f64,
    /// Bytes that cross a stage boundary cut right after this module, per minibatch: its output.
    pub output_bytes: f64,
    /// Bytes of the module's parameters.
    pub param_bytes: f64,
    /// Seconds of one optimizer step over the module's parameters (every replica steps them all).
    pub optimizer_s: f64,
}

/// Bandwidths of the network levels, innermost first (GPUs in a server, then servers in a
/// cluster, ...), and how many workers each level groups.
#[derive(Debug, Clone, PartialEq)]
pub struct Network {
    /// `(workers per group at this level, bytes per second between them)`, innermost first. The
    /// last level's group size is the total worker count.
    pub levels: Vec<(usize, f64)>,
}

impl Network {
    /// One flat network of `workers` at `bandwidth` bytes per second.
    pub fn flat(workers: usize, bandwidth: f64) -> Network {
        Network {
            levels: vec![(workers, bandwidth)],
        }
    }

    /// Bandwidth among `workers` (positions in the pipeline, assigned in order): that of the
    /// innermost level one of whose groups holds them all.
    pub fn bandwidth(&self, workers: &Range<usize>) -> f64 {
        self.between(workers.start, workers.end.max(workers.start + 1) - 1)
    }

    /// Bandwidth between workers `a` and `b`: that of the innermost level one of whose groups
    /// holds both.
    pub fn between(&self, a: usize, b: usize) -> f64 {
        self.levels
            .iter()
            .find(|(group, _)| a / group.max(&1) == b / group.max(&1))
            .or(self.levels.last())
            .map(|(_, bandwidth)| *bandwidth)
            .expect("a network has at least one level")
    }

    /// Seconds to move `bytes` forward across a boundary from the replicas on `from` to those on
    /// `to`, and as many back (the gradient), per byte. Replicas take microbatches round-robin
    /// (the runtime's route), so over `lcm(|from|, |to|)` microbatches sender `i % |from|` feeds
    /// receiver `i % |to|`; each pair's share crosses at the bandwidth of the innermost level
    /// holding both. A worker's link carries its pairs one after another, so the boundary takes
    /// as long as its busiest worker, sender or receiver.
    pub fn boundary_seconds_per_byte(&self, from: &Range<usize>, to: &Range<usize>) -> f64 {
        let (senders, receivers) = (from.len().max(1), to.len().max(1));
        let period = lcm(senders, receivers);
        let mut busy = vec![0.0; senders + receivers];
        for i in 0..period {
            let (s, r) = (i % senders, i % receivers);
            let seconds = 2.0 / period as f64 / self.between(from.start + s, to.start + r);
            busy[s] += seconds;
            busy[senders + r] += seconds;
        }
        busy.into_iter().fold(0.0, f64::max)
    }
}

pub(crate) fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// What one worker of a stage spends per minibatch, by kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageParts {
    /// Forward and backward of its share of the microbatches.
    pub compute_s: f64,
    /// The optimizer step over the stage's parameters.
    pub optimizer_s: f64,
    /// The replicas' gradient all-reduce (0 for one replica).
    pub allreduce_s: f64,
}

impl StageParts {
    /// The stage's time: the parts add.
    pub fn total(&self) -> f64 {
        self.compute_s + self.optimizer_s + self.allreduce_s
    }

    /// The stage's time with its compute stretched by `stretch` (a flushing schedule's fill and
    /// drain) and its update (all-reduce, optimizer step) once.
    pub fn stretched(&self, stretch: f64) -> f64 {
        self.compute_s * stretch + self.optimizer_s + self.allreduce_s
    }
}

/// How a flushing schedule (GPipe, 1F1B) of `stages` stages stretches a minibatch of
/// `microbatches`: the pipeline fills and drains every minibatch, so the slowest stage's
/// `microbatches` slots become `microbatches + stages - 1`.
pub fn fill_and_drain(microbatches: usize, stages: usize) -> f64 {
    let m = microbatches.max(1) as f64;
    (m + stages.max(1) as f64 - 1.0) / m
}

/// The costs of a split, computed from the modules' measurements.
#[derive(Debug, Clone)]
pub struct CostModel {
    /// Prefix sums, so a range's totals cost O(1).
    compute: Vec<f64>,
    optimizer: Vec<f64>,
    params: Vec<f64>,
    activations: Vec<f64>,
    /// Each module's output bytes, for boundaries.
    outputs: Vec<f64>,
    pub network: Network,
    /// Bytes per worker; `None` for no limit.
    pub memory_limit: Option<f64>,
    /// The schedule the plan is for: how often replicas update, and what a minibatch costs.
    pub schedule: Schedule,
    /// The first measurement that is not a finite number, which [`crate::plan`] refuses (the
    /// prefix sums would hide a NaN as 0).
    not_finite: Option<String>,
}

/// The schedule a plan is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// The pipeline's steady state with one update (all-reduce and optimizer step) per minibatch,
    /// fill and drain left out: PipeDream's planner's figure, and the default.
    Steady,
    /// GPipe or 1F1B at `microbatches`: every minibatch fills and drains the pipeline, so each
    /// stage's compute and transfers stretch over `microbatches + stages - 1` microbatch slots
    /// ([`fill_and_drain`]); then each stage updates once (all-reduce, optimizer step).
    Flushing { microbatches: usize },
    /// PipeDream's asynchronous 1F1B at `microbatches` per minibatch: no flush, and each replica
    /// updates after each of its backwards, `microbatches / replicas` times per minibatch.
    PipeDream { microbatches: usize },
}

/// Prefix sums of measurements, a negative one (noise around nothing) counted as 0: a stage then
/// costs and holds no less for every module it adds, which the planner's program relies on.
fn prefix(values: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut sums = vec![0.0];
    for v in values {
        sums.push(sums.last().expect("starts with 0") + v.max(0.0));
    }
    sums
}

impl CostModel {
    pub fn new(layers: &[LayerCost], network: Network, memory_limit: Option<f64>) -> CostModel {
        CostModel {
            compute: prefix(layers.iter().map(|l| l.compute_s)),
            optimizer: prefix(layers.iter().map(|l| l.optimizer_s)),
            params: prefix(layers.iter().map(|l| l.param_bytes)),
            activations: prefix(layers.iter().map(|l| l.activation_bytes)),
            outputs: layers.iter().map(|l| l.output_bytes).collect(),
            network,
            memory_limit,
            schedule: Schedule::Steady,
            not_finite: layers.iter().enumerate().find_map(|(i, l)| {
                let fields = [
                    ("compute_s", l.compute_s),
                    ("activation_bytes", l.activation_bytes),
                    ("output_bytes", l.output_bytes),
                    ("param_bytes", l.param_bytes),
                    ("optimizer_s", l.optimizer_s),
                ];
                let (field, value) = fields.into_iter().find(|(_, v)| !v.is_finite())?;
                Some(format!("module {i}'s {field} is {value}"))
            }),
        }
    }

    /// Why the costs or the network cannot be planned over, if they cannot: a measurement that
    /// is not a finite number, a bandwidth that is not a finite number above 0, a memory limit
    /// that is not a number.
    pub fn invalid(&self) -> Option<String> {
        if let Some(problem) = &self.not_finite {
            return Some(format!("{problem}; the planner needs finite measurements"));
        }
        if self.network.levels.is_empty() {
            return Some("the network has no levels".into());
        }
        if let Some((i, (_, bandwidth))) = (self.network.levels.iter().enumerate())
            .find(|(_, (_, bandwidth))| !(bandwidth.is_finite() && *bandwidth > 0.0))
        {
            return Some(format!(
                "network level {i}'s bandwidth is {bandwidth} bytes/s; it must be a finite number above 0"
            ));
        }
        match self.memory_limit {
            Some(limit) if limit.is_nan() => Some("the memory limit is NaN".into()),
            _ => None,
        }
    }

    /// The same costs for `schedule`.
    pub fn with_schedule(mut self, schedule: Schedule) -> CostModel {
        self.schedule = schedule;
        self
    }

    /// Whether a stage may run on `replicas` workers under this schedule: PipeDream's replicas
    /// take a minibatch's microbatches in turn, so their count must divide the microbatches (the
    /// runtime refuses a plan whose does not).
    pub fn replicas_allowed(&self, replicas: usize) -> bool {
        match self.schedule {
            Schedule::PipeDream { microbatches } => replicas > 0 && microbatches.is_multiple_of(replicas),
            Schedule::Steady | Schedule::Flushing { .. } => true,
        }
    }

    /// How much a plan of `stages` stages stretches its stages' compute and transfers per
    /// minibatch: [`fill_and_drain`] under a flushing schedule, 1 otherwise.
    pub fn stretch(&self, stages: usize) -> f64 {
        match self.schedule {
            Schedule::Flushing { microbatches } => fill_and_drain(microbatches, stages),
            Schedule::Steady | Schedule::PipeDream { .. } => 1.0,
        }
    }

    /// Modules in the model.
    pub fn len(&self) -> usize {
        self.outputs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.outputs.is_empty()
    }

    fn sum(sums: &[f64], range: &Range<usize>) -> f64 {
        sums[range.end] - sums[range.start]
    }

    /// Seconds per minibatch of stage `modules` on `workers` (its replicas): they share the
    /// microbatches, all-reduce their gradients (a ring: 2 (r-1)/r of the parameters each way),
    /// and each steps the stage's parameters. The model charges the all-reduce after the backward,
    /// so the parts add.
    pub fn stage_time(&self, modules: &Range<usize>, workers: &Range<usize>) -> f64 {
        self.stage_parts(modules, workers).total()
    }

    /// [`CostModel::stage_time`] in its parts. Under PipeDream's schedule a replica updates
    /// after each of its backwards, so its all-reduce and step count once per microbatch it runs.
    pub fn stage_parts(&self, modules: &Range<usize>, workers: &Range<usize>) -> StageParts {
        let replicas = workers.len() as f64;
        let updates = match self.schedule {
            Schedule::PipeDream { microbatches } => (microbatches as f64 / replicas).max(1.0),
            Schedule::Steady | Schedule::Flushing { .. } => 1.0,
        };
        let allreduce_s = if workers.len() > 1 {
            let bytes = 2.0 * (replicas - 1.0) / replicas * Self::sum(&self.params, modules);
            updates * bytes / self.network.bandwidth(workers)
        } else {
            0.0
        };
        StageParts {
            compute_s: Self::sum(&self.compute, modules) / replicas,
            optimizer_s: updates * Self::sum(&self.optimizer, modules),
            allreduce_s,
        }
    }

    /// Seconds per minibatch to send module `last`'s output forward and its gradient back across
    /// the boundary from the stage on workers `from` to the next on `to`
    /// ([`Network::boundary_seconds_per_byte`]).
    pub fn boundary_time(&self, last: usize, from: &Range<usize>, to: &Range<usize>) -> f64 {
        self.outputs[last] * self.network.boundary_seconds_per_byte(from, to)
    }

    /// Bytes per minibatch that cross a cut right after module `last`.
    pub fn output_bytes(&self, last: usize) -> f64 {
        self.outputs[last]
    }

    /// Seconds per minibatch in steady state of `split` (module ranges with their replica
    /// counts, workers assigned in order), memory aside: the slowest stage or boundary.
    pub fn evaluate(&self, split: &[(Range<usize>, usize)]) -> f64 {
        self.stretched(split, 1.0)
    }

    /// What the planner minimises for `split`, memory aside: seconds per minibatch under the
    /// schedule, the slowest stage or boundary with compute and transfers stretched by
    /// [`CostModel::stretch`] and each stage's update once. The steady state's
    /// ([`CostModel::evaluate`]) but for a flushing schedule. One split can be judged by another's
    /// model with it.
    pub fn objective(&self, split: &[(Range<usize>, usize)]) -> f64 {
        self.stretched(split, self.stretch(split.len()))
    }

    fn stretched(&self, split: &[(Range<usize>, usize)], stretch: f64) -> f64 {
        let mut time: f64 = 0.0;
        let mut worker = 0;
        for (i, (modules, replicas)) in split.iter().enumerate() {
            let workers = worker..worker + replicas;
            time = time.max(self.stage_parts(modules, &workers).stretched(stretch));
            if let Some((_, next)) = split.get(i + 1) {
                let to = workers.end..workers.end + next;
                time = time.max(stretch * self.boundary_time(modules.end - 1, &workers, &to));
            }
            worker = workers.end;
        }
        time
    }

    /// Bytes one worker of the stage holds: weights, gradients and momentum, one stashed weight
    /// version per extra in-flight minibatch, and the activations of every in-flight minibatch.
    /// `in_flight` is the number of workers from this stage to the end divided by its replicas
    /// (PipeDream's 1F1B warm-up depth).
    pub fn stage_memory(&self, modules: &Range<usize>, replicas: usize, workers_from_here: usize) -> f64 {
        let in_flight = workers_from_here.div_ceil(replicas) as f64;
        let params = Self::sum(&self.params, modules);
        let activations = Self::sum(&self.activations, modules);
        params * (3.0 + (in_flight - 1.0)) + activations * in_flight
    }

    /// Whether the stage fits the memory limit.
    pub fn fits(&self, modules: &Range<usize>, replicas: usize, workers_from_here: usize) -> bool {
        self.memory_limit
            .is_none_or(|limit| self.stage_memory(modules, replicas, workers_from_here) <= limit)
    }
}
