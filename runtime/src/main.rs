//! The `runtime` binary: parse arguments, run, and map the outcome to an exit code
//! (0 success, 1 the run failed, 2 a bad argument, 143 stopped by SIGTERM after a checkpoint).
//!
//! The modules are layered, bottom first; each imports only modules listed before it, so none
//! imports one that imports it back:
//! - `ffi`: the C ABI of the bridge to libtorch (`csrc/`); `lr`: learning-rate schedules;
//!   `signals`: SIGTERM noted for a checkpoint; `host_memory`: what becomes of freed memory;
//!   `profiler_trace`: PyTorch's profiler over a run's iterations;
//! - `cuda`: CUDA, loaded at run time; `comm`: c10d's store and process groups;
//! - `models`; `data`: batch streams for a model's input; `schedule`: per-rank action lists;
//! - `config`: every validated request;
//! - `metrics`: the metrics lines and the measurements they carry;
//! - `stage`: one rank's slice of the model with its optimizer, autograd helpers and amp;
//! - `pipeline`: running a stage's action list across ranks;
//! - the commands, none importing another: `train`, `profile`, `inspect`, `forward`, `p2p`,
//!   `reach`, `info`;
//! - `cli`, where clap stops, and this file.

mod cli;
mod comm;
mod config;
mod cuda;
mod data;
mod determinism;
mod ffi;
mod forward;
mod host_memory;
mod info;
mod inspect;
mod lr;
mod metrics;
mod models;
mod p2p;
mod pipeline;
mod profile;
mod profiler_trace;
mod reach;
mod schedule;
mod signals;
mod stage;
mod train;

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::config::{Command, DeviceSpec};

use stagehand_contract::{Event, PeerSilent};

use stagehand_contract::exit_codes::{
    FAILED as EXIT_FAILED, REFUSED as EXIT_USAGE, TERMINATED as EXIT_TERMINATED,
    UNRESOLVED as EXIT_UNRESOLVED,
};

fn main() -> ExitCode {
    one_line_panics();
    let cli = match cli::Cli::parse_given_from(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            let _ = e.print(); // --help, --version
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line: clap's first paragraph (the reason and any names it lists), without usage.
            let rendered = e.render().to_string();
            let paragraph = rendered.split("\n\n").next().unwrap_or("bad arguments");
            let reason = paragraph.split_whitespace().collect::<Vec<_>>().join(" ");
            let reason = reason.trim_start_matches("error: ");
            eprintln!("runtime: error: {reason} (see runtime --help)");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let command = match cli.into_command() {
        Ok(command) => command,
        Err(e) => {
            eprintln!("runtime: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // CUDA loads before anything else touches libtorch (which decides once whether CUDA
    // exists); a CUDA device that is not there is a bad argument.
    if let Some(DeviceSpec::Cuda(index)) = command.device() {
        if let Err(reason) = cuda::require_device(index) {
            eprintln!("runtime: error: --device: {reason}");
            return ExitCode::from(EXIT_USAGE);
        }
    }
    // A run that fails waiting for a peer says which, for the driver to name it.
    let waits = match &command {
        Command::Train(config) => Some((config.dist.rank, config.dist.comm_timeout)),
        _ => None,
    };
    let run = || match command {
        // A request that would not start is a bad argument.
        Command::Check(config) => {
            train::check(&config, &mut std::io::stdout().lock()).map_err(train::Refused::error)
        }
        Command::Info => info::run(&mut std::io::stdout().lock()),
        Command::Reach(config) => reach::run(&config, &mut std::io::stdout().lock()),
        Command::Train(config) => train::run(&config, &mut metrics::Emitter::new(std::io::stdout())),
        Command::Modules(config) => inspect::run(&config, &mut std::io::stdout().lock()),
        Command::Profile(config) => profile::run(&config, &mut std::io::stdout().lock()),
        Command::Forward(config) => forward::run(&config, &mut std::io::stdout().lock()),
        Command::P2pBench(config) => p2p::run(&config, &mut std::io::stdout().lock()),
    };
    // Memory running out is how a run fails, said in one line by the panic hook; any other
    // panic is a bug, and ends as Rust's do (101).
    let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(result) => result,
        Err(_) if OUT_OF_MEMORY.load(Ordering::SeqCst) => return ExitCode::from(EXIT_FAILED),
        Err(panic) => std::panic::resume_unwind(panic),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<signals::Stopped>().is_some() => {
            // Not eprintln!, which panics where the reader is gone (the driver killed outright).
            let _ = writeln!(std::io::stderr(), "runtime: {e}");
            ExitCode::from(EXIT_TERMINATED)
        }
        // The driver's preflight tells a name no host resolves from a port it cannot reach.
        Err(e) if e.downcast_ref::<reach::Unresolved>().is_some() => {
            eprintln!("runtime: error: {e:#}");
            ExitCode::from(EXIT_UNRESOLVED)
        }
        // What `--check` refuses is a bad argument in a run too.
        Err(e) if e.downcast_ref::<train::Refused>().is_some() => {
            eprintln!("runtime: error: {e:#}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(e) => {
            if let Some(silent) = waits.and_then(|(rank, timeout)| peer_silent(&e, rank, timeout)) {
                // Not println!, which panics where the reader is gone.
                let _ = writeln!(std::io::stdout(), "{}", silent.to_line());
            }
            eprintln!("runtime: error: {e:#}");
            ExitCode::from(EXIT_FAILED)
        }
    }
}

/// The `peer_silent` event of rank `rank`'s run that failed with `e`, where that is a
/// point-to-point operation whose peer did not answer within `timeout`.
fn peer_silent(e: &anyhow::Error, rank: usize, timeout: std::time::Duration) -> Option<Event> {
    let (peer, op) = e
        .chain()
        .find_map(|cause| cause.downcast_ref::<comm::CommError>())?
        .silent_peer()?;
    Some(Event::PeerSilent(PeerSilent {
        rank,
        peer,
        op,
        timeout_s: timeout.as_secs_f64(),
    }))
}

/// A panic (as a rule libtorch refusing an allocation inside tch, whose error carries a C++
/// backtrace) ends the rank with one line ([`panic_line`]) instead of pages of frames;
/// `RUST_BACKTRACE` set keeps Rust's own report.
fn one_line_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        if out_of_memory(&message) {
            OUT_OF_MEMORY.store(true, Ordering::SeqCst);
        }
        if std::env::var_os("RUST_BACKTRACE").is_some() {
            return default(info);
        }
        let at = info.location().map(|l| format!("{}:{}", l.file(), l.line()));
        eprintln!("{}", panic_line(&message, at.as_deref()));
    }));
}

/// Whether a panic ran out of memory (libtorch refusing an allocation, on the host or a GPU).
static OUT_OF_MEMORY: AtomicBool = AtomicBool::new(false);

/// Whether a panic's message says an allocation was refused.
fn out_of_memory(message: &str) -> bool {
    ["can't allocate memory", "out of memory"]
        .iter()
        .any(|m| message.contains(m))
}

/// A panic's `message` (raised `at`) as one line: what failed, where, and for memory what to
/// lower. libtorch's error, as tch's unwrap quotes it, is cut at its first line (its backtrace
/// follows with its line breaks escaped).
fn panic_line(message: &str, at: Option<&str>) -> String {
    let first = message
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("a panic");
    let first = first.split("\\n").next().unwrap_or(first);
    let first = first.trim_start_matches("called `Result::unwrap()` on an `Err` value: ");
    let first = first.trim_start_matches("Torch(\"");
    let at = at.map(|at| format!(" (at {at})")).unwrap_or_default();
    let hint = match out_of_memory(message) {
        true => "; the run needs more memory than there is: lower --batch-size or the model's sizes",
        false => "",
    };
    format!("runtime: error: {first}{at}{hint}")
}

#[cfg(test)]
mod tests {
    use super::panic_line;

    #[test]
    fn a_panic_is_one_line_and_memory_says_what_to_lower() {
        let tch = "called `Result::unwrap()` on an `Err` value: Torch(\"[enforce fail at alloc_cpu.cpp:127] \
                   DefaultCPUAllocator: can't allocate memory: you tried to allocate 32000000000 bytes.\\nframe \
                   #0: c10::ThrowEnforceNotMet\\nframe #1: ...\")";
        assert_eq!(
            panic_line(tch, Some("tensor_generated.rs:15382")),
            "runtime: error: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate \
             memory: you tried to allocate 32000000000 bytes. (at tensor_generated.rs:15382); the run \
             needs more memory than there is: lower --batch-size or the model's sizes"
        );
        assert_eq!(
            panic_line("index out of bounds\nmore", None),
            "runtime: error: index out of bounds"
        );
    }
}
