//! Preflight's proof that every host reaches the master port: the runtime listens on it on the
//! first host (`runtime reach listen`) while a container on every host connects to the master
//! address the ranks will use (`runtime reach connect`), all at once, in the experiment's image
//! with host networking, as the ranks will. A host that cannot is named before any rank starts,
//! instead of every rank timing out in the rendezvous.

use futures_util::future::join_all;
use stagehand_contract::exit_codes::UNRESOLVED;

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
        Ok::<_, LaunchError>((code == 0).then_some(()).ok_or_else(|| Missed {
            host: host.name.clone(),
            unresolved: code == i64::from(UNRESOLVED),
            reason: format!("exit {code}: {}", runtime_error(&stderr)),
        }))
    });
    let mut failed = Vec::new();
    for result in join_all(tries).await {
        if let Err(missed) = result? {
            failed.push(missed);
        }
    }
    judge(failed, &hosts[0].name, &plan.master_addr, plan.master_port)
}

/// One host's connection that failed: the runtime's reason, and whether it could not resolve
/// the master address's name at all.
struct Missed {
    host: String,
    unresolved: bool,
    reason: String,
}

/// The error for the hosts that `failed` to reach the master at `addr:port` on `first`: hosts
/// that cannot resolve its name are told to change the name, before any port is blamed.
fn judge(failed: Vec<Missed>, first: &str, addr: &str, port: u16) -> Result<(), LaunchError> {
    let (unresolved, unreached): (Vec<Missed>, Vec<Missed>) = failed.into_iter().partition(|m| m.unresolved);
    if let Some(one) = unresolved.first() {
        return Err(LaunchError::MasterUnresolved {
            hosts: unresolved.iter().map(|m| m.host.clone()).collect(),
            first: first.to_string(),
            addr: addr.to_string(),
            reason: one.reason.clone(),
        });
    }
    let Some(one) = unreached.first() else {
        return Ok(());
    };
    Err(LaunchError::MasterUnreachable {
        hosts: unreached.iter().map(|m| m.host.clone()).collect(),
        first: first.to_string(),
        addr: addr.to_string(),
        port,
        reason: one.reason.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn missed(host: &str, unresolved: bool) -> Missed {
        let reason = match unresolved {
            true => {
                "exit 3: cannot reach th1:29500: cannot resolve th1: failed to lookup address information"
            }
            false => "exit 1: cannot reach 10.0.0.1:29500: Connection refused (os error 111)",
        };
        Missed {
            host: host.into(),
            unresolved,
            reason: reason.into(),
        }
    }

    /// A host that cannot resolve the master's name is told to change the name, not to open a
    /// port, even where another host also failed to connect; hosts that resolved it and could not
    /// connect are the port's case.
    #[test]
    fn a_name_that_does_not_resolve_is_blamed_before_the_port() {
        let failed = vec![missed("th3", false), missed("th2", true), missed("th4", true)];
        let err = judge(failed, "th1", "th1", 29500).unwrap_err().to_string();
        assert!(
            err.starts_with("th2, th4 cannot resolve the master address th1 (exit 3: "),
            "{err}"
        );
        assert!(
            err.contains("set `master_addr:` to an IP address of th1"),
            "{err}"
        );
        assert!(!err.contains("open that port"), "{err}");

        let err = judge(vec![missed("th3", false)], "th1", "10.0.0.1", 29500)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("th3 cannot reach the master port at 10.0.0.1:29500 (exit 1: "),
            "{err}"
        );
        assert!(err.contains("open that port to the other hosts on th1"), "{err}");
        assert!(judge(Vec::new(), "th1", "th1", 29500).is_ok());
    }
}
