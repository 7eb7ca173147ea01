//! The runtime's fused CUDA kernels (`csrc/kernels/fusions.cu`, run by `csrc/fusions.cpp`): a
//! convolution's bias and ReLU in one pass, and 2x2 max pooling that keeps a byte per window
//! instead of an int64 index, forward and backward; a pool over a fused bias and ReLU takes one
//! backward through all three, and, where a convolution and its pool are one layer
//! ([`conv_bias_relu_pool`]), one kernel forward too. `--fused-kernels` turns them on; the models
//! call [`conv_bias_relu`], [`max_pool2x2`] and [`conv_bias_relu_pool`], which run ATen's own
//! operations wherever the kernels are off or the tensors do not suit them (not CUDA, not
//! bfloat16, not channels_last).
//!
//! What they compute is what ATen's operations compute, bit for bit, except the bias gradient: a
//! sum in another order (`bench/fusion_probe.py` checks both on a GPU and times them against
//! ATen).

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};

use tch::Tensor;
use torch_sys::C_tensor;

use super::cuda;
use crate::ffi::check;

pub(super) type ConvBiasRelu = unsafe extern "C" fn(
    *const C_tensor,
    *const C_tensor,
    *const C_tensor,
    i64,
    i64,
    *mut *mut C_tensor,
) -> *mut c_char;
pub(super) type MaxPool = unsafe extern "C" fn(*const C_tensor, *mut *mut C_tensor) -> *mut c_char;
pub(super) type Compile = unsafe extern "C" fn(i64, *mut usize) -> *mut c_char;
pub(super) type CpuStandIn = unsafe extern "C" fn(c_int);
pub(super) type GradFnName = unsafe extern "C" fn(*const C_tensor, *mut c_char, usize) -> *mut c_char;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns the fused kernels on for this process (`--fused-kernels`).
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// The bridge, when the fused kernels are on and `xs` is on a GPU (or, in tests, when this
/// thread's CPU stands in for one).
fn bridge(xs: &Tensor) -> Option<&'static super::Api> {
    let wanted = if xs.device().is_cuda() {
        ENABLED.load(Ordering::Relaxed)
    } else {
        stand_in::on()
    };
    if !wanted {
        return None;
    }
    cuda().ok().map(super::Cuda::api)
}

/// Whether this thread's CPU tensors take the fused operations: never outside the tests.
#[cfg(not(test))]
mod stand_in {
    pub fn on() -> bool {
        false
    }
}

#[cfg(test)]
mod stand_in {
    use std::cell::Cell;

    thread_local! {
        pub static ON: Cell<bool> = const { Cell::new(false) };
    }

    pub fn on() -> bool {
        ON.with(Cell::get)
    }
}

/// A tensor the bridge made, or a panic with its message, as tch's own operations fail.
fn made(error: *mut c_char, out: *mut C_tensor, what: &str) -> Tensor {
    match check(error) {
        // SAFETY: on success the bridge handed over a new `at::Tensor` that nothing else owns.
        Ok(()) => unsafe { Tensor::from_ptr(out) },
        Err(message) => panic!("{what}: {message}"),
    }
}

/// `relu(conv2d(xs, weight, bias))` with `stride` and `padding` in both dimensions: on a GPU
/// with the fused kernels on, the bias and the ReLU in one kernel each way.
pub fn conv_bias_relu(xs: &Tensor, weight: &Tensor, bias: &Tensor, stride: i64, padding: i64) -> Tensor {
    match bridge(xs) {
        Some(api) => convolve(
            api.conv_bias_relu,
            [xs, weight, bias],
            stride,
            padding,
            "the fused convolution, bias and ReLU",
        ),
        None => xs
            .conv2d(
                weight,
                Some(bias),
                [stride, stride],
                [padding, padding],
                [1, 1],
                1,
            )
            .relu_(),
    }
}

/// `max_pool2d(relu(conv2d(xs, weight, bias)), 2, 2)`, as [`max_pool2x2`] of [`conv_bias_relu`]
/// computes it: on a GPU with the fused kernels on, the bias, the ReLU and the pool in one kernel
/// each way, the activation between the ReLU and the pool never made full-size.
pub fn conv_bias_relu_pool(xs: &Tensor, weight: &Tensor, bias: &Tensor, stride: i64, padding: i64) -> Tensor {
    match bridge(xs) {
        Some(api) => convolve(
            api.conv_bias_relu_pool,
            [xs, weight, bias],
            stride,
            padding,
            "the fused convolution, bias, ReLU and pool",
        ),
        None => max_pool2x2(&conv_bias_relu(xs, weight, bias, stride, padding)),
    }
}

/// One of the bridge's fused operations that start with a convolution, on `[input, weight,
/// bias]`.
fn convolve(
    entry: ConvBiasRelu,
    [xs, weight, bias]: [&Tensor; 3],
    stride: i64,
    padding: i64,
    what: &str,
) -> Tensor {
    let mut out = std::ptr::null_mut();
    // SAFETY: live tensor handles, read only; the bridge catches every C++ exception.
    let error = unsafe {
        entry(
            xs.as_ptr(),
            weight.as_ptr(),
            bias.as_ptr(),
            stride,
            padding,
            &mut out,
        )
    };
    made(error, out, what)
}

/// `max_pool2d(xs, 2, 2)`: on a GPU with the fused kernels on, a kernel each way that keeps a
/// byte per output instead of an int64 index.
pub fn max_pool2x2(xs: &Tensor) -> Tensor {
    match bridge(xs) {
        Some(api) => {
            let mut out = std::ptr::null_mut();
            // SAFETY: a live tensor handle, read only; the bridge catches every C++ exception.
            let error = unsafe { (api.max_pool2x2)(xs.as_ptr(), &mut out) };
            made(error, out, "the fused max pool")
        }
        None => xs.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false),
    }
}

#[cfg(test)]
impl super::Cuda {
    /// Compiles the fused kernels for compute capability `arch` (90: sm_90) with NVRTC, as their
    /// first use on a device does, and gives the machine code's size; needs no GPU.
    pub fn compile_fusions(&self, arch: u32) -> Result<usize, String> {
        let mut bytes = 0usize;
        // SAFETY: a valid out-pointer; the bridge catches every C++ exception.
        check(unsafe { (self.api().fusions_compile)(i64::from(arch), &mut bytes) })?;
        Ok(bytes)
    }
}

/// This thread's CPU standing in for a GPU (see [`super::Cuda::cpu_stand_in`]) until dropped;
/// the flags are the thread's, so the guard stays on it (`!Send`).
#[cfg(test)]
pub struct StandIn(&'static super::Api, std::marker::PhantomData<*const ()>);

#[cfg(test)]
impl Drop for StandIn {
    fn drop(&mut self) {
        // SAFETY: a plain call through a loaded bridge.
        unsafe { (self.0.fusions_cpu_stand_in)(0) };
        stand_in::ON.with(|on| on.set(false));
    }
}

#[cfg(test)]
impl super::Cuda {
    /// Lets this thread's CPU tensors take the fused operations, and their kernels run on this
    /// thread with the launches a GPU gets (`csrc/fusions_cpu.cpp`): the kernels, their launch
    /// shapes, the autograd operations and when each is chosen, tested without a GPU.
    pub fn cpu_stand_in(&'static self) -> StandIn {
        // SAFETY: a plain call through a loaded bridge.
        unsafe { (self.api().fusions_cpu_stand_in)(1) };
        stand_in::ON.with(|on| on.set(true));
        StandIn(self.api(), std::marker::PhantomData)
    }

    /// The name of the autograd node that made `xs` (empty for a leaf).
    pub fn grad_fn_name(&self, xs: &Tensor) -> String {
        let mut buffer = [0 as c_char; 256];
        // SAFETY: a live tensor handle, read only; the buffer outlives the call and its length
        // is passed.
        check(unsafe { (self.api().grad_fn_name)(xs.as_ptr(), buffer.as_mut_ptr(), buffer.len()) })
            .expect("the autograd node's name");
        // SAFETY: the bridge NUL-terminates within the buffer.
        unsafe { std::ffi::CStr::from_ptr(buffer.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Per channel of `terms` ([n, c, h, w]), the sum of their magnitudes in float: what bounds a
/// bias gradient summed from them.
#[cfg(test)]
pub(crate) fn channel_magnitudes(terms: &Tensor) -> Tensor {
    terms
        .to_kind(tch::Kind::Float)
        .abs()
        .sum_dim_intlist([0i64, 2, 3].as_slice(), false, tch::Kind::Float)
}

/// A bias gradient the fused operations summed against ATen's: float sums of the same bf16 terms
/// in another order, each rounded to bf16, so within 2^-7 of `magnitudes` (the terms'
/// [`channel_magnitudes`]); and ATen's not zero, which would prove nothing.
#[cfg(test)]
pub(crate) fn assert_bias_gradient_close(ours: &Tensor, aten: &Tensor, magnitudes: &Tensor, what: &str) {
    let off = (ours.to_kind(tch::Kind::Float) - aten.to_kind(tch::Kind::Float)).abs();
    let bound = magnitudes * 2f64.powi(-7);
    assert!(
        bool::try_from(off.le_tensor(&bound).all()).unwrap(),
        "{what}: the bias gradient is off by {off:?} against a bound of {bound:?}"
    );
    assert!(
        bool::try_from(aten.abs().sum(tch::Kind::Float).gt(0.0)).unwrap(),
        "{what}: a bias gradient of zero proves nothing"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' source compiles with the NVRTC beside the CUDA runtime libtorch loaded, for
    /// the GPUs the runtime meets (A100, H100/H200), as it does on first use there, into machine
    /// code that holds every kernel the bridge loads by name; no GPU needed.
    #[test]
    fn the_fused_kernels_compile_for_ampere_and_hopper() {
        let Ok(cuda) = cuda() else {
            eprintln!(
                "SKIPPED the_fused_kernels_compile_for_ampere_and_hopper: no CUDA bridge in this build"
            );
            return;
        };
        for arch in [80, 90] {
            let bytes = cuda
                .compile_fusions(arch)
                .unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
            assert!(bytes > 1000, "sm_{arch}: {bytes} bytes of machine code");
        }
        let err = cuda.compile_fusions(1).unwrap_err();
        assert!(err.contains("sm_1"), "{err}");
    }

    use tch::{Device, Kind};

    // Drawn holding the CPU generator, so that other tests' seeded draws stay theirs.
    use crate::models::seeded;

    /// `t` ([n, c, h, w]) laid out channels_last, as the kernels read it.
    fn channels_last(t: &Tensor) -> Tensor {
        t.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2])
    }

    /// A bf16 tensor of `shape` (channels_last when 4-D) from normals times `scale` (drawn under
    /// [`seeded`]).
    fn bf16(shape: &[i64], scale: f64) -> Tensor {
        let t = (Tensor::randn(shape, (Kind::Float, Device::Cpu)) * scale).to_kind(Kind::BFloat16);
        match shape.len() {
            4 => channels_last(&t),
            _ => t,
        }
    }

    /// A 3x3 convolution's input `[n, cin, h, w]`, weight `[c, cin, 3, 3]` and bias `[c]`, bf16,
    /// drawn from `seed`; half the bias is negative enough that many of its outputs' ReLUs give
    /// zeros.
    fn conv_leaves(seed: i64, [n, cin, h, w]: [i64; 4], c: i64) -> [Tensor; 3] {
        seeded(seed, || {
            let b = bf16(&[c], 1.0)
                - Tensor::from_slice(&[0.0f32, 2.0])
                    .repeat([c / 2])
                    .to_kind(Kind::BFloat16);
            [bf16(&[n, cin, h, w], 1.0), bf16(&[c, cin, 3, 3], 0.2), b]
        })
    }

    /// One side's leaves (input, weight, bias), each a copy of `of`'s, requiring gradients.
    fn leaves(of: &[&Tensor; 3]) -> [Tensor; 3] {
        of.map(|t| t.detach().copy().set_requires_grad(true))
    }

    /// `relu(conv2d(x, w) + b)` as ATen's own operations, the bias added after the convolution
    /// as the fused path adds it.
    fn aten_conv_bias_relu([x, w, b]: &[Tensor; 3]) -> Tensor {
        (x.conv2d(w, None::<&Tensor>, [1, 1], [1, 1], [1, 1], 1) + b.view([1, -1, 1, 1])).relu()
    }

    fn aten_pool(y: &Tensor) -> Tensor {
        y.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false)
    }

    /// `sum(p * k)` in float: its gradient reaches `p` as `k` rounded to p's bf16.
    fn weighted(p: &Tensor, k: &Tensor) -> Tensor {
        (p.to_kind(Kind::Float) * k).sum(Kind::Float)
    }

    /// The fused side's gradients are ATen's: the input's and the weight's bit for bit (the
    /// convolution's backward gets the same gradient on both sides), the bias's, float sums of
    /// bf16 terms in another order, each rounded to bf16, within 2^-7 of `terms`, the sum of
    /// its terms' magnitudes per channel.
    fn same_gradients(ours: &[Tensor; 3], aten: &[Tensor; 3], terms: &Tensor, what: &str) {
        for (i, name) in [(0, "input"), (1, "weight")] {
            assert!(
                ours[i].grad().equal(&aten[i].grad()),
                "{what}: the {name}'s gradient differs from ATen's"
            );
        }
        assert_bias_gradient_close(&ours[2].grad(), &aten[2].grad(), terms, what);
    }

    /// The fused pool picks, in every window, the value ATen's pool picks and sends the gradient
    /// where ATen's sends it, where that choice is hardest: windows with ties (the first maximum
    /// wins) and with NaNs (a NaN wins, a later one over an earlier). The input is small
    /// integers, so most windows tie, and one value in fifty a NaN; the kernels run on the CPU,
    /// two blocks at a time, so both of the pool's grid-stride loops take several passes.
    #[test]
    fn the_fused_pool_picks_atens_winner_among_ties_and_nans() {
        let Ok(cuda) = cuda() else {
            eprintln!(
                "SKIPPED the_fused_pool_picks_atens_winner_among_ties_and_nans: no CUDA bridge in \
                 this build"
            );
            return;
        };
        let shape = [2i64, 16, 32, 32];
        let (x, k) = seeded(5, || {
            let values = Tensor::randint(4, shape, (Kind::Float, Device::Cpu));
            let nans = Tensor::rand(shape, (Kind::Float, Device::Cpu)).lt(0.02);
            (
                channels_last(&values.masked_fill(&nans, f64::NAN).to_kind(Kind::BFloat16)),
                Tensor::randn([2, 16, 16, 16], (Kind::Float, Device::Cpu)),
            )
        });

        let aten_x = x.copy().set_requires_grad(true);
        let aten_p = aten_pool(&aten_x);
        let ours_x = x.copy().set_requires_grad(true);
        let ours_p = {
            let _cpu = cuda.cpu_stand_in();
            max_pool2x2(&ours_x)
        };
        let name = cuda.grad_fn_name(&ours_p);
        assert!(name.contains("MaxPool2x2"), "{name}");
        let pooled_nans = i64::try_from(aten_p.isnan().sum(Kind::Int64)).unwrap();
        assert!(pooled_nans > 0, "no NaN was pooled: nothing tested");
        assert!(
            ours_p.isnan().equal(&aten_p.isnan()),
            "the pooled NaNs are not where ATen's are"
        );
        let numbers = |p: &Tensor| p.nan_to_num(0.0, 0.0, 0.0);
        assert!(
            numbers(&ours_p).equal(&numbers(&aten_p)),
            "the pooled values differ from ATen's"
        );
        weighted(&aten_p, &k).backward();
        weighted(&ours_p, &k).backward();
        assert!(
            ours_x.grad().equal(&aten_x.grad()),
            "the gradient does not reach the places ATen's reaches"
        );
    }

    /// A convolution with its bias, ReLU and pool as one operation ([`conv_bias_relu_pool`],
    /// vgg16's last convolution of a block and its pool in one stage) runs one kernel each way
    /// (`BiasReluPool`) and gives exactly what the two operations give one after the other
    /// (the pooled activations, and every gradient, the bias's included, since both sum it in
    /// the same kernel), and ATen's values: bit for bit but the bias's gradient, as
    /// [`same_gradients`] says. Half the bias is negative enough that many windows pool zeros.
    /// Without a gradient it records nothing; an output of odd size goes through the two
    /// operations (ATen's pool) with ATen's values. The kernels run on the CPU, two blocks at a
    /// time, so their grid-stride loops take several passes.
    #[test]
    fn a_convolution_with_its_pool_takes_one_kernel_each_way_with_the_two_operations_values() {
        let Ok(cuda) = cuda() else {
            eprintln!(
                "SKIPPED a_convolution_with_its_pool_takes_one_kernel_each_way_with_the_two_\
                 operations_values: no CUDA bridge in this build"
            );
            return;
        };
        let [x, w, b] = conv_leaves(7, [2, 8, 32, 32], 16);
        let (k, k_odd) = seeded(8, || {
            (
                Tensor::randn([2, 16, 16, 16], (Kind::Float, Device::Cpu)),
                Tensor::randn([2, 16, 15, 15], (Kind::Float, Device::Cpu)),
            )
        });

        let two = leaves(&[&x, &w, &b]);
        let two_p = {
            let _cpu = cuda.cpu_stand_in();
            max_pool2x2(&conv_bias_relu(&two[0], &two[1], &two[2], 1, 1))
        };
        assert_eq!(cuda.grad_fn_name(&two_p), "PoolReluBiasBackward");
        weighted(&two_p, &k).backward();
        let ours = leaves(&[&x, &w, &b]);
        let ours_p = {
            let _cpu = cuda.cpu_stand_in();
            conv_bias_relu_pool(&ours[0], &ours[1], &ours[2], 1, 1)
        };
        let name = cuda.grad_fn_name(&ours_p);
        assert!(name.contains("BiasReluPool"), "{name}");
        assert!(
            ours_p.equal(&two_p),
            "the pooled activations differ from the two operations'"
        );
        let zeros = i64::try_from(ours_p.eq(0.0).sum(Kind::Int64)).unwrap();
        assert!(zeros > 0 && zeros < ours_p.numel() as i64, "{zeros} zeros pooled");
        weighted(&ours_p, &k).backward();
        for (i, leaf) in ["input", "weight", "bias"].iter().enumerate() {
            assert!(
                ours[i].grad().equal(&two[i].grad()),
                "the {leaf}'s gradient differs from the two operations'"
            );
        }
        let aten = leaves(&[&x, &w, &b]);
        let aten_p = aten_pool(&aten_conv_bias_relu(&aten));
        assert!(ours_p.equal(&aten_p), "the pooled activations differ from ATen's");
        weighted(&aten_p, &k).backward();
        same_gradients(
            &ours,
            &aten,
            &channel_magnitudes(&k.to_kind(Kind::BFloat16)),
            "fused",
        );

        // Without a gradient: the same values, nothing recorded.
        let plain = || [x.copy(), w.copy(), b.copy()];
        let ours_p = tch::no_grad(|| {
            let _cpu = cuda.cpu_stand_in();
            conv_bias_relu_pool(&x, &w, &b, 1, 1)
        });
        assert_eq!(cuda.grad_fn_name(&ours_p), "");
        assert!(ours_p.equal(&tch::no_grad(|| aten_pool(&aten_conv_bias_relu(&plain())))));

        // An odd size: the fused bias and ReLU, then ATen's pool (the last row and column left
        // out), with ATen's values.
        let odd = channels_last(&x.narrow(2, 0, 31).narrow(3, 0, 31));
        let aten = leaves(&[&odd, &w, &b]);
        let aten_p = aten_pool(&aten_conv_bias_relu(&aten));
        let ours = leaves(&[&odd, &w, &b]);
        let ours_p = {
            let _cpu = cuda.cpu_stand_in();
            conv_bias_relu_pool(&ours[0], &ours[1], &ours[2], 1, 1)
        };
        let name = cuda.grad_fn_name(&ours_p);
        assert!(name.starts_with("MaxPool2DWithIndices"), "{name}");
        assert!(
            ours_p.equal(&aten_p),
            "odd: the pooled activations differ from ATen's"
        );
        weighted(&aten_p, &k_odd).backward();
        weighted(&ours_p, &k_odd).backward();
        same_gradients(
            &ours,
            &aten,
            &channel_magnitudes(&k_odd.to_kind(Kind::BFloat16)),
            "odd",
        );
    }

    /// A 2x2 pool over the fused bias and ReLU (vgg16's last convolution of each block) takes
    /// one backward through the pool, the ReLU and the bias (`PoolReluBiasBackward`, one kernel
    /// on a GPU) instead of the pool's and then BiasRelu's, with ATen's values: the pooled
    /// activations bit for bit, and the gradients as [`same_gradients`] says. Half the bias is
    /// negative enough that many windows pool zeros, whose gradient the ReLU stops.
    ///
    /// Also, where BiasRelu's output has a second use, its own backward takes that use's
    /// gradient and the two reach the convolution summed, as ATen's one backward does; an
    /// output changed in place after BiasRelu pools with the plain fused pool; a pool without
    /// a gradient records nothing. The CPU stands in for the GPU: the kernels themselves run
    /// there, two blocks at a time, so every kernel's grid-stride loop takes several passes
    /// over these tensors.
    #[test]
    fn a_pool_over_the_fused_bias_and_relu_takes_one_backward_with_atens_values() {
        let Ok(cuda) = cuda() else {
            eprintln!(
                "SKIPPED a_pool_over_the_fused_bias_and_relu_takes_one_backward_with_atens_values: \
                 no CUDA bridge in this build"
            );
            return;
        };
        let [x, w, b] = conv_leaves(3, [2, 8, 32, 32], 16);
        let (k, k2) = seeded(4, || {
            (
                Tensor::randn([2, 16, 16, 16], (Kind::Float, Device::Cpu)),
                Tensor::randn([2, 16, 32, 32], (Kind::Float, Device::Cpu)),
            )
        });
        // Each pooled gradient reaches one place; the magnitudes of k rounded to bf16 bound the
        // bias gradient's terms.
        let mag = |k: &Tensor| channel_magnitudes(&k.to_kind(Kind::BFloat16));

        // One use: the pool.
        let aten = leaves(&[&x, &w, &b]);
        let aten_p = aten_pool(&aten_conv_bias_relu(&aten));
        weighted(&aten_p, &k).backward();
        let ours = leaves(&[&x, &w, &b]);
        let ours_p = {
            let _cpu = cuda.cpu_stand_in();
            let y = conv_bias_relu(&ours[0], &ours[1], &ours[2], 1, 1);
            assert!(
                cuda.grad_fn_name(&y).contains("BiasRelu"),
                "{}",
                cuda.grad_fn_name(&y)
            );
            max_pool2x2(&y)
        };
        assert_eq!(cuda.grad_fn_name(&ours_p), "PoolReluBiasBackward");
        assert!(ours_p.equal(&aten_p), "the pooled activations differ from ATen's");
        let zeros = i64::try_from(aten_p.eq(0.0).sum(Kind::Int64)).unwrap();
        assert!(zeros > 0 && zeros < aten_p.numel() as i64, "{zeros} zeros pooled");
        weighted(&ours_p, &k).backward();
        same_gradients(&ours, &aten, &mag(&k), "one use");

        // Two uses: the pool, and a weighted sum of BiasRelu's output itself.
        let aten = leaves(&[&x, &w, &b]);
        let aten_y = aten_conv_bias_relu(&aten);
        (weighted(&aten_pool(&aten_y), &k) + weighted(&aten_y, &k2)).backward();
        let ours = leaves(&[&x, &w, &b]);
        let (ours_y, ours_p) = {
            let _cpu = cuda.cpu_stand_in();
            let y = conv_bias_relu(&ours[0], &ours[1], &ours[2], 1, 1);
            let p = max_pool2x2(&y);
            (y, p)
        };
        assert_eq!(cuda.grad_fn_name(&ours_p), "PoolReluBiasBackward");
        (weighted(&ours_p, &k) + weighted(&ours_y, &k2)).backward();
        same_gradients(&ours, &aten, &(mag(&k) + mag(&k2)), "two uses");

        // Not BiasRelu's output as it came (here doubled): the plain fused pool, and BiasRelu's
        // own backward after it, with ATen's values.
        let aten = leaves(&[&x, &w, &b]);
        let aten_p = aten_pool(&(aten_conv_bias_relu(&aten) * 2.0));
        weighted(&aten_p, &k).backward();
        let ours = leaves(&[&x, &w, &b]);
        let ours_p = {
            let _cpu = cuda.cpu_stand_in();
            max_pool2x2(&(conv_bias_relu(&ours[0], &ours[1], &ours[2], 1, 1) * 2.0))
        };
        let name = cuda.grad_fn_name(&ours_p);
        assert!(name.contains("MaxPool2x2"), "{name}");
        assert!(
            ours_p.equal(&aten_p),
            "doubled: the pooled activations differ from ATen's"
        );
        weighted(&ours_p, &k).backward();
        same_gradients(&ours, &aten, &(mag(&k) * 2.0), "doubled");

        // Without a gradient: the same values, nothing recorded.
        let ours_p = tch::no_grad(|| {
            let _cpu = cuda.cpu_stand_in();
            max_pool2x2(&conv_bias_relu(&x, &w, &b, 1, 1))
        });
        assert_eq!(cuda.grad_fn_name(&ours_p), "");
        assert!(ours_p.equal(&tch::no_grad(|| aten_pool(&aten_conv_bias_relu(&[
            x.copy(),
            w.copy(),
            b.copy()
        ])))));
    }

    /// Every kernel indexes every shape vgg16's blocks give it, and refuses one it cannot take:
    /// for convolution outputs of 8 to 512 channels (one to 64 of a thread's 16-byte vectors a
    /// pixel, so a block's 256 threads take 256 to 4 pixels a pass), pooled rows of odd and
    /// even length (vgg16's last pool at 224x224 gives 7x7) and a single output pixel, the
    /// convolution with its pool, the convolution alone, and the pool alone give ATen's values,
    /// and gradients as [`same_gradients`] says (the pool's bit for bit). 24 channels (3 vectors,
    /// which do not divide a block) go to ATen's kernels, with ATen's values. The kernels run on
    /// the CPU, two blocks at a time, so the larger shapes take many passes of each grid-stride
    /// loop.
    #[test]
    fn every_kernel_indexes_the_shapes_vgg16_gives_it_and_refuses_what_it_cannot_take() {
        let Ok(cuda) = cuda() else {
            eprintln!(
                "SKIPPED every_kernel_indexes_the_shapes_vgg16_gives_it_and_refuses_what_it_\
                 cannot_take: no CUDA bridge in this build"
            );
            return;
        };
        // [n, c, h, w] of the convolution's output; whether the fused kernels take it.
        let shapes = [
            ([2i64, 512, 14, 14], true),
            ([3, 64, 10, 6], true),
            ([1, 8, 2, 2], true),
            ([2, 24, 8, 8], false),
        ];
        for (seed, ([n, c, h, w], fused)) in (20..).step_by(2).zip(shapes) {
            let what = format!("[{n}, {c}, {h}, {w}]");
            let [x, wt, b] = conv_leaves(seed, [n, 8, h, w], c);
            let (plain, k, k_full) = seeded(seed + 1, || {
                (
                    bf16(&[n, c, h, w], 1.0),
                    Tensor::randn([n, c, h / 2, w / 2], (Kind::Float, Device::Cpu)),
                    Tensor::randn([n, c, h, w], (Kind::Float, Device::Cpu)),
                )
            });
            let mag = |k: &Tensor| channel_magnitudes(&k.to_kind(Kind::BFloat16));
            let expect = |name: String, ours: &str, aten: &str, case: &str| {
                let wanted = if fused { ours } else { aten };
                assert!(
                    name.contains(wanted) && (fused || !name.contains(ours)),
                    "{what}, {case}: {name}, not {wanted}"
                );
            };

            // A convolution's case: the bridge's `ours_op` and ATen's `aten_op` on the same
            // leaves, the output weighted by `k`.
            type Op<'a> = &'a dyn Fn(&[Tensor; 3]) -> Tensor;
            let conv_case = |ours_op: Op, aten_op: Op, k: &Tensor, names: [&str; 2], case: &str| {
                let aten = leaves(&[&x, &wt, &b]);
                let aten_out = aten_op(&aten);
                weighted(&aten_out, k).backward();
                let ours = leaves(&[&x, &wt, &b]);
                let ours_out = {
                    let _cpu = cuda.cpu_stand_in();
                    ours_op(&ours)
                };
                expect(cuda.grad_fn_name(&ours_out), names[0], names[1], case);
                assert!(
                    ours_out.equal(&aten_out),
                    "{what}, {case}: the activations differ from ATen's"
                );
                weighted(&ours_out, k).backward();
                same_gradients(&ours, &aten, &mag(k), &format!("{what}, {case}"));
            };
            // With its pool: bias_relu_pool, pool_relu_bias_backward.
            conv_case(
                &|[x, w, b]| conv_bias_relu_pool(x, w, b, 1, 1),
                &|leaves| aten_pool(&aten_conv_bias_relu(leaves)),
                &k,
                ["BiasReluPool", "MaxPool2DWithIndices"],
                "with its pool",
            );
            // Alone: bias_relu, relu_bias_backward.
            conv_case(
                &|[x, w, b]| conv_bias_relu(x, w, b, 1, 1),
                &aten_conv_bias_relu,
                &k_full,
                ["BiasRelu", "Relu"],
                "alone",
            );

            // The pool alone: pool_forward, pool_backward.
            let aten_x = plain.copy().set_requires_grad(true);
            let aten_p = aten_pool(&aten_x);
            weighted(&aten_p, &k).backward();
            let ours_x = plain.copy().set_requires_grad(true);
            let ours_p = {
                let _cpu = cuda.cpu_stand_in();
                max_pool2x2(&ours_x)
            };
            expect(
                cuda.grad_fn_name(&ours_p),
                "MaxPool2x2",
                "MaxPool2DWithIndices",
                "the pool",
            );
            assert!(
                ours_p.equal(&aten_p),
                "{what}: the pool's values differ from ATen's"
            );
            weighted(&ours_p, &k).backward();
            assert!(
                ours_x.grad().equal(&aten_x.grad()),
                "{what}: the pool's gradient differs from ATen's"
            );
        }
    }
}
