//! Communication between ranks through PyTorch's own c10d: the TCPStore rendezvous, Gloo process
//! groups for CPU tensors and NCCL for CUDA tensors (created by the CUDA half of the bridge, see
//! `crate::cuda`, where CUDA is loaded).
//!
//! The C++ side is `csrc/c10d_bridge.cpp`, compiled by `build.rs` against the torch wheel's headers
//! (and Debian's gloo headers); this module is its safe face.
//!
//! - [`Store`] is the rendezvous (rank 0 hosts it; the others connect).
//! - [`ProcessGroup`] runs asynchronous point-to-point and all-reduce operations; each returns a
//!   [`Work`] that keeps its tensors alive until [`Work::wait`] or drop.
//! - Everything is bounded by a timeout: a rendezvous that cannot complete and a peer that dies or
//!   stops answering surface as a [`CommError`] naming the address or rank, never as a hang.
//!
//! Things c10d does not check for us:
//! - A `recv` must get a tensor with exactly the sender's byte size. On a mismatch gloo fails an
//!   assertion on its own I/O thread and aborts the whole process; shapes must be agreed first
//!   (for instance through [`Store::set`]/[`Store::get`]).
//! - Ranks must issue collectives on a group in the same order; each group's `name` (and each
//!   world group, counted per store) gets its own key space in the store.
//! - c10d logs its own errors (with C++ stack traces) to stderr before the error reaches us;
//!   `TORCH_CPP_LOG_LEVEL=FATAL` silences them. A rank connecting to the store shows none unless
//!   `TORCH_CPP_LOG_LEVEL` asks for them: each attempt made while rank 0 is not yet listening
//!   logs one, and the rendezvous's error says once why it failed.

// The API is complete for the stage runtime; not every part of it has a caller in every build.
#![allow(dead_code, unused_imports)]

mod group;
mod store;
#[cfg(test)]
mod tests;
mod watch;

use std::time::Duration;

use stagehand_contract::P2pOp;

use crate::ffi;

pub use group::{ProcessGroup, Work};
pub use store::Store;
pub use watch::Watched;

/// What went wrong talking to other ranks.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The store could not be hosted or reached, or the ranks did not all join in time.
    #[error("rendezvous with rank 0 at {addr}:{port} failed: {reason}")]
    Rendezvous { addr: String, port: u16, reason: String },
    /// Creating a group or running an operation failed (a dead peer, a timeout, a bad tensor).
    /// `peer` is the world rank of the other side of a point-to-point operation.
    #[error("{op}{} failed: {reason}", describe_peer(*.peer))]
    Op {
        op: &'static str,
        peer: Option<usize>,
        reason: String,
    },
    /// The requested backend or operation is not built into this runtime.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The caller passed something no rank could agree on (ranks out of range, a tag too large).
    #[error("invalid argument: {0}")]
    Invalid(String),
}

impl CommError {
    /// The peer a point-to-point operation waited for until its timeout ran out, and which way
    /// it went; not a peer that closed the connection, which failed itself.
    pub fn silent_peer(&self) -> Option<(usize, P2pOp)> {
        let CommError::Op {
            op,
            peer: Some(peer),
            reason,
        } = self
        else {
            return None;
        };
        let op = match *op {
            "send" => P2pOp::Send,
            "recv" => P2pOp::Recv,
            _ => return None,
        };
        reason.to_lowercase().contains("timed out").then_some((*peer, op))
    }
}

fn describe_peer(peer: Option<usize>) -> String {
    match peer {
        Some(rank) => format!(" with rank {rank}"),
        None => String::new(),
    }
}

/// The torch version this runtime was built against (the headers' `TORCH_VERSION`).
pub fn torch_version() -> String {
    // SAFETY: returns a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(ffi::sh_torch_version()) }
        .to_string_lossy()
        .into_owned()
}

/// A timeout as the bridge takes it: whole milliseconds, at least one.
fn millis(timeout: Duration) -> i64 {
    i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX).max(1)
}
