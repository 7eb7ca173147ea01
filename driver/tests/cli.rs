//! Command-line and configuration failures: nothing starts, the exit code is documented, and the
//! message points into the file.

use crate::util::*;

#[test]
fn a_malformed_config_exits_2_with_its_location() {
    let h = Harness::new("bad-config");
    let config = h.config("machines: [localhost]\nbatch_sise: 32\n");
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(
        run.stderr().contains("exp.yml:3:1: unknown field `batch_sise`"),
        "{}",
        run.stderr()
    );
    assert!(
        run.stderr().contains("did you mean `batch_size`?"),
        "{}",
        run.stderr()
    );
    assert!(!h.records().exists(), "no record for a config that never ran");
    h.assert_no_processes();
}

#[test]
fn a_stage_config_for_another_world_size_is_refused_before_launch() {
    let h = Harness::new("bad-stages");
    std::fs::write(
        h.dir.path().join("stages.json"),
        r#"{"module_to_stage_map": [0,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    let config =
        h.config("machines: [localhost, localhost, localhost]\nconfig_file: stages.json\nbackend: process\n");
    let run = h.run(&config, &[]);
    assert_eq!(run.code(), 2, "{}", run.stderr());
    assert!(run.stderr().contains("exp.yml:3:1:"), "{}", run.stderr());
    assert!(run.stderr().contains("rank 2 is in no stage"), "{}", run.stderr());
    h.assert_no_processes();
}

#[test]
fn a_missing_config_file_is_a_config_error() {
    let h = Harness::new("no-config");
    let run = h.run(&h.dir.path().join("nope.yml"), &[]);
    assert_eq!(run.code(), 2);
    assert!(
        run.stderr().contains("cannot read experiment file"),
        "{}",
        run.stderr()
    );
    assert!(
        run.stderr().contains("caused by:"),
        "the cause chain is printed: {}",
        run.stderr()
    );
    h.assert_no_processes();
}
