//! A rank's argument vector and environment: the runtime's flags from the experiment file, or the
//! user's `command:`, with the torchrun-style rank environment. Vectors only, never shell text.

use std::collections::BTreeMap;
use std::path::Path;

use crate::config::{Device, ExperimentFile, Resume};
use crate::options::Backend;

use super::HostSpec;

/// What every rank's command is built from.
pub(super) struct ArgsContext<'a> {
    pub file: &'a ExperimentFile,
    pub base: &'a Path,
    pub runtime: &'a Path,
    pub stage_config: Option<&'a Path>,
    pub device: Device,
    pub backend: Backend,
    pub world_size: usize,
    pub master_addr: &'a str,
    pub master_port: u16,
    /// Whether the user chose the master port (the Slurm backend passes only a chosen one: its
    /// ranks derive theirs from the job id).
    pub master_port_given: bool,
    /// Microbatches per minibatch: the file's, or the planned ones with `config_file: auto`.
    pub microbatches: Option<u32>,
    /// The folder each rank writes its profiler trace into (`profiler_trace: true`).
    pub trace_dir: Option<&'a Path>,
}

/// The runtime's flag for a profiler trace, whose value [`super::Experiment::keep_traces_in`]
/// points into the record.
pub(super) const PROFILER_TRACE_FLAG: &str = "--profiler-trace";

/// The argument vector and environment of one rank.
pub(super) fn rank_command(
    ctx: &ArgsContext,
    rank: usize,
    local_rank: usize,
    host: &HostSpec,
    gpus: &[u32],
) -> (Vec<String>, BTreeMap<String, String>) {
    let mut env: BTreeMap<String, String> = ctx.file.env.clone();
    // CUDA numbers GPUs fastest first by default: on a server of mixed GPUs, not as nvidia-smi,
    // the engine and `machines` number them. PCI bus order is theirs.
    env.entry("CUDA_DEVICE_ORDER".into())
        .or_insert_with(|| "PCI_BUS_ID".into());
    if ctx.backend == Backend::Slurm {
        return (slurm_command(ctx, host), env);
    }
    env.insert("RANK".into(), rank.to_string());
    env.insert("WORLD_SIZE".into(), ctx.world_size.to_string());
    env.insert("LOCAL_RANK".into(), local_rank.to_string());
    env.insert("LOCAL_WORLD_SIZE".into(), host.ranks.len().to_string());
    env.insert("MASTER_ADDR".into(), ctx.master_addr.to_string());
    env.insert("MASTER_PORT".into(), ctx.master_port.to_string());
    // A process rank sees what a container would: its host's GPUs of the experiment, from 0 in
    // index order, whatever the driver's own shell exported (which would renumber them).
    if ctx.backend == Backend::Process && !host.gpus.is_empty() {
        let list: Vec<String> = host.gpus.iter().map(u32::to_string).collect();
        env.insert(super::VISIBLE_DEVICES.into(), list.join(","));
    }

    if let Some(command) = &ctx.file.command {
        return (command.clone(), env);
    }

    (runtime_command(ctx, rank, local_rank, host, gpus), env)
}

/// The one command every task of a Slurm job step runs: each rank reads its place from Slurm's
/// environment (`--launcher slurm`), so the argument vector is the same for all, with every
/// rank's slowdown (each rank applies its own).
fn slurm_command(ctx: &ArgsContext, host: &HostSpec) -> Vec<String> {
    let mut argv = runtime_command(ctx, 0, 0, host, &[]);
    for rank in 1..ctx.world_size {
        if let Some(factor) = slowdown_of(ctx.file, rank, &host.name) {
            argv.push("--slowdown".into());
            argv.push(format!("{rank}={factor}"));
        }
    }
    argv
}

/// The runtime's argument vector for one rank.
fn runtime_command(
    ctx: &ArgsContext,
    rank: usize,
    local_rank: usize,
    host: &HostSpec,
    gpus: &[u32],
) -> Vec<String> {
    let f = ctx.file;
    let mut argv = vec![ctx.runtime.display().to_string()];
    model_flags(ctx, &mut argv);
    let mut flag = |name: &str, value: String| push_flag(&mut argv, name, value);
    if let Some(b) = f.batch_size {
        flag("batch-size", b.to_string());
    }
    if let Some(i) = f.iterations {
        flag("iterations", i.to_string());
    }
    if let Some(e) = f.epochs {
        flag("epochs", e.to_string());
    }
    if let Some(n) = f.epoch_samples {
        flag("epoch-samples", n.to_string());
    }
    if let Some(lr) = f.learning_rate {
        flag("lr", lr.to_string());
    }
    if let Some(p) = f.learning_rate_policy {
        flag("lr-policy", p.as_arg().to_string());
    }
    if let Some(w) = f.lr_warmup_epochs {
        flag("lr-warmup-epochs", w.to_string());
    }
    if let Some(o) = f.optimizer {
        flag("optimizer", o.as_arg().to_string());
    }
    if let Some(s) = f.seed {
        flag("seed", s.to_string());
    }
    if let Some(w) = f.weight_decay {
        flag("weight-decay", w.to_string());
    }
    if let Some(m) = f.momentum {
        flag("momentum", m.to_string());
    }
    if let Some(t) = f.comm_timeout {
        flag("comm-timeout", t.to_string());
    }
    if let Some(d) = data_arg(ctx) {
        flag("data", d);
    }
    if let Some(a) = f.augment {
        flag("augment", a.as_arg().to_string());
    }
    if let Some(n) = f.data_workers {
        flag("data-workers", n.to_string());
    }
    let (name, value) = device_flag(ctx, host, gpus);
    flag(name, value);
    if let Some(t) = f.threads {
        flag("threads", t.to_string());
    }
    if let Some(p) = f.precision {
        flag("precision", p.as_arg().to_string());
    }
    if let Some(scale) = f.fp16_init_scale {
        flag("fp16-init-scale", scale.to_string());
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
    if let Some(m) = ctx.microbatches {
        flag("microbatches", m.to_string());
    }
    if let Some(b) = f.distributed_backend {
        flag("backend", b.as_arg().to_string());
    }
    if ctx.backend == Backend::Slurm {
        flag("launcher", "slurm".into());
        flag("world-size", ctx.world_size.to_string());
        if ctx.master_port_given {
            flag("master-port", ctx.master_port.to_string());
        }
    } else if distributed {
        flag("rank", rank.to_string());
        flag("world-size", ctx.world_size.to_string());
        flag("master-addr", ctx.master_addr.to_string());
        flag("master-port", ctx.master_port.to_string());
        flag("local-rank", local_rank.to_string());
    }
    if let Some(dir) = super::checkpoint_dir(f, ctx.base) {
        flag("checkpoint-dir", dir.display().to_string());
    }
    if let Some(weights) = super::init_from(f, ctx.base) {
        flag("init-from", weights.display().to_string());
    }
    if let Some(n) = f.checkpoint_every {
        flag("checkpoint-every", n.to_string());
    }
    if let Some(n) = f.validate_every {
        flag("validate-every", n.to_string());
    }
    if let Some(n) = f.validation_batches {
        flag("validation-batches", n.to_string());
    }
    if let Some(flag) = f.resume.and_then(Resume::as_flag) {
        argv.push(flag.into());
    }
    if f.compress_activations == Some(true) {
        argv.push("--compress-activations".into());
    }
    if f.channels_last == Some(true) {
        argv.push("--channels-last".into());
    }
    if f.cuda_graph == Some(true) {
        argv.push("--cuda-graph".into());
    }
    if f.deterministic == Some(true) {
        argv.push("--deterministic".into());
    }
    if f.cudnn_benchmark == Some(true) {
        argv.push("--cudnn-benchmark".into());
    }
    if f.fused_kernels == Some(true) {
        argv.push("--fused-kernels".into());
    }
    if f.nesterov == Some(true) {
        argv.push("--nesterov".into());
    }
    if let Some(dir) = ctx.trace_dir {
        argv.push(PROFILER_TRACE_FLAG.into());
        argv.push(super::trace_template(dir));
        if let Some(steps) = ctx.file.profiler_steps {
            argv.push("--profiler-steps".into());
            argv.push(steps.to_string());
        }
    }
    if let Some(h) = f.host_memory {
        argv.push("--host-memory".into());
        argv.push(h.as_arg().to_string());
    }
    if let Some(mb) = f.bucket_mb {
        argv.push("--bucket-mb".into());
        argv.push(f64::from(mb).to_string());
    }
    if let Some(o) = f.overlap_reduce {
        argv.push("--overlap-reduce".into());
        argv.push(o.as_arg().to_string());
    }
    if let Some(c) = f.compress {
        argv.push("--compress".into());
        argv.push(c.as_arg().to_string());
    }
    if let Some(reduce) = f.reduce {
        argv.push("--reduce".into());
        argv.push(reduce.into());
    }
    if let Some(every) = f.sync_every {
        argv.push("--sync-every".into());
        argv.push(every.to_string());
    }
    if let Some(factor) = slowdown_of(f, rank, &host.name) {
        argv.push("--slowdown".into());
        argv.push(format!("{rank}={factor}"));
    }
    argv
}

/// The factor `slowdown:` gives `rank` on `host`: its own entry's, else its machine's.
pub(super) fn slowdown_of(file: &ExperimentFile, rank: usize, host: &str) -> Option<f64> {
    let own = file.slowdown.iter().find(|s| s.rank == Some(rank));
    let machine = || file.slowdown.iter().find(|s| s.host.as_deref() == Some(host));
    own.or_else(machine).map(|s| s.factor)
}

/// The experiment key a runtime flag of [`runtime_command`] comes from, for a refusal that names
/// the flag: the flag's name with `_` for `-`, but for the few spelled otherwise.
pub fn key_of_flag(flag: &str) -> String {
    let renamed = [
        ("lr", "learning_rate"),
        ("lr-policy", "learning_rate_policy"),
        ("stage-config", "config_file"),
        ("backend", "distributed_backend"),
        ("data", "data_dir"),
        ("model", "module"),
    ];
    match renamed.iter().find(|(f, _)| *f == flag) {
        Some((_, key)) => key.to_string(),
        None => flag.replace('-', "_"),
    }
}

/// Appends `--name value`, or `--name=value` where the value starts with `-` (a negative number,
/// a path such as `-data`), which a parser would otherwise take for a flag of its own.
fn push_flag(argv: &mut Vec<String>, name: &str, value: String) {
    match value.starts_with('-') {
        true => argv.push(format!("--{name}={value}")),
        false => argv.extend([format!("--{name}"), value]),
    }
}

/// The value `argv` gives flag `flag` (`--layers`), in either form [`push_flag`] writes.
pub fn flag_value<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    let spaced = argv.iter().position(|a| a == flag).and_then(|i| argv.get(i + 1));
    spaced
        .map(String::as_str)
        .or_else(|| argv.iter().find_map(|a| a.strip_prefix(flag)?.strip_prefix('=')))
}

/// The model's flags, the same for training and for profiling so both build one model.
fn model_flags(ctx: &ArgsContext, argv: &mut Vec<String>) {
    let f = ctx.file;
    let mut flag = |name: &str, value: Option<String>| {
        if let Some(value) = value {
            push_flag(argv, name, value);
        }
    };
    flag("model", super::runtime_model(f));
    flag("num-classes", f.num_classes.map(|v| v.to_string()));
    flag("image-size", f.image_size.map(|v| v.to_string()));
    flag("layers", f.layers.map(|v| v.to_string()));
    flag("hidden", f.hidden.map(|v| v.to_string()));
    flag("active-units", f.active_units.map(|v| v.to_string()));
    flag("heads", f.heads.map(|v| v.to_string()));
    flag("seq-len", f.seq_len.map(|v| v.to_string()));
    flag("vocab-size", f.vocab_size.map(|v| v.to_string()));
    flag("dropout", f.dropout.map(|v| v.to_string()));
}

/// The `--data` value: `synthetic`, or the folder made absolute (the same path on every host,
/// where it is mounted) with the format prefix it was given.
fn data_arg(ctx: &ArgsContext) -> Option<String> {
    let d = ctx.file.data_dir.as_ref()?;
    Some(match super::data_folder(d, ctx.base) {
        Some((prefix, folder)) => format!("{prefix}{}", folder.display()),
        None => d.clone(),
    })
}

/// The command that profiles the experiment's model on rank 0's machine and device, at the
/// microbatch size, printing the profile JSON on stdout.
pub(super) fn profile_command(
    ctx: &ArgsContext,
    host: &HostSpec,
    gpus: &[u32],
    micro_batch_size: u32,
    repeats: Option<u32>,
) -> Vec<String> {
    let mut argv = vec![ctx.runtime.display().to_string(), "profile".to_string()];
    model_flags(ctx, &mut argv);
    let mut flag = |name: &str, value: String| push_flag(&mut argv, name, value);
    flag("batch-size", micro_batch_size.to_string());
    flag("device", device_arg(ctx, host, gpus));
    if let Some(d) = data_arg(ctx) {
        flag("data", d);
    }
    if let Some(t) = ctx.file.threads {
        flag("threads", t.to_string());
    }
    if let Some(r) = repeats {
        flag("repeats", r.to_string());
    }
    // The arithmetic the ranks will compute in: a bf16 activation is half a float32 one's bytes,
    // and its kernels take their own time.
    if let Some(p) = ctx.file.precision {
        flag("precision", p.as_arg().to_string());
    }
    if let Some(h) = ctx.file.host_memory {
        flag("host-memory", h.as_arg().to_string());
    }
    if ctx.file.channels_last == Some(true) {
        argv.push("--channels-last".into());
    }
    argv
}

/// The `--device` value as the rank sees its GPUs: a container given one GPU sees it as `cuda:0`.
pub(super) fn device_arg(ctx: &ArgsContext, host: &HostSpec, gpus: &[u32]) -> String {
    // Slurm shows each task its GPUs; the runtime picks among them by its rank on the node.
    if ctx.backend == Backend::Slurm {
        return match ctx.device {
            Device::Cuda => "cuda".to_string(),
            Device::Cpu => "cpu".to_string(),
        };
    }
    let Some(&gpu) = gpus.first() else {
        return "cpu".to_string();
    };
    if ctx.device == Device::Cpu {
        return "cpu".to_string();
    }
    format!("cuda:{}", visible_index(ctx, host, gpu))
}

/// How the rank's process sees `gpu` (one of its GPUs): a container, one per rank or one per
/// host, is given every GPU the experiment has on its host and sees them in the host's order; a
/// process is shown the same through `CUDA_VISIBLE_DEVICES`.
fn visible_index(ctx: &ArgsContext, host: &HostSpec, gpu: u32) -> usize {
    match ctx.backend {
        Backend::Slurm => gpu as usize,
        Backend::Process | Backend::Docker => host
            .gpus
            .iter()
            .position(|g| *g == gpu)
            .expect("rank's GPU is among its host's"),
    }
}

/// `--device D`, or `--devices D0,D1,...` for a rank whose stage spans several GPUs (its machine
/// entry's GPUs in groups of `gpus_per_rank`, or Slurm's `gpus_per_task`, each task seeing its
/// own from 0).
fn device_flag(ctx: &ArgsContext, host: &HostSpec, gpus: &[u32]) -> (&'static str, String) {
    if ctx.device == Device::Cuda {
        let list: Vec<String> = match ctx.backend {
            Backend::Slurm => {
                let per_task = ctx.file.slurm.as_ref().and_then(|s| s.gpus_per_task).unwrap_or(1);
                (0..per_task).map(|i| format!("cuda:{i}")).collect()
            }
            Backend::Process | Backend::Docker => gpus
                .iter()
                .map(|&g| format!("cuda:{}", visible_index(ctx, host, g)))
                .collect(),
        };
        if list.len() > 1 {
            return ("devices", list.join(","));
        }
    }
    ("device", device_arg(ctx, host, gpus))
}
