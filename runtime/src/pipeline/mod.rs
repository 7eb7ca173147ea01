//! Running one stage of a pipeline across ranks: the schedules (pure action lists), what
//! crosses stage boundaries, who sends it to whom and in what order, the channels it travels on,
//! and the executor that runs a rank's list over c10d.

mod channel;
mod exec;
mod reduce;
mod route;
pub mod schedule;
mod wire;

pub use channel::Channels;
pub use exec::{Executor, Links};
pub use reduce::{ReduceOptions, Reducer};
pub use wire::TensorSpec;
