//! The command line: clap types live here and nowhere else. [`Cli::into_task`] turns them into
//! the validated [`Task`] (its [`Options`]) the rest of the driver reads.

use std::path::PathBuf;

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};

use crate::options::{default_torch_venv, Backend, ContainerMode, Options, Progress, Verbosity};
use crate::partition::{PartitionOptions, PlanRequest};
use crate::results::{CurveX, Format, ResultsOptions, Smoothing, Target};
use crate::sweep::{SweepOptions, SweepSource};

/// Runs stagehand experiments: ranks of the runtime (or any torchrun-style program) on Docker
/// hosts or as local processes, with logs and throughput gathered into record folders; sweeps over
/// configuration grids, result tables and plots, and pipeline plans from layer profiles.
///
/// `driver --config-file FILE` runs one experiment (the same as `driver run --config-file FILE`).
#[derive(Debug, Parser)]
#[command(
    name = "driver",
    version,
    about,
    long_about = None,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs one experiment (what `driver --config-file FILE` does).
    Run(RunArgs),
    /// Resolves an experiment and prints what a run would do (hosts, containers, each rank's
    /// GPUs and command, the image), with the runtime's own check of every rank's request;
    /// touches no host. The same as `driver run --dry-run`.
    Check(CheckArgs),
    /// Runs an experiment once per point of a configuration grid, into one sweep folder.
    Sweep(SweepArgs),
    /// Prints a table (or writes a plot) of experiment records: one record, a sweep folder, or a
    /// folder of them.
    Results(ResultsArgs),
    /// Plans a pipeline from a layer profile (`runtime profile`): writes PipeDream's stage config.
    Plan(PlanArgs),
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The experiment YAML (see driver_configs/).
    #[arg(
        long = "config-file",
        alias = "config_file",
        short = 'c',
        value_name = "FILE",
        required = true
    )]
    config_file: Option<PathBuf>,

    /// Check the experiment and print what would run, as `driver check`; start nothing.
    #[arg(long = "dry-run")]
    dry_run: bool,

    #[command(flatten)]
    experiment: ExperimentArgs,
}

#[derive(Debug, Args)]
struct CheckArgs {
    /// The experiment YAML (see driver_configs/).
    #[arg(long = "config-file", alias = "config_file", short = 'c', value_name = "FILE")]
    config_file: PathBuf,

    #[command(flatten)]
    experiment: ExperimentArgs,
}

#[derive(Debug, Args)]
struct SweepArgs {
    /// The experiment YAML; its `sweep:` section and every --grid give the grid.
    #[arg(
        long = "config-file",
        alias = "config_file",
        short = 'c',
        value_name = "FILE",
        required_unless_present = "resume"
    )]
    config_file: Option<PathBuf>,

    /// A grid axis: an experiment key and its values, e.g. `batch_size=32,64`. Repeat for more
    /// axes; the sweep runs their cartesian product.
    #[arg(long, value_name = "KEY=V1,V2", value_parser = parse_grid)]
    grid: Vec<(String, Vec<String>)>,

    /// Runs each point this many times.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,

    /// Continues the sweep in DIR: runs only the points without a succeeded record.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["config_file", "grid", "repeat", "output_dir"])]
    resume: Option<PathBuf>,

    #[command(flatten)]
    experiment: ExperimentArgs,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("curves").multiple(true)))]
#[command(group(
    clap::ArgGroup::new("curve_readers")
        .multiple(true)
        .args(["plot_loss", "plot_accuracy", "time_to"])
))]
struct ResultsArgs {
    /// Record folders, sweep folders or folders of them (default `experiments/`), and `KEY=VALUE`
    /// filters (e.g. `schedule=1f1b`; a key given twice keeps the rows with either value).
    #[arg(value_name = "PATH|KEY=VALUE")]
    inputs: Vec<String>,

    /// Output format.
    #[arg(long, value_enum, default_value_t = FormatArg::Table)]
    format: FormatArg,

    /// Sorts rows by this column or experiment key (numbers numerically).
    #[arg(long, value_name = "KEY")]
    sort: Option<String>,

    /// One table per value of this column or experiment key.
    #[arg(long = "group-by", value_name = "KEY")]
    group_by: Option<String>,

    /// The row speedups are measured against: `KEY=VALUE[,KEY=VALUE]` (the first matching row) or
    /// a row's name or record id. Default: the first row, in the records' order (before --sort).
    #[arg(long, value_name = "ROW")]
    baseline: Option<String>,

    /// Also writes an SVG plot: throughput against --plot-x, or for a single record its
    /// per-stage compute/communication/idle time.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// The key on the plot's x axis (default: the sweep's first grid key).
    #[arg(long = "plot-x", value_name = "KEY", requires = "plot")]
    plot_x: Option<String>,

    /// Also writes an SVG plot of every record's training loss (the last stage's), a line per
    /// record, to compare how runs converge.
    #[arg(long = "plot-loss", value_name = "FILE.svg", group = "curves")]
    plot_loss: Option<PathBuf>,

    /// Also writes an SVG plot of every record's training accuracy (the last stage's): top-1 a
    /// solid line per record, top-5 a dashed one where the model reports it.
    #[arg(long = "plot-accuracy", value_name = "FILE.svg", group = "curves")]
    plot_accuracy: Option<PathBuf>,

    /// The x axis of the loss and accuracy plots: iterations, or seconds of training.
    #[arg(
        long = "curve-x",
        visible_alias = "loss-x",
        value_enum,
        default_value = "iteration",
        requires = "curves"
    )]
    curve_x: CurveXArg,

    /// Smooths the loss and accuracy plots' lines as TensorBoard does: the weight of a debiased
    /// moving average, from 0 (raw values) up to, not including, 1; the raw values are drawn
    /// faint beneath. --time-to then reads the smoothed curves.
    #[arg(
        long,
        value_name = "WEIGHT",
        default_value = "0",
        value_parser = parse_smoothing,
        allow_negative_numbers = true,
        requires = "curve_readers"
    )]
    smooth: Smoothing,

    /// Adds a column: when each record's curve first reached TARGET, in seconds of training and
    /// iterations (PipeDream's time to accuracy): `accuracy=90%`, `top5=0.99` (at or above) or
    /// `loss=0.5` (at or below) on the training samples, or `val_accuracy=90%`, `val_top5`,
    /// `val_loss` on the validation passes (`validate_every`). `--sort time_to` ranks the runs
    /// by it.
    #[arg(long = "time-to", value_name = "METRIC=TARGET", value_parser = Target::parse)]
    time_to: Option<Target>,
}

fn parse_smoothing(text: &str) -> Result<Smoothing, String> {
    let weight: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number; give a weight from 0 up to, not including, 1"))?;
    Smoothing::new(weight)
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum CurveXArg {
    Iteration,
    Seconds,
}

#[derive(Debug, Args)]
struct PlanArgs {
    /// The layer profile: the JSON `runtime profile` writes, or PipeDream's `graph.txt` (planned
    /// over its layers, cut only where one tensor crosses).
    #[arg(long, value_name = "FILE")]
    profile: PathBuf,

    /// Workers (GPUs or CPU ranks) to plan for.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..))]
    workers: u64,

    /// Network bandwidth between all workers in GB/s (default 10, when no --level is given).
    #[arg(long, value_name = "GBPS", allow_negative_numbers = true, value_parser = parse_gbps)]
    bandwidth: Option<f64>,

    /// A network level, innermost first: groups of WORKERS at GBPS GB/s (e.g. `4:100` for four
    /// GPUs on NVLink). The last level's group is widened to all workers.
    #[arg(long, value_name = "WORKERS:GBPS", allow_hyphen_values = true, value_parser = parse_level)]
    level: Vec<(usize, f64)>,

    /// Memory per worker in GiB (default: no limit).
    #[arg(long, value_name = "GIB", allow_negative_numbers = true, value_parser = parse_gib)]
    memory: Option<f64>,

    /// No replication: one worker per stage.
    #[arg(long)]
    straight: bool,

    /// Microbatches per minibatch. The profile's batch is one microbatch, so this sets the
    /// minibatch (M x the profile's batch) the plan is for: forward, backward and transfers
    /// happen M times per minibatch, the all-reduce and optimizer step once. It changes the
    /// plan (more microbatches make replication cheaper) and GPipe/1F1B's fill-and-drain.
    #[arg(long, value_name = "M", default_value_t = 4, allow_negative_numbers = true, value_parser = clap::value_parser!(u64).range(1..))]
    microbatches: u64,

    /// Also print why: each stage's compute, optimizer, all-reduce and transfer per minibatch
    /// and their share of the predicted time, the bottleneck marked.
    #[arg(long)]
    explain: bool,

    /// The schedule to plan for: gpipe or 1f1b (one update per minibatch; the plan pays for
    /// filling and draining the pipeline every minibatch) or pipedream (no flush; each replica
    /// updates after each of its microbatches). Without it: the steady state with one update
    /// per minibatch, PipeDream's planner's figure.
    #[arg(long, value_name = "SCHEDULE", value_parser = parse_schedule)]
    schedule: Option<crate::config::Schedule>,

    /// Plan for runs with compress_activations: float32 activations cross stage boundaries in
    /// float16 (their gradients come back in float32), as the profile recorded their sizes.
    #[arg(long)]
    compress_activations: bool,

    /// Also show the best plan of each of the next N stage shapes (replicas per stage), fastest
    /// first, with how much slower each is predicted; the predictions JSON gets them with their
    /// stage configs. Up to 12 workers.
    #[arg(long, value_name = "N", default_value_t = 0)]
    alternatives: usize,

    /// Where to write the stage config (default: stdout); for a PipeDream graph, the graph with
    /// each node's `stage_id`, as PipeDream's optimizer writes it.
    #[arg(long, short = 'o', value_name = "FILE")]
    output: Option<PathBuf>,

    /// Where to write the predictions as JSON.
    #[arg(long, value_name = "FILE")]
    prediction: Option<PathBuf>,
}

/// Options shared by `run` and `sweep`: how each experiment is launched and shown.
#[derive(Debug, Args)]
struct ExperimentArgs {
    /// Run one container per host with that host's ranks inside it, instead of one per rank.
    #[arg(long = "launch-single-container", alias = "launch_single_container")]
    launch_single_container: bool,

    /// Where to put the record (or sweep) folder; overrides the YAML's `log_directory`.
    #[arg(long = "output-dir", value_name = "DIR")]
    output_dir: Option<PathBuf>,

    /// How to run the ranks; overrides the YAML's `backend`.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,

    /// Run this machine's runtime build instead of the runtime image's (for development): it is
    /// mounted into containers at the same path (copied where a host lacks it), with the torch
    /// environment its rpath names. The process backend runs the source's target/release/runtime
    /// without it.
    #[arg(long, env = "STAGEHAND_RUNTIME", value_name = "PATH")]
    runtime: Option<PathBuf>,

    /// The stagehand source the runtime image is built from (default: the checkout the working
    /// folder is in, else the one this driver was built from).
    #[arg(long, env = "STAGEHAND_SOURCE", value_name = "DIR")]
    source: Option<PathBuf>,

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

    /// How many times every rank is started again after a failure, from the checkpoints the
    /// ranks wrote in the run (as torchrun's); overrides the YAML's `max_restarts`.
    #[arg(long = "max-restarts", value_name = "N")]
    max_restarts: Option<u32>,

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
enum FormatArg {
    Table,
    Markdown,
    Csv,
    Json,
}

/// `KEY=V1,V2` with a non-empty key and values.
fn parse_grid(text: &str) -> Result<(String, Vec<String>), String> {
    let (key, values) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` is not KEY=V1,V2 (e.g. batch_size=32,64)"))?;
    let key = key.trim();
    if key.is_empty() {
        return Err(format!("`{text}` has no key before `=`"));
    }
    let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
    if values.iter().any(String::is_empty) {
        return Err(format!(
            "`{text}` has an empty value; separate values with single commas"
        ));
    }
    Ok((key.to_string(), values))
}

/// A finite number above zero.
fn parse_positive(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{text}` is not a number above zero")),
    }
}

/// A bandwidth in GB/s, from 1e-6 (a kilobyte per second) to 1e6 (a petabyte per second,
/// hundreds of times NVLink's). Beyond either end the planner's times stop being numbers: 1e300
/// GB/s is infinite bytes per second, and at 1e-300 GB/s a megabyte takes longer than f64 holds.
/// Within it, the most a profile lets cross a boundary (2^50 bytes, at 2^64 microbatches) takes
/// a finite time.
fn parse_gbps(text: &str) -> Result<f64, String> {
    match parse_positive(text) {
        Ok(v) if (1e-6..=1e6).contains(&v) => Ok(v),
        _ => Err(format!(
            "`{text}` is not a bandwidth in GB/s from 1e-6 (a kilobyte per second) to 1e6 (a petabyte per second)"
        )),
    }
}

/// Memory per worker in GiB: above 0 and at most 2^20 (a pebibyte, more than any worker has),
/// which keeps it a finite number of bytes.
fn parse_gib(text: &str) -> Result<f64, String> {
    match parse_positive(text) {
        Ok(v) if v <= (1u64 << 20) as f64 => Ok(v),
        _ => Err(format!(
            "`{text}` is not GiB per worker above 0 and at most 1048576 (a pebibyte)"
        )),
    }
}

/// `WORKERS:GBPS`.
fn parse_level(text: &str) -> Result<(usize, f64), String> {
    let (workers, gbps) = text
        .split_once(':')
        .ok_or_else(|| format!("`{text}` is not WORKERS:GBPS (e.g. 4:100)"))?;
    let workers = match workers.parse::<usize>() {
        Ok(w) if w > 0 => w,
        _ => return Err(format!("`{workers}` is not a worker count above zero")),
    };
    Ok((workers, parse_gbps(gbps)?))
}

/// Whether a `driver results` argument is a `KEY=VALUE` filter rather than a path: the part
/// before `=` is a plain key.
fn as_filter(text: &str) -> Option<(String, String)> {
    let (key, value) = text.split_once('=')?;
    let plain = !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    plain.then(|| (key.to_string(), value.to_string()))
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    Docker,
    Process,
    Slurm,
}

/// What the command line asks for, validated.
#[derive(Debug, Clone)]
pub enum Task {
    /// Run one experiment.
    Run(Options),
    /// Check one experiment and show what would run.
    Check(Options),
    /// Run or resume a sweep.
    Sweep(SweepOptions),
    /// Read records into a table or plot.
    Results(ResultsOptions),
    /// Plan a pipeline from a profile.
    Plan(PartitionOptions),
}

impl Cli {
    /// Converts the parsed arguments once; nothing past this point sees clap. An error is
    /// clap's, printed and turned into exit code 2 like any other bad argument.
    pub fn into_task(self) -> Result<Task, clap::Error> {
        Ok(match self.command {
            None => self.run.into_task(),
            Some(Command::Run(run)) => run.into_task(),
            Some(Command::Check(check)) => Task::Check(check.experiment.into_options(check.config_file)),
            Some(Command::Sweep(sweep)) => Task::Sweep(sweep.into_options()),
            Some(Command::Results(results)) => Task::Results(results.into_options()),
            Some(Command::Plan(plan)) => Task::Plan(plan.into_options()?),
        })
    }
}

impl RunArgs {
    fn into_task(self) -> Task {
        let config_file = self.config_file.expect("clap requires --config-file");
        let options = self.experiment.into_options(config_file);
        match self.dry_run {
            true => Task::Check(options),
            false => Task::Run(options),
        }
    }
}

impl SweepArgs {
    fn into_options(self) -> SweepOptions {
        let source = match (self.resume, self.config_file) {
            (Some(dir), _) => SweepSource::Resume(dir),
            (None, Some(config_file)) => SweepSource::New {
                config_file,
                grid: self.grid,
                repeat: self.repeat,
            },
            (None, None) => unreachable!("clap requires --config-file without --resume"),
        };
        // With --resume the experiment file is the one the sweep folder names.
        let config_file = match &source {
            SweepSource::New { config_file, .. } => config_file.clone(),
            SweepSource::Resume(_) => PathBuf::new(),
        };
        SweepOptions {
            run: self.experiment.into_options(config_file),
            source,
        }
    }
}

impl ResultsArgs {
    fn into_options(self) -> ResultsOptions {
        let mut paths = Vec::new();
        let mut filters = Vec::new();
        for input in self.inputs {
            match as_filter(&input) {
                Some(filter) => filters.push(filter),
                None => paths.push(PathBuf::from(input)),
            }
        }
        if paths.is_empty() {
            paths.push(PathBuf::from("experiments"));
        }
        ResultsOptions {
            paths,
            format: match self.format {
                FormatArg::Table => Format::Table,
                FormatArg::Markdown => Format::Markdown,
                FormatArg::Csv => Format::Csv,
                FormatArg::Json => Format::Json,
            },
            sort: self.sort,
            group_by: self.group_by,
            filters,
            baseline: self.baseline,
            plot: self.plot,
            plot_x: self.plot_x,
            plot_loss: self.plot_loss,
            plot_accuracy: self.plot_accuracy,
            curve_x: match self.curve_x {
                CurveXArg::Iteration => CurveX::Iteration,
                CurveXArg::Seconds => CurveX::Seconds,
            },
            smoothing: self.smooth,
            time_to: self.time_to,
        }
    }
}

impl PlanArgs {
    fn into_options(self) -> Result<PartitionOptions, clap::Error> {
        let workers = self.workers as usize;
        let invalid = |message: String| {
            let mut command = <Cli as clap::CommandFactory>::command();
            command.build();
            let plan = command
                .find_subcommand_mut("plan")
                .expect("the plan subcommand exists");
            plan.error(clap::error::ErrorKind::ValueValidation, message)
        };
        for (i, &(group, _)) in self.level.iter().enumerate() {
            if group > workers {
                return Err(invalid(format!(
                    "--level {group}:.. groups more workers than --workers {workers}"
                )));
            }
            if i > 0 && group <= self.level[i - 1].0 {
                return Err(invalid(format!(
                    "--level groups go innermost first and grow: {group} after {}",
                    self.level[i - 1].0
                )));
            }
        }
        if self.alternatives > 0 && workers > stagehand_planner::MAX_ALTERNATIVE_WORKERS {
            return Err(invalid(format!(
                "--alternatives tries every stage shape, up to {} workers; --workers is {workers}",
                stagehand_planner::MAX_ALTERNATIVE_WORKERS
            )));
        }
        if self.alternatives > 0 && self.straight {
            return Err(invalid(
                "--straight has one shape (a worker per stage); drop --alternatives or --straight".into(),
            ));
        }
        let mut levels: Vec<(usize, f64)> = self.level.iter().map(|&(w, g)| (w, g * 1e9)).collect();
        if levels.is_empty() || self.bandwidth.is_some() {
            levels.push((workers, self.bandwidth.unwrap_or(DEFAULT_BANDWIDTH_GBPS) * 1e9));
        }
        if let Some(last) = levels.last_mut() {
            last.0 = workers;
        }
        // Groups nest: each level's groups are whole groups of the level inside it.
        if let Some(pair) = levels.windows(2).find(|pair| pair[1].0 % pair[0].0 != 0) {
            let (inner, outer) = (pair[0].0, pair[1].0);
            return Err(invalid(format!(
                "--level {inner}:..: groups of {inner} workers do not divide {outer}, the workers \
                 of the level around them{}; give group sizes that divide each other and --workers",
                if outer == workers { " (--workers)" } else { "" }
            )));
        }
        Ok(PartitionOptions {
            profile: self.profile,
            request: PlanRequest {
                workers,
                levels,
                memory_bytes: self.memory.map(|gib| gib * (1u64 << 30) as f64),
                straight: self.straight,
                microbatches: self.microbatches as usize,
                alternatives: self.alternatives,
                schedule: self.schedule,
                compress_activations: self.compress_activations,
            },
            output: self.output,
            prediction: self.prediction,
            explain: self.explain,
        })
    }
}

/// A schedule as the runtime spells it.
fn parse_schedule(text: &str) -> Result<crate::config::Schedule, String> {
    use crate::config::Schedule;
    match text {
        "gpipe" => Ok(Schedule::Gpipe),
        "1f1b" => Ok(Schedule::OneFOneB),
        "pipedream" => Ok(Schedule::Pipedream),
        _ => Err("one of gpipe, 1f1b, pipedream".into()),
    }
}

/// `driver plan`'s bandwidth between all workers when none is given, in GB/s.
const DEFAULT_BANDWIDTH_GBPS: f64 = 10.0;

impl ExperimentArgs {
    fn into_options(self, config_file: PathBuf) -> Options {
        let verbosity = match (self.quiet, self.verbose) {
            (true, _) => Verbosity::Quiet,
            (false, 0) => Verbosity::Normal,
            (false, _) => Verbosity::Verbose,
        };
        Options {
            config_file,
            container_mode: if self.launch_single_container {
                ContainerMode::PerHost
            } else {
                ContainerMode::PerRank
            },
            output_dir: self.output_dir,
            backend: self.backend.map(|b| match b {
                BackendArg::Docker => Backend::Docker,
                BackendArg::Process => Backend::Process,
                BackendArg::Slurm => Backend::Slurm,
            }),
            runtime: self.runtime,
            source: self.source,
            torch_venv: self.torch_venv.unwrap_or_else(default_torch_venv),
            mount_directories: self.mount_directories,
            master_port: self.master_port,
            max_restarts: self.max_restarts,
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
    use std::path::Path;

    use super::*;

    fn try_task(args: &[&str]) -> Result<Task, clap::Error> {
        Cli::try_parse_from(std::iter::once("driver").chain(args.iter().copied()))?.into_task()
    }

    fn task(args: &[&str]) -> Task {
        try_task(args).unwrap_or_else(|e| panic!("{e}"))
    }

    fn options(args: &[&str]) -> Options {
        match task(args) {
            Task::Run(o) => o,
            other => panic!("not a run: {other:?}"),
        }
    }

    fn plan(args: &[&str]) -> PartitionOptions {
        let mut all = vec!["plan", "--profile", "p.json"];
        all.extend_from_slice(args);
        match task(&all) {
            Task::Plan(o) => o,
            other => panic!("not a plan: {other:?}"),
        }
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
        assert_eq!(o.max_restarts, None);
        assert_eq!(
            options(&["-c", "x.yml", "--max-restarts", "3"]).max_restarts,
            Some(3)
        );
        assert_eq!(o.container_mode, ContainerMode::PerRank);
    }

    #[test]
    fn quiet_and_verbose_conflict() {
        assert!(Cli::try_parse_from(["driver", "-c", "x.yml", "-q", "-v"]).is_err());
    }

    #[test]
    fn the_run_subcommand_is_the_same_as_no_subcommand() {
        let a = options(&["-c", "x.yml", "--backend", "process"]);
        let b = options(&["run", "-c", "x.yml", "--backend", "process"]);
        assert_eq!(a.config_file, b.config_file);
        assert_eq!(a.backend, b.backend);
    }

    #[test]
    fn subcommands_do_not_mix_with_top_level_run_flags() {
        assert!(Cli::try_parse_from(["driver", "-c", "x.yml", "results"]).is_err());
        assert!(
            Cli::try_parse_from(["driver"]).is_err(),
            "--config-file is required"
        );
    }

    #[test]
    fn sweep_grids_parse_and_resume_excludes_a_new_grid() {
        let Task::Sweep(s) = task(&[
            "sweep",
            "-c",
            "x.yml",
            "--grid",
            "batch_size=32,64",
            "--grid",
            "schedule=gpipe",
            "--repeat",
            "2",
            "--backend",
            "process",
        ]) else {
            panic!("not a sweep")
        };
        let SweepSource::New { grid, repeat, .. } = s.source else {
            panic!("not a new sweep")
        };
        assert_eq!(repeat, 2);
        assert_eq!(
            grid[0],
            ("batch_size".to_string(), vec!["32".to_string(), "64".to_string()])
        );
        assert_eq!(s.run.backend, Some(Backend::Process));
        let Task::Sweep(s) = task(&["sweep", "--resume", "dir"]) else {
            panic!("not a sweep")
        };
        assert!(matches!(s.source, SweepSource::Resume(d) if d == Path::new("dir")));
        assert!(Cli::try_parse_from(["driver", "sweep", "--resume", "d", "--grid", "a=1"]).is_err());
        assert!(Cli::try_parse_from(["driver", "sweep", "--resume", "d", "--output-dir", "o"]).is_err());
        assert!(Cli::try_parse_from(["driver", "sweep", "-c", "x.yml", "--grid", "a=1,,2"]).is_err());
        assert!(Cli::try_parse_from(["driver", "sweep", "-c", "x.yml", "--grid", "=1"]).is_err());
        assert!(Cli::try_parse_from(["driver", "sweep", "--grid", "a=1"]).is_err());
    }

    #[test]
    fn results_arguments_split_into_paths_and_filters() {
        let Task::Results(r) = task(&["results", "a/b", "schedule=1f1b", "--format", "csv", "./x=y"]) else {
            panic!("not results")
        };
        assert_eq!(r.paths, vec![PathBuf::from("a/b"), PathBuf::from("./x=y")]);
        assert_eq!(r.filters, vec![("schedule".to_string(), "1f1b".to_string())]);
        assert_eq!(r.format, Format::Csv);
        let Task::Results(r) = task(&["results"]) else {
            panic!("not results")
        };
        assert_eq!(r.paths, vec![PathBuf::from("experiments")]);
    }

    #[test]
    fn loss_and_accuracy_plots_share_one_x_axis_that_needs_either() {
        let Task::Results(r) = task(&[
            "results",
            "--plot-loss",
            "l.svg",
            "--plot-accuracy",
            "a.svg",
            "--curve-x",
            "seconds",
        ]) else {
            panic!("not results")
        };
        assert_eq!(r.plot_loss, Some(PathBuf::from("l.svg")));
        assert_eq!(r.plot_accuracy, Some(PathBuf::from("a.svg")));
        assert_eq!(r.curve_x, CurveX::Seconds);
        // The flag's name from before the accuracy plot, with the accuracy plot alone.
        let Task::Results(r) = task(&["results", "--plot-accuracy", "a.svg", "--loss-x", "seconds"]) else {
            panic!("not results")
        };
        assert_eq!((r.plot_loss, r.curve_x), (None, CurveX::Seconds));
        let Task::Results(r) = task(&["results", "--plot-loss", "l.svg"]) else {
            panic!("not results")
        };
        assert_eq!((r.plot_accuracy, r.curve_x), (None, CurveX::Iteration));
        assert!(
            Cli::try_parse_from(["driver", "results", "--curve-x", "seconds"]).is_err(),
            "an x axis without a curve plot"
        );
    }

    #[test]
    fn curve_smoothing_is_a_weight_below_one_for_a_curve_plot() {
        let Task::Results(r) = task(&["results", "--plot-loss", "l.svg", "--smooth", "0.6"]) else {
            panic!("not results")
        };
        assert_eq!(r.smoothing.weight(), 0.6);
        let Task::Results(r) = task(&["results", "--plot-accuracy", "a.svg"]) else {
            panic!("not results")
        };
        assert_eq!(r.smoothing, Smoothing::NONE, "raw values by default");
        for (weight, says) in [
            ("1", "not including, 1"),
            ("-0.1", "not a smoothing weight"),
            ("x", "not a number"),
        ] {
            let error =
                Cli::try_parse_from(["driver", "results", "--plot-loss", "l.svg", "--smooth", weight])
                    .expect_err(weight)
                    .to_string();
            assert!(error.contains(says), "{weight}: {error}");
        }
        assert!(
            Cli::try_parse_from(["driver", "results", "--smooth", "0.6"]).is_err(),
            "smoothing without a curve plot"
        );
        // The time to a target reads a curve too, smoothed or not, with no plot.
        let Task::Results(r) = task(&["results", "--time-to", "accuracy=90%", "--smooth", "0.6"]) else {
            panic!("not results")
        };
        assert_eq!(
            (r.time_to.map(|t| t.value), r.smoothing.weight()),
            (Some(0.9), 0.6)
        );
        let error = Cli::try_parse_from(["driver", "results", "--time-to", "accuracy=90"])
            .expect_err("a percentage without %")
            .to_string();
        assert!(error.contains("or a percentage (90%)"), "{error}");
    }

    #[test]
    fn plan_bandwidth_and_levels_become_bytes_per_second() {
        let p = plan(&["--workers", "8"]);
        assert_eq!(
            p.request.levels,
            vec![(8, 10e9)],
            "one 10 GB/s level over all workers"
        );
        assert_eq!(p.request.microbatches, 4);
        assert_eq!(p.request.memory_bytes, None);
        let p = plan(&["--workers", "8", "--bandwidth", "25"]);
        assert_eq!(p.request.levels, vec![(8, 25e9)]);
        let p = plan(&[
            "--workers",
            "16",
            "--level",
            "4:100",
            "--level",
            "8:10",
            "--memory",
            "16",
            "--straight",
        ]);
        assert_eq!(
            p.request.levels,
            vec![(4, 100e9), (16, 10e9)],
            "the last group widened to all workers"
        );
        assert_eq!(p.request.memory_bytes, Some(16.0 * 1024.0 * 1024.0 * 1024.0));
        assert!(p.request.straight);
        let p = plan(&["--workers", "16", "--level", "4:100", "--bandwidth", "1"]);
        assert_eq!(p.request.levels, vec![(4, 100e9), (16, 1e9)]);
        for bad in [
            &["--workers", "0"][..],
            &["--workers", "2", "--level", "4"],
            &["--workers", "2", "--bandwidth", "-1"],
        ] {
            let mut all = vec!["plan", "--profile", "p.json"];
            all.extend_from_slice(bad);
            assert!(try_task(&all).is_err(), "{bad:?}");
        }
        for bad in [
            &["--workers", "4", "--level", "8:100"][..],
            &["--workers", "16", "--level", "8:100", "--level", "4:10"],
            // Groups of 3 in 4 workers, and of 2 in groups of 3, do not nest.
            &["--workers", "4", "--level", "3:100", "--bandwidth", "1"],
            &[
                "--workers",
                "12",
                "--level",
                "2:100",
                "--level",
                "3:10",
                "--bandwidth",
                "1",
            ],
        ] {
            let mut all = vec!["plan", "--profile", "p.json"];
            all.extend_from_slice(bad);
            let e = try_task(&all).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains("--level"), "{e}");
        }
        assert_eq!(
            plan(&["--workers", "12", "--alternatives", "3"])
                .request
                .alternatives,
            3
        );
        for bad in [
            &["--workers", "13", "--alternatives", "1"][..],
            &["--workers", "4", "--alternatives", "1", "--straight"],
        ] {
            let mut all = vec!["plan", "--profile", "p.json"];
            all.extend_from_slice(bad);
            let e = try_task(&all).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains("--alternatives"), "{e}");
        }
    }

    /// Bandwidths and memory whose bytes would not be finite numbers (1e300 GB/s is infinite
    /// bytes per second; at 1e-300 GB/s a transfer takes longer than f64 holds) are refused,
    /// saying what is allowed; the bounds themselves are taken.
    #[test]
    fn plan_bandwidths_and_memory_beyond_meaning_are_refused() {
        for (bad, expected) in [
            (
                &["--bandwidth", "1e300"][..],
                "`1e300` is not a bandwidth in GB/s from 1e-6 (a kilobyte per second) to 1e6",
            ),
            (&["--bandwidth", "1e-300"], "`1e-300` is not a bandwidth in GB/s"),
            (&["--level", "2:1e7"], "`1e7` is not a bandwidth in GB/s"),
            (&["--bandwidth", "NaN"], "`NaN` is not a bandwidth in GB/s"),
            (
                &["--memory", "1e300"],
                "`1e300` is not GiB per worker above 0 and at most 1048576 (a pebibyte)",
            ),
            (&["--memory", "0"], "`0` is not GiB per worker"),
            // Negative numbers are values, refused as such, not taken for flags.
            (&["--bandwidth", "-1"], "`-1` is not a bandwidth in GB/s"),
            (&["--memory", "-2"], "`-2` is not GiB per worker"),
            (&["--level", "-2:10"], "--level"),
            (&["--microbatches", "-3"], "--microbatches"),
        ] {
            let mut all = vec!["plan", "--profile", "p.json", "--workers", "4"];
            all.extend_from_slice(bad);
            let e = try_task(&all).expect_err(expected);
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains(expected), "{e}");
            assert!(!e.to_string().contains("unexpected argument"), "{e}");
        }
        let p = plan(&[
            "--workers",
            "4",
            "--bandwidth",
            "1e6",
            "--level",
            "2:1e-6",
            "--memory",
            "1048576",
        ]);
        assert_eq!(p.request.levels, vec![(2, 1e3), (4, 1e15)]);
        assert_eq!(p.request.memory_bytes, Some((1u64 << 50) as f64));
    }
}
