//! PyTorch's fused optimizer kernels over many parameters at once, through `csrc/optim.cpp`.

use std::os::raw::c_char;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::ffi::check;

extern "C" {
    fn sh_fused_sgd_step(
        params: *const *const C_tensor,
        momentum_buffers: *const *const C_tensor,
        count: usize,
        lr: f64,
        lr_tensor: *const C_tensor,
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
        found_inf: *const C_tensor,
    ) -> *mut c_char;
    fn sh_fused_adam_step(
        params: *const *const C_tensor,
        exp_avgs: *const *const C_tensor,
        exp_avg_sqs: *const *const C_tensor,
        steps: *const *const C_tensor,
        count: usize,
        lr: f64,
        lr_tensor: *const C_tensor,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled_weight_decay: bool,
        found_inf: *const C_tensor,
    ) -> *mut c_char;
}

/// The learning rate: a number, or a 0-dim float32 tensor on the parameters' device that the
/// kernels read when they run (a step captured in a CUDA graph).
#[derive(Debug, Clone, Copy)]
pub enum Lr<'a> {
    Value(f64),
    Tensor(&'a Tensor),
}

impl Lr<'_> {
    /// The bridge's pair: the number (unused with a tensor) and the tensor or null.
    fn raw(self) -> (f64, *const C_tensor) {
        match self {
            Lr::Value(lr) => (lr, std::ptr::null()),
            Lr::Tensor(t) => (f64::NAN, t.as_ptr()),
        }
    }
}

/// SGD's hyper-parameters (dampening is always 0).
#[derive(Debug, Clone, Copy)]
pub struct SgdHyper<'a> {
    pub lr: Lr<'a>,
    pub momentum: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

/// Adam's hyper-parameters; `decoupled` makes it AdamW.
#[derive(Debug, Clone, Copy)]
pub struct AdamHyper<'a> {
    pub lr: Lr<'a>,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub decoupled: bool,
}

fn handles(tensors: &[&Tensor]) -> Vec<*const C_tensor> {
    tensors.iter().map(|t| t.as_ptr()).collect()
}

fn handle_or_null(tensor: Option<&Tensor>) -> *const C_tensor {
    tensor.map_or(std::ptr::null(), |t| t.as_ptr())
}

/// One `torch.optim.SGD(fused=True)` step over `params`, which all have gradients. With momentum,
/// `buffers` holds one buffer per parameter, shaped like it, which the gradient is blended into
/// (a new buffer is zeros: the blend is then torch's first step exactly). Without momentum
/// `buffers` must be empty. With `found_inf` (a one-element float32 tensor) the kernel skips the
/// step on the device where the flag is 1.0 (fp16's gradient scaler).
pub fn sgd_step(
    params: &[&Tensor],
    buffers: &[&Tensor],
    hyper: SgdHyper,
    found_inf: Option<&Tensor>,
) -> Result<(), String> {
    let with_buffers = hyper.momentum != 0.0;
    if buffers.len() != if with_buffers { params.len() } else { 0 } {
        return Err(format!(
            "{} momentum buffers for {} parameters at momentum {}",
            buffers.len(),
            params.len(),
            hyper.momentum
        ));
    }
    let (params, buffers) = (handles(params), handles(buffers));
    let (lr, lr_tensor) = hyper.lr.raw();
    // SAFETY: every handle is a live tch tensor (an `at::Tensor*`) borrowed for the call, or null
    // where optional; the bridge reads `count` entries of each array (none of `buffers` without
    // momentum), mutates the tensors' data only, and catches every C++ exception.
    check(unsafe {
        sh_fused_sgd_step(
            params.as_ptr(),
            if with_buffers {
                buffers.as_ptr()
            } else {
                std::ptr::null()
            },
            params.len(),
            lr,
            lr_tensor,
            hyper.momentum,
            hyper.weight_decay,
            hyper.nesterov,
            handle_or_null(found_inf),
        )
    })
}

/// One `torch.optim.Adam(fused=True)` (or `AdamW`) step over `params`, which all have gradients,
/// with their moments (shaped like the parameter) and step counts (0-dim float32 on the
/// parameter's device), which the step increments. `found_inf` skips the step as in
/// [`sgd_step`], the step counts included.
pub fn adam_step(
    params: &[&Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
    steps: &[&Tensor],
    hyper: AdamHyper,
    found_inf: Option<&Tensor>,
) -> Result<(), String> {
    let n = params.len();
    if exp_avgs.len() != n || exp_avg_sqs.len() != n || steps.len() != n {
        return Err(format!(
            "{n} parameters with {}, {} and {} state tensors",
            exp_avgs.len(),
            exp_avg_sqs.len(),
            steps.len()
        ));
    }
    let (params, exp_avgs, exp_avg_sqs, steps) = (
        handles(params),
        handles(exp_avgs),
        handles(exp_avg_sqs),
        handles(steps),
    );
    let (lr, lr_tensor) = hyper.lr.raw();
    // SAFETY: every handle is a live tch tensor borrowed for the call; the bridge reads `n`
    // entries of each array, mutates the tensors' data only, and catches every C++ exception.
    check(unsafe {
        sh_fused_adam_step(
            params.as_ptr(),
            exp_avgs.as_ptr(),
            exp_avg_sqs.as_ptr(),
            steps.as_ptr(),
            n,
            lr,
            lr_tensor,
            hyper.betas.0,
            hyper.betas.1,
            hyper.eps,
            hyper.weight_decay,
            hyper.decoupled,
            handle_or_null(found_inf),
        )
    })
}
