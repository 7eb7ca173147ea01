//! `runtime info`: one JSON line saying what this runtime can use on this machine, for the
//! driver's preflight, CI and people:
//! `{"torch": "2.11.0", "torch_lib": "/…/torch/lib", "cuda": true, "nccl": true, "cuda_devices": 1,
//! "devices": ["NVIDIA H100 80GB HBM3"], "nccl_version": "2.28.9"}`.
//!
//! `cuda` means libtorch_cuda and the CUDA bridge are loaded and usable in this process (with
//! zero devices on a machine without a GPU); `nccl` that NCCL's library answers as well. When
//! either is false, `cuda_error` / `nccl_error` say why; `cuda_devices_error` says why the CUDA
//! runtime sees no device.

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
            }
        }
    };
    writeln!(out, "{}", serde_json::to_string(&info)?)?;
    Ok(())
}
