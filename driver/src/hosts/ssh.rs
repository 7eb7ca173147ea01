//! SSH hosts: one multiplexed SSH connection per host (the system `ssh` client as a ControlMaster,
//! driven by the openssh crate over the mux protocol, so `~/.ssh/config`, agents and keys work as
//! with `ssh` and no further ssh process is spawned per request), with the
//! host's Docker socket forwarded to a local unix socket that bollard talks to. Every API call to
//! that host, streams included, goes through the one connection.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bollard::Docker;
use openssh::{ControlPersist, ForwardType, KnownHosts, Session, SessionBuilder, Socket};

use crate::config::machine::HostKeyCheck;
use crate::experiment::HostSpec;

/// Where the Docker socket is on a host unless the machine entry says otherwise.
const DEFAULT_REMOTE_SOCKET: &str = "/var/run/docker.sock";
/// How long a host's SSH connection stays up with nothing going through it (no command, no
/// forwarded Docker API connection) before it ends itself: dropping the tunnel ends it at once,
/// and this bounds it where the driver could not (killed with SIGKILL), where `ssh`'s default
/// would keep it, and the host's Docker socket forwarded here, for ever. Longer than anything
/// the driver waits for on another host with nothing open to this one (an image built there).
const MASTER_IDLE_S: std::num::NonZeroUsize = std::num::NonZeroUsize::new(3600).unwrap();
/// How long the SSH handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout for each Docker API request through the tunnel.
const API_TIMEOUT_S: u64 = 120;

/// Why an SSH host could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    #[error("cannot open an SSH connection to {host}; check that `ssh {host}` works without a password prompt and that its host key is in known_hosts")]
    Connect {
        host: String,
        #[source]
        source: openssh::Error,
    },
    #[error("cannot forward the Docker socket {remote} of {host} over SSH; is the path right (`docker_socket:`) and is stream-local forwarding allowed by its sshd?")]
    Forward {
        host: String,
        remote: String,
        #[source]
        source: openssh::Error,
    },
    #[error("cannot make a local folder for the SSH control socket of {host}")]
    TempDir {
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot talk to the Docker engine of {host} at {socket} through SSH; is the engine running there (`ssh {ssh_host} docker info`), and is `docker_socket:` right?")]
    Docker {
        host: String,
        ssh_host: String,
        socket: String,
        #[source]
        source: Box<bollard::errors::Error>,
    },
    #[error("{host} has no socket at {socket}, where the driver reaches its Docker engine: is the engine running there (`ssh {ssh_host} docker info`), or does it listen elsewhere (`docker_socket:` in the machine's entry)?")]
    NoSocket {
        host: String,
        ssh_host: String,
        socket: String,
    },
    #[error("cannot tell the address {host} is reached at: its SSH_CONNECTION is {seen:?}; set `master_addr:` in the experiment file")]
    NoEndpoints { host: String, seen: String },
}

/// An open SSH connection with the Docker socket forwarded; closed when dropped.
pub struct Tunnel {
    session: Option<Session>,
    /// Holds the control socket and the forwarded socket.
    _dir: tempfile::TempDir,
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        // Dropping the session stops its ControlMaster; nothing else to undo.
        drop(self.session.take());
    }
}

impl Tunnel {
    /// Whether `path` exists on the host (`test -e`, its argument quoted by the openssh crate).
    pub async fn path_exists(&self, host: &str, path: &std::path::Path) -> Result<bool, SshError> {
        let session = self.session.as_ref().expect("a live tunnel has a session");
        let status = session
            .command("test")
            .arg("-e")
            .arg(path.display().to_string())
            .status()
            .await
            .map_err(|source| SshError::Connect {
                host: host.to_string(),
                source,
            })?;
        Ok(status.success())
    }
}

/// How long a quick question to the host ([`Tunnel::answers`], [`Tunnel::is_socket`]) waits for
/// its answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

impl Tunnel {
    /// Whether `program` with `args` succeeds on the host (its arguments quoted by the openssh
    /// crate); `None` when the host does not answer within [`ANSWER_TIMEOUT`].
    async fn succeeds(&self, program: &str, args: &[&str]) -> Option<bool> {
        let session = self.session.as_ref()?;
        let mut command = session.command(program);
        command.args(args);
        match tokio::time::timeout(ANSWER_TIMEOUT, command.status()).await {
            Ok(Ok(status)) => Some(status.success()),
            _ => None,
        }
    }

    /// Whether the host still runs a command over this connection (`true`): when its Docker
    /// engine stopped answering, whether the host did too.
    pub async fn answers(&self) -> bool {
        self.succeeds("true", &[]).await == Some(true)
    }

    /// Whether `path` is a socket on the host (`test -S`); `None` when the host cannot say.
    async fn is_socket(&self, path: &std::path::Path) -> Option<bool> {
        self.succeeds("test", &["-S", &path.display().to_string()]).await
    }
}

impl Tunnel {
    /// The two ends of this SSH connection as the host sees them (its `SSH_CONNECTION`): the
    /// address it sees this machine at, and its own address this machine reached it at.
    pub async fn endpoints(&self, host: &str) -> Result<Endpoints, SshError> {
        let session = self.session.as_ref().expect("a live tunnel has a session");
        let output = session
            .command("printenv")
            .arg("SSH_CONNECTION")
            .output()
            .await
            .map_err(|source| SshError::Connect {
                host: host.to_string(),
                source,
            })?;
        let text = String::from_utf8_lossy(&output.stdout);
        Endpoints::parse(&text).ok_or_else(|| SshError::NoEndpoints {
            host: host.to_string(),
            seen: text.trim().to_string(),
        })
    }
}

/// Both ends of an SSH connection, from `SSH_CONNECTION` (`client port server port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// This machine's address as the host sees it.
    pub client: String,
    /// The host's own address on the connection.
    pub server: String,
}

impl Endpoints {
    fn parse(text: &str) -> Option<Endpoints> {
        let words: Vec<&str> = text.split_whitespace().collect();
        match words[..] {
            [client, _, server, _] => Some(Endpoints {
                client: client.to_string(),
                server: server.to_string(),
            }),
            _ => None,
        }
    }
}

impl Tunnel {
    /// Whether nothing listens on `port` of the host's loopback: a forwarded connection to it is
    /// refused (closed at once) when the port is free, and stays open when something listens.
    pub async fn port_free(&self, port: u16) -> Result<bool, openssh::Error> {
        let session = self.session.as_ref().expect("a live tunnel has a session");
        let local = crate::experiment::free_local_port().map_err(openssh::Error::Connect)?;
        let listen = Socket::TcpSocket {
            host: "127.0.0.1".into(),
            port: local,
        };
        let remote = Socket::TcpSocket {
            host: "127.0.0.1".into(),
            port,
        };
        session
            .request_port_forward(ForwardType::Local, listen.clone(), remote.clone())
            .await?;
        let free = probe(local).await;
        let _ = session
            .close_port_forward(ForwardType::Local, listen, remote)
            .await;
        Ok(free)
    }
}

/// Connects to the local end of a forward and waits briefly: closed at once means refused.
async fn probe(local: u16) -> bool {
    use tokio::io::AsyncReadExt;
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", local)).await else {
        return true;
    };
    let mut byte = [0u8; 1];
    match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut byte)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        Ok(Ok(_)) | Err(_) => false,
    }
}

/// SSH settings that apply to every host.
#[derive(Debug, Clone, Default)]
pub struct SshOptions {
    /// An ssh_config file to use instead of `~/.ssh/config` (`ssh -F`).
    pub config_file: Option<PathBuf>,
}

/// Opens the connection and returns a Docker handle through it, plus the tunnel to keep alive.
pub async fn connect(host: &HostSpec, options: &SshOptions) -> Result<(Docker, Arc<Tunnel>), SshError> {
    let m = &host.machine;
    let dir = tempfile::Builder::new()
        .prefix("stagehand-ssh-")
        .tempdir()
        .map_err(|source| SshError::TempDir {
            host: host.name.clone(),
            source,
        })?;
    let mut builder = SessionBuilder::default();
    builder
        .control_directory(dir.path())
        .control_persist(ControlPersist::IdleFor(MASTER_IDLE_S))
        .connect_timeout(CONNECT_TIMEOUT)
        .server_alive_interval(Duration::from_secs(5))
        .known_hosts_check(match m.host_key_check {
            HostKeyCheck::Strict => KnownHosts::Strict,
            HostKeyCheck::AcceptNew => KnownHosts::Add,
        });
    if let Some(user) = &m.user {
        builder.user(user.clone());
    }
    if let Some(port) = m.port {
        builder.port(port);
    }
    if let Some(key) = &m.identity_file {
        builder.keyfile(key);
    }
    if let Some(config) = &options.config_file {
        builder.config_file(config);
    }
    let session = builder
        .connect_mux(&m.host)
        .await
        .map_err(|source| SshError::Connect {
            host: host.name.clone(),
            source,
        })?;

    let remote = m
        .docker_socket
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_REMOTE_SOCKET));
    let local = dir.path().join("docker.sock");
    session
        .request_port_forward(
            ForwardType::Local,
            Socket::UnixSocket {
                path: local.as_path().into(),
            },
            Socket::UnixSocket {
                path: remote.as_path().into(),
            },
        )
        .await
        .map_err(|source| SshError::Forward {
            host: host.name.clone(),
            remote: remote.display().to_string(),
            source,
        })?;
    let tunnel = Arc::new(Tunnel {
        session: Some(session),
        _dir: dir,
    });
    let socket = remote.display().to_string();
    let unreached = |source| SshError::Docker {
        host: host.name.clone(),
        ssh_host: m.host.clone(),
        socket: socket.clone(),
        source: Box::new(source),
    };
    let docker = Docker::connect_with_unix(
        &local.display().to_string(),
        API_TIMEOUT_S,
        bollard::API_DEFAULT_VERSION,
    )
    .map_err(unreached)?;
    match docker.negotiate_version().await {
        Ok(docker) => Ok((docker, tunnel)),
        // sshd takes the forward before it opens the socket: a socket that is not there is only
        // seen now, as a connection reset, and is named as such.
        Err(source) => match tunnel.is_socket(&remote).await {
            Some(false) => Err(SshError::NoSocket {
                host: host.name.clone(),
                ssh_host: m.host.clone(),
                socket,
            }),
            _ => Err(unreached(source)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssh_connection_gives_both_ends() {
        let e = Endpoints::parse("10.77.0.1 51234 10.77.0.11 22\n").unwrap();
        assert_eq!(
            (e.client.as_str(), e.server.as_str()),
            ("10.77.0.1", "10.77.0.11")
        );
        let v6 = Endpoints::parse("fe80::1 40000 fe80::2 22").unwrap();
        assert_eq!(v6.server, "fe80::2");
        assert_eq!(Endpoints::parse(""), None);
        assert_eq!(Endpoints::parse("10.0.0.1 22"), None);
    }
}
