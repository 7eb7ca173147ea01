//! Slurm's side of the launch contract: what a task started by `srun` learns from Slurm's
//! environment (its rank, the world, its rank on the node, the job's nodes), and the hostlist
//! syntax Slurm writes node lists in (`node[01-04,07],gpu-a1`). The runtime reads it with
//! `--launcher slurm`; the driver expands the node list it records.

/// A node list that is not Slurm's hostlist syntax.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{list}` is not a Slurm node list ({reason}); expected names such as `node[01-04,07],gpu1`")]
pub struct HostlistError {
    /// The list as given.
    pub list: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Expands a Slurm hostlist (`node[01-03],login`, `rack[1-2]-n[1-2]`) into node names, in
/// Slurm's order; zero padding follows the range's first number, as Slurm writes it.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, HostlistError> {
    let error = |reason: &str| HostlistError {
        list: list.to_string(),
        reason: reason.to_string(),
    };
    let mut nodes = Vec::new();
    for item in split_top_level(list).map_err(|r| error(&r))? {
        if item.is_empty() {
            return Err(error("an empty name"));
        }
        nodes.extend(expand_item(item).map_err(|r| error(&r))?);
    }
    if nodes.is_empty() {
        return Err(error("no nodes"));
    }
    Ok(nodes)
}

/// The items of a list: split at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested brackets".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("a `]` without its `[`".into()),
            ',' if depth == 0 => {
                items.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a `[` without its `]`".into());
    }
    items.push(list[start..].trim());
    Ok(items)
}

/// One item, each bracket group in it expanded (several groups multiply out).
fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else {
        return Ok(vec![item.to_string()]);
    };
    let close = open + item[open..].find(']').expect("brackets are balanced");
    let (prefix, inner, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let tails = expand_item(rest)?;
    let mut out = Vec::new();
    for part in inner.split(',') {
        for middle in expand_range(part.trim())? {
            out.extend(tails.iter().map(|tail| format!("{prefix}{middle}{tail}")));
        }
    }
    Ok(out)
}

/// `07` or `01-04`, zero-padded to the first number's width.
fn expand_range(part: &str) -> Result<Vec<String>, String> {
    let number = |s: &str| {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("`{s}` in brackets is not a number"));
        }
        s.parse::<u64>().map_err(|_| format!("`{s}` is too large"))
    };
    let (first, last) = match part.split_once('-') {
        Some((a, b)) => (a, Some(b)),
        None => (part, None),
    };
    let width = first.len();
    let start = number(first)?;
    let end = match last {
        Some(b) => number(b)?,
        None => start,
    };
    if end < start {
        return Err(format!("the range `{part}` runs backwards"));
    }
    if end - start >= 1 << 20 {
        return Err(format!("the range `{part}` is too long"));
    }
    Ok((start..=end).map(|n| format!("{n:0width$}")).collect())
}

/// What a task of a Slurm job step knows about its place in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmTask {
    /// The job's id (`SLURM_JOB_ID`).
    pub job_id: u64,
    /// This task's rank in the step (`SLURM_PROCID`).
    pub rank: usize,
    /// Tasks in the step (`SLURM_NTASKS`).
    pub world_size: usize,
    /// This task's rank among the step's tasks on its node (`SLURM_LOCALID`).
    pub local_rank: usize,
    /// The step's nodes in order (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`); task 0
    /// runs on the first with srun's default block distribution.
    pub nodes: Vec<String>,
}

/// A task's environment that does not say what [`SlurmTask`] needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlurmEnvError {
    #[error("{0} is not set: this process was not started by srun (run it as `srun ... runtime --launcher slurm`)")]
    Missing(&'static str),
    #[error("{name} is `{value}`, not a number")]
    NotANumber { name: &'static str, value: String },
    #[error(transparent)]
    Hostlist(#[from] HostlistError),
    #[error("SLURM_PROCID {rank} is not below SLURM_NTASKS {world_size}")]
    RankOutOfRange { rank: usize, world_size: usize },
}

impl SlurmTask {
    /// Reads the task's place from an environment (`std::env::var` in a task).
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<SlurmTask, SlurmEnvError> {
        let get = |name: &'static str| var(name).ok_or(SlurmEnvError::Missing(name));
        let number = |name: &'static str| {
            let value = get(name)?;
            value
                .trim()
                .parse::<u64>()
                .map_err(|_| SlurmEnvError::NotANumber { name, value })
        };
        let nodes = match var("SLURM_STEP_NODELIST") {
            Some(list) => list,
            None => get("SLURM_JOB_NODELIST")?,
        };
        let task = SlurmTask {
            job_id: number("SLURM_JOB_ID")?,
            rank: number("SLURM_PROCID")? as usize,
            world_size: number("SLURM_NTASKS")? as usize,
            local_rank: number("SLURM_LOCALID")? as usize,
            nodes: expand_hostlist(&nodes)?,
        };
        if task.rank >= task.world_size {
            return Err(SlurmEnvError::RankOutOfRange {
                rank: task.rank,
                world_size: task.world_size,
            });
        }
        Ok(task)
    }

    /// Where rank 0 listens: the step's first node.
    pub fn master_addr(&self) -> &str {
        &self.nodes[0]
    }

    /// The rendezvous port when none is given: derived from the job id, so every task of the
    /// job agrees without talking, and two jobs on one node rarely collide (10000-29999, above
    /// the well-known ports and below Linux's ephemeral range).
    pub fn default_master_port(&self) -> u16 {
        10_000 + (self.job_id % 20_000) as u16
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn expand(list: &str) -> Vec<String> {
        expand_hostlist(list).unwrap()
    }

    #[test]
    fn hostlists_expand_as_slurm_writes_them() {
        assert_eq!(expand("vm"), ["vm"]);
        assert_eq!(expand("node[01-03,07]"), ["node01", "node02", "node03", "node07"]);
        assert_eq!(expand("a[9-11],login"), ["a9", "a10", "a11", "login"]);
        assert_eq!(expand("r[1-2]-n[1-2]"), ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]);
        assert_eq!(
            expand("gpu-[008-010].cluster"),
            ["gpu-008.cluster", "gpu-009.cluster", "gpu-010.cluster"]
        );
    }

    #[test]
    fn malformed_hostlists_say_what_is_wrong() {
        for (list, says) in [
            ("node[1-3", "without its `]`"),
            ("node1-3]", "without its `[`"),
            ("node[3-1]", "runs backwards"),
            ("node[a-b]", "not a number"),
            ("a,,b", "empty name"),
            ("n[[1]]", "nested"),
        ] {
            let e = expand_hostlist(list).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(list), "{list}: {e}");
        }
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn a_task_reads_its_place_and_the_first_node_of_its_step() {
        let task = SlurmTask::from_env(env(&[
            ("SLURM_JOB_ID", "12345"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "n[1-9]"),
            ("SLURM_STEP_NODELIST", "n[4-5]"),
        ]))
        .unwrap();
        assert_eq!((task.rank, task.world_size, task.local_rank), (3, 4, 1));
        assert_eq!(task.master_addr(), "n4");
        assert_eq!(task.default_master_port(), 22345);
        let other = SlurmTask {
            job_id: 40_001,
            ..task
        };
        assert_eq!(other.default_master_port(), 10_001);
    }

    #[test]
    fn outside_srun_the_error_says_how_to_start_it() {
        let e = SlurmTask::from_env(env(&[])).unwrap_err().to_string();
        assert!(e.contains("not started by srun"), "{e}");
        let e = SlurmTask::from_env(env(&[
            ("SLURM_JOB_ID", "1"),
            ("SLURM_PROCID", "x"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "vm"),
        ]))
        .unwrap_err();
        assert_eq!(
            e,
            SlurmEnvError::NotANumber {
                name: "SLURM_PROCID",
                value: "x".into()
            }
        );
    }
}
