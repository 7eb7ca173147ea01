//! `driver results` as a user runs it, on the checked-in fixture records: every record shown,
//! the unreadable ones with their reason, and command-line mistakes exiting 2.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::Duration;

use crate::util::*;

fn fixtures() -> PathBuf {
    workspace().join("driver/tests/fixtures/results/experiments")
}

#[test]
fn a_folder_of_records_and_sweeps_is_one_table_with_nothing_dropped() {
    let h = Harness::new("res-all");
    let dir = fixtures();
    let args = [
        OsStr::new("results"),
        dir.as_os_str(),
        OsStr::new("--format"),
        OsStr::new("markdown"),
    ];
    let run = h.driver(&args, Duration::from_secs(30));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let out = run.stdout();
    assert_eq!(
        out.lines().filter(|l| l.starts_with("| ")).count(),
        10,
        "header and 9 rows: {out}"
    );
    // The record planned at launch shows its prediction beside the measurement.
    let auto = out
        .lines()
        .find(|l| l.starts_with("| mlp-auto"))
        .expect("the planned record");
    let cells: Vec<&str> = auto.split('|').map(str::trim).collect();
    assert!(cells.contains(&"2x(1,2)") && cells.contains(&"1280.0"), "{auto}");
    assert_eq!(out.matches("| unreadable").count(), 3, "{out}");
    assert!(
        out.contains("| failed") && out.contains("exited with code 3"),
        "{out}"
    );
    assert!(out.contains("| not run"), "{out}");
    h.assert_no_processes();
}

#[test]
fn mistakes_on_the_command_line_exit_2_with_what_to_change() {
    let h = Harness::new("res-bad");
    let dir = fixtures();
    let missing = h.dir.path().join("nope");
    let (one, other) = (
        dir.join("20261122T090000Z_vgg16-2pipe"),
        dir.join("20261122T094000Z_mlp-auto"),
    );
    let svg = h.dir.path().join("x.svg");
    let cases: [(Vec<&OsStr>, &str); 5] = [
        (
            vec![OsStr::new("results"), missing.as_os_str()],
            "is not a folder",
        ),
        (
            vec![
                OsStr::new("results"),
                dir.as_os_str(),
                OsStr::new("--sort"),
                OsStr::new("speed"),
            ],
            "unknown key `speed`",
        ),
        (
            vec![
                OsStr::new("results"),
                dir.as_os_str(),
                OsStr::new("--baseline"),
                OsStr::new("model=gpt"),
            ],
            "no row matches --baseline model=gpt",
        ),
        // Two records of no sweep have no grid key to plot against.
        (
            vec![
                OsStr::new("results"),
                one.as_os_str(),
                other.as_os_str(),
                OsStr::new("--plot"),
                svg.as_os_str(),
            ],
            "no x axis: give --plot-x KEY",
        ),
        (
            vec![
                OsStr::new("results"),
                dir.as_os_str(),
                OsStr::new("--plot"),
                svg.as_os_str(),
                OsStr::new("--plot-x"),
                OsStr::new("bogus"),
            ],
            "unknown key `bogus`",
        ),
    ];
    for (args, expected) in cases {
        let run = h.driver(&args, Duration::from_secs(30));
        assert_eq!(run.code(), 2, "{args:?}: {}", run.stderr());
        assert!(run.stderr().contains(expected), "{args:?}: {}", run.stderr());
        // Said before any table is printed.
        assert!(run.stdout().is_empty(), "{args:?}: {}", run.stdout());
    }
    assert!(!svg.exists());
    h.assert_no_processes();
}

/// A record whose metrics.jsonl holds lines that are not metrics lines (cut short, or edited)
/// is plotted from the rest, and says so once, with how many and where the first is.
#[test]
fn metrics_lines_that_cannot_be_read_are_said_once_and_left_out() {
    let h = Harness::new("res-damaged");
    let record = h.dir.path().join("20261122T090000Z_vgg16-2pipe");
    std::fs::create_dir(&record).unwrap();
    let from = fixtures().join("20261122T090000Z_vgg16-2pipe");
    for file in std::fs::read_dir(&from).unwrap() {
        let file = file.unwrap();
        std::fs::copy(file.path(), record.join(file.file_name())).unwrap();
    }
    let metrics = record.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap();
    let lines = text.lines().count();
    std::fs::write(
        &metrics,
        format!("{text}\n{{\"event\": \"iteration\", \"iter\nnot json\n"),
    )
    .unwrap();
    let plot = h.dir.path().join("loss.svg");
    let args = [
        OsStr::new("results"),
        record.as_os_str(),
        OsStr::new("--plot-loss"),
        plot.as_os_str(),
        OsStr::new("--time-to"),
        OsStr::new("loss=0.5"),
    ];
    let run = h.driver(&args, Duration::from_secs(30));
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let said = format!(
        "warning: 2 of {}'s lines are not metrics lines this driver reads (the first is line {})",
        metrics.display(),
        lines + 2
    );
    assert_eq!(run.stderr().matches(&said).count(), 1, "{}", run.stderr());
    assert!(plot.is_file(), "drawn from the lines that could be read");
    h.assert_no_processes();
}
