//! The process groups point-to-point messages travel on, by direction of the pipeline, and
//! the ledger of the operations issued on them (the `p2p` metrics events of `--trace`).

use std::cell::RefCell;
use std::collections::HashMap;

use stagehand_contract::{Channel, P2p, P2pOp};
use tch::{Kind, Tensor};

use super::route::Transfer;
use crate::comm::{CommError, ProcessGroup, Work};

/// The groups point-to-point messages travel on ([`P2pGroups`](crate::config::P2pGroups)): one
/// per direction over every rank, or one per pair of neighbouring ranks and direction. Either way,
/// between two ranks each group carries messages one way, so NCCL, which pairs a send with a receive by issue order,
/// pairs them as the tags say (route.rs has the argument), and with pairs no operation waits
/// behind another peer's.
pub struct Channels {
    /// The forward group over every rank: the world's collectives run on it, and with
    /// [`P2pGroups::World`](crate::config::P2pGroups::World) headers, activations and targets.
    world: ProcessGroup,
    lanes: Lanes,
    ledger: RefCell<Ledger>,
}

/// The groups beside the world's that messages travel on.
pub enum Lanes {
    /// The backward group over every rank (group rank equal to world rank), for gradients.
    World { backward: ProcessGroup },
    /// Groups of this rank and one neighbour (in world rank order), by direction and the
    /// neighbour's world rank.
    Pairs(HashMap<(Channel, usize), ProcessGroup>),
}

#[derive(Default)]
struct Ledger {
    /// Operations issued so far, per (channel, op, peer): the next one's `seq`.
    issued: HashMap<(Channel, P2pOp, usize), u64>,
    /// Operations issued since the last [`Channels::take_log`].
    log: Vec<P2p>,
}

impl Channels {
    /// `world`, a group over every rank with group rank equal to world rank, for collectives (and
    /// with [`Lanes::World`] the forward channel), and the `lanes` messages travel on.
    pub fn new(world: ProcessGroup, lanes: Lanes) -> Channels {
        Channels {
            world,
            lanes,
            ledger: RefCell::default(),
        }
    }

    /// The group over every rank (its collectives).
    pub fn everyone(&self) -> &ProcessGroup {
        &self.world
    }

    fn my_rank(&self) -> usize {
        self.world.ranks()[self.world.rank()]
    }

    /// The group `transfer` travels on, and its peer's rank in that group.
    fn lane(&self, transfer: Transfer) -> Result<(&ProcessGroup, usize), CommError> {
        let channel = transfer.message.channel();
        match &self.lanes {
            Lanes::World { backward } => Ok((
                match channel {
                    Channel::Forward => &self.world,
                    Channel::Backward => backward,
                },
                transfer.peer,
            )),
            Lanes::Pairs(pairs) => {
                let group = pairs.get(&(channel, transfer.peer)).ok_or_else(|| {
                    CommError::Invalid(format!(
                        "internal error: no {channel:?} group with rank {}",
                        transfer.peer
                    ))
                })?;
                Ok((group, usize::from(transfer.peer > self.my_rank())))
            }
        }
    }

    /// Starts sending `tensor` as `transfer`'s message to its peer.
    pub fn send(&self, transfer: Transfer, tensor: &Tensor) -> Result<Work, CommError> {
        let channel = transfer.message.channel();
        let (group, peer) = self.lane(transfer)?;
        let work = group.send(tensor, peer, transfer.message.tag())?;
        self.record(P2pOp::Send, channel, transfer, tensor.kind());
        Ok(work)
    }

    /// Starts receiving `transfer`'s message from its peer into `tensor`.
    pub fn recv(&self, transfer: Transfer, tensor: &mut Tensor) -> Result<Work, CommError> {
        let channel = transfer.message.channel();
        let (group, peer) = self.lane(transfer)?;
        let work = group.recv(tensor, peer, transfer.message.tag())?;
        self.record(P2pOp::Recv, channel, transfer, tensor.kind());
        Ok(work)
    }

    /// Starts sending a compressed message's payload (after its header, sent with
    /// [`Channels::send`], which the ledger records as the message).
    pub fn send_payload(&self, transfer: Transfer, payload: &Tensor) -> Result<Work, CommError> {
        let (group, peer) = self.lane(transfer)?;
        group.send(payload, peer, transfer.message.payload_tag())
    }

    /// Starts receiving a framed message's payload into `payload`: with room for the dense form
    /// (a shorter payload lands in its first bytes), or of the size its header gave.
    pub fn recv_payload(&self, transfer: Transfer, payload: &mut Tensor) -> Result<Work, CommError> {
        let (group, peer) = self.lane(transfer)?;
        group.recv(payload, peer, transfer.message.payload_tag())
    }

    fn record(&self, op: P2pOp, channel: Channel, transfer: Transfer, kind: Kind) {
        let mut ledger = self.ledger.borrow_mut();
        let issued = ledger.issued.entry((channel, op, transfer.peer)).or_default();
        let seq = *issued;
        *issued += 1;
        let (tensor, microbatch) = transfer.message.describe();
        let rank = self.my_rank();
        ledger.log.push(P2p {
            rank,
            op,
            peer: transfer.peer,
            channel,
            seq,
            tensor,
            microbatch,
            dtype: dtype_name(kind).to_string(),
            validation: None,
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
