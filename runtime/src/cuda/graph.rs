//! CUDA graphs: a stage's whole training step captured once and replayed (`--cuda-graph`), so a
//! step costs one launch instead of one per kernel (`csrc/cuda_bridge.cpp`).

use std::os::raw::c_char;

use super::{cuda, Api};
use crate::ffi::check;

/// The bridge's graph (a `CUDAGraph` and its side stream).
#[repr(C)]
pub struct RawGraph {
    _private: [u8; 0],
}

/// A CUDA graph with a side stream of its own. While it lives, that stream is the current stream
/// of the thread that made it, on its device: everything the thread queues there, eager or
/// captured, runs on it in order. Dropping it waits for the stream and restores the thread's
/// previous stream.
pub struct Graph {
    raw: *mut RawGraph,
    api: &'static Api,
    captured: bool,
}

impl Graph {
    /// A new graph on `cuda:device`, its stream made current (after the device's queued work).
    pub fn new(device: usize) -> Result<Graph, String> {
        let api = cuda().map_err(|e| format!("CUDA graphs need CUDA: {e}"))?.api();
        let mut raw = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the bridge checks the device index.
        check(unsafe { (api.graph_new)(device as i64, &mut raw) })?;
        Ok(Graph {
            raw,
            api,
            captured: false,
        })
    }

    /// Starts capturing what is queued on the graph's stream, autograd's backward passes
    /// included; nothing of it runs until [`Graph::replay`]. Until [`Graph::end_capture`], nothing
    /// may wait for the device (no reads of tensor values, no synchronisation) or reseed the random
    /// generators. A capture never ended (an error on the way) is dropped with the graph.
    pub fn begin_capture(&mut self) -> Result<(), String> {
        if self.captured {
            return Err("this CUDA graph already holds a capture".into());
        }
        // SAFETY: `raw` is live until drop; the bridge refuses a capture under way.
        check(unsafe { (self.api.graph_begin)(self.raw) })
    }

    /// Ends the capture [`Graph::begin_capture`] started and makes the graph ready to replay.
    pub fn end_capture(&mut self) -> Result<(), String> {
        // SAFETY: `raw` is live; the bridge refuses when no capture is under way.
        check(unsafe { (self.api.graph_end)(self.raw) })
            .map_err(|e| format!("the CUDA graph capture failed: {e}"))?;
        self.captured = true;
        Ok(())
    }

    /// Runs the captured work on the graph's stream, with the random generators as they are now.
    pub fn replay(&self) -> Result<(), String> {
        if !self.captured {
            return Err("nothing was captured into this CUDA graph".into());
        }
        // SAFETY: `raw` is live and holds a finished capture.
        check(unsafe { (self.api.graph_replay)(self.raw) })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: `raw` came from graph_new and is freed once.
        unsafe { (self.api.graph_free)(self.raw) }
    }
}

/// The graph entry points' signatures, for [`Api`].
pub(crate) type GraphNew = unsafe extern "C" fn(i64, *mut *mut RawGraph) -> *mut c_char;
pub(crate) type GraphOp = unsafe extern "C" fn(*mut RawGraph) -> *mut c_char;
pub(crate) type GraphFree = unsafe extern "C" fn(*mut RawGraph);
