//! The runtime's fused CUDA kernels (`csrc/kernels/fusions.cu`, run by `csrc/fusions.cpp`): a
//! convolution's bias and ReLU in one pass, and 2x2 max pooling that keeps a byte per window
//! instead of an int64 index, forward and backward. `--fused-kernels` turns them on; the models
//! call [`conv_bias_relu`] and [`max_pool2x2`], which run ATen's own operations wherever the
//! kernels are off or the tensors do not suit them (not CUDA, not bfloat16, not channels_last).
//!
//! What they compute is what ATen's operations compute, bit for bit, except the bias gradient: a
//! sum in another order (`bench/fusion_probe.py` checks both on a GPU and times them against
//! ATen).

use std::ffi::c_char;
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

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns the fused kernels on for this process (`--fused-kernels`).
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// The bridge, when the fused kernels are on and `xs` is on a GPU.
fn bridge(xs: &Tensor) -> Option<&'static super::Api> {
    if !ENABLED.load(Ordering::Relaxed) || !xs.device().is_cuda() {
        return None;
    }
    cuda().ok().map(super::Cuda::api)
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
        Some(api) => {
            let mut out = std::ptr::null_mut();
            // SAFETY: live tensor handles, read only; the bridge catches every C++ exception.
            let error = unsafe {
                (api.conv_bias_relu)(
                    xs.as_ptr(),
                    weight.as_ptr(),
                    bias.as_ptr(),
                    stride,
                    padding,
                    &mut out,
                )
            };
            made(error, out, "the fused convolution, bias and ReLU")
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' source compiles with the NVRTC beside the CUDA runtime libtorch loaded, for
    /// the GPUs the runtime meets (A100, H100/H200), as it does on first use there; no GPU needed.
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
}
