//! `config_file: auto` at launch: profile the model on rank 0's machine and device (in a container
//! of the experiment's image, or as a local process), plan the stages for the experiment's
//! machines, and keep the profile, the predictions and the stage config in the record.

use stagehand_contract::Profile;

use crate::config::Schedule;
use crate::events::{Ended, Event, PlanFacts, StopCause, Stream};
use crate::experiment::{AutoPartition, Experiment, Partitioned};
use crate::hosts::{Host, SshOptions};
use crate::launch::{self, LaunchError, Target, Watch};
use crate::options::ContainerMode;
use crate::partition::{self, PlanRequest};
use crate::records::{files, Record, RecordError};
use crate::reporters::Reporters;
use crate::signals::StopSignals;

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

/// The size flags the run gives (`argv`, as `--layers 6` or `--layers=6`) at values other than
/// the profile measured: `(flag, the run's, the profile's)`. A profile that recorded no sizes, and
/// a flag the run leaves to the runtime's default, differ in nothing said here.
fn other_sizes(profile: &Profile, argv: &[String]) -> Vec<(String, String, String)> {
    profile
        .sizes
        .iter()
        .filter_map(|(flag, measured)| {
            let run = crate::experiment::flag_value(argv, flag)?.to_string();
            let same = match (run.parse::<f64>(), measured.as_f64()) {
                (Ok(a), Some(b)) => a == b,
                _ => run == crate::config::value_text(measured),
            };
            (!same).then(|| (flag.clone(), run, crate::config::value_text(measured)))
        })
        .collect()
}

/// Why no stage config came out; the run ends with this.
#[derive(Debug)]
pub enum AutoError {
    /// Profiling failed or was interrupted, or planning failed; the reporters were told
    /// (`Stopping`) and the run ends with this status.
    Stopped(Ended),
    /// The profiling container or process could not be started.
    Launch(LaunchError),
    /// The record could not be written.
    Record(RecordError),
    /// The profiling container could not be removed.
    Cleanup(LaunchError),
}

/// The machine rank 0 runs on, and how to reach it.
pub struct FirstHost<'a> {
    /// The host after preflight (`None` with the process and Slurm backends).
    pub host: Option<&'a Host>,
    /// With the Slurm backend, the job's settings and the profiling job's name: the profile is
    /// taken by one task on one of the job's kind of nodes.
    pub slurm: Option<(&'a crate::config::SlurmSettings, String)>,
    /// SSH settings for a remote host.
    pub ssh: &'a SshOptions,
    /// Profiles already taken by this driver (a sweep's earlier points).
    pub cache: &'a ProfileCache,
}

/// Whether `profile` (taken `profiled_on`) measured what the run plans for: its batch (a
/// microbatch's), model, arithmetic and sizes (as rank 0's `argv` gives them), and, where
/// activations are sent compressed, whether they can be; `Err` says what differs and what to do.
/// `driver check` and preflight ask it of a given profile (`planner: {profile: FILE}`) before
/// anything starts.
pub fn profile_fits(
    profile: &Profile,
    profiled_on: &str,
    auto: &AutoPartition,
    argv: &[String],
) -> Result<(), String> {
    if profile.batch_size != auto.micro_batch_size as usize {
        return Err(format!(
            "the profile {profiled_on} was taken at batch {} but the run's microbatches have {} \
             samples; profile at batch_size / microbatches",
            profile.batch_size, auto.micro_batch_size
        ));
    }
    if profile.model != auto.model {
        return Err(format!(
            "the profile {profiled_on} is of {} but the run trains {}; profile {} with `runtime profile`",
            profile.model, auto.model, auto.model
        ));
    }
    if profile.arithmetic() != auto.arithmetic {
        return Err(format!(
            "the profile {profiled_on} was measured in {} but the run computes in {} (its \
             kernels' times and activations' bytes differ); profile with the run's \
             --precision and --channels-last",
            profile.arithmetic(),
            auto.arithmetic
        ));
    }
    let differ = other_sizes(profile, argv);
    if !differ.is_empty() {
        let list = |side: fn(&(String, String, String)) -> String| {
            differ.iter().map(side).collect::<Vec<_>>().join(", ")
        };
        return Err(format!(
            "the profile {profiled_on} was measured with {} but the run trains with {}; profile \
             the model the run trains (`runtime profile` with its sizes), or leave `profile:` \
             out for the driver to",
            list(|(flag, _, measured)| format!("{flag} {measured}")),
            list(|(flag, given, _)| format!("{flag} {given}")),
        ));
    }
    if auto.compress_activations {
        partition::compressible(profile).map_err(|reason| format!("the profile {profiled_on}: {reason}"))?;
    }
    Ok(())
}

/// Profiles (or reads the given profile), plans and writes `profile.json`, `plan.json` and
/// `stage_config.json` into the record. Returns what the ranks run with.
pub async fn profile_and_plan(
    plan: &Experiment,
    auto: &AutoPartition,
    schedule: Option<Schedule>,
    first: FirstHost<'_>,
    record: &Record,
    reporters: &mut Reporters,
    signals: &mut StopSignals,
) -> Result<Partitioned, AutoError> {
    let (profile, profiled_on) = match (&auto.profile_argv, &auto.profile_file) {
        (_, Some(path)) => match partition::read_profile(path) {
            Ok(p) => (p, path.display().to_string()),
            Err(e) => return Err(plan_failed(reporters, crate::error::error_chain(&e))),
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
    if let Err(reason) = profile_fits(&profile, &profiled_on, auto, &plan.ranks[0].argv) {
        return Err(plan_failed(reporters, reason));
    }
    write(record, "profile.json", &profile)?;

    let request = PlanRequest {
        workers: auto.workers,
        levels: auto.levels.clone(),
        memory_bytes: auto.memory_bytes,
        straight: auto.straight,
        microbatches: auto.microbatches as usize,
        alternatives: 0,
        schedule,
        compress_activations: auto.compress_activations,
    };
    let (solved, prediction) = match partition::solve_profile(&profile, &request) {
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
        table: partition::render(&profile, &solved, &prediction),
    }));
    Ok(Partitioned {
        stage_config: crate::experiment::absolute(&stage_config),
        microbatches: auto.microbatches,
    })
}

fn write(record: &Record, name: &str, value: &impl serde::Serialize) -> Result<(), AutoError> {
    files::write_json(&record.dir.join(name), value).map_err(AutoError::Record)
}

/// Tells the reporters planning failed, and why.
pub fn plan_failed(reporters: &mut Reporters, reason: String) -> AutoError {
    reporters.report(&Event::Stopping(StopCause::PlanFailed { reason }));
    AutoError::Stopped(Ended::Failed)
}

/// Runs the profiling command as rank 0 would run, on its host and device, and returns what it
/// printed on stdout (the profile JSON).
async fn run_profile(
    plan: &Experiment,
    argv: &[String],
    first: &FirstHost<'_>,
    record: &Record,
    reporters: &mut Reporters,
    signals: &mut StopSignals,
) -> Result<String, AutoError> {
    let profile_plan = one_rank(plan, argv);
    let target = match (first.host, &first.slurm) {
        (None, Some((settings, job_name))) => Target::Slurm {
            settings: crate::config::SlurmSettings {
                nodes: 1,
                tasks_per_node: 1,
                ..(*settings).clone()
            },
            job_name: job_name.clone(),
        },
        (None, None) => Target::Processes,
        (Some(h), _) => Target::Containers {
            hosts: vec![h.clone()],
            id: format!("{}-profile", record.id),
            ssh: first.ssh.clone(),
        },
    };
    let mut watch = Profiling {
        host: profile_plan.hosts[0].name.clone(),
        stdout: String::new(),
    };
    let outcome = launch::run_ranks(target, &profile_plan, reporters, signals, &mut watch)
        .await
        .map_err(AutoError::Launch)?;
    let status = outcome.status();
    outcome.cleanup.map_err(AutoError::Cleanup)?;
    match status {
        Ended::Succeeded => Ok(watch.stdout),
        ended => Err(AutoError::Stopped(ended)),
    }
}

/// The profiling rank: its stdout is the profile, kept here; its stderr is shown as profile
/// lines; its start and end are not the experiment's ranks' and are not reported.
struct Profiling {
    host: String,
    stdout: String,
}

impl Watch for Profiling {
    fn show(&mut self, event: Event) -> Option<Event> {
        match event {
            Event::LineLogged {
                stream: Stream::Stdout,
                line,
                ..
            }
            | Event::Metrics { line, .. } => {
                self.stdout.push_str(&line);
                self.stdout.push('\n');
                None
            }
            Event::LineLogged {
                stream: Stream::Stderr,
                line,
                ..
            } => Some(Event::ProfileLine {
                host: self.host.clone(),
                line,
            }),
            Event::RankStarted { .. }
            | Event::RankExited { .. }
            | Event::RankRemoved { .. }
            | Event::RankLost { .. } => None,
            other => Some(other),
        }
    }

    fn failed(&self, _rank: usize, host: String, exit_code: Option<i64>, out_of_memory: bool) -> StopCause {
        StopCause::ProfileFailed {
            host,
            exit_code,
            out_of_memory,
        }
    }
}

/// The experiment's plan cut down to rank 0 running `argv` alone in its own container.
fn one_rank(plan: &Experiment, argv: &[String]) -> Experiment {
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
    // The profile is not the experiment's run: it leaves no profiler trace to gather.
    one.profiler_trace = false;
    one.traces_dir = None;
    one
}
