//! `--profiler-trace FILE`: PyTorch's profiler (Kineto) over `--profiler-steps` iterations after
//! the warm-up, written as the Chrome trace `torch.profiler`'s `export_chrome_trace` writes
//! (`csrc/profiler.cpp`). Operators (with their inputs' shapes and dtypes) on the training thread
//! and the backward's, and on a GPU every kernel, copy and memset; each iteration is a
//! `ProfilerStep#N` scope, as `prof.step()` marks them. Perfetto (ui.perfetto.dev) and
//! chrome://tracing open it, and `bench/trace_table.py` tabulates it against a PyTorch script's
//! trace of the same model.
//!
//! Recording costs time on every operator it records, and writing the trace stalls the rank (and
//! its peers, in the next iteration) between two iterations: those iterations' lines say
//! `profiled` ([`ProfilerTrace::slows`]), and throughput statistics leave them out while other
//! iterations remain. The `start` event says a trace is written (`config.profiler_trace`,
//! `config.profiler_steps`).

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::ffi::check;

extern "C" {
    fn sh_profiler_start(cuda: bool) -> *mut c_char;
    fn sh_profiler_step(step: i64) -> *mut c_char;
    fn sh_profiler_stop(path: *const c_char) -> *mut c_char;
    fn sh_profiler_scope_begin(name: *const c_char) -> *mut c_void;
    fn sh_profiler_scope_end(scope: *mut c_void);
}

/// Whether a trace is recording: scopes cost nothing (no call into libtorch) while none is.
static RECORDING: AtomicBool = AtomicBool::new(false);

/// A named part of an iteration (`forward`, `backward`, `step`) in the trace, from
/// [`Scope::enter`] until dropped, as `torch.profiler.record_function(name)` marks one; the
/// kernels its operators launch are the part's. Dropped on the thread that entered it.
pub struct Scope(*mut c_void);

impl Scope {
    /// The scope `name`, or `None` when no trace records.
    pub fn enter(name: &CStr) -> Option<Scope> {
        if !RECORDING.load(Ordering::Relaxed) {
            return None;
        }
        // SAFETY: a NUL-terminated name that outlives the call (the scope copies it).
        let scope = unsafe { sh_profiler_scope_begin(name.as_ptr()) };
        (!scope.is_null()).then_some(Scope(scope))
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        // SAFETY: the scope sh_profiler_scope_begin made, ended once, on its thread (Scope is
        // neither Send nor Sync: it holds a raw pointer).
        unsafe { sh_profiler_scope_end(self.0) }
    }
}

/// The placeholder `--profiler-trace` replaces with the rank, so that ranks on one host write
/// files of their own.
pub const RANK_PLACEHOLDER: &str = stagehand_contract::defaults::TRACE_RANK_PLACEHOLDER;

/// The file a rank writes its trace to: `template` with `{rank}` replaced.
pub fn path_for_rank(template: &Path, rank: usize) -> PathBuf {
    match template.to_str() {
        Some(text) if text.contains(RANK_PLACEHOLDER) => {
            PathBuf::from(text.replace(RANK_PLACEHOLDER, &rank.to_string()))
        }
        _ => template.to_path_buf(),
    }
}

/// The first iteration a trace records: the first after the warm-up (`--warmup` counts from the
/// run's first iteration, 0, and a resumed run starts at `first`) and, under `--cuda-graph`, the
/// first replayed one (`replays_from`): eager and capturing iterations are not the steps to see.
pub fn first_traced(warmup: u64, first: u64, replays_from: Option<u64>) -> u64 {
    warmup.max(first).max(replays_from.unwrap_or(0))
}

/// Records `steps` iterations from `from` on and writes the trace as soon as they have run (or
/// when the run ends, if it ends first): a run that fails later keeps it, and the profiler's
/// memory is given back. A run that ends otherwise before writing it (an error) leaves no file.
pub struct ProfilerTrace {
    path: PathBuf,
    cuda: bool,
    from: u64,
    until: u64,
    state: State,
}

/// Where a [`ProfilerTrace`] is in its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Recording,
    Written,
}

impl ProfilerTrace {
    /// A trace of `steps` iterations from `from` on, of the GPU's activity too with `cuda`, to be
    /// written to `path`, which is made now (and its folder), so that a path the run cannot
    /// write fails it before it trains. Nothing records until [`Self::before_iteration`]
    /// reaches `from`.
    pub fn create(path: PathBuf, cuda: bool, from: u64, steps: u64) -> Result<Self, String> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("--profiler-trace: cannot create {}: {e}", dir.display()))?;
        }
        std::fs::File::create(&path)
            .map_err(|e| format!("--profiler-trace: cannot write {}: {e}", path.display()))?;
        Ok(Self {
            path,
            cuda,
            from,
            until: from.saturating_add(steps),
            state: State::Waiting,
        })
    }

    /// Call on the training thread before iteration `iteration` runs, with no scope open: starts
    /// recording at the first iteration traced and opens the iteration's `ProfilerStep#N`; once
    /// the window's iterations have run, writes the trace and returns its file.
    pub fn before_iteration(&mut self, iteration: u64) -> Result<Option<PathBuf>, String> {
        if iteration >= self.until {
            return self.write();
        }
        if iteration < self.from || self.state == State::Written {
            return Ok(None);
        }
        if self.state == State::Waiting {
            // SAFETY: takes a bool; a C++ exception comes back as a message.
            check(unsafe { sh_profiler_start(self.cuda) })
                .map_err(|e| format!("--profiler-trace: starting the profiler: {e}"))?;
            self.state = State::Recording;
            RECORDING.store(true, Ordering::Relaxed);
        }
        // SAFETY: takes an integer; a C++ exception comes back as a message.
        check(unsafe { sh_profiler_step(iteration as i64) }).map_err(|e| format!("--profiler-trace: {e}"))?;
        Ok(None)
    }

    /// Whether PyTorch's profiler slows iteration `iteration`: it records it, or, being the first
    /// after the recorded ones, its ranks wait on a trace being written (each rank writes its own
    /// between two iterations, and its peers wait for it in the next one).
    pub fn slows(&self, iteration: u64) -> bool {
        (self.from..=self.until).contains(&iteration)
    }

    /// Call when the run has ended: writes the trace if it still records (the run ended within
    /// the window), and says what became of it.
    pub fn finish(mut self) -> Result<Finished, String> {
        if self.state == State::Written {
            return Ok(Finished::WrittenEarlier);
        }
        Ok(self
            .write()?
            .map_or(Finished::NothingTraced, Finished::WrittenNow))
    }

    /// Stops recording and writes the trace, if it records.
    fn write(&mut self) -> Result<Option<PathBuf>, String> {
        if self.state != State::Recording {
            return Ok(None);
        }
        // Whatever the outcome, nothing records any more: scopes stop calling the profiler.
        self.state = State::Waiting;
        RECORDING.store(false, Ordering::Relaxed);
        let c_path = CString::new(self.path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("--profiler-trace: {} holds a NUL byte", self.path.display()))?;
        // SAFETY: a NUL-terminated path that outlives the call.
        check(unsafe { sh_profiler_stop(c_path.as_ptr()) })
            .map_err(|e| format!("--profiler-trace: writing {}: {e}", self.path.display()))?;
        self.state = State::Written;
        Ok(Some(self.path.clone()))
    }
}

/// What became of a trace when its run ended ([`ProfilerTrace::finish`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Finished {
    /// Written now, into this file: the run ended within the traced iterations.
    WrittenNow(PathBuf),
    /// Written during the run, once its iterations had run.
    WrittenEarlier,
    /// No iteration ran after the warm-up.
    NothingTraced,
}

impl Drop for ProfilerTrace {
    /// The empty file [`ProfilerTrace::create`] made goes unless a trace was written into it.
    fn drop(&mut self) {
        if self.state != State::Written {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_gets_its_own_file_where_the_path_asks() {
        assert_eq!(
            path_for_rank(Path::new("traces/rank-{rank}.json"), 3),
            PathBuf::from("traces/rank-3.json")
        );
        assert_eq!(
            path_for_rank(Path::new("trace.json"), 3),
            PathBuf::from("trace.json")
        );
    }

    #[test]
    fn the_file_is_made_at_the_start_and_gone_unless_a_trace_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/traces/rank-0.json");
        let trace = ProfilerTrace::create(path.clone(), false, 1, 5).unwrap();
        assert!(path.is_file(), "made before the run trains");
        drop(trace);
        assert!(!path.exists(), "a run that wrote no trace leaves no file");
        let blocker = dir.path().join("a-file");
        std::fs::write(&blocker, "").unwrap();
        let err = ProfilerTrace::create(blocker.join("t.json"), false, 1, 5)
            .err()
            .unwrap();
        assert!(err.starts_with("--profiler-trace: cannot create"), "{err}");
    }

    /// The recorded iterations and the one after, which waits on the trace being written.
    #[test]
    fn the_recorded_iterations_and_the_one_after_are_slowed() {
        let dir = tempfile::tempdir().unwrap();
        let trace = ProfilerTrace::create(dir.path().join("t.json"), false, 2, 3).unwrap();
        let slowed: Vec<u64> = (0..10).filter(|&i| trace.slows(i)).collect();
        assert_eq!(slowed, [2, 3, 4, 5]);
    }

    #[test]
    fn the_trace_starts_after_the_warm_up_the_resumed_start_and_the_capture() {
        assert_eq!(first_traced(1, 0, None), 1);
        assert_eq!(first_traced(0, 0, None), 0);
        assert_eq!(first_traced(1, 5, None), 5);
        assert_eq!(first_traced(1, 0, Some(4)), 4);
        assert_eq!(first_traced(10, 0, Some(4)), 10);
    }
}
