//! The process groups point-to-point messages travel on, one per direction of the pipeline, and
//! the ledger of the operations issued on them (the `p2p` metrics events of `--trace`).

use std::cell::RefCell;
use std::collections::HashMap;

use stagehand_contract::{Channel, P2p, P2pOp};
use tch::{Kind, Tensor};

use super::route::Transfer;
use crate::comm::{CommError, ProcessGroup, Work};

/// Two groups over every rank: `forward` for headers, activations and targets, `backward` for
/// gradients. Between two ranks each carries messages one way, so NCCL, which pairs a send with
/// a receive by issue order, pairs them as the tags say (route.rs has the argument).
pub struct Channels {
    forward: ProcessGroup,
    backward: ProcessGroup,
    ledger: RefCell<Ledger>,
}

#[derive(Default)]
struct Ledger {
    /// Operations issued so far, per (channel, op, peer): the next one's `seq`.
    issued: HashMap<(Channel, P2pOp, usize), u64>,
    /// Operations issued since the last [`Channels::take_log`].
    log: Vec<P2p>,
}

impl Channels {
    /// Both groups must span the world with group rank equal to world rank.
    pub fn new(forward: ProcessGroup, backward: ProcessGroup) -> Channels {
        Channels {
            forward,
            backward,
            ledger: RefCell::default(),
        }
    }

    /// The group a channel runs on.
    pub fn group(&self, channel: Channel) -> &ProcessGroup {
        match channel {
            Channel::Forward => &self.forward,
            Channel::Backward => &self.backward,
        }
    }

    /// Starts sending `tensor` as `transfer`'s message to its peer.
    pub fn send(&self, transfer: Transfer, tensor: &Tensor) -> Result<Work, CommError> {
        let channel = transfer.message.channel();
        let work = self
            .group(channel)
            .send(tensor, transfer.peer, transfer.message.tag())?;
        self.record(P2pOp::Send, channel, transfer, tensor.kind());
        Ok(work)
    }

    /// Starts receiving `transfer`'s message from its peer into `tensor`.
    pub fn recv(&self, transfer: Transfer, tensor: &mut Tensor) -> Result<Work, CommError> {
        let channel = transfer.message.channel();
        let work = self
            .group(channel)
            .recv(tensor, transfer.peer, transfer.message.tag())?;
        self.record(P2pOp::Recv, channel, transfer, tensor.kind());
        Ok(work)
    }

    /// Starts sending a compressed message's payload (after its header, sent with
    /// [`Channels::send`], which the ledger records as the message).
    pub fn send_payload(&self, transfer: Transfer, payload: &Tensor) -> Result<Work, CommError> {
        let channel = transfer.message.channel();
        self.group(channel)
            .send(payload, transfer.peer, transfer.message.payload_tag())
    }

    /// Starts receiving a compressed message's payload, once its header has said its size.
    pub fn recv_payload(&self, transfer: Transfer, payload: &mut Tensor) -> Result<Work, CommError> {
        let channel = transfer.message.channel();
        self.group(channel)
            .recv(payload, transfer.peer, transfer.message.payload_tag())
    }

    fn record(&self, op: P2pOp, channel: Channel, transfer: Transfer, kind: Kind) {
        let mut ledger = self.ledger.borrow_mut();
        let issued = ledger.issued.entry((channel, op, transfer.peer)).or_default();
        let seq = *issued;
        *issued += 1;
        let (tensor, microbatch) = transfer.message.describe();
        let rank = self.forward.ranks()[self.forward.rank()];
        ledger.log.push(P2p {
            rank,
            op,
            peer: transfer.peer,
            channel,
            seq,
            tensor,
            microbatch,
            dtype: dtype_name(kind).to_string(),
        });
    }

    /// The operations issued since the last call, in issue order.
    pub fn take_log(&self) -> Vec<P2p> {
        std::mem::take(&mut self.ledger.borrow_mut().log)
    }
}

/// PyTorch's name of an element type.
fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "float32",
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Double => "float64",
        Kind::Int64 => "int64",
        Kind::Int => "int32",
        _ => "other",
    }
}
