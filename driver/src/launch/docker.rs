//! The docker backend: one container per rank, or one per host with the host's ranks started in it
//! through the exec API. Every container carries the experiment's label, and only containers with
//! that label are ever stopped or removed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, DeviceRequest, HostConfig, Mount as DockerMount, MountType};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, ListContainersOptionsBuilder, LogsOptionsBuilder,
    RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder, WaitContainerOptions,
};
use futures_util::future::join_all;
use futures_util::{Stream as FutStream, StreamExt};
use tokio::sync::mpsc::UnboundedSender;

use super::lines::LineSplitter;
use super::{classify_line, LaunchError};
use crate::cli::ContainerMode;
use crate::events::{Event, Stream};
use crate::hosts::{Host, SshOptions};
use crate::plan::{Plan, RankPlan};

/// Label holding the experiment id; the only thing cleanup selects on.
pub const LABEL_EXPERIMENT: &str = "stagehand.experiment";
/// Label holding the experiment name.
pub const LABEL_NAME: &str = "stagehand.name";
/// Label holding the rank (or ranks, comma-separated, for a per-host container).
pub const LABEL_RANK: &str = "stagehand.rank";
/// How long stopping every container may take.
pub const STOP_DEADLINE: Duration = Duration::from_secs(10);

/// Containers of one experiment across its hosts.
pub struct DockerLauncher {
    hosts: Vec<Host>,
    id: String,
    ssh: SshOptions,
}

impl DockerLauncher {
    /// Prepares to launch on `hosts` (from preflight, in plan order) under experiment `id`.
    pub fn new(hosts: Vec<Host>, id: String, ssh: SshOptions) -> DockerLauncher {
        DockerLauncher { hosts, id, ssh }
    }

    /// Creates and starts every container and rank; events go to `tx`.
    pub async fn start(&self, plan: &Plan, tx: UnboundedSender<Event>) -> Result<(), LaunchError> {
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
        plan: &Plan,
        r: &RankPlan,
        tx: &UnboundedSender<Event>,
    ) -> Result<(), LaunchError> {
        let host = &self.hosts[r.host];
        let labels = self.labels(plan, &r.rank.to_string());
        let body = container_body(plan, host, labels, &r.gpus, Some(r));
        let id = create(host, format!("{}-r{}", self.id, r.rank), body).await?;
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
        plan: &Plan,
        index: usize,
        tx: &UnboundedSender<Event>,
    ) -> Result<(), LaunchError> {
        let host = &self.hosts[index];
        let host_plan = &plan.hosts[index];
        let ranks: Vec<String> = host_plan.ranks.iter().map(|r| r.to_string()).collect();
        let labels = self.labels(plan, &ranks.join(","));
        let body = container_body(plan, host, labels, &host_plan.gpus, None);
        let container = create(host, format!("{}-h{index}", self.id), body).await?;
        start(host, &container).await?;
        for &rank in &host_plan.ranks {
            let r = &plan.ranks[rank];
            let docker_err = |action: &'static str| {
                let host = host.name.clone();
                move |source| LaunchError::Docker { host, action, source }
            };
            let options = CreateExecOptions {
                cmd: Some(r.argv.clone()),
                env: Some(env_list(r)),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            };
            let exec = host
                .docker
                .create_exec(&container, options)
                .await
                .map_err(docker_err("create an exec"))?;
            let started = host
                .docker
                .start_exec(&exec.id, None)
                .await
                .map_err(docker_err("start an exec"))?;
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
            tokio::spawn(follow_exec(host.clone(), exec.id, output, rank, tx.clone()));
        }
        Ok(())
    }

    fn labels(&self, plan: &Plan, rank: &str) -> HashMap<String, String> {
        labels(&self.id, plan, rank)
    }

    /// Removes (force, so killed) every container labelled with this experiment on every host,
    /// concurrently, within [`STOP_DEADLINE`]. Returns what could not be removed.
    pub async fn remove_all(&self) -> Vec<LaunchError> {
        let work = join_all(self.hosts.iter().map(|h| self.remove_on(h)));
        match tokio::time::timeout(STOP_DEADLINE, work).await {
            Ok(results) => results.into_iter().flatten().collect(),
            Err(_) => vec![LaunchError::CleanupTimeout {
                seconds: STOP_DEADLINE.as_secs(),
            }],
        }
    }
}

impl DockerLauncher {
    /// Removes the experiment's containers on one host; when its connection was lost, connects
    /// again once so a lost SSH session does not leave containers behind.
    async fn remove_on(&self, host: &Host) -> Vec<LaunchError> {
        let errors = remove_labelled(&host.docker, &host.name, &self.id).await;
        if errors.is_empty() {
            return errors;
        }
        match crate::hosts::connect(&host.plan, &self.ssh).await {
            Ok((docker, _tunnel)) => remove_labelled(&docker, &host.name, &self.id).await,
            Err(e) => {
                let mut errors = errors;
                errors.push(e);
                errors
            }
        }
    }
}

pub(super) async fn start(host: &Host, id: &str) -> Result<(), LaunchError> {
    host.docker
        .start_container(id, None::<bollard::query_parameters::StartContainerOptions>)
        .await
        .map_err(|source| LaunchError::Docker {
            host: host.name.clone(),
            action: "start a container",
            source,
        })
}

/// Creates a container and copies in the files the host lacks, so it is ready to start.
pub(super) async fn create(host: &Host, name: String, body: ContainerCreateBody) -> Result<String, LaunchError> {
    let options = CreateContainerOptionsBuilder::default().name(&name).build();
    let id = host
        .docker
        .create_container(Some(options), body)
        .await
        .map(|r| r.id)
        .map_err(|source| LaunchError::Docker {
            host: host.name.clone(),
            action: "create a container",
            source,
        })?;
    if !host.copies.is_empty() {
        let tar = pack_files(host)?;
        let options = UploadToContainerOptionsBuilder::default().path("/").build();
        host.docker
            .upload_to_container(&id, Some(options), bollard::body_full(tar.into()))
            .await
            .map_err(|source| LaunchError::Docker {
                host: host.name.clone(),
                action: "copy code into a container",
                source,
            })?;
    }
    Ok(id)
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

fn env_list(rank: &RankPlan) -> Vec<String> {
    rank.env.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// The container for one rank (`rank` given) or for a host's ranks (an idle init process the
/// ranks are exec'd into).
pub(super) fn container_body(
    plan: &Plan,
    host: &Host,
    labels: HashMap<String, String>,
    gpus: &[u32],
    rank: Option<&RankPlan>,
) -> ContainerCreateBody {
    let mounts = host
        .mounts
        .iter()
        .map(|m| DockerMount {
            source: Some(m.source.display().to_string()),
            target: Some(m.target.display().to_string()),
            typ: Some(MountType::BIND),
            read_only: Some(m.read_only),
            ..Default::default()
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
        None => (vec!["sleep".into(), "infinity".into()], Vec::new()),
    };
    ContainerCreateBody {
        image: Some(host.image.clone()),
        cmd: Some(cmd),
        // The image's entrypoint must not wrap our argument vector in a shell.
        entrypoint: Some(Vec::new()),
        env: Some(env),
        labels: Some(labels),
        host_config: Some(HostConfig {
            network_mode: Some("host".into()),
            ipc_mode: Some("host".into()),
            shm_size: Some(plan.shm_size_bytes as i64),
            mounts: Some(mounts),
            device_requests,
            init: Some(true),
            ..Default::default()
        }),
        ..Default::default()
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
    let exit_code = match wait.next().await {
        Some(Ok(r)) => Some(r.status_code),
        Some(Err(DockerError::DockerContainerWaitError { code, .. })) => Some(code),
        // Removed by the driver while stopping: no exit code to report.
        Some(Err(DockerError::DockerResponseServerError { status_code: 404, .. })) | None => None,
        Some(Err(e)) => {
            let _ = tx.send(Event::HostLost {
                host: host.name.clone(),
                reason: e.to_string(),
            });
            None
        }
    };
    if let Some(reason) = lost {
        if exit_code.is_none() {
            let _ = tx.send(Event::HostLost {
                host: host.name.clone(),
                reason,
            });
        }
    }
    let _ = tx.send(Event::RankExited { rank, exit_code });
}

/// Streams an exec's output into events, then reports its exit code.
async fn follow_exec(
    host: Host,
    exec: String,
    output: impl FutStream<Item = Result<LogOutput, DockerError>> + Unpin,
    rank: usize,
    tx: UnboundedSender<Event>,
) {
    let lost = forward(output, rank, &tx).await;
    // The exec may still be winding down for a moment after its output closes.
    let mut exit_code = None;
    for _ in 0..20 {
        match host.docker.inspect_exec(&exec).await {
            Ok(i) if i.running == Some(true) => tokio::time::sleep(Duration::from_millis(50)).await,
            Ok(i) => {
                exit_code = i.exit_code;
                break;
            }
            // The container was removed by the driver while stopping.
            Err(DockerError::DockerResponseServerError { status_code: 404, .. }) => break,
            Err(e) => {
                let reason = lost.unwrap_or_else(|| e.to_string());
                let _ = tx.send(Event::HostLost {
                    host: host.name.clone(),
                    reason,
                });
                break;
            }
        }
    }
    let _ = tx.send(Event::RankExited { rank, exit_code });
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
pub(super) fn labels(id: &str, plan: &Plan, rank: &str) -> HashMap<String, String> {
    HashMap::from([
        (LABEL_EXPERIMENT.to_string(), id.to_string()),
        (LABEL_NAME.to_string(), plan.name.clone()),
        (LABEL_RANK.to_string(), rank.to_string()),
    ])
}

/// What the runtime says of itself in a host's image (`runtime info`), as preflight sees it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct RuntimeInfo {
    pub cuda_devices: usize,
    #[serde(default)]
    pub cuda_error: Option<String>,
    #[serde(default)]
    pub cuda_devices_error: Option<String>,
}

/// Preflight's proof that the runtime starts where it will run: `runtime info` in a container of
/// each host's image, with the mounts, copied files and GPUs its ranks get, all hosts at once.
/// A runtime that cannot start (a missing library) or a host that shows fewer CUDA devices than
/// its ranks asked for is refused here, naming the host, before any rank starts. The containers
/// carry `id` as their experiment label and are removed afterwards.
pub async fn self_check(hosts: &[Host], plan: &Plan, id: &str) -> Result<(), LaunchError> {
    let checks = plan.hosts.iter().zip(hosts).map(|(hp, host)| async move {
        let Some(&first) = hp.ranks.first() else {
            return Ok(());
        };
        let rank = &plan.ranks[first];
        let mut check = rank.clone();
        check.argv = vec![rank.argv[0].clone(), "info".into()];
        check.gpus = hp.gpus.clone();
        let body = container_body(plan, host, labels(id, plan, "check"), &check.gpus, Some(&check));
        let outcome = run_to_end(
            host,
            format!(
                "{id}-{}",
                hp.name.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
            ),
            body,
        )
        .await;
        let _ = remove_labelled(&host.docker, &host.name, id).await;
        let (code, stdout, stderr) = outcome?;
        let failed = |reason: String| LaunchError::SelfCheck {
            host: host.name.clone(),
            reason,
        };
        if code != 0 {
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
            return Err(failed(format!(
                "`{} info` exited with {code}: {last}",
                rank.argv[0]
            )));
        }
        let info: RuntimeInfo = serde_json::from_str(stdout.trim())
            .map_err(|e| failed(format!("`runtime info` printed {:?}: {e}", stdout.trim())))?;
        let device = rank
            .argv
            .iter()
            .position(|a| a == "--device")
            .and_then(|i| rank.argv.get(i + 1));
        let wants_cuda = device.is_some_and(|d| d.starts_with("cuda"));
        if wants_cuda && info.cuda_devices < hp.gpus.len().max(1) {
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
        Ok(())
    });
    join_all(checks).await.into_iter().collect()
}

/// Removes every container labelled with experiment `id` on every host (after an interrupted
/// [`self_check`]).
pub async fn remove_everywhere(hosts: &[Host], id: &str) -> Vec<LaunchError> {
    join_all(hosts.iter().map(|h| remove_labelled(&h.docker, &h.name, id)))
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Creates, starts and waits for a container; returns its exit code, stdout and stderr.
pub(super) async fn run_to_end(
    host: &Host,
    name: String,
    body: ContainerCreateBody,
) -> Result<(i64, String, String), LaunchError> {
    let id = create(host, name, body).await?;
    start(host, &id).await?;
    let mut wait = host.docker.wait_container(&id, None::<WaitContainerOptions>);
    let code = match wait.next().await {
        Some(Ok(r)) => r.status_code,
        Some(Err(DockerError::DockerContainerWaitError { code, .. })) => code,
        Some(Err(source)) => {
            return Err(LaunchError::Docker {
                host: host.name.clone(),
                action: "wait for the runtime's self-check",
                source,
            })
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
                return Err(LaunchError::Docker {
                    host: host.name.clone(),
                    action: "read the runtime's self-check",
                    source,
                })
            }
        }
    }
    Ok((code, stdout, stderr))
}

/// Removes every container on `host` labelled with experiment `id`.
pub(super) async fn remove_labelled(docker: &bollard::Docker, host: &str, id: &str) -> Vec<LaunchError> {
    let filters = HashMap::from([("label", vec![format!("{LABEL_EXPERIMENT}={id}")])]);
    let options = ListContainersOptionsBuilder::default()
        .all(true)
        .filters(&filters)
        .build();
    let containers = match docker.list_containers(Some(options)).await {
        Ok(c) => c,
        Err(source) => {
            return vec![LaunchError::Docker {
                host: host.to_string(),
                action: "list the experiment's containers",
                source,
            }]
        }
    };
    let removals = containers.into_iter().filter_map(|c| c.id).map(|cid| async move {
        let options = RemoveContainerOptionsBuilder::default()
            .force(true)
            .v(true)
            .build();
        match docker.remove_container(&cid, Some(options)).await {
            Ok(()) | Err(DockerError::DockerResponseServerError { status_code: 404, .. }) => None,
            // 409: removal already in progress (a concurrent stop); it will finish.
            Err(DockerError::DockerResponseServerError { status_code: 409, .. }) => None,
            Err(source) => Some(LaunchError::Docker {
                host: host.to_string(),
                action: "remove a container",
                source,
            }),
        }
    });
    join_all(removals).await.into_iter().flatten().collect()
}

fn short(id: &str) -> String {
    id.chars().take(12).collect()
}

#[cfg(test)]
mod tests {
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
}
