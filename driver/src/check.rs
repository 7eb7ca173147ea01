//! `driver check` and `driver run --dry-run`: the experiment resolved and shown as it would be
//! launched (hosts, containers, each rank's GPUs and command, the image), and the training request
//! validated by the runtime's own check (`runtime --check`, run here with each rank's arguments),
//! without touching any host. A real run does the same validation in rank 0's image at preflight.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::config::{self, ConfigError, Loaded, StageConfigRef};
use crate::error::error_chain;
use crate::exit_codes;
use crate::experiment::{self, Experiment, ImageSource, RUNTIME_IN_IMAGE};
use crate::hosts::image::planned_tag;
use crate::launch::docker::runtime_error;
use crate::options::{Backend, ContainerMode, Options};

/// Why an experiment does not pass the check.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("invalid experiment file")]
    Config(#[from] ConfigError),
    #[error("the runtime refuses rank {rank}'s training request: {reason}{at}; change the experiment file")]
    Refused {
        rank: usize,
        reason: String,
        /// Where the key behind the flag the refusal names is written (` (`lr` at FILE:LINE)`),
        /// or nothing.
        at: String,
    },
    #[error("{reason}; change the experiment file")]
    Profile { reason: String },
    #[error("checkpoint_dir: {reason}{at}; choose a folder the ranks can write in")]
    CheckpointDir {
        reason: String,
        /// Where `checkpoint_dir` is written (` (`checkpoint_dir` at FILE:LINE)`), or nothing.
        at: String,
    },
    #[error("cannot run the runtime's check with {}", runtime.display())]
    Runtime {
        runtime: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl CheckError {
    /// The documented exit code: every refusal is the experiment file's to fix.
    pub fn exit_code(&self) -> i32 {
        match self {
            CheckError::Config(_)
            | CheckError::Refused { .. }
            | CheckError::Profile { .. }
            | CheckError::CheckpointDir { .. } => exit_codes::INVALID_CONFIG,
            CheckError::Runtime { .. } => exit_codes::PREFLIGHT_FAILED,
        }
    }
}

/// Why a check could not be made here.
pub const NO_RUNTIME: &str =
    "no runtime on this machine (build it, or pass --runtime); a run checks in the image";

/// What the runtime's check said of the experiment.
#[derive(Debug, PartialEq, Eq)]
pub enum RuntimeCheck {
    /// Every rank's request was accepted by this runtime, which warned of what the `warnings`
    /// say (each once, with where its key is written); with `resume`, the iterations done of the
    /// checkpoints the ranks checked here would resume from (0: none yet, they start afresh).
    Accepted {
        runtime: PathBuf,
        warnings: Vec<String>,
        resumes_after: Option<u64>,
    },
    /// Not checked, and why.
    Skipped(String),
    /// Not checked: there is no runtime on this machine to check with.
    NoRuntime,
}

/// Checks the experiment `options` names and prints what a run would do on stdout.
pub fn run(options: &Options) -> Result<(), CheckError> {
    let loaded = config::load(&options.config_file)?;
    // A port picked at launch is planned as the usual default (and said to be picked).
    let port = options.master_port.unwrap_or(29500);
    let plan = experiment::resolve(&loaded, options, port)?;
    let verdict = runtime_check(&loaded, &plan, options, true)?;
    if let Some(warning) = unused_gpus(&loaded, &plan) {
        stderr_line!("warning: {warning}");
    }
    stdout_text!(
        "{}",
        render(
            &plan,
            &image_line(&plan),
            &verdict,
            loaded.file.master_addr.is_some(),
            options.master_port.is_none()
        )
    );
    Ok(())
}

/// Runs `runtime --check` with the arguments and environment of every rank (or of rank 0 alone,
/// as a run does before it touches a host), with a runtime found on this machine; refuses on the
/// first rank it refuses.
pub fn runtime_check(
    loaded: &Loaded,
    plan: &Experiment,
    options: &Options,
    every_rank: bool,
) -> Result<RuntimeCheck, CheckError> {
    if loaded.file.command.is_some() {
        return Ok(RuntimeCheck::Skipped(
            "the ranks run `command:`, not the runtime".into(),
        ));
    }
    // A profile given to plan with is checked against the run now, not at launch.
    let given = plan
        .auto
        .as_ref()
        .and_then(|a| Some((a, a.profile_file.as_ref()?)));
    if let Some((auto, path)) = given {
        let profile = crate::partition::read_profile(path).map_err(|e| CheckError::Profile {
            reason: error_chain(&e),
        })?;
        let on = path.display().to_string();
        crate::auto_partition::profile_fits(&profile, &on, auto, &plan.ranks[0].argv)
            .map_err(|reason| CheckError::Profile { reason })?;
    }
    if loaded.file.config_file == Some(StageConfigRef::Auto) {
        checkpoints_writable(loaded, plan)?;
        return Ok(RuntimeCheck::Skipped(
            "config_file: auto; the stage config is planned at launch and checked there".into(),
        ));
    }
    let Some(runtime) = local_runtime(plan, options) else {
        checkpoints_writable(loaded, plan)?;
        return Ok(RuntimeCheck::NoRuntime);
    };
    let ranks = if every_rank {
        &plan.ranks[..]
    } else {
        &plan.ranks[..1]
    };
    let mut warnings = Vec::new();
    let mut resumes_after: Option<u64> = None;
    for rank in ranks {
        // A rank on another host resumes from checkpoints on that host's disk, not this one's:
        // its image's runtime checks them at preflight, where they are.
        let remote = !plan.hosts[rank.host].machine.is_local();
        let argv = rank.argv[1..]
            .iter()
            .filter(|arg| !(remote && arg.starts_with("--resume")));
        let out = Command::new(&runtime)
            .args(argv)
            .arg("--check")
            .envs(&rank.env)
            .envs(experiment::slurm_task_env(plan, rank))
            .output()
            .map_err(|source| CheckError::Runtime {
                runtime: runtime.clone(),
                source,
            })?;
        if !out.status.success() {
            let reason = runtime_error(&String::from_utf8_lossy(&out.stderr)).to_string();
            return Err(CheckError::Refused {
                rank: rank.rank,
                at: written_at(loaded, &reason),
                reason,
            });
        }
        // The ranks go on from the newest checkpoint every one of them holds.
        let said = serde_json::from_slice::<serde_json::Value>(out.stdout.trim_ascii()).ok();
        if let Some(after) = said.as_ref().and_then(|s| s.get("resumes_after")?.as_u64()) {
            resumes_after = Some(resumes_after.map_or(after, |r| r.min(after)));
        }
        for warning in runtime_warnings(&String::from_utf8_lossy(&out.stderr)) {
            let warning = format!("{warning}{}", written_at(loaded, &warning));
            if !warnings.contains(&warning) {
                warnings.push(warning);
            }
        }
    }
    // After the runtime's refusals, which say more (a resume with no checkpoint, say).
    checkpoints_writable(loaded, plan)?;
    Ok(RuntimeCheck::Accepted {
        runtime,
        warnings,
        resumes_after,
    })
}

/// `device: cpu` where `machines` names GPUs: the ranks train on the CPU, and the GPUs named
/// (which the containers are still given) go unused; said, with where the key is written.
pub fn unused_gpus(loaded: &Loaded, plan: &Experiment) -> Option<String> {
    if loaded.file.device != Some(config::Device::Cpu) {
        return None;
    }
    let named: Vec<String> = plan
        .hosts
        .iter()
        .filter(|h| !h.gpus.is_empty())
        .map(|h| format!("{} GPUs {}", h.name, join(&h.gpus)))
        .collect();
    if named.is_empty() {
        return None;
    }
    let at = loaded
        .written("device")
        .map(|w| format!(" ({w})"))
        .unwrap_or_default();
    Some(format!(
        "`device: cpu`{at}: the ranks train on the CPU, and the GPUs `machines` names go unused \
         ({}); remove `device: cpu` to train on them, or name the machines without GPUs",
        named.join(", ")
    ))
}

/// Refuses a checkpoint folder on this machine that cannot be made or written in, which would
/// fail the run at its start.
fn checkpoints_writable(loaded: &Loaded, plan: &Experiment) -> Result<(), CheckError> {
    for dir in local_checkpoint_dirs(plan) {
        can_write(&dir).map_err(|reason| CheckError::CheckpointDir {
            reason,
            at: loaded
                .written("checkpoint_dir")
                .map(|w| format!(" ({w})"))
                .unwrap_or_default(),
        })?;
    }
    Ok(())
}

/// The checkpoint folders of the ranks on this machine (`--checkpoint-dir`), each once; those
/// of other hosts are on their disks, which preflight creates.
fn local_checkpoint_dirs(plan: &Experiment) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for rank in plan
        .ranks
        .iter()
        .filter(|r| plan.hosts[r.host].machine.is_local())
    {
        let dir = experiment::flag_value(&rank.argv, "--checkpoint-dir").map(PathBuf::from);
        if let Some(dir) = dir.filter(|d| !dirs.contains(d)) {
            dirs.push(dir);
        }
    }
    dirs
}

/// Whether folder `dir` can be made (with its parents) and written in, as a rank does at its
/// start, tried for real and undone: what this made is removed again, so a check leaves nothing.
fn can_write(dir: &Path) -> Result<(), String> {
    // The folders this would make, innermost first, and the one that is there.
    let mut missing = Vec::new();
    let mut there = Some(dir);
    while let Some(at) = there.filter(|at| !at.as_os_str().is_empty() && std::fs::metadata(at).is_err()) {
        missing.push(at.to_path_buf());
        there = at.parent();
    }
    if let Some(at) = there.filter(|at| !at.as_os_str().is_empty() && !at.is_dir()) {
        return Err(format!("{} is not a folder", at.display()));
    }
    let probe = dir.join(format!(".stagehand-check-{}", std::process::id()));
    let tried = std::fs::create_dir_all(dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))
        .and_then(|()| {
            std::fs::write(&probe, b"").map_err(|e| format!("cannot write in {}: {e}", dir.display()))
        });
    let _ = std::fs::remove_file(&probe);
    for made in &missing {
        let _ = std::fs::remove_dir(made);
    }
    tried
}

/// The warnings in a runtime's stderr: lines `runtime: warning: WHAT` as `WHAT`, and `runtime:
/// rank R: warning: WHAT` as `rank R: WHAT`.
fn runtime_warnings(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|line| {
            let said = line.strip_prefix("runtime: ")?;
            if let Some(what) = said.strip_prefix("warning: ") {
                return Some(what.to_string());
            }
            let (who, what) = said.split_once(": warning: ")?;
            let rank = who.strip_prefix("rank ")?;
            rank.bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| format!("{who}: {what}"))
        })
        .collect()
}

/// Where the experiment key behind the first runtime flag `reason` names is written, as
/// ` (`key` at FILE:LINE)` (or ` (`key` from --grid)` for a sweep point's); nothing when it
/// names no flag or the file does not write its key (a flag the driver adds itself, such as
/// `--microbatches` defaulted from the replicas).
fn written_at(loaded: &Loaded, reason: &str) -> String {
    let flag = reason.match_indices("--").find_map(|(i, _)| {
        let name = &reason[i + 2..];
        let end = name
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .unwrap_or(name.len());
        (end > 0).then(|| &name[..end])
    });
    let Some(flag) = flag else {
        return String::new();
    };
    match loaded.written(&experiment::key_of_flag(flag)) {
        Some(written) => format!(" ({written})"),
        None => String::new(),
    }
}

/// The runtime to check with: `--runtime`, the ranks' own program where it is on this machine,
/// the source's release build, or `runtime` on PATH.
fn local_runtime(plan: &Experiment, options: &Options) -> Option<PathBuf> {
    if let Some(r) = &options.runtime {
        return Some(r.clone());
    }
    let program = Path::new(&plan.ranks[0].argv[0]);
    if program != Path::new(RUNTIME_IN_IMAGE) && program.is_file() {
        return Some(program.to_path_buf());
    }
    let built = experiment::source_root(options.source.as_deref())
        .map(|root| root.join(experiment::DEFAULT_LOCAL_RUNTIME))
        .filter(|p| p.is_file());
    built.or_else(|| find_program("runtime"))
}

/// Where `program` would be found: a path as given, or a bare name on `PATH`.
pub fn find_program(program: &str) -> Option<PathBuf> {
    let path = Path::new(program);
    if program.contains('/') {
        return path.is_file().then(|| path.to_path_buf());
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// The image line: which image, and whether a run builds it.
fn image_line(plan: &Experiment) -> String {
    match (&plan.backend, &plan.image) {
        (Backend::Process, _) => "none (local processes)".to_string(),
        (Backend::Slurm, _) => "none (Slurm runs the runtime on its nodes)".to_string(),
        (Backend::Docker, ImageSource::Named(name)) => {
            format!("{name}, used as is (it must exist on every host)")
        }
        (Backend::Docker, ImageSource::Base { name, build }) => format!(
            "{name} as is if it holds the stagehand runtime, else the runtime built on it: {}",
            image_line_of_build(build)
        ),
        (Backend::Docker, ImageSource::Build(spec)) => image_line_of_build(spec),
    }
}

/// The image line of a build.
fn image_line_of_build(spec: &crate::experiment::BuildSpec) -> String {
    let tag = match planned_tag(spec) {
        Ok(tag) => tag,
        Err(e) => format!(
            "{}:? (cannot list the context: {})",
            spec.repository,
            error_chain(&e)
        ),
    };
    format!(
        "{tag}, built from {} ({}) on the first host of each architecture that lacks it, \
         streamed to the others",
        spec.context.display(),
        spec.dockerfile
    )
}

/// The plan as people read it.
pub fn render(
    plan: &Experiment,
    image: &str,
    verdict: &RuntimeCheck,
    addr_given: bool,
    port_picked: bool,
) -> String {
    let mut out = String::new();
    let how = match (plan.backend, plan.container_mode) {
        (Backend::Process, _) => "local processes",
        (Backend::Slurm, _) => "tasks of one Slurm job",
        (Backend::Docker, ContainerMode::PerRank) => "docker containers, one per rank",
        (Backend::Docker, ContainerMode::PerHost) => "docker containers, one per host",
    };
    let _ = writeln!(
        out,
        "experiment {}: {} rank(s) on {} host(s) as {how}",
        plan.name,
        plan.world_size(),
        plan.hosts.len()
    );
    let _ = writeln!(out, "image: {image}");
    let _ = writeln!(out, "master: {}", master(plan, addr_given, port_picked));
    // What the launch finds is shown as such in the command lines, not as a value they will not
    // have.
    let addr_found =
        !addr_given && plan.backend != Backend::Slurm && plan.hosts.iter().any(|h| !h.machine.is_local());
    let later: Vec<(&str, &str)> = [
        (addr_found, ("--master-addr", "<master address>")),
        (
            port_picked && plan.backend != Backend::Slurm,
            ("--master-port", "<master port>"),
        ),
    ]
    .into_iter()
    .filter_map(|(found, pair)| found.then_some(pair))
    .collect();
    let record = crate::experiment::record_to_come(&plan.log_directory, &plan.name);
    let _ = writeln!(out, "record: {}", record.display());
    if plan.max_restarts > 0 {
        let from = match plan.checkpoints() {
            true => "from the latest checkpoints written in the run, else as first started",
            false => "as first started (no checkpoint_dir)",
        };
        let _ = writeln!(
            out,
            "restarts: up to {} after a failure, every rank {from}",
            plan.max_restarts
        );
    }
    for (i, host) in plan.hosts.iter().enumerate() {
        let gpus = if host.gpus.is_empty() {
            "no GPUs".to_string()
        } else {
            format!("GPUs {}", join(&host.gpus))
        };
        let _ = writeln!(out, "host {}: ranks {}; {gpus}", host.name, join(&host.ranks));
        for rank in plan.ranks.iter().filter(|r| r.host == i) {
            let stage = rank.stage.map(|s| format!(" stage {s}")).unwrap_or_default();
            let gpus = if rank.gpus.is_empty() {
                "cpu".to_string()
            } else {
                format!("gpu {}", join(&rank.gpus))
            };
            let _ = writeln!(
                out,
                "  rank {}{stage} ({gpus}): {}",
                rank.rank,
                shown_planned(&rank.argv, &later)
            );
        }
    }
    if let Some(slurm) = &plan.slurm {
        let request = crate::launch::slurm::srun_argv(slurm, "stagehand-<record id>", &[]);
        let _ = writeln!(out, "slurm: {} <rank command>", shown(&request));
    }
    if plan.auto.is_some() {
        let _ = writeln!(
            out,
            "stages: config_file: auto; rank 0's host profiles the model and the stages are planned at launch"
        );
    }
    let _ = match verdict {
        RuntimeCheck::Accepted {
            runtime,
            warnings,
            resumes_after,
        } => {
            let _ = writeln!(
                out,
                "runtime check: every rank's request accepted ({} --check)",
                runtime.display()
            );
            let remote = plan.hosts.iter().any(|h| !h.machine.is_local());
            let elsewhere = match remote {
                true => " (ranks on other hosts: checked there at preflight)",
                false => "",
            };
            let _ = match resumes_after {
                Some(0) => writeln!(out, "resume: no checkpoint yet; the run starts afresh{elsewhere}"),
                Some(n) => writeln!(
                    out,
                    "resume: from the checkpoints of {n} iterations done; training goes on at \
                     iteration {n}{elsewhere}"
                ),
                None => Ok(()),
            };
            warnings
                .iter()
                .try_for_each(|warning| writeln!(out, "runtime warning: {warning}"))
        }
        RuntimeCheck::Skipped(why) => writeln!(out, "runtime check: skipped: {why}"),
        RuntimeCheck::NoRuntime => writeln!(out, "runtime check: skipped: {NO_RUNTIME}"),
    };
    out
}

/// Where every rank reaches rank 0 (`MASTER_ADDR`, `MASTER_PORT`), as a run will find it: the
/// address and port the experiment gives (`addr_given`, and a port unless `port_picked`), or how
/// the launch finds them.
fn master(plan: &Experiment, addr_given: bool, port_picked: bool) -> String {
    let first = &plan.hosts[0];
    let remote = plan.hosts.iter().find(|h| !h.machine.is_local());
    let addr = match remote {
        _ if addr_given || plan.backend == Backend::Slurm => plan.master_addr.clone(),
        None => plan.master_addr.clone(),
        Some(other) if first.machine.is_local() => {
            format!(
                "this machine's address as {} sees it (found at launch)",
                other.name
            )
        }
        Some(_) => format!(
            "{}'s own address on the driver's SSH connection to it (found at launch)",
            first.name
        ),
    };
    let port = match (port_picked, plan.backend) {
        (false, _) => plan.master_port.to_string(),
        (true, Backend::Slurm) => "10000 + the job id modulo 20000".to_string(),
        (true, _) if first.machine.is_local() => "a free one picked at launch".to_string(),
        (true, _) => format!("a free one on {} picked at launch", first.name),
    };
    format!("{addr}, port {port}")
}

fn join<T: ToString>(items: &[T]) -> String {
    items.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}

/// [`shown`], with the value after each of `later`'s flags replaced by its placeholder (shown
/// unquoted): what the launch finds.
fn shown_planned(argv: &[String], later: &[(&str, &str)]) -> String {
    let mut words = Vec::new();
    let mut placeholder = None;
    for (i, arg) in argv.iter().enumerate() {
        match placeholder.take() {
            Some(shown) => words.push(String::from(shown)),
            None => words.push(shown(&argv[i..=i])),
        }
        placeholder = later
            .iter()
            .find(|(flag, _)| flag == arg)
            .map(|(_, shown)| *shown);
    }
    words.join(" ")
}

/// A command line to read (never run): words with anything but plain characters single-quoted.
fn shown(argv: &[String]) -> String {
    let word = |w: &String| {
        let plain = !w.is_empty()
            && w.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+".contains(c));
        if plain {
            w.clone()
        } else {
            format!("'{}'", w.replace('\'', r"'\''"))
        }
    };
    argv.iter().map(word).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `driver check`'s master line for an experiment of `machines` (and `more`), with the port
    /// given (`29400`) or to be picked.
    fn master_of(machines: &str, more: &str, port: Option<u16>) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exp.yml");
        std::fs::write(
            &path,
            format!("machines: {machines}\ncontainer: stagehand-runtime:test\nmodule: mlp\n{more}"),
        )
        .unwrap();
        let loaded = config::load(&path).unwrap();
        let options = crate::experiment::tests::options(None, crate::options::ContainerMode::PerRank);
        let plan = experiment::resolve(&loaded, &options, port.unwrap_or(29500)).unwrap();
        master(&plan, loaded.file.master_addr.is_some(), port.is_none())
    }

    #[test]
    fn the_master_is_said_as_the_launch_will_find_it() {
        assert_eq!(
            master_of("[localhost, localhost]", "", None),
            "127.0.0.1, port a free one picked at launch"
        );
        assert_eq!(
            master_of("[th1, th2]", "", None),
            "th1's own address on the driver's SSH connection to it (found at launch), port a free \
             one on th1 picked at launch"
        );
        assert_eq!(
            master_of("[localhost, th2]", "", Some(29400)),
            "this machine's address as th2 sees it (found at launch), port 29400"
        );
        assert_eq!(
            master_of("[th1, th2]", "master_addr: 10.0.0.5\n", Some(29400)),
            "10.0.0.5, port 29400"
        );
    }

    #[test]
    fn words_people_would_misread_are_quoted() {
        let argv = ["runtime", "--data", "a b", "it's", "--lr", "0.1"].map(String::from);
        assert_eq!(shown(&argv), r"runtime --data 'a b' 'it'\''s' --lr 0.1");
        let argv: Vec<String> = [
            "runtime",
            "--master-port",
            "29500",
            "--master-addr",
            "n1",
            "--lr",
            "0.1",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            shown_planned(&argv, &[("--master-port", "<master port>")]),
            "runtime --master-port <master port> --master-addr n1 --lr 0.1"
        );
    }

    #[test]
    fn a_refusal_says_where_the_key_behind_its_flag_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exp.yml");
        std::fs::write(
            &path,
            "machines: [localhost]\nmodule: mlp\nlr: 0\nbatch_size: 32\n",
        )
        .unwrap();
        let loaded = config::load(&path).unwrap();
        let at = |reason: &str| written_at(&loaded, reason);
        let file = path.display();
        assert_eq!(
            at("--lr: 0 is not a positive number"),
            format!(" (`learning_rate` at {file}:3)")
        );
        assert_eq!(
            at("--batch-size 32 is not divisible by --microbatches 3"),
            format!(" (`batch_size` at {file}:4)")
        );
        // A flag the file does not write (the driver's own), or none at all.
        assert_eq!(at("--microbatches: must be at least 1"), "");
        assert_eq!(at("unknown model"), "");
    }
}
