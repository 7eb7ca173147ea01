//! The runtime's exit codes, which the driver reads: whether a failure would end every start
//! the same way, and what a preflight check found.

/// A failure of the run (a peer gone, memory run out, a file that cannot be read).
pub const FAILED: u8 = 1;
/// A request the runtime refuses (arguments, a plan that cannot run): the same refusal would end
/// every start.
pub const REFUSED: u8 = 2;
/// `runtime reach connect` could not resolve the master address's name on any try: the name,
/// not the port, is what to change.
pub const UNRESOLVED: u8 = 3;
/// Stopped by SIGTERM (after the checkpoint of the iteration it was in, where it checkpoints):
/// the status the signal itself would have given.
pub const TERMINATED: u8 = 143;
