//! The signals that stop a run or a sweep: SIGINT (Ctrl-C) and SIGTERM. Once installed they are
//! the driver's to act on; a run stops its ranks, a sweep stops after its current point.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// SIGINT and SIGTERM, received as one stream.
pub struct StopSignals {
    int: Signal,
    term: Signal,
}

impl StopSignals {
    /// Installs the handlers; from now on these signals are the driver's to act on.
    pub fn install() -> std::io::Result<StopSignals> {
        Ok(StopSignals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
        })
    }

    /// Resolves when either signal arrives.
    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }

    /// A flag set once either signal arrives, for work that checks between steps (a sweep's
    /// points); needs a running tokio runtime.
    pub fn into_flag(mut self) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        let set = flag.clone();
        tokio::spawn(async move {
            self.recv().await;
            set.store(true, Ordering::SeqCst);
        });
        flag
    }
}
