//! The replicas' gradient all-reduce, as DDP's reducer does it: parameters in reverse order (about
//! the order backward produces their gradients) packed into flat buckets of at most a byte cap,
//! each bucket's all-reduce started as soon as the last backward before a step has written all of
//! its gradients, while the rest of that backward runs; the step waits for them and copies back.
//!
//! With overlap off the same buckets are all-reduced after the backward, in the same order, so
//! both ways run the same collectives on the same flat buffers and give the same bits. A bucket
//! starts only after every earlier one has (c10d matches collectives by issue order, so every
//! replica must issue them in one order whatever order its autograd produced gradients in).

use std::collections::HashSet;
use std::ffi::{c_char, c_void};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use tch::{Device, Tensor};

use crate::comm::{ProcessGroup, Work};
use crate::config::ReduceOptions;
use crate::schedule::Action;
use crate::stage::{set_grad_ready_hook, GradReadyFn};

/// What one step's all-reduce did, for the iteration's metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ReduceStats {
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Of those, buckets started before the backward pass finished.
    pub early: usize,
    /// From the first bucket started during the backward to the backward's end: all-reduce that
    /// could run alongside compute.
    pub overlap: Duration,
    /// After the backward: starting the buckets not yet started, waiting for all of them and
    /// copying the sums back (the all-reduce the step waits on).
    pub wait: Duration,
    /// Bytes this rank sent: exact for point-to-point messages, and for each all-reduce what a
    /// ring all-reduce sends ([`ring_bytes`]).
    pub sent: u64,
}

/// What each of `ranks` sends in a ring all-reduce of `bytes`: its share of the buffer, once
/// while reducing and once while gathering, to each of the other ranks' turns.
pub fn ring_bytes(bytes: u64, ranks: usize) -> u64 {
    match ranks {
        0 | 1 => 0,
        n => 2 * (n as u64 - 1) * bytes / n as u64,
    }
}

impl std::ops::AddAssign for ReduceStats {
    fn add_assign(&mut self, other: ReduceStats) {
        self.buckets += other.buckets;
        self.early += other.early;
        self.overlap += other.overlap;
        self.wait += other.wait;
        self.sent += other.sent;
    }
}

/// Parameter indices per bucket, in the order buckets are all-reduced: parameters in reverse
/// order, a new bucket whenever the next gradient would take the current one past `cap` bytes.
pub fn bucket_layout(bytes: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0;
    for i in (0..bytes.len()).rev() {
        match buckets.last_mut() {
            Some(bucket) if filled + bytes[i] <= cap => bucket.push(i),
            _ => {
                buckets.push(vec![i]);
                filled = 0;
            }
        }
        filled += bytes[i];
    }
    buckets
}

/// The backwards after which a step follows with no other backward between (the last gradient
/// accumulation of each step on this rank): the ones whose hooks start buckets.
pub fn last_backwards(actions: &[Action]) -> HashSet<usize> {
    let mut last = None;
    let mut out = HashSet::new();
    for action in actions {
        match action {
            Action::Forward(_) => {}
            Action::Backward(g) => last = Some(*g),
            Action::Step => out.extend(last.take()),
        }
    }
    out
}

/// A bucket whose all-reduce has started.
struct Started {
    /// The bucket's gradients, flat, summed in place by the all-reduce.
    flat: Tensor,
    work: Work,
    /// Started from a hook, during the backward.
    early: bool,
}

/// What the hooks and the step share. The hooks reach it through a raw pointer, only while a
/// backward runs; the step only between backwards.
struct State {
    /// The stage's parameters (handles to the optimizer's), in the optimizer's order.
    params: Vec<Tensor>,
    buckets: Vec<Vec<usize>>,
    /// The bucket of each parameter.
    bucket_of: Vec<usize>,
    /// Multiplies each bucket before the sum (PipeDream averages its replicas' gradients).
    scale: Option<f64>,
    /// Where the flat buckets are (the first parameter's device: the process group's).
    device: Device,
    /// The replicas' group while an armed backward runs.
    armed: Option<*const ProcessGroup>,
    /// Gradients written by the armed backward.
    ready: Vec<bool>,
    /// Per bucket, gradients the armed backward has yet to write.
    missing: Vec<usize>,
    /// Buckets started this step, a prefix of `buckets`.
    started: Vec<Started>,
    first_early: Option<Instant>,
    /// When the armed backward returned.
    backward_end: Option<Instant>,
    /// The first failure inside a hook (it also fails the backward).
    error: Option<String>,
}

impl State {
    fn reset(&mut self) {
        self.ready.iter_mut().for_each(|r| *r = false);
        for (missing, bucket) in self.missing.iter_mut().zip(&self.buckets) {
            *missing = bucket.len();
        }
        self.started.clear();
        self.first_early = None;
        self.backward_end = None;
        self.error = None;
    }

    /// A hook: parameter `index`'s gradient is final for this step.
    fn grad_ready(&mut self, index: usize, group: &ProcessGroup) -> Result<(), String> {
        if std::mem::replace(&mut self.ready[index], true) {
            return Err(format!(
                "internal error: parameter {index}'s gradient was written twice in one backward"
            ));
        }
        self.missing[self.bucket_of[index]] -= 1;
        while self.started.len() < self.buckets.len() && self.missing[self.started.len()] == 0 {
            self.first_early.get_or_insert_with(Instant::now);
            self.start_next(group, true)?;
        }
        Ok(())
    }

    /// Flattens the next bucket and starts its all-reduce.
    fn start_next(&mut self, group: &ProcessGroup, early: bool) -> Result<(), String> {
        let bucket = &self.buckets[self.started.len()];
        let flat = tch::no_grad(|| {
            let grads = bucket
                .iter()
                .map(|&i| {
                    let grad = self.params[i].grad();
                    if grad.defined() {
                        // A stage over several devices all-reduces on its first one.
                        Ok(match grad.device() == self.device {
                            true => grad.reshape([-1]),
                            false => grad.reshape([-1]).to_device(self.device),
                        })
                    } else {
                        Err(format!(
                            "internal error: parameter {i} has no gradient to all-reduce"
                        ))
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut flat = Tensor::f_cat(&grads, 0).map_err(|e| e.to_string())?;
            if let Some(scale) = self.scale {
                let _ = flat.f_mul_scalar_(scale).map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(flat)
        })?;
        let work = group
            .all_reduce_sum(std::slice::from_ref(&flat))
            .map_err(|e| e.to_string())?;
        self.started.push(Started { flat, work, early });
        Ok(())
    }
}

/// The all-reduce of one stage's gradients across its replicas.
pub struct Reducer {
    state: NonNull<State>,
    overlap: bool,
}

// SAFETY: the state is owned by the reducer and touched from other threads only by hooks, which
// run while the owning thread waits in a backward it armed (see `backward`).
unsafe impl Send for Reducer {}

impl Reducer {
    /// A reducer for `params` (the optimizer's, in its order). With overlap on, it hooks every
    /// parameter until it is dropped. `scale` multiplies the gradients before the sum.
    pub fn new(params: &[Tensor], options: ReduceOptions, scale: Option<f64>) -> Result<Reducer, String> {
        let bytes: Vec<usize> = params
            .iter()
            .map(|p| p.numel() * p.kind().elt_size_in_bytes())
            .collect();
        let buckets = bucket_layout(&bytes, options.bucket_bytes);
        let mut bucket_of = vec![0; params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for &i in bucket {
                bucket_of[i] = b;
            }
        }
        let mut state = State {
            params: params.iter().map(Tensor::shallow_clone).collect(),
            missing: vec![0; buckets.len()],
            buckets,
            bucket_of,
            scale,
            device: params.first().map_or(Device::Cpu, Tensor::device),
            armed: None,
            ready: vec![false; params.len()],
            started: Vec::new(),
            first_early: None,
            backward_end: None,
            error: None,
        };
        state.reset();
        let reducer = Reducer {
            state: NonNull::from(Box::leak(Box::new(state))),
            overlap: options.overlap,
        };
        if options.overlap {
            for (i, p) in params.iter().enumerate() {
                // SAFETY: the context is the reducer's state, which outlives the hook: `drop`
                // removes every hook before freeing it.
                unsafe {
                    set_grad_ready_hook(
                        p,
                        Some((grad_ready as GradReadyFn, reducer.state.as_ptr().cast())),
                        i,
                    )
                }?;
            }
        }
        Ok(reducer)
    }

    /// Runs `backward`; when `last` (the step's last gradient accumulation on this rank) and
    /// overlap is on, buckets start on `group` as the backward completes them. Returns when the
    /// backward ends.
    pub fn backward<T>(
        &mut self,
        group: &ProcessGroup,
        last: bool,
        backward: impl FnOnce() -> Result<T, String>,
    ) -> Result<T, String> {
        let armed = self.overlap && last;
        if armed {
            // SAFETY: between backwards only this thread touches the state.
            unsafe { self.state.as_mut() }.armed = Some(group as *const ProcessGroup);
        }
        // While it runs, hooks (on this thread for CPU parameters, on autograd's device thread
        // for CUDA ones, while this thread waits) are the only users of the state and of `group`,
        // which the borrow keeps alive.
        let result = backward();
        // SAFETY: the backward has returned: no hook runs any more.
        let state = unsafe { self.state.as_mut() };
        state.armed = None;
        if armed {
            state.backward_end = Some(Instant::now());
        }
        match (result, state.error.take()) {
            (_, Some(error)) => Err(format!("the gradient all-reduce during the backward: {error}")),
            (result, None) => result,
        }
    }

    /// After the step's last backward: starts the buckets not started yet, waits for every
    /// all-reduce and copies the sums into the gradients. Every parameter must have a gradient.
    pub fn finish(&mut self, group: &ProcessGroup, device: Device) -> Result<ReduceStats, String> {
        // SAFETY: no backward runs: only this thread touches the state.
        let state = unsafe { self.state.as_mut() };
        let started_at = Instant::now();
        let result = (|| {
            while state.started.len() < state.buckets.len() {
                state.start_next(group, false)?;
            }
            let mut stats = ReduceStats {
                buckets: state.buckets.len(),
                early: state.started.iter().filter(|s| s.early).count(),
                overlap: match (state.first_early, state.backward_end) {
                    (Some(first), Some(end)) => end.saturating_duration_since(first),
                    _ => Duration::ZERO,
                },
                wait: Duration::ZERO,
                sent: state
                    .started
                    .iter()
                    .map(|s| {
                        ring_bytes(
                            s.flat.numel() as u64 * s.flat.kind().elt_size_in_bytes() as u64,
                            group.size(),
                        )
                    })
                    .sum(),
            };
            for (started, bucket) in state.started.drain(..).zip(&state.buckets) {
                started.work.wait().map_err(|e| e.to_string())?;
                tch::no_grad(|| {
                    let mut offset = 0;
                    for &i in bucket {
                        let grad = state.params[i].grad();
                        let n = grad.numel() as i64;
                        grad.data()
                            .f_copy_(&started.flat.narrow(0, offset, n).view_as(&grad))
                            .map_err(|e| e.to_string())?;
                        offset += n;
                    }
                    Ok::<_, String>(())
                })?;
            }
            crate::cuda::synchronize(device)?;
            stats.wait = started_at.elapsed();
            Ok(stats)
        })();
        state.reset();
        result
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        // SAFETY: no backward runs while the reducer is dropped; once the hooks are gone nothing
        // else holds the pointer.
        unsafe {
            if self.overlap {
                for p in &self.state.as_ref().params {
                    let _ = set_grad_ready_hook(p, None, 0);
                }
            }
            drop(Box::from_raw(self.state.as_ptr()));
        }
    }
}

/// The hook every parameter calls once autograd has written its gradient.
unsafe extern "C" fn grad_ready(context: *mut c_void, index: i64) -> *mut c_char {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `context` is a live reducer's state (hooks are removed before it is freed),
        // reached only by hooks while a backward runs.
        let state = unsafe { &mut *context.cast::<State>() };
        let Some(group) = state.armed else {
            return Ok(());
        };
        // SAFETY: `Reducer::backward` holds the borrow of the group while the state is armed.
        let result = state.grad_ready(index as usize, unsafe { &*group });
        if let Err(error) = &result {
            state.error.get_or_insert_with(|| error.clone());
        }
        result
    }));
    let message = match outcome {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(message)) => message,
        Err(_) => "a panic in the gradient hook".to_string(),
    };
    crate::ffi::malloc_message(&message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::{Backward as B, Forward as F, Step};

    #[test]
    fn buckets_take_parameters_in_reverse_up_to_the_cap() {
        assert_eq!(bucket_layout(&[4, 4, 4, 4], 8), vec![vec![3, 2], vec![1, 0]]);
        // A gradient larger than the cap is a bucket alone; small ones after it start anew.
        assert_eq!(
            bucket_layout(&[4, 100, 4, 4], 8),
            vec![vec![3, 2], vec![1], vec![0]]
        );
        // A cap below every gradient: one bucket per parameter.
        assert_eq!(bucket_layout(&[4, 4, 4], 1), vec![vec![2], vec![1], vec![0]]);
        assert_eq!(bucket_layout(&[4, 4, 4], 1 << 20), vec![vec![2, 1, 0]]);
        assert!(bucket_layout(&[], 8).is_empty());
    }

    #[test]
    fn the_last_backward_before_each_step_is_armed() {
        // GPipe / 1F1B: one step at the end of the list.
        let flushing = [F(0), F(1), B(0), F(2), B(1), B(2), Step];
        assert_eq!(last_backwards(&flushing), HashSet::from([2]));
        // PipeDream: a step after every backward, forwards in between.
        let async_ = [F(0), F(1), B(0), Step, F(2), B(1), Step, B(2), Step];
        assert_eq!(last_backwards(&async_), HashSet::from([0, 1, 2]));
    }
}
