//! The replicas' gradient all-reduce, as DDP's reducer does it: parameters in reverse order (about
//! the order backward produces their gradients) packed into flat buckets of at most a byte cap,
//! each bucket's all-reduce started as soon as the last backward before a step has written all of
//! its gradients, while the rest of that backward runs; the step waits for them.
//!
//! With overlap off the same buckets are all-reduced after the backward, in the same order, so
//! both ways run the same collectives on the same flat buffers and give the same bits. A bucket
//! starts only after every earlier one has (c10d matches collectives by issue order, so every
//! replica must issue them in one order whatever order its autograd produced gradients in).
//!
//! A gradient moves into its bucket's buffer once, when the bucket starts, and the parameter's
//! gradient is from then on a view into it (DDP's `gradient_as_bucket_view`): the all-reduce sums
//! the gradients where the optimizer reads them, with no copy back, and the buffer is freed with
//! the gradients at the next `zero_grad`.

use std::collections::HashSet;
use std::ffi::{c_char, c_void};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use tch::{Device, Tensor};

use crate::comm::{ProcessGroup, Work};
use crate::config::ReduceOptions;
use crate::schedule::Action;
use crate::stage::{set_grad, set_grad_ready_hook, GradReadyFn};

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
    /// copying back the sums of any gradients that are not views into their bucket (the
    /// all-reduce the step waits on).
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

/// Gradients gathered into one flat buffer, for a collective that sums them in place. A gradient
/// on the buffer's device with its dtype moves into the buffer and stays there: the parameter's
/// gradient becomes a view into it, with the strides autograd gave it (DDP's
/// `gradient_as_bucket_view`), so the sums need no copying back. The others (a stage over several
/// devices reduces on its first one) are copied in, and back by [`Flat::scatter`].
pub struct Flat {
    /// The gradients, end to end, in the order gathered.
    pub tensor: Tensor,
    /// The parameters whose gradients were copied in rather than moved, each with its offset in
    /// `tensor`.
    copied: Vec<(usize, i64)>,
}

impl Flat {
    /// Gathers the gradients of `params[i]` for each `i` in `indices`, in that order, into a
    /// buffer on `device` with the first one's dtype, multiplied by `scale` if given. Every one of
    /// those parameters must have a gradient.
    pub fn gather(
        params: &[Tensor],
        indices: &[usize],
        device: Device,
        scale: Option<f64>,
    ) -> Result<Flat, String> {
        tch::no_grad(|| {
            let grads = indices
                .iter()
                .map(|&i| match params[i].grad() {
                    grad if grad.defined() => Ok(grad),
                    _ => Err(format!("internal error: parameter {i} has no gradient to reduce")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let kind = grads.first().map_or(tch::Kind::Float, Tensor::kind);
            let total = grads.iter().map(|g| g.numel() as i64).sum::<i64>();
            let mut tensor = Tensor::f_empty([total], (kind, device)).map_err(|e| e.to_string())?;
            let mut copied = Vec::new();
            let mut offset = 0;
            for (&i, grad) in indices.iter().zip(&grads) {
                let n = grad.numel() as i64;
                if grad.device() == device && grad.kind() == kind {
                    let size = grad.size();
                    let stride = dense_strides(&size, &grad.stride());
                    let mut view = tensor
                        .f_as_strided(&size, &stride, offset)
                        .map_err(|e| e.to_string())?;
                    view.f_copy_(grad).map_err(|e| e.to_string())?;
                    set_grad(&params[i], &view)?;
                } else {
                    tensor
                        .narrow(0, offset, n)
                        .f_copy_(&grad.reshape([-1]))
                        .map_err(|e| e.to_string())?;
                    copied.push((i, offset));
                }
                offset += n;
            }
            if let Some(scale) = scale {
                let _ = tensor.f_mul_scalar_(scale).map_err(|e| e.to_string())?;
            }
            Ok(Flat { tensor, copied })
        })
    }

    /// Copies the buffer's sums back into the gradients that were copied in (the rest are views of
    /// it and hold them already). `params` are the ones [`Flat::gather`] was given.
    pub fn scatter(&self, params: &[Tensor]) -> Result<(), String> {
        tch::no_grad(|| {
            for &(i, offset) in &self.copied {
                let grad = params[i].grad();
                let n = grad.numel() as i64;
                grad.data()
                    .f_copy_(&self.tensor.narrow(0, offset, n).view_as(&grad))
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    }

    /// The buffer's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.tensor.numel() as u64 * self.tensor.kind().elt_size_in_bytes() as u64
    }
}

/// A bucket whose all-reduce has started.
struct Started {
    /// The bucket's gradients, summed in place by the all-reduce.
    flat: Flat,
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

    /// Gathers the next bucket's gradients into a flat buffer ([`Flat::gather`]) and starts its
    /// all-reduce.
    fn start_next(&mut self, group: &ProcessGroup, early: bool) -> Result<(), String> {
        let bucket = &self.buckets[self.started.len()];
        let flat = Flat::gather(&self.params, bucket, self.device, self.scale)?;
        let work = group
            .all_reduce_sum(std::slice::from_ref(&flat.tensor))
            .map_err(|e| e.to_string())?;
        self.started.push(Started { flat, work, early });
        Ok(())
    }
}

/// The strides of a view over `size.iter().product()` consecutive elements that holds a gradient
/// of these `size` and `stride`: its own where it fills such a run of memory, each element once
/// (PyTorch's non-overlapping and dense, which autograd's layout contract gives the gradient of
/// every parameter that is: channels_last convolution weights keep their layout), else those of
/// a contiguous tensor.
fn dense_strides(size: &[i64], stride: &[i64]) -> Vec<i64> {
    let mut dims: Vec<(i64, i64)> = stride
        .iter()
        .zip(size)
        .filter(|&(_, &n)| n != 1)
        .map(|(&s, &n)| (s, n))
        .collect();
    dims.sort_unstable();
    let mut next = 1;
    let dense = size.contains(&0)
        || dims.into_iter().all(|(s, n)| {
            let fits = s == next;
            next *= n;
            fits
        });
    if dense {
        return stride.to_vec();
    }
    let mut contiguous = vec![1; size.len()];
    for d in (0..size.len().saturating_sub(1)).rev() {
        contiguous[d] = contiguous[d + 1] * size[d + 1].max(1);
    }
    contiguous
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

    /// After the step's last backward: starts the buckets not started yet and waits for every
    /// all-reduce, after which the gradients hold the sums. Every parameter must have a gradient.
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
                    .map(|s| ring_bytes(s.flat.bytes(), group.size()))
                    .sum(),
            };
            for started in state.started.drain(..) {
                started.work.wait().map_err(|e| e.to_string())?;
                started.flat.scatter(&state.params)?;
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
    fn a_view_keeps_a_dense_gradients_strides_and_makes_others_contiguous() {
        // Contiguous, channels_last (N, C, H, W with C fastest) and a transposed matrix: dense.
        assert_eq!(dense_strides(&[4, 3], &[3, 1]), [3, 1]);
        assert_eq!(dense_strides(&[8, 3, 5, 5], &[75, 1, 15, 3]), [75, 1, 15, 3]);
        assert_eq!(dense_strides(&[3, 4], &[1, 3]), [1, 3]);
        // A dimension of one may have any stride; an empty tensor fills nothing.
        assert_eq!(dense_strides(&[1, 4], &[99, 1]), [99, 1]);
        assert_eq!(dense_strides(&[0, 4], &[7, 3]), [7, 3]);
        // Every other element, or one element twice (an expanded dimension): contiguous instead.
        assert_eq!(dense_strides(&[4, 3], &[6, 2]), [3, 1]);
        assert_eq!(dense_strides(&[2, 3, 4], &[0, 4, 1]), [12, 4, 1]);
    }

    /// Two replicas on threads, over Gloo on loopback: each parameter's gradient ends as the sum,
    /// in its own layout, as a view into its bucket's one buffer, with nothing copied back.
    #[test]
    fn the_sums_land_in_gradients_that_are_views_of_their_bucket() {
        use crate::comm::Store;
        use tch::Kind;
        const TIMEOUT: Duration = Duration::from_secs(20);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut listener = Some(listener);
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let listener = listener.take();
                std::thread::spawn(move || {
                    let store = match listener {
                        Some(l) => Store::host(l, 2, TIMEOUT),
                        None => Store::connect("127.0.0.1", port, 2, false, TIMEOUT),
                    }
                    .unwrap();
                    let group = ProcessGroup::gloo(&store, rank, 2, TIMEOUT).unwrap();
                    let cpu = (Kind::Float, Device::Cpu);
                    let matrix = Tensor::zeros([3, 4], cpu).set_requires_grad(true);
                    // A channels_last convolution weight: channels fastest.
                    let conv = Tensor::zeros([2, 3, 2, 2], cpu)
                        .permute([0, 2, 3, 1])
                        .contiguous()
                        .permute([0, 3, 1, 2])
                        .set_requires_grad(true);
                    let bias = Tensor::zeros([5], cpu).set_requires_grad(true);
                    let params = [matrix, conv, bias];
                    // Rank r's gradient of each parameter is (r + 1) times 0, 1, 2, ... in
                    // logical order: small integers, so the sum is exact.
                    let loss = params.iter().fold(Tensor::zeros([], cpu), |loss, p| {
                        let weights = Tensor::arange(p.numel() as i64, cpu).view(p.size().as_slice());
                        loss + (p * weights * (rank + 1) as f64).sum(Kind::Float)
                    });
                    loss.backward();
                    let options = ReduceOptions {
                        bucket_bytes: 1 << 20,
                        overlap: false,
                        partial: None,
                    };
                    let mut reducer = Reducer::new(&params, options, None).unwrap();
                    let stats = reducer.finish(&group, Device::Cpu).unwrap();
                    assert_eq!(stats.buckets, 1);
                    params
                })
            })
            .collect();
        for (rank, handle) in ranks.into_iter().enumerate() {
            let params = handle.join().unwrap();
            let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            for (p, g) in params.iter().zip(&grads) {
                let sum = Tensor::arange(p.numel() as i64, (tch::Kind::Float, Device::Cpu))
                    .view(p.size().as_slice())
                    * 3.0;
                assert!(g.equal(&sum), "rank {rank}: {g} against {sum}");
                assert_eq!(g.stride(), p.stride(), "rank {rank}: the parameter's layout");
            }
            // One buffer, parameters in reverse order: bias, conv, matrix.
            let at = |g: &Tensor| g.data_ptr() as usize;
            assert_eq!(at(&grads[1]), at(&grads[2]) + 5 * 4, "rank {rank}");
            assert_eq!(at(&grads[0]), at(&grads[1]) + 24 * 4, "rank {rank}");
        }
    }

    /// A gradient of another dtype than the buffer's (its first gradient's) is copied in, not
    /// moved: its parameter keeps its own gradient, which gets the buffer's values back from
    /// `scatter`; the others are views from `gather` on.
    #[test]
    fn a_gradient_of_another_dtype_is_copied_in_and_its_sum_copied_back() {
        use tch::Kind;
        let params = [
            Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
            Tensor::zeros([4], (Kind::Double, Device::Cpu)).set_requires_grad(true),
        ];
        let loss = params
            .iter()
            .fold(Tensor::zeros([], (Kind::Double, Device::Cpu)), |loss, p| {
                let weights =
                    Tensor::arange(p.numel() as i64, (p.kind(), Device::Cpu)).view(p.size().as_slice());
                loss + (p * weights).sum(Kind::Double)
            });
        loss.backward();
        let double = params[1].grad();
        let flat = Flat::gather(&params, &[1, 0], Device::Cpu, Some(2.0)).unwrap();
        // The first gradient gathered (the double one) gives the buffer its dtype and moves; the
        // float one is copied in after it.
        assert_eq!(flat.tensor.kind(), Kind::Double);
        assert_eq!(flat.copied, [(0, 4)]);
        assert_eq!(
            params[1].grad().data_ptr(),
            flat.tensor.data_ptr(),
            "the double one is a view"
        );
        assert_ne!(double.data_ptr(), flat.tensor.data_ptr());
        // A collective's sum, standing in: add 1 everywhere.
        let _ = flat.tensor.shallow_clone().f_add_scalar_(1.0).unwrap();
        flat.scatter(&params).unwrap();
        for p in &params {
            let expected =
                Tensor::arange(p.numel() as i64, (p.kind(), Device::Cpu)).view(p.size().as_slice()) * 2.0
                    + 1.0;
            assert!(p.grad().equal(&expected), "{} against {expected}", p.grad());
            assert_eq!(p.grad().kind(), p.kind());
        }
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
