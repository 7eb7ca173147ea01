//! `runtime reach`: the driver's preflight proof that every host reaches the master port where
//! rank 0 will listen. `listen` holds the port on the first host for a while and greets whoever
//! connects; `connect` (on every host, with the address the ranks will use) retries until it is
//! greeted or its time is up, and says why not.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::config::ReachConfig;

/// What the listener sends, so that `connect` knows it reached this listener and not something
/// else on the port.
pub const GREETING: &[u8] = b"stagehand-reach\n";

/// Runs it; `Ok` when the listener ran its time or the connection was greeted.
pub fn run(config: &ReachConfig, out: &mut impl Write) -> anyhow::Result<()> {
    match config {
        ReachConfig::Listen { port, seconds } => listen(*port, Duration::from_secs_f64(*seconds), out),
        ReachConfig::Connect { host, port, seconds } => {
            connect(host, *port, Duration::from_secs_f64(*seconds))?;
            writeln!(out, "reached {host}:{port}")?;
            Ok(())
        }
    }
}

fn listen(port: u16, period: Duration, out: &mut impl Write) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| anyhow::anyhow!("cannot listen on port {port}: {e}"))?;
    listener.set_nonblocking(true)?;
    // Port 0 is the system's pick: the port it picked is the one to connect to.
    let port = listener.local_addr().map_or(port, |a| a.port());
    writeln!(out, "listening on port {port}")?;
    out.flush()?;
    let end = Instant::now() + period;
    while Instant::now() < end {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false)?;
                let _ = stream.write_all(GREETING);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// `connect`'s last try could not resolve the host's name (`main` exits
/// [`stagehand_contract::exit_codes::UNRESOLVED`]).
#[derive(Debug)]
pub struct Unresolved(String);

impl std::fmt::Display for Unresolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unresolved {}

/// Why one try to connect failed.
enum Missed {
    /// The name did not resolve to an address.
    Unresolved(String),
    /// The address did not answer, or not with the greeting.
    Unreached(String),
}

fn connect(host: &str, port: u16, period: Duration) -> anyhow::Result<()> {
    let end = Instant::now() + period;
    loop {
        let last = match attempt(host, port, end) {
            Ok(()) => return Ok(()),
            Err(why) => why,
        };
        if Instant::now() >= end {
            return Err(match last {
                Missed::Unresolved(why) => Unresolved(format!("cannot reach {host}:{port}: {why}")).into(),
                Missed::Unreached(why) => anyhow::anyhow!("cannot reach {host}:{port}: {why}"),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn attempt(host: &str, port: u16, end: Instant) -> Result<(), Missed> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| Missed::Unresolved(format!("cannot resolve {host}: {e}")))?
        .collect();
    let addr = addrs
        .first()
        .ok_or_else(|| Missed::Unresolved(format!("{host} has no address")))?;
    let unreached = |e: std::io::Error| Missed::Unreached(e.to_string());
    let left = end
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    let stream = TcpStream::connect_timeout(addr, left.min(Duration::from_secs(3))).map_err(unreached)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .map_err(unreached)?;
    let mut got = Vec::new();
    let _ = stream.take(GREETING.len() as u64).read_to_end(&mut got);
    if got == GREETING {
        Ok(())
    } else {
        Err(Missed::Unreached(format!(
            "something else answers on port {port}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// What a listener writes, line by line as it writes it.
    struct Lines(std::sync::mpsc::Sender<Vec<u8>>);

    impl Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.send(bytes.to_vec());
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// `listen --port 0` says the port the system picked, which is then reached.
    #[test]
    fn a_listener_on_port_0_says_the_port_it_holds() {
        let (tx, rx) = std::sync::mpsc::channel();
        let listener = std::thread::spawn(move || listen(0, Duration::from_secs(3), &mut Lines(tx)));
        let mut said = String::new();
        while !said.ends_with('\n') {
            said.push_str(&String::from_utf8(rx.recv().unwrap()).unwrap());
        }
        let port: u16 = said
            .trim()
            .strip_prefix("listening on port ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("{said:?}"));
        assert_ne!(port, 0, "{said:?}");
        connect("127.0.0.1", port, Duration::from_secs(2)).unwrap();
        listener.join().unwrap().unwrap();
    }

    #[test]
    fn a_listener_is_reached_and_greets() {
        let port = free_port();
        let listener = std::thread::spawn(move || {
            let mut out = Vec::new();
            run(&ReachConfig::Listen { port, seconds: 3.0 }, &mut out).unwrap();
        });
        // The connector retries until the listener is up.
        let mut out = Vec::new();
        run(
            &ReachConfig::Connect {
                host: "127.0.0.1".into(),
                port,
                seconds: 5.0,
            },
            &mut out,
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("reached 127.0.0.1:{port}\n")
        );
        listener.join().unwrap();
    }

    #[test]
    fn nothing_listening_fails_with_the_reason() {
        let port = free_port();
        let err = connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("cannot reach 127.0.0.1:{port}")),
            "{err}"
        );
    }

    /// A name that resolves nowhere (`.invalid` is reserved for that, RFC 2606) is an
    /// `Unresolved` error, which `main` exits with its own code; a port nobody listens on is not.
    #[test]
    fn a_name_that_does_not_resolve_is_told_from_a_port_nobody_answers() {
        let err = connect("stagehand-master.invalid", 29500, Duration::from_millis(300)).unwrap_err();
        let unresolved = err.downcast_ref::<Unresolved>();
        assert!(unresolved.is_some(), "{err:?}");
        assert!(
            err.to_string().starts_with(
                "cannot reach stagehand-master.invalid:29500: cannot resolve stagehand-master.invalid"
            ),
            "{err}"
        );
        let port = free_port();
        let err = connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
        assert!(err.downcast_ref::<Unresolved>().is_none(), "{err}");
    }

    #[test]
    fn another_server_on_the_port_is_not_mistaken_for_the_listener() {
        let server = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = server.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in server.incoming().flatten() {
                let mut s = stream;
                let _ = s.write_all(b"SSH-2.0-other\n");
            }
        });
        let err = connect("127.0.0.1", port, Duration::from_millis(500)).unwrap_err();
        assert!(err.to_string().contains("something else answers"), "{err}");
    }
}
