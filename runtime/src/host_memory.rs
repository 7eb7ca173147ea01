//! What becomes of host memory a training step frees.
//!
//! glibc's malloc serves a block above its mmap threshold (128 KiB, rising to the size of such
//! blocks as they are freed, up to 32 MiB) with a mapping of its own, unmapped on free, and gives
//! the free top of its heap back to the system past a trim threshold. A step frees and
//! allocates the same tensors every iteration (activations, gradients set to none), so under
//! those defaults every iteration maps again, faults in and has the kernel zero memory the
//! previous one just returned: VGG16's classifier gradients alone are 400 MB a step.
//!
//! [`Policy::Keep`] (the default) turns both off, as mallopt(3) describes: no block gets a
//! mapping of its own and the heap is never trimmed, so freed memory is reused by the next
//! iteration. The process keeps its peak until it ends, as a training process reaches that peak
//! every iteration anyway. [`Policy::Release`] leaves glibc's defaults. Settings the
//! environment makes (`GLIBC_TUNABLES`' malloc tunables, `MALLOC_*_`) are the user's and win.
//! Where malloc is not glibc's (or glibc refuses a setting) nothing changes, and the run says
//! `release`.

use std::fmt;

/// Whether freed host memory stays with the process or goes back to the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Keep,
    Release,
}

/// What [`apply`] did: the `host_memory` the `start` event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Freed memory stays with the process.
    Kept,
    /// glibc's defaults.
    Released,
    /// The environment tunes glibc's malloc; left as it says.
    Environment,
}

impl fmt::Display for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Applied::Kept => "keep",
            Applied::Released => "release",
            Applied::Environment => "environment",
        })
    }
}

/// Environment variables through which glibc's malloc reads its settings at start-up.
const MALLOC_VARIABLES: [&str; 5] = [
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
];

/// Whether an environment (read through `var`) sets any of glibc's malloc settings.
fn environment_tunes_malloc(var: impl Fn(&str) -> Option<String>) -> bool {
    var("GLIBC_TUNABLES").is_some_and(|t| t.split(':').any(|kv| kv.starts_with("glibc.malloc.")))
        || MALLOC_VARIABLES.iter().any(|name| var(name).is_some())
}

/// Applies `policy` to this process's allocator, unless the environment tunes it.
pub fn apply(policy: Policy) -> Applied {
    if environment_tunes_malloc(|name| std::env::var(name).ok()) {
        return Applied::Environment;
    }
    match policy {
        Policy::Release => Applied::Released,
        Policy::Keep if keep_freed_memory() => Applied::Kept,
        // An allocator that is not glibc's keeps its own ways.
        Policy::Keep => Applied::Released,
    }
}

/// Tells glibc's malloc to keep freed memory; whether it took both settings.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() -> bool {
    // SAFETY: mallopt only sets the allocator's parameters (under its own lock); blocks already
    // handed out keep how they were allocated. Both settings are valid on every glibc: 0 mappings
    // of their own, and a trim threshold of -1 (as size_t, the largest), which mallopt(3)
    // documents as turning trimming off. mallopt returns 1 where it took a setting.
    unsafe { libc::mallopt(libc::M_MMAP_MAX, 0) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn only_malloc_settings_in_the_environment_take_over() {
        assert!(!environment_tunes_malloc(env(&[])));
        assert!(!environment_tunes_malloc(env(&[(
            "GLIBC_TUNABLES",
            "glibc.cpu.hwcaps=-AVX512F:glibc.rtld.nns=2"
        )])));
        assert!(environment_tunes_malloc(env(&[(
            "GLIBC_TUNABLES",
            "glibc.cpu.hwcaps=-AVX512F:glibc.malloc.trim_threshold=0"
        )])));
        assert!(environment_tunes_malloc(env(&[("MALLOC_ARENA_MAX", "2")])));
        assert!(environment_tunes_malloc(env(&[(
            "MALLOC_MMAP_THRESHOLD_",
            "65536"
        )])));
    }

    /// Page faults this thread has taken so far.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn thread_faults() -> i64 {
        // SAFETY: getrusage fills the struct it is given.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0);
            usage.ru_minflt + usage.ru_majflt
        }
    }

    /// Under Keep, a big block freed and asked for again is memory already in place: writing
    /// it again takes no page faults. glibc's default unmaps it on free and maps it anew, and
    /// each of its pages faults in (zeroed by the kernel) once more.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_freed_big_block_is_reused_rather_than_unmapped() {
        if environment_tunes_malloc(|name| std::env::var(name).ok()) {
            eprintln!("skipped: the environment tunes glibc's malloc");
            return;
        }
        assert!(keep_freed_memory(), "glibc refused a setting");
        // Large for a heap to grow by, within what a thread's own arena can hold (libtest runs
        // each test on a thread of its own, whose blocks come from such an arena).
        const BIG: usize = 16 << 20;
        let write_once = || {
            let before = thread_faults();
            // SAFETY: a block this closure allocates, writes only inside, and frees.
            unsafe {
                let block = libc::malloc(BIG) as *mut u8;
                assert!(!block.is_null());
                block.write_bytes(7, BIG);
                // Kept from the optimiser, which may drop a block nothing reads.
                libc::free(std::hint::black_box(block) as *mut libc::c_void);
            }
            thread_faults() - before
        };
        let first = write_once();
        let again = write_once();
        // Mapped anew, the block faults in as often as the first time (4096 4-KiB pages, or 8
        // huge ones); reused, not at all. (The first may have reused memory freed before.)
        assert!(
            again <= (first / 4).max(2),
            "{again} page faults writing a block freed just before ({first} the first time)"
        );
    }
}
