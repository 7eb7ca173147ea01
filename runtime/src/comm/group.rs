//! Process groups (Gloo or NCCL over a set of ranks) and the asynchronous work they return.

use std::cell::Cell;
use std::ffi::{c_void, CString};
use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::{Device, Tensor};

use super::{millis, CommError, Store};
use crate::ffi;

/// Which c10d backend a group runs on; subgroups inherit it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Backend {
    /// Gloo, with the device bound as described.
    Gloo(GlooDevice),
    /// NCCL, with this rank's communicators on this CUDA device.
    Nccl(usize),
}

/// Where this rank's gloo device listens for its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum GlooDevice {
    /// `GLOO_SOCKET_IFNAME`, as in PyTorch.
    Interface(String),
    /// The local address this host uses to reach the store.
    Address(String),
}

/// A c10d process group over some of the world's ranks. `Send`: use it from one thread at a time
/// (c10d matches operations by the order each rank issues them).
pub struct ProcessGroup {
    raw: NonNull<ffi::RawGroup>,
    backend: Backend,
    /// This rank's index in `ranks`.
    rank: usize,
    /// World rank of each group rank, ascending.
    ranks: Vec<usize>,
    world_rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Page-locked host buffers for Gloo operations on CUDA tensors.
    staging: Arc<Staging>,
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: the C++ backend is thread-safe to move between threads; `!Sync` keeps use to one thread
// at a time.
unsafe impl Send for ProcessGroup {}

impl ProcessGroup {
    /// Gloo over all ranks (`rank` of `world_size`), rendezvous through `store`. Collective/p2p
    /// ops time out after `timeout`.
    ///
    /// The gloo device binds to the interface named by `GLOO_SOCKET_IFNAME` if set, else to the
    /// local address this host uses to reach the store's address.
    pub fn gloo(
        store: &Store,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<ProcessGroup, CommError> {
        let device = gloo_device(store).map_err(|reason| CommError::Op {
            op: "gloo setup",
            peer: None,
            reason,
        })?;
        let ranks: Vec<usize> = (0..world_size).collect();
        Self::create(
            store,
            &store.next_world_prefix(),
            Backend::Gloo(device),
            rank,
            &ranks,
            rank,
            world_size,
            timeout,
        )
    }

    /// NCCL over all ranks, this rank's communicators on CUDA device `device` (which becomes
    /// the calling thread's current device). Needs CUDA loaded ([`crate::cuda::nccl`]); without
    /// it returns CommError::Unsupported saying why.
    ///
    /// NCCL ignores `tag`s (messages between two ranks match in issue order), and `wait` only makes
    /// the current CUDA stream wait for the operation. A stuck NCCL operation is caught by
    /// ProcessGroupNCCL's watchdog after `timeout`, which by default tears the process down.
    pub fn nccl(
        store: &Store,
        rank: usize,
        world_size: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<ProcessGroup, CommError> {
        crate::cuda::nccl()
            .map_err(|reason| CommError::Unsupported(format!("the nccl backend: {reason}")))?;
        // Only where the group can be made (the device exists): the choice sets the process's
        // environment, best left alone otherwise.
        if crate::cuda::cuda().is_ok_and(|cuda| device < cuda.device_count()) {
            choose_nccl_interface(store);
        }
        let ranks: Vec<usize> = (0..world_size).collect();
        Self::create(
            store,
            &store.next_world_prefix(),
            Backend::Nccl(device),
            rank,
            &ranks,
            rank,
            world_size,
            timeout,
        )
    }

    /// A group of `ranks` (global ranks, sorted) using the same backend, rendezvous under a
    /// PrefixStore named `name`. Every rank of the world must call it with the same arguments
    /// (like torch.distributed.new_group); returns None on ranks not in `ranks`.
    ///
    /// `name` must be unique among the job's groups.
    pub fn subgroup(
        &self,
        store: &Store,
        name: &str,
        ranks: &[usize],
    ) -> Result<Option<ProcessGroup>, CommError> {
        if ranks.is_empty() {
            return Err(CommError::Invalid(format!("group {name:?} has no ranks")));
        }
        if !ranks.windows(2).all(|w| w[0] < w[1]) {
            return Err(CommError::Invalid(format!(
                "the ranks of group {name:?} must be sorted and distinct, got {ranks:?}"
            )));
        }
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(CommError::Invalid(format!(
                "group {name:?} names rank {bad}, but the world has {} ranks",
                self.world_size
            )));
        }
        let Some(rank) = ranks.iter().position(|&r| r == self.world_rank) else {
            return Ok(None);
        };
        Self::create(
            store,
            &format!("stagehand/group/{name}"),
            self.backend.clone(),
            rank,
            ranks,
            self.world_rank,
            self.world_size,
            self.timeout,
        )
        .map(Some)
    }

    #[allow(clippy::too_many_arguments)]
    fn create(
        store: &Store,
        prefix: &str,
        backend: Backend,
        rank: usize,
        ranks: &[usize],
        world_rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<ProcessGroup, CommError> {
        let size = ranks.len();
        if rank >= size {
            return Err(CommError::Invalid(format!(
                "rank {rank} is outside a group of {size} ranks"
            )));
        }
        let invalid = |what: &str| CommError::Invalid(format!("{what} contains a NUL byte"));
        let prefix_c = CString::new(store.namespaced(prefix)).map_err(|_| invalid("the group name"))?;
        let mut raw = std::ptr::null_mut();
        let (op, result) = match &backend {
            Backend::Gloo(device) => {
                let (host, iface) = match device {
                    GlooDevice::Address(a) => (Some(a.as_str()), None),
                    GlooDevice::Interface(i) => (None, Some(i.as_str())),
                };
                let host = host
                    .map(CString::new)
                    .transpose()
                    .map_err(|_| invalid("the address"))?;
                let iface = iface
                    .map(CString::new)
                    .transpose()
                    .map_err(|_| invalid("GLOO_SOCKET_IFNAME"))?;
                // SAFETY: live store, valid C strings (or null), valid out-pointer.
                let result = ffi::check(unsafe {
                    ffi::sh_pg_gloo(
                        store.raw(),
                        prefix_c.as_ptr(),
                        host.as_ref().map_or(std::ptr::null(), |h| h.as_ptr()),
                        iface.as_ref().map_or(std::ptr::null(), |i| i.as_ptr()),
                        rank as i64,
                        size as i64,
                        millis(timeout),
                        &mut raw,
                    )
                });
                ("gloo group setup", result)
            }
            Backend::Nccl(device) => {
                let cuda = crate::cuda::nccl().map_err(CommError::Unsupported)?;
                // SAFETY: live store, valid C string, valid out-pointer.
                let result = ffi::check(unsafe {
                    (cuda.api().pg_nccl)(
                        store.raw(),
                        prefix_c.as_ptr(),
                        rank as i64,
                        size as i64,
                        *device as i64,
                        millis(timeout),
                        &mut raw,
                    )
                });
                ("nccl group setup", result)
            }
        };
        result.map_err(|reason| CommError::Op {
            op,
            peer: None,
            reason: format!(
                "{reason} (group {prefix:?} of ranks {ranks:?}, rendezvous at {}:{}); \
                 did every rank of the group start and create it?",
                store.addr(),
                store.port()
            ),
        })?;
        let raw = NonNull::new(raw).ok_or_else(|| CommError::Op {
            op,
            peer: None,
            reason: "the bridge returned no group".into(),
        })?;
        Ok(ProcessGroup {
            raw,
            backend,
            rank,
            ranks: ranks.to_vec(),
            world_rank,
            world_size,
            timeout,
            staging: Arc::default(),
            _not_sync: PhantomData,
        })
    }

    /// This rank's rank within the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the group has.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The world rank of each group rank, ascending.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// How long operations (and [`Work::wait`]) may take before they fail.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Asynchronous point-to-point; `dst`/`src` are ranks within this group. `tag` disambiguates
    /// concurrent messages (gloo; tags must be below 2^31).
    pub fn send(&self, tensor: &Tensor, dst: usize, tag: u32) -> Result<Work, CommError> {
        let peer = self.peer("send", dst)?;
        let tag = checked_tag("send", peer, tag)?;
        let staged = self.stage_out("send", Some(peer), tensor)?;
        let wire = staged.as_ref().unwrap_or(tensor);
        let mut raw = std::ptr::null_mut();
        // SAFETY: live group; `as_ptr` points at the C++ at::Tensor, which the bridge copies
        // (a reference-counted handle) before returning.
        let result = ffi::check(unsafe {
            ffi::sh_pg_send(
                self.raw.as_ptr(),
                wire.as_ptr() as *const c_void,
                dst as i64,
                tag,
                &mut raw,
            )
        });
        let kept = vec![wire.shallow_clone()];
        let after = staged.map(|host| self.staging.release_after(vec![host], Vec::new()));
        self.work("send", Some(peer), result, raw, kept, after)
    }

    /// Asynchronous receive into `tensor` (as a rule of the sender's shape and dtype). Its
    /// contents are defined once the returned work has been waited for.
    ///
    /// Gloo aborts the process (an assertion on its I/O thread) if the message is larger than
    /// `tensor`, so agree on shapes before the first message. A shorter one lands in `tensor`'s
    /// first bytes (framed payloads, whose header gives their size, rely on it).
    pub fn recv(&self, tensor: &mut Tensor, src: usize, tag: u32) -> Result<Work, CommError> {
        let peer = self.peer("recv", src)?;
        let tag = checked_tag("recv", peer, tag)?;
        let mut staged = self.staging_buffer("recv", Some(peer), tensor)?;
        let mut raw = std::ptr::null_mut();
        let wire = staged.as_mut().unwrap_or(tensor);
        // SAFETY: as in `send`.
        let result = ffi::check(unsafe {
            ffi::sh_pg_recv(
                self.raw.as_ptr(),
                wire.as_mut_ptr() as *mut c_void,
                src as i64,
                tag,
                &mut raw,
            )
        });
        let kept = vec![wire.shallow_clone()];
        let after = staged.map(|host| {
            self.staging
                .release_after(vec![host.shallow_clone()], vec![(tensor.shallow_clone(), host)])
        });
        self.work("recv", Some(peer), result, raw, kept, after)
    }

    /// Asynchronous in-place sum all-reduce of every tensor in the list.
    pub fn all_reduce_sum(&self, tensors: &[Tensor]) -> Result<Work, CommError> {
        let mut wire: Vec<Tensor> = Vec::with_capacity(tensors.len());
        let mut hosts = Vec::new();
        let mut copy_back = Vec::new();
        for tensor in tensors {
            match self.stage_out("all_reduce_sum", None, tensor)? {
                Some(host) => {
                    wire.push(host.shallow_clone());
                    copy_back.push((tensor.shallow_clone(), host.shallow_clone()));
                    hosts.push(host);
                }
                None => wire.push(tensor.shallow_clone()),
            }
        }
        let pointers: Vec<*const c_void> = wire.iter().map(|t| t.as_ptr() as *const c_void).collect();
        let mut raw = std::ptr::null_mut();
        // SAFETY: live group; `pointers` holds `len` valid at::Tensor pointers for the call.
        let result = ffi::check(unsafe {
            ffi::sh_pg_all_reduce_sum(self.raw.as_ptr(), pointers.as_ptr(), pointers.len(), &mut raw)
        });
        let after = (!hosts.is_empty()).then(|| self.staging.release_after(hosts, copy_back));
        self.work("all_reduce_sum", None, result, raw, wire, after)
    }

    /// For Gloo and a CUDA tensor: a page-locked host buffer of its shape (Gloo moves host
    /// memory only); None when the tensor can go as it is.
    fn staging_buffer(
        &self,
        op: &'static str,
        peer: Option<usize>,
        tensor: &Tensor,
    ) -> Result<Option<Tensor>, CommError> {
        let (Backend::Gloo(_), Device::Cuda(_)) = (&self.backend, tensor.device()) else {
            return Ok(None);
        };
        self.staging
            .take(tensor)
            .map(Some)
            .map_err(|reason| CommError::Op { op, peer, reason })
    }

    /// [`Self::staging_buffer`] holding a copy of `tensor` (the copy waits for the kernels that
    /// produce it).
    fn stage_out(
        &self,
        op: &'static str,
        peer: Option<usize>,
        tensor: &Tensor,
    ) -> Result<Option<Tensor>, CommError> {
        let Some(mut host) = self.staging_buffer(op, peer, tensor)? else {
            return Ok(None);
        };
        host.f_copy_(tensor).map_err(|e| CommError::Op {
            op,
            peer,
            reason: format!("copying a CUDA tensor to host memory: {e}"),
        })?;
        Ok(Some(host))
    }

    /// Blocks until every rank of the group has reached the barrier (or the timeout passes).
    pub fn barrier(&self) -> Result<(), CommError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: live group, valid out-pointer.
        let result = ffi::check(unsafe { ffi::sh_pg_barrier(self.raw.as_ptr(), &mut raw) });
        self.work("barrier", None, result, raw, Vec::new(), None)?.wait()
    }

    /// The world rank of group rank `rank`, or an error naming the group's size.
    fn peer(&self, op: &'static str, rank: usize) -> Result<usize, CommError> {
        if rank == self.rank {
            return Err(CommError::Invalid(format!(
                "{op} with itself (rank {rank} of group {:?})",
                self.ranks
            )));
        }
        self.ranks.get(rank).copied().ok_or_else(|| {
            CommError::Invalid(format!(
                "{op} with rank {rank}, but the group has {} ranks ({:?})",
                self.ranks.len(),
                self.ranks
            ))
        })
    }

    fn work(
        &self,
        op: &'static str,
        peer: Option<usize>,
        result: Result<(), String>,
        raw: *mut ffi::RawWork,
        tensors: Vec<Tensor>,
        after: Option<AfterWait>,
    ) -> Result<Work, CommError> {
        let context = WorkContext {
            op,
            peer,
            ranks: self.ranks.clone(),
            timeout: self.timeout,
            gloo: matches!(self.backend, Backend::Gloo(_)),
        };
        if let Err(reason) = result {
            return Err(context.error(reason));
        }
        let raw =
            NonNull::new(raw).ok_or_else(|| context.error("the bridge returned no work handle".into()))?;
        Ok(Work {
            raw: Some(raw),
            _tensors: tensors,
            after,
            context,
        })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: live handle, freed only here; pending works hold their own reference to the
        // C++ backend.
        unsafe { ffi::sh_pg_free(self.raw.as_ptr()) };
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend)
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Runs once an operation has completed.
type AfterWait = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// Page-locked host buffers, reused by shape, through which a Gloo group moves CUDA tensors
/// (Bundle-style hybrids whose GPUs talk through the CPU): a send copies the tensor into one, a
/// receive lands in one and is copied to the GPU when waited for, an all-reduce does both.
/// Buffers come back for reuse once their operation has completed.
/// Element type (as tch names it) and shape.
type BufferKey = (String, Vec<i64>);

#[derive(Default)]
struct Staging {
    /// By element type and shape (a rank computes on one device).
    free: Mutex<std::collections::HashMap<BufferKey, Vec<Tensor>>>,
}

impl Staging {
    /// A buffer shaped like `like` (a CUDA tensor), pinned for `like`'s device.
    fn take(&self, like: &Tensor) -> Result<Tensor, String> {
        let key = (format!("{:?}", like.kind()), like.size());
        if let Some(buffer) = self
            .free
            .lock()
            .expect("staging lock")
            .get_mut(&key)
            .and_then(Vec::pop)
        {
            return Ok(buffer);
        }
        Tensor::f_empty(like.size(), (like.kind(), Device::Cpu))
            .and_then(|t| t.f_pin_memory(like.device()))
            .map_err(|e| format!("allocating page-locked host memory for a CUDA tensor: {e}"))
    }

    /// Once the operation completes: copies each host buffer into its device tensor, then gives
    /// the buffers back.
    fn release_after(self: &Arc<Self>, buffers: Vec<Tensor>, copy_back: Vec<(Tensor, Tensor)>) -> AfterWait {
        let staging = Arc::clone(self);
        Box::new(move || {
            for (mut device, host) in copy_back {
                device
                    .f_copy_(&host)
                    .map_err(|e| format!("copying received data to the GPU: {e}"))?;
            }
            let mut free = staging.free.lock().expect("staging lock");
            for buffer in buffers {
                free.entry((format!("{:?}", buffer.kind()), buffer.size()))
                    .or_default()
                    .push(buffer);
            }
            Ok(())
        })
    }
}

/// What an error from a work needs to name.
struct WorkContext {
    op: &'static str,
    peer: Option<usize>,
    ranks: Vec<usize>,
    timeout: Duration,
    /// Whether it runs on Gloo (whose point-to-point waits can be aborted).
    gloo: bool,
}

impl WorkContext {
    fn error(&self, reason: String) -> CommError {
        let hint = match self.peer {
            Some(peer) => format!("is rank {peer} still running? (timeout {:?})", self.timeout),
            None => format!(
                "are all ranks {:?} still running and calling it? (timeout {:?})",
                self.ranks, self.timeout
            ),
        };
        CommError::Op {
            op: self.op,
            peer: self.peer,
            reason: format!("{}; {hint}", lowercase_first(&reason)),
        }
    }
}

/// Whether a wait in this process has failed (timed out, or found its peer gone): from then on
/// the rank is ending, and the operations still pending are let go at once rather than waited for.
static A_WAIT_FAILED: AtomicBool = AtomicBool::new(false);

/// Notes that a wait has failed ([`A_WAIT_FAILED`]).
pub(super) fn note_failed_wait() {
    A_WAIT_FAILED.store(true, Ordering::Relaxed);
}

/// An operation in flight. It keeps its tensors alive until [`Work::wait`] returns or it is
/// dropped; dropping it without waiting still waits (up to the group's timeout) so that no
/// tensor is released while c10d may still read or write it, and ignores the outcome. Once a
/// wait has failed, a pending Gloo point-to-point operation dropped has its wait aborted instead:
/// a send to a peer that stopped never completes (Gloo sends once the receiver asks), and each
/// would hold the rank's exit, and its error, back by a whole timeout. Aborted, Gloo lets go of
/// the buffer (its pair holds it through a weak pointer), as [`super::Watched`] relies on.
pub struct Work {
    raw: Option<NonNull<ffi::RawWork>>,
    _tensors: Vec<Tensor>,
    /// What completes the operation once c10d has (copying staged data back to the GPU).
    after: Option<AfterWait>,
    context: WorkContext,
}

// SAFETY: c10d works may be waited for from any thread; the tensors are `Send`.
unsafe impl Send for Work {}

impl Work {
    /// Waits until the operation has completed; errors include timeouts and a dead peer.
    pub fn wait(mut self) -> Result<(), CommError> {
        self.finish().map_err(|reason| {
            note_failed_wait();
            self.context.error(reason)
        })
    }

    fn finish(&mut self) -> Result<(), String> {
        self.finish_within(self.context.timeout, None)
    }

    /// Waits at most `timeout`, then frees the handle, first taking it out of `shared` (through
    /// which another thread may abort the wait) so that no abort reaches it freed.
    pub(super) fn finish_within(&mut self, timeout: Duration, shared: Option<&Shared>) -> Result<(), String> {
        let Some(raw) = self.raw.take() else {
            return Ok(());
        };
        // SAFETY: a live work handle, waited for and freed exactly once.
        let result = ffi::check(unsafe { ffi::sh_work_wait(raw.as_ptr(), millis(timeout)) });
        if let Some(shared) = shared {
            shared.forget();
        }
        unsafe { ffi::sh_work_free(raw.as_ptr()) };
        result?;
        // After a failure c10d may still hold the staging buffers: they are not reused.
        match self.after.take() {
            Some(after) => after(),
            None => Ok(()),
        }
    }

    /// The handle another thread may abort this work's wait through, for a Gloo work still
    /// pending; `None` otherwise.
    pub(super) fn shared(&self) -> Option<Shared> {
        self.raw
            .filter(|_| self.context.gloo)
            .map(|raw| Shared(Mutex::new(Some(RawWork(raw)))))
    }

    /// The error of this work failing for `reason`.
    pub(super) fn error(&self, reason: String) -> CommError {
        self.context.error(reason)
    }

    /// The group's timeout, which its waits keep to.
    pub(super) fn timeout(&self) -> Duration {
        self.context.timeout
    }
}

/// A pending Gloo work's handle, shared with a thread that waits on it, through which its wait
/// is aborted; emptied before the handle is freed.
pub(super) struct Shared(Mutex<Option<RawWork>>);

struct RawWork(NonNull<ffi::RawWork>);

// SAFETY: c10d's Gloo works may be aborted from any thread; the mutex keeps the handle from being
// freed while it is used.
unsafe impl Send for RawWork {}

impl Shared {
    /// Ends a wait on the work at once, as not completed; nothing if it was freed.
    pub(super) fn abort(&self) {
        let held = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(raw) = held.as_ref() {
            // SAFETY: the handle is live while it is held here ([`Work::finish_within`]).
            let _ = ffi::check(unsafe { ffi::sh_work_abort(raw.0.as_ptr()) });
        }
    }

    fn forget(&self) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if A_WAIT_FAILED.load(Ordering::Relaxed) {
            if let Some(shared) = self.shared() {
                // Gloo keeps the abort until the wait, which then ends at once.
                shared.abort();
            }
        }
        let _ = self.finish();
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.context.op)
            .field("peer", &self.context.peer)
            .field("pending", &self.raw.is_some())
            .finish()
    }
}

fn checked_tag(op: &'static str, peer: usize, tag: u32) -> Result<i64, CommError> {
    if tag > i32::MAX as u32 {
        return Err(CommError::Invalid(format!(
            "{op} with rank {peer}: tag {tag} is above c10d's limit {}",
            i32::MAX
        )));
    }
    Ok(i64::from(tag))
}

fn lowercase_first(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// The gloo device for this rank: `GLOO_SOCKET_IFNAME` if set, else the local address of the
/// route to the store (loopback when the store is on this host).
fn gloo_device(store: &Store) -> Result<GlooDevice, String> {
    if let Some(iface) = std::env::var("GLOO_SOCKET_IFNAME").ok().filter(|s| !s.is_empty()) {
        return Ok(GlooDevice::Interface(iface));
    }
    route_to_store(store)
        .map(|ip| GlooDevice::Address(ip.to_string()))
        .map_err(|e| format!("{e}; set GLOO_SOCKET_IFNAME to the network interface to use"))
}

/// NCCL's sockets (its bootstrap, and its network transport between hosts) on the interface of
/// the route to the store, as Gloo's, unless `NCCL_SOCKET_IFNAME` says otherwise: left to itself
/// NCCL takes the first interface not named docker*, lo or virbr*, which may be a Docker bridge,
/// a management port or a VPN that does not reach the other hosts. Set before the first NCCL
/// communicator, which reads it.
fn choose_nccl_interface(store: &Store) {
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_some_and(|v| !v.is_empty()) {
        return;
    }
    let Some(name) = route_to_store(store).ok().and_then(interface_of) else {
        return;
    };
    // `=`: this interface exactly, not every one whose name starts so (NCCL's rule).
    std::env::set_var("NCCL_SOCKET_IFNAME", format!("={name}"));
    eprintln!(
        "runtime: NCCL uses network interface {name}, the route to the master; set \
         NCCL_SOCKET_IFNAME to choose another"
    );
}

/// The name of the interface holding `ip` (getifaddrs), if one does.
pub(super) fn interface_of(ip: IpAddr) -> Option<String> {
    let held = |address: &nix::sys::socket::SockaddrStorage| {
        let v4 = address.as_sockaddr_in().map(|a| IpAddr::from(a.ip()));
        v4.or_else(|| address.as_sockaddr_in6().map(|a| IpAddr::from(a.ip())))
    };
    nix::ifaddrs::getifaddrs()
        .ok()?
        .find(|interface| interface.address.as_ref().and_then(held) == Some(ip))
        .map(|interface| interface.interface_name)
}

/// The local address of the route to the store (loopback when the store is on this host), found
/// by "connecting" a UDP socket, which sends nothing.
fn route_to_store(store: &Store) -> Result<IpAddr, String> {
    let target: SocketAddr = (store.addr(), store.port())
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve the store address {}: {e}", store.addr()))?
        .next()
        .ok_or_else(|| format!("the store address {} resolves to nothing", store.addr()))?;
    if target.ip().is_unspecified() {
        return Ok(IpAddr::from([127, 0, 0, 1]));
    }
    let bind: SocketAddr = match target {
        SocketAddr::V4(_) => (IpAddr::from([0, 0, 0, 0]), 0).into(),
        SocketAddr::V6(_) => (IpAddr::from([0u16; 8]), 0).into(),
    };
    let probe = UdpSocket::bind(bind)
        .and_then(|s| s.connect(target).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| format!("cannot find a local address that reaches the store at {target}: {e}"))?;
    Ok(probe.ip())
}
