//! A validation pass: the model, as it stands where every rank's pipeline is drained, run forward
//! over the held-out split (no gradients, dropout off, batch norm on its running statistics).
//! The split's minibatches are cut into microbatches as training's are and take the same route:
//! the same replica of each stage runs microbatch `g` as in training (round-robin within each
//! minibatch), activations and targets cross stages in the same messages and order, and the last
//! stage's replicas sum what they measured.

use std::time::{Duration, Instant};

use anyhow::Context;
use stagehand_contract::{P2p, P2pTensor};
use tch::{Device, Kind, Tensor};

use super::{slice_microbatch, tally_of, Executor, Progress, Tally};
use crate::data::{Batches, DataError};
use crate::pipeline::channel::Channels;
use crate::pipeline::route::Op;
use crate::pipeline::wire::Message;
use crate::profiler_trace::Scope;
use crate::schedule::Action;

/// Opens the held-out split afresh, at its start (the first stage's).
pub type OpenSplit = Box<dyn Fn() -> Result<Box<dyn Batches>, DataError> + Send>;

/// When validation passes run and over what.
pub struct Validation {
    /// After every this many iterations, and after the last.
    pub every: u64,
    /// The run's iterations.
    pub total: u64,
    /// Minibatches a pass runs (every rank agrees on it).
    pub batches: u64,
    /// The first stage's way to the held-out split; `None` on other stages.
    pub open: Option<OpenSplit>,
    /// A run resumed where a pass was due: the iteration that pass follows, run before any
    /// training (a rank stopped by SIGTERM writes its checkpoint and stops before the pass).
    pub at_start: Option<u64>,
}

impl Validation {
    /// Whether a pass follows once `done` iterations are done.
    pub fn due(&self, done: u64) -> bool {
        done > 0 && (done == self.total || done.is_multiple_of(self.every))
    }
}

/// What a pass measured (the figures on the last stage only).
#[derive(Debug)]
pub struct ValidationReport {
    /// The training iteration the pass followed.
    pub iteration: u64,
    /// Mean loss and accuracies over the pass's samples (last stage only).
    pub tally: Option<Tally>,
    /// Samples the pass ran through the whole model.
    pub samples: u64,
    pub time: Duration,
    /// The pass's point-to-point operations, in issue order (with `--trace`; else empty).
    pub p2p: Vec<P2p>,
}

impl Executor {
    /// Runs a validation pass after iteration `iteration`, every rank of the plan at once. The
    /// caller runs it where nothing of training is in flight (at the end of a chunk that ends a
    /// segment), so the pass's messages are the only ones on the channels.
    pub(super) fn validate(&mut self, iteration: u64) -> anyhow::Result<ValidationReport> {
        let started = Instant::now();
        let validation = self
            .validation
            .as_ref()
            .expect("a pass runs only with --validate-every");
        let (batches, m) = (validation.batches as usize, self.microbatches);
        let mut data = match &validation.open {
            Some(open) => Some(open().context("--validate-every")?),
            None => None,
        };
        let route = self.route();
        let mine: Vec<usize> = (0..batches * m)
            .filter(|&g| route.owner(self.stage_id, g) == self.rank)
            .collect();
        let program = route.forward_program(&mine);
        let mut progress = Progress::default();
        let mut batch: Option<(usize, Tensor, Tensor)> = None;
        let mut tallies: Vec<Tensor> = Vec::new();
        let _scope = Scope::enter(c"validation");
        for op in program {
            self.land_headers(&mut progress)?;
            match op {
                Op::Recv(transfer) => self.post_recv(&mut progress, transfer)?,
                Op::Send(transfer) => self.send(&mut progress, transfer)?,
                Op::Run(Action::Forward(g)) => {
                    let (input, target) = match data.as_deref_mut() {
                        Some(data) => slice_microbatch(data, &mut batch, g, m, self.micro_size)
                            .context("--validate-every")?,
                        None => (
                            self.take(&mut progress, Message::Activation(g))?,
                            self.take(&mut progress, Message::Target(g))?,
                        ),
                    };
                    let output = tch::no_grad(|| self.stage.forward(&input, false));
                    match self.stage.loss_and_accuracy(&output, &target) {
                        Some(computed) => {
                            let (loss, accuracy) = computed.context("computing the validation loss")?;
                            tallies.push(tally_of(&loss, accuracy));
                        }
                        None => {
                            progress.outbox.insert(Message::Activation(g), output);
                            progress.outbox.insert(Message::Target(g), target);
                        }
                    }
                }
                Op::Run(action) => {
                    anyhow::bail!("internal error: a validation pass runs forwards only, not {action:?}")
                }
            }
        }
        for work in progress.sends.drain(..) {
            work.wait()?;
        }
        progress.finish_payload_sends()?;
        // The pass's transfers are its own `--trace` events, not the next iteration's. A pass
        // that starts a resumed run also takes the start's shape headers, which stay unmarked.
        let log = self.links.channels.as_ref().map(Channels::take_log);
        let p2p = log
            .filter(|_| self.trace)
            .unwrap_or_default()
            .into_iter()
            .map(|op| P2p {
                validation: (op.tensor != P2pTensor::Header).then_some(iteration),
                ..op
            })
            .collect();
        let tally = match self.is_last() {
            true => Some(self.validation_tally(&tallies)?),
            false => None,
        };
        let samples = (batches * m) as u64 * self.micro_size as u64;
        Ok(ValidationReport {
            iteration,
            tally,
            samples,
            time: started.elapsed(),
            p2p,
        })
    }

    /// The pass's mean loss and accuracies over every microbatch, the last stage's replicas'
    /// summed (each ran its own microbatches).
    fn validation_tally(&self, tallies: &[Tensor]) -> anyhow::Result<Tally> {
        // Every replica runs some of each minibatch's microbatches (there are at least as many).
        let total = Tensor::stack(tallies, 0)
            .sum_dim_intlist(0, false, Kind::Double)
            .to_device(self.device);
        // The count rides along: the replicas' shares of a pass differ when its microbatches
        // are not a multiple of them.
        let count = Tensor::from_slice(&[tallies.len() as f64]).to_device(self.device);
        let total = Tensor::cat(&[total, count], 0);
        if let Some(group) = &self.links.replicas {
            group.all_reduce_sum(std::slice::from_ref(&total))?.wait()?;
        }
        let total = Vec::<f64>::try_from(&total.to_device(Device::Cpu))
            .map_err(|e| anyhow::anyhow!("the device failed running the validation pass: {e}"))?;
        let (count, sums) = total.split_last().context("internal error: an empty tally")?;
        Tally::mean_of(sums, *count)
    }
}
