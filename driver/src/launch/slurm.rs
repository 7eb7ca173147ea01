//! The Slurm backend: every rank is a task of one job step that a single foreground `srun`
//! submits and starts (`--label`, so each output line names its task; `-v`, so srun says when
//! the job is queued, which nodes it got and which tasks started where). srun runs in its own
//! process group, started with an argument vector, never through a shell. Stopping is Slurm's
//! own `scancel`, which signals the ranks (SIGTERM, then SIGKILL after the cluster's KillWait)
//! and removes the job from the queue; [`SlurmLauncher::finish`] checks with `squeue` that
//! nothing of the job is left.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use stagehand_contract::slurm::expand_hostlist;
use tokio::io::AsyncRead;
use tokio::process::Command;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::watch;

use super::lines::for_each_line;
use super::{classify_line, oom, LaunchError};
use crate::config::SlurmSettings;
use crate::events::{Event, SlurmEvent, SlurmJob, Stream};
use crate::experiment::Experiment;

/// How long [`SlurmLauncher::finish`] waits for srun to end and for the job to leave the queue.
const FINISH_GRACE: Duration = Duration::from_secs(30);
/// How often `squeue` is asked while waiting.
const POLL: Duration = Duration::from_millis(500);

/// srun's options for `settings`, named `job_name`, that start `program` on every task.
pub fn srun_argv(settings: &SlurmSettings, job_name: &str, program: &[String]) -> Vec<String> {
    let mut argv = vec!["srun".to_string(), format!("--job-name={job_name}")];
    argv.extend(settings.srun_options());
    argv.extend([
        "--kill-on-bad-exit=1".to_string(),
        "--label".to_string(),
        "--verbose".to_string(),
        "--".to_string(),
    ]);
    argv.extend(program.iter().cloned());
    argv
}

/// Slurm's verdict on the request, without submitting it (`srun --test-only`): when and where
/// it would start, or why Slurm refuses it (no such partition, more nodes or CPUs than it has,
/// an invalid time limit, GPUs it lacks).
pub async fn preflight(
    settings: &SlurmSettings,
    job_name: &str,
    program: &[String],
) -> Result<String, LaunchError> {
    let mut argv = srun_argv(settings, job_name, program);
    argv.insert(1, "--test-only".into());
    let output = slurm_command(&argv)
        .output()
        .await
        .map_err(|source| LaunchError::SlurmMissing {
            program: "srun".into(),
            source,
        })?;
    let said = String::from_utf8_lossy(&output.stderr);
    let said: Vec<&str> = said.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if output.status.success() {
        let verdict = said.iter().rev().find(|l| l.contains("to start at"));
        return Ok(verdict.or(said.last()).map_or(String::new(), |l| l.to_string()));
    }
    Err(LaunchError::SlurmRefused {
        request: settings.srun_options().join(" "),
        reason: said.join("; "),
    })
}

/// A Slurm command with a clean Slurm environment: a driver started inside a job (`salloc`,
/// `sbatch`) must not make srun run a step of that job, nor take its sizes from the job's
/// variables. SLURM_CONF, which says where the cluster is, stays.
fn slurm_command(argv: &[String]) -> Command {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(Stdio::null());
    for (name, _) in std::env::vars_os() {
        let name_text = name.to_string_lossy();
        if name_text.starts_with("SLURM_") && name_text != "SLURM_CONF" {
            cmd.env_remove(&name);
        }
    }
    cmd
}

/// What the launcher knows of the job, shared with its reader tasks.
#[derive(Debug, Default)]
struct JobState {
    /// Ranks in the job.
    world: usize,
    job_id: Option<u64>,
    /// The job got its nodes.
    started: bool,
    /// Tasks seen to start.
    ranks_started: Vec<usize>,
    /// Tasks seen to end, with srun's exit code for each.
    ranks_ended: Vec<usize>,
    /// The driver asked Slurm to stop the job.
    stopping: bool,
    /// A [`SlurmEvent::Stopped`] was sent.
    stop_sent: bool,
    /// srun's last error or warning line.
    last_error: Option<String>,
    /// The end of the job's last rank, as srun reported it: sent once srun has exited and its
    /// output has been read, since the run ends with it and nothing after it would be reported.
    last_end: Option<Event>,
}

/// A running srun and its job.
pub struct SlurmLauncher {
    job_name: String,
    state: Arc<Mutex<JobState>>,
    srun: Pid,
    /// Becomes true once srun has exited and every rank's end was reported.
    done: watch::Receiver<bool>,
}

impl SlurmLauncher {
    /// Submits the job and starts every rank through srun; events go to `tx`.
    pub fn start(
        plan: &Experiment,
        settings: &SlurmSettings,
        job_name: String,
        tx: UnboundedSender<Event>,
    ) -> Result<SlurmLauncher, LaunchError> {
        let rank = &plan.ranks[0];
        let argv = srun_argv(settings, &job_name, &rank.argv);
        let mut cmd = slurm_command(&argv);
        cmd.envs(&rank.env)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        super::ends_with_the_driver(&mut cmd);
        let mut child = cmd.spawn().map_err(|source| LaunchError::SlurmMissing {
            program: "srun".into(),
            source,
        })?;
        let pid = child.id().expect("a just-spawned child has a pid");
        let world = plan.world_size();
        let state = Arc::new(Mutex::new(JobState {
            world,
            ..JobState::default()
        }));
        let out = tokio::spawn(read_stdout(child.stdout.take().expect("piped"), tx.clone()));
        let err = tokio::spawn(read_stderr(
            child.stderr.take().expect("piped"),
            state.clone(),
            tx.clone(),
        ));
        let (done_tx, done) = watch::channel(false);
        let ended = state.clone();
        let events = tx.clone();
        tokio::spawn(async move {
            let _ = out.await;
            let _ = err.await;
            let status = child.wait().await.ok();
            report_ends(&ended, status, &events);
            let _ = done_tx.send(true);
        });
        if let Some(seconds) = settings.start_timeout_s {
            tokio::spawn(start_deadline(state.clone(), Duration::from_secs(seconds), tx));
        }
        Ok(SlurmLauncher {
            job_name,
            state,
            srun: Pid::from_raw(pid as i32),
            done,
        })
    }

    /// Cancels the job: Slurm signals every rank (SIGTERM, SIGKILL after its KillWait) and
    /// takes the job out of the queue if it still waits there.
    pub async fn stop_all(&self) {
        let job_id = {
            let mut state = self.state.lock().expect("job state lock");
            state.stopping = true;
            state.job_id
        };
        let _ = scancel(job_id, &self.job_name).await;
    }

    /// Waits for srun to end and for the job to leave Slurm's queue, cancelling it again if it
    /// lingers; an error names a job that is still there and how to cancel it. A job whose srun
    /// had to be killed gets a grace of its own to leave the queue after that cancel.
    pub async fn finish(&self) -> Result<(), LaunchError> {
        let mut deadline = tokio::time::Instant::now() + FINISH_GRACE;
        let mut done = self.done.clone();
        let srun_ended = tokio::time::timeout_at(deadline, done.wait_for(|d| *d)).await;
        if srun_ended.is_err() {
            let _ = scancel(self.job_id(), &self.job_name).await;
            let _ = killpg(self.srun, Signal::SIGKILL);
            deadline = tokio::time::Instant::now() + FINISH_GRACE;
        }
        loop {
            let left = match queued(&self.job_name).await {
                Ok(left) => left,
                Err(reason) => {
                    return Err(LaunchError::SlurmJobLeft {
                        job: self.job_label(),
                        state: format!("unknown: squeue failed: {reason}"),
                        cancel: self.cancel_by_hand(),
                    })
                }
            };
            let Some((job_id, job_state)) = left.into_iter().next() else {
                return Ok(());
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(LaunchError::SlurmJobLeft {
                    job: job_id.to_string(),
                    state: job_state,
                    cancel: format!("scancel {job_id}"),
                });
            }
            // A job still queued or running after srun ended was not cancelled yet (srun
            // submitted it as the driver was stopping); a completing one is on its way out.
            if job_state != "COMPLETING" {
                let _ = scancel(Some(job_id), &self.job_name).await;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn job_id(&self) -> Option<u64> {
        self.state.lock().expect("job state lock").job_id
    }

    fn job_label(&self) -> String {
        match self.job_id() {
            Some(id) => id.to_string(),
            None => format!("named {}", self.job_name),
        }
    }

    fn cancel_by_hand(&self) -> String {
        match self.job_id() {
            Some(id) => format!("scancel {id}"),
            None => format!("scancel --me --name={}", self.job_name),
        }
    }
}

/// Asks Slurm to cancel the job: by id once known, else by its name (unique to the record).
async fn scancel(job_id: Option<u64>, job_name: &str) -> Result<(), String> {
    let argv = match job_id {
        Some(id) => vec!["scancel".to_string(), id.to_string()],
        None => vec!["scancel".into(), "--me".into(), format!("--name={job_name}")],
    };
    let output = slurm_command(&argv).output().await.map_err(|e| e.to_string())?;
    match output.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&output.stderr).trim().to_string()),
    }
}

/// `squeue --noheader` with `select` (which jobs) and a two-field `--format`, as pairs.
async fn squeue(select: &[String], format: &str) -> Result<Vec<(String, String)>, String> {
    let mut argv = vec!["squeue".to_string(), "--noheader".into()];
    argv.extend(select.iter().cloned());
    argv.push(format!("--format={format}"));
    let output = slurm_command(&argv).output().await.map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).trim().to_string());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            let (a, b) = l.trim().split_once('|')?;
            Some((a.to_string(), b.to_string()))
        })
        .collect())
}

/// The jobs named `job_name` that Slurm still lists, with their states.
async fn queued(job_name: &str) -> Result<Vec<(u64, String)>, String> {
    let select = ["--me".to_string(), format!("--name={job_name}")];
    let jobs = squeue(&select, "%i|%T").await?;
    Ok(jobs
        .into_iter()
        .filter_map(|(id, state)| Some((id.parse().ok()?, state)))
        .collect())
}

/// The job's state and Slurm's reason for it (`PENDING`, `Resources`), if it is listed.
async fn pending_reason(job_id: u64) -> Option<(String, String)> {
    squeue(&[format!("--jobs={job_id}")], "%T|%r")
        .await
        .ok()?
        .into_iter()
        .next()
}

/// After `wait`, a job that has not got its nodes is reported as not started (the supervisor
/// then cancels it).
async fn start_deadline(state: Arc<Mutex<JobState>>, wait: Duration, tx: UnboundedSender<Event>) {
    tokio::time::sleep(wait).await;
    let job_id = {
        let s = state.lock().expect("job state lock");
        if s.started || s.stopping || s.stop_sent {
            return;
        }
        s.job_id
    };
    let why = match job_id {
        Some(id) => match pending_reason(id).await {
            Some((state, reason)) => format!("did not start: still {state} (reason: {reason})"),
            None => "did not start".to_string(),
        },
        None => "was not even queued".to_string(),
    };
    let reason = format!(
        "{why} after {} s, the experiment's slurm.start_timeout_s; cancelled",
        wait.as_secs()
    );
    let mut s = state.lock().expect("job state lock");
    if s.started || s.stopping || s.stop_sent {
        return;
    }
    s.stop_sent = true;
    let _ = tx.send(Event::Slurm(SlurmEvent::Stopped {
        job_id,
        reason,
        never_started: true,
    }));
}

/// Once srun has exited (with `status`, when it could be had): every rank whose end srun did
/// not report ends now, with exit code 0 when srun succeeded; a job that never started says why
/// first, and its ranks are reported removed (they never ran).
fn report_ends(
    state: &Mutex<JobState>,
    status: Option<std::process::ExitStatus>,
    tx: &UnboundedSender<Event>,
) {
    let ok = status.is_some_and(|s| s.success());
    let mut s = state.lock().expect("job state lock");
    if let Some(end) = s.last_end.take() {
        let _ = tx.send(end);
    }
    if !s.started && !s.stopping && !s.stop_sent {
        let code = status
            .and_then(|st| st.code())
            .map_or("a signal".to_string(), |c| format!("code {c}"));
        let reason = match &s.last_error {
            Some(line) => format!("did not start: srun exited with {code}: {line}"),
            None => format!("did not start: srun exited with {code} before the job started"),
        };
        s.stop_sent = true;
        let _ = tx.send(Event::Slurm(SlurmEvent::Stopped {
            job_id: s.job_id,
            reason,
            never_started: true,
        }));
    }
    for rank in 0..s.world {
        if s.ranks_ended.contains(&rank) {
            continue;
        }
        let event = if s.ranks_started.contains(&rank) {
            Event::RankExited {
                rank,
                exit_code: ok.then_some(0),
                out_of_memory: false,
            }
        } else {
            Event::RankRemoved { rank }
        };
        let _ = tx.send(event);
    }
}

async fn read_stdout(stream: impl AsyncRead + Unpin, tx: UnboundedSender<Event>) {
    for_each_line(stream, |line| {
        let event = match task_line(&line) {
            Some((rank, text)) => classify_line(rank, Stream::Stdout, text.to_string()),
            None => Event::Slurm(SlurmEvent::Line {
                line,
                important: false,
            }),
        };
        let _ = tx.send(event);
    })
    .await;
}

async fn read_stderr(
    stream: impl AsyncRead + Unpin,
    state: Arc<Mutex<JobState>>,
    tx: UnboundedSender<Event>,
) {
    for_each_line(stream, |line| {
        let mut s = state.lock().expect("job state lock");
        for event in stderr_events(&mut s, line) {
            let _ = tx.send(event);
        }
    })
    .await;
}

/// The events one line of srun's stderr makes, updating what is known of the job.
fn stderr_events(s: &mut JobState, line: String) -> Vec<Event> {
    let mut events = Vec::new();
    match parse_srun_line(&line) {
        SrunLine::Task { rank, text } => {
            // slurmstepd says why it ends a step in the first task's stderr.
            if let Some(reason) = step_cancelled(&text).filter(|_| !s.stopping && !s.stop_sent) {
                s.stop_sent = true;
                events.push(Event::Slurm(SlurmEvent::Stopped {
                    job_id: s.job_id,
                    reason: reason.to_string(),
                    never_started: !s.started,
                }));
            }
            events.push(classify_line(rank, Stream::Stderr, text));
        }
        SrunLine::Queued { job_id } => {
            s.job_id = Some(job_id);
            events.push(Event::Slurm(SlurmEvent::Queued { job_id }));
        }
        SrunLine::Allocated { job_id, nodes } => {
            s.job_id = Some(job_id);
            s.started = true;
            events.push(Event::Slurm(SlurmEvent::Started(SlurmJob { job_id, nodes })));
        }
        SrunLine::Launching { host, tasks } => {
            let job = s.job_id.map_or(String::new(), |id| format!("Slurm job {id} "));
            for rank in tasks {
                s.ranks_started.push(rank);
                events.push(Event::RankStarted {
                    rank,
                    host: host.clone(),
                    handle: format!("{job}task {rank}"),
                });
            }
        }
        SrunLine::TasksEnded {
            tasks,
            exit_code,
            out_of_memory,
        } => {
            // srun's own words first: once the last rank has exited the run ends, and an event
            // queued behind that exit would never be reported.
            events.push(Event::Slurm(SlurmEvent::Line {
                line,
                important: true,
            }));
            for rank in tasks {
                if !s.ranks_ended.contains(&rank) {
                    s.ranks_ended.push(rank);
                    let end = Event::RankExited {
                        rank,
                        exit_code,
                        out_of_memory,
                    };
                    // The last rank's end waits for the rest of srun's output (report_ends).
                    match s.ranks_ended.len() == s.world {
                        true => s.last_end = Some(end),
                        false => events.push(end),
                    }
                }
            }
        }
        SrunLine::Srun { important } => {
            if important {
                let text = line.strip_prefix("srun: ").unwrap_or(&line);
                s.last_error = Some(text.strip_prefix("error: ").unwrap_or(text).to_string());
            }
            events.push(Event::Slurm(SlurmEvent::Line { line, important }));
        }
    }
    events
}

/// A line srun printed on stderr.
#[derive(Debug, PartialEq, Eq)]
enum SrunLine {
    /// `3: text`: a rank's own line (`--label`).
    Task { rank: usize, text: String },
    /// `srun: job 12 queued and waiting for resources`.
    Queued { job_id: u64 },
    /// `srun: jobid 12: nodes(2):`n[1-2]', cpu counts: 4(x2)`.
    Allocated { job_id: u64, nodes: Vec<String> },
    /// `srun: launching StepId=12.0 on host n1, 2 tasks: [0-1]`.
    Launching { host: String, tasks: Vec<usize> },
    /// `srun: error: n1: task 1: Exited with exit code 3` (or `tasks 0-1: Terminated`, or `task
    /// 0: Out Of Memory`: Slurm's cgroup saw it killed for memory; srun says so once a step).
    TasksEnded {
        tasks: Vec<usize>,
        exit_code: Option<i64>,
        out_of_memory: bool,
    },
    /// Anything else srun says; errors and warnings are `important`.
    Srun { important: bool },
}

/// Why slurmstepd's `*** STEP 12.0 ON n1 CANCELLED AT <time> DUE TO TIME LIMIT ***` ended the
/// step, when Slurm itself ended it. A plain `CANCELLED AT` is a cancellation (the driver's,
/// srun's after a failed task, or someone's scancel): the ranks' exits tell that story.
fn step_cancelled(text: &str) -> Option<&'static str> {
    if !(text.contains("*** STEP ") || text.contains("*** JOB ")) || !text.contains(" CANCELLED AT ") {
        return None;
    }
    if text.contains("DUE TO TIME LIMIT") {
        Some("reached its time limit (slurm.time_limit); Slurm sent the ranks SIGTERM")
    } else if text.contains("DUE TO PREEMPTION") {
        Some("was preempted by Slurm")
    } else if text.contains("DUE TO NODE FAILURE") {
        Some("lost a node (Slurm reports a node failure)")
    } else {
        None
    }
}

/// `N: text` with srun's (space-padded) task label.
fn task_line(line: &str) -> Option<(usize, &str)> {
    let (label, text) = line.split_once(": ")?;
    let rank = label.trim_start().parse().ok()?;
    Some((rank, text))
}

fn parse_srun_line(line: &str) -> SrunLine {
    if let Some((rank, text)) = task_line(line) {
        return SrunLine::Task {
            rank,
            text: text.to_string(),
        };
    }
    let Some(said) = line.strip_prefix("srun: ") else {
        return SrunLine::Srun { important: true };
    };
    let number = |s: &str| s.trim().parse::<u64>().ok();
    if let Some(job_id) = said
        .strip_prefix("job ")
        .and_then(|r| r.strip_suffix(" queued and waiting for resources"))
        .and_then(number)
    {
        return SrunLine::Queued { job_id };
    }
    if let Some(rest) = said.strip_prefix("jobid ") {
        let job_id = rest.split(':').next().and_then(number);
        let nodes = rest
            .split_once('`')
            .and_then(|(_, r)| r.split_once('\''))
            .and_then(|(list, _)| expand_hostlist(list).ok());
        if let (Some(job_id), Some(nodes)) = (job_id, nodes) {
            return SrunLine::Allocated { job_id, nodes };
        }
    }
    if let Some(rest) = said.strip_prefix("launching StepId=") {
        let parsed = rest.split_once(" on host ").and_then(|(_, r)| {
            let (host, tasks) = r.split_once(", ")?;
            let (_, list) = tasks.split_once(": ")?;
            Some((host.to_string(), task_list(list)?))
        });
        if let Some((host, tasks)) = parsed {
            return SrunLine::Launching { host, tasks };
        }
    }
    if let Some(rest) = said.strip_prefix("error: ") {
        // `HOST: task(s) LIST: REASON`
        let mut parts = rest.splitn(3, ": ");
        let (_host, tasks, reason) = (parts.next(), parts.next(), parts.next());
        let tasks = tasks.and_then(|t| t.strip_prefix("tasks ").or_else(|| t.strip_prefix("task ")));
        if let (Some(tasks), Some(reason)) = (tasks.and_then(task_list), reason) {
            // The kernel's OOM killer sends SIGKILL.
            let out_of_memory = reason.trim() == "Out Of Memory";
            return SrunLine::TasksEnded {
                tasks,
                exit_code: if out_of_memory {
                    Some(oom::SIGKILLED)
                } else {
                    exit_code_of(reason)
                },
                out_of_memory,
            };
        }
    }
    let important = said.starts_with("error")
        || said.starts_with("warning")
        || said.starts_with("Job ")
        || said.starts_with("Force Terminated")
        || said.contains("CANCELLED");
    SrunLine::Srun { important }
}

/// `[0-1,4]`, `0-1` or `3`: task ids.
fn task_list(list: &str) -> Option<Vec<usize>> {
    let list = list.trim();
    let inner = list
        .strip_prefix('[')
        .and_then(|l| l.strip_suffix(']'))
        .unwrap_or(list);
    let ids = expand_hostlist(&format!("[{inner}]")).ok()?;
    ids.iter().map(|id| id.parse().ok()).collect()
}

/// The shell-style exit code srun's reason for a task's end means.
fn exit_code_of(reason: &str) -> Option<i64> {
    if let Some(code) = reason.strip_prefix("Exited with exit code ") {
        return code.trim().parse().ok();
    }
    let signal = match reason.trim() {
        "Interrupt" => 2,
        "Aborted" => 6,
        "Killed" => 9,
        "Segmentation fault" => 11,
        "Terminated" => 15,
        _ => return None,
    };
    Some(128 + signal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_lines_keep_their_text_and_srun_says_where_and_how_they_ran() {
        assert_eq!(
            parse_srun_line(" 3: loss: 0.5"),
            SrunLine::Task {
                rank: 3,
                text: "loss: 0.5".into()
            }
        );
        assert_eq!(
            parse_srun_line("srun: job 17 queued and waiting for resources"),
            SrunLine::Queued { job_id: 17 }
        );
        assert_eq!(
            parse_srun_line("srun: jobid 17: nodes(3):`gpu[01-02],cpu7', cpu counts: 2(x3)"),
            SrunLine::Allocated {
                job_id: 17,
                nodes: vec!["gpu01".into(), "gpu02".into(), "cpu7".into()]
            }
        );
        assert_eq!(
            parse_srun_line("srun: launching StepId=17.0 on host gpu02, 2 tasks: [2-3]"),
            SrunLine::Launching {
                host: "gpu02".into(),
                tasks: vec![2, 3]
            }
        );
        assert_eq!(
            parse_srun_line("srun: launching StepId=17.0 on host vm, 1 tasks: 0"),
            SrunLine::Launching {
                host: "vm".into(),
                tasks: vec![0]
            }
        );
    }

    #[test]
    fn slurm_ending_a_step_itself_is_told_apart_from_a_cancellation() {
        let line = |why: &str| {
            format!("slurmstepd-vm: error: *** STEP 16.0 ON vm CANCELLED AT 2026-11-25T01:42:42{why} ***")
        };
        assert!(step_cancelled(&line(" DUE TO TIME LIMIT"))
            .unwrap()
            .contains("time limit"));
        assert!(step_cancelled(&line(" DUE TO PREEMPTION"))
            .unwrap()
            .contains("preempted"));
        assert_eq!(step_cancelled(&line("")), None);
        assert_eq!(step_cancelled("the word CANCELLED AT in a rank's own line"), None);
    }

    #[test]
    fn task_ends_carry_the_exit_code_a_shell_would_show() {
        let ended = |line| match parse_srun_line(line) {
            SrunLine::TasksEnded {
                tasks,
                exit_code,
                out_of_memory: false,
            } => (tasks, exit_code),
            other => panic!("{line}: {other:?}"),
        };
        assert_eq!(
            ended("srun: error: vm: task 1: Exited with exit code 3"),
            (vec![1], Some(3))
        );
        assert_eq!(ended("srun: error: vm: task 0: Terminated"), (vec![0], Some(143)));
        assert_eq!(
            ended("srun: error: n1: tasks 0-2,5: Killed"),
            (vec![0, 1, 2, 5], Some(137))
        );
        assert_eq!(ended("srun: error: n1: task 4: Bus error"), (vec![4], None));
        // Slurm's task/cgroup plugin saw the task killed for memory.
        assert_eq!(
            parse_srun_line("srun: error: gpu01: task 1: Out Of Memory"),
            SrunLine::TasksEnded {
                tasks: vec![1],
                exit_code: Some(137),
                out_of_memory: true
            }
        );
        assert_eq!(
            parse_srun_line("srun: error: Unable to allocate resources: Invalid partition name specified"),
            SrunLine::Srun { important: true }
        );
        assert_eq!(
            parse_srun_line("srun: route/default: init: route default plugin loaded"),
            SrunLine::Srun { important: false }
        );
    }

    #[test]
    fn the_last_ranks_end_comes_after_everything_srun_said() {
        // A run ends with its last rank's exit: what came after it in the queue would be lost.
        let state = Mutex::new(JobState {
            world: 2,
            started: true,
            ranks_started: vec![0, 1],
            ..JobState::default()
        });
        let oom = |rank| Event::RankExited {
            rank,
            exit_code: Some(137),
            out_of_memory: true,
        };
        let said = |line: &str| stderr_events(&mut state.lock().unwrap(), line.into());
        let events = said("srun: error: vm: task 1: Out Of Memory");
        assert!(
            matches!(
                events.as_slice(),
                [Event::Slurm(SlurmEvent::Line { important: true, .. }), end] if format!("{end:?}") == format!("{:?}", oom(1))
            ),
            "{events:?}"
        );
        let events = said("srun: error: vm: task 0: Out Of Memory");
        assert!(
            matches!(
                events.as_slice(),
                [Event::Slurm(SlurmEvent::Line { important: true, .. })]
            ),
            "{events:?}"
        );
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // Whatever rank 0's output still held has been read; srun exited 1.
        let failed = std::os::unix::process::ExitStatusExt::from_raw(1 << 8);
        report_ends(&state, Some(failed), &tx);
        assert_eq!(format!("{:?}", rx.try_recv().unwrap()), format!("{:?}", oom(0)));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn the_ranks_run_one_srun_whose_every_value_is_one_argument() {
        let settings = SlurmSettings {
            partition: Some("debug".into()),
            tasks_per_node: 2,
            ..SlurmSettings::default()
        };
        let argv = srun_argv(
            &settings,
            "stagehand-x",
            &["/bin/runtime".into(), "--model".into(), "mlp".into()],
        );
        assert_eq!(
            argv,
            [
                "srun",
                "--job-name=stagehand-x",
                "--nodes=1",
                "--ntasks-per-node=2",
                "--ntasks=2",
                "--partition=debug",
                "--kill-on-bad-exit=1",
                "--label",
                "--verbose",
                "--",
                "/bin/runtime",
                "--model",
                "mlp"
            ]
        );
    }

    #[test]
    fn a_job_that_never_started_says_why_before_its_ranks_are_removed() {
        let state = Mutex::new(JobState {
            world: 2,
            job_id: Some(9),
            last_error: Some("Unable to allocate resources: Requested time limit is invalid".into()),
            ..JobState::default()
        });
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        report_ends(&state, None, &tx);
        match rx.try_recv().unwrap() {
            Event::Slurm(SlurmEvent::Stopped {
                job_id,
                reason,
                never_started,
            }) => {
                assert!(never_started);
                assert_eq!(job_id, Some(9));
                assert!(reason.contains("Requested time limit is invalid"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(rx.try_recv().unwrap(), Event::RankRemoved { rank: 0 }));
        assert!(matches!(rx.try_recv().unwrap(), Event::RankRemoved { rank: 1 }));
    }

    #[test]
    fn ranks_whose_end_srun_did_not_report_ended_as_srun_did() {
        let state = Mutex::new(JobState {
            world: 2,
            job_id: Some(9),
            started: true,
            ranks_started: vec![0, 1],
            ranks_ended: vec![1],
            ..JobState::default()
        });
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // srun exited 0.
        let success = std::os::unix::process::ExitStatusExt::from_raw(0);
        report_ends(&state, Some(success), &tx);
        assert!(matches!(
            rx.try_recv().unwrap(),
            Event::RankExited {
                rank: 0,
                exit_code: Some(0),
                ..
            }
        ));
        assert!(rx.try_recv().is_err());
    }
}
