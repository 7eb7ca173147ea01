//! Every validated request the runtime can be given: what the CLI resolves to, with per-model
//! defaults filled in, before anything is built. The commands read these types and nothing of
//! the CLI; this module names only the models, datasets and schedules they refer to.

use std::path::PathBuf;
use std::time::Duration;

use stagehand_contract::{RunConfig, StageConfig};

use crate::data::{Augment, DataError, DataSpec};
use crate::host_memory;
use crate::lr::LrSchedule;
use crate::models::{ModelOptions, MODEL_NAMES};
use crate::schedule::Schedule;

/// What the process was asked to do.
#[derive(Debug)]
pub enum Command {
    /// Train (the default).
    Train(Box<TrainConfig>),
    /// Validate a training request without training or connecting (`--check`).
    Check(Box<TrainConfig>),
    /// List the model's modules.
    Modules(ModulesConfig),
    /// Profile the model's modules.
    Profile(ProfileConfig),
    /// Measure point-to-point throughput.
    P2pBench(P2pConfig),
    /// Say what this runtime can use on this machine.
    Info,
    /// Listen on or connect to the master port (the driver's preflight).
    Reach(ReachConfig),
    /// Run the model once on given weights and inputs.
    Forward(ForwardConfig),
}

impl Command {
    /// The device the command computes on, if it names one.
    pub fn device(&self) -> Option<DeviceSpec> {
        match self {
            Command::Train(config) => Some(config.device),
            Command::Profile(config) => Some(config.device),
            Command::Forward(config) => Some(config.device),
            Command::Modules(_)
            | Command::P2pBench(_)
            | Command::Info
            | Command::Reach(_)
            | Command::Check(_) => None,
        }
    }
}

/// A bad argument; the message names the flag and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{flag}: {reason}")]
    Invalid { flag: &'static str, reason: String },
    #[error("--model: unknown model {name:?}; known models: {known}", known = MODEL_NAMES.join(", "))]
    UnknownModel { name: String },
    #[error(transparent)]
    Data(#[from] DataError),
}

/// A model name with its sizes resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelChoice {
    pub name: String,
    pub options: ModelOptions,
}

/// Sizes given on the command line; `None` takes the model's default.
#[derive(Debug, Default)]
pub struct ModelOverrides {
    pub num_classes: Option<i64>,
    pub image_size: Option<i64>,
    pub layers: Option<usize>,
    pub hidden: Option<i64>,
    pub heads: Option<i64>,
    pub seq_len: Option<i64>,
    pub vocab_size: Option<i64>,
    pub dropout: Option<f64>,
    pub active_units: Option<i64>,
}

impl ModelChoice {
    /// Fills in the defaults of model `name`, taking the class count and image size from the
    /// dataset where it fixes them.
    pub fn resolve(
        name: String,
        data: Option<&DataSpec>,
        o: ModelOverrides,
    ) -> Result<ModelChoice, ConfigError> {
        if !MODEL_NAMES.contains(&name.as_str()) {
            return Err(ConfigError::UnknownModel { name });
        }
        let is_mlp = name == "mlp" || name == "sparse_mlp";
        let is_transformer = name == "transformer";
        if let (true, Some(spec)) = (is_transformer, data) {
            if !matches!(spec, DataSpec::Synthetic) {
                return Err(ConfigError::Invalid {
                    flag: "--data",
                    reason: format!(
                        "the transformer trains on synthetic tokens only; {spec} is an image dataset"
                    ),
                });
            }
        }
        let data_classes = data.map(DataSpec::num_classes).transpose()?.flatten();
        let num_classes = match (o.num_classes, data_classes) {
            (Some(n), Some(d)) if n < d => {
                return Err(ConfigError::Invalid {
                    flag: "--num-classes",
                    reason: format!("{n} is fewer than the {d} classes of the dataset"),
                })
            }
            (Some(n), _) => n,
            (None, Some(d)) => d,
            (None, None) if is_mlp => 10,
            (None, None) => 1000,
        };
        let default_image = match data {
            Some(DataSpec::Cifar10(_)) => 32,
            _ if is_mlp => 32,
            _ => 224,
        };
        let hidden = o.hidden.unwrap_or(if is_transformer { 768 } else { 1024 });
        if o.active_units.is_some() && name != "sparse_mlp" {
            return Err(ConfigError::Invalid {
                flag: "--active-units",
                reason: format!("only sparse_mlp keeps a number of active units; {name} is dense"),
            });
        }
        let options = ModelOptions {
            num_classes,
            image_size: o.image_size.unwrap_or(default_image),
            layers: o.layers.unwrap_or(if is_transformer { 12 } else { 4 }),
            hidden,
            active_units: o.active_units.unwrap_or((hidden / 16).max(1)),
            heads: o.heads.unwrap_or(12),
            seq_len: o.seq_len.unwrap_or(128),
            vocab_size: o.vocab_size.unwrap_or(30522),
            dropout: o.dropout.unwrap_or(match name.as_str() {
                "vgg16" | "vgg16_bn" | "alexnet" => 0.5,
                "transformer" => 0.1,
                _ => 0.0,
            }),
        };
        check_options(&name, &options)?;
        Ok(ModelChoice { name, options })
    }
}

/// The most layers a model may be given (`--layers`): GPT-3 has 96.
const MAX_LAYERS: i64 = 4096;
/// The most a hidden width or sequence may be (`--hidden`, `--seq-len`): 2^20.
const MAX_WIDTH: i64 = 1 << 20;
/// The most classes or tokens (`--num-classes`, `--vocab-size`): 2^24.
const MAX_CLASSES: i64 = 1 << 24;
/// The most pixels an image's side may have (`--image-size`): 2^16.
const MAX_IMAGE_SIZE: i64 = 1 << 16;

fn check_options(name: &str, o: &ModelOptions) -> Result<(), ConfigError> {
    let invalid = |flag, reason: String| Err(ConfigError::Invalid { flag, reason });
    // AlexNet's 11x11 stride-4 convolution and three 3x3 stride-2 pools leave nothing of a
    // smaller image.
    let min_image = if name == "alexnet" {
        63
    } else if name.starts_with("vgg") || name.starts_with("resnet") {
        32
    } else {
        1
    };
    if o.image_size < min_image {
        return invalid(
            "--image-size",
            format!("{name} needs images of at least {min_image} pixels"),
        );
    }
    // Each from 1 to a most far past any model trained (whose products still fit an i64 of
    // elements): a larger one is a typo, which built for minutes or wrapped to a negative size.
    let sizes = [
        (
            "--layers",
            i64::try_from(o.layers).unwrap_or(i64::MAX),
            MAX_LAYERS,
        ),
        ("--hidden", o.hidden, MAX_WIDTH),
        ("--seq-len", o.seq_len, MAX_WIDTH),
        ("--vocab-size", o.vocab_size, MAX_CLASSES),
        ("--num-classes", o.num_classes, MAX_CLASSES),
        ("--image-size", o.image_size, MAX_IMAGE_SIZE),
    ];
    for (flag, value, most) in sizes {
        if !(1..=most).contains(&value) {
            return invalid(flag, format!("{value} is not a size from 1 to {most}"));
        }
    }
    if name == "transformer" && (o.heads < 1 || o.hidden % o.heads != 0) {
        return invalid(
            "--heads",
            format!("{} heads do not divide hidden size {}", o.heads, o.hidden),
        );
    }
    if !(0.0..1.0).contains(&o.dropout) {
        return invalid("--dropout", format!("{} is not in [0, 1)", o.dropout));
    }
    if !(1..=o.hidden).contains(&o.active_units) {
        return invalid(
            "--active-units",
            format!(
                "{} is not between 1 and the hidden width {}",
                o.active_units, o.hidden
            ),
        );
    }
    Ok(())
}

/// The optimizer and its hyper-parameters, as `torch.optim` names them (the learning rate is in
/// [`TrainConfig`]; SGD's dampening is 0, Adam's betas and eps are torch's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// SGD; `nesterov` needs a momentum above 0.
    Sgd {
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
    },
    /// Adam, weight decay added to the gradient (L2 penalty).
    Adam { weight_decay: f64 },
    /// AdamW: Adam with weight decay applied to the weights directly (decoupled).
    AdamW { weight_decay: f64 },
}

impl OptimizerKind {
    /// The `--optimizer` value.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerKind::Sgd { .. } => "sgd",
            OptimizerKind::Adam { .. } => "adam",
            OptimizerKind::AdamW { .. } => "adamw",
        }
    }
}

/// Where tensors live.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

impl DeviceSpec {
    pub fn parse(text: &str) -> Result<DeviceSpec, ConfigError> {
        let bad = || ConfigError::Invalid {
            flag: "--device",
            reason: format!("{text:?} is not cpu, cuda or cuda:N"),
        };
        match text {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            other => {
                let index = other.strip_prefix("cuda:").ok_or_else(bad)?;
                index.parse().map(DeviceSpec::Cuda).map_err(|_| bad())
            }
        }
    }

    pub fn tch(self) -> tch::Device {
        match self {
            DeviceSpec::Cpu => tch::Device::Cpu,
            DeviceSpec::Cuda(i) => tch::Device::Cuda(i),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A validated training run.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Flags given that do nothing in this request, each with why (the run goes on).
    pub warnings: Vec<String>,
    pub model: ModelChoice,
    pub batch_size: usize,
    pub iterations: u64,
    pub lr: f64,
    /// The learning rate of each iteration (`lr` throughout unless a policy or warm-up is set).
    pub lr_schedule: LrSchedule,
    pub optimizer: OptimizerKind,
    pub seed: u64,
    pub data: DataSpec,
    /// How real images are transformed (synthetic data is not).
    pub augment: Augment,
    /// Threads decoding an image folder's images.
    pub data_workers: usize,
    /// The first of `devices`: where the data and the process groups are.
    pub device: DeviceSpec,
    /// The devices this rank's stage spans (`--devices`), `device` first; one for most runs.
    pub devices: Vec<DeviceSpec>,
    /// Weights to start from (`--init-from`): a PyTorch state dict or a safetensors file.
    pub init_from: Option<PathBuf>,
    /// Intra-op threads; `None` leaves libtorch's default.
    pub threads: Option<usize>,
    /// fp32, or autocast to a 16-bit type.
    pub precision: Precision,
    /// fp16: the gradient scaler's first loss scale.
    pub fp16_init_scale: f64,
    /// Parameters and image inputs in channels_last layout.
    pub channels_last: bool,
    /// Capture the training step in a CUDA graph after the first iterations and replay it.
    pub cuda_graph: bool,
    /// Deterministic algorithms only (`--deterministic`).
    pub deterministic: bool,
    /// cuDNN picks convolution algorithms by timing them (`--cudnn-benchmark`).
    pub cudnn_benchmark: bool,
    /// The runtime's own fused CUDA kernels where the layers suit them (`--fused-kernels`).
    pub fused_kernels: bool,
    /// What becomes of host memory a step frees.
    pub host_memory: host_memory::Policy,
    /// Leading iterations left out of the summary's throughput.
    pub warmup: u64,
    /// Where this rank sits in the job and how it talks to the others.
    pub dist: DistConfig,
    /// Folder to write each rank's final parameters to.
    pub save_params: Option<PathBuf>,
    /// Emit `trace` events.
    pub trace: bool,
    /// Write a Chrome trace of PyTorch's profiler here (`--profiler-trace`, `{rank}` replaced).
    pub profiler_trace: Option<PathBuf>,
    /// How many iterations the trace records (`--profiler-steps`).
    pub profiler_steps: u64,
    /// Where to checkpoint, how often, and whether to resume from there.
    pub checkpoint: Option<CheckpointConfig>,
    /// Validation passes over the held-out split (`--validate-every`).
    pub validation: Option<ValidationConfig>,
}

/// `--validate-every` and `--validation-batches`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ValidationConfig {
    /// A pass after every this many iterations, and after the last.
    pub every: u64,
    /// Minibatches a pass runs; `None`: all the held-out split holds.
    pub batches: Option<u64>,
}

/// `--checkpoint-dir`, `--checkpoint-every` and `--resume`.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointConfig {
    pub dir: PathBuf,
    /// Checkpoint after every this many iterations, and after the last; `None`: after the last.
    pub every: Option<u64>,
    /// Whether to start from the latest checkpoint in `dir`.
    pub resume: Resume,
}

/// `--resume`: whether a run starts from the latest checkpoint in `--checkpoint-dir`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Start afresh (no `--resume`), overwriting what the folder holds as checkpoints come.
    No,
    /// `--resume`: from the latest checkpoint, which must be there.
    Required,
    /// `--resume=auto`: from the latest checkpoint if the folder holds one, else afresh (a job
    /// requeued, a sweep's point run again).
    IfPresent,
}

impl CheckpointConfig {
    /// Whether to checkpoint once `done` of `total` iterations are done.
    pub fn due(&self, done: u64, total: u64) -> bool {
        done == total || self.every.is_some_and(|n| n > 0 && done.is_multiple_of(n))
    }
}

/// fp16's first loss scale unless `--fp16-init-scale` says otherwise: torch.amp.GradScaler's 2^16.
pub const DEFAULT_FP16_INIT_SCALE: f64 = 65536.0;

/// `--precision`: the arithmetic of forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Everything in float32.
    Fp32,
    /// PyTorch's autocast to bfloat16 (same range as float32: no loss scaling needed).
    Bf16,
    /// PyTorch's autocast to float16, with a gradient scaler.
    Fp16,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Backend {
    Gloo,
    Nccl,
}

/// The process groups activations and gradients travel on between stages (`--p2p-groups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum P2pGroups {
    /// One group per direction over every rank (Gloo's default: its operations with different
    /// peers never wait on each other).
    World,
    /// A group of two ranks per pair of neighbouring ranks and direction (NCCL's default). An
    /// NCCL group whose communicator is made up front, as the runtime's are, runs all of its
    /// point-to-point operations on one stream in issue order (PyTorch's eager-init mode), so on
    /// one group over every rank a send would wait behind a receive posted from another peer.
    Pairs,
}

/// The distributed side of a run: launch contract, stage config and schedule.
#[derive(Debug, Clone)]
pub struct DistConfig {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The run's key space on the rendezvous store (`--run-id`).
    pub run_id: Option<String>,
    pub backend: Backend,
    /// The groups point-to-point messages between stages travel on.
    pub p2p_groups: P2pGroups,
    /// PipeDream stage config; `None` is pure data parallelism over `world_size` ranks.
    pub stage_config: Option<StageConfig>,
    pub schedule: Schedule,
    /// Microbatches per minibatch; `None` takes the plan's default.
    pub microbatches: Option<usize>,
    /// Bound on every rendezvous and communication wait.
    pub comm_timeout: Duration,
    /// Compute slow-down factor of this rank (straggler emulation), 1 for none.
    pub slowdown: f64,
    /// How replicas all-reduce their gradients.
    pub reduce: ReduceOptions,
    /// float32 activations cross stages as float16.
    pub compress_activations: bool,
    /// Activations and gradients cross stages in their smallest form, dense, indices or bitmask
    /// (`--compress auto`).
    pub sparse: bool,
}

/// How the replicas' gradients are all-reduced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReduceOptions {
    /// A bucket holds at most this many bytes of gradients, or one larger gradient alone.
    pub bucket_bytes: usize,
    /// Start buckets during the backward pass (DDP) instead of after it.
    pub overlap: bool,
    /// Combine with only the first K replicas ready (`--reduce partial:K`) instead of all.
    pub partial: Option<PartialOptions>,
}

/// Partial reduce: each step a replica combines with the first `k` replicas ready; every
/// `sync_every`-th group is every live replica (pipeline/partial.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialOptions {
    pub k: usize,
    pub sync_every: usize,
}

impl TrainConfig {
    /// Whether the data is an image folder, which `data_workers` is for.
    fn image_folder(&self) -> bool {
        matches!(self.data, DataSpec::ImageFolder(_))
    }

    /// The schedule as the `start` event and `--check` report it: `none` over one stage.
    pub fn schedule_reported(&self, stages: usize) -> String {
        if stages > 1 {
            self.dist.schedule.to_string()
        } else {
            "none".into()
        }
    }

    /// The configuration as the `start` event reports it.
    pub fn to_run_config(
        &self,
        threads: usize,
        microbatches: usize,
        stages: usize,
        host_memory: host_memory::Applied,
    ) -> RunConfig {
        RunConfig {
            model: self.model.name.clone(),
            batch_size: self.batch_size,
            iterations: self.iterations,
            lr: self.lr,
            optimizer: self.optimizer.name().into(),
            seed: self.seed,
            data: self.data.to_string(),
            augment: (self.data != DataSpec::Synthetic).then(|| self.augment.as_arg().to_string()),
            data_workers: self.image_folder().then_some(self.data_workers),
            device: self.device.to_string(),
            threads,
            schedule: self.schedule_reported(stages),
            microbatches,
            precision: self.precision.to_string(),
            fp16_init_scale: (self.precision == Precision::Fp16).then_some(self.fp16_init_scale),
            channels_last: self.channels_last,
            cuda_graph: self.cuda_graph,
            deterministic: self.deterministic,
            cudnn_benchmark: self.cudnn_benchmark,
            fused_kernels: self.fused_kernels,
            profiler_trace: self.profiler_trace.clone(),
            profiler_steps: self.profiler_trace.is_some().then_some(self.profiler_steps),
            host_memory: host_memory.to_string(),
            bucket_mb: self.dist.reduce.bucket_bytes as f64 / (1u64 << 20) as f64,
            overlap_reduce: self.dist.reduce.overlap,
            compress_activations: self.dist.compress_activations,
            compress: if self.dist.sparse { "auto" } else { "off" }.into(),
            p2p_groups: Some(
                match self.dist.p2p_groups {
                    P2pGroups::World => "world",
                    P2pGroups::Pairs => "pairs",
                }
                .into(),
            ),
            reduce: match self.dist.reduce.partial {
                None => "all".into(),
                Some(p) => format!("partial:{}", p.k),
            },
            sync_every: self.dist.reduce.partial.map(|p| p.sync_every),
            lr_policy: self.lr_schedule.policy.name().into(),
            lr_warmup_epochs: self.lr_schedule.warmup_epochs,
            epoch_iterations: self
                .lr_schedule
                .varies()
                .then_some(self.lr_schedule.epoch_iterations),
            validate_every: self.validation.map(|v| v.every),
            validation_batches: None,
        }
    }
}

/// A validated `runtime modules` request.
#[derive(Debug)]
pub struct ModulesConfig {
    pub model: ModelChoice,
    pub batch_size: usize,
    pub json: bool,
}

/// A validated `runtime forward` request.
#[derive(Debug)]
pub struct ForwardConfig {
    pub model: ModelChoice,
    pub init_from: PathBuf,
    pub input: PathBuf,
    pub output: PathBuf,
    /// Training mode (batch statistics, dropout) rather than evaluation.
    pub train: bool,
    pub device: DeviceSpec,
    pub threads: Option<usize>,
}

/// A validated `runtime profile` request.
#[derive(Debug)]
pub struct ProfileConfig {
    pub model: ModelChoice,
    pub batch_size: usize,
    pub device: DeviceSpec,
    pub threads: Option<usize>,
    /// What becomes of host memory the measurements free.
    pub host_memory: host_memory::Policy,
    /// Timed repeats per module, after one untimed warm-up.
    pub repeats: usize,
    /// Where to write the profile; stdout when `None`.
    pub output: Option<PathBuf>,
    /// The arithmetic measured: fp32, or autocast to a 16-bit type.
    pub precision: Precision,
    /// Parameters and image inputs in channels_last layout.
    pub channels_last: bool,
}

/// A validated `runtime p2p-bench` request.
#[derive(Debug)]
pub struct P2pConfig {
    pub rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub bytes: usize,
    pub rounds: usize,
}

/// What `runtime reach` does.
#[derive(Debug, Clone, PartialEq)]
pub enum ReachConfig {
    /// Listen on `port` (every address) for `seconds`.
    Listen { port: u16, seconds: f64 },
    /// Connect to `host:port`, retrying for up to `seconds`.
    Connect { host: String, port: u16, seconds: f64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_model_and_the_data() {
        let mlp = ModelChoice::resolve("mlp".into(), Some(&DataSpec::Synthetic), Default::default()).unwrap();
        assert_eq!((mlp.options.num_classes, mlp.options.image_size), (10, 32));
        let vgg = ModelChoice::resolve("vgg16".into(), None, Default::default()).unwrap();
        assert_eq!(
            (
                vgg.options.num_classes,
                vgg.options.image_size,
                vgg.options.dropout
            ),
            (1000, 224, 0.5)
        );
    }

    #[test]
    fn bad_values_name_the_flag() {
        let heads = ModelOverrides {
            heads: Some(5),
            hidden: Some(64),
            ..Default::default()
        };
        let err = ModelChoice::resolve("transformer".into(), None, heads).unwrap_err();
        assert_eq!(err.to_string(), "--heads: 5 heads do not divide hidden size 64");
        let err = DeviceSpec::parse("gpu0").unwrap_err();
        assert_eq!(err.to_string(), "--device: \"gpu0\" is not cpu, cuda or cuda:N");
        assert_eq!(DeviceSpec::parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
        let err = ModelChoice::resolve("lenet".into(), None, Default::default()).unwrap_err();
        assert!(err
            .to_string()
            .starts_with("--model: unknown model \"lenet\"; known models: mlp, sparse_mlp, alexnet, vgg16"));
    }
}
