//! How an error is shown: with its whole cause chain, one `caused by` per line.

/// An error and its sources, one `caused by` per line.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    joined(error, "\n  caused by: ")
}

/// An error and its sources on one line, each after a `: `, for a record.
pub fn error_line(error: &dyn std::error::Error) -> String {
    joined(error, ": ")
}

fn joined(error: &dyn std::error::Error, separator: &str) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(separator);
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
