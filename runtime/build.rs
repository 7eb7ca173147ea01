//! Builds the C++ halves of the bridge to PyTorch and gives the `runtime` binary an rpath to the
//! libtorch it was linked against, so it runs without anyone exporting `LD_LIBRARY_PATH`.
//!
//! - `csrc/c10d_bridge.cpp` (the C ABI to PyTorch's c10d: TCPStore, Gloo, the operations) and
//!   `csrc/autograd.cpp` (autograd entry points tch lacks), `csrc/amp.cpp` (autocast, the
//!   gradient scaler's kernels, channels_last) and `csrc/optim.cpp` (the optimizers' step in
//!   PyTorch's fused multi-tensor kernels), `csrc/threads.cpp` (threads kept off the intra-op
//!   pool), `csrc/determinism.cpp` (`--deterministic`) and `csrc/profiler.cpp` (`--profiler-trace`:
//!   PyTorch's profiler, Kineto, which libtorch_cpu holds) are linked into the binary. They need
//!   libtorch_cpu and c10 only. Gloo's own headers come from Debian's `libgloo-dev`.
//! - `csrc/cuda_bridge.cpp` (NCCL groups, the current device, the caching allocator's figures)
//!   and `csrc/fusions.cpp` (the fused kernels of `csrc/kernels/fusions.cu`, whose source it
//!   embeds, through `OUT_DIR/fusions_source.h`, for NVRTC to compile at run time), with
//!   `csrc/fusions_cpu.cpp` (the same kernels compiled as C++, for the tests' CPU stand-in), are
//!   linked as a shared object against libtorch_cuda, c10_cuda, cudart and NCCL, and embedded in
//!   the binary (`OUT_DIR/libstagehand_cuda.so`, cfg `cuda_bridge`). The binary itself never links
//!   a CUDA library: src/cuda/ loads libtorch_cuda and this object at run time, so the same
//!   binary trains on GPUs where the CUDA libraries exist and on CPUs where they do not.
//!
//! The CUDA half is built whenever the torch it is built against ships libtorch_cuda (the Linux
//! x86-64 wheels do) and the headers it needs are there: `nccl.h` and the CUDA runtime headers
//! from `CUDA_HOME` (or /usr/local/cuda) or from the nvidia wheels beside torch, where PyPI's
//! `nvidia-cuda-crt` and `nvidia-cuda-cccl` add two header sets torch's own wheels lack
//! (scripts/setup.sh installs them). Otherwise the runtime is CPU-only and says so.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=csrc/bridge.hpp");
    println!("cargo:rerun-if-changed=csrc/c10d_bridge.cpp");
    println!("cargo:rerun-if-changed=csrc/autograd.cpp");
    println!("cargo:rerun-if-changed=csrc/amp.cpp");
    println!("cargo:rerun-if-changed=csrc/optim.cpp");
    println!("cargo:rerun-if-changed=csrc/threads.cpp");
    println!("cargo:rerun-if-changed=csrc/determinism.cpp");
    println!("cargo:rerun-if-changed=csrc/profiler.cpp");
    println!("cargo:rerun-if-changed=csrc/cuda_bridge.cpp");
    println!("cargo:rerun-if-changed=csrc/fusions.cpp");
    println!("cargo:rerun-if-changed=csrc/kernels/fusions.cu");
    println!("cargo:rerun-if-changed=csrc/fusions_cpu.cpp");
    println!("cargo:rerun-if-changed=csrc/fusions_cpu.hpp");
    println!("cargo:rerun-if-changed=csrc/fusions_kernels.hpp");
    println!("cargo::rustc-check-cfg=cfg(cuda_bridge)");
    let lib_dir = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not export DEP_TCH_LIBTORCH_LIB (is torch-sys a dependency?)"),
    );
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());

    let mut build = cxx_build(&lib_dir);
    build
        .file("csrc/c10d_bridge.cpp")
        .file("csrc/autograd.cpp")
        .file("csrc/amp.cpp")
        .file("csrc/optim.cpp")
        .file("csrc/threads.cpp")
        .file("csrc/determinism.cpp")
        .file("csrc/profiler.cpp");
    build.compile("c10d_bridge");
    // The bridge's symbols come from libtorch_cpu (c10d) and c10, which torch-sys links already;
    // naming them again keeps the order right after the static bridge library.
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");

    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    match cuda_bridge(&lib_dir, &out_dir) {
        Ok(()) => println!("cargo:rustc-cfg=cuda_bridge"),
        Err(reason) => {
            println!("cargo:warning=building a CPU-only runtime: {reason}; `runtime info` will say so")
        }
    }
}

/// A C++17 build against libtorch's headers, with the flags both halves share.
fn cxx_build(lib_dir: &Path) -> cc::Build {
    let include = lib_dir.join("../include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .warnings(true) // -Wall -Wextra
        .define("USE_C10D_GLOO", None)
        .define("_GLIBCXX_USE_CXX11_ABI", "1");
    // System includes: warnings inside torch's and gloo's headers are not ours to fix.
    for dir in [include.clone(), include.join("torch/csrc/api/include")] {
        build
            .flag("-isystem")
            .flag(dir.to_str().expect("a UTF-8 libtorch path"));
    }
    build
}

/// Compiles and links `csrc/cuda_bridge.cpp`, `csrc/fusions.cpp` and `csrc/fusions_cpu.cpp` into
/// `OUT_DIR/libstagehand_cuda.so`, or says why
/// it cannot be built against this torch.
fn cuda_bridge(lib_dir: &Path, out_dir: &Path) -> Result<(), String> {
    if !lib_dir.join("libtorch_cuda.so").exists() {
        return Err(format!(
            "{} has no libtorch_cuda.so (a CPU-only torch)",
            lib_dir.display()
        ));
    }
    let nvidia = lib_dir.join("../../nvidia");
    let includes = cuda_include_dirs(&nvidia);
    for header in ["nccl.h", "cuda_runtime.h", "crt/host_config.h", "nv/target"] {
        if !includes.iter().any(|d| d.join(header).exists()) {
            return Err(format!(
                "no {header} under CUDA_HOME or {} (scripts/setup.sh installs the \
                 nvidia-cuda-crt and nvidia-cuda-cccl headers)",
                nvidia.display()
            ));
        }
    }
    let lib_dirs = cuda_lib_dirs(&nvidia);
    let mut build = cxx_build(lib_dir);
    build.define("USE_C10D_NCCL", None).opt_level(2).pic(true);
    for dir in &includes {
        build
            .flag("-isystem")
            .flag(dir.to_str().expect("a UTF-8 CUDA path"));
    }
    // The kernels' source, for fusions.cpp to hand NVRTC at run time.
    let source = std::fs::read_to_string("csrc/kernels/fusions.cu")
        .map_err(|e| format!("cannot read csrc/kernels/fusions.cu: {e}"))?;
    assert!(
        !source.contains(")fusions\""),
        "fusions.cu holds the raw string's delimiter"
    );
    std::fs::write(
        out_dir.join("fusions_source.h"),
        format!("static const char FUSIONS_SOURCE[] = R\"fusions({source})fusions\";\n"),
    )
    .map_err(|e| format!("cannot write fusions_source.h: {e}"))?;
    build.include(out_dir);
    let output = out_dir.join("libstagehand_cuda.so");
    let mut command: Command = build.get_compiler().to_command();
    command
        .arg("-shared")
        .arg("-s")
        .arg("-Wl,-soname,libstagehand_cuda.so")
        .arg("-o")
        .arg(&output)
        .arg("csrc/cuda_bridge.cpp")
        .arg("csrc/fusions.cpp")
        .arg("csrc/fusions_cpu.cpp")
        // fusions_cpu.cpp compiles the kernels as C++, `#pragma unroll` and all.
        .arg("-Wno-unknown-pragmas")
        // A symbol left undefined fails here, not when the runtime loads the bridge.
        .arg("-Wl,-z,defs")
        .arg(format!("-L{}", lib_dir.display()));
    for dir in &lib_dirs {
        command.arg(format!("-L{}", dir.display()));
    }
    // Every library is named on purpose (the object has no other reason to keep them).
    command.args([
        "-Wl,--no-as-needed",
        "-ltorch_cuda",
        "-lc10_cuda",
        "-ltorch_cpu",
        "-lc10",
        "-l:libcudart.so.13",
        "-l:libnccl.so.2",
        "-ldl",
        "-Wl,--as-needed",
    ]);
    let status = command
        .status()
        .map_err(|e| format!("could not run the C++ compiler: {e}"))?;
    if !status.success() {
        // A compile error in our own source must fail the build, not silently drop CUDA.
        panic!("compiling the CUDA bridge (csrc/cuda_bridge.cpp, csrc/fusions.cpp) failed ({status}); see the compiler's output above");
    }
    Ok(())
}

/// `CUDA_HOME`'s (or /usr/local/cuda's) include folder, then the include folders of the nvidia
/// wheels installed beside torch (`site-packages/nvidia/*/include`, which hold nccl.h and the CUDA
/// runtime headers).
fn cuda_include_dirs(nvidia: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let cuda_home = std::env::var_os("CUDA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"));
    if cuda_home.join("include/cuda_runtime.h").exists() {
        dirs.push(cuda_home.join("include"));
    }
    dirs.extend(wheel_dirs(nvidia, "include"));
    // nvidia-cuda-cccl keeps libcu++ (`cuda/std`, `nv/target`) in include/cccl.
    let cccl: Vec<PathBuf> = dirs
        .iter()
        .map(|d| d.join("cccl"))
        .filter(|d| d.is_dir())
        .collect();
    dirs.extend(cccl);
    dirs
}

/// The nvidia wheels' library folders (libcudart.so.13, libnccl.so.2), for linking only: at run
/// time libtorch_cuda has already loaded them.
fn cuda_lib_dirs(nvidia: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let cuda_home = std::env::var_os("CUDA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"));
    if cuda_home.join("lib64").is_dir() {
        dirs.push(cuda_home.join("lib64"));
    }
    dirs.extend(wheel_dirs(nvidia, "lib"));
    dirs
}

fn wheel_dirs(nvidia: &Path, sub: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(nvidia)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path().join(sub)))
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}
