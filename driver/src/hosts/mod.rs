//! Hosts: reaching each machine's Docker engine and making sure it can run the experiment
//! (preflight). The local engine is reached over its unix socket; an SSH host would slot in at
//! [`connect`] as another way to get a [`bollard::Docker`] handle (bollard's `ssh` feature or a
//! socket forwarded by the openssh crate), with everything after it unchanged.

pub mod context;
pub mod image;

use bollard::Docker;

use crate::events::HostFacts;
use crate::launch::LaunchError;
use crate::plan::{HostPlan, ImageSource};

/// A host whose engine answered.
#[derive(Clone)]
pub struct Host {
    /// Name as in the experiment file.
    pub name: String,
    /// The engine.
    pub docker: Docker,
    /// The image tag containers run.
    pub image: String,
}

/// Connects to a host's engine and agrees on an API version (servers here speak 1.41).
pub async fn connect(host: &HostPlan) -> Result<Docker, LaunchError> {
    if !host.machine.is_local() {
        return Err(LaunchError::RemoteHost {
            host: host.name.clone(),
        });
    }
    let docker = Docker::connect_with_local_defaults().map_err(|source| LaunchError::Connect {
        host: host.name.clone(),
        source,
    })?;
    docker
        .negotiate_version()
        .await
        .map_err(|source| LaunchError::Connect {
            host: host.name.clone(),
            source,
        })
}

/// Preflight for one host: engine reachable, GPUs usable when asked for, image present or built.
pub async fn prepare(
    host: &HostPlan,
    image: &ImageSource,
    verbose: bool,
) -> Result<(Host, HostFacts), LaunchError> {
    let docker = connect(host).await?;
    let docker_err = |action: &'static str| {
        let host = host.name.clone();
        move |source| LaunchError::Docker { host, action, source }
    };
    let version = docker
        .version()
        .await
        .map_err(docker_err("ask for its version"))?;
    if !host.gpus.is_empty() {
        let info = docker.info().await.map_err(docker_err("ask for its runtimes"))?;
        let has_nvidia = info.runtimes.as_ref().is_some_and(|r| r.contains_key("nvidia"))
            || info.cdi_spec_dirs.as_ref().is_some_and(|d| !d.is_empty());
        if !has_nvidia {
            return Err(LaunchError::NoGpuRuntime {
                host: host.name.clone(),
                gpus: host.gpus.clone(),
            });
        }
    }
    let prepared = image::ensure(&docker, &host.name, image, verbose).await?;
    let facts = HostFacts {
        host: host.name.clone(),
        docker_version: version.version,
        gpus: host.gpus.iter().map(|g| g.to_string()).collect(),
        image_id: Some(prepared.id.clone()),
        image: Some(prepared.tag.clone()),
        image_built: prepared.built,
    };
    Ok((
        Host {
            name: host.name.clone(),
            docker,
            image: prepared.tag,
        },
        facts,
    ))
}
