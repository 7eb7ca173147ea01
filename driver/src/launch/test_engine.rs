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
        tunnel,
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
        engine_id: String::new(),
        mounts: Vec::new(),
        copies: Vec::new(),
        infiniband: false,
        tunnel: None,
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
    import(
        docker,
        &left.image,
        super::lease::file_tar("hello", "hello\n", 0o644),
    )
    .await;
}

/// Imports `image` into the local engine: the machine's own `/bin/sh` and `sleep`, with the
/// libraries they load (as `ldd` lists them) at the same paths, so containers of it can run the
/// lease guard. `left` removes it.
pub async fn shell_image(docker: &bollard::Docker, left: &Leftovers) {
    let mut files = vec![
        std::path::PathBuf::from("/bin/sh"),
        std::path::PathBuf::from("/bin/sleep"),
    ];
    for program in files.clone() {
        let ldd = std::process::Command::new("ldd").arg(&program).output().unwrap();
        assert!(ldd.status.success(), "ldd {}", program.display());
        let listed = String::from_utf8_lossy(&ldd.stdout).into_owned();
        let libraries = listed.split_whitespace().filter(|w| w.starts_with('/'));
        files.extend(libraries.map(std::path::PathBuf::from));
    }
    files.sort();
    files.dedup();
    let mut builder = tar::Builder::new(Vec::new());
    for file in &files {
        // The file itself, where a path is a link (`/bin/sh` to dash).
        let content = std::fs::read(file).unwrap();
        let mut header = tar::Header::new_gnu();
        header.set_size(content.len() as u64);
        header.set_mode(0o755);
        header.set_cksum();
        let inside = file.strip_prefix("/").unwrap();
        builder
            .append_data(&mut header, inside, content.as_slice())
            .unwrap();
    }
    import(docker, &left.image, builder.into_inner().unwrap()).await;
}

/// Imports `tar`, a root file system, into the local engine as `image`.
async fn import(docker: &bollard::Docker, image: &str, tar: Vec<u8>) {
    let options = bollard::query_parameters::CreateImageOptionsBuilder::default()
        .from_src("-")
        .repo(image)
        .build();
    let mut import = docker.create_image(Some(options), Some(bollard::body_full(tar.into())), None);
    while let Some(reply) = import.next().await {
        reply.unwrap();
    }
}
