//! Hosts: reaching each machine's Docker engine and making sure it can run the experiment
//! (preflight). The local engine is reached over its unix socket, any other host through an SSH
//! connection that forwards its socket ([`ssh`]); after [`connect`] both are a plain
//! [`bollard::Docker`] handle.

pub mod context;
mod dockerignore;
pub mod image;
pub mod ssh;

use std::path::PathBuf;
use std::sync::Arc;

use bollard::Docker;

pub use ssh::SshOptions;

use self::context::ContextError;
use crate::config::Mount;
use crate::events::HostFacts;
use crate::experiment::{HostSpec, ImageSource, MountSpec, WhenMissing};

/// Failures while reaching a host's engine or preparing it (mounts, GPUs, the image).
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("cannot reach the Docker engine on {host}; is it running, and may this user use its socket? (or use --backend process)")]
    Connect {
        host: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error(transparent)]
    Ssh(#[from] crate::hosts::ssh::SshError),
    #[error("docker on {host} could not {action}")]
    Docker {
        host: String,
        action: &'static str,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("{} does not exist on {host}; create it there, or drop it from data_dir, mounts or --mount-directories", path.display())]
    MountMissing { host: String, path: PathBuf },
    #[error("`machines` gives the ranks on {host} GPUs {gpus:?}, but {host} has no NVIDIA driver loaded ({NVIDIA_DRIVER} is missing there); name it without GPU indices (`{host}` rather than `{host}:{}`) to train on its CPUs, or load the NVIDIA driver there", gpus[0])]
    NoNvidiaDriver { host: String, gpus: Vec<u32> },
    #[error("image {image} does not exist on {host}; build it there, or name a build context with `container: {{build: DIR}}`")]
    ImageMissing { host: String, image: String },
    #[error("building the image from {} on {host} failed: {message}", context.display())]
    ImageBuild {
        host: String,
        context: PathBuf,
        message: String,
    },
    #[error(
        "{host} lacks the base image(s) {}, and could not pull them ({reason}), nor send them from \
         this machine's engine, which lacks them too; without a registry, make them here \
         (scripts/base-image.sh; docker/base/README.md) for the driver to send, or load them there \
         from a machine that has them (`docker save {} | ssh {host} docker load`)",
        images.join(", "),
        images.join(" ")
    )]
    BaseImagesMissing {
        host: String,
        images: Vec<String>,
        reason: String,
    },
    #[error("sending image {image} from {from} to {to} failed: {message}")]
    ImageTransfer {
        from: String,
        to: String,
        image: String,
        message: String,
    },
    #[error(transparent)]
    Context {
        #[from]
        source: ContextError,
    },
}

/// A host whose engine answered.
#[derive(Clone)]
pub struct Host {
    /// Name as in the experiment file.
    pub name: String,
    /// The host's part of the plan, kept to reconnect after a lost connection.
    pub plan: HostSpec,
    /// The engine.
    pub docker: Docker,
    /// The image tag containers run.
    pub image: String,
    /// The engine's CPU architecture (images are built once per architecture).
    pub arch: String,
    /// The engine's own ID (`docker info`), the same under every name the machine is reached by.
    pub engine_id: String,
    /// Bind mounts whose source exists on this host.
    pub mounts: Vec<Mount>,
    /// Files this host lacks, copied into each container before it starts.
    pub copies: Vec<PathBuf>,
    /// Whether the host has `/dev/infiniband` (InfiniBand or RoCE verbs devices for NCCL).
    pub infiniband: bool,
    /// The SSH connection the engine is reached through, for a remote host: dropping the last
    /// clone closes the connection.
    pub tunnel: Option<Arc<ssh::Tunnel>>,
}

impl Host {
    /// Makes a file written on this machine after preflight (a stage config planned at launch)
    /// reach this host's containers: bind-mounted where it exists, copied in elsewhere.
    pub fn add_file(&mut self, path: &std::path::Path) {
        if self.plan.machine.is_local() {
            self.mounts.push(Mount {
                source: path.to_path_buf(),
                target: path.to_path_buf(),
                read_only: true,
                create: false,
            });
        } else {
            self.copies.push(path.to_path_buf());
        }
    }
}

/// Connects to a host's engine and agrees on an API version (servers here speak 1.41).
pub async fn connect(
    host: &HostSpec,
    ssh: &SshOptions,
) -> Result<(Docker, Option<Arc<ssh::Tunnel>>), HostError> {
    if !host.machine.is_local() {
        let (docker, tunnel) = ssh::connect(host, ssh).await?;
        return Ok((docker, Some(tunnel)));
    }
    let connect_err = |source| HostError::Connect {
        host: host.name.clone(),
        source,
    };
    let docker = Docker::connect_with_local_defaults().map_err(connect_err)?;
    let docker = docker.negotiate_version().await.map_err(connect_err)?;
    Ok((docker, None))
}

/// Where a host's InfiniBand/RoCE verbs device files are, and where containers get them.
pub const INFINIBAND: &str = "/dev/infiniband";

/// Where the driver looks for every host's verbs device files: [`INFINIBAND`], or the folder
/// `STAGEHAND_INFINIBAND_DIR` names (a host that keeps them elsewhere; the tests' stand-in).
pub fn infiniband_dir() -> PathBuf {
    std::env::var_os("STAGEHAND_INFINIBAND_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(INFINIBAND))
}

/// Reaches every host's engine again on a new connection, all at once: after a host was lost,
/// before its ranks start again. The first host that does not answer is the error.
pub async fn reconnect_all(hosts: &mut [Host], ssh: &SshOptions) -> Result<(), HostError> {
    let fresh = futures_util::future::join_all(hosts.iter().map(|h| connect(&h.plan, ssh))).await;
    for (host, connection) in hosts.iter_mut().zip(fresh) {
        let (docker, tunnel) = connection?;
        host.docker = docker;
        host.tunnel = tunnel;
    }
    Ok(())
}

/// Preflight for every host: each engine reachable, its mounts and GPUs checked, all at once;
/// then the image on every host, built once and streamed where it is missing ([`image`]), once
/// `before_changes` has resolved (a host that has the image is not changed, and waits for
/// nothing).
pub async fn prepare_all(
    hosts: &[HostSpec],
    image: &ImageSource,
    planned: &[MountSpec],
    ssh: &SshOptions,
    feedback: image::Feedback,
    before_changes: impl std::future::Future<Output = ()>,
) -> Result<Vec<(Host, HostFacts)>, HostError> {
    let ready = futures_util::future::join_all(hosts.iter().map(|h| prepare(h, planned, ssh)))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    for (first, second) in
        one_engine_twice(ready.iter().map(|(h, _)| (h.name.as_str(), h.engine_id.as_str())))
    {
        stderr_line!(
            "warning: {first} and {second} are one machine (the same Docker engine): their ranks are \
             each told they are alone there (LOCAL_RANK, LOCAL_WORLD_SIZE) and may be given the same \
             GPUs; list it once in `machines`, with all its ranks"
        );
    }
    let engines: Vec<image::Engine> = ready
        .iter()
        .map(|(h, _)| image::Engine {
            host: &h.name,
            docker: &h.docker,
            arch: &h.arch,
        })
        .collect();
    let images = image::ensure_all(&engines, image, feedback, before_changes).await?;
    Ok(ready
        .into_iter()
        .zip(images)
        .map(|((mut host, mut facts), prepared)| {
            host.image = prepared.tag.clone();
            facts.image = Some(prepared.tag);
            facts.image_id = Some(prepared.id);
            facts.image_built = prepared.built;
            facts.image_received_from = prepared.received_from;
            facts.image_seconds = prepared.seconds;
            (host, facts)
        })
        .collect())
}

/// The names of `(name, engine ID)` pairs that reach one engine, each with the first name it
/// was reached by: a machine listed twice (`th1` and its address, or `localhost` and this
/// machine's name). Warned of, not refused: a test bed of one engine reached under several
/// addresses is one on purpose.
fn one_engine_twice<'a>(hosts: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<(&'a str, &'a str)> {
    let mut seen: Vec<(&str, &str)> = Vec::new();
    let mut twice = Vec::new();
    for (name, id) in hosts {
        match seen.iter().find(|(_, seen_id)| !id.is_empty() && *seen_id == id) {
            Some((first, _)) => twice.push((*first, name)),
            None => seen.push((name, id)),
        }
    }
    twice
}

/// What the NVIDIA kernel driver puts in `/proc` once loaded (as it is at boot on a machine with
/// NVIDIA GPUs and the driver installed): on a host given GPUs, its absence means no GPU can run,
/// unless the host is WSL 2 ([`WSL_GPU`]).
pub const NVIDIA_DRIVER: &str = "/proc/driver/nvidia/version";

/// WSL 2's GPU device, through which its Linux reaches Windows' NVIDIA driver (no
/// [`NVIDIA_DRIVER`] there).
const WSL_GPU: &str = "/dev/dxg";

/// Preflight for one host: engine reachable, mounts present or copied, GPUs usable when asked for.
/// The image is left to [`prepare_all`].
async fn prepare(
    host: &HostSpec,
    planned: &[MountSpec],
    ssh: &SshOptions,
) -> Result<(Host, HostFacts), HostError> {
    let (docker, tunnel) = connect(host, ssh).await?;
    // One remote check per path, all at once over the multiplexed connection: the mounts', and
    // the verbs devices NCCL's InfiniBand transport would need in the containers.
    let infiniband_dir = infiniband_dir();
    let exists = |path: &std::path::Path| {
        let path = path.to_path_buf();
        let tunnel = &tunnel;
        async move {
            match tunnel {
                None => Ok(path.exists()),
                Some(t) => t.path_exists(&host.name, &path).await,
            }
        }
    };
    let checks = futures_util::future::join_all(planned.iter().map(|p| exists(&p.mount.source)));
    // A host given GPUs has a loaded NVIDIA driver, or none of them: said before any image is
    // built or sent (a CUDA image is several GB).
    let nvidia = async {
        if host.gpus.is_empty() || exists(std::path::Path::new(NVIDIA_DRIVER)).await? {
            return Ok(true);
        }
        exists(std::path::Path::new(WSL_GPU)).await
    };
    let (checks, infiniband, nvidia) = futures_util::join!(checks, exists(&infiniband_dir), nvidia);
    let infiniband = infiniband?;
    if !nvidia? {
        return Err(HostError::NoNvidiaDriver {
            host: host.name.clone(),
            gpus: host.gpus.clone(),
        });
    }
    let mut mounts = Vec::new();
    let mut copies = Vec::new();
    for (p, exists) in planned.iter().zip(checks) {
        match (exists?, p.when_missing) {
            (true, _) => mounts.push(p.mount.clone()),
            (false, WhenMissing::Copy) => copies.push(p.mount.source.clone()),
            (false, WhenMissing::Skip) => {}
            (false, WhenMissing::Create) => mounts.push(p.mount.clone()),
            (false, WhenMissing::Fail) => {
                return Err(HostError::MountMissing {
                    host: host.name.clone(),
                    path: p.mount.source.clone(),
                })
            }
        }
    }
    let docker_err = |action: &'static str| {
        let host = host.name.clone();
        move |source| HostError::Docker { host, action, source }
    };
    let (version, info) = futures_util::join!(docker.version(), docker.info());
    let version = version.map_err(docker_err("ask for its version"))?;
    let engine_id = info
        .map_err(docker_err("describe itself"))?
        .id
        .unwrap_or_default();
    let facts = HostFacts {
        host: host.name.clone(),
        docker_version: version.version,
        gpus: host.gpus.iter().map(|g| g.to_string()).collect(),
        image_id: None,
        image: None,
        image_built: false,
        image_received_from: None,
        image_seconds: 0.0,
        copied_in: copies.iter().map(|p| p.display().to_string()).collect(),
        infiniband,
    };
    let host = Host {
        name: host.name.clone(),
        plan: host.clone(),
        docker,
        image: String::new(),
        arch: version.arch.unwrap_or_default(),
        engine_id,
        mounts,
        copies,
        infiniband,
        tunnel,
    };
    Ok((host, facts))
}

/// The address every machine reaches rank 0's machine at, found on the machines themselves
/// rather than taken from a name in the experiment file (an ssh alias means nothing to the other
/// hosts): the first machine's own address on the driver's SSH connection to it, or, when the first
/// machine is this one, the address a remote machine sees this one at. `None` when every machine
/// is this one.
pub async fn master_address(hosts: &[Host]) -> Result<Option<String>, HostError> {
    let Some(first) = hosts.first() else {
        return Ok(None);
    };
    if let Some(tunnel) = &first.tunnel {
        return Ok(Some(tunnel.endpoints(&first.name).await?.server));
    }
    for host in hosts {
        if let Some(tunnel) = &host.tunnel {
            return Ok(Some(tunnel.endpoints(&host.name).await?.client));
        }
    }
    Ok(None)
}

/// The lowest port the driver picks a master port from: above the ports services are commonly
/// configured on, and above those a Slurm job's ranks derive from its id (10000-29999), so a
/// run of processes and a Slurm job on one machine do not meet.
const MASTER_PORTS_FROM: u16 = 30_000;
/// How many random ports [`pick_master_port`] tries before it takes any free one.
const MASTER_PORT_DRAWS: u64 = 64;

/// Picks a master port free on this machine, below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, 32768 and up by default). A port in that range that is free
/// now can be taken at any moment as the local end of some outgoing connection: between this
/// pick and rank 0's listening, or between one start of the ranks and the next after a failure;
/// and a rank connecting to it while rank 0 is not listening yet can be handed it as its own end
/// and connect to itself (TCP's simultaneous open), then wait on a store that is not there. Below
/// the range only a program that binds the port by number takes it. When the range starts too
/// low to leave room, any free port is taken.
pub fn pick_master_port() -> std::io::Result<u16> {
    let below = ephemeral_ports_start().unwrap_or(32_768);
    let draw = std::collections::hash_map::RandomState::new();
    let draw = |n: u64| std::hash::BuildHasher::hash_one(&draw, n);
    pick_port_in(MASTER_PORTS_FROM..below, draw, free_here)
}

/// A port of `range` that `is_free` accepts, drawn at random (`draw(n)` the `n`th draw), or any
/// free port of this machine's when none of [`MASTER_PORT_DRAWS`] draws is, or the range is under
/// a thousand ports.
fn pick_port_in(
    range: std::ops::Range<u16>,
    draw: impl Fn(u64) -> u64,
    is_free: impl Fn(u16) -> bool,
) -> std::io::Result<u16> {
    let span = range.len() as u64;
    if span >= 1000 {
        let mut drawn = (0..MASTER_PORT_DRAWS).map(|n| range.start + (draw(n) % span) as u16);
        if let Some(port) = drawn.find(|&port| is_free(port)) {
            return Ok(port);
        }
    }
    crate::experiment::free_local_port()
}

/// Whether `port` is free on this machine: nothing listens on it on any address.
fn free_here(port: u16) -> bool {
    std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
}

/// The first port of the kernel's ephemeral range, where it can be read.
fn ephemeral_ports_start() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

/// Whether the master port is free on the first machine (where rank 0 listens). `None` when it
/// cannot be told (the check itself failed); the run goes on then.
pub async fn master_port_free(host: Option<&Host>, port: u16) -> Option<bool> {
    match host.and_then(|h| h.tunnel.as_ref()) {
        None => Some(free_here(port)),
        Some(tunnel) => tunnel.port_free(port).await.ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_reached_under_two_names_is_found_by_its_engine_id() {
        let hosts = [
            ("th1", "A"),
            ("th2", "B"),
            ("10.77.0.11", "A"),
            ("old", ""),
            ("older", ""),
        ];
        assert_eq!(one_engine_twice(hosts.into_iter()), [("th1", "10.77.0.11")]);
        assert!(one_engine_twice([("th1", "A"), ("th2", "B")].into_iter()).is_empty());
    }

    #[test]
    fn the_master_port_is_picked_free_below_the_ephemeral_range() {
        let below = ephemeral_ports_start().expect("Linux says where its ephemeral range starts");
        for _ in 0..20 {
            let port = pick_master_port().unwrap();
            assert!(
                (MASTER_PORTS_FROM..below).contains(&port),
                "{port} (ephemeral from {below})"
            );
            std::net::TcpListener::bind(("0.0.0.0", port)).expect("the picked port is free");
        }
    }

    #[test]
    fn a_taken_port_is_drawn_past_and_with_none_free_any_free_port_is_taken() {
        // Draws land on 20000, 27919, 25838, ...: the first free one is taken.
        let draws = |n: u64| n * 7919;
        let picked = |range, is_free: fn(u16) -> bool| pick_port_in(range, draws, is_free).unwrap();
        assert_eq!(picked(20_000..30_000, |_| true), 20_000);
        assert_eq!(picked(20_000..30_000, |port| port != 20_000), 27_919);
        // None free, or too few ports to draw from: the kernel's pick, from its ephemeral range.
        let ephemeral = ephemeral_ports_start().unwrap();
        assert!(picked(20_000..30_000, |_| false) >= ephemeral);
        assert!(picked(20_000..20_500, |_| true) >= ephemeral);
    }
}
