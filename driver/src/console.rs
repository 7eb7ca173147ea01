//! Lines for whoever watches the driver: a terminal, a pipe, a log file. The driver's output may
//! go away while it runs (`driver ... | head`, a `tee` that was killed, the terminal of an SSH
//! session that dropped), and `println!` would then panic and end the driver without stopping
//! its ranks or removing its containers. These write the same text and drop what cannot be
//! written: the run goes on and ends as it would have, and its record keeps everything.

/// `println!` that never fails.
macro_rules! stdout_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `eprintln!` that never fails.
macro_rules! stderr_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// `print!` that never fails.
macro_rules! stdout_text {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = write!(out, $($arg)*);
        let _ = out.flush();
    }};
}

/// `eprint!` that never fails.
macro_rules! stderr_text {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr().lock(), $($arg)*);
    }};
}
