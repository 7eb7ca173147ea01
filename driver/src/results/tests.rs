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
    let curve = plot::curve(dir.path(), plot::Metric::Loss).unwrap();
    let got: Vec<(u64, f64, f64)> = curve.iter().map(|p| (p.iteration, p.seconds, p.value)).collect();
    assert_eq!(got, [(0, 1.0, 3.0), (1, 2.0, 1.5), (2, 4.0, 1.0)]);
    assert_eq!(
        plot::curve(dir.path(), plot::Metric::Accuracy),
        None,
        "lines without an accuracy"
    );
    std::fs::write(dir.path().join("metrics.jsonl"), line(0, 0, None, 0.5)).unwrap();
    assert_eq!(
        plot::curve(dir.path(), plot::Metric::Loss),
        None,
        "no loss, no curve"
    );
}

/// Losses that span orders of magnitude (a run that diverged beside one that converged) go on a
/// log scale with readable labels; close ones on a plain scale. Rows whose labels repeat are told
/// apart by their record folders.
#[test]
fn a_loss_plot_goes_to_a_log_scale_only_when_losses_span_orders_of_magnitude() {
    let dir = tempfile::tempdir().unwrap();
    let record = |name: &str, losses: &[f64]| {
        let path = dir.path().join(name);
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
    };
    let calm = record("20261127T000000Z_mlp", &[2.3, 1.9, 1.2]);
    let wild = record("20261127T000100Z_mlp", &[2.3, 40.0, 3.0e6]);
    let svg = dir.path().join("loss.svg");
    plot::losses(
        &[calm.clone(), wild],
        plot::CurveX::Iteration,
        plot::Smoothing::NONE,
        &svg,
    )
    .unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("loss (log scale)"), "{text}");
    assert!(text.contains("3.00e6") || text.contains("1.00e6"), "{text}");
    for folder in ["mlp (20261127T000000Z_mlp)", "mlp (20261127T000100Z_mlp)"] {
        assert!(text.contains(folder), "{folder}: {text}");
    }
    plot::losses(&[calm], plot::CurveX::Seconds, plot::Smoothing::NONE, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(!text.contains("log scale") && text.contains("\nloss\n"), "{text}");
    assert!(text.contains("seconds of training"), "{text}");
}

#[test]
fn smoothing_is_a_debiased_moving_average_that_starts_at_the_first_value() {
    let half = plot::Smoothing::new(0.5).unwrap();
    // (0.5 * 0 + 0.5 * 2) / (1 - 0.5), then (0.5 * 1 + 0.5 * 4) / (1 - 0.25).
    assert_eq!(half.apply(&[2.0, 4.0]), [2.0, 2.5 / 0.75]);
    assert_eq!(plot::Smoothing::NONE.apply(&[3.0, 1.0, 2.0]), [3.0, 1.0, 2.0]);
    // A constant stays put: each of 50 steps rounds once or twice, so within 50 * 2 ulps.
    let steady = plot::Smoothing::new(0.9).unwrap().apply(&[0.7; 50]);
    for v in steady {
        assert!((v - 0.7).abs() <= 100.0 * f64::EPSILON * 0.7, "{v}");
    }
    assert!(plot::Smoothing::new(1.0).is_err() && plot::Smoothing::new(-0.5).is_err());
    assert!(plot::Smoothing::new(f64::NAN).is_err());
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
    type Draw = fn(&[read::Row], plot::CurveX, plot::Smoothing, &Path) -> Result<(), plot::PlotError>;
    for (draw, what) in [(plot::losses as Draw, "loss"), (plot::accuracies, "accuracy")] {
        draw(
            std::slice::from_ref(&row),
            plot::CurveX::Iteration,
            plot::Smoothing::NONE,
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

        let smoothing = plot::Smoothing::new(0.6).unwrap();
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

    let top5 = plot::curve(image.dir.as_path(), plot::Metric::AccuracyTop5).unwrap();
    assert_eq!(
        top5.iter().map(|p| p.value).collect::<Vec<_>>(),
        [0.5, 0.875, 1.0, 0.875, 1.0]
    );
    assert_eq!(plot::curve(&tokens.dir, plot::Metric::AccuracyTop5), None);

    let svg = dir.path().join("accuracy.svg");
    plot::accuracies(
        &[image, tokens, old],
        plot::CurveX::Seconds,
        plot::Smoothing::NONE,
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
        plot::Smoothing::NONE,
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
