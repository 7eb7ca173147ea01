//! `runtime info`: one JSON line saying what this runtime can use on this machine, for the
//! driver's preflight, CI and people:
//! `{"torch": "2.11.0", "torch_lib": "/…/torch/lib", "cuda": true, "nccl": true, "cuda_devices": 1,
//! "devices": ["NVIDIA H100 80GB HBM3"], "nccl_version": "2.28.9"}`.
//!
//! `cuda` means libtorch_cuda and the CUDA bridge are loaded and usable in this process (with
//! zero devices on a machine without a GPU); `nccl` that NCCL's library answers as well. When
//! either is false, `cuda_error` / `nccl_error` say why; `cuda_devices_error` says why the CUDA
//! runtime sees no device. `rdma` says what NCCL's InfiniBand/RoCE transport needs here: the
//! verbs devices the kernel lists (`/sys/class/infiniband`), their device files
//! (`/dev/infiniband`, which a container has only when given them), and whether libibverbs
//! loads (NCCL opens it at run time, and talks TCP between hosts without it).

use std::io::Write;

use serde::Serialize;

#[derive(Debug, Serialize)]
struct Info {
    torch: String,
    /// The folder libtorch was loaded from.
    torch_lib: Option<String>,
    cuda: bool,
    nccl: bool,
    cuda_devices: usize,
    devices: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nccl_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cuda_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nccl_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cuda_devices_error: Option<String>,
    rdma: Rdma,
}

/// What NCCL's InfiniBand/RoCE transport would find here.
#[derive(Debug, Serialize)]
struct Rdma {
    /// Verbs devices the kernel lists (`mlx5_0`, ...), sorted.
    devices: Vec<String>,
    /// Whether `/dev/infiniband` (the verbs device files) exists.
    device_files: bool,
    /// Whether libibverbs loads.
    ibverbs: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    ibverbs_error: Option<String>,
}

impl Rdma {
    fn here() -> Rdma {
        let mut devices: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
            .map(|dir| {
                dir.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        devices.sort();
        let ibverbs_error = loads("libibverbs.so.1").err();
        Rdma {
            devices,
            device_files: std::path::Path::new("/dev/infiniband").is_dir(),
            ibverbs: ibverbs_error.is_none(),
            ibverbs_error,
        }
    }
}

/// Whether the shared library `name` loads (as NCCL's `dlopen` would find it); the loader's
/// words when it does not. It stays loaded: this process only reports and exits.
fn loads(name: &str) -> Result<(), String> {
    let name = std::ffi::CString::new(name).expect("a library name has no NUL");
    // SAFETY: a NUL-terminated name; dlopen/dlerror have no other preconditions.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if !handle.is_null() {
        return Ok(());
    }
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call.
    let error = unsafe { libc::dlerror() };
    Err(match error.is_null() {
        true => "not found".to_string(),
        // SAFETY: checked non-null above; copied before any other dl call.
        false => unsafe { std::ffi::CStr::from_ptr(error) }
            .to_string_lossy()
            .into_owned(),
    })
}

pub fn run(out: &mut impl Write) -> anyhow::Result<()> {
    let torch = crate::comm::torch_version();
    let torch_lib = crate::cuda::torch_lib_dir()
        .ok()
        .map(|dir| dir.display().to_string());
    let info = match crate::cuda::cuda() {
        Err(reason) => Info {
            torch,
            torch_lib,
            cuda: false,
            nccl: false,
            cuda_devices: 0,
            devices: Vec::new(),
            nccl_version: None,
            cuda_error: Some(reason.to_string()),
            nccl_error: Some("CUDA is unavailable".into()),
            cuda_devices_error: None,
            rdma: Rdma::here(),
        },
        Ok(cuda) => {
            let devices = (0..cuda.device_count())
                .map(|i| cuda.device_name(i).unwrap_or_else(|e| format!("unknown ({e})")))
                .collect();
            let (nccl_version, nccl_error) = match cuda.nccl_version() {
                Ok((major, minor, patch)) => (Some(format!("{major}.{minor}.{patch}")), None),
                Err(e) => (None, Some(e.to_string())),
            };
            Info {
                torch,
                torch_lib,
                cuda: true,
                nccl: nccl_error.is_none(),
                cuda_devices: cuda.device_count(),
                devices,
                nccl_version,
                cuda_error: None,
                nccl_error,
                cuda_devices_error: cuda.no_devices_reason().map(str::to_string),
                rdma: Rdma::here(),
            }
        }
    };
    writeln!(out, "{}", serde_json::to_string(&info)?)?;
    Ok(())
}
