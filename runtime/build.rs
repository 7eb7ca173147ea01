//! Gives the `runtime` binary an rpath to the libtorch it was linked against, so it runs without
//! anyone exporting `LD_LIBRARY_PATH`. torch-sys publishes that folder as `DEP_TCH_LIBTORCH_LIB`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
