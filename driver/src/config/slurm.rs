//! The `slurm:` section: what `backend: slurm` asks Slurm for. Every value becomes one argument of
//! `srun` (`--partition=debug`), never shell text; Slurm itself judges the request at preflight
//! (`srun --test-only`).

use serde::{Deserialize, Serialize};

/// The job's resources and limits, as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmSettings {
    /// The partition (`--partition`); Slurm's default partition when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    /// Nodes (`--nodes`).
    #[serde(default = "one")]
    pub nodes: u32,
    /// Ranks on each node (`--ntasks-per-node`); the world is nodes x tasks_per_node ranks.
    #[serde(default = "one")]
    pub tasks_per_node: u32,
    /// GPUs bound to each rank (`--gpus-per-task`): each rank sees only its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_per_task: Option<u32>,
    /// Generic resources per node (`--gres`, such as `gpu:4`): the node's ranks share them, each
    /// taking the GPU its rank on the node picks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gres: Option<String>,
    /// CPUs for each rank (`--cpus-per-task`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus_per_task: Option<u32>,
    /// The job's time limit in Slurm's format (`--time`: `30`, `1:30:00`, `2-00:00:00`); at the
    /// limit Slurm sends the ranks SIGTERM (a checkpoint with `checkpoint_dir`) and ends the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit: Option<String>,
    /// The account charged (`--account`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// Seconds the job may wait in the queue before the driver cancels it (default: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timeout_s: Option<u64>,
    /// More srun options, one argument each (`--constraint=a100`, `--exclusive`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

fn one() -> u32 {
    1
}

impl Default for SlurmSettings {
    fn default() -> SlurmSettings {
        SlurmSettings {
            partition: None,
            nodes: 1,
            tasks_per_node: 1,
            gpus_per_task: None,
            gres: None,
            cpus_per_task: None,
            time_limit: None,
            account: None,
            start_timeout_s: None,
            options: Vec::new(),
        }
    }
}

/// Options the driver sets itself, which `options:` may not repeat.
const DRIVER_OPTIONS: [&str; 10] = [
    "--job-name",
    "-J",
    "--nodes",
    "-N",
    "--ntasks",
    "-n",
    "--ntasks-per-node",
    "--label",
    "--kill-on-bad-exit",
    "-K",
];

/// srun's GPU requests, which have keys of their own: given in `options:`, the ranks would hold
/// GPUs the driver does not know of and train on the CPU.
const GPU_OPTIONS: [&str; 6] = [
    "--gpus",
    "-G",
    "--gpus-per-node",
    "--gpus-per-socket",
    "--gpus-per-task",
    "--gres",
];

impl SlurmSettings {
    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.nodes as usize * self.tasks_per_node as usize
    }

    /// Whether the ranks get GPUs.
    pub fn has_gpus(&self) -> bool {
        self.gpus_per_task.is_some_and(|g| g > 0)
            || self
                .gres
                .as_deref()
                .is_some_and(|g| g.split(',').any(|r| r.trim().starts_with("gpu")))
    }

    /// What is wrong with the settings, as `(key, message)`.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.nodes == 0 {
            return Err(("slurm", "slurm.nodes must be at least 1".into()));
        }
        if self.tasks_per_node == 0 {
            return Err(("slurm", "slurm.tasks_per_node must be at least 1".into()));
        }
        let text_values = [
            ("partition", &self.partition),
            ("gres", &self.gres),
            ("time_limit", &self.time_limit),
            ("account", &self.account),
        ];
        for (key, value) in text_values {
            if let Some(v) = value
                .as_deref()
                .filter(|v| v.trim().is_empty() || v.starts_with('-'))
            {
                return Err((
                    "slurm",
                    format!("slurm.{key} `{v}` is not a value; give the {key} itself, or leave it out"),
                ));
            }
        }
        for option in &self.options {
            if !option.starts_with('-') {
                return Err((
                    "slurm",
                    format!(
                        "slurm.options entry `{option}` is not an srun option; write each as one \
                         argument, such as `--constraint=a100`"
                    ),
                ));
            }
            let name = option.split('=').next().unwrap_or(option);
            if GPU_OPTIONS.contains(&name) || (option.starts_with("-G") && !option.starts_with("--")) {
                return Err((
                    "slurm",
                    format!(
                        "slurm.options asks for GPUs with `{option}`; use slurm.gpus_per_task (or \
                         slurm.gres) instead, so the ranks are started on their GPUs"
                    ),
                ));
            }
            if DRIVER_OPTIONS.contains(&name) {
                return Err((
                    "slurm",
                    format!(
                        "slurm.options sets `{name}`, which the driver sets itself; use slurm.nodes \
                         and slurm.tasks_per_node for the job's shape"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// srun's options for this request, one argument each.
    pub fn srun_options(&self) -> Vec<String> {
        let mut args = vec![
            format!("--nodes={}", self.nodes),
            format!("--ntasks-per-node={}", self.tasks_per_node),
            format!("--ntasks={}", self.world_size()),
        ];
        let mut opt = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                args.push(format!("--{name}={v}"));
            }
        };
        opt("partition", self.partition.clone());
        opt("account", self.account.clone());
        opt("time", self.time_limit.clone());
        opt("gpus-per-task", self.gpus_per_task.map(|g| g.to_string()));
        opt("gres", self.gres.clone());
        opt("cpus-per-task", self.cpus_per_task.map(|c| c.to_string()));
        args.extend(self.options.iter().cloned());
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setting_is_one_srun_argument() {
        let s = SlurmSettings {
            partition: Some("gpu; rm -rf /".into()),
            nodes: 2,
            tasks_per_node: 4,
            gpus_per_task: Some(1),
            time_limit: Some("1:00:00".into()),
            options: vec!["--constraint=a100".into()],
            ..SlurmSettings::default()
        };
        assert_eq!(
            s.srun_options(),
            [
                "--nodes=2",
                "--ntasks-per-node=4",
                "--ntasks=8",
                "--partition=gpu; rm -rf /",
                "--time=1:00:00",
                "--gpus-per-task=1",
                "--constraint=a100"
            ]
        );
        assert!(s.has_gpus());
        assert_eq!(s.world_size(), 8);
    }

    #[test]
    fn settings_that_srun_would_misread_are_refused() {
        let bad = [
            SlurmSettings {
                nodes: 0,
                ..SlurmSettings::default()
            },
            SlurmSettings {
                partition: Some("--exclusive".into()),
                ..SlurmSettings::default()
            },
            SlurmSettings {
                options: vec!["exclusive".into()],
                ..SlurmSettings::default()
            },
            SlurmSettings {
                options: vec!["--ntasks=3".into()],
                ..SlurmSettings::default()
            },
        ];
        let said: Vec<String> = bad.iter().map(|s| s.check().unwrap_err().1).collect();
        assert!(said[0].contains("nodes must be at least 1"), "{said:?}");
        assert!(said[1].contains("`--exclusive` is not a value"), "{said:?}");
        assert!(said[2].contains("not an srun option"), "{said:?}");
        assert!(said[3].contains("which the driver sets itself"), "{said:?}");
        assert!(SlurmSettings::default().check().is_ok());
        let gres = SlurmSettings {
            gres: Some("gpu:4".into()),
            ..SlurmSettings::default()
        };
        assert!(gres.has_gpus() && !SlurmSettings::default().has_gpus());
        for option in ["--gpus-per-node=4", "--gpus=8", "-G", "-G2", "--gres=gpu:4"] {
            let s = SlurmSettings {
                options: vec![option.into()],
                ..SlurmSettings::default()
            };
            let said = s.check().unwrap_err().1;
            assert!(
                said.contains(&format!("`{option}`")) && said.contains("slurm.gpus_per_task"),
                "{option}: {said}"
            );
        }
        let fine = SlurmSettings {
            options: vec!["--constraint=a100".into(), "--gpu-bind=closest".into()],
            ..SlurmSettings::default()
        };
        assert!(fine.check().is_ok());
    }
}
