//! `--cuda-graph`: a training iteration captured in a CUDA graph once the first iterations have
//! run eagerly, then replayed: its inputs copied into the graph's buffers, one launch a step.

use tch::Tensor;

use super::{iteration_seed, timed, Executor, Progress};
use crate::cuda::Graph;

/// Iterations run eagerly before the step is captured: the first makes the optimizer's state and
/// the library handles (cuBLAS, cuDNN) on the graph's stream, the next ones run as every later
/// step will (PyTorch's whole-network capture recipe warms up a few iterations the same way).
pub const GRAPH_EAGER_ITERATIONS: usize = 3;

/// The first iteration replayed from the graph in a run whose first iteration is `first`: after
/// the eager ones and the one captured.
pub fn first_replayed(first: u64) -> u64 {
    first + GRAPH_EAGER_ITERATIONS as u64 + 1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GraphPhase {
    /// Iterations still run kernel by kernel.
    Eager,
    /// This iteration's actions are being captured.
    Capturing,
    /// The last iteration started was replayed (its actions only keep count); the next one
    /// replays again.
    Replayed,
}

/// A training iteration captured in a CUDA graph: its inputs and targets are copied into `inputs`
/// and `targets` before each replay, which leaves the microbatches' losses and accuracies in
/// `tallies`.
pub(super) struct StepGraph {
    pub(super) graph: Graph,
    pub(super) phase: GraphPhase,
    pub(super) inputs: Option<Tensor>,
    pub(super) targets: Option<Tensor>,
    pub(super) tallies: Vec<Tensor>,
    /// The first iteration of this run (a resumed run starts later).
    pub(super) first: usize,
}

impl Executor {
    /// With `--cuda-graph`, at the start of `iteration` (before its first forward): runs it eagerly
    /// during the warm-up, captures it after, and replays the graph from then on.
    pub(super) fn start_graphed_iteration(
        &mut self,
        progress: &mut Progress,
        iteration: usize,
    ) -> anyhow::Result<()> {
        let Some(graph) = progress.graph.as_mut() else {
            return Ok(());
        };
        if graph.phase == GraphPhase::Eager && iteration < graph.first + GRAPH_EAGER_ITERATIONS {
            return Ok(());
        }
        let data = self.data.as_mut().expect("a single stage has data");
        let (x, y) = data.next_batch()?;
        self.optimizer.set_lr(self.lr.at(iteration as u64));
        if graph.phase == GraphPhase::Eager {
            // The graph reads its inputs, and the optimizer its learning rate, from tensors that
            // stay where they are; the gradients start out as none, so the captured backward
            // makes them (in the graph's memory) instead of adding to earlier ones.
            let (inputs, targets) = (x.copy(), y.copy());
            progress.batch = Some((iteration, inputs.shallow_clone(), targets.shallow_clone()));
            graph.inputs = Some(inputs);
            graph.targets = Some(targets);
            self.optimizer.zero_grad();
            self.optimizer
                .keep_lr_on_device(self.device)
                .map_err(|e| anyhow::anyhow!("--cuda-graph: {e}"))?;
            self.optimizer.write_lr();
            graph
                .graph
                .begin_capture()
                .map_err(|e| anyhow::anyhow!("--cuda-graph: starting the capture: {e}"))?;
            graph.phase = GraphPhase::Capturing;
            eprintln!(
                "runtime: rank {}: iteration {iteration}'s work captured in a CUDA graph, replayed from \
                 then on",
                self.rank
            );
            return Ok(());
        }
        let (inputs, targets) = (
            graph.inputs.as_mut().expect("captured with inputs"),
            graph.targets.as_mut().expect("captured with targets"),
        );
        inputs.copy_(&x);
        targets.copy_(&y);
        self.optimizer.write_lr();
        self.replay(progress, iteration)
    }

    /// Replays the graph as `iteration`: reseeded as an eager iteration is, timed as compute; its
    /// losses and accuracies are the iteration's.
    pub(super) fn replay(&mut self, progress: &mut Progress, iteration: usize) -> anyhow::Result<()> {
        let graph = progress.graph.as_mut().expect("replaying a graph");
        tch::manual_seed(iteration_seed(self.seed, self.rank, iteration));
        timed(
            c"replay",
            &self.stage.devices(),
            1.0,
            &mut progress.timing,
            || graph.graph.replay(),
        )
        .map_err(|e| anyhow::anyhow!("--cuda-graph: replaying iteration {iteration}: {e}"))?;
        progress.tallies = graph.tallies.iter().map(Tensor::shallow_clone).collect();
        graph.phase = GraphPhase::Replayed;
        Ok(())
    }

    /// With `--cuda-graph`, after the step that ends `iteration`: ends a capture under way and
    /// runs what it captured (a capture runs nothing).
    pub(super) fn end_graphed_iteration(
        &mut self,
        progress: &mut Progress,
        iteration: usize,
    ) -> anyhow::Result<()> {
        let Some(graph) = progress
            .graph
            .as_mut()
            .filter(|g| g.phase == GraphPhase::Capturing)
        else {
            return Ok(());
        };
        graph
            .graph
            .end_capture()
            .map_err(|e| anyhow::anyhow!("--cuda-graph: {e}"))?;
        // The tallies the capture left are where each replay writes them.
        graph.tallies = std::mem::take(&mut progress.tallies);
        self.replay(progress, iteration)
    }
}
