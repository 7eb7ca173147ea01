//! SSH hosts: a real sshd on loopback, several loopback addresses as distinct hosts, each reached
//! through one SSH connection forwarding its Docker socket.

use std::time::{Duration, Instant};

use crate::util::sshd::{Sshd, BARE, TRUSTED, UNKNOWN_KEY, UNREACHABLE};
use crate::util::*;

fn config(h: &Harness, machines: &[&str], args: &str) -> std::path::PathBuf {
    base_image();
    h.config(&format!(
        "machines: [{}]\ncontainer: {{build: '{}'}}\ncommand: ['{FAKE_RANK}', {args}]\n",
        machines.join(", "),
        local_context().display()
    ))
}

#[test]
fn two_ssh_hosts_run_their_ranks_in_both_container_modes() {
    let sshd = Sshd::start();
    let ssh_config = sshd.config();
    for mode in [&[][..], &["--launch-single-container"][..]] {
        let h = Harness::new("ssh-ok");
        let exp = config(&h, &TRUSTED[..2], "--iterations, '3'");
        let mut args = vec!["--ssh-config", ssh_config.to_str().unwrap()];
        args.extend_from_slice(mode);
        let run = h.run(&exp, &args);
        assert_eq!(run.code(), 0, "{mode:?}: {}", run.stderr());
        let (dir, summary) = h.summary();
        assert_eq!(summary["status"], "succeeded");
        assert_eq!(summary["ranks"][1]["host"], TRUSTED[1]);
        let hosts: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("hosts.json")).unwrap()).unwrap();
        assert_eq!(hosts.as_array().unwrap().len(), 2, "{hosts}");
        // The master is the first machine, as the other ranks reach it.
        let log = std::fs::read_to_string(dir.join("rank-1.log")).unwrap();
        assert!(log.contains(&format!("master {}:", TRUSTED[0])), "{log}");
        assert!(
            run.stderr().contains(&format!("[{} r1]", TRUSTED[1])),
            "{}",
            run.stderr()
        );
        h.assert_no_containers();
    }
}

#[test]
fn an_unreachable_host_fails_preflight_and_starts_nothing_anywhere() {
    let sshd = Sshd::start();
    let h = Harness::new("ssh-unreachable");
    let exp = config(&h, &[TRUSTED[0], UNREACHABLE], "--iterations, '3'");
    let run = h.run(&exp, &["--ssh-config", sshd.config().to_str().unwrap()]);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains(&format!("cannot open an SSH connection to {UNREACHABLE}")),
        "{}",
        run.stderr()
    );
    assert!(run.stderr().contains("nothing was started"), "{}", run.stderr());
    assert!(!h.records().exists());
    h.assert_no_containers();
}

#[test]
fn an_unknown_host_key_is_refused() {
    let sshd = Sshd::start();
    let h = Harness::new("ssh-hostkey");
    let exp = config(&h, &[UNKNOWN_KEY], "--iterations, '1'");
    let run = h.run(&exp, &["--ssh-config", sshd.config().to_str().unwrap()]);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains(&format!("cannot open an SSH connection to {UNKNOWN_KEY}")),
        "{}",
        run.stderr()
    );
    h.assert_no_containers();
}

#[test]
fn a_killed_ssh_session_fails_the_run_and_every_container_is_removed() {
    let sshd = Sshd::start();
    let h = Harness::new("ssh-lost");
    let exp = config(&h, &TRUSTED[..2], "--iterations, '1', --hang");
    let child = h.spawn(&exp, &["--ssh-config", sshd.config().to_str().unwrap()]);
    h.wait_for_running(2, Duration::from_secs(60));
    let record = wait_for_record(&h.records(), Duration::from_secs(10));
    wait_for_text(&record.join("rank-1.log"), "hanging", Duration::from_secs(20));
    let killed_at = Instant::now();
    assert!(sshd.kill_sessions() > 0, "no SSH session to kill");
    let (_, summary) = h.expect_stop(child, killed_at, Duration::from_secs(10), 1);
    assert_eq!(summary["status"], "failed");
    assert_eq!(summary["failure"]["cause"]["kind"], "host_lost", "{summary}");
    h.assert_no_containers();
}

#[test]
fn code_is_copied_into_containers_on_a_host_that_lacks_it() {
    let sshd = Sshd::start();
    let ssh_config = sshd.config();
    for mode in [&[][..], &["--launch-single-container"][..]] {
        let h = Harness::new("ssh-copy");
        let exp = config(&h, &[TRUSTED[0], BARE], "--iterations, '2'");
        let mut args = vec!["--ssh-config", ssh_config.to_str().unwrap()];
        args.extend_from_slice(mode);
        let run = h.run(&exp, &args);
        assert_eq!(run.code(), 0, "{mode:?}: {}", run.stderr());
        let (dir, summary) = h.summary();
        assert_eq!(summary["status"], "succeeded");
        let hosts: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("hosts.json")).unwrap()).unwrap();
        let copied = |host: &str| {
            let h = hosts
                .as_array()
                .unwrap()
                .iter()
                .find(|h| h["host"] == host)
                .unwrap();
            h["copied_in"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(copied(BARE), vec![FAKE_RANK.to_string()], "{hosts}");
        assert!(copied(TRUSTED[0]).is_empty(), "{hosts}");
        assert!(std::fs::read_to_string(dir.join("rank-1.log"))
            .unwrap()
            .contains("iteration 1 done"));
        h.assert_no_containers();
    }
}

/// A machine whose Docker socket is not where its entry says: sshd takes the forward and resets
/// the connection, and preflight names the host and the path rather than the reset.
#[test]
fn a_docker_socket_that_is_not_there_is_named_at_preflight() {
    let sshd = Sshd::start();
    let h = Harness::new("ssh-nosocket");
    base_image();
    let exp = h.config(&format!(
        "machines: [{{host: {BARE}, docker_socket: /run/dockr.sock}}]\ncontainer: {{build: '{}'}}\n\
         command: ['{FAKE_RANK}']\n",
        local_context().display()
    ));
    let run = h.run(&exp, &["--ssh-config", sshd.config().to_str().unwrap()]);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr().contains(&format!(
            "{BARE} has no socket at /run/dockr.sock, where the driver reaches its Docker engine"
        )),
        "{}",
        run.stderr()
    );
    h.assert_no_containers();
}

#[test]
fn a_data_dir_missing_on_a_host_fails_preflight() {
    let sshd = Sshd::start();
    let h = Harness::new("ssh-nodata");
    base_image();
    let data = h.dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let exp = h.config(&format!(
        "machines: [{BARE}]\ncontainer: {{build: '{}'}}\ndata_dir: data\ncommand: ['{FAKE_RANK}']\n",
        local_context().display()
    ));
    let run = h.run(&exp, &["--ssh-config", sshd.config().to_str().unwrap()]);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains(&format!("{} does not exist on {BARE}", data.display())),
        "{}",
        run.stderr()
    );
    h.assert_no_containers();
}

#[test]
fn a_master_port_in_use_on_the_first_host_fails_preflight() {
    let sshd = Sshd::start();
    // The "remote" host is this machine, so a port held here is held there.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let h = Harness::new("ssh-port");
    let exp = config(&h, &TRUSTED[..2], "--iterations, '1'");
    let run = h.run(
        &exp,
        &[
            "--ssh-config",
            sshd.config().to_str().unwrap(),
            "--master-port",
            &port,
        ],
    );
    assert_eq!(run.code(), 3, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains(&format!("master port {port} is in use on {}", TRUSTED[0])),
        "{}",
        run.stderr()
    );
    h.assert_no_containers();
    // A free port passes the same check.
    drop(taken);
    let run = h.run(
        &exp,
        &[
            "--ssh-config",
            sshd.config().to_str().unwrap(),
            "--master-port",
            &port,
        ],
    );
    assert_eq!(run.code(), 0, "{}", run.stderr());
    h.assert_no_containers();
}

#[test]
fn every_host_is_connected_to_at_once() {
    let sshd = Sshd::start();
    let h = Harness::new("ssh-concurrent");
    // An `ssh` first on the driver's PATH that logs when each invocation began and returned. The
    // master connection (`-M`) returns once the host has accepted it (it forks into the
    // background after authenticating): that interval is the first part of preparing the host.
    let bin = h.dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let log = h.dir.path().join("ssh.log");
    std::fs::write(
        bin.join("ssh"),
        format!(
            "#!/bin/sh\nstart=$(date +%s.%N)\n/usr/bin/ssh \"$@\"\nrc=$?\n\
             echo \"$start $(date +%s.%N) $*\" >> '{}'\nexit $rc\n",
            log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        bin.join("ssh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let exp = config(&h, &TRUSTED, "--iterations, '1'");
    let records = h.records();
    let ssh_config = sshd.config();
    let run = h.driver_with_env(
        &[
            "--config-file".as_ref(),
            exp.as_os_str(),
            "--output-dir".as_ref(),
            records.as_os_str(),
            "--ssh-config".as_ref(),
            ssh_config.as_os_str(),
        ],
        &[("PATH", &path)],
        Duration::from_secs(120),
    );
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let text = std::fs::read_to_string(&log).expect("the driver ran ssh through the wrapper");
    // Each host's first master connection: (began, returned) in seconds.
    let mut connects: Vec<(String, f64, f64)> = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let host = words.last().unwrap().to_string();
        if words.contains(&"-M") && !connects.iter().any(|(h, _, _)| *h == host) {
            connects.push((host, words[0].parse().unwrap(), words[1].parse().unwrap()));
        }
    }
    let mut hosts: Vec<&str> = connects.iter().map(|(h, _, _)| h.as_str()).collect();
    hosts.sort();
    assert_eq!(hosts, TRUSTED, "one master connection per host: {text}");
    // Each ends itself once idle for an hour, so a driver killed outright leaves none for ever.
    let masters = text.lines().filter(|l| l.split_whitespace().any(|w| w == "-M"));
    assert!(masters.clone().count() >= TRUSTED.len(), "{text}");
    for master in masters {
        assert!(master.contains("ControlPersist=3600s"), "{master}");
    }
    // Connected one after another, the intervals would not overlap and the whole would span at
    // least their sum; connected together they overlap and span less. Both are measured in the
    // same run, so a busy machine stretches them alike.
    let sum: f64 = connects.iter().map(|(_, b, e)| e - b).sum();
    let first = connects.iter().map(|(_, b, _)| *b).fold(f64::INFINITY, f64::min);
    let last = connects.iter().map(|(_, _, e)| *e).fold(0.0, f64::max);
    let span = last - first;
    eprintln!("connections span {span:.3} s, sum of the connections {sum:.3} s");
    assert!(span < sum, "the hosts were connected one at a time: {text}");
    h.assert_no_containers();
}
