//! Mixed precision and channels_last, through `csrc/amp.cpp`: PyTorch's own autocast around a
//! stage's forward and loss, the gradient scaler fp16 needs (PyTorch's `torch.amp.GradScaler`
//! rules and kernels), and the channels_last layout for convolutional models.

use std::os::raw::{c_char, c_int, c_void};

use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

use crate::config::Precision;
use crate::ffi::check;

extern "C" {
    fn sh_autocast_enter(cuda: c_int, dtype: c_int) -> *mut c_char;
    fn sh_autocast_exit(cuda: c_int) -> *mut c_char;
    fn sh_amp_unscale(
        grads: *const *const c_void,
        n: usize,
        found_inf: *mut c_void,
        inv_scale: *const c_void,
    ) -> *mut c_char;
    fn sh_amp_update_scale(
        scale: *mut c_void,
        growth_tracker: *mut c_void,
        found_inf: *const c_void,
        growth: f64,
        backoff: f64,
        interval: i64,
    ) -> *mut c_char;
    fn sh_channels_last_param(param: *mut c_void) -> *mut c_char;
    fn sh_channels_last(input: *const c_void, out: *mut *mut c_void) -> *mut c_char;
}

/// Autocast on for the current thread while alive (`torch.autocast(device, dtype)`); a no-op for
/// fp32.
pub struct Autocast {
    cuda: Option<c_int>,
    /// Autocast state is per thread: the guard stays on the thread that entered it.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Autocast {
    pub fn enter(precision: Precision, device: Device) -> Result<Autocast, String> {
        let dtype = match precision {
            Precision::Fp32 => {
                return Ok(Autocast {
                    cuda: None,
                    _thread: std::marker::PhantomData,
                })
            }
            Precision::Bf16 => 0,
            Precision::Fp16 => 1,
        };
        let cuda = c_int::from(matches!(device, Device::Cuda(_)));
        // SAFETY: sets thread-local autocast state; undone in Drop on the same thread (`!Send`).
        check(unsafe { sh_autocast_enter(cuda, dtype) })?;
        Ok(Autocast {
            cuda: Some(cuda),
            _thread: std::marker::PhantomData,
        })
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        if let Some(cuda) = self.cuda {
            // SAFETY: pairs with the enter above; cannot fail beyond a message we can only drop.
            let _ = check(unsafe { sh_autocast_exit(cuda) });
        }
    }
}

/// `torch.amp.GradScaler` with its defaults (initial scale 2^16, growth 2 after 2000 clean
/// steps, backoff 0.5): the loss is multiplied by the scale before backward so fp16 gradients do
/// not underflow, gradients are unscaled before the step, and a step whose gradients hold an inf
/// or a nan is skipped (and the scale halved).
///
/// All of it stays on the device, as with torch's fused optimizers: the inf/nan flag goes to the
/// optimizer's kernels ([`crate::stage::Optimizer::step_unless`]), which skip the step there, and
/// the scale is updated by torch's own kernel; nothing waits for the device to learn whether a
/// step was taken (so a step with the scaler can be captured in a CUDA graph).
///
/// In a pipeline every rank keeps the same scale: the last stage scales the loss, every stage
/// unscales its own gradients with the same factor, and the inf/nan flag is summed over all ranks
/// so they all skip the same steps.
pub struct GradScaler {
    scale: Tensor,
    growth_tracker: Tensor,
    found_inf: Tensor,
}

/// What fp16's gradient scaler did at a step (see [`GradScaler::report`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerReport {
    /// The loss scale after the step's update (what `GradScaler.get_scale()` returns then).
    pub scale: f64,
    /// Whether the step was skipped: some rank's gradients held an inf or a nan.
    pub skipped: bool,
}

const GROWTH: f64 = 2.0;
const BACKOFF: f64 = 0.5;
const INTERVAL: i64 = 2000;

impl GradScaler {
    /// A scaler whose first scale is `init_scale` (torch's default is
    /// [`crate::config::DEFAULT_FP16_INIT_SCALE`]).
    pub fn new(device: Device, init_scale: f64) -> GradScaler {
        GradScaler {
            scale: Tensor::full([1], init_scale, (Kind::Float, device)),
            growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
            found_inf: Tensor::zeros([1], (Kind::Float, device)),
        }
    }

    /// `loss` times the scale (a one-element tensor, so no host round trip), in float32 as torch's
    /// scaler multiplies: a float16 loss times 2^16 would overflow (autocast computes losses in
    /// float32, which stay as they are).
    pub fn scale_loss(&self, loss: &Tensor) -> Tensor {
        let loss = match loss.kind() {
            Kind::Float => loss.shallow_clone(),
            _ => loss.to_kind(Kind::Float),
        };
        loss * self.scale.reshape(Vec::<i64>::new())
    }

    /// Unscales `grads` in place and returns this rank's inf/nan flag (1.0 when any gradient
    /// holds one); sum it over the ranks before [`Self::update`].
    pub fn unscale(&mut self, grads: &[Tensor]) -> Result<&Tensor, String> {
        let _ = self.found_inf.zero_();
        let inv_scale = self.scale.reciprocal();
        // The kernel takes gradients of one device, with the flag and scale there: a stage over
        // several devices unscales each device's gradients with its own flag, then adds it in.
        let home = self.found_inf.device();
        let mut devices: Vec<Device> = Vec::new();
        for g in grads {
            if !devices.contains(&g.device()) {
                devices.push(g.device());
            }
        }
        for device in devices {
            let mine: Vec<*const c_void> = grads
                .iter()
                .filter(|g| g.device() == device)
                .map(|g| g.as_ptr() as *const c_void)
                .collect();
            let (found, inv) = if device == home {
                (self.found_inf.shallow_clone(), inv_scale.shallow_clone())
            } else {
                (
                    Tensor::zeros([1], (Kind::Float, device)),
                    inv_scale.to_device(device),
                )
            };
            // SAFETY: live tensors for the call; the kernel writes the gradients and the flag in
            // place.
            check(unsafe {
                sh_amp_unscale(
                    mine.as_ptr(),
                    mine.len(),
                    found.as_ptr() as *mut c_void,
                    inv.as_ptr() as *const c_void,
                )
            })?;
            if device != home {
                let _ = self
                    .found_inf
                    .f_add_(&found.to_device(home))
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(&self.found_inf)
    }

    /// The flag the optimizer's step reads, once summed over the ranks: clamped to 1.0, as the
    /// kernels skip a step where it is exactly 1.0 (two ranks' infs sum to 2).
    pub fn step_flag(&mut self) -> Result<&Tensor, String> {
        let _ = self.found_inf.f_clamp_max_(1.0).map_err(|e| e.to_string())?;
        Ok(&self.found_inf)
    }

    /// Updates the scale from the (summed) flag, on the device: halved after a skipped step,
    /// doubled after [`INTERVAL`] clean ones in a row.
    pub fn update(&mut self) -> Result<(), String> {
        // SAFETY: live one-element tensors of the kinds the kernel wants.
        check(unsafe {
            sh_amp_update_scale(
                self.scale.as_mut_ptr() as *mut c_void,
                self.growth_tracker.as_mut_ptr() as *mut c_void,
                self.found_inf.as_ptr() as *const c_void,
                GROWTH,
                BACKOFF,
                INTERVAL,
            )
        })?;
        Ok(())
    }

    /// What the last step did, read back from the device (one copy, which waits for the step):
    /// the scale the next step uses, and whether the last one was skipped.
    pub fn report(&self) -> ScalerReport {
        let both = Tensor::cat(&[&self.scale, &self.found_inf], 0).to_device(Device::Cpu);
        let values = Vec::<f32>::try_from(&both).expect("two float32 values");
        ScalerReport {
            scale: f64::from(values[0]),
            skipped: values[1] > 0.0,
        }
    }

    /// What a checkpoint keeps: the scale and the growth tracker.
    pub fn state_tensors(&self) -> [(&'static str, &Tensor); 2] {
        [("scale", &self.scale), ("growth_tracker", &self.growth_tracker)]
    }

    /// Restores what [`GradScaler::state_tensors`] gave, onto the scaler's device.
    pub fn load_state(&mut self, named: Vec<(String, Tensor)>) -> Result<(), String> {
        for (name, tensor) in named {
            let target = match name.as_str() {
                "scale" => &mut self.scale,
                "growth_tracker" => &mut self.growth_tracker,
                other => return Err(format!("unknown gradient-scaler state {other:?}")),
            };
            if tensor.size() != target.size() || tensor.kind() != target.kind() {
                return Err(format!(
                    "gradient-scaler state {name:?} has the wrong shape or kind"
                ));
            }
            tch::no_grad(|| target.f_copy_(&tensor)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The flag, for summing across ranks in place.
    pub fn found_inf(&self) -> &Tensor {
        &self.found_inf
    }
}

/// Puts every 4-dimensional parameter in channels_last layout, in place.
pub fn params_to_channels_last(params: &mut [Tensor]) -> Result<(), String> {
    for p in params {
        // SAFETY: a live tensor handle; set_data keeps the parameter's identity.
        check(unsafe { sh_channels_last_param(p.as_mut_ptr() as *mut c_void) })?;
    }
    Ok(())
}

/// A channels_last copy of a 4-dimensional tensor (a new handle to the same tensor otherwise).
pub fn channels_last(input: &Tensor) -> Result<Tensor, String> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live handle in; on success `out` is a heap `at::Tensor` we own.
    check(unsafe { sh_channels_last(input.as_ptr() as *const c_void, &mut out) })?;
    // SAFETY: a fresh at::Tensor allocated with `new`, as tch's own handles are.
    Ok(unsafe { Tensor::from_ptr(out as *mut C_tensor) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_FP16_INIT_SCALE as INIT_SCALE;

    #[test]
    fn autocast_runs_matmuls_in_bfloat16_and_ends_with_its_guard() {
        let a = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
        {
            let _guard = Autocast::enter(Precision::Bf16, Device::Cpu).unwrap();
            assert_eq!(a.matmul(&a).kind(), Kind::BFloat16);
        }
        assert_eq!(a.matmul(&a).kind(), Kind::Float);
        let _none = Autocast::enter(Precision::Fp32, Device::Cpu).unwrap();
        assert_eq!(a.matmul(&a).kind(), Kind::Float);
    }

    #[test]
    fn the_scaler_flags_a_step_with_an_inf_and_halves_its_scale() {
        let mut scaler = GradScaler::new(Device::Cpu, INIT_SCALE);
        let grads = [Tensor::from_slice(&[65536.0f32, 131072.0])];
        scaler.unscale(&grads).unwrap();
        assert_eq!(Vec::<f32>::try_from(&grads[0]).unwrap(), vec![1.0, 2.0]);
        assert_eq!(scaler.step_flag().unwrap().double_value(&[0]), 0.0);
        scaler.update().unwrap();
        assert_eq!(
            scaler.report(),
            ScalerReport {
                scale: INIT_SCALE,
                skipped: false
            }
        );

        let bad = [
            Tensor::from_slice(&[1.0f32, f32::INFINITY]),
            Tensor::from_slice(&[f32::NAN]),
        ];
        scaler.unscale(&bad).unwrap();
        // As if three ranks had found one each: the kernels skip only on exactly 1.
        let _ = scaler.found_inf.fill_(3.0);
        assert_eq!(scaler.step_flag().unwrap().double_value(&[0]), 1.0);
        scaler.update().unwrap();
        assert_eq!(
            scaler.report(),
            ScalerReport {
                scale: INIT_SCALE * BACKOFF,
                skipped: true
            }
        );
    }

    #[test]
    fn channels_last_changes_layout_not_values() {
        let x = Tensor::arange(2 * 3 * 4 * 5, (Kind::Float, Device::Cpu)).reshape([2, 3, 4, 5]);
        let y = channels_last(&x).unwrap();
        assert_eq!(y.stride(), vec![60, 1, 15, 3]);
        assert!(y.equal(&x));
        let mut params = [x.copy()];
        params_to_channels_last(&mut params).unwrap();
        assert_eq!(params[0].stride(), vec![60, 1, 15, 3]);
    }
}
