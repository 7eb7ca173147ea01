//! Runs one rank's action list: forwards and backwards of its microbatches, the activations,
//! targets and gradients that cross stage boundaries (asynchronous c10d point-to-point, issued in
//! the order route.rs decides), the replicas' gradient all-reduce (reduce.rs) and the optimizer
//! step, with PipeDream's weight stashing.

use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use stagehand_contract::{P2p, StagePlan, Trace};
use tch::{Device, Kind, Tensor};

use super::bundle::Bundle;
use super::channel::Channels;
use super::partial::{GroupReport, PartialReduce};
use super::reduce::{last_backwards, ReduceStats, Reducer};
use super::route::{Op, Route};
use super::wire::{header, header_buffer, read_header, Message, TensorSpec};
use crate::comm::{ProcessGroup, Watched, Work};
use crate::config::CheckpointConfig;
use crate::cuda::{DeviceError, Graph};
use crate::data::Batches;
use crate::lr::LrSchedule;
use crate::profiler_trace::Scope;
use crate::schedule::{Action, Chunk, Schedule, ScheduleError};
use crate::signals::{self, Stopped};
use crate::stage::checkpoint::{self, Identity};
use crate::stage::{backward_with_grad, GradScaler, Optimizer, ScalerReport, Stage};

mod graph;
mod transfer;
mod validate;

pub use graph::first_replayed;
pub use validate::{OpenSplit, Validation, ValidationReport};

use graph::{GraphPhase, StepGraph};
use transfer::Posted;

/// The process groups a rank talks through; `None` in a single-process run.
pub struct Links {
    /// Every rank: point-to-point between stages, one group per direction.
    pub channels: Option<Channels>,
    /// This stage's replicas, when there are several: the gradient all-reduce.
    pub replicas: Option<ProcessGroup>,
    /// With the stage config's `bundles` and replicas: the bundle's and the masters' groups,
    /// which reduce the gradients instead of the all-reduce over `replicas`.
    pub bundle: Option<Bundle>,
}

impl Links {
    /// A group spanning every rank: the forward channel's, or the replicas' of a single stage
    /// (none in a single process).
    pub fn everyone(&self) -> Option<&ProcessGroup> {
        self.channels
            .as_ref()
            .map(Channels::everyone)
            .or(self.replicas.as_ref())
    }
}

/// Where time went during one iteration.
#[derive(Debug, Default, Clone, Copy)]
pub struct Timing {
    pub compute: Duration,
    /// Waiting on all-reduces and on sends to complete.
    pub comm: Duration,
    /// The replicas' gradient all-reduce (its wait is part of `comm`).
    pub reduce: ReduceStats,
    /// Bytes of the messages (activations, gradients, targets) this rank sent to other stages.
    pub wire: WireBytes,
}

/// What a rank's sends to other stages weighed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WireBytes {
    /// As sent (compressed forms and their headers included).
    pub sent: u64,
    /// As dense tensors in the kinds they travel in.
    pub dense: u64,
}

/// What a finished iteration reports.
#[derive(Debug)]
pub struct IterationReport {
    pub iteration: u64,
    pub time: Duration,
    pub timing: Timing,
    /// Loss and accuracies over the minibatch (last stage only).
    pub tally: Option<Tally>,
    /// The learning rate of the iteration's steps.
    pub lr: f64,
    /// With tracing on, the weights each finished microbatch used.
    pub traces: Vec<Trace>,
    /// With tracing on, the point-to-point operations issued since the last report (the first
    /// report also has the shape headers), in issue order.
    pub p2p: Vec<P2p>,
    /// With a partial reduce, the group of the iteration's step.
    pub group: Option<GroupReport>,
    /// With fp16, what the gradient scaler did at the iteration's step.
    pub scaler: Option<ScalerReport>,
    /// A whole checkpoint of the iterations done so far was written after this iteration.
    pub checkpointed: bool,
}

/// What [`Executor::run`] hands its caller as the run goes.
#[derive(Debug)]
pub enum Report {
    /// An iteration finished on this rank (boxed: a pass's report is a fraction of its size).
    Iteration(Box<IterationReport>),
    /// A validation pass finished on this rank.
    Validation(ValidationReport),
}

/// An iteration's mean loss and accuracies on the last stage.
#[derive(Debug, Clone, Copy)]
pub struct Tally {
    pub loss: f64,
    /// Top-1 accuracy, averaged as the loss is.
    pub accuracy: f64,
    /// Top-5 accuracy, as `accuracy` (class logits only: [`crate::models::Loss::accuracy`]).
    pub accuracy_top5: Option<f64>,
}

impl Tally {
    /// The means of microbatch tallies summed into `sums` (`[loss, top-1]` or `[loss, top-1,
    /// top-5]`, as [`tally_of`] makes them) over `count` microbatches.
    fn mean_of(sums: &[f64], count: f64) -> anyhow::Result<Tally> {
        let mean = |i: usize| sums.get(i).map(|sum| sum / count);
        Ok(Tally {
            loss: mean(0).context("internal error: an empty tally")?,
            accuracy: mean(1).context("internal error: a tally without an accuracy")?,
            accuracy_top5: mean(2),
        })
    }
}

/// A microbatch between its forward and its backward.
struct InFlight {
    /// The stage's input, which needs a gradient to send back (stages after the first).
    input: Option<Tensor>,
    /// The stage's output, or the scaled loss on the last stage.
    output: Tensor,
    /// Parameters as they were at the forward, when a step happens before the backward.
    stash: Option<Vec<Tensor>>,
    /// Optimizer steps taken before the forward.
    version: u64,
    /// With tracing on, the first parameter's sum as the forward saw it.
    checksum: Option<f64>,
}

pub struct Executor {
    pub plan: StagePlan,
    pub rank: usize,
    pub stage_id: usize,
    pub schedule: Schedule,
    /// Microbatches per minibatch (iteration).
    pub microbatches: usize,
    /// Samples per microbatch.
    pub micro_size: i64,
    pub stage: Stage,
    pub optimizer: Optimizer,
    pub links: Links,
    /// With replicas: the all-reduce of this rank's gradients over `links.replicas`.
    pub reducer: Option<Reducer>,
    /// With replicas and `--reduce partial:K`: the groups the reducer's all-reduce gives way to.
    pub partial: Option<PartialReduce>,
    pub data: Option<Box<dyn Batches>>,
    pub device: Device,
    /// Compute slow-down factor (straggler emulation).
    pub slowdown: f64,
    /// Record which weights each microbatch used.
    pub trace: bool,
    /// fp16: the gradient scaler (the same scale on every rank).
    pub scaler: Option<GradScaler>,
    /// The learning rate of each iteration.
    pub lr: LrSchedule,
    /// float32 activations cross stages as float16.
    pub compress_activations: bool,
    /// Activations and gradients cross stages in their smallest form (`--compress auto`).
    pub sparse: bool,
    /// Where and when to checkpoint.
    pub checkpoint: Option<Checkpointing>,
    /// The run's seed: with the rank and the iteration it reseeds torch's generator at each
    /// iteration's first forward on this rank, so what dropout draws never depends on earlier
    /// iterations and a resumed run draws what the uninterrupted one did.
    pub seed: u64,
    /// `--cuda-graph`: after [`GRAPH_EAGER_ITERATIONS`](graph::GRAPH_EAGER_ITERATIONS) eager
    /// iterations, one iteration's work is captured in a CUDA graph and every later iteration
    /// replays it (one process, one GPU).
    pub cuda_graph: bool,
    /// `--validate-every`: when passes over the held-out split run.
    pub validation: Option<Validation>,
    /// Shapes crossing into and out of this stage, learned at start.
    pub input_spec: Option<TensorSpec>,
    pub output_spec: Option<TensorSpec>,
    pub target_spec: Option<TensorSpec>,
}

/// The generator's seed for `rank`'s iteration `iteration` of a run seeded `seed`.
fn iteration_seed(seed: u64, rank: usize, iteration: usize) -> i64 {
    let mixed = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((rank as u64) << 40)
        .wrapping_add(iteration as u64);
    (mixed & (i64::MAX as u64)) as i64
}

/// A vote on stopping (SIGTERM on some rank), possibly still in flight.
struct StopVote {
    flag: Tensor,
    work: Option<Work>,
}

impl StopVote {
    /// Waits for the vote; whether any rank asked to stop.
    fn outcome(self) -> anyhow::Result<bool> {
        if let Some(work) = self.work {
            work.wait()?;
        }
        Ok(self.flag.double_value(&[0]) > 0.0)
    }
}

/// Checkpoints of this rank (`--checkpoint-dir`).
pub struct Checkpointing {
    pub config: CheckpointConfig,
    pub identity: Identity,
    /// The run's iterations.
    pub total: u64,
    /// The iterations done of this run's last checkpoint (written, or resumed from), which the
    /// next keeps beside it.
    pub kept: Option<u64>,
}

/// Mutable state while the action list runs.
#[derive(Default)]
struct Progress {
    in_flight: HashMap<usize, InFlight>,
    sends: Vec<Work>,
    /// The minibatch the first stage is slicing: (index, inputs, targets).
    batch: Option<(usize, Tensor, Tensor)>,
    timing: Timing,
    /// Each finished microbatch's loss and accuracies (`[loss, top-1]`, or `[loss, top-1,
    /// top-5]` for class logits), a `Double` tensor on the device (the last stage's; read once,
    /// at the iteration's end).
    tallies: Vec<Tensor>,
    traces: Vec<Trace>,
    /// Receives posted ahead of the action that takes them (a framed message's payload with its
    /// header, or, for a sparse COO tensor, once its header is in: transfer.rs).
    posted: HashMap<Message, Posted>,
    /// Framed messages' payload sends, which a step does not wait for (transfer.rs).
    payload_sends: Vec<Watched>,
    /// What the last action produced for other ranks, until the program sends it.
    outbox: HashMap<Message, Tensor>,
    /// The partial reduce's group of the last step.
    group: Option<GroupReport>,
    /// With `--cuda-graph`: the graph and what it reads and writes.
    graph: Option<StepGraph>,
    /// The iteration whose seed the generator was last given ([`iteration_seed`]).
    seeded: Option<usize>,
}

impl Progress {
    /// Whether a CUDA graph capture is under way (nothing may wait for the device).
    fn capturing(&self) -> bool {
        self.graph
            .as_ref()
            .is_some_and(|g| g.phase == GraphPhase::Capturing)
    }

    /// Whether this iteration's work was replayed from the graph (its actions only keep count).
    fn replayed(&self) -> bool {
        self.graph
            .as_ref()
            .is_some_and(|g| g.phase == GraphPhase::Replayed)
    }
}

impl Executor {
    fn num_stages(&self) -> usize {
        self.plan.stages.len()
    }

    fn is_first(&self) -> bool {
        self.stage_id == 0
    }

    fn is_last(&self) -> bool {
        self.stage_id + 1 == self.num_stages()
    }

    fn channels(&self) -> &Channels {
        self.links
            .channels
            .as_ref()
            .expect("a multi-stage plan has channels")
    }

    fn route(&self) -> Route<'_> {
        Route::new(&self.plan, self.stage_id, self.microbatches)
    }

    /// The first stage's inputs and targets of global microbatch `g`.
    fn microbatch(&mut self, progress: &mut Progress, g: usize) -> anyhow::Result<(Tensor, Tensor)> {
        let data = self.data.as_deref_mut().expect("the first stage has data");
        slice_microbatch(data, &mut progress.batch, g, self.microbatches, self.micro_size)
    }

    fn forward(&mut self, progress: &mut Progress, g: usize, stash: bool) -> anyhow::Result<()> {
        // Reseeded at this rank's first forward of each iteration (a replica's first microbatch
        // is not the iteration's first); a captured iteration is reseeded before each replay.
        let iteration = g / self.microbatches;
        if progress.seeded != Some(iteration) && !progress.capturing() {
            tch::manual_seed(iteration_seed(self.seed, self.rank, iteration));
            progress.seeded = Some(iteration);
        }
        let (input, target) = if self.is_first() {
            let (x, y) = self.microbatch(progress, g)?;
            (x, Some(y))
        } else {
            let input = self.take(progress, Message::Activation(g))?;
            let target = self.take(progress, Message::Target(g))?;
            (input.set_requires_grad(true), Some(target))
        };
        let target = target.expect("every forward has a target");
        // Weight stashing: a copy of the weights, which the forward itself runs on (see
        // [`with_data`]), for microbatches whose backward comes after a step.
        let stash: Option<Vec<Tensor>> =
            stash.then(|| tch::no_grad(|| self.optimizer.params().iter().map(|p| p.data().copy()).collect()));
        let params = self.stashed_params(stash.is_some());
        let scale = match self.schedule {
            Schedule::PipeDream => 1.0,
            Schedule::GPipe | Schedule::OneFOneB => 1.0 / self.microbatches as f64,
        };
        let devices = self.timed_devices(progress);
        let (output, tally) = with_data(&params, stash.as_deref(), || {
            timed(
                c"forward",
                &devices,
                self.slowdown,
                &mut progress.timing,
                || -> anyhow::Result<(Tensor, Option<Tensor>)> {
                    let out = self.stage.forward(&input, true);
                    match self.stage.loss_and_accuracy(&out, &target) {
                        Some(computed) => {
                            let (loss, accuracy) = computed.context("computing the loss")?;
                            let backward = match &self.scaler {
                                Some(scaler) => scaler.scale_loss(&(&loss * scale)),
                                None => &loss * scale,
                            };
                            Ok((backward, Some(tally_of(&loss, accuracy))))
                        }
                        None => Ok((out, None)),
                    }
                },
            )
        })?;
        if let Some(tally) = tally {
            progress.tallies.push(tally);
        } else {
            progress
                .outbox
                .insert(Message::Activation(g), output.shallow_clone());
            progress.outbox.insert(Message::Target(g), target);
        }
        let input = (!self.is_first()).then_some(input);
        let version = self.optimizer.steps();
        let checksum = self.trace.then(|| self.checksum());
        progress.in_flight.insert(
            g,
            InFlight {
                input,
                output,
                stash,
                version,
                checksum,
            },
        );
        Ok(())
    }

    /// The backward of microbatch `g`; `last` when it is this rank's last before a step (its
    /// gradients are final, and the reducer may start all-reducing them as they appear).
    fn backward(&mut self, progress: &mut Progress, g: usize, last: bool) -> anyhow::Result<()> {
        let s = self.stage_id;
        let flight = progress
            .in_flight
            .remove(&g)
            .expect("a backward follows its forward");
        let grad = if self.is_last() {
            None
        } else {
            Some(self.take(progress, Message::Gradient(g))?)
        };
        // Weight stashing: the backward runs against the weights the forward used, swapped in
        // (and the live ones back after) only for microbatches that have a stash.
        let params = self.stashed_params(flight.stash.is_some());
        let (devices, slowdown) = (self.timed_devices(progress), self.slowdown);
        // The gradient arrives on the process group's device; the output may be on another of a
        // stage's devices.
        let grad = grad.map(|g| match g.device() == flight.output.device() {
            true => g,
            false => g.to_device(flight.output.device()),
        });
        with_data(&params, flight.stash.as_deref(), || {
            if let Some(forward_checksum) = flight.checksum {
                progress.traces.push(Trace {
                    rank: self.rank,
                    stage: s,
                    microbatch: g as u64,
                    forward_version: flight.version,
                    steps_at_backward: self.optimizer.steps(),
                    forward_checksum,
                    backward_checksum: self.checksum(),
                });
            }
            let mut run = || {
                timed(
                    c"backward",
                    &devices,
                    slowdown,
                    &mut progress.timing,
                    || match &grad {
                        None => flight.output.f_backward().map_err(|e| e.to_string()),
                        Some(grad) => backward_with_grad(&flight.output, grad),
                    },
                )
            };
            match (&mut self.reducer, &self.links.replicas) {
                (Some(reducer), Some(group)) => reducer.backward(group, last, run),
                _ => run(),
            }
        })
        .map_err(|e| anyhow::anyhow!("backward of microbatch {g} on stage {s}: {e}"))?;
        if let Some(input) = &flight.input {
            let grad = input.grad();
            if !grad.defined() {
                bail!(
                    "stage {s} produced no gradient for its input; its modules do not depend on their input"
                );
            }
            progress.outbox.insert(Message::Gradient(g), grad);
        }
        Ok(())
    }

    /// The devices whose queued work ends a timed span: the stage's, except during a CUDA graph
    /// capture, when nothing runs (and waiting would break the capture), and in a process that
    /// does not [wait after each action](Self::waits_after_each_action).
    fn timed_devices(&self, progress: &Progress) -> Vec<Device> {
        match progress.capturing() || !self.waits_after_each_action() {
            true => Vec::new(),
            false => self.stage.devices(),
        }
    }

    /// Whether each forward, backward and step waits for the device to run it, so that its
    /// kernels' time is booked as compute apart from the waits for peers, and `--slowdown` can
    /// stretch it. A single process has no peers and, unslowed, nothing to stretch: its actions
    /// are queued back to back as PyTorch's are, with no wait for the device between them (which
    /// would leave the GPU idle while the next action's first kernels are launched), and the
    /// iteration's one wait, for its loss and accuracy, is booked as compute
    /// ([`Self::take_tally`]). On a CPU nothing changes: its kernels run as they are called.
    fn waits_after_each_action(&self) -> bool {
        self.links.everyone().is_some() || self.slowdown > 1.0
    }

    /// The parameters whose data [`with_data`] swaps a microbatch's stash in and out of, when it
    /// has one (`stashed`); none otherwise.
    fn stashed_params(&self, stashed: bool) -> Vec<Tensor> {
        match stashed {
            true => self
                .optimizer
                .params()
                .iter()
                .map(Tensor::shallow_clone)
                .collect(),
            false => Vec::new(),
        }
    }

    /// Sum of the first parameter's current values (weights as the next kernel will see them).
    fn checksum(&self) -> f64 {
        self.optimizer
            .params()
            .first()
            .map_or(0.0, |p| p.data().sum(Kind::Double).double_value(&[]))
    }

    fn step(&mut self, progress: &mut Progress) -> anyhow::Result<()> {
        if let Some(message) = progress.outbox.keys().next() {
            bail!("internal error: {message:?} was produced but never sent");
        }
        let started = Instant::now();
        // Waiting for this rank's sends, the replicas' gradient all-reduce and the scaler's
        // flags: a `sync` scope in a --profiler-trace, ended before the step's own.
        let sync = Scope::enter(c"sync");
        for work in progress.sends.drain(..) {
            work.wait()?;
        }
        progress.reap_payload_sends()?;
        if let (Some(reducer), Some(group)) = (&mut self.reducer, &self.links.replicas) {
            // Parameters that took no part in any backward get zero gradients, so every replica
            // all-reduces buckets of the same shapes.
            let _ = self.optimizer.grads();
            let stats = match (&mut self.partial, &self.links.bundle) {
                (Some(partial), _) => {
                    partial.before_step(reducer, group, self.optimizer.params(), self.device)
                }
                (None, Some(bundle)) => {
                    // As the all-reduce: PipeDream's replicas average.
                    let scale = (self.schedule == Schedule::PipeDream).then(|| 1.0 / group.size() as f64);
                    bundle.reduce(self.optimizer.params(), scale, self.device)
                }
                (None, None) => reducer.finish(group, self.device),
            }
            .map_err(|e| anyhow::anyhow!("the gradient all-reduce of stage {}: {e}", self.stage_id))?;
            progress.timing.reduce += stats;
        }
        // fp16: the inf/nan flag the step reads, on the device (nothing here waits for it).
        let found_inf = match &mut self.scaler {
            None => None,
            Some(scaler) => {
                let grads = self.optimizer.grads();
                scaler.unscale(&grads).map_err(anyhow::Error::msg)?;
                // Every rank skips the same steps with the same scale: sum the inf/nan flags over
                // all ranks (the forward channel spans them; a single stage's replicas are all).
                let everyone = self.links.everyone();
                if let Some(group) = everyone {
                    group
                        .all_reduce_sum(std::slice::from_ref(scaler.found_inf()))?
                        .wait()?;
                }
                Some(scaler.step_flag().map_err(anyhow::Error::msg)?.shallow_clone())
            }
        };
        // With peers, the waits above end once the device has run what they ordered its stream
        // after. A single process has nothing to wait for: its step is queued behind the backward
        // (the iteration's one wait is for its loss).
        if !progress.capturing() && self.waits_after_each_action() {
            crate::cuda::synchronize(self.device)?;
        }
        if self.links.channels.is_some() || self.links.replicas.is_some() {
            progress.timing.comm += started.elapsed();
        } else {
            // Without peers nothing was waited on (comm_wait_s is 0 in one process): the time is
            // the gradient scaler's, if any (on a GPU its launches; its kernels' time is booked
            // with the loss's wait).
            progress.timing.compute += started.elapsed();
        }
        drop(sync);
        let slowdown = self.slowdown;
        let devices = self.timed_devices(progress);
        let optimizer = &mut self.optimizer;
        timed(
            c"step",
            &devices,
            slowdown,
            &mut progress.timing,
            || match &found_inf {
                None => optimizer.step(),
                Some(flag) => optimizer.step_unless(flag),
            },
        )
        .map_err(|e| anyhow::anyhow!("the optimizer step of stage {} failed: {e}", self.stage_id))?;
        if let Some(scaler) = &mut self.scaler {
            scaler.update().map_err(anyhow::Error::msg)?;
        }
        if let (Some(partial), Some(group)) = (&mut self.partial, &self.links.replicas) {
            let started = Instant::now();
            let (stats, report) = partial
                .after_step(group, self.optimizer.params(), self.device)
                .map_err(|e| anyhow::anyhow!("the partial reduce of stage {}: {e}", self.stage_id))?;
            progress.timing.reduce += stats;
            progress.timing.comm += started.elapsed();
            progress.group = Some(report);
        }
        self.optimizer.zero_grad();
        Ok(())
    }

    /// Learns the shapes crossing this stage's boundaries: receives the upstream header from
    /// every rank of the previous stage (they must agree), runs one forward without gradients to
    /// learn its own output, and sends the header to every rank of the next stage. `first` is the
    /// (input, target) spec of a microbatch, used by the first stage.
    pub fn learn_shapes(&mut self, first: (TensorSpec, TensorSpec)) -> anyhow::Result<()> {
        let s = self.stage_id;
        let (input, target) = if self.is_first() {
            first
        } else {
            let mut agreed: Option<(TensorSpec, TensorSpec)> = None;
            for source in self.route().header_sources() {
                let mut buffer = header_buffer().to_device(self.device);
                self.channels().recv(source, &mut buffer)?.wait()?;
                let specs = read_header(&buffer.to_device(Device::Cpu))
                    .with_context(|| format!("rank {} sent a malformed shape header", source.peer))?;
                match &agreed {
                    Some(a) if *a != specs => bail!(
                        "replicas of stage {} disagree on the shapes they send: {a:?} vs {specs:?} from rank {}",
                        s - 1,
                        source.peer
                    ),
                    _ => agreed = Some(specs),
                }
            }
            agreed.expect("a stage has at least one rank")
        };
        let output = tch::no_grad(|| self.stage.forward(&input.zeros(self.device), false));
        if !self.is_last() {
            let output = TensorSpec::of(&output);
            let header = header(&output, &target)
                .map_err(anyhow::Error::msg)?
                .to_device(self.device);
            let sends = self
                .route()
                .header_destinations()
                .into_iter()
                .map(|destination| self.channels().send(destination, &header))
                .collect::<Result<Vec<_>, _>>()?;
            for work in sends {
                work.wait()?;
            }
            self.output_spec = Some(output);
        }
        self.input_spec = Some(input);
        self.target_spec = Some(target);
        Ok(())
    }

    /// Runs `actions` (this rank's over the run, a [`Chunk`] at a time), calling `report` as
    /// each iteration, and each validation pass, completes on this rank. A pass runs after a
    /// chunk whose last iteration is due one: chunks end at every multiple of
    /// `--validate-every` ([`crate::schedule::RankActions`]), where nothing is in flight.
    pub fn run(
        &mut self,
        actions: impl IntoIterator<Item = Result<Chunk, ScheduleError>>,
        mut report: impl FnMut(Report) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let mut chunks = actions.into_iter().peekable();
        let mut progress = Progress::default();
        if self.cuda_graph {
            let Device::Cuda(index) = self.device else {
                bail!("--cuda-graph needs a CUDA device");
            };
            let first = chunks.peek().and_then(|chunk| {
                let chunk = chunk.as_ref().ok()?;
                chunk.actions.iter().find_map(|a| match a {
                    Action::Forward(g) => Some(g / self.microbatches),
                    _ => None,
                })
            });
            progress.graph = Some(StepGraph {
                graph: Graph::new(index).map_err(|e| anyhow::anyhow!("--cuda-graph: {e}"))?,
                phase: GraphPhase::Eager,
                inputs: None,
                targets: None,
                tallies: Vec::new(),
                first: first.unwrap_or(0),
            });
        }
        let mut started = Instant::now();
        let mut pending_end: Option<usize> = None;
        // Asked to stop (SIGTERM on some rank): at the next iteration end where a checkpoint
        // can be written, every iteration's end but PipeDream's between its drained segments.
        let mut stopping = false;
        // The vote of the last iteration's end, still in flight (see `start_stop_vote`).
        let mut vote: Option<StopVote> = None;
        let drains_every_iteration = self.schedule != Schedule::PipeDream || self.num_stages() == 1;
        // The last iteration this rank ended in the current chunk.
        let mut ended: Option<usize> = None;
        if let Some(iteration) = self.validation.as_ref().and_then(|v| v.at_start) {
            report(Report::Validation(self.validate(iteration)?))?;
            started = Instant::now();
        }
        for chunk in chunks {
            let Chunk { actions, stashed } = chunk.context("deriving this rank's schedule")?;
            let last_backwards: HashSet<usize> = last_backwards(&actions);
            let program = self.route().program(&actions);
            for op in program {
                self.land_headers(&mut progress)?;
                match op {
                    Op::Recv(transfer) => self.post_recv(&mut progress, transfer)?,
                    Op::Send(transfer) => self.send(&mut progress, transfer)?,
                    Op::Run(Action::Forward(g)) => {
                        if g.is_multiple_of(self.microbatches) {
                            self.start_graphed_iteration(&mut progress, g / self.microbatches)?;
                        }
                        if !progress.replayed() {
                            self.forward(&mut progress, g, stashed.contains(&g))?;
                        }
                    }
                    Op::Run(Action::Backward(g)) => {
                        if !progress.replayed() {
                            self.backward(&mut progress, g, last_backwards.contains(&g))?;
                        }
                        let iteration = g / self.microbatches;
                        // The step that follows belongs to this backward's iteration.
                        self.optimizer.set_lr(self.lr.at(iteration as u64));
                        // The iteration ends with the step after this rank's last microbatch of it.
                        if self.route().ends_iteration(g) {
                            pending_end = Some(iteration);
                        }
                    }
                    Op::Run(Action::Step) => {
                        match progress.replayed() {
                            true => self.optimizer.count_replayed_step(),
                            false => self.step(&mut progress)?,
                        }
                        if let Some(iteration) = pending_end.take() {
                            ended = Some(iteration);
                            self.end_graphed_iteration(&mut progress, iteration)?;
                            // A checkpointing run stops where any rank was asked to: every rank
                            // learns it at the same iteration's end.
                            if self.checkpoint.is_some() {
                                if let Some(previous) = vote.take() {
                                    stopping |= previous.outcome()?;
                                }
                                if !stopping {
                                    vote = Some(self.start_stop_vote()?);
                                }
                            }
                            let tally = self.take_tally(&mut progress)?;
                            let time = started.elapsed();
                            let traces = std::mem::take(&mut progress.traces);
                            let p2p = self.links.channels.as_ref().map(Channels::take_log);
                            // The checkpoint is written before the iteration's line, which says so:
                            // a driver that restarts the ranks resumes only from checkpoints it saw
                            // written whole.
                            let done = iteration as u64 + 1;
                            let (checkpointed, stop) = match &mut self.checkpoint {
                                Some(c) => {
                                    let due = c.config.due(done, c.total);
                                    let stop = stopping && (drains_every_iteration || due);
                                    if stop || due {
                                        checkpoint::save(
                                            &c.config.dir,
                                            &c.identity,
                                            done,
                                            c.kept,
                                            &self.stage,
                                            &self.optimizer,
                                            self.scaler.as_ref(),
                                        )
                                        .map_err(anyhow::Error::msg)?;
                                        c.kept = Some(done);
                                    }
                                    (stop || due, stop && done < c.total)
                                }
                                None => (false, false),
                            };
                            report(Report::Iteration(Box::new(IterationReport {
                                lr: self.lr.at(iteration as u64),
                                iteration: iteration as u64,
                                time,
                                timing: progress.timing,
                                tally,
                                traces,
                                p2p: p2p.filter(|_| self.trace).unwrap_or_default(),
                                group: progress.group.take(),
                                scaler: self.scaler.as_ref().map(GradScaler::report),
                                checkpointed,
                            })))?;
                            if let (true, Some(c)) = (stop, &self.checkpoint) {
                                progress.finish_payload_sends()?;
                                return Err(Stopped {
                                    iterations_done: done,
                                    dir: checkpoint::rank_dir(&c.config.dir, self.rank),
                                }
                                .into());
                            }
                            progress.timing = Timing::default();
                            started = Instant::now();
                        }
                    }
                }
            }
            let due = |it: &usize| self.validation.as_ref().is_some_and(|v| v.due(*it as u64 + 1));
            if let Some(iteration) = ended.take().filter(due) {
                if let Some(message) = progress.posted.keys().next() {
                    bail!("internal error: the receive of {message:?} is posted across a validation pass");
                }
                progress.finish_payload_sends()?;
                report(Report::Validation(self.validate(iteration as u64)?))?;
                // The pass is no part of the next iteration's time.
                started = Instant::now();
            }
        }
        if let Some(message) = progress.posted.keys().next() {
            bail!("internal error: the receive of {message:?} was posted but never taken");
        }
        progress.finish_payload_sends()?;
        // Every rank started the last vote: finish it, so no collective is left behind.
        if let Some(last) = vote {
            last.outcome()?;
        }
        Ok(())
    }

    /// Starts the vote on stopping at this iteration's end: a sum of every rank's SIGTERM flag
    /// over a group that spans them all ([`Links::everyone`]). It completes in the background and is
    /// read at the next iteration's end, so no rank waits on it while a peer waits on this rank's
    /// sends (PipeDream's stages run iterations apart); every rank reads the same sum at the same
    /// iteration, so all stop together.
    fn start_stop_vote(&self) -> anyhow::Result<StopVote> {
        let mine = f32::from(u8::from(signals::term_requested()));
        let everyone = self.links.everyone();
        let flag = Tensor::from_slice(&[mine]).to_device(self.device);
        let work = everyone
            .map(|group| group.all_reduce_sum(std::slice::from_ref(&flag)))
            .transpose()?;
        Ok(StopVote { flag, work })
    }

    /// The mean loss and accuracies of the iteration's microbatches on this rank (summed over the
    /// replicas of the last stage for GPipe and 1F1B, so every replica reports the whole
    /// minibatch's).
    fn take_tally(&self, progress: &mut Progress) -> anyhow::Result<Option<Tally>> {
        if !self.is_last() {
            return Ok(None);
        }
        let tallies = std::mem::take(&mut progress.tallies);
        let total = Tensor::stack(&tallies, 0).sum_dim_intlist(0, false, Kind::Double);
        let mut count = tallies.len() as f64;
        // PipeDream's replicas, and a partial reduce's, each report their own microbatches'.
        let own = self.schedule == Schedule::PipeDream || self.partial.is_some();
        if let (Some(group), false) = (&self.links.replicas, own) {
            // Waiting for the other replicas' figures is communication, as the gradients' is.
            let started = Instant::now();
            group.all_reduce_sum(std::slice::from_ref(&total))?.wait()?;
            progress.timing.comm += started.elapsed();
            count = self.microbatches as f64;
        }
        let started = Instant::now();
        // The iteration's queued kernels end here; a fault of the device's shows here too.
        let total = total
            .f_to_device(Device::Cpu)
            .and_then(|t| Vec::<f64>::try_from(&t))
            .map_err(|e| anyhow::anyhow!("the device failed running the iteration: {e}"))?;
        if !self.waits_after_each_action() {
            progress.timing.compute += started.elapsed();
        }
        let tally = Tally::mean_of(&total, count)?;
        if !tally.loss.is_finite() {
            bail!("loss became {}; lower --lr", tally.loss);
        }
        Ok(Some(tally))
    }
}

/// Microbatch `g` (of `microbatches` of `micro_size` samples a minibatch) from `data`, whose
/// minibatch being sliced is kept in `batch` (its index, inputs and targets): the next one is
/// taken when `g` starts another.
fn slice_microbatch(
    data: &mut dyn Batches,
    batch: &mut Option<(usize, Tensor, Tensor)>,
    g: usize,
    microbatches: usize,
    micro_size: i64,
) -> anyhow::Result<(Tensor, Tensor)> {
    let index = g / microbatches;
    if batch.as_ref().is_none_or(|(i, _, _)| *i != index) {
        let (x, y) = data.next_batch()?;
        *batch = Some((index, x, y));
    }
    let (_, x, y) = batch.as_ref().expect("just loaded");
    let start = (g % microbatches) as i64 * micro_size;
    let loaded = data.rows().is_none_or(|rows| {
        let wanted = start as usize..(start + micro_size) as usize;
        rows.iter()
            .any(|r| r.start <= wanted.start && wanted.end <= r.end)
    });
    ensure!(
        loaded,
        "internal error: microbatch {g} takes rows {start}.. of its minibatch, which this \
         rank's data stream was told it would not use"
    );
    Ok((x.narrow(0, start, micro_size), y.narrow(0, start, micro_size)))
}

/// Runs `f` with `params`' data replaced by `data` (one tensor each, of the same shape, dtype and
/// device), putting their own back after; with `data` `None` it only runs `f`. Weight stashing runs
/// a microbatch's forward and its backward on its stash this way: the forward's graph keeps what it
/// saved of the weights, a convolution the parameter itself but a linear layer a transposed view of
/// its data, which `set_data` cannot reach later. So the stash must be the data the forward ran on,
/// not a copy beside it: the optimizer's steps update the live data in place, and the view then
/// still holds the stashed values at the backward.
fn with_data<T>(params: &[Tensor], data: Option<&[Tensor]>, f: impl FnOnce() -> T) -> T {
    let Some(data) = data else {
        return f();
    };
    debug_assert_eq!(params.len(), data.len());
    let swap = |incoming: &[Tensor]| -> Vec<Tensor> {
        params
            .iter()
            .zip(incoming)
            .map(|(p, d)| {
                let previous = p.data();
                p.shallow_clone().set_data(d);
                previous
            })
            .collect()
    };
    let live = swap(data);
    let value = f();
    swap(&live);
    value
}

/// A microbatch's tally: its loss and its accuracies (`[top-1]` or `[top-1, top-5]`), one
/// `Double` tensor on the device, summed over microbatches and read once.
fn tally_of(loss: &Tensor, accuracy: Tensor) -> Tensor {
    let loss = loss.detach().to_kind(Kind::Double).reshape([1]);
    Tensor::cat(&[loss, accuracy], 0)
}

/// Runs `f`, the iteration's `part` (`forward`, `backward`, `step`: a scope of that name in a
/// `--profiler-trace`), as compute: timed, and stretched by the slow-down factor (straggler
/// emulation). On CUDA the clock stops only once the GPU has run what `f` queued, so the time is
/// the kernels' and not their launches'; a device's fault seen then is the result (`f`'s own
/// error first).
fn timed<T, E: From<DeviceError>>(
    part: &CStr,
    devices: &[Device],
    slowdown: f64,
    timing: &mut Timing,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let started = Instant::now();
    let value = {
        let _scope = Scope::enter(part);
        f()?
    };
    for &device in devices {
        crate::cuda::synchronize(device)?;
    }
    let mut spent = started.elapsed();
    if slowdown > 1.0 {
        let extra = spent.mul_f64(slowdown - 1.0);
        std::thread::sleep(extra);
        spent += extra;
    }
    timing.compute += spent;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Weight stashing through [`with_data`], as the executor runs it: a forward on the stash, a
    /// step of the real optimizer, then the backward on the stash. Both the input's gradient (what
    /// a stage sends back) and the weights' must be the ones the stashed weights give, for a
    /// linear layer (whose graph saves a transposed view of the weights' data) and a convolution
    /// (which saves the parameter), and the parameters must hold the stepped weights after.
    /// Every figure is computed twice the same way on the same values, so they are equal exactly.
    #[test]
    fn a_stashed_backward_sees_the_stashed_weights_through_what_its_graph_saved() {
        type Layer = fn(&Tensor, &Tensor) -> Tensor;
        let linear: Layer = |x, w| x.linear::<&Tensor>(w, None);
        let conv: Layer = |x, w| x.conv2d::<&Tensor>(w, None, [1, 1], [0, 0], [1, 1], 1);
        let float = (Kind::Float, Device::Cpu);
        for (name, layer, weight, input) in [
            ("linear", linear, vec![3, 4], vec![2, 4]),
            ("conv", conv, vec![3, 4, 1, 1], vec![2, 4, 2, 2]),
        ] {
            let (w, x, upstream) = crate::models::seeded(5, || {
                let w = Tensor::randn(weight.as_slice(), float).set_requires_grad(true);
                let x = Tensor::randn(input.as_slice(), float).set_requires_grad(true);
                let out = tch::no_grad(|| layer(&x, &w));
                (w, x, Tensor::randn_like(&out))
            });
            let kind = crate::config::OptimizerKind::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
            };
            let mut optimizer = Optimizer::new(kind, 0.5, vec![w.shallow_clone()]);
            let params = [w.shallow_clone()];
            let stash = vec![tch::no_grad(|| w.data().copy())];
            let out = with_data(&params, Some(&stash), || layer(&x, &w));
            // Another microbatch's gradient, and the step PipeDream takes before this backward.
            w.sum(Kind::Float).backward();
            optimizer.step().unwrap();
            let stepped = w.data().copy();
            assert!(!stepped.equal(&stash[0]), "{name}: the step moved the weights");
            w.shallow_clone().zero_grad();
            with_data(&params, Some(&stash), || backward_with_grad(&out, &upstream)).unwrap();
            assert!(w.data().equal(&stepped), "{name}: the live weights are back");

            let (x_ref, w_ref) = (
                x.detach().copy().set_requires_grad(true),
                stash[0].copy().set_requires_grad(true),
            );
            backward_with_grad(&layer(&x_ref, &w_ref), &upstream).unwrap();
            assert!(
                x.grad().equal(&x_ref.grad()),
                "{name}: the input's gradient is not the stashed weights'"
            );
            assert!(
                w.grad().equal(&w_ref.grad()),
                "{name}: the weights' gradient differs"
            );
        }
    }

    /// The stretch is slept, not only booked: the compute booked is `factor` times the work's own
    /// time and no more than the time that really passed. (Both hold however loaded the machine
    /// is: a sleep never ends early, and the work is timed inside the outer clock.)
    #[test]
    fn slowdown_sleeps_the_stretch_it_books() {
        let mut timing = Timing::default();
        let mut work = Duration::ZERO;
        let started = Instant::now();
        timed(c"work", &[Device::Cpu], 3.0, &mut timing, || {
            let begun = Instant::now();
            std::thread::sleep(Duration::from_millis(5));
            work = begun.elapsed();
            Ok::<_, String>(())
        })
        .unwrap();
        let passed = started.elapsed();
        // A nanosecond's slack for the float arithmetic of `mul_f64`.
        let slack = Duration::from_nanos(10);
        assert!(
            timing.compute + slack >= work.mul_f64(3.0),
            "{timing:?} for {work:?} of work"
        );
        assert!(timing.compute <= passed, "{timing:?} booked, {passed:?} passed");
        assert_eq!(timing.comm, Duration::ZERO);

        let mut plain = Timing::default();
        let started = Instant::now();
        timed(c"work", &[Device::Cpu], 1.0, &mut plain, || {
            std::thread::sleep(Duration::from_millis(5));
            Ok::<_, String>(())
        })
        .unwrap();
        assert!(plain.compute >= Duration::from_millis(5) && plain.compute <= started.elapsed());
    }
}
