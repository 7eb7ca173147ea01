//! One experiment from start to end: config -> plan -> preflight -> record -> launch -> supervise
//! -> cleanup. Each failure is returned with the exit code it maps to.

use std::collections::BTreeMap;

use tokio::sync::mpsc;

use crate::autoplan::{self, AutoError, FirstHost, ProfileCache};
use crate::cli::{Backend, ContainerMode, Options};
use crate::config::{self, ConfigError};
use crate::events::{Event, HostFacts, Status};
use crate::exit_codes;
use crate::hosts;
use crate::launch::{
    self, cleanup::REMOVAL_GRACE, docker::DockerLauncher, process::ProcessLauncher, LaunchError, Launcher,
    StopSignals,
};
use crate::plan;
use crate::reporters::progress::{self, ProgressReporter};
use crate::reporters::record::{Record, RecordError, RecordReporter};
use crate::reporters::terminal::TerminalReporter;
use crate::reporters::{Reporter, Reporters};

/// Why a run did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("invalid experiment file")]
    Config(#[from] ConfigError),
    #[error("cannot pick a free master port on this machine")]
    Port(#[source] std::io::Error),
    #[error("preflight failed; nothing was started")]
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
}

impl RunError {
    /// The documented exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Config(_) => exit_codes::INVALID_CONFIG,
            RunError::Port(_) | RunError::Preflight(_) | RunError::Signals(_) => exit_codes::PREFLIGHT_FAILED,
            RunError::Launch(LaunchError::Interrupted) => exit_codes::INTERRUPTED,
            RunError::Launch(_) => exit_codes::EXPERIMENT_FAILED,
            RunError::Record(_) => exit_codes::RECORD_FAILED,
            RunError::Interrupted { .. } => exit_codes::INTERRUPTED,
            RunError::Failed { .. } => exit_codes::EXPERIMENT_FAILED,
            RunError::Cleanup(_) => exit_codes::CLEANUP_FAILED,
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
            | RunError::Cleanup(_) => None,
        }
    }
}

/// Waits for a preflight check that runs containers labelled `id`; Ctrl-C removes them on every
/// host and ends the run as interrupted.
async fn in_check_containers(
    check: impl std::future::Future<Output = Result<(), LaunchError>>,
    hosts: &[hosts::Host],
    id: &str,
    signals: &mut StopSignals,
) -> Result<(), RunError> {
    tokio::select! {
        r = check => r.map_err(RunError::Preflight),
        _ = signals.recv() => {
            crate::launch::docker::remove_everywhere(hosts, id).await;
            Err(RunError::Launch(LaunchError::Interrupted))
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
        None => plan::free_local_port().map_err(RunError::Port)?,
    };
    let plan = plan::resolve(&loaded, &options, port)?;
    let mut signals = StopSignals::install().map_err(RunError::Signals)?;
    let verbose = options.verbosity == crate::cli::Verbosity::Verbose;
    if plan.backend == Backend::Process && options.container_mode == ContainerMode::PerHost {
        eprintln!("warning: --launch-single-container is ignored with the process backend");
    }
    let ssh = hosts::SshOptions {
        config_file: options.ssh_config.clone(),
    };

    // A local runtime must exist here (it is mounted or copied into containers); the image's
    // runtime and a `command:` program in containers come with the image.
    let program = &plan.ranks[0].argv[0];
    let must_exist_here =
        plan.backend == Backend::Process || (loaded.file.command.is_none() && options.runtime.is_some());
    if must_exist_here && find_program(program).is_none() {
        return Err(RunError::Preflight(LaunchError::ProgramMissing {
            path: program.into(),
        }));
    }

    // Preflight every host concurrently before anything starts anywhere.
    let prepared = match plan.backend {
        Backend::Process => None,
        Backend::Docker => {
            let feedback = hosts::image::Feedback {
                verbose,
                normal: options.verbosity != crate::cli::Verbosity::Quiet,
                bars: options.progress == crate::cli::Progress::Auto,
            };
            let work = hosts::prepare_all(&plan.hosts, &plan.image, &plan.mounts, &ssh, feedback);
            let results = tokio::select! {
                r = work => r,
                _ = signals.recv() => return Err(RunError::Launch(LaunchError::Interrupted)),
            };
            Some(results.map_err(RunError::Preflight)?)
        }
    };

    // MASTER_ADDR is where the other machines reach the first one, as found on the machines,
    // unless the experiment file says.
    let mut plan = plan;
    let engines: Option<Vec<hosts::Host>> = prepared
        .as_ref()
        .map(|p| p.iter().map(|(h, _)| h.clone()).collect());
    if let (Some(hosts), None) = (&engines, &loaded.file.master_addr) {
        if let Some(addr) = hosts::master_address(hosts).await.map_err(RunError::Preflight)? {
            loaded.file.master_addr = Some(addr);
            plan = plan::resolve(&loaded, &options, plan.master_port)?;
        }
    }

    // The runtime must start where it will run: `runtime info` in each host's image.
    if let (Some(hosts), None) = (&engines, &loaded.file.command) {
        let id = format!("{}-check-{}", plan.name, std::process::id());
        let check = crate::launch::docker::self_check(hosts, &plan, &id);
        in_check_containers(check, hosts, &id, &mut signals).await?;
    }

    // The master port must be free where rank 0 listens; a port the driver picked is replaced
    // when the first machine has it taken, a port the user chose is reported.
    let master = prepared.as_ref().and_then(|p| p.first()).map(|(host, _)| host);
    for attempt in 0.. {
        match hosts::master_port_free(master, plan.master_port).await {
            Some(true) => break,
            Some(false) if options.master_port.is_none() && attempt < 5 => {
                let port = plan::free_local_port().map_err(RunError::Port)?;
                plan = plan::resolve(&loaded, &options, port)?;
            }
            Some(false) => {
                let host = plan.hosts[0].name.clone();
                return Err(RunError::Preflight(LaunchError::PortInUse {
                    host,
                    port: plan.master_port,
                }));
            }
            None => {
                let (port, host) = (plan.master_port, &plan.hosts[0].name);
                eprintln!("warning: could not check that master port {port} is free on {host}");
                break;
            }
        }
    }
    let plan = plan;

    // Every host must reach the master port where rank 0 will listen (checked with the runtime).
    if let (Some(hosts), None) = (&engines, &loaded.file.command) {
        let id = format!("{}-reach-{}", plan.name, std::process::id());
        let runtime = plan.ranks[0].argv[0].clone();
        let check = crate::launch::reach::master_reachable(hosts, &plan, &runtime, &id);
        in_check_containers(check, hosts, &id, &mut signals).await?;
    }

    let record = Record::create(&plan.log_directory, &plan.name)?;
    record.write_setup(&loaded, &plan)?;
    let bar = progress::bar(options.progress, plan.iterations, bars);
    let rank_hosts: BTreeMap<usize, String> = plan
        .ranks
        .iter()
        .map(|r| (r.rank, plan.hosts[r.host].name.clone()))
        .collect();
    let reporters: Vec<Box<dyn Reporter>> = vec![
        Box::new(RecordReporter::new(record.clone(), &plan)?),
        Box::new(TerminalReporter::new(options.verbosity, bar.clone(), rank_hosts)),
        Box::new(ProgressReporter::new(bar)),
    ];
    let mut reporters = Reporters::new(reporters);
    if options.verbosity != crate::cli::Verbosity::Quiet {
        let how = match plan.backend {
            Backend::Process => "local processes",
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

    let mut prepared = prepared;
    let plan = match plan.auto.clone() {
        None => plan,
        Some(auto) => {
            let first = FirstHost {
                host: prepared.as_ref().and_then(|p| p.first()).map(|(host, _)| host),
                ssh: &ssh,
                cache: profiles,
            };
            let schedule = loaded.file.schedule;
            let outcome = autoplan::profile_and_plan(
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
            let plan = match plan::resolve_planned(&loaded, &options, plan.master_port, &planned) {
                Ok(plan) => plan,
                Err(e) => {
                    let reason = crate::error_chain(&e);
                    let e = autoplan::plan_failed(&mut reporters, reason);
                    return Err(auto_failed(e, &record, &mut reporters));
                }
            };
            record.write_setup(&loaded, &plan)?;
            for (host, _) in prepared.iter_mut().flatten() {
                host.add_file(&planned.stage_config);
            }
            plan
        }
    };

    let (tx, rx) = mpsc::unbounded_channel();
    let (status, cleanup) = match prepared {
        None => {
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
            }));
            let launcher = match ProcessLauncher::start(&plan, tx) {
                Ok(l) => l,
                Err(e) => {
                    reporters.report(&Event::Finished {
                        status: Status::Failed,
                    });
                    return Err(RunError::Launch(e));
                }
            };
            let launcher = Launcher::Process(launcher);
            let status = launch::supervise(&plan, &launcher, rx, &mut reporters, &mut signals).await;
            (status, Ok(()))
        }
        Some(prepared) => {
            let (hosts, facts): (Vec<_>, Vec<_>) = prepared.into_iter().unzip();
            for f in facts {
                reporters.report(&Event::HostReady(f));
            }
            let docker = DockerLauncher::new(hosts, record.id.clone(), ssh.clone());
            let started = docker.start(&plan, tx).await;
            let launcher = Launcher::Docker(docker);
            let status = match started {
                Ok(()) => launch::supervise(&plan, &launcher, rx, &mut reporters, &mut signals).await,
                Err(e) => {
                    let Launcher::Docker(d) = &launcher else {
                        unreachable!()
                    };
                    if let Err(LaunchError::ContainersLeft { left, .. }) = d.remove_all(REMOVAL_GRACE).await {
                        reporters.report(&Event::ContainersLeft(left));
                    }
                    reporters.report(&Event::Finished {
                        status: Status::Failed,
                    });
                    return Err(RunError::Launch(e));
                }
            };
            let Launcher::Docker(d) = &launcher else {
                unreachable!()
            };
            (status, d.remove_all(REMOVAL_GRACE).await)
        }
    };
    if let Err(LaunchError::ContainersLeft { left, .. }) = &cleanup {
        reporters.report(&Event::ContainersLeft(left.clone()));
    }
    reporters.report(&Event::Finished { status });
    cleanup.map_err(RunError::Cleanup)?;
    let (id, dir) = (record.id, record.dir);
    match status {
        Status::Succeeded => {
            say(
                bars,
                format!("driver: experiment {id} succeeded; record in {}", dir.display()),
            );
            Ok(dir)
        }
        Status::Failed => Err(RunError::Failed { id, dir }),
        Status::Interrupted => Err(RunError::Interrupted { id, dir }),
        Status::Running => unreachable!("supervise returns a final status"),
    }
}

/// Ends a run whose `config_file: auto` step did not give a stage config.
fn auto_failed(error: AutoError, record: &Record, reporters: &mut Reporters) -> RunError {
    let (id, dir) = (record.id.clone(), record.dir.clone());
    let (status, error) = match error {
        AutoError::Stopped(Status::Interrupted) => (Status::Interrupted, RunError::Interrupted { id, dir }),
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
        Some(bars) => bars.suspend(|| eprintln!("{text}")),
        None => eprintln!("{text}"),
    }
}

/// Where `program` would be found: a path as given, or a bare name on `PATH`.
fn find_program(program: &str) -> Option<std::path::PathBuf> {
    let path = std::path::Path::new(program);
    if program.contains('/') {
        return path.is_file().then(|| path.to_path_buf());
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}
