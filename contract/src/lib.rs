//! The contracts between the driver and the runtime: the metrics lines a rank prints on stdout,
//! the layer profile `runtime profile` writes for the planner, and the PipeDream stage-config
//! format. Both binaries depend on this crate; it never links
//! libtorch, so the driver builds without it.

pub mod architecture;
pub mod defaults;
pub mod exit_codes;
pub mod metrics;
pub mod profile;
pub mod slurm;
pub mod stage_config;

pub use metrics::{
    Channel, Event, Iteration, P2p, P2pOp, P2pTensor, PartialGroup, PeerSilent, ReduceMetrics, RunConfig,
    Start, Summary, Trace, ValidationFigures, SCHEMA_VERSION,
};
pub use profile::{ModuleProfile, Profile, PROFILE_VERSION};
pub use stage_config::{Stage, StageConfig, StageConfigError, StagePlan};
