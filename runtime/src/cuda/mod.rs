//! CUDA, loaded at run time. The runtime binary links libtorch_cpu only; the first time anything
//! asks for CUDA, [`cuda`] loads libtorch_cuda from the folder libtorch_cpu was loaded from
//! (its start-up code registers CUDA with libtorch, as `import torch` does) and then the
//! embedded CUDA half of the bridge (`csrc/cuda_bridge.cpp`: NCCL groups, the current device,
//! the caching allocator's figures, CUDA graphs; `csrc/fusions.cpp`: the fused kernels).
//!
//! So one binary serves every machine: with the full torch wheel and a GPU it trains on CUDA
//! over NCCL; where libtorch_cuda or one of its libraries (cuBLAS, cuDNN, NCCL ...) is missing,
//! as in the CPU image, it trains on the CPU and [`cuda`] says exactly what could not be loaded.
//!
//! Nothing may touch CUDA through libtorch before [`cuda`] has run: libtorch caches its answer
//! to "is there CUDA" on first use. `main` loads it first for every command that names a CUDA
//! device or NCCL, and `runtime info`.

pub mod fusions;
mod graph;
mod load;

pub use graph::Graph;
pub use load::torch_lib_dir;

use std::ffi::{c_char, CStr};
use std::sync::OnceLock;

use crate::ffi::{check, RawGroup, RawStore};

/// The CUDA half's entry points, resolved from the loaded object.
#[allow(clippy::type_complexity)]
pub(crate) struct Api {
    pub device_count: unsafe extern "C" fn() -> i64,
    pub device_count_error: unsafe extern "C" fn() -> *mut c_char,
    pub device_name: unsafe extern "C" fn(i64, *mut c_char, usize) -> *mut c_char,
    pub set_device: unsafe extern "C" fn(i64) -> *mut c_char,
    pub synchronize: unsafe extern "C" fn(i64) -> *mut c_char,
    pub memory_peaks: unsafe extern "C" fn(i64, *mut i64, *mut i64) -> *mut c_char,
    pub nccl_version: unsafe extern "C" fn(*mut i64) -> *mut c_char,
    pub pg_nccl: unsafe extern "C" fn(
        *mut RawStore,
        *const c_char,
        i64,
        i64,
        i64,
        i64,
        *mut *mut RawGroup,
    ) -> *mut c_char,
    pub graph_new: graph::GraphNew,
    pub graph_begin: graph::GraphOp,
    pub graph_end: graph::GraphOp,
    pub graph_replay: graph::GraphOp,
    pub graph_free: graph::GraphFree,
    pub conv_bias_relu: fusions::ConvBiasRelu,
    pub max_pool2x2: fusions::MaxPool,
    pub conv_bias_relu_pool: fusions::ConvBiasRelu,
    /// Only the tests compile the kernels ahead of their first use, let the CPU stand in for a
    /// GPU, or ask which autograd node made a tensor.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fusions_compile: fusions::Compile,
    #[cfg_attr(not(test), allow(dead_code))]
    pub fusions_cpu_stand_in: fusions::CpuStandIn,
    #[cfg_attr(not(test), allow(dead_code))]
    pub grad_fn_name: fusions::GradFnName,
}

/// CUDA support, loaded and usable in this process.
pub struct Cuda {
    api: Api,
    devices: usize,
    /// Why the CUDA runtime reports no devices, when it does.
    no_devices: Option<String>,
    /// NCCL's version, when its library answers.
    nccl: Result<(u32, u32, u32), String>,
}

/// The caching allocator's peaks on one device, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryPeaks {
    pub allocated: u64,
    pub reserved: u64,
}

static CUDA: OnceLock<Result<Cuda, String>> = OnceLock::new();

/// CUDA support, loading it on first call; `Err` says why this process has none (a CPU-only
/// build, libtorch_cuda or one of its libraries missing).
pub fn cuda() -> Result<&'static Cuda, &'static str> {
    CUDA.get_or_init(load::load).as_ref().map_err(String::as_str)
}

/// For a unit test that needs a GPU: the first CUDA device, with libtorch_cuda loaded the
/// runtime's way (the only way libtorch sees CUDA here); else `None`, after saying loudly on
/// stderr why (`SKIPPED <test>: ...`, which scripts/gpu-checks counts).
#[cfg(test)]
pub(crate) fn test_gpu(test: &str) -> Option<tch::Device> {
    match cuda().map(Cuda::device_count) {
        Ok(n) if n > 0 => Some(tch::Device::Cuda(0)),
        Ok(_) => {
            eprintln!("SKIPPED {test}: no CUDA device here");
            None
        }
        Err(reason) => {
            eprintln!("SKIPPED {test}: CUDA is unavailable: {reason}");
            None
        }
    }
}

impl Cuda {
    pub(crate) fn from_api(api: Api) -> Cuda {
        // SAFETY: plain queries through a loaded bridge.
        let devices = usize::try_from(unsafe { (api.device_count)() }).unwrap_or(0);
        let no_devices = if devices == 0 {
            // Without a driver the CUDA runtime says "driver version is insufficient", which
            // sends people looking for the wrong fix.
            Some(match load::driver_missing() {
                Some(reason) => format!("no NVIDIA driver on this machine: {reason}"),
                // SAFETY: returns null or a malloc'd message that `check` frees.
                None => check(unsafe { (api.device_count_error)() })
                    .err()
                    .unwrap_or_else(|| "the CUDA runtime reports no device".into()),
            })
        } else {
            None
        };
        let mut version = 0i64;
        // SAFETY: a valid out-pointer.
        let nccl = check(unsafe { (api.nccl_version)(&mut version) }).map(|()| {
            let v = version as u32;
            (v / 10000, v / 100 % 100, v % 100)
        });
        Cuda {
            api,
            devices,
            no_devices,
            nccl,
        }
    }

    /// CUDA devices this process sees (0 on a machine without a GPU or driver).
    pub fn device_count(&self) -> usize {
        self.devices
    }

    /// Why there are no devices, as the CUDA runtime puts it.
    pub fn no_devices_reason(&self) -> Option<&str> {
        self.no_devices.as_deref()
    }

    /// NCCL's version, or why NCCL does not answer.
    pub fn nccl_version(&self) -> Result<(u32, u32, u32), &str> {
        self.nccl.as_ref().copied().map_err(String::as_str)
    }

    pub fn device_name(&self, device: usize) -> Result<String, String> {
        let mut buffer = [0 as c_char; 256];
        // SAFETY: the buffer outlives the call and its length is passed.
        check(unsafe { (self.api.device_name)(device as i64, buffer.as_mut_ptr(), buffer.len()) })?;
        // SAFETY: the bridge NUL-terminates within the buffer.
        Ok(unsafe { CStr::from_ptr(buffer.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Makes `device` the current device of the calling thread (contexts and default streams go
    /// there, not to cuda:0).
    pub fn set_device(&self, device: usize) -> Result<(), String> {
        // SAFETY: a plain call through a loaded bridge.
        check(unsafe { (self.api.set_device)(device as i64) })
    }

    /// Waits until everything queued on the calling thread's current stream of `device` has run.
    pub fn synchronize(&self, device: usize) -> Result<(), String> {
        // SAFETY: a plain call through a loaded bridge.
        check(unsafe { (self.api.synchronize)(device as i64) })
    }

    /// The caching allocator's peak allocated and reserved bytes since the last reset.
    pub fn memory_peaks(&self, device: usize) -> Result<MemoryPeaks, String> {
        let (mut allocated, mut reserved) = (0i64, 0i64);
        // SAFETY: valid out-pointers.
        check(unsafe { (self.api.memory_peaks)(device as i64, &mut allocated, &mut reserved) })?;
        Ok(MemoryPeaks {
            allocated: allocated.max(0) as u64,
            reserved: reserved.max(0) as u64,
        })
    }

    pub(crate) fn api(&self) -> &Api {
        &self.api
    }
}

/// CUDA device `index`, checked to exist, or a message for the user saying what to use instead.
pub fn require_device(index: usize) -> Result<&'static Cuda, String> {
    let cuda = cuda().map_err(|reason| {
        format!("cuda:{index} requested but CUDA is unavailable in this runtime: {reason}; use --device cpu")
    })?;
    if index >= cuda.device_count() {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        return Err(missing_device(
            index,
            cuda.device_count(),
            cuda.no_devices_reason(),
            visible.as_deref(),
        ));
    }
    Ok(cuda)
}

/// What to tell a user who asked for `cuda:index` where the process sees `count` devices. With
/// `CUDA_VISIBLE_DEVICES` set, the devices are those it lists (from 0 in its order), up to the
/// first index that does not exist: say so, as a GPU number that seems to be missing is often one
/// that the variable hides or renumbers.
fn missing_device(index: usize, count: usize, reason: Option<&str>, visible: Option<&str>) -> String {
    let why = reason.map(|r| format!(" ({r})")).unwrap_or_default();
    let sees = match visible {
        Some(list) => format!(
            "this process sees {count} CUDA device(s){why}: CUDA_VISIBLE_DEVICES={list} shows it \
             those it lists, numbered from 0, up to the first that does not exist (`nvidia-smi -L` \
             lists the machine's)"
        ),
        None => format!("this machine has {count} CUDA device(s){why}"),
    };
    let instead = match count {
        0 => String::new(),
        n => format!(" or cuda:0..cuda:{}", n - 1),
    };
    format!("cuda:{index} requested but {sees}; use --device cpu{instead}")
}

/// Whether NCCL can be used in this process: CUDA loaded and NCCL's library answering.
pub fn nccl() -> Result<&'static Cuda, String> {
    let cuda = cuda().map_err(|e| format!("CUDA is unavailable: {e}"))?;
    cuda.nccl_version()
        .map_err(|e| format!("NCCL is unavailable: {e}"))?;
    Ok(cuda)
}

/// Binds this process to `device` before any CUDA work: a CUDA device becomes current, so
/// contexts, streams and NCCL communicators are created there and not on cuda:0; nothing to do
/// on the CPU.
pub fn bind_device(device: tch::Device) -> Result<(), String> {
    if let tch::Device::Cuda(index) = device {
        let cuda = require_device(index)?;
        cuda.set_device(index)
            .map_err(|e| format!("making cuda:{index} the current device: {e}"))?;
    }
    Ok(())
}

/// Waits for the work queued on this thread's current stream of `device` when it is a CUDA device
/// (a timing boundary): compute, and the transfers a `Work::wait` ordered the stream after; not
/// NCCL's streams, whose receives posted ahead of time may wait for this rank's next send. A no-op
/// on the CPU, and when CUDA is not loaded (then nothing can be queued there).
///
/// Kernels fail asynchronously: a fault of anything queued before (an illegal memory access, say)
/// is reported here, as the error.
pub fn synchronize(device: tch::Device) -> Result<(), DeviceError> {
    if let tch::Device::Cuda(index) = device {
        if let Some(cuda) = CUDA.get().and_then(|c| c.as_ref().ok()) {
            cuda.synchronize(index)
                .map_err(|e| DeviceError(format!("cuda:{index}: {e}")))?;
        }
    }
    Ok(())
}

/// A CUDA device's failure, seen when waiting for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError(pub String);

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeviceError {}

impl From<DeviceError> for String {
    fn from(e: DeviceError) -> String {
        e.0
    }
}

#[cfg(test)]
mod tests {
    use super::missing_device;

    #[test]
    fn a_missing_gpu_names_what_cuda_visible_devices_shows() {
        assert_eq!(
            missing_device(1, 1, None, Some("1,3")),
            "cuda:1 requested but this process sees 1 CUDA device(s): CUDA_VISIBLE_DEVICES=1,3 \
             shows it those it lists, numbered from 0, up to the first that does not exist \
             (`nvidia-smi -L` lists the machine's); use --device cpu or cuda:0..cuda:0"
        );
        assert_eq!(
            missing_device(0, 0, Some("no driver"), None),
            "cuda:0 requested but this machine has 0 CUDA device(s) (no driver); use --device cpu"
        );
    }
}
