//! The driver's integration tests that need no Docker engine: the real binary with the process
//! backend, `driver check`, `driver results`, `driver plan`, sweeps of local processes, and
//! command-line and configuration errors. Every test that starts ranks checks that no process of
//! it is left behind. They pass with the engine unreachable:
//! `DOCKER_HOST=unix:///nonexistent.sock cargo test --release -p stagehand-driver --test local`.

/// No test of this binary may call the docker CLI: the harness's docker helpers refuse.
pub const USES_DOCKER: bool = false;

mod util;

mod autoplan;
mod check;
mod cli;
mod pipeline;
mod plan;
mod process;
mod results;
mod slurm;
mod sweep;
