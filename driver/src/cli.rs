//! The command line: clap types live here and nowhere else. [`Cli::into_options`] turns them into
//! the validated [`Options`] the rest of the driver reads.

use std::path::PathBuf;

use clap::{ArgAction, Parser, ValueEnum};

/// Runs a stagehand experiment: ranks of the runtime (or any torchrun-style program) on Docker
/// hosts or as local processes, with logs and throughput gathered into a record folder.
#[derive(Debug, Parser)]
#[command(name = "driver", version, about, long_about = None)]
pub struct Cli {
    /// The experiment YAML (see driver_configs/).
    #[arg(long = "config-file", short = 'c', value_name = "FILE")]
    config_file: PathBuf,

    /// Run one container per host with that host's ranks inside it, instead of one per rank.
    #[arg(long = "launch-single-container", alias = "launch_single_container")]
    launch_single_container: bool,

    /// Where to put the record folder; overrides the YAML's `log_directory`.
    #[arg(long = "output-dir", value_name = "DIR")]
    output_dir: Option<PathBuf>,

    /// How to run the ranks; overrides the YAML's `backend`.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,

    /// The runtime binary to launch (mounted into containers at the same path).
    #[arg(
        long,
        env = "STAGEHAND_RUNTIME",
        value_name = "PATH",
        default_value = "target/release/runtime"
    )]
    runtime: PathBuf,

    /// The Python environment whose site-packages hold torch; mounted into containers when it exists.
    #[arg(long = "torch-venv", env = "STAGEHAND_TORCH_VENV", value_name = "DIR")]
    torch_venv: Option<PathBuf>,

    /// Extra directories to mount into every container at the same path (PipeDream's
    /// --mount_directories).
    #[arg(long = "mount-directories", alias = "mount_directories", value_name = "DIR", num_args = 1..)]
    mount_directories: Vec<PathBuf>,

    /// The master port (default: a free port the driver picks); checked free on the first machine.
    #[arg(long = "master-port", value_name = "PORT")]
    master_port: Option<u16>,

    /// An ssh_config file to use for SSH hosts instead of ~/.ssh/config (as `ssh -F`).
    #[arg(long = "ssh-config", env = "STAGEHAND_SSH_CONFIG", value_name = "FILE")]
    ssh_config: Option<PathBuf>,

    /// Print only failures and the final result.
    #[arg(long, short = 'q', conflicts_with = "verbose")]
    quiet: bool,

    /// Also print the ranks' metrics lines and image build output.
    #[arg(long, short = 'v', action = ArgAction::Count)]
    verbose: u8,

    /// Show no progress bar even on a terminal.
    #[arg(long = "no-progress")]
    no_progress: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    Docker,
    Process,
}

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
    /// The runtime binary.
    pub runtime: PathBuf,
    /// The torch environment to mount into containers.
    pub torch_venv: PathBuf,
    /// Extra directories mounted at the same path in every container.
    pub mount_directories: Vec<PathBuf>,
    /// Master port chosen by the user, if any.
    pub master_port: Option<u16>,
    /// ssh_config file for SSH hosts, instead of ~/.ssh/config.
    pub ssh_config: Option<PathBuf>,
    /// Terminal verbosity.
    pub verbosity: Verbosity,
    /// Progress bar.
    pub progress: Progress,
}

/// Default location of the torch environment, matching the runtime's build scripts.
fn default_torch_venv() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/stagehand/torch-2.11.0")
}

impl Cli {
    /// Converts the parsed arguments once; nothing past this point sees clap.
    pub fn into_options(self) -> Options {
        let verbosity = match (self.quiet, self.verbose) {
            (true, _) => Verbosity::Quiet,
            (false, 0) => Verbosity::Normal,
            (false, _) => Verbosity::Verbose,
        };
        Options {
            config_file: self.config_file,
            container_mode: if self.launch_single_container {
                ContainerMode::PerHost
            } else {
                ContainerMode::PerRank
            },
            output_dir: self.output_dir,
            backend: self.backend.map(|b| match b {
                BackendArg::Docker => Backend::Docker,
                BackendArg::Process => Backend::Process,
            }),
            runtime: self.runtime,
            torch_venv: self.torch_venv.unwrap_or_else(default_torch_venv),
            mount_directories: self.mount_directories,
            master_port: self.master_port,
            ssh_config: self.ssh_config,
            verbosity,
            progress: if self.no_progress || verbosity == Verbosity::Quiet {
                Progress::Off
            } else {
                Progress::Auto
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(args: &[&str]) -> Options {
        Cli::try_parse_from(std::iter::once("driver").chain(args.iter().copied()))
            .unwrap()
            .into_options()
    }

    #[test]
    fn pipedreams_usage_parses_into_a_per_host_plan() {
        let o = options(&[
            "--config-file",
            "driver_configs/vgg16_2pipe.yml",
            "--launch-single-container",
        ]);
        assert_eq!(o.container_mode, ContainerMode::PerHost);
        assert_eq!(o.config_file, PathBuf::from("driver_configs/vgg16_2pipe.yml"));
        assert_eq!(o.backend, None);
        assert_eq!(o.verbosity, Verbosity::Normal);
    }

    #[test]
    fn quiet_turns_the_progress_bar_off() {
        let o = options(&["-c", "x.yml", "-q", "--backend", "process"]);
        assert_eq!(o.verbosity, Verbosity::Quiet);
        assert_eq!(o.progress, Progress::Off);
        assert_eq!(o.backend, Some(Backend::Process));
        assert_eq!(o.container_mode, ContainerMode::PerRank);
    }

    #[test]
    fn quiet_and_verbose_conflict() {
        assert!(Cli::try_parse_from(["driver", "-c", "x.yml", "-q", "-v"]).is_err());
    }
}
