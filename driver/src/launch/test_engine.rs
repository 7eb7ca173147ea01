//! For unit tests against the machine's real Docker engine: the local engine as a host, an image
//! of one file to create containers from, and what removes a test's containers and image however
//! the test ends.

use futures_util::StreamExt;

use crate::hosts::{Host, SshOptions};

/// Removes a test's containers and image from the local engine when dropped, passed or not.
pub struct Leftovers {
    /// The image the test made.
    pub image: String,
    /// The containers it created (ids or names).
    pub containers: Vec<String>,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        for id in &self.containers {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f", id])
                .output();
        }
        let _ = std::process::Command::new("docker")
            .args(["rmi", "-f", &self.image])
            .output();
    }
}

/// The local engine as a host of the experiment.
pub async fn local_host() -> Host {
    let plan = local_plan();
    let (docker, tunnel) = crate::hosts::connect(&plan, &SshOptions::default())
        .await
        .unwrap();
    Host {
        _tunnel: tunnel,
        ..host_on(docker)
    }
}

/// A host named `localhost` whose engine is `docker`.
pub fn host_on(docker: bollard::Docker) -> Host {
    let plan = local_plan();
    Host {
        name: plan.name.clone(),
        plan,
        docker,
        image: String::new(),
        arch: String::new(),
        mounts: Vec::new(),
        copies: Vec::new(),
        infiniband: false,
        _tunnel: None,
    }
}

fn local_plan() -> crate::experiment::HostSpec {
    crate::experiment::HostSpec {
        name: "localhost".into(),
        machine: crate::config::Machine::placeholder("localhost".into()),
        ranks: vec![0, 1],
        gpus: Vec::new(),
    }
}

/// Imports `image`, an image of one file (`/hello`) and nothing to run, into the local engine:
/// enough to create containers that never start. `left` removes it.
pub async fn one_file_image(docker: &bollard::Docker, left: &Leftovers) {
    let options = bollard::query_parameters::CreateImageOptionsBuilder::default()
        .from_src("-")
        .repo(&left.image)
        .build();
    let tar = bollard::body_full(super::lease::file_tar("hello", "hello\n", 0o644).into());
    let mut import = docker.create_image(Some(options), Some(tar), None);
    while let Some(reply) = import.next().await {
        reply.unwrap();
    }
}
