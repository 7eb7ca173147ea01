//! Whether the kernel killed a rank for lack of memory where no engine says so: for ranks that are
//! plain processes, the count of such kills in the driver's memory cgroup, which its ranks
//! inherit; for ranks exec'd into a per-host container, which runs on, the container's own count,
//! read inside it. cgroup v2 keeps it in `memory.events`, v1 in `memory.oom_control`, both as
//! `oom_kill N`; the kernel counts a kill there whichever limit ran out (the cgroup's or the
//! machine's).

use std::path::{Path, PathBuf};

/// The exit code of a process SIGKILL ended (the OOM killer's signal), as shells give it.
pub const SIGKILLED: i64 = 128 + 9;

/// A POSIX sh script that prints the kill count of the memory cgroup its shell sees at the cgroup
/// mount, a container's own in a container (cgroup v2's `memory.events`, v1's
/// `memory/memory.oom_control`), with the shell's builtins alone; exits 1 where neither is.
/// Constant text: run as `sh -c SCRIPT`.
pub const COUNT_SCRIPT: &str = r#"for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
    [ -r "$f" ] || continue
    while read -r key value; do
        [ "$key" = oom_kill ] && echo "$value"
    done <"$f"
    exit 0
done
exit 1
"#;

/// Where the kill count of the memory cgroup described by `proc_cgroup` (a `/proc/PID/cgroup`)
/// is, under the cgroup file system mounted at `root`: v1's memory hierarchy when there is one,
/// else the unified (v2) one.
pub fn counter_path(proc_cgroup: &str, root: &Path) -> Option<PathBuf> {
    let mut unified = None;
    for line in proc_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let relative = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            return Some(root.join("memory").join(relative).join("memory.oom_control"));
        }
        if controllers.is_empty() {
            unified = Some(root.join(relative).join("memory.events"));
        }
    }
    unified
}

/// The `oom_kill` count in a `memory.events` or `memory.oom_control` file's text.
pub fn parse_kills(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

/// Processes the kernel has killed for lack of memory in this process's memory cgroup; `None`
/// where that cannot be read (no such file, no permission, another layout).
pub fn kills() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = counter_path(&cgroup, Path::new("/sys/fs/cgroup"))?;
    parse_kills(&std::fs::read_to_string(path).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counter_is_found_on_either_cgroup_version_and_read() {
        let root = Path::new("/sys/fs/cgroup");
        let v1 = "9:name=systemd:/\n4:memory:/process_api/4966de\n3:cpuset:/\n0::/\n";
        assert_eq!(
            counter_path(v1, root).unwrap(),
            Path::new("/sys/fs/cgroup/memory/process_api/4966de/memory.oom_control")
        );
        // Controllers mounted together.
        let joined = "5:cpu,memory:/slurm/job1\n";
        assert_eq!(
            counter_path(joined, root).unwrap(),
            Path::new("/sys/fs/cgroup/memory/slurm/job1/memory.oom_control")
        );
        let v2 = "0::/user.slice/user-0.slice/session-3.scope\n";
        assert_eq!(
            counter_path(v2, root).unwrap(),
            Path::new("/sys/fs/cgroup/user.slice/user-0.slice/session-3.scope/memory.events")
        );
        assert_eq!(counter_path("", root), None);

        let events = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_kills(events), Some(2));
        let control = "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n";
        assert_eq!(parse_kills(control), Some(7));
        assert_eq!(parse_kills("oom_kill_disable 0\nunder_oom 0\n"), None);
    }
}
