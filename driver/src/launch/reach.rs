//! Preflight's proof that every host reaches the master port: the runtime listens on it on the
//! first host (`runtime reach listen`) while a container on every host connects to the master
//! address the ranks will use (`runtime reach connect`), all at once, in the experiment's image
//! with host networking, as the ranks will. A host that cannot is named before any rank starts,
//! instead of every rank timing out in the rendezvous.

use futures_util::future::join_all;

use super::docker::{
    container_body, copy_in, create, labels, remove_everywhere, run_to_end, runtime_error, start,
};
use super::LaunchError;
use crate::experiment::Experiment;
use crate::hosts::{Host, SshOptions};

/// How long each host keeps trying to connect (the listener may still be starting).
const CONNECT_SECONDS: u32 = 10;
/// How long the listener holds the port at most (it is removed as soon as every host has tried).
const LISTEN_SECONDS: u32 = 60;

/// Checks that every host reaches `plan.master_addr:plan.master_port` with the runtime at
/// `runtime` (its path in the containers). Containers carry `id` as their experiment label and
/// are removed afterwards; one left is a warning naming how to remove it (over `ssh`). Nothing to
/// check with one host.
pub async fn master_reachable(
    hosts: &[Host],
    ssh: &SshOptions,
    plan: &Experiment,
    runtime: &str,
    id: &str,
) -> Result<(), LaunchError> {
    if hosts.len() < 2 {
        return Ok(());
    }
    let first = &hosts[0];
    let port = plan.master_port.to_string();
    let mut listen = plan.ranks[plan.hosts[0].ranks[0]].clone();
    listen.argv = [runtime, "reach", "listen", "--port", &port, "--seconds"]
        .map(String::from)
        .into_iter()
        .chain([LISTEN_SECONDS.to_string()])
        .collect();
    let body = container_body(plan, first, labels(id, plan, "reach"), &[], Some(&listen));
    let listener = async {
        let cid = create(first, format!("{id}-listen"), body).await?;
        copy_in(first, &cid).await?;
        start(first, &cid).await
    };
    let outcome = match listener.await {
        Ok(()) => connect_all(hosts, plan, runtime, &port, id).await,
        Err(e) => Err(e),
    };
    remove_everywhere(hosts, ssh, id).await;
    outcome
}

async fn connect_all(
    hosts: &[Host],
    plan: &Experiment,
    runtime: &str,
    port: &str,
    id: &str,
) -> Result<(), LaunchError> {
    let tries = plan.hosts.iter().zip(hosts).map(|(hp, host)| async move {
        let mut connect = plan.ranks[hp.ranks[0]].clone();
        connect.argv = [
            runtime,
            "reach",
            "connect",
            "--host",
            &plan.master_addr,
            "--port",
            port,
            "--seconds",
        ]
        .map(String::from)
        .into_iter()
        .chain([CONNECT_SECONDS.to_string()])
        .collect();
        let body = container_body(plan, host, labels(id, plan, "reach"), &[], Some(&connect));
        let name = format!(
            "{id}-connect-{}",
            hp.name.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
        );
        let (code, _, stderr) = run_to_end(host, name, body).await?;
        Ok::<_, LaunchError>((code == 0).then_some(()).ok_or_else(|| {
            let reason = runtime_error(&stderr).to_string();
            (host.name.clone(), format!("exit {code}: {reason}"))
        }))
    });
    let mut failed = Vec::new();
    for result in join_all(tries).await {
        if let Err((host, reason)) = result? {
            failed.push((host, reason));
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    Err(LaunchError::MasterUnreachable {
        hosts: failed.iter().map(|(h, _)| h.clone()).collect(),
        first: hosts[0].name.clone(),
        addr: plan.master_addr.clone(),
        port: plan.master_port,
        reason: failed[0].1.clone(),
    })
}
