//! Throughput and time shares computed from the ranks' metrics lines; shared by the progress bar
//! and the record so both show the same numbers.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use stagehand_contract::{Event as Metrics, ValidationFigures};

/// Per-stage sums of where time went.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageShares {
    /// Stage number.
    pub stage: usize,
    /// Ranks seen reporting for this stage.
    pub ranks: Vec<usize>,
    /// Fraction of the stage's time spent computing.
    pub compute_share: f64,
    /// Fraction spent waiting on communication.
    pub comm_share: f64,
    /// Fraction spent idle (pipeline bubbles).
    pub idle_share: f64,
}

/// Mean and spread of the whole job's samples/s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    /// Mean samples/s over the measured iterations.
    pub samples_per_sec_mean: f64,
    /// Sample standard deviation (n - 1) of samples/s over the measured iterations, as the
    /// runtime's summary reports it.
    pub samples_per_sec_std: f64,
    /// Iterations measured: the first is left out as warm-up, and those PyTorch's profiler
    /// slowed (`profiled`), when any others remain.
    pub iterations_measured: usize,
}

/// What the last stage's ranks reported of one iteration, summed over the ranks.
#[derive(Debug, Default, Clone, Copy)]
struct LastStage {
    /// Samples/s, and how many ranks reported.
    rate: f64,
    ranks: usize,
    /// Loss, top-1 and top-5 accuracy over the ranks that reported a finite one.
    loss: Mean,
    accuracy: Mean,
    accuracy_top5: Mean,
}

/// A mean over the finite values given.
#[derive(Debug, Default, Clone, Copy)]
struct Mean {
    sum: f64,
    count: usize,
}

impl Mean {
    fn add(&mut self, value: Option<f64>) {
        if let Some(value) = value.filter(|v| v.is_finite()) {
            self.sum += value;
            self.count += 1;
        }
    }

    fn value(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// How training went by the last complete iteration: its loss and top-1 and top-5 accuracy,
/// each the mean of what the last stage's ranks reported (every replica reports the whole
/// minibatch's, or its own equal share of it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub accuracy_top5: Option<f64>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Sums {
    compute: f64,
    comm: f64,
    idle: f64,
}

/// Accumulates metrics events from every rank.
#[derive(Debug, Default)]
pub struct Stats {
    /// Stage of each rank, from its `start` event or its iterations.
    stage_of: BTreeMap<usize, usize>,
    num_stages: Option<usize>,
    /// Per iteration: samples/s, loss and accuracy summed over the last stage's ranks, and how
    /// many reported. Every rank reports the whole minibatch's rate (docs/metrics.md), so the
    /// job's rate is the mean.
    per_iteration: BTreeMap<u64, LastStage>,
    sums: BTreeMap<usize, Sums>,
    /// With fp16 (iterations that say whether their step was skipped): the skipped ones. Every
    /// rank skips the same steps, so an iteration counts once however many ranks report it.
    skipped: Option<BTreeSet<u64>>,
    /// Iterations some rank said PyTorch's profiler slowed (`--profiler-trace`).
    profiled: BTreeSet<u64>,
    /// The first iteration of each start of the ranks after a restart: a warm-up, as the run's
    /// first is.
    restarts_at: BTreeSet<u64>,
    /// The ranks were started again and no iteration of theirs has arrived yet.
    restarting: bool,
    /// The first iteration the ranks' `start` lines name, where they resumed (the earliest).
    first_iteration: Option<u64>,
    /// Validation passes (`validate_every`), by the iteration they followed: every rank of the
    /// last stage reports the whole pass's figures, so the first report of a pass is kept.
    validation: BTreeMap<u64, ValidationFigures>,
}

impl Stats {
    /// Takes one metrics event.
    pub fn record(&mut self, event: &Metrics) {
        match event {
            Metrics::Start(s) => {
                self.stage_of.insert(s.rank, s.stage);
                self.num_stages = Some(s.num_stages);
                if s.first_iteration > 0 {
                    let first = self.first_iteration.get_or_insert(s.first_iteration);
                    *first = (*first).min(s.first_iteration);
                }
            }
            Metrics::Iteration(it) => {
                if std::mem::take(&mut self.restarting) {
                    self.start_again_at(it.iteration);
                }
                self.stage_of.insert(it.rank, it.stage);
                let sums = self.sums.entry(it.stage).or_default();
                sums.compute += it.compute_s;
                sums.comm += it.comm_wait_s;
                sums.idle += it.idle_s;
                if let Some(skipped) = it.step_skipped {
                    let set = self.skipped.get_or_insert_default();
                    if skipped {
                        set.insert(it.iteration);
                    }
                }
                if it.profiled {
                    self.profiled.insert(it.iteration);
                }
                if self.is_last_stage(it.stage) {
                    let entry = self.per_iteration.entry(it.iteration).or_default();
                    entry.rate += it.samples_per_sec;
                    entry.ranks += 1;
                    entry.loss.add(it.loss);
                    entry.accuracy.add(it.accuracy);
                    entry.accuracy_top5.add(it.accuracy_top5);
                }
            }
            Metrics::Validation(v) => {
                self.validation.entry(v.iteration).or_insert(v.figures);
            }
            // Per-microbatch tracing (`--trace`) says nothing about throughput or time shares,
            // nor a failure's last line.
            Metrics::Summary(_) | Metrics::Trace(_) | Metrics::P2p(_) | Metrics::PeerSilent(_) => {}
        }
    }

    /// The ranks are being started again: their iterations from the first one they report
    /// replace what the earlier start reported of the same iterations (they resume from a
    /// checkpoint, or start afresh).
    pub fn restarted(&mut self) {
        self.restarting = true;
    }

    fn start_again_at(&mut self, iteration: u64) {
        self.per_iteration.split_off(&iteration);
        if let Some(skipped) = &mut self.skipped {
            skipped.split_off(&iteration);
        }
        self.profiled.split_off(&iteration);
        // A pass after iteration `iteration - 1` ran once its iteration was done: a resumed
        // run that starts at `iteration` repeats none of them.
        self.validation.split_off(&iteration);
        self.restarts_at.split_off(&iteration);
        self.restarts_at.insert(iteration);
    }

    fn is_last_stage(&self, stage: usize) -> bool {
        match self.num_stages {
            Some(n) => stage + 1 == n,
            None => true,
        }
    }

    fn last_stage_ranks(&self) -> usize {
        let last = self.num_stages.map(|n| n.saturating_sub(1)).unwrap_or(0);
        self.stage_of.values().filter(|&&s| s == last).count().max(1)
    }

    /// Iterations every rank of the last stage has finished.
    pub fn iterations_done(&self) -> u64 {
        let need = self.last_stage_ranks();
        self.per_iteration.values().filter(|it| it.ranks >= need).count() as u64
    }

    /// The first iteration the last stage reported, where it is not the first of training: the
    /// ranks resumed there from a checkpoint written before this run. Where no iteration came,
    /// what the ranks' `start` lines said (a checkpoint that had done every iteration).
    pub fn resumed_at(&self) -> Option<u64> {
        self.per_iteration
            .first_key_value()
            .map(|(&i, _)| i)
            .or(self.first_iteration)
            .filter(|&i| i > 0)
    }

    /// Loss and accuracies of the latest iteration every last-stage rank has reported; `None`
    /// before the first.
    pub fn fit(&self) -> Option<Fit> {
        let need = self.last_stage_ranks();
        let it = self.per_iteration.values().rev().find(|it| it.ranks >= need)?;
        Some(Fit {
            loss: it.loss.value(),
            accuracy: it.accuracy.value(),
            accuracy_top5: it.accuracy_top5.value(),
        })
    }

    /// The latest validation pass: the iteration it followed and what it measured.
    pub fn validation(&self) -> Option<(u64, ValidationFigures)> {
        self.validation.last_key_value().map(|(&it, &v)| (it, v))
    }

    /// Samples/s of the latest iteration every last-stage rank has reported.
    pub fn latest_samples_per_sec(&self) -> Option<f64> {
        let need = self.last_stage_ranks();
        self.per_iteration
            .values()
            .rev()
            .find(|it| it.ranks >= need)
            .map(|it| it.rate / it.ranks as f64)
    }

    /// Mean and spread over complete iterations, leaving out the first, and the first of each
    /// start after a restart, as warm-up when that leaves any, and then the iterations the
    /// profiler slowed when that leaves any.
    pub fn throughput(&self) -> Option<Throughput> {
        let need = self.last_stage_ranks();
        let complete: Vec<(u64, f64)> = self
            .per_iteration
            .iter()
            .filter(|(_, it)| it.ranks >= need)
            .map(|(&i, it)| (i, it.rate / it.ranks as f64))
            .collect();
        let warm: Vec<(u64, f64)> = complete
            .iter()
            .skip(1)
            .filter(|(i, _)| !self.restarts_at.contains(i))
            .copied()
            .collect();
        let unprofiled: Vec<f64> = warm
            .iter()
            .filter(|(i, _)| !self.profiled.contains(i))
            .map(|&(_, rate)| rate)
            .collect();
        let measured: Vec<f64> = [unprofiled, warm.iter().map(|&(_, rate)| rate).collect()]
            .into_iter()
            .find(|rates| !rates.is_empty())
            .unwrap_or_else(|| complete.iter().map(|&(_, rate)| rate).collect());
        if measured.is_empty() {
            return None;
        }
        // As each rank's summary computes it, so the job's spread reads as the ranks' do.
        let (mean, std) = stagehand_contract::metrics::mean_and_std(&measured);
        Some(Throughput {
            samples_per_sec_mean: mean,
            samples_per_sec_std: std,
            iterations_measured: measured.len(),
        })
    }

    /// Steps the fp16 gradient scaler skipped; `None` when no rank computes in fp16.
    pub fn skipped_steps(&self) -> Option<u64> {
        self.skipped.as_ref().map(|s| s.len() as u64)
    }

    /// Compute, communication and idle shares per stage.
    pub fn stage_shares(&self) -> Vec<StageShares> {
        self.sums
            .iter()
            .map(|(&stage, s)| {
                let total = s.compute + s.comm + s.idle;
                let share = |x: f64| if total > 0.0 { x / total } else { 0.0 };
                StageShares {
                    stage,
                    ranks: self
                        .stage_of
                        .iter()
                        .filter(|(_, &st)| st == stage)
                        .map(|(&r, _)| r)
                        .collect(),
                    compute_share: share(s.compute),
                    comm_share: share(s.comm),
                    idle_share: share(s.idle),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_contract::Iteration;

    fn it(iteration: u64, rank: usize, stage: usize, sps: f64) -> Metrics {
        Metrics::Iteration(Iteration {
            iteration,
            rank,
            stage,
            loss: None,
            accuracy: None,
            accuracy_top5: None,
            lr: None,
            samples: 8,
            time_s: 8.0 / sps,
            samples_per_sec: sps,
            compute_s: 0.6,
            comm_wait_s: 0.3,
            idle_s: 0.1,
            peak_mem_bytes: None,
            host_peak_rss_bytes: None,
            gpu_peak_allocated_bytes: None,
            gpu_peak_reserved_bytes: None,
            reduce: Default::default(),
            sent_bytes: 0,
            sent_dense_bytes: 0,
            partial_reduce: None,
            loss_scale: None,
            step_skipped: None,
            checkpointed: false,
            profiled: false,
        })
    }

    #[test]
    fn data_parallel_ranks_report_the_same_minibatch_and_warmup_is_left_out() {
        let mut s = Stats::default();
        // Both replicas report the rate of the whole minibatch; the job's rate is theirs, not the sum.
        for (i, sps) in [(0, 1.0), (1, 10.0), (2, 14.0)] {
            s.record(&it(i, 0, 0, sps));
            s.record(&it(i, 1, 0, sps + 2.0));
        }
        let t = s.throughput().unwrap();
        assert_eq!(t.iterations_measured, 2);
        assert!((t.samples_per_sec_mean - 13.0).abs() < 1e-9, "{t:?}");
        // Sample standard deviation of 11 and 15 (n - 1), as the ranks' summaries compute it.
        assert!((t.samples_per_sec_std - 8f64.sqrt()).abs() < 1e-9, "{t:?}");
        assert_eq!(s.iterations_done(), 3);
        assert_eq!(s.latest_samples_per_sec(), Some(15.0));
    }

    /// The record's loss and accuracies are the latest iteration every replica of the last
    /// stage finished, the mean of theirs (PipeDream's replicas each report their own
    /// microbatches' share); a runtime that reports no accuracy (or no top-5, for token logits)
    /// leaves it unknown, and a non-finite loss is not averaged in.
    #[test]
    fn the_fit_is_the_latest_complete_iterations_mean_over_the_last_stages_replicas() {
        let reported = |i: u64, rank: usize, loss: f64, top1: Option<f64>, top5: Option<f64>| {
            let Metrics::Iteration(mut line) = it(i, rank, 0, 10.0) else {
                unreachable!()
            };
            line.loss = Some(loss);
            line.accuracy = top1;
            line.accuracy_top5 = top5;
            Metrics::Iteration(line)
        };
        let fit = |loss, accuracy, accuracy_top5| {
            Some(Fit {
                loss: Some(loss),
                accuracy,
                accuracy_top5,
            })
        };
        let mut s = Stats::default();
        assert_eq!(s.fit(), None, "nothing finished yet");
        s.record(&reported(0, 0, 2.0, Some(0.25), Some(0.5)));
        s.record(&reported(0, 1, 1.0, Some(0.5), Some(0.5)));
        s.record(&reported(1, 0, 0.5, Some(0.75), Some(0.75)));
        s.record(&reported(1, 1, 0.25, Some(1.0), Some(1.0)));
        // Rank 1 has not finished iteration 2 yet.
        s.record(&reported(2, 0, 9.0, Some(0.0), Some(0.25)));
        assert_eq!(s.fit(), fit(0.375, Some(0.875), Some(0.875)));
        s.record(&reported(2, 1, f64::NAN, None, None));
        assert_eq!(s.fit(), fit(9.0, Some(0.0), Some(0.25)));
        let mut older = Stats::default();
        older.record(&reported(0, 0, 1.5, None, None));
        assert_eq!(older.fit(), fit(1.5, None, None));
        let mut tokens = Stats::default();
        tokens.record(&reported(0, 0, 1.5, Some(0.5), None));
        assert_eq!(tokens.fit(), fit(1.5, Some(0.5), None));
    }

    /// Ranks started again replace what the failed start reported from the iteration they
    /// resume at, and that first iteration is a warm-up as the run's first is.
    #[test]
    fn a_restart_replaces_the_iterations_it_runs_again_and_warms_up_again() {
        let mut s = Stats::default();
        for (i, sps) in [(0, 1.0), (1, 10.0), (2, 10.0), (3, 10.0)] {
            s.record(&it(i, 0, 0, sps));
            s.record(&it(i, 1, 0, sps));
        }
        // Rank 1 died in iteration 4; rank 0 finished it alone.
        s.record(&it(4, 0, 0, 10.0));
        s.restarted();
        assert_eq!(
            s.iterations_done(),
            4,
            "nothing changes until the new start reports"
        );
        // Resumed from the checkpoint of 2 iterations done: 2 and 3 again, then 4 and 5.
        for (i, sps) in [(2, 2.0), (3, 20.0), (4, 20.0), (5, 20.0)] {
            s.record(&it(i, 0, 0, sps));
            s.record(&it(i, 1, 0, sps));
        }
        assert_eq!(s.iterations_done(), 6);
        let t = s.throughput().unwrap();
        // Measured: 1 from the first start, 3, 4 and 5 from the second; 0 and 2 warm up.
        assert_eq!(t.iterations_measured, 4, "{t:?}");
        assert!((t.samples_per_sec_mean - 17.5).abs() < 1e-9, "{t:?}");
    }

    /// A run that starts past iteration 0 resumed from a checkpoint written before it; a restart
    /// within a run that started at 0 is not that.
    #[test]
    fn a_run_that_starts_past_the_first_iteration_resumed_there() {
        let mut s = Stats::default();
        assert_eq!(s.resumed_at(), None);
        for i in 140..150 {
            s.record(&it(i, 0, 0, 10.0));
        }
        assert_eq!(s.resumed_at(), Some(140));
        assert_eq!(s.iterations_done(), 10);
        let mut s = Stats::default();
        for i in 0..4 {
            s.record(&it(i, 0, 0, 10.0));
        }
        s.restarted();
        for i in 2..6 {
            s.record(&it(i, 0, 0, 10.0));
        }
        assert_eq!(s.resumed_at(), None);
        // Resumed where the run ends: no iteration, but the ranks' start lines say where.
        let mut s = Stats::default();
        for rank in 0..2 {
            let line = format!(
                r#"{{"event":"start","schema_version":1,"rank":{rank},"world_size":2,"stage":0,"num_stages":1,"num_modules":6,"num_params":10,"first_module":0,"end_module":6,"stage_params":10,"first_iteration":20,"config":{{"model":"mlp","batch_size":8,"iterations":20,"lr":0.1,"optimizer":"sgd","seed":0,"data":"synthetic","device":"cpu","threads":1}}}}"#
            );
            s.record(&Metrics::parse_line(&line).unwrap());
        }
        assert_eq!(s.resumed_at(), Some(20));
        assert_eq!(s.iterations_done(), 0);
    }

    /// Iterations a rank said the profiler slowed are left out of the throughput while others
    /// remain; a run all of whose measured iterations were profiled still has a throughput.
    #[test]
    fn iterations_the_profiler_slowed_are_left_out_while_others_remain() {
        let profiled = |i: u64, rank: usize, sps: f64| {
            let Metrics::Iteration(mut line) = it(i, rank, 0, sps) else {
                unreachable!()
            };
            line.profiled = true;
            Metrics::Iteration(line)
        };
        let mut s = Stats::default();
        s.record(&it(0, 0, 0, 1.0));
        s.record(&it(0, 1, 0, 1.0));
        // Iterations 1 and 2 traced, 3 waited on the trace being written; only rank 1 says so
        // of 3 (rank 0 wrote its trace between its iterations).
        for i in [1, 2] {
            s.record(&profiled(i, 0, 4.0));
            s.record(&profiled(i, 1, 4.0));
        }
        s.record(&it(3, 0, 0, 6.0));
        s.record(&profiled(3, 1, 6.0));
        let t = s.throughput().unwrap();
        assert_eq!(
            t.iterations_measured, 3,
            "all but the warm-up, none being left: {t:?}"
        );
        assert!((t.samples_per_sec_mean - 14.0 / 3.0).abs() < 1e-9, "{t:?}");
        for (i, sps) in [(4, 10.0), (5, 12.0)] {
            s.record(&it(i, 0, 0, sps));
            s.record(&it(i, 1, 0, sps));
        }
        let t = s.throughput().unwrap();
        assert_eq!(t.iterations_measured, 2, "{t:?}");
        assert!((t.samples_per_sec_mean - 11.0).abs() < 1e-9, "{t:?}");
        assert_eq!(
            s.iterations_done(),
            6,
            "profiled iterations are done all the same"
        );
    }

    #[test]
    fn only_complete_iterations_count() {
        let mut s = Stats::default();
        s.record(&it(0, 0, 0, 5.0));
        s.record(&it(0, 1, 0, 5.0));
        s.record(&it(1, 0, 0, 5.0));
        assert_eq!(s.iterations_done(), 1);
    }

    #[test]
    fn tracing_events_change_no_statistic() {
        let p2p = Metrics::P2p(stagehand_contract::P2p {
            rank: 1,
            op: stagehand_contract::P2pOp::Recv,
            peer: 0,
            channel: stagehand_contract::Channel::Forward,
            seq: 0,
            tensor: stagehand_contract::P2pTensor::Activation,
            microbatch: Some(0),
            dtype: "float32".into(),
            validation: None,
        });
        let (mut plain, mut traced) = (Stats::default(), Stats::default());
        for i in 0..3 {
            plain.record(&it(i, 0, 0, 5.0 + i as f64));
            traced.record(&p2p);
            traced.record(&it(i, 0, 0, 5.0 + i as f64));
            traced.record(&p2p);
        }
        assert_eq!(traced.iterations_done(), 3);
        assert_eq!(traced.throughput(), plain.throughput());
        assert_eq!(traced.stage_shares(), plain.stage_shares());
    }

    /// fp16's skipped steps are counted once per iteration, however many ranks say so; runs in
    /// other arithmetics (no `step_skipped`) have no count at all, not a zero.
    #[test]
    fn skipped_steps_are_iterations_any_rank_skipped() {
        let mut plain = Stats::default();
        plain.record(&it(0, 0, 0, 5.0));
        assert_eq!(plain.skipped_steps(), None);
        let mut s = Stats::default();
        for (iteration, skipped) in [(0, true), (1, false), (2, true), (3, false)] {
            for rank in 0..2 {
                let Metrics::Iteration(mut event) = it(iteration, rank, rank, 5.0) else {
                    unreachable!()
                };
                event.step_skipped = Some(skipped);
                s.record(&Metrics::Iteration(event));
            }
        }
        assert_eq!(s.skipped_steps(), Some(2));
    }

    #[test]
    fn shares_are_per_stage_fractions() {
        let mut s = Stats::default();
        s.record(&it(0, 0, 0, 5.0));
        let shares = s.stage_shares();
        assert_eq!(shares.len(), 1);
        assert!((shares[0].compute_share - 0.6).abs() < 1e-9);
        assert!((shares[0].comm_share + shares[0].idle_share - 0.4).abs() < 1e-9);
    }

    /// The latest pass is the record's; a restart that resumes at an iteration drops the passes
    /// that followed it or later, which the resumed run makes again.
    #[test]
    fn the_latest_validation_pass_is_kept_and_a_restart_drops_those_it_runs_again() {
        let pass = |iteration: u64, rank: usize, accuracy: f64| {
            Metrics::Validation(stagehand_contract::metrics::Validation {
                iteration,
                rank,
                stage: 0,
                figures: ValidationFigures {
                    loss: 1.0 - accuracy,
                    accuracy,
                    accuracy_top5: None,
                    samples: 64,
                },
                time_s: 0.1,
            })
        };
        let mut s = Stats::default();
        assert_eq!(s.validation(), None);
        for event in [
            it(0, 0, 0, 10.0),
            it(1, 0, 0, 10.0),
            pass(1, 0, 0.5),
            pass(1, 1, 0.5),
        ] {
            s.record(&event);
        }
        for event in [it(2, 0, 0, 10.0), it(3, 0, 0, 10.0), pass(3, 0, 0.75)] {
            s.record(&event);
        }
        assert_eq!(s.validation().map(|(i, v)| (i, v.accuracy)), Some((3, 0.75)));
        // Resumed from the checkpoint of 2 iterations done: iteration 3's pass comes again.
        s.restarted();
        s.record(&it(2, 0, 0, 10.0));
        assert_eq!(s.validation().map(|(i, v)| (i, v.accuracy)), Some((1, 0.5)));
    }
}
