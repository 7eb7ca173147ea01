//! The multi-host test bed (scripts/testbed, docs/testbed.md) for the tests: hosts th1..thN, each
//! a network namespace with its own Docker engine and sshd, reached as `ssh thI` through the block
//! the script writes into ~/.ssh/config. A test holds the bed from `up` until its `Bed` is dropped,
//! which takes the bed down again; a lock file keeps every other test, in this process or another
//! (a second checkout's tests), from touching the bed meanwhile.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

use super::workspace;

/// Held by the test that owns the bed.
pub const LOCK: &str = "/run/lock/stagehand-testbed-tests.lock";
/// `scripts/testbed check` exits with this where the bed cannot be built.
const UNAVAILABLE: i32 = 3;

/// The script.
pub fn script() -> PathBuf {
    workspace().join("scripts/testbed")
}

/// Runs the script with `args`, killing it past `deadline`.
pub fn testbed(args: &[&str], deadline: Duration) -> Output {
    let child = Command::new(script())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run scripts/testbed");
    finish(child, deadline, &format!("scripts/testbed {}", args.join(" ")))
}

/// Waits for a child, killing it past the deadline so a hung command fails the test.
fn finish(mut child: Child, deadline: Duration, what: &str) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "{what} did not finish within {deadline:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// Text of an output's stream.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

/// The bed, up, for one test.
pub struct Bed {
    /// Its hosts' names, th1..thN.
    pub hosts: Vec<String>,
    /// Taken down already (by `down`).
    down: bool,
    /// Released after Drop has taken the bed down.
    _lock: Flock<File>,
}

/// Takes the bed for `test` and brings it up with `hosts` hosts, or says `SKIPPED` and returns
/// None where this machine cannot build it (not root, no dockerd, ...). Any other failure fails the
/// test.
pub fn up(test: &str, hosts: usize) -> Option<Bed> {
    let check = testbed(&["check"], Duration::from_secs(30));
    match check.status.code() {
        Some(0) => {}
        Some(UNAVAILABLE) => {
            eprintln!("SKIPPED {test}: {}", text(&check.stderr));
            return None;
        }
        _ => panic!("scripts/testbed check failed: {}", text(&check.stderr)),
    }
    let file = File::create(LOCK).unwrap_or_else(|e| panic!("cannot create {LOCK}: {e}"));
    let lock =
        Flock::lock(file, FlockArg::LockExclusive).unwrap_or_else(|(_, e)| panic!("cannot lock {LOCK}: {e}"));
    let bed = Bed {
        hosts: (1..=hosts).map(|i| format!("th{i}")).collect(),
        down: false,
        _lock: lock,
    };
    let out = testbed(&["up", &hosts.to_string()], Duration::from_secs(180));
    assert!(
        out.status.success(),
        "scripts/testbed up {hosts} failed:\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    Some(bed)
}

impl Bed {
    /// Runs `command` (remote shell text) on `host` over ssh, as a user would.
    pub fn ssh(&self, host: &str, command: &str) -> Output {
        self.ssh_with_input(host, command, &[])
    }

    /// Runs `command` on `host` with `input` on its stdin.
    pub fn ssh_with_input(&self, host: &str, command: &str, input: &[u8]) -> Output {
        let mut child = Command::new("ssh")
            .args(["-o", "ConnectTimeout=3", host, command])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("ssh (apt-get install openssh-client)");
        let mut stdin = child.stdin.take().unwrap();
        // A host that dies early closes the pipe; its exit status says why.
        let _ = stdin.write_all(input);
        drop(stdin);
        finish(child, Duration::from_secs(120), &format!("ssh {host} {command}"))
    }

    /// `command`'s stdout on `host`, which must succeed.
    pub fn ssh_ok(&self, host: &str, command: &str) -> String {
        let out = self.ssh(host, command);
        assert!(
            out.status.success(),
            "ssh {host} {command}: exit {:?}: {}",
            out.status.code(),
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// The address of `host`, as its ssh alias names it.
    pub fn address(&self, host: &str) -> String {
        let out = Command::new("ssh").args(["-G", host]).output().expect("ssh -G");
        text(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("hostname "))
            .unwrap_or_else(|| panic!("no address for {host} in `ssh -G {host}`"))
            .to_string()
    }

    /// The driver machine's address on the bed's network (the bridge: the hosts' /24, `.1`).
    pub fn gateway(&self) -> String {
        let address = self.address(&self.hosts[0]);
        let (net, _) = address.rsplit_once('.').expect("an IPv4 address");
        format!("{net}.1")
    }

    /// Whether `from` opens a TCP connection to `address:port` within 3 s.
    pub fn reaches(&self, from: &str, address: &str, port: u16) -> bool {
        self.ssh(from, &format!("timeout 3 bash -c '</dev/tcp/{address}/{port}'"))
            .status
            .success()
    }

    /// Sets `host`'s link down (`scripts/testbed cut`).
    pub fn cut(&self, host: &str) {
        let out = testbed(&["cut", host], Duration::from_secs(30));
        assert!(out.status.success(), "cut {host}: {}", text(&out.stderr));
    }

    /// Sets `host`'s link up again (`scripts/testbed heal`).
    pub fn heal(&self, host: &str) {
        let out = testbed(&["heal", host], Duration::from_secs(30));
        assert!(out.status.success(), "heal {host}: {}", text(&out.stderr));
    }

    /// Stops `host`'s Docker engine, sshd running on (`scripts/testbed stop-engine`); the next
    /// `up` starts it again.
    pub fn stop_engine(&self, host: &str) {
        let out = testbed(&["stop-engine", host], Duration::from_secs(90));
        assert!(out.status.success(), "stop-engine {host}: {}", text(&out.stderr));
    }

    /// Takes the bed down (the lock stays held until the bed is dropped) and returns what the
    /// script said.
    pub fn down(&mut self) -> Output {
        self.down = true;
        testbed(&["down"], Duration::from_secs(180))
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        if self.down {
            return;
        }
        // A failed assertion must not leave the bed up for the next test.
        let out = testbed(&["down"], Duration::from_secs(180));
        if !out.status.success() && !std::thread::panicking() {
            panic!("scripts/testbed down failed: {}", text(&out.stderr));
        }
    }
}
