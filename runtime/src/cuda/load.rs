#![cfg_attr(not(cuda_bridge), allow(dead_code, unused_imports))]

//! Loading libtorch_cuda and the embedded CUDA bridge with the dynamic loader.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

use super::{Api, Cuda};

/// `OUT_DIR/libstagehand_cuda.so`, built by build.rs against libtorch_cuda and NCCL.
#[cfg(cuda_bridge)]
static BRIDGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libstagehand_cuda.so"));

pub(super) fn load() -> Result<Cuda, String> {
    #[cfg(not(cuda_bridge))]
    {
        Err("this runtime was built against a torch without libtorch_cuda (CPU-only build)".into())
    }
    #[cfg(cuda_bridge)]
    {
        let dir = torch_lib_dir()?;
        let torch_cuda = dir.join("libtorch_cuda.so");
        if !torch_cuda.exists() {
            return Err(format!(
                "{} is not there (a CPU-only torch or image)",
                torch_cuda.display()
            ));
        }
        // Global, so that the bridge (and libtorch's own lookups) resolve CUDA symbols from it.
        open(&torch_cuda.to_string_lossy(), libc::RTLD_LAZY | libc::RTLD_GLOBAL)
            .map_err(|e| format!("libtorch_cuda.so could not be loaded: {e}"))?;
        let bridge = open_embedded(BRIDGE)?;
        // SAFETY: every name is one of cuda_bridge.cpp's `extern "C"` functions, declared in
        // `Api` with exactly its signature.
        let api = unsafe {
            Api {
                device_count: resolve(bridge, "shc_device_count")?,
                device_count_error: resolve(bridge, "shc_device_count_error")?,
                device_name: resolve(bridge, "shc_device_name")?,
                set_device: resolve(bridge, "shc_set_device")?,
                synchronize: resolve(bridge, "shc_synchronize")?,
                memory_peaks: resolve(bridge, "shc_memory_peaks")?,
                nccl_version: resolve(bridge, "shc_nccl_version")?,
                pg_nccl: resolve(bridge, "shc_pg_nccl")?,
                graph_new: resolve(bridge, "shc_graph_new")?,
                graph_begin: resolve(bridge, "shc_graph_begin")?,
                graph_end: resolve(bridge, "shc_graph_end")?,
                graph_replay: resolve(bridge, "shc_graph_replay")?,
                graph_free: resolve(bridge, "shc_graph_free")?,
                conv_bias_relu: resolve(bridge, "shc_conv_bias_relu")?,
                max_pool2x2: resolve(bridge, "shc_max_pool2x2")?,
                conv_bias_relu_pool: resolve(bridge, "shc_conv_bias_relu_pool")?,
                fusions_compile: resolve(bridge, "shc_fusions_compile")?,
                fusions_cpu_stand_in: resolve(bridge, "shc_fusions_cpu_stand_in")?,
                grad_fn_name: resolve(bridge, "shc_grad_fn_name")?,
            }
        };
        let cuda = Cuda::from_api(api);
        // libtorch decides once, on first use, whether CUDA exists; asked before this load, it
        // keeps saying no (and CUDA tensors fail) even though the devices are there.
        let seen = usize::try_from(tch::Cuda::device_count()).unwrap_or(0);
        if seen != cuda.device_count() {
            return Err(format!(
                "libtorch was asked about CUDA before libtorch_cuda was loaded and sees {seen} of {} \
                 device(s) (a bug in the runtime: load CUDA before any other torch call)",
                cuda.device_count()
            ));
        }
        Ok(cuda)
    }
}

/// Why the NVIDIA driver's library cannot be loaded, if it cannot.
pub(super) fn driver_missing() -> Option<String> {
    open("libcuda.so.1", libc::RTLD_LAZY | libc::RTLD_LOCAL).err()
}

/// The folder libtorch_cpu.so was loaded from, as the loader found it (through
/// `LD_LIBRARY_PATH`, the rpath, or the system's paths): libtorch_cuda.so lives beside it.
pub fn torch_lib_dir() -> Result<PathBuf, String> {
    unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: the loader passes a valid info for the duration of the call; `data` is the
        // `Option<PathBuf>` below.
        let (info, found) = unsafe { (&*info, &mut *(data as *mut Option<PathBuf>)) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: a NUL-terminated path owned by the loader.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) }.to_string_lossy();
        let path = PathBuf::from(name.as_ref());
        if path.file_name().is_some_and(|f| f == "libtorch_cpu.so") {
            *found = path.parent().map(PathBuf::from);
            return 1;
        }
        0
    }
    let mut found: Option<PathBuf> = None;
    // SAFETY: `visit` only reads the info and writes `found`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut found as *mut Option<PathBuf> as *mut c_void) };
    found.ok_or_else(|| "libtorch_cpu.so is not loaded in this process".to_string())
}

/// dlopen, with dlerror's message on failure.
fn open(path: &str, flags: c_int) -> Result<*mut c_void, String> {
    let c_path = CString::new(path).map_err(|_| format!("{path:?} contains a NUL byte"))?;
    // SAFETY: a valid C string; the handle is kept for the life of the process.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), flags) };
    if handle.is_null() {
        return Err(last_dl_error());
    }
    Ok(handle)
}

/// Loads a shared object from memory: written to an anonymous memory file, opened by its
/// /proc/self/fd path. Nothing is left on disk; its own libraries (libtorch_cuda, NCCL, ...)
/// are already loaded, so the loader finds them by name.
fn open_embedded(bytes: &[u8]) -> Result<*mut c_void, String> {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    let name = CString::new("stagehand_cuda").expect("no NUL");
    // SAFETY: a valid name; the fd is owned by the File below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "could not create a memory file for the CUDA bridge: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a fresh fd nobody else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes)
        .map_err(|e| format!("could not write the CUDA bridge to a memory file: {e}"))?;
    let handle = open(&format!("/proc/self/fd/{fd}"), libc::RTLD_NOW | libc::RTLD_LOCAL)
        .map_err(|e| format!("the CUDA bridge could not be loaded: {e}"))?;
    drop(file); // the loader keeps its own mapping
    Ok(handle)
}

/// The function `name` as the function pointer type `F`.
///
/// # Safety
/// `F` must be the `extern "C"` function pointer type of the symbol's definition.
unsafe fn resolve<F: Copy>(handle: *mut c_void, name: &str) -> Result<F, String> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    let address = symbol(handle, name)?;
    // SAFETY: a non-null code address, reinterpreted as the pointer type the caller vouches for.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

fn symbol(handle: *mut c_void, name: &str) -> Result<*mut c_void, String> {
    let c_name = CString::new(name).expect("no NUL in symbol names");
    // SAFETY: a live handle and a valid C string.
    let address = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
    if address.is_null() {
        return Err(format!("the CUDA bridge lacks {name}: {}", last_dl_error()));
    }
    Ok(address)
}

fn last_dl_error() -> String {
    // SAFETY: dlerror returns null or a loader-owned C string valid until the next dl call.
    let message: *const c_char = unsafe { libc::dlerror() };
    if message.is_null() {
        return "unknown loader error".into();
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
}
