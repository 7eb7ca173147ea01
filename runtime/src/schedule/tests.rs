//! Schedules as action lists: exact orders for small pipelines, and properties (every
//! microbatch forward then backward once, bounded in-flight work, deadlock freedom) over many
//! plans, checked by an executor independent of the simulation.

use std::collections::BTreeSet;

use stagehand_contract::{Stage, StagePlan};

use super::*;
use Action::{Backward as B, Forward as F, Step};

/// A plan with `replicas[s]` ranks on stage `s`, ranks numbered stage by stage (also used by
/// route.rs's tests).
pub(crate) fn plan(replicas: &[usize], depths: Option<&[usize]>) -> StagePlan {
    let mut next = 0;
    let stages = replicas
        .iter()
        .enumerate()
        .map(|(id, &n)| {
            let ranks = (next..next + n).collect();
            next += n;
            Stage {
                id,
                modules: id..id + 1,
                ranks,
                depth: depths.map(|d| d[id]),
                device_parts: None,
                bundles: None,
            }
        })
        .collect();
    StagePlan {
        stages,
        world_size: next,
    }
}

#[test]
fn gpipe_runs_all_forwards_then_all_backwards() {
    let t = timeline(&plan(&[1, 1], None), Schedule::GPipe, 3).unwrap();
    for rank in 0..2 {
        assert_eq!(t.actions[rank], [F(0), F(1), F(2), B(0), B(1), B(2), Step]);
    }
}

#[test]
fn one_f_one_b_warms_up_then_alternates() {
    let t = timeline(&plan(&[1, 1], None), Schedule::OneFOneB, 4).unwrap();
    assert_eq!(
        t.actions[0],
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3), Step]
    );
    assert_eq!(
        t.actions[1],
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), Step]
    );
}

#[test]
fn pipedream_steps_after_every_backward_and_never_flushes() {
    let t = timeline(&plan(&[1, 1], None), Schedule::PipeDream, 3).unwrap();
    assert_eq!(
        t.actions[0],
        [F(0), F(1), B(0), Step, F(2), B(1), Step, B(2), Step]
    );
    assert_eq!(
        t.actions[1],
        [F(0), B(0), Step, F(1), B(1), Step, F(2), B(2), Step]
    );
}

#[test]
fn depth_one_makes_pipedream_synchronous() {
    let t = timeline(&plan(&[1, 1, 1], Some(&[1, 1, 1])), Schedule::PipeDream, 2).unwrap();
    for rank in 0..3 {
        assert_eq!(t.actions[rank], [F(0), B(0), Step, F(1), B(1), Step]);
    }
}

#[test]
fn replicas_take_microbatches_round_robin() {
    let p = plan(&[3, 1], None);
    let t = timeline(&p, Schedule::GPipe, 6).unwrap();
    assert_eq!(t.actions[0], [F(0), F(3), B(0), B(3), Step]);
    assert_eq!(t.actions[2], [F(2), F(5), B(2), B(5), Step]);
    assert_eq!(t.actions[3].len(), 13);
    assert_eq!(rank_for(&p, 0, 4), 1);
    assert_eq!(rank_for(&p, 1, 4), 3);
}

/// Runs the lists with blocking semantics in any interleaving: repeatedly advance any rank whose
/// next action's inputs exist. Independent of the simulation's time steps.
fn executes(p: &StagePlan, t: &Timeline) -> bool {
    use std::collections::HashSet;
    let mut pos = vec![0usize; p.world_size];
    let mut fwd: HashSet<(usize, usize)> = HashSet::new();
    let mut bwd: HashSet<(usize, usize)> = HashSet::new();
    let mut steps = vec![0usize; p.world_size];
    let stage_of = |r: usize| p.stage_of_rank(r).id;
    loop {
        let mut moved = false;
        for rank in 0..p.world_size {
            let Some(&action) = t.actions[rank].get(pos[rank]) else {
                continue;
            };
            let s = stage_of(rank);
            let ok = match action {
                F(g) => s == 0 || fwd.contains(&(s - 1, g)),
                B(g) => fwd.contains(&(s, g)) && (s + 1 == p.stages.len() || bwd.contains(&(s + 1, g))),
                // A step is a collective among the stage's replicas: all must have reached it.
                Step => p.stages[s].ranks.iter().all(|&q| {
                    steps[q] > steps[rank]
                        || t.actions[q].get(pos[q]) == Some(&Step) && steps[q] == steps[rank]
                }),
            };
            if ok {
                match action {
                    F(g) => drop(fwd.insert((s, g))),
                    B(g) => drop(bwd.insert((s, g))),
                    Step => steps[rank] += 1,
                }
                pos[rank] += 1;
                moved = true;
            }
        }
        if !moved {
            return (0..p.world_size).all(|r| pos[r] == t.actions[r].len())
                && (0..t.microbatches).all(|g| bwd.contains(&(0, g)));
        }
    }
}

#[test]
fn every_plan_completes_with_bounded_in_flight_work() {
    let shapes: &[&[usize]] = &[
        &[1],
        &[4],
        &[1, 1],
        &[1, 1, 1, 1],
        &[3, 1],
        &[1, 3],
        &[2, 1, 2],
        &[4, 2],
        &[2, 2, 1, 1],
    ];
    for &shape in shapes {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB, Schedule::PipeDream] {
            for microbatches in [4, 8, 12] {
                let p = plan(shape, None);
                if validate(&p, schedule, microbatches).is_err() {
                    continue;
                }
                let t = timeline(&p, schedule, microbatches).unwrap();
                assert!(
                    executes(&p, &t),
                    "{shape:?} {schedule} m={microbatches} does not run"
                );
                for (rank, actions) in t.actions.iter().enumerate() {
                    let s = p.stage_of_rank(rank).id;
                    let mine: Vec<usize> = (0..microbatches)
                        .filter(|&g| rank_for(&p, s, g) == rank)
                        .collect();
                    let forwards: Vec<usize> = actions
                        .iter()
                        .filter_map(|a| if let F(g) = a { Some(*g) } else { None })
                        .collect();
                    let backwards: Vec<usize> = actions
                        .iter()
                        .filter_map(|a| if let B(g) = a { Some(*g) } else { None })
                        .collect();
                    assert_eq!(forwards, mine, "{shape:?} {schedule} rank {rank}");
                    assert_eq!(backwards, mine, "{shape:?} {schedule} rank {rank}");
                    let steps = actions.iter().filter(|a| **a == Step).count();
                    let expected_steps = if schedule == Schedule::PipeDream {
                        mine.len()
                    } else {
                        1
                    };
                    assert_eq!(steps, expected_steps, "{shape:?} {schedule} rank {rank}");
                    if schedule != Schedule::GPipe {
                        let mut in_flight = 0usize;
                        for a in actions {
                            match a {
                                F(_) => in_flight += 1,
                                B(_) => in_flight -= 1,
                                Step => {}
                            }
                            assert!(
                                in_flight <= depth(&p, s),
                                "{shape:?} {schedule} rank {rank} exceeds its depth"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn plans_that_cannot_run_are_rejected_with_what_to_change() {
    let p = plan(&[3, 1], None);
    let err = validate(&p, Schedule::OneFOneB, 2).unwrap_err();
    assert_eq!(
        err,
        ScheduleError::TooFewMicrobatches {
            stage: 0,
            replicas: 3,
            microbatches: 2
        }
    );
    assert!(err.to_string().contains("use --microbatches 3 or more"));
    assert_eq!(
        validate(&p, Schedule::PipeDream, 4),
        Err(ScheduleError::UnevenReplicas {
            stage: 0,
            replicas: 3
        })
    );
    assert_eq!(validate(&p, Schedule::GPipe, 4), Ok(()));
    let zero = plan(&[1, 1], Some(&[2, 0]));
    assert_eq!(
        validate(&zero, Schedule::OneFOneB, 4),
        Err(ScheduleError::ZeroDepth { stage: 1 })
    );
}

/// `list` with every microbatch number moved up by `shift`.
fn shifted(list: &[Action], shift: usize) -> Vec<Action> {
    list.iter().map(|a| a.shifted(shift)).collect()
}

/// Every chunk of `actions`, which must all derive.
fn chunks(actions: RankActions) -> Vec<Chunk> {
    actions.map(Result::unwrap).collect()
}

/// The actions of every chunk of `actions`.
fn lists(actions: RankActions) -> Vec<Vec<Action>> {
    chunks(actions).into_iter().map(|c| c.actions).collect()
}

/// GPipe and 1F1B hand out one iteration's list repeated, `chunk` iterations a chunk, from the
/// iteration a run resumes at.
#[test]
fn flushing_schedules_repeat_one_iteration_a_chunk_at_a_time() {
    let p = plan(&[1, 2], None);
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let one = timeline(&p, schedule, 4).unwrap();
        for rank in 0..3 {
            let chunks = chunks(RankActions::new(&p, schedule, rank, 4, (3, 10), None, 3).unwrap());
            let lengths: Vec<usize> = chunks.iter().map(|c| c.actions.len()).collect();
            let per = one.actions[rank].len();
            assert_eq!(
                lengths,
                [3 * per, 3 * per, per],
                "{schedule} rank {rank}: 3, 3 and 1 iterations"
            );
            let whole: Vec<Action> = (3..10)
                .flat_map(|it| shifted(&one.actions[rank], it * 4))
                .collect();
            let actions: Vec<Action> = chunks.iter().flat_map(|c| c.actions.clone()).collect();
            assert_eq!(actions, whole, "{schedule} rank {rank}");
            assert!(
                chunks
                    .iter()
                    .all(|c| c.actions.last() == Some(&Step) && c.stashed.is_empty()),
                "each chunk ends with a step, and no forward spans one"
            );
        }
    }
}

/// With a segment (`--validate-every`, `--checkpoint-every`), a flushing schedule's chunks also
/// end at each of its multiples, where a validation pass runs with nothing received ahead.
#[test]
fn flushing_schedules_end_a_chunk_at_each_segment_end() {
    let p = plan(&[1, 2], None);
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        let per = timeline(&p, schedule, 4).unwrap().actions[0].len();
        let chunks = chunks(RankActions::new(&p, schedule, 0, 4, (3, 13), Some(4), 3).unwrap());
        let iterations: Vec<usize> = chunks.iter().map(|c| c.actions.len() / per).collect();
        // 3 to 4 (a segment ends at 4), 4 to 7, 7 to 8, 8 to 11, 11 to 12, 12 to 13.
        assert_eq!(iterations, [1, 3, 1, 3, 1, 1], "{schedule}");
    }
}

/// PipeDream hands out one drained stream per segment (the first one shorter when a run resumes
/// mid-segment), the whole run as one without a segment.
#[test]
fn pipedream_hands_out_a_drained_stream_per_segment() {
    let p = plan(&[1, 1, 1], None);
    let m = 2;
    // Chunks longer than any segment: one chunk a segment.
    let chunk = 100;
    for rank in 0..3 {
        let stream = |from: usize, to: usize| {
            let t = timeline(&p, Schedule::PipeDream, m * (to - from)).unwrap();
            shifted(&t.actions[rank], from * m)
        };
        let segments =
            lists(RankActions::new(&p, Schedule::PipeDream, rank, m, (3, 14), Some(4), chunk).unwrap());
        let expected = [stream(3, 4), stream(4, 8), stream(8, 12), stream(12, 14)];
        assert_eq!(segments, expected, "rank {rank}");
        let whole = lists(RankActions::new(&p, Schedule::PipeDream, rank, m, (0, 7), None, chunk).unwrap());
        assert_eq!(whole, [stream(0, 7)], "rank {rank}");
    }
    let done = lists(RankActions::new(&p, Schedule::PipeDream, 0, m, (7, 7), Some(4), 1).unwrap());
    assert!(done.is_empty(), "a run resumed at its end has nothing left to do");
}

/// Cut into chunks as the simulation goes, PipeDream's stream is the whole one: each chunk but a
/// segment's last ends right after a forward and holds at least a chunk's worth of resolved
/// forwards, and the forwards that stash are those whose backward comes after a step, whichever
/// chunk it is in.
#[test]
fn pipedream_streams_cut_after_a_forward_and_stash_across_chunks() {
    let plans = [
        plan(&[1, 1], None),
        plan(&[1, 1, 1, 1], None),
        plan(&[2, 1, 2], None),
        plan(&[3, 1], None),
        plan(&[1, 1, 1], Some(&[1, 1, 1])),
        plan(&[2, 1, 1], Some(&[4, 1, 2])),
    ];
    for p in &plans {
        let m = 6;
        let iterations = 5;
        let whole = timeline(p, Schedule::PipeDream, m * iterations).unwrap();
        for rank in 0..p.world_size {
            let what = format!(
                "{:?} rank {rank}",
                p.stages.iter().map(|s| s.ranks.len()).collect::<Vec<_>>()
            );
            let per_iteration = m / p.stage_of_rank(rank).ranks.len();
            for chunk in [1, 2] {
                let chunks = chunks(
                    RankActions::new(p, Schedule::PipeDream, rank, m, (0, iterations), None, chunk).unwrap(),
                );
                assert!(chunks.len() > 1, "{what}: the stream is cut");
                let actions: Vec<Action> = chunks.iter().flat_map(|c| c.actions.clone()).collect();
                assert_eq!(actions, whole.actions[rank], "{what}, chunks of {chunk}");
                let stashed: BTreeSet<usize> = chunks.iter().flat_map(|c| c.stashed.clone()).collect();
                assert_eq!(stashed, super::stashed(&whole.actions[rank]), "{what}");
                for (i, c) in chunks.iter().enumerate() {
                    let forwards: BTreeSet<usize> = c
                        .actions
                        .iter()
                        .filter_map(|a| if let F(g) = a { Some(*g) } else { None })
                        .collect();
                    assert!(
                        c.stashed.is_subset(&forwards),
                        "{what}: chunk {i} stashes its own forwards"
                    );
                    if i + 1 < chunks.len() {
                        assert!(
                            matches!(c.actions.last(), Some(F(_))),
                            "{what}: chunk {i} ends with a forward"
                        );
                        assert!(
                            forwards.len() >= chunk * per_iteration,
                            "{what}: chunk {i} is a chunk long"
                        );
                    }
                }
            }
        }
    }
}

/// A simulation holds the completion times of what is in flight, not of the run so far.
#[test]
fn a_simulation_holds_only_what_is_in_flight() {
    for p in [
        plan(&[1, 1, 1, 1], None),
        plan(&[2, 1, 2], None),
        plan(&[2, 1, 1], Some(&[4, 1, 2])),
    ] {
        let in_flight: usize = (0..p.world_size).map(|r| depth(&p, p.stage_of_rank(r).id)).sum();
        let mut simulation = Simulation::new(p.clone(), Schedule::PipeDream, 4000, &[0]);
        let mut most = 0;
        while !simulation.done() {
            simulation.advance().unwrap();
            most = most.max(simulation.fwd_done.len() + simulation.bwd_done.len());
        }
        // A forward's time is kept while its microbatch is in flight at that stage, a backward's
        // while it is at the previous one.
        assert!(
            most <= 2 * in_flight,
            "{most} completion times held, {in_flight} in flight at most"
        );
        assert!(simulation.fwd_done.is_empty() && simulation.bwd_done.is_empty());
        let mine = 4000 / p.stages[0].ranks.len();
        assert_eq!(
            simulation.take(0).len(),
            3 * mine,
            "rank 0's forwards, backwards and steps"
        );
        assert!(simulation.take(1).is_empty(), "rank 1's actions are not kept");
    }
}

/// What a rank holds of its schedule is bounded by a chunk, not by the run: a run of a billion
/// iterations starts at once.
#[test]
fn a_long_run_derives_its_actions_as_it_goes() {
    let p = plan(&[1, 2], None);
    let iterations = 1_000_000_000;
    for (schedule, segment) in [
        (Schedule::OneFOneB, None),
        (Schedule::PipeDream, Some(5)),
        (Schedule::PipeDream, None),
    ] {
        let mut actions =
            RankActions::new(&p, schedule, 1, 4, (2, iterations), segment, CHUNK_ITERATIONS).unwrap();
        let first = actions.next().unwrap().unwrap().actions;
        let forwards: Vec<usize> = first
            .iter()
            .filter_map(|a| match a {
                F(g) => Some(g / 4),
                _ => None,
            })
            .collect();
        let span = (forwards[0], *forwards.last().unwrap());
        // A segment of 5 iterations ends at iteration 5; otherwise a chunk holds 64 iterations'
        // forwards (PipeDream's cut right after them, once they resolved).
        let expected = match segment {
            Some(_) => (2, 4),
            None => (2, 2 + CHUNK_ITERATIONS - 1),
        };
        assert_eq!(span, expected, "{schedule} {segment:?}");
    }
}

/// A stream whose simulation gets stuck (here a plan `validate` rejects: replicas of stage 0 run
/// different numbers of microbatches, so one waits alone for a step its peers never take) hands
/// out the error and then nothing.
#[test]
fn a_stuck_stream_ends_with_its_error() {
    let p = plan(&[3, 1], None);
    assert!(validate(&p, Schedule::PipeDream, 4).is_err());
    let mut actions = RankActions::new(&p, Schedule::PipeDream, 0, 4, (0, 1), None, 1).unwrap();
    let mut outcomes = Vec::new();
    for item in actions.by_ref() {
        outcomes.push(item.map(|c| c.actions.len()));
    }
    assert!(
        matches!(
            outcomes.last(),
            Some(Err(ScheduleError::Deadlock {
                schedule: Schedule::PipeDream,
                ..
            }))
        ),
        "{outcomes:?}"
    );
    assert!(outcomes[..outcomes.len() - 1].iter().all(Result::is_ok));
    assert!(actions.next().is_none(), "nothing after the error");
}

#[test]
fn only_microbatches_spanning_a_step_are_stashed() {
    let actions = [F(0), F(1), B(0), Step, F(2), B(1), Step, B(2), Step];
    assert_eq!(stashed(&actions), BTreeSet::from([1, 2]));
    let flushing = [F(0), F(1), B(0), B(1), Step];
    assert!(stashed(&flushing).is_empty());
}
