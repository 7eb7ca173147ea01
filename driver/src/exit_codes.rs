//! The driver's exit codes, documented for scripts that run experiments in a loop.

/// Every rank exited 0.
pub const SUCCESS: i32 = 0;
/// The experiment ran and failed: a rank exited non-zero or a host was lost; for a sweep, some
/// point failed.
pub const EXPERIMENT_FAILED: i32 = 1;
/// The command line, the experiment file or a sweep's grid is invalid (the runtime refusing a
/// training request included), `driver results` was given a path or key it cannot use, or
/// `driver plan` a profile it cannot plan; nothing was started.
pub const INVALID_CONFIG: i32 = 2;
/// Preflight failed (a host unreachable, the image missing or failing to build, a program
/// missing); nothing was started.
pub const PREFLIGHT_FAILED: i32 = 3;
/// Containers of the experiment could not all be removed; `docker ps -a --filter
/// label=stagehand.experiment=ID` lists them.
pub const CLEANUP_FAILED: i32 = 4;
/// The record or sweep folder could not be created, or a plot or plan output not written.
pub const RECORD_FAILED: i32 = 5;
/// Interrupted by SIGINT (Ctrl-C), SIGTERM or SIGHUP (the terminal went away); as shells report
/// 128 + SIGINT.
pub const INTERRUPTED: i32 = 130;
