//! Running one stage of a pipeline across ranks: the schedules (pure action lists), what
//! crosses stage boundaries, and the executor that runs a rank's list over c10d.

mod exec;
pub mod schedule;
mod wire;

pub use exec::{Executor, Links};
pub use wire::TensorSpec;
