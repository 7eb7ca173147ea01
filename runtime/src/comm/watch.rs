//! Point-to-point operations waited for on threads of their own, so that a rank can ask whether
//! one has ended without blocking: c10d's Gloo works say so only once something waits on them,
//! and a wait that times out fails the whole group, so they cannot be polled with short waits.
//! The watching thread waits without the group's timeout; whoever then waits on the [`Watched`]
//! keeps to it, counted from that wait, as with the [`Work`] itself, and at its end aborts the
//! thread's wait (which leaves the group usable).

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::group::Shared;
use super::{CommError, Work};

/// How long a watching thread waits on its own: long enough never to end a wait that someone
/// will still make, bounded so that a thread nobody waits on is not kept for ever.
const WATCH_LIMIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// A Gloo [`Work`] waited for on a thread of its own ([`Watched::new`]). Dropped without being
/// waited for, it aborts the thread's wait and joins it.
pub struct Watched {
    thread: Option<JoinHandle<()>>,
    outcome: mpsc::Receiver<Result<(), CommError>>,
    shared: Arc<Shared>,
    /// The group's timeout and what its errors name.
    timeout: Duration,
    timed_out: CommError,
}

impl Watched {
    /// Starts waiting on `work` on a thread of its own. Only Gloo's works can be watched: on NCCL
    /// a wait only orders streams, so a finished wait would not mean the operation had ended.
    pub fn new(work: Work) -> Result<Watched, CommError> {
        let shared = Arc::new(work.shared().ok_or_else(|| {
            CommError::Invalid("internal error: only a pending Gloo operation can be watched".into())
        })?);
        let timeout = work.timeout();
        let timed_out = work.error(format!("timed out after {}ms", timeout.as_millis()));
        let (give, given) = mpsc::channel::<Work>();
        let (tell, outcome) = mpsc::channel();
        let on_thread = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("watch".into())
            .stack_size(256 << 10)
            .spawn(move || {
                let Ok(mut work) = given.recv() else {
                    return;
                };
                let result = work.finish_within(WATCH_LIMIT, Some(&on_thread));
                let _ = tell.send(result.map_err(|reason| work.error(reason)));
            });
        let thread = match spawned {
            Ok(thread) => thread,
            Err(e) => {
                // The work is still here: its drop (a wait) ends at once once aborted.
                shared.abort();
                drop(work);
                return Err(CommError::Invalid(format!(
                    "could not start a thread to wait on an operation: {e}"
                )));
            }
        };
        give.send(work).expect("the thread waits for its work");
        Ok(Watched {
            thread: Some(thread),
            outcome,
            shared,
            timeout,
            timed_out,
        })
    }

    /// Whether the operation has ended, successfully or not (so [`Watched::wait`] returns at
    /// once); never blocks.
    pub fn is_completed(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits until the operation has completed, at most the group's timeout from now; errors
    /// include timeouts and a dead peer, as [`Work::wait`]'s.
    pub fn wait(mut self) -> Result<(), CommError> {
        let outcome = match self.outcome.recv_timeout(self.timeout) {
            Ok(outcome) => outcome,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.shared.abort();
                Err(std::mem::replace(
                    &mut self.timed_out,
                    CommError::Invalid(String::new()),
                ))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(CommError::Invalid(
                "internal error: the thread waiting on an operation ended without its outcome".into(),
            )),
        };
        self.join();
        if outcome.is_err() {
            super::group::note_failed_wait();
        }
        outcome
    }

    fn join(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shared.abort();
            self.join();
        }
    }
}
