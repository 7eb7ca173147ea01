//! `driver sweep` and `driver results` end to end on the process backend: a failing point that
//! does not stop the sweep, an interrupted sweep resumed, and a bad grid refused before anything
//! runs. (A 4-point sweep of the real runtime on the local engine is in `docker_runtime`.)

use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::util::*;

fn args<'a>(items: &'a [&'a str]) -> Vec<&'a OsStr> {
    items.iter().map(OsStr::new).collect()
}

/// `driver sweep -c CONFIG --output-dir RECORDS` with `extra` after.
fn sweep_args(h: &Harness, config: &Path, extra: &[&str]) -> Vec<OsString> {
    let mut all: Vec<OsString> = vec![
        "sweep".into(),
        "-c".into(),
        config.into(),
        "--output-dir".into(),
        h.records().into(),
    ];
    all.extend(extra.iter().map(OsString::from));
    all
}

fn os(args: &[OsString]) -> Vec<&OsStr> {
    args.iter().map(OsString::as_os_str).collect()
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
    // Rank 1 fails before its first iteration, so no iteration of that point completes on every
    // rank: its throughput is unknown (null), whatever the timing of rank 0's lines.
    let bad = format!("['{FAKE_RANK}', --iterations, '3', --fail-rank, '1', --fail-at, '0']");
    let also_ok = format!("['{FAKE_RANK}', --iterations, '3']");
    let config = fake_sweep(&h, &ok, &format!("sweep:\n  command: [{ok}, {bad}, {also_ok}]\n"));
    let run = h.driver(&os(&sweep_args(&h, &config, &["-q"])), Duration::from_secs(120));
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
    // The fake rank reports a loss and accuracies: the sweep drew its curves beside throughput.
    for name in ["sweep.svg", "loss.svg", "accuracy.svg"] {
        assert!(dir.join(name).is_file(), "{name}");
    }
    assert!(!run.stderr().contains("warning: no plot"), "{}", run.stderr());
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
    // The fake rank reports 8 samples per 20 ms iteration (its defaults), exactly: 400 samples/s.
    assert_eq!(rows[0]["samples_per_sec"], 400.0, "{}", rows[0]);
    assert_eq!(rows[2]["samples_per_sec"], 400.0, "{}", rows[2]);
    assert_eq!(
        rows[1].get("samples_per_sec"),
        Some(&serde_json::Value::Null),
        "the failed point measured nothing: {}",
        rows[1]
    );
    h.assert_no_processes();
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
    // One setting four times: points that differ in a seed the fake rank never sees would be
    // refused as the same point.
    let child = h.spawn_driver(&os(&sweep_args(
        &h,
        &config,
        &["--grid", "seed=1", "--repeat", "4", "-q"],
    )));
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
    // Its experiment file moved away: the resume says where the sweep folder keeps a copy.
    let moved = config.with_extension("moved");
    std::fs::rename(&config, &moved).unwrap();
    let again = h.driver(
        &args(&["sweep", "--resume", dir.to_str().unwrap(), "--no-progress"]),
        Duration::from_secs(30),
    );
    assert_eq!(again.code(), 2, "{}", again.stderr());
    assert!(
        again.stderr().contains(&format!(
            "the sweep folder keeps it as the sweep started, in {}: copy it back to {}",
            dir.join("config.given.yml").display(),
            config.display()
        )),
        "{}",
        again.stderr()
    );
    h.assert_no_processes();
}

/// A sweep whose driver was killed outright (SIGKILL: no chance to write its index) leaves its
/// running point's record in the sweep folder; `sweep --resume` lists it among that point's
/// earlier records, beside the record of the point's new run.
#[test]
fn a_point_record_left_by_a_killed_sweep_is_kept_among_its_earlier_records() {
    let h = Harness::new("sw-killed");
    let marker = h.dir.path().join("started");
    // Hangs the first time, succeeds once the marker is there.
    let config = h.config(&format!(
        "backend: process\nmachines: [localhost]\ncommand: [sh, -c, 'test -e {0} || {{ touch {0}; exec sleep 600; }}']\n",
        marker.display()
    ));
    let mut child = h.spawn_driver(&os(&sweep_args(&h, &config, &["--grid", "seed=1", "-q"])));
    let records = h.records();
    let orphan = crate::util::experiments::wait_until(Duration::from_secs(60), || {
        let dir = std::fs::read_dir(&records).ok()?.next()?.ok()?.path();
        let record = point_records(&dir).into_iter().next()?;
        (marker.exists() && record.join("summary.json").exists()).then_some((dir, record))
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let (dir, orphan) = orphan;
    assert_eq!(
        point_statuses(&dir),
        ["running"],
        "the index as the driver left it"
    );
    let resumed = h.driver(
        &args(&["sweep", "--resume", dir.to_str().unwrap(), "--no-progress"]),
        Duration::from_secs(120),
    );
    assert_eq!(resumed.code(), 0, "{}", resumed.stderr());
    let point = &sweep_index(&dir)["points"][0];
    let name = orphan.file_name().unwrap().to_str().unwrap();
    assert_eq!(point["status"], "succeeded", "{point}");
    assert_eq!(point["earlier_records"], serde_json::json!([name]), "{point}");
    assert_ne!(point["record"], name, "{point}");
    h.assert_no_processes();
}

#[test]
fn a_bad_grid_is_refused_before_anything_runs() {
    let h = Harness::new("sw-bad");
    let config = fake_sweep(&h, &format!("['{FAKE_RANK}']"), "");
    let records = h.records();
    let cases: [(&[&str], &str); 7] = [
        (
            &["--grid", "batch_size=32,lots"],
            "invalid grid given with --grid; nothing was run\n  caused by: grid value `lots` for \
             `batch_size`: wrong type",
        ),
        // A value as typed, not as read.
        (&["--grid", "batch_size=1e3"], "grid value `1e3` for `batch_size`"),
        (&["--grid", "batch_sise=32"], "did you mean `batch_size`?"),
        (&["--grid", "schedule=gpipe"], "a schedule needs a `config_file`"),
        (&[], "no grid"),
        (
            &["--grid", "batch_size=32,32"],
            "point batch_size=32 is in the grid twice (a value given twice); drop one",
        ),
        // The ranks run `command:`: the seed never reaches them.
        (
            &["--grid", "seed=1,2,3"],
            "points seed=1 and seed=2 would run the same ranks the same way: `seed` changes nothing \
             they run (the ranks run `command:`, which the runtime's keys never reach); drop it from \
             the grid (`--repeat N` runs each point N times); nothing was run",
        ),
    ];
    for (grid, expected) in cases {
        let run = h.driver(&os(&sweep_args(&h, &config, grid)), Duration::from_secs(30));
        assert_eq!(run.code(), 2, "{grid:?}: {}", run.stderr());
        assert!(run.stderr().contains(expected), "{grid:?}: {}", run.stderr());
        assert!(
            run.stderr().contains("nothing was run") || grid.is_empty(),
            "{}",
            run.stderr()
        );
        assert!(!records.exists(), "no sweep folder for a grid that never ran");
    }
    // A value in the file's `sweep:` section is named at its line (line 1 is the harness's name).
    let config = fake_sweep(
        &h,
        &format!("['{FAKE_RANK}']"),
        "sweep:\n  batch_size: [32, lots]\n",
    );
    let run = h.driver(&os(&sweep_args(&h, &config, &[])), Duration::from_secs(30));
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(
        run.stderr().contains(&format!(
            "invalid grid at {}:6; nothing was run",
            config.display()
        )) && run.stderr().contains("grid value `lots`"),
        "{}",
        run.stderr()
    );
    assert!(!records.exists());
    h.assert_no_processes();
}

/// A point whose training request the runtime refuses stops the sweep before any point runs,
/// named with why and where its value is written: in the file's `sweep:` section, or with
/// `--grid`.
#[test]
fn a_point_the_runtime_refuses_stops_the_sweep_before_anything_runs() {
    let runtime = runtime();
    let h = Harness::new("sw-refused");
    let base = "backend: process\nmachines: [localhost]\nmodule: mlp\nlayers: 2\nhidden: 32\n\
                iterations: 2\nthreads: 1\n";
    let cases: [(String, &[&str], &str, String); 2] = [
        (
            base.to_string(),
            &["--grid", "batch_size=4,0"],
            "point batch_size=0 is invalid",
            "(`batch_size` from --grid)".to_string(),
        ),
        (
            format!("{base}sweep:\n  lr: [0.1]\n  batch_size: [4, 0]\n"),
            &[],
            "point lr=0.1 batch_size=0 is invalid",
            // Line 1 is the harness's `name:`.
            format!("(`batch_size` at {}:11)", h.dir.path().join("exp.yml").display()),
        ),
    ];
    for (text, grid, point, at) in cases {
        let config = h.config(&text);
        let mut extra = vec!["--runtime", runtime.to_str().unwrap()];
        extra.extend_from_slice(grid);
        let run = h.driver(&os(&sweep_args(&h, &config, &extra)), Duration::from_secs(60));
        assert_eq!(run.code(), 2, "{text}: {}", run.stderr());
        let stderr = run.stderr();
        assert!(
            stderr.contains(point)
                && stderr.contains("the runtime refuses its training request: ")
                && stderr.contains("--batch-size")
                && stderr.contains(&format!("{at}; nothing was run")),
            "{text}: {stderr}"
        );
        assert!(
            !h.records().exists(),
            "no sweep folder for a sweep that never ran"
        );
    }
    h.assert_no_processes();
}

/// A sweep of real runtimes with one `checkpoint_dir`: each point checkpoints into its own
/// subfolder, named as the point, under one named as the sweep's folder, so no point overwrites
/// or resumes from another's, nor a second sweep of the file from the first's (each point has
/// `resume: auto` where the file says none).
#[test]
fn each_point_of_a_sweep_checkpoints_into_its_own_folder() {
    let runtime = runtime();
    let h = Harness::new("sw-ckpt");
    let config = h.config(
        "backend: process\nmachines: [localhost]\nmodule: mlp\nlayers: 2\nhidden: 32\nbatch_size: 4\n\
         iterations: 2\nthreads: 1\ncheckpoint_dir: ckpt\nsweep:\n  lr: [0.1, 0.2]\n",
    );
    let run = h.driver(
        &os(&sweep_args(
            &h,
            &config,
            &["--runtime", runtime.to_str().unwrap(), "-q"],
        )),
        Duration::from_secs(120),
    );
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let sweep = h.sweep_dir();
    let names = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let ckpt = config.parent().unwrap().join("ckpt");
    assert_eq!(names(&ckpt), [sweep.file_name().unwrap().to_string_lossy()]);
    let folders = names(&ckpt.join(sweep.file_name().unwrap()));
    assert_eq!(folders.len(), 2, "{folders:?}");
    assert!(
        folders[0].ends_with("-p0") && folders[1].ends_with("-p1"),
        "{folders:?}"
    );
    for folder in &folders {
        assert!(
            ckpt.join(sweep.file_name().unwrap())
                .join(folder)
                .join("rank-0")
                .is_dir(),
            "{folder} holds its rank's checkpoint"
        );
    }

    // The same sweep again, into another records folder: its points train from iteration 0, in
    // folders of their own, and the first sweep's checkpoints stay.
    let again = h.dir.path().join("again");
    let run = h.driver(
        &args(&[
            "sweep",
            "--config-file",
            config.to_str().unwrap(),
            "--output-dir",
            again.to_str().unwrap(),
            "--runtime",
            runtime.to_str().unwrap(),
            "-q",
        ]),
        Duration::from_secs(120),
    );
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert_eq!(names(&ckpt).len(), 2, "{:?}", names(&ckpt));
    let second = std::fs::read_dir(&again).unwrap().next().unwrap().unwrap().path();
    for point in point_records(&second) {
        let first: serde_json::Value = serde_json::from_str(
            lines(&point.join("metrics.jsonl"))
                .iter()
                .find(|l| l.contains("\"event\":\"iteration\""))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(first["iteration"], 0, "{}: trained afresh", point.display());
    }
    h.assert_no_processes();
}

/// `driver results --plot-loss` over a sweep of real runtimes draws each point's training loss,
/// a line per point with a vertex per iteration, labelled as the point, against iterations or
/// seconds of training; `--plot-accuracy`, in the same call, each point's top-1 accuracy the same
/// way and its top-5 dashed beside it; `--smooth` draws each smoothed over its raw values;
/// `--time-to` says when each point's loss reached a target; a record without losses is refused
/// with what is missing.
#[test]
fn a_sweeps_loss_and_accuracy_curves_are_plotted_a_line_per_point() {
    let runtime = runtime();
    let h = Harness::new("sw-loss");
    let config = h.config(
        "backend: process\nmachines: [localhost]\nmodule: mlp\nlayers: 2\nhidden: 32\nbatch_size: 8\n\
         iterations: 6\nthreads: 1\nsweep:\n  lr: [0.001, 0.05]\n",
    );
    let run = h.driver(
        &os(&sweep_args(
            &h,
            &config,
            &["--runtime", runtime.to_str().unwrap(), "-q"],
        )),
        Duration::from_secs(120),
    );
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let dir = h.sweep_dir();
    // Each curve drawn solid is one polyline through its 6 iterations (a legend's sample line,
    // and a dash of a dashed curve, have 2).
    let solid_curves = |text: &str| {
        text.split("<polyline")
            .skip(1)
            .filter(|p| {
                let points = p
                    .split("points=\"")
                    .nth(1)
                    .unwrap_or("")
                    .split('"')
                    .next()
                    .unwrap();
                points.split_whitespace().count() == 6
            })
            .count()
    };
    // The sweep drew both against iterations itself.
    for (name, what) in [("loss.svg", "loss"), ("accuracy.svg", "accuracy")] {
        let text = std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(solid_curves(&text), 2, "{name}: {text}");
        assert!(
            text.contains(&format!("training {what} against iteration")),
            "{text}"
        );
    }
    for (x, flag) in [("iteration", "--curve-x"), ("seconds", "--loss-x")] {
        let svg = h.dir.path().join(format!("loss-{x}.svg"));
        let accuracy_svg = h.dir.path().join(format!("accuracy-{x}.svg"));
        let plotted = h.driver(
            &[
                "results".as_ref(),
                dir.as_os_str(),
                "--plot-loss".as_ref(),
                svg.as_os_str(),
                "--plot-accuracy".as_ref(),
                accuracy_svg.as_os_str(),
                flag.as_ref(),
                x.as_ref(),
            ],
            Duration::from_secs(30),
        );
        assert_eq!(plotted.code(), 0, "{}", plotted.stderr());
        for written in ["loss plot written to", "accuracy plot written to"] {
            assert!(plotted.stderr().contains(written), "{}", plotted.stderr());
        }
        let desc = if x == "iteration" {
            "iteration"
        } else {
            "seconds of training"
        };
        let text = std::fs::read_to_string(&svg).unwrap();
        assert_eq!(solid_curves(&text), 2, "{x}: {text}");
        for label in ["lr=0.001", "lr=0.05"] {
            assert!(text.contains(label), "{x}: no {label} in {text}");
        }
        assert!(text.contains(&format!("training loss against {desc}")), "{text}");
        // The mlp has class logits: top-1 solid, top-5 dashed, for each point.
        let text = std::fs::read_to_string(&accuracy_svg).unwrap();
        assert_eq!(solid_curves(&text), 2, "{x}: {text}");
        for label in [
            "lr=0.001 top-1",
            "lr=0.05 top-1",
            "lr=0.001 top-5",
            "lr=0.05 top-5",
        ] {
            assert!(text.contains(label), "{x}: no {label} in {text}");
        }
        assert!(
            text.contains(&format!("training accuracy against {desc}")),
            "{text}"
        );
    }
    // Smoothed: each point's line over its raw values, both through the 6 iterations.
    let smoothed_svg = h.dir.path().join("loss-smoothed.svg");
    let smoothed = |weight: &str| {
        h.driver(
            &[
                "results".as_ref(),
                dir.as_os_str(),
                "--plot-loss".as_ref(),
                smoothed_svg.as_os_str(),
                "--smooth".as_ref(),
                weight.as_ref(),
            ],
            Duration::from_secs(30),
        )
    };
    let plotted = smoothed("0.6");
    assert_eq!(plotted.code(), 0, "{}", plotted.stderr());
    let text = std::fs::read_to_string(&smoothed_svg).unwrap();
    assert!(
        text.contains("training loss against iteration, smoothed (0.6)"),
        "{text}"
    );
    assert_eq!(solid_curves(&text), 4, "2 raw and 2 smoothed: {text}");
    let refused = smoothed("1");
    assert_eq!(refused.code(), 2, "{}", refused.stderr());
    assert!(
        refused.stderr().contains("not a smoothing weight"),
        "{}",
        refused.stderr()
    );
    // Every point's first loss is below 1000: each reached it at its first iteration.
    let timed = h.driver(
        &[
            "results".as_ref(),
            dir.as_os_str(),
            "--time-to".as_ref(),
            "loss=1000".as_ref(),
            "--sort".as_ref(),
            "time_to".as_ref(),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(timed.code(), 0, "{}", timed.stderr());
    assert!(timed.stdout().contains("to loss ≤ 1000"), "{}", timed.stdout());
    assert_eq!(
        timed.stdout().matches(" s, it 0 ").count(),
        2,
        "{}",
        timed.stdout()
    );
    // A program that prints no metrics has no loss: a sweep of it draws no curves, and says
    // nothing of them (the throughput plot it cannot draw is a warning, as it was).
    let quiet =
        h.config("backend: process\nmachines: [localhost]\nsweep:\n  command: [[/bin/true], [/bin/echo]]\n");
    let quiet_records = h.dir.path().join("quiet-records");
    let swept = h.driver(
        &[
            "sweep".as_ref(),
            "-c".as_ref(),
            quiet.as_os_str(),
            "--output-dir".as_ref(),
            quiet_records.as_os_str(),
            "-q".as_ref(),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(swept.code(), 0, "{}", swept.stderr());
    let quiet_dir = std::fs::read_dir(&quiet_records)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert!(quiet_dir.join("sweep.json").is_file(), "{}", quiet_dir.display());
    for name in ["loss.svg", "accuracy.svg"] {
        assert!(
            !quiet_dir.join(name).exists(),
            "{name} of a sweep without metrics"
        );
    }
    assert!(!swept.stderr().contains("no record has"), "{}", swept.stderr());
    let fake = h.config("backend: process\nmachines: [localhost]\ncommand: [/bin/true]\n");
    let records = h.dir.path().join("fake-records");
    let run = h.run_into(&fake, &records, &[]);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let svg = h.dir.path().join("none.svg");
    let refused = h.driver(
        &[
            "results".as_ref(),
            records.as_os_str(),
            "--plot-loss".as_ref(),
            svg.as_os_str(),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(
        refused.code(),
        5,
        "a plot that cannot be drawn: {}",
        refused.stderr()
    );
    assert!(
        refused.stderr().contains("no record has a loss to plot"),
        "{}",
        refused.stderr()
    );
    let refused = h.driver(
        &[
            "results".as_ref(),
            records.as_os_str(),
            "--plot-accuracy".as_ref(),
            svg.as_os_str(),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(refused.code(), 5, "{}", refused.stderr());
    assert!(
        refused.stderr().contains("no record has an accuracy to plot"),
        "{}",
        refused.stderr()
    );
    h.assert_no_processes();
}

/// A sweep of real runtimes with `checkpoint_dir` (and so `resume: auto`), interrupted in its first
/// point: that point's ranks checkpoint, and `driver sweep --resume` goes on from that checkpoint
/// for it while the point that never ran starts afresh.
#[test]
fn a_resumed_sweep_continues_its_interrupted_point_from_its_checkpoint() {
    let runtime = runtime();
    let h = Harness::new("sw-ckpt-resume");
    let body = "backend: process\nmachines: [localhost]\nmodule: mlp\nlayers: 2\nhidden: 32\n\
                batch_size: 4\nthreads: 1\ncheckpoint_dir: ckpt\nsweep:\n  lr: [0.01, 0.02]\n";
    let config = h.config(&format!("{body}iterations: 1000000\n"));
    let records = h.records();
    let child = h.spawn_driver(&os(&sweep_args(
        &h,
        &config,
        &["--runtime", runtime.to_str().unwrap(), "-q"],
    )));
    // Interrupt once the first point has trained a few iterations.
    let start = Instant::now();
    let metrics = loop {
        let found = std::fs::read_dir(&records)
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|sweep| std::fs::read_dir(sweep.ok()?.path()).ok())
            .and_then(|entries| {
                entries
                    .flatten()
                    .map(|e| e.path().join("metrics.jsonl"))
                    .find(|m| lines(m).iter().filter(|l| l.contains("\"iteration\"")).count() >= 3)
            });
        if let Some(m) = found {
            break m;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no three iterations");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(metrics.exists());
    interrupt(&child);
    let out = wait_with_deadline(child, Duration::from_secs(90));
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = h.sweep_dir();
    let index = sweep_index(&dir);
    let point = |i: usize| index["points"][i]["name"].as_str().unwrap().to_string();
    let ckpt = config
        .parent()
        .unwrap()
        .join("ckpt")
        .join(dir.file_name().unwrap());
    let latest = ckpt.join(point(0)).join("rank-0/latest");
    let done = serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&latest).unwrap()).unwrap()
        ["iterations_done"]
        .as_u64()
        .unwrap();
    assert!(done >= 3, "{done}");
    assert!(!ckpt.join(point(1)).exists(), "the second point never ran");

    // Two iterations past the checkpoint, for both points.
    std::fs::write(&config, format!("{body}iterations: {}\n", done + 2)).unwrap();
    let resumed = h.driver(
        &args(&[
            "sweep",
            "--resume",
            dir.to_str().unwrap(),
            "--no-progress",
            "--runtime",
            runtime.to_str().unwrap(),
        ]),
        Duration::from_secs(120),
    );
    let logs: Vec<String> = point_records(&dir)
        .iter()
        .map(|r| std::fs::read_to_string(r.join("rank-0.log")).unwrap_or_default())
        .collect();
    assert_eq!(resumed.code(), 0, "{}\n{logs:#?}", resumed.stderr());
    assert_eq!(point_statuses(&dir), ["succeeded"; 2]);
    let after = sweep_index(&dir);
    let iterations = |i: usize| -> Vec<u64> {
        let record = dir.join(after["points"][i]["record"].as_str().unwrap());
        lines(&record.join("metrics.jsonl"))
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["event"] == "iteration")
            .map(|e| e["iteration"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(
        iterations(0),
        [done, done + 1],
        "the first point went on from its checkpoint"
    );
    assert_eq!(
        iterations(1),
        (0..done + 2).collect::<Vec<_>>(),
        "the second started afresh"
    );
    // The resumed point's record says its figures cover only the iterations from its checkpoint.
    let summary = |i: usize| -> serde_json::Value {
        let record = dir.join(after["points"][i]["record"].as_str().unwrap());
        serde_json::from_str(&std::fs::read_to_string(record.join("summary.json")).unwrap()).unwrap()
    };
    assert_eq!(summary(0)["resumed_at"], done, "{}", summary(0));
    assert!(summary(1).get("resumed_at").is_none(), "{}", summary(1));
    let table = h.driver(
        &args(&["results", dir.to_str().unwrap(), "--format", "json"]),
        Duration::from_secs(30),
    );
    assert_eq!(table.code(), 0, "{}", table.stderr());
    let rows: serde_json::Value = serde_json::from_str(&table.stdout()).unwrap();
    let first = format!(
        "resumed at iteration {done} from an earlier run's checkpoint: its figures cover iterations \
         {done} to {}",
        done + 1
    );
    assert!(
        rows.as_array()
            .unwrap()
            .iter()
            .any(|r| r["note"].as_str().is_some_and(|n| n.starts_with(&first))),
        "{rows}"
    );
    h.assert_no_processes();
}
