//! Removing an experiment's containers: by its label on each host, retried on a fresh connection
//! for a grace period when a host does not answer, and, for what still could not be removed,
//! exactly which containers are left where and the command that removes them by hand.

use std::collections::HashMap;
use std::time::Duration;

use bollard::errors::Error as DockerError;
use bollard::query_parameters::{
    InspectContainerOptions, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
};
use futures_util::future::join_all;

use super::labels::LABEL_EXPERIMENT;
use super::lease::LEASE_TTL;
use super::LaunchError;
use crate::config::machine::Machine;
use crate::hosts::HostError;
use crate::hosts::{Host, SshOptions};

/// How long the driver keeps trying to remove the containers of a host that does not answer,
/// connecting to it again between tries, before it says what is left and how to remove it.
pub const REMOVAL_GRACE: Duration = Duration::from_secs(20);
/// The same for preflight's containers (the self-check's and the reach check's), shorter: it is
/// how long Ctrl-C during preflight may wait on a host that does not answer, and what preflight
/// leaves is only a warning (each container stops itself once its lease runs out). Removing a
/// container takes well under a second on an engine that answers, so 10 s still leaves room for
/// a slow engine, or for a second try on a new connection after one that failed at once.
pub const PREFLIGHT_REMOVAL_GRACE: Duration = Duration::from_secs(10);
/// The most one try on one host may take (an SSH connection that cannot be made takes 10 s).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(12);
/// The pause between tries.
const RETRY_PAUSE: Duration = Duration::from_secs(2);
/// How long a try waits for a removal the engine already has in progress (one a try that ran out
/// of time started) to end: well over the second or so one takes. Within the try's own bound.
const IN_PROGRESS_WAIT: Duration = Duration::from_secs(5);
/// How often it asks.
const IN_PROGRESS_POLL: Duration = Duration::from_millis(100);
// Ctrl-C during preflight waits no longer than a failed run's removal.
const _: () = assert!(PREFLIGHT_REMOVAL_GRACE.as_millis() <= REMOVAL_GRACE.as_millis());

/// A container the driver created: where, and which ranks it runs.
#[derive(Debug, Clone)]
pub struct Tracked {
    /// Index of its host in the launcher's hosts.
    pub host: usize,
    /// Full container id.
    pub id: String,
    /// Container name.
    pub name: String,
    /// The ranks it runs.
    pub ranks: Vec<usize>,
}

/// What removing one experiment's containers on one engine did.
pub struct Pass {
    /// Containers seen gone: removed now, or already.
    pub gone: Vec<String>,
    /// Why it did not finish, and which containers (id, name) are known to be left; `None` when
    /// that is not known (the engine could not list them, or did not answer in time).
    pub failure: Option<(LaunchError, Option<Named>)>,
}

/// Containers by (id, name).
pub type Named = Vec<(String, String)>;

/// Removes (force: killed first) every container on `docker` labelled with experiment `id`.
pub async fn remove_labelled(docker: &bollard::Docker, host: &str, id: &str) -> Pass {
    let filters = HashMap::from([("label", vec![format!("{LABEL_EXPERIMENT}={id}")])]);
    let options = ListContainersOptionsBuilder::default()
        .all(true)
        .filters(&filters)
        .build();
    let containers = match docker.list_containers(Some(options)).await {
        Ok(c) => c,
        Err(source) => {
            let e = LaunchError::from(HostError::Docker {
                host: host.to_string(),
                action: "list the experiment's containers",
                source,
            });
            return Pass {
                gone: Vec::new(),
                failure: Some((e, None)),
            };
        }
    };
    let removals = containers.into_iter().filter_map(|c| {
        let name = c
            .names
            .and_then(|n| n.into_iter().next())
            .map(|n| n.trim_start_matches('/').to_string())
            .unwrap_or_default();
        c.id.map(|cid| async move {
            let options = RemoveContainerOptionsBuilder::default()
                .force(true)
                .v(true)
                .build();
            let outcome = match docker.remove_container(&cid, Some(options)).await {
                Ok(()) | Err(DockerError::DockerResponseServerError { status_code: 404, .. }) => Ok(()),
                // 409: a removal already in progress, as one an earlier try that ran out of time
                // started and left to the engine: the container is gone once the engine says so.
                Err(DockerError::DockerResponseServerError { status_code: 409, .. }) => {
                    gone_within(docker, host, &cid, IN_PROGRESS_WAIT).await
                }
                Err(source) => Err(LaunchError::from(HostError::Docker {
                    host: host.to_string(),
                    action: "remove a container",
                    source,
                })),
            };
            (cid, name, outcome)
        })
    });
    let mut pass = Pass {
        gone: Vec::new(),
        failure: None,
    };
    let mut left = Vec::new();
    for (cid, name, outcome) in join_all(removals).await {
        match outcome {
            Ok(()) => pass.gone.push(cid),
            Err(e) => {
                left.push((cid, name));
                if pass.failure.is_none() {
                    pass.failure = Some((e, None));
                }
            }
        }
    }
    if let Some((_, known)) = &mut pass.failure {
        *known = Some(left);
    }
    pass
}

/// Waits, for `wait` at most, until the engine no longer has container `cid`, whose removal it
/// has in progress (it answered a removal with 409).
async fn gone_within(
    docker: &bollard::Docker,
    host: &str,
    cid: &str,
    wait: Duration,
) -> Result<(), LaunchError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let inspect = docker
            .inspect_container(cid, None::<InspectContainerOptions>)
            .await;
        if let Err(DockerError::DockerResponseServerError { status_code: 404, .. }) = inspect {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(LaunchError::RemovalInProgress {
                host: host.to_string(),
                seconds: wait.as_secs(),
            });
        }
        tokio::time::sleep(IN_PROGRESS_POLL).await;
    }
}

/// Removes experiment `id`'s containers on `host`: a try on the connection it has, then, until
/// `grace` has passed since the start, tries on a new connection. Every try is bounded by
/// [`ATTEMPT_TIMEOUT`] and by what is left of `grace`, so the whole takes `grace` at most; a
/// `grace` of zero is one try of [`ATTEMPT_TIMEOUT`] at most (a quick first pass, which a later
/// call with a grace tries again).
pub async fn remove_on(host: &Host, ssh: &SshOptions, id: &str, grace: Duration) -> Pass {
    let deadline = tokio::time::Instant::now() + grace;
    let timed_out = |wait: Duration| Pass {
        gone: Vec::new(),
        failure: Some((
            LaunchError::CleanupTimeout {
                host: host.name.clone(),
                wait,
            },
            None,
        )),
    };
    let limit = match grace.is_zero() {
        true => ATTEMPT_TIMEOUT,
        false => ATTEMPT_TIMEOUT.min(grace),
    };
    let first = tokio::time::timeout(limit, remove_labelled(&host.docker, &host.name, id)).await;
    let mut pass = first.unwrap_or_else(|_| timed_out(limit));
    let mut gone = Vec::new();
    loop {
        gone.append(&mut pass.gone);
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if pass.failure.is_none() || remaining.is_zero() {
            pass.gone = gone;
            return pass;
        }
        tokio::time::sleep(RETRY_PAUSE.min(remaining)).await;
        let limit = ATTEMPT_TIMEOUT.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
        let again = async {
            match crate::hosts::connect(&host.plan, ssh).await {
                // The new connection lives as long as this try.
                Ok((docker, _tunnel)) => remove_labelled(&docker, &host.name, id).await,
                Err(e) => Pass {
                    gone: Vec::new(),
                    failure: Some((e.into(), None)),
                },
            }
        };
        let next = tokio::time::timeout(limit.max(Duration::from_millis(1)), again).await;
        let earlier = pass.failure.and_then(|(_, known)| known);
        // The last try has what is left of the grace: its running out is the grace's.
        pass = next.unwrap_or_else(|_| timed_out(grace));
        // A try that could not list the containers keeps an earlier try's account of them.
        if let Some((_, known @ None)) = &mut pass.failure {
            *known = earlier;
        }
    }
}

/// How long a container of another run must have been stopped (or never started) before
/// [`warn_of_leftovers`] names it: a run going on beside this one removes its own as soon as they
/// stop.
const LEFT_FOR: jiff::SignedDuration = jiff::SignedDuration::from_secs(120);

/// Warns of containers of earlier runs left on `docker` (a driver killed outright, a host lost
/// during cleanup): stopped or never started for [`LEFT_FOR`], with an experiment's label. A
/// running one may be another run's, and is left unsaid.
pub async fn warn_of_leftovers(
    docker: &bollard::Docker,
    machine: &Machine,
    ssh_config: Option<&std::path::Path>,
) {
    let names = left_behind(docker, LEFT_FOR).await;
    let Some(first) = names.first() else {
        return;
    };
    let shown = names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    let more = match names.len() {
        n if n > 3 => format!(" and {} more", n - 3),
        _ => String::new(),
    };
    stderr_line!(
        "warning: {} holds {} container(s) of earlier runs, stopped and never removed ({shown}{more}): \
         `{}` removes the first; `docker ps -a --filter label={LABEL_EXPERIMENT}` there lists them all",
        machine.host,
        names.len(),
        remove_by_hand(machine, ssh_config, first)
    );
}

/// The names of the containers with an experiment's label on `docker` that stopped (or were
/// created and never started) more than `older_than` ago; none when the engine cannot say.
async fn left_behind(docker: &bollard::Docker, older_than: jiff::SignedDuration) -> Vec<String> {
    let filters = HashMap::from([
        ("label", vec![LABEL_EXPERIMENT.to_string()]),
        (
            "status",
            vec!["created".to_string(), "exited".to_string(), "dead".to_string()],
        ),
    ]);
    let options = ListContainersOptionsBuilder::default()
        .all(true)
        .filters(&filters)
        .build();
    let listed = tokio::time::timeout(Duration::from_secs(10), docker.list_containers(Some(options))).await;
    let Ok(Ok(listed)) = listed else {
        return Vec::new();
    };
    let now = jiff::Timestamp::now();
    let since = |c: &bollard::models::ContainerSummary| {
        let id = c.id.clone().unwrap_or_default();
        let created = c.created.and_then(|s| jiff::Timestamp::from_second(s).ok());
        async move {
            let state = docker
                .inspect_container(&id, None::<InspectContainerOptions>)
                .await
                .ok()?
                .state?;
            // A container never started has no finishing time (the year 1): its creation's.
            let finished = state
                .finished_at
                .and_then(|at| at.parse::<jiff::Timestamp>().ok())
                .filter(|at| at.as_second() > 0);
            finished.or(created)
        }
    };
    let stopped = join_all(listed.iter().map(|c| {
        let at = since(c);
        async move { (c, at.await) }
    }))
    .await;
    stopped
        .into_iter()
        .filter(|(_, at)| at.is_some_and(|at| now.duration_since(at) > older_than))
        .filter_map(|(c, _)| {
            c.names
                .as_ref()?
                .first()
                .map(|n| n.trim_start_matches('/').to_string())
        })
        .collect()
}

/// The command that removes container `name` of `machine` by hand, quoted for a POSIX shell:
/// `docker rm -f NAME` for the local engine, `ssh HOST docker rm -f NAME` for another host, with
/// the ssh options and the Docker socket the experiment names. Printed for the user, never run.
pub fn remove_by_hand(machine: &Machine, ssh_config: Option<&std::path::Path>, name: &str) -> String {
    let mut docker = vec!["docker".to_string()];
    if let Some(socket) = &machine.docker_socket {
        docker.push("-H".into());
        docker.push(format!("unix://{}", socket.display()));
    }
    docker.extend(["rm".to_string(), "-f".to_string(), name.to_string()]);
    if machine.is_local() {
        return docker.iter().map(|w| sh_quote(w)).collect::<Vec<_>>().join(" ");
    }
    let mut words = vec!["ssh".to_string()];
    if let Some(config) = ssh_config {
        words.push("-F".into());
        words.push(config.display().to_string());
    }
    if let Some(port) = machine.port {
        words.push("-p".into());
        words.push(port.to_string());
    }
    if let Some(key) = &machine.identity_file {
        words.push("-i".into());
        words.push(key.display().to_string());
    }
    words.push(match &machine.user {
        Some(user) => format!("{user}@{}", machine.host),
        None => machine.host.clone(),
    });
    let mut text: Vec<String> = words.iter().map(|w| sh_quote(w)).collect();
    // ssh joins the remote words with spaces for the remote shell: quoted once for it, once here.
    text.extend(docker.iter().map(|w| sh_quote(&sh_quote(w))));
    text.join(" ")
}

/// The warnings for preflight's containers (labelled with experiment `id`) that `host`, the
/// experiment's `machine`, did not remove, because of `why`: one per container `known` (id, name)
/// to be left, naming it and the command that removes it by hand ([`remove_by_hand`]), or, when
/// which are left is not known (the engine could not list them, or did not answer in time: `why`
/// says which), one for the host, naming the label. Preflight goes on: each stops itself, but
/// stays listed under a label that is not the experiment record's.
pub fn preflight_left(
    host: &str,
    machine: &Machine,
    ssh_config: Option<&std::path::Path>,
    id: &str,
    why: &str,
    known: Option<&Named>,
) -> Vec<String> {
    let ttl = LEASE_TTL.as_secs();
    let Some(known) = known else {
        return vec![format!(
            "warning: preflight's containers on {host} (label {LABEL_EXPERIMENT}={id}) may not have been \
             removed, and which are left is not known: {why}; each stops itself once its lease has \
             not been renewed for {ttl} s, but stays listed (`docker ps -a`) until removed"
        )];
    };
    known
        .iter()
        .map(|(cid, name)| {
            // The engine names every container; its id removes one all the same.
            let name = if name.is_empty() { cid } else { name };
            format!(
                "warning: preflight container {name} on {host} could not be removed: {why}; it stops \
                 itself once its lease has not been renewed for {ttl} s, but stays listed \
                 (`docker ps -a`) until removed: run `{}`",
                remove_by_hand(machine, ssh_config, name)
            )
        })
        .collect()
}

/// `word` as one word for a POSIX shell: as it is when it holds only safe characters, else in
/// single quotes.
fn sh_quote(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "_-./:@=,+%".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_engine::{local_host, one_file_image, Leftovers};
    use super::*;
    use crate::config::machine::HostKeyCheck;

    fn machine(host: &str) -> Machine {
        Machine {
            host: host.into(),
            user: None,
            port: None,
            identity_file: None,
            gpus: Vec::new(),
            host_key_check: HostKeyCheck::Strict,
            docker_socket: None,
        }
    }

    #[test]
    fn removing_by_hand_names_the_host_as_ssh_reaches_it() {
        assert_eq!(
            remove_by_hand(&machine("localhost"), None, "e-r0"),
            "docker rm -f e-r0"
        );
        assert_eq!(
            remove_by_hand(&machine("th2"), None, "e-r1"),
            "ssh th2 docker rm -f e-r1"
        );
        let mut m = machine("gpu 7");
        m.user = Some("ann".into());
        m.port = Some(2222);
        m.identity_file = Some("/keys/it's".into());
        m.docker_socket = Some("/run/my docker.sock".into());
        let cfg = std::path::Path::new("/etc/ssh cfg");
        assert_eq!(
            remove_by_hand(&m, Some(cfg), "e-h0"),
            r#"ssh -F '/etc/ssh cfg' -p 2222 -i '/keys/it'\''s' 'ann@gpu 7' docker -H ''\''unix:///run/my docker.sock'\''' rm -f e-h0"#
        );
    }

    #[test]
    fn preflight_names_each_container_left_and_how_to_remove_it() {
        let left = vec![("0123456789ab".to_string(), "e-check-7-h0".to_string())];
        let why = "docker on localhost could not remove a container: 500";
        assert_eq!(
            preflight_left(
                "localhost",
                &machine("localhost"),
                None,
                "e-check-7",
                why,
                Some(&left)
            ),
            vec![
                "warning: preflight container e-check-7-h0 on localhost could not be removed: docker on \
                 localhost could not remove a container: 500; it stops itself once its lease has not been \
                 renewed for 30 s, but stays listed (`docker ps -a`) until removed: run `docker rm -f \
                 e-check-7-h0`"
            ]
        );
        let mut m = machine("th2");
        m.user = Some("ann".into());
        let cfg = std::path::Path::new("/etc/ssh cfg");
        let left = vec![
            ("0123456789ab".to_string(), "e-reach-7-listen".to_string()),
            ("ba9876543210".to_string(), String::new()),
        ];
        let why = "docker on th2 could not remove a container: 500";
        assert_eq!(
            preflight_left("th2", &m, Some(cfg), "e-reach-7", why, Some(&left)),
            vec![
                "warning: preflight container e-reach-7-listen on th2 could not be removed: docker on th2 \
                 could not remove a container: 500; it stops itself once its lease has not been renewed \
                 for 30 s, but stays listed (`docker ps -a`) until removed: run `ssh -F '/etc/ssh cfg' \
                 ann@th2 docker rm -f e-reach-7-listen`",
                "warning: preflight container ba9876543210 on th2 could not be removed: docker on th2 \
                 could not remove a container: 500; it stops itself once its lease has not been renewed \
                 for 30 s, but stays listed (`docker ps -a`) until removed: run `ssh -F '/etc/ssh cfg' \
                 ann@th2 docker rm -f ba9876543210`",
            ]
        );
        let why = "docker on th2 could not list the experiment's containers: connection reset";
        assert_eq!(
            preflight_left("th2", &m, Some(cfg), "e-reach-7", why, None),
            vec![
                "warning: preflight's containers on th2 (label stagehand.experiment=e-reach-7) may not \
                 have been removed, and which are left is not known: docker on th2 could not list the \
                 experiment's containers: connection reset; each stops itself once its lease has not \
                 been renewed for 30 s, but stays listed (`docker ps -a`) until removed"
            ]
        );
    }

    #[test]
    fn preflight_that_ran_out_of_time_names_the_host_the_label_and_the_time() {
        let why = crate::error::error_line(&LaunchError::CleanupTimeout {
            host: "th2".into(),
            wait: PREFLIGHT_REMOVAL_GRACE,
        });
        assert_eq!(
            preflight_left("th2", &machine("th2"), None, "e-check-7", &why, None),
            vec![
                "warning: preflight's containers on th2 (label stagehand.experiment=e-check-7) may not \
                 have been removed, and which are left is not known: removing the experiment's \
                 containers on th2 took longer than 10 s; each stops itself once its lease has not been \
                 renewed for 30 s, but stays listed (`docker ps -a`) until removed"
            ]
        );
    }

    /// A container on the local engine that never starts (an image of one file), labelled with
    /// an experiment of its own, named for the test (`what`): what removes it and its image
    /// however the test ends, the experiment's id and the container's.
    async fn labelled_container(host: &Host, what: &str) -> (Leftovers, String, String) {
        let pid = std::process::id();
        let mut left = Leftovers {
            image: format!("stagehand-unit-{what}:{pid}"),
            containers: Vec::new(),
        };
        one_file_image(&host.docker, &left).await;
        let id = format!("stagehand-unit-{what}-{pid}");
        let options = bollard::query_parameters::CreateContainerOptionsBuilder::default()
            .name(&id)
            .build();
        let body = bollard::models::ContainerCreateBody {
            image: Some(left.image.clone()),
            cmd: Some(vec!["/hello".into()]),
            labels: Some(HashMap::from([(LABEL_EXPERIMENT.to_string(), id.clone())])),
            ..Default::default()
        };
        let cid = host
            .docker
            .create_container(Some(options), body)
            .await
            .unwrap()
            .id;
        left.containers.push(cid.clone());
        (left, id, cid)
    }

    /// Containers of earlier runs that stopped, or never started, are found once they have been
    /// left long enough (here at once, and not within an hour).
    #[tokio::test]
    async fn containers_left_by_earlier_runs_are_found_once_left_long_enough() {
        let host = local_host().await;
        let (_left, name, _) = labelled_container(&host, "left-behind").await;
        let found = left_behind(&host.docker, jiff::SignedDuration::ZERO).await;
        assert!(found.contains(&name), "{found:?}");
        let found = left_behind(&host.docker, jiff::SignedDuration::from_hours(1)).await;
        assert!(!found.contains(&name), "{found:?}");
    }

    /// A grace of zero is one whole try, not none: a failed run's first pass (`stop_all`) removes
    /// with it, and a try cut short there left the ranks running until the lease ran out. Against
    /// the real engine, with a container that never starts.
    #[tokio::test]
    async fn a_grace_of_zero_still_makes_one_whole_try() {
        let host = local_host().await;
        let (_left, id, cid) = labelled_container(&host, "zero-grace").await;
        let pass = remove_on(&host, &crate::hosts::SshOptions::default(), &id, Duration::ZERO).await;
        let failure = pass.failure.map(|(e, _)| crate::error::error_line(&e));
        assert_eq!(failure, None);
        assert_eq!(pass.gone, vec![cid.clone()]);
        let there = host
            .docker
            .inspect_container(&cid, None::<bollard::query_parameters::InspectContainerOptions>)
            .await;
        assert!(
            matches!(
                there,
                Err(DockerError::DockerResponseServerError { status_code: 404, .. })
            ),
            "the engine still has it"
        );
    }

    /// A container whose removal the engine already has in progress (a 409, as when a try that
    /// ran out of time started it) counts as removed only once the engine no longer has it.
    /// Against the real engine: a container holding 20000 files (so its removal takes a while)
    /// is removed by a plain request and, at once, by its label; a wait for one that nobody
    /// removes runs out.
    #[tokio::test]
    async fn a_removal_already_in_progress_counts_once_the_container_is_gone() {
        let host = local_host().await;
        let (_left, id, cid) = labelled_container(&host, "in-progress").await;
        let docker = &host.docker;
        let mut files = tar::Builder::new(Vec::new());
        for n in 0..20_000 {
            let mut header = tar::Header::new_gnu();
            header.set_size(0);
            header.set_mode(0o644);
            header.set_cksum();
            files
                .append_data(&mut header, format!("many/{n}"), std::io::empty())
                .unwrap();
        }
        let tar = bollard::body_full(files.into_inner().unwrap().into());
        let options = bollard::query_parameters::UploadToContainerOptionsBuilder::default()
            .path("/")
            .build();
        docker
            .upload_to_container(&cid, Some(options), tar)
            .await
            .unwrap();

        // A container nobody removes is not gone: the wait runs out, naming the host.
        let started = std::time::Instant::now();
        let stuck = gone_within(docker, &host.name, &cid, Duration::from_secs(1)).await;
        assert!(started.elapsed() >= Duration::from_secs(1));
        assert_eq!(
            stuck.map_err(|e| crate::error::error_line(&e)),
            Err(
                "the engine on localhost was already removing a container, and it was still there 1 s \
                 later"
                    .to_string()
            )
        );

        let options = RemoveContainerOptionsBuilder::default().force(true).build();
        let plain = docker.remove_container(&cid, Some(options));
        let labelled = async {
            // After the plain request has reached the engine.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let pass = remove_labelled(docker, &host.name, &id).await;
            let there = docker
                .inspect_container(&cid, None::<InspectContainerOptions>)
                .await
                .map(|c| c.state.and_then(|s| s.status));
            (pass, there)
        };
        let (plain, (pass, there)) = futures_util::join!(plain, labelled);
        plain.unwrap();
        let failure = pass.failure.map(|(e, _)| crate::error::error_line(&e));
        assert_eq!(failure, None);
        assert_eq!(pass.gone, vec![cid.clone()]);
        assert!(
            matches!(
                there,
                Err(DockerError::DockerResponseServerError { status_code: 404, .. })
            ),
            "counted removed while the engine still had it: {there:?}"
        );
    }

    #[test]
    fn quoting_survives_a_posix_shell_twice() {
        for word in ["plain", "a b", "it's", "$(rm -rf /)", "", "`x`;y"] {
            let once = std::process::Command::new("/bin/sh")
                .args(["-c", &format!("printf %s {}", sh_quote(word))])
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&once.stdout), word);
            let twice = std::process::Command::new("/bin/sh")
                .args([
                    "-c",
                    &format!("sh -c \"printf %s \"{}", sh_quote(&sh_quote(word))),
                ])
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&twice.stdout), word, "{word:?}");
        }
    }
}
