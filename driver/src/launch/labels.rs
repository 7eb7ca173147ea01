//! The labels every container of an experiment carries; cleanup selects on the experiment id
//! alone, so whatever else a container was given, it is found and removed.

/// Label holding the experiment id; the only thing cleanup selects on.
pub const LABEL_EXPERIMENT: &str = "stagehand.experiment";
/// Label holding the experiment name.
pub const LABEL_NAME: &str = "stagehand.name";
/// Label holding the rank (or ranks, comma-separated, for a per-host container).
pub const LABEL_RANK: &str = "stagehand.rank";
