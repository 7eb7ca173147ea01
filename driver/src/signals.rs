//! The signals that stop a run or a sweep: SIGINT (Ctrl-C), SIGTERM, and SIGHUP (the terminal
//! went away: an SSH session dropped, a terminal window closed). Once installed they are the
//! driver's to act on; a run stops its ranks, a sweep stops after its current point. Left to its
//! default, a hang-up would end the driver on the spot, its ranks running on and its containers
//! left to their leases. A driver started with SIGHUP ignored (`nohup driver ...`) keeps ignoring
//! it and runs on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// SIGINT, SIGTERM and SIGHUP, received as one stream.
pub struct StopSignals {
    int: Signal,
    term: Signal,
    /// `None` when the driver was started with SIGHUP ignored.
    hup: Option<Signal>,
    /// One of them was received: the user asked the driver to be done, whichever wait saw it.
    received: bool,
}

impl StopSignals {
    /// Installs the handlers; from now on these signals are the driver's to act on.
    pub fn install() -> std::io::Result<StopSignals> {
        let hup = match hangups_ignored() {
            true => None,
            false => Some(signal(SignalKind::hangup())?),
        };
        Ok(StopSignals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup,
            received: false,
        })
    }

    /// Resolves when any of the signals arrives.
    pub async fn recv(&mut self) {
        let hangup = async {
            match &mut self.hup {
                Some(hup) => hup.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
            _ = hangup => {}
        }
        self.received = true;
    }

    /// Whether one of the signals has arrived since they were installed: received by [`recv`]
    /// in some wait (a copy the signal cut short, say) or not yet (which this receives).
    ///
    /// [`recv`]: StopSignals::recv
    pub fn arrived(&mut self) -> bool {
        use futures_util::FutureExt;
        self.received || self.recv().now_or_never().is_some()
    }

    /// A flag set once any of the signals arrives, for work that checks between steps (a sweep's
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

/// Whether SIGHUP is ignored in this process (as `nohup` leaves it); asked, not changed.
fn hangups_ignored() -> bool {
    let mut current = std::mem::MaybeUninit::<nix::libc::sigaction>::zeroed();
    // SAFETY: a null new action only reads the current one into `current`, which is zeroed and
    // of the right type.
    let read = unsafe { nix::libc::sigaction(nix::libc::SIGHUP, std::ptr::null(), current.as_mut_ptr()) };
    // SAFETY: zero-initialised and, on success, written by sigaction.
    read == 0 && unsafe { current.assume_init() }.sa_sigaction == nix::libc::SIG_IGN
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use nix::sys::signal::{raise, Signal};

    use super::StopSignals;

    /// A signal one wait received (the traces' copy that Ctrl-C cut short) still counts at the
    /// next check, so a run the user asked to end is not started again. SIGTERM, raised after the
    /// handlers are in place, reaches this test's handler only: nothing else in the test binary
    /// installs one.
    #[tokio::test]
    async fn a_signal_one_wait_received_has_still_arrived_for_the_next() {
        let mut signals = StopSignals::install().unwrap();
        assert!(!signals.arrived(), "no signal was sent yet");
        raise(Signal::SIGTERM).unwrap();
        tokio::time::timeout(Duration::from_secs(30), signals.recv())
            .await
            .expect("the raised SIGTERM reaches recv");
        assert!(signals.arrived(), "the SIGTERM recv took no longer counts");
    }
}
