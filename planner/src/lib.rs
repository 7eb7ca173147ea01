//! Picks where to cut a model into pipeline stages and how far to replicate each stage, from
//! measured per-module costs: PipeDream's dynamic program, with a cost model of this project's
//! runtime.
//!
//! The program runs over suffixes of the module list: `best(i, m)` is the lowest time per
//! minibatch for modules `i..` on `m` workers, whose first stage is `i..j` on `r` replicas
//! followed by `best(j, m - r)`. A stage's time is its compute shared by its replicas plus their
//! gradient all-reduce; a boundary costs its activation forward and its gradient back. The
//! pipeline's time is its slowest stage or boundary (steady state, as PipeDream assumed); for a
//! flushing schedule (GPipe, 1F1B) compute and transfers stretch over the pipeline's fill and
//! drain, and each stage then updates once, so the program runs once per stage count. Working
//! over suffixes means a stage knows how many workers sit downstream of it, so its in-flight
//! microbatches, and with them its memory, are known exactly.

mod cost;
mod pipedream;
mod solve;

pub use cost::{
    fill_and_drain, CostModel, LayerCost, Network, Schedule, StageParts, MAX_LAYER_BYTES, MAX_LAYER_SECONDS,
};
pub use pipedream::{Graph, GraphError, GraphNode, Segment};
pub use solve::{
    alternatives, plan, plan_for_shape, Plan, PlanError, PlannedStage, MAX_ALTERNATIVE_WORKERS, MAX_STEPS,
    MAX_TABLE_BYTES,
};

#[cfg(test)]
mod tests;
