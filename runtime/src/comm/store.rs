//! The rendezvous store: c10d's TCPStore, hosted by rank 0 and reached by every other rank.

use std::ffi::CString;
use std::net::TcpListener;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use super::{millis, CommError};
use crate::ffi;

/// A connection to the job's TCPStore. Rank 0 hosts it (and must outlive everyone's use of it);
/// the key/value operations are thread-safe.
pub struct Store {
    raw: NonNull<ffi::RawStore>,
    addr: String,
    port: u16,
    world_size: usize,
    timeout: Duration,
    /// How many world groups this rank has created on the store, so each gets its own key space.
    world_groups: AtomicUsize,
    /// The run's own key space on the store (`--run-id`), empty for none: a rank of another run
    /// that reaches this store (two runs given one port) then meets none of this run's keys.
    namespace: String,
}

// SAFETY: c10d::TCPStore serialises its operations with an internal mutex, and the handle is only
// freed by Drop.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Rank 0 listens on `addr:port`; others connect. Fails (no hang) after `timeout`.
    ///
    /// Rank 0 returns once all `world_size` ranks have connected; the others return once
    /// connected. `port` 0 on rank 0 picks a free port (see [`Store::port`]).
    pub fn connect(
        addr: &str,
        port: u16,
        world_size: usize,
        is_master: bool,
        timeout: Duration,
    ) -> Result<Store, CommError> {
        Self::open(addr, port, world_size, is_master, timeout, None)
    }

    /// Rank 0's side of [`Store::connect`] on a socket the caller already bound, so there is no
    /// window in which another process can take the port (tests, launchers that pick a port).
    pub fn host(listener: TcpListener, world_size: usize, timeout: Duration) -> Result<Store, CommError> {
        use std::os::fd::IntoRawFd;
        let local = listener.local_addr().map_err(|e| CommError::Rendezvous {
            addr: "?".into(),
            port: 0,
            reason: format!("the given listener has no local address: {e}"),
        })?;
        let fd = listener.into_raw_fd();
        Self::open(
            &local.ip().to_string(),
            local.port(),
            world_size,
            true,
            timeout,
            Some(fd),
        )
    }

    fn open(
        addr: &str,
        port: u16,
        world_size: usize,
        is_master: bool,
        timeout: Duration,
        listen_fd: Option<i32>,
    ) -> Result<Store, CommError> {
        let fail = |reason: String| CommError::Rendezvous {
            addr: addr.to_string(),
            port,
            reason,
        };
        if world_size == 0 {
            return Err(fail("the world size is 0".into()));
        }
        let host = CString::new(addr).map_err(|_| fail("the address contains a NUL byte".into()))?;
        // A name that does not resolve would otherwise read as rank 0 not answering, after the
        // whole timeout.
        if !is_master {
            if let Err(e) = std::net::ToSocketAddrs::to_socket_addrs(&(addr, port)) {
                return Err(fail(format!(
                    "{addr} does not resolve to an address ({e}); give --master-addr (MASTER_ADDR) as \
                     rank 0's host name or IP address"
                )));
            }
        }
        // c10d's client retries a failed connect after a back-off, so one attempt can take up to
        // about three times `timeout`; the connect runs on a helper thread and is given up on at
        // the deadline (the helper frees whatever it gets afterwards).
        let (tx, rx) = mpsc::channel::<Result<SendPtr, String>>();
        let ms = millis(timeout);
        let spawned = std::thread::Builder::new()
            .name("store-connect".into())
            .spawn(move || {
                let mut raw = std::ptr::null_mut();
                // SAFETY: valid C string and out-pointer; the bridge takes over `listen_fd` if given.
                let result = ffi::check(unsafe {
                    ffi::sh_store_connect(
                        host.as_ptr(),
                        port,
                        world_size as i64,
                        i32::from(is_master),
                        ms,
                        listen_fd.unwrap_or(-1),
                        &mut raw,
                    )
                });
                if let Err(mpsc::SendError(Ok(late))) = tx.send(result.map(|()| SendPtr(raw))) {
                    if !late.0.is_null() {
                        // SAFETY: a store nobody else saw; freed once.
                        unsafe { ffi::sh_store_free(late.0) };
                    }
                }
            });
        if let Err(e) = spawned {
            return Err(fail(format!("cannot start a thread: {e}")));
        }
        let deadline = timeout + Duration::from_secs(1).max(timeout / 20);
        let started = std::time::Instant::now();
        let raw = match rx.recv_timeout(deadline) {
            Ok(Ok(raw)) => raw.0,
            Ok(Err(message)) => {
                return Err(fail(rendezvous_reason(
                    &message,
                    is_master,
                    port,
                    world_size,
                    started.elapsed(),
                )));
            }
            Err(_) => {
                let message = format!("no connection within {deadline:?}");
                return Err(fail(rendezvous_reason(
                    &message,
                    is_master,
                    port,
                    world_size,
                    started.elapsed(),
                )));
            }
        };
        let raw = NonNull::new(raw).ok_or_else(|| fail("the bridge returned no store".into()))?;
        // SAFETY: a live store handle.
        let port = unsafe { ffi::sh_store_port(raw.as_ptr()) };
        Ok(Store {
            raw,
            addr: addr.to_string(),
            port,
            world_size,
            timeout,
            world_groups: AtomicUsize::new(0),
            namespace: String::new(),
        })
    }

    /// This store with every key and group of this rank in the key space of run `id`
    /// (`run/ID/`); every rank of the run must give the same.
    pub fn for_run(mut self, id: &str) -> Store {
        self.namespace = format!("run/{id}/");
        self
    }

    /// `name` in this run's key space.
    pub(super) fn namespaced(&self, name: &str) -> String {
        format!("{}{name}", self.namespace)
    }

    /// The address rank 0 hosts the store on, as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The store's port (the one actually bound when rank 0 asked for port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The timeout every wait on the store (and every group's rendezvous) is bounded by.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets `key` to `value` for every rank to read.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let key_c = self.key(key)?;
        // SAFETY: live handle, valid key, `value` readable for its length.
        ffi::check(unsafe {
            ffi::sh_store_set(self.raw.as_ptr(), key_c.as_ptr(), value.as_ptr(), value.len())
        })
        .map_err(|reason| self.op_error("store set", key, reason))
    }

    /// The value of `key`, waiting (up to the store's timeout) until some rank has set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        let key_c = self.key(key)?;
        let mut data = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live handle, valid key and out-pointers.
        ffi::check(unsafe { ffi::sh_store_get(self.raw.as_ptr(), key_c.as_ptr(), &mut data, &mut len) })
            .map_err(|reason| self.op_error("store get", key, reason))?;
        // SAFETY: on success `data` holds `len` bytes malloc'd by the bridge, freed once here.
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { ffi::sh_bytes_free(data) };
        Ok(value)
    }

    /// Adds `delta` to the counter at `key` (0 when unset) and returns the new value; `delta` 0
    /// reads it without waiting.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let key_c = self.key(key)?;
        let mut value = 0i64;
        // SAFETY: live handle, valid key and out-pointer.
        ffi::check(unsafe { ffi::sh_store_add(self.raw.as_ptr(), key_c.as_ptr(), delta, &mut value) })
            .map_err(|reason| self.op_error("store add", key, reason))?;
        Ok(value)
    }

    /// Whether `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool, CommError> {
        let key_c = self.key(key)?;
        let keys = [key_c.as_ptr()];
        let mut set = 0;
        // SAFETY: live handle, one valid key, valid out-pointer.
        ffi::check(unsafe { ffi::sh_store_check(self.raw.as_ptr(), keys.as_ptr(), 1, &mut set) })
            .map_err(|reason| self.op_error("store check", key, reason))?;
        Ok(set != 0)
    }

    /// Sets `key` to `value` unless some rank set it first; returns what the key holds after,
    /// which every rank racing to set it reads the same.
    pub fn set_once(&self, key: &str, value: &[u8]) -> Result<Vec<u8>, CommError> {
        let key_c = self.key(key)?;
        let mut data = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live handle, valid key, `value` readable for its length (an empty expected
        // value means "absent"), valid out-pointers.
        ffi::check(unsafe {
            ffi::sh_store_compare_set(
                self.raw.as_ptr(),
                key_c.as_ptr(),
                std::ptr::null(),
                0,
                value.as_ptr(),
                value.len(),
                &mut data,
                &mut len,
            )
        })
        .map_err(|reason| self.op_error("store compare-set", key, reason))?;
        // SAFETY: on success `data` holds `len` bytes malloc'd by the bridge, freed once here.
        let current = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { ffi::sh_bytes_free(data) };
        Ok(current)
    }

    fn key(&self, key: &str) -> Result<CString, CommError> {
        CString::new(self.namespaced(&format!("user/{key}")))
            .map_err(|_| CommError::Invalid(format!("store key {key:?} contains a NUL byte")))
    }

    fn op_error(&self, op: &'static str, key: &str, reason: String) -> CommError {
        CommError::Op {
            op,
            peer: None,
            reason: format!(
                "key {key:?} on the store at {}:{}: {reason}; is rank 0 still running?",
                self.addr, self.port
            ),
        }
    }

    /// A fresh key-space name for the next world group this rank creates. Every rank creates its
    /// world groups in the same order, so the names agree.
    pub(super) fn next_world_prefix(&self) -> String {
        format!(
            "stagehand/world/{}",
            self.world_groups.fetch_add(1, Ordering::Relaxed)
        )
    }

    pub(super) fn raw(&self) -> *mut ffi::RawStore {
        self.raw.as_ptr()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: the handle is live and freed only here; process groups hold their own
        // references to the C++ store.
        unsafe { ffi::sh_store_free(self.raw.as_ptr()) };
    }
}

/// A store handle on its way back from the connecting thread.
struct SendPtr(*mut ffi::RawStore);

// SAFETY: the handle is not shared; ownership moves to the receiving thread (or stays to be freed).
unsafe impl Send for SendPtr {}

/// c10d's message plus what the user should check.
/// Why a rendezvous failed, `waited` into it (not the timeout: a port in use fails at once).
fn rendezvous_reason(
    message: &str,
    is_master: bool,
    port: u16,
    world_size: usize,
    waited: Duration,
) -> String {
    let lower = message.to_lowercase();
    let hint = if !is_master {
        "is rank 0 running and the port reachable?".to_string()
    } else if lower.contains("address already in use") || lower.contains("eaddrinuse") {
        format!("is another process using port {port}?")
    } else if lower.contains("timed out") || lower.contains("timeout") || lower.contains("no connection") {
        format!("did all {world_size} ranks start and point at this address and port?")
    } else {
        "can this host bind that address and port?".to_string()
    };
    format!("after {:.1} s: {message}; {hint}", waited.as_secs_f64())
}
