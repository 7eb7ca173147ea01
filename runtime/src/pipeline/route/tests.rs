//! Issue orders over many plans: on every channel, the sends one rank issues to another come in
//! the order the other issues the receives, and the whole run completes when operations match the
//! way NCCL matches them (by issue order per channel and pair of ranks, tags ignored); on one
//! shared channel it does not.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use stagehand_contract::{Channel, P2pOp, StagePlan};

use super::*;
use crate::schedule::tests::plan;
use crate::schedule::{validate, RankActions, Schedule};
use Action::{Backward as B, Forward as F, Step};
use Message::{Activation as A, Gradient as G, Target as T};

/// Every rank's actions over `iterations`, as the runtime derives them ([`RankActions`]): GPipe
/// and 1F1B repeat one iteration's lists with shifted microbatches, PipeDream runs one long
/// stream; whole, in one chunk.
fn run_actions(
    p: &StagePlan,
    schedule: Schedule,
    microbatches: usize,
    iterations: usize,
) -> Vec<Vec<Action>> {
    run_chunks(p, schedule, microbatches, iterations, None, iterations)
        .into_iter()
        .map(|chunks| chunks.concat())
        .collect()
}

/// Every rank's chunks of actions: GPipe's and 1F1B's of `chunk` iterations, PipeDream's of
/// about `chunk` (cut from segments of `segment` iterations, or from the whole run).
fn run_chunks(
    p: &StagePlan,
    schedule: Schedule,
    microbatches: usize,
    iterations: usize,
    segment: Option<usize>,
    chunk: usize,
) -> Vec<Vec<Vec<Action>>> {
    (0..p.world_size)
        .map(|rank| {
            RankActions::new(p, schedule, rank, microbatches, (0, iterations), segment, chunk)
                .unwrap()
                .map(|chunk| chunk.unwrap().actions)
                .collect()
        })
        .collect()
}

fn to(peer: usize, message: Message) -> Transfer {
    Transfer { message, peer }
}

/// What one rank does that involves other ranks, in order.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    /// Issue an operation; it completes when matched.
    Issue(P2pOp, Transfer),
    /// Wait until these receives have completed.
    Await(Vec<Transfer>),
    /// Wait until every send issued so far has completed (the step waits on them).
    SendsDone,
    /// Meet the stage's other replicas (the gradient all-reduce).
    Collective,
}

/// A rank's run as the executor issues it: the shape headers at start, then `program`.
fn items(route: &Route, program: Vec<Op>) -> Vec<Item> {
    let mut items = Vec::new();
    for source in route.header_sources() {
        items.push(Item::Issue(P2pOp::Recv, source));
        items.push(Item::Await(vec![source]));
    }
    for destination in route.header_destinations() {
        items.push(Item::Issue(P2pOp::Send, destination));
    }
    items.push(Item::SendsDone);
    for op in program {
        match op {
            Op::Recv(t) => items.push(Item::Issue(P2pOp::Recv, t)),
            Op::Send(t) => items.push(Item::Issue(P2pOp::Send, t)),
            Op::Run(action @ (F(_) | B(_))) => items.push(Item::Await(route.receives(action))),
            Op::Run(Step) => items.extend([Item::SendsDone, Item::Collective]),
        }
    }
    items
}

/// How a rank turns its actions into operations: [`Route::program`], or a variant to compare.
type Programmer = fn(&Route, &[Action]) -> Vec<Op>;

/// Every rank's items for a plan run.
fn all_items_by(
    p: &StagePlan,
    schedule: Schedule,
    microbatches: usize,
    iterations: usize,
    programmer: Programmer,
) -> Vec<Vec<Item>> {
    run_actions(p, schedule, microbatches, iterations)
        .iter()
        .enumerate()
        .map(|(rank, actions)| {
            let route = Route::new(p, p.stage_of_rank(rank).id, microbatches);
            items(&route, programmer(&route, actions))
        })
        .collect()
}

fn all_items(p: &StagePlan, schedule: Schedule, microbatches: usize, iterations: usize) -> Vec<Vec<Item>> {
    all_items_by(p, schedule, microbatches, iterations, |route, actions| {
        route.program(actions)
    })
}

/// Every rank's items for a plan run a program per chunk of one iteration (PipeDream's cut from
/// segments of `segment` iterations, or from one stream).
fn chunked_items(
    p: &StagePlan,
    schedule: Schedule,
    microbatches: usize,
    iterations: usize,
    segment: Option<usize>,
) -> Vec<Vec<Item>> {
    run_chunks(p, schedule, microbatches, iterations, segment, 1)
        .iter()
        .enumerate()
        .map(|(rank, chunks)| {
            assert_eq!(chunks.len(), iterations, "{schedule}: one chunk an iteration");
            let route = Route::new(p, p.stage_of_rank(rank).id, microbatches);
            let program = chunks.iter().flat_map(|c| route.program(c)).collect();
            items(&route, program)
        })
        .collect()
}

/// Per (channel, sender, receiver): the messages the sender sends and the receiver receives.
type Sides = BTreeMap<(Channel, usize, usize), (Vec<Message>, Vec<Message>)>;

fn sides(items: &[Vec<Item>], channel_of: fn(Message) -> Channel) -> Sides {
    let mut sides = Sides::new();
    for (rank, items) in items.iter().enumerate() {
        for item in items {
            if let Item::Issue(op, t) = item {
                let c = channel_of(t.message);
                match op {
                    P2pOp::Send => sides.entry((c, rank, t.peer)).or_default().0.push(t.message),
                    P2pOp::Recv => sides.entry((c, t.peer, rank)).or_default().1.push(t.message),
                }
            }
        }
    }
    sides
}

/// Runs every rank's items with NCCL's matching: per channel and pair of ranks, each rank's
/// operations with the other form one queue in issue order, and the heads of the two queues
/// complete together when they are a send and the receive of the same message. Once both heads
/// are something else, that pair is stuck for good. Ranks wait on receives, on their sends
/// before a step, and on their replicas at a step; any interleaving of the ranks gives the same
/// outcome, so advancing them in rank order is enough.
fn run_fifo(p: &StagePlan, items: &[Vec<Item>], channel_of: fn(Message) -> Channel) -> Result<(), String> {
    let world = items.len();
    let mut pc = vec![0usize; world];
    let mut queues: HashMap<(Channel, usize, usize), VecDeque<(P2pOp, Message)>> = HashMap::new();
    let mut received: HashSet<(usize, usize, Message)> = HashSet::new();
    let mut unsent = vec![0usize; world];
    let mut collectives = vec![0usize; world];
    loop {
        let mut moved = false;
        for rank in 0..world {
            while let Some(item) = items[rank].get(pc[rank]) {
                let ready = match item {
                    Item::Issue(op, t) => {
                        let queue = queues.entry((channel_of(t.message), rank, t.peer)).or_default();
                        queue.push_back((*op, t.message));
                        unsent[rank] += usize::from(*op == P2pOp::Send);
                        true
                    }
                    Item::Await(needs) => needs
                        .iter()
                        .all(|t| received.contains(&(rank, t.peer, t.message))),
                    Item::SendsDone => unsent[rank] == 0,
                    Item::Collective => {
                        let stage = p.stage_of_rank(rank);
                        let mine = collectives[rank];
                        let all = stage.ranks.iter().all(|&q| {
                            collectives[q] > mine
                                || collectives[q] == mine
                                    && matches!(items[q].get(pc[q]), Some(Item::Collective))
                        });
                        if all {
                            collectives[rank] += 1;
                        }
                        all
                    }
                };
                if !ready {
                    break;
                }
                pc[rank] += 1;
                moved = true;
            }
        }
        let keys: Vec<_> = queues.keys().copied().filter(|(_, a, b)| a < b).collect();
        for (c, a, b) in keys {
            loop {
                let heads = (
                    queues[&(c, a, b)].front().copied(),
                    queues.get(&(c, b, a)).and_then(|q| q.front().copied()),
                );
                let (Some(x), Some(y)) = heads else { break };
                let (sender, receiver) = match (x, y) {
                    ((P2pOp::Send, m), (P2pOp::Recv, n)) if m == n => (a, b),
                    ((P2pOp::Recv, m), (P2pOp::Send, n)) if m == n => (b, a),
                    _ => {
                        return Err(format!(
                            "on the {c:?} channel rank {a} issues {x:?} while rank {b} issues {y:?}"
                        ))
                    }
                };
                queues.get_mut(&(c, a, b)).unwrap().pop_front();
                queues.get_mut(&(c, b, a)).unwrap().pop_front();
                received.insert((receiver, sender, x.1));
                unsent[sender] -= 1;
                moved = true;
            }
        }
        if !moved {
            let stuck: Vec<_> = (0..world)
                .filter(|&r| pc[r] < items[r].len())
                .map(|r| (r, items[r][pc[r]].clone()))
                .collect();
            if stuck.is_empty() && queues.values().all(VecDeque::is_empty) {
                return Ok(());
            }
            return Err(format!("stuck: {stuck:?}"));
        }
    }
}

/// Plans that exercise replicas (even and uneven), depths and long pipelines.
fn plans() -> Vec<(StagePlan, &'static str)> {
    vec![
        (plan(&[1, 1], None), "[1, 1]"),
        (plan(&[1, 1, 1], None), "[1, 1, 1]"),
        (plan(&[1, 1, 1, 1], None), "[1, 1, 1, 1]"),
        (plan(&[2, 1], None), "[2, 1]"),
        (plan(&[3, 1], None), "[3, 1]"),
        (plan(&[1, 2], None), "[1, 2]"),
        (plan(&[1, 3], None), "[1, 3]"),
        (plan(&[2, 1, 2], None), "[2, 1, 2]"),
        (plan(&[4, 2], None), "[4, 2]"),
        (plan(&[2, 3], None), "[2, 3]"),
        (plan(&[2, 2, 1, 1], None), "[2, 2, 1, 1]"),
        (plan(&[3, 2, 1], None), "[3, 2, 1]"),
        (plan(&[1, 1, 3], None), "[1, 1, 3]"),
        (plan(&[1, 1, 1], Some(&[1, 1, 1])), "[1, 1, 1] depth 1"),
        (plan(&[2, 1, 1], Some(&[4, 1, 2])), "[2, 1, 1] depths 4 1 2"),
    ]
}

const SCHEDULES: [Schedule; 3] = [Schedule::GPipe, Schedule::OneFOneB, Schedule::PipeDream];

#[test]
fn receives_are_posted_as_soon_as_their_buffers_can_be() {
    // The middle of three stages under 1F1B: the next forward's input right after a forward,
    // a microbatch's gradient right after its forward, each send right after its action.
    let p = plan(&[1, 1, 1], None);
    let actions = run_actions(&p, Schedule::OneFOneB, 3, 1);
    assert_eq!(actions[1], [F(0), F(1), B(0), F(2), B(1), B(2), Step]);
    assert_eq!(
        Route::new(&p, 1, 3).program(&actions[1]),
        [
            Op::Recv(to(0, A(0))),
            Op::Recv(to(0, T(0))),
            Op::Run(F(0)),
            Op::Send(to(2, A(0))),
            Op::Send(to(2, T(0))),
            Op::Recv(to(2, G(0))),
            Op::Recv(to(0, A(1))),
            Op::Recv(to(0, T(1))),
            Op::Run(F(1)),
            Op::Send(to(2, A(1))),
            Op::Send(to(2, T(1))),
            Op::Recv(to(2, G(1))),
            Op::Recv(to(0, A(2))),
            Op::Recv(to(0, T(2))),
            Op::Run(B(0)),
            Op::Send(to(0, G(0))),
            Op::Run(F(2)),
            Op::Send(to(2, A(2))),
            Op::Send(to(2, T(2))),
            Op::Recv(to(2, G(2))),
            Op::Run(B(1)),
            Op::Send(to(0, G(1))),
            Op::Run(B(2)),
            Op::Send(to(0, G(2))),
            Op::Run(Step),
        ]
    );
}

#[test]
fn owners_follow_the_microbatch_index_within_its_iteration() {
    // Three replicas, four microbatches: global microbatch 4 is index 0 of iteration 1, so rank 0
    // of stage 0 owns it, not rank 1 as a global round-robin would say.
    let p = plan(&[3, 1], None);
    let route = Route::new(&p, 1, 4);
    assert_eq!(route.receives(F(4)), [to(0, A(4)), to(0, T(4))]);
    assert_eq!(route.receives(F(7)), [to(0, A(7)), to(0, T(7))]);
    assert_eq!(route.sends(B(5)), [to(1, G(5))]);
    assert_eq!(
        route.header_sources(),
        [
            to(0, Message::Header),
            to(1, Message::Header),
            to(2, Message::Header)
        ]
    );
    assert!(route.header_destinations().is_empty());
    assert!(
        route.sends(F(4)).is_empty(),
        "the last stage sends nothing downstream"
    );
}

#[test]
fn each_replica_ends_an_iteration_with_its_last_microbatch_of_it() {
    for (p, name) in plans() {
        for microbatches in 1..=7 {
            for stage in &p.stages {
                if microbatches < stage.ranks.len() {
                    continue;
                }
                let route = Route::new(&p, stage.id, microbatches);
                for iteration in 0..3 {
                    let range = iteration * microbatches..(iteration + 1) * microbatches;
                    for &rank in &stage.ranks {
                        let mine: Vec<usize> = range
                            .clone()
                            .filter(|&g| route.owner(stage.id, g) == rank)
                            .collect();
                        let ends: Vec<usize> = mine
                            .iter()
                            .copied()
                            .filter(|&g| route.ends_iteration(g))
                            .collect();
                        assert_eq!(
                            ends,
                            [*mine.last().unwrap()],
                            "{name} m={microbatches} stage {} rank {rank}",
                            stage.id
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn on_every_channel_sends_and_receives_between_two_ranks_come_in_one_order() {
    let mut checked = 0;
    for (p, name) in plans() {
        for schedule in SCHEDULES {
            for microbatches in 1..=6 {
                if validate(&p, schedule, microbatches).is_err() {
                    continue;
                }
                let what = format!("{name} {schedule} m={microbatches}");
                let iterations = 2;
                let sides = sides(
                    &all_items(&p, schedule, microbatches, iterations),
                    Message::channel,
                );
                for ((channel, sender, receiver), (sent, received)) in &sides {
                    assert_eq!(
                        sent, received,
                        "{what}: {channel:?} channel from rank {sender} to rank {receiver}"
                    );
                    let backwards = sides.contains_key(&(*channel, *receiver, *sender));
                    assert!(
                        !backwards,
                        "{what}: {channel:?} channel carries both ways between {sender} and {receiver}"
                    );
                }
                // Every boundary carries a header per pair of ranks and each microbatch's
                // activation and target downstream, and its gradient upstream.
                let total = iterations * microbatches;
                for s in 1..p.stages.len() {
                    let (up, down) = (&p.stages[s - 1].ranks, &p.stages[s].ranks);
                    let count = |channel: Channel| -> usize {
                        sides
                            .iter()
                            .filter(|((c, a, b), _)| {
                                *c == channel
                                    && (up.contains(a) && down.contains(b)
                                        || up.contains(b) && down.contains(a))
                            })
                            .map(|(_, (sent, _))| sent.len())
                            .sum()
                    };
                    assert_eq!(
                        count(Channel::Forward),
                        up.len() * down.len() + 2 * total,
                        "{what}"
                    );
                    assert_eq!(count(Channel::Backward), total, "{what}");
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 80, "only {checked} combinations were valid");
}

/// Whole, and as the executor runs it, a program per chunk of one iteration: drained chunks
/// (GPipe's, 1F1B's, PipeDream's segments of one iteration), where a receive of the next chunk's
/// first forward is posted only once that chunk starts, and PipeDream's stream cut as it goes.
#[test]
fn every_plan_completes_when_operations_match_by_issue_order() {
    for (p, name) in plans() {
        for schedule in SCHEDULES {
            for microbatches in 1..=6 {
                if validate(&p, schedule, microbatches).is_err() {
                    continue;
                }
                let items = all_items(&p, schedule, microbatches, 2);
                if let Err(stuck) = run_fifo(&p, &items, Message::channel) {
                    panic!("{name} {schedule} m={microbatches}: {stuck}");
                }
                let items = chunked_items(&p, schedule, microbatches, 3, Some(1));
                if let Err(stuck) = run_fifo(&p, &items, Message::channel) {
                    panic!("{name} {schedule} m={microbatches}, a chunk an iteration: {stuck}");
                }
                if schedule == Schedule::PipeDream {
                    // Cut right after a forward, a stream's chunks issue what the whole does.
                    let chunked = chunked_items(&p, schedule, microbatches, 4, None);
                    let whole = all_items(&p, schedule, microbatches, 4);
                    assert_eq!(chunked, whole, "{name} m={microbatches}: a stream's chunks");
                }
            }
        }
    }
}

#[test]
fn one_channel_for_both_directions_deadlocks() {
    // What the runtime did before: gradients shared the activations' group, and a look-ahead
    // receive of a gradient got between two sends of activations.
    fn shared(_: Message) -> Channel {
        Channel::Forward
    }
    let p = plan(&[1, 1], None);
    for schedule in SCHEDULES {
        let items = all_items(&p, schedule, 4, 1);
        let err = run_fifo(&p, &items, shared).unwrap_err();
        assert_eq!(
            err,
            "on the Forward channel rank 0 issues (Recv, Gradient(0)) while rank 1 issues (Recv, Activation(1))",
            "{schedule}"
        );
        assert_eq!(run_fifo(&p, &items, Message::channel), Ok(()), "{schedule}");
    }
}

#[test]
fn posting_receives_only_one_action_ahead_hangs_replicated_pipedream() {
    // The runtime's earlier policy: an action's receives posted while the action before it
    // runs. Stage 0's replicas step together after every backward and wait for their sends
    // first; stage 1 takes microbatch 5 from rank 2 only after stepping on microbatch 3, whose
    // gradient rank 0 posts only after the collective step rank 2 cannot reach.
    fn one_ahead(route: &Route, actions: &[Action]) -> Vec<Op> {
        let mut ops = Vec::new();
        for (index, &action) in actions.iter().enumerate() {
            let from = if index == 0 { 0 } else { index + 1 };
            for &later in actions.iter().take(index + 2).skip(from) {
                ops.extend(route.receives(later).into_iter().map(Op::Recv));
            }
            ops.push(Op::Run(action));
            ops.extend(route.sends(action).into_iter().map(Op::Send));
        }
        ops
    }
    let p = plan(&[3, 1], None);
    let items = all_items(&p, Schedule::PipeDream, 6, 2);
    assert_eq!(run_fifo(&p, &items, Message::channel), Ok(()));
    let items = all_items_by(&p, Schedule::PipeDream, 6, 2, one_ahead);
    let err = run_fifo(&p, &items, Message::channel).unwrap_err();
    assert_eq!(
        err,
        "stuck: [(0, Collective), (1, Collective), (2, SendsDone), (3, SendsDone)]"
    );
}

#[test]
fn the_model_catches_a_receive_order_that_differs_from_the_send_order() {
    let p = plan(&[1, 1], None);
    let mut items = all_items(&p, Schedule::GPipe, 2, 1);
    // Rank 1 posts microbatch 1's activation before microbatch 0's.
    let first = items[1]
        .iter()
        .position(|i| matches!(i, Item::Issue(P2pOp::Recv, t) if t.message == A(0)))
        .unwrap();
    let second = items[1]
        .iter()
        .position(|i| matches!(i, Item::Issue(P2pOp::Recv, t) if t.message == A(1)))
        .unwrap();
    items[1].swap(first, second);
    let err = run_fifo(&p, &items, Message::channel).unwrap_err();
    assert!(
        err.contains("Activation(0)") && err.contains("Activation(1)"),
        "{err}"
    );
}

/// A validation pass after every chunk (`--validate-every 1`: a chunk an iteration, PipeDream's
/// segments drained at each): [`Route::forward_program`] over each rank's own microbatches of
/// two minibatches, then the wait for its sends and the last stage's sum over its replicas. The
/// whole run completes with NCCL's matching on every plan, schedule and microbatch count. (The
/// passes' microbatches are numbered from a multiple of the iteration's far past training's
/// here, where the model keeps every message it matched; the executor keeps a pass's apart.)
#[test]
fn validation_passes_between_chunks_complete_when_operations_match_by_issue_order() {
    for (p, name) in plans() {
        for schedule in SCHEDULES {
            for microbatches in 1..=6 {
                if validate(&p, schedule, microbatches).is_err() {
                    continue;
                }
                let chunks = run_chunks(&p, schedule, microbatches, 3, Some(1), 1);
                let items: Vec<Vec<Item>> = chunks
                    .iter()
                    .enumerate()
                    .map(|(rank, chunks)| {
                        let stage = p.stage_of_rank(rank).id;
                        let route = Route::new(&p, stage, microbatches);
                        let mut program = Vec::new();
                        for (pass, chunk) in chunks.iter().enumerate() {
                            program.extend(route.program(chunk));
                            let first = (pass + 1) * 1000 * microbatches;
                            let mine: Vec<usize> = (first..first + 2 * microbatches)
                                .filter(|&g| route.owner(stage, g) == rank)
                                .collect();
                            assert!(!mine.is_empty(), "{name}: every rank runs some of a pass");
                            program.extend(route.forward_program(&mine));
                            program.push(Op::Run(Step));
                        }
                        items(&route, program)
                    })
                    .collect();
                if let Err(stuck) = run_fifo(&p, &items, Message::channel) {
                    panic!("{name} {schedule} m={microbatches}, a pass after each chunk: {stuck}");
                }
            }
        }
    }
}
