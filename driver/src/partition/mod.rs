//! `driver plan`: reads a layer profile (`runtime profile`'s JSON, or PipeDream's `graph.txt`),
//! solves PipeDream's partitioning for the workers and network given, and writes the stage config
//! (or, for a PipeDream graph, the graph partitioned in PipeDream's format) with its predictions.

use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Serialize;
use stagehand_contract::{Profile, StageConfig};

use crate::config::Schedule;
use stagehand_planner::{
    alternatives, fill_and_drain, plan, CostModel, Graph, LayerCost, Network, Plan, Segment, MAX_LAYER_BYTES,
    MAX_LAYER_SECONDS,
};

/// What to plan for: the workers, their network and memory, and the schedule's microbatches.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// Workers (GPUs, or CPU ranks) to plan for.
    pub workers: usize,
    /// Network levels, innermost first: `(workers per group, bytes per second)`. The last level
    /// spans all workers.
    pub levels: Vec<(usize, f64)>,
    /// Memory per worker in bytes; `None` for no limit.
    pub memory_bytes: Option<f64>,
    /// Allow no replication: one worker per stage.
    pub straight: bool,
    /// Microbatches per minibatch; the profile's batch size is the microbatch's.
    pub microbatches: usize,
    /// How many runner-up plans (the best of each other stage shape) to predict as well.
    pub alternatives: usize,
    /// The schedule the plan is for; `None` plans the steady state with one update per minibatch.
    pub schedule: Option<Schedule>,
    /// Activations cross stage boundaries compressed (`--compress-activations`): float32 ones
    /// forward in float16, their gradients back as they are.
    pub compress_activations: bool,
}

impl PlanRequest {
    /// The microbatches of a flushing schedule (GPipe, 1F1B), if the plan is for one.
    pub fn flushing(&self) -> Option<usize> {
        flushes(self.schedule).then_some(self.microbatches)
    }

    /// The planner's view of the schedule.
    fn planner_schedule(&self) -> stagehand_planner::Schedule {
        let microbatches = self.microbatches;
        match self.schedule {
            None => stagehand_planner::Schedule::Steady,
            Some(Schedule::Gpipe | Schedule::OneFOneB) => {
                stagehand_planner::Schedule::Flushing { microbatches }
            }
            Some(Schedule::Pipedream) => stagehand_planner::Schedule::PipeDream { microbatches },
        }
    }
}

/// Whether `schedule` flushes the pipeline every minibatch (GPipe, 1F1B), so a plan for it is
/// judged with fill and drain.
fn flushes(schedule: Option<Schedule>) -> bool {
    matches!(schedule, Some(Schedule::Gpipe | Schedule::OneFOneB))
}

/// A validated `driver plan` request.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionOptions {
    /// The profile: JSON written by `runtime profile`, or PipeDream's `graph.txt`.
    pub profile: PathBuf,
    /// What to plan for.
    pub request: PlanRequest,
    /// Where to write the stage config (PipeDream's JSON), or for a PipeDream graph the graph with
    /// each node's `stage_id`; stdout when `None`.
    pub output: Option<PathBuf>,
    /// Where to write the predictions as JSON, if anywhere.
    pub prediction: Option<PathBuf>,
    /// Also print each stage's parts of the predicted time.
    pub explain: bool,
}

/// Why planning failed; each says what to change.
#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    #[error("cannot read the profile {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Profile { path: PathBuf, reason: String },
    #[error(transparent)]
    Plan(#[from] stagehand_planner::PlanError),
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The predictions written beside the stage config.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub model: String,
    /// Samples per microbatch (the profile's batch size; null for a PipeDream graph, which does
    /// not record it).
    pub batch_size: Option<usize>,
    pub workers: usize,
    /// The schedule planned for (null: the steady state with one update per minibatch).
    pub schedule: Option<Schedule>,
    /// Seconds per minibatch in steady state (the slowest stage or boundary; PipeDream's figure).
    pub time_per_minibatch_s: f64,
    /// Seconds per minibatch with GPipe or 1F1B at `microbatches` (fill and drain included).
    pub flushing_time_per_minibatch_s: f64,
    pub microbatches: usize,
    /// Seconds per minibatch of pure data parallelism on the same workers (null if it does not fit).
    pub data_parallel_time_s: Option<f64>,
    /// Data parallelism's time over the plan's (null if data parallelism does not fit).
    pub speedup_over_data_parallel: Option<f64>,
    pub stages: Vec<PredictedStage>,
    /// The runner-ups `--alternatives` asked for, fastest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub alternatives: Vec<Alternative>,
    /// Whether activations were planned to cross compressed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub compress_activations: bool,
}

/// One runner-up plan: the best split of another stage shape.
#[derive(Debug, Clone, Serialize)]
pub struct Alternative {
    pub time_per_minibatch_s: f64,
    pub flushing_time_per_minibatch_s: f64,
    pub stages: Vec<PredictedStage>,
    /// Its stage config, to run it (for the runtime's profiles; null for a PipeDream graph).
    pub stage_config: Option<StageConfig>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PredictedStage {
    /// The stage's units: the runtime's modules, or the segments of a PipeDream graph.
    pub first_module: usize,
    pub end_module: usize,
    /// The names of its first and last: modules, or PipeDream node ids with their layers.
    pub first: String,
    pub last: String,
    pub replicas: usize,
    pub time_s: f64,
    pub memory_bytes: f64,
}

/// The profile's modules as the planner's costs per minibatch of `microbatches` microbatches of
/// the profile's batch size: forward, backward and boundary traffic happen once per microbatch,
/// the optimizer step once per minibatch.
pub fn layer_costs(profile: &Profile, microbatches: usize, compress_activations: bool) -> Vec<LayerCost> {
    let m = microbatches.max(1) as f64;
    profile
        .modules
        .iter()
        .map(|module| {
            let full = module.activation_bytes as f64;
            // The planner moves a boundary's bytes forward and as many back: a compressed
            // activation goes forward in its compressed size and its gradient comes back whole,
            // so the boundary carries their mean each way.
            let crossing = match module.compressed_activation_bytes {
                Some(compressed) if compress_activations => (compressed as f64 + full) / 2.0,
                _ => full,
            };
            LayerCost {
                compute_s: m * (module.forward_s + module.backward_s),
                activation_bytes: m * full,
                output_bytes: m * crossing,
                param_bytes: module.param_bytes as f64,
                optimizer_s: module.optimizer_s,
            }
        })
        .collect()
}

/// What `driver plan` plans over.
#[derive(Debug, Clone)]
pub enum Source {
    /// The runtime's modules, from `runtime profile`.
    Runtime(Profile),
    /// A PipeDream profile graph, as the chain of its cuts the runtime can make.
    PipeDream {
        /// The file's name, as the model's.
        name: String,
        graph: Graph,
        chain: Vec<Segment>,
    },
}

impl Source {
    /// Reads `path`: a JSON profile when it starts with `{`, PipeDream's graph otherwise.
    pub fn read(path: &std::path::Path) -> Result<Source, PartitionError> {
        let text = std::fs::read_to_string(path).map_err(|source| PartitionError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |reason: String| PartitionError::Profile {
            path: path.to_path_buf(),
            reason,
        };
        if text.trim_start().starts_with('{') {
            let profile =
                Profile::from_json(&text).map_err(|e| invalid(explain_json_number(&text).unwrap_or(e)))?;
            check_profile(&profile).map_err(invalid)?;
            return Ok(Source::Runtime(profile));
        }
        // Neither form: say so, rather than what a graph.txt line lacks.
        if !text.lines().any(|l| l.contains(" -- ")) {
            return Err(invalid(
                "it is neither a profile `runtime profile` writes (JSON, starting with `{`) nor \
                 PipeDream's graph.txt (lines `<id> -- <description> -- <measurements>`)"
                    .into(),
            ));
        }
        let read = |e: stagehand_planner::GraphError| invalid(format!("as PipeDream's graph.txt: {e}"));
        let graph = Graph::parse(&text).map_err(read)?;
        let chain = graph.chain().map_err(read)?;
        let compute_s = chain.iter().map(|s| s.cost.compute_s).sum();
        check_some_compute(compute_s, "nodes' forward_compute_time and backward_compute_time")
            .map_err(|e| invalid(format!("as PipeDream's graph.txt: {e}")))?;
        let name = path
            .parent()
            .and_then(|p| p.file_name())
            .filter(|_| path.file_name().is_some_and(|f| f == "graph.txt"))
            .or(path.file_stem())
            .map_or_else(|| "graph".to_string(), |n| n.to_string_lossy().into_owned());
        Ok(Source::PipeDream { name, graph, chain })
    }

    fn model(&self) -> &str {
        match self {
            Source::Runtime(profile) => &profile.model,
            Source::PipeDream { name, .. } => name,
        }
    }

    fn batch_size(&self) -> Option<usize> {
        match self {
            Source::Runtime(profile) => Some(profile.batch_size),
            Source::PipeDream { .. } => None,
        }
    }

    /// The planner's units at `microbatches` microbatches of the profiled batch (PipeDream's
    /// graphs know no compression).
    fn costs(&self, microbatches: usize, compress_activations: bool) -> Vec<LayerCost> {
        match self {
            Source::Runtime(profile) => layer_costs(profile, microbatches, compress_activations),
            Source::PipeDream { chain, .. } => {
                let m = microbatches.max(1) as f64;
                chain
                    .iter()
                    .map(|s| LayerCost {
                        compute_s: m * s.cost.compute_s,
                        activation_bytes: m * s.cost.activation_bytes,
                        output_bytes: m * s.cost.output_bytes,
                        ..s.cost.clone()
                    })
                    .collect()
            }
        }
    }

    /// Unit `i`'s first or last name: a module's, or a PipeDream node's id and layer.
    fn name(&self, i: usize, last: bool) -> String {
        match self {
            Source::Runtime(profile) => profile.modules.get(i).map_or("?".into(), |m| m.name.clone()),
            Source::PipeDream { graph, chain, .. } => chain
                .get(i)
                .and_then(|s| if last { s.nodes.last() } else { s.nodes.first() })
                .map_or("?".into(), |&n| {
                    let node = &graph.nodes[n];
                    let layer = node.description.split('(').next().unwrap_or_default();
                    format!("{} {layer}", node.id)
                }),
        }
    }

    /// What `--output` holds: the stage config, or the graph with each node's stage.
    fn output(&self, plan: &Plan) -> String {
        match self {
            Source::Runtime(_) => {
                serde_json::to_string_pretty(&plan.stage_config()).expect("stage configs serialize") + "\n"
            }
            Source::PipeDream { graph, chain, .. } => {
                let mut stage_of = vec![0; graph.nodes.len()];
                for (id, stage) in plan.stages.iter().enumerate() {
                    for segment in &chain[stage.modules.clone()] {
                        for &node in &segment.nodes {
                            stage_of[node] = id;
                        }
                    }
                }
                graph.with_stages(&stage_of)
            }
        }
    }
}

/// Whether `profile`'s measurements can be planned over: every time a finite number of seconds
/// from 0 to [`MAX_LAYER_SECONDS`], every size at most [`MAX_LAYER_BYTES`], the modules numbered
/// 0, 1, 2, ... in order (as `runtime profile` writes them; the stage config maps modules by
/// position), and some time to balance. The reason names the module and the field, and says
/// what is allowed.
pub fn check_profile(profile: &Profile) -> Result<(), String> {
    if profile.modules.is_empty() {
        return Err("it lists no modules; `runtime profile` writes one entry per module of the model".into());
    }
    for (i, module) in profile.modules.iter().enumerate() {
        let at = format!("modules[{i}] (`{}`)", module.name);
        if module.index != i {
            let reason = match profile.modules[..i].iter().position(|m| m.index == module.index) {
                Some(j) => format!(
                    "index {} repeats modules[{j}]'s (`{}`)",
                    module.index, profile.modules[j].name
                ),
                None => format!("index {}, not {i}", module.index),
            };
            return Err(format!(
                "{at}: {reason}; `runtime profile` numbers the modules 0, 1, 2, ... in order, each its \
                 position in the list"
            ));
        }
        let times = [
            ("forward_s", module.forward_s),
            ("backward_s", module.backward_s),
            ("optimizer_s", module.optimizer_s),
        ];
        if let Some((field, value)) = times
            .into_iter()
            .find(|(_, v)| !(0.0..=MAX_LAYER_SECONDS).contains(v))
        {
            // 1e300 as 1e300, not its 301 digits.
            let value = match value.abs() {
                v if v >= 1e9 || (v > 0.0 && v < 1e-6) => format!("{value:e}"),
                _ => value.to_string(),
            };
            return Err(format!(
                "{at}: {field} is {value}; times must be finite numbers of seconds from 0 to 1e6 \
                 (eleven and a half days)"
            ));
        }
        let sizes = [
            ("activation_bytes", Some(module.activation_bytes)),
            ("compressed_activation_bytes", module.compressed_activation_bytes),
            ("param_bytes", Some(module.param_bytes)),
        ];
        if let Some((field, Some(value))) = sizes
            .into_iter()
            .find(|(_, v)| v.is_some_and(|v| v as f64 > MAX_LAYER_BYTES))
        {
            return Err(format!(
                "{at}: {field} is {value}; sizes must be bytes from 0 to 2^50 (a pebibyte)"
            ));
        }
    }
    let compute_s = profile.modules.iter().map(|m| m.forward_s + m.backward_s).sum();
    check_some_compute(compute_s, "modules' forward_s and backward_s")
}

/// A profile whose times add up to nothing has nothing to balance, and its plan's speedup over
/// data parallelism would be 0 / 0: refused. A model's forward and backward take at least a
/// nanosecond; below that the planner's times could round to 0.
fn check_some_compute(seconds: f64, what: &str) -> Result<(), String> {
    match seconds >= 1e-9 {
        true => Ok(()),
        false => Err(format!(
            "its {what} add up to {seconds} s; a model's forward and backward take time (at least \
             a nanosecond): is this a measured profile?"
        )),
    }
}

/// Why `text` is not JSON, where that is a number JSON cannot hold (`NaN`, `Infinity`, as
/// Python's json module writes them; or beyond f64, as `1e400`): the line and column, the field
/// and what is allowed.
fn explain_json_number(text: &str) -> Option<String> {
    let error = serde_json::from_str::<serde_json::Value>(text).err()?;
    let line = text.lines().nth(error.line().checked_sub(1)?)?;
    let upto = line.get(..error.column().min(line.len()))?;
    // The value the error is in: after the last `:` before the error, up to the next delimiter.
    let colon = upto.rfind(':')?;
    let value = line[colon + 1..]
        .split([',', '}', ']'])
        .next()
        .unwrap_or_default()
        .trim();
    let number_like = value.starts_with(|c: char| c == '-' || c == '+' || c.is_ascii_digit())
        || ["NaN", "Infinity"].iter().any(|t| value.starts_with(t));
    if !number_like || value.parse::<f64>().is_ok_and(f64::is_finite) {
        return None;
    }
    let key = line[..colon].trim_end().trim_end_matches('"');
    let key = &key[key.rfind('"')? + 1..];
    Some(format!(
        "line {} column {}: {key} is `{value}`, not a number JSON can hold; times must be finite \
         numbers of seconds from 0 to 1e6, sizes bytes from 0 to 2^50",
        error.line(),
        error.column()
    ))
}

/// Reads a profile JSON file.
pub fn read_profile(path: &std::path::Path) -> Result<Profile, PartitionError> {
    match Source::read(path)? {
        Source::Runtime(profile) => Ok(profile),
        Source::PipeDream { .. } => Err(PartitionError::Profile {
            path: path.to_path_buf(),
            reason: "a PipeDream graph plans over PipeDream's layers, not the runtime's modules; \
                     profile the model with `runtime profile` (or let config_file: auto do it)"
                .into(),
        }),
    }
}

/// Reads the profile and solves.
pub fn solve(options: &PartitionOptions) -> Result<(Source, Plan, Prediction), PartitionError> {
    let source = Source::read(&options.profile)?;
    if options.request.compress_activations {
        let checked = match &source {
            Source::Runtime(profile) => compressible(profile),
            Source::PipeDream { .. } => Err(NOT_COMPRESSIBLE.into()),
        };
        checked.map_err(|reason| PartitionError::Profile {
            path: options.profile.clone(),
            reason,
        })?;
    }
    let (plan, prediction) = solve_source(&source, &options.request)?;
    Ok((source, plan, prediction))
}

/// Whether `profile` says what its activations weigh compressed, which profiles taken before it
/// was recorded do not (nor do PipeDream's graphs, which [`solve`] refuses alike).
pub fn compressible(profile: &Profile) -> Result<(), String> {
    match profile
        .modules
        .iter()
        .all(|m| m.compressed_activation_bytes.is_some())
    {
        true => Ok(()),
        false => Err(NOT_COMPRESSIBLE.into()),
    }
}

const NOT_COMPRESSIBLE: &str = "it does not record what activations weigh compressed, which \
                                --compress-activations plans for; profile with this version's \
                                `runtime profile`";

/// Solves PipeDream's partitioning of `profile` for `request`.
pub fn solve_profile(
    profile: &Profile,
    request: &PlanRequest,
) -> Result<(Plan, Prediction), stagehand_planner::PlanError> {
    solve_source(&Source::Runtime(profile.clone()), request)
}

fn solve_source(
    source: &Source,
    request: &PlanRequest,
) -> Result<(Plan, Prediction), stagehand_planner::PlanError> {
    let network = Network {
        levels: request.levels.clone(),
    };
    let model = CostModel::new(
        &source.costs(request.microbatches, request.compress_activations),
        network,
        request.memory_bytes,
    )
    .with_schedule(request.planner_schedule());
    let plan = plan(&model, request.workers, request.straight)?;
    let predicted = |plan: &Plan| -> Vec<PredictedStage> {
        plan.stages
            .iter()
            .map(|s| PredictedStage {
                first_module: s.modules.start,
                end_module: s.modules.end,
                first: source.name(s.modules.start, false),
                last: source.name(s.modules.end - 1, true),
                replicas: s.replicas,
                time_s: s.time_s,
                memory_bytes: s.memory_bytes,
            })
            .collect()
    };
    let runner_ups = if request.straight {
        Vec::new()
    } else {
        alternatives(&model, request.workers, &plan, request.alternatives)
    };
    let prediction = Prediction {
        model: source.model().to_string(),
        batch_size: source.batch_size(),
        workers: request.workers,
        schedule: request.schedule,
        time_per_minibatch_s: plan.time_per_minibatch,
        flushing_time_per_minibatch_s: plan.flushing_time(request.microbatches),
        microbatches: request.microbatches,
        data_parallel_time_s: plan.data_parallel_time,
        speedup_over_data_parallel: plan.speedup(),
        stages: predicted(&plan),
        compress_activations: request.compress_activations,
        alternatives: runner_ups
            .iter()
            .map(|p| Alternative {
                time_per_minibatch_s: p.time_per_minibatch,
                flushing_time_per_minibatch_s: p.flushing_time(request.microbatches),
                stages: predicted(p),
                stage_config: matches!(source, Source::Runtime(_)).then(|| p.stage_config()),
            })
            .collect(),
    };
    Ok((plan, prediction))
}

/// The plan as a table for people.
pub fn render(profile: &Profile, plan: &Plan, prediction: &Prediction) -> String {
    render_source(&Source::Runtime(profile.clone()), plan, prediction)
}

/// `first` to `last` (both included) of the things a `unit` counts, for people: `rank 2`,
/// `ranks 0-3`.
fn span(unit: &str, first: usize, last: usize) -> String {
    match first == last {
        true => format!("{unit} {first}"),
        false => format!("{unit}s {first}-{last}"),
    }
}

pub fn render_source(source: &Source, plan: &Plan, prediction: &Prediction) -> String {
    let mut out = String::new();
    let (units, batch) = match source {
        Source::Runtime(profile) => (
            "module",
            format!("{} in {}", profile.batch_size, profile.arithmetic()),
        ),
        Source::PipeDream { .. } => ("segment", "PipeDream's profiled batch".to_string()),
    };
    let compressed = match prediction.compress_activations {
        true => ", activations sent in fp16",
        false => "",
    };
    let _ = writeln!(
        out,
        "{} at {} microbatches of {batch} on {} workers{compressed}:",
        source.model(),
        prediction.microbatches,
        prediction.workers
    );
    let mut worker = 0;
    for (id, s) in plan.stages.iter().enumerate() {
        let (first, last) = (s.modules.start, s.modules.end - 1);
        let (from, to) = (source.name(first, false), source.name(last, true));
        let names = match from == to {
            true => from,
            false => format!("{from} .. {to}"),
        };
        let _ = writeln!(
            out,
            "  stage {id}: {} ({names}) on {} worker(s) ({}), {:.1} ms, {:.2} GiB per worker",
            span(units, first, last),
            s.replicas,
            span("rank", worker, worker + s.replicas - 1),
            s.time_s * 1e3,
            s.memory_bytes / (1u64 << 30) as f64
        );
        worker += s.replicas;
    }
    let _ = writeln!(
        out,
        "predicted time per minibatch: {:.1} ms steady state, {:.1} ms with GPipe/1F1B at {} microbatches",
        prediction.time_per_minibatch_s * 1e3,
        prediction.flushing_time_per_minibatch_s * 1e3,
        prediction.microbatches
    );
    let _ = match (
        prediction.data_parallel_time_s,
        prediction.speedup_over_data_parallel,
    ) {
        (Some(dp), Some(speedup)) => writeln!(
            out,
            "pure data parallelism: {:.1} ms per minibatch; predicted speedup {speedup:.2}x",
            dp * 1e3
        ),
        _ => writeln!(out, "pure data parallelism does not fit in memory"),
    };
    if !prediction.alternatives.is_empty() {
        let _ = writeln!(out, "runner-ups, the best split of each other shape:");
        // Compared by what the planner minimised: with fill and drain for GPipe and 1F1B.
        let flushing = flushes(prediction.schedule);
        for a in &prediction.alternatives {
            let shape: Vec<String> = a.stages.iter().map(|s| s.replicas.to_string()).collect();
            let (steady, with_flush) = (
                a.time_per_minibatch_s / prediction.time_per_minibatch_s,
                a.flushing_time_per_minibatch_s / prediction.flushing_time_per_minibatch_s,
            );
            let _ = match flushing {
                false => writeln!(
                    out,
                    "  {:<12} {:.1} ms steady state ({steady:.2}x the plan's), {:.1} ms with GPipe/1F1B",
                    shape.join("-"),
                    a.time_per_minibatch_s * 1e3,
                    a.flushing_time_per_minibatch_s * 1e3
                ),
                true => writeln!(
                    out,
                    "  {:<12} {:.1} ms steady state, {:.1} ms with GPipe/1F1B ({with_flush:.2}x the plan's)",
                    shape.join("-"),
                    a.time_per_minibatch_s * 1e3,
                    a.flushing_time_per_minibatch_s * 1e3
                ),
            };
        }
    }
    out
}

/// Why the plan predicts what it does: per stage, what one worker spends per minibatch on
/// compute, the optimizer, the all-reduce and the transfer to the next stage, as milliseconds and
/// as shares of the predicted time; the part that sets it is marked. For a flushing schedule
/// (`flushing`: its microbatches) compute and transfers stretch over the pipeline's fill and
/// drain, and the prediction is the time with them.
pub fn explain(plan: &Plan, flushing: Option<usize>) -> String {
    let mut out = String::new();
    let (time, stretch) = match flushing {
        Some(m) => (plan.flushing_time(m), fill_and_drain(m, plan.stages.len())),
        None => (plan.time_per_minibatch, 1.0),
    };
    let share = |s: f64| format!("({:.0}%)", 100.0 * s / time);
    let part = |name: &str, s: f64| format!("{name} {:.1} ms {}", s * 1e3, share(s));
    // Compute and transfers, stretched by fill and drain where the schedule flushes.
    let spread = |name: &str, s: f64| match flushing {
        Some(_) => format!("{name} {:.1} ms x {stretch:.2} {}", s * 1e3, share(s * stretch)),
        None => part(name, s),
    };
    // A stage or a transfer sets the time; its parts only add up to it.
    let sets = |text: String, s: f64| {
        let mark = if s >= time * (1.0 - 1e-9) {
            " <- bottleneck"
        } else {
            ""
        };
        format!("{text}{mark}")
    };
    let _ = match flushing {
        Some(m) => writeln!(
            out,
            "why: per minibatch, each worker of a stage spends (share of the predicted {:.1} ms with \
             GPipe/1F1B at {m} microbatches, whose fill and drain stretch compute and transfers \
             x {stretch:.2}):",
            time * 1e3
        ),
        None => writeln!(
            out,
            "why: per minibatch, each worker of a stage spends (share of the predicted {:.1} ms):",
            time * 1e3
        ),
    };
    for (id, s) in plan.stages.iter().enumerate() {
        let parts = [
            spread("compute", s.parts.compute_s),
            part("optimizer", s.parts.optimizer_s),
            part("all-reduce", s.parts.allreduce_s),
        ];
        let mut line = format!("  stage {id}: {}", parts.join(" + "));
        let total = s.parts.stretched(stretch);
        let _ = write!(line, " = {}", sets(part("stage", total), total));
        if let Some(t) = s.transfer_s {
            let text = spread(&format!("transfer to stage {}", id + 1), t);
            let _ = write!(line, "; {}", sets(text, t * stretch));
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "the slowest stage or transfer sets the time; a stage's parts add, transfers overlap with compute"
    );
    out
}

/// Runs `driver plan`: writes the stage config (or prints it) and the predictions, and prints
/// the plan for people on stderr.
pub fn run(options: &PartitionOptions) -> Result<(), PartitionError> {
    let (source, plan, prediction) = solve(options)?;
    let config = source.output(&plan);
    match &options.output {
        Some(path) => std::fs::write(path, &config).map_err(|source| PartitionError::Write {
            path: path.clone(),
            source,
        })?,
        None => stdout_text!("{config}"),
    }
    if let Some(path) = &options.prediction {
        let text = serde_json::to_string_pretty(&prediction).expect("predictions serialize") + "\n";
        std::fs::write(path, text).map_err(|source| PartitionError::Write {
            path: path.clone(),
            source,
        })?;
    }
    stderr_text!("{}", render_source(&source, &plan, &prediction));
    if options.explain {
        stderr_text!("{}", explain(&plan, options.request.flushing()));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
