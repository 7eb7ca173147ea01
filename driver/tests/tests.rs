//! The driver's integration tests: the real binary against real processes and the machine's real
//! Docker engine. Every test checks that none of its containers are left behind.

mod util;

mod autoplan;
mod cli;
mod docker;
mod image;
mod pipeline;
mod plan;
mod process;
mod results;
mod ssh;
mod sweep;
mod testbed;
