//! Reporters turn events into what people and tools read: terminal lines, the progress bar and the
//! record folder. Each implements [`Reporter`]; the run hands every event to all of them.

pub mod progress;
pub mod record;
pub mod terminal;

use crate::events::Event;

/// A consumer of run events.
pub trait Reporter {
    /// Handles one event. An error is shown once and does not stop the run: the ranks' work is
    /// worth more than a record file.
    fn report(&mut self, event: &Event) -> Result<(), crate::records::RecordError>;
}

/// Fans events out to several reporters.
pub struct Reporters {
    reporters: Vec<Box<dyn Reporter>>,
    warned: bool,
}

impl Reporters {
    /// Wraps the given reporters, in the order they see events.
    pub fn new(reporters: Vec<Box<dyn Reporter>>) -> Reporters {
        Reporters {
            reporters,
            warned: false,
        }
    }

    /// Hands an event to every reporter.
    pub fn report(&mut self, event: &Event) {
        for r in &mut self.reporters {
            if let Err(e) = r.report(event) {
                if !self.warned {
                    self.warned = true;
                    stderr_line!("warning: {}", crate::error::error_chain(&e));
                }
            }
        }
    }
}
