//! The runtime's defaults that the driver must know too, to say what a run will do without
//! asking the runtime (its progress bar's length, for one).

/// `--batch-size` when none is given: samples per iteration.
pub const BATCH_SIZE: usize = 32;

/// An epoch of synthetic data, in samples: PipeDream's synthetic dataset's length.
pub const SYNTHETIC_EPOCH_SAMPLES: u64 = 1_000_000;

/// What `--profiler-trace` replaces with the rank in its path, so that ranks started with one
/// argument vector (Slurm's tasks) or on one host write files of their own.
pub const TRACE_RANK_PLACEHOLDER: &str = "{rank}";
