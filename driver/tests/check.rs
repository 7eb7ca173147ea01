//! `driver check` and `driver run --dry-run`: the experiment resolved and printed, every rank's
//! request put to the real runtime's own `runtime --check`, and nothing started: no record, no
//! process left, and no Docker engine needed (each driver here runs with `DOCKER_HOST` pointing at
//! a socket that does not exist, so touching an engine would fail it).

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::util::experiments::{pipedream_alexnet, refused_pipedream_mlp};
use crate::util::*;

/// An engine that cannot be reached.
const NO_ENGINE: (&str, &str) = ("DOCKER_HOST", "unix:///nonexistent.sock");

fn listing(dir: &Path) -> BTreeSet<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default()
}

/// Runs `driver check --config-file CONFIG` with no engine reachable.
fn check(h: &Harness, config: &Path) -> Run {
    h.driver_with_env(
        &[
            OsStr::new("check"),
            OsStr::new("--config-file"),
            config.as_os_str(),
        ],
        &[NO_ENGINE],
        Duration::from_secs(60),
    )
}

/// The number of ranks the first line announces (`experiment NAME: N rank(s) on ...`).
fn announced_ranks(out: &str) -> usize {
    let first = out.lines().next().unwrap_or_default();
    let (_, rest) = first.split_once(": ").unwrap_or_else(|| panic!("{out}"));
    let (n, _) = rest.split_once(" rank(s) on ").unwrap_or_else(|| panic!("{out}"));
    n.parse().unwrap_or_else(|_| panic!("{out}"))
}

/// The ranks that have a line of their own (`  rank N ...`), in the order shown.
fn ranks_shown(out: &str) -> Vec<usize> {
    out.lines()
        .filter_map(|l| l.strip_prefix("  rank "))
        .map(|l| {
            let n: String = l.chars().take_while(char::is_ascii_digit).collect();
            n.parse().unwrap_or_else(|_| panic!("{l}"))
        })
        .collect()
}

#[test]
fn every_shipped_config_passes_driver_check_and_names_each_rank() {
    let h = Harness::new("check-shipped");
    let configs_dir = workspace().join("driver_configs");
    let mut configs: Vec<PathBuf> = listing(&configs_dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yml"))
        .collect();
    configs.sort();
    assert!(configs.len() >= 6, "the shipped configs: {configs:?}");
    let shipped_before = listing(&configs_dir);
    let scratch_before = listing(h.dir.path());
    for config in &configs {
        let run = check(&h, config);
        let out = run.stdout();
        assert_eq!(run.code(), 0, "{}: {}{out}", config.display(), run.stderr());
        let n = announced_ranks(&out);
        assert!(n >= 1, "{}: {out}", config.display());
        let mut shown = ranks_shown(&out);
        shown.sort();
        assert_eq!(
            shown,
            (0..n).collect::<Vec<_>>(),
            "{}: each rank once: {out}",
            config.display()
        );
        // Whether the stages are planned at launch is read from the file, not from the output.
        let text = std::fs::read_to_string(config).unwrap();
        let auto = text.lines().any(|l| l.trim() == "config_file: auto");
        let verdict = out
            .lines()
            .find(|l| l.starts_with("runtime check: "))
            .unwrap_or_else(|| panic!("{}: no verdict: {out}", config.display()));
        if auto {
            assert!(
                verdict.starts_with("runtime check: skipped: config_file: auto"),
                "{}: {verdict}",
                config.display()
            );
        } else {
            assert!(
                verdict.starts_with("runtime check: every rank's request accepted"),
                "{}: {verdict}",
                config.display()
            );
        }
        // The shipped files ask for nothing the runtime would ignore.
        let warned: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("runtime warning: "))
            .collect();
        assert!(warned.is_empty(), "{}: {warned:?}", config.display());
        // The record folder it names (relative ones land where it ran) is not made.
        let record = out
            .lines()
            .find_map(|l| l.strip_prefix("record: "))
            .unwrap_or_else(|| panic!("{out}"));
        let (parent, name) = record
            .split_once("<UTC time>_")
            .unwrap_or_else(|| panic!("{record}"));
        let made: Vec<PathBuf> = listing(&h.dir.path().join(parent))
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(&format!("_{name}")))
            .collect();
        assert!(made.is_empty(), "{}: {made:?}", config.display());
    }
    assert_eq!(listing(&configs_dir), shipped_before, "driver_configs/ unchanged");
    assert_eq!(
        listing(h.dir.path()),
        scratch_before,
        "nothing written where it ran"
    );
    h.assert_no_processes();
}

#[test]
fn a_pipedream_experiment_passes_driver_check_with_its_split_translated() {
    let h = Harness::new("check-pipedream");
    let config = pipedream_alexnet(&h, "docker");
    let run = check(&h, &config);
    let out = run.stdout();
    assert_eq!(run.code(), 0, "{}{out}", run.stderr());
    assert_eq!(ranks_shown(&out), [0, 1], "{out}");
    // Every rank runs the runtime's alexnet with the translated stage config, and the epochs,
    // learning-rate policy and weight decay PipeDream's keys ask for.
    for line in out.lines().filter(|l| l.starts_with("  rank ")) {
        for needle in [
            "--model alexnet",
            "--epochs 2",
            "--lr-policy step",
            "--weight-decay 0.0005",
            "stage-configs/pipedream-",
        ] {
            assert!(line.contains(needle), "{needle}: {line}");
        }
    }
    assert!(
        out.contains("runtime check: every rank's request accepted"),
        "{out}"
    );
    h.assert_no_processes();
}

#[test]
fn a_request_the_runtime_refuses_exits_2_with_its_reason() {
    let h = Harness::new("check-refused");
    let config = refused_pipedream_mlp(&h);
    let run = check(&h, &config);
    let stderr = run.stderr();
    assert_eq!(run.code(), 2, "{stderr}");
    assert!(
        stderr.contains("the runtime refuses rank 0's training request")
            && stderr.contains("multiple of every stage's replica count"),
        "{stderr}"
    );
    assert!(
        run.stdout().is_empty(),
        "no plan printed for a refused request: {}",
        run.stdout()
    );
    // With 4 microbatches the same file passes: the refusal was about the microbatches.
    let fixed = std::fs::read_to_string(&config)
        .unwrap()
        .replace("microbatches: 3", "microbatches: 4");
    std::fs::write(&config, fixed).unwrap();
    let run = check(&h, &config);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(!h.records().exists());
    h.assert_no_processes();
}

/// Ranks on other hosts resume from checkpoints on those hosts' disks: `resume: true` with no
/// checkpoint here passes the check (the image's runtime checks it there at preflight), where a
/// rank on this machine is checked against this machine's folder.
#[test]
fn a_resume_is_checked_where_the_checkpoints_are() {
    let h = Harness::new("check-resume");
    let body = |machines: &str| {
        format!(
            "machines: [{machines}]\nmodule: mlp\nbatch_size: 8\niterations: 3\n\
             checkpoint_dir: /nonexistent/ckpt\nresume: true\n"
        )
    };
    let run = check(&h, &h.config(&body("th1, th2")));
    assert_eq!(run.code(), 0, "{}{}", run.stderr(), run.stdout());
    assert!(
        run.stdout()
            .contains("runtime check: every rank's request accepted"),
        "{}",
        run.stdout()
    );
    let run = check(&h, &h.config(&format!("backend: process\n{}", body("localhost"))));
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("no checkpoint of rank 0 in /nonexistent/ckpt"),
        "{}",
        run.stderr()
    );
    h.assert_no_processes();
}

/// With `resume`, the check says where the run would go on: from the checkpoints the ranks here
/// hold, or afresh where there are none yet (`resume: auto`).
#[test]
fn a_resume_is_said_to_go_on_where_the_checkpoints_are() {
    let h = Harness::new("check-resume-at");
    let body = |resume: &str, iterations: u32| {
        format!(
            "backend: process\nmachines: [localhost, localhost]\nmodule: mlp\nbatch_size: 8\n\
             iterations: {iterations}\nthreads: 1\ncheckpoint_dir: ckpt\n{resume}"
        )
    };
    let run = check(&h, &h.config(&body("resume: auto\n", 3)));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(
        run.stdout()
            .contains("resume: no checkpoint yet; the run starts afresh\n"),
        "{}",
        run.stdout()
    );
    let trained = h.run(&h.config(&body("", 3)), &[]);
    assert_eq!(trained.code(), 0, "{}", trained.stderr());
    for resume in ["resume: true\n", "resume: auto\n"] {
        let run = check(&h, &h.config(&body(resume, 6)));
        assert_eq!(run.code(), 0, "{resume}{}", run.stderr());
        assert!(
            run.stdout().contains(
                "resume: from the checkpoints of 3 iterations done; training goes on at iteration 3\n"
            ),
            "{resume}{}",
            run.stdout()
        );
    }
    // Without `resume`, nothing is said of it.
    let run = check(&h, &h.config(&body("", 6)));
    assert!(!run.stdout().contains("resume:"), "{}", run.stdout());
    h.assert_no_processes();
}

/// Keys the runtime accepts but would do nothing with in this experiment pass, each named once
/// (every rank's check warns of it) with why and where it is written.
#[test]
fn keys_that_would_do_nothing_are_warned_of_once_with_where_they_are_written() {
    let h = Harness::new("check-idle");
    let config = h.config(
        "machines: [localhost, localhost]\nbackend: process\nmodule: mlp\nbatch_size: 8\n\
         iterations: 3\nchannels_last: true\nthreads: 1\ncudnn_benchmark: true\n",
    );
    let run = check(&h, &config);
    let out = run.stdout();
    assert_eq!(run.code(), 0, "{}{out}", run.stderr());
    let warned: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("runtime warning: "))
        .collect();
    let file = config.display();
    assert_eq!(
        warned,
        [
            format!(
                "runtime warning: --channels-last does nothing for mlp, which has no convolutions; \
                 drop it (`channels_last` at {file}:7)"
            ),
            format!(
                "runtime warning: --cudnn-benchmark does nothing on the CPU (cuDNN runs on CUDA \
                 devices); drop it (`cudnn_benchmark` at {file}:9)"
            ),
        ],
        "{out}"
    );
    h.assert_no_processes();
}

/// A `container: {build: DIR}` without its folder or its Dockerfile is the file's to fix, said by
/// `driver check` and by a run before either reaches a host (a run found it at the build, once
/// every host had been reached).
#[test]
fn a_build_folder_or_dockerfile_that_is_not_there_is_refused_where_it_is_written() {
    let h = Harness::new("check-build");
    std::fs::create_dir(h.dir.path().join("ctx")).unwrap();
    let cases = [
        ("{build: missing-ctx}", "missing-ctx is not a folder here"),
        ("{build: ctx}", "ctx holds no Dockerfile"),
        (
            "{build: ctx, dockerfile: d/Dockerfile}",
            "ctx holds no d/Dockerfile",
        ),
    ];
    for (container, expected) in cases {
        let config = h.config(&format!(
            "machines: [localhost]\ncontainer: {container}\ncommand: [/bin/true]\n"
        ));
        let checked = check(&h, &config);
        let ran = h.driver_with_env(
            &[OsStr::new("--config-file"), config.as_os_str()],
            &[NO_ENGINE],
            Duration::from_secs(60),
        );
        for (what, run) in [("check", &checked), ("run", &ran)] {
            let stderr = run.stderr();
            assert_eq!(run.code(), 2, "{what} {container}: {stderr}");
            assert!(
                stderr.contains(expected) && stderr.contains(&format!("{}:3", config.display())),
                "{what} {container}: {stderr}"
            );
        }
    }
    // With the process backend no image is built, and the same key is no matter.
    let config = h.config(
        "machines: [localhost]\nbackend: process\ncontainer: {build: missing-ctx}\ncommand: [/bin/true]\n",
    );
    let checked = check(&h, &config);
    assert_eq!(checked.code(), 0, "{}", checked.stderr());
    assert!(!h.records().exists());
    h.assert_no_processes();
}

/// Local ranks run the checkout's release runtime wherever the driver is run from, and the check
/// asks that same runtime (from a folder without a build it asked the checkout's, and the ranks
/// then failed to find `target/release/runtime` in the working folder).
#[test]
fn local_ranks_run_the_runtime_the_check_asks_from_any_folder() {
    let h = Harness::new("check-local-runtime");
    let config = h.config("machines: [localhost]\nbackend: process\nmodule: mlp\nbatch_size: 8\n");
    let run = check(&h, &config);
    let out = run.stdout();
    assert_eq!(run.code(), 0, "{}{out}", run.stderr());
    assert!(
        !h.dir.path().join("target").exists(),
        "the test's folder has no build"
    );
    let built = workspace().join("target/release/runtime");
    let rank = out
        .lines()
        .find(|l| l.starts_with("  rank 0"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        rank.contains(&format!("): {} --model mlp", built.display())),
        "{rank}"
    );
    assert!(
        out.contains(&format!(
            "runtime check: every rank's request accepted ({} --check)",
            built.display()
        )),
        "{out}"
    );
}

/// Settings a run would trip on only once it had reached its hosts, or after it had run, are
/// refused where they are written: a mount source that is not on this machine when every host
/// is this machine, a shared memory size past any machine's, a records folder that is a file.
#[test]
fn settings_a_run_would_trip_on_late_are_refused_where_they_are_written() {
    let h = Harness::new("check-late");
    std::fs::write(h.dir.path().join("a-file"), "").unwrap();
    let cases = [
        (
            "mounts: ['missing:/data']",
            "mount source",
            "missing does not exist",
        ),
        (
            "shm_size_mb: 18446744073709551615",
            "shm_size_mb",
            "give at most 1048576",
        ),
        (
            "log_directory: a-file",
            "log_directory",
            "a-file is a file, not a folder",
        ),
    ];
    for (setting, key, expected) in cases {
        let config = h.config(&format!(
            "machines: [localhost]\ncontainer: {{build: '{}'}}\ncommand: [/bin/true]\n{setting}\n",
            local_context().display()
        ));
        let run = check(&h, &config);
        let stderr = run.stderr();
        assert_eq!(run.code(), 2, "{setting}: {stderr}");
        assert!(
            stderr.contains(expected) && stderr.contains(&format!("{}:5", config.display())),
            "{setting} ({key}): {stderr}"
        );
    }
    // A mount whose source is here passes.
    std::fs::create_dir(h.dir.path().join("present")).unwrap();
    let config = h.config(&format!(
        "machines: [localhost]\ncontainer: {{build: '{}'}}\ncommand: [/bin/true]\nmounts: ['present:/data']\n",
        local_context().display()
    ));
    let run = check(&h, &config);
    assert_eq!(run.code(), 0, "{}", run.stderr());
}

/// `device: cpu` with GPUs named in `machines` passes, warned of: the GPUs would go unused.
#[test]
fn gpus_named_for_a_cpu_run_are_warned_of() {
    let h = Harness::new("check-cpu-gpus");
    let config =
        h.config("machines: ['th1:0', 'th2:1', th3, th3]\nmodule: mlp\nbatch_size: 8\ndevice: cpu\n");
    let run = check(&h, &config);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let stderr = run.stderr();
    assert!(
        stderr.contains(&format!(
            "warning: `device: cpu` (`device` at {}:5): the ranks train on the CPU, and the GPUs \
             `machines` names go unused (th1 GPUs 0, th2 GPUs 1)",
            config.display()
        )),
        "{stderr}"
    );
    let run = check(&h, &h.config("machines: ['th1:0']\nmodule: mlp\nbatch_size: 8\n"));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(!run.stderr().contains("go unused"), "{}", run.stderr());
}

/// A checkpoint folder on this machine that cannot be made or written in is refused where it
/// is written, not found by the ranks at their start; one that can passes, and the check leaves
/// no folder behind.
#[test]
fn a_checkpoint_folder_that_cannot_be_written_is_refused_and_the_check_leaves_none() {
    let h = Harness::new("check-ckpt-dir");
    std::fs::write(h.dir.path().join("a-file"), "").unwrap();
    let body = |dir: &str| {
        format!(
            "backend: process\nmachines: [localhost]\nmodule: mlp\nbatch_size: 8\niterations: 3\n\
             checkpoint_dir: {dir}\n"
        )
    };
    for (dir, expected) in [
        ("a-file/ckpt", "a-file is a file, not a folder"),
        ("/proc/stagehand-nope", "cannot create /proc/stagehand-nope"),
    ] {
        let config = h.config(&body(dir));
        let run = check(&h, &config);
        let stderr = run.stderr();
        assert_eq!(run.code(), 2, "{dir}: {stderr}");
        assert!(stderr.contains(expected), "{dir}: {stderr}");
        assert!(
            stderr.contains(&format!("`checkpoint_dir` at {}:7", config.display())),
            "{dir}: {stderr}"
        );
    }
    let run = check(&h, &h.config(&body("new/deeper")));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(
        !h.dir.path().join("new").exists(),
        "the check made a folder it left"
    );
    h.assert_no_processes();
}

#[test]
fn dry_run_prints_what_check_prints_and_starts_nothing() {
    let h = Harness::new("check-dry");
    std::fs::write(
        h.dir.path().join("mlp_2stage.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    let config = h.config(&format!(
        "machines: [localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: mlp\n\
         config_file: mlp_2stage.json\nschedule: 1f1b\nmicrobatches: 2\nbatch_size: 8\n\
         iterations: 3\ndistributed_backend: gloo\nthreads: 1\ncheckpoint_dir: ckpt\nmax_restarts: 2\n",
        local_context().display()
    ));
    let records = h.records();
    let output_dir = [OsStr::new("--output-dir"), records.as_os_str()];
    let mut checked = vec![OsStr::new("check"), OsStr::new("-c"), config.as_os_str()];
    checked.extend(output_dir);
    let checked = h.driver_with_env(&checked, &[NO_ENGINE], Duration::from_secs(60));
    let mut dry = vec![
        OsStr::new("--config-file"),
        config.as_os_str(),
        OsStr::new("--dry-run"),
    ];
    dry.extend(output_dir);
    let dry = h.driver_with_env(&dry, &[NO_ENGINE], Duration::from_secs(60));
    assert_eq!(checked.code(), 0, "{}", checked.stderr());
    assert_eq!(dry.code(), 0, "{}", dry.stderr());
    let out = checked.stdout();
    assert_eq!(dry.stdout(), out, "--dry-run prints what `driver check` prints");
    assert_eq!(ranks_shown(&out), [0, 1], "{out}");
    assert!(out.contains("docker containers, one per rank"), "{out}");
    assert!(
        out.contains(
            "restarts: up to 2 after a failure, every rank from the latest checkpoints written in \
             the run, else as first started"
        ),
        "{out}"
    );
    assert!(
        out.contains(&format!("record: {}", records.join("<UTC time>_").display())),
        "{out}"
    );
    assert!(!records.exists(), "no record folder");
    h.assert_no_processes();
}
