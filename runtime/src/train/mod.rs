//! Training: resolves the rank's place in the plan, builds its stage, connects to its peers,
//! runs its schedule, and reports each iteration as a metrics event. One process holding the
//! whole model is the same path with a one-stage, one-rank plan and no peers.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use stagehand_contract::{
    Channel, Event, Iteration, PartialGroup, ReduceMetrics, RunConfig, StagePlan, Start, Summary,
    ValidationFigures, SCHEMA_VERSION,
};
use tch::Kind;

use crate::comm::{ProcessGroup, Store};
use crate::config::{
    Backend, CheckpointConfig, DeviceSpec, DistConfig, OptimizerKind, P2pGroups, Precision, ReduceOptions,
    Resume, TrainConfig,
};
use crate::data::{self, BatchRequest, Shard};
use crate::host_memory;
use crate::metrics::{Emitter, Memory, Throughput};
use crate::models::{InputKind, ModelDef};
use crate::pipeline::{
    first_replayed, Bundle, Channels, Checkpointing, Executor, Lanes, Links, OpenSplit, PartialReduce,
    Reducer, Report, Tally, TensorSpec, Validation,
};
use crate::profiler_trace::{self, Finished, ProfilerTrace};
use crate::schedule::{self, RankActions, Schedule};
use crate::stage::checkpoint::{self, Identity, Latest};
use crate::stage::{GradScaler, Optimizer, Stage};

/// The plan of stages: the config's, or every rank on one stage (data parallelism).
fn stage_plan(dist: &DistConfig, num_modules: usize) -> anyhow::Result<StagePlan> {
    match &dist.stage_config {
        Some(config) => config
            .validate(num_modules, dist.world_size)
            .context("--stage-config"),
        None => Ok(StagePlan::data_parallel(num_modules, dist.world_size)),
    }
}

/// This rank's actions from iteration `first` on, a chunk at a time ([`RankActions`]), drained
/// at the end of every [`segment`].
fn rank_actions(
    plan: &StagePlan,
    config: &TrainConfig,
    microbatches: usize,
    first: u64,
) -> anyhow::Result<RankActions> {
    Ok(RankActions::new(
        plan,
        config.dist.schedule,
        config.dist.rank,
        microbatches,
        (first as usize, config.iterations as usize),
        segment(config).map(|s| s as usize),
        schedule::CHUNK_ITERATIONS,
    )?)
}

/// The iterations between the ends where every rank's pipeline is drained (its chunks end
/// there, and PipeDream's streams): each `--checkpoint-every` and `--validate-every` is one of
/// them. `None`: only the run's end.
fn segment(config: &TrainConfig) -> Option<u64> {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let checkpoint = config.checkpoint.as_ref().and_then(|c| c.every);
    let validation = config.validation.map(|v| v.every);
    match (checkpoint, validation) {
        (Some(c), Some(v)) => Some(gcd(c, v)),
        (c, v) => c.or(v),
    }
}

/// The iterations done of the checkpoint every rank resumes from: the newest one every rank
/// holds (a rank stopped while checkpointing holds the others' latest but one), or 0, every rank
/// starting afresh, when some rank holds none and `afresh` (`--resume=auto`) allows it. A rank
/// whose checkpoints are `damaged` holds none, and refuses every rank, `--resume=auto` or not.
/// Each rank's holdings reach every rank as an all-gather: a sum over a group spanning them all,
/// each rank filling its own slots (iterations + 1, exact in float64 for any count a run reaches,
/// and 1 where it is damaged).
fn agree_on_resume(
    links: &Links,
    mine: Option<&Latest>,
    damaged: Option<&str>,
    afresh: bool,
    device: tch::Device,
) -> anyhow::Result<u64> {
    let everyone = links.everyone();
    let Some(group) = everyone else {
        if let Some(damage) = damaged {
            return Err(Refused::error(anyhow::anyhow!("{damage}")));
        }
        return Ok(mine.map_or(0, |latest| latest.iterations_done));
    };
    const SLOTS: usize = 3;
    let mut slots = vec![0f64; SLOTS * group.size()];
    let own = SLOTS * group.rank();
    for (slot, k) in mine.into_iter().flat_map(Latest::held).take(2).enumerate() {
        slots[own + slot] = k as f64 + 1.0;
    }
    slots[own + 2] = if damaged.is_some() { 1.0 } else { 0.0 };
    let gathered = tch::Tensor::from_slice(&slots).to_device(device);
    group.all_reduce_sum(std::slice::from_ref(&gathered))?.wait()?;
    let gathered: Vec<f64> = Vec::<f64>::try_from(gathered.to_device(tch::Device::Cpu))?;
    let held: Vec<(Vec<u64>, bool)> = gathered
        .chunks(SLOTS)
        .map(|own| {
            let held = own[..2]
                .iter()
                .filter(|&&k| k > 0.0)
                .map(|&k| k as u64 - 1)
                .collect();
            (held, own[2] > 0.0)
        })
        .collect();
    let everyone_holds = |k: &u64| held.iter().all(|(h, _)| h.contains(k));
    let newest = held[group.rank()].0.iter().copied().filter(everyone_holds).max();
    let any_damaged = held.iter().any(|(_, damaged)| *damaged);
    match newest {
        Some(k) => Ok(k),
        None if afresh && !any_damaged => Ok(0),
        None => {
            if let Some(damage) = damaged {
                return Err(Refused::error(anyhow::anyhow!("{damage}")));
            }
            let listed: Vec<String> = held
                .iter()
                .zip(group.ranks())
                .map(|((h, damaged), rank)| match h.as_slice() {
                    [] if *damaged => format!("rank {rank} none whole (its log says what is damaged)"),
                    [] => format!("rank {rank} none"),
                    [k] => format!("rank {rank} {k}"),
                    [k, previous] => format!("rank {rank} {k} and {previous}"),
                    _ => unreachable!("two slots per rank"),
                })
                .collect();
            bail!(
                "--resume: no iteration has a checkpoint on every rank (iterations held: {}); \
                 start afresh without --resume, or restore each rank's checkpoint of one iteration",
                listed.join(", ")
            )
        }
    }
}

/// The minibatches of a validation pass, which only the first stage can count (its ranks hold
/// the data, the others may not): every rank learns the count of the first stage's first rank
/// (`counted`, `None` elsewhere), a sum over a group spanning them all to which only it adds.
fn agree_on_validation_batches(
    links: &Links,
    plan: &StagePlan,
    rank: usize,
    counted: Option<u64>,
    device: tch::Device,
) -> anyhow::Result<u64> {
    let everyone = links.everyone();
    let mine = counted.filter(|_| plan.stages[0].ranks.first() == Some(&rank));
    let Some(group) = everyone else {
        return mine.context("internal error: a single process's validation pass was not counted");
    };
    let sum = tch::Tensor::from_slice(&[mine.unwrap_or(0) as f64]).to_device(device);
    group.all_reduce_sum(std::slice::from_ref(&sum))?.wait()?;
    Ok(sum.to_device(tch::Device::Cpu).double_value(&[0]) as u64)
}

/// The run's end, met by every rank before any of its groups is torn down (a barrier over every
/// rank, which on a GPU blocks until the device has run it). Each rank's last receive comes before
/// its end, so once all are here nothing sent is still on its way. Without it a rank could exit,
/// and tear its groups down, while its last send was still in flight: NCCL hands a send over a
/// network to a proxy thread after the send's kernel ends, and ProcessGroupNCCL's destructor
/// aborts the communicators, which stops it.
fn meet_at_the_end(links: &Links) -> anyhow::Result<()> {
    if let Some(group) = links.everyone() {
        group.barrier().context("the ranks' meeting at the run's end")?;
    }
    Ok(())
}

/// Makes folder `dir` (`flag`'s) and writes and removes a file in it, so that a run that could
/// not write there fails before its first iteration rather than after its last.
fn writable(dir: &std::path::Path, flag: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{flag}: cannot create {}", dir.display()))?;
    let probe = dir.join(format!(".stagehand-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").with_context(|| format!("{flag}: cannot write in {}", dir.display()))?;
    std::fs::remove_file(&probe).with_context(|| format!("{flag}: cannot remove {}", probe.display()))
}

/// Where the ranks resume (`--resume`): the iterations done of the checkpoint every rank
/// agreed on ([`agree_on_resume`], 0 to start afresh) and this rank's checkpoint of them to load,
/// after stepping back to it from a newer `latest` or setting `latest` aside.
fn agree_and_step_back(
    c: &CheckpointConfig,
    links: &Links,
    latest: Option<Latest>,
    damaged: Option<String>,
    identity: &Identity,
    device: tch::Device,
) -> anyhow::Result<(u64, Option<Latest>)> {
    let rank = identity.rank;
    let afresh = c.resume == Resume::IfPresent;
    let first = agree_on_resume(links, latest.as_ref(), damaged.as_deref(), afresh, device)?;
    let resume_from = match latest {
        Some(latest) if latest.iterations_done == first => {
            // Names it as `latest` again, and removes any newer one: a no-op unless the newer one
            // was found damaged and passed over (`checkpoint::whole_or_before`).
            checkpoint::step_back(&c.dir, &latest).map_err(anyhow::Error::msg)?;
            Some(latest)
        }
        None => None,
        Some(latest) if first == 0 => {
            checkpoint::set_aside(&c.dir, rank).map_err(anyhow::Error::msg)?;
            eprintln!(
                "runtime: rank {rank}: another rank holds no checkpoint of this run, so every rank \
                 starts afresh (--resume=auto); this rank's, of iteration {}, is set aside",
                latest.iterations_done,
            );
            None
        }
        Some(latest) => {
            let before = checkpoint::read_held(&c.dir, identity, first).map_err(anyhow::Error::msg)?;
            checkpoint::step_back(&c.dir, &before).map_err(anyhow::Error::msg)?;
            eprintln!(
                "runtime: rank {rank}: resuming from iteration {first}, the newest checkpoint every \
                 rank holds; this rank's of iteration {}, which another rank lacks (not written, or \
                 damaged), is removed",
                latest.iterations_done
            );
            Some(before)
        }
    };
    Ok((first, resume_from))
}

/// Rendezvous with the other ranks: the two point-to-point channels (every rank creates them in
/// the same order), and this stage's replica group; the store too, when a partial reduce needs
/// it after the rendezvous.
fn connect(
    dist: &DistConfig,
    plan: &StagePlan,
    device: DeviceSpec,
    request: &[(&'static str, String)],
) -> anyhow::Result<(Links, Option<Store>)> {
    if dist.world_size == 1 {
        let links = Links {
            channels: None,
            replicas: None,
            bundle: None,
        };
        return Ok((links, None));
    }
    let timeout = dist.comm_timeout;
    let store = Store::connect(
        &dist.master_addr,
        dist.master_port,
        dist.world_size,
        dist.rank == 0,
        timeout,
    )?;
    let store = match &dist.run_id {
        Some(id) => store.for_run(id),
        None => store,
    };
    agree_on_request(&store, dist.rank, dist.world_size, request)?;
    // The world group is the forward channel; the backward channel is a second group over the
    // same ranks, so upstream traffic never queues behind downstream traffic between two ranks.
    let forward = match dist.backend {
        Backend::Gloo => ProcessGroup::gloo(&store, dist.rank, dist.world_size, timeout)?,
        Backend::Nccl => {
            let DeviceSpec::Cuda(index) = device else {
                bail!("--backend nccl needs a CUDA device; use --device cuda or --backend gloo");
            };
            ProcessGroup::nccl(&store, dist.rank, dist.world_size, index, timeout)?
        }
    };
    let lanes = match dist.p2p_groups {
        P2pGroups::World => {
            let everyone: Vec<usize> = (0..dist.world_size).collect();
            let backward = forward
                .subgroup(&store, "channel/backward", &everyone)?
                .expect("every rank is in a group of every rank");
            Lanes::World { backward }
        }
        P2pGroups::Pairs => Lanes::Pairs(pair_groups(&forward, &store, plan, dist.rank)?),
    };
    let mut replicas = None;
    for stage in plan.stages.iter().filter(|s| s.ranks.len() > 1) {
        let mut ranks = stage.ranks.clone();
        ranks.sort_unstable();
        if let Some(group) = forward.subgroup(&store, &format!("stage{}", stage.id), &ranks)? {
            replicas = Some(group);
        }
    }
    let bundle = bundle_groups(&forward, &store, plan, dist.rank)?;
    let links = Links {
        channels: Some(Channels::new(forward, lanes)),
        replicas,
        bundle,
    };
    Ok((links, dist.reduce.partial.map(|_| store)))
}

/// What every rank of a run must be given alike, by name: what decides the messages the ranks
/// exchange and the training they do together. Not the rank's own (`--rank`, devices, threads,
/// data workers, slowdown, timeouts, paths it writes, kernel choices).
fn shared_request(config: &TrainConfig, microbatches: usize) -> Vec<(&'static str, String)> {
    let dist = &config.dist;
    vec![
        ("--model and its sizes", format!("{:?}", config.model)),
        ("--world-size", dist.world_size.to_string()),
        ("--stage-config", format!("{:?}", dist.stage_config)),
        ("--schedule", dist.schedule.to_string()),
        ("--microbatches", microbatches.to_string()),
        ("--batch-size", config.batch_size.to_string()),
        ("--iterations", config.iterations.to_string()),
        ("--lr", config.lr.to_string()),
        ("the learning rate schedule", format!("{:?}", config.lr_schedule)),
        ("--optimizer", format!("{:?}", config.optimizer)),
        ("--seed", config.seed.to_string()),
        ("--data", config.data.to_string()),
        ("--augment", format!("{:?}", config.augment)),
        ("--precision", format!("{:?}", config.precision)),
        ("--fp16-init-scale", config.fp16_init_scale.to_string()),
        ("--channels-last", config.channels_last.to_string()),
        ("--backend", format!("{:?}", dist.backend)),
        ("--p2p-groups", format!("{:?}", dist.p2p_groups)),
        (
            "--bucket-mb, --overlap-reduce and --reduce",
            format!("{:?}", dist.reduce),
        ),
        ("--compress-activations", dist.compress_activations.to_string()),
        ("--compress", dist.sparse.to_string()),
        (
            "--validate-every and --validation-batches",
            format!("{:?}", config.validation),
        ),
        (
            "--checkpoint-dir, --checkpoint-every and --resume",
            format!("{:?}", config.checkpoint.as_ref().map(|c| (c.every, c.resume))),
        ),
    ]
}

/// Every rank posts its [`shared_request`] in the store and reads every rank's: a rank given
/// another (a batch size, a `--compress` the others lack) is refused on every rank alike, naming
/// it and what differs, before any group forms. Otherwise it would train on what the others
/// send without a word, or abort on a message larger than it expected.
fn agree_on_request(
    store: &Store,
    rank: usize,
    world_size: usize,
    request: &[(&'static str, String)],
) -> anyhow::Result<()> {
    let text = |request: &[(&'static str, String)]| {
        request
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    store.set(&format!("request/{rank}"), text(request).as_bytes())?;
    let first = String::from_utf8_lossy(&store.get("request/0")?).into_owned();
    let mut differs = None;
    for other in 1..world_size {
        let theirs = String::from_utf8_lossy(&store.get(&format!("request/{other}"))?).into_owned();
        let pair = first.lines().zip(theirs.lines()).find(|(a, b)| a != b);
        if let Some((ours, theirs)) = pair {
            differs = Some((other, ours.to_string(), theirs.to_string()));
            break;
        }
    }
    let Some((other, ours, theirs)) = differs else {
        return Ok(());
    };
    // Every rank found the same; rank 0, which hosts the store, leaves once all have read.
    store.add("request/read", 1)?;
    if rank == 0 {
        let deadline = std::time::Instant::now() + store.timeout();
        while store.add("request/read", 0)? < world_size as i64 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let (name, ours) = ours.split_once('=').unwrap_or(("the request", &ours));
    let theirs = theirs.split_once('=').map_or(theirs.as_str(), |(_, v)| v);
    Err(Refused::error(anyhow::anyhow!(
        "rank {other} was started with another training request than rank 0: {name} is {theirs} there, \
         {ours} on rank 0; start every rank with the same arguments (only --rank, --local-rank, \
         devices, threads, data workers, --slowdown, timeouts and output paths may differ)"
    )))
}

/// With `--p2p-groups pairs`: this rank's groups with each rank of the stages next to its own, one
/// per direction. Every rank goes through the pairs of the whole plan in one order and joins
/// those it is in: making a group waits for both of its ranks, and in one global order the first
/// pair still missing always has both of them waiting for it, so no two ranks wait on each other.
fn pair_groups(
    world: &ProcessGroup,
    store: &Store,
    plan: &StagePlan,
    rank: usize,
) -> anyhow::Result<HashMap<(Channel, usize), ProcessGroup>> {
    let mut pairs: Vec<(usize, usize)> = plan
        .stages
        .windows(2)
        .flat_map(|w| {
            w[0].ranks
                .iter()
                .flat_map(|&a| w[1].ranks.iter().map(move |&b| (a.min(b), a.max(b))))
        })
        .collect();
    pairs.sort_unstable();
    pairs.dedup();
    let mut groups = HashMap::new();
    for (low, high) in pairs {
        for channel in [Channel::Forward, Channel::Backward] {
            let name = format!("p2p/{channel:?}/{low}-{high}").to_lowercase();
            if let Some(group) = world.subgroup(store, &name, &[low, high])? {
                let peer = if rank == low { high } else { low };
                groups.insert((channel, peer), group);
            }
        }
    }
    Ok(groups)
}

/// With the stage config's `bundles`: this rank's groups for its stage's bundle reduce (every rank
/// calls this, in the same order, so the groups' names agree; only members rendezvous).
fn bundle_groups(
    world: &ProcessGroup,
    store: &Store,
    plan: &StagePlan,
    rank: usize,
) -> anyhow::Result<Option<Bundle>> {
    let mut mine = None;
    for stage in plan.stages.iter().filter(|s| s.ranks.len() > 1) {
        let Some(bundles) = &stage.bundles else { continue };
        let mut local = None;
        for (b, ranks) in bundles.iter().enumerate().filter(|(_, r)| r.len() > 1) {
            if let Some(group) = world.subgroup(store, &format!("stage{}/bundle{b}", stage.id), ranks)? {
                local = Some(group);
            }
        }
        let masters: Vec<usize> = bundles.iter().map(|r| r[0]).collect();
        let masters = match masters.len() > 1 {
            true => world.subgroup(store, &format!("stage{}/masters", stage.id), &masters)?,
            false => None,
        };
        if stage.ranks.contains(&rank) {
            mine = Some(Bundle { local, masters });
        }
    }
    Ok(mine)
}

/// The (stage, rank) of every replica of a replicated stage: the ranks a partial reduce matches.
fn partial_participants(plan: &StagePlan) -> Vec<(usize, usize)> {
    plan.stages
        .iter()
        .filter(|s| s.ranks.len() > 1)
        .flat_map(|s| s.ranks.iter().map(move |&r| (s.id, r)))
        .collect()
}

/// Shapes of one microbatch's input and target at the first stage.
fn first_specs(input: InputKind, micro_size: i64) -> (TensorSpec, TensorSpec) {
    match input {
        InputKind::Image { size, .. } => (
            TensorSpec::dense(vec![micro_size, 3, size, size], Kind::Float),
            TensorSpec::dense(vec![micro_size], Kind::Int64),
        ),
        InputKind::Tokens { seq_len, .. } => (
            TensorSpec::dense(vec![micro_size, seq_len], Kind::Int64),
            TensorSpec::dense(vec![micro_size, seq_len], Kind::Int64),
        ),
    }
}

/// What [`check_plan`] found valid.
struct Checked {
    model: ModelDef,
    plan: StagePlan,
    microbatches: usize,
    actions: RankActions,
    /// The checkpoint to resume from (`--resume`).
    resume: Option<Latest>,
    /// Why this rank has no whole checkpoint to resume from, when its latest and the one before
    /// it are damaged.
    damaged: Option<String>,
    identity: Identity,
    /// The settings a resume changes ([`Identity::changed_settings`]), each as a warning.
    changed: Vec<String>,
}

/// Everything about a training request that can be checked without data, devices or other ranks:
/// the model, the stage config against its modules and the world size, the schedule with the
/// replicas and microbatches, the batch split, and this rank's actions.
fn check_plan(config: &TrainConfig) -> anyhow::Result<Checked> {
    let dist = &config.dist;
    let model = ModelDef::named(&config.model.name, &config.model.options)?;
    let plan = stage_plan(dist, model.num_modules())?;
    let max_replicas = plan.stages.iter().map(|s| s.ranks.len()).max().unwrap_or(1);
    let microbatches = dist.microbatches.unwrap_or(plan.stages.len().max(max_replicas));
    schedule::validate(&plan, dist.schedule, microbatches)?;
    if let Some(partial) = dist.reduce.partial {
        ensure!(
            plan.stages.iter().all(|s| s.bundles.is_none()),
            "--reduce partial:{} and the stage config's bundles are two ways of grouping replicas; \
             use one (drop `bundles`, or use --reduce all)",
            partial.k
        );
        // A replica's next step can wait on another stage, which can wait on a peer replica held
        // in a group that waits for that next step: a cycle, so pipelines are refused.
        ensure!(
            plan.stages.len() == 1,
            "--reduce partial:{} works on data-parallel replicas of the whole model, not on a \
             pipeline: a group may need a replica's next step, which waits on the next stage, which \
             waits on the group's other members. Drop --stage-config, or use --reduce all",
            partial.k
        );
        ensure!(
            max_replicas > 1,
            "--reduce partial:{} needs a stage with replicas; this plan has none (give --world-size \
             above 1 without a stage config, or replicate a stage in it)",
            partial.k
        );
        ensure!(
            partial.k <= max_replicas,
            "--reduce partial:{} asks for more replicas than a stage has (at most {max_replicas}); \
             use a K up to {max_replicas}",
            partial.k
        );
        // A group that mixes parameters steps each member on the mean over its own microbatches,
        // as the share of the minibatch every replica holds when each has as many.
        ensure!(
            microbatches.is_multiple_of(max_replicas),
            "--reduce partial:{} steps each replica on its own share of the minibatch, so each needs \
             as many microbatches: {microbatches} is not a multiple of the {max_replicas} replicas; \
             give --microbatches a multiple of {max_replicas}",
            partial.k
        );
    }
    ensure!(
        !(model.makes_sparse_activations() && plan.stages.len() > 1 && dist.backend == Backend::Nccl),
        "{} hands sparse COO activations between stages, whose size only their header tells, \
         which NCCL (pairing sends and receives by issue order) cannot match; add --backend gloo",
        model.name
    );
    ensure!(
        !(config.cuda_graph && model.makes_sparse_activations()),
        "--cuda-graph: {} makes sparse COO tensors, whose operations wait for the device to learn \
         their sizes, which a CUDA graph capture cannot; drop --cuda-graph",
        model.name
    );
    if !config.batch_size.is_multiple_of(microbatches) {
        // Without --microbatches, one per stage or per replica of the widest stage.
        let defaulted = match dist.microbatches {
            Some(_) => String::new(),
            None if max_replicas >= plan.stages.len() => format!(
                " (--microbatches defaults to the {max_replicas} replicas of a stage, each with its \
                 share of the batch; give --batch-size a multiple of {microbatches}, or --microbatches)"
            ),
            None => format!(
                " (--microbatches defaults to the {} stages; give --batch-size a multiple of \
                 {microbatches}, or --microbatches)",
                plan.stages.len()
            ),
        };
        bail!(
            "--batch-size {} is not divisible by --microbatches {microbatches}{defaulted}",
            config.batch_size
        );
    }
    let mine = plan.stage_of_rank(dist.rank);
    if let Some(parts) = mine
        .device_parts
        .as_ref()
        .filter(|p| p.len() != config.devices.len())
    {
        bail!(
            "the stage config's module_to_device_map puts stage {} on {} device(s), but this rank has {}; \
             give --devices with {} devices, or change the map",
            mine.id,
            parts.len(),
            config.devices.len(),
            parts.len()
        );
    }
    let identity = identity(config, &model, &plan, microbatches);
    let folders = [
        config.checkpoint.as_ref().map(|c| ("--checkpoint-dir", &c.dir)),
        config.save_params.as_ref().map(|dir| ("--save-params", dir)),
    ];
    for (flag, dir) in folders.into_iter().flatten() {
        if let Some(file) = dir.ancestors().find(|p| p.is_file()) {
            bail!(
                "{flag}: {} is a file, not a folder; give a folder (made if missing)",
                file.display()
            );
        }
    }
    let resume = match &config.checkpoint {
        Some(c) if c.resume == Resume::No => {
            checkpoint::check_afresh(&c.dir, &identity).map_err(anyhow::Error::msg)?;
            None
        }
        Some(c) if c.resume == Resume::Required => {
            Some(checkpoint::read_latest(&c.dir, &identity).map_err(anyhow::Error::msg)?)
        }
        Some(c) if c.resume == Resume::IfPresent => {
            checkpoint::read_latest_if_any(&c.dir, &identity).map_err(anyhow::Error::msg)?
        }
        _ => None,
    };
    // A damaged checkpoint is passed over for the one before it, which the ranks then agree on;
    // a rank with none whole offers none, and every rank is refused at that agreement.
    let (resume, damaged) = match (resume, &config.checkpoint) {
        (Some(latest), Some(c)) => match checkpoint::whole_or_before(&c.dir, &identity, latest) {
            Ok(whole) => (Some(whole), None),
            Err(damage) => (None, Some(damage)),
        },
        _ => (None, None),
    };
    let first = resume.as_ref().map_or(0, |latest| latest.iterations_done);
    if first > config.iterations {
        bail!(
            "--iterations {} is fewer than the {first} iterations the checkpoint resumed from has \
             done already; give at least {first} (the run's whole length, not the iterations to add)",
            config.iterations
        );
    }
    let actions = rank_actions(&plan, config, microbatches, first)?;
    let changed = resume
        .as_ref()
        .map(|latest| latest.changed_settings(&identity))
        .unwrap_or_default();
    Ok(Checked {
        model,
        plan,
        microbatches,
        actions,
        resume,
        damaged,
        identity,
        changed,
    })
}

/// The modules each of this rank's devices holds: the stage config's `module_to_device_map`
/// (checked against the devices by `check_plan`), or runs of even measured cost; `None` for a
/// stage on one device.
fn device_parts(
    config: &TrainConfig,
    model: &ModelDef,
    stage: &stagehand_contract::Stage,
    micro: i64,
) -> anyhow::Result<Option<Vec<Range<usize>>>> {
    let devices = config.devices.len();
    match &stage.device_parts {
        Some(parts) if devices > 1 => Ok(Some(parts.clone())),
        _ if devices > 1 => {
            let costs = crate::stage::placement::measure_costs(
                model,
                stage.modules.clone(),
                micro,
                config.device.tch(),
                3,
            );
            let parts = crate::stage::placement::split_by_cost(stage.modules.clone(), &costs, devices)
                .map_err(anyhow::Error::msg)?;
            Ok(Some(parts))
        }
        _ => Ok(None),
    }
}

/// This rank's stage, on its device or split over its devices, and how it was placed (for the
/// start line: `cpu`, or `cuda:0 (modules 0..9), cuda:1 (modules 9..18)`).
fn build_stage(
    config: &TrainConfig,
    model: &ModelDef,
    stage: &stagehand_contract::Stage,
    micro: i64,
) -> anyhow::Result<(Stage, String)> {
    Ok(match device_parts(config, model, stage, micro)? {
        None => (
            Stage::build(model, stage.modules.clone(), config.seed, config.device.tch()),
            config.device.to_string(),
        ),
        Some(parts) => {
            let placed: Vec<(Range<usize>, tch::Device)> = parts
                .into_iter()
                .zip(config.devices.iter().map(|d| d.tch()))
                .collect();
            let described = placed
                .iter()
                .zip(&config.devices)
                .map(|((modules, _), device)| {
                    format!("{device} (modules {}..{})", modules.start, modules.end)
                })
                .collect::<Vec<_>>()
                .join(", ");
            (Stage::build_placed(model, &placed, config.seed), described)
        }
    })
}

/// What this rank's checkpoints must agree with.
fn identity(config: &TrainConfig, model: &ModelDef, plan: &StagePlan, microbatches: usize) -> Identity {
    let stage = plan.stage_of_rank(config.dist.rank);
    Identity {
        model: model.name.clone(),
        world_size: config.dist.world_size,
        rank: config.dist.rank,
        first_module: stage.modules.start,
        end_module: stage.modules.end,
        optimizer: config.optimizer.name().to_string(),
        batch_size: config.batch_size,
        microbatches,
        schedule: config.dist.schedule.to_string(),
        seed: config.seed,
        data: config.data.to_string(),
        sizes: crate::models::size_flags(&model.name)
            .iter()
            .filter_map(|flag| Some((flag.to_string(), config.model.options.value_of(flag)?)))
            .collect(),
        settings: step_settings(config),
    }
}

/// What the steps are taken with, by flag, as a checkpoint records them.
fn step_settings(config: &TrainConfig) -> BTreeMap<String, serde_json::Value> {
    let mut settings = BTreeMap::new();
    let mut set = |flag: &str, value: serde_json::Value| settings.insert(flag.to_string(), value);
    set("--lr", config.lr.into());
    set("--lr-policy", config.lr_schedule.policy.name().into());
    set("--lr-warmup-epochs", config.lr_schedule.warmup_epochs.into());
    match config.optimizer {
        OptimizerKind::Sgd {
            momentum,
            weight_decay,
            nesterov,
        } => {
            set("--momentum", momentum.into());
            set("--weight-decay", weight_decay.into());
            set("--nesterov", nesterov.into());
        }
        OptimizerKind::Adam { weight_decay } | OptimizerKind::AdamW { weight_decay } => {
            set("--weight-decay", weight_decay.into());
        }
    }
    // PipeDream's stream drains at each segment's end, so other segments step otherwise.
    if config.dist.schedule == Schedule::PipeDream {
        set(PIPEDREAM_SEGMENT, serde_json::json!(segment(config)));
    }
    settings
}

/// How a checkpoint names PipeDream's segment among its settings ([`segment`]; `null`: the
/// whole run).
const PIPEDREAM_SEGMENT: &str = "PipeDream's segment (from --checkpoint-every and --validate-every)";

/// The rows of each minibatch a replica of the first stage runs (its microbatches, taken
/// round-robin within each iteration); `None` where it runs them all.
fn own_rows(
    plan: &StagePlan,
    rank: usize,
    microbatches: usize,
    micro_size: usize,
) -> Option<Vec<Range<usize>>> {
    if plan.stages[0].ranks.len() < 2 {
        return None;
    }
    let rows = (0..microbatches)
        .filter(|&m| schedule::rank_for(plan, 0, m) == rank)
        .map(|m| m * micro_size..(m + 1) * micro_size)
        .collect();
    Some(rows)
}

/// A training request refused before the run starts, as `runtime --check` refuses it: a bad
/// argument (exit 2), which starting the run again would not mend.
#[derive(Debug)]
pub struct Refused(anyhow::Error);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for Refused {}

impl Refused {
    /// `e` as a refusal: a bad argument (exit 2), whichever check found it.
    pub fn error(e: anyhow::Error) -> anyhow::Error {
        anyhow::Error::new(Refused(e))
    }
}

/// Says the request's warnings (flags given that do nothing in it, settings a resume changes),
/// one line each.
fn say_warnings(config: &TrainConfig, checked: &Checked) {
    for warning in config.warnings.iter().chain(&checked.changed) {
        eprintln!("runtime: warning: {warning}");
    }
}

/// `runtime --check`: validates a training request as [`run`] would before it connects, and
/// prints one JSON line describing the plan (`driver check` and preflight ask it).
pub fn check<W: Write>(config: &TrainConfig, out: &mut W) -> anyhow::Result<()> {
    let checked = check_plan(config)?;
    if let Some(damage) = &checked.damaged {
        bail!("{damage}");
    }
    say_warnings(config, &checked);
    let mut line = serde_json::json!({
        "check": "ok",
        "model": config.model.name,
        "modules": checked.model.num_modules(),
        "world_size": config.dist.world_size,
        "stages": checked.plan.stages.iter().map(|s| s.ranks.len()).collect::<Vec<_>>(),
        "schedule": config.schedule_reported(checked.plan.stages.len()),
        "microbatches": checked.microbatches,
    });
    // Where this rank would resume (`--resume`): the iterations its checkpoint has done, or 0
    // where it starts afresh (`--resume=auto` with no checkpoint).
    if config.checkpoint.as_ref().is_some_and(|c| c.resume != Resume::No) {
        line["resumes_after"] = checked.resume.as_ref().map_or(0, |l| l.iterations_done).into();
    }
    writeln!(out, "{line}")?;
    Ok(())
}

/// Trains this rank's part of the model.
pub fn run<W: Write>(config: &TrainConfig, out: &mut Emitter<W>) -> anyhow::Result<()> {
    // Before any operator runs and any thread of ours starts (it sets cuBLAS's environment).
    if config.deterministic {
        crate::determinism::apply().map_err(anyhow::Error::msg)?;
    }
    if config.cudnn_benchmark {
        crate::determinism::benchmark_cudnn().map_err(anyhow::Error::msg)?;
    }
    if config.fused_kernels {
        crate::cuda::fusions::enable();
    }
    let host_memory = host_memory::apply(config.host_memory);
    if let Some(threads) = config.threads {
        tch::set_num_threads(threads as i32);
    }
    // Every device of the stage must exist; the first is made current.
    for device in config.devices.iter().rev() {
        crate::cuda::bind_device(device.tch()).map_err(anyhow::Error::msg)?;
    }
    let dist = &config.dist;
    let device = config.device.tch();
    // Everything that can be wrong with the plan is found before talking to any other rank.
    let checked = check_plan(config).map_err(Refused::error)?;
    // The same on every rank, said once.
    if dist.rank == 0 {
        say_warnings(config, &checked);
    }
    let Checked {
        model,
        plan,
        microbatches,
        mut actions,
        resume: latest,
        damaged,
        identity,
        changed: _,
    } = checked;
    let micro_size = (config.batch_size / microbatches) as i64;
    let config_iterations = config.iterations;
    let my_stage = plan.stage_of_rank(dist.rank).clone();
    let num_params: u64 = model.param_counts().iter().sum();

    let (mut stage, placement) = build_stage(config, &model, &my_stage, micro_size)?;
    stage
        .set_arithmetic(config.precision, config.channels_last)
        .map_err(|e| anyhow::anyhow!("--precision/--channels-last: {e}"))?;
    let mut optimizer = Optimizer::new(config.optimizer, config.lr, stage.params());
    let mut scaler =
        (config.precision == Precision::Fp16).then(|| GradScaler::new(device, config.fp16_init_scale));
    let init_from = |stage: &mut Stage| -> anyhow::Result<()> {
        if let Some(path) = &config.init_from {
            // A file that is not there or does not fit the model is a bad argument.
            let loaded = stage
                .init_from(path)
                .map_err(|e| Refused::error(anyhow::Error::msg(e)))?;
            eprintln!(
                "runtime: rank {}: {loaded} parameters and buffers from {}",
                dist.rank,
                path.display()
            );
        }
        Ok(())
    };
    let latest_done = latest.as_ref().map_or(0, |latest| latest.iterations_done);
    // Without a checkpoint of its own a rank starts afresh whatever the others hold.
    if latest.is_none() {
        init_from(&mut stage)?;
    }
    // Where this run will write is found writable now, not after its iterations.
    if let Some(c) = &config.checkpoint {
        writable(&checkpoint::rank_dir(&c.dir, dist.rank), "--checkpoint-dir").map_err(Refused::error)?;
    }
    if let Some(dir) = &config.save_params {
        writable(dir, "--save-params").map_err(Refused::error)?;
    }
    if config.checkpoint.is_some() {
        crate::signals::catch_term().map_err(anyhow::Error::msg)?;
    }
    // Every first-stage replica reads the same minibatches and takes its own microbatches.
    let request = (my_stage.id == 0).then(|| BatchRequest {
        input: model.input,
        batch_size: config.batch_size,
        seed: config.seed,
        shard: Shard::WHOLE,
        device,
        augment: config.augment,
        workers: config.data_workers,
        rows: own_rows(&plan, dist.rank, microbatches, micro_size as usize),
    });
    // Data that is not there or not what --data says is a bad argument, as a parse finds it.
    let refused = |e: data::DataError| Refused::error(e.into());
    let mut data = request
        .clone()
        .map(|request| data::open(&config.data, request))
        .transpose()
        .map_err(refused)?;
    // The held-out split is found (and counted) before talking to any other rank.
    let held_out = match (&config.validation, &request) {
        (Some(v), Some(_)) => {
            let split = config.data.held_out().map_err(refused)?;
            let batches = split.batches(config.batch_size, v.batches).map_err(refused)?;
            Some((split, batches))
        }
        _ => None,
    };
    let (links, store) = connect(dist, &plan, config.device, &shared_request(config, microbatches))?;
    // Iterations done of the checkpoint every rank resumes from (0 when starting afresh).
    let mut first = 0;
    if let Some(c) = config.checkpoint.as_ref().filter(|c| c.resume != Resume::No) {
        let resume_from;
        (first, resume_from) = agree_and_step_back(c, &links, latest, damaged, &identity, device)?;
        match &resume_from {
            Some(from) => checkpoint::load(&c.dir, from, &mut stage, &mut optimizer, scaler.as_mut())
                .map_err(anyhow::Error::msg)?,
            // Another rank held none: this one starts afresh too.
            None if latest_done > 0 => init_from(&mut stage)?,
            None => {}
        }
        if first != latest_done {
            actions = rank_actions(&plan, config, microbatches, first)?;
        }
        if first > 0 && first < config.iterations && dist.rank == 0 {
            eprintln!(
                "runtime: resuming from the checkpoint of iteration {first} in {}: iterations {first} \
                 to {} run",
                c.dir.display(),
                config.iterations.saturating_sub(1)
            );
        }
    }
    if let Some(stream) = &mut data {
        // The minibatches the resumed iterations already took.
        stream.skip(first)?;
    }
    let validation = match config.validation {
        Some(v) => {
            let counted = held_out.as_ref().map(|(_, batches)| *batches);
            let mut validation = Validation {
                every: v.every,
                total: config_iterations,
                batches: agree_on_validation_batches(&links, &plan, dist.rank, counted, device)?,
                at_start: None,
                open: held_out.zip(request).map(|((split, _), request)| -> OpenSplit {
                    Box::new(move || split.open(request.clone()))
                }),
            };
            validation.at_start = (validation.due(first) && first < config_iterations).then(|| first - 1);
            Some(validation)
        }
        None => None,
    };
    let validation_batches = validation.as_ref().map(|v| v.batches);
    let reducer = links
        .replicas
        .as_ref()
        .map(|group| {
            // PipeDream's replicas each step on their own microbatch: average, as data
            // parallelism does (GPipe and 1F1B already scale each microbatch's loss).
            let scale = (dist.schedule == Schedule::PipeDream).then(|| 1.0 / group.size() as f64);
            // Bundles reduce after the backward, through their masters: no hooks starting
            // all-reduces over every replica.
            let options = ReduceOptions {
                overlap: dist.reduce.overlap && links.bundle.is_none(),
                ..dist.reduce
            };
            Reducer::new(optimizer.params(), options, scale)
        })
        .transpose()
        .map_err(|e| anyhow::anyhow!("setting up the gradient all-reduce: {e}"))?;
    // Rank 0 hosts the store the partial reduce matches replicas through: it keeps a connection
    // of its own to outlast the other replicas; each replica hands the rendezvous one to its
    // partial reduce.
    let (partial, keeper) = match (dist.reduce.partial, store, &links.replicas) {
        (Some(options), Some(store), Some(_)) => {
            let keeper = (dist.rank == 0)
                .then(|| {
                    Store::connect(
                        store.addr(),
                        store.port(),
                        dist.world_size,
                        false,
                        store.timeout(),
                    )
                })
                .transpose()?;
            let mut replicas = my_stage.ranks.clone();
            replicas.sort_unstable();
            let partial = PartialReduce::new(store, my_stage.id, &replicas, dist.rank, options)
                .map_err(|e| anyhow::anyhow!("setting up the partial reduce: {e}"))?;
            (Some(partial), keeper)
        }
        _ => (None, None),
    };
    let mut executor = Executor {
        plan: plan.clone(),
        rank: dist.rank,
        stage_id: my_stage.id,
        schedule: dist.schedule,
        microbatches,
        micro_size,
        stage,
        optimizer,
        links,
        reducer,
        partial,
        data,
        device,
        slowdown: dist.slowdown,
        trace: config.trace,
        scaler,
        lr: config.lr_schedule,
        checkpoint: config.checkpoint.clone().map(|config| Checkpointing {
            config,
            identity: identity.clone(),
            total: config_iterations,
            kept: (first > 0).then_some(first),
        }),
        compress_activations: dist.compress_activations,
        sparse: dist.sparse,
        seed: config.seed,
        cuda_graph: config.cuda_graph,
        validation,
        input_spec: None,
        output_spec: None,
        target_spec: None,
    };
    executor.learn_shapes(first_specs(model.input, micro_size))?;
    if let Some(c) = config.checkpoint.as_ref().filter(|c| c.resume == Resume::No) {
        // Starting afresh: an earlier run's checkpoint is no longer this run's to resume. Only
        // now, with everything before the first iteration done: a run that fails to start (its
        // data, a rank that never came) leaves the earlier checkpoint as it was.
        if let Some(what) = checkpoint::set_aside(&c.dir, dist.rank).map_err(anyhow::Error::msg)? {
            eprintln!(
                "runtime: rank {}: starting afresh (no --resume): {what} in {} is set aside, and \
                 goes when this run writes its first",
                dist.rank,
                c.dir.display()
            );
        }
    }

    out.emit(&Event::Start(Start {
        schema_version: SCHEMA_VERSION,
        rank: dist.rank,
        world_size: dist.world_size,
        stage: my_stage.id,
        num_stages: plan.stages.len(),
        num_modules: model.num_modules(),
        num_params,
        first_module: my_stage.modules.start,
        end_module: my_stage.modules.end,
        stage_params: executor.stage.num_params(),
        first_iteration: first,
        config: RunConfig {
            validation_batches,
            ..config.to_run_config(
                tch::get_num_threads() as usize,
                microbatches,
                plan.stages.len(),
                host_memory,
            )
        },
    }))?;
    eprintln!(
        "runtime: rank {} of {}: stage {} of {} (modules {}..{}) of {} on {}, {} microbatches of {}",
        dist.rank,
        dist.world_size,
        my_stage.id,
        plan.stages.len(),
        my_stage.modules.start,
        my_stage.modules.end,
        model.name,
        placement,
        microbatches,
        micro_size
    );

    let percent = |share: f64| format!("{:.1}%", share * 100.0);
    let mut throughput = Throughput::default();
    let mut totals = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut last_tally: Option<Tally> = None;
    let mut skipped_steps = 0u64;
    let (rank, stage_id, batch) = (dist.rank, my_stage.id, config.batch_size);
    let mut profiler = match config.profiler_trace.clone() {
        Some(path) => {
            let replays_from = config.cuda_graph.then(|| first_replayed(first));
            let from = profiler_trace::first_traced(config.warmup, first, replays_from);
            let steps = config.profiler_steps;
            Some(ProfilerTrace::create(path, device.is_cuda(), from, steps).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };
    let said_written =
        |path: &std::path::Path| eprintln!("runtime: rank {rank}: profiler trace in {}", path.display());
    if let Some(profiler) = profiler.as_mut() {
        profiler.before_iteration(first).map_err(anyhow::Error::msg)?;
    }
    let mut last_validation: Option<ValidationFigures> = None;
    executor.run(actions, |report| {
        let report = match report {
            Report::Iteration(report) => *report,
            Report::Validation(pass) => {
                for op in pass.p2p {
                    out.emit(&Event::P2p(op))?;
                }
                let Some(tally) = pass.tally else {
                    return Ok(());
                };
                let figures = ValidationFigures {
                    loss: tally.loss,
                    accuracy: tally.accuracy,
                    accuracy_top5: tally.accuracy_top5,
                    samples: pass.samples,
                };
                let time_s = pass.time.as_secs_f64();
                eprintln!(
                    "runtime: rank {rank}: validation after iteration {}: loss {:.4}, accuracy {}{} \
                     over {} samples in {time_s:.1} s",
                    pass.iteration,
                    tally.loss,
                    percent(tally.accuracy),
                    tally
                        .accuracy_top5
                        .map_or(String::new(), |a| format!(" (top-5 {})", percent(a))),
                    pass.samples,
                );
                last_validation = Some(figures);
                out.emit(&Event::Validation(stagehand_contract::metrics::Validation {
                    iteration: pass.iteration,
                    rank,
                    stage: stage_id,
                    figures,
                    time_s,
                }))?;
                return Ok(());
            }
        };
        let time_s = report.time.as_secs_f64();
        let compute_s = report.timing.compute.as_secs_f64();
        let comm_wait_s = report.timing.comm.as_secs_f64();
        let samples_per_sec = batch as f64 / time_s;
        let profiled = profiler.as_ref().is_some_and(|p| p.slows(report.iteration));
        if report.iteration >= config.warmup {
            throughput.push(samples_per_sec, profiled);
        }
        totals.0 += report.time;
        totals.1 += report.timing.compute;
        totals.2 += report.timing.comm;
        last_tally = report.tally.or(last_tally);
        skipped_steps += report.scaler.map_or(0, |s| u64::from(s.skipped));
        for op in report.p2p {
            out.emit(&Event::P2p(op))?;
        }
        for trace in report.traces {
            out.emit(&Event::Trace(trace))?;
        }
        let memory = Memory::read(device);
        out.emit(&Event::Iteration(Iteration {
            iteration: report.iteration,
            rank,
            stage: stage_id,
            loss: report.tally.map(|t| t.loss),
            accuracy: report.tally.map(|t| t.accuracy),
            accuracy_top5: report.tally.and_then(|t| t.accuracy_top5),
            lr: Some(report.lr),
            samples: batch as u64,
            time_s,
            samples_per_sec,
            compute_s,
            comm_wait_s,
            idle_s: (time_s - compute_s - comm_wait_s).max(0.0),
            peak_mem_bytes: memory.peak,
            host_peak_rss_bytes: memory.host_peak_rss,
            gpu_peak_allocated_bytes: memory.gpu_peak_allocated,
            gpu_peak_reserved_bytes: memory.gpu_peak_reserved,
            reduce: ReduceMetrics {
                buckets: report.timing.reduce.buckets as u64,
                buckets_early: report.timing.reduce.early as u64,
                overlap_s: report.timing.reduce.overlap.as_secs_f64(),
                wait_s: report.timing.reduce.wait.as_secs_f64(),
                sent_bytes: report.timing.reduce.sent,
            },
            sent_bytes: report.timing.wire.sent,
            sent_dense_bytes: report.timing.wire.dense,
            partial_reduce: report.group.map(|g| PartialGroup {
                index: g.index,
                members: g.members,
                full: g.full,
                drift: g.drift,
                update: g.update,
                wait_s: g.wait.as_secs_f64(),
            }),
            loss_scale: report.scaler.map(|s| s.scale),
            step_skipped: report.scaler.map(|s| s.skipped),
            checkpointed: report.checkpointed,
            profiled,
        }))?;
        if let Some(profiler) = profiler
            .as_mut()
            .filter(|_| report.iteration + 1 < config.iterations)
        {
            // The window's last iteration has run: the trace is written now, mid-run.
            if let Some(path) = profiler
                .before_iteration(report.iteration + 1)
                .map_err(anyhow::Error::msg)?
            {
                said_written(&path);
            }
        }
        Ok(())
    })?;
    // A trace that cannot be written fails the run, but only once its summary is out.
    let traced = profiler.take().map(ProfilerTrace::finish).transpose();
    match &traced {
        Ok(Some(Finished::WrittenNow(path))) => said_written(path),
        Ok(Some(Finished::NothingTraced)) => eprintln!(
            "runtime: rank {rank}: --profiler-trace: no iteration ran after the warm-up; no trace written"
        ),
        Ok(Some(Finished::WrittenEarlier) | None) | Err(_) => {}
    }

    // Done: no group waits for this replica any more; rank 0 stays until no replica needs its
    // store.
    if let Some(partial) = executor.partial.as_mut() {
        partial
            .retire()
            .map_err(|e| anyhow::anyhow!("the partial reduce: {e}"))?;
    }
    drop(executor.partial.take());
    if let Some(keeper) = &keeper {
        crate::pipeline::outlast(keeper, &partial_participants(&plan))
            .map_err(|e| anyhow::anyhow!("waiting for the partial reduce's replicas: {e}"))?;
    }
    // A partial reduce leaves replicas that died behind, and the others end without them.
    if dist.reduce.partial.is_none() {
        meet_at_the_end(&executor.links)?;
    }
    if let Some(dir) = &config.save_params {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--save-params: cannot create {}", dir.display()))?;
        let path = dir.join(format!("rank-{rank}.safetensors"));
        executor
            .stage
            .save(&path)
            .with_context(|| format!("--save-params: cannot write {}", path.display()))?;
    }
    let (time, compute, comm) = (
        totals.0.as_secs_f64(),
        totals.1.as_secs_f64(),
        totals.2.as_secs_f64(),
    );
    let memory = Memory::read(device);
    let summary = Summary {
        rank,
        stage: stage_id,
        iterations: config.iterations,
        warmup_iterations: config.warmup.min(config.iterations),
        samples_per_sec_mean: throughput.mean(),
        samples_per_sec_std: throughput.std(),
        time_s: time,
        compute_s: compute,
        comm_wait_s: comm,
        idle_s: (time - compute - comm).max(0.0),
        final_loss: last_tally.map(|t| t.loss),
        final_accuracy: last_tally.map(|t| t.accuracy),
        final_accuracy_top5: last_tally.and_then(|t| t.accuracy_top5),
        peak_mem_bytes: memory.peak,
        host_peak_rss_bytes: memory.host_peak_rss,
        gpu_peak_allocated_bytes: memory.gpu_peak_allocated,
        gpu_peak_reserved_bytes: memory.gpu_peak_reserved,
        skipped_steps: (config.precision == Precision::Fp16).then_some(skipped_steps),
        validation: last_validation,
    };
    let rate = match throughput.measured_any() {
        true => format!(
            "{:.1} samples/s (std {:.1})",
            summary.samples_per_sec_mean, summary.samples_per_sec_std
        ),
        false if config.iterations == 0 => "no iterations asked for".to_string(),
        false if first == config.iterations => {
            format!("nothing left to run: the checkpoint it resumed from had done all {first} iterations")
        }
        // The summary's 0.0 is no measurement: say so.
        false => format!(
            "no throughput measured (its {} iterations are all within --warmup {})",
            config.iterations - first,
            config.warmup
        ),
    };
    eprintln!(
        "runtime: rank {rank} done: {rate}, final loss {}, accuracy {}{}",
        last_tally.map_or("-".to_string(), |t| format!("{:.4}", t.loss)),
        last_tally.map_or("-".to_string(), |t| percent(t.accuracy)),
        last_tally
            .and_then(|t| t.accuracy_top5)
            .map_or(String::new(), |a| format!(" (top-5 {})", percent(a)))
    );
    out.emit(&Event::Summary(summary))?;
    traced.map_err(anyhow::Error::msg)?;
    Ok(())
}
