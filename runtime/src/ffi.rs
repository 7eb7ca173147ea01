//! The C ABI of the bridge to libtorch (`csrc/`), at the bottom of the runtime: the entry points
//! of `csrc/c10d_bridge.cpp` (the store and process groups `comm` wraps), the opaque handles the
//! CUDA half (`csrc/cuda_bridge.cpp`, loaded by `cuda`) takes and returns, and the error-string
//! rule every part of the bridge keeps (the stage's `amp.cpp`, `autograd.cpp` and `optim.cpp`
//! included).
//!
//! Every fallible bridge call returns null on success or a malloc'd, NUL-terminated message that
//! the caller owns; [`check`] takes that ownership.

use std::ffi::{c_char, c_int, c_void, CStr};

/// Opaque C++ handles (`sh_store`, `sh_pg`, `sh_work`).
#[repr(C)]
pub struct RawStore {
    _private: [u8; 0],
}
#[repr(C)]
pub struct RawGroup {
    _private: [u8; 0],
}
#[repr(C)]
pub struct RawWork {
    _private: [u8; 0],
}

extern "C" {
    fn sh_error_free(message: *mut c_char);
    pub fn sh_torch_version() -> *const c_char;

    pub fn sh_store_connect(
        host: *const c_char,
        port: u16,
        world_size: i64,
        is_master: c_int,
        timeout_ms: i64,
        listen_fd: c_int,
        out: *mut *mut RawStore,
    ) -> *mut c_char;
    pub fn sh_store_port(store: *const RawStore) -> u16;
    pub fn sh_store_free(store: *mut RawStore);
    pub fn sh_store_set(store: *mut RawStore, key: *const c_char, data: *const u8, len: usize)
        -> *mut c_char;
    pub fn sh_store_get(
        store: *mut RawStore,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> *mut c_char;
    pub fn sh_bytes_free(data: *mut u8);
    pub fn sh_store_add(store: *mut RawStore, key: *const c_char, delta: i64, out: *mut i64) -> *mut c_char;
    pub fn sh_store_check(
        store: *mut RawStore,
        keys: *const *const c_char,
        n: usize,
        out: *mut c_int,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    pub fn sh_store_compare_set(
        store: *mut RawStore,
        key: *const c_char,
        expected: *const u8,
        expected_len: usize,
        desired: *const u8,
        desired_len: usize,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> *mut c_char;

    #[allow(clippy::too_many_arguments)]
    pub fn sh_pg_gloo(
        store: *mut RawStore,
        prefix: *const c_char,
        hostname: *const c_char,
        interface: *const c_char,
        rank: i64,
        size: i64,
        timeout_ms: i64,
        out: *mut *mut RawGroup,
    ) -> *mut c_char;
    pub fn sh_pg_free(pg: *mut RawGroup);
    pub fn sh_pg_send(
        pg: *mut RawGroup,
        tensor: *const c_void,
        dst: i64,
        tag: i64,
        out: *mut *mut RawWork,
    ) -> *mut c_char;
    pub fn sh_pg_recv(
        pg: *mut RawGroup,
        tensor: *mut c_void,
        src: i64,
        tag: i64,
        out: *mut *mut RawWork,
    ) -> *mut c_char;
    pub fn sh_pg_all_reduce_sum(
        pg: *mut RawGroup,
        tensors: *const *const c_void,
        n: usize,
        out: *mut *mut RawWork,
    ) -> *mut c_char;
    pub fn sh_pg_barrier(pg: *mut RawGroup, out: *mut *mut RawWork) -> *mut c_char;
    pub fn sh_work_wait(work: *mut RawWork, timeout_ms: i64) -> *mut c_char;
    pub fn sh_work_abort(work: *mut RawWork) -> *mut c_char;
    pub fn sh_work_free(work: *mut RawWork);
    fn sh_keep_this_thread_serial();
}

/// Runs every ATen operator this thread calls from now on single-threaded (`csrc/threads.cpp`),
/// leaving libtorch's intra-op pool to the other threads.
pub fn keep_this_thread_serial() {
    // SAFETY: takes nothing and cannot fail; it only sets a thread-local flag of c10's.
    unsafe { sh_keep_this_thread_serial() }
}

/// Takes ownership of a bridge call's result: `Ok` for null, else the message, freed here.
pub fn check(message: *mut c_char) -> Result<(), String> {
    if message.is_null() {
        return Ok(());
    }
    // SAFETY: the bridge returns either null or a NUL-terminated malloc'd string it gives up.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    // SAFETY: freed exactly once, with the allocator that made it.
    unsafe { sh_error_free(message) };
    Err(text)
}

/// A malloc'd, NUL-terminated copy of `message` for the bridge to own (and free with
/// `std::free`): how a Rust callback reports an error to C++. Interior NUL bytes end it early.
pub fn malloc_message(message: &str) -> *mut c_char {
    let bytes = message.as_bytes();
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    // SAFETY: a fresh allocation of len + 1 bytes, filled and terminated before it is returned.
    unsafe {
        let out = libc::malloc(len + 1).cast::<u8>();
        if !out.is_null() {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, len);
            *out.add(len) = 0;
        }
        out.cast()
    }
}
