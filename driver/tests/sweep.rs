//! `driver sweep` and `driver results` end to end: the real runtime on the local engine over a
//! 4-point grid, a failing point that does not stop the sweep, an interrupted sweep resumed, and
//! a bad grid refused before anything runs.

use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::util::*;

fn args<'a>(items: &'a [&'a str]) -> Vec<&'a OsStr> {
    items.iter().map(OsStr::new).collect()
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

/// A process-backend sweep of the fake rank.
fn fake_sweep(h: &Harness, command: &str, sweep: &str) -> std::path::PathBuf {
    h.config(&format!(
        "backend: process\nmachines: [localhost, localhost]\ncommand: {command}\n{sweep}"
    ))
}

#[test]
fn a_failed_point_is_recorded_the_sweep_goes_on_and_the_table_shows_it() {
    let h = Harness::new("sw-fail");
    let ok = format!("['{FAKE_RANK}', --iterations, '2']");
    let bad = format!("['{FAKE_RANK}', --iterations, '3', --fail-rank, '1', --fail-at, '1']");
    let config = fake_sweep(&h, &ok, &format!("sweep:\n  command: [{ok}, {bad}, {ok}]\n"));
    let records = h.records();
    let run = h.driver(
        &args(&[
            "sweep",
            "-c",
            config.to_str().unwrap(),
            "--output-dir",
            records.to_str().unwrap(),
            "-q",
        ]),
        Duration::from_secs(120),
    );
    assert_eq!(run.code(), 1, "some point failed: {}", run.stderr());
    assert!(
        run.stderr().contains("1 of 3 point(s) failed"),
        "{}",
        run.stderr()
    );
    let dir = h.sweep_dir();
    assert_eq!(
        point_statuses(&dir),
        ["succeeded", "failed", "succeeded"],
        "the sweep went on"
    );
    assert_eq!(point_records(&dir).len(), 3, "every point has its record");
    let failed = run
        .stdout()
        .lines()
        .find(|l| l.contains("--fail-rank"))
        .unwrap_or_else(|| panic!("{}", run.stdout()))
        .to_string();
    assert!(
        failed.contains("failed") && failed.contains("rank 1 on localhost exited with code 3"),
        "{failed}"
    );

    let json = h.driver(
        &args(&["results", dir.to_str().unwrap(), "--format", "json"]),
        Duration::from_secs(30),
    );
    assert_eq!(json.code(), 0, "{}", json.stderr());
    let rows: serde_json::Value = serde_json::from_str(&json.stdout()).unwrap();
    let statuses: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["succeeded", "failed", "succeeded"]);
    assert!(rows[1]["samples_per_sec"].is_null() || rows[1]["status"] == "failed");
    h.assert_no_containers();
}

/// Waits until the index shows at least `n` points succeeded.
fn wait_for_succeeded(records: &Path, n: usize, timeout: Duration) -> std::path::PathBuf {
    let start = Instant::now();
    loop {
        if let Some(Ok(entry)) = std::fs::read_dir(records).ok().and_then(|mut d| d.next()) {
            let dir = entry.path();
            let done = std::fs::read_to_string(dir.join("sweep.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .map(|i| {
                    i["points"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|p| p["status"] == "succeeded")
                        .count()
                })
                .unwrap_or(0);
            if done >= n {
                return dir;
            }
        }
        assert!(start.elapsed() < timeout, "{n} points never succeeded");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_interrupted_sweep_resumed_runs_only_the_missing_points() {
    let h = Harness::new("sw-resume");
    let command = format!("['{FAKE_RANK}', --iterations, '4', --sleep-ms, '250']");
    let config = fake_sweep(&h, &command, "");
    let records = h.records();
    let child = h.spawn_driver(&args(&[
        "sweep",
        "-c",
        config.to_str().unwrap(),
        "--grid",
        "seed=1,2,3,4",
        "--output-dir",
        records.to_str().unwrap(),
        "-q",
    ]));
    let dir = wait_for_succeeded(&records, 2, Duration::from_secs(60));
    interrupt(&child);
    let out = wait_with_deadline(child, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("--resume"), "says how to go on: {stderr}");
    let before = sweep_index(&dir);
    let done: Vec<(usize, String)> = before["points"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["status"] == "succeeded")
        .map(|p| {
            (
                p["index"].as_u64().unwrap() as usize,
                p["record"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!((2..4).contains(&done.len()), "{before}");
    let missing = 4 - done.len();
    let records_before = point_records(&dir).len();

    let resumed = h.driver(
        &args(&["sweep", "--resume", dir.to_str().unwrap(), "--no-progress"]),
        Duration::from_secs(120),
    );
    assert_eq!(resumed.code(), 0, "{}", resumed.stderr());
    assert!(
        resumed.stderr().contains(&format!("{missing} to run")),
        "only the missing points run: {}",
        resumed.stderr()
    );
    assert_eq!(point_statuses(&dir), ["succeeded"; 4]);
    assert_eq!(
        point_records(&dir).len(),
        records_before + missing,
        "one new record per missing point"
    );
    let after = sweep_index(&dir);
    for (i, record) in &done {
        assert_eq!(
            after["points"][i]["record"],
            record.as_str(),
            "point {i} was not run again"
        );
    }
    assert_eq!(
        resumed.stdout().matches("succeeded").count(),
        4,
        "{}",
        resumed.stdout()
    );
    h.assert_no_containers();
}

#[test]
fn a_bad_grid_is_refused_before_anything_runs() {
    let h = Harness::new("sw-bad");
    let config = fake_sweep(&h, &format!("['{FAKE_RANK}']"), "");
    let records = h.records();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--grid", "batch_size=32,lots"],
            "grid value `lots` for `batch_size`: wrong type",
        ),
        (&["--grid", "batch_sise=32"], "did you mean `batch_size`?"),
        (&["--grid", "schedule=gpipe"], "a schedule needs a `config_file`"),
        (&[], "no grid"),
    ];
    for (grid, expected) in cases {
        let mut all = vec![
            "sweep",
            "-c",
            config.to_str().unwrap(),
            "--output-dir",
            records.to_str().unwrap(),
        ];
        all.extend_from_slice(grid);
        let run = h.driver(&args(&all), Duration::from_secs(30));
        assert_eq!(run.code(), 2, "{grid:?}: {}", run.stderr());
        assert!(run.stderr().contains(expected), "{grid:?}: {}", run.stderr());
        assert!(
            run.stderr().contains("nothing was run") || grid.is_empty(),
            "{}",
            run.stderr()
        );
        assert!(!records.exists(), "no sweep folder for a grid that never ran");
    }
    h.assert_no_containers();
}
