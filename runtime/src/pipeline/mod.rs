//! Running one stage of a pipeline across ranks: what crosses stage boundaries, who sends it to
//! whom and in what order, the channels it travels on, the replicas' gradient all-reduce, and the
//! executor that runs a rank's action list (from the schedules) over c10d.

mod bundle;
mod channel;
mod exec;
mod partial;
mod reduce;
mod route;
mod sparse;
mod wire;

pub use bundle::Bundle;
pub use channel::{Channels, Lanes};
pub use exec::{first_replayed, Checkpointing, Executor, Links, OpenSplit, Report, Tally, Validation};
pub use partial::{outlast, PartialReduce};
pub use reduce::Reducer;
pub use sparse::coo_wire_bytes;
pub use wire::TensorSpec;
