//! What the core reads of the command line: validated options and the enums they hold. clap's
//! types stop in `cli.rs`, which builds these; everything below `main` imports this module,
//! never the CLI.

use std::path::PathBuf;

/// How much the terminal shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verbosity {
    /// Failures and the final result only.
    Quiet,
    /// Rank log lines, prefixed by host and rank.
    Normal,
    /// Rank log lines, metrics lines and image build output.
    Verbose,
}

/// Where ranks run, when the command line chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// Containers on the machines' Docker engines.
    Docker,
    /// Local child processes, no Docker involved.
    Process,
    /// Tasks of one Slurm job step, started by `srun`.
    Slurm,
}

/// How ranks are packed into containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ContainerMode {
    /// One container per rank.
    PerRank,
    /// One container per host, running all of the host's ranks.
    PerHost,
}

/// Whether to draw a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Draw it when stderr is a terminal.
    Auto,
    /// Never draw it.
    Off,
}

/// The command line, validated; what the core reads instead of clap types.
#[derive(Debug, Clone)]
pub struct Options {
    /// The experiment YAML.
    pub config_file: PathBuf,
    /// Container packing.
    pub container_mode: ContainerMode,
    /// Overrides the YAML's `log_directory`.
    pub output_dir: Option<PathBuf>,
    /// Overrides the YAML's `backend`.
    pub backend: Option<Backend>,
    /// This machine's runtime build to run instead of the image's (`--runtime`).
    pub runtime: Option<PathBuf>,
    /// The source the runtime image is built from (`--source`).
    pub source: Option<PathBuf>,
    /// The torch environment to mount into containers.
    pub torch_venv: PathBuf,
    /// Extra directories mounted at the same path in every container.
    pub mount_directories: Vec<PathBuf>,
    /// Master port chosen by the user, if any.
    pub master_port: Option<u16>,
    /// Overrides the YAML's `max_restarts`.
    pub max_restarts: Option<u32>,
    /// ssh_config file for SSH hosts, instead of ~/.ssh/config.
    pub ssh_config: Option<PathBuf>,
    /// Terminal verbosity.
    pub verbosity: Verbosity,
    /// Progress bar.
    pub progress: Progress,
}

/// Default location of the torch environment, matching the runtime's build scripts.
pub fn default_torch_venv() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/stagehand/torch-2.11.0")
}
