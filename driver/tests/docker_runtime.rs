//! The real runtime in containers on the machine's engine: the 2-stage pipeline in both container
//! modes, a request the runtime refuses stopped at preflight, a 4-point sweep, and
//! `config_file: auto` profiling in a container (and failing there). Their process-backend
//! counterparts are in the `local` binary.

use std::ffi::OsStr;
use std::time::Duration;

use crate::util::experiments::*;
use crate::util::*;

fn args<'a>(items: &'a [&'a str]) -> Vec<&'a OsStr> {
    items.iter().map(OsStr::new).collect()
}

#[test]
fn a_two_stage_pipeline_runs_in_both_container_modes() {
    let runtime = runtime();
    base_image();
    for mode in [&[][..], &["--launch-single-container"][..]] {
        let h = Harness::new("pipe-docker");
        let mut args = vec!["--runtime", runtime.to_str().unwrap()];
        args.extend_from_slice(mode);
        let run = h.run(&two_stage_mlp(&h, "docker"), &args);
        check_pipeline_run(&h, &run);
        h.assert_no_containers();
    }
}

/// `profiler_trace: true` in both container modes: each rank writes its trace inside its
/// container, and the driver copies it out into the record before removing the container.
#[test]
fn profiler_traces_are_copied_out_of_the_containers_into_the_record() {
    let runtime = runtime();
    base_image();
    for mode in [&[][..], &["--launch-single-container"][..]] {
        let h = Harness::new("pipe-docker-traced");
        let mut args = vec!["--runtime", runtime.to_str().unwrap()];
        args.extend_from_slice(mode);
        let run = h.run(&traced(&two_stage_mlp(&h, "docker")), &args);
        check_traces_kept(&h, &run);
        h.assert_no_containers();
    }
}

/// A rank's container killed after the traced iterations fails the run; the driver kills the
/// other rank's container, copies both traces out of the stopped containers, then removes them.
#[test]
fn a_failed_runs_traces_are_copied_out_of_its_stopped_containers() {
    base_image();
    let h = Harness::new("pipe-docker-traced-failed");
    a_failed_runs_traces_are_kept(&h, "docker", |container| {
        docker(&["kill", container]);
    });
    h.assert_no_containers();
}

/// Checkpoints written inside containers land in a folder the engine made on the host, and a
/// later run's containers resume from it.
/// An image folder on this machine reaches the containers (mounted read-only) and trains there:
/// two data-parallel replicas, each decoding its own rows of every minibatch on the file's
/// `data_workers` threads with the file's `augment`. The fixture's JPEGs and PNGs were written by
/// torchvision (libjpeg-turbo and libpng), smooth images of 4 sizes in two classes.
#[test]
fn an_image_folder_trains_in_containers_with_its_transform_and_loader_threads() {
    let runtime = runtime();
    base_image();
    let h = Harness::new("images-docker");
    let images = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images");
    let config = h.config(&format!(
        "machines: [localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: mlp\nimage_size: 16\n\
         batch_size: 8\nmicrobatches: 2\niterations: 3\ndistributed_backend: gloo\nthreads: 1\n\
         data_dir: '{}'\naugment: none\ndata_workers: 2\n",
        local_context().display(),
        images.display()
    ));
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 3);
    let mut starts = 0;
    for line in lines(&dir.join("metrics.jsonl")) {
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        match event["event"].as_str() {
            Some("start") => {
                starts += 1;
                let c = &event["config"];
                assert!(c["data"].as_str().unwrap().starts_with("imagefolder:"), "{c}");
                assert_eq!(
                    (c["augment"].as_str(), c["data_workers"].as_u64()),
                    (Some("none"), Some(2)),
                    "{c}"
                );
                // The dataset's two classes size the model's head.
                assert_eq!(
                    event["num_params"],
                    3 * 16 * 16 * 1024 + 1024 + 3 * (1024 * 1024 + 1024) + 1024 * 2 + 2
                );
            }
            Some("iteration") => assert!(event["loss"].as_f64().unwrap().is_finite(), "{event}"),
            _ => {}
        }
    }
    assert_eq!(starts, 2, "both ranks started");
    h.assert_no_containers();
}

#[test]
fn checkpoints_outlive_the_containers_that_wrote_them() {
    let runtime = runtime();
    base_image();
    let h = Harness::new("pipe-ckpt");
    let config = two_stage_mlp(&h, "docker");
    let text = std::fs::read_to_string(&config).unwrap();
    let ckpt = h.dir.path().join("not-yet").join("ckpt");
    let first = format!("{text}checkpoint_dir: '{}'\n", ckpt.display());
    std::fs::write(&config, &first).unwrap();
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    for rank in 0..2 {
        assert!(ckpt.join(format!("rank-{rank}/latest")).is_file(), "rank {rank}");
    }
    let resumed = format!(
        "{}resume: true\n",
        first.replace("iterations: 3", "iterations: 4")
    );
    std::fs::write(&config, resumed).unwrap();
    let run = h.run(&config, &["--runtime", runtime.to_str().unwrap()]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    for rank in 0..2 {
        assert!(ckpt.join(format!("rank-{rank}/iter-4")).is_dir(), "rank {rank}");
    }
    h.assert_no_containers();
}

#[test]
fn an_interrupted_pipeline_in_containers_checkpoints_every_rank_and_resumes() {
    base_image();
    let h = Harness::new("pipe-term-docker");
    an_interrupted_run_checkpoints_every_rank_and_resumes(&h, "docker", &[]);
    h.assert_no_containers();
}

/// The same with the ranks exec'd into one container per host: the container's guard passes the
/// interrupt's TERM on to them.
#[test]
fn an_interrupted_pipeline_in_one_container_checkpoints_every_rank_and_resumes() {
    base_image();
    let h = Harness::new("pipe-term-host");
    an_interrupted_run_checkpoints_every_rank_and_resumes(&h, "docker", &["--launch-single-container"]);
    h.assert_no_containers();
}

/// A rank's container killed by someone else (`docker kill`, as an admin or the kernel would):
/// the driver removes every container of the run, starts new ones that resume from the
/// checkpoints, and leaves none behind.
#[test]
fn a_killed_rank_container_restarts_from_its_checkpoint() {
    base_image();
    let h = Harness::new("pipe-restart-docker");
    a_killed_rank_restarts_from_its_checkpoint(&h, "docker", |container| {
        docker(&["kill", container]);
    });
    h.assert_no_containers();
}

#[test]
fn a_request_the_runtime_refuses_fails_preflight_before_any_rank_starts() {
    base_image();
    let h = Harness::new("pipe-refused");
    let exp = refused_pipedream_mlp(&h);
    let run = h.run(&exp, &[]);
    assert_eq!(run.code(), 2, "the experiment file's to change: {}", run.stderr());
    let stderr = run.stderr();
    assert!(
        stderr.contains("the runtime refuses the experiment's training request")
            && stderr.contains("multiple of every stage's replica count"),
        "{stderr}"
    );
    assert!(!h.records().exists(), "nothing started, so no record");
    h.assert_no_containers();
}

#[test]
fn a_request_the_runtime_refuses_costs_no_image_build() {
    // The runtime on this machine checks the request while the hosts are reached; an image that
    // must be built for the run waits for its verdict, and is not built when it refuses.
    base_image();
    let h = Harness::new("pipe-refused-build");
    let context = h.dir.path().join("fresh-context");
    std::fs::create_dir(&context).unwrap();
    let dockerfile = std::fs::read_to_string(local_context().join("Dockerfile")).unwrap();
    // A context no engine has seen: its tag is new, so the run would build it.
    std::fs::write(
        context.join("Dockerfile"),
        format!("{dockerfile}\nLABEL test={}\n", h.name),
    )
    .unwrap();
    let exp = refused_pipedream_mlp(&h);
    let body = std::fs::read_to_string(&exp).unwrap().replace(
        &local_context().display().to_string(),
        &context.display().to_string(),
    );
    std::fs::write(&exp, body).unwrap();
    let run = h.run(&exp, &[]);
    assert_eq!(run.code(), 2, "{}", run.stderr());
    let stderr = run.stderr();
    assert!(
        stderr.contains("multiple of every stage's replica count"),
        "{stderr}"
    );
    assert!(!stderr.contains("driver: building"), "{stderr}");
    let built = docker(&["images", "-q", "stagehand-fresh-context"]);
    assert!(built.trim().is_empty(), "an image was built: {built}");
    h.assert_no_containers();
}

#[test]
fn a_four_point_sweep_trains_the_real_runtime_on_the_local_engine() {
    let runtime = runtime();
    base_image();
    let h = Harness::new("sw-real");
    std::fs::write(
        h.dir.path().join("mlp_2stage.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    let config = h.config(&format!(
        "machines: [localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: mlp\n\
         config_file: mlp_2stage.json\nbatch_size: 8\niterations: 3\ndistributed_backend: gloo\n\
         threads: 1\ndevice: cpu\nsweep:\n  schedule: [gpipe, 1f1b]\n",
        local_context().display()
    ));
    let records = h.records();
    let run = h.driver(
        &args(&[
            "sweep",
            "--config-file",
            config.to_str().unwrap(),
            "--grid",
            "microbatches=2,4",
            "--output-dir",
            records.to_str().unwrap(),
            "--runtime",
            runtime.to_str().unwrap(),
            "-q",
        ]),
        Duration::from_secs(400),
    );
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let dir = h.sweep_dir();
    assert_eq!(point_statuses(&dir), ["succeeded"; 4]);
    let index = sweep_index(&dir);
    assert_eq!(index["axes"][0]["key"], "schedule", "the file's axis first");
    assert_eq!(index["axes"][1]["key"], "microbatches");
    for point in index["points"].as_array().unwrap() {
        let record = dir.join(point["record"].as_str().unwrap());
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(record.join("summary.json")).unwrap()).unwrap();
        assert_eq!(summary["status"], "succeeded", "{summary}");
        assert_eq!(summary["iterations_done"], 3);
        assert_eq!(summary["stages"].as_array().unwrap().len(), 2, "{summary}");
        let given = std::fs::read_to_string(record.join("config.given.yml")).unwrap();
        let schedule = point["settings"][0][1].as_str().unwrap();
        assert!(given.contains(&format!("schedule: {schedule}")), "{given}");
        assert!(!given.contains("sweep:"), "{given}");
    }
    // The table printed at the end: one row per point, each measured.
    let table = run.stdout();
    for label in [
        "schedule=gpipe microbatches=2",
        "schedule=gpipe microbatches=4",
        "schedule=1f1b microbatches=2",
        "schedule=1f1b microbatches=4",
    ] {
        let row = table
            .lines()
            .find(|l| l.contains(label))
            .unwrap_or_else(|| panic!("{label}: {table}"));
        assert!(
            row.contains("succeeded") && row.contains("2x1") && row.contains(" ± "),
            "{row}"
        );
    }
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).expect("the sweep's plot");
    assert!(
        svg.starts_with("<svg") && svg.contains("throughput against schedule"),
        "{svg}"
    );
    assert!(svg.contains("microbatches=4"), "one line per other key's value");

    // `driver results` reads the same folder in every format.
    let csv = h.driver(
        &args(&[
            "results",
            dir.to_str().unwrap(),
            "--format",
            "csv",
            "--sort",
            "samples_per_sec:desc",
        ]),
        Duration::from_secs(30),
    );
    assert_eq!(csv.code(), 0, "{}", csv.stderr());
    let text = csv.stdout();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5, "{}", csv.stdout());
    let sps: Vec<f64> = lines[1..]
        .iter()
        .map(|l| l.split(',').nth(10).unwrap().parse().unwrap())
        .collect();
    assert!(sps.windows(2).all(|w| w[0] >= w[1]), "sorted descending: {sps:?}");
    let plot = h.dir.path().join("by-mb.svg");
    let plotted = h.driver(
        &args(&[
            "results",
            dir.to_str().unwrap(),
            "schedule=1f1b",
            "--plot",
            plot.to_str().unwrap(),
            "--plot-x",
            "microbatches",
        ]),
        Duration::from_secs(30),
    );
    assert_eq!(plotted.code(), 0, "{}", plotted.stderr());
    assert_eq!(
        plotted.stdout().matches("1f1b").count(),
        4,
        "two rows, filtered: {}",
        plotted.stdout()
    );
    assert!(std::fs::read_to_string(&plot)
        .unwrap()
        .contains("throughput against microbatches"));
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
