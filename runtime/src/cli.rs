//! Command-line arguments. The clap types stop here: [`Cli::into_command`] turns them into the
//! validated [`crate::config`] types the rest of the runtime works with.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use stagehand_contract::slurm::SlurmTask;
use stagehand_contract::StageConfig;

use crate::config::{
    Backend, CheckpointConfig, Command, ConfigError, DeviceSpec, DistConfig, ForwardConfig, ModelChoice,
    ModulesConfig, OptimizerKind, P2pConfig, P2pGroups, PartialOptions, Precision, ProfileConfig,
    ReachConfig, ReduceOptions, Resume, TrainConfig, ValidationConfig, DEFAULT_FP16_INIT_SCALE,
};
use crate::data::{Augment, DataSpec};
use crate::host_memory;
use crate::lr::{LrPolicy, LrSchedule};
use crate::schedule::Schedule;

/// One training process (rank) of a model split across ranks.
///
/// stdout carries one JSON metrics object per line (docs/metrics.md); human-readable text goes to
/// stderr.
#[derive(Debug, Parser)]
#[command(
    name = "runtime",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Sub>,
    /// Validate the training request (model, stage config, schedule, replicas, microbatches,
    /// batch split) as a run would before connecting, print one JSON line and exit: 0 when it
    /// would start, 2 with the reason when not. Needs no device, data or other rank.
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    train: TrainArgs,
    /// The ids of the arguments given (on the command line or in the environment), not left
    /// to their defaults; set by [`Cli::parse_given_from`].
    #[arg(skip)]
    given: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Print the model's module list (index, name, parameters, output shape), to write stage configs by hand.
    Modules(ModulesArgs),
    /// Measure each module's forward and backward time, activation and parameter bytes, and write
    /// the profile JSON `driver plan` reads.
    Profile(ProfileArgs),
    /// Run the whole model once on given inputs with given weights, without training: the output
    /// and the loss, to compare with PyTorch's on the same weights and inputs (`--init-from`).
    Forward(ForwardArgs),
    /// Print one JSON line saying what this runtime can use here: its torch version, whether CUDA
    /// and NCCL are loaded and usable, and the CUDA devices it sees (the driver's preflight and
    /// CI ask it).
    Info,
    /// Prove a host reaches the master port (the driver's preflight): `listen` on the first host,
    /// `connect` from every host.
    #[command(hide = true, subcommand)]
    Reach(ReachSub),
    /// Measure point-to-point throughput between two ranks (used by bench/).
    #[command(hide = true)]
    P2pBench(P2pArgs),
}

#[derive(Debug, Subcommand)]
enum ReachSub {
    /// Hold PORT on every address for SECONDS, greeting whoever connects.
    Listen {
        #[arg(long)]
        port: u16,
        #[arg(long, default_value_t = 30.0)]
        seconds: f64,
    },
    /// Connect to HOST:PORT, retrying for up to SECONDS; exit 1 with the reason when it fails.
    Connect {
        #[arg(long)]
        host: String,
        #[arg(long)]
        port: u16,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
}

#[derive(Debug, Args)]
struct ProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Samples per measured batch: one microbatch of the runs the plan is for (`driver plan`
    /// plans minibatches of --microbatches times this; profile at the microbatch size).
    #[arg(long, default_value_t = stagehand_contract::defaults::BATCH_SIZE)]
    batch_size: usize,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Intra-op threads for libtorch [default: libtorch's own choice].
    #[arg(long)]
    threads: Option<usize>,
    #[command(flatten)]
    host_memory: HostMemoryArgs,
    /// Timed repeats per module; the profile keeps the median.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Write the profile here instead of stdout.
    #[arg(long, short)]
    output: Option<PathBuf>,
    /// The training data (as `--data` of a training run), so the model gets the same classes and
    /// image size; only its description is read.
    #[arg(long)]
    data: Option<String>,
    /// Measure in this arithmetic, as a training run with the same `--precision` computes: the
    /// forward passes and the loss under PyTorch's autocast, the activations in the dtype they
    /// cross stages in.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Fp32)]
    precision: PrecisionArg,
    /// Measure with parameters and image inputs in channels_last layout (`--channels-last`).
    #[arg(long)]
    channels_last: bool,
}

#[derive(Debug, Args)]
struct ForwardArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The weights: a `torch.save` state dict or a safetensors file, as `--init-from`.
    #[arg(long, value_name = "FILE")]
    init_from: PathBuf,
    /// The inputs: a file of the same formats holding `input` (images NCHW, or token ids) and
    /// `target` (class indices, or token ids).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// Where to write `output` and `loss` (safetensors).
    #[arg(long, short, value_name = "FILE")]
    output: PathBuf,
    /// Run as in training (batch statistics, dropout) instead of evaluation.
    #[arg(long)]
    train: bool,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Intra-op threads for libtorch [default: libtorch's own choice].
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Debug, Args)]
struct P2pArgs {
    #[arg(long, env = "RANK")]
    rank: usize,
    #[arg(long, env = "MASTER_ADDR", default_value = "127.0.0.1")]
    master_addr: String,
    #[arg(long, env = "MASTER_PORT", default_value_t = 29500)]
    master_port: u16,
    /// Bytes per message.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: usize,
    /// Messages to time.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
}

#[derive(Debug, Args)]
struct ModelArgs {
    /// Model to train: mlp, sparse_mlp, alexnet, vgg16, vgg16_bn, resnet50, resnet101, resnet152 or transformer.
    #[arg(long, required = true)]
    model: Option<String>,
    /// Output classes of image models [default: from the dataset, else 1000; 10 for mlp].
    #[arg(long)]
    num_classes: Option<i64>,
    /// Side of the square input images [default: 224; 32 for mlp and CIFAR-10].
    #[arg(long)]
    image_size: Option<i64>,
    /// Hidden layers (mlp and sparse_mlp, default 4) or encoder layers (transformer, default 12).
    #[arg(long)]
    layers: Option<usize>,
    /// Hidden width (mlp and sparse_mlp, default 1024) or hidden size (transformer, default 768).
    #[arg(long)]
    hidden: Option<i64>,
    /// Attention heads of the transformer [default: 12].
    #[arg(long)]
    heads: Option<i64>,
    /// Sequence length of the transformer [default: 128].
    #[arg(long)]
    seq_len: Option<i64>,
    /// Vocabulary size of the transformer [default: 30522].
    #[arg(long)]
    vocab_size: Option<i64>,
    /// Dropout probability [default: 0.5 for AlexNet's and VGG's classifiers, 0.1 for the transformer, 0 otherwise].
    #[arg(long)]
    dropout: Option<f64>,
    /// Hidden units each layer of sparse_mlp keeps per sample, handed on as a sparse COO tensor
    /// [default: a sixteenth of --hidden].
    #[arg(long, value_name = "N")]
    active_units: Option<i64>,
}

/// The longest `--comm-timeout`, in seconds.
const MAX_COMM_TIMEOUT_S: f64 = 1e7;

#[derive(Debug, Args)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Samples per iteration (minibatch).
    #[arg(long, default_value_t = stagehand_contract::defaults::BATCH_SIZE)]
    batch_size: usize,
    /// Iterations (optimizer steps) to run.
    #[arg(long, default_value_t = 10)]
    iterations: u64,
    /// Epochs to run instead of --iterations: each is --epoch-samples samples, in whole batches.
    #[arg(long, conflicts_with = "iterations")]
    epochs: Option<u64>,
    /// Samples in an epoch [default: the dataset's size; with synthetic data 1000000, as
    /// PipeDream's synthetic dataset]. Read only with --epochs or a learning-rate schedule.
    #[arg(long, value_name = "N")]
    epoch_samples: Option<u64>,
    /// Learning rate (the base rate of --lr-policy).
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// How the learning rate changes per epoch: constant, step (x --lr-step-factor every
    /// --lr-step-epochs), polynomial ((1 - epoch/epochs)^2) or exponential (0.97^(epoch/epochs)),
    /// PipeDream's policies.
    #[arg(long, value_enum, default_value_t = LrPolicyArg::Constant)]
    lr_policy: LrPolicyArg,
    /// Epochs between the step policy's decays.
    #[arg(long, default_value_t = 30)]
    lr_step_epochs: u64,
    /// The step policy's factor.
    #[arg(long, default_value_t = 0.1)]
    lr_step_factor: f64,
    /// Epochs of linear warm-up to --lr before the policy takes over (PipeDream's --lr_warmup: 5).
    #[arg(long, default_value_t = 0)]
    lr_warmup_epochs: u64,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    optimizer: OptimizerArg,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// SGD with Nesterov momentum.
    #[arg(long)]
    nesterov: bool,
    /// Weight decay: an L2 penalty for sgd and adam, decoupled for adamw.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Seed for parameters and synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Data: `synthetic`, `cifar10:DIR` (CIFAR-10 binary files), `imagefolder:DIR` (a subfolder of
    /// images per class; a DIR split as ImageNet's, train/ beside val/, means its train/), or a
    /// DIR whose format is recognised.
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// How images are transformed: crop-flip (an image folder's default: torchvision's
    /// RandomResizedCrop and RandomHorizontalFlip, as ImageNet training and PipeDream do; for
    /// CIFAR-10, RandomCrop(32, padding=4) and RandomHorizontalFlip) or none (an image folder's
    /// Resize and CenterCrop, CIFAR-10's images as they are; CIFAR-10's default).
    #[arg(long, value_enum)]
    augment: Option<Augment>,
    /// Threads decoding an image folder's images, as DataLoader's num_workers [default: 4, or
    /// the CPUs this process may use if fewer].
    #[arg(long, value_name = "N")]
    data_workers: Option<usize>,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Start from these weights instead of the seeded initialisation: a `torch.save` state dict
    /// (of `model.state_dict()`) or a safetensors file with torchvision's or BERT's names; each
    /// rank takes its own modules. Not read with --resume (the checkpoint holds the weights).
    #[arg(long, value_name = "FILE")]
    init_from: Option<PathBuf>,
    /// Several devices of this host for this rank's stage (`cuda:0,cuda:1`): its modules are
    /// split over them, as the stage config's module_to_device_map says or in runs of even
    /// measured cost, and activations move between them inside the process.
    #[arg(long, value_delimiter = ',', conflicts_with = "device", value_name = "LIST")]
    devices: Vec<String>,
    /// Intra-op threads for libtorch [default: libtorch's own choice].
    #[arg(long)]
    threads: Option<usize>,
    /// Arithmetic: fp32, or PyTorch's autocast to bf16 or fp16 (fp16 with a gradient scaler);
    /// activations and gradients cross stages in the autocast dtype.
    #[arg(long, value_enum, default_value_t = PrecisionArg::Fp32)]
    precision: PrecisionArg,
    /// fp16: the gradient scaler's first loss scale (torch.amp.GradScaler's init_scale), halved
    /// at each step whose gradients overflow, doubled after 2000 clean steps in a row.
    #[arg(long, value_name = "SCALE")]
    fp16_init_scale: Option<f64>,
    /// Parameters and image inputs in channels_last layout (convolutional models).
    #[arg(long)]
    channels_last: bool,
    /// Capture the whole training step (forwards, backwards, optimizer step) in a CUDA graph once
    /// the first iterations have run eagerly, and replay it from then on: one launch a step
    /// instead of one per kernel. A single process on one GPU; not with --trace or --slowdown.
    #[arg(long)]
    cuda_graph: bool,
    /// Deterministic algorithms only (PyTorch's torch.use_deterministic_algorithms(True) and
    /// cudnn.deterministic): a run repeats bit for bit on the same device, and an operator that
    /// has no deterministic version fails naming itself. Sets CUBLAS_WORKSPACE_CONFIG=:4096:8
    /// unless the environment sets :4096:8 or :16:8. Costs speed on a GPU.
    #[arg(long)]
    deterministic: bool,
    /// cuDNN times its convolution algorithms for each new shape on first use and keeps the
    /// fastest (PyTorch's torch.backends.cudnn.benchmark = True; PipeDream's runtime sets it):
    /// slower first iterations, faster ones after while shapes stay the same. Not with
    /// --deterministic.
    #[arg(long, conflicts_with = "deterministic")]
    cudnn_benchmark: bool,
    /// The runtime's own CUDA kernels where vgg16's layers suit them (bf16, channels_last): a
    /// convolution's bias and ReLU in one pass each way, and 2x2 max pooling that keeps a byte
    /// per window. The same values as ATen's kernels, but for the bias gradients' summing
    /// order. Needs --device cuda; not with --deterministic.
    #[arg(long, conflicts_with = "deterministic")]
    fused_kernels: bool,
    #[command(flatten)]
    host_memory: HostMemoryArgs,
    /// Leading iterations left out of the summary's throughput.
    #[arg(long, default_value_t = 1)]
    warmup: u64,
    /// At the end, write this rank's parameters to DIR/rank-N.safetensors.
    #[arg(long, value_name = "DIR")]
    save_params: Option<PathBuf>,
    /// Print a `trace` event per microbatch: the weights its forward and backward used.
    #[arg(long)]
    trace: bool,
    /// Record PyTorch's profiler over --profiler-steps iterations after --warmup (with
    /// --cuda-graph, after the capture) and write its Chrome trace here as soon as they have run:
    /// operators, and on a GPU every kernel, each iteration a `ProfilerStep#N`. `{rank}` in the
    /// path becomes the rank. Open it in Perfetto, or tabulate it with bench/trace_table.py;
    /// recording slows the iterations it records and the next, whose lines say `profiled` and
    /// which the summary's throughput leaves out while others remain.
    #[arg(long, value_name = "FILE")]
    profiler_trace: Option<PathBuf>,
    /// How many iterations --profiler-trace records (fewer if the run ends first) [default: 5]:
    /// a trace holds thousands of events an iteration, so a long run's whole would fill the
    /// host's memory and a file too big to open.
    #[arg(long, value_name = "N", requires = "profiler_trace")]
    profiler_steps: Option<u64>,
    /// Checkpoint this rank's parameters and optimizer state into DIR/rank-N/ after the last
    /// iteration (and every --checkpoint-every), replacing the previous checkpoint.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint after every N iterations as well.
    #[arg(long, value_name = "N", requires = "checkpoint_dir")]
    checkpoint_every: Option<u64>,
    /// Start from the latest checkpoint in --checkpoint-dir: the same losses and parameters, from
    /// there on, as a run that was never stopped. Give the arguments the checkpoint was written
    /// with. `--resume=auto` starts afresh when the folder holds no checkpoint yet.
    #[arg(
        long,
        value_enum,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "required",
        value_name = "auto",
        requires = "checkpoint_dir"
    )]
    resume: Option<ResumeArg>,
    /// Run the model forward over the held-out split after every N iterations and after the
    /// last (CIFAR-10's test_batch.bin, an image folder's val/ beside its train/, synthetic
    /// samples apart from the training pool), dropout off and batch norm on its running
    /// statistics: a `validation` line on the last stage with the loss and accuracies. A
    /// pipeline drains there (PipeDream's too, as at --checkpoint-every).
    #[arg(long, value_name = "N")]
    validate_every: Option<u64>,
    /// Minibatches of --batch-size each validation pass runs, at most 1048576 [default: all the
    /// held-out split holds; 4 with synthetic data].
    #[arg(long, value_name = "N", requires = "validate_every")]
    validation_batches: Option<u64>,
    #[command(flatten)]
    dist: DistArgs,
}

/// The launch contract (torchrun's variables as fallbacks), stage config and schedule.
#[derive(Debug, Args)]
struct DistArgs {
    /// Where the rank's place comes from: `env`, these flags with torchrun's variables as
    /// fallbacks; `slurm`, the environment srun gives each task (SLURM_PROCID, SLURM_NTASKS,
    /// SLURM_LOCALID, the step's first node as the master address), which then overrides
    /// --rank, --local-rank and --master-addr.
    #[arg(long, value_enum, default_value_t = LauncherArg::Env)]
    launcher: LauncherArg,
    /// This process's rank.
    #[arg(long, env = "RANK", default_value_t = 0)]
    rank: usize,
    /// Number of ranks [default: 1; with --launcher slurm, SLURM_NTASKS, which it must match].
    #[arg(long, env = "WORLD_SIZE")]
    world_size: Option<usize>,
    /// Address of rank 0, which hosts the rendezvous store.
    #[arg(long, env = "MASTER_ADDR", default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store on rank 0 [default: 29500; with --launcher slurm, 10000 +
    /// the job id modulo 20000].
    #[arg(long, env = "MASTER_PORT")]
    master_port: Option<u16>,
    /// Rank within this host; picks the GPU when --device is plain `cuda`.
    #[arg(long, env = "LOCAL_RANK", default_value_t = 0)]
    local_rank: usize,
    /// The run this rank is one of, the same on every rank (the driver gives each run its own):
    /// the rendezvous keeps the run's keys apart, so a rank of another run that reaches the same
    /// master port meets none of them.
    #[arg(long, env = "STAGEHAND_RUN_ID", value_name = "ID")]
    run_id: Option<String>,
    /// Communication backend [default: gloo on CPU, nccl on CUDA].
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// The groups activations and gradients travel on between stages: `world` (one per
    /// direction over every rank) or `pairs` (one per pair of neighbouring ranks and direction,
    /// each with its own NCCL communicator and stream) [default: pairs with nccl, world with gloo].
    #[arg(long, value_enum, value_name = "GROUPS")]
    p2p_groups: Option<P2pGroupsArg>,
    /// PipeDream stage config (JSON: module_to_stage_map, stage_to_rank_map, stage_to_depth_map).
    /// Without one, every rank holds the whole model (data parallelism).
    #[arg(long)]
    stage_config: Option<PathBuf>,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = ScheduleArg::OneFOneB)]
    schedule: ScheduleArg,
    /// Microbatches per minibatch [default: the number of stages or the largest replica count].
    #[arg(long)]
    microbatches: Option<usize>,
    /// Seconds any rendezvous or communication may wait before the rank gives up.
    #[arg(long, default_value_t = 60.0)]
    comm_timeout: f64,
    /// Slow one rank's compute by a factor, as RANK=FACTOR (straggler emulation); repeatable.
    #[arg(long, value_name = "RANK=FACTOR")]
    slowdown: Vec<String>,
    /// Replicas all-reduce gradients in flat buckets of at most this many MiB (DDP's
    /// bucket_cap_mb; fractions allowed).
    #[arg(long, value_name = "MB", default_value_t = 25.0)]
    bucket_mb: f64,
    /// Start each bucket's all-reduce during the backward pass, as soon as its gradients are
    /// final (DDP), or only after the backward. `auto` (the default): on with CUDA devices, off
    /// on CPUs, where Gloo's reduction takes the cores the backward pass runs on (measured on 2
    /// cores: a slower step, bench/overlap_reduce.py).
    #[arg(long, value_enum, default_value_t = Overlap::Auto)]
    overlap_reduce: Overlap,
    /// How a stage's replicas combine each step: `all` all-reduces every replica's gradients;
    /// `partial:K` (SD-PIPE's partial reduce) averages parameters and gradients with only the
    /// first K replicas ready, so a straggler holds no one back (GPipe and 1F1B only).
    #[arg(long, value_name = "all|partial:K", default_value = "all")]
    reduce: String,
    /// With --reduce partial:K, every this many groups is every live replica (bounds how far
    /// replicas drift apart; 1 makes every group full) [default: 10].
    #[arg(long, value_name = "GROUPS")]
    sync_every: Option<usize>,
    /// Send float32 activations between stages as float16 (half the bytes; PipeDream's
    /// compress_activations), cast on the device that holds them; gradients stay float32.
    /// Every rank must be given it.
    #[arg(long)]
    compress_activations: bool,
    /// Sparse transfers (SparsePipedream): `auto` sends each activation and gradient in its
    /// smallest form by measured density (dense, int32 indices + values, or a bitmask + values),
    /// rebuilt bit for bit on arrival; `off` sends them dense. Needs Gloo (its tags match the
    /// variable-size payloads); every rank must be given the same.
    #[arg(long, value_enum, default_value_t = CompressArg::Off)]
    compress: CompressArg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CompressArg {
    Auto,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LauncherArg {
    Env,
    Slurm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Overlap {
    Auto,
    On,
    Off,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    Gloo,
    Nccl,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum P2pGroupsArg {
    World,
    Pairs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ScheduleArg {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    Pipedream,
}

#[derive(Debug, Args)]
struct ModulesArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Batch size used to compute output shapes.
    #[arg(long, default_value_t = 1)]
    batch_size: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LrPolicyArg {
    Constant,
    Step,
    Polynomial,
    /// PipeDream's `exponential_decay`.
    #[value(alias = "exponential_decay")]
    Exponential,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OptimizerArg {
    Sgd,
    Adam,
    /// Adam with decoupled weight decay.
    #[value(name = "adamw")]
    AdamW,
}

/// `--host-memory`, shared by the commands that train or measure.
#[derive(Debug, Args)]
struct HostMemoryArgs {
    /// Host memory a step frees: `keep` it for the next iteration (no block unmapped, the heap
    /// never trimmed, so the next iteration faults in and zeroes nothing again), or `release` it
    /// to the system as glibc does by default. malloc settings in the environment
    /// (GLIBC_TUNABLES, MALLOC_*_) win over either.
    #[arg(long, value_enum, default_value_t = HostMemoryArg::Keep)]
    host_memory: HostMemoryArg,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum HostMemoryArg {
    Keep,
    Release,
}

impl From<HostMemoryArgs> for host_memory::Policy {
    fn from(args: HostMemoryArgs) -> host_memory::Policy {
        match args.host_memory {
            HostMemoryArg::Keep => host_memory::Policy::Keep,
            HostMemoryArg::Release => host_memory::Policy::Release,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ResumeArg {
    /// What `--resume` alone means: the checkpoint must be there.
    #[value(hide = true)]
    Required,
    Auto,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum PrecisionArg {
    Fp32,
    Bf16,
    Fp16,
}

impl From<PrecisionArg> for Precision {
    fn from(arg: PrecisionArg) -> Precision {
        match arg {
            PrecisionArg::Fp32 => Precision::Fp32,
            PrecisionArg::Bf16 => Precision::Bf16,
            PrecisionArg::Fp16 => Precision::Fp16,
        }
    }
}

impl Cli {
    /// Parses `argv` as clap's `try_parse_from` does, keeping which arguments were given, so a
    /// flag given that does nothing in its request can be warned of even where it has a default.
    pub fn parse_given_from<I, T>(argv: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{parser::ValueSource, CommandFactory, FromArgMatches};
        let matches = Cli::command().try_get_matches_from(argv)?;
        let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut Cli::command()))?;
        cli.given = matches
            .ids()
            .filter(|id| {
                matches!(
                    matches.value_source(id.as_str()),
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                )
            })
            .map(|id| id.to_string())
            .collect();
        Ok(cli)
    }

    /// Validates the arguments into the command to run.
    pub fn into_command(self) -> Result<Command, ConfigError> {
        match self.command {
            Some(Sub::Modules(m)) => Ok(Command::Modules(ModulesConfig {
                model: m.model.into_choice(None)?,
                batch_size: batch_size(m.batch_size)?,
                json: m.json,
            })),
            Some(Sub::Profile(p)) => Ok(Command::Profile(ProfileConfig {
                model: p
                    .model
                    .into_choice(p.data.as_deref().map(DataSpec::parse).transpose()?.as_ref())?,
                batch_size: batch_size(p.batch_size)?,
                device: DeviceSpec::parse(&p.device)?,
                threads: p.threads.map(|t| positive("--threads", t)).transpose()?,
                host_memory: p.host_memory.into(),
                repeats: positive("--repeats", p.repeats)?,
                output: p.output,
                precision: p.precision.into(),
                channels_last: p.channels_last,
            })),
            Some(Sub::Forward(f)) => Ok(Command::Forward(ForwardConfig {
                model: f.model.into_choice(None)?,
                init_from: f.init_from,
                input: f.input,
                output: f.output,
                train: f.train,
                device: DeviceSpec::parse(&f.device)?,
                threads: f.threads.map(|t| positive("--threads", t)).transpose()?,
            })),
            Some(Sub::Info) => Ok(Command::Info),
            Some(Sub::Reach(r)) => Ok(Command::Reach(match r {
                ReachSub::Listen { port, seconds } => ReachConfig::Listen {
                    port,
                    seconds: positive_seconds("--seconds", seconds)?,
                },
                ReachSub::Connect { host, port, seconds } => ReachConfig::Connect {
                    host,
                    port,
                    seconds: positive_seconds("--seconds", seconds)?,
                },
            })),
            Some(Sub::P2pBench(p)) => {
                if p.rank > 1 {
                    return Err(ConfigError::Invalid {
                        flag: "--rank",
                        reason: "p2p-bench runs ranks 0 and 1".into(),
                    });
                }
                Ok(Command::P2pBench(P2pConfig {
                    rank: p.rank,
                    master_addr: p.master_addr,
                    master_port: p.master_port,
                    bytes: positive("--bytes", p.bytes)?,
                    rounds: positive("--rounds", p.rounds)?,
                }))
            }
            None => {
                let check = self.check;
                self.train.into_config(&self.given).map(|config| match check {
                    true => Command::Check(Box::new(config)),
                    false => Command::Train(Box::new(config)),
                })
            }
        }
    }
}

/// What `--cuda-graph` needs: one process (no peers, whose transfers and collectives the
/// graph would have to hold), on one GPU, and a step with nothing that waits for the device or
/// reseeds within it (--trace reads the weights; --slowdown sleeps by the compute's time). fp16's
/// gradient scaler skips steps on the device, so it is captured with the rest.
fn check_cuda_graph(trace: bool, dist: &DistConfig, devices: &[DeviceSpec]) -> Result<(), ConfigError> {
    let refusal = if !matches!(devices, [DeviceSpec::Cuda(_)]) {
        Some((
            "--device",
            "captures the step on one GPU; use --device cuda (one device), or drop --cuda-graph",
        ))
    } else if dist.world_size > 1 {
        Some((
            "--world-size",
            "captures a single process's step; ranks that talk to each other run without it \
                 (drop --cuda-graph, or use --world-size 1)",
        ))
    } else if trace {
        Some(("--trace", "reads the weights within the step; drop --trace"))
    } else if dist.slowdown > 1.0 {
        Some((
            "--slowdown",
            "stretches each kernel run by its measured time; drop --slowdown",
        ))
    } else {
        None
    };
    match refusal {
        Some((flag, why)) => Err(ConfigError::Invalid {
            flag,
            reason: format!("not with --cuda-graph: {why}"),
        }),
        None => Ok(()),
    }
}

/// The most minibatches a validation pass may take (`--validation-batches`): a pass's actions
/// are listed before it runs, and a count past this asks for more memory than a machine has
/// (1e11 aborted allocating); a real split holds far fewer (ImageNet's: 50,000 images).
const MAX_VALIDATION_BATCHES: u64 = 1 << 20;

/// `--sync-every` without the flag.
const DEFAULT_SYNC_EVERY: usize = 10;

/// The flags of a training request that do something only in some settings, as given.
struct Asked {
    channels_last: bool,
    cudnn_benchmark: bool,
    threads: Option<usize>,
    sync_every: bool,
    overlap_reduce: bool,
    compress: bool,
    compress_activations: bool,
    /// The other flags given, by clap id (`lr_step_epochs`).
    given: Vec<String>,
    checkpoint_every: Option<u64>,
}

impl Asked {
    fn of(args: &TrainArgs, given: &[String]) -> Asked {
        Asked {
            given: given.to_vec(),
            checkpoint_every: args.checkpoint_every,
            channels_last: args.channels_last,
            cudnn_benchmark: args.cudnn_benchmark,
            threads: args.threads,
            sync_every: args.dist.sync_every.is_some(),
            overlap_reduce: args.dist.overlap_reduce == Overlap::On,
            compress: args.dist.compress == CompressArg::Auto,
            compress_activations: args.dist.compress_activations,
        }
    }

    /// A warning for each flag given that does nothing in this request (a request that has it
    /// runs as one without it), saying why; the run goes on.
    fn idle(
        &self,
        model: &ModelChoice,
        devices: &[DeviceSpec],
        dist: &DistConfig,
        iterations: u64,
        optimizer: &OptimizerKind,
        schedule: &LrSchedule,
    ) -> Vec<String> {
        let mut idle = Vec::new();
        let stage_ranks: Vec<usize> = match &dist.stage_config {
            Some(config) => config.stage_to_rank_map.values().map(Vec::len).collect(),
            None => vec![dist.world_size],
        };
        if self.channels_last && !crate::models::has_convolutions(&model.name) {
            idle.push(format!(
                "--channels-last does nothing for {}, which has no convolutions; drop it",
                model.name
            ));
        }
        if self.cudnn_benchmark && devices.iter().all(|d| *d == DeviceSpec::Cpu) {
            idle.push(
                "--cudnn-benchmark does nothing on the CPU (cuDNN runs on CUDA devices); drop it".into(),
            );
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if let Some(threads) = self.threads.filter(|&t| t > cores) {
            idle.push(format!(
                "--threads {threads} is more than the {cores} cores this process may use: the threads \
                 take turns on them, which makes each step slower; give at most {cores}"
            ));
        }
        if self.sync_every && dist.reduce.partial.is_none() {
            idle.push("--sync-every does nothing without --reduce partial:K; drop it".into());
        }
        if self.overlap_reduce && stage_ranks.iter().all(|&n| n == 1) {
            idle.push(
                "--overlap-reduce on does nothing here: no stage has replicas, so no gradients are \
                 all-reduced; drop it"
                    .into(),
            );
        }
        idle.extend(self.idle_given(model, &stage_ranks, iterations, optimizer, schedule));
        for (given, flag) in [
            (self.compress, "--compress auto"),
            (self.compress_activations, "--compress-activations"),
        ] {
            if given && stage_ranks.len() == 1 {
                idle.push(format!(
                    "{flag} does nothing here: the run has one stage, so no activations or \
                     gradients pass between stages; drop it"
                ));
            }
        }
        idle
    }

    /// [`Asked::idle`]'s warnings of flags that have defaults, seen as given by clap.
    fn idle_given(
        &self,
        model: &ModelChoice,
        stage_ranks: &[usize],
        iterations: u64,
        optimizer: &OptimizerKind,
        schedule: &LrSchedule,
    ) -> Vec<String> {
        let given = |id: &str| self.given.iter().any(|g| g == id);
        let mut idle = Vec::new();
        let sizes = crate::models::size_flags(&model.name);
        for id in [
            "num_classes",
            "image_size",
            "layers",
            "hidden",
            "heads",
            "seq_len",
            "vocab_size",
            "dropout",
        ] {
            let flag = format!("--{}", id.replace('_', "-"));
            if given(id) && !sizes.contains(&flag.as_str()) {
                idle.push(format!(
                    "{flag} does nothing for {}, which is sized by {} alone; drop it",
                    model.name,
                    sizes.join(", ")
                ));
            }
        }
        let optimizer = optimizer.name();
        if given("momentum") && optimizer != "sgd" {
            idle.push(format!(
                "--momentum does nothing with --optimizer {optimizer}, which keeps its own moments \
                 (--momentum is SGD's); drop it"
            ));
        }
        let policy = schedule.policy.name();
        if policy != "step" {
            for (id, flag) in [
                ("lr_step_epochs", "--lr-step-epochs"),
                ("lr_step_factor", "--lr-step-factor"),
            ] {
                if given(id) {
                    idle.push(format!(
                        "{flag} does nothing with --lr-policy {policy}; it sets the step policy's \
                         decay: give --lr-policy step, or drop it"
                    ));
                }
            }
        }
        if given("epoch_samples") && !given("epochs") && !schedule.varies() {
            idle.push(
                "--epoch-samples does nothing without --epochs, --lr-policy or --lr-warmup-epochs \
                 (the epoch is what they count in); drop it"
                    .into(),
            );
        }
        if given("bucket_mb") && stage_ranks.iter().all(|&n| n == 1) {
            idle.push(
                "--bucket-mb does nothing here: no stage has replicas, so no gradients are \
                 all-reduced; drop it"
                    .into(),
            );
        }
        if given("p2p_groups") && stage_ranks.len() == 1 {
            idle.push(
                "--p2p-groups does nothing here: the run has one stage, so nothing passes between \
                 stages; drop it"
                    .into(),
            );
        }
        if let Some(every) = self.checkpoint_every.filter(|&every| every > iterations) {
            idle.push(format!(
                "--checkpoint-every {every} does nothing in a run of {iterations} iterations: its \
                 one checkpoint is the one at the end, which is written without it; drop it or \
                 give at most {iterations}"
            ));
        }
        idle
    }
}

impl TrainArgs {
    fn into_config(self, given: &[String]) -> Result<TrainConfig, ConfigError> {
        let asked = Asked::of(&self, given);
        let optimizer = self.optimizer_kind()?;
        let data = DataSpec::parse(&self.data)?;
        let (augment, data_workers) = self.image_loading(&data)?;
        let batch_size = batch_size(self.batch_size)?;
        let (iterations, lr_schedule) = self.lr_schedule(&data, batch_size)?;
        let devices = self.devices()?;
        let model = self.model.into_choice(Some(&data))?;
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(ConfigError::Invalid {
                flag: "--lr",
                reason: format!("{} is not a positive number", self.lr),
            });
        }
        let place = self.dist.place(|name| std::env::var(name).ok())?;
        let device = match self.device.as_str() {
            _ if !devices.is_empty() => devices[0],
            "cuda" => DeviceSpec::Cuda(place.cuda_index),
            other => DeviceSpec::parse(other)?,
        };
        let spans = devices.len() > 1;
        if spans && self.dist.overlap_reduce == Overlap::On {
            return Err(ConfigError::Invalid {
                flag: "--overlap-reduce",
                reason: "a stage over several --devices all-reduces after its backward (autograd \
                         runs each device's part on a thread of its own); use --overlap-reduce off \
                         or auto"
                    .into(),
            });
        }
        let mut dist = self.dist.into_config(place, device)?;
        if spans {
            dist.reduce.overlap = false;
        }
        let devices = if devices.is_empty() { vec![device] } else { devices };
        let stages = dist
            .stage_config
            .as_ref()
            .map_or(1, |c| c.stage_to_rank_map.len());
        if matches!(self.precision, PrecisionArg::Fp16) && dist.schedule == Schedule::PipeDream && stages > 1
        {
            return Err(ConfigError::Invalid {
                flag: "--precision",
                reason: "fp16's gradient scaler makes every stage skip the same steps, which needs the \
                         flush of --schedule gpipe or 1f1b; use --precision bf16 with pipedream"
                    .into(),
            });
        }
        let checkpoint = self.checkpoint_dir.clone().map(|dir| CheckpointConfig {
            dir,
            every: self.checkpoint_every,
            resume: match self.resume {
                None => Resume::No,
                Some(ResumeArg::Required) => Resume::Required,
                Some(ResumeArg::Auto) => Resume::IfPresent,
            },
        });
        if checkpoint.is_some() && self.checkpoint_every == Some(0) {
            return Err(ConfigError::Invalid {
                flag: "--checkpoint-every",
                reason: "must be at least 1".into(),
            });
        }
        if self.cuda_graph {
            check_cuda_graph(self.trace, &dist, &devices)?;
        }
        if self.fused_kernels && !devices.iter().all(|d| matches!(d, DeviceSpec::Cuda(_))) {
            return Err(ConfigError::Invalid {
                flag: "--fused-kernels",
                reason: "runs CUDA kernels; use --device cuda, or drop --fused-kernels".into(),
            });
        }
        let profiler_steps = self.profiler_steps.unwrap_or(DEFAULT_PROFILER_STEPS);
        if profiler_steps == 0 {
            return Err(ConfigError::Invalid {
                flag: "--profiler-steps",
                reason: "must be at least 1".into(),
            });
        }
        if self.profiler_trace.is_some() {
            let replays_from = self.cuda_graph.then(|| crate::pipeline::first_replayed(0));
            let from = crate::profiler_trace::first_traced(self.warmup, 0, replays_from);
            if iterations <= from {
                let what = if from > self.warmup {
                    format!(
                        "the replayed iterations (from iteration {from} on: --cuda-graph captures \
                         iteration {})",
                        from - 1
                    )
                } else {
                    format!("the iterations after --warmup {from} (from iteration {from} on)")
                };
                return Err(ConfigError::Invalid {
                    flag: "--profiler-trace",
                    reason: format!(
                        "records {what}, and the run has only {iterations}; raise --iterations \
                         or lower --warmup"
                    ),
                });
            }
        }
        if self.deterministic {
            let current = std::env::var(crate::determinism::CUBLAS_WORKSPACE_CONFIG).ok();
            crate::determinism::cublas_workspace(current.as_deref()).map_err(|reason| {
                ConfigError::Invalid {
                    flag: "--deterministic",
                    reason,
                }
            })?;
        }
        let fp16_init_scale = match (self.fp16_init_scale, &self.precision) {
            (None, _) => DEFAULT_FP16_INIT_SCALE,
            (Some(_), PrecisionArg::Fp32 | PrecisionArg::Bf16) => {
                return Err(ConfigError::Invalid {
                    flag: "--fp16-init-scale",
                    reason: "scales the loss for fp16's gradient scaler; use it with --precision fp16".into(),
                })
            }
            // Kept as float32, as torch's scaler keeps it.
            (Some(scale), PrecisionArg::Fp16) if scale > 0.0 && scale <= f64::from(f32::MAX) => scale,
            (Some(scale), PrecisionArg::Fp16) => {
                return Err(ConfigError::Invalid {
                    flag: "--fp16-init-scale",
                    reason: format!("must be a positive float32 number (at most 3.4e38), not {scale}"),
                })
            }
        };
        if dist.reduce.partial.is_some() {
            // Each of these needs every replica at the same step, which a partial reduce gives up.
            let refusal = if dist.schedule == Schedule::PipeDream {
                Some((
                    "--schedule",
                    "pipedream steps after every backward with weights stashed; use gpipe or 1f1b",
                ))
            } else if matches!(self.precision, PrecisionArg::Fp16) {
                Some((
                    "--precision",
                    "fp16's gradient scaler makes every rank skip the same steps; use bf16 or fp32",
                ))
            } else if checkpoint.is_some() {
                Some((
                    "--checkpoint-dir",
                    "checkpoints are of one iteration on every rank; drop --checkpoint-dir",
                ))
            } else {
                None
            };
            if let Some((flag, why)) = refusal {
                return Err(ConfigError::Invalid {
                    flag,
                    reason: format!(
                        "not with --reduce partial:K (replicas step apart): {why}, or use --reduce all"
                    ),
                });
            }
        }
        let validation = self
            .validate_every
            .map(|every| -> Result<ValidationConfig, ConfigError> {
                // With --cuda-graph a pass runs eagerly between replays, on the weights the
                // replays update in place.
                if dist.reduce.partial.is_some() {
                    return Err(ConfigError::Invalid {
                        flag: "--validate-every",
                        reason: "not with --reduce partial:K: it lets replicas step apart, and a pass \
                                 needs every one at the same weights; use --reduce all"
                            .into(),
                    });
                }
                Ok(ValidationConfig {
                    every: positive("--validate-every", every as usize)? as u64,
                    batches: self
                        .validation_batches
                        .map(|n| match n {
                            n if n > MAX_VALIDATION_BATCHES => Err(ConfigError::Invalid {
                                flag: "--validation-batches",
                                reason: format!(
                                    "{n} is more than a pass may take: give at most \
                                     {MAX_VALIDATION_BATCHES}"
                                ),
                            }),
                            n => positive("--validation-batches", n as usize).map(|n| n as u64),
                        })
                        .transpose()?,
                })
            })
            .transpose()?;
        let profiler_trace = self
            .profiler_trace
            .map(|template| crate::profiler_trace::path_for_rank(&template, dist.rank));
        let warnings = asked.idle(&model, &devices, &dist, iterations, &optimizer, &lr_schedule);
        Ok(TrainConfig {
            warnings,
            validation,
            dist,
            model,
            batch_size,
            iterations,
            lr: self.lr,
            lr_schedule,
            optimizer,
            seed: self.seed,
            data,
            augment,
            data_workers,
            device,
            devices,
            init_from: self.init_from,
            threads: self.threads.map(|t| positive("--threads", t)).transpose()?,
            precision: self.precision.into(),
            fp16_init_scale,
            channels_last: self.channels_last,
            cuda_graph: self.cuda_graph,
            deterministic: self.deterministic,
            cudnn_benchmark: self.cudnn_benchmark,
            fused_kernels: self.fused_kernels,
            host_memory: self.host_memory.into(),
            warmup: self.warmup,
            save_params: self.save_params,
            trace: self.trace,
            profiler_trace,
            profiler_steps,
            checkpoint,
        })
    }

    /// `--devices`, each parsed; all CPU or all CUDA, none twice (the CPU may repeat, for
    /// trying a split without GPUs).
    fn devices(&self) -> Result<Vec<DeviceSpec>, ConfigError> {
        let invalid = |reason: String| ConfigError::Invalid {
            flag: "--devices",
            reason,
        };
        let devices =
            self.devices
                .iter()
                .map(|d| match d.trim() {
                    "cuda" => Err(invalid("name each GPU (cuda:0,cuda:1), not plain cuda".into())),
                    other => DeviceSpec::parse(other)
                        .map_err(|_| invalid(format!("{other:?} is not cpu or cuda:N"))),
                })
                .collect::<Result<Vec<_>, _>>()?;
        if devices.contains(&DeviceSpec::Cpu) && devices.iter().any(|d| *d != DeviceSpec::Cpu) {
            return Err(invalid(
                "mixes the CPU and GPUs; give only cuda:N devices, or only cpu".into(),
            ));
        }
        for (i, d) in devices.iter().enumerate() {
            if *d != DeviceSpec::Cpu && devices[..i].contains(d) {
                return Err(invalid(format!("names {d} twice")));
            }
        }
        Ok(devices)
    }

    /// `--augment` (image data: an image folder crops and flips by default, CIFAR-10 does not)
    /// and `--data-workers` (an image folder's, the one dataset decoded as it goes).
    fn image_loading(&self, data: &DataSpec) -> Result<(Augment, usize), ConfigError> {
        let refuse = |flag: &'static str, what: &str| ConfigError::Invalid {
            flag,
            reason: format!("only {what}; {data} has none: drop {flag}"),
        };
        let augment = match (data, self.augment) {
            (DataSpec::Synthetic, Some(_)) => return Err(refuse("--augment", "real images are transformed")),
            (_, Some(augment)) => augment,
            (DataSpec::ImageFolder(_), None) => Augment::CropFlip,
            (_, None) => Augment::None,
        };
        let workers = match (data, self.data_workers) {
            (DataSpec::ImageFolder(_), Some(n)) => positive("--data-workers", n)?,
            (_, Some(_)) => {
                return Err(refuse(
                    "--data-workers",
                    "an image folder's images are decoded as it goes",
                ))
            }
            (_, None) => {
                DEFAULT_DATA_WORKERS.min(std::thread::available_parallelism().map_or(1, |n| n.get()))
            }
        };
        Ok((augment, workers))
    }

    /// The run's iterations and learning rate per iteration. An epoch's length is read only when
    /// something needs it: --epochs, a policy other than constant, or a warm-up.
    fn lr_schedule(&self, data: &DataSpec, batch_size: usize) -> Result<(u64, LrSchedule), ConfigError> {
        let invalid = |flag, reason: String| ConfigError::Invalid { flag, reason };
        let policy = match self.lr_policy {
            LrPolicyArg::Constant => LrPolicy::Constant,
            LrPolicyArg::Step => {
                if !(self.lr_step_factor.is_finite() && self.lr_step_factor > 0.0) {
                    return Err(invalid(
                        "--lr-step-factor",
                        format!("{} is not a positive number", self.lr_step_factor),
                    ));
                }
                LrPolicy::Step {
                    every_epochs: positive("--lr-step-epochs", self.lr_step_epochs as usize)? as u64,
                    factor: self.lr_step_factor,
                }
            }
            LrPolicyArg::Polynomial => LrPolicy::Polynomial { power: 2.0 },
            LrPolicyArg::Exponential => LrPolicy::Exponential { rate: 0.97 },
        };
        let mut schedule = LrSchedule {
            policy,
            warmup_epochs: self.lr_warmup_epochs,
            ..LrSchedule::constant(self.lr)
        };
        if self.epochs.is_none() && !schedule.varies() {
            return Ok((self.iterations, schedule));
        }
        let samples = match self.epoch_samples {
            Some(n) => n,
            None => data.samples().map_err(|e| {
                invalid(
                    "--epoch-samples",
                    format!(
                        "an epoch is the dataset once over, and {data} cannot be counted on this \
                         rank ({e}); pass --epoch-samples N"
                    ),
                )
            })?,
        };
        schedule.epoch_iterations = samples / batch_size as u64;
        if schedule.epoch_iterations == 0 {
            return Err(invalid(
                "--epoch-samples",
                format!("an epoch of {samples} samples holds no whole batch of {batch_size}"),
            ));
        }
        let iterations = match self.epochs {
            Some(epochs) => positive("--epochs", epochs as usize)? as u64 * schedule.epoch_iterations,
            None => self.iterations,
        };
        schedule.epochs = iterations as f64 / schedule.epoch_iterations as f64;
        Ok((iterations, schedule))
    }

    /// The optimizer, with torch.optim's checks of its hyper-parameters.
    fn optimizer_kind(&self) -> Result<OptimizerKind, ConfigError> {
        let invalid = |flag, reason: String| ConfigError::Invalid { flag, reason };
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(invalid(
                "--weight-decay",
                format!("{} is not a number of at least 0", self.weight_decay),
            ));
        }
        let weight_decay = self.weight_decay;
        if self.nesterov && !matches!(self.optimizer, OptimizerArg::Sgd) {
            return Err(invalid("--nesterov", "applies to --optimizer sgd only".into()));
        }
        Ok(match self.optimizer {
            OptimizerArg::Sgd => {
                if !(self.momentum.is_finite() && self.momentum >= 0.0) {
                    return Err(invalid(
                        "--momentum",
                        format!("{} is not a number of at least 0", self.momentum),
                    ));
                }
                if self.nesterov && self.momentum == 0.0 {
                    return Err(invalid("--nesterov", "needs a --momentum above 0".into()));
                }
                OptimizerKind::Sgd {
                    momentum: self.momentum,
                    weight_decay,
                    nesterov: self.nesterov,
                }
            }
            OptimizerArg::Adam => OptimizerKind::Adam { weight_decay },
            OptimizerArg::AdamW => OptimizerKind::AdamW { weight_decay },
        })
    }
}

/// Where a rank is in the world: from its flags, or from Slurm's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Place {
    rank: usize,
    world_size: usize,
    master_addr: String,
    master_port: u16,
    /// The CUDA device plain `--device cuda` means.
    cuda_index: usize,
}

/// The rendezvous port when neither --master-port nor MASTER_PORT gives one (torchrun's).
const DEFAULT_MASTER_PORT: u16 = 29500;
/// Image decoding threads without `--data-workers`: PipeDream's `--workers` default.
const DEFAULT_DATA_WORKERS: usize = 4;

impl DistArgs {
    /// The rank's place; `var` reads the environment (Slurm's, with `--launcher slurm`).
    fn place(&self, var: impl Fn(&str) -> Option<String>) -> Result<Place, ConfigError> {
        let invalid = |flag, reason: String| ConfigError::Invalid { flag, reason };
        let place = match self.launcher {
            LauncherArg::Env => Place {
                rank: self.rank,
                world_size: self.world_size.unwrap_or(1),
                master_addr: self.master_addr.clone(),
                master_port: self.master_port.unwrap_or(DEFAULT_MASTER_PORT),
                cuda_index: self.local_rank,
            },
            LauncherArg::Slurm => {
                let task = SlurmTask::from_env(&var).map_err(|e| invalid("--launcher", e.to_string()))?;
                if let Some(n) = self.world_size.filter(|&n| n != task.world_size) {
                    return Err(invalid(
                        "--world-size",
                        format!(
                            "{n}, but srun started {} tasks; ask srun for {n} tasks (--ntasks, or \
                             --nodes x --ntasks-per-node) or drop --world-size",
                            task.world_size
                        ),
                    ));
                }
                // With --gpus-per-task Slurm shows each task its own GPUs; with a node's --gres
                // every task sees them all and takes the one its rank on the node picks.
                let visible = var("CUDA_VISIBLE_DEVICES")
                    .map(|v| v.split(',').filter(|d| !d.trim().is_empty()).count())
                    .filter(|&n| n > 0);
                Place {
                    rank: task.rank,
                    world_size: task.world_size,
                    master_addr: task.master_addr().to_string(),
                    master_port: self.master_port.unwrap_or_else(|| task.default_master_port()),
                    cuda_index: visible.map_or(task.local_rank, |n| task.local_rank % n),
                }
            }
        };
        if place.world_size == 0 {
            return Err(invalid("--world-size", "must be at least 1".into()));
        }
        if place.rank >= place.world_size {
            return Err(invalid(
                "--rank",
                format!("{} is not below --world-size {}", place.rank, place.world_size),
            ));
        }
        Ok(place)
    }

    fn into_config(self, place: Place, device: DeviceSpec) -> Result<DistConfig, ConfigError> {
        let invalid = |flag, reason: String| ConfigError::Invalid { flag, reason };
        if self.microbatches == Some(0) {
            return Err(invalid("--microbatches", "must be at least 1".into()));
        }
        if !(self.comm_timeout.is_finite() && self.comm_timeout > 0.0) {
            return Err(invalid(
                "--comm-timeout",
                format!("{} is not a positive number of seconds", self.comm_timeout),
            ));
        }
        // c10d counts its timeouts in milliseconds of an i64.
        if self.comm_timeout > MAX_COMM_TIMEOUT_S {
            return Err(invalid(
                "--comm-timeout",
                format!(
                    "{} s is longer than the {MAX_COMM_TIMEOUT_S} s (about 116 days) it may be",
                    self.comm_timeout
                ),
            ));
        }
        let stage_config = match &self.stage_config {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| invalid("--stage-config", format!("cannot read {}: {e}", path.display())))?;
                let config = StageConfig::from_json(&text)
                    .map_err(|e| invalid("--stage-config", format!("{}: {e}", path.display())))?;
                Some(config)
            }
        };
        let mut slowdown = 1.0;
        for spec in &self.slowdown {
            let parsed = spec
                .split_once('=')
                .and_then(|(r, f)| Some((r.parse::<usize>().ok()?, f.parse::<f64>().ok()?)));
            match parsed {
                Some((rank, factor)) if factor >= 1.0 && factor.is_finite() => {
                    if rank == place.rank {
                        slowdown = factor;
                    }
                }
                _ => {
                    return Err(invalid(
                        "--slowdown",
                        format!("{spec:?} is not RANK=FACTOR with a factor of at least 1"),
                    ))
                }
            }
        }
        let bucket_bytes = self.bucket_mb * (1u64 << 20) as f64;
        if !(bucket_bytes.is_finite() && bucket_bytes >= 1.0) {
            return Err(invalid(
                "--bucket-mb",
                format!("{} is not a positive size (at least one byte)", self.bucket_mb),
            ));
        }
        let partial = match self.reduce.as_str() {
            "all" => None,
            spec => {
                let k = spec
                    .strip_prefix("partial:")
                    .and_then(|k| k.parse::<usize>().ok())
                    .filter(|&k| k >= 1)
                    .ok_or_else(|| {
                        invalid(
                            "--reduce",
                            format!("{spec:?} is neither `all` nor `partial:K` with K at least 1"),
                        )
                    })?;
                let sync_every = self.sync_every.unwrap_or(DEFAULT_SYNC_EVERY);
                if sync_every == 0 {
                    return Err(invalid("--sync-every", "must be at least 1".into()));
                }
                if self.overlap_reduce == Overlap::On {
                    return Err(invalid(
                        "--overlap-reduce",
                        "a partial reduce forms its group after the backward; use \
                         --overlap-reduce off or auto"
                            .into(),
                    ));
                }
                Some(PartialOptions { k, sync_every })
            }
        };
        let reduce = ReduceOptions {
            bucket_bytes: bucket_bytes as usize,
            overlap: match self.overlap_reduce {
                Overlap::On => true,
                Overlap::Off => false,
                Overlap::Auto => partial.is_none() && matches!(device, DeviceSpec::Cuda(_)),
            },
            partial,
        };
        let backend = match (self.backend, device) {
            (Some(BackendArg::Gloo), _) | (None, DeviceSpec::Cpu) => Backend::Gloo,
            (Some(BackendArg::Nccl), DeviceSpec::Cpu) => {
                return Err(invalid(
                    "--backend",
                    "nccl needs CUDA tensors; use --device cuda or --backend gloo".into(),
                ))
            }
            (Some(BackendArg::Nccl), _) | (None, DeviceSpec::Cuda(_)) => Backend::Nccl,
        };
        let sparse = self.compress == CompressArg::Auto;
        if sparse && backend == Backend::Nccl {
            return Err(invalid(
                "--compress",
                "auto sends payloads whose size only their header tells, which NCCL (pairing \
                 sends and receives by issue order) cannot match; add --backend gloo, or use \
                 --compress off"
                    .into(),
            ));
        }
        if let Some(id) = self
            .run_id
            .as_deref()
            .filter(|id| id.is_empty() || id.contains('\0'))
        {
            return Err(invalid(
                "--run-id",
                format!("{id:?} is not an id: give a non-empty one without NUL bytes"),
            ));
        }
        Ok(DistConfig {
            rank: place.rank,
            world_size: place.world_size,
            master_addr: place.master_addr,
            master_port: place.master_port,
            run_id: self.run_id,
            backend,
            p2p_groups: match (self.p2p_groups, backend) {
                (Some(P2pGroupsArg::World), _) | (None, Backend::Gloo) => P2pGroups::World,
                (Some(P2pGroupsArg::Pairs), _) | (None, Backend::Nccl) => P2pGroups::Pairs,
            },
            stage_config,
            schedule: match self.schedule {
                ScheduleArg::Gpipe => Schedule::GPipe,
                ScheduleArg::OneFOneB => Schedule::OneFOneB,
                ScheduleArg::Pipedream => Schedule::PipeDream,
            },
            microbatches: self.microbatches,
            comm_timeout: Duration::from_secs_f64(self.comm_timeout),
            slowdown,
            reduce,
            compress_activations: self.compress_activations,
            sparse,
        })
    }
}

impl ModelArgs {
    fn into_choice(self, data: Option<&DataSpec>) -> Result<ModelChoice, ConfigError> {
        let name = self.model.expect("clap requires --model");
        ModelChoice::resolve(
            name,
            data,
            crate::config::ModelOverrides {
                num_classes: self.num_classes,
                image_size: self.image_size,
                layers: self.layers,
                hidden: self.hidden,
                heads: self.heads,
                seq_len: self.seq_len,
                vocab_size: self.vocab_size,
                dropout: self.dropout,
                active_units: self.active_units,
            },
        )
    }
}

/// Iterations `--profiler-trace` records unless `--profiler-steps` says otherwise: as many as
/// `torch.profiler`'s own examples record (a few steps of a steady state), few enough to open.
pub const DEFAULT_PROFILER_STEPS: u64 = 5;

fn positive(flag: &'static str, value: usize) -> Result<usize, ConfigError> {
    if value == 0 {
        return Err(ConfigError::Invalid {
            flag,
            reason: "must be at least 1".to_string(),
        });
    }
    Ok(value)
}

/// The most samples a minibatch may have (`--batch-size`): 2^24, past any run's, so that no size
/// computed from it wraps (2^32 wrapped to a negative tensor size and panicked).
const MAX_BATCH_SIZE: usize = 1 << 24;

/// `--batch-size`, from 1 to [`MAX_BATCH_SIZE`].
fn batch_size(value: usize) -> Result<usize, ConfigError> {
    if value > MAX_BATCH_SIZE {
        return Err(ConfigError::Invalid {
            flag: "--batch-size",
            reason: format!("{value} is more than a minibatch may have: give at most {MAX_BATCH_SIZE}"),
        });
    }
    positive("--batch-size", value)
}

fn positive_seconds(flag: &'static str, value: f64) -> Result<f64, ConfigError> {
    if !(value.is_finite() && value > 0.0 && value <= 3600.0) {
        return Err(ConfigError::Invalid {
            flag,
            reason: format!("{value} is not a number of seconds above 0 and at most 3600"),
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn dist(args: &[&str]) -> DistArgs {
        let argv = ["runtime", "--model", "mlp"].iter().chain(args);
        Cli::try_parse_from(argv).expect("flags parse").train.dist
    }

    fn slurm_env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let mut map: BTreeMap<String, String> = [
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "gpu[07-08]"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        map.extend(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        move |k| map.get(k).cloned()
    }

    #[test]
    fn under_slurm_the_place_comes_from_the_task_environment() {
        let place = dist(&["--launcher", "slurm"]).place(slurm_env(&[])).unwrap();
        assert_eq!(
            place,
            Place {
                rank: 3,
                world_size: 4,
                master_addr: "gpu07".into(),
                master_port: 14242,
                cuda_index: 1,
            }
        );
        let given_port = dist(&["--launcher", "slurm", "--master-port", "5000"]);
        assert_eq!(given_port.place(slurm_env(&[])).unwrap().master_port, 5000);
    }

    #[test]
    fn under_slurm_a_task_takes_the_gpu_its_rank_on_the_node_picks_among_those_it_sees() {
        let d = dist(&["--launcher", "slurm"]);
        let one_each = d.place(slurm_env(&[("CUDA_VISIBLE_DEVICES", "5")])).unwrap();
        assert_eq!(one_each.cuda_index, 0);
        let shared = d.place(slurm_env(&[
            ("CUDA_VISIBLE_DEVICES", "0,1"),
            ("SLURM_LOCALID", "3"),
        ]));
        assert_eq!(shared.unwrap().cuda_index, 1);
    }

    #[test]
    fn a_world_size_that_srun_did_not_start_is_refused() {
        let e = dist(&["--launcher", "slurm", "--world-size", "8"])
            .place(slurm_env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("8, but srun started 4 tasks"), "{e}");
        let e = dist(&["--launcher", "slurm"])
            .place(|_| None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not started by srun"), "{e}");
    }

    #[test]
    fn without_slurm_the_flags_and_their_defaults_hold() {
        let place = dist(&["--rank", "1", "--world-size", "2"])
            .place(slurm_env(&[]))
            .unwrap();
        assert_eq!((place.rank, place.world_size, place.master_port), (1, 2, 29500));
        assert_eq!(place.master_addr, "127.0.0.1");
    }

    /// What `runtime --check` says of `args` (the check itself needs no CUDA, so a CUDA request
    /// is checked here on any machine).
    fn check(args: &[&str]) -> Result<(), String> {
        let argv = ["runtime", "--check"].iter().chain(args);
        let command = Cli::try_parse_from(argv).expect("flags parse").into_command();
        let config = match command {
            Ok(Command::Check(config)) => config,
            Ok(other) => panic!("not a check: {other:?}"),
            Err(e) => return Err(e.to_string()),
        };
        crate::train::check(&config, &mut Vec::new()).map_err(|e| format!("{e:#}"))
    }

    #[test]
    fn a_cuda_graph_takes_one_process_on_one_gpu_and_a_step_that_never_waits() {
        let on = |device: &'static str, extra: &[&'static str]| {
            let mut args = vec!["--model", "resnet50", "--device", device, "--cuda-graph"];
            args.extend(extra);
            check(&args)
        };
        let graphed = |extra: &[&'static str]| on("cuda:0", extra);
        graphed(&[]).unwrap();
        // The learning rate may change every iteration: the graph reads it from the device.
        graphed(&["--precision", "bf16", "--channels-last", "--optimizer", "adamw"]).unwrap();
        graphed(&["--lr-policy", "polynomial", "--lr-warmup-epochs", "1"]).unwrap();
        // fp16's gradient scaler skips steps on the device.
        graphed(&["--precision", "fp16"]).unwrap();
        // Validation passes run eagerly between the replays.
        graphed(&["--validate-every", "2", "--validation-batches", "1"]).unwrap();
        let refusals: [(&[&str], &str); 3] = [
            (&["--world-size", "2", "--backend", "nccl"], "--world-size"),
            (&["--trace"], "--trace"),
            (&["--slowdown", "0=2"], "--slowdown"),
        ];
        for (extra, flag) in refusals {
            let err = graphed(extra).unwrap_err();
            assert!(
                err.starts_with(&format!("{flag}: not with --cuda-graph:")),
                "{extra:?}: {err}"
            );
        }
        let err = check(&["--model", "sparse_mlp", "--device", "cuda:0", "--cuda-graph"]).unwrap_err();
        assert!(
            err.contains("sparse COO") && err.contains("drop --cuda-graph"),
            "{err}"
        );
        let err = on("cpu", &[]).unwrap_err();
        assert!(err.starts_with("--device: not with --cuda-graph:"), "{err}");
        let err = check(&["--model", "mlp", "--devices", "cuda:0,cuda:1", "--cuda-graph"]).unwrap_err();
        assert!(err.contains("use --device cuda (one device)"), "{err}");
    }

    /// The warnings a training request `args` parses to.
    fn warnings(args: &[&str]) -> Vec<String> {
        let argv = ["runtime"].iter().chain(args);
        match Cli::parse_given_from(argv).expect("flags parse").into_command() {
            Ok(Command::Train(config)) => config.warnings,
            other => panic!("not a training run: {other:?}"),
        }
    }

    #[test]
    fn flags_that_do_nothing_in_their_request_are_named_with_why_and_the_rest_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let pipeline = dir.path().join("pipeline.json");
        std::fs::write(
            &pipeline,
            r#"{"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
        )
        .unwrap();
        let pipeline = pipeline.to_str().unwrap();
        let world = |n: &'static str| ["--world-size", n, "--rank", "0"];
        let cases: Vec<(Vec<&str>, &str)> = vec![
            (
                vec!["--model", "mlp", "--channels-last"],
                "--channels-last does nothing for mlp",
            ),
            (
                vec!["--model", "transformer", "--channels-last"],
                "--channels-last does nothing for transformer, which has no convolutions",
            ),
            (
                vec!["--model", "mlp", "--cudnn-benchmark"],
                "--cudnn-benchmark does nothing on the CPU",
            ),
            (
                vec!["--model", "mlp", "--sync-every", "3"],
                "--sync-every does nothing without --reduce partial:K",
            ),
            (
                vec!["--model", "mlp", "--threads", "100000"],
                "--threads 100000 is more than the",
            ),
            (
                [&["--model", "mlp", "--overlap-reduce", "on"][..], &world("1")].concat(),
                "--overlap-reduce on does nothing here: no stage has replicas",
            ),
            (
                [&["--model", "mlp", "--compress", "auto"][..], &world("2")].concat(),
                "--compress auto does nothing here: the run has one stage",
            ),
            (
                vec!["--model", "mlp", "--compress-activations"],
                "--compress-activations does nothing here",
            ),
            (
                vec!["--model", "mlp", "--heads", "4"],
                "--heads does nothing for mlp, which is sized by --image-size, --num-classes, \
                 --layers, --hidden alone",
            ),
            (
                vec!["--model", "resnet50", "--dropout", "0.1"],
                "--dropout does nothing for resnet50",
            ),
            (
                vec!["--model", "transformer", "--image-size", "64"],
                "--image-size does nothing for transformer",
            ),
            (
                vec!["--model", "mlp", "--optimizer", "adam", "--momentum", "0.9"],
                "--momentum does nothing with --optimizer adam",
            ),
            (
                vec!["--model", "mlp", "--lr-step-factor", "0.5"],
                "--lr-step-factor does nothing with --lr-policy constant",
            ),
            (
                vec![
                    "--model",
                    "mlp",
                    "--lr-policy",
                    "polynomial",
                    "--lr-step-epochs",
                    "3",
                    "--epoch-samples",
                    "64",
                ],
                "--lr-step-epochs does nothing with --lr-policy polynomial",
            ),
            (
                vec!["--model", "mlp", "--epoch-samples", "64"],
                "--epoch-samples does nothing without --epochs",
            ),
            (
                [&["--model", "mlp", "--bucket-mb", "4"][..], &world("1")].concat(),
                "--bucket-mb does nothing here: no stage has replicas",
            ),
            (
                [&["--model", "mlp", "--p2p-groups", "pairs"][..], &world("2")].concat(),
                "--p2p-groups does nothing here: the run has one stage",
            ),
            (
                vec![
                    "--model",
                    "mlp",
                    "--iterations",
                    "4",
                    "--checkpoint-dir",
                    "ck",
                    "--checkpoint-every",
                    "5",
                ],
                "--checkpoint-every 5 does nothing in a run of 4 iterations",
            ),
        ];
        for (args, expected) in cases {
            let said = warnings(&args);
            assert!(
                said.len() == 1 && said[0].contains(expected),
                "{args:?}: {said:?} lacks {expected:?}"
            );
        }
        // Where each does something: nothing said.
        for args in [
            vec!["--model", "vgg16", "--channels-last"],
            vec!["--model", "mlp", "--threads", "1"],
            [
                &["--model", "mlp", "--reduce", "partial:1", "--sync-every", "3"][..],
                &world("2"),
            ]
            .concat(),
            [&["--model", "mlp", "--overlap-reduce", "on"][..], &world("2")].concat(),
            [&["--model", "mlp", "--bucket-mb", "4"][..], &world("2")].concat(),
            vec![
                "--model",
                "transformer",
                "--heads",
                "4",
                "--hidden",
                "64",
                "--dropout",
                "0.0",
            ],
            vec![
                "--model",
                "vgg16",
                "--dropout",
                "0.1",
                "--image-size",
                "32",
                "--num-classes",
                "10",
            ],
            vec![
                "--model",
                "mlp",
                "--optimizer",
                "sgd",
                "--momentum",
                "0.5",
                "--nesterov",
            ],
            vec![
                "--model",
                "mlp",
                "--lr-policy",
                "step",
                "--lr-step-epochs",
                "3",
                "--epoch-samples",
                "64",
            ],
            vec!["--model", "mlp", "--epochs", "1", "--epoch-samples", "64"],
            vec![
                "--model",
                "mlp",
                "--lr-warmup-epochs",
                "1",
                "--epoch-samples",
                "64",
            ],
            vec![
                "--model",
                "mlp",
                "--iterations",
                "4",
                "--checkpoint-dir",
                "ck",
                "--checkpoint-every",
                "4",
            ],
            [
                &["--model", "mlp", "--compress", "auto", "--compress-activations"][..],
                &["--stage-config", pipeline],
                &world("2"),
            ]
            .concat(),
        ] {
            assert_eq!(warnings(&args), Vec::<String>::new(), "{args:?}");
        }
    }

    #[test]
    fn sizes_past_any_models_are_refused_naming_their_flag() {
        let cases = [
            (
                &["--batch-size", "4294967296"][..],
                "--batch-size: 4294967296 is more than a minibatch may have",
            ),
            (
                &["--hidden", "99999999999"],
                "--hidden: 99999999999 is not a size from 1 to 1048576",
            ),
            (
                &["--layers", "100000000"],
                "--layers: 100000000 is not a size from 1 to 4096",
            ),
            (&["--hidden", "0"], "--hidden: 0 is not a size from 1 to 1048576"),
            (
                &["--image-size", "100000"],
                "--image-size: 100000 is not a size from 1 to 65536",
            ),
        ];
        for (args, expected) in cases {
            let said = check(&[&["--model", "mlp"][..], args].concat()).unwrap_err();
            assert!(said.starts_with(expected), "{args:?}: {said}");
        }
        let said = check(&["--model", "transformer", "--seq-len", "100000000"]).unwrap_err();
        assert!(said.starts_with("--seq-len: 100000000 is not a size"), "{said}");
    }

    #[test]
    fn a_validation_pass_longer_than_any_split_is_refused() {
        let pass = |n: &str| {
            check(&[
                "--model",
                "mlp",
                "--validate-every",
                "1",
                "--validation-batches",
                n,
            ])
        };
        assert_eq!(
            pass("100000000000").unwrap_err(),
            "--validation-batches: 100000000000 is more than a pass may take: give at most 1048576"
        );
        assert_eq!(pass("1048576"), Ok(()));
    }

    #[test]
    fn fused_kernels_need_a_gpu_and_no_determinism() {
        let err = check(&["--model", "vgg16", "--fused-kernels"]).unwrap_err();
        assert_eq!(
            err,
            "--fused-kernels: runs CUDA kernels; use --device cuda, or drop --fused-kernels"
        );
        let on_gpu = |extra: &[&str]| {
            let argv = [
                "runtime",
                "--model",
                "vgg16",
                "--device",
                "cuda",
                "--fused-kernels",
            ];
            Cli::try_parse_from(argv.iter().chain(extra))
        };
        let err = on_gpu(&["--deterministic"]).unwrap_err().to_string();
        assert!(
            err.contains("--fused-kernels") && err.contains("--deterministic"),
            "{err}"
        );
        let Ok(Command::Train(config)) = on_gpu(&[]).unwrap().into_command() else {
            panic!("not a training run");
        };
        assert!(config.fused_kernels);
    }

    #[test]
    fn sparse_coo_activations_between_stages_need_gloo() {
        let dir = tempfile::tempdir().unwrap();
        let two = dir.path().join("two.json");
        std::fs::write(
            &two,
            r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
        )
        .unwrap();
        let over = |model: &'static str, backend: &'static str, split: bool| {
            let mut args = vec![
                "--model",
                model,
                "--device",
                "cuda:0",
                "--backend",
                backend,
                "--world-size",
                "2",
            ];
            if split {
                args.extend(["--stage-config", two.to_str().unwrap()]);
            }
            check(&args)
        };
        let err = over("sparse_mlp", "nccl", true).unwrap_err();
        assert!(
            err.contains("sparse COO") && err.contains("add --backend gloo"),
            "{err}"
        );
        over("sparse_mlp", "gloo", true).unwrap();
        // Replicas of the whole model send nothing between stages; a dense model's messages have
        // sizes known in advance.
        over("sparse_mlp", "nccl", false).unwrap();
        over("mlp", "nccl", true).unwrap();
    }

    #[test]
    fn active_units_belong_to_sparse_mlp_and_fit_its_width() {
        let err = check(&["--model", "mlp", "--active-units", "4"]).unwrap_err();
        assert!(err.contains("only sparse_mlp"), "{err}");
        let err = check(&["--model", "sparse_mlp", "--hidden", "64", "--active-units", "65"]).unwrap_err();
        assert!(err.contains("between 1 and the hidden width 64"), "{err}");
        check(&["--model", "sparse_mlp", "--hidden", "64", "--active-units", "64"]).unwrap();
    }
}
