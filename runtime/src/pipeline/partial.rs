//! Partial reduce (SD-PIPE's `--preduce`, after Miao et al., "Heterogeneity-aware distributed
//! machine learning training via partial reduce", SIGMOD 2021): each step, a replica combines its
//! model with only the first K replicas to be ready, so a straggler no longer holds every replica
//! back. Data parallelism only (train/ refuses a pipeline): a replica's next step must depend on
//! nothing but itself, or a group waiting for it could close a cycle through another stage.
//!
//! **Forming groups.** The rendezvous store is the matchmaker. A replica ready to step takes the
//! next ticket of its stage (an atomic counter) and records its rank under it. Groups are runs of
//! consecutive tickets, sealed in order: group g starts where g-1 ended and is sealed (set once,
//! so every replica reads the same record) as soon as it holds its target of tickets: K, or every
//! live replica for each `sync_every`-th group (a full group). A group also seals with fewer when
//! none of the replicas missing from it can come: they have retired (done with their
//! iterations) or their heartbeat (a counter each replica's own thread bumps every 100 ms) has
//! not moved for [`DEAD_AFTER`]. So a dead replica costs the others at most that long at a full
//! group, and nothing otherwise. Each group's members reduce over a c10d group of exactly them,
//! created the first time those members meet and kept.
//!
//! **Weighting.** As P-Reduce does, each member steps on its own gradient with its own
//! optimizer state, then the members average their parameters with equal weights (one flat
//! all-reduce of the parameters: the bytes of the all-reduce's gradients). A replica's gradient is
//! scaled for the whole minibatch (its loss by 1/microbatches, as the all-reduce's sum needs), so
//! before its local step it is multiplied by the replicas, making it the mean over the replica's
//! own samples; for SGD a group of m then moves the members' mean model by the mean of their m
//! gradients, as data parallelism over their samples would. Averaging the parameters, not the
//! gradients, is what pulls the replicas together: gradients alone would leave replicas that meet
//! in different groups on separate paths for good. While every group so far held every replica
//! (K = replicas), the replicas are one model and the gradients are all-reduced before the step,
//! with the all-reduce's own buckets on the replicas' group: exactly `--reduce all`.
//!
//! **The bound.** Per parameter, averaging never leaves the members' range and a step moves one
//! replica by at most its update's largest magnitude u (`update`, reported per step). Right after
//! the last full group f every live replica holds one model w (at the start too: the same seeded
//! model); every model the averages of groups f+1..g make is within the sum U of u over the steps
//! of those groups of w, so a member's distance from its group's mean (`drift`, its model after
//! its step against the mean) is at most 2U. Replicas that missed the full group (presumed dead)
//! are outside the bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use super::reduce::{ring_bytes, ReduceStats, Reducer};
use crate::comm::{ProcessGroup, Store};
use crate::config::PartialOptions;

/// A replica whose heartbeat has not moved for this long is presumed dead.
pub const DEAD_AFTER: Duration = Duration::from_secs(10);
/// How often a replica's heartbeat moves.
const BEAT_EVERY: Duration = Duration::from_millis(100);
/// A replica waiting for its group to fill looks again after this, doubling each time up to
/// [`POLL_AT_MOST`] (each look is a few store requests, which cost CPU on both ends).
const POLL_FIRST: Duration = Duration::from_micros(50);
const POLL_AT_MOST: Duration = Duration::from_millis(4);

/// How a sealed group combines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Every replica, every group so far too: one model, only gradients are all-reduced.
    Sum,
    /// Parameters and gradients averaged over the members.
    Mix,
}

/// A sealed group: tickets `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    start: u64,
    end: u64,
    mode: Mode,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mode = match self.mode {
            Mode::Sum => "sum",
            Mode::Mix => "mix",
        };
        format!("{} {} {mode}", self.start, self.end).into_bytes()
    }

    fn decode(bytes: &[u8]) -> Result<Record, String> {
        let text = String::from_utf8_lossy(bytes);
        let mut fields = text.split(' ');
        let parsed = (|| {
            let start = fields.next()?.parse().ok()?;
            let end = fields.next()?.parse().ok()?;
            let mode = match fields.next()? {
                "sum" => Mode::Sum,
                "mix" => Mode::Mix,
                _ => return None,
            };
            Some(Record { start, end, mode })
        })();
        parsed.ok_or_else(|| format!("internal error: a malformed partial-reduce group record {text:?}"))
    }
}

/// What one step's partial reduce did, for the iteration's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupReport {
    /// The group's index in the stage's sequence of groups.
    pub index: u64,
    /// Its members' world ranks, ascending.
    pub members: Vec<usize>,
    /// A full group (every live replica).
    pub full: bool,
    /// Largest |own parameter after the step - the members' mean| (0 for one model).
    pub drift: f64,
    /// Largest |parameter change| of this replica's local step (0 for one model).
    pub update: f64,
    /// Waiting for the group to fill.
    pub wait: Duration,
}

/// A step's group between its join and the average after the step.
struct Pending {
    report: GroupReport,
    /// Mix: the parameters before the local step, flat.
    before: Option<Tensor>,
}

/// One replica's side of its stage's partial reduce.
pub struct PartialReduce {
    store: Store,
    /// Store keys of this stage.
    prefix: String,
    /// The stage's replicas (world ranks, ascending) and this one's.
    replicas: Vec<usize>,
    me: usize,
    options: PartialOptions,
    /// The first group this replica may still join, and its first ticket.
    next_group: u64,
    next_start: u64,
    /// How the group before `next_group` combined.
    previous_mode: Mode,
    /// Per member set, its c10d group.
    groups: HashMap<Vec<usize>, ProcessGroup>,
    /// Per other replica, its last heartbeat and when it was seen to change.
    beats: HashMap<usize, (i64, Instant)>,
    presumed_dead: Vec<usize>,
    /// The group of the step in progress, from before the step to after it.
    pending: Option<Pending>,
    /// Held for its drop, which stops the thread.
    _heartbeat: Heartbeat,
}

impl PartialReduce {
    /// This replica (`me`) of a stage whose replicas are `replicas`, matched through `store`
    /// (rank 0's store, reached at `addr`:`port` once more for the heartbeat).
    pub fn new(
        store: Store,
        stage: usize,
        replicas: &[usize],
        me: usize,
        options: PartialOptions,
    ) -> Result<PartialReduce, String> {
        let prefix = format!("preduce/stage{stage}");
        let heartbeat = Heartbeat::start(&store, format!("{prefix}/beat/{me}"))?;
        let now = Instant::now();
        Ok(PartialReduce {
            store,
            replicas: replicas.to_vec(),
            me,
            options,
            next_group: 0,
            next_start: 0,
            previous_mode: Mode::Sum,
            groups: HashMap::new(),
            beats: replicas
                .iter()
                .filter(|&&r| r != me)
                .map(|&r| (r, (-1, now)))
                .collect(),
            presumed_dead: Vec::new(),
            pending: None,
            _heartbeat: heartbeat,
            prefix,
        })
    }

    fn key(&self, what: std::fmt::Arguments) -> String {
        format!("{}/{what}", self.prefix)
    }

    /// Whether group `index` is a full one.
    fn is_full(&self, index: u64) -> bool {
        (index + 1).is_multiple_of(self.options.sync_every as u64)
    }

    /// The replicas that may still take a ticket: not retired, heartbeat moving (this one always).
    fn live(&mut self) -> Result<Vec<usize>, String> {
        let mut live = Vec::with_capacity(self.replicas.len());
        for r in self.replicas.clone() {
            if r == self.me {
                live.push(r);
                continue;
            }
            if self
                .store
                .check(&self.key(format_args!("retired/{r}")))
                .map_err(|e| e.to_string())?
            {
                continue;
            }
            let beat = self
                .store
                .add(&self.key(format_args!("beat/{r}")), 0)
                .map_err(|e| e.to_string())?;
            let (last, since) = self.beats.get_mut(&r).expect("every other replica has an entry");
            if beat != *last {
                (*last, *since) = (beat, Instant::now());
            }
            if since.elapsed() < DEAD_AFTER {
                live.push(r);
            } else if !self.presumed_dead.contains(&r) {
                self.presumed_dead.push(r);
                eprintln!(
                    "runtime: rank {}: replica rank {r} has shown no heartbeat for {DEAD_AFTER:?}; \
                     presumed dead, the partial reduce goes on without it",
                    self.me
                );
            }
        }
        Ok(live)
    }

    /// The world rank that took `ticket`.
    fn holder(&self, ticket: u64) -> Result<usize, String> {
        // Set right after the ticket was taken: a short wait at most.
        let bytes = self
            .store
            .get(&self.key(format_args!("who/{ticket}")))
            .map_err(|e| e.to_string())?;
        String::from_utf8_lossy(&bytes)
            .parse()
            .map_err(|_| format!("internal error: ticket {ticket} has holder {bytes:?}"))
    }

    /// Takes a ticket and waits until the group holding it is sealed: its index and record.
    fn join(&mut self) -> Result<(u64, Record), String> {
        let ticket = self
            .store
            .add(&self.key(format_args!("ticket")), 1)
            .map_err(|e| e.to_string())? as u64
            - 1;
        self.store
            .set(
                &self.key(format_args!("who/{ticket}")),
                self.me.to_string().as_bytes(),
            )
            .map_err(|e| e.to_string())?;
        let (mut index, mut start, mut previous) = (self.next_group, self.next_start, self.previous_mode);
        let mut pause = POLL_FIRST;
        loop {
            let key = self.key(format_args!("group/{index}"));
            let record = if self.store.check(&key).map_err(|e| e.to_string())? {
                Some(Record::decode(&self.store.get(&key).map_err(|e| e.to_string())?)?)
            } else {
                self.propose(index, start, previous)?
                    .map(|proposal| {
                        let stored = self
                            .store
                            .set_once(&key, &proposal.encode())
                            .map_err(|e| e.to_string())?;
                        Record::decode(&stored)
                    })
                    .transpose()?
            };
            match record {
                Some(record) if ticket < record.end => {
                    (self.next_group, self.next_start, self.previous_mode) =
                        (index + 1, record.end, record.mode);
                    return Ok((index, record));
                }
                Some(record) => (index, start, previous) = (index + 1, record.end, record.mode),
                None => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(POLL_AT_MOST);
                }
            }
        }
    }

    /// The record to seal open group `index` (first ticket `start`) with, if it can be sealed now.
    fn propose(&mut self, index: u64, start: u64, previous: Mode) -> Result<Option<Record>, String> {
        let taken = self
            .store
            .add(&self.key(format_args!("ticket")), 0)
            .map_err(|e| e.to_string())? as u64;
        let live = self.live()?;
        let full = self.is_full(index);
        let target = match full {
            true => live.len(),
            false => self.options.k.min(live.len()),
        }
        .max(1) as u64;
        let everyone = self.options.k >= self.replicas.len();
        let record = |end: u64| {
            let all = end - start == self.replicas.len() as u64;
            let mode = match previous == Mode::Sum && everyone && all {
                true => Mode::Sum,
                false => Mode::Mix,
            };
            Record { start, end, mode }
        };
        if taken - start >= target {
            return Ok(Some(record(start + target)));
        }
        let present = (start..taken)
            .map(|t| self.holder(t))
            .collect::<Result<Vec<_>, _>>()?;
        if live.iter().all(|r| present.contains(r)) {
            return Ok(Some(record(taken)));
        }
        Ok(None)
    }

    /// Before this replica's optimizer step: joins a group (see the module's notes). While the
    /// replicas are one model the gradients are all-reduced as `--reduce all` does; otherwise
    /// this replica's gradient is made the mean over its own samples (times the replicas: each
    /// replica's loss is scaled for the whole minibatch) for its local step. `replicas` is the
    /// group of every replica of the stage.
    pub fn before_step(
        &mut self,
        reducer: &mut Reducer,
        replicas: &ProcessGroup,
        params: &[Tensor],
        device: Device,
    ) -> Result<ReduceStats, String> {
        let waited = Instant::now();
        let (index, record) = self.join()?;
        let members = {
            let mut members = (record.start..record.end)
                .map(|t| self.holder(t))
                .collect::<Result<Vec<_>, _>>()?;
            members.sort_unstable();
            members
        };
        if !members.contains(&self.me) {
            return Err(format!(
                "internal error: group {index} (tickets {}..{}) is {members:?}, without rank {}",
                record.start, record.end, self.me
            ));
        }
        let report = GroupReport {
            index,
            full: self.is_full(index) || record.mode == Mode::Sum,
            members,
            drift: 0.0,
            update: 0.0,
            wait: waited.elapsed(),
        };
        let (stats, before) = match record.mode {
            Mode::Sum => (reducer.finish(replicas, device)?, None),
            Mode::Mix => {
                // Each replica ran microbatches / replicas of them (check_plan refuses other
                // splits), each backward scaled by 1 / microbatches: times the replicas, the mean
                // over its own.
                let scale = self.replicas.len() as f64;
                tch::no_grad(|| {
                    for p in params {
                        let mut grad = p.grad();
                        if grad.defined() {
                            let _ = grad.f_mul_scalar_(scale).map_err(|e| e.to_string())?;
                        }
                    }
                    Ok::<_, String>(())
                })?;
                (ReduceStats::default(), Some(flat_params(params, device)?))
            }
        };
        self.pending = Some(Pending { report, before });
        Ok(stats)
    }

    /// After the optimizer step: the members average their parameters (one flat all-reduce over
    /// a group of exactly them). Returns what it did and the step's group report.
    pub fn after_step(
        &mut self,
        replicas: &ProcessGroup,
        params: &[Tensor],
        device: Device,
    ) -> Result<(ReduceStats, GroupReport), String> {
        let Pending { mut report, before } = self
            .pending
            .take()
            .ok_or("internal error: a step with no partial-reduce group")?;
        let Some(before) = before else {
            return Ok((ReduceStats::default(), report));
        };
        let started = Instant::now();
        let after = flat_params(params, device)?;
        report.update = largest_difference(&after, &before);
        if report.members.len() == 1 {
            return Ok((ReduceStats::default(), report));
        }
        let share = 1.0 / report.members.len() as f64;
        let members = report.members.clone();
        let group = self.group(replicas, &members)?;
        let mean = tch::no_grad(|| {
            let mean = &after * share;
            group
                .all_reduce_sum(std::slice::from_ref(&mean))
                .map_err(|e| e.to_string())?
                .wait()
                .map_err(|e| e.to_string())?;
            let mut offset = 0;
            for p in params {
                let n = p.numel() as i64;
                p.data()
                    .f_copy_(&mean.narrow(0, offset, n).view_as(p))
                    .map_err(|e| e.to_string())?;
                offset += n;
            }
            Ok::<_, String>(mean)
        })?;
        report.drift = largest_difference(&after, &mean);
        let stats = ReduceStats {
            buckets: 1,
            wait: started.elapsed(),
            sent: ring_bytes(
                after.numel() as u64 * after.kind().elt_size_in_bytes() as u64,
                report.members.len(),
            ),
            ..ReduceStats::default()
        };
        Ok((stats, report))
    }

    /// The c10d group of `members`, made the first time they meet.
    fn group(&mut self, replicas: &ProcessGroup, members: &[usize]) -> Result<&ProcessGroup, String> {
        if !self.groups.contains_key(members) {
            let name = format!(
                "{}/members/{}",
                self.prefix,
                members.iter().map(usize::to_string).collect::<Vec<_>>().join("-")
            );
            let group = replicas
                .subgroup(&self.store, &name, members)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("internal error: rank {} is not in {members:?}", self.me))?;
            self.groups.insert(members.to_vec(), group);
        }
        Ok(&self.groups[members])
    }

    /// This replica is done: it takes no more tickets, and groups stop waiting for it.
    pub fn retire(&mut self) -> Result<(), String> {
        self.store
            .set(&self.key(format_args!("retired/{}", self.me)), b"1")
            .map_err(|e| e.to_string())
    }
}

/// The parameters' values, flat, on `device`.
fn flat_params(params: &[Tensor], device: Device) -> Result<Tensor, String> {
    tch::no_grad(|| {
        let parts: Vec<Tensor> = params
            .iter()
            .map(|p| p.data().reshape([-1]).to_device(device))
            .collect();
        Tensor::f_cat(&parts, 0).map_err(|e| e.to_string())
    })
}

/// The largest |a - b| of two flat tensors.
fn largest_difference(a: &Tensor, b: &Tensor) -> f64 {
    tch::no_grad(|| (a - b).abs().max().to_kind(Kind::Double).double_value(&[]))
}

/// The thread that bumps this replica's heartbeat counter over its own store connection (so no
/// wait on the main one ever delays it).
struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    fn start(store: &Store, key: String) -> Result<Heartbeat, String> {
        let own = Store::connect(
            store.addr(),
            store.port(),
            store.world_size(),
            false,
            store.timeout(),
        )
        .map_err(|e| format!("the partial reduce's heartbeat connection: {e}"))?;
        own.add(&key, 1).map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("preduce-heartbeat".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(BEAT_EVERY);
                    if let Err(e) = own.add(&key, 1) {
                        // Once rank 0 has exited its store is gone and nobody is listening; any
                        // earlier failure makes this replica look dead to its peers, so say why.
                        if !flag.load(Ordering::Relaxed) {
                            eprintln!("runtime: the partial reduce's heartbeat stopped: {e}");
                        }
                        break;
                    }
                }
            })
            .map_err(|e| format!("cannot start the heartbeat thread: {e}"))?;
        Ok(Heartbeat {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Rank 0 hosts the store: before it exits, it waits until every rank taking part in a partial
/// reduce (`participants`) has retired or shown no heartbeat for [`DEAD_AFTER`].
pub fn outlast(store: &Store, participants: &[(usize, usize)]) -> Result<(), String> {
    let mut beats: HashMap<usize, (i64, Instant)> = HashMap::new();
    loop {
        let mut waiting = false;
        for &(stage, rank) in participants {
            let prefix = format!("preduce/stage{stage}");
            if store
                .check(&format!("{prefix}/retired/{rank}"))
                .map_err(|e| e.to_string())?
            {
                continue;
            }
            let beat = store
                .add(&format!("{prefix}/beat/{rank}"), 0)
                .map_err(|e| e.to_string())?;
            let (last, since) = beats.entry(rank).or_insert((beat, Instant::now()));
            if beat != *last {
                (*last, *since) = (beat, Instant::now());
            }
            waiting |= since.elapsed() < DEAD_AFTER;
        }
        if !waiting {
            return Ok(());
        }
        std::thread::sleep(BEAT_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_records_round_trip_and_refuse_garbage() {
        for mode in [Mode::Sum, Mode::Mix] {
            let record = Record {
                start: 12,
                end: 15,
                mode,
            };
            assert_eq!(Record::decode(&record.encode()), Ok(record));
        }
        for bad in ["", "1 2", "1 x sum", "1 2 avg"] {
            assert!(Record::decode(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }
}
