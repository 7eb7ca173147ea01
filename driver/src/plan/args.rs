//! A rank's argument vector and environment: the runtime's flags from the experiment file, or the
//! user's `command:`, with the torchrun-style rank environment. Vectors only, never shell text.

use std::collections::BTreeMap;
use std::path::Path;

use crate::cli::{Backend, ContainerMode};
use crate::config::{Device, ExperimentFile};

use super::HostPlan;

/// What every rank's command is built from.
pub(super) struct ArgsContext<'a> {
    pub file: &'a ExperimentFile,
    pub base: &'a Path,
    pub runtime: &'a Path,
    pub stage_config: Option<&'a Path>,
    pub device: Device,
    pub backend: Backend,
    pub container_mode: ContainerMode,
    pub world_size: usize,
    pub master_addr: &'a str,
    pub master_port: u16,
}

/// The argument vector and environment of one rank.
pub(super) fn rank_command(
    ctx: &ArgsContext,
    rank: usize,
    local_rank: usize,
    host: &HostPlan,
    gpus: &[u32],
) -> (Vec<String>, BTreeMap<String, String>) {
    let mut env: BTreeMap<String, String> = ctx.file.env.clone();
    env.insert("RANK".into(), rank.to_string());
    env.insert("WORLD_SIZE".into(), ctx.world_size.to_string());
    env.insert("LOCAL_RANK".into(), local_rank.to_string());
    env.insert("LOCAL_WORLD_SIZE".into(), host.ranks.len().to_string());
    env.insert("MASTER_ADDR".into(), ctx.master_addr.to_string());
    env.insert("MASTER_PORT".into(), ctx.master_port.to_string());

    if let Some(command) = &ctx.file.command {
        return (command.clone(), env);
    }

    let f = ctx.file;
    let mut argv = vec![ctx.runtime.display().to_string()];
    let mut flag = |name: &str, value: String| {
        argv.push(format!("--{name}"));
        argv.push(value);
    };
    if let Some(m) = &f.module {
        flag("model", m.clone());
    }
    if let Some(b) = f.batch_size {
        flag("batch-size", b.to_string());
    }
    if let Some(i) = f.iterations {
        flag("iterations", i.to_string());
    }
    if let Some(lr) = f.learning_rate {
        flag("lr", lr.to_string());
    }
    if let Some(o) = f.optimizer {
        flag("optimizer", o.as_arg().to_string());
    }
    if let Some(s) = f.seed {
        flag("seed", s.to_string());
    }
    if let Some(d) = &f.data_dir {
        let p = ctx.base.join(d);
        flag(
            "data",
            if p.exists() {
                p.display().to_string()
            } else {
                d.clone()
            },
        );
    }
    flag("device", device_arg(ctx, host, gpus));
    if let Some(t) = f.threads {
        flag("threads", t.to_string());
    }
    // The distributed flags exist only in runtimes that know pipelines; a single rank without a
    // stage config gets none, so it runs on any runtime version.
    let distributed = ctx.world_size > 1 || ctx.stage_config.is_some();
    if let Some(p) = ctx.stage_config {
        flag("stage-config", p.display().to_string());
    }
    if let Some(s) = f.schedule {
        flag("schedule", s.as_arg().to_string());
    }
    if let Some(m) = f.microbatches {
        flag("microbatches", m.to_string());
    }
    if let Some(b) = f.distributed_backend {
        flag("backend", b.as_arg().to_string());
    }
    if distributed {
        flag("rank", rank.to_string());
        flag("world-size", ctx.world_size.to_string());
        flag("master-addr", ctx.master_addr.to_string());
        flag("master-port", ctx.master_port.to_string());
        flag("local-rank", local_rank.to_string());
    }
    (argv, env)
}

/// The `--device` value as the rank sees its GPUs: a container given one GPU sees it as `cuda:0`.
fn device_arg(ctx: &ArgsContext, host: &HostPlan, gpus: &[u32]) -> String {
    let Some(&gpu) = gpus.first() else {
        return "cpu".to_string();
    };
    if ctx.device == Device::Cpu {
        return "cpu".to_string();
    }
    let visible_index = match (ctx.backend, ctx.container_mode) {
        (Backend::Process, _) => gpu as usize,
        (Backend::Docker, ContainerMode::PerRank) => 0,
        (Backend::Docker, ContainerMode::PerHost) => host
            .gpus
            .iter()
            .position(|g| *g == gpu)
            .expect("rank's GPU is among its host's"),
    };
    format!("cuda:{visible_index}")
}
