//! Autograd operations beyond tch's `backward()`, through `csrc/autograd.cpp`.

use std::os::raw::{c_char, c_void};

use tch::Tensor;
use torch_sys::C_tensor;

use crate::ffi::check;

extern "C" {
    fn sh_backward_with_grad(output: *const C_tensor, grad: *const C_tensor) -> *mut c_char;
    fn sh_grad_to_none(param: *mut C_tensor) -> *mut c_char;
    fn sh_set_grad(param: *const C_tensor, grad: *const C_tensor) -> *mut c_char;
    fn sh_set_grad_ready_hook(
        param: *const C_tensor,
        hook: Option<GradReadyFn>,
        context: *mut c_void,
        index: i64,
    ) -> *mut c_char;
}

/// A parameter's gradient-ready hook: called with its context and index once a backward has
/// written the parameter's gradient; returns null, or a message from
/// [`crate::ffi::malloc_message`] that fails the backward.
pub type GradReadyFn = unsafe extern "C" fn(context: *mut c_void, index: i64) -> *mut c_char;

/// Backward from `output` given the gradient of the loss with respect to it (a pipeline stage's
/// backward with the gradient its successor sent); gradients accumulate into the leaves.
pub fn backward_with_grad(output: &Tensor, grad: &Tensor) -> Result<(), String> {
    // SAFETY: both handles are live tch tensors, which point at `at::Tensor`s; the bridge only
    // reads them and catches every C++ exception.
    check(unsafe { sh_backward_with_grad(output.as_ptr(), grad.as_ptr()) })
}

/// Drops a parameter's gradient (PyTorch's `zero_grad(set_to_none=True)`): no memset, and the
/// next backward writes the gradient instead of accumulating into zeros.
pub fn grad_to_none(param: &mut Tensor) -> Result<(), String> {
    // SAFETY: a live tch tensor handle; the bridge resets its gradient and catches exceptions.
    check(unsafe { sh_grad_to_none(param.as_mut_ptr()) })
}

/// Makes `grad` itself (a view, say) `param`'s gradient, which later backwards accumulate into in
/// place; it must have the parameter's shape, dtype and device.
pub fn set_grad(param: &Tensor, grad: &Tensor) -> Result<(), String> {
    // SAFETY: live tch tensor handles; the bridge checks them and catches every C++ exception.
    check(unsafe { sh_set_grad(param.as_ptr(), grad.as_ptr()) })
}

/// Sets `param`'s post-accumulate-grad hook (replacing any) to `hook` = (function, context),
/// called with `index`; `None` removes it. The hook stays with the parameter across backwards and
/// weight stashing's `set_data`.
///
/// # Safety
/// `context` must stay valid for the function until the hook is removed or replaced, and the
/// function must be callable from autograd's threads (CUDA parameters' hooks run on the device's
/// autograd thread while the caller of `backward` waits).
pub unsafe fn set_grad_ready_hook(
    param: &Tensor,
    hook: Option<(GradReadyFn, *mut c_void)>,
    index: usize,
) -> Result<(), String> {
    let (function, context) = hook.map_or((None, std::ptr::null_mut()), |(f, c)| (Some(f), c));
    // SAFETY: a live tch tensor handle; the bridge catches every C++ exception.
    check(unsafe { sh_set_grad_ready_hook(param.as_ptr(), function, context, index as i64) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn backward_with_grad_accumulates_the_vector_jacobian_product() {
        let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let out = &w * &w; // d out_i / d w_i = 2 w_i
        let grad = Tensor::from_slice(&[1.0f32, 10.0, 100.0]);
        backward_with_grad(&out, &grad).unwrap();
        assert!(w
            .grad()
            .allclose(&Tensor::from_slice(&[2.0f32, 40.0, 600.0]), 1e-6, 1e-6, false));
        // A shape mismatch is an error, not a crash.
        let bad = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let err = backward_with_grad(&(&w * 2.0), &bad).unwrap_err();
        assert!(err.contains("shape") || err.contains("size"), "{err}");
    }

    #[test]
    fn a_set_gradient_is_the_one_backward_accumulates_into() {
        let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let flat = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        set_grad(&w, &flat.narrow(0, 3, 2)).unwrap();
        (&w * 3.0).sum(Kind::Float).backward();
        (&w * 4.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&flat).unwrap(), [0.0, 0.0, 0.0, 7.0, 7.0]);
        // Another shape, dtype or device is refused, not a crash.
        for bad in [
            Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            Tensor::zeros([2], (Kind::Double, Device::Cpu)),
        ] {
            let err = set_grad(&w, &bad).unwrap_err();
            assert!(err.contains("must have its shape, dtype and device"), "{err}");
        }
    }

    #[test]
    fn grad_to_none_drops_the_gradient() {
        let mut w = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        (&w * 3.0).sum(Kind::Float).backward();
        assert!(w.grad().defined());
        grad_to_none(&mut w).unwrap();
        assert!(!w.grad().defined());
        (&w * 5.0).sum(Kind::Float).backward();
        assert!(w.grad().allclose(
            &Tensor::full([2], 5.0, (Kind::Float, Device::Cpu)),
            1e-6,
            1e-6,
            false
        ));
    }

    /// Records each call's index; fails when the context's flag says so.
    unsafe extern "C" fn record(context: *mut c_void, index: i64) -> *mut c_char {
        let (calls, fail) = unsafe { &mut *context.cast::<(Vec<i64>, bool)>() };
        calls.push(index);
        if *fail {
            crate::ffi::malloc_message("the hook says no")
        } else {
            std::ptr::null_mut()
        }
    }

    #[test]
    fn a_grad_ready_hook_runs_once_per_backward_after_accumulation_and_can_fail_it() {
        let w = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut context: (Vec<i64>, bool) = (Vec::new(), false);
        let hook = Some((
            record as GradReadyFn,
            (&mut context as *mut (Vec<i64>, bool)).cast(),
        ));
        // SAFETY: `context` outlives the hook, which is removed below.
        unsafe { set_grad_ready_hook(&w, hook, 7) }.unwrap();
        // Two uses of w in one backward: one accumulation, one call.
        ((&w * 2.0).sum(Kind::Float) + (&w * 3.0).sum(Kind::Float)).backward();
        assert_eq!(context.0, vec![7]);
        assert!(w.grad().allclose(
            &Tensor::full([2], 5.0, (Kind::Float, Device::Cpu)),
            0.0,
            0.0,
            false
        ));
        context.1 = true;
        let err =
            backward_with_grad(&(&w * 1.0), &Tensor::ones([2], (Kind::Float, Device::Cpu))).unwrap_err();
        assert!(err.contains("the hook says no"), "{err}");
        assert_eq!(context.0, vec![7, 7]);
        unsafe { set_grad_ready_hook(&w, None, 0) }.unwrap();
        (&w * 1.0).sum(Kind::Float).backward();
        assert_eq!(context.0, vec![7, 7], "a removed hook is not called");
    }
}
