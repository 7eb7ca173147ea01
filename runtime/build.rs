//! Gives the `runtime` binary an rpath to the libtorch it was linked against, so it runs without
//! anyone exporting `LD_LIBRARY_PATH`, and compiles `csrc/c10d_bridge.cpp`, the C ABI to PyTorch's
//! own c10d, and `csrc/autograd.cpp`, autograd entry points tch lacks. torch-sys publishes
//! libtorch's library folder as `DEP_TCH_LIBTORCH_LIB`; the headers sit beside it in `../include`. Gloo's own headers come from Debian's `libgloo-dev`.
//!
//! The `nccl` feature adds ProcessGroupNCCL, which needs `nccl.h` and the CUDA headers: taken from
//! `CUDA_HOME` (or `/usr/local/cuda`) if present, and from the nvidia wheels beside torch.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=csrc/c10d_bridge.cpp");
    println!("cargo:rerun-if-changed=csrc/autograd.cpp");
    let lib_dir = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not export DEP_TCH_LIBTORCH_LIB (is torch-sys a dependency?)"),
    );
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());

    let include = lib_dir.join("../include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("csrc/c10d_bridge.cpp")
        .file("csrc/autograd.cpp")
        .std("c++17")
        .warnings(true) // -Wall -Wextra
        .define("USE_C10D_GLOO", None)
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        // System includes: warnings inside torch's and gloo's headers are not ours to fix.
        .flag("-isystem")
        .flag(include.to_str().expect("a UTF-8 libtorch path"))
        .flag("-isystem")
        .flag(
            include
                .join("torch/csrc/api/include")
                .to_str()
                .expect("a UTF-8 libtorch path"),
        );

    if std::env::var_os("CARGO_FEATURE_NCCL").is_some() {
        build.define("USE_C10D_NCCL", None);
        for dir in cuda_include_dirs(&lib_dir) {
            build
                .flag("-isystem")
                .flag(dir.to_str().expect("a UTF-8 CUDA path"));
        }
        // torch-sys links libtorch_cuda only when it decides to; ProcessGroupNCCL lives there.
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
    }
    build.compile("c10d_bridge");
    // The bridge's symbols come from libtorch_cpu (c10d) and c10, which torch-sys links already;
    // naming them again keeps the order right after the static bridge library.
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

/// `CUDA_HOME`'s (or /usr/local/cuda's) include folder, then the include folders of the nvidia
/// wheels installed beside torch (`site-packages/nvidia/*/include`, which hold nccl.h and the CUDA
/// runtime headers; torch's own wheels lack two header sets that ProcessGroupNCCL.hpp needs, which
/// PyPI's `nvidia-cuda-crt` (`crt/host_config.h`) and `nvidia-cuda-cccl` (`nv/target`) provide).
fn cuda_include_dirs(torch_lib: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let cuda_home = std::env::var_os("CUDA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"));
    if cuda_home.join("include/cuda_runtime.h").exists() {
        dirs.push(cuda_home.join("include"));
    }
    let nvidia = torch_lib.join("../../nvidia");
    if let Ok(entries) = std::fs::read_dir(&nvidia) {
        let mut wheels: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path().join("include")))
            .filter(|p| p.is_dir())
            .collect();
        wheels.sort();
        dirs.extend(wheels);
    }
    if !dirs.iter().any(|d| d.join("nccl.h").exists()) {
        println!(
            "cargo:warning=feature `nccl`: no nccl.h found under CUDA_HOME or {}",
            nvidia.display()
        );
    }
    dirs
}
