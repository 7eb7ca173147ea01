//! How libtorch picks its kernels (`csrc/determinism.cpp`): `--deterministic`, runs that repeat
//! bit for bit on the same device, as PyTorch's `torch.use_deterministic_algorithms(True)` with
//! `torch.backends.cudnn.deterministic = True` makes them; and its opposite, `--cudnn-benchmark`
//! ([`benchmark_cudnn`]), the fastest convolution algorithms cuDNN finds by timing them.
//!
//! On a GPU the default kernels are free to vary between runs: cuDNN may pick algorithms that
//! accumulate with atomics, and cuBLAS splits its reductions by the workspace it has. Rounding
//! differences of one part in 10^7 are then all that differs, but a deep network early in
//! training can amplify them: resnet50 at batch 8 turns a change of 2e-6 in the learning rate
//! into losses 10% apart by the fourth iteration. Comparing two runs (a change against the run
//! before it, a CUDA graph's replays against the eager steps) then needs both to be
//! deterministic. On a CPU libtorch's kernels already are for a given thread count; there the
//! flag changes no result, but refuses the few operators without a deterministic version (and,
//! as in PyTorch, fills memory a new tensor leaves uninitialised, which costs some speed).
//!
//! cuBLAS is deterministic only with a fixed workspace per stream, which it reads from
//! `CUBLAS_WORKSPACE_CONFIG` (`:4096:8` or `:16:8`) when it first runs: [`apply`] sets the first
//! unless the environment already names one of them, and refuses any other value.

use std::ffi::c_char;

use crate::ffi::check;

extern "C" {
    fn sh_use_deterministic_algorithms() -> *mut c_char;
    fn sh_deterministic_algorithms() -> bool;
    fn sh_benchmark_cudnn() -> *mut c_char;
    fn sh_benchmarking_cudnn() -> bool;
}

/// The environment variable through which cuBLAS takes a fixed workspace per stream.
pub const CUBLAS_WORKSPACE_CONFIG: &str = "CUBLAS_WORKSPACE_CONFIG";
/// The settings under which cuBLAS is deterministic (NVIDIA's cuBLAS guide, "Results
/// reproducibility"); the first is what [`apply`] sets.
const DETERMINISTIC_WORKSPACES: [&str; 2] = [":4096:8", ":16:8"];

/// The value `CUBLAS_WORKSPACE_CONFIG` must take: `None` to keep the environment's, or the one to
/// set; the reason when the environment names a workspace cuBLAS is not deterministic with.
pub fn cublas_workspace(current: Option<&str>) -> Result<Option<&'static str>, String> {
    match current {
        None => Ok(Some(DETERMINISTIC_WORKSPACES[0])),
        Some(value) if DETERMINISTIC_WORKSPACES.contains(&value) => Ok(None),
        Some(value) => Err(format!(
            "{CUBLAS_WORKSPACE_CONFIG}={value} leaves cuBLAS free to vary between \
             runs; unset it (the runtime then sets {}) or set it to {} or {}",
            DETERMINISTIC_WORKSPACES[0], DETERMINISTIC_WORKSPACES[0], DETERMINISTIC_WORKSPACES[1]
        )),
    }
}

/// Makes every operator this process runs from now on deterministic. Call it before the first
/// CUDA operator (cuBLAS reads its workspace setting once) and before other threads start.
pub fn apply() -> Result<(), String> {
    let current = std::env::var(CUBLAS_WORKSPACE_CONFIG).ok();
    let set = cublas_workspace(current.as_deref()).map_err(|reason| format!("--deterministic: {reason}"))?;
    if let Some(value) = set {
        std::env::set_var(CUBLAS_WORKSPACE_CONFIG, value);
    }
    // SAFETY: takes nothing; a C++ exception comes back as a message.
    check(unsafe { sh_use_deterministic_algorithms() })?;
    if !enabled() {
        return Err("--deterministic: libtorch did not take its deterministic settings".into());
    }
    Ok(())
}

/// `--cudnn-benchmark`, the other way to pick kernels: cuDNN times its algorithms for each new
/// convolution shape on first use and keeps the fastest, as `torch.backends.cudnn.benchmark =
/// True` makes it (PipeDream's runtime sets it). The first iterations pay for the timing; shapes
/// that stay the same, as a training run's do, gain from then on. Results may then differ
/// between runs, so it excludes `--deterministic`.
pub fn benchmark_cudnn() -> Result<(), String> {
    // SAFETY: takes nothing; a C++ exception comes back as a message.
    check(unsafe { sh_benchmark_cudnn() })?;
    // SAFETY: reads ATen's global context.
    if !unsafe { sh_benchmarking_cudnn() } {
        return Err("--cudnn-benchmark: libtorch did not take the setting".into());
    }
    Ok(())
}

/// Whether libtorch runs deterministic algorithms only, as [`apply`] leaves it.
fn enabled() -> bool {
    // SAFETY: reads ATen's global context.
    unsafe { sh_deterministic_algorithms() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cublas_gets_a_fixed_workspace_unless_the_environment_names_one() {
        assert_eq!(cublas_workspace(None), Ok(Some(":4096:8")));
        assert_eq!(cublas_workspace(Some(":4096:8")), Ok(None));
        assert_eq!(cublas_workspace(Some(":16:8")), Ok(None));
        for bad in ["", ":0:0", "4096:8", ":4096:2:16:8"] {
            let err = cublas_workspace(Some(bad)).unwrap_err();
            assert!(
                err.contains(&format!("CUBLAS_WORKSPACE_CONFIG={bad} ")) && err.contains(":16:8"),
                "{err}"
            );
        }
    }
}
