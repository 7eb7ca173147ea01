//! The resolved plan: the experiment file and the command line combined into what will run where —
//! hosts, ranks with their argument vectors and environments, mounts and the image. Everything
//! that can be checked without touching a host is checked here.

mod args;
pub use args::{flag_value, key_of_flag};
pub mod pipedream;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use stagehand_contract::StageConfig;

use crate::config::{
    ConfigError, Container, Device, DistributedBackend, ExperimentFile, Loaded, Machine, Mount, Precision,
    SlurmSettings, StageConfigRef,
};
use crate::options::{Backend, ContainerMode, Options};

/// The release build of the runtime, relative to a checkout.
pub const DEFAULT_LOCAL_RUNTIME: &str = "target/release/runtime";
/// Default shared memory per container: data loaders need more than Docker's 64 MiB.
const DEFAULT_SHM_MB: u64 = 2048;
/// The most shared memory a container may be given, in MiB: a tebibyte (more wrapped around
/// when counted in bytes).
const MAX_SHM_MB: u64 = 1 << 20;
/// `config_file: auto`'s bandwidth between GPUs of one machine when none is given, in GB/s.
const DEFAULT_INTRA_HOST_GPU_GBPS: f64 = 10.0;
/// ... between CPU ranks of one machine (gloo over loopback measured 2.3 GB/s here).
const DEFAULT_INTRA_HOST_CPU_GBPS: f64 = 2.0;
/// ... between machines (10 Gb Ethernet).
const DEFAULT_INTER_HOST_GBPS: f64 = 1.25;

/// What `config_file: auto` does before launch: profile (or read a profile), then plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AutoPartition {
    /// The profiling command, run on rank 0's machine and device; `None` when a profile is given.
    pub profile_argv: Option<Vec<String>>,
    /// A profile to use instead of profiling.
    pub profile_file: Option<PathBuf>,
    /// Rank 0's `--device`, where the profile is taken.
    pub profile_device: String,
    /// The model profiled and planned.
    pub model: String,
    /// The arithmetic the ranks compute in, as a profile says it ([`Profile::arithmetic`]):
    /// `fp32`, `bf16 channels_last`, ...
    ///
    /// [`Profile::arithmetic`]: stagehand_contract::Profile::arithmetic
    pub arithmetic: String,
    /// Microbatches per minibatch the plan and the run use.
    pub microbatches: u32,
    /// Samples per microbatch: the profile's batch size.
    pub micro_batch_size: u32,
    /// Workers to plan for (the world size).
    pub workers: usize,
    /// Network levels, innermost first: (workers per group, bytes per second).
    pub levels: Vec<(usize, f64)>,
    /// Memory per worker in bytes, if limited.
    pub memory_bytes: Option<f64>,
    /// One rank per stage.
    pub straight: bool,
    /// Whether activations cross stage boundaries compressed (`compress_activations`).
    pub compress_activations: bool,
}

/// The outcome of `config_file: auto`, for the second resolution.
#[derive(Debug, Clone, PartialEq)]
pub struct Partitioned {
    /// The stage config written for the run (absolute).
    pub stage_config: PathBuf,
    /// Microbatches per minibatch.
    pub microbatches: u32,
}

/// Where the image comes from, with paths made absolute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageSource {
    /// Use this image as named.
    Named(String),
    /// Build it once per source version (hosts/image.rs).
    Build(BuildSpec),
    /// PipeDream's `container: IMAGE` for ranks that run the image's runtime: the image as
    /// named if it already holds the stagehand runtime (its label says so), else the runtime
    /// image `build` builds on it (`BASE_IMAGE`).
    Base { name: String, build: BuildSpec },
}

/// A build the driver runs: context, Dockerfile, arguments and the repository the tag goes in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BuildSpec {
    /// The context folder.
    pub context: PathBuf,
    /// The Dockerfile, relative to the context.
    pub dockerfile: String,
    /// Build arguments.
    pub args: BTreeMap<String, String>,
    /// Repository of the tag; the tag itself is the context's hash.
    pub repository: String,
}

/// The runtime's path inside the runtime image (docker/runtime/Dockerfile).
pub const RUNTIME_IN_IMAGE: &str = "/usr/local/bin/runtime";
/// The runtime image's Dockerfile, relative to the workspace.
pub const RUNTIME_DOCKERFILE: &str = "docker/runtime/Dockerfile";

/// What to do with a mount whose source path a host lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenMissing {
    /// Copy the file from this machine into the containers through the Docker API (code).
    Copy,
    /// Leave it out (the image provides it, as the GPU image does the torch environment).
    Skip,
    /// Fail preflight, naming the host and the path (data and user mounts).
    Fail,
    /// Mount it all the same: the engine creates the folder (the checkpoint folder).
    Create,
}

/// A bind mount and its fallback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MountSpec {
    /// The mount.
    pub mount: Mount,
    /// What to do where the source path does not exist.
    pub when_missing: WhenMissing,
}

/// One distinct host and the ranks it runs.
#[derive(Debug, Clone, Serialize)]
pub struct HostSpec {
    /// Host name as written (`localhost` for the local engine).
    pub name: String,
    /// SSH details from the first entry naming this host.
    pub machine: Machine,
    /// Ranks on this host, in order.
    pub ranks: Vec<usize>,
    /// Every GPU the host's ranks use, in order of first use.
    pub gpus: Vec<u32>,
}

/// One rank: where it runs and exactly what it is started with.
#[derive(Debug, Clone, Serialize)]
pub struct RankSpec {
    /// Global rank.
    pub rank: usize,
    /// Index into [`Experiment::hosts`].
    pub host: usize,
    /// Rank among the ranks on the same host.
    pub local_rank: usize,
    /// GPUs this rank uses (host numbering).
    pub gpus: Vec<u32>,
    /// Program and arguments; never passed through a shell.
    pub argv: Vec<String>,
    /// Environment added to the program's.
    pub env: BTreeMap<String, String>,
    /// Pipeline stage, when a stage config was given.
    pub stage: Option<usize>,
}

/// The environment variable that gives a rank its run's id (the runtime's `--run-id`).
pub const RUN_ID_VARIABLE: &str = "STAGEHAND_RUN_ID";

/// Everything the launch needs, resolved and checked.
#[derive(Debug, Clone, Serialize)]
pub struct Experiment {
    /// Experiment name.
    pub name: String,
    /// Where ranks run.
    pub backend: Backend,
    /// Container packing (ignored by the process backend).
    pub container_mode: ContainerMode,
    /// The image (ignored by the process backend).
    pub image: ImageSource,
    /// Distinct hosts in order of first appearance.
    pub hosts: Vec<HostSpec>,
    /// Ranks by global rank.
    pub ranks: Vec<RankSpec>,
    /// Master address as every rank reaches it.
    pub master_addr: String,
    /// Master port chosen by the driver.
    pub master_port: u16,
    /// Iterations each rank runs, when known (drives the progress bar).
    pub iterations: Option<u64>,
    /// Samples per iteration of one pipeline, when known.
    pub batch_size: Option<u32>,
    /// Every N iterations the terminal shows the loss line (`print_frequency`).
    pub print_every: Option<u64>,
    /// Every N iterations the terminal shows every rank's metrics line (`verbose_frequency`).
    pub verbose_every: Option<u64>,
    /// Bind mounts for every container (host path = container path for code and data), each
    /// with what to do on a host that lacks the source path.
    pub mounts: Vec<MountSpec>,
    /// Shared memory per container in bytes.
    pub shm_size_bytes: u64,
    /// Where the record folder goes.
    pub log_directory: PathBuf,
    /// Profiling and planning still to do (`config_file: auto`), before the ranks can start.
    pub auto: Option<AutoPartition>,
    /// What the job asks Slurm for, with the Slurm backend.
    pub slurm: Option<SlurmSettings>,
    /// How many times the ranks are started again after a failure (`max_restarts`).
    pub max_restarts: u32,
    /// Whether containers get their host's InfiniBand/RoCE devices (`rdma:`).
    pub rdma: crate::config::Rdma,
    /// Whether the ranks record PyTorch's profiler (`profiler_trace: true`).
    pub profiler_trace: bool,
    /// The record's [`TRACES_FOLDER`] the ranks' profiler traces are kept in, once
    /// [`Experiment::keep_traces_in`] has named the record.
    pub traces_dir: Option<PathBuf>,
}

/// The folder, inside each container, that its ranks write their profiler traces into; the
/// driver copies them out into the record before it removes the container.
pub const CONTAINER_TRACE_DIR: &str = "/tmp/stagehand-traces";

/// The record's folder of profiler traces, one `rank-N.json` per rank.
pub const TRACES_FOLDER: &str = "traces";

/// The record folder `records::Record::create` will make under `log_directory` for experiment
/// `name`, as shown before it exists (its time is not known yet).
pub fn record_to_come(log_directory: &Path, name: &str) -> PathBuf {
    log_directory.join(format!("<UTC time>_{name}"))
}

/// The file `rank` writes its trace to in `dir`.
pub fn trace_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.json"))
}

/// `--profiler-trace`'s value for the ranks that write into `dir`: one path whose placeholder
/// each rank replaces with its rank ([`trace_file`]), since Slurm starts every task with the
/// same argument vector.
pub fn trace_template(dir: &Path) -> String {
    let placeholder = stagehand_contract::defaults::TRACE_RANK_PLACEHOLDER;
    dir.join(format!("rank-{placeholder}.json")).display().to_string()
}

impl Experiment {
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Whether the ranks write checkpoints (`checkpoint_dir`): an interrupt then gives them the
    /// time to write one.
    pub fn checkpoints(&self) -> bool {
        self.ranks
            .iter()
            .any(|r| r.argv.iter().any(|a| a == "--checkpoint-dir"))
    }

    /// The plan for a start of the runtime's ranks after a restart: resuming from their
    /// checkpoints when `resume` (the runtime's `--resume=auto` in place of the experiment's own
    /// setting: from the newest iteration every rank holds, or afresh when a rank stopped while
    /// writing its first holds none), else as first planned.
    pub fn restarted(&self, resume: bool) -> Experiment {
        let mut plan = self.clone();
        if resume {
            for rank in &mut plan.ranks {
                rank.argv
                    .retain(|a| a != "--resume" && !a.starts_with("--resume="));
                rank.argv.push("--resume=auto".into());
            }
        }
        plan
    }

    /// Gives every rank the run's id ([`RUN_ID_VARIABLE`]), under which the runtime keeps its
    /// keys on the rendezvous store: a rank of another run that reaches the same master port (two
    /// runs given one `--master-port`) meets none of them.
    pub fn run_as(&mut self, id: &str) {
        for rank in &mut self.ranks {
            rank.env.insert(RUN_ID_VARIABLE.into(), id.to_string());
        }
    }

    /// Names the record folder the ranks' profiler traces are kept in (its [`TRACES_FOLDER`]):
    /// ranks that run where the record is (local processes, Slurm's tasks on nodes that share
    /// its filesystem) write theirs straight into it, in place of the folder they were checked
    /// with; containers' ranks write inside their container, whence the driver copies them.
    pub fn keep_traces_in(&mut self, record: &Path) {
        if !self.profiler_trace {
            return;
        }
        let kept = absolute(&record.join(TRACES_FOLDER));
        if self.backend != Backend::Docker {
            for rank in &mut self.ranks {
                if let Some(i) = rank.argv.iter().position(|a| a == args::PROFILER_TRACE_FLAG) {
                    if let Some(value) = rank.argv.get_mut(i + 1) {
                        *value = trace_template(&kept);
                    }
                }
            }
        }
        self.traces_dir = Some(kept);
    }

    /// The host a rank runs on.
    pub fn host_of(&self, rank: usize) -> &HostSpec {
        &self.hosts[self.ranks[rank].host]
    }
}

/// The experiment's name: the file's `name`, else the file's stem.
pub fn experiment_name(loaded: &Loaded) -> String {
    loaded.file.name.clone().unwrap_or_else(|| {
        loaded
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "experiment".into())
    })
}

/// Where record (and sweep) folders go: `--output-dir`, else the file's `log_directory`, else
/// `experiments/`.
pub fn log_directory(loaded: &Loaded, options: &Options) -> PathBuf {
    options
        .output_dir
        .clone()
        .or_else(|| loaded.file.log_directory.clone())
        .unwrap_or_else(|| PathBuf::from("experiments"))
}

/// [`log_directory`], refused where a file is in its way (a run would find that only once it
/// had run, with nowhere to write its record).
fn checked_log_directory(loaded: &Loaded, options: &Options) -> Result<PathBuf, ConfigError> {
    let dir = log_directory(loaded, options);
    if dir.exists() && !dir.is_dir() {
        let key = match options.output_dir {
            Some(_) => "--output-dir",
            None => "log_directory",
        };
        return Err(loaded.error_at(
            key,
            format!(
                "{key}: {} is a file, not a folder; name a folder for the experiment records",
                dir.display()
            ),
        ));
    }
    Ok(dir)
}

/// Resolves the plan; `master_port` is chosen by the caller (it depends on the hosts). With
/// `config_file: auto` the plan carries [`Experiment::auto`]; once planned, [`resolve_planned`] gives
/// the plan the ranks run.
pub fn resolve(loaded: &Loaded, options: &Options, master_port: u16) -> Result<Experiment, ConfigError> {
    resolve_with(loaded, options, master_port, None)
}

/// Resolves the plan of a `config_file: auto` experiment with the stage config planned for it.
pub fn resolve_planned(
    loaded: &Loaded,
    options: &Options,
    master_port: u16,
    planned: &Partitioned,
) -> Result<Experiment, ConfigError> {
    resolve_with(loaded, options, master_port, Some(planned))
}

fn resolve_with(
    loaded: &Loaded,
    options: &Options,
    master_port: u16,
    planned: Option<&Partitioned>,
) -> Result<Experiment, ConfigError> {
    let file = &loaded.file;
    let base = absolute(&loaded.base_dir());
    let backend = options.backend.or(file.backend).unwrap_or(Backend::Docker);
    let slurm = slurm_settings(loaded, backend)?;
    let machines = match &slurm {
        Some(settings) => slurm_nodes(settings),
        None => file.machines.clone(),
    };
    if machines.is_empty() {
        return Err(loaded.error_at(
            "machines",
            "machines is empty; list one `host:gpu` (or `localhost`) per rank, or run on Slurm \
             with `backend: slurm`",
        ));
    }
    if backend == Backend::Process {
        if let Some(m) = file.machines.iter().find(|m| !m.is_local()) {
            return Err(loaded.error_at(
                "machines",
                format!(
                    "host `{}` is not local, but the process backend runs ranks only on this machine; \
                     use `localhost` or the docker backend",
                    m.host
                ),
            ));
        }
    }

    let gpus_per_rank = match (file.gpus_per_rank, &slurm) {
        (Some(_), Some(_)) => {
            return Err(loaded.error_at(
                "gpus_per_rank",
                "gpus_per_rank is for machines entries; with `backend: slurm` give each rank its GPUs with slurm.gpus_per_task",
            ))
        }
        (Some(0), None) => return Err(loaded.error_at("gpus_per_rank", "gpus_per_rank must be at least 1")),
        (Some(n), None) => n as usize,
        (None, _) => 1,
    };
    let (hosts, rank_slots) =
        group_hosts(&machines, gpus_per_rank).map_err(|e| loaded.error_at("gpus_per_rank", e))?;
    let world_size = rank_slots.len();
    check_visible_devices(loaded, &hosts, slurm.as_ref())?;
    check_env_names(loaded)?;
    check_shared_gpus(loaded, &hosts, &rank_slots)?;
    check_slowdown(loaded, &hosts, world_size)?;
    check_pipedream_keys(loaded)?;

    let auto = matches!(file.config_file, Some(StageConfigRef::Auto));
    let stage_config_file = match planned {
        Some(p) => Some(p.stage_config.clone()),
        None => file
            .config_file
            .as_ref()
            .and_then(StageConfigRef::file)
            .map(|rel| stage_config_path(&base, rel)),
    };
    let stages = match stage_config_file {
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                loaded.error_at(
                    "config_file",
                    format!("cannot read stage config {}: {e}", path.display()),
                )
            })?;
            let config = StageConfig::from_json(&text)
                .map_err(|e| loaded.error_at("config_file", format!("{}: {e}", path.display())))?;
            let (path, config) = match planned {
                Some(_) => (path, config),
                None => translate_pipedream(loaded, &base, config, &path)?,
            };
            // The driver does not know the model's module count; the runtime checks it. The rank
            // layout is checked here so a wrong world size fails before anything starts.
            let num_modules = config.module_to_stage_map.len();
            let plan = config.validate(num_modules, world_size).map_err(|e| {
                loaded.error_at(
                    "config_file",
                    format!(
                        "{}: {e} ({} {world_size} ranks)",
                        path.display(),
                        match slurm {
                            Some(_) => "slurm.nodes x slurm.tasks_per_node give",
                            None => "the machines list gives",
                        }
                    ),
                )
            })?;
            Some((path, plan))
        }
        None => None,
    };
    if file.planner.is_some() && !auto {
        return Err(loaded.error_at(
            "planner",
            "planner settings apply only with `config_file: auto`; remove them or set config_file to auto",
        ));
    }
    if file.schedule.is_some() && stages.is_none() && !auto && world_size > 1 {
        return Err(loaded.error_at(
            "schedule",
            "a schedule needs a `config_file` that splits the model into stages",
        ));
    }

    let any_gpu = hosts.iter().any(|h| !h.gpus.is_empty()) || slurm.as_ref().is_some_and(|s| s.has_gpus());
    let device = file
        .device
        .unwrap_or(if any_gpu { Device::Cuda } else { Device::Cpu });
    if device == Device::Cuda && slurm.is_none() && rank_slots.iter().any(|(_, gpus)| gpus.is_empty()) {
        return Err(loaded.error_at(
            "device",
            "device is cuda but some machines entries name no GPU; write them as `host:gpu`",
        ));
    }
    if file.command.as_ref().is_some_and(|c| c.is_empty()) {
        return Err(loaded.error_at(
            "command",
            "command is empty; give the program and its arguments as a list",
        ));
    }

    let name = experiment_name(loaded);
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(loaded.error_at(
            "name",
            format!("name `{name}` may only contain letters, digits, `-`, `_` and `.`"),
        ));
    }

    let local_runtime = options.runtime.as_ref().map(|r| absolute(r));
    let image = image_source(loaded, file.container.as_ref(), &base, options, device)?;
    if backend == Backend::Docker {
        check_build(loaded, &image)?;
    }

    // Rank 0 runs on the first machine; the address must be how the other machines reach it.
    let all_local = hosts.iter().all(|h| h.machine.is_local());
    // Until preflight finds it on the machines (run.rs), a remote first machine goes by its name.
    let master_addr = match (&file.master_addr, all_local, hosts[0].machine.is_local()) {
        _ if slurm.is_some() => SLURM_MASTER_ADDR.to_string(),
        (Some(addr), _, _) => addr.clone(),
        (None, true, _) => "127.0.0.1".to_string(),
        (None, false, true) => this_host_name(),
        (None, false, false) => hosts[0].name.clone(),
    };

    // The runtime the ranks run: this machine's build with the process backend or when
    // `--runtime` names one (mounted or copied into containers); else the image's own.
    let runtime = match (backend, &local_runtime) {
        (_, Some(path)) => path.clone(),
        (Backend::Process | Backend::Slurm, None) => built_runtime(options),
        (Backend::Docker, None) => PathBuf::from(RUNTIME_IN_IMAGE),
    };
    let runtime_is_local = backend != Backend::Docker || local_runtime.is_some();
    let stage_config_path = stages.as_ref().map(|(p, _)| p.clone());
    let microbatches = planned.map(|p| p.microbatches).or(file.microbatches);
    let program = match &file.command {
        Some(argv) => PathBuf::from(&argv[0]),
        None => runtime.clone(),
    };
    let mut mounts = Vec::new();
    let mut same_path = |path: PathBuf, read_only: bool, when_missing: WhenMissing| {
        let mount = Mount {
            source: path.clone(),
            target: path,
            read_only,
            create: when_missing == WhenMissing::Create,
        };
        mounts.push(MountSpec { mount, when_missing });
    };
    // Code reaches containers by a bind mount where the host has the path, else it is copied in.
    let program = (runtime_is_local || file.command.is_some()).then_some(program);
    for path in [program, stage_config_path.clone()].into_iter().flatten() {
        if path.is_absolute() && path.is_file() {
            same_path(path, true, WhenMissing::Copy);
        }
    }
    // A local runtime's libtorch is the torch environment its rpath names, mounted where it
    // exists (an image with its own at the same path may do without).
    if runtime_is_local && options.torch_venv.is_absolute() && options.torch_venv.exists() {
        same_path(options.torch_venv.clone(), true, WhenMissing::Skip);
    }
    // The data's folder is mounted whether or not it is here: preflight names a host that lacks it.
    if let Some((_, folder)) = file.data_dir.as_deref().and_then(|d| data_folder(d, &base)) {
        same_path(folder, true, WhenMissing::Fail);
    }
    if let Some(weights) = init_from(file, &base) {
        if !weights.is_file() {
            return Err(loaded.error_at(
                "init_from",
                format!(
                    "init_from: {} is not a file here; give the path (relative to the experiment \
                     file) of a torch.save state dict or a safetensors file",
                    weights.display()
                ),
            ));
        }
        same_path(weights, true, WhenMissing::Copy);
    }
    for dir in &options.mount_directories {
        same_path(absolute(dir), false, WhenMissing::Fail);
    }
    // Checkpoints outlive the containers: each host keeps its ranks' in this folder.
    if let Some(dir) = checkpoint_dir(file, &base) {
        same_path(dir, false, WhenMissing::Create);
    }
    for m in &file.mounts {
        let source = base.join(&m.source);
        // Where every host is this machine, a source that is not here is not on the host either
        // (found now, not at preflight).
        if backend == Backend::Docker && all_local && !source.exists() {
            return Err(loaded.error_at(
                "mounts",
                format!(
                    "mount source {} does not exist; create it, or correct the path (relative \
                     paths start at this file's folder)",
                    source.display()
                ),
            ));
        }
        let mount = Mount {
            source,
            target: m.target.clone(),
            read_only: m.read_only,
            create: false,
        };
        mounts.push(MountSpec {
            mount,
            when_missing: WhenMissing::Fail,
        });
    }

    // Each rank's trace goes into its container, or (checked with this folder, written into the
    // record's once it exists: `keep_traces_in`) where the record goes.
    let profiler_trace = file.profiler_trace == Some(true);
    let trace_dir = profiler_trace.then(|| match backend {
        Backend::Docker => PathBuf::from(CONTAINER_TRACE_DIR),
        Backend::Process | Backend::Slurm => {
            let record = record_to_come(&log_directory(loaded, options), &name);
            absolute(&record.join(TRACES_FOLDER))
        }
    });
    let ctx = args::ArgsContext {
        trace_dir: trace_dir.as_deref(),
        file,
        base: &base,
        runtime: &runtime,
        stage_config: stage_config_path.as_deref(),
        device,
        backend,
        world_size,
        master_addr: &master_addr,
        master_port,
        master_port_given: options.master_port.is_some(),
        microbatches,
    };
    let auto = match (auto, planned) {
        (true, None) => Some(auto_plan(loaded, &ctx, &hosts, &rank_slots)?),
        _ => None,
    };
    let ranks = rank_slots
        .iter()
        .enumerate()
        .map(|(rank, (host, gpus))| {
            let host_plan = &hosts[*host];
            let local_rank = host_plan
                .ranks
                .iter()
                .position(|&r| r == rank)
                .expect("rank is on its host");
            let stage = stages.as_ref().map(|(_, p)| p.stage_of_rank(rank).id);
            let (argv, env) = args::rank_command(&ctx, rank, local_rank, host_plan, gpus);
            RankSpec {
                rank,
                host: *host,
                local_rank,
                gpus: gpus.clone(),
                argv,
                env,
                stage,
            }
        })
        .collect();

    Ok(Experiment {
        name,
        backend,
        container_mode: options.container_mode,
        image,
        hosts,
        ranks,
        master_addr,
        master_port,
        iterations: file.iterations.or_else(|| epoch_iterations(file)),
        batch_size: file.batch_size,
        print_every: file.print_frequency,
        verbose_every: file.verbose_frequency,
        mounts,
        shm_size_bytes: shm_size_bytes(loaded)?,
        log_directory: checked_log_directory(loaded, options)?,
        auto,
        slurm,
        max_restarts: options.max_restarts.or(file.max_restarts).unwrap_or(0),
        rdma: file.rdma.unwrap_or_default(),
        profiler_trace,
        traces_dir: None,
    })
}

/// The runtime's prefixes for a data folder of a given format (`--data cifar10:DIR`).
const DATA_FORMATS: [&str; 2] = ["cifar10:", "imagefolder:"];

/// The folder `data_dir` names (`cifar10:DIR`, `imagefolder:DIR`, or `DIR`), relative paths
/// against `base` (the experiment file's folder), with the format prefix it was given (or `""`);
/// `None` for `synthetic`.
pub(crate) fn data_folder<'a>(data_dir: &'a str, base: &Path) -> Option<(&'a str, PathBuf)> {
    if data_dir == "synthetic" {
        return None;
    }
    let prefix = DATA_FORMATS
        .into_iter()
        .find(|p| data_dir.starts_with(p))
        .map_or("", |p| &data_dir[..p.len()]);
    Some((prefix, base.join(&data_dir[prefix.len()..])))
}

/// What `master_addr` says with the Slurm backend, where every rank finds it in its job.
pub const SLURM_MASTER_ADDR: &str = "the Slurm job's first node";

/// The `slurm:` settings with `backend: slurm` (the defaults when the section is left out),
/// checked; `None` with other backends, which must not have the section or keys only Slurm
/// runs without.
fn slurm_settings(loaded: &Loaded, backend: Backend) -> Result<Option<SlurmSettings>, ConfigError> {
    let file = &loaded.file;
    if backend != Backend::Slurm {
        if file.slurm.is_some() {
            return Err(loaded.error_at(
                "slurm",
                "slurm settings apply only with `backend: slurm`; set the backend or remove them",
            ));
        }
        return Ok(None);
    }
    if !file.machines.is_empty() {
        return Err(loaded.error_at(
            "machines",
            "with `backend: slurm` Slurm places the ranks; remove `machines` and give the job's \
             shape as `slurm: {nodes: N, tasks_per_node: T}`",
        ));
    }
    if file.command.is_some() {
        return Err(loaded.error_at(
            "command",
            "`command:` runs a program with torchrun's rank environment, which the Slurm backend \
             does not set (its ranks read Slurm's); run the runtime, or use the process or docker \
             backend",
        ));
    }
    if file.master_addr.is_some() {
        return Err(loaded.error_at(
            "master_addr",
            "with `backend: slurm` every rank reaches the job's first node, which Slurm picks; \
             remove `master_addr`",
        ));
    }
    if file.slowdown.iter().any(|s| s.host.is_some()) {
        return Err(loaded.error_at(
            "slowdown",
            "with `backend: slurm` the nodes are Slurm's to pick, so a slowdown names a `rank`, \
             not a `host`",
        ));
    }
    let settings = file.slurm.clone().unwrap_or_default();
    settings
        .check()
        .map_err(|(key, message)| loaded.error_at(key, message))?;
    Ok(Some(settings))
}

/// The environment srun would give `rank`'s task, for its check (the Slurm backend's ranks read
/// their place from it); none with other backends.
pub fn slurm_task_env(plan: &Experiment, rank: &RankSpec) -> Vec<(String, String)> {
    if plan.backend != Backend::Slurm {
        return Vec::new();
    }
    [
        ("SLURM_JOB_ID", "1".to_string()),
        ("SLURM_PROCID", rank.rank.to_string()),
        ("SLURM_NTASKS", plan.world_size().to_string()),
        ("SLURM_LOCALID", rank.local_rank.to_string()),
        ("SLURM_JOB_NODELIST", "localhost".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The driver shows each rank its GPUs (a container's, the process backend's
/// `CUDA_VISIBLE_DEVICES`, or Slurm's): an `env:` entry naming others would renumber them under the
/// rank's `--device`, so it is refused where the driver assigns GPUs.
fn check_visible_devices(
    loaded: &Loaded,
    hosts: &[HostSpec],
    slurm: Option<&SlurmSettings>,
) -> Result<(), ConfigError> {
    let assigned = hosts.iter().any(|h| !h.gpus.is_empty()) || slurm.is_some_and(SlurmSettings::has_gpus);
    match loaded.file.env.get(VISIBLE_DEVICES) {
        Some(value) if assigned => Err(loaded.error_at(
            "env",
            format!(
                "env sets {VISIBLE_DEVICES}={value}, but the driver shows each rank the GPUs its \
                 machines entry (or slurm.gpus_per_task) gives it; name the GPUs there \
                 (`host:gpu`) and drop {VISIBLE_DEVICES} from env"
            ),
        )),
        _ => Ok(()),
    }
}

/// What the driver gives each rank itself (torchrun's names), which `env:` would not change.
const DRIVER_ENV: [&str; 6] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// Every `env:` name must be one a process can be given: not empty, no `=` (Docker's `-e A=B=1`
/// sets `A` to `B=1`), no space or control character; and not one the driver sets itself.
fn check_env_names(loaded: &Loaded) -> Result<(), ConfigError> {
    if let Some(name) = DRIVER_ENV.iter().find(|n| loaded.file.env.contains_key(**n)) {
        return Err(loaded.error_at(
            "env",
            format!(
                "env sets {name}, which the driver gives each rank itself ({}); drop it \
                 (`master_addr:` and --master-port set the master's)",
                DRIVER_ENV.join(", ")
            ),
        ));
    }
    let bad =
        loaded.file.env.keys().find(|k| {
            k.is_empty() || k.contains('=') || k.chars().any(|c| c.is_whitespace() || c.is_control())
        });
    match bad {
        Some(name) => Err(loaded.error_at(
            "env",
            format!(
                "env: {name:?} is not an environment variable's name (one without `=`, spaces or \
                 control characters, such as `NCCL_DEBUG`)"
            ),
        )),
        None => Ok(()),
    }
}

/// NCCL refuses two ranks on one GPU (its communicator fails at the first collective, after the
/// image is built and every rank started), so two ranks given the same GPU of one host are
/// refused here unless they talk Gloo or compute on the CPU.
fn check_shared_gpus(loaded: &Loaded, hosts: &[HostSpec], slots: &[RankSlot]) -> Result<(), ConfigError> {
    let file = &loaded.file;
    if file.device == Some(Device::Cpu) || file.distributed_backend == Some(DistributedBackend::Gloo) {
        return Ok(());
    }
    let mut seen: BTreeMap<(usize, u32), usize> = BTreeMap::new();
    for (rank, (host, gpus)) in slots.iter().enumerate() {
        for &gpu in gpus {
            if let Some(first) = seen.insert((*host, gpu), rank) {
                return Err(loaded.error_at(
                    "machines",
                    format!(
                        "ranks {first} and {rank} both get GPU {gpu} of `{}`, and NCCL refuses two ranks \
                         on one GPU; give each rank a GPU of its own, or set `distributed_backend: gloo`",
                        hosts[*host].name
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// CUDA's variable for the GPUs a process sees, numbered from 0 in the order it lists.
pub(crate) const VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// Placeholder machines for a Slurm job's nodes (Slurm names them once the job starts), each
/// with its ranks: srun's default block distribution puts ranks `i*T .. (i+1)*T` on node `i`.
fn slurm_nodes(settings: &SlurmSettings) -> Vec<Machine> {
    let mut machines = Vec::new();
    for node in 0..settings.nodes {
        for _ in 0..settings.tasks_per_node {
            machines.push(Machine::placeholder(format!("slurm-node-{node}")));
        }
    }
    machines
}

/// A stage config named in the experiment file: next to the file, or, as PipeDream's driver
/// found it, relative to the working directory (its configs name `models/<model>/gpus=<N>/...`
/// from PipeDream's runtime folder). Next to the file when it is in neither, so the error names
/// that path.
fn stage_config_path(base: &Path, given: &Path) -> PathBuf {
    let beside = base.join(given);
    if beside.exists() || given.is_absolute() {
        return beside;
    }
    match std::path::absolute(given) {
        Ok(here) if here.exists() => here,
        _ => beside,
    }
}

/// The checkpoint folder, absolute (relative to the experiment file).
pub fn checkpoint_dir(file: &ExperimentFile, base: &Path) -> Option<PathBuf> {
    file.checkpoint_dir.as_ref().map(|d| absolute(&base.join(d)))
}

/// The weights file (`init_from`), absolute.
pub fn init_from(file: &ExperimentFile, base: &Path) -> Option<PathBuf> {
    file.init_from.as_ref().map(|p| absolute(&base.join(p)))
}

/// The runtime's model the file names: its `module`, or the model of a PipeDream partitioned
/// model (`models.vgg16.gpus=4` is `vgg16`).
pub fn runtime_model(file: &ExperimentFile) -> Option<String> {
    let module = file.module.as_deref()?;
    Some(
        pipedream::partitioned_module(module)
            .map_or(module, |(model, _)| model)
            .to_string(),
    )
}

/// The stage config of a PipeDream partitioned model (`module: models.<model>.gpus=<N>`), whose
/// `module_to_stage_map` numbers PipeDream's stage modules, rewritten over the runtime's modules
/// with the same split and written to this user's cache; the path to run with.
fn translate_pipedream(
    loaded: &Loaded,
    base: &Path,
    config: StageConfig,
    config_path: &Path,
) -> Result<(PathBuf, StageConfig), ConfigError> {
    let file = &loaded.file;
    let Some((model, folder)) = file.module.as_deref().and_then(pipedream::partitioned_module) else {
        return Ok((config_path.to_path_buf(), config));
    };
    let module = file.module.as_deref().unwrap_or_default();
    let relative = Path::new("models").join(model).join(folder);
    let dir = stage_config_path(base, &relative);
    if !dir.is_dir() {
        return Err(loaded.error_at(
            "module",
            format!(
                "`{module}` is PipeDream's partitioned model, whose folder {} is neither next to \
                 the experiment file nor in the working directory; copy PipeDream's models/ folder \
                 there, or name the runtime's model (`module: {model}`)",
                relative.display()
            ),
        ));
    }
    let modules = pipedream::read_folder(&dir).map_err(|e| loaded.error_at("module", e))?;
    let classes = file.num_classes.unwrap_or(1000);
    let ours = stagehand_contract::architecture::module_layers(model, classes).ok_or_else(|| {
        loaded.error_at(
            "module",
            format!(
                "`{module}`: the runtime has no model `{model}` to map PipeDream's stages onto \
                 (it has alexnet, vgg16, vgg16_bn, resnet50, resnet101, resnet152)"
            ),
        )
    })?;
    let names = |i: usize| format!("{i} (`runtime modules --model {model}` lists them)");
    let map = pipedream::translate(&config.module_to_stage_map, &modules, &ours, &names)
        .map_err(|e| loaded.error_at("config_file", format!("{}: {e}", config_path.display())))?;
    let translated = StageConfig {
        module_to_stage_map: map,
        ..config
    };
    let text = serde_json::to_string_pretty(&translated).expect("stage configs serialize") + "\n";
    let path = absolute(&pipedream::translated_path(&text));
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&path, &text));
    written.map_err(|e| {
        loaded.error_at(
            "config_file",
            format!("cannot write the translated stage config {}: {e}", path.display()),
        )
    })?;
    Ok((path, translated))
}

/// Iterations of `epochs` epochs when the file says how long an epoch is (`epoch_samples`, or
/// synthetic data's PipeDream length), for the progress bar; a dataset's size is the runtime's
/// to read.
fn epoch_iterations(file: &ExperimentFile) -> Option<u64> {
    let samples = match (file.epoch_samples, &file.data_dir) {
        (Some(n), _) => n,
        (None, None) => stagehand_contract::defaults::SYNTHETIC_EPOCH_SAMPLES,
        (None, Some(_)) => return None,
    };
    let batch = file
        .batch_size
        .map_or(stagehand_contract::defaults::BATCH_SIZE as u64, u64::from);
    Some(file.epochs? * (samples / batch.max(1)))
}

/// Checks the keys PipeDream's driver configs have that this driver does not honour yet: each
/// is refused with what to use instead, never ignored.
fn check_pipedream_keys(loaded: &Loaded) -> Result<(), ConfigError> {
    let f = &loaded.file;
    if f.epochs.is_some() && f.iterations.is_some() {
        return Err(loaded.error_at(
            "epochs",
            "`epochs` and `iterations` both say how long to train; keep one",
        ));
    }
    if f.iterations == Some(0) {
        return Err(loaded.error_at(
            "iterations",
            "iterations: 0 trains nothing, and the run would succeed having done nothing; give at \
             least 1",
        ));
    }
    match (f.synthetic_data, &f.data_dir) {
        (Some(true), Some(_)) => {
            return Err(loaded.error_at(
                "synthetic_data",
                "`synthetic_data: true` with a `data_dir`: drop `data_dir` to train on synthetic \
                 data, or `synthetic_data` to train on the data",
            ))
        }
        (Some(false), None) => {
            return Err(loaded.error_at(
                "synthetic_data",
                "`synthetic_data: false` needs a `data_dir` to train on",
            ))
        }
        _ => {}
    }
    if let Some(dir) = &f.checkpoint_dir {
        if dir.to_string_lossy().contains([':', ',']) {
            return Err(loaded.error_at(
                "checkpoint_dir",
                format!(
                    "`{}`: the folder is mounted with Docker's `-v` form, which cannot hold `:` or \
                     `,`; choose a path without them",
                    dir.display()
                ),
            ));
        }
    }
    let needs_dir = [
        ("checkpoint_every", f.checkpoint_every.is_some()),
        ("resume", f.resume.is_some()),
    ];
    if let (None, Some((key, _))) = (&f.checkpoint_dir, needs_dir.iter().find(|(_, given)| *given)) {
        return Err(loaded.error_at(key, format!("`{key}` needs a `checkpoint_dir`")));
    }
    if f.validation_batches.is_some() && f.validate_every.is_none() {
        return Err(loaded.error_at(
            "validation_batches",
            "`validation_batches` sizes the passes `validate_every` runs; add `validate_every: N` \
             or drop it",
        ));
    }
    if f.sync_every.is_some() && !matches!(f.reduce, Some(crate::config::Reduce::Partial(_))) {
        return Err(loaded.error_at(
            "sync_every",
            "`sync_every` spaces the full groups of a partial reduce; add `reduce: partial:K` or \
             drop it",
        ));
    }
    if f.compress_activations == Some(true) && f.compress_in_gpu == Some(false) {
        return Err(loaded.error_at(
            "compress_in_gpu",
            "the runtime casts activations to float16 on the device that holds them (the GPU with \
             CUDA); set `compress_in_gpu: true` or leave it out",
        ));
    }
    if f.deterministic == Some(true) && f.cudnn_benchmark == Some(true) {
        return Err(loaded.error_at(
            "cudnn_benchmark",
            "`cudnn_benchmark` lets cuDNN pick kernels by timing them, which may differ from run to \
             run, and `deterministic` rules that out; drop one",
        ));
    }
    if f.deterministic == Some(true) && f.fused_kernels == Some(true) {
        return Err(loaded.error_at(
            "fused_kernels",
            "the fused kernels sum bias gradients with atomic adds, in no fixed order, and \
             `deterministic` rules that out; drop one",
        ));
    }
    if f.profiler_steps.is_some() && f.profiler_trace != Some(true) {
        return Err(loaded.error_at(
            "profiler_steps",
            "`profiler_steps` is how many iterations `profiler_trace` records; add \
             `profiler_trace: true` or drop it",
        ));
    }
    let runtime_keys = [
        ("epochs", f.epochs.is_some()),
        ("epoch_samples", f.epoch_samples.is_some()),
        ("learning_rate_policy", f.learning_rate_policy.is_some()),
        ("lr_warmup_epochs", f.lr_warmup_epochs.is_some()),
        ("compress_activations", f.compress_activations == Some(true)),
        ("checkpoint_dir", f.checkpoint_dir.is_some()),
        ("augment", f.augment.is_some()),
        ("data_workers", f.data_workers.is_some()),
        ("deterministic", f.deterministic == Some(true)),
        ("cudnn_benchmark", f.cudnn_benchmark == Some(true)),
        ("fused_kernels", f.fused_kernels == Some(true)),
        ("profiler_trace", f.profiler_trace == Some(true)),
        ("momentum", f.momentum.is_some()),
        ("nesterov", f.nesterov == Some(true)),
        ("comm_timeout", f.comm_timeout.is_some()),
        ("layers", f.layers.is_some()),
        ("hidden", f.hidden.is_some()),
        ("image_size", f.image_size.is_some()),
        ("num_classes", f.num_classes.is_some()),
        ("active_units", f.active_units.is_some()),
        ("heads", f.heads.is_some()),
        ("seq_len", f.seq_len.is_some()),
        ("vocab_size", f.vocab_size.is_some()),
        ("dropout", f.dropout.is_some()),
    ];
    if let (Some(_), Some((key, _))) = (&f.command, runtime_keys.iter().find(|(_, given)| *given)) {
        return Err(loaded.error_at(
            key,
            format!("`{key}` is the runtime's, but the ranks run `command:`; drop one"),
        ));
    }
    // PipeDream's image configs say `translation_model: False`; a translation model is not here.
    let translation = f
        .translation_model
        .as_ref()
        .filter(|v| **v != serde_json::Value::Bool(false));
    if translation.is_some() {
        return Err(loaded.error_at(
            "translation_model",
            "`translation_model` (PipeDream's) is not supported by this driver yet; the runtime has \
             no GNMT; `module: transformer` is its BERT-style language model (`translation_model: \
             false` is accepted)",
        ));
    }
    match f.model_type.as_deref() {
        None | Some("image_classification") => Ok(()),
        Some(other) => Err(loaded.error_at(
            "model_type",
            format!(
                "model_type `{other}` is not one the runtime has; it trains image classification \
                 (mlp, alexnet, vgg16, resnet50/101/152) and a BERT-style transformer: use \
                 `model_type: image_classification` or leave the key out"
            ),
        )),
    }
}

/// Every `slowdown:` entry names one rank of the world or one of the machines, with a factor of
/// at least 1, and the ranks run the runtime (the factor is its `--slowdown`).
fn check_slowdown(loaded: &Loaded, hosts: &[HostSpec], world_size: usize) -> Result<(), ConfigError> {
    let file = &loaded.file;
    let invalid = |message: String| Err(loaded.error_at("slowdown", message));
    if !file.slowdown.is_empty() && file.command.is_some() {
        return invalid(
            "slowdown stretches the runtime's compute, but the ranks run `command:`; drop one".into(),
        );
    }
    for (i, s) in file.slowdown.iter().enumerate() {
        match (&s.rank, &s.host) {
            (Some(_), Some(_)) | (None, None) => {
                return invalid(format!(
                    "slowdown entry {i} must name either a `rank` or a `host`, not both or neither"
                ))
            }
            (Some(rank), None) if *rank >= world_size => {
                return invalid(format!(
                "slowdown entry {i} names rank {rank}, but the machines give {world_size} rank(s) (0 to {})",
                world_size - 1
            ))
            }
            (None, Some(host)) if !hosts.iter().any(|h| &h.name == host) => {
                let names: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
                return invalid(format!(
                    "slowdown entry {i} names host `{host}`, which is not one of the machines ({})",
                    names.join(", ")
                ));
            }
            _ => {}
        }
        if !(s.factor.is_finite() && s.factor >= 1.0) {
            return invalid(format!(
                "slowdown entry {i} has factor {}; a factor is at least 1 (2 makes compute take twice as long)",
                s.factor
            ));
        }
    }
    Ok(())
}

/// What `config_file: auto` will do: checks the keys it needs, picks the microbatches and the
/// network levels from the machines, and builds the profiling command for rank 0's device.
fn auto_plan(
    loaded: &Loaded,
    ctx: &args::ArgsContext,
    hosts: &[HostSpec],
    rank_slots: &[(usize, Vec<u32>)],
) -> Result<AutoPartition, ConfigError> {
    let file = &loaded.file;
    let need = |what: &str| {
        loaded.error_at(
            "config_file",
            format!("config_file: auto profiles and plans the runtime's model, so it needs {what}"),
        )
    };
    if file.command.is_some() {
        return Err(need("the runtime, not a `command:`"));
    }
    let Some(model) = runtime_model(file) else {
        return Err(need("`module:` (the model to profile)"));
    };
    let Some(batch_size) = file.batch_size else {
        return Err(need("`batch_size:` (the plan is for one minibatch size)"));
    };
    if batch_size == 0 {
        return Err(loaded.error_at("batch_size", "batch_size must be at least 1"));
    }
    let world_size = rank_slots.len();
    let microbatches = match file.microbatches {
        Some(0) => return Err(loaded.error_at("microbatches", "microbatches must be at least 1")),
        Some(m) => {
            if !batch_size.is_multiple_of(m) {
                return Err(loaded.error_at(
                    "microbatches",
                    format!("{m} microbatches do not divide batch_size {batch_size}"),
                ));
            }
            m
        }
        None => default_microbatches(batch_size, world_size).ok_or_else(|| {
            loaded.error_at(
                "batch_size",
                format!(
                    "batch_size {batch_size} is smaller than the {world_size} ranks; config_file: auto needs at least one sample per rank"
                ),
            )
        })?,
    };
    let settings = file.planner.clone().unwrap_or_default();
    if settings.repeats == Some(0) {
        return Err(loaded.error_at("planner", "planner: repeats must be at least 1"));
    }
    let gpu = ctx.device == Device::Cuda;
    let intra = settings.intra_host_gbps.unwrap_or(if gpu {
        DEFAULT_INTRA_HOST_GPU_GBPS
    } else {
        DEFAULT_INTRA_HOST_CPU_GBPS
    }) * 1e9;
    let inter = settings.inter_host_gbps.unwrap_or(DEFAULT_INTER_HOST_GBPS) * 1e9;
    let profile_file = settings.profile.as_ref().map(|p| ctx.base.join(p));
    if let Some(path) = profile_file.as_ref().filter(|p| !p.is_file()) {
        return Err(loaded.error_at(
            "planner",
            format!(
                "planner: profile: there is no file {} (a profile `runtime profile` wrote, or leave \
                 `profile` out to profile at launch)",
                path.display()
            ),
        ));
    }
    let (host, gpus) = &rank_slots[0];
    let profile_argv = match &profile_file {
        Some(_) => None,
        None => Some(args::profile_command(
            ctx,
            &hosts[*host],
            gpus,
            batch_size / microbatches,
            settings.repeats,
        )),
    };
    Ok(AutoPartition {
        profile_argv,
        profile_file,
        profile_device: args::device_arg(ctx, &hosts[*host], gpus),
        model,
        arithmetic: stagehand_contract::profile::arithmetic(
            file.precision.unwrap_or(Precision::Fp32).as_arg(),
            file.channels_last == Some(true),
        ),
        microbatches,
        micro_batch_size: batch_size / microbatches,
        workers: world_size,
        levels: network_levels(hosts, world_size, intra, inter),
        memory_bytes: settings.memory_gib.map(|gib| gib * (1u64 << 30) as f64),
        straight: settings.straight,
        compress_activations: file.compress_activations == Some(true),
    })
}

/// Microbatches when the file names none: the fewest that give every rank work (the world size
/// bounds both the stage count and any stage's replicas) and divide the minibatch.
fn default_microbatches(batch_size: u32, world_size: usize) -> Option<u32> {
    let least = u32::try_from(world_size).ok()?.max(1);
    (least..=batch_size).find(|m| batch_size.is_multiple_of(*m))
}

/// The network as the planner sees it: ranks of one machine talk at `intra` bytes/s, machines at
/// `inter`. Machines with different rank counts are planned as one flat level at `inter`.
fn network_levels(hosts: &[HostSpec], world_size: usize, intra: f64, inter: f64) -> Vec<(usize, f64)> {
    if hosts.len() == 1 {
        return vec![(world_size, intra)];
    }
    let per_host = hosts[0].ranks.len();
    if per_host > 1 && hosts.iter().all(|h| h.ranks.len() == per_host) {
        vec![(per_host, intra), (world_size, inter)]
    } else {
        vec![(world_size, inter)]
    }
}

/// A rank's host (an index into the hosts) and its GPUs there.
type RankSlot = (usize, Vec<u32>);

/// Groups machine entries by host; returns the hosts and, per rank, its host index and GPUs
/// (each entry's GPUs in groups of `gpus_per_rank`).
fn group_hosts(machines: &[Machine], gpus_per_rank: usize) -> Result<(Vec<HostSpec>, Vec<RankSlot>), String> {
    let mut hosts: Vec<HostSpec> = Vec::new();
    let mut slots = Vec::new();
    for m in machines {
        let index = match hosts.iter().position(|h| h.name == m.host) {
            Some(i) => i,
            None => {
                hosts.push(HostSpec {
                    name: m.host.clone(),
                    machine: m.clone(),
                    ranks: Vec::new(),
                    gpus: Vec::new(),
                });
                hosts.len() - 1
            }
        };
        if gpus_per_rank > 1 && (m.gpus.is_empty() || !m.gpus.len().is_multiple_of(gpus_per_rank)) {
            return Err(format!(
                "gpus_per_rank is {gpus_per_rank}, but the machines entry for `{}` lists {} GPU(s); \
                 list a multiple of {gpus_per_rank} as `{{host: {}, gpus: [0, 1, ...]}}`",
                m.host,
                m.gpus.len(),
                m.host
            ));
        }
        let per_rank: Vec<Vec<u32>> = if m.gpus.is_empty() {
            vec![Vec::new()]
        } else {
            m.gpus.chunks(gpus_per_rank).map(<[u32]>::to_vec).collect()
        };
        for gpus in per_rank {
            let host = &mut hosts[index];
            host.ranks.push(slots.len());
            for g in &gpus {
                if !host.gpus.contains(g) {
                    host.gpus.push(*g);
                }
            }
            slots.push((index, gpus));
        }
    }
    // In index order, as CUDA numbers a container's GPUs under CUDA_DEVICE_ORDER=PCI_BUS_ID
    // (the order nvidia-smi's and the engine's indices follow), whatever order the machines list.
    for host in &mut hosts {
        host.gpus.sort_unstable();
    }
    Ok((hosts, slots))
}

/// The image the containers run. Without `container:`, the runtime image built from the
/// workspace's source (docker/runtime/Dockerfile, its torch image chosen by the device), or the
/// development image docker/local when `--runtime` mounts this machine's build.
/// The build an image needs has its folder and its Dockerfile here (a run would find it missing
/// only once it had reached every host).
fn check_build(loaded: &Loaded, image: &ImageSource) -> Result<(), ConfigError> {
    let (ImageSource::Build(spec) | ImageSource::Base { build: spec, .. }) = image else {
        return Ok(());
    };
    if !spec.context.is_dir() {
        return Err(loaded.error_at(
            "container",
            format!(
                "the build folder {} is not a folder here; give `container: {{build: DIR}}` a \
                 folder that holds the image's Dockerfile (relative paths start at this file's folder)",
                spec.context.display()
            ),
        ));
    }
    let dockerfile = spec.context.join(&spec.dockerfile);
    if !dockerfile.is_file() {
        return Err(loaded.error_at(
            "container",
            format!(
                "the build folder {} holds no {} (the Dockerfile, relative to the folder); add it, \
                 or name the one there with `dockerfile:`",
                spec.context.display(),
                spec.dockerfile
            ),
        ));
    }
    Ok(())
}

fn image_source(
    loaded: &Loaded,
    container: Option<&Container>,
    base: &Path,
    options: &Options,
    device: Device,
) -> Result<ImageSource, ConfigError> {
    let build = match container {
        // The user's program, or this machine's runtime copied in: the image as it is.
        Some(Container::Image(name)) if loaded.file.command.is_some() || options.runtime.is_some() => {
            return Ok(ImageSource::Named(name.clone()))
        }
        Some(Container::Image(name)) => {
            return match image_source(loaded, None, base, options, device)? {
                ImageSource::Build(mut build) => {
                    build.args.insert("BASE_IMAGE".to_string(), name.clone());
                    Ok(ImageSource::Base {
                        name: name.clone(),
                        build,
                    })
                }
                other => Ok(other),
            };
        }
        Some(Container::Build(b)) => b.clone(),
        None => Default::default(),
    };
    if let Some(dir) = &build.dir {
        let context = base.join(dir);
        let stem = context
            .file_name()
            .map(|s| s.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        let stem: String = stem
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        return Ok(ImageSource::Build(BuildSpec {
            context,
            dockerfile: build.dockerfile.unwrap_or_else(|| "Dockerfile".into()),
            args: build.args,
            repository: format!("stagehand-{stem}"),
        }));
    }
    let source = source_root(options.source.as_deref()).ok_or_else(|| {
        loaded.error_at(
            "container",
            format!(
                "the runtime image is built from the stagehand source, and none was found (no \
                 {RUNTIME_DOCKERFILE} in this folder or above it); run the driver inside a \
                 checkout, give `--source DIR`, or name an image in `container:`"
            ),
        )
    })?;
    if options.runtime.is_some() && container.is_none() {
        return Ok(ImageSource::Build(BuildSpec {
            context: source.join("docker/local"),
            dockerfile: "Dockerfile".into(),
            args: BTreeMap::new(),
            repository: "stagehand-local".into(),
        }));
    }
    let variant = match device {
        Device::Cuda => "cuda",
        Device::Cpu => "cpu",
    };
    let mut args = BTreeMap::from([(
        "TORCH_IMAGE".to_string(),
        format!("stagehand-torch:{TORCH_VERSION}-{variant}"),
    )]);
    args.extend(build.args);
    Ok(ImageSource::Build(BuildSpec {
        context: source,
        dockerfile: build.dockerfile.unwrap_or_else(|| RUNTIME_DOCKERFILE.into()),
        args,
        repository: format!("stagehand-runtime-{variant}"),
    }))
}

/// The torch version the runtime is built against (the torch images' tag).
pub const TORCH_VERSION: &str = "2.11.0";

/// The workspace the runtime image is built from: `given`, else the nearest folder at or above
/// the working folder holding the runtime's Dockerfile, else the workspace this driver was built
/// from, if it is still there.
pub fn source_root(given: Option<&Path>) -> Option<PathBuf> {
    if let Some(dir) = given {
        return Some(absolute(dir));
    }
    let cwd = std::env::current_dir().ok()?;
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf);
    cwd.ancestors()
        .map(Path::to_path_buf)
        .chain(built_from)
        .find(|d| d.join(RUNTIME_DOCKERFILE).is_file())
}

/// The runtime local ranks run when `--runtime` names none: the release build of the checkout the
/// driver works from ([`source_root`]: `--source`, the working folder or one above it, or the
/// checkout that built the driver), else the `runtime` beside the driver's own program; where
/// neither is built, the checkout's path, which preflight finds missing and says how to build.
fn built_runtime(options: &Options) -> PathBuf {
    let checkout = source_root(options.source.as_deref()).map(|root| root.join(DEFAULT_LOCAL_RUNTIME));
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("runtime")));
    checkout
        .iter()
        .chain(&beside)
        .find(|p| p.is_file())
        .or(checkout.as_ref())
        .cloned()
        .unwrap_or_else(|| absolute(Path::new(DEFAULT_LOCAL_RUNTIME)))
}

/// The containers' shared memory (`shm_size_mb`, default [`DEFAULT_SHM_MB`]), in bytes; at most
/// [`MAX_SHM_MB`].
fn shm_size_bytes(loaded: &Loaded) -> Result<u64, ConfigError> {
    let mb = loaded.file.shm_size_mb.unwrap_or(DEFAULT_SHM_MB);
    if mb > MAX_SHM_MB {
        return Err(loaded.error_at(
            "shm_size_mb",
            format!(
                "shm_size_mb: {mb} MiB is more than any machine's memory; give at most {MAX_SHM_MB} \
                 (a tebibyte)"
            ),
        ));
    }
    Ok(mb << 20)
}

/// Makes a path absolute against the current directory, without requiring it to exist.
pub fn absolute(path: &Path) -> PathBuf {
    if path.is_absolute() {
        return path.to_path_buf();
    }
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    let joined = cwd.join(path);
    // Drop `.` components so mounts and argv read cleanly.
    joined
        .components()
        .filter(|c| !matches!(c, std::path::Component::CurDir))
        .collect()
}

/// This machine's name as other machines would resolve it.
fn this_host_name() -> String {
    host_name()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// This machine's name (`gethostname`), where the system gives one.
pub fn host_name() -> Option<String> {
    nix::unistd::gethostname().ok()?.into_string().ok()
}

/// A free TCP port on this machine, from the kernel's ephemeral range: for a listener of the
/// driver's own, such as an SSH forward's local end (a master port is picked below that range).
pub fn free_local_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
pub(crate) mod tests;
