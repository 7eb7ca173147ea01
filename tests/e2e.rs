//! End-to-end tests across both binaries: profile a model with the runtime, plan with the
//! driver, run the plan, and compare. They use the release binaries `scripts/setup.sh` builds
//! (`cargo build --release --workspace`); `STAGEHAND_BIN_DIR` points elsewhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("STAGEHAND_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release"));
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/setup.sh (or cargo build --release --workspace)",
        path.display()
    );
    path
}

fn ok(output: Output, what: &str) -> Output {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The tests time CPU ranks on a small machine: one at a time, so neither measures the other.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Compares the predicted seconds per iteration with the mean of `rank`'s iterations after two of
/// warm-up (ten of them) in `metrics` (metrics lines), prints the error and checks its range. The
/// profile and the run are timed minutes apart on two shared cores (CI machines run other jobs),
/// so contention can slow one and not the other: only a prediction off by more than 4x either way
/// (a cost model that forgot microbatches, replicas or the step) fails. How close predictions
/// come is a benchmark's question, not this test's.
fn compare(what: &str, predicted_s: f64, metrics: &str, rank: usize) {
    let times: Vec<f64> = metrics
        .lines()
        .filter_map(stagehand_contract::Event::parse_line)
        .filter_map(|e| match e {
            stagehand_contract::Event::Iteration(i) if i.rank == rank && i.iteration >= 2 => Some(i.time_s),
            _ => None,
        })
        .collect();
    assert_eq!(times.len(), 10, "{what}: {metrics}");
    let measured_s = times.iter().sum::<f64>() / times.len() as f64;
    let error = (measured_s - predicted_s) / predicted_s;
    eprintln!(
        "{what}: predicted {:.1} ms per iteration, measured {:.1} ms, error {:+.0}%",
        predicted_s * 1e3,
        measured_s * 1e3,
        error * 100.0
    );
    let ratio = measured_s / predicted_s;
    assert!(
        (0.25..4.0).contains(&ratio),
        "{what}: predicted {predicted_s:.4}s, measured {measured_s:.4}s (error {:+.0}%)",
        error * 100.0
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Profiles an MLP at the microbatch size, plans it for 2 workers with the loopback's bandwidth,
/// runs the plan as two ranks with 1F1B, and compares the predicted time per iteration with the
/// measured one.
#[test]
fn plan_then_run_on_cpu_and_compare_the_prediction() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let stages = dir.path().join("stages.json");
    let prediction = dir.path().join("prediction.json");
    let model = [
        "--model",
        "mlp",
        "--layers",
        "6",
        "--hidden",
        "1024",
        "--image-size",
        "32",
        "--threads",
        "1",
    ];
    ok(
        Command::new(bin("runtime"))
            .arg("profile")
            .args(model)
            // The profile is taken at the microbatch size: 64 samples in 4 microbatches.
            .args(["--batch-size", "16", "--repeats", "5", "--output"])
            .arg(&profile)
            .output()
            .unwrap(),
        "runtime profile",
    );
    ok(
        Command::new(bin("driver"))
            .args([
                "plan",
                "--workers",
                "2",
                "--bandwidth",
                "1.5",
                "--straight",
                "--microbatches",
                "4",
                "--profile",
            ])
            .arg(&profile)
            .arg("--output")
            .arg(&stages)
            .arg("--prediction")
            .arg(&prediction)
            .output()
            .unwrap(),
        "driver plan",
    );
    let predicted: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&prediction).unwrap()).unwrap();
    let predicted_s = predicted["flushing_time_per_minibatch_s"].as_f64().unwrap();

    let port = free_port().to_string();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(bin("runtime"))
                .args(model)
                .args([
                    "--batch-size",
                    "64",
                    "--iterations",
                    "12",
                    "--warmup",
                    "2",
                    "--lr",
                    "0.01",
                ])
                .args([
                    "--schedule",
                    "1f1b",
                    "--microbatches",
                    "4",
                    "--world-size",
                    "2",
                    "--master-port",
                    &port,
                ])
                .args(["--rank", &rank.to_string(), "--stage-config"])
                .arg(&stages)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| ok(c.wait_with_output().unwrap(), "a planned rank"))
        .collect();
    let last = String::from_utf8(outputs[1].stdout.clone()).unwrap();
    compare("plan vs run", predicted_s, &last, 1);
}

/// The same comparison through `config_file: auto`: the driver profiles on the first machine,
/// plans, runs 1F1B and records the prediction beside the measurement.
#[test]
fn an_auto_planned_experiment_records_its_prediction_and_meets_it() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("auto.yml");
    std::fs::write(
        &config,
        "name: mlp_auto\nbackend: process\nmachines: [localhost, localhost]\n\
         module: mlp\nlayers: 6\nhidden: 1024\nimage_size: 32\nconfig_file: auto\n\
         batch_size: 64\nmicrobatches: 4\nschedule: 1f1b\niterations: 12\nthreads: 1\n\
         planner: {intra_host_gbps: 1.5, straight: true}\n",
    )
    .unwrap();
    let records = dir.path().join("records");
    ok(
        Command::new(bin("driver"))
            .arg("--config-file")
            .arg(&config)
            .arg("--runtime")
            .arg(bin("runtime"))
            .arg("--output-dir")
            .arg(&records)
            .output()
            .unwrap(),
        "driver with config_file: auto",
    );
    let record = std::fs::read_dir(&records)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(record.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["plan"]["replicas"], serde_json::json!([1, 1]));
    let predicted_s = summary["plan"]["predicted_time_per_iteration_s"]
        .as_f64()
        .unwrap();

    let metrics = std::fs::read_to_string(record.join("metrics.jsonl")).unwrap();
    compare("config_file auto", predicted_s, &metrics, 1);
}
