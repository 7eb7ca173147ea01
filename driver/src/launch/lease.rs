//! The lease that keeps a container alive only while its driver is: every container's first
//! process is a constant POSIX sh guard ([`GUARD_SCRIPT`]) that runs the rank (or, for a per-host
//! container, just waits) and stops everything once the lease file [`LEASE_FILE`] has not changed
//! for [`LEASE_TTL`], counted on the container's own clock. The driver rewrites that file's content
//! every [`RENEW_EVERY`] through the Docker API (an archive upload: no exec, no shell, nothing
//! the image must provide beyond `/bin/sh` and `sleep`), each call bounded by [`RENEW_CALL_TIMEOUT`]
//! so a host that does not answer holds up nothing. A driver killed, or a host cut off from it,
//! stops renewing, and the containers stop themselves, exiting with 86
//! ([`crate::events::LEASE_EXPIRED_EXIT_CODE`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::query_parameters::UploadToContainerOptionsBuilder;
use futures_util::future::join_all;
use tokio::task::JoinHandle;

/// How often the driver rewrites every container's lease.
pub const RENEW_EVERY: Duration = Duration::from_secs(5);
/// How long a lease that has not changed keeps its container alive.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// The most one renewal call may take; past it the host is skipped until the next round.
pub const RENEW_CALL_TIMEOUT: Duration = Duration::from_secs(4);
/// The lease file inside a container: at the root, where no bind mount of the experiment can
/// put it on a host's disk shared with another container.
pub const LEASE_FILE: &str = "/.stagehand-lease";

/// The guard. Constant text: the lease file, the TTL in seconds and the program's argument vector
/// arrive as positional parameters (`$1`, `$2`, then `"$@"`), never spliced into the script.
///
/// With no program it is a per-host container's idle process. It exits when the lease expires,
/// which stops the container and every rank exec'd into it. On TERM (or INT) it passes TERM to
/// the ranks exec'd into the container, which are not its children: each wrote its process ID
/// into [`RANKS_FILE`] as it started ([`exec_rank`]). It exits 143 (130) once none of them is
/// left, so ranks that checkpoint on TERM finish writing first; 86 if the lease expires before.
///
/// With one, it runs the program in the background, passes TERM on (and INT as TERM: a shell
/// starts background programs with INT ignored), exits with the program's status, and when the
/// lease expires sends TERM, then KILL 10 s later, and exits with 86.
///
/// Time is counted in one-second sleeps, so a loaded host only stretches the TTL, never shortens
/// it.
pub const GUARD_SCRIPT: &str = r#"lease=$1 ttl=$2 ranks=$1.ranks
shift 2
watch() {
  last= age=0
  while [ "$age" -lt "$ttl" ]; do
    sleep 1
    now=
    { IFS= read -r now <"$lease"; } 2>/dev/null
    if [ "$now" = "$last" ]; then age=$((age + 1)); else last=$now age=0; fi
    if [ -n "$stopping" ] && ! ranks_alive; then exit "$stopping"; fi
  done
  echo "stagehand-guard: the driver has not renewed this container's lease for $ttl s (it is gone or cannot reach this host); stopping the rank (exit 86)" >&2
}
signal_ranks() {
  [ -f "$ranks" ] || return 0
  while IFS= read -r pid; do kill -TERM "$pid" 2>/dev/null; done <"$ranks"
}
ranks_alive() {
  [ -f "$ranks" ] || return 1
  while IFS= read -r pid; do
    kill -0 "$pid" 2>/dev/null && return 0
  done <"$ranks"
  return 1
}
stopping=
if [ "$#" -eq 0 ]; then
  trap 'stopping=143; signal_ranks' TERM
  trap 'stopping=130; signal_ranks' INT
  watch
  exit 86
fi
"$@" &
child=$!
(
  trap - TERM
  watch
  trap '' TERM
  kill -TERM "$child" 2>/dev/null
  n=0
  while kill -0 "$child" 2>/dev/null && [ "$n" -lt 10 ]; do sleep 1; n=$((n + 1)); done
  kill -KILL "$child" 2>/dev/null
  exit 86
) &
watcher=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
while :; do
  wait "$child" 2>/dev/null
  status=$?
  kill -0 "$child" 2>/dev/null || break
done
kill -TERM "$watcher" 2>/dev/null
wait "$watcher" 2>/dev/null
[ "$?" -eq 86 ] && exit 86
exit "$status"
"#;

/// Where the ranks exec'd into a per-host container write their process IDs: the lease file's
/// path with `.ranks` added, as the guard derives it.
pub const RANKS_FILE: &str = "/.stagehand-lease.ranks";

/// Starts a rank exec'd into a per-host container: appends its process ID to the ranks file
/// (`$1`), then becomes the rank (`exec`: the same process, so a TERM sent to that ID reaches the
/// rank itself). Constant text; the file and the rank's argument vector are positional
/// parameters.
pub const RANK_SCRIPT: &str = r#"echo "$$" >>"$1"
shift
exec "$@"
"#;

/// The command that execs `argv` as a rank into a per-host container, so its idle guard can pass
/// a TERM on to it.
pub fn exec_rank(argv: &[String]) -> Vec<String> {
    let mut cmd = vec![
        "/bin/sh".to_string(),
        "-c".to_string(),
        RANK_SCRIPT.to_string(),
        "stagehand-rank".to_string(),
        RANKS_FILE.to_string(),
    ];
    cmd.extend(argv.iter().cloned());
    cmd
}

/// The entrypoint that runs `argv` (none: idle) under the guard.
pub fn guarded(argv: &[String]) -> Vec<String> {
    guarded_for(LEASE_TTL, argv)
}

/// [`guarded`] with a lease of `ttl` (whole seconds) rather than [`LEASE_TTL`].
pub(super) fn guarded_for(ttl: Duration, argv: &[String]) -> Vec<String> {
    let mut entry = vec![
        "/bin/sh".to_string(),
        "-c".to_string(),
        GUARD_SCRIPT.to_string(),
        "stagehand-guard".to_string(),
        LEASE_FILE.to_string(),
        ttl.as_secs().to_string(),
    ];
    entry.extend(argv.iter().cloned());
    entry
}

/// A tar holding the lease file with `content`, for an upload to `/`.
pub fn lease_tar(content: &str) -> Vec<u8> {
    file_tar(LEASE_FILE, content, 0o644)
}

/// A tar holding an empty [`RANKS_FILE`] that every user may append to, for an upload to `/`
/// before a per-host container starts: ranks running as an image's own user (not root) cannot
/// create a file at the root.
pub fn ranks_tar() -> Vec<u8> {
    file_tar(RANKS_FILE, "", 0o666)
}

/// A tar of one file holding `content` with `mode`, at `path` less any leading `/` (relative to
/// wherever it is unpacked).
pub(super) fn file_tar(path: &str, content: &str, mode: u32) -> Vec<u8> {
    let mut header = tar::Header::new_gnu();
    header.set_size(content.len() as u64);
    header.set_mode(mode);
    header.set_cksum();
    let mut builder = tar::Builder::new(Vec::new());
    builder
        .append_data(&mut header, path.trim_start_matches('/'), content.as_bytes())
        .expect("a tar in memory cannot fail to grow");
    builder
        .into_inner()
        .expect("a tar in memory cannot fail to finish")
}

/// The containers whose leases are renewed: id -> its host's engine.
pub type Leased = Arc<Mutex<HashMap<String, bollard::Docker>>>;

/// Renews the leases of the containers in `leased` until dropped.
pub struct Renewer {
    task: JoinHandle<()>,
}

impl Renewer {
    /// Starts renewing now, and every [`RENEW_EVERY`].
    pub fn start(leased: Leased) -> Renewer {
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(RENEW_EVERY);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for round in 1u64.. {
                ticks.tick().await;
                let targets: Vec<(String, bollard::Docker)> = leased
                    .lock()
                    .expect("lease list lock")
                    .iter()
                    .map(|(id, docker)| (id.clone(), docker.clone()))
                    .collect();
                let tar = lease_tar(&format!("{round} {}\n", jiff::Timestamp::now()));
                join_all(targets.iter().map(|(id, docker)| renew(docker, id, &tar))).await;
            }
        });
        Renewer { task }
    }

    /// Renews the lease of container `id` on `docker` alone: a container that runs to its end
    /// while the driver waits (preflight's checks), which may take longer than a lease.
    pub fn one(docker: &bollard::Docker, id: &str) -> Renewer {
        let leased = Leased::default();
        leased
            .lock()
            .expect("lease list lock")
            .insert(id.to_string(), docker.clone());
        Renewer::start(leased)
    }
}

impl Drop for Renewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One renewal; a failure is not reported: a container that keeps missing renewals stops itself,
/// and a host that stopped answering is reported by the streams that follow its ranks.
async fn renew(docker: &bollard::Docker, id: &str, tar: &[u8]) {
    let options = UploadToContainerOptionsBuilder::default().path("/").build();
    let upload = docker.upload_to_container(id, Some(options), bollard::body_full(tar.to_vec().into()));
    let _ = tokio::time::timeout(RENEW_CALL_TIMEOUT, upload).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::LEASE_EXPIRED_EXIT_CODE as EXPIRED_EXIT_CODE;
    use std::process::{Command, Stdio};
    use std::time::Instant;

    /// Runs the guard with the system's /bin/sh and a short TTL.
    fn guard(lease: &std::path::Path, ttl: u32, argv: &[&str]) -> Command {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(GUARD_SCRIPT)
            .arg("stagehand-guard")
            .arg(lease)
            .arg(ttl.to_string())
            .args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    #[test]
    fn the_programs_arguments_and_exit_status_pass_through_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let tricky = ["a b", "$(echo no)", "'\"", "*", ""];
        let mut argv = vec![
            "sh",
            "-c",
            r#"for a in "$@"; do printf '[%s]' "$a"; done; exit 7"#,
            "x",
        ];
        argv.extend(tricky);
        let out = guard(&dir.path().join("lease"), 30, &argv).output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(7),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "[a b][$(echo no)]['\"][*][]"
        );
        assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    #[test]
    fn an_unrenewed_lease_stops_the_program_with_86() {
        let dir = tempfile::tempdir().unwrap();
        let start = Instant::now();
        let out = guard(&dir.path().join("lease"), 2, &["sleep", "60"])
            .output()
            .unwrap();
        assert_eq!(out.status.code().map(i64::from), Some(EXPIRED_EXIT_CODE));
        assert!(GUARD_SCRIPT.contains(&format!("exit {EXPIRED_EXIT_CODE}\n")));
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(30),
            "{elapsed:?}"
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("has not renewed this container's lease for 2 s"),
            "{stderr}"
        );
    }

    /// Rewrites `lease` every 100 ms until `stop`, atomically (a rename, so the guard never reads
    /// a half-written file), and returns the longest gap between two renewals.
    fn renew_until(lease: &std::path::Path, stop: Instant) -> Duration {
        let fresh = lease.with_extension("new");
        let mut last = Instant::now();
        let mut longest = Duration::ZERO;
        for n in 0u64.. {
            std::fs::write(&fresh, format!("{n}\n")).unwrap();
            std::fs::rename(&fresh, lease).unwrap();
            let now = Instant::now();
            longest = longest.max(now - last);
            last = now;
            if now >= stop {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        longest
    }

    #[test]
    fn a_renewed_lease_keeps_the_program_running_and_an_idle_guard_exits_when_it_expires() {
        // The guard samples the lease once a second and stops after TTL equal samples, so a
        // program whose lease changed at least once a second must run to its end. A renewer
        // that a busy machine held up longer than that proves nothing either way: the run is
        // tried again, and a guard that stops a program renewed on time fails the test.
        const TTL: u32 = 2;
        for attempt in 1..=3 {
            let dir = tempfile::tempdir().unwrap();
            let lease = dir.path().join("lease");
            let mut program = guard(&lease, TTL, &["sleep", "5"]).spawn().unwrap();
            let mut idle = guard(&lease, TTL, &[]).spawn().unwrap();
            let longest = renew_until(&lease, Instant::now() + Duration::from_millis(6500));
            let status = program.wait().unwrap().code();
            let idle_running = idle.try_wait().unwrap().is_none();
            if longest >= Duration::from_secs(1) {
                let _ = idle.kill();
                let _ = idle.wait();
                eprintln!("attempt {attempt}: the renewer was held up {longest:?}; trying again");
                continue;
            }
            // The program ran its 5 s to the end, renewed past twice the TTL.
            assert_eq!(status, Some(0), "renewed at most {longest:?} apart");
            assert!(idle_running, "the idle guard stopped while renewed");
            let stopped = Instant::now();
            assert_eq!(idle.wait().unwrap().code(), Some(86));
            // TTL 2 s of one-second samples: a few seconds, stretched only by a busy machine.
            assert!(
                stopped.elapsed() < Duration::from_secs(30),
                "{:?}",
                stopped.elapsed()
            );
            return;
        }
        panic!("three attempts in a row, this machine held the renewer up for a second or more");
    }

    #[test]
    fn term_reaches_the_program_and_its_status_is_the_guards() {
        let dir = tempfile::tempdir().unwrap();
        let child = guard(&dir.path().join("lease"), 30, &["sleep", "60"])
            .spawn()
            .unwrap();
        // Signal only once the guard has set its TERM trap (a busy machine may take a while to
        // get there): before that a TERM would end the shell itself, not test the guard.
        wait_for_term_trap(child.id());
        let start = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(143),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    }

    /// Waits until process `pid` catches SIGTERM (a shell that has set its trap).
    fn wait_for_term_trap(pid: u32) {
        let status = format!("/proc/{pid}/status");
        let ready = Instant::now();
        while !catches_term(&std::fs::read_to_string(&status).unwrap_or_default()) {
            assert!(
                ready.elapsed() < Duration::from_secs(30),
                "{pid} never set its trap"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A per-host container's idle guard, told to stop, passes TERM to the ranks the rank starter
    /// recorded (not its children), waits for them to finish what TERM makes them do (a
    /// checkpoint), and only then exits 143.
    #[test]
    fn an_idle_guard_passes_term_to_the_ranks_started_beside_it_and_waits_for_them() {
        let dir = tempfile::tempdir().unwrap();
        let lease = dir.path().join("lease");
        assert_eq!(
            RANKS_FILE,
            format!("{LEASE_FILE}.ranks"),
            "the guard derives the ranks file"
        );
        let ranks_file = dir.path().join("lease.ranks");
        // A rank that takes a second and a half after TERM to write what it was asked to, then
        // exits 143, as a checkpointing runtime does.
        let rank = |n: usize| {
            let mut cmd = Command::new("/bin/sh");
            let done = dir.path().join(format!("done-{n}"));
            cmd.arg("-c")
                .arg(RANK_SCRIPT)
                .arg("stagehand-rank")
                .arg(&ranks_file)
                .args([
                    "sh",
                    "-c",
                    "trap 'sleep 1.5; : >\"$1\"; exit 143' TERM; while :; do sleep 0.1; done",
                ])
                .arg("rank")
                .arg(&done)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            (Reaped(cmd.spawn().unwrap()), done)
        };
        let mut ranks = vec![rank(0), rank(1)];
        let mut idle = Reaped(guard(&lease, 30, &[]).spawn().unwrap());
        for (child, _) in &ranks {
            wait_for_term_trap(child.0.id());
        }
        wait_for_term_trap(idle.0.id());
        let mut recorded: Vec<u32> = std::fs::read_to_string(&ranks_file)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        recorded.sort_unstable();
        let mut ids: Vec<u32> = ranks.iter().map(|(c, _)| c.0.id()).collect();
        ids.sort_unstable();
        assert_eq!(
            recorded, ids,
            "each rank recorded its own process ID (exec keeps it)"
        );
        // Each rank reaped as it ends, as the engine reaps a process exec'd into a container (a
        // zombie would still count as alive).
        let reapers: Vec<_> = ranks
            .drain(..)
            .map(|(mut child, done)| {
                std::thread::spawn(move || {
                    // Bounded, so a guard that never passes TERM on fails the test, not hangs it.
                    let deadline = Instant::now() + Duration::from_secs(60);
                    loop {
                        if let Some(status) = child.0.try_wait().unwrap() {
                            return (status.code(), Instant::now(), done);
                        }
                        if Instant::now() > deadline {
                            return (None, Instant::now(), done);
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                })
            })
            .collect();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(idle.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert_eq!(idle.0.wait().unwrap().code(), Some(143));
        let guard_ended = Instant::now();
        for reaper in reapers {
            let (code, ended, done) = reaper.join().unwrap();
            assert_eq!(code, Some(143), "the rank got TERM");
            assert!(done.exists(), "{} was written", done.display());
            assert!(
                ended <= guard_ended,
                "the guard exited before the rank had finished"
            );
        }
    }

    /// A child killed and reaped when dropped, so a failing test leaves nothing running.
    struct Reaped(std::process::Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// Whether a process's `/proc/PID/status` says it catches SIGTERM (bit 15 of `SigCgt`).
    fn catches_term(status: &str) -> bool {
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & (1 << (15 - 1)) != 0)
    }

    #[test]
    fn the_lease_tar_holds_one_readable_file_at_the_lease_path() {
        let tar = lease_tar("7 now\n");
        let mut archive = tar::Archive::new(tar.as_slice());
        let mut entries = archive.entries().unwrap();
        let mut entry = entries.next().unwrap().unwrap();
        assert_eq!(entry.path().unwrap().to_str(), Some(".stagehand-lease"));
        assert_eq!(entry.header().mode().unwrap(), 0o644);
        let mut text = String::new();
        std::io::Read::read_to_string(&mut entry, &mut text).unwrap();
        assert_eq!(text, "7 now\n");
        assert!(entries.next().is_none());
        assert_eq!(
            &guarded(&["p".into()])[3..],
            ["stagehand-guard", LEASE_FILE, "30", "p"]
        );
        let tar = ranks_tar();
        let mut archive = tar::Archive::new(tar.as_slice());
        let entry = archive.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(entry.path().unwrap().to_str(), Some(".stagehand-lease.ranks"));
        assert_eq!(entry.header().mode().unwrap(), 0o666, "any user appends to it");
        assert_eq!(entry.header().size().unwrap(), 0);
    }
}
