//! Every output format rendered from the checked-in fixture records
//! (`tests/fixtures/gen_records.py`), snapshot-tested; filters, sorting, grouping and baselines
//! on the same rows.

use std::path::{Path, PathBuf};

use super::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/results/experiments")
}

fn options(format: Format) -> ResultsOptions {
    ResultsOptions::plain(vec![fixtures()], format)
}

/// The output with the machine-specific fixture path replaced.
fn rendered(options: &ResultsOptions) -> String {
    render(options)
        .unwrap_or_else(|e| panic!("{}", crate::error::error_chain(&e)))
        .replace(&fixtures().display().to_string(), "<fixtures>")
}

#[test]
fn every_format_renders_every_record_failed_and_unreadable_included() {
    for (name, format) in [
        ("table", Format::Table),
        ("markdown", Format::Markdown),
        ("csv", Format::Csv),
        ("json", Format::Json),
    ] {
        let out = rendered(&options(format));
        for needle in [
            "failed",
            "not run",
            "unreadable",
            "format_version 2",
            "config.resolved.json",
        ] {
            assert!(out.contains(needle), "{name} lacks {needle:?}:\n{out}");
        }
        insta::assert_snapshot!(format!("results_{name}"), out);
    }
}

#[test]
fn filters_sort_group_and_baseline() {
    let mut o = options(Format::Table);
    o.paths = vec![fixtures().join("20261122T091000Z_mlp-sweep")];
    o.filters = vec![("schedule".into(), "gpipe".into())];
    o.sort = Some("samples_per_sec:desc".into());
    o.baseline = Some("microbatches=2".into());
    let out = rendered(&o);
    insta::assert_snapshot!("results_filtered_sorted", out);
    let rows: Vec<&str> = out.lines().filter(|l| l.contains("gpipe")).collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(
        rows[0].contains("microbatches=4") && rows[0].contains("1.25x"),
        "{out}"
    );
    assert!(!out.contains("1f1b"), "{out}");

    let mut o = options(Format::Markdown);
    o.paths = vec![fixtures().join("20261122T091000Z_mlp-sweep")];
    o.group_by = Some("schedule".into());
    let out = rendered(&o);
    assert!(
        out.contains("schedule = gpipe") && out.contains("schedule = 1f1b"),
        "{out}"
    );
    insta::assert_snapshot!("results_grouped", out);
}

/// A key filtered on twice keeps the rows with either value (keys still all apply), and the
/// default baseline is the first row with a throughput in the records' order, however sorted.
#[test]
fn filters_on_one_key_widen_and_sorting_keeps_the_baseline() {
    let rows = |o: &ResultsOptions| -> Vec<read::Row> {
        select(o).unwrap().into_iter().flat_map(|(_, r)| r).collect()
    };
    let mut o = options(Format::Table);
    let all = rows(&o);
    let with = |s: &str| all.iter().filter(|r| r.schedule.as_deref() == Some(s)).count();
    assert!(with("gpipe") > 0 && with("1f1b") > 0, "the fixtures have both");
    o.filters = vec![
        ("schedule".into(), "gpipe".into()),
        ("schedule".into(), "1f1b".into()),
    ];
    assert_eq!(rows(&o).len(), with("gpipe") + with("1f1b"));
    o.filters.push(("microbatches".into(), "4".into()));
    let both = rows(&o);
    assert!(!both.is_empty() && both.len() < with("gpipe") + with("1f1b"));
    assert!(both.iter().all(|r| r.microbatches == Some(4)));

    let measured: Vec<&read::Row> = all.iter().filter(|r| r.throughput.is_some()).collect();
    assert!(measured.len() >= 2, "the fixtures have rows to sort");
    let base = measured[0].throughput.as_ref().unwrap().samples_per_sec_mean;
    for spec in ["samples_per_sec:desc", "samples_per_sec"] {
        let mut o = options(Format::Table);
        o.sort = Some(spec.into());
        let sorted = rows(&o);
        assert_eq!(sorted.len(), all.len());
        for row in sorted.iter().filter(|r| r.throughput.is_some()) {
            let t = row.throughput.as_ref().unwrap().samples_per_sec_mean;
            assert_eq!(row.speedup, Some(t / base), "{spec}: {}", row.name);
        }
    }
}

#[test]
fn unknown_keys_and_baselines_are_errors() {
    let mut o = options(Format::Table);
    o.sort = Some("throughputt".into());
    let e = render(&o).unwrap_err();
    assert!(matches!(e, ResultsError::UnknownKey { .. }), "{e}");
    insta::assert_snapshot!("results_unknown_key", e.to_string());
    let mut o = options(Format::Table);
    o.baseline = Some("schedule=zigzag".into());
    assert!(matches!(render(&o), Err(ResultsError::Baseline { .. })));
    let mut o = options(Format::Table);
    o.paths = vec![fixtures().join("missing")];
    assert_eq!(
        render(&o).unwrap_err().exit_code(),
        crate::exit_codes::INVALID_CONFIG
    );
    // A sort direction that is neither asc nor desc is named as such, not as an unknown key.
    for spec in ["batch:up", "batch:desc:x"] {
        let mut o = options(Format::Table);
        o.sort = Some(spec.into());
        let e = render(&o).unwrap_err();
        assert!(matches!(e, ResultsError::SortDirection { .. }), "{spec}: {e}");
        assert!(e.to_string().contains("give KEY, KEY:asc or KEY:desc"), "{e}");
    }
    // The time to a target, without the target, has nothing to sort or group by.
    for (sort, group) in [
        (Some("time_to"), None),
        (Some("time_to:desc"), None),
        (None, Some("time_to")),
    ] {
        let mut o = options(Format::Table);
        o.sort = sort.map(Into::into);
        o.group_by = group.map(Into::into);
        let e = render(&o).unwrap_err();
        assert!(matches!(e, ResultsError::TimeToWithoutTarget { .. }), "{e}");
        assert!(e.to_string().contains("add --time-to METRIC=TARGET"), "{e}");
        assert_eq!(e.exit_code(), crate::exit_codes::INVALID_CONFIG);
    }
    // A plot's x axis is a key the rows know.
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(Format::Table);
    o.plot = Some(dir.path().join("p.svg"));
    o.plot_x = Some("batch_sise".into());
    assert!(matches!(run(&o), Err(ResultsError::UnknownKey { .. })));
    assert!(!dir.path().join("p.svg").exists());
    // Plots are SVG: a file named as another format is refused before anything is written.
    for (flag, set) in [
        (
            "--plot",
            (|o, p| o.plot = Some(p)) as fn(&mut ResultsOptions, PathBuf),
        ),
        ("--plot-loss", |o, p| o.plot_loss = Some(p)),
        ("--plot-accuracy", |o, p| o.plot_accuracy = Some(p)),
    ] {
        let mut o = options(Format::Table);
        set(&mut o, dir.path().join("p.png"));
        let e = run(&o).unwrap_err();
        assert!(
            e.to_string().starts_with(&format!("{flag} "))
                && e.to_string().contains("give a file ending in .svg"),
            "{e}"
        );
        assert_eq!(e.exit_code(), crate::exit_codes::INVALID_CONFIG);
        assert!(!dir.path().join("p.png").exists());
    }
    let mut o = options(Format::Table);
    o.plot = Some(dir.path().join("P.SVG"));
    assert!(!matches!(run(&o), Err(ResultsError::NotSvg { .. })), "any case");
    // A plot that cannot be written says why in the system's words alone.
    let mut o = options(Format::Table);
    let nowhere = dir.path().join("no-such-folder/p.svg");
    o.plot = Some(nowhere.clone());
    let e = crate::error::error_chain(&run(&o).unwrap_err());
    assert!(
        e.ends_with(&format!(
            "cannot draw {}: No such file or directory (os error 2)",
            nowhere.display()
        )),
        "{e}"
    );
}

/// Runs compare by how far they trained as by how fast: `--sort` takes the final loss and
/// accuracies (under their record names too), numbers as numbers, runs without one last.
#[test]
fn runs_sort_by_their_final_loss_and_accuracy() {
    let order = |sort: &str| {
        let mut o = options(Format::Csv);
        o.sort = Some(sort.into());
        rendered(&o)
            .lines()
            .skip(1)
            .map(|line| line.split(',').nth(2).unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let by_accuracy = order("accuracy:desc");
    assert_eq!(
        by_accuracy[..3],
        ["mlp-p1", "mlp-p0", "vgg16-2pipe"],
        "{by_accuracy:?}"
    );
    assert_eq!(order("final_accuracy:desc")[..3], by_accuracy[..3]);
    // The sweep's two runs rank the other way round by top-5.
    let by_top5 = order("top5:desc");
    assert_eq!(by_top5[..3], ["mlp-p0", "mlp-p1", "vgg16-2pipe"], "{by_top5:?}");
    assert_eq!(order("final_accuracy_top5:desc")[..3], by_top5[..3]);
    let by_loss = order("final_loss");
    assert_eq!(
        by_loss[..4],
        ["mlp-p1", "mlp-p0", "mlp-auto", "vgg16-2pipe"],
        "the record without an accuracy still has its loss: {by_loss:?}"
    );
}

#[test]
fn a_filter_on_an_experiment_key_not_in_the_table_works() {
    let mut o = options(Format::Csv);
    o.filters = vec![("config_file".into(), "vgg16_2pipe.json".into())];
    let out = rendered(&o);
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(out.contains("vgg16-2pipe"), "{out}");
}

#[test]
fn plots_are_svg_drawn_by_plotters() {
    let tmp = tempfile::tempdir().unwrap();
    let sweep = tmp.path().join("sweep.svg");
    plot_sweep(&fixtures().join("20261122T091000Z_mlp-sweep"), &sweep).unwrap();
    let text = std::fs::read_to_string(&sweep).unwrap();
    assert!(text.starts_with("<svg"), "{text}");
    assert!(text.contains("throughput against schedule"), "{text}");
    assert!(
        text.contains("microbatches=4"),
        "a line per value of the other key: {text}"
    );
    assert!(text.contains("<polyline"), "{text}");

    let mut o = options(Format::Table);
    o.paths = vec![fixtures().join("20261122T090000Z_vgg16-2pipe")];
    let stages = tmp.path().join("stages.svg");
    o.plot = Some(stages.clone());
    run(&o).unwrap();
    let text = std::fs::read_to_string(&stages).unwrap();
    for needle in ["stage 0", "stage 1", "compute", "communication", "idle"] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    let times = plot::stage_times(&fixtures().join("20261122T090000Z_vgg16-2pipe")).unwrap();
    assert_eq!(times.len(), 2);
    assert!(
        (times[1].1[2] - 0.06).abs() < 1e-9,
        "stage 1 idles 60 ms: {times:?}"
    );
}

#[test]
fn a_record_of_another_format_version_says_so() {
    let reason =
        crate::records::summary::read_summary(&fixtures().join("20261122T092000Z_future")).unwrap_err();
    assert!(
        reason.contains("format_version 2, written by a newer driver"),
        "{reason}"
    );
    assert!(!record_succeeded(&fixtures().join("20261122T092000Z_future")));
    assert!(record_succeeded(&fixtures().join("20261122T090000Z_vgg16-2pipe")));
}

#[test]
fn the_model_cell_says_the_arithmetic_when_it_is_not_plain_fp32() {
    let mut row = read::Row::empty(Path::new("r"), "r".into(), read::RowStatus::Succeeded, None);
    assert_eq!(row.model_cell(), None);
    row.model = Some("resnet50".into());
    assert_eq!(row.model_cell().as_deref(), Some("resnet50"));
    row.experiment.insert("precision".into(), "fp32".into());
    assert_eq!(row.model_cell().as_deref(), Some("resnet50"));
    row.experiment.insert("precision".into(), "bf16".into());
    row.experiment.insert("channels_last".into(), true.into());
    assert_eq!(
        row.model_cell().as_deref(),
        Some("resnet50 (bf16, channels_last)")
    );
    row.experiment.insert("precision".into(), serde_json::Value::Null);
    assert_eq!(row.model_cell().as_deref(), Some("resnet50 (channels_last)"));
}

/// A record's note says why the run stopped, with what the exit code means where it says more
/// than a number: a command not found (an image without /bin/sh), the ranks never started.
#[test]
fn a_failures_note_says_what_its_exit_code_means() {
    use crate::events::StopCause;
    let rank_failed = |code| StopCause::RankFailed {
        rank: 1,
        host: "node1".into(),
        exit_code: Some(code),
        out_of_memory: false,
        silent_peer: None,
    };
    assert_eq!(
        read::cause_text(&rank_failed(1)),
        "rank 1 on node1 exited with code 1"
    );
    assert_eq!(
        read::cause_text(&rank_failed(127)),
        "rank 1 on node1 exited with code 127: a command was not found (a container needs /bin/sh, \
         with which the driver starts each rank, and the rank's program on its PATH)"
    );
    assert!(read::cause_text(&rank_failed(126)).ends_with(
        ": a command was found but could not run (not executable, or built for another platform)"
    ));
    assert_eq!(
        read::cause_text(&StopCause::LaunchFailed {
            reason: "the container for the ranks on node1 exited with code 127".into()
        }),
        "the ranks could not start: the container for the ranks on node1 exited with code 127"
    );
}

/// A record's loss curve: each iteration's losses from the ranks that report one (the first stage
/// reports none), averaged over data-parallel replicas, a restarted run's later report of an
/// iteration replacing the earlier, and training seconds added up over the iterations.
#[test]
fn a_loss_curve_averages_replicas_and_takes_each_iterations_last_report() {
    let dir = tempfile::tempdir().unwrap();
    let line = |iteration: u64, rank: usize, loss: Option<f64>, time: f64| {
        let loss = loss.map_or("null".to_string(), |l| l.to_string());
        format!(
            r#"{{"event":"iteration","iteration":{iteration},"rank":{rank},"stage":{},"loss":{loss},"samples":8,"time_s":{time},"samples_per_sec":1.0,"compute_s":0.0,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null}}"#,
            usize::from(rank > 0)
        )
    };
    let lines = [
        line(0, 0, None, 0.5),
        line(0, 1, Some(2.0), 0.5),
        line(0, 2, Some(4.0), 1.5),
        line(1, 1, Some(1.0), 1.0),
        line(1, 2, Some(2.0), 1.0),
        line(2, 1, Some(9.0), 1.0),
        // Started again from the checkpoint after iteration 1: iteration 2 anew.
        line(2, 1, Some(0.5), 2.0),
        line(2, 2, Some(1.5), 2.0),
        "not a metrics line".to_string(),
    ];
    std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n")).unwrap();
    let curve = curves::curve(dir.path(), curves::Metric::Loss).unwrap();
    let got: Vec<(u64, f64, f64)> = curve.iter().map(|p| (p.iteration, p.seconds, p.value)).collect();
    assert_eq!(got, [(0, 1.0, 3.0), (1, 2.0, 1.5), (2, 4.0, 1.0)]);
    assert_eq!(
        curves::curve(dir.path(), curves::Metric::Accuracy),
        None,
        "lines without an accuracy"
    );
    std::fs::write(dir.path().join("metrics.jsonl"), line(0, 0, None, 0.5)).unwrap();
    assert_eq!(
        curves::curve(dir.path(), curves::Metric::Loss),
        None,
        "no loss, no curve"
    );
}

/// A record folder `name` in `dir` whose iterations reported `losses`, one each, as its row.
fn loss_record(dir: &Path, name: &str, losses: &[f64]) -> read::Row {
    let path = dir.join(name);
    std::fs::create_dir(&path).unwrap();
    let lines: Vec<String> = losses
        .iter()
        .enumerate()
        .map(|(i, loss)| {
            format!(
                r#"{{"event":"iteration","iteration":{i},"rank":0,"stage":0,"loss":{loss},"samples":8,"time_s":0.5,"samples_per_sec":16.0,"compute_s":0.5,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null}}"#
            )
        })
        .collect();
    std::fs::write(path.join("metrics.jsonl"), lines.join("\n")).unwrap();
    read::Row::empty(&path, "mlp".into(), read::RowStatus::Succeeded, None)
}

/// Losses that span orders of magnitude (a run that diverged beside one that converged) go on a
/// log scale with readable labels; close ones on a plain scale. Rows whose labels repeat are told
/// apart by their record folders.
#[test]
fn a_loss_plot_goes_to_a_log_scale_only_when_losses_span_orders_of_magnitude() {
    let dir = tempfile::tempdir().unwrap();
    let record = |name: &str, losses: &[f64]| loss_record(dir.path(), name, losses);
    let calm = record("20261127T000000Z_mlp", &[2.3, 1.9, 1.2]);
    let wild = record("20261127T000100Z_mlp", &[2.3, 40.0, 3.0e6]);
    let svg = dir.path().join("loss.svg");
    plot::losses(
        &[calm.clone(), wild],
        plot::CurveX::Iteration,
        curves::Smoothing::NONE,
        &svg,
    )
    .unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("loss (log scale)"), "{text}");
    assert!(text.contains("3.00e6") || text.contains("1.00e6"), "{text}");
    for folder in ["mlp (20261127T000000Z_mlp)", "mlp (20261127T000100Z_mlp)"] {
        assert!(text.contains(folder), "{folder}: {text}");
    }
    plot::losses(&[calm], plot::CurveX::Seconds, curves::Smoothing::NONE, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(!text.contains("log scale") && text.contains("\nloss\n"), "{text}");
    assert!(text.contains("seconds of training"), "{text}");
}

#[test]
fn smoothing_is_a_debiased_moving_average_that_starts_at_the_first_value() {
    let half = curves::Smoothing::new(0.5).unwrap();
    // (0.5 * 0 + 0.5 * 2) / (1 - 0.5), then (0.5 * 1 + 0.5 * 4) / (1 - 0.25).
    assert_eq!(half.apply(&[2.0, 4.0]), [2.0, 2.5 / 0.75]);
    assert_eq!(curves::Smoothing::NONE.apply(&[3.0, 1.0, 2.0]), [3.0, 1.0, 2.0]);
    // A constant stays put: each of 50 steps rounds once or twice, so within 50 * 2 ulps.
    let steady = curves::Smoothing::new(0.9).unwrap().apply(&[0.7; 50]);
    for v in steady {
        assert!((v - 0.7).abs() <= 100.0 * f64::EPSILON * 0.7, "{v}");
    }
    assert!(curves::Smoothing::new(1.0).is_err() && curves::Smoothing::new(-0.5).is_err());
    assert!(curves::Smoothing::new(f64::NAN).is_err());
}

/// The `points` of every polyline in `svg` whose attributes contain `with`.
fn polylines(svg: &str, with: &str) -> Vec<String> {
    svg.split("<polyline")
        .skip(1)
        .filter(|p| p.split("/>").next().unwrap().contains(with))
        .filter_map(|p| Some(p.split("points=\"").nth(1)?.split('"').next()?.to_string()))
        .collect()
}

/// The spread of a polyline's y coordinates, in pixels.
fn y_spread(points: &str) -> f64 {
    let ys: Vec<f64> = points
        .split_whitespace()
        .map(|xy| xy.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    ys.iter().cloned().fold(f64::MIN, f64::max) - ys.iter().cloned().fold(f64::MAX, f64::min)
}

#[test]
fn a_smoothed_curve_plot_draws_the_smoothed_line_over_its_raw_values_drawn_faint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("20261127T000000Z_mlp");
    std::fs::create_dir(&path).unwrap();
    let lines: Vec<String> = [4.0, 1.0, 3.0, 0.5, 2.0, 0.25]
        .iter()
        .enumerate()
        .map(|(i, loss)| {
            let top1 = 0.125 * (i % 3) as f64;
            format!(
                r#"{{"event":"iteration","iteration":{i},"rank":0,"stage":0,"loss":{loss},"accuracy":{top1},"samples":8,"time_s":0.5,"samples_per_sec":16.0,"compute_s":0.5,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null}}"#
            )
        })
        .collect();
    std::fs::write(path.join("metrics.jsonl"), lines.join("\n")).unwrap();
    let row = read::Row::empty(&path, "mlp".into(), read::RowStatus::Succeeded, None);
    let svg = dir.path().join("plot.svg");
    let six_points = |p: &String| p.split_whitespace().count() == 6;
    type Draw = fn(&[read::Row], plot::CurveX, curves::Smoothing, &Path) -> Result<(), plot::PlotError>;
    for (draw, what) in [(plot::losses as Draw, "loss"), (plot::accuracies, "accuracy")] {
        draw(
            std::slice::from_ref(&row),
            plot::CurveX::Iteration,
            curves::Smoothing::NONE,
            &svg,
        )
        .unwrap();
        let raw_text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            !raw_text.contains("smoothed") && !raw_text.contains("opacity=\"0.25\""),
            "{raw_text}"
        );
        let raw: Vec<String> = polylines(&raw_text, "").into_iter().filter(six_points).collect();
        assert_eq!(
            raw.len(),
            1,
            "{what}: one line through the 6 iterations: {raw_text}"
        );

        let smoothing = curves::Smoothing::new(0.6).unwrap();
        draw(
            std::slice::from_ref(&row),
            plot::CurveX::Iteration,
            smoothing,
            &svg,
        )
        .unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            text.contains(&format!("training {what} against iteration, smoothed (0.6)")),
            "{text}"
        );
        // The raw values, as the unsmoothed plot drew them (the y axis spans them either way),
        // now faint; over them the smoothed line, flatter.
        assert_eq!(polylines(&text, "opacity=\"0.25\""), raw, "{what}: {text}");
        let solid: Vec<String> = polylines(&text, "stroke-width=\"2\"")
            .into_iter()
            .filter(six_points)
            .collect();
        assert_eq!(solid.len(), 1, "{what}: {text}");
        assert!(
            y_spread(&solid[0]) < y_spread(&raw[0]),
            "{what}: smoothed {} against raw {}",
            solid[0],
            raw[0]
        );
        // Both start at the first value: the average is debiased.
        let first = |points: &str| points.split_whitespace().next().unwrap().to_string();
        assert_eq!(first(&solid[0]), first(&raw[0]), "{what}");
    }
}

/// A record's metrics.jsonl whose last-stage lines carry these top-1 and top-5 accuracies, an
/// iteration each, with a loss of 1.
fn accuracy_record(dir: &Path, name: &str, accuracies: &[(f64, Option<f64>)]) -> read::Row {
    let path = dir.join(name);
    std::fs::create_dir(&path).unwrap();
    let lines: Vec<String> = accuracies
        .iter()
        .enumerate()
        .map(|(i, (top1, top5))| {
            let top5 = top5.map_or("null".to_string(), |a| a.to_string());
            format!(
                r#"{{"event":"iteration","iteration":{i},"rank":0,"stage":0,"loss":1.0,"accuracy":{top1},"accuracy_top5":{top5},"samples":8,"time_s":0.5,"samples_per_sec":16.0,"compute_s":0.5,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null}}"#
            )
        })
        .collect();
    std::fs::write(path.join("metrics.jsonl"), lines.join("\n")).unwrap();
    read::Row::empty(&path, "mlp".into(), read::RowStatus::Succeeded, None)
}

/// The accuracy plot: top-1 a solid line per record through every iteration; top-5 a dashed
/// line in the same colour where the record reports it (a transformer's does not), each labelled
/// as its row and which accuracy it is; a percent scale; records with no accuracy (a runtime's
/// from before it) are left out, and with none at all the plot is refused.
#[test]
fn an_accuracy_plot_draws_top1_solid_and_top5_dashed_where_reported() {
    let dir = tempfile::tempdir().unwrap();
    let image = accuracy_record(
        dir.path(),
        "20261127T000000Z_mlp",
        &[
            (0.125, Some(0.5)),
            (0.5, Some(0.875)),
            (0.75, Some(1.0)),
            (0.625, Some(0.875)),
            (0.875, Some(1.0)),
        ],
    );
    let tokens = accuracy_record(
        dir.path(),
        "20261127T000100Z_mlp",
        &[(0.0, None), (0.25, None), (0.5, None), (0.25, None), (0.5, None)],
    );
    let old = old_row(dir.path());
    std::fs::create_dir(&old.dir).unwrap();
    std::fs::write(
        old.dir.join("metrics.jsonl"),
        r#"{"event":"iteration","iteration":0,"rank":0,"stage":0,"loss":2.0,"samples":8,"time_s":0.5,"samples_per_sec":16.0,"compute_s":0.5,"comm_wait_s":0.0,"idle_s":0.0,"peak_mem_bytes":null}"#,
    )
    .unwrap();

    let top5 = curves::curve(image.dir.as_path(), curves::Metric::AccuracyTop5).unwrap();
    assert_eq!(
        top5.iter().map(|p| p.value).collect::<Vec<_>>(),
        [0.5, 0.875, 1.0, 0.875, 1.0]
    );
    assert_eq!(curves::curve(&tokens.dir, curves::Metric::AccuracyTop5), None);

    let svg = dir.path().join("accuracy.svg");
    plot::accuracies(
        &[image, tokens, old],
        plot::CurveX::Seconds,
        curves::Smoothing::NONE,
        &svg,
    )
    .unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.contains("training accuracy against seconds of training"),
        "{text}"
    );
    assert!(
        text.contains("100%") && text.contains("50%"),
        "a percent scale: {text}"
    );
    for label in [
        "mlp (20261127T000000Z_mlp) top-1",
        "mlp (20261127T000000Z_mlp) top-5",
        "\nmlp (20261127T000100Z_mlp)\n",
    ] {
        assert!(text.contains(label), "{label}: {text}");
    }
    assert!(!text.contains("20261127T000100Z_mlp) top-"), "{text}");
    assert!(
        !text.contains("\nold\n"),
        "a record without accuracies is left out: {text}"
    );
    // Solid lines are one polyline through every iteration: the two top-1 curves. The dashed
    // top-5 is drawn in dashes of two points each (three where one turns a corner).
    let polylines: Vec<usize> = text
        .split("<polyline")
        .skip(1)
        .map(|p| {
            let points = p
                .split("points=\"")
                .nth(1)
                .unwrap_or("")
                .split('"')
                .next()
                .unwrap();
            points.split_whitespace().count()
        })
        .collect();
    assert_eq!(polylines.iter().filter(|&&n| n == 5).count(), 2, "{polylines:?}");
    assert!(
        polylines.iter().filter(|&&n| n == 2).count() > 4,
        "top-5's dashes and the legend's samples: {polylines:?}"
    );

    let none = plot::accuracies(
        &[old_row(dir.path())],
        plot::CurveX::Iteration,
        curves::Smoothing::NONE,
        &svg,
    );
    assert!(matches!(none, Err(plot::PlotError::NoAccuracy)), "{none:?}");
}

/// The row of a record whose runtime reported no accuracy.
fn old_row(dir: &Path) -> read::Row {
    read::Row::empty(
        &dir.join("20261127T000200Z_mlp"),
        "old".into(),
        read::RowStatus::Succeeded,
        None,
    )
}

/// A copy of the vgg16 fixture record as `dir/name` whose last stage reported these losses and
/// top-1 accuracies (and no top-5), an iteration of 0.5 s each.
fn trained_record(dir: &Path, name: &str, points: &[(f64, f64)]) -> PathBuf {
    let from = fixtures().join("20261122T090000Z_vgg16-2pipe");
    let to = dir.join(name);
    std::fs::create_dir(&to).unwrap();
    for file in ["summary.json", "config.resolved.json", "config.given.yml"] {
        std::fs::copy(from.join(file), to.join(file)).unwrap();
    }
    let lines: Vec<String> = points
        .iter()
        .enumerate()
        .map(|(i, (loss, top1))| {
            format!(
                r#"{{"event":"iteration","iteration":{i},"rank":1,"stage":1,"loss":{loss},"accuracy":{top1},"samples":64,"time_s":0.5,"samples_per_sec":128.0,"compute_s":0.4,"comm_wait_s":0.05,"idle_s":0.05,"peak_mem_bytes":null}}"#
            )
        })
        .collect();
    std::fs::write(to.join("metrics.jsonl"), lines.join("\n")).unwrap();
    to
}

/// Reaches 90% top-1 at iteration 1, raw; smoothed by 0.6 only at iteration 4 (0.2, 0.669,
/// 0.812, 0.876, 0.908); a loss of 0.5 or less at iteration 3.
const LATE: [(f64, f64); 6] = [
    (2.3, 0.2),
    (1.9, 0.95),
    (1.2, 0.95),
    (0.4, 0.95),
    (0.45, 0.95),
    (0.3, 0.95),
];

#[test]
fn the_time_to_a_target_is_the_first_iteration_whose_curve_reaches_it() {
    let dir = tempfile::tempdir().unwrap();
    let late = trained_record(dir.path(), "20261129T000000Z_late", &LATE);
    let target = |t: &str| Target::parse(t).unwrap();
    let raw = Smoothing::NONE;
    let reached = |iteration, seconds| Some(curves::TimeTo::Reached { iteration, seconds });
    // Seconds of training: the iterations' 0.5 s each, up to and including the one that reached.
    assert_eq!(
        curves::time_to(&late, target("accuracy=90%"), raw),
        reached(1, 1.0)
    );
    assert_eq!(
        curves::time_to(&late, target("accuracy=0.9"), Smoothing::new(0.6).unwrap()),
        reached(4, 2.5),
        "the smoothed curve reaches it later"
    );
    assert_eq!(curves::time_to(&late, target("loss=0.5"), raw), reached(3, 2.0));
    assert_eq!(
        curves::time_to(&late, target("acc=99%"), raw),
        Some(curves::TimeTo::NotReached { iterations: 6 })
    );
    assert_eq!(
        curves::time_to(&late, target("top5=0.5"), raw),
        None,
        "no top-5 reported"
    );
}

#[test]
fn a_target_is_a_metric_and_a_figure_it_can_reach() {
    let parsed = |t: &str| Target::parse(t).map(|t| (t.metric, t.value));
    assert_eq!(parsed("accuracy=90%"), Ok((curves::Metric::Accuracy, 0.9)));
    assert_eq!(parsed("top-1=0.75"), Ok((curves::Metric::Accuracy, 0.75)));
    assert_eq!(parsed("top5=99.5%"), Ok((curves::Metric::AccuracyTop5, 0.995)));
    assert_eq!(parsed("loss=0.25"), Ok((curves::Metric::Loss, 0.25)));
    assert_eq!(
        Target::parse("accuracy=90%").unwrap().header(),
        "to accuracy ≥ 90%"
    );
    assert_eq!(Target::parse("loss=0.25").unwrap().header(), "to loss ≤ 0.25");
    // 0.29 * 100 is 28.999999999999996 in binary floating point: the header says what was typed.
    assert_eq!(Target::parse("acc=29%").unwrap().header(), "to accuracy ≥ 29%");
    assert_eq!(Target::parse("top5=0.995").unwrap().header(), "to top5 ≥ 99.5%");
    for (text, says) in [
        ("accuracy", "is not METRIC=TARGET"),
        ("speed=3", "unknown metric `speed`"),
        (
            "accuracy=90",
            "a fraction above 0 and up to 1 (0.9) or a percentage (90%)",
        ),
        ("accuracy=0%", "a fraction above 0"),
        ("loss=-1", "give a positive loss"),
        ("loss=50%", "give a positive loss"),
        (
            "loss=low",
            "`low` is not a number; give a target such as loss=0.5",
        ),
    ] {
        let error = Target::parse(text).expect_err(text);
        assert!(error.contains(says), "{text}: {error}");
    }
}

/// `--time-to` adds a column to every format, which `--sort time_to` ranks by, runs that never
/// reached the target last; without it no format changes.
#[test]
fn a_time_to_column_ranks_runs_by_when_they_reached_the_target() {
    let dir = tempfile::tempdir().unwrap();
    trained_record(dir.path(), "20261129T000000Z_late", &LATE);
    trained_record(dir.path(), "20261129T000100Z_early", &[(2.0, 0.92), (1.0, 0.96)]);
    trained_record(dir.path(), "20261129T000200Z_never", &[(2.3, 0.1), (2.2, 0.2)]);
    let request = |format| {
        let mut o = ResultsOptions::plain(vec![dir.path().to_path_buf()], format);
        o.time_to = Some(Target::parse("accuracy=90%").unwrap());
        o.sort = Some("time_to".into());
        o
    };
    let table = render(&request(Format::Table)).unwrap();
    assert!(table.contains("to accuracy ≥ 90%"), "{table}");
    let at = |cell: &str| table.find(cell).unwrap_or_else(|| panic!("no {cell}: {table}"));
    assert!(
        at("0.50 s, it 0") < at("1.00 s, it 1") && at("1.00 s, it 1") < at("not in 2 its"),
        "{table}"
    );

    let csv = render(&request(Format::Csv)).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(
        lines[0].contains(",accuracy_top5,time_to_s,time_to_iteration,time_to_reached,idle_share,"),
        "{csv}"
    );
    assert!(lines[1].contains(",0.5,0,true,"), "{csv}");
    assert!(lines[2].contains(",1,1,true,"), "{csv}");
    assert!(lines[3].contains(",,,false,"), "{csv}");

    let json: serde_json::Value = serde_json::from_str(&render(&request(Format::Json)).unwrap()).unwrap();
    assert_eq!(
        json[0]["time_to"],
        serde_json::json!({"metric": "accuracy", "target": 0.9, "reached": true, "seconds": 0.5,
                           "iteration": 0, "iterations_run": null})
    );
    assert_eq!(json[2]["time_to"]["reached"], false);
    assert_eq!(json[2]["time_to"]["iterations_run"], 2);

    let plain = ResultsOptions::plain(vec![dir.path().to_path_buf()], Format::Json);
    let json: serde_json::Value = serde_json::from_str(&render(&plain).unwrap()).unwrap();
    assert!(json[0].get("time_to").is_none(), "{json}");
    let table = render(&ResultsOptions::plain(
        vec![dir.path().to_path_buf()],
        Format::Table,
    ))
    .unwrap();
    assert!(
        !table.contains("to accuracy") && !table.contains(" its"),
        "{table}"
    );
}

/// A copy of [`trained_record`] whose summary keeps a last validation pass of these figures.
fn validated_record(dir: &Path, name: &str, loss: f64, accuracy: f64) -> PathBuf {
    let to = trained_record(dir, name, &[(2.0, 0.5), (1.0, 0.6)]);
    let path = to.join("summary.json");
    let mut summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    summary["validation"] = serde_json::json!({"iteration": 1, "loss": loss, "accuracy": accuracy,
                                               "accuracy_top5": null, "samples": 640});
    std::fs::write(&path, summary.to_string()).unwrap();
    to
}

/// The last validation pass's loss and top-1 join every format where some record has one (the
/// others show `-`, or empty cells), `--sort val_accuracy` ranks by it, and records without
/// passes change no format.
#[test]
fn validation_columns_show_each_records_last_pass() {
    let dir = tempfile::tempdir().unwrap();
    validated_record(dir.path(), "20261129T000000Z_worse", 1.25, 0.8);
    validated_record(dir.path(), "20261129T000100Z_better", 0.75, 0.9);
    trained_record(dir.path(), "20261129T000200Z_unvalidated", &[(2.0, 0.5)]);
    let request = |format| {
        let mut o = ResultsOptions::plain(vec![dir.path().to_path_buf()], format);
        o.sort = Some("val_accuracy:desc".into());
        o
    };
    let table = render(&request(Format::Table)).unwrap();
    let header = table.lines().nth(1).unwrap();
    let at = |cell: &str| header.find(cell).unwrap_or_else(|| panic!("no {cell}: {table}"));
    assert!(at("top-5") < at("val loss") && at("val loss") < at("val top-1") && at("val top-1") < at("idle"));
    // The records share their name: each row's validation cells tell them apart.
    let column = header.split('┆').position(|c| c.trim() == "val loss").unwrap();
    let cells = |line: &str| -> Vec<String> {
        line.split('┆')
            .skip(column)
            .take(2)
            .map(|c| c.trim().to_string())
            .collect()
    };
    let rows: Vec<Vec<String>> = table
        .lines()
        .filter(|l| l.contains("succeeded"))
        .map(cells)
        .collect();
    assert_eq!(
        rows,
        [["0.7500", "90.0%"], ["1.2500", "80.0%"], ["-", "-"]],
        "{table}"
    );

    let csv = render(&request(Format::Csv)).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(
        lines[0].contains(",accuracy_top5,validation_iteration,validation_loss,validation_accuracy,validation_accuracy_top5,validation_samples,idle_share,"),
        "{csv}"
    );
    assert!(lines[1].contains(",1,0.75,0.9,,640,"), "{csv}");
    assert!(lines[3].contains(",,,,,,"), "{csv}");

    let json: serde_json::Value = serde_json::from_str(&render(&request(Format::Json)).unwrap()).unwrap();
    assert_eq!(json[0]["validation"]["accuracy"], 0.9);
    assert_eq!(json[0]["validation"]["iteration"], 1);
    assert!(json[2].get("validation").is_none(), "{json}");

    let without = tempfile::tempdir().unwrap();
    trained_record(without.path(), "20261129T000200Z_unvalidated", &[(2.0, 0.5)]);
    let plain = |format| ResultsOptions::plain(vec![without.path().to_path_buf()], format);
    assert!(!render(&plain(Format::Table)).unwrap().contains("val "));
    assert!(!render(&plain(Format::Csv)).unwrap().contains("validation"));
}

/// A validation metric's time to a target is read on the passes, a point each, at the seconds
/// of training up to the iteration the pass followed; a record without passes has no such curve.
#[test]
fn the_time_to_a_validation_target_is_read_on_the_passes() {
    let dir = tempfile::tempdir().unwrap();
    let late = trained_record(dir.path(), "20261129T000000Z_late", &LATE);
    let passes = [(1, 1.5, 0.6), (3, 0.6, 0.92), (5, 0.4, 0.95)];
    let mut text = std::fs::read_to_string(late.join("metrics.jsonl")).unwrap();
    for (iteration, loss, accuracy) in passes {
        // Both ranks of a replicated last stage report each pass, the same figures.
        for rank in [1, 2] {
            text.push_str(&format!(
                "\n{{\"event\":\"validation\",\"iteration\":{iteration},\"rank\":{rank},\"stage\":1,\"loss\":{loss},\"accuracy\":{accuracy},\"accuracy_top5\":null,\"samples\":64,\"time_s\":9.0}}"
            ));
        }
    }
    std::fs::write(late.join("metrics.jsonl"), text).unwrap();
    let target = |t: &str| Target::parse(t).unwrap();
    let raw = Smoothing::NONE;
    let reached = |iteration, seconds| Some(curves::TimeTo::Reached { iteration, seconds });
    // The training curve reaches 90% at iteration 1; the held-out one only at iteration 3's
    // pass, after 2 s of training (the passes' own 9 s are no training).
    assert_eq!(
        curves::time_to(&late, target("accuracy=90%"), raw),
        reached(1, 1.0)
    );
    assert_eq!(
        curves::time_to(&late, target("val_accuracy=90%"), raw),
        reached(3, 2.0)
    );
    assert_eq!(
        curves::time_to(&late, target("val_loss=0.5"), raw),
        reached(5, 3.0)
    );
    // Passes are read unsmoothed (smoothed at 0.6, 0.6 then 0.92 would be 0.795 at iteration 3).
    let smoothed = Smoothing::new(0.6).unwrap();
    assert_eq!(
        curves::time_to(&late, target("val_accuracy=90%"), smoothed),
        reached(3, 2.0)
    );
    assert_eq!(
        curves::time_to(&late, target("val_acc=99%"), raw),
        Some(curves::TimeTo::NotReached { iterations: 3 }),
        "three passes, none of them there"
    );
    assert_eq!(
        curves::time_to(&late, target("val_top5=0.5"), raw),
        None,
        "no top-5 reported"
    );
    let plain = trained_record(dir.path(), "20261129T000100Z_plain", &LATE);
    assert_eq!(curves::time_to(&plain, target("val_accuracy=90%"), raw), None);
    assert_eq!(target("val_accuracy=0.9").header(), "to val_accuracy ≥ 90%");
    assert_eq!(target("val_loss=0.5").header(), "to val_loss ≤ 0.5");
    let unknown = Target::parse("val_speed=3").unwrap_err();
    assert!(
        unknown.contains("val_loss, val_accuracy or val_top5"),
        "{unknown}"
    );
}

/// A record that ran validation passes has their loss on the loss plot: a line through a dot per
/// pass in its row's colour, through the passes' raw values (not smoothed when the training
/// curve is), labelled as the validation's beside the row's training line; the y axis reaches
/// the passes' losses where they lie above every training loss; a record without passes draws
/// no dot and keeps its plain label.
#[test]
fn a_loss_plot_draws_the_validation_passes_as_dotted_points() {
    let dir = tempfile::tempdir().unwrap();
    let record = |name: &str| loss_record(dir.path(), name, &[2.0, 1.5, 1.0, 0.75, 0.5]);
    let validated = record("20261130T000000Z_mlp");
    add_validation_passes(&validated, &[(1, 3.5, 0.5), (3, 2.0, 0.5), (4, 1.25, 0.5)]);
    let plain = record("20261130T000100Z_mlp");
    let svg = dir.path().join("loss.svg");
    let smoothed = curves::Smoothing::new(0.6).unwrap();
    plot::losses(&[validated, plain], plot::CurveX::Iteration, smoothed, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.contains("training and validation loss against iteration, smoothed (0.6)"),
        "{text}"
    );
    assert!(text.contains("mlp (20261130T000000Z_mlp) validation"), "{text}");
    assert!(text.contains("mlp (20261130T000000Z_mlp) training"), "{text}");
    assert!(text.contains("\nmlp (20261130T000100Z_mlp)\n"), "{text}");
    assert!(!text.contains("20261130T000100Z_mlp) validation"), "{text}");
    // The axis reaches the highest pass, 3.5, above every training loss (2.0 at most).
    assert!(text.contains("\n3.5\n"), "{text}");
    // The passes' line runs through their raw values, 3.5 to 1.25, one and a half times the
    // spread of the training loss's raw values, 2.0 to 0.5.
    let ratio = three_passes_against_five_raw_values(&text);
    assert!((ratio - 1.5).abs() < 0.03, "{ratio}: {text}");
}

/// Appends a `validation` line per (iteration, loss, top-1) to `row`'s metrics.
fn add_validation_passes(row: &read::Row, passes: &[(u64, f64, f64)]) {
    let path = row.dir.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&path).unwrap();
    for (iteration, loss, accuracy) in passes {
        text.push_str(&format!(
            "\n{{\"event\":\"validation\",\"iteration\":{iteration},\"rank\":0,\"stage\":0,\"loss\":{loss},\"accuracy\":{accuracy},\"accuracy_top5\":null,\"samples\":64,\"time_s\":1.0}}"
        ));
    }
    std::fs::write(path, text).unwrap();
}

/// Of a curve plot with one record's three validation passes and five iterations drawn smoothed:
/// asserts a dot per pass and one on the legend's sample, and returns the spread of the passes'
/// line over that of the iterations' faint raw line.
fn three_passes_against_five_raw_values(svg: &str) -> f64 {
    let marked = svg
        .split("<circle")
        .skip(1)
        .filter(|c| c.contains("r=\"4\""))
        .count();
    assert_eq!(marked, 4, "{svg}");
    let passes = polylines(svg, "stroke-width=\"2\"")
        .into_iter()
        .find(|p| p.split_whitespace().count() == 3)
        .unwrap_or_else(|| panic!("no three-point line: {svg}"));
    let raw = polylines(svg, "stroke-width=\"1\"")
        .into_iter()
        .find(|p| p.split_whitespace().count() == 5)
        .unwrap_or_else(|| panic!("no faint raw line: {svg}"));
    y_spread(&passes) / y_spread(&raw)
}

/// A record that ran validation passes has their top-1 on the accuracy plot: a line through a
/// dot per pass, in its row's colour, at the passes' iterations (not smoothed when the training
/// curves are), labelled as the validation's; a record without passes draws no dot.
#[test]
fn an_accuracy_plot_draws_the_validation_passes_as_dotted_points() {
    let dir = tempfile::tempdir().unwrap();
    let five = [
        (0.125, None),
        (0.5, None),
        (0.75, None),
        (0.625, None),
        (0.875, None),
    ];
    let validated = accuracy_record(dir.path(), "20261129T000000Z_mlp", &five);
    add_validation_passes(&validated, &[(1, 1.0, 0.25), (3, 1.0, 0.5), (4, 1.0, 0.625)]);
    let plain = accuracy_record(dir.path(), "20261129T000100Z_mlp", &five);
    let svg = dir.path().join("accuracy.svg");
    let smoothed = curves::Smoothing::new(0.6).unwrap();
    plot::accuracies(&[validated, plain], plot::CurveX::Iteration, smoothed, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.contains("training and validation accuracy against iteration, smoothed (0.6)"),
        "{text}"
    );
    assert!(
        text.contains("mlp (20261129T000000Z_mlp) validation top-1"),
        "{text}"
    );
    assert!(text.contains("mlp (20261129T000000Z_mlp) top-1"), "{text}");
    assert!(text.contains("\nmlp (20261129T000100Z_mlp)\n"), "{text}");
    assert!(!text.contains("20261129T000100Z_mlp) validation"), "{text}");
    // The passes' line runs through their raw values, 0.25 to 0.625, half the spread of the
    // training top-1's raw values, 0.125 to 0.875, drawn faint (smoothed at 0.6 the passes
    // would spread 0.26, about a third, instead).
    let ratio = three_passes_against_five_raw_values(&text);
    assert!((ratio - 0.5).abs() < 0.02, "{ratio}: {text}");
}

/// A record whose ranks resumed from an earlier run's checkpoint says so beside its figures,
/// which cover only the iterations from there.
#[test]
fn a_run_resumed_from_an_earlier_runs_checkpoint_says_what_its_figures_cover() {
    let scratch = tempfile::tempdir().unwrap();
    let from = fixtures().join("20261122T090000Z_vgg16-2pipe");
    let dir = scratch.path().join("20261122T090000Z_vgg16-2pipe");
    std::fs::create_dir(&dir).unwrap();
    for file in std::fs::read_dir(&from).unwrap() {
        let file = file.unwrap();
        std::fs::copy(file.path(), dir.join(file.file_name())).unwrap();
    }
    let path = dir.join("summary.json");
    let mut summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    summary["resumed_at"] = 140.into();
    summary["iterations_done"] = 10.into();
    std::fs::write(&path, summary.to_string()).unwrap();
    let out = render(&ResultsOptions::plain(vec![dir], Format::Json)).unwrap();
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let note = rows[0]["note"].as_str().unwrap_or_default();
    assert!(
        note.starts_with(
            "resumed at iteration 140 from an earlier run's checkpoint: its figures cover iterations \
             140 to 149"
        ),
        "{}",
        rows[0]
    );
}
