//! The driver's integration tests that need the machine's Docker engine: the real binary against
//! real containers (and real sshd, test-bed engines). Every test checks that none of its
//! containers are left behind. The tests that need no engine are the `local` binary (local.rs).

/// This binary's tests talk to the machine's Docker engine (see util's docker helpers).
pub const USES_DOCKER: bool = true;

mod util;

mod docker;
mod docker_runtime;
mod image;
mod ssh;
mod testbed;
