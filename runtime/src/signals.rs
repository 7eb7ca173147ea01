//! SIGTERM, as Slurm sends before a time limit and the driver when it stops ranks: a rank that
//! checkpoints notes it (the handler only sets a flag) and stops at the end of the iteration it
//! is in, after every rank has agreed to and written its checkpoint of that iteration.

use std::sync::atomic::{AtomicBool, Ordering};

static TERM: AtomicBool = AtomicBool::new(false);
/// Whether [`catch_term`] ran: the run stops after a checkpoint when asked to.
static CAUGHT: AtomicBool = AtomicBool::new(false);

extern "C" fn note_term(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    TERM.store(true, Ordering::SeqCst);
}

/// From now on SIGTERM sets the flag instead of ending the process.
pub fn catch_term() -> Result<(), String> {
    let handler = note_term as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installs a handler that only stores to an atomic.
    let previous = unsafe { libc::signal(libc::SIGTERM, handler) };
    if previous == libc::SIG_ERR {
        return Err(format!(
            "cannot catch SIGTERM: {}",
            std::io::Error::last_os_error()
        ));
    }
    CAUGHT.store(true, Ordering::SeqCst);
    Ok(())
}

/// Whether SIGTERM arrived since [`catch_term`], or the metrics' reader went away since
/// ([`output_gone`]).
pub fn term_requested() -> bool {
    TERM.load(Ordering::SeqCst)
}

/// Takes the metrics' reader going away (a broken pipe: the driver killed outright, whose ranks
/// the kernel also sends SIGTERM) as SIGTERM, where the run stops after a checkpoint; returns
/// whether it does, else the broken pipe ends the run as any failure to write does.
pub fn output_gone() -> bool {
    let caught = CAUGHT.load(Ordering::SeqCst);
    if caught {
        TERM.store(true, Ordering::SeqCst);
    }
    caught
}

/// A run ended early by SIGTERM, after its checkpoint of `iterations_done` was written
/// (the process exits 143, as if the signal had ended it).
#[derive(Debug, thiserror::Error)]
#[error("stopped by SIGTERM after {}; its checkpoint is in {}", done(*.iterations_done), dir.display())]
pub struct Stopped {
    pub iterations_done: u64,
    pub dir: std::path::PathBuf,
}

/// `n` iterations done, numbered as the iteration lines number them (from 0).
fn done(n: u64) -> String {
    match n {
        0 => "no iteration".into(),
        1 => "iteration 0".into(),
        n => format!("iterations 0 to {}", n - 1),
    }
}
