//! `config_file: auto` on the process backend: the driver profiles the model with the real
//! runtime on the first machine, plans the stages, keeps profile, plan and stage config in the
//! record, and runs with them. (Profiling in a container is in `docker_runtime`.)

use crate::util::experiments::*;
use crate::util::*;

/// With compress_activations the plan is made for the bytes that cross: the profile says what
/// each activation weighs in float16, and the plan says it planned for them. The planned ranks'
/// profiler traces are kept, and the profiling run is not taken for one that left none.
#[test]
fn auto_profiles_plans_and_runs_as_processes() {
    let runtime = runtime();
    let h = Harness::new("auto-proc");
    let run = h.run(
        &auto_mlp(
            &h,
            "process",
            "compress_activations: true\nprofiler_trace: true\n",
        ),
        &["--runtime", runtime.to_str().unwrap()],
    );
    let (dir, summary) = check_planned_run(&h, &run);
    assert_eq!(summary["traces"]["ranks"], serde_json::json!([0, 1]), "{summary}");
    assert!(!run.stderr().contains("no profiler trace"), "{}", run.stderr());
    for rank in 0..2 {
        assert!(dir.join(format!("traces/rank-{rank}.json")).is_file());
    }
    assert!(dir.join("rank-0.log").exists());
    assert!(
        run.stderr().contains("on 2 workers, activations sent in fp16:"),
        "{}",
        run.stderr()
    );
    assert_eq!(json(&dir.join("plan.json"))["compress_activations"], true);
    let profile = json(&dir.join("profile.json"));
    let hidden = &profile["modules"][0];
    assert_eq!(hidden["activation_bytes"], 4 * 256 * 4);
    assert_eq!(hidden["compressed_activation_bytes"], 4 * 256 * 2);
    h.assert_no_processes();
}

/// A profile that does not fit the run (another microbatch size, another arithmetic, another
/// model, or the same model at other sizes) is refused before anything starts, saying what
/// differs and what to do.
#[test]
fn a_given_profile_that_does_not_fit_the_run_is_refused_with_what_to_do() {
    let cases: [(&str, &[&str], &str); 4] = [
        (
            "batch",
            &["--model", "mlp", "--batch-size", "8"],
            "was taken at batch 8 but the run's microbatches have 4 samples",
        ),
        (
            "arithmetic",
            &["--model", "mlp", "--batch-size", "4", "--precision", "bf16"],
            "was measured in bf16 but the run computes in fp32",
        ),
        (
            "model",
            &[
                "--model",
                "sparse_mlp",
                "--batch-size",
                "4",
                "--layers",
                "3",
                "--hidden",
                "256",
            ],
            "is of sparse_mlp but the run trains mlp",
        ),
        (
            "sizes",
            &[
                "--model",
                "mlp",
                "--batch-size",
                "4",
                "--layers",
                "3",
                "--hidden",
                "128",
            ],
            "was measured with --hidden 128 but the run trains with --hidden 256",
        ),
    ];
    for (name, profile_args, refusal) in cases {
        let h = Harness::new(&format!("auto-given-{name}"));
        let profile = h.dir.path().join("given.profile.json");
        let status = std::process::Command::new(runtime())
            .arg("profile")
            .args(profile_args)
            .args(["--repeats", "1", "--output"])
            .arg(&profile)
            .status()
            .unwrap();
        assert!(status.success(), "{name}: runtime profile failed");
        let config = auto_mlp(&h, "process", "planner: {profile: given.profile.json}\n");
        // Refused before anything starts (exit 2, no record), and by `driver check` as well.
        let run = h.run(&config, &["--runtime", runtime().to_str().unwrap()]);
        assert_eq!(run.code(), 2, "{name}: {}", run.stderr());
        assert!(run.stderr().contains(refusal), "{name}: {}", run.stderr());
        assert!(!h.records().exists(), "{name}: no record when nothing started");
        let check = h.driver(
            &[
                "check".as_ref(),
                "--config-file".as_ref(),
                config.as_os_str(),
                "--runtime".as_ref(),
                runtime().as_os_str(),
            ],
            std::time::Duration::from_secs(60),
        );
        assert_eq!(check.code(), 2, "{name}: {}", check.stderr());
        assert!(check.stderr().contains(refusal), "{name}: {}", check.stderr());
        h.assert_no_processes();
    }
}

#[test]
fn a_sweep_profiles_once_for_points_that_share_the_model() {
    let runtime = runtime();
    let h = Harness::new("auto-sweep");
    let config = auto_mlp(&h, "process", "sweep:\n  schedule: [gpipe, 1f1b]\n");
    let records = h.records();
    let args: Vec<&std::ffi::OsStr> = [
        "sweep",
        "--config-file",
        config.to_str().unwrap(),
        "--output-dir",
        records.to_str().unwrap(),
        "--runtime",
        runtime.to_str().unwrap(),
    ]
    .into_iter()
    .map(std::ffi::OsStr::new)
    .collect();
    let run = h.driver(&args, std::time::Duration::from_secs(300));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert_eq!(
        run.stderr().matches("driver: profiling mlp").count(),
        1,
        "{}",
        run.stderr()
    );
    let dir = h.sweep_dir();
    assert_eq!(point_statuses(&dir), ["succeeded"; 2]);
    let on: Vec<String> = point_records(&dir)
        .iter()
        .map(|record| {
            assert!(
                record.join("profile.json").exists(),
                "each record keeps its profile"
            );
            json(&record.join("summary.json"))["plan"]["profiled_on"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        on,
        ["localhost (cpu)", "localhost (cpu), taken for an earlier run"]
    );
    h.assert_no_processes();
}
