//! Stages over several devices of one host (`--devices`): the same placement over CPU "devices"
//! runs every path a GPU split runs (parts built on their devices, activations moved between
//! them, the optimizer and the all-reduce over all parts, checkpoints of every part) and must
//! give the single-device run's losses and parameters bit for bit: the same operations on the
//! same numbers in the same order, so nothing here is a tolerance. The GPU split is in `cuda.rs`.

use std::time::Duration;

use stagehand_contract::Event;

use crate::util::{assert_same_params, run, run_ok, run_ranks, Run};

const LIMIT: Duration = Duration::from_secs(120);

/// An MLP of 6 modules (5 layers and the loss) with momentum, one thread, fixed seed.
fn mlp(iterations: &str, extra: &[&str]) -> Vec<String> {
    let base = "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --threads 1 --seed 3 \
                --lr 0.05 --momentum 0.9";
    let mut args: Vec<String> = base.split_whitespace().map(String::from).collect();
    args.extend(["--iterations".to_string(), iterations.to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn start_line(run: &Run) -> String {
    run.stderr()
        .lines()
        .find(|l| l.contains("microbatches of"))
        .unwrap_or_else(|| panic!("no start line: {}", run.stderr()))
        .to_string()
}

#[test]
fn a_stage_split_over_devices_trains_as_it_does_on_one() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    let reference = run_ok(&strs(&mlp("4", &["--save-params", one.to_str().unwrap()])));
    // Runs of even measured cost over two and three devices, and bf16 autocast on each part.
    for (devices, precision) in [("cpu,cpu", "fp32"), ("cpu,cpu,cpu", "fp32"), ("cpu,cpu", "bf16")] {
        let dir = tmp.path().join(format!("{devices}-{precision}"));
        let split = run_ok(&strs(&mlp(
            "4",
            &[
                "--devices",
                devices,
                "--precision",
                precision,
                "--save-params",
                dir.to_str().unwrap(),
            ],
        )));
        let parts = devices.split(',').count();
        let line = start_line(&split);
        assert_eq!(line.matches("cpu (modules").count(), parts, "{line}");
        if precision == "fp32" {
            assert_eq!(split.losses(), reference.losses(), "{devices}");
            assert_same_params(&one, &dir, devices);
        } else {
            let bf16 = run_ok(&strs(&mlp("4", &["--precision", "bf16"])));
            assert_eq!(split.losses(), bf16.losses(), "{devices} bf16");
        }
    }
}

#[test]
fn the_stage_configs_device_map_places_a_pipeline_stage_and_replicas_reduce_across_parts() {
    let tmp = tempfile::tempdir().unwrap();
    // Stage 0 (modules 0..3) over rank 0's two devices as the map says, stage 1 on one.
    let pipeline = tmp.path().join("pipeline.json");
    std::fs::write(
        &pipeline,
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]},
            "module_to_device_map": [0,1,1,0,0,0]}"#,
    )
    .unwrap();
    let plain = tmp.path().join("plain.json");
    std::fs::write(
        &plain,
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    let ok = |runs: Vec<Run>| -> Vec<Run> {
        for r in &runs {
            assert!(r.output.status.success(), "{}", r.stderr());
        }
        runs
    };
    let schedule = ["--schedule", "1f1b", "--microbatches", "4"];
    let reference = ok(run_ranks(
        2,
        &strs(&mlp(
            "3",
            &[&schedule[..], &["--stage-config", plain.to_str().unwrap()]].concat(),
        )),
        LIMIT,
    ));
    // Every rank gets the same arguments: rank 1's stage maps to one device, so it gives one.
    let port = crate::util::free_port().to_string();
    let args = |rank: &str, devices: &[&str]| -> Vec<String> {
        let mut a = mlp(
            "3",
            &[&schedule[..], &["--stage-config", pipeline.to_str().unwrap()]].concat(),
        );
        a.extend(
            [
                devices,
                &["--world-size", "2", "--rank", rank, "--master-port", &port][..],
            ]
            .concat()
            .iter()
            .map(|s| s.to_string()),
        );
        a
    };
    let children: Vec<_> = [
        ("0", &["--devices", "cpu,cpu"][..]),
        ("1", &["--device", "cpu"][..]),
    ]
    .into_iter()
    .map(|(rank, devices)| {
        crate::util::runtime()
            .args(args(rank, devices))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    })
    .collect();
    let runs: Vec<Run> = children
        .into_iter()
        .map(|c| {
            let output = c.wait_with_output().unwrap();
            let events = String::from_utf8_lossy(&output.stdout)
                .lines()
                .filter_map(Event::parse_line)
                .collect();
            Run { output, events }
        })
        .collect();
    let runs = ok(runs);
    let stderr0 = runs[0].stderr();
    assert!(
        stderr0.contains("cpu (modules 0..1), cpu (modules 1..3)"),
        "the map's placement: {stderr0}"
    );
    let losses = runs[1].losses();
    assert_eq!(losses, reference[1].losses(), "the pipeline with a split stage");

    // Data parallelism across ranks whose stage spans two devices: the all-reduce covers
    // every part's gradients.
    let dp = ok(run_ranks(2, &strs(&mlp("3", &["--devices", "cpu,cpu"])), LIMIT));
    let dp_reference = ok(run_ranks(2, &strs(&mlp("3", &[])), LIMIT));
    assert_eq!(
        dp[0].losses(),
        dp_reference[0].losses(),
        "replicas over two devices each"
    );
}

#[test]
fn a_checkpoint_of_a_split_stage_resumes_exactly_and_on_another_split() {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, resumed, ckpt) = (
        tmp.path().join("whole"),
        tmp.path().join("resumed"),
        tmp.path().join("ckpt"),
    );
    let (w, r, c) = (
        whole.to_str().unwrap(),
        resumed.to_str().unwrap(),
        ckpt.to_str().unwrap(),
    );
    let never_stopped = run_ok(&strs(&mlp("6", &["--save-params", w]))).losses();
    // Three iterations over two devices, then three more over three: a checkpoint holds
    // parameters by name, not by device.
    let first = run_ok(&strs(&mlp("3", &["--devices", "cpu,cpu", "--checkpoint-dir", c])));
    assert_eq!(first.losses(), never_stopped[..3]);
    let second = run_ok(&strs(&mlp(
        "6",
        &[
            "--devices",
            "cpu,cpu,cpu",
            "--checkpoint-dir",
            c,
            "--resume",
            "--save-params",
            r,
        ],
    )));
    assert_eq!(second.losses(), never_stopped[3..]);
    assert_same_params(&whole, &resumed, "resumed over another split");
}

#[test]
fn placements_that_cannot_work_are_refused_with_what_to_change() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("stages.json");
    std::fs::write(
        &config,
        r#"{"module_to_stage_map": [0,0,0,0,0,0], "stage_to_rank_map": {"0": [0]},
            "module_to_device_map": [0,0,1,1,2,2]}"#,
    )
    .unwrap();
    let s = config.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--stage-config", s, "--devices", "cpu,cpu"],
            "puts stage 0 on 3 device(s), but this rank has 2",
        ),
        (&["--devices", "cpu,cuda:0"], "mixes the CPU and GPUs"),
        (&["--devices", "cuda:0,cuda:0"], "names cuda:0 twice"),
        (
            &["--devices", "cpu,cpu", "--overlap-reduce", "on"],
            "--overlap-reduce off",
        ),
        (
            &["--devices", "cpu,cpu,cpu,cpu,cpu,cpu,cpu"],
            "fewer than the 7 devices",
        ),
    ];
    for (extra, expected) in cases {
        let out = run(&strs(&mlp("1", extra)));
        assert!(!out.output.status.success(), "{extra:?}");
        assert!(out.stderr().contains(expected), "{extra:?}: {}", out.stderr());
        assert!(
            out.events.iter().all(|e| !matches!(e, Event::Iteration(_))),
            "{extra:?}"
        );
    }
}
