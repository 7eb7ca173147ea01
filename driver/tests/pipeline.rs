//! The real runtime as a 2-stage CPU pipeline (gloo over loopback), end to end, with the process
//! backend and in both container modes.

use crate::util::*;

fn two_stage_mlp(h: &Harness, backend: &str) -> std::path::PathBuf {
    std::fs::write(
        h.dir.path().join("mlp_2stage.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    h.config(&format!(
        "backend: {backend}\nmachines: [localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: mlp\n\
         config_file: mlp_2stage.json\nschedule: gpipe\nmicrobatches: 2\nbatch_size: 8\niterations: 3\n\
         distributed_backend: gloo\nthreads: 1\n",
        local_context().display()
    ))
}

fn check(h: &Harness, run: &Run) {
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (_, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 3);
    let stages = summary["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{summary}");
    // The second stage waits on the first: its time is not all compute.
    for stage in stages {
        let total: f64 = ["compute_share", "comm_share", "idle_share"]
            .iter()
            .map(|k| stage[k].as_f64().unwrap())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{stage}");
    }
    assert!(summary["throughput"]["samples_per_sec_mean"].as_f64().unwrap() > 0.0);
    h.assert_no_containers();
}

#[test]
fn a_two_stage_pipeline_runs_as_processes() {
    let runtime = runtime();
    let h = Harness::new("pipe-proc");
    let run = h.run(
        &two_stage_mlp(&h, "process"),
        &["--runtime", runtime.to_str().unwrap()],
    );
    check(&h, &run);
    h.assert_no_containers();
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
        check(&h, &run);
    }
}

#[test]
fn a_request_the_runtime_refuses_fails_preflight_before_any_rank_starts() {
    base_image();
    let h = Harness::new("pipe-refused");
    std::fs::write(
        h.dir.path().join("mlp_hybrid.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#,
    )
    .unwrap();
    // PipeDream needs the microbatches to be a multiple of stage 0's two replicas.
    let exp = h.config(&format!(
        "machines: [localhost, localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: mlp\n\
         config_file: mlp_hybrid.json\nschedule: pipedream\nmicrobatches: 3\nbatch_size: 12\n\
         iterations: 2\ndistributed_backend: gloo\nthreads: 1\n",
        local_context().display()
    ));
    let run = h.run(&exp, &[]);
    assert_eq!(run.code(), 3, "{}", run.stderr());
    let stderr = run.stderr();
    assert!(
        stderr.contains("the runtime refuses the experiment's training request")
            && stderr.contains("multiple of every stage's replica count"),
        "{stderr}"
    );
    assert!(!h.records().exists(), "nothing started, so no record");
    h.assert_no_containers();
}
