//! A real sshd on loopback for the SSH tests: generated host and client keys, several loopback
//! addresses acting as distinct hosts, and an ssh_config the driver is pointed at with
//! `--ssh-config`. The "remote" Docker engine is this machine's, reached through the tunnel.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running sshd; stopped when dropped.
pub struct Sshd {
    dir: tempfile::TempDir,
    child: Child,
    /// The port it listens on, on every address.
    pub port: u16,
}

/// Addresses sshd listens on and whose host key the client trusts.
pub const TRUSTED: [&str; 4] = ["127.0.0.2", "127.0.0.3", "127.0.0.6", "127.0.0.7"];
/// An address sshd listens on whose host key the client does not know.
pub const UNKNOWN_KEY: &str = "127.0.0.4";
/// A trusted address where every `test -e PATH` fails (a ForceCommand wrapper), so every path
/// looks missing there: the driver must copy code in instead of mounting it.
pub const BARE: &str = "127.0.0.5";
/// An address nothing listens on.
pub const UNREACHABLE: &str = "127.0.0.9";

fn keygen(path: &Path) {
    let status = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .expect("ssh-keygen (apt-get install openssh-client)");
    assert!(status.success());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn sshd_binary() -> PathBuf {
    let path = PathBuf::from("/usr/sbin/sshd");
    assert!(
        path.exists(),
        "the SSH tests need sshd: apt-get install openssh-server (scripts/setup.sh does)"
    );
    path
}

impl Sshd {
    pub fn start() -> Sshd {
        let sshd = sshd_binary();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        keygen(&d.join("host_key"));
        keygen(&d.join("id_ed25519"));
        std::fs::copy(d.join("id_ed25519.pub"), d.join("authorized_keys")).unwrap();
        // Privilege separation needs this folder when sshd runs as root.
        let _ = std::fs::create_dir_all("/run/sshd");
        let bare = d.join("bare.sh");
        std::fs::write(
            &bare,
            "#!/bin/sh\ncase \"$SSH_ORIGINAL_COMMAND\" in\n    test\\ *) exit 1 ;;\nesac\n\
             exec /bin/sh -c \"$SSH_ORIGINAL_COMMAND\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&bare, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let port = free_port();
        let listen: String = TRUSTED
            .iter()
            .chain([&UNKNOWN_KEY, &BARE])
            .map(|a| format!("ListenAddress {a}\n"))
            .collect();
        std::fs::write(
            d.join("sshd_config"),
            format!(
                "Port {port}\n{listen}HostKey {0}/host_key\nAuthorizedKeysFile {0}/authorized_keys\n\
                 PidFile {0}/sshd.pid\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n\
                 AllowStreamLocalForwarding yes\nLogLevel ERROR\n\
                 Match LocalAddress {BARE}\n  ForceCommand {0}/bare.sh\n",
                d.display()
            ),
        )
        .unwrap();
        let host_key = std::fs::read_to_string(d.join("host_key.pub")).unwrap();
        let host_key: Vec<&str> = host_key.split_whitespace().take(2).collect();
        let known: String = TRUSTED
            .iter()
            .chain([&BARE])
            .map(|a| format!("[{a}]:{port} {}\n", host_key.join(" ")))
            .collect();
        std::fs::write(d.join("known_hosts"), known).unwrap();
        let user = std::env::var("USER").unwrap_or_else(|_| "root".into());
        std::fs::write(
            d.join("ssh_config"),
            format!(
                "Host 127.0.0.*\n  Port {port}\n  User {user}\n  IdentityFile {0}/id_ed25519\n  \
                 IdentitiesOnly yes\n  UserKnownHostsFile {0}/known_hosts\n  GlobalKnownHostsFile /dev/null\n",
                d.display()
            ),
        )
        .unwrap();
        let child = Command::new(sshd)
            .args(["-D", "-e", "-f"])
            .arg(d.join("sshd_config"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sshd");
        let start = Instant::now();
        while TcpStream::connect((TRUSTED[0], port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "sshd did not start listening"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Sshd { dir, child, port }
    }

    /// The ssh_config to give the driver.
    pub fn config(&self) -> PathBuf {
        self.dir.path().join("ssh_config")
    }

    /// Kills every session sshd is serving (its children), as a dropped connection would,
    /// leaving the listener up so the driver can connect again to clean up.
    pub fn kill_sessions(&self) -> usize {
        let mut killed = 0;
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // Field 4 (after the parenthesised name) is the parent pid.
            let Some(after) = stat.rsplit_once(')').map(|(_, a)| a.to_string()) else {
                continue;
            };
            let ppid: Option<u32> = after.split_whitespace().nth(1).and_then(|p| p.parse().ok());
            if ppid == Some(self.child.id()) {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                killed += 1;
            }
        }
        killed
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
