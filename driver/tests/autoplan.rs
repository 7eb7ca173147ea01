//! `config_file: auto`: the driver profiles the model with the real runtime on the first machine,
//! plans the stages, keeps profile, plan and stage config in the record, and runs with them.

use serde_json::Value;

use crate::util::*;

/// A small MLP on two CPU ranks, planned at launch.
fn auto_mlp(h: &Harness, backend: &str, extra: &str) -> std::path::PathBuf {
    h.config(&format!(
        "backend: {backend}\nmachines: [localhost, localhost]\ncontainer: {{build: '{}'}}\n\
         module: mlp\nlayers: 3\nhidden: 256\nconfig_file: auto\nbatch_size: 16\nmicrobatches: 4\n\
         iterations: 3\ndistributed_backend: gloo\nthreads: 1\n{extra}",
        local_context().display()
    ))
}

fn json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The record holds the profile, the prediction and the stage config, the summary the plan, and
/// every rank ran with the planned stage config.
fn check_planned_run(h: &Harness, run: &Run) -> (std::path::PathBuf, Value) {
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("driver: profiling mlp at batch 4 on localhost (cpu)"),
        "{}",
        run.stderr()
    );
    assert!(
        run.stderr().contains("predicted time per minibatch"),
        "{}",
        run.stderr()
    );
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 3);

    let profile = json(&dir.join("profile.json"));
    assert_eq!(profile["model"], "mlp");
    assert_eq!(profile["batch_size"], 4, "profiled at the microbatch size");
    let modules = profile["modules"].as_array().unwrap();
    assert!(modules.len() >= 4, "{profile}");
    assert!(modules.iter().all(|m| m["forward_s"].as_f64().unwrap() >= 0.0));

    let stages = json(&dir.join("stage_config.json"));
    let map = stages["module_to_stage_map"].as_array().unwrap();
    assert_eq!(map.len(), modules.len(), "one stage per module of the profile");
    let prediction = json(&dir.join("plan.json"));
    assert_eq!(prediction["workers"], 2);
    assert_eq!(prediction["microbatches"], 4);

    let plan = &summary["plan"];
    let replicas: Vec<u64> = plan["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .collect();
    assert_eq!(replicas.iter().sum::<u64>(), 2, "{plan}");
    assert_eq!(
        replicas.len(),
        stages["stage_to_rank_map"].as_object().unwrap().len()
    );
    assert_eq!(plan["microbatches"], 4);
    assert!(plan["predicted_time_per_iteration_s"].as_f64().unwrap() > 0.0);
    assert_eq!(plan["profiled_on"], "localhost (cpu)");
    // The stage shares in the summary come from the ranks' own reports of their stage.
    assert_eq!(
        summary["stages"].as_array().unwrap().len(),
        replicas.len(),
        "{summary}"
    );

    // Every rank was given the planned file and the microbatches.
    let resolved = json(&dir.join("config.resolved.json"));
    let stage_config = dir.join("stage_config.json");
    for rank in resolved["plan"]["ranks"].as_array().unwrap() {
        let argv: Vec<&str> = rank["argv"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let at = argv
            .iter()
            .position(|a| *a == "--stage-config")
            .expect("--stage-config");
        assert_eq!(
            std::path::Path::new(argv[at + 1]),
            stage_config.canonicalize().unwrap()
        );
        assert!(argv.windows(2).any(|w| w == ["--microbatches", "4"]), "{argv:?}");
    }
    assert_eq!(resolved["experiment"]["config_file"], "auto");
    (dir, summary)
}

#[test]
fn auto_profiles_plans_and_runs_as_processes() {
    let runtime = runtime();
    let h = Harness::new("auto-proc");
    let run = h.run(
        &auto_mlp(&h, "process", ""),
        &["--runtime", runtime.to_str().unwrap()],
    );
    let (dir, _) = check_planned_run(&h, &run);
    assert!(dir.join("rank-0.log").exists());
    h.assert_no_containers();
}

#[test]
fn auto_profiles_in_a_container_on_the_first_host() {
    let runtime = runtime();
    base_image();
    let h = Harness::new("auto-docker");
    let run = h.run(
        &auto_mlp(&h, "docker", "planner: {straight: true}\n"),
        &["--runtime", runtime.to_str().unwrap()],
    );
    let (_, summary) = check_planned_run(&h, &run);
    assert_eq!(
        summary["plan"]["replicas"],
        serde_json::json!([1, 1]),
        "straight: two stages"
    );
    h.assert_no_containers();
}

#[test]
fn a_failed_profile_ends_the_run_with_its_reason_and_starts_no_rank() {
    let runtime = runtime();
    base_image();
    let h = Harness::new("auto-fail");
    let config = h.config(&format!(
        "machines: [localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: nosuchmodel\n\
         config_file: auto\nbatch_size: 8\niterations: 3\n",
        local_context().display()
    ));
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert!(
        run.stderr().contains(
            "driver: profiling the model on localhost failed with exit code 2; no rank was started"
        ),
        "{}",
        run.stderr()
    );
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "failed");
    assert_eq!(summary["failure"]["cause"]["kind"], "profile_failed");
    let last = summary["failure"]["last_lines"].to_string();
    assert!(
        last.contains("nosuchmodel"),
        "the runtime's own message is kept: {last}"
    );
    assert!(std::fs::read_to_string(dir.join("profile.log"))
        .unwrap()
        .contains("nosuchmodel"));
    assert!(!dir.join("rank-0.log").exists(), "no rank started");
    assert!(!dir.join("stage_config.json").exists());
    // `driver results` shows why.
    let results = h.driver(
        &["results".as_ref(), h.records().as_os_str()],
        std::time::Duration::from_secs(30),
    );
    assert!(
        results
            .stdout()
            .contains("profiling on localhost failed with exit code 2"),
        "{}",
        results.stdout()
    );
    h.assert_no_containers();
}

#[test]
fn a_given_profile_of_the_wrong_batch_size_is_refused_with_what_to_do() {
    let h = Harness::new("auto-given");
    let profile = h.dir.path().join("mlp.profile.json");
    let status = std::process::Command::new(runtime())
        .args([
            "profile",
            "--model",
            "mlp",
            "--layers",
            "3",
            "--hidden",
            "256",
            "--batch-size",
            "8",
        ])
        .args(["--repeats", "1", "--output"])
        .arg(&profile)
        .status()
        .unwrap();
    assert!(status.success());
    let config = auto_mlp(&h, "process", "planner: {profile: mlp.profile.json}\n");
    let run = h.run(&config, &["--runtime", runtime().to_str().unwrap()]);
    assert_eq!(run.code(), 1, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("was taken at batch 8 but the run's microbatches have 4 samples"),
        "{}",
        run.stderr()
    );
    let (_, summary) = h.summary();
    assert_eq!(summary["failure"]["cause"]["kind"], "plan_failed");
    h.assert_no_containers();
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
    h.assert_no_containers();
}
