//! `driver`: runs an experiment YAML as ranks in containers or processes and records the results;
//! sweeps grids of experiments, reads records into tables and plots, and plans pipelines.
//! This file only parses arguments, runs, and turns the outcome into an exit code (see
//! [`exit_codes`]), printing an error once with its whole cause chain.
//!
//! Modules import only downwards, bottom to top:
//! - `console` (the macros every module prints with: output that went away never stops a run);
//! - `error`, `exit_codes`, `signals`, `events`, `options`: what everything shares;
//! - `config` (the YAML, typed) -> `experiment` (resolved: hosts, ranks, argv, image);
//! - `records` (the record format: folders, files, summary, resolved config, sweep index);
//! - `reporters` (events rendered: terminal, progress bar, the record);
//! - `hosts` (engines, SSH, preflight, images) -> `launch` (backends, one `run_ranks`);
//! - `partition` (`driver plan`) -> `auto_partition` (`config_file: auto` inside a run);
//! - `run` (one experiment) -> `sweep`; `results` (reads records only);
//! - `cli` (clap, only `main` imports it).
#[macro_use]
mod console;

mod auto_partition;
mod check;
mod cli;
mod config;
mod error;
mod events;
mod exit_codes;
mod experiment;
mod hosts;
mod launch;
mod options;
mod partition;
mod records;
mod reporters;
mod results;
mod run;
mod signals;
mod sweep;

use clap::Parser;

use crate::cli::Task;

/// Prints `error` once with its causes and returns its exit code.
fn fail(error: &dyn std::error::Error, code: i32) -> i32 {
    stderr_line!("error: {}", error::error_chain(error));
    code
}

fn main() {
    let task = cli::Cli::parse().into_task().unwrap_or_else(|e| e.exit());
    let code = match task {
        Task::Run(options) => on_async(async {
            match run::run(options).await {
                Ok(()) => exit_codes::SUCCESS,
                Err(e) => fail(&e, e.exit_code()),
            }
        }),
        Task::Check(options) => match check::run(&options) {
            Ok(()) => exit_codes::SUCCESS,
            Err(e) => fail(&e, e.exit_code()),
        },
        Task::Sweep(options) => on_async(async {
            match sweep::run(options).await {
                Ok(code) => code,
                Err(e) => fail(&e, e.exit_code()),
            }
        }),
        Task::Results(options) => match results::run(&options) {
            Ok(()) => exit_codes::SUCCESS,
            Err(e) => fail(&e, e.exit_code()),
        },
        Task::Plan(options) => match partition::run(&options) {
            Ok(()) => exit_codes::SUCCESS,
            Err(e) => fail(&e, plan_exit_code(&e)),
        },
    };
    std::process::exit(code);
}

/// `driver plan`: a bad profile or plan request is the user's to fix (2); an output file that
/// cannot be written is 5, as a record folder.
fn plan_exit_code(error: &partition::PartitionError) -> i32 {
    match error {
        partition::PartitionError::Read { .. }
        | partition::PartitionError::Profile { .. }
        | partition::PartitionError::Plan(_) => exit_codes::INVALID_CONFIG,
        partition::PartitionError::Write { .. } => exit_codes::RECORD_FAILED,
    }
}

/// Runs an experiment or a sweep on the async runtime and returns its exit code.
fn on_async(work: impl std::future::Future<Output = i32>) -> i32 {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            stderr_line!("error: cannot start the async runtime: {e}");
            return exit_codes::PREFLIGHT_FAILED;
        }
    };
    let code = runtime.block_on(work);
    // Reader tasks of killed ranks may still be parked; don't wait for them.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}
