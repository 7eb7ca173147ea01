//! `driver plan` on a profile the real runtime measured: the stage config it writes is one the
//! driver and the runtime accept and train with.

use std::ffi::OsStr;
use std::time::Duration;

use crate::util::*;

#[test]
fn a_plan_from_a_real_profile_trains() {
    let runtime = runtime();
    let h = Harness::new("plan");
    let profile = h.dir.path().join("mlp.profile.json");
    let status = std::process::Command::new(&runtime)
        .args([
            "profile",
            "--model",
            "mlp",
            "--batch-size",
            "16",
            "--threads",
            "1",
            "--repeats",
            "2",
            "--output",
        ])
        .arg(&profile)
        .status()
        .expect("runtime profile");
    assert!(status.success());
    let stages = h.dir.path().join("stages.json");
    let prediction = h.dir.path().join("prediction.json");
    let args: Vec<&OsStr> = vec![
        OsStr::new("plan"),
        OsStr::new("--profile"),
        profile.as_os_str(),
        OsStr::new("--workers"),
        OsStr::new("2"),
        OsStr::new("--bandwidth"),
        OsStr::new("10"),
        OsStr::new("--microbatches"),
        OsStr::new("2"),
        OsStr::new("--output"),
        stages.as_os_str(),
        OsStr::new("--prediction"),
        prediction.as_os_str(),
    ];
    let run = h.driver(&args, Duration::from_secs(60));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("mlp at 2 microbatches of 16 in fp32 on 2 workers"),
        "{}",
        run.stderr()
    );
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stages).unwrap()).unwrap();
    assert_eq!(
        config["module_to_stage_map"].as_array().unwrap().len(),
        6,
        "{config}"
    );
    let predicted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&prediction).unwrap()).unwrap();
    assert_eq!(predicted["workers"], 2);
    assert_eq!(predicted["microbatches"], 2);

    // The stage config trains: two ranks of the real runtime as processes.
    let experiment = h.config(
        "backend: process\nmachines: [localhost, localhost]\nmodule: mlp\nconfig_file: stages.json\n\
         batch_size: 16\niterations: 2\ndistributed_backend: gloo\nthreads: 1\ndevice: cpu\n",
    );
    let trained = h.run(&experiment, &["--runtime", runtime.to_str().unwrap(), "-q"]);
    assert_eq!(trained.code(), 0, "{}", trained.stderr());
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 2);
    h.assert_no_processes();
}

#[test]
fn a_bad_profile_or_level_exits_2() {
    let h = Harness::new("plan-bad");
    let profile = h.dir.path().join("bad.json");
    std::fs::write(&profile, "{\"format_version\": 1}").unwrap();
    let run = h.driver(
        &[
            OsStr::new("plan"),
            OsStr::new("--profile"),
            profile.as_os_str(),
            OsStr::new("--workers"),
            OsStr::new("2"),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(run.stderr().contains("bad.json"), "{}", run.stderr());
    let run = h.driver(
        &[
            OsStr::new("plan"),
            OsStr::new("--profile"),
            profile.as_os_str(),
            OsStr::new("--workers"),
            OsStr::new("2"),
            OsStr::new("--level"),
            OsStr::new("fast"),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(run.stderr().contains("WORKERS:GBPS"), "{}", run.stderr());
    h.assert_no_processes();
}
