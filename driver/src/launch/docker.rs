//! The docker backend: one container per rank, or one per host with the host's ranks started in it
//! through the exec API. Every container carries the experiment's label, and only containers with
//! that label are ever stopped or removed. Every container runs under the lease guard
//! ([`super::lease`]): it stops itself when this driver stops renewing it.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::models::{
    ContainerCreateBody, DeviceMapping, DeviceRequest, HostConfig, Mount as DockerMount, MountType,
    ResourcesUlimits,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder, LogsOptionsBuilder,
    UploadToContainerOptionsBuilder, WaitContainerOptions,
};
use futures_util::future::{join_all, OptionFuture};
use futures_util::{Stream as FutStream, StreamExt};
use tokio::sync::mpsc::UnboundedSender;

use super::cleanup::{self, Tracked};
use super::labels::{LABEL_EXPERIMENT, LABEL_NAME, LABEL_RANK};
use super::lease::{self, Leased, Renewer};
use super::lines::LineSplitter;
use super::{classify_line, oom, traces, LaunchError};
use crate::events::{Event, LeftContainer, Stream};
use crate::experiment::{Experiment, RankSpec, CONTAINER_TRACE_DIR};
use crate::hosts::HostError;
use crate::hosts::{Host, SshOptions};
use crate::options::ContainerMode;

/// How long copying one container's profiler traces out may take.
const TRACE_COPY_DEADLINE: Duration = Duration::from_secs(300);

/// Containers of one experiment across its hosts.
pub struct DockerLauncher {
    hosts: Vec<Host>,
    id: String,
    ssh: SshOptions,
    /// Every container created, for the record of what could not be removed.
    tracked: Mutex<Vec<Tracked>>,
    /// Containers seen gone.
    removed: Mutex<HashSet<String>>,
    /// The containers whose leases are renewed.
    leased: Leased,
    /// Renews them while it lives; dropped when removal starts.
    renewer: Mutex<Option<Renewer>>,
}

impl DockerLauncher {
    /// Prepares to launch on `hosts` (from preflight, in plan order) under experiment `id`.
    pub fn new(hosts: Vec<Host>, id: String, ssh: SshOptions) -> DockerLauncher {
        DockerLauncher {
            hosts,
            id,
            ssh,
            tracked: Mutex::default(),
            removed: Mutex::default(),
            leased: Leased::default(),
            renewer: Mutex::default(),
        }
    }

    /// Remembers a created container and renews its lease from now on.
    fn track(&self, host: usize, id: &str, name: String, ranks: Vec<usize>) {
        let docker = self.hosts[host].docker.clone();
        self.leased
            .lock()
            .expect("lease list lock")
            .insert(id.to_string(), docker);
        self.tracked.lock().expect("tracked lock").push(Tracked {
            host,
            id: id.to_string(),
            name,
            ranks,
        });
    }

    /// Creates and starts every container and rank; events go to `tx`.
    pub async fn start(&self, plan: &Experiment, tx: UnboundedSender<Event>) -> Result<(), LaunchError> {
        *self.renewer.lock().expect("renewer lock") = Some(Renewer::start(self.leased.clone()));
        // Every host (and every rank's container) is brought up concurrently, so launching on many
        // hosts takes about as long as on one.
        let results = match plan.container_mode {
            ContainerMode::PerRank => {
                join_all(plan.ranks.iter().map(|r| self.start_rank(plan, r, &tx))).await
            }
            ContainerMode::PerHost => {
                join_all(
                    plan.hosts
                        .iter()
                        .enumerate()
                        .map(|(i, _)| self.start_host(plan, i, &tx)),
                )
                .await
            }
        };
        results.into_iter().collect()
    }

    /// One container running one rank.
    async fn start_rank(
        &self,
        plan: &Experiment,
        r: &RankSpec,
        tx: &UnboundedSender<Event>,
    ) -> Result<(), LaunchError> {
        let host = &self.hosts[r.host];
        let labels = self.labels(plan, &r.rank.to_string());
        // Every GPU the experiment has on the host, not only the rank's (its `--device` names its
        // own): NCCL takes ranks on one host (one hostname under host networking) for one node and
        // reaches their GPUs directly (NVLink, CUDA IPC), which fails from a container that cannot
        // see them; and `LOCAL_RANK` then numbers the GPUs as the container sees them.
        let body = container_body(plan, host, labels, &plan.hosts[r.host].gpus, Some(r));
        let name = format!("{}-r{}", self.id, r.rank);
        let id = create(host, name.clone(), body).await?;
        self.track(r.host, &id, name, vec![r.rank]);
        copy_in(host, &id).await?;
        start(host, &id).await?;
        let _ = tx.send(Event::RankStarted {
            rank: r.rank,
            host: host.name.clone(),
            handle: short(&id),
        });
        tokio::spawn(follow_container(host.clone(), id, r.rank, tx.clone()));
        Ok(())
    }

    /// One container per host, its ranks started inside it through the exec API.
    async fn start_host(
        &self,
        plan: &Experiment,
        index: usize,
        tx: &UnboundedSender<Event>,
    ) -> Result<(), LaunchError> {
        let host = &self.hosts[index];
        let host_plan = &plan.hosts[index];
        let ranks: Vec<String> = host_plan.ranks.iter().map(|r| r.to_string()).collect();
        let labels = self.labels(plan, &ranks.join(","));
        let body = container_body(plan, host, labels, &host_plan.gpus, None);
        let name = format!("{}-h{index}", self.id);
        let container = create(host, name.clone(), body).await?;
        self.track(index, &container, name, host_plan.ranks.clone());
        copy_in(host, &container).await?;
        // The file the ranks record their process IDs in, writable by the image's user.
        upload(host, &container, lease::ranks_tar(), "prepare a container").await?;
        start(host, &container).await?;
        for &rank in &host_plan.ranks {
            let r = &plan.ranks[rank];
            let docker_err = |action: &'static str| {
                let host = host.name.clone();
                move |source| LaunchError::from(HostError::Docker { host, action, source })
            };
            let options = CreateExecOptions {
                // Through the rank starter, which records the rank's process ID for the guard.
                cmd: Some(lease::exec_rank(&r.argv)),
                env: Some(env_list(r)),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            };
            let exec = match host.docker.create_exec(&container, options).await {
                Ok(exec) => exec,
                Err(source) => return Err(exec_refused(host, &container, "create an exec", source).await),
            };
            let started = match host.docker.start_exec(&exec.id, None).await {
                Ok(started) => started,
                Err(source) => return Err(exec_refused(host, &container, "start an exec", source).await),
            };
            let StartExecResults::Attached { output, .. } = started else {
                let source = DockerError::DockerStreamError {
                    error: "exec started detached".into(),
                };
                return Err(docker_err("attach to an exec")(source));
            };
            let handle = format!("{} exec {}", short(&container), short(&exec.id));
            let _ = tx.send(Event::RankStarted {
                rank,
                host: host.name.clone(),
                handle,
            });
            tokio::spawn(follow_exec(
                host.clone(),
                container.clone(),
                exec.id,
                output,
                rank,
                tx.clone(),
            ));
        }
        Ok(())
    }

    fn labels(&self, plan: &Experiment, rank: &str) -> HashMap<String, String> {
        labels(&self.id, plan, rank)
    }

    /// Copies the profiler traces each container's ranks wrote in [`CONTAINER_TRACE_DIR`] into
    /// `dir` (each `rank-N.json`), every container concurrently, before they are removed; says
    /// for each rank why it has none.
    pub async fn copy_traces(&self, dir: &std::path::Path) -> traces::Copied {
        let tracked = self.tracked.lock().expect("tracked lock").clone();
        let copies = join_all(tracked.iter().map(|t| async move {
            let host = &self.hosts[t.host];
            let options = DownloadFromContainerOptionsBuilder::new()
                .path(CONTAINER_TRACE_DIR)
                .build();
            let download = async {
                let mut tar = Vec::new();
                let mut stream = std::pin::pin!(host.docker.download_from_container(&t.id, Some(options)));
                while let Some(chunk) = stream.next().await {
                    tar.extend_from_slice(&chunk?);
                }
                Ok::<_, DockerError>(tar)
            };
            let tar = match tokio::time::timeout(TRACE_COPY_DEADLINE, download).await {
                Ok(Ok(tar)) => tar,
                // No trace folder: no rank there got as far as writing its trace.
                Ok(Err(DockerError::DockerResponseServerError {
                    status_code: 404,
                    message,
                })) if !message.contains("No such container") => Vec::new(),
                Ok(Err(e)) => {
                    let reason = format!("cannot copy it out of container {} on {}: {e}", t.name, host.name);
                    return traces::fail_all(&t.ranks, reason);
                }
                Err(_) => {
                    let reason = format!(
                        "copying it out of container {} on {} took over {} s",
                        t.name,
                        host.name,
                        TRACE_COPY_DEADLINE.as_secs()
                    );
                    return traces::fail_all(&t.ranks, reason);
                }
            };
            let (ranks, dir) = (t.ranks.clone(), dir.to_path_buf());
            tokio::task::spawn_blocking(move || traces::unpack(&tar, &ranks, &dir))
                .await
                .unwrap_or_else(|e| traces::fail_all(&t.ranks, format!("unpacking it failed: {e}")))
        }))
        .await;
        copies.into_iter().flatten().collect()
    }

    /// Sends every container SIGTERM (its lease guard passes it on to its rank, or to the ranks
    /// exec'd into a per-host container), so ranks that checkpoint can write one before
    /// [`DockerLauncher::remove_all`]; each call is bounded, and a container that does not take
    /// it is removed like any other afterwards.
    pub async fn terminate_all(&self) {
        self.signal_all("SIGTERM").await
    }

    /// Kills every container (SIGKILL) without removing it: what its ranks wrote inside (their
    /// profiler traces) can still be copied out before [`DockerLauncher::remove_all`].
    pub async fn kill_all(&self) {
        self.signal_all("SIGKILL").await
    }

    /// Sends every container `signal`, each call bounded.
    async fn signal_all(&self, signal: &str) {
        let tracked = self.tracked.lock().expect("tracked lock").clone();
        let options = bollard::query_parameters::KillContainerOptionsBuilder::new()
            .signal(signal)
            .build();
        join_all(tracked.iter().map(|t| {
            let docker = self.hosts[t.host].docker.clone();
            let options = options.clone();
            async move {
                let call = docker.kill_container(&t.id, Some(options));
                let _ = tokio::time::timeout(Duration::from_secs(4), call).await;
            }
        }))
        .await;
    }

    /// Stops renewing every lease, then removes (force, so killed) every container labelled with
    /// this experiment on every host, concurrently, each host tried again on a new connection until
    /// `grace` has passed ([`cleanup::remove_on`]). Fails naming exactly the containers left, where,
    /// and how to remove each by hand.
    pub async fn remove_all(&self, grace: Duration) -> Result<(), LaunchError> {
        drop(self.renewer.lock().expect("renewer lock").take());
        let passes = join_all(
            self.hosts
                .iter()
                .map(|h| cleanup::remove_on(h, &self.ssh, &self.id, grace)),
        )
        .await;
        let mut removed = self.removed.lock().expect("removed lock");
        let tracked = self.tracked.lock().expect("tracked lock");
        let mut left = Vec::new();
        for (index, pass) in passes.into_iter().enumerate() {
            removed.extend(pass.gone);
            let Some((error, known)) = pass.failure else {
                continue;
            };
            let host = &self.hosts[index];
            // Known: what the engine listed and could not remove. Unknown (the engine did not
            // answer): every container created there and not seen gone.
            let containers: Vec<(String, String)> = match known {
                Some(known) => known,
                None => tracked
                    .iter()
                    .filter(|t| t.host == index && !removed.contains(&t.id))
                    .map(|t| (t.id.clone(), t.name.clone()))
                    .collect(),
            };
            for (id, name) in containers {
                let ranks = tracked
                    .iter()
                    .find(|t| t.id == id)
                    .map(|t| t.ranks.clone())
                    .unwrap_or_default();
                let remove_by_hand =
                    cleanup::remove_by_hand(&host.plan.machine, self.ssh.config_file.as_deref(), &name);
                left.push(LeftContainer {
                    host: host.name.clone(),
                    name,
                    id,
                    ranks,
                    error: crate::error::error_chain(&error),
                    remove_by_hand,
                });
            }
        }
        match left.is_empty() {
            true => Ok(()),
            false => Err(LaunchError::ContainersLeft {
                left,
                grace_s: grace.as_secs(),
            }),
        }
    }
}

pub(super) async fn start(host: &Host, id: &str) -> Result<(), LaunchError> {
    host.docker
        .start_container(id, None::<bollard::query_parameters::StartContainerOptions>)
        .await
        .map_err(|source| {
            LaunchError::from(HostError::Docker {
                host: host.name.clone(),
                action: "start a container",
                source,
            })
        })
}

/// Creates a container; [`copy_in`] then gives it the files the host lacks. (Two steps, so a
/// launcher tracks the container before a copy that fails can leave it.)
pub(super) async fn create(
    host: &Host,
    name: String,
    body: ContainerCreateBody,
) -> Result<String, LaunchError> {
    let options = CreateContainerOptionsBuilder::default().name(&name).build();
    let id = host
        .docker
        .create_container(Some(options), body)
        .await
        .map(|r| r.id)
        .map_err(|source| {
            LaunchError::from(HostError::Docker {
                host: host.name.clone(),
                action: "create a container",
                source,
            })
        })?;
    Ok(id)
}

/// Copies into the container `id`, created by [`create`], the files its host lacks, so it is
/// ready to start.
pub(super) async fn copy_in(host: &Host, id: &str) -> Result<(), LaunchError> {
    if !host.copies.is_empty() {
        upload(host, id, pack_files(host)?, "copy code into a container").await?;
    }
    Ok(())
}

/// Unpacks `tar` at the root of container `id`; a failure is `action`'s, on this host.
async fn upload(host: &Host, id: &str, tar: Vec<u8>, action: &'static str) -> Result<(), LaunchError> {
    let options = UploadToContainerOptionsBuilder::default().path("/").build();
    host.docker
        .upload_to_container(id, Some(options), bollard::body_full(tar.into()))
        .await
        .map_err(|source| {
            LaunchError::from(HostError::Docker {
                host: host.name.clone(),
                action,
                source,
            })
        })
}

/// A tar of the files a host lacks, each at its absolute path, modes kept (binaries stay executable).
fn pack_files(host: &Host) -> Result<Vec<u8>, LaunchError> {
    pack_paths(&host.copies).map_err(|(path, source)| LaunchError::Pack {
        host: host.name.clone(),
        path,
        source,
    })
}

/// Tars `paths` at their absolute paths; an error names the path that failed (`/` for the end).
fn pack_paths(paths: &[PathBuf]) -> Result<Vec<u8>, (PathBuf, std::io::Error)> {
    let mut builder = tar::Builder::new(Vec::new());
    // tar writes a file with holes (a linked binary can have some) as a GNU sparse entry (type 83)
    // by default, and Docker's extractor refuses those ("unhandled tar header type 83").
    builder.sparse(false);
    for path in paths {
        let fail = |source| (path.clone(), source);
        let mut file = std::fs::File::open(path).map_err(fail)?;
        let inside = path.strip_prefix("/").unwrap_or(path);
        builder.append_file(inside, &mut file).map_err(fail)?;
    }
    builder.into_inner().map_err(|source| ("/".into(), source))
}

fn env_list(rank: &RankSpec) -> Vec<String> {
    rank.env.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// The container for one rank (`rank` given) or for a host's ranks (an idle init process the
/// ranks are exec'd into).
pub(super) fn container_body(
    plan: &Experiment,
    host: &Host,
    labels: HashMap<String, String>,
    gpus: &[u32],
    rank: Option<&RankSpec>,
) -> ContainerCreateBody {
    let mounts = host
        .mounts
        .iter()
        .filter(|m| !m.create)
        .map(|m| DockerMount {
            source: Some(m.source.display().to_string()),
            target: Some(m.target.display().to_string()),
            typ: Some(MountType::BIND),
            read_only: Some(m.read_only),
            ..Default::default()
        })
        .collect();
    // A folder the engine makes where it is missing: the `-v` form does, on every engine (the
    // mount form's CreateMountpoint needs API 1.42). Its paths hold no `:` (checked at resolve).
    let binds: Vec<String> = host
        .mounts
        .iter()
        .filter(|m| m.create)
        .map(|m| {
            format!(
                "{}:{}:{}",
                m.source.display(),
                m.target.display(),
                if m.read_only { "ro" } else { "rw" }
            )
        })
        .collect();
    let device_requests = (!gpus.is_empty()).then(|| {
        vec![DeviceRequest {
            driver: Some("nvidia".into()),
            device_ids: Some(gpus.iter().map(|g| g.to_string()).collect()),
            capabilities: Some(vec![vec!["gpu".into()]]),
            ..Default::default()
        }]
    });
    let (cmd, env) = match rank {
        Some(r) => (r.argv.clone(), env_list(r)),
        None => (Vec::new(), Vec::new()),
    };
    let rdma = rdma(plan, host);
    ContainerCreateBody {
        image: Some(host.image.clone()),
        // The guard runs the argument vector as its positional parameters (no argument vector: it
        // is a per-host container's idle process), and replaces the image's own entrypoint.
        entrypoint: Some(lease::guarded(&[])),
        cmd: Some(cmd),
        env: Some(env),
        labels: Some(labels),
        host_config: Some(HostConfig {
            network_mode: Some("host".into()),
            ipc_mode: Some("host".into()),
            shm_size: Some(plan.shm_size_bytes as i64),
            mounts: Some(mounts),
            binds: (!binds.is_empty()).then_some(binds),
            device_requests,
            init: Some(true),
            devices: rdma.devices,
            cap_add: rdma.cap_add,
            ulimits: rdma.ulimits,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What a container needs for NCCL's InfiniBand/RoCE transport, as NVIDIA's containers are run
/// for it (`--device=/dev/infiniband --cap-add=IPC_LOCK --ulimit memlock=-1`): the host's verbs
/// device files, the capability to lock memory, and no limit on locked memory (the transport
/// registers, and so pins, its buffers). Nothing where the host has no `/dev/infiniband` or the
/// experiment says `rdma: off`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Rdma {
    devices: Option<Vec<DeviceMapping>>,
    cap_add: Option<Vec<String>>,
    ulimits: Option<Vec<ResourcesUlimits>>,
}

pub(super) fn rdma(plan: &Experiment, host: &Host) -> Rdma {
    rdma_for(plan.rdma, host.infiniband, &crate::hosts::infiniband_dir())
}

/// [`rdma`] for the experiment's `setting`, on a host that has (`infiniband`) its verbs device
/// files in `dir`.
fn rdma_for(setting: crate::config::Rdma, infiniband: bool, dir: &std::path::Path) -> Rdma {
    if setting == crate::config::Rdma::Off || !infiniband {
        return Rdma::default();
    }
    Rdma {
        // A folder: the engine gives every device file under it.
        devices: Some(vec![DeviceMapping {
            path_on_host: Some(dir.display().to_string()),
            path_in_container: Some(crate::hosts::INFINIBAND.to_string()),
            cgroup_permissions: Some("rwm".into()),
        }]),
        cap_add: Some(vec!["IPC_LOCK".into()]),
        ulimits: Some(vec![ResourcesUlimits {
            name: Some("memlock".into()),
            soft: Some(-1),
            hard: Some(-1),
        }]),
    }
}

/// Streams a container's output into events, then reports its exit.
async fn follow_container(host: Host, id: String, rank: usize, tx: UnboundedSender<Event>) {
    let options = LogsOptionsBuilder::default()
        .follow(true)
        .stdout(true)
        .stderr(true)
        .build();
    let logs = host.docker.logs(&id, Some(options));
    let lost = forward(logs, rank, &tx).await;
    let mut wait = host.docker.wait_container(&id, None::<WaitContainerOptions>);
    let event = match wait.next().await {
        Some(Ok(r)) => container_exited(&host, &id, rank, r.status_code).await,
        Some(Err(DockerError::DockerContainerWaitError { code, .. })) => {
            container_exited(&host, &id, rank, code).await
        }
        // Removed (by the driver while stopping) before its exit was seen.
        Some(Err(DockerError::DockerResponseServerError { status_code: 404, .. })) => {
            Event::RankRemoved { rank }
        }
        Some(Err(e)) => lost_rank(&host, rank, lost.unwrap_or_else(|| e.to_string()), &tx).await,
        None => match lost {
            Some(reason) => lost_rank(&host, rank, reason, &tx).await,
            None => Event::RankRemoved { rank },
        },
    };
    let _ = tx.send(event);
}

/// Reports `host` lost, after `error` from its engine, and returns the event for its `rank`,
/// whose exit was not seen.
async fn lost_rank(host: &Host, rank: usize, error: String, tx: &UnboundedSender<Event>) -> Event {
    let reason = match &host.tunnel {
        Some(tunnel) => lost_remote(&host.plan.machine.host, tunnel.answers().await, &error),
        None => format!("this machine's Docker engine stopped answering: {error}"),
    };
    let _ = tx.send(Event::HostLost {
        host: host.name.clone(),
        reason: reason.clone(),
    });
    Event::RankLost {
        rank,
        host: host.name.clone(),
        reason,
    }
}

/// Why a remote host reached as `ssh_host` is lost, after `error` from its engine: its engine
/// stopped answering (when the host still `answers` over SSH), or the host did.
fn lost_remote(ssh_host: &str, answers: bool, error: &str) -> String {
    match answers {
        true => format!(
            "its Docker engine stopped answering, though `ssh {ssh_host}` still works (is the engine \
             running there? `ssh {ssh_host} docker info` says): {error}"
        ),
        false => format!("it stopped answering over SSH: {error}"),
    }
}

/// A rank's container exited with `code`; a failure says whether it ran out of memory.
async fn container_exited(host: &Host, id: &str, rank: usize, code: i64) -> Event {
    Event::RankExited {
        rank,
        exit_code: Some(code),
        out_of_memory: code != 0 && out_of_memory(host, id).await,
    }
}

/// Whether the engine says the kernel killed a process of container `id` for lack of memory
/// (its limit's or the host's): Docker's `OOMKilled`, which stays set until the container
/// restarts. `false` when the engine cannot say.
async fn out_of_memory(host: &Host, id: &str) -> bool {
    state_of(host, id)
        .await
        .and_then(|s| s.oom_killed)
        .unwrap_or(false)
}

/// Container `id`'s state, as the engine says within 10 seconds; `None` when it does not.
async fn state_of(host: &Host, id: &str) -> Option<bollard::models::ContainerState> {
    let inspected = host
        .docker
        .inspect_container(id, None::<bollard::query_parameters::InspectContainerOptions>);
    match tokio::time::timeout(Duration::from_secs(10), inspected).await {
        Ok(Ok(container)) => container.state,
        _ => None,
    }
}

/// Why the engine refused an exec into `container`: how the container ended, when its own
/// process (the guard) has, else the engine's error.
async fn exec_refused(
    host: &Host,
    container: &str,
    action: &'static str,
    source: DockerError,
) -> LaunchError {
    match container_state(host, container).await {
        ContainerState::Exited(error) => error,
        ContainerState::Running | ContainerState::Unknown => LaunchError::from(HostError::Docker {
            host: host.name.clone(),
            action,
            source,
        }),
    }
}

/// What the engine says of a container: still running, ended (how, as the error of the ranks
/// that were to run in it), or nothing it can say (it is gone, or the engine does not answer).
enum ContainerState {
    Running,
    Exited(LaunchError),
    Unknown,
}

/// The state of container `id`, with its exit code and last log line once it has ended.
async fn container_state(host: &Host, id: &str) -> ContainerState {
    let Some(state) = state_of(host, id).await else {
        return ContainerState::Unknown;
    };
    if state.running != Some(false) {
        return ContainerState::Running;
    }
    let options = LogsOptionsBuilder::default()
        .stdout(true)
        .stderr(true)
        .tail("5")
        .build();
    let mut logs = host.docker.logs(id, Some(options));
    let mut text = String::new();
    let read = async {
        while let Some(Ok(item)) = logs.next().await {
            text.push_str(&String::from_utf8_lossy(&item.into_bytes()));
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(10), read).await;
    ContainerState::Exited(LaunchError::ContainerExited {
        host: host.name.clone(),
        code: state.exit_code.unwrap_or(-1),
        last: last_line(&text).to_string(),
    })
}

/// Processes the kernel has killed for lack of memory in running container `id` since it
/// started (its memory cgroup is its own), read inside it by the image's `/bin/sh`; `None` when
/// that cannot be read.
///
/// Asked right after a rank's death, the container may still be at its memory limit: the kernel
/// frees a killed process's memory after the kill, and until then the reading exec can be
/// refused or killed itself (runc's exec needs memory of its own in the container's cgroup), and
/// on a loaded host that can last seconds. So a reading that fails is tried again a quarter of a
/// second later while the container runs, until one succeeds or 15 seconds have passed. A
/// container that has stopped or is gone (the driver stopping the run kills its ranks too) has
/// nothing more to say: no retry.
async fn oom_kills_inside(host: &Host, id: &str) -> Option<u64> {
    let retried = async {
        loop {
            if let Some(kills) = read_oom_kills_inside(host, id).await {
                return Some(kills);
            }
            if !running(host, id).await {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(15), retried)
        .await
        .ok()
        .flatten()
}

/// Whether container `id` is running, as the engine says within 10 seconds.
async fn running(host: &Host, id: &str) -> bool {
    state_of(host, id).await.and_then(|s| s.running).unwrap_or(false)
}

/// One reading of [`oom_kills_inside`].
async fn read_oom_kills_inside(host: &Host, id: &str) -> Option<u64> {
    let options = CreateExecOptions {
        cmd: Some(["/bin/sh", "-c", oom::COUNT_SCRIPT].map(String::from).to_vec()),
        attach_stdout: Some(true),
        ..Default::default()
    };
    let read = async {
        let exec = host.docker.create_exec(id, options).await.ok()?;
        let StartExecResults::Attached { mut output, .. } =
            host.docker.start_exec(&exec.id, None).await.ok()?
        else {
            return None;
        };
        let mut text = String::new();
        while let Some(Ok(item)) = output.next().await {
            if let LogOutput::StdOut { message } = item {
                text.push_str(&String::from_utf8_lossy(&message));
            }
        }
        text.trim().parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(10), read).await.ok()?
}

/// Streams an exec's output into events, then reports its exit code.
async fn follow_exec(
    host: Host,
    container: String,
    exec: String,
    output: impl FutStream<Item = Result<LogOutput, DockerError>> + Unpin,
    rank: usize,
    tx: UnboundedSender<Event>,
) {
    let lost = forward(output, rank, &tx).await;
    // The exec may still be winding down for a moment after its output closes.
    let mut event = Event::RankExited {
        rank,
        exit_code: None,
        out_of_memory: false,
    };
    for _ in 0..20 {
        match host.docker.inspect_exec(&exec).await {
            Ok(i) if i.running == Some(true) => tokio::time::sleep(Duration::from_millis(50)).await,
            Ok(i) => {
                let failed = i.exit_code.is_some_and(|c| c != 0);
                // Docker sets OOMKilled only once the container exits, and this one may run on;
                // a rank SIGKILLed where its container's cgroup counts an OOM kill died of one.
                let out_of_memory = failed
                    && (out_of_memory(&host, &container).await
                        || (i.exit_code == Some(oom::SIGKILLED)
                            && oom_kills_inside(&host, &container).await.is_some_and(|n| n > 0)));
                event = Event::RankExited {
                    rank,
                    exit_code: i.exit_code,
                    out_of_memory,
                };
                break;
            }
            // The container was removed (by the driver while stopping) before the exit was seen.
            Err(DockerError::DockerResponseServerError { status_code: 404, .. }) => {
                event = Event::RankRemoved { rank };
                break;
            }
            Err(e) => {
                event = lost_rank(&host, rank, lost.unwrap_or_else(|| e.to_string()), &tx).await;
                break;
            }
        }
    }
    // A rank that could not run (126, 127, or no code) in a container whose guard could not run
    // either (no /bin/sh): that is the reason, whichever way the engine reported the exec
    // (refused inside, or gone: the engine drops a container's execs when it stops, so an exec
    // not found is not only one the driver removed). The container may take a moment to be seen
    // stopped; one that is gone was removed, and says nothing more.
    if matches!(
        event,
        Event::RankExited {
            exit_code: None | Some(126 | 127),
            ..
        } | Event::RankRemoved { .. }
    ) {
        for _ in 0..10 {
            match container_state(&host, &container).await {
                ContainerState::Exited(ended @ LaunchError::ContainerExited { code: 126 | 127, .. }) => {
                    let _ = tx.send(Event::LineLogged {
                        rank,
                        stream: Stream::Stderr,
                        line: format!("driver: {ended}"),
                    });
                    break;
                }
                ContainerState::Exited(_) | ContainerState::Unknown => break,
                ContainerState::Running => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    let _ = tx.send(event);
}

/// Forwards a Docker output stream line by line; returns the error that ended it, if any.
async fn forward(
    mut stream: impl FutStream<Item = Result<LogOutput, DockerError>> + Unpin,
    rank: usize,
    tx: &UnboundedSender<Event>,
) -> Option<String> {
    let mut out = LineSplitter::default();
    let mut err = LineSplitter::default();
    let mut failure = None;
    while let Some(item) = stream.next().await {
        match item {
            Ok(LogOutput::StdOut { message }) | Ok(LogOutput::Console { message }) => {
                for line in out.push(&message) {
                    let _ = tx.send(classify_line(rank, Stream::Stdout, line));
                }
            }
            Ok(LogOutput::StdErr { message }) => {
                for line in err.push(&message) {
                    let _ = tx.send(classify_line(rank, Stream::Stderr, line));
                }
            }
            Ok(LogOutput::StdIn { .. }) => {}
            Err(e) => {
                failure = Some(e.to_string());
                break;
            }
        }
    }
    for (splitter, kind) in [(&mut out, Stream::Stdout), (&mut err, Stream::Stderr)] {
        if let Some(line) = splitter.finish() {
            let _ = tx.send(classify_line(rank, kind, line));
        }
    }
    failure
}

/// The labels of a container of experiment `id`: cleanup selects on the experiment label only.
pub(super) fn labels(id: &str, plan: &Experiment, rank: &str) -> HashMap<String, String> {
    HashMap::from([
        (LABEL_EXPERIMENT.to_string(), id.to_string()),
        (LABEL_NAME.to_string(), plan.name.clone()),
        (LABEL_RANK.to_string(), rank.to_string()),
    ])
}

/// Whether a host's ranks train on CUDA: it was given GPUs, or the rank's `--device` or
/// `--devices` (a stage over several GPUs) names one.
fn wants_cuda(argv: &[String], gpus: &[u32]) -> bool {
    let named = argv.windows(2).any(|w| {
        matches!(w[0].as_str(), "--device" | "--devices") && w[1].split(',').any(|d| d.starts_with("cuda"))
    });
    named || !gpus.is_empty()
}

/// What the runtime says of itself in a host's image (`runtime info`), as preflight sees it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct RuntimeInfo {
    pub cuda_devices: usize,
    #[serde(default)]
    pub cuda_error: Option<String>,
    #[serde(default)]
    pub cuda_devices_error: Option<String>,
    /// Absent from runtimes before it was reported.
    #[serde(default)]
    pub rdma: Option<RdmaInfo>,
}

/// What NCCL's InfiniBand transport finds in the container (`runtime info`'s `rdma`).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct RdmaInfo {
    pub device_files: bool,
    pub ibverbs: bool,
    #[serde(default)]
    pub ibverbs_error: Option<String>,
}

/// Why NCCL in the containers of a host given its InfiniBand devices would still talk TCP, as
/// the image's runtime saw it; `None` when nothing stands in the way.
pub fn rdma_unusable(host: &str, info: &RdmaInfo) -> Option<String> {
    if !info.device_files {
        return Some(format!(
            "{host} has {} but its containers do not see it (the engine did not pass the devices on)",
            crate::hosts::INFINIBAND
        ));
    }
    (!info.ibverbs).then(|| {
        format!(
            "{host} has InfiniBand/RoCE devices but its image cannot load libibverbs ({}); add \
             libibverbs1 and ibverbs-providers to the image (the runtime image has them)",
            info.ibverbs_error.as_deref().unwrap_or("not found")
        )
    })
}

/// Preflight's proof that the ranks start where they will run, all hosts at once; says, per host,
/// whether its containers get its InfiniBand devices ([`rdma`]). With the
/// runtime (`runs_runtime`): `runtime info` in a container of each host's image, with the mounts,
/// copied files and GPUs its ranks get; a runtime that cannot start (a missing library) or a host
/// that shows fewer CUDA devices than its ranks asked for is refused here. With a `command:` of
/// the user's, a host whose ranks get GPUs starts a container of the image with them. Either way
/// an engine that cannot give the GPUs is refused naming the host, before any rank starts. Where
/// rank 0 runs, the training request itself is checked by the image's runtime too, in a second
/// container started alongside the first. The containers carry `id` as their experiment label
/// and are removed afterwards; one left is a warning naming how to remove it (over `ssh`).
pub async fn self_check(
    hosts: &[Host],
    ssh: &SshOptions,
    plan: &Experiment,
    id: &str,
    runs_runtime: bool,
) -> Result<Vec<bool>, LaunchError> {
    let checks = plan.hosts.iter().zip(hosts).map(|(hp, host)| async move {
        let given_rdma = rdma(plan, host) != Rdma::default();
        let Some(&first) = hp.ranks.first() else {
            return Ok(false);
        };
        // A host with InfiniBand devices to give is checked whatever runs: an engine may refuse
        // the locked-memory limit that comes with them.
        if !runs_runtime && hp.gpus.is_empty() && !given_rdma {
            return Ok(false);
        }
        let rank = &plan.ranks[first];
        let mut check = rank.clone();
        check.argv = match runs_runtime {
            true => vec![rank.argv[0].clone(), "info".into()],
            // The guard already needs a shell in the image.
            false => ["/bin/sh", "-c", "exit 0"].map(String::from).to_vec(),
        };
        check.gpus = hp.gpus.clone();
        let without_rdma = Host {
            infiniband: false,
            ..host.clone()
        };
        let body_on =
            |host: &Host| container_body(plan, host, labels(id, plan, "check"), &check.gpus, Some(&check));
        let name = format!(
            "{id}-{}",
            hp.name.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
        );
        // The training request itself, as the runtime validates it before connecting (model,
        // stage config, schedule, replicas, microbatches): once, where rank 0 runs. With
        // `config_file: auto` the request is not final until planned (the profile checks it).
        let request = (runs_runtime && first == 0 && plan.auto.is_none()).then(|| {
            let mut request = rank.clone();
            request.argv.push("--check".into());
            container_body(
                plan,
                &without_rdma,
                labels(id, plan, "check"),
                &[],
                Some(&request),
            )
        });
        let asked = OptionFuture::from(request.map(|body| run_to_end(host, format!("{id}-request"), body)));
        let (started, asked) = futures_util::join!(run_to_end(host, name.clone(), body_on(host)), asked);
        // An engine that cannot raise the locked-memory limit (its own is lower) cannot start
        // containers with InfiniBand as NCCL needs it: the ranks go without, over TCP.
        let (started, rdma_given) = match started {
            Err(e) if given_rdma && locked_memory_refused(&e) => {
                stderr_line!(
                    "warning: the engine on {} cannot give its containers unlimited locked memory, which \
                     NCCL's InfiniBand transport needs ({}); they get no InfiniBand devices and NCCL \
                     will talk TCP between hosts: raise dockerd's limit there (systemd: \
                     LimitMEMLOCK=infinity) to use them, or set `rdma: off`",
                    host.name,
                    last_line(&crate::error::error_line(&e))
                );
                let body = body_on(&without_rdma);
                (run_to_end(host, format!("{name}-tcp"), body).await, false)
            }
            other => (other, given_rdma),
        };
        remove_preflight(host, ssh, id).await;
        let info = runs_where_asked(host, hp, rank, runs_runtime, started).await?;
        // The ranks still start without InfiniBand: NCCL then talks TCP, which is slower between
        // hosts, so say why.
        if let Some(why) = info
            .and_then(|i| i.rdma)
            .filter(|_| rdma_given)
            .and_then(|r| rdma_unusable(&host.name, &r))
        {
            stderr_line!("warning: {why}; NCCL will talk TCP between hosts (`rdma: off` says so up front)");
        }
        match asked {
            Some(outcome) => request_accepted(outcome?).map(|()| rdma_given),
            None => Ok(rdma_given),
        }
    });
    join_all(checks).await.into_iter().collect()
}

/// Whether starting a container failed on the locked-memory limit asked for it (runc: "error
/// setting rlimit type 8": RLIMIT_MEMLOCK above what the engine itself may have).
fn locked_memory_refused(error: &LaunchError) -> bool {
    let text = crate::error::error_line(error);
    text.contains("rlimit type 8") || (text.contains("rlimit") && text.contains("memlock"))
}

/// Whether the check container on `host` (for its first rank, `rank`) proved the ranks start
/// there with what they asked for.
async fn runs_where_asked(
    host: &Host,
    hp: &crate::experiment::HostSpec,
    rank: &RankSpec,
    runs_runtime: bool,
    outcome: Result<(i64, String, String), LaunchError>,
) -> Result<Option<RuntimeInfo>, LaunchError> {
    // With GPUs asked for, the engine refusing the container is the NVIDIA runtime refusing
    // an index this host lacks (or the toolkit missing): say so, naming host and GPUs.
    let (code, stdout, stderr) = match outcome {
        Err(LaunchError::Host(HostError::Docker { source, .. })) if !hp.gpus.is_empty() => {
            return Err(LaunchError::GpusUnavailable {
                host: host.name.clone(),
                gpus: hp.gpus.clone(),
                message: format!("{source}{}", gpu_support_hint(&host.docker).await),
            })
        }
        other => other?,
    };
    let failed = |reason: String| LaunchError::SelfCheck {
        host: host.name.clone(),
        reason,
    };
    if !runs_runtime {
        return match code {
            0 => Ok(None),
            _ => Err(failed(format!(
                "a container of the image given GPUs {:?} exited with {code}: {}",
                hp.gpus,
                last_line(&stderr)
            ))),
        };
    }
    if code != 0 {
        let last = last_line(&stderr);
        return Err(failed(format!(
            "`{} info` exited with {code}: {last}",
            rank.argv[0]
        )));
    }
    let info: RuntimeInfo = serde_json::from_str(stdout.trim())
        .map_err(|e| failed(format!("`runtime info` printed {:?}: {e}", stdout.trim())))?;
    if wants_cuda(&rank.argv, &hp.gpus) && info.cuda_devices < hp.gpus.len().max(1) {
        let why = info
            .cuda_error
            .or(info.cuda_devices_error)
            .unwrap_or_else(|| "no reason given".into());
        return Err(LaunchError::GpusMissing {
            host: host.name.clone(),
            gpus: hp.gpus.clone(),
            seen: info.cuda_devices,
            why,
        });
    }
    Ok(Some(info))
}

/// The image's runtime's verdict on the training request (`runtime --check`).
fn request_accepted((code, _, stderr): (i64, String, String)) -> Result<(), LaunchError> {
    match code {
        0 => Ok(()),
        _ => Err(LaunchError::RequestRefused {
            reason: runtime_error(&stderr).to_string(),
        }),
    }
}

/// What the engine's own description says of its GPU support, when it says none: no `nvidia`
/// runtime and no CDI spec folders. Not a refusal by itself: an engine (before Docker 25) with the
/// NVIDIA hook on its PATH gives containers GPUs without either, so only the container that could
/// not start decides.
async fn gpu_support_hint(docker: &bollard::Docker) -> &'static str {
    let Ok(Ok(info)) = tokio::time::timeout(Duration::from_secs(10), docker.info()).await else {
        return "";
    };
    let runtime = info.runtimes.as_ref().is_some_and(|r| r.contains_key("nvidia"));
    let cdi = info.cdi_spec_dirs.as_ref().is_some_and(|d| !d.is_empty());
    match runtime || cdi {
        true => "",
        false => " (the engine lists no nvidia runtime and no CDI spec folders: the NVIDIA container toolkit looks missing there)",
    }
}

/// Removes every container labelled with experiment `id` on every host, all at once (preflight's,
/// as [`remove_preflight`], so for [`cleanup::PREFLIGHT_REMOVAL_GRACE`] at most: after the reach
/// check, or an interrupted [`self_check`]).
pub async fn remove_everywhere(hosts: &[Host], ssh: &SshOptions, id: &str) {
    join_all(hosts.iter().map(|h| remove_preflight(h, ssh, id))).await;
}

/// The last line of a program's output that is not blank (its error, as a rule).
pub(super) fn last_line(text: &str) -> &str {
    text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("")
}

/// Why the runtime refused, from its stderr: its last line less the `runtime: error: ` prefix.
pub fn runtime_error(stderr: &str) -> &str {
    last_line(stderr).trim_start_matches("runtime: error: ")
}

/// Creates, starts and waits for a container, renewing its lease all along; returns its exit code,
/// stdout and stderr.
pub(super) async fn run_to_end(
    host: &Host,
    name: String,
    body: ContainerCreateBody,
) -> Result<(i64, String, String), LaunchError> {
    let id = create(host, name, body).await?;
    // Its lease is renewed until it has ended, as a rank's is: a check can take longer than the
    // lease (a GPU host's first CUDA start without persistence mode, an image's slow start), and
    // one stopped by its guard would be blamed on the lease with the driver still there.
    let _renewer = Renewer::one(&host.docker, &id);
    copy_in(host, &id).await?;
    start(host, &id).await?;
    let mut wait = host.docker.wait_container(&id, None::<WaitContainerOptions>);
    let code = match wait.next().await {
        Some(Ok(r)) => r.status_code,
        Some(Err(DockerError::DockerContainerWaitError { code, .. })) => code,
        Some(Err(source)) => {
            return Err(LaunchError::from(HostError::Docker {
                host: host.name.clone(),
                action: "wait for the runtime's self-check",
                source,
            }))
        }
        None => -1,
    };
    let options = LogsOptionsBuilder::default().stdout(true).stderr(true).build();
    let mut logs = host.docker.logs(&id, Some(options));
    let (mut stdout, mut stderr) = (String::new(), String::new());
    while let Some(item) = logs.next().await {
        match item {
            Ok(LogOutput::StdOut { message }) => stdout.push_str(&String::from_utf8_lossy(&message)),
            Ok(LogOutput::StdErr { message }) => stderr.push_str(&String::from_utf8_lossy(&message)),
            Ok(_) => {}
            Err(source) => {
                return Err(LaunchError::from(HostError::Docker {
                    host: host.name.clone(),
                    action: "read the runtime's self-check",
                    source,
                }))
            }
        }
    }
    Ok((code, stdout, stderr))
}

/// Removes every container on `host` labelled with preflight's experiment `id`, tried again on a
/// new connection (over `ssh`) for [`cleanup::PREFLIGHT_REMOVAL_GRACE`] at most
/// ([`cleanup::remove_on`]); each one left is a warning on stderr, naming it and how to remove it
/// by hand ([`cleanup::preflight_left`]), and preflight goes on.
async fn remove_preflight(host: &Host, ssh: &SshOptions, id: &str) {
    for line in preflight_left_on(host, ssh, id, cleanup::PREFLIGHT_REMOVAL_GRACE).await {
        stderr_line!("{line}");
    }
}

/// [`remove_preflight`]'s removal, for `grace`: the warnings it has for what is left.
async fn preflight_left_on(host: &Host, ssh: &SshOptions, id: &str, grace: Duration) -> Vec<String> {
    let pass = cleanup::remove_on(host, ssh, id, grace).await;
    let Some((error, known)) = pass.failure else {
        return Vec::new();
    };
    let why = crate::error::error_line(&error);
    let config = ssh.config_file.as_deref();
    cleanup::preflight_left(&host.name, &host.plan.machine, config, id, &why, known.as_ref())
}

fn short(id: &str) -> String {
    id.chars().take(12).collect()
}

#[cfg(test)]
mod tests {
    use super::super::test_engine::{host_on, local_host, one_file_image, shell_image, Leftovers};
    use super::*;

    #[test]
    fn a_file_with_holes_is_packed_as_a_plain_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("holes");
        {
            use std::io::{Seek, SeekFrom, Write};
            let mut file = std::fs::File::create(&path).unwrap();
            file.write_all(b"head").unwrap();
            file.seek(SeekFrom::Start(1 << 20)).unwrap();
            file.write_all(b"tail").unwrap();
        }
        let tar = pack_paths(std::slice::from_ref(&path)).unwrap();
        let mut archive = tar::Archive::new(tar.as_slice());
        let mut entries = archive.entries().unwrap();
        let mut entry = entries.next().unwrap().unwrap();
        assert_eq!(entry.header().entry_type(), tar::EntryType::Regular);
        assert_eq!(entry.path().unwrap(), path.strip_prefix("/").unwrap());
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
        assert_eq!(data.len(), (1 << 20) + 4);
        assert!(data.starts_with(b"head") && data.ends_with(b"tail"));
        assert!(entries.next().is_none());
    }

    #[test]
    fn a_rank_on_several_gpus_is_checked_for_cuda_too() {
        let argv = |args: &str| -> Vec<String> { args.split_whitespace().map(String::from).collect() };
        assert!(wants_cuda(&argv("runtime --device cuda:0"), &[]));
        assert!(wants_cuda(&argv("runtime --devices cuda:0,cuda:1"), &[]));
        assert!(wants_cuda(&argv("runtime --devices cpu,cuda:1"), &[]));
        assert!(
            wants_cuda(&argv("train.py"), &[3]),
            "given GPUs, a user command wants them"
        );
        assert!(!wants_cuda(
            &argv("runtime --device cpu --devices-note cuda"),
            &[]
        ));
        assert!(!wants_cuda(&argv("runtime --devices cpu,cpu"), &[]));
    }

    /// Preflight's containers on an engine that does not answer (a socket that takes requests and
    /// never replies, as a hung engine or SSH tunnel) hold the driver up for
    /// [`cleanup::PREFLIGHT_REMOVAL_GRACE`], not for ever; what may be left is then a warning
    /// naming the host, the label and the time that ran out.
    #[tokio::test]
    async fn preflight_removal_on_an_engine_that_does_not_answer_ends_in_time() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("silent.sock");
        // Connections wait in its backlog: never accepted, never answered.
        let _silent = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let docker =
            bollard::Docker::connect_with_unix(socket.to_str().unwrap(), 120, bollard::API_DEFAULT_VERSION)
                .unwrap();
        let host = host_on(docker);
        let grace = cleanup::PREFLIGHT_REMOVAL_GRACE;
        let started = std::time::Instant::now();
        let left = preflight_left_on(&host, &SshOptions::default(), "e-check-7", grace).await;
        let took = started.elapsed();
        // The grace, and a busy machine's slack: no second wait of its own.
        assert!(took >= grace && took < grace + Duration::from_secs(3), "{took:?}");
        assert_eq!(
            left,
            vec![
                "warning: preflight's containers on localhost (label stagehand.experiment=e-check-7) may \
                 not have been removed, and which are left is not known: removing the experiment's \
                 containers on localhost took longer than 10 s; each stops itself once its lease has not \
                 been renewed for 30 s, but stays listed (`docker ps -a`) until removed"
            ]
        );
    }

    /// A container that runs to its end while the driver waits ([`run_to_end`]: preflight's
    /// checks) keeps its lease however long it runs. Against the real engine: a guard with a lease
    /// of 10 s runs a program of 15 s to its end, where without renewals it would stop the
    /// program at 10 s and exit 86.
    #[tokio::test]
    async fn a_check_that_outlasts_its_lease_runs_to_its_end() {
        let host = local_host().await;
        let pid = std::process::id();
        let mut left = Leftovers {
            image: format!("stagehand-unit-shell:{pid}"),
            containers: Vec::new(),
        };
        shell_image(&host.docker, &left).await;
        let name = format!("stagehand-unit-long-check-{pid}");
        left.containers.push(name.clone());
        let program = ["/bin/sleep", "15"].map(String::from);
        let body = ContainerCreateBody {
            image: Some(left.image.clone()),
            entrypoint: Some(lease::guarded_for(Duration::from_secs(10), &program)),
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let (code, _, stderr) = run_to_end(&host, name, body).await.unwrap();
        assert_eq!(code, 0, "{stderr}");
        assert!(
            started.elapsed() >= Duration::from_secs(15),
            "{:?}",
            started.elapsed()
        );
    }

    /// What [`follow_exec`] reports of exec `exec` in `container`, which has no output.
    async fn followed(host: &Host, container: &str, exec: &str) -> Vec<Event> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let output = futures_util::stream::empty::<Result<LogOutput, DockerError>>();
        follow_exec(host.clone(), container.into(), exec.into(), output, 1, tx).await;
        let mut events = Vec::new();
        while let Ok(event) = rx.try_recv() {
            events.push(event);
        }
        events
    }

    /// The engine drops a container's execs when the container stops, so a rank whose exec is
    /// gone was not necessarily removed by the driver: in a container that could not run (an
    /// image without `/bin/sh`) the rank's log says so before its end is reported, whichever
    /// rank the engine tells first. A container that is gone says nothing more. Against the
    /// real engine, with an image of one file.
    #[tokio::test]
    async fn a_rank_whose_exec_went_with_a_container_that_could_not_run_says_why() {
        let host = local_host().await;
        let mut left = Leftovers {
            image: format!("stagehand-unit-no-shell:{}", std::process::id()),
            containers: Vec::new(),
        };
        one_file_image(&host.docker, &left).await;
        let body = ContainerCreateBody {
            image: Some(left.image.clone()),
            cmd: Some(vec!["/bin/sh".into()]),
            ..Default::default()
        };
        let container = host
            .docker
            .create_container(None::<bollard::query_parameters::CreateContainerOptions>, body)
            .await
            .unwrap()
            .id;
        left.containers.push(container.clone());
        let refused = host
            .docker
            .start_container(
                &container,
                None::<bollard::query_parameters::StartContainerOptions>,
            )
            .await;
        assert!(refused.is_err(), "an image without /bin/sh cannot start it");

        let events = followed(&host, &container, "an-exec-the-engine-dropped").await;
        let [Event::LineLogged {
            rank: 1,
            stream: Stream::Stderr,
            line,
        }, Event::RankRemoved { rank: 1 }] = events.as_slice()
        else {
            panic!("{events:?}");
        };
        assert!(
            line.starts_with(
                "driver: the container for the ranks on localhost exited with code 127 before they \
                 could start: a command was not found"
            ),
            "{line}"
        );

        host.docker
            .remove_container(
                &container,
                None::<bollard::query_parameters::RemoveContainerOptions>,
            )
            .await
            .unwrap();
        let events = followed(&host, &container, "an-exec-the-engine-dropped").await;
        assert!(
            matches!(events.as_slice(), [Event::RankRemoved { rank: 1 }]),
            "{events:?}"
        );
    }
}

#[cfg(test)]
mod rdma_tests {
    use super::*;
    use crate::config::Rdma as Setting;

    /// A host with verbs device files gives its containers them (as /dev/infiniband), IPC_LOCK
    /// and unlimited locked memory, unless the experiment says `rdma: off`; a host without gives
    /// nothing.
    #[test]
    fn containers_get_infiniband_only_where_the_host_has_it_and_it_is_wanted() {
        let dir = std::path::Path::new("/srv/ib");
        let given = rdma_for(Setting::Auto, true, dir);
        let device = &given.devices.as_ref().unwrap()[0];
        assert_eq!(device.path_on_host.as_deref(), Some("/srv/ib"));
        assert_eq!(device.path_in_container.as_deref(), Some("/dev/infiniband"));
        assert_eq!(device.cgroup_permissions.as_deref(), Some("rwm"));
        assert_eq!(given.cap_add, Some(vec!["IPC_LOCK".to_string()]));
        let limit = &given.ulimits.as_ref().unwrap()[0];
        assert_eq!(
            (limit.name.as_deref(), limit.soft, limit.hard),
            (Some("memlock"), Some(-1), Some(-1))
        );
        assert_eq!(rdma_for(Setting::Off, true, dir), Rdma::default());
        assert_eq!(rdma_for(Setting::Auto, false, dir), Rdma::default());
    }

    /// Why NCCL would still talk TCP, as the image's runtime saw the container.
    #[test]
    fn what_stands_in_the_way_of_infiniband_is_named() {
        let seen = |device_files, ibverbs| RdmaInfo {
            device_files,
            ibverbs,
            ibverbs_error: (!ibverbs).then(|| "libibverbs.so.1: cannot open shared object file".into()),
        };
        assert_eq!(rdma_unusable("th1", &seen(true, true)), None);
        assert!(rdma_unusable("th1", &seen(false, true))
            .unwrap()
            .contains("do not see it"));
        let why = rdma_unusable("th1", &seen(true, false)).unwrap();
        assert!(
            why.contains("cannot load libibverbs (libibverbs.so.1: cannot open"),
            "{why}"
        );
        assert!(why.contains("libibverbs1 and ibverbs-providers"), "{why}");
    }
}
