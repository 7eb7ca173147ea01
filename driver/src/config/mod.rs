//! The experiment YAML as typed serde structs, PipeDream's key names wherever the meaning is the
//! same. Parsing (and the choice of YAML crate) lives in [`yaml`]; each non-trivial element has its
//! own module with its own `Deserialize`.

mod container;
pub mod machine;
mod mount;
mod planner;
mod resume;
mod slurm;
mod sweep;
mod yaml;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use container::Container;
pub use machine::Machine;
pub use mount::Mount;
pub use planner::{PlannerSettings, StageConfigRef};
pub use resume::Resume;
pub use slurm::SlurmSettings;
pub use sweep::{check_grid_value, value_text, with_overrides, Axis, Sweep};
pub use yaml::{load, locate_sweep_key, parse_scalar, ConfigError, Loaded};

use crate::options::Backend;

/// One experiment file, as written.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentFile {
    /// Experiment name used in the record folder; defaults to the file's stem.
    #[serde(default)]
    pub name: Option<String>,
    /// Where ranks run: `docker` (default), `process` or `slurm`.
    #[serde(default)]
    pub backend: Option<Backend>,
    /// One entry per rank (`host:gpu`, `host`) or a mapping for a host with several GPUs; with
    /// `backend: slurm`, Slurm places the ranks (`slurm:`) and there are none.
    #[serde(default)]
    pub machines: Vec<Machine>,
    /// What `backend: slurm` asks Slurm for: partition, nodes, tasks per node, GPUs, time limit,
    /// account, more srun options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm: Option<SlurmSettings>,
    /// An image name, or `{build: DIR}`; by default the build context `docker/`.
    #[serde(default)]
    pub container: Option<Container>,
    /// The model the runtime builds (PipeDream's `module`).
    #[serde(default, alias = "model")]
    pub module: Option<String>,
    /// A PipeDream stage config JSON, relative to this file, or `auto` to profile the model on
    /// the first machine and plan the stages at launch.
    #[serde(default)]
    pub config_file: Option<StageConfigRef>,
    /// How `config_file: auto` plans (bandwidths, memory, straight pipelines, a given profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<PlannerSettings>,
    /// Output classes of image models (the runtime's `--num-classes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_classes: Option<u32>,
    /// Side of square input images (`--image-size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<u32>,
    /// Hidden layers of the MLP, encoder layers of the transformer (`--layers`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<u32>,
    /// Hidden width of the MLP, hidden size of the transformer (`--hidden`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden: Option<u32>,
    /// Attention heads of the transformer (`--heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<u32>,
    /// Tokens per sample of the transformer (`--seq-len`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u32>,
    /// Vocabulary of the transformer (`--vocab-size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u32>,
    /// Dropout of the transformer, a probability (`--dropout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// Hidden units each layer of `sparse_mlp` keeps per sample, handed on as sparse COO tensors
    /// (`--active-units`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_units: Option<u32>,
    /// Samples per iteration of one pipeline (the minibatch).
    #[serde(default)]
    pub batch_size: Option<u32>,
    /// Optimizer steps to run.
    #[serde(default)]
    pub iterations: Option<u64>,
    /// Epochs to run instead of `iterations` (`--epochs`; PipeDream's `epochs`): each is
    /// `epoch_samples` samples, the dataset's size, or with synthetic data PipeDream's 1000000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs: Option<u64>,
    /// Samples in an epoch (`--epoch-samples`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch_samples: Option<u64>,
    /// Learning rate.
    #[serde(default, alias = "lr")]
    pub learning_rate: Option<f64>,
    /// Where each rank checkpoints its parameters and optimizer state (`--checkpoint-dir`), a
    /// folder on every host (relative paths against this file); mounted into the containers and
    /// created where missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Weights to start from (`--init-from`): a `torch.save` state dict or a safetensors file on
    /// this machine (relative to the file), mounted read-only where the host has the path and
    /// copied into the containers where it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// Checkpoint every N iterations as well as after the last (`--checkpoint-every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<u64>,
    /// Run the model over the held-out split after every N iterations and after the last
    /// (`--validate-every`); the record keeps each pass's figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validate_every: Option<u64>,
    /// Minibatches each validation pass runs (`--validation-batches`; default: all the held-out
    /// split holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_batches: Option<u64>,
    /// Start from the latest checkpoint in `checkpoint_dir`: `true` (`--resume`: it must be
    /// there), `false`, or `auto` (`--resume=auto`: from it if there is one, else afresh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resume>,
    /// How many times the ranks are started again after a rank fails or a host is lost (as
    /// torchrun's `--max-restarts`): from the latest checkpoint the ranks wrote in this run, or
    /// as first started when they wrote none. 0 (the default) ends the run at its first failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_restarts: Option<u32>,
    /// How the learning rate changes per epoch (`--lr-policy`; PipeDream's `learning_rate_policy`):
    /// `constant`, `step`, `polynomial` or `exponential_decay`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate_policy: Option<LrPolicy>,
    /// Epochs of linear warm-up to the learning rate (`--lr-warmup-epochs`; PipeDream's
    /// `--lr_warmup` is 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_warmup_epochs: Option<u64>,
    /// PipeDream's choice of synthetic data: `true` is this runtime's default (leave `data_dir`
    /// out), `false` needs `data_dir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synthetic_data: Option<bool>,
    /// `sgd`, `adam` or `adamw`.
    #[serde(default)]
    pub optimizer: Option<Optimizer>,
    /// Seed for parameters and synthetic data.
    #[serde(default)]
    pub seed: Option<u64>,
    /// `gloo` or `nccl`.
    #[serde(default)]
    pub distributed_backend: Option<DistributedBackend>,
    /// Data given to the runtime's `--data`; a path that exists is mounted into containers.
    #[serde(default)]
    pub data_dir: Option<String>,
    /// How the images are transformed (`--augment`): `crop-flip` (the dataset's training recipe:
    /// an image folder's default) or `none` (CIFAR-10's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub augment: Option<Augment>,
    /// Threads decoding an image folder's images per rank (`--data-workers`, as DataLoader's
    /// `num_workers`; the runtime's default is 4, fewer on fewer CPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_workers: Option<std::num::NonZeroU32>,
    /// `cpu` or `cuda`; defaults to `cuda` when the machines name GPUs.
    #[serde(default)]
    pub device: Option<Device>,
    /// The address every rank reaches rank 0's machine at (`MASTER_ADDR`). By default it is
    /// found on the machines: the first machine's own address on the driver's SSH connection to
    /// it (or, when the first machine is this one, the address the remote machines see this one
    /// at).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_addr: Option<String>,
    /// Intra-op threads per rank.
    #[serde(default)]
    pub threads: Option<u32>,
    /// `fp32` (the default), or PyTorch's autocast to `bf16` or `fp16` (`--precision`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// fp16: the gradient scaler's first loss scale (`--fp16-init-scale`; the runtime's default is
    /// torch's 65536).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16_init_scale: Option<f64>,
    /// Parameters and image inputs in channels_last layout (`--channels-last`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channels_last: Option<bool>,
    /// Each rank's step replayed from a CUDA graph captured once (`--cuda-graph`; one process on
    /// one GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_graph: Option<bool>,
    /// Deterministic algorithms only (`--deterministic`): a rank's run repeats bit for bit on the
    /// same device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deterministic: Option<bool>,
    /// cuDNN picks each convolution's algorithm by timing them (`--cudnn-benchmark`; not with
    /// `deterministic`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cudnn_benchmark: Option<bool>,
    /// The runtime's own fused CUDA kernels where vgg16's layers suit them (`--fused-kernels`;
    /// GPUs only, not with `deterministic`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused_kernels: Option<bool>,
    /// Each rank records PyTorch's profiler over a few iterations after the warm-up
    /// (`--profiler-trace`), and the record keeps every rank's trace in `traces/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiler_trace: Option<bool>,
    /// How many iterations `profiler_trace` records (`--profiler-steps`; the runtime's default
    /// is 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiler_steps: Option<std::num::NonZeroU64>,
    /// Host memory a step frees: `keep` it for the next iteration (the runtime's default) or
    /// `release` it to the system (`--host-memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<HostMemory>,
    /// Replicas all-reduce gradients in buckets of at most this many MiB (`--bucket-mb`, DDP's
    /// `bucket_cap_mb`; the runtime's default is 25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_mb: Option<BucketMb>,
    /// L2 weight decay of the optimizer (`--weight-decay`; PipeDream's `weight_decay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// SGD's momentum (`--momentum`; the runtime's default is 0.9).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    /// SGD with Nesterov momentum (`--nesterov`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nesterov: Option<bool>,
    /// Seconds a rank waits in a rendezvous or a communication before it gives up
    /// (`--comm-timeout`; the runtime's default is 60): longer for a slow first stage, shorter to
    /// hear of a hung peer sooner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_timeout: Option<f64>,
    /// PipeDream's kind of model; only `image_classification` (what PipeDream's image models and
    /// this runtime's are) is accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    /// PipeDream keys this driver does not honour yet; each is refused at resolve with what to
    /// use instead (experiment/mod.rs), so an experiment never runs with one silently ignored.
    /// Every N iterations the terminal shows the loss, throughput and learning rate (PipeDream's
    /// `print_frequency`; 0 for never). metrics.jsonl has every iteration regardless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub print_frequency: Option<u64>,
    /// Every N iterations the terminal shows every rank's metrics line (PipeDream's
    /// `verbose_frequency`; 0 for never), as `-v` does for all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbose_frequency: Option<u64>,
    /// Activations cross stages as float16 (`--compress-activations`; PipeDream's key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress_activations: Option<bool>,
    /// PipeDream's choice of where to compress; the runtime casts on the device holding the
    /// activation, so with `compress_activations: true` only `true` (or leaving it out) is accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress_in_gpu: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub translation_model: Option<serde_json::Value>,
    /// Start each gradient bucket's all-reduce during the backward pass (`on`, as DDP does), only
    /// after it (`off`), or `auto` (the runtime's default: on with CUDA devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap_reduce: Option<OverlapReduce>,
    /// Sparse transfers (`--compress`): `auto` sends each activation and gradient in its
    /// smallest form, rebuilt bit for bit; `off` (the runtime's default) sends them dense.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<Compress>,
    /// How a stage's replicas combine each step (`--reduce`): `all` (the all-reduce, the
    /// runtime's default) or `partial:K`, SD-PIPE's partial reduce with the first K ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce: Option<Reduce>,
    /// With `reduce: partial:K`, every this many groups is every live replica (`--sync-every`;
    /// the runtime's default is 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_every: Option<std::num::NonZeroU32>,
    /// Straggler and heterogeneity emulation: a rank's, or a machine's ranks', compute stretched
    /// by a factor (`--slowdown`), as SD-PIPE's `--hetero`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slowdown: Vec<Slowdown>,
    /// Pipeline schedule.
    #[serde(default)]
    pub schedule: Option<Schedule>,
    /// Microbatches per minibatch.
    #[serde(default)]
    pub microbatches: Option<u32>,
    /// Where record folders go, relative to the current directory (default `experiments/`).
    #[serde(default)]
    pub log_directory: Option<PathBuf>,
    /// Extra environment for every rank.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Extra bind mounts for every container.
    #[serde(default)]
    pub mounts: Vec<Mount>,
    /// Launch this program and arguments instead of the runtime, with the same rank environment.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// GPUs each rank holds (default 1): a machine entry's `gpus` taken in groups of this many,
    /// each group one rank whose stage spans them (the runtime's `--devices`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_per_rank: Option<u32>,
    /// Shared memory per container, in MiB (default 2048).
    #[serde(default)]
    pub shm_size_mb: Option<u64>,
    /// InfiniBand/RoCE for NCCL in containers: `auto` (the default) gives the containers of a
    /// host that has `/dev/infiniband` its verbs devices, the IPC_LOCK capability and unlimited
    /// locked memory; `off` gives them none (NCCL then talks TCP between hosts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<Rdma>,
    /// A grid for `driver sweep`: experiment keys and the values each takes; ignored by a
    /// single run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<Sweep>,
}

/// Spellings of one key; a grid value replaces every spelling the file used.
const ALIASES: [(&str, &str); 2] = [("model", "module"), ("lr", "learning_rate")];

/// The canonical spelling of an experiment key.
pub fn canonical_key(key: &str) -> &str {
    ALIASES
        .iter()
        .find(|(alias, _)| *alias == key)
        .map_or(key, |(_, canonical)| canonical)
}

/// The runtime's optimizers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    Sgd,
    Adam,
    Adamw,
}

/// The runtime's arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

/// Whether containers get a host's InfiniBand/RoCE devices (`rdma:`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rdma {
    /// Where the host has `/dev/infiniband`.
    #[default]
    Auto,
    /// Never.
    Off,
}

/// How the images are transformed (`--augment`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum Augment {
    #[serde(rename = "crop-flip", alias = "crop_flip")]
    CropFlip,
    #[serde(rename = "none")]
    None,
}

impl Augment {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            Augment::CropFlip => "crop-flip",
            Augment::None => "none",
        }
    }
}

/// What becomes of host memory a runtime step frees (`--host-memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostMemory {
    Keep,
    Release,
}

impl HostMemory {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            HostMemory::Keep => "keep",
            HostMemory::Release => "release",
        }
    }
}

/// A gradient bucket size in MiB: positive and at least one byte.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct BucketMb(f64);

/// A `bucket_mb:` that is not a size.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("bucket_mb must be a positive number of MiB (at least one byte), not {0}")]
pub struct BucketMbError(pub f64);

impl TryFrom<f64> for BucketMb {
    type Error = BucketMbError;

    fn try_from(mb: f64) -> Result<BucketMb, BucketMbError> {
        if mb.is_finite() && mb * (1u64 << 20) as f64 >= 1.0 {
            Ok(BucketMb(mb))
        } else {
            Err(BucketMbError(mb))
        }
    }
}

impl From<BucketMb> for f64 {
    fn from(mb: BucketMb) -> f64 {
        mb.0
    }
}

/// When replicas start their gradient all-reduce (`--overlap-reduce`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapReduce {
    Auto,
    On,
    Off,
}

impl OverlapReduce {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            OverlapReduce::Auto => "auto",
            OverlapReduce::On => "on",
            OverlapReduce::Off => "off",
        }
    }
}

/// Sparse transfers between stages (`--compress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Compress {
    Auto,
    Off,
}

impl Compress {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            Compress::Auto => "auto",
            Compress::Off => "off",
        }
    }
}

/// How replicas combine (`--reduce`): every replica, or the first K ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub enum Reduce {
    All,
    Partial(u32),
}

/// A `reduce:` that is neither `all` nor `partial:K`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "reduce must be `all` or `partial:K` with K at least 1 (the replicas each step combines with), not {0:?}"
)]
pub struct ReduceError(pub String);

impl TryFrom<String> for Reduce {
    type Error = ReduceError;

    fn try_from(text: String) -> Result<Reduce, ReduceError> {
        match text.as_str() {
            "all" => Ok(Reduce::All),
            other => other
                .strip_prefix("partial:")
                .and_then(|k| k.parse::<u32>().ok())
                .filter(|&k| k >= 1)
                .map(Reduce::Partial)
                .ok_or(ReduceError(text)),
        }
    }
}

impl From<Reduce> for String {
    /// The runtime's spelling.
    fn from(reduce: Reduce) -> String {
        match reduce {
            Reduce::All => "all".into(),
            Reduce::Partial(k) => format!("partial:{k}"),
        }
    }
}

/// One `slowdown:` entry: the rank, or the machine (every rank on it), whose compute takes
/// `factor` times as long. A rank's own entry wins over its machine's. The rank sleeps `factor - 1`
/// times what each forward, backward and step took, so on a loaded host the time it spent
/// waiting for a CPU is stretched as well.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Slowdown {
    /// A global rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// A host, as written in `machines`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// How many times as long its compute takes; at least 1.
    pub factor: f64,
}

/// Collective backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DistributedBackend {
    Gloo,
    Nccl,
}

/// Device kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    Cpu,
    Cuda,
}

/// The runtime's learning-rate policies, PipeDream's names accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LrPolicy {
    Constant,
    Step,
    Polynomial,
    #[serde(alias = "exponential_decay")]
    Exponential,
}

impl LrPolicy {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            LrPolicy::Constant => "constant",
            LrPolicy::Step => "step",
            LrPolicy::Polynomial => "polynomial",
            LrPolicy::Exponential => "exponential",
        }
    }
}

/// Pipeline schedules the runtime knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    Pipedream,
}

impl Optimizer {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            Optimizer::Sgd => "sgd",
            Optimizer::Adam => "adam",
            Optimizer::Adamw => "adamw",
        }
    }
}

impl DistributedBackend {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            DistributedBackend::Gloo => "gloo",
            DistributedBackend::Nccl => "nccl",
        }
    }
}

impl Schedule {
    /// The runtime's spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            Schedule::Gpipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Pipedream => "pipedream",
        }
    }
}

#[cfg(test)]
mod tests;
