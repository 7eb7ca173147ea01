//! `driver`: runs an experiment YAML as ranks in containers or processes and records the results.
//! This file only parses arguments, runs, and turns the outcome into an exit code (see
//! [`exit_codes`]), printing an error once with its whole cause chain.

mod cli;
mod config;
mod events;
mod exit_codes;
mod hosts;
mod launch;
mod plan;
#[allow(dead_code)] // until the CLI has its `plan` subcommand
mod planning;
mod reporters;
mod run;

use clap::Parser;

/// An error and its sources, one `caused by` per line.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str("\n  caused by: ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn main() {
    let options = cli::Cli::parse().into_options();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(exit_codes::PREFLIGHT_FAILED);
        }
    };
    let code = match runtime.block_on(run::run(options)) {
        Ok(()) => exit_codes::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            e.exit_code()
        }
    };
    // Reader tasks of killed ranks may still be parked; don't wait for them.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    std::process::exit(code);
}
