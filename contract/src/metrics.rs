//! The metrics line format: one JSON object per line on a rank's stdout, tagged by `event`.
//!
//! Documented for users in `docs/metrics.md`. Fields are only ever added (with a serde default so
//! older lines still parse); a change of meaning bumps [`SCHEMA_VERSION`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Version of the metrics line format, carried by every `start` event.
pub const SCHEMA_VERSION: u32 = 1;

/// One line of a rank's stdout.
// `Start` is the largest variant by far (it holds the whole run configuration), but events are
// handled a line at a time (the driver keeps no list of them), so the size of the enum costs no
// memory worth having back by boxing it.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// Printed once, before the first iteration.
    Start(Start),
    /// Printed after every training iteration (one optimizer step).
    Iteration(Iteration),
    /// Printed once, after the last iteration.
    Summary(Summary),
    /// With `--validate-every`: a pass over the held-out split, after every that many iterations
    /// and after the last (last stage only).
    Validation(Validation),
    /// With `--trace`: the weights one microbatch's forward and backward used on one rank.
    Trace(Trace),
    /// With `--trace`: one point-to-point operation a rank issued, in issue order.
    P2p(P2p),
    /// Printed as a rank fails because the peer of a point-to-point operation did not answer
    /// within `--comm-timeout`.
    PeerSilent(PeerSilent),
}

impl Event {
    /// Parses one stdout line. Lines that are not metrics events give `None`, so a consumer can
    /// treat them as plain log output.
    pub fn parse_line(line: &str) -> Option<Event> {
        let line = line.trim();
        if !line.starts_with('{') {
            return None;
        }
        serde_json::from_str(line).ok()
    }

    /// Renders the event as one line of JSON, without the trailing newline.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("metrics events always serialize")
    }
}

/// The configuration a rank resolved from its arguments and environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Model name as given to `--model`.
    pub model: String,
    /// Samples per iteration for this rank's pipeline (the minibatch).
    pub batch_size: usize,
    /// Iterations (optimizer steps) to run.
    pub iterations: u64,
    /// Learning rate.
    pub lr: f64,
    /// `sgd` or `adam`.
    pub optimizer: String,
    /// Seed for parameters and synthetic data.
    pub seed: u64,
    /// Data source, as given to `--data`.
    pub data: String,
    /// How the images were transformed (`--augment`): `crop-flip` or `none`; absent for
    /// synthetic data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub augment: Option<String>,
    /// Threads decoding an image folder's images (`--data-workers`); absent for other data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_workers: Option<usize>,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Intra-op threads used by libtorch.
    pub threads: usize,
    /// Pipeline schedule (`none` for a single stage).
    #[serde(default = "default_schedule")]
    pub schedule: String,
    /// Microbatches per minibatch.
    #[serde(default = "one")]
    pub microbatches: usize,
    /// `fp32`, `bf16` or `fp16` (autocast).
    #[serde(default = "fp32")]
    pub precision: String,
    /// fp16: the gradient scaler's first loss scale (`--fp16-init-scale`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16_init_scale: Option<f64>,
    /// Parameters and image inputs in channels_last layout.
    #[serde(default)]
    pub channels_last: bool,
    /// Each training step replayed from a CUDA graph captured once (`--cuda-graph`).
    #[serde(default)]
    pub cuda_graph: bool,
    /// Deterministic algorithms only (`--deterministic`): the run repeats bit for bit on the same
    /// device.
    #[serde(default)]
    pub deterministic: bool,
    /// cuDNN picked convolution algorithms by timing them (`--cudnn-benchmark`).
    #[serde(default)]
    pub cudnn_benchmark: bool,
    /// The runtime's own fused CUDA kernels ran where the layers suited them (`--fused-kernels`).
    #[serde(default)]
    pub fused_kernels: bool,
    /// Where this rank wrote a Chrome trace of PyTorch's profiler (`--profiler-trace`); absent
    /// when it wrote none. Recording slows the iterations it records (`profiled` on their
    /// lines), which the throughput statistics leave out while others remain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiler_trace: Option<PathBuf>,
    /// How many iterations that trace records (`--profiler-steps`): from the first after the
    /// warm-up (under `--cuda-graph`, the first replayed one), fewer where the run ended first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiler_steps: Option<u64>,
    /// What became of host memory a step freed (`--host-memory`): `keep` (reused by the next
    /// iteration), `release` (glibc's defaults; what runtimes before the option did), or
    /// `environment` (the environment's malloc settings).
    #[serde(default = "release")]
    pub host_memory: String,
    /// Replicas all-reduce gradients in buckets of at most this many MiB (`--bucket-mb`).
    #[serde(default = "default_bucket_mb")]
    pub bucket_mb: f64,
    /// Buckets are all-reduced during the backward pass (`--overlap-reduce on`).
    #[serde(default = "yes")]
    pub overlap_reduce: bool,
    /// float32 activations cross stages as float16 (`--compress-activations`).
    #[serde(default)]
    pub compress_activations: bool,
    /// Sparse transfers (`--compress`): `auto` (each message in its smallest form) or `off`.
    #[serde(default = "off")]
    pub compress: String,
    /// The groups messages between stages travel on (`--p2p-groups`): `world` (one per direction
    /// over every rank) or `pairs` (one per pair of neighbouring ranks and direction); absent in
    /// records of runtimes before the option, which used `world`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p2p_groups: Option<String>,
    /// How replicas combine (`--reduce`): `all`, or `partial:K` (the first K ready).
    #[serde(default = "all")]
    pub reduce: String,
    /// With a partial reduce, every this many groups is every live replica (`--sync-every`).
    #[serde(default)]
    pub sync_every: Option<usize>,
    /// How the learning rate changes: `constant`, `step`, `polynomial` or `exponential`.
    #[serde(default = "constant")]
    pub lr_policy: String,
    /// Epochs of linear warm-up before the policy.
    #[serde(default)]
    pub lr_warmup_epochs: u64,
    /// Iterations per epoch, when the learning rate depends on it.
    #[serde(default)]
    pub epoch_iterations: Option<u64>,
    /// A validation pass ran after every this many iterations and after the last
    /// (`--validate-every`); absent when none ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validate_every: Option<u64>,
    /// Minibatches of the held-out split each validation pass ran (`--validation-batches`, or
    /// as many whole ones as the split holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_batches: Option<u64>,
}

fn all() -> String {
    "all".into()
}

fn release() -> String {
    "release".into()
}

fn off() -> String {
    "off".into()
}

fn constant() -> String {
    "constant".into()
}

fn default_bucket_mb() -> f64 {
    25.0
}

fn yes() -> bool {
    true
}

fn fp32() -> String {
    "fp32".to_string()
}

fn default_schedule() -> String {
    "none".to_string()
}

fn one() -> usize {
    1
}

/// The `start` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Start {
    /// Version of this format; see [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// The pipeline stage this rank runs.
    pub stage: usize,
    /// Number of pipeline stages.
    pub num_stages: usize,
    /// Modules in the whole model, the loss included.
    pub num_modules: usize,
    /// Parameters in the whole model.
    pub num_params: u64,
    /// Index of the first module this rank runs.
    pub first_module: usize,
    /// One past the index of the last module this rank runs.
    pub end_module: usize,
    /// Parameters held by this rank.
    pub stage_params: u64,
    /// The iteration training starts at: the iterations done of the checkpoint the rank resumed
    /// from (`--resume`), 0 when it starts afresh (absent then). Equal to `config.iterations`
    /// where the checkpoint had done them all and nothing is left to run.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_iteration: u64,
    /// The resolved configuration.
    pub config: RunConfig,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The `iteration` event: what one rank did during one optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Iteration {
    /// Iteration index, from 0.
    pub iteration: u64,
    /// This process's rank.
    pub rank: usize,
    /// The pipeline stage this rank runs.
    pub stage: usize,
    /// Mean loss over the iteration's samples; only the last stage knows it, others print `null`.
    pub loss: Option<f64>,
    /// Top-1 accuracy of the training samples' logits against their targets, averaged over the
    /// iteration's microbatches as `loss` is; only the last stage knows it, others print `null`
    /// (absent, read as `null`, from runtimes before it).
    #[serde(default)]
    pub accuracy: Option<f64>,
    /// Top-5 accuracy, as `accuracy`: the share of targets whose class is among the five highest
    /// logits. Class logits only (the image models and the MLP); the transformer's per-token
    /// figure is top-1 alone, and it prints `null` (absent, read as `null`, from runtimes before
    /// it).
    #[serde(default)]
    pub accuracy_top5: Option<f64>,
    /// The learning rate this iteration's steps used.
    #[serde(default)]
    pub lr: Option<f64>,
    /// Samples that went through the whole pipeline in this iteration.
    pub samples: u64,
    /// Wall-clock seconds of the iteration.
    pub time_s: f64,
    /// `samples / time_s`.
    pub samples_per_sec: f64,
    /// Seconds spent in forward, backward and optimizer work.
    pub compute_s: f64,
    /// Seconds spent waiting for communication to complete.
    pub comm_wait_s: f64,
    /// Seconds neither computing nor waiting on a transfer (pipeline bubbles).
    pub idle_s: f64,
    /// Peak memory of this rank's device so far, in bytes: on CUDA the caching allocator's peak
    /// allocated bytes, on the CPU the host's peak resident set.
    pub peak_mem_bytes: Option<u64>,
    /// The host's peak resident set so far, in bytes (every device).
    #[serde(default)]
    pub host_peak_rss_bytes: Option<u64>,
    /// The CUDA caching allocator's peak allocated bytes on this rank's device so far (CUDA only).
    #[serde(default)]
    pub gpu_peak_allocated_bytes: Option<u64>,
    /// The CUDA caching allocator's peak reserved bytes (allocated plus its cache) so far.
    #[serde(default)]
    pub gpu_peak_reserved_bytes: Option<u64>,
    /// The replicas' gradient all-reduce (zero on a stage without replicas).
    #[serde(default)]
    pub reduce: ReduceMetrics,
    /// Bytes this rank sent to other stages in the iteration (activations, gradients, targets),
    /// compressed forms and their headers included (`--compress auto`).
    #[serde(default)]
    pub sent_bytes: u64,
    /// The same messages' bytes as dense tensors: `sent_bytes` without compression.
    #[serde(default)]
    pub sent_dense_bytes: u64,
    /// With `--reduce partial:K`, the group this rank's step combined in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_reduce: Option<PartialGroup>,
    /// With `--precision fp16`: the gradient scaler's loss scale after this iteration's step
    /// (what `torch.amp.GradScaler.get_scale()` returns then; the same on every rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// With `--precision fp16`: whether this iteration's step was skipped because some rank's
    /// gradients held an inf or a nan (every rank skips it; the scale is halved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_skipped: Option<bool>,
    /// With `--checkpoint-dir`: a whole checkpoint of the `iteration + 1` iterations done was
    /// written after this iteration (absent when none was).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpointed: bool,
    /// With `--profiler-trace`: PyTorch's profiler recorded this iteration, or the iteration
    /// waited on the trace being written (the first after the traced ones), so its time is
    /// slowed by the profiler; throughput statistics leave it out (absent when neither).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub profiled: bool,
}

/// One step's group of a partial reduce (`--reduce partial:K`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartialGroup {
    /// The group's index in its stage's sequence of groups (the same on every member).
    pub index: u64,
    /// Its members' ranks, ascending.
    pub members: Vec<usize>,
    /// A full group: every live replica (every `sync_every`-th).
    pub full: bool,
    /// Largest |parameter - the members' mean| of this rank after its step, before the average
    /// (0 while the replicas are one model).
    pub drift: f64,
    /// Largest |parameter change| of this rank's local optimizer step (0 while the replicas are
    /// one model).
    pub update: f64,
    /// Seconds waiting for the group to fill (part of `comm_wait_s`).
    pub wait_s: f64,
}

/// What the gradient all-reduce of one iteration's steps did on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ReduceMetrics {
    /// Buckets all-reduced.
    pub buckets: u64,
    /// Of those, buckets whose all-reduce started before the backward pass ended.
    pub buckets_early: u64,
    /// Seconds from the first bucket started during the backward to the backward's end: the
    /// all-reduce that could run behind compute (part of `compute_s`).
    pub overlap_s: f64,
    /// Seconds the step spent on the all-reduce after the backward (starting the remaining
    /// buckets, waiting, copying the sums back): the exposed part (part of `comm_wait_s`).
    pub wait_s: f64,
    /// Bytes this rank sent for it: exact for the point-to-point messages of bundles, and for
    /// each all-reduce what a ring all-reduce sends, 2(n-1)/n of the buffer.
    #[serde(default)]
    pub sent_bytes: u64,
}

/// The mean and the sample standard deviation (n - 1; 0 for fewer than two values) of
/// per-iteration throughputs: what a rank's `summary` reports and the driver's record of the job,
/// so the two agree. `(0, 0)` for none.
pub fn mean_and_std(values: &[f64]) -> (f64, f64) {
    let n = values.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, 0.0);
    }
    let squares: f64 = values.iter().map(|v| (v - mean).powi(2)).sum();
    (mean, (squares / (n - 1) as f64).sqrt())
}

/// The `summary` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// This process's rank.
    pub rank: usize,
    /// The pipeline stage this rank runs.
    pub stage: usize,
    /// Iterations run.
    pub iterations: u64,
    /// Leading iterations left out of the means below.
    pub warmup_iterations: u64,
    /// Mean of the per-iteration samples/s after warm-up.
    pub samples_per_sec_mean: f64,
    /// Sample standard deviation of the per-iteration samples/s after warm-up
    /// ([`mean_and_std`]).
    pub samples_per_sec_std: f64,
    /// Wall-clock seconds of all iterations.
    pub time_s: f64,
    /// Sum of compute seconds over all iterations.
    pub compute_s: f64,
    /// Sum of communication-wait seconds over all iterations.
    pub comm_wait_s: f64,
    /// Sum of idle seconds over all iterations.
    pub idle_s: f64,
    /// Loss of the last iteration, on the last stage.
    pub final_loss: Option<f64>,
    /// Top-1 accuracy of the last iteration, on the last stage (absent, read as `null`, from
    /// runtimes before it).
    #[serde(default)]
    pub final_accuracy: Option<f64>,
    /// Top-5 accuracy of the last iteration, as [`Iteration::accuracy_top5`].
    #[serde(default)]
    pub final_accuracy_top5: Option<f64>,
    /// Peak memory of this rank's device over the run, as in [`Iteration::peak_mem_bytes`].
    pub peak_mem_bytes: Option<u64>,
    /// The host's peak resident set, in bytes (every device).
    #[serde(default)]
    pub host_peak_rss_bytes: Option<u64>,
    /// The CUDA caching allocator's peak allocated bytes on this rank's device (CUDA only).
    #[serde(default)]
    pub gpu_peak_allocated_bytes: Option<u64>,
    /// The CUDA caching allocator's peak reserved bytes (allocated plus its cache).
    #[serde(default)]
    pub gpu_peak_reserved_bytes: Option<u64>,
    /// With `--precision fp16`: steps the gradient scaler skipped over the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    /// With `--validate-every`: the last validation pass's figures, on the last stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<ValidationFigures>,
}

/// The `validation` event (only with `runtime --validate-every`): the model, as it stood after
/// iteration `iteration`, run forward over the held-out split (`test_batch.bin` beside CIFAR-10's
/// training files, an image folder's `val/`, synthetic data drawn apart from the training
/// pool), with dropout off and batch normalisation on its running statistics. Printed by every
/// rank of the last stage, each with the whole pass's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Validation {
    /// The training iteration the pass followed (index from 0).
    pub iteration: u64,
    /// This process's rank.
    pub rank: usize,
    /// The pipeline stage this rank runs (the last).
    pub stage: usize,
    #[serde(flatten)]
    pub figures: ValidationFigures,
    /// Wall-clock seconds of the pass (not counted in any iteration's `time_s`).
    pub time_s: f64,
}

/// What one validation pass measured over its samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ValidationFigures {
    /// Mean loss over the pass's samples.
    pub loss: f64,
    /// Top-1 accuracy over the pass's samples.
    pub accuracy: f64,
    /// Top-5 accuracy, for class logits (as [`Iteration::accuracy_top5`]).
    #[serde(default)]
    pub accuracy_top5: Option<f64>,
    /// Samples the pass ran.
    pub samples: u64,
}

/// The `trace` event (only with `runtime --trace`): which weights a microbatch's forward and
/// backward ran with on one rank. PipeDream's weight stashing makes the two equal even when the
/// stage stepped in between.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// This process's rank.
    pub rank: usize,
    /// The pipeline stage this rank runs.
    pub stage: usize,
    /// Global microbatch number.
    pub microbatch: u64,
    /// Optimizer steps the stage had taken when the forward ran.
    pub forward_version: u64,
    /// Steps the stage had taken when the backward ran.
    pub steps_at_backward: u64,
    /// Sum of the stage's first parameter as the forward saw it.
    pub forward_checksum: f64,
    /// Sum of the stage's first parameter as the backward saw it.
    pub backward_checksum: f64,
}

/// The `p2p` event (only with `runtime --trace`): one point-to-point operation, printed in the
/// order the rank issued them. Between two ranks a channel carries messages one way only, so the
/// sender's sends to a peer and the peer's receives from the sender on one channel pair up by
/// `seq`; NCCL matches them by exactly that order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct P2p {
    /// This process's rank.
    pub rank: usize,
    /// `send` or `recv`.
    pub op: P2pOp,
    /// The rank on the other side.
    pub peer: usize,
    /// The process group it runs on.
    pub channel: Channel,
    /// This rank's operations of this `op` with this `peer` on this `channel` before this one.
    pub seq: u64,
    /// What it carries.
    pub tensor: P2pTensor,
    /// Global microbatch number; `null` for a shape header.
    pub microbatch: Option<u64>,
    /// The element type that travels (`float32`, `bfloat16`, `float16`, `int64`, ...).
    #[serde(default)]
    pub dtype: String,
    /// For an operation of a validation pass: the iteration the pass followed (its
    /// `validation` line's); absent for training's. A pass numbers its microbatches from 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<u64>,
}

/// The `peer_silent` event: the last line of a rank that fails because a point-to-point
/// operation's peer did not answer within `--comm-timeout` (not one whose peer closed the
/// connection, which is that peer's failure to tell). The peer may be stuck, or itself waiting on
/// another rank; the driver names it where it is still running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerSilent {
    /// This process's rank.
    pub rank: usize,
    /// The rank that did not answer.
    pub peer: usize,
    /// The operation that waited: `send` or `recv`.
    pub op: P2pOp,
    /// How long it waited: the run's `--comm-timeout`, in seconds.
    pub timeout_s: f64,
}

/// Which way a point-to-point operation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum P2pOp {
    Send,
    Recv,
}

impl P2pOp {
    /// `send` or `recv`, as the lines spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            P2pOp::Send => "send",
            P2pOp::Recv => "recv",
        }
    }
}

/// The process group a point-to-point operation runs on: one per direction of the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Channel {
    /// Downstream: shape headers, activations and targets.
    Forward,
    /// Upstream: gradients.
    Backward,
}

/// What a point-to-point operation carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum P2pTensor {
    /// The shapes a stage sends each rank of the next stage once, before the first microbatch.
    Header,
    /// A stage's output for a microbatch.
    Activation,
    /// A microbatch's targets, carried along to the last stage.
    Target,
    /// The gradient of the loss with respect to a stage's input.
    Gradient,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iteration() -> Iteration {
        Iteration {
            iteration: 3,
            rank: 1,
            stage: 1,
            loss: Some(2.25),
            accuracy: Some(0.375),
            accuracy_top5: Some(0.75),
            lr: Some(0.01),
            samples: 32,
            time_s: 0.5,
            samples_per_sec: 64.0,
            compute_s: 0.4,
            comm_wait_s: 0.05,
            idle_s: 0.05,
            peak_mem_bytes: Some(1 << 20),
            host_peak_rss_bytes: Some(1 << 20),
            gpu_peak_allocated_bytes: None,
            gpu_peak_reserved_bytes: None,
            reduce: ReduceMetrics::default(),
            sent_bytes: 0,
            sent_dense_bytes: 0,
            partial_reduce: None,
            loss_scale: None,
            step_skipped: None,
            checkpointed: false,
            profiled: false,
        }
    }

    #[test]
    fn events_round_trip_through_one_line() {
        let event = Event::Iteration(iteration());
        let line = event.to_line();
        assert!(
            line.starts_with(r#"{"event":"iteration","iteration":3,"#),
            "{line}"
        );
        assert!(!line.contains('\n'));
        assert_eq!(Event::parse_line(&line), Some(event));
    }

    #[test]
    fn p2p_events_name_their_op_channel_and_tensor_in_lowercase() {
        let op = P2p {
            rank: 2,
            op: P2pOp::Recv,
            peer: 1,
            channel: Channel::Backward,
            seq: 7,
            tensor: P2pTensor::Gradient,
            microbatch: Some(5),
            dtype: "bfloat16".into(),
            validation: None,
        };
        let event = Event::P2p(op.clone());
        let line = event.to_line();
        assert_eq!(
            line,
            r#"{"event":"p2p","rank":2,"op":"recv","peer":1,"channel":"backward","seq":7,"tensor":"gradient","microbatch":5,"dtype":"bfloat16"}"#
        );
        assert_eq!(Event::parse_line(&line), Some(event));
        let header = r#"{"event":"p2p","rank":0,"op":"send","peer":1,"channel":"forward","seq":0,"tensor":"header","microbatch":null}"#;
        assert!(matches!(
            Event::parse_line(header),
            Some(Event::P2p(P2p {
                tensor: P2pTensor::Header,
                microbatch: None,
                validation: None,
                ..
            }))
        ));
        // A validation pass's operation names the iteration the pass followed.
        let pass = Event::P2p(P2p {
            validation: Some(9),
            ..op
        });
        let line = pass.to_line();
        assert!(line.ends_with(r#""dtype":"bfloat16","validation":9}"#), "{line}");
        assert_eq!(Event::parse_line(&line), Some(pass));
    }

    /// A validation line carries its figures flat beside the iteration it followed.
    #[test]
    fn validation_events_round_trip_with_their_figures_flat() {
        let event = Event::Validation(Validation {
            iteration: 9,
            rank: 1,
            stage: 1,
            figures: ValidationFigures {
                loss: 0.5,
                accuracy: 0.75,
                accuracy_top5: None,
                samples: 64,
            },
            time_s: 0.25,
        });
        let line = event.to_line();
        assert_eq!(
            line,
            r#"{"event":"validation","iteration":9,"rank":1,"stage":1,"loss":0.5,"accuracy":0.75,"accuracy_top5":null,"samples":64,"time_s":0.25}"#
        );
        assert_eq!(Event::parse_line(&line), Some(event));
    }

    #[test]
    fn plain_log_lines_are_not_events() {
        assert_eq!(Event::parse_line("epoch 1 done"), None);
        assert_eq!(Event::parse_line(r#"{"event":"unknown_kind"}"#), None);
        assert_eq!(Event::parse_line(""), None);
    }

    /// `checkpointed` and `profiled` are on the line only when true, and read back either way.
    #[test]
    fn only_an_iteration_that_checkpointed_or_was_profiled_says_so() {
        let plain = Event::Iteration(iteration()).to_line();
        assert!(!plain.contains("checkpointed"), "{plain}");
        assert!(!plain.contains("profiled"), "{plain}");
        assert_eq!(Event::parse_line(&plain), Some(Event::Iteration(iteration())));
        let mut it = iteration();
        it.checkpointed = true;
        let event = Event::Iteration(it.clone());
        let line = event.to_line();
        assert!(line.ends_with(r#","checkpointed":true}"#), "{line}");
        assert_eq!(Event::parse_line(&line), Some(event));
        it.profiled = true;
        let event = Event::Iteration(it);
        let line = event.to_line();
        assert!(
            line.ends_with(r#","checkpointed":true,"profiled":true}"#),
            "{line}"
        );
        assert_eq!(Event::parse_line(&line), Some(event));
    }

    #[test]
    fn a_first_stage_reports_no_loss_as_null() {
        let mut it = iteration();
        it.loss = None;
        let line = Event::Iteration(it).to_line();
        assert!(line.contains(r#""loss":null"#), "{line}");
    }
}
