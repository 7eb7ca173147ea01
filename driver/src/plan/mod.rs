//! The resolved plan: the experiment file and the command line combined into what will run where —
//! hosts, ranks with their argument vectors and environments, mounts and the image. Everything
//! that can be checked without touching a host is checked here.

mod args;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use stagehand_contract::StageConfig;

use crate::cli::{Backend, ContainerMode, Options};
use crate::config::{ConfigError, Container, Device, Loaded, Machine, Mount};

/// Default shared memory per container: data loaders need more than Docker's 64 MiB.
const DEFAULT_SHM_MB: u64 = 2048;

/// Where the image comes from, with paths made absolute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageSource {
    /// Use this image as named.
    Named(String),
    /// Build this context directory.
    Build(PathBuf),
}

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
}

/// A bind mount and its fallback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedMount {
    /// The mount.
    pub mount: Mount,
    /// What to do where the source path does not exist.
    pub when_missing: WhenMissing,
}

/// One distinct host and the ranks it runs.
#[derive(Debug, Clone, Serialize)]
pub struct HostPlan {
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
pub struct RankPlan {
    /// Global rank.
    pub rank: usize,
    /// Index into [`Plan::hosts`].
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

/// Everything the launch needs, resolved and checked.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Experiment name.
    pub name: String,
    /// Where ranks run.
    pub backend: Backend,
    /// Container packing (ignored by the process backend).
    pub container_mode: ContainerMode,
    /// The image (ignored by the process backend).
    pub image: ImageSource,
    /// Distinct hosts in order of first appearance.
    pub hosts: Vec<HostPlan>,
    /// Ranks by global rank.
    pub ranks: Vec<RankPlan>,
    /// Master address as every rank reaches it.
    pub master_addr: String,
    /// Master port chosen by the driver.
    pub master_port: u16,
    /// Iterations each rank runs, when known (drives the progress bar).
    pub iterations: Option<u64>,
    /// Samples per iteration of one pipeline, when known.
    pub batch_size: Option<u32>,
    /// Bind mounts for every container (host path = container path for code and data), each
    /// with what to do on a host that lacks the source path.
    pub mounts: Vec<PlannedMount>,
    /// Shared memory per container in bytes.
    pub shm_size_bytes: u64,
    /// Where the record folder goes.
    pub log_directory: PathBuf,
}

impl Plan {
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// The host a rank runs on.
    pub fn host_of(&self, rank: usize) -> &HostPlan {
        &self.hosts[self.ranks[rank].host]
    }
}

/// Resolves the plan; `master_port` is chosen by the caller (it depends on the hosts).
pub fn resolve(loaded: &Loaded, options: &Options, master_port: u16) -> Result<Plan, ConfigError> {
    let file = &loaded.file;
    let base = absolute(&loaded.base_dir());
    if file.machines.is_empty() {
        return Err(loaded.error_at(
            "machines",
            "machines is empty; list one `host:gpu` (or `localhost`) per rank",
        ));
    }
    let backend = options.backend.or(file.backend).unwrap_or(Backend::Docker);
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

    let (hosts, rank_slots) = group_hosts(&file.machines);
    let world_size = rank_slots.len();

    let stages = match &file.config_file {
        Some(rel) => {
            let path = base.join(rel);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                loaded.error_at(
                    "config_file",
                    format!("cannot read stage config {}: {e}", path.display()),
                )
            })?;
            let config = StageConfig::from_json(&text)
                .map_err(|e| loaded.error_at("config_file", format!("{}: {e}", path.display())))?;
            // The driver does not know the model's module count; the runtime checks it. The rank
            // layout is checked here so a wrong world size fails before anything starts.
            let num_modules = config.module_to_stage_map.len();
            let plan = config.validate(num_modules, world_size).map_err(|e| {
                loaded.error_at(
                    "config_file",
                    format!(
                        "{}: {e} (the machines list gives {world_size} ranks)",
                        path.display()
                    ),
                )
            })?;
            Some((path, plan))
        }
        None => None,
    };
    if file.schedule.is_some() && stages.is_none() && world_size > 1 {
        return Err(loaded.error_at(
            "schedule",
            "a schedule needs a `config_file` that splits the model into stages",
        ));
    }

    let any_gpu = hosts.iter().any(|h| !h.gpus.is_empty());
    let device = file
        .device
        .unwrap_or(if any_gpu { Device::Cuda } else { Device::Cpu });
    if device == Device::Cuda && rank_slots.iter().any(|(_, gpus)| gpus.is_empty()) {
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

    let name = file.name.clone().unwrap_or_else(|| {
        loaded
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "experiment".into())
    });
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

    let image = match &file.container {
        Some(Container::Image(name)) => ImageSource::Named(name.clone()),
        Some(Container::Build(dir)) => ImageSource::Build(base.join(dir)),
        None => ImageSource::Build(absolute(Path::new("docker"))),
    };

    // Rank 0 runs on the first machine; the address must be how the other machines reach it.
    let all_local = hosts.iter().all(|h| h.machine.is_local());
    let master_addr = match (all_local, hosts[0].machine.is_local()) {
        (true, _) => "127.0.0.1".to_string(),
        (false, true) => this_host_name(),
        (false, false) => hosts[0].name.clone(),
    };

    let runtime = absolute(&options.runtime);
    let stage_config_path = stages.as_ref().map(|(p, _)| p.clone());
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
        };
        mounts.push(PlannedMount { mount, when_missing });
    };
    // Code reaches containers by a bind mount where the host has the path, else it is copied in.
    for path in [Some(program), stage_config_path.clone()].into_iter().flatten() {
        if path.is_absolute() && path.is_file() {
            same_path(path, true, WhenMissing::Copy);
        }
    }
    // The torch environment is optional: the GPU image carries its own at the same path.
    if options.torch_venv.is_absolute() && options.torch_venv.exists() {
        same_path(options.torch_venv.clone(), true, WhenMissing::Skip);
    }
    if let Some(data) = &file.data_dir {
        let p = base.join(data);
        if p.exists() {
            same_path(p, true, WhenMissing::Fail);
        }
    }
    for dir in &options.mount_directories {
        same_path(absolute(dir), false, WhenMissing::Fail);
    }
    for m in &file.mounts {
        let mount = Mount {
            source: base.join(&m.source),
            target: m.target.clone(),
            read_only: m.read_only,
        };
        mounts.push(PlannedMount {
            mount,
            when_missing: WhenMissing::Fail,
        });
    }

    let ctx = args::ArgsContext {
        file,
        base: &base,
        runtime: &runtime,
        stage_config: stage_config_path.as_deref(),
        device,
        backend,
        container_mode: options.container_mode,
        world_size,
        master_addr: &master_addr,
        master_port,
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
            RankPlan {
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

    Ok(Plan {
        name,
        backend,
        container_mode: options.container_mode,
        image,
        hosts,
        ranks,
        master_addr,
        master_port,
        iterations: file.iterations,
        batch_size: file.batch_size,
        mounts,
        shm_size_bytes: file.shm_size_mb.unwrap_or(DEFAULT_SHM_MB) * 1024 * 1024,
        log_directory: options
            .output_dir
            .clone()
            .or_else(|| file.log_directory.clone())
            .unwrap_or_else(|| PathBuf::from("experiments")),
    })
}

/// Groups machine entries by host; returns the hosts and, per rank, its host index and GPUs.
fn group_hosts(machines: &[Machine]) -> (Vec<HostPlan>, Vec<(usize, Vec<u32>)>) {
    let mut hosts: Vec<HostPlan> = Vec::new();
    let mut slots = Vec::new();
    for m in machines {
        let index = match hosts.iter().position(|h| h.name == m.host) {
            Some(i) => i,
            None => {
                hosts.push(HostPlan {
                    name: m.host.clone(),
                    machine: m.clone(),
                    ranks: Vec::new(),
                    gpus: Vec::new(),
                });
                hosts.len() - 1
            }
        };
        let per_rank: Vec<Vec<u32>> = if m.gpus.is_empty() {
            vec![Vec::new()]
        } else {
            m.gpus.iter().map(|g| vec![*g]).collect()
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
    (hosts, slots)
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
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Picks a free TCP port on this machine for the master.
pub fn free_local_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
mod tests;
