//! Parsing tests: good files, and snapshots of the message each malformed file gets.

use std::path::Path;

use super::yaml::parse;
use super::*;

fn ok(text: &str) -> ExperimentFile {
    parse(Path::new("exp.yml"), text).unwrap_or_else(|e| panic!("{e}"))
}

fn err(text: &str) -> String {
    parse(Path::new("exp.yml"), text)
        .expect_err("the file should be rejected")
        .to_string()
}

#[test]
fn pipedream_keys_parse() {
    let f = ok("
module: vgg16
machines: [node1:0, 'node2:1']
container: stagehand:latest
config_file: vgg16_2pipe.json
batch_size: 64
learning_rate: 0.01
distributed_backend: nccl
data_dir: /data/imagenet
log_directory: /tmp/exp
schedule: 1f1b
microbatches: 4
iterations: 10
");
    assert_eq!(f.module.as_deref(), Some("vgg16"));
    assert_eq!(f.machines.len(), 2);
    assert_eq!(f.machines[1].host, "node2");
    assert_eq!(f.machines[1].gpus, vec![1]);
    assert_eq!(f.container, Some(Container::Image("stagehand:latest".into())));
    assert_eq!(f.schedule, Some(Schedule::OneFOneB));
    assert_eq!(f.distributed_backend, Some(DistributedBackend::Nccl));
}

#[test]
fn mappings_model_alias_command_env_and_mounts_parse() {
    let f = ok("
model: mlp
backend: process
machines:
  - localhost
  - host: gpu-box
    user: alice
    port: 2222
    identity_file: ~/.ssh/id_ed25519
    gpus: [0, 1]
container: {build: ../docker/local}
env: {OMP_NUM_THREADS: '1'}
mounts: ['/data:/data:ro', {source: ./x, target: /x}]
command: [python3, train.py, --epochs, '1']
");
    assert_eq!(f.module.as_deref(), Some("mlp"));
    assert_eq!(f.backend, Some(crate::options::Backend::Process));
    assert_eq!(f.machines[1].port, Some(2222));
    assert_eq!(f.machines[1].gpus, vec![0, 1]);
    assert_eq!(
        f.container,
        Some(Container::Build(super::container::Build {
            dir: Some("../docker/local".into()),
            ..Default::default()
        }))
    );
    assert_eq!(f.env["OMP_NUM_THREADS"], "1");
    assert!(f.mounts[0].read_only);
    assert_eq!(f.mounts[1].target, std::path::PathBuf::from("/x"));
    assert_eq!(f.command.as_ref().unwrap()[1], "train.py");
}

#[test]
fn malformed_files_get_located_messages() {
    let cases: &[(&str, &str)] = &[
        ("unknown_key", "machines: [localhost]\nbatch_sise: 32\n"),
        ("machines_not_a_list", "machines: localhost\n"),
        ("bad_gpu_index", "machines:\n  - node1:0\n  - node1:first\n"),
        ("unknown_machine_key", "machines:\n  - host: node1\n    gpu: 0\n"),
        ("batch_size_text", "machines: [localhost]\nbatch_size: lots\n"),
        ("negative_iterations", "machines: [localhost]\niterations: -3\n"),
        ("huge_threads", "machines: [localhost]\nthreads: 99999999999\n"),
        ("unknown_schedule", "machines: [localhost]\nschedule: zigzag\n"),
        ("unknown_backend", "machines: [localhost]\nbackend: kubernetes\n"),
        (
            "container_both",
            "machines: [localhost]\ncontainer: {image: a, build: b}\n",
        ),
        (
            "relative_mount_target",
            "machines: [localhost]\nmounts: ['/data:data']\n",
        ),
        (
            "command_not_list",
            "machines: [localhost]\ncommand: python3 train.py\n",
        ),
        ("bad_indentation", "machines:\n  - localhost\n - node1\n"),
        ("tab_indentation", "machines:\n\t- localhost\n"),
        ("env_not_mapping", "machines: [localhost]\nenv: [A=1]\n"),
        ("empty_file", ""),
        ("list_at_top", "- localhost\n- node1\n"),
        ("duplicate_key", "machines: [localhost]\nmachines: [node1]\n"),
        (
            "duplicate_alias",
            "machines: [localhost]\n# the model\nmodel: mlp\nmodule: vgg16\n",
        ),
        (
            "duplicate_flow",
            "{machines: [localhost],\n  batch_size: 8, 'batch_size': 16}\n",
        ),
        ("unclosed_bracket", "machines: [localhost\n"),
    ];
    for (name, text) in cases {
        let message = err(text);
        assert!(message.starts_with("exp.yml:"), "{name}: {message}");
        insta::assert_snapshot!(*name, message);
    }
}

/// Keys are found where they are written, in block style and in flow style (a key inside a
/// nested mapping, or inside a quoted value, is not a top-level key).
#[test]
fn top_level_keys_are_located_in_either_style() {
    let at = |text: &str, key: &str| {
        let loaded = Loaded {
            path: "exp.yml".into(),
            text: text.to_string(),
            file: ok(text),
            point: None,
        };
        loaded.locate(key).map(|l| (l.line, l.column))
    };
    let block = "# a comment: not a key\nmachines: [localhost]\ncontainer: {build: ctx}\nlr: 0.1\n";
    assert_eq!(at(block, "machines"), Some((2, 1)));
    assert_eq!(at(block, "learning_rate"), Some((4, 1)), "an alias, by its key");
    assert_eq!(at(block, "batch_size"), None);
    let flow = "{machines: [localhost], master_addr: 'a:b, c',\n   container: {build: ctx}, lr: 0.1}\n";
    assert_eq!(at(flow, "machines"), Some((1, 2)));
    assert_eq!(at(flow, "master_addr"), Some((1, 25)));
    assert_eq!(at(flow, "learning_rate"), Some((2, 29)));
    assert_eq!(at(flow, "container"), Some((2, 4)));
    assert_eq!(at(flow, "build"), None, "a nested key");
}

#[test]
fn a_missing_file_names_the_path() {
    let e = load(Path::new("/nonexistent/exp.yml")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/exp.yml"), "{e}");
    assert!(std::error::Error::source(&e).is_some());
}

#[test]
fn a_sweep_section_keeps_its_order_and_refuses_empty_axes() {
    let f = ok("machines: [localhost]\nsweep:\n  schedule: [gpipe, 1f1b]\n  batch_size: [64, 32]\n");
    let axes = f.sweep.unwrap().axes;
    assert_eq!(axes[0].key, "schedule", "written order, not sorted");
    assert_eq!(axes[1].values, [serde_json::json!(64), serde_json::json!(32)]);
    insta::assert_snapshot!(
        "sweep_empty_axis",
        err("machines: [localhost]\nsweep:\n  batch_size: []\n")
    );
    insta::assert_snapshot!(
        "sweep_not_mapping",
        err("machines: [localhost]\nsweep: [batch_size]\n")
    );
}

#[test]
fn a_points_file_has_its_values_under_one_spelling_its_name_and_no_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    std::fs::write(
        &path,
        "# comment\nname: base\nmachines: [localhost]\nmodel: mlp\nlr: 0.1\nsweep:\n  batch_size: [1, 2]\n",
    )
    .unwrap();
    let loaded = load(&path).unwrap();
    let point = with_overrides(
        &loaded,
        "base-p1",
        "sw",
        &[
            ("module".into(), serde_json::json!("vgg16")),
            ("learning_rate".into(), serde_json::json!(0.5)),
            ("batch_size".into(), serde_json::json!(2)),
        ],
    )
    .unwrap();
    assert_eq!(point.file.module.as_deref(), Some("vgg16"));
    assert_eq!(point.file.learning_rate, Some(0.5));
    assert_eq!(point.file.batch_size, Some(2));
    assert_eq!(point.file.name.as_deref(), Some("base-p1"));
    assert_eq!(point.file.sweep, None);
    assert_eq!(
        point.path, loaded.path,
        "relative paths still resolve against the file"
    );
    assert!(
        point
            .text
            .starts_with("# sweep point base-p1 (module=vgg16 learning_rate=0.5 batch_size=2)"),
        "{}",
        point.text
    );
    assert!(
        !point.text.contains("model:") && !point.text.contains("lr:"),
        "{}",
        point.text
    );
}

/// A point's file is written by the sweep, but its keys are located where the user wrote them:
/// a swept value at its line in the `sweep:` section, one given with `--grid` as such, and every
/// other key at its line in the experiment file.
#[test]
fn a_points_keys_are_located_where_the_user_wrote_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    let text = "# comment\nmachines: [localhost]\n\nmodel: mlp\nlr: 0.1\nsweep:\n  # swept\n  \
                schedule: [gpipe, 1f1b]\n  batch_size:\n    - 8\n    - 16\nepochs: 2\n";
    std::fs::write(&path, text).unwrap();
    let loaded = load(&path).unwrap();
    let point = with_overrides(
        &loaded,
        "exp-p1",
        "sw",
        &[
            ("schedule".into(), serde_json::json!("1f1b")),
            ("batch_size".into(), serde_json::json!(16)),
            ("lr".into(), serde_json::json!(0.5)),
        ],
    )
    .unwrap();
    let line = |key: &str| point.locate(key).map(|at| (at.line, at.column));
    assert_eq!(line("schedule"), Some((8, 3)));
    assert_eq!(line("batch_size"), Some((9, 3)), "a block list");
    assert_eq!(line("learning_rate"), None, "given with --grid: not in the file");
    assert_eq!(line("epochs"), Some((12, 1)), "a key after the section");
    assert_eq!(line("machines"), Some((2, 1)));
    assert_eq!(
        point.written("learning_rate").as_deref(),
        Some("`learning_rate` from --grid")
    );
    assert_eq!(
        point.written("module"),
        Some(format!("`module` at {}:4", path.display()))
    );
    // A point of a point (a sweep's point file set again) keeps the user's file.
    let again = with_overrides(&point, "exp-p2", "sw", &[]).unwrap();
    assert_eq!(again.locate("machines").map(|at| at.line), Some(2));
}

#[test]
fn each_point_checkpoints_into_a_folder_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    std::fs::write(
        &path,
        "machines: [localhost]\nmodel: mlp\ncheckpoint_dir: ckpt\nresume: true\nsweep:\n  lr: [0.1, 0.2]\n",
    )
    .unwrap();
    let loaded = load(&path).unwrap();
    let dirs: Vec<_> = ["exp-p0", "exp-p1"]
        .iter()
        .map(|name| {
            with_overrides(&loaded, name, "sw", &[("lr".into(), serde_json::json!(0.1))])
                .unwrap()
                .file
                .checkpoint_dir
                .unwrap()
        })
        .collect();
    assert_eq!(
        dirs,
        [
            std::path::Path::new("ckpt/sw/exp-p0"),
            std::path::Path::new("ckpt/sw/exp-p1")
        ]
    );
    // A swept checkpoint_dir is the point's too: two points may still share a value.
    let point = with_overrides(
        &loaded,
        "exp-p3",
        "sw",
        &[("checkpoint_dir".into(), serde_json::json!("/abs/ck"))],
    )
    .unwrap();
    assert_eq!(
        point.file.checkpoint_dir.as_deref(),
        Some(std::path::Path::new("/abs/ck/sw/exp-p3"))
    );
    assert!(
        point.text.contains("checkpoint_dir: /abs/ck/sw/exp-p3"),
        "{}",
        point.text
    );
    // The file's `resume` stays the point's; where it says none, a point resumes from its own
    // checkpoint when it has one (run again by `driver sweep --resume`), and only a point that
    // checkpoints is given it.
    assert_eq!(point.file.resume, Some(crate::config::Resume::Required));
    std::fs::write(&path, "machines: [localhost]\nmodel: mlp\ncheckpoint_dir: ckpt\n").unwrap();
    let point = with_overrides(&load(&path).unwrap(), "exp-p0", "sw", &[]).unwrap();
    assert_eq!(point.file.resume, Some(crate::config::Resume::Auto));
    std::fs::write(&path, "machines: [localhost]\nmodel: mlp\n").unwrap();
    let point = with_overrides(&load(&path).unwrap(), "exp-p0", "sw", &[]).unwrap();
    assert_eq!(point.file.resume, None);
}

#[test]
fn resume_is_true_false_or_auto() {
    for (text, resume) in [
        ("true", Resume::Required),
        ("false", Resume::No),
        ("auto", Resume::Auto),
        ("'auto'", Resume::Auto),
    ] {
        let f = ok(&format!("machines: [a]\ncheckpoint_dir: c\nresume: {text}\n"));
        assert_eq!(f.resume, Some(resume), "{text}");
    }
    let e = err("machines: [a]\ncheckpoint_dir: c\nresume: later\n");
    assert!(
        e.contains("exp.yml:3:9: resume: \"later\" is not true, false or auto; write true"),
        "{e}"
    );
    assert!(check_grid_value("resume", &serde_json::json!("auto")).is_ok());
}

#[test]
fn grid_values_are_checked_against_the_keys_types() {
    assert!(check_grid_value("batch_size", &serde_json::json!(32)).is_ok());
    assert!(check_grid_value("model", &serde_json::json!("mlp")).is_ok());
    assert!(check_grid_value("machines", &serde_json::json!(["localhost", "localhost"])).is_ok());
    let e = check_grid_value("microbatches", &serde_json::json!("four")).unwrap_err();
    assert!(e.contains("expected a whole number"), "{e}");
    let e = check_grid_value("name", &serde_json::json!("x")).unwrap_err();
    assert!(e.contains("set by the sweep"), "{e}");
}

#[test]
fn config_file_is_a_path_or_auto_with_planner_settings() {
    let f = ok("machines: [a]\nconfig_file: stages.json\n");
    assert_eq!(f.config_file, Some(StageConfigRef::File("stages.json".into())));
    let f = ok("
machines: [a, b]
config_file: auto
planner:
  intra_host_gbps: 25
  inter_host_gbps: 1.25
  memory_gib: 16
  straight: true
  profile: mlp.profile.json
  repeats: 3
");
    assert_eq!(f.config_file, Some(StageConfigRef::Auto));
    let p = f.planner.unwrap();
    assert_eq!(p.intra_host_gbps, Some(25.0));
    assert_eq!(p.inter_host_gbps, Some(1.25));
    assert_eq!(p.memory_gib, Some(16.0));
    assert!(p.straight);
    assert_eq!(p.profile, Some("mlp.profile.json".into()));
    assert_eq!(p.repeats, Some(3));
    // `auto` serializes back as written, for the record's resolved config.
    let yaml = serde_norway::to_string(&ok("machines: [a]\nconfig_file: auto\n")).unwrap();
    assert!(yaml.contains("config_file: auto"), "{yaml}");

    let e = err("machines: [a]\nconfig_file: auto\nplanner: {intra_host_gbps: 0}\n");
    assert!(
        e.contains("exp.yml:3:") && e.contains("0 is not a positive number"),
        "{e}"
    );
    let e = err("machines: [a]\nconfig_file: auto\nplanner: {bandwith: 3}\n");
    assert!(e.contains("unknown field `bandwith`"), "{e}");
    // A short list of keys is given whole; the top level's 80, without a close one, is not.
    assert!(e.contains(", expected one of `"), "{e}");
    let e = err("machines: [a]\nzzzqqq: 1\n");
    assert!(
        e.ends_with("unknown field `zzzqqq`, not an experiment key (driver/README.md lists them all)"),
        "{e}"
    );
    let e = err("machines: [a]\nprecision: fp8\n");
    assert!(
        e.contains("exp.yml:2:") && e.contains("`fp32`, `bf16`, `fp16`"),
        "{e}"
    );
    let e = err("machines: [a]\nconfig_file: ''\n");
    assert!(e.contains("config_file is empty"), "{e}");
}

#[test]
fn a_container_reads_back_as_it_was_written() {
    for text in [
        "stagehand:latest",
        "{build: ../docker/local}",
        "{build: ctx, dockerfile: d/Dockerfile, args: {A: b}}",
        "{args: {TORCH_IMAGE: t}}",
    ] {
        let c: Container = serde_norway::from_str(text).unwrap();
        let json = serde_json::to_string(&c).unwrap();
        let back: Container = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c, "{text} -> {json}");
    }
}

#[test]
fn bucket_mb_is_a_positive_size() {
    assert_eq!(
        ok("machines: [a]\nbucket_mb: 0.5\n").bucket_mb.map(f64::from),
        Some(0.5)
    );
    assert_eq!(
        ok("machines: [a]\nbucket_mb: 25\n").bucket_mb.map(f64::from),
        Some(25.0)
    );
    for bad in ["0", "-1", "0.0000001", ".nan"] {
        let e = err(&format!("machines: [a]\nbucket_mb: {bad}\n"));
        assert!(
            e.contains("bucket_mb must be a positive number of MiB"),
            "{bad}: {e}"
        );
    }
    assert!(check_grid_value("bucket_mb", &serde_json::json!(0)).is_err());
    assert!(check_grid_value("bucket_mb", &serde_json::json!(4)).is_ok());
}
