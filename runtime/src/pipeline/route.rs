//! Who a rank exchanges messages with, and the order it issues its point-to-point operations.
//!
//! NCCL ignores tags: between two ranks it pairs sends with receives by the order both issue them
//! on a communicator, and runs each side's operations with the other strictly in that order. With
//! `--p2p-groups pairs` (NCCL's default) every pair of neighbouring ranks has a group, so a
//! communicator and a stream, per direction; with `world` the groups span every rank, and c10d
//! gives each pair its own communicator only while a group's is not made up front (Gloo has no
//! such ordering at all).
//! [`Route::program`] is the one place that order is decided; the executor runs its operations
//! as they come. Two properties make it safe (route/tests.rs checks both over many plans,
//! replicated stages and uneven round-robins included, against a model of that matching):
//!
//! - The orders agree. Every message travels on the channel of its direction
//!   ([`Message::channel`]), so between two ranks a channel carries messages one way only: on
//!   the forward channel the upstream rank's header, then an activation and a target per
//!   microbatch; on the backward channel the downstream rank's gradients. A rank runs its
//!   forwards, and separately its backwards, in increasing microbatch order (the schedule hands
//!   each rank its microbatches in order), sends what an action produced right after running it,
//!   and posts receives in the order of the actions that take them: the next forward's inputs
//!   after a forward, a microbatch's gradient after its forward. So both sides of a pair handle
//!   the microbatches they share (the same set whatever the replicas' round-robin) in the same
//!   increasing order. On one shared channel the two directions interleave differently on the
//!   two sides (a gradient's receive issued between two sends of activations, while the peer
//!   still waits for the second), and each side waits on the other.
//! - No wait closes a cycle. A rank waits for its sends (framed messages' headers, not their
//!   payloads: below) before a step, and a step with replicas is a collective among them, so a
//!   sender can be held up by a receiver that has not posted yet. Receives are therefore posted
//!   as early as their buffers can be, not just before the action that takes them: a microbatch's
//!   gradient right after its forward, before the rank can block again (so its sender never waits
//!   on it), and the next forward's inputs right after a forward. With receives posted one action
//!   ahead instead, PipeDream on three replicas of stage 0 hangs: a replica's step waits for an
//!   activation the next stage will only take after a step of its own, which waits for a gradient
//!   another replica only posts after the collective step.
//!
//! A framed message (`--compress auto`, a sparse COO tensor) is a header, posted as early as a
//! dense message, then a payload of the size only the header tells. A compressed dense tensor's
//! payload receive is posted with the header's, with room for the dense form; a COO payload's
//! once the header is in. No step waits for a payload's send (exec/transfer.rs), so the payloads
//! add no wait to the argument above.

use stagehand_contract::StagePlan;

use super::wire::Message;
use crate::schedule::{rank_for, Action};

/// One message to or from another rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    pub message: Message,
    /// The world rank on the other side.
    pub peer: usize,
}

/// One step of a rank's run, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Post a receive, to be waited for by the action that needs it.
    Recv(Transfer),
    /// Run an action: wait for its receives, compute (or step).
    Run(Action),
    /// Send a tensor the previous action produced.
    Send(Transfer),
}

/// Where one rank's messages come from and go to.
#[derive(Debug, Clone, Copy)]
pub struct Route<'a> {
    plan: &'a StagePlan,
    stage: usize,
    /// Microbatches per iteration.
    microbatches: usize,
}

impl<'a> Route<'a> {
    pub fn new(plan: &'a StagePlan, stage: usize, microbatches: usize) -> Route<'a> {
        Route {
            plan,
            stage,
            microbatches,
        }
    }

    /// The rank of `stage` that runs microbatch `g`. Replicas take microbatches round-robin
    /// within each iteration (the schedule is derived for one iteration and repeated), so the
    /// owner follows `g`'s index in its iteration, not its global number: the two differ when
    /// the microbatches are not a multiple of the replica count.
    pub fn owner(&self, stage: usize, g: usize) -> usize {
        rank_for(self.plan, stage, g % self.microbatches)
    }

    /// Whether microbatch `g` is the last of its iteration that its owner at this stage runs:
    /// replicas take an iteration's microbatches round-robin, so each of the last `replicas`
    /// ends one replica's share.
    pub fn ends_iteration(&self, g: usize) -> bool {
        g % self.microbatches + self.plan.stages[self.stage].ranks.len() >= self.microbatches
    }

    fn is_first(&self) -> bool {
        self.stage == 0
    }

    fn is_last(&self) -> bool {
        self.stage + 1 == self.plan.stages.len()
    }

    /// What `action` needs from other ranks, in the order it takes them.
    pub fn receives(&self, action: Action) -> Vec<Transfer> {
        match action {
            Action::Forward(g) if !self.is_first() => forward_pair(g, self.owner(self.stage - 1, g)),
            Action::Backward(g) if !self.is_last() => vec![Transfer {
                message: Message::Gradient(g),
                peer: self.owner(self.stage + 1, g),
            }],
            Action::Forward(_) | Action::Backward(_) | Action::Step => Vec::new(),
        }
    }

    /// What `action` produces for other ranks, in the order it sends them.
    pub fn sends(&self, action: Action) -> Vec<Transfer> {
        match action {
            Action::Forward(g) if !self.is_last() => forward_pair(g, self.owner(self.stage + 1, g)),
            Action::Backward(g) if !self.is_first() => vec![Transfer {
                message: Message::Gradient(g),
                peer: self.owner(self.stage - 1, g),
            }],
            Action::Forward(_) | Action::Backward(_) | Action::Step => Vec::new(),
        }
    }

    /// The shape headers this rank receives at start: one from every rank of the previous stage.
    pub fn header_sources(&self) -> Vec<Transfer> {
        self.neighbours(self.stage.checked_sub(1))
    }

    /// The shape headers this rank sends at start: one to every rank of the next stage.
    pub fn header_destinations(&self) -> Vec<Transfer> {
        self.neighbours(Some(self.stage + 1).filter(|_| !self.is_last()))
    }

    fn neighbours(&self, stage: Option<usize>) -> Vec<Transfer> {
        stage.map_or_else(Vec::new, |s| {
            self.plan.stages[s]
                .ranks
                .iter()
                .map(|&peer| Transfer {
                    message: Message::Header,
                    peer,
                })
                .collect()
        })
    }

    /// The operations of running `actions`. Receives are posted as early as their buffers can
    /// be: the first forward's at start, the next forward's right after a forward, and a
    /// microbatch's gradient right after its forward. A sender that waits for its sends to
    /// complete (before a step) then waits only on receivers that already posted them or will
    /// without waiting on that sender.
    pub fn program(&self, actions: &[Action]) -> Vec<Op> {
        let mut forwards = actions.iter().filter(|a| matches!(a, Action::Forward(_)));
        let mut ops: Vec<Op> = Vec::new();
        let post = |ops: &mut Vec<Op>, action: Option<&Action>| {
            if let Some(&action) = action {
                ops.extend(self.receives(action).into_iter().map(Op::Recv));
            }
        };
        post(&mut ops, forwards.next());
        for &action in actions {
            ops.push(Op::Run(action));
            ops.extend(self.sends(action).into_iter().map(Op::Send));
            if let Action::Forward(g) = action {
                post(&mut ops, Some(&Action::Backward(g)));
                post(&mut ops, forwards.next());
            }
        }
        ops
    }

    /// The operations of a forward-only pass (validation) over this rank's microbatches
    /// `forwards`, in increasing order: as [`Self::program`]'s forwards, each next forward's
    /// receives posted right after a forward, with no gradient to wait for. Messages flow one
    /// way, so no wait closes a cycle.
    pub fn forward_program(&self, forwards: &[usize]) -> Vec<Op> {
        let mut ops: Vec<Op> = Vec::new();
        let post = |ops: &mut Vec<Op>, g: Option<&usize>| {
            if let Some(&g) = g {
                ops.extend(self.receives(Action::Forward(g)).into_iter().map(Op::Recv));
            }
        };
        post(&mut ops, forwards.first());
        for (i, &g) in forwards.iter().enumerate() {
            ops.push(Op::Run(Action::Forward(g)));
            ops.extend(self.sends(Action::Forward(g)).into_iter().map(Op::Send));
            post(&mut ops, forwards.get(i + 1));
        }
        ops
    }
}

#[cfg(test)]
mod tests;

/// A forward's messages between two ranks, activation before target (both sides use this order).
fn forward_pair(g: usize, peer: usize) -> Vec<Transfer> {
    vec![
        Transfer {
            message: Message::Activation(g),
            peer,
        },
        Transfer {
            message: Message::Target(g),
            peer,
        },
    ]
}
