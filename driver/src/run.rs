//! One experiment from start to end: config -> plan -> preflight -> record -> launch -> supervise
//! -> cleanup. Each failure is returned with the exit code it maps to.

use std::collections::BTreeMap;

use crate::auto_partition::{self, AutoError, FirstHost, ProfileCache};
use crate::check::{self, CheckError};
use crate::config::{self, ConfigError};
use crate::events::{Ended, Event, HostFacts, SlurmEvent, Status, StopCause};
use crate::exit_codes;
use crate::experiment;
use crate::hosts;
use crate::launch::restart::{self, Decision};
use crate::launch::{self, LaunchError, Outcome, Target};
use crate::options::{Backend, ContainerMode, Options};
use crate::records::{Record, RecordError};
use crate::reporters::progress::{self, ProgressReporter};
use crate::reporters::record::RecordReporter;
use crate::reporters::terminal::{Intervals, TerminalReporter};
use crate::reporters::{Reporter, Reporters};
use crate::signals::StopSignals;

/// What a preflight error says first: a refusal of the file's request is the file's to change
/// (exit 2), a failed check of the hosts the hosts' (exit 3).
fn preflight_heading(e: &LaunchError) -> &'static str {
    match e {
        LaunchError::RequestRefused { .. } | LaunchError::SettingRefused { .. } => {
            "the experiment was refused before anything started"
        }
        _ => "preflight failed; nothing was started",
    }
}

/// Why a run did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("invalid experiment file")]
    Config(#[from] ConfigError),
    #[error("cannot pick a free master port on this machine")]
    Port(#[source] std::io::Error),
    #[error("{}", preflight_heading(.0))]
    Preflight(#[source] LaunchError),
    #[error("cannot start the ranks; every rank started so far was stopped")]
    Launch(#[source] LaunchError),
    #[error("cannot write the record")]
    Record(#[from] RecordError),
    #[error("cannot install the Ctrl-C handler")]
    Signals(#[source] std::io::Error),
    #[error("experiment {id} failed; the summary and the ranks' logs are in {}", dir.display())]
    Failed { id: String, dir: std::path::PathBuf },
    #[error("experiment {id} was interrupted; what it gathered is in {}", dir.display())]
    Interrupted { id: String, dir: std::path::PathBuf },
    #[error("some of the experiment's containers could not be removed")]
    Cleanup(#[source] LaunchError),
    /// [`LaunchError::StartLeft`]: the start's error, then the containers left as the source.
    #[error("cannot start the ranks ({}), and some of the experiment's containers could not be removed", crate::error::error_line(.start))]
    LaunchLeft {
        start: LaunchError,
        #[source]
        left: LaunchError,
    },
}

impl RunError {
    /// The documented exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Config(_)
            | RunError::Preflight(LaunchError::RequestRefused { .. } | LaunchError::SettingRefused { .. }) => {
                exit_codes::INVALID_CONFIG
            }
            RunError::Port(_) | RunError::Preflight(_) | RunError::Signals(_) => exit_codes::PREFLIGHT_FAILED,
            RunError::Launch(LaunchError::Interrupted) => exit_codes::INTERRUPTED,
            RunError::Launch(_) => exit_codes::EXPERIMENT_FAILED,
            RunError::Record(_) => exit_codes::RECORD_FAILED,
            RunError::Interrupted { .. } => exit_codes::INTERRUPTED,
            RunError::Failed { .. } => exit_codes::EXPERIMENT_FAILED,
            RunError::Cleanup(_) | RunError::LaunchLeft { .. } => exit_codes::CLEANUP_FAILED,
        }
    }
}

impl RunError {
    /// The record folder of a run that got as far as its ranks, if the error names one.
    pub fn record_dir(&self) -> Option<&std::path::Path> {
        match self {
            RunError::Failed { dir, .. } | RunError::Interrupted { dir, .. } => Some(dir),
            RunError::Config(_)
            | RunError::Port(_)
            | RunError::Preflight(_)
            | RunError::Launch(_)
            | RunError::Record(_)
            | RunError::Signals(_)
            | RunError::Cleanup(_)
            | RunError::LaunchLeft { .. } => None,
        }
    }
}

/// Waits for preflight checks that run containers labelled with any of `ids`; Ctrl-C removes
/// them on every host, every label at once, so within one
/// [`crate::launch::cleanup::PREFLIGHT_REMOVAL_GRACE`] (reached over `ssh`, which a warning about
/// one left names), and ends the run as interrupted.
async fn in_check_containers<T>(
    checks: impl std::future::Future<Output = T>,
    hosts: &[hosts::Host],
    ssh: &hosts::SshOptions,
    ids: &[&str],
    signals: &mut StopSignals,
) -> Result<T, RunError> {
    tokio::select! {
        r = checks => Ok(r),
        _ = signals.recv() => {
            let removals = ids.iter().map(|id| crate::launch::docker::remove_everywhere(hosts, ssh, id));
            futures_util::future::join_all(removals).await;
            Err(RunError::Launch(LaunchError::Interrupted))
        }
    }
}

/// The plan with its master port checked free on the first machine (a port the driver picked and
/// found taken there is replaced; a port the user chose is reported), and, with Docker hosts
/// running the runtime, every host shown to reach it (containers labelled `reach_id`).
async fn port_and_reach(
    loaded: &config::Loaded,
    options: &Options,
    plan: &experiment::Experiment,
    prepared: Option<&[(hosts::Host, HostFacts)]>,
    ssh: &hosts::SshOptions,
    reach_id: &str,
) -> Result<experiment::Experiment, RunError> {
    let master = prepared.and_then(|p| p.first()).map(|(host, _)| host);
    let port = match plan.backend {
        // Each job's ranks derive theirs from the job id, or take the one given, on Slurm's node.
        Backend::Slurm => PortPick::Free(plan.master_port),
        Backend::Process | Backend::Docker => {
            master_port(
                plan.master_port,
                options.master_port.is_some(),
                hosts::pick_master_port,
                |port| hosts::master_port_free(master, port),
            )
            .await
        }
    };
    let plan = match port {
        PortPick::Free(port) if port == plan.master_port => plan.clone(),
        PortPick::Free(port) => experiment::resolve(loaded, options, port)?,
        PortPick::Unchecked => {
            let (port, host) = (plan.master_port, &plan.hosts[0].name);
            stderr_line!("warning: could not check that master port {port} is free on {host}");
            plan.clone()
        }
        PortPick::Taken(port) => {
            let host = plan.hosts[0].name.clone();
            return Err(RunError::Preflight(LaunchError::PortInUse { host, port }));
        }
        PortPick::NoneFree(e) => return Err(RunError::Port(e)),
    };
    if let (Some(prepared), None) = (prepared, &loaded.file.command) {
        let hosts: Vec<hosts::Host> = prepared.iter().map(|(h, _)| h.clone()).collect();
        let runtime = plan.ranks[0].argv[0].clone();
        crate::launch::reach::master_reachable(&hosts, ssh, &plan, &runtime, reach_id)
            .await
            .map_err(RunError::Preflight)?;
    }
    Ok(plan)
}

/// This machine's runtime's verdict on rank 0's training request (`runtime --check`, as
/// [`check::runtime_check`]), reached on a thread of its own while the run goes on.
struct LocalCheck {
    /// `None` until the check has spoken; then `Some` of its refusal, `Some(None)` when it
    /// accepted (or could not judge: no runtime here, which the image's runtime then does).
    verdict: tokio::sync::watch::Receiver<Option<Option<Refusal>>>,
}

/// What the local check refused.
#[derive(Debug, Clone)]
enum Refusal {
    /// The training request, as the runtime (or the experiment file) says.
    Request(String),
    /// A setting the runtime does not see: the profile given to plan with, which does not fit
    /// the run, or a checkpoint folder here that cannot be written.
    Setting(String),
}

impl LocalCheck {
    fn start(loaded: &config::Loaded, plan: &experiment::Experiment, options: &Options) -> LocalCheck {
        let (tx, verdict) = tokio::sync::watch::channel(None);
        let (loaded, plan, options) = (loaded.clone(), plan.clone(), options.clone());
        tokio::task::spawn_blocking(move || {
            let refusal = match check::runtime_check(&loaded, &plan, &options, false) {
                Err(CheckError::Refused { reason, at, .. }) => {
                    Some(Refusal::Request(format!("{reason}{at}")))
                }
                Err(CheckError::Config(e)) => Some(Refusal::Request(crate::error::error_chain(&e))),
                Err(CheckError::Profile { reason }) => Some(Refusal::Setting(reason)),
                Err(e @ CheckError::CheckpointDir { .. }) => Some(Refusal::Setting(e.to_string())),
                // No runtime here to ask, or it could not run: the image's runtime checks it.
                Ok(_) | Err(CheckError::Runtime { .. }) => None,
            };
            let _ = tx.send(Some(refusal));
        });
        LocalCheck { verdict }
    }

    /// The refusal, once the check has spoken; `None` when it accepted.
    async fn spoken(&self) -> Option<Refusal> {
        let mut verdict = self.verdict.clone();
        let said = match verdict.wait_for(Option::is_some).await {
            Ok(said) => said.clone().flatten(),
            // The thread is gone without a word (it panicked): nothing was refused here.
            Err(_) => None,
        };
        said
    }

    /// Waits for the verdict: the run goes on, or is refused.
    async fn verdict(&self) -> Result<(), RunError> {
        match self.spoken().await {
            None => Ok(()),
            Some(Refusal::Request(reason)) => {
                Err(RunError::Preflight(LaunchError::RequestRefused { reason }))
            }
            Some(Refusal::Setting(reason)) => {
                Err(RunError::Preflight(LaunchError::SettingRefused { reason }))
            }
        }
    }

    /// Resolves once the request is accepted; never, when it is refused.
    async fn accepted(&self) {
        if self.spoken().await.is_some() {
            std::future::pending::<()>().await;
        }
    }

    /// Resolves with the refusal once the request is refused; never, when it is accepted.
    async fn refused(&self) -> RunError {
        match self.verdict().await {
            Err(refusal) => refusal,
            Ok(()) => std::future::pending().await,
        }
    }
}

/// Runs the experiment the options name.
pub async fn run(options: Options) -> Result<(), RunError> {
    let loaded = config::load(&options.config_file)?;
    run_loaded(&loaded, &options, None, &ProfileCache::default())
        .await
        .map(|_| ())
}

/// Runs an experiment already loaded (a sweep's point), its progress bar under `bars` when
/// given, reusing profiles in `profiles` for `config_file: auto`; returns the record folder of a
/// run that succeeded.
pub async fn run_loaded(
    loaded: &config::Loaded,
    options: &Options,
    bars: Option<&indicatif::MultiProgress>,
    profiles: &ProfileCache,
) -> Result<std::path::PathBuf, RunError> {
    let mut loaded = loaded.clone();
    let options = options.clone();
    let port = match options.master_port {
        Some(p) => p,
        None => hosts::pick_master_port().map_err(RunError::Port)?,
    };
    let plan = experiment::resolve(&loaded, &options, port)?;
    let mut signals = StopSignals::install().map_err(RunError::Signals)?;
    let verbose = options.verbosity == crate::options::Verbosity::Verbose;
    if plan.backend == Backend::Process && options.container_mode == ContainerMode::PerHost {
        stderr_line!("warning: --launch-single-container is ignored with the process backend");
    }
    if plan.backend != Backend::Docker && loaded.file.container.is_some() {
        let at = loaded
            .locate("container")
            .map(|at| format!(" ({}:{})", loaded.path.display(), at.line));
        stderr_line!(
            "warning: `container:`{} is ignored with the {} backend: the ranks run this machine's \
             runtime",
            at.unwrap_or_default(),
            match plan.backend {
                Backend::Slurm => "slurm",
                _ => "process",
            }
        );
    }
    if let Some(warning) = check::unused_gpus(&loaded, &plan) {
        stderr_line!("warning: {warning}");
    }
    let ssh = hosts::SshOptions {
        config_file: options.ssh_config.clone(),
    };

    // A local runtime must exist here (it is mounted or copied into containers); the image's
    // runtime and a `command:` program in containers come with the image.
    let program = &plan.ranks[0].argv[0];
    let must_exist_here =
        plan.backend != Backend::Docker || (loaded.file.command.is_none() && options.runtime.is_some());
    if must_exist_here && check::find_program(program).is_none() {
        return Err(RunError::Preflight(LaunchError::ProgramMissing {
            path: program.into(),
        }));
    }

    // The training request, checked by a runtime on this machine when there is one (it loads
    // libtorch: a third of a second), while the hosts are reached; nothing is built on them until
    // it is accepted, and nothing starts before. Without Docker hosts it is waited for here.
    let local_check = LocalCheck::start(&loaded, &plan, &options);
    if plan.backend != Backend::Docker {
        local_check.verdict().await?;
    }

    // Slurm judges the request itself, without running it.
    let slurm_verdict = match &plan.slurm {
        Some(settings) => {
            let name = format!("{}-check", plan.name);
            let check = launch::slurm::preflight(settings, &name, &plan.ranks[0].argv);
            tokio::select! {
                r = check => Some(r.map_err(RunError::Preflight)?),
                _ = signals.recv() => return Err(RunError::Launch(LaunchError::Interrupted)),
            }
        }
        None => None,
    };

    // Preflight every host concurrently before anything starts anywhere.
    let mut prepared = match plan.backend {
        Backend::Process | Backend::Slurm => None,
        Backend::Docker => {
            let feedback = hosts::image::Feedback {
                verbose,
                normal: options.verbosity != crate::options::Verbosity::Quiet,
                bars: options.progress == crate::options::Progress::Auto,
            };
            let work = hosts::prepare_all(
                &plan.hosts,
                &plan.image,
                &plan.mounts,
                &ssh,
                feedback,
                local_check.accepted(),
            );
            let results = tokio::select! {
                r = work => r,
                refusal = local_check.refused() => return Err(refusal),
                _ = signals.recv() => return Err(RunError::Launch(LaunchError::Interrupted)),
            };
            Some(results.map_err(|e| RunError::Preflight(e.into()))?)
        }
    };

    // MASTER_ADDR is where the other machines reach the first one, as found on the machines,
    // unless the experiment file says.
    let mut plan = plan;
    let engines: Option<Vec<hosts::Host>> = prepared
        .as_ref()
        .map(|p| p.iter().map(|(h, _)| h.clone()).collect());
    if let (Some(hosts), None) = (&engines, &loaded.file.master_addr) {
        if let Some(addr) = hosts::master_address(hosts)
            .await
            .map_err(|e| RunError::Preflight(e.into()))?
        {
            loaded.file.master_addr = Some(addr);
            plan = experiment::resolve(&loaded, &options, plan.master_port)?;
        }
    }

    // Side by side: the ranks must start where they will run (`runtime info` in each host's
    // image, and the GPUs given to a container there), and the master port must be free where
    // rank 0 listens and reached from every host.
    let check_id = format!("{}-check-{}", plan.name, std::process::id());
    let reach_id = format!("{}-reach-{}", plan.name, std::process::id());
    let runs_runtime = loaded.file.command.is_none();
    let starts = async {
        match &engines {
            Some(hosts) => crate::launch::docker::self_check(hosts, &ssh, &plan, &check_id, runs_runtime)
                .await
                .map(Some)
                .map_err(RunError::Preflight),
            None => Ok(None),
        }
    };
    let port = port_and_reach(&loaded, &options, &plan, prepared.as_deref(), &ssh, &reach_id);
    // Containers earlier runs left on the hosts are named while the checks run.
    let leftovers = futures_util::future::join_all(engines.iter().flatten().map(|host| {
        launch::cleanup::warn_of_leftovers(&host.docker, &host.plan.machine, ssh.config_file.as_deref())
    }));
    let checks = async {
        let (started, port, _) = futures_util::join!(starts, port, leftovers);
        (started, port)
    };
    let (started, port) = match &engines {
        Some(hosts) => {
            in_check_containers(checks, hosts, &ssh, &[&check_id, &reach_id], &mut signals).await?
        }
        None => checks.await,
    };
    local_check.verdict().await?;
    let rdma_given = started?;
    let plan = port?;
    // Hosts whose engine cannot give their containers InfiniBand as NCCL needs it go without.
    if let (Some(prepared), Some(given)) = (prepared.as_mut(), rdma_given) {
        for ((host, facts), given) in prepared.iter_mut().zip(given) {
            host.infiniband = given;
            facts.infiniband = given;
        }
    }

    let record = Record::create(&plan.log_directory, &plan.name)?;
    // Unique among runs started the same second under the same name, by this process's id.
    let run_id = format!("{}-{}", record.id, std::process::id());
    let mut plan = plan;
    plan.run_as(&run_id);
    plan.keep_traces_in(&record.dir);
    record.write_setup(&loaded, &plan)?;
    let bar = progress::bar(options.progress, plan.iterations, bars);
    let rank_hosts: BTreeMap<usize, String> = plan
        .ranks
        .iter()
        .map(|r| (r.rank, plan.hosts[r.host].name.clone()))
        .collect();
    let reporters: Vec<Box<dyn Reporter>> = vec![
        Box::new(RecordReporter::new(record.clone(), &plan)?),
        Box::new(
            TerminalReporter::new(options.verbosity, bar.clone(), rank_hosts).with_intervals(Intervals {
                print_every: plan.print_every,
                verbose_every: plan.verbose_every,
            }),
        ),
        Box::new(ProgressReporter::new(bar)),
    ];
    let mut reporters = Reporters::new(reporters);
    if options.verbosity != crate::options::Verbosity::Quiet {
        let how = match plan.backend {
            Backend::Process => "local processes",
            Backend::Slurm => "tasks of one Slurm job",
            Backend::Docker => match plan.container_mode {
                ContainerMode::PerRank => "docker containers, one per rank",
                ContainerMode::PerHost => "docker containers, one per host",
            },
        };
        say(
            bars,
            format!(
                "driver: experiment {} with {} rank(s) as {how}; record in {}",
                record.id,
                plan.world_size(),
                record.dir.display()
            ),
        );
    }

    if let Some(verdict) = slurm_verdict {
        reporters.report(&Event::Slurm(SlurmEvent::Line {
            line: format!("preflight (srun --test-only): {verdict}"),
            important: false,
        }));
    }
    let job_name = format!("stagehand-{}", record.id);
    let plan = match plan.auto.clone() {
        None => plan,
        Some(auto) => {
            let first = FirstHost {
                host: prepared.as_ref().and_then(|p| p.first()).map(|(host, _)| host),
                slurm: plan.slurm.as_ref().map(|s| (s, format!("{job_name}-profile"))),
                ssh: &ssh,
                cache: profiles,
            };
            let schedule = loaded.file.schedule;
            let outcome = auto_partition::profile_and_plan(
                &plan,
                &auto,
                schedule,
                first,
                &record,
                &mut reporters,
                &mut signals,
            )
            .await;
            let planned = match outcome {
                Ok(planned) => planned,
                Err(e) => return Err(auto_failed(e, &record, &mut reporters)),
            };
            let mut plan = match experiment::resolve_planned(&loaded, &options, plan.master_port, &planned) {
                Ok(plan) => plan,
                Err(e) => {
                    let reason = crate::error::error_chain(&e);
                    let e = auto_partition::plan_failed(&mut reporters, reason);
                    return Err(auto_failed(e, &record, &mut reporters));
                }
            };
            plan.run_as(&run_id);
            plan.keep_traces_in(&record.dir);
            record.write_setup(&loaded, &plan)?;
            for (host, _) in prepared.iter_mut().flatten() {
                host.add_file(&planned.stage_config);
            }
            plan
        }
    };

    let target = match (prepared, &plan.slurm) {
        (None, Some(settings)) => Target::Slurm {
            settings: settings.clone(),
            job_name,
        },
        (None, None) => {
            reporters.report(&Event::HostReady(HostFacts {
                host: plan.hosts[0].name.clone(),
                docker_version: None,
                gpus: plan.hosts[0].gpus.iter().map(|g| g.to_string()).collect(),
                image_id: None,
                image: None,
                image_built: false,
                image_received_from: None,
                image_seconds: 0.0,
                copied_in: Vec::new(),
                infiniband: false,
            }));
            Target::Processes
        }
        (Some(prepared), _) => {
            let (hosts, facts): (Vec<_>, Vec<_>) = prepared.into_iter().unzip();
            for f in facts {
                reporters.report(&Event::HostReady(f));
            }
            Target::Containers {
                hosts,
                id: record.id.clone(),
                ssh: ssh.clone(),
            }
        }
    };
    let outcome = match run_with_restarts(target, &plan, runs_runtime, &mut reporters, &mut signals).await {
        Ok(outcome) => outcome,
        Err(e) => {
            // The record says why, as the terminal's last lines do.
            if !matches!(e, LaunchError::Interrupted) {
                reporters.report(&Event::Stopping(StopCause::LaunchFailed {
                    reason: crate::error::error_line(&e),
                }));
            }
            reporters.report(&Event::Finished {
                status: Status::Failed,
            });
            return Err(start_failed(e));
        }
    };
    let status = outcome.status();
    reporters.report(&Event::Finished {
        status: status.into(),
    });
    outcome.cleanup.map_err(RunError::Cleanup)?;
    let (id, dir) = (record.id, record.dir);
    match status {
        Ended::Succeeded => {
            say(
                bars,
                format!("driver: experiment {id} succeeded; record in {}", dir.display()),
            );
            Ok(dir)
        }
        Ended::Failed => Err(RunError::Failed { id, dir }),
        Ended::Interrupted => Err(RunError::Interrupted { id, dir }),
    }
}

/// Runs the ranks on `target` and, while `max_restarts` allows, starts them again after a
/// failure once every one was stopped and removed: from the latest checkpoints the runtime's
/// ranks wrote in the run, or as first started. Returns the last start's outcome; an error
/// means a start failed before its ranks ran.
async fn run_with_restarts(
    mut target: Target,
    plan: &experiment::Experiment,
    runs_runtime: bool,
    reporters: &mut Reporters,
    signals: &mut StopSignals,
) -> Result<Outcome, LaunchError> {
    let mut ranks = launch::Ranks::default();
    let mut this_start = plan.clone();
    let mut restarts = 0;
    let mut previous: Option<restart::Failure> = None;
    loop {
        let outcome = launch::run_ranks(target.clone(), &this_start, reporters, signals, &mut ranks).await?;
        let cause = match (outcome.status(), &outcome.cause, &outcome.cleanup) {
            (Ended::Failed, Some(cause), Ok(())) => cause.clone(),
            // Succeeded, interrupted, or with containers left behind: nothing starts again.
            _ => return Ok(outcome),
        };
        // A signal that came while the ranks were being stopped, or that cut their traces' copy
        // short, ends the run here.
        if signals.arrived() {
            return Ok(outcome);
        }
        match restart::decide(
            &cause,
            (restarts, plan.max_restarts),
            plan.world_size(),
            &ranks.progress,
            previous.as_ref(),
        ) {
            Decision::Stop { why } => {
                if let Some(why) = why {
                    reporters.report(&Event::NotRestarted { why });
                }
                return Ok(outcome);
            }
            Decision::Restart { resume_from } => {
                // A host that was lost and came back is reached on a new connection; one that
                // still does not answer ends the run.
                if let (StopCause::HostLost { .. }, Target::Containers { hosts, ssh, .. }) =
                    (&cause, &mut target)
                {
                    if let Err(e) = hosts::reconnect_all(hosts, ssh).await {
                        let why = format!("a host still does not answer: {}", crate::error::error_line(&e));
                        reporters.report(&Event::NotRestarted { why });
                        return Ok(outcome);
                    }
                }
                restarts += 1;
                previous = Some(restart::Failure::new(&cause, &ranks.progress, runs_runtime));
                // Only the runtime's ranks are told to resume; a `command:` starts as it did.
                let resume_from = resume_from.filter(|_| runs_runtime);
                reporters.report(&Event::Restarting {
                    restart: restarts,
                    max: plan.max_restarts,
                    cause,
                    resume_from,
                });
                this_start = plan.restarted(resume_from.is_some());
            }
        }
    }
}

/// How many times a port the driver picked is replaced when the first machine has it taken.
const PORT_RETRIES: usize = 5;

/// The master port [`master_port`] settled on.
#[derive(Debug)]
enum PortPick {
    /// Free on the first machine.
    Free(u16),
    /// Could not be checked there; the port first given is used.
    Unchecked,
    /// Taken there: the user's port, or the last of the driver's picks.
    Taken(u16),
    /// No free port could be picked on this machine.
    NoneFree(std::io::Error),
}

/// Checks `port` with `is_free` on the first machine; a port the driver picked (`chosen` false)
/// that is taken is replaced by `pick` up to [`PORT_RETRIES`] times, a port the user chose is
/// reported taken.
async fn master_port<F: std::future::Future<Output = Option<bool>>>(
    mut port: u16,
    chosen: bool,
    mut pick: impl FnMut() -> std::io::Result<u16>,
    is_free: impl Fn(u16) -> F,
) -> PortPick {
    let mut retries = 0;
    loop {
        match is_free(port).await {
            Some(true) => return PortPick::Free(port),
            None => return PortPick::Unchecked,
            Some(false) if chosen || retries == PORT_RETRIES => return PortPick::Taken(port),
            Some(false) => match pick() {
                Ok(p) => {
                    port = p;
                    retries += 1;
                }
                Err(e) => return PortPick::NoneFree(e),
            },
        }
    }
}

/// Ends a run whose `config_file: auto` step did not give a stage config.
fn auto_failed(error: AutoError, record: &Record, reporters: &mut Reporters) -> RunError {
    let (id, dir) = (record.id.clone(), record.dir.clone());
    let (status, error) = match error {
        AutoError::Stopped(Ended::Interrupted) => (Status::Interrupted, RunError::Interrupted { id, dir }),
        AutoError::Stopped(_) => (Status::Failed, RunError::Failed { id, dir }),
        AutoError::Launch(e) => (Status::Failed, RunError::Launch(e)),
        AutoError::Record(e) => (Status::Failed, RunError::Record(e)),
        AutoError::Cleanup(e) => (Status::Failed, RunError::Cleanup(e)),
    };
    reporters.report(&Event::Finished { status });
    error
}

/// Prints one of the driver's lines on stderr, around a sweep's bars when there are any.
fn say(bars: Option<&indicatif::MultiProgress>, text: String) {
    match bars {
        Some(bars) => bars.suspend(|| stderr_line!("{text}")),
        None => stderr_line!("{text}"),
    }
}

/// The run's error for ranks that could not start: exit 4 where containers were left.
fn start_failed(e: LaunchError) -> RunError {
    match e {
        LaunchError::StartLeft { start, left } => RunError::LaunchLeft {
            start: *start,
            left: *left,
        },
        e => RunError::Launch(e),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    fn block_on<T>(work: impl std::future::Future<Output = T>) -> T {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(work)
    }

    /// Runs [`master_port`] against a first machine where `taken` ports are in use, picking from
    /// `picks`; returns the outcome and the ports it asked about.
    fn settle(port: u16, chosen: bool, picks: &[u16], taken: &[u16]) -> (PortPick, Vec<u16>) {
        let asked = RefCell::new(Vec::new());
        let mut picks = picks.iter().copied();
        let outcome = block_on(master_port(
            port,
            chosen,
            || picks.next().ok_or_else(|| std::io::Error::other("no more ports")),
            |p| {
                asked.borrow_mut().push(p);
                std::future::ready(Some(!taken.contains(&p)))
            },
        ));
        (outcome, asked.into_inner())
    }

    /// A start that failed and could not remove a container it made ends as every cleanup
    /// failure does (exit 4), its error saying why the start failed and how to remove what was
    /// left; without containers left it is the start's failure (exit 1).
    #[test]
    fn a_failed_start_that_left_a_container_exits_4_naming_both() {
        let start = || LaunchError::PortInUse {
            host: "th1".into(),
            port: 4000,
        };
        let left = LaunchError::ContainersLeft {
            left: vec![crate::events::LeftContainer {
                host: "th2".into(),
                name: "exp-r1".into(),
                id: "0123456789abcdef".into(),
                ranks: vec![1],
                error: "cannot open an SSH connection to th2".into(),
                remove_by_hand: "ssh th2 docker rm -f exp-r1".into(),
            }],
            grace_s: 20,
        };
        let e = start_failed(LaunchError::StartLeft {
            start: Box::new(start()),
            left: Box::new(left),
        });
        assert_eq!(e.exit_code(), exit_codes::CLEANUP_FAILED);
        let text = crate::error::error_chain(&e);
        for part in ["master port 4000 is in use on th1", "ssh th2 docker rm -f exp-r1"] {
            assert!(text.contains(part), "{part:?} missing from: {text}");
        }
        assert_eq!(start_failed(start()).exit_code(), exit_codes::EXPERIMENT_FAILED);
    }

    #[test]
    fn a_picked_port_taken_on_the_first_machine_is_replaced() {
        let (outcome, asked) = settle(4000, false, &[4001, 4002], &[4000, 4001]);
        assert!(matches!(outcome, PortPick::Free(4002)), "{outcome:?}");
        assert_eq!(asked, [4000, 4001, 4002]);
    }

    #[test]
    fn a_port_the_user_chose_is_reported_taken_not_replaced() {
        let (outcome, asked) = settle(4000, true, &[4001], &[4000]);
        assert!(matches!(outcome, PortPick::Taken(4000)), "{outcome:?}");
        assert_eq!(asked, [4000]);
    }

    #[test]
    fn picking_gives_up_after_its_retries() {
        let picks: Vec<u16> = (4001..4100).collect();
        let (outcome, asked) = settle(
            4000,
            false,
            &picks,
            &picks.iter().copied().chain([4000]).collect::<Vec<_>>(),
        );
        assert!(matches!(outcome, PortPick::Taken(4005)), "{outcome:?}");
        assert_eq!(asked.len(), PORT_RETRIES + 1);
    }

    #[test]
    fn a_port_that_cannot_be_checked_is_used_as_given() {
        let outcome = block_on(master_port(
            4000,
            false,
            || Ok(4001),
            |_| std::future::ready(None),
        ));
        assert!(matches!(outcome, PortPick::Unchecked), "{outcome:?}");
    }
}
