//! `config_file: auto` at launch: profile the model on rank 0's machine and device (in a container
//! of the experiment's image, or as a local process), plan the stages for the experiment's
//! machines, and keep the profile, the predictions and the stage config in the record.

use std::time::Duration;

use stagehand_contract::Profile;
use tokio::sync::mpsc;

use crate::cli::ContainerMode;
use crate::config::Schedule;
use crate::events::{Event, PlanFacts, Status, StopCause, Stream};
use crate::hosts::{Host, SshOptions};
use crate::launch::{
    cleanup::REMOVAL_GRACE, docker::DockerLauncher, process::ProcessLauncher, LaunchError, Launcher,
    StopSignals,
};
use crate::plan::{AutoPlan, Plan, Planned};
use crate::planning::{self, PlanRequest};
use crate::reporters::record::{files, Record, RecordError};
use crate::reporters::Reporters;

/// Profiles taken by this driver process, by host and profiling command: a sweep whose points
/// differ only in what the profile does not depend on (schedule, iterations, learning rate, ...)
/// profiles once.
#[derive(Default)]
pub struct ProfileCache {
    taken: std::sync::Mutex<std::collections::HashMap<(String, Vec<String>), Profile>>,
}

impl ProfileCache {
    fn get(&self, key: &(String, Vec<String>)) -> Option<Profile> {
        self.taken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    fn put(&self, key: (String, Vec<String>), profile: Profile) {
        self.taken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, profile);
    }
}

/// How long the profiling process gets to exit once stopped.
const EXIT_DEADLINE: Duration = Duration::from_secs(15);

/// Why no stage config came out; the run ends with this.
#[derive(Debug)]
pub enum AutoError {
    /// Profiling failed or was interrupted, or planning failed; the reporters were told
    /// (`Stopping`) and the run ends with this status.
    Stopped(Status),
    /// The profiling container or process could not be started.
    Launch(LaunchError),
    /// The record could not be written.
    Record(RecordError),
    /// The profiling container could not be removed.
    Cleanup(LaunchError),
}

/// The machine rank 0 runs on, and how to reach it.
pub struct FirstHost<'a> {
    /// The host after preflight (`None` with the process backend).
    pub host: Option<&'a Host>,
    /// SSH settings for a remote host.
    pub ssh: &'a SshOptions,
    /// Profiles already taken by this driver (a sweep's earlier points).
    pub cache: &'a ProfileCache,
}

/// Profiles (or reads the given profile), plans and writes `profile.json`, `plan.json` and
/// `stage_config.json` into the record. Returns what the ranks run with.
pub async fn profile_and_plan(
    plan: &Plan,
    auto: &AutoPlan,
    schedule: Option<Schedule>,
    first: FirstHost<'_>,
    record: &Record,
    reporters: &mut Reporters,
    signals: &mut StopSignals,
) -> Result<Planned, AutoError> {
    let (profile, profiled_on) = match (&auto.profile_argv, &auto.profile_file) {
        (_, Some(path)) => match planning::read_profile(path) {
            Ok(p) => (p, path.display().to_string()),
            Err(e) => return Err(plan_failed(reporters, crate::error_chain(&e))),
        },
        (Some(argv), None) => {
            let host = plan.hosts[0].name.clone();
            let key = (host.clone(), argv.clone());
            if let Some(profile) = first.cache.get(&key) {
                let on = format!("{host} ({}), taken for an earlier run", auto.profile_device);
                (profile, on)
            } else {
                reporters.report(&Event::Profiling {
                    model: auto.model.clone(),
                    host: host.clone(),
                    device: auto.profile_device.clone(),
                    batch_size: auto.micro_batch_size,
                });
                let text = run_profile(plan, argv, &first, record, reporters, signals).await?;
                let profile = Profile::from_json(&text).map_err(|reason| {
                    plan_failed(
                        reporters,
                        format!("the profile the runtime printed on {host} is not valid: {reason}"),
                    )
                })?;
                first.cache.put(key, profile.clone());
                (profile, format!("{host} ({})", auto.profile_device))
            }
        }
        (None, None) => unreachable!("auto plans either profile or read a profile"),
    };
    if profile.batch_size != auto.micro_batch_size as usize {
        return Err(plan_failed(
            reporters,
            format!(
                "the profile {profiled_on} was taken at batch {} but the run's microbatches have {} \
                 samples; profile at batch_size / microbatches",
                profile.batch_size, auto.micro_batch_size
            ),
        ));
    }
    write(record, "profile.json", &profile)?;

    let request = PlanRequest {
        workers: auto.workers,
        levels: auto.levels.clone(),
        memory_bytes: auto.memory_bytes,
        straight: auto.straight,
        microbatches: auto.microbatches as usize,
    };
    let (solved, prediction) = match planning::solve_profile(&profile, &request) {
        Ok(s) => s,
        Err(e) => return Err(plan_failed(reporters, e.to_string())),
    };
    if schedule == Some(Schedule::Pipedream) {
        if let Some(s) = solved
            .stages
            .iter()
            .find(|s| !(auto.microbatches as usize).is_multiple_of(s.replicas))
        {
            let reason = format!(
                "the plan replicates a stage {} times, which does not divide {} microbatches as \
                 pipedream needs; set microbatches to a multiple of it, or planner: {{straight: true}}",
                s.replicas, auto.microbatches
            );
            return Err(plan_failed(reporters, reason));
        }
    }
    write(record, "plan.json", &prediction)?;
    let stage_config = record.dir.join("stage_config.json");
    write(record, "stage_config.json", &solved.stage_config())?;

    // GPipe and 1F1B flush every iteration (fill and drain); PipeDream runs in steady state.
    let predicted = match schedule {
        Some(Schedule::Pipedream) => prediction.time_per_minibatch_s,
        _ => prediction.flushing_time_per_minibatch_s,
    };
    reporters.report(&Event::Planned(PlanFacts {
        model: profile.model.clone(),
        profiled_on,
        microbatches: auto.microbatches,
        micro_batch_size: auto.micro_batch_size,
        stage_starts: solved.stages.iter().map(|s| s.modules.start).collect(),
        replicas: solved.stages.iter().map(|s| s.replicas).collect(),
        predicted_time_per_iteration_s: predicted,
        data_parallel_time_s: prediction.data_parallel_time_s,
        table: planning::render(&profile, &solved, &prediction),
    }));
    Ok(Planned {
        stage_config: crate::plan::absolute(&stage_config),
        microbatches: auto.microbatches,
    })
}

fn write(record: &Record, name: &str, value: &impl serde::Serialize) -> Result<(), AutoError> {
    files::write_json(&record.dir.join(name), value).map_err(AutoError::Record)
}

/// Tells the reporters planning failed, and why.
pub fn plan_failed(reporters: &mut Reporters, reason: String) -> AutoError {
    reporters.report(&Event::Stopping(StopCause::PlanFailed { reason }));
    AutoError::Stopped(Status::Failed)
}

/// Runs the profiling command as rank 0 would run, on its host and device, and returns what it
/// printed on stdout (the profile JSON).
async fn run_profile(
    plan: &Plan,
    argv: &[String],
    first: &FirstHost<'_>,
    record: &Record,
    reporters: &mut Reporters,
    signals: &mut StopSignals,
) -> Result<String, AutoError> {
    let profile_plan = one_rank(plan, argv);
    let host = profile_plan.hosts[0].name.clone();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let launcher = match first.host {
        None => ProcessLauncher::start(&profile_plan, tx)
            .map(Launcher::Process)
            .map_err(AutoError::Launch)?,
        Some(h) => {
            let docker = DockerLauncher::new(
                vec![h.clone()],
                format!("{}-profile", record.id),
                first.ssh.clone(),
            );
            if let Err(e) = docker.start(&profile_plan, tx).await {
                let _ = docker.remove_all(REMOVAL_GRACE).await;
                return Err(AutoError::Launch(e));
            }
            Launcher::Docker(docker)
        }
    };

    let mut stdout = String::new();
    let mut cause: Option<StopCause> = None;
    let mut deadline: Option<tokio::time::Instant> = None;
    let exit_code = loop {
        let until_deadline = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            e = rx.recv() => e,
            _ = signals.recv(), if cause.is_none() => {
                let c = StopCause::Interrupted;
                reporters.report(&Event::Stopping(c.clone()));
                cause = Some(c);
                deadline = Some(tokio::time::Instant::now() + EXIT_DEADLINE);
                launcher.stop_all().await;
                continue;
            }
            _ = until_deadline => None,
        };
        match event {
            None => break None,
            Some(Event::LineLogged {
                stream: Stream::Stdout,
                line,
                ..
            })
            | Some(Event::Metrics { line, .. }) => {
                stdout.push_str(&line);
                stdout.push('\n');
            }
            Some(Event::LineLogged {
                stream: Stream::Stderr,
                line,
                ..
            }) => {
                reporters.report(&Event::ProfileLine {
                    host: host.clone(),
                    line,
                });
            }
            Some(Event::RankExited { exit_code, .. }) => break exit_code,
            Some(Event::RankRemoved { .. }) => break None,
            Some(Event::RankLost { host, reason, .. }) => {
                if cause.is_none() {
                    let c = StopCause::HostLost { host, reason };
                    reporters.report(&Event::Stopping(c.clone()));
                    cause = Some(c);
                }
                break None;
            }
            Some(Event::HostLost { host, reason }) if cause.is_none() => {
                reporters.report(&Event::HostLost {
                    host: host.clone(),
                    reason: reason.clone(),
                });
                let c = StopCause::HostLost { host, reason };
                reporters.report(&Event::Stopping(c.clone()));
                cause = Some(c);
                deadline = Some(tokio::time::Instant::now() + EXIT_DEADLINE);
                launcher.stop_all().await;
            }
            Some(_) => {}
        }
    };
    let cleanup = match &launcher {
        Launcher::Docker(d) => d.remove_all(REMOVAL_GRACE).await,
        Launcher::Process(p) => {
            p.stop_all().await;
            Ok(())
        }
    };
    if let Err(e) = cleanup {
        if let LaunchError::ContainersLeft { left, .. } = &e {
            reporters.report(&Event::ContainersLeft(left.clone()));
        }
        return Err(AutoError::Cleanup(e));
    }
    match cause {
        Some(StopCause::Interrupted) => Err(AutoError::Stopped(Status::Interrupted)),
        Some(_) => Err(AutoError::Stopped(Status::Failed)),
        None if exit_code == Some(0) => Ok(stdout),
        None => {
            reporters.report(&Event::Stopping(StopCause::ProfileFailed { host, exit_code }));
            Err(AutoError::Stopped(Status::Failed))
        }
    }
}

/// The experiment's plan cut down to rank 0 running `argv` alone in its own container.
fn one_rank(plan: &Plan, argv: &[String]) -> Plan {
    let mut one = plan.clone();
    let mut rank = plan.ranks[0].clone();
    rank.argv = argv.to_vec();
    rank.stage = None;
    let mut host = plan.hosts[rank.host].clone();
    host.ranks = vec![0];
    host.gpus = rank.gpus.clone();
    rank.host = 0;
    rank.local_rank = 0;
    one.hosts = vec![host];
    one.ranks = vec![rank];
    one.container_mode = ContainerMode::PerRank;
    one.auto = None;
    one
}
