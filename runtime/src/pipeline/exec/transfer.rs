//! What crosses a stage boundary: the receives posted ahead and taken when an action needs them,
//! the sends issued as route.rs orders them, each message's spec and the kind it travels in
//! (framed sparse payloads through sparse.rs).
//!
//! A framed message's header is posted ahead as a dense message is. A compressed dense tensor's
//! payload is never larger than its dense form, so its receive is posted ahead too, with room
//! for that: Gloo takes a shorter message into a receive's first bytes, and the header says how
//! many. A payload sent before its receive is posted waits for it (Gloo sends only to a posted
//! receive), and on a slow link the receiver's word that it is posted queues behind the bulk
//! traffic going its way, so a payload whose receive waited for its header lost that time.
//!
//! A sparse COO tensor's payload has no bound short of its entries, so its receive is posted as
//! soon as the header is seen in ([`Executor::land_headers`], between operations, or when the
//! action takes it). Payload sends are not waited for before a step
//! ([`Progress::reap_payload_sends`]): a receiver can post a COO payload's receive only once the
//! header is in, which may be after a step of its own that waits on this rank's replicas, so
//! waiting for it could close a cycle that the receives posted ahead keep dense messages out of
//! (route.rs). Both such a header's receive and every payload's send are
//! [watched](crate::comm::Watched) on threads of their own, since Gloo says an operation has ended
//! only once it is waited for.

use anyhow::bail;
use tch::{Kind, Tensor};

use super::{Executor, Progress};
use crate::comm::{Watched, Work};
use crate::pipeline::route::Transfer;
use crate::pipeline::sparse;
use crate::pipeline::wire::{Message, TensorSpec};
use crate::profiler_trace::Scope;

impl Executor {
    /// The spec of what `message` carries as this rank receives it.
    pub(super) fn recv_spec(&self, message: Message) -> anyhow::Result<&TensorSpec> {
        let spec = match message {
            Message::Activation(_) => self.input_spec.as_ref(),
            Message::Target(_) => self.target_spec.as_ref(),
            Message::Gradient(_) => self.output_spec.as_ref(),
            Message::Header => bail!("internal error: a shape header is received only at start"),
        };
        Ok(spec.expect("shapes are learned at start"))
    }

    /// The spec of what `message` carries as this rank sends it (the same spec its receiver has).
    pub(super) fn send_spec(&self, message: Message) -> anyhow::Result<&TensorSpec> {
        let spec = match message {
            Message::Activation(_) => self.output_spec.as_ref(),
            Message::Target(_) => self.target_spec.as_ref(),
            Message::Gradient(_) => self.input_spec.as_ref(),
            Message::Header => bail!("internal error: a shape header is sent only at start"),
        };
        Ok(spec.expect("shapes are learned at start"))
    }

    /// Whether `message` travels framed, a header then the payload it announces: activations and
    /// gradients under `--compress auto`, and both across a boundary where the model makes sparse
    /// COO tensors (their sizes vary with their entries).
    pub(super) fn framed(&self, message: Message, spec: &TensorSpec) -> bool {
        matches!(message, Message::Activation(_) | Message::Gradient(_)) && (self.sparse || spec.is_sparse())
    }

    /// Starts receiving `transfer` into a fresh buffer; a framed message's header, and its
    /// payload into room for its dense form where the spec is dense.
    pub(super) fn post_recv(&self, progress: &mut Progress, transfer: Transfer) -> anyhow::Result<()> {
        let spec = self.recv_spec(transfer.message)?;
        let framed = self.framed(transfer.message, spec);
        let wire = self.wire_kind(transfer.message, spec.kind);
        let mut tensor = if framed {
            // The header: the payload's form and size, then the payload itself.
            sparse::header_buffer()
        } else {
            match wire {
                Some(kind) => Tensor::empty(spec.shape.as_slice(), (kind, self.device)),
                None => spec.empty(self.device),
            }
        };
        let work = self.channels().recv(transfer, &mut tensor)?;
        let arrival = match (framed, spec.is_sparse()) {
            (true, false) => {
                let elements: i64 = spec.shape.iter().product();
                let room = elements * wire.unwrap_or(spec.kind).elt_size_in_bytes() as i64;
                let mut payload = Tensor::empty([room], (Kind::Uint8, self.device));
                let payload_work = self.channels().recv_payload(transfer, &mut payload)?;
                Arrival::Bounded {
                    header: tensor,
                    header_work: work,
                    payload,
                    payload_work,
                }
            }
            (true, true) => Arrival::Header {
                tensor,
                watched: Watched::new(work)?,
            },
            (false, _) => Arrival::Buffer { tensor, work },
        };
        progress
            .posted
            .insert(transfer.message, Posted { transfer, arrival });
        Ok(())
    }

    /// Posts the payload receives of the framed messages whose headers are in, so that their
    /// payloads travel while this rank computes; never waits.
    pub(super) fn land_headers(&self, progress: &mut Progress) -> anyhow::Result<()> {
        let landed: Vec<Message> = progress
            .posted
            .iter()
            .filter(|(_, posted)| posted.header_landed())
            .map(|(&message, _)| message)
            .collect();
        for message in landed {
            let posted = progress.posted.remove(&message).expect("listed above");
            let posted = self.post_payload(posted)?;
            progress.posted.insert(message, posted);
        }
        Ok(())
    }

    /// A framed message whose header is on its way with its payload's receive posted: once the
    /// header is in (waiting for it if need be), the receive of the size it gives. Any other
    /// receive as it was.
    fn post_payload(&self, posted: Posted) -> anyhow::Result<Posted> {
        let Posted { transfer, arrival } = posted;
        let Arrival::Header { tensor, watched } = arrival else {
            return Ok(Posted { transfer, arrival });
        };
        watched.wait()?;
        let header = sparse::read_header(&tensor)
            .map_err(|e| anyhow::anyhow!("{:?} from rank {}: {e}", transfer.message, transfer.peer))?;
        let mut payload = Tensor::empty([header.bytes], (Kind::Uint8, self.device));
        let work = self.channels().recv_payload(transfer, &mut payload)?;
        Ok(Posted {
            transfer,
            arrival: Arrival::Payload {
                header,
                payload,
                work,
            },
        })
    }

    /// The posted receive of `message`, once it has arrived (a `receive` scope in a
    /// `--profiler-trace`: the wait for the peer is in it). A framed message is rebuilt as the
    /// tensor of the message's spec (in the kind it travels in): dense, or sparse COO as it was
    /// sent.
    pub(super) fn take(&self, progress: &mut Progress, message: Message) -> anyhow::Result<Tensor> {
        let _scope = Scope::enter(c"receive");
        let posted = progress
            .posted
            .remove(&message)
            .expect("the program posts every receive before the action that takes it");
        let posted = self.post_payload(posted)?;
        let spec = self.recv_spec(message)?;
        let tensor = match posted.arrival {
            Arrival::Buffer { tensor, work } => {
                work.wait()?;
                tensor
            }
            Arrival::Header { .. } => unreachable!("its payload's receive is posted above"),
            framed => {
                let from = posted.transfer.peer;
                let (header, payload) = framed_arrival(framed, &format!("{message:?} from rank {from}"))?;
                let kind = self.wire_kind(message, spec.kind).unwrap_or(spec.kind);
                sparse::decode(header, &payload, &spec.shape, kind)
                    .map_err(|e| anyhow::anyhow!("{message:?} from rank {from}: {e}"))?
            }
        };
        // NCCL's wait only orders the streams: settle here so the transfer is not timed as the
        // compute that follows.
        crate::cuda::synchronize(self.device)?;
        // A compressed activation goes back to the kind the stage computes in.
        Ok(match message {
            Message::Activation(_) if tensor.kind() != spec.kind => tensor.to_kind(spec.kind),
            _ => tensor,
        })
    }

    /// The kind `message` travels in when it is not `kind`: float16 for a float32 activation
    /// under `--compress-activations`.
    pub(super) fn wire_kind(&self, message: Message, kind: Kind) -> Option<Kind> {
        (self.compress_activations && matches!(message, Message::Activation(_)) && kind == Kind::Float)
            .then_some(Kind::Half)
    }

    /// Starts sending what the last action produced as `transfer`'s message.
    pub(super) fn send(&self, progress: &mut Progress, transfer: Transfer) -> anyhow::Result<()> {
        let tensor = progress
            .outbox
            .remove(&transfer.message)
            .expect("the action before a send produced its tensor");
        let tensor = match self.wire_kind(transfer.message, tensor.kind()) {
            Some(kind) => tensor.detach().to_kind(kind),
            None => tensor,
        };
        // A stage over several devices sends from its last one through the group's device.
        let tensor = match tensor.device() == self.device {
            true => tensor,
            false => tensor.detach().to_device(self.device),
        };
        let dense_bytes = (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64;
        progress.timing.wire.dense += dense_bytes;
        let spec = self.send_spec(transfer.message)?;
        if self.framed(transfer.message, spec) {
            // Its receiver has room for the dense form where the spec is dense: a sparse gradient
            // for a dense input goes as the dense tensor it stands for, in its smallest form.
            let tensor = match tensor.is_sparse() && !spec.is_sparse() {
                true => tensor.to_dense(None::<Kind>, false),
                false => tensor,
            };
            let encoded = sparse::encode(&tensor, self.sparse)
                .map_err(|e| anyhow::anyhow!("compressing {:?}: {e}", transfer.message))?;
            // The receiver has room for the dense form only, and Gloo aborts on more.
            let payload = encoded.payload.numel() as u64;
            if !spec.is_sparse() && payload > dense_bytes {
                bail!(
                    "internal error: {:?}'s payload of {payload} bytes is larger than its dense form's \
                     {dense_bytes}",
                    transfer.message
                );
            }
            progress.timing.wire.sent += sparse::HEADER_LEN as u64 * 8 + encoded.payload.numel() as u64;
            progress
                .sends
                .push(self.channels().send(transfer, &encoded.header)?);
            let payload = self.channels().send_payload(transfer, &encoded.payload)?;
            progress.payload_sends.push(Watched::new(payload)?);
            return Ok(());
        }
        progress.timing.wire.sent += dense_bytes;
        // A sparse gradient for a dense input (a module whose backward makes one) goes as the
        // dense tensor its receiver expects.
        let tensor = match tensor.is_sparse() {
            true => tensor.to_dense(None::<Kind>, false),
            false => tensor.contiguous(),
        };
        let work = self.channels().send(transfer, &tensor)?;
        progress.sends.push(work);
        Ok(())
    }
}

impl Progress {
    /// Waits for the payload sends that have ended (for their errors) and keeps the others, which
    /// their receivers post only once they get to them; never blocks.
    pub(super) fn reap_payload_sends(&mut self) -> anyhow::Result<()> {
        let (ended, pending): (Vec<Watched>, Vec<Watched>) =
            self.payload_sends.drain(..).partition(Watched::is_completed);
        self.payload_sends = pending;
        for work in ended {
            work.wait()?;
        }
        Ok(())
    }

    /// Waits for every payload send: before a validation pass, a stop at a checkpoint and at the
    /// run's end, where every receiver takes what was sent to it without waiting on this rank.
    pub(super) fn finish_payload_sends(&mut self) -> anyhow::Result<()> {
        for work in self.payload_sends.drain(..) {
            work.wait()?;
        }
        Ok(())
    }
}

/// A receive posted ahead of the action that takes it.
pub(super) struct Posted {
    transfer: Transfer,
    arrival: Arrival,
}

impl Posted {
    /// Whether it is a framed message's header, and in.
    fn header_landed(&self) -> bool {
        matches!(&self.arrival, Arrival::Header { watched, .. } if watched.is_completed())
    }
}

/// A framed message's header and payload (its first bytes, those the header gives), once both are
/// in; `what` names the message and its sender in a bad header's error.
fn framed_arrival(arrival: Arrival, what: &str) -> anyhow::Result<(sparse::Header, Tensor)> {
    match arrival {
        Arrival::Payload {
            header,
            payload,
            work,
        } => {
            work.wait()?;
            Ok((header, payload))
        }
        Arrival::Bounded {
            header,
            header_work,
            payload,
            payload_work,
        } => {
            header_work.wait()?;
            let header = sparse::read_header(&header).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
            // A sender never sends more (`send` checks), and Gloo would abort on a payload
            // larger than the receive: this catches a header that disagrees with its sender.
            let room = payload.size()[0];
            if !(0..=room).contains(&header.bytes) {
                bail!(
                    "{what}: its header announces {} payload bytes, not at most the {room} of its dense form",
                    header.bytes
                );
            }
            payload_work.wait()?;
            Ok((header, payload.narrow(0, 0, header.bytes)))
        }
        Arrival::Buffer { .. } | Arrival::Header { .. } => {
            unreachable!("a framed message's payload, its receive posted")
        }
    }
}

enum Arrival {
    /// A dense message on its way into `tensor`.
    Buffer { tensor: Tensor, work: Work },
    /// A framed message's header on its way into `tensor`, watched so that its payload's receive
    /// is posted once it is in.
    Header { tensor: Tensor, watched: Watched },
    /// A framed message's payload on its way, the header in.
    Payload {
        header: sparse::Header,
        payload: Tensor,
        work: Work,
    },
    /// A framed message of a dense spec on its way: its header into `header`, its payload into
    /// the first bytes of `payload`, which has room for the dense form (the largest the sender
    /// picks).
    Bounded {
        header: Tensor,
        header_work: Work,
        payload: Tensor,
        payload_work: Work,
    },
}
