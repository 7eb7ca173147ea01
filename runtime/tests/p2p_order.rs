//! Point-to-point order as NCCL needs it, checked on real ranks over gloo: with `--trace` every
//! rank prints its operations in issue order, and on every channel the sends one rank issues to
//! another must be, one for one, the receives the other issues (NCCL ignores tags and pairs them
//! by that order).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use stagehand_contract::{Channel, Event, P2p, P2pOp, P2pTensor, StageConfig};

use crate::util::{assert_every_rank_succeeded, run_ranks, Run};

const LIMIT: Duration = Duration::from_secs(120);

/// The small MLP of distributed.rs (modules layers.0..3, head, loss), without --batch-size.
const MLP: &str =
    "--model mlp --layers 4 --hidden 64 --image-size 8 --threads 1 --seed 3 --iterations 2 --trace";

/// What a message is: the validation pass it belongs to (the iteration the pass followed;
/// `None` for training's), its kind and its microbatch.
type Content = (Option<u64>, P2pTensor, Option<u64>);

/// One rank's operations with one peer on one channel, as (op, content), in issue order.
type Lane = Vec<(P2pOp, Content)>;

/// Per (channel, sender, receiver): what the sender sent and what the receiver received.
type Pairs = BTreeMap<(Channel, usize, usize), (Vec<Content>, Vec<Content>)>;

/// Every rank's `p2p` events, checked to be its own and numbered consecutively per
/// (channel, op, peer), grouped by (channel, rank, peer).
fn lanes(what: &str, runs: &[Run]) -> BTreeMap<(Channel, usize, usize), Lane> {
    let mut lanes: BTreeMap<(Channel, usize, usize), Lane> = BTreeMap::new();
    let mut next_seq: BTreeMap<(usize, Channel, P2pOp, usize), u64> = BTreeMap::new();
    assert_every_rank_succeeded(what, runs);
    for (rank, run) in runs.iter().enumerate() {
        for event in &run.events {
            let Event::P2p(P2p {
                rank: from,
                op,
                peer,
                channel,
                seq,
                tensor,
                microbatch,
                validation,
                ..
            }) = *event
            else {
                continue;
            };
            assert_eq!(from, rank, "{what}: rank {rank} printed an event of rank {from}");
            let next = next_seq.entry((rank, channel, op, peer)).or_default();
            assert_eq!(
                seq, *next,
                "{what}: rank {rank}'s {op:?} with {peer} on {channel:?}"
            );
            *next += 1;
            let expected = match tensor {
                P2pTensor::Header | P2pTensor::Activation | P2pTensor::Target => Channel::Forward,
                P2pTensor::Gradient => Channel::Backward,
            };
            assert_eq!(channel, expected, "{what}: {event:?}");
            lanes
                .entry((channel, rank, peer))
                .or_default()
                .push((op, (validation, tensor, microbatch)));
        }
    }
    lanes
}

/// For every channel and ordered pair of ranks: the sender's sends to the receiver, as content
/// in issue order, and the receiver's receives from the sender. Asserts that each lane carries
/// one op only (a channel is one-way between two ranks).
fn directions(what: &str, lanes: &BTreeMap<(Channel, usize, usize), Lane>) -> Pairs {
    let mut pairs = Pairs::new();
    for (&(channel, rank, peer), lane) in lanes {
        let ops: BTreeSet<P2pOp> = lane.iter().map(|(op, _)| *op).collect();
        assert_eq!(
            ops.len(),
            1,
            "{what}: rank {rank} both sends to and receives from {peer} on {channel:?}"
        );
        let contents = lane.iter().map(|(_, c)| *c).collect();
        match lane[0].0 {
            P2pOp::Send => pairs.entry((channel, rank, peer)).or_default().0 = contents,
            P2pOp::Recv => pairs.entry((channel, peer, rank)).or_default().1 = contents,
        }
    }
    pairs
}

/// Runs one process per rank of `stage_config` with `args`; checks the pairing on every channel
/// and that each stage boundary carried every microbatch's activation, target and gradient once,
/// and each validation pass in `passes` (by the iteration it followed) the activations and
/// targets of its own `microbatches` (numbered from 0), and no gradient.
fn check(what: &str, stage_config: &str, args: &str, microbatches: u64, passes: &[u64]) {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("stages.json");
    std::fs::write(&path, stage_config).unwrap();
    let config = StageConfig::from_json(stage_config).unwrap();
    let world = config.stage_to_rank_map.values().map(Vec::len).sum();
    let plan = config.validate(6, world).unwrap();
    let args: Vec<&str> = MLP
        .split_whitespace()
        .chain(args.split_whitespace())
        .chain(["--stage-config", path.to_str().unwrap()])
        .collect();
    let runs = run_ranks(world, &args, LIMIT);
    let pairs = directions(what, &lanes(what, &runs));
    for ((channel, sender, receiver), (sent, received)) in &pairs {
        assert_eq!(
            sent, received,
            "{what}: on the {channel:?} channel, rank {sender}'s sends to rank {receiver} (left) and its receives (right)"
        );
    }
    let total = 2 * microbatches;
    for s in 1..plan.stages.len() {
        let (up, down) = (&plan.stages[s - 1].ranks, &plan.stages[s].ranks);
        let across = |channel: Channel, from: &Vec<usize>, to: &Vec<usize>| -> Vec<Content> {
            let mut contents: Vec<Content> = pairs
                .iter()
                .filter(|((c, a, b), _)| *c == channel && from.contains(a) && to.contains(b))
                .flat_map(|(_, (sent, _))| sent.iter().copied())
                .collect();
            contents.sort();
            contents
        };
        let carried = |pass: Option<u64>, g: u64| {
            [
                (pass, P2pTensor::Activation, Some(g)),
                (pass, P2pTensor::Target, Some(g)),
            ]
        };
        let mut forward: Vec<Content> = vec![(None, P2pTensor::Header, None); up.len() * down.len()];
        forward.extend((0..total).flat_map(|g| carried(None, g)));
        for &pass in passes {
            forward.extend((0..microbatches).flat_map(|g| carried(Some(pass), g)));
        }
        forward.sort();
        let backward: Vec<Content> = (0..total).map(|g| (None, P2pTensor::Gradient, Some(g))).collect();
        assert_eq!(
            across(Channel::Forward, up, down),
            forward,
            "{what}: into stage {s}"
        );
        assert_eq!(
            across(Channel::Backward, down, up),
            backward,
            "{what}: out of stage {s}"
        );
        assert!(
            across(Channel::Forward, down, up).is_empty(),
            "{what}: downstream traffic going up"
        );
        assert!(
            across(Channel::Backward, up, down).is_empty(),
            "{what}: gradients going down"
        );
    }
}

const TWO: &str = r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#;
const THREE: &str =
    r#"{"module_to_stage_map": [0,0,1,1,2,2], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2]}}"#;
const FOUR: &str = r#"{"module_to_stage_map": [0,0,1,2,3,3], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2], "3": [3]}}"#;
/// Stage 0 on three replicas.
const THREE_ONE: &str =
    r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1,2], "1": [3]}}"#;

#[test]
fn every_schedule_sends_in_the_order_its_peers_receive_on_2_3_and_4_stages() {
    for schedule in ["gpipe", "1f1b", "pipedream"] {
        for (name, config) in [("2 stages", TWO), ("3 stages", THREE), ("4 stages", FOUR)] {
            let what = format!("{schedule}, {name}");
            let args = format!("--schedule {schedule} --microbatches 4 --batch-size 16");
            check(&what, config, &args, 4, &[]);
        }
    }
}

#[test]
fn replicated_stages_send_in_the_order_their_peers_receive() {
    // GPipe and 1F1B with four microbatches on three replicas: the owners' round-robin restarts
    // every iteration. PipeDream needs a multiple of three, and stepped its replicas into a hang
    // when receives were posted only one action ahead.
    for schedule in ["gpipe", "1f1b"] {
        let args = format!("--schedule {schedule} --microbatches 4 --batch-size 16");
        check(
            &format!("{schedule}, stage 0 on 3 replicas"),
            THREE_ONE,
            &args,
            4,
            &[],
        );
    }
    let args = "--schedule pipedream --microbatches 6 --batch-size 24";
    check("pipedream, stage 0 on 3 replicas", THREE_ONE, args, 6, &[]);
}

/// A validation pass after every iteration sends its own activations and targets between the
/// iterations, each operation marked with the pass: the iterations' operations stay exactly the
/// schedule's, each pass's are its own microbatches', and the sequence numbers run on through
/// both, pairing sends with receives as NCCL does.
#[test]
fn validation_passes_transfers_are_marked_as_theirs_and_the_iterations_stay_the_schedules() {
    for (schedule, stages, config) in [("1f1b", "2 stages", TWO), ("pipedream", "3 stages", THREE)] {
        let args = format!(
            "--schedule {schedule} --microbatches 4 --batch-size 16 --validate-every 1 --validation-batches 1"
        );
        check(
            &format!("{schedule}, {stages}, validating"),
            config,
            &args,
            4,
            &[0, 1],
        );
    }
}

/// A run resumed where a pass is due makes that pass before training: the shape headers its
/// start sent stay unmarked, printed before the pass's own operations, which are marked.
#[test]
fn a_pass_that_starts_a_resumed_run_leaves_the_shape_headers_unmarked() {
    let tmp = tempfile::tempdir().unwrap();
    let config = crate::util::two_stages(tmp.path());
    let ckpt = tmp.path().join("ckpt");
    let mut args: Vec<&str> = MLP.split_whitespace().collect();
    args.extend([
        "--schedule",
        "1f1b",
        "--microbatches",
        "4",
        "--batch-size",
        "16",
        "--validate-every",
        "2",
        "--validation-batches",
        "1",
        "--stage-config",
        &config,
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]);
    crate::util::run_ranks_ok(2, &args, LIMIT, "the first 2 iterations");
    let resumed = crate::distributed::with_value(&args, "--iterations", "4");
    let resumed = [&resumed[..], &["--resume"]].concat();
    let runs = crate::util::run_ranks_ok(2, &resumed, LIMIT, "resumed to 4");
    for (rank, run) in runs.iter().enumerate() {
        let ops: Vec<&P2p> = run
            .events
            .iter()
            .filter_map(|e| match e {
                Event::P2p(op) => Some(op),
                _ => None,
            })
            .collect();
        let header = ops
            .iter()
            .position(|op| op.tensor == P2pTensor::Header)
            .unwrap_or_else(|| panic!("rank {rank}: no shape header: {ops:?}"));
        assert_eq!(ops[header].validation, None, "rank {rank}: {ops:?}");
        // The pass after iteration 1 (of the run resumed at 2) comes first, then iteration 3's.
        assert_eq!(ops[header + 1].validation, Some(1), "rank {rank}: {ops:?}");
        assert!(
            ops.iter().any(|op| op.validation == Some(3)),
            "rank {rank}: {ops:?}"
        );
    }
}
