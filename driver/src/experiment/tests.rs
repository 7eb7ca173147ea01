//! Resolution tests: rank layout, environments, argument vectors and cross-field checks.

use std::path::{Path, PathBuf};

use super::*;
use crate::options::{Progress, Verbosity};

pub(crate) fn options(backend: Option<Backend>, mode: ContainerMode) -> Options {
    Options {
        config_file: PathBuf::from("exp.yml"),
        container_mode: mode,
        output_dir: None,
        backend,
        runtime: Some(PathBuf::from("/opt/stagehand/runtime")),
        source: None,
        torch_venv: PathBuf::from("/nonexistent/venv"),
        mount_directories: Vec::new(),
        master_port: None,
        max_restarts: None,
        ssh_config: None,
        verbosity: Verbosity::Normal,
        progress: Progress::Off,
    }
}

fn loaded(dir: &Path, text: &str) -> Loaded {
    let path = dir.join("exp.yml");
    std::fs::write(&path, text).unwrap();
    crate::config::load(&path).unwrap()
}

/// Why `text` is refused, whether loading it or resolving it (one container per rank on the
/// default backend) refuses it.
fn refusal(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    std::fs::write(&path, text).unwrap();
    crate::config::load(&path)
        .map_err(|e| e.to_string())
        .and_then(|l| {
            let o = options(None, ContainerMode::PerRank);
            resolve(&l, &o, 29500).map(|_| ()).map_err(|e| e.to_string())
        })
        .unwrap_err()
}

/// `text` resolved with one container per rank on the default backend, which must succeed.
fn plan_per_rank(text: &str) -> Experiment {
    resolve_text(text, &options(None, ContainerMode::PerRank)).unwrap()
}

fn resolve_text(text: &str, opts: &Options) -> Result<Experiment, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("two.json"),
        r#"{"module_to_stage_map": [0,0,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    resolve(&loaded(dir.path(), text), opts, 29500)
}

fn flag<'a>(argv: &'a [String], name: &str) -> Option<&'a str> {
    argv.iter().position(|a| a == name).map(|i| argv[i + 1].as_str())
}

#[test]
fn data_parallel_ranks_get_torchrun_environments() {
    let plan = resolve_text(
        "machines: [localhost, localhost]\nmodule: mlp\nbatch_size: 8\niterations: 3\nenv: {OMP_NUM_THREADS: '1'}\n",
        &options(Some(Backend::Process), ContainerMode::PerRank),
    )
    .unwrap();
    assert_eq!(plan.world_size(), 2);
    assert_eq!(plan.hosts.len(), 1);
    assert_eq!(plan.master_addr, "127.0.0.1");
    let r1 = &plan.ranks[1];
    assert_eq!(r1.env["RANK"], "1");
    assert_eq!(r1.env["WORLD_SIZE"], "2");
    assert_eq!(r1.env["LOCAL_RANK"], "1");
    assert_eq!(r1.env["MASTER_PORT"], "29500");
    assert_eq!(r1.env["OMP_NUM_THREADS"], "1");
    assert_eq!(r1.argv[0], "/opt/stagehand/runtime");
    assert_eq!(flag(&r1.argv, "--model"), Some("mlp"));
    assert_eq!(flag(&r1.argv, "--device"), Some("cpu"));
    assert_eq!(flag(&r1.argv, "--rank"), Some("1"));
    assert_eq!(flag(&r1.argv, "--world-size"), Some("2"));
}

#[test]
fn a_local_first_machine_is_named_so_remote_ranks_can_reach_it() {
    let plan = plan_per_rank("machines: [localhost, node2]\n");
    assert_ne!(plan.master_addr, "localhost");
    assert_ne!(plan.master_addr, "127.0.0.1");
    assert_eq!(plan.master_addr, this_host_name());
    assert_eq!(plan.ranks[1].env["MASTER_ADDR"], plan.master_addr);
}

#[test]
fn a_single_rank_gets_no_distributed_flags() {
    let plan = plan_per_rank("machines: [localhost]\nmodule: mlp\n");
    assert_eq!(plan.backend, Backend::Docker);
    assert_eq!(flag(&plan.ranks[0].argv, "--rank"), None);
    assert_eq!(flag(&plan.ranks[0].argv, "--master-port"), None);
}

#[test]
fn bucket_mb_reaches_every_rank() {
    let plan = plan_per_rank("machines: [localhost, localhost]\nmodule: mlp\nbucket_mb: 0.5\n");
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--bucket-mb"), Some("0.5"));
    }
    let plan = plan_per_rank("machines: [localhost]\nmodule: mlp\n");
    assert_eq!(flag(&plan.ranks[0].argv, "--bucket-mb"), None);
}

#[test]
fn sparse_mlps_active_units_reach_every_rank() {
    let plan = plan_per_rank("machines: [localhost, localhost]\nmodule: sparse_mlp\nhidden: 256\nactive_units: 12\ncompress: auto\n");
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--model"), Some("sparse_mlp"));
        assert_eq!(flag(&rank.argv, "--hidden"), Some("256"));
        assert_eq!(flag(&rank.argv, "--active-units"), Some("12"));
    }
}

/// The transformer's sizes are experiment keys, handed on as the runtime's flags.
#[test]
fn the_transformers_sizes_reach_every_rank() {
    let plan = plan_per_rank(
        "machines: [localhost, localhost]\nmodule: transformer\nheads: 4\nseq_len: 64\nvocab_size: 1000\ndropout: 0.1\n",
    );
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--heads"), Some("4"));
        assert_eq!(flag(&rank.argv, "--seq-len"), Some("64"));
        assert_eq!(flag(&rank.argv, "--vocab-size"), Some("1000"));
        assert_eq!(flag(&rank.argv, "--dropout"), Some("0.1"));
    }
}

#[test]
fn precision_and_channels_last_reach_every_rank() {
    let plan = plan_per_rank(
        "machines: [localhost, localhost]\nmodule: resnet50\nprecision: bf16\nchannels_last: true\n",
    );
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--precision"), Some("bf16"));
        assert!(
            rank.argv.iter().any(|a| a == "--channels-last"),
            "{:?}",
            rank.argv
        );
        assert!(!rank.argv.iter().any(|a| a == "--cuda-graph"), "{:?}", rank.argv);
        assert_eq!(flag(&rank.argv, "--host-memory"), None);
    }
    let plan = plan_per_rank("machines: [localhost, localhost]\nmodule: mlp\nhost_memory: release\n");
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--host-memory"), Some("release"));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    std::fs::write(&path, "machines: [localhost]\nmodule: mlp\nhost_memory: free\n").unwrap();
    let bad = crate::config::load(&path).unwrap_err().to_string();
    assert!(
        bad.contains("exp.yml:3") && bad.contains("`keep`") && bad.contains("`release`"),
        "{bad}"
    );
    let plan = plan_per_rank("machines: ['node1:0']\nmodule: resnet50\ncuda_graph: true\n");
    assert!(
        plan.ranks[0].argv.iter().any(|a| a == "--cuda-graph"),
        "{:?}",
        plan.ranks[0].argv
    );
    let plan = plan_per_rank("machines: [localhost]\nmodule: mlp\n");
    assert_eq!(flag(&plan.ranks[0].argv, "--precision"), None);
    assert!(!plan.ranks[0].argv.iter().any(|a| a == "--channels-last"));
    assert_eq!(flag(&plan.ranks[0].argv, "--fp16-init-scale"), None);
    let plan = plan_per_rank(
        "machines: [localhost]
module: mlp
precision: fp16
fp16_init_scale: 1024
",
    );
    assert_eq!(flag(&plan.ranks[0].argv, "--fp16-init-scale"), Some("1024"));
}

#[test]
fn stage_configs_place_ranks_and_are_passed_by_absolute_path() {
    let plan = plan_per_rank("machines: ['node1:0', 'node2:0']\nmodule: vgg16\nconfig_file: two.json\nschedule: 1f1b\nmicrobatches: 4\n");
    assert_eq!(plan.ranks[1].stage, Some(1));
    assert_eq!(plan.master_addr, "node1");
    let argv = &plan.ranks[0].argv;
    assert!(Path::new(flag(argv, "--stage-config").unwrap()).is_absolute());
    assert_eq!(flag(argv, "--schedule"), Some("1f1b"));
    assert_eq!(flag(argv, "--device"), Some("cuda:0"));
    let stage_mount = plan
        .mounts
        .iter()
        .find(|m| m.mount.target.ends_with("two.json"))
        .unwrap();
    assert!(stage_mount.mount.read_only);
    assert_eq!(stage_mount.when_missing, WhenMissing::Copy);
}

#[test]
fn gpus_are_numbered_as_each_container_sees_them() {
    let text = "machines:\n  - host: box\n    gpus: [2, 3]\n";
    // Either way a container sees the host's GPUs of the experiment, in index order (PCI bus
    // order, which the ranks' CUDA_DEVICE_ORDER makes CUDA's too), whatever order they are listed in.
    let listed_backwards = "machines:\n  - host: box\n    gpus: [3, 1]\n";
    let plan = plan_per_rank(listed_backwards);
    assert_eq!(plan.hosts[0].gpus, vec![1, 3]);
    assert_eq!(plan.ranks[0].gpus, vec![3]);
    assert_eq!(flag(&plan.ranks[0].argv, "--device"), Some("cuda:1"));
    assert_eq!(
        plan.ranks[0].env.get("CUDA_DEVICE_ORDER").map(String::as_str),
        Some("PCI_BUS_ID")
    );
    for mode in [ContainerMode::PerRank, ContainerMode::PerHost] {
        let plan = resolve_text(text, &options(None, mode)).unwrap();
        assert_eq!(plan.world_size(), 2);
        assert_eq!(flag(&plan.ranks[1].argv, "--device"), Some("cuda:1"), "{mode:?}");
        assert_eq!(plan.ranks[1].gpus, vec![3]);
        assert_eq!(plan.ranks[1].env.get("LOCAL_RANK").map(String::as_str), Some("1"));
        assert_eq!(plan.hosts[0].gpus, vec![2, 3]);
    }
}

#[test]
fn a_process_rank_sees_its_hosts_gpus_whatever_the_drivers_shell_exported() {
    let o = options(Some(Backend::Process), ContainerMode::PerRank);
    let plan = resolve_text("machines: ['localhost:3', 'localhost:1']\n", &o).unwrap();
    for (rank, device) in [(0, "cuda:1"), (1, "cuda:0")] {
        let spec = &plan.ranks[rank];
        assert_eq!(flag(&spec.argv, "--device"), Some(device), "rank {rank}");
        // Set on the rank, so an inherited value (a shared server's shell) cannot renumber them.
        assert_eq!(
            spec.env.get("CUDA_VISIBLE_DEVICES").map(String::as_str),
            Some("1,3")
        );
    }
    // Without GPUs the driver shows nothing and the rank inherits what the shell has.
    let cpu = resolve_text("machines: ['localhost']\n", &o).unwrap();
    assert_eq!(cpu.ranks[0].env.get("CUDA_VISIBLE_DEVICES"), None);
    assert_eq!(flag(&cpu.ranks[0].argv, "--device"), Some("cpu"));
    // A user's own choice is theirs where the driver assigns no GPUs ...
    let own = resolve_text("machines: ['localhost']\nenv: {CUDA_VISIBLE_DEVICES: '2'}\n", &o).unwrap();
    assert_eq!(
        own.ranks[0].env.get("CUDA_VISIBLE_DEVICES").map(String::as_str),
        Some("2")
    );
    // ... and refused where it does, at its line, on every backend.
    for (text, line) in [
        ("machines: ['localhost:0']\nenv:\n  CUDA_VISIBLE_DEVICES: '2'\n", 2),
        (
            "backend: slurm\nslurm: {tasks_per_node: 2, gpus_per_task: 1}\nmodule: mlp\nenv:\n  CUDA_VISIBLE_DEVICES: '2'\n",
            4,
        ),
    ] {
        let options = match text.starts_with("backend") {
            true => options(None, ContainerMode::PerRank),
            false => o.clone(),
        };
        let message = resolve_text(text, &options).unwrap_err().to_string();
        assert!(message.contains("CUDA_VISIBLE_DEVICES=2"), "{message}");
        assert!(message.contains("name the GPUs there"), "{message}");
        assert!(message.contains(&format!("exp.yml:{line}:1:")), "not at env's line: {message}");
    }
}

#[test]
fn gpus_per_rank_gives_each_rank_a_stage_over_several_gpus() {
    let text = "machines:\n  - host: box\n    gpus: [4, 5, 6, 7]\ngpus_per_rank: 2\n";
    let per_rank = plan_per_rank(text);
    assert_eq!(per_rank.world_size(), 2);
    assert_eq!(per_rank.ranks[1].gpus, vec![6, 7]);
    // Each container sees the host's four GPUs, as one container per host does.
    assert_eq!(flag(&per_rank.ranks[1].argv, "--devices"), Some("cuda:2,cuda:3"));
    assert_eq!(flag(&per_rank.ranks[1].argv, "--device"), None);
    let per_host = resolve_text(text, &options(None, ContainerMode::PerHost)).unwrap();
    assert_eq!(flag(&per_host.ranks[1].argv, "--devices"), Some("cuda:2,cuda:3"));
    let process = resolve_text(
        "machines:\n  - host: localhost\n    gpus: [4, 5, 6, 7]\ngpus_per_rank: 2\n",
        &options(Some(Backend::Process), ContainerMode::PerRank),
    )
    .unwrap();
    // A process is shown the same GPUs through CUDA_VISIBLE_DEVICES, so it numbers them alike.
    assert_eq!(flag(&process.ranks[1].argv, "--devices"), Some("cuda:2,cuda:3"));
    assert_eq!(
        process.ranks[1]
            .env
            .get("CUDA_VISIBLE_DEVICES")
            .map(String::as_str),
        Some("4,5,6,7")
    );
    let slurm = plan_per_rank("backend: slurm\nslurm: {tasks_per_node: 2, gpus_per_task: 2}\nmodule: mlp\n");
    assert_eq!(flag(&slurm.ranks[0].argv, "--devices"), Some("cuda:0,cuda:1"));

    let refused = [
        (
            "machines: ['box:0', 'box:1']\ngpus_per_rank: 2\n",
            "the machines entry for `box` lists 1 GPU(s)",
        ),
        (
            "machines:\n  - host: box\n    gpus: [0, 1, 2]\ngpus_per_rank: 2\n",
            "lists 3 GPU(s); list a multiple of 2",
        ),
        (
            "backend: slurm\nslurm: {gpus_per_task: 2}\ngpus_per_rank: 2\n",
            "slurm.gpus_per_task",
        ),
    ];
    for (text, expected) in refused {
        let e = resolve_text(text, &options(None, ContainerMode::PerRank)).unwrap_err();
        assert!(e.to_string().contains(expected), "{text}: {e}");
        assert!(e.to_string().contains("gpus_per_rank"), "{e}");
    }
}

#[test]
fn init_from_reaches_every_rank_as_a_read_only_file_or_is_refused_where_missing() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("weights.pt"), b"weights").unwrap();
    let text = "machines: [localhost, localhost]\nmodule: mlp\ninit_from: weights.pt\n";
    let plan = resolve(
        &loaded(dir.path(), text),
        &options(None, ContainerMode::PerRank),
        29500,
    )
    .unwrap();
    let weights = dir.path().join("weights.pt");
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--init-from"), weights.to_str());
    }
    let mount = plan
        .mounts
        .iter()
        .find(|m| m.mount.source == weights)
        .expect("the weights are mounted");
    assert!(mount.mount.read_only);
    assert_eq!(mount.when_missing, WhenMissing::Copy);
    let missing = "machines: [localhost]\nmodule: mlp\ninit_from: nowhere.pt\n";
    let e = resolve(
        &loaded(dir.path(), missing),
        &options(None, ContainerMode::PerRank),
        29500,
    )
    .unwrap_err();
    assert!(e.to_string().contains("nowhere.pt is not a file here"), "{e}");
}

#[test]
fn command_replaces_the_runtime_and_keeps_the_rank_environment() {
    let plan = resolve_text(
        "machines: [localhost, localhost]\ncommand: [python3, 'train.py; rm -rf /', --x]\nmodule: mlp\n",
        &options(Some(Backend::Process), ContainerMode::PerRank),
    )
    .unwrap();
    assert_eq!(plan.ranks[0].argv, vec!["python3", "train.py; rm -rf /", "--x"]);
    assert_eq!(plan.ranks[0].env["WORLD_SIZE"], "2");
}

#[test]
fn a_stage_config_with_bundles_runs_and_a_crossing_one_is_refused_at_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let stages = r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1,2,3], "1": [4,5]}, "bundles": "#;
    let o = options(None, ContainerMode::PerRank);
    let text = "machines: [a, b, c, d, e, f]\nmodule: mlp\nconfig_file: bundles.json\n";
    std::fs::write(
        dir.path().join("bundles.json"),
        format!("{stages}[[0,2,4],[1,3,5]]}}"),
    )
    .unwrap();
    let plan = resolve(&loaded(dir.path(), text), &o, 29500).unwrap();
    for rank in &plan.ranks {
        assert!(flag(&rank.argv, "--stage-config").is_some(), "{:?}", rank.argv);
    }
    std::fs::write(
        dir.path().join("bundles.json"),
        format!("{stages}[[0,1,4],[2,3,5]]}}"),
    )
    .unwrap();
    let e = resolve(&loaded(dir.path(), text), &o, 29500)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("exp.yml:3:1:") && e.contains("from rank 1 (stage 0, bundle 0) to rank 5"),
        "{e}"
    );
}

#[test]
fn cross_field_mistakes_point_at_their_key() {
    let cases = [
        ("machines: []\n", "exp.yml:1:1: machines is empty"),
        ("module: mlp\n", "machines is empty; list one `host:gpu`"),
        (
            "machines: [node1]\nbackend: process\n",
            "host `node1` is not local",
        ),
        (
            "machines: [a, b, c]\nconfig_file: two.json\n",
            "the machines list gives 3 ranks",
        ),
        (
            "machines: [a]\nconfig_file: missing.json\n",
            "cannot read stage config",
        ),
        (
            "machines: [a, b]\nschedule: gpipe\n",
            "a schedule needs a `config_file`",
        ),
        ("machines: [a]\ndevice: cuda\n", "device is cuda but"),
        ("machines: [a]\ncommand: []\n", "command is empty"),
        (
            "name: 'my exp'\nmachines: [a]\n",
            "name `my exp` may only contain",
        ),
    ];
    for (text, expected) in cases {
        let e = resolve_text(text, &options(None, ContainerMode::PerRank))
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{text:?}: {e}");
        assert!(e.contains("exp.yml:"), "{e}");
    }
    let e = resolve_text(
        "machines: [a, b, c]\n\nconfig_file: two.json\n",
        &options(None, ContainerMode::PerRank),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("exp.yml:3:1:"), "{e}");
}

#[test]
fn auto_profiles_rank_zeros_device_at_the_microbatch_size() {
    let plan = plan_per_rank("machines: ['gpu1:2', 'gpu1:3', 'gpu2:0', 'gpu2:1']\nmodule: resnet50\nimage_size: 64\nbatch_size: 64\nconfig_file: auto\nschedule: 1f1b\nthreads: 4\nplanner: {intra_host_gbps: 100, memory_gib: 16}\n");
    let auto = plan.auto.as_ref().expect("auto is pending");
    // Four ranks: four microbatches of 16 (the fewest that give every rank work).
    assert_eq!((auto.microbatches, auto.micro_batch_size), (4, 16));
    assert_eq!(auto.workers, 4);
    // Two GPUs per machine on 100 GB/s, machines on the default 10 GbE.
    assert_eq!(auto.levels, vec![(2, 100e9), (4, 1.25e9)]);
    assert_eq!(auto.memory_bytes, Some(16.0 * (1u64 << 30) as f64));
    assert!(!auto.straight);
    let argv = auto.profile_argv.as_ref().unwrap();
    assert_eq!(&argv[..2], ["/opt/stagehand/runtime", "profile"]);
    assert_eq!(flag(argv, "--model"), Some("resnet50"));
    assert_eq!(flag(argv, "--image-size"), Some("64"));
    assert_eq!(flag(argv, "--batch-size"), Some("16"));
    assert_eq!(flag(argv, "--threads"), Some("4"));
    // A container given one GPU sees it as cuda:0.
    assert_eq!(flag(argv, "--device"), Some("cuda:0"));
    assert_eq!(auto.profile_device, "cuda:0");
    // Until planned, the ranks have no stage config.
    assert_eq!(flag(&plan.ranks[0].argv, "--stage-config"), None);
    assert_eq!(flag(&plan.ranks[0].argv, "--image-size"), Some("64"));
}

#[test]
fn auto_profiles_in_the_arithmetic_the_ranks_compute_in() {
    let text = "machines: ['gpu1:0', 'gpu1:1']\nmodule: resnet50\nbatch_size: 32\nconfig_file: auto\n";
    let plain = plan_per_rank(text);
    let argv = plain.auto.as_ref().unwrap().profile_argv.clone().unwrap();
    assert_eq!(flag(&argv, "--precision"), None, "fp32 is the runtime's default");
    assert!(!argv.iter().any(|a| a == "--channels-last"), "{argv:?}");
    let mixed = plan_per_rank(&format!(
        "{text}precision: bf16\nchannels_last: true\nhost_memory: keep\n"
    ));
    let argv = mixed.auto.as_ref().unwrap().profile_argv.clone().unwrap();
    assert_eq!(flag(&argv, "--precision"), Some("bf16"));
    assert_eq!(flag(&argv, "--host-memory"), Some("keep"));
    assert!(argv.iter().any(|a| a == "--channels-last"), "{argv:?}");
    // The ranks get the same arithmetic.
    assert_eq!(flag(&mixed.ranks[0].argv, "--precision"), Some("bf16"));
}

#[test]
fn a_planned_stage_config_and_its_microbatches_reach_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let stages = dir.path().join("record/stage_config.json");
    std::fs::create_dir_all(stages.parent().unwrap()).unwrap();
    std::fs::write(
        &stages,
        r#"{"module_to_stage_map": [0,0,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#,
    )
    .unwrap();
    let l = loaded(
        dir.path(),
        "backend: process\nmachines: [localhost, localhost, localhost]\nmodule: mlp\nbatch_size: 30\nconfig_file: auto\n",
    );
    let o = options(None, ContainerMode::PerRank);
    let pending = resolve(&l, &o, 29500).unwrap();
    let auto = pending.auto.unwrap();
    assert_eq!(auto.microbatches, 3, "3 divides 30");
    assert_eq!(auto.levels, vec![(3, 2e9)], "CPU ranks of one machine");
    let planned = Partitioned {
        stage_config: stages.clone(),
        microbatches: auto.microbatches,
    };
    let plan = resolve_planned(&l, &o, 29500, &planned).unwrap();
    assert!(plan.auto.is_none());
    for r in &plan.ranks {
        assert_eq!(flag(&r.argv, "--stage-config"), Some(stages.to_str().unwrap()));
        assert_eq!(flag(&r.argv, "--microbatches"), Some("3"));
    }
    assert_eq!(
        plan.ranks.iter().map(|r| r.stage).collect::<Vec<_>>(),
        [Some(0), Some(0), Some(1)]
    );
}

#[test]
fn auto_needs_the_runtime_a_model_and_a_batch_size() {
    let cases = [
        (
            "machines: [a, b]\nconfig_file: auto\nbatch_size: 8\n",
            "needs `module:`",
        ),
        (
            "machines: [a, b]\nconfig_file: auto\nmodule: mlp\n",
            "needs `batch_size:`",
        ),
        (
            "machines: [a, b]\nconfig_file: auto\nmodule: mlp\nbatch_size: 8\ncommand: [x]\n",
            "not a `command:`",
        ),
        (
            "machines: [a, b, c]\nconfig_file: auto\nmodule: mlp\nbatch_size: 2\n",
            "batch_size 2 is smaller than the 3 ranks",
        ),
        (
            "machines: [a, b]\nconfig_file: auto\nmodule: mlp\nbatch_size: 8\nmicrobatches: 3\n",
            "3 microbatches do not divide batch_size 8",
        ),
        (
            "machines: [a, b]\nconfig_file: two.json\nplanner: {straight: true}\n",
            "planner settings apply only with `config_file: auto`",
        ),
        (
            "machines: [a, b]\nconfig_file: auto\nmodule: mlp\nbatch_size: 8\nplanner: {repeats: 0}\n",
            "repeats must be at least 1",
        ),
        (
            "machines: [a, b]\nconfig_file: auto\nmodule: mlp\nbatch_size: 0\nmicrobatches: 0\n",
            "batch_size must be at least 1",
        ),
        (
            "machines: [a, b]\nconfig_file: auto\nmodule: mlp\nbatch_size: 48\nmicrobatches: 0\n",
            "microbatches must be at least 1",
        ),
        (
            "machines: [a, b]\nconfig_file: auto\nmodule: mlp\nbatch_size: 8\nplanner: {profile: /nonexistent/p.json}\n",
            "planner: profile: there is no file /nonexistent/p.json",
        ),
    ];
    for (text, expected) in cases {
        let e = resolve_text(text, &options(None, ContainerMode::PerRank))
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{text:?}: {e}");
    }
}

#[test]
fn auto_networks_follow_the_machines() {
    let hosts = |counts: &[usize]| -> Vec<HostSpec> {
        counts
            .iter()
            .enumerate()
            .map(|(i, &n)| HostSpec {
                name: format!("h{i}"),
                machine: Machine::placeholder(format!("h{i}")),
                ranks: (0..n).collect(),
                gpus: Vec::new(),
            })
            .collect()
    };
    assert_eq!(network_levels(&hosts(&[4]), 4, 10.0, 1.0), vec![(4, 10.0)]);
    assert_eq!(
        network_levels(&hosts(&[2, 2]), 4, 10.0, 1.0),
        vec![(2, 10.0), (4, 1.0)]
    );
    assert_eq!(network_levels(&hosts(&[1, 1]), 2, 10.0, 1.0), vec![(2, 1.0)]);
    // Uneven machines: one flat level at the slower bandwidth.
    assert_eq!(network_levels(&hosts(&[3, 1]), 4, 10.0, 1.0), vec![(4, 1.0)]);
    assert_eq!(default_microbatches(32, 3), Some(4));
    assert_eq!(default_microbatches(7, 2), Some(7));
    assert_eq!(default_microbatches(1, 2), None);
}

#[test]
fn output_dir_overrides_log_directory() {
    let mut o = options(None, ContainerMode::PerRank);
    let plan = resolve_text("machines: [localhost]\nlog_directory: /tmp/a\n", &o).unwrap();
    assert_eq!(plan.log_directory, PathBuf::from("/tmp/a"));
    o.output_dir = Some(PathBuf::from("/tmp/b"));
    let plan = resolve_text("machines: [localhost]\nlog_directory: /tmp/a\n", &o).unwrap();
    assert_eq!(plan.log_directory, PathBuf::from("/tmp/b"));
}

#[test]
fn every_shipped_config_resolves() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../driver_configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yml") {
            let loaded = crate::config::load(&path).unwrap_or_else(|e| panic!("{e}"));
            let plan = resolve(&loaded, &options(None, ContainerMode::PerHost), 29500)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if loaded.file.config_file != Some(crate::config::StageConfigRef::Auto) {
                runtime_accepts_every_rank(&path, &plan);
            }
            seen += 1;
        }
    }
    assert!(
        seen >= 4,
        "quickstart, 2-stage, data-parallel and hybrid configs ship"
    );
}

/// The runtime's own validation (`runtime --check`, the build scripts/setup.sh makes) accepts
/// every rank's argument vector and environment as the plan resolves them.
fn runtime_accepts_every_rank(config: &Path, plan: &Experiment) {
    let runtime = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/runtime");
    assert!(
        runtime.is_file(),
        "{} is missing: build the workspace (scripts/setup.sh) first",
        runtime.display()
    );
    for rank in &plan.ranks {
        let out = std::process::Command::new(&runtime)
            .args(&rank.argv[1..])
            .arg("--check")
            .envs(&rank.env)
            .envs(slurm_task_env(plan, rank))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{} rank {}: runtime --check refused {:?}: {}",
            config.display(),
            rank.rank,
            rank.argv,
            String::from_utf8_lossy(&out.stderr)
        );
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(line["world_size"], plan.world_size(), "{line}");
    }
}

#[test]
fn slowdown_reaches_the_ranks_it_names_and_a_rank_wins_over_its_machine() {
    let o = options(None, ContainerMode::PerRank);
    let plan = resolve_text(
        "machines: [localhost, localhost, localhost]\nmodule: mlp\nslowdown:\n  - {host: localhost, factor: 1.5}\n  - {rank: 2, factor: 3}\n",
        &o,
    )
    .unwrap();
    assert_eq!(flag(&plan.ranks[0].argv, "--slowdown"), Some("0=1.5"));
    assert_eq!(flag(&plan.ranks[1].argv, "--slowdown"), Some("1=1.5"));
    assert_eq!(flag(&plan.ranks[2].argv, "--slowdown"), Some("2=3"));
    let plan = resolve_text(
        "machines: [localhost, localhost]\nslowdown: [{rank: 1, factor: 2}]\n",
        &o,
    )
    .unwrap();
    assert_eq!(flag(&plan.ranks[0].argv, "--slowdown"), None);
    assert_eq!(flag(&plan.ranks[1].argv, "--slowdown"), Some("1=2"));
}

#[test]
fn a_slowdown_that_names_nothing_real_is_refused_with_what_to_change() {
    let o = options(None, ContainerMode::PerRank);
    for (body, expected) in [
        (
            "slowdown: [{rank: 2, factor: 2}]",
            "names rank 2, but the machines give 2 rank(s)",
        ),
        (
            "slowdown: [{host: node9, factor: 2}]",
            "names host `node9`, which is not one of the machines",
        ),
        (
            "slowdown: [{rank: 1, host: localhost, factor: 2}]",
            "either a `rank` or a `host`",
        ),
        ("slowdown: [{rank: 1, factor: 0.5}]", "a factor is at least 1"),
        (
            "command: [sleep, '1']\nslowdown: [{rank: 1, factor: 2}]",
            "the ranks run `command:`",
        ),
    ] {
        let text = format!("machines: [localhost, localhost]\n{body}\n");
        let e = resolve_text(&text, &o).unwrap_err().to_string();
        assert!(e.contains(expected), "{body}: {e}");
        assert!(e.contains("exp.yml:"), "located in the file: {e}");
    }
}

#[test]
fn overlap_reduce_and_compress_reach_every_rank() {
    let plan =
        plan_per_rank("machines: [localhost, localhost]\nmodule: mlp\noverlap_reduce: on\ncompress: auto\n");
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--overlap-reduce"), Some("on"));
        assert_eq!(flag(&rank.argv, "--compress"), Some("auto"));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    std::fs::write(&path, "machines: [localhost]\ncompress: sometimes\n").unwrap();
    let e = crate::config::load(&path).unwrap_err();
    assert!(e.to_string().contains("expected `auto` or `off`"), "{e}");
}

#[test]
fn reduce_and_sync_every_reach_every_rank() {
    let plan = plan_per_rank(
        "machines: [localhost, localhost, localhost]\nmodule: mlp\nreduce: partial:2\nsync_every: 4\n",
    );
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--reduce"), Some("partial:2"));
        assert_eq!(flag(&rank.argv, "--sync-every"), Some("4"));
    }
    let o = options(None, ContainerMode::PerRank);
    let e = resolve_text("machines: [localhost]\nmodule: mlp\nsync_every: 4\n", &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("add `reduce: partial:K`") && e.contains("exp.yml:"),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    for bad in ["partial:0", "partial", "some", "partial:-1"] {
        std::fs::write(&path, format!("machines: [localhost]\nreduce: {bad}\n")).unwrap();
        let e = crate::config::load(&path).unwrap_err().to_string();
        assert!(e.contains("reduce must be `all` or `partial:K`"), "{bad}: {e}");
    }
}

#[test]
fn pipedreams_weight_decay_and_model_type_are_honoured() {
    let o = options(None, ContainerMode::PerRank);
    let plan = resolve_text(
        "machines: [localhost]\nmodule: vgg16\nweight_decay: 0.0001\nmodel_type: image_classification\n",
        &o,
    )
    .unwrap();
    assert_eq!(flag(&plan.ranks[0].argv, "--weight-decay"), Some("0.0001"));
    let e = resolve_text("machines: [localhost]\nmodel_type: translation\n", &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model_type `translation` is not one the runtime has"),
        "{e}"
    );
}

/// SGD's momentum, Nesterov's and the communication timeout reach the runtime as its flags; a
/// `command:` never sees them, so they are refused with one.
#[test]
fn momentum_nesterov_and_the_comm_timeout_reach_the_runtime() {
    let o = options(None, ContainerMode::PerRank);
    let plan = resolve_text(
        "machines: [localhost]\nmodule: mlp\nmomentum: 0.5\nnesterov: true\ncomm_timeout: 300\n",
        &o,
    )
    .unwrap();
    let argv = &plan.ranks[0].argv;
    assert_eq!(flag(argv, "--momentum"), Some("0.5"));
    assert_eq!(flag(argv, "--comm-timeout"), Some("300"));
    assert!(argv.iter().any(|a| a == "--nesterov"), "{argv:?}");
    let plan = resolve_text("machines: [localhost]\nmodule: mlp\nnesterov: false\n", &o).unwrap();
    assert!(!plan.ranks[0]
        .argv
        .iter()
        .any(|a| a == "--nesterov" || a == "--momentum"));
    let e = resolve_text(
        "machines: [localhost]\ncommand: [/bin/true]\ncomm_timeout: 5\n",
        &o,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`comm_timeout` is the runtime's"), "{e}");
    // The model's sizes too: a `command:` never sees them.
    for key in [
        "layers: 2",
        "hidden: 64",
        "image_size: 32",
        "num_classes: 10",
        "heads: 4",
        "dropout: 0.1",
    ] {
        let e = resolve_text(
            &format!("machines: [localhost]\ncommand: [/bin/true]\n{key}\n"),
            &o,
        )
        .unwrap_err()
        .to_string();
        let name = key.split(':').next().unwrap();
        assert!(e.contains(&format!("`{name}` is the runtime's")), "{key}: {e}");
    }
}

#[test]
fn pipedreams_epochs_learning_rate_policy_and_synthetic_data_reach_the_runtime() {
    let o = options(None, ContainerMode::PerRank);
    // As in PipeDream's vgg16_4pipedream.yml.
    let plan = resolve_text(
        "machines: [localhost]\nbatch_size: 64\nepochs: 60\nlearning_rate_policy: polynomial\n\
         synthetic_data: true\nlr_warmup_epochs: 5\n",
        &o,
    )
    .unwrap();
    let argv = &plan.ranks[0].argv;
    assert_eq!(flag(argv, "--epochs"), Some("60"));
    assert_eq!(flag(argv, "--lr-policy"), Some("polynomial"));
    assert_eq!(flag(argv, "--lr-warmup-epochs"), Some("5"));
    assert_eq!(flag(argv, "--iterations"), None);
    assert_eq!(
        flag(argv, "--data"),
        None,
        "synthetic data is the runtime's default"
    );
    assert!(!argv.contains(&"--compress-activations".to_string()));
    // PipeDream's published configs say `compress_activations: False, compress_in_gpu: False`.
    let off = resolve_text(
        "machines: [localhost]\ncompress_activations: false\ncompress_in_gpu: false\n",
        &o,
    )
    .unwrap();
    assert!(!off.ranks[0].argv.contains(&"--compress-activations".to_string()));
    let on = resolve_text(
        "machines: [localhost]\ncompress_activations: true\ncompress_in_gpu: true\n",
        &o,
    )
    .unwrap();
    assert!(on.ranks[0].argv.contains(&"--compress-activations".to_string()));
    // 60 epochs of PipeDream's 1000000 synthetic samples in batches of 64, for the progress bar.
    assert_eq!(plan.iterations, Some(60 * (1_000_000 / 64)));
    let plan = resolve_text(
        "machines: [localhost]\nepochs: 2\nepoch_samples: 640\nbatch_size: 64\n\
         learning_rate_policy: exponential_decay\n",
        &o,
    )
    .unwrap();
    assert_eq!(flag(&plan.ranks[0].argv, "--lr-policy"), Some("exponential"));
    assert_eq!(flag(&plan.ranks[0].argv, "--epoch-samples"), Some("640"));
    assert_eq!(plan.iterations, Some(20));
    for (text, key, reason) in [
        ("epochs: 2\niterations: 5\n", "epochs", "keep one"),
        ("iterations: 0\n", "iterations", "0 trains nothing"),
        (
            "synthetic_data: true\ndata_dir: /data\n",
            "synthetic_data",
            "drop `data_dir`",
        ),
        ("synthetic_data: false\n", "synthetic_data", "needs a `data_dir`"),
        (
            "compress_activations: true\ncompress_in_gpu: false\n",
            "compress_in_gpu",
            "on the device that holds them",
        ),
        (
            "command: [python3, train.py]\nepochs: 3\n",
            "epochs",
            "the ranks run `command:`",
        ),
    ] {
        let e = resolve_text(&format!("machines: [localhost]\n{text}"), &o)
            .unwrap_err()
            .to_string();
        assert!(e.contains(reason), "{text}: {e}");
        assert!(e.contains(key), "{text}: {e}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("exp.yml");
    std::fs::write(&path, "machines: [localhost]\nlearning_rate_policy: cosine\n").unwrap();
    let e = crate::config::load(&path).unwrap_err().to_string();
    assert!(
        e.contains("exp.yml:2:23: learning_rate_policy: unknown variant `cosine`"),
        "{e}"
    );
}

#[test]
fn pipedreams_keys_not_honoured_yet_are_refused_with_what_to_use_instead() {
    let o = options(None, ContainerMode::PerRank);
    for value in ["gnmt", "true"] {
        let text = format!("machines: [localhost]\ntranslation_model: {value}\n");
        let e = resolve_text(&text, &o).unwrap_err().to_string();
        assert!(
            e.contains("`translation_model` (PipeDream's) is not supported"),
            "{e}"
        );
        assert!(e.contains("module: transformer"), "{e}");
        assert!(e.contains("exp.yml:2:1"), "located at its line: {e}");
    }
    // What every one of PipeDream's image-classification configs says.
    let plan = resolve_text("machines: [localhost]\ntranslation_model: false\n", &o).unwrap();
    assert_eq!(plan.world_size(), 1);
}

#[test]
fn print_and_verbose_frequency_set_the_terminals_intervals() {
    let o = options(None, ContainerMode::PerRank);
    let plan = resolve_text(
        "machines: [localhost]\nprint_frequency: 100\nverbose_frequency: 0\n",
        &o,
    )
    .unwrap();
    assert_eq!((plan.print_every, plan.verbose_every), (Some(100), Some(0)));
}

/// PipeDream's `__init__.py` for stage modules `stage0.py`..., criterion last.
fn pipedream_init(stages: usize) -> String {
    let mut text = String::from("import torch\n");
    for s in 0..stages {
        text += &format!("from .stage{s} import Stage{s}\n");
    }
    text += "\ndef arch():\n    return \"model\"\n\ndef model(criterion):\n    return [\n";
    for s in 0..stages {
        let input = if s == 0 {
            "input0".to_string()
        } else {
            format!("out{}", s - 1)
        };
        text += &format!("        (Stage{s}(), [\"{input}\"], [\"out{s}\"]),\n");
    }
    text += &format!(
        "        (criterion, [\"out{}\"], [\"loss\"])\n    ]\n",
        stages - 1
    );
    text
}

/// A stage file in the shape PipeDream's `convert_graph_to_model.py` writes: one
/// `self.layerN = torch.nn...` line per layer.
fn pipedream_stage(index: usize, layers: &[&str]) -> String {
    let mut text = format!(
        "import torch\n\n\nclass Stage{index}(torch.nn.Module):\n    def __init__(self):\n        super(Stage{index}, self).__init__()\n"
    );
    for (n, layer) in layers.iter().enumerate() {
        text += &format!("        self.layer{} = torch.nn.{layer}\n", n + 2);
    }
    text += "\n    def forward(self, input0):\n        return input0\n";
    text
}

/// VGG-16 as PipeDream's vgg16 folders split it, cut after the third max-pool.
fn pipedream_vgg16(dir: &Path, cut_after_pool: usize) {
    let folder = dir.join("models").join("vgg16").join("gpus=2");
    std::fs::create_dir_all(&folder).unwrap();
    let (mut first, mut second): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    let (mut c_in, mut pools) = (3, 0);
    for entry in [
        64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
    ] {
        let target = if pools < cut_after_pool {
            &mut first
        } else {
            &mut second
        };
        if entry == 0 {
            target.push("MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)".into());
            pools += 1;
            continue;
        }
        target.push(format!(
            "Conv2d({c_in}, {entry}, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))"
        ));
        target.push("ReLU(inplace=True)".into());
        c_in = entry;
    }
    for (d_in, d_out, last) in [(25088, 4096, false), (4096, 4096, false), (4096, 1000, true)] {
        second.push(format!(
            "Linear(in_features={d_in}, out_features={d_out}, bias=True)"
        ));
        if !last {
            second.push("ReLU(inplace=True)".into());
            second.push("Dropout(p=0.5)".into());
        }
    }
    fn refs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    std::fs::write(folder.join("stage0.py"), pipedream_stage(0, &refs(&first))).unwrap();
    std::fs::write(folder.join("stage1.py"), pipedream_stage(1, &refs(&second))).unwrap();
    std::fs::write(folder.join("__init__.py"), pipedream_init(2)).unwrap();
    std::fs::write(
        folder.join("hybrid_conf.json"),
        r#"{"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}, "stage_to_depth_map": {"0": 1, "1": 0}}"#,
    )
    .unwrap();
}

fn pipedream_experiment(module: &str, config: &str, logs: &Path) -> String {
    format!(
        "machines: [localhost, localhost]\nmodule: {module}\nconfig_file: {config}\n\
         batch_size: 8\nschedule: 1f1b\nmicrobatches: 2\nlog_directory: {}\n",
        logs.display()
    )
}

const VGG16_CONF: &str = "models/vgg16/gpus=2/hybrid_conf.json";

#[test]
fn a_pipedream_partitioned_model_runs_the_runtimes_modules_with_the_same_split() {
    let dir = tempfile::tempdir().unwrap();
    pipedream_vgg16(dir.path(), 3);
    let logs = dir.path().join("logs");
    let o = options(Some(Backend::Process), ContainerMode::PerRank);
    let plan = resolve(
        &loaded(
            dir.path(),
            &pipedream_experiment("models.vgg16.gpus=2", VGG16_CONF, &logs),
        ),
        &o,
        29500,
    )
    .unwrap();
    let argv = &plan.ranks[0].argv;
    assert_eq!(flag(argv, "--model"), Some("vgg16"));
    let written = Path::new(flag(argv, "--stage-config").unwrap());
    assert!(
        written.is_absolute() && !written.starts_with(&logs),
        "{}",
        written.display()
    );
    let config = StageConfig::from_json(&std::fs::read_to_string(written).unwrap()).unwrap();
    // The runtime's vgg16: ten modules up to the third pool (seven convolutions, three pools) in
    // stage 0; the rest, the flattening avgpool, the classifier and the loss in stage 1.
    let mut expected = vec![0; 10];
    expected.extend([1; 13]);
    assert_eq!(config.module_to_stage_map, expected);
    assert_eq!(config.stage_to_rank_map["0"], vec![0]);
    assert_eq!(
        config.stage_to_depth_map,
        Some([("0".to_string(), 1), ("1".to_string(), 0)].into())
    );
    // The same file resolves to the same path.
    let again = resolve(
        &loaded(
            dir.path(),
            &pipedream_experiment("models.vgg16.gpus=2", VGG16_CONF, &logs),
        ),
        &o,
        29500,
    )
    .unwrap();
    assert_eq!(
        flag(&again.ranks[0].argv, "--stage-config"),
        Some(written.to_str().unwrap())
    );
}

#[test]
fn a_pipedream_split_the_runtimes_modules_cannot_make_names_the_layer() {
    let o = options(Some(Backend::Process), ContainerMode::PerRank);
    let resolve_in = |dir: &Path, module: &str, config: &str| {
        resolve(
            &loaded(dir, &pipedream_experiment(module, config, &dir.join("logs"))),
            &o,
            29500,
        )
        .unwrap_err()
        .to_string()
    };
    // vgg16_bn's convolutions each come with a batch norm, which PipeDream's vgg16 files lack.
    let dir = tempfile::tempdir().unwrap();
    pipedream_vgg16(dir.path(), 3);
    std::fs::rename(
        dir.path().join("models/vgg16"),
        dir.path().join("models/vgg16_bn"),
    )
    .unwrap();
    let e = resolve_in(
        dir.path(),
        "models.vgg16_bn.gpus=2",
        "models/vgg16_bn/gpus=2/hybrid_conf.json",
    );
    assert!(e.contains("do not line up"), "{e}");
    assert!(e.contains("holds BatchNorm2d(64)"), "{e}");
    assert!(e.contains("stage0.py:"), "{e}");
    // A stage module whose layers are cut mid-way through the runtime's module: a convolution
    // moved from stage 1 to stage 0 leaves stage 1's first module short.
    let dir = tempfile::tempdir().unwrap();
    pipedream_vgg16(dir.path(), 3);
    let folder = dir.path().join("models/vgg16/gpus=2");
    let mut first = std::fs::read_to_string(folder.join("stage0.py")).unwrap();
    first = first.replace(
        "    def forward",
        "        self.layer99 = torch.nn.Linear(in_features=4096, out_features=1000, bias=True)\n\n    def forward",
    );
    std::fs::write(folder.join("stage0.py"), first).unwrap();
    let e = resolve_in(dir.path(), "models.vgg16.gpus=2", VGG16_CONF);
    assert!(e.contains("stage0.py:"), "{e}");
    assert!(e.contains("Linear(4096, 1000)"), "{e}");
    // No folder: where it was looked for, and what to do instead.
    let empty = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(empty.path().join("models/vgg16/gpus=2")).unwrap();
    std::fs::write(
        empty.path().join("models/vgg16/gpus=2/hybrid_conf.json"),
        r#"{"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    let e = resolve_in(empty.path(), "models.vgg16.gpus=2", VGG16_CONF);
    assert!(e.contains("__init__.py (PipeDream's partitioned model)"), "{e}");
    let e = resolve_in(empty.path(), "models.vgg16.gpus=8", VGG16_CONF);
    assert!(
        e.contains("models/vgg16/gpus=8 is neither next to the experiment file"),
        "{e}"
    );
    assert!(e.contains("module: vgg16"), "{e}");
}

#[test]
fn pipedreams_container_is_the_base_the_runtime_image_is_built_on() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let image_mode = Options {
        runtime: None,
        source: Some(workspace.clone()),
        ..options(None, ContainerMode::PerRank)
    };
    let text = "machines: [localhost]\nmodule: mlp\ncontainer: nvcr.io/nvidia/pytorch:19.05-py3\n";
    let plan = resolve_text(text, &image_mode).unwrap();
    let ImageSource::Base { name, build } = &plan.image else {
        panic!("{:?}", plan.image)
    };
    assert_eq!(name, "nvcr.io/nvidia/pytorch:19.05-py3");
    assert_eq!(build.args["BASE_IMAGE"], *name);
    assert_eq!(build.context, workspace);
    assert!(build.repository.starts_with("stagehand-runtime-"), "{build:?}");
    // The user's own program, or this machine's runtime copied in: the image as it is.
    let own =
        "machines: [localhost]\ncontainer: nvcr.io/nvidia/pytorch:19.05-py3\ncommand: [python3, train.py]\n";
    assert_eq!(
        resolve_text(own, &image_mode).unwrap().image,
        ImageSource::Named("nvcr.io/nvidia/pytorch:19.05-py3".into())
    );
    let dev = options(None, ContainerMode::PerRank);
    assert_eq!(
        resolve_text(text, &dev).unwrap().image,
        ImageSource::Named("nvcr.io/nvidia/pytorch:19.05-py3".into())
    );
}

/// A restart that resumes gives every rank `--resume=auto` (from the newest checkpoint every rank
/// holds, afresh if a rank holds none) in place of the file's own setting, once; one that does
/// not keeps the ranks' commands as they were. `--max-restarts` overrides the file's
/// `max_restarts`.
#[test]
fn a_restart_resumes_every_rank_from_its_checkpoint_and_the_flag_overrides_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(None, ContainerMode::PerRank);
    for resume in ["", "resume: auto\n", "resume: true\n", "resume: false\n"] {
        let text = format!(
            "machines: [localhost, localhost]\nmodule: mlp\ncheckpoint_dir: ckpt\n{resume}max_restarts: 2\n"
        );
        let plan = resolve(&loaded(dir.path(), &text), &o, 29500).unwrap();
        assert_eq!(plan.max_restarts, 2);
        let resumed = plan.restarted(true);
        let afresh = plan.restarted(false);
        for (rank, first) in plan.ranks.iter().enumerate() {
            let argv = &resumed.ranks[rank].argv;
            let given: Vec<&String> = argv.iter().filter(|a| a.starts_with("--resume")).collect();
            assert_eq!(given, ["--resume=auto"], "{resume:?}: {argv:?}");
            let kept: Vec<&String> = argv.iter().filter(|a| !a.starts_with("--resume")).collect();
            let before: Vec<&String> = first.argv.iter().filter(|a| !a.starts_with("--resume")).collect();
            assert_eq!(kept, before, "{resume:?}: nothing else changes");
            assert_eq!(afresh.ranks[rank].argv, first.argv, "{resume:?}");
        }
    }
    o.max_restarts = Some(0);
    let text = "machines: [localhost]\nmodule: mlp\nmax_restarts: 2\n";
    assert_eq!(
        resolve(&loaded(dir.path(), text), &o, 29500)
            .unwrap()
            .max_restarts,
        0
    );
}

/// `validate_every` and `validation_batches` reach every rank as the runtime's flags; a size
/// without the passes it sizes is refused where it is written.
#[test]
fn validation_passes_reach_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let o = options(None, ContainerMode::PerRank);
    let text = "machines: [localhost, localhost]\nmodule: mlp\nvalidate_every: 5\nvalidation_batches: 2\n";
    let plan = resolve(&loaded(dir.path(), text), &o, 29500).unwrap();
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--validate-every"), Some("5"));
        assert_eq!(flag(&rank.argv, "--validation-batches"), Some("2"));
    }
    let plain = resolve(
        &loaded(dir.path(), "machines: [localhost]\nmodule: mlp\n"),
        &o,
        29500,
    )
    .unwrap();
    assert!(!plain.ranks[0].argv.iter().any(|a| a.starts_with("--validat")));
    let e = resolve_text("machines: [localhost]\nvalidation_batches: 2\n", &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("exp.yml:2:1") && e.contains("add `validate_every: N`"),
        "{e}"
    );
}

#[test]
fn a_checkpoint_folder_reaches_every_rank_and_outlives_its_containers() {
    let dir = tempfile::tempdir().unwrap();
    let o = options(None, ContainerMode::PerRank);
    let text = "machines: [localhost, localhost]\nmodule: mlp\ncheckpoint_dir: ckpt\ncheckpoint_every: 5\nresume: true\n";
    let plan = resolve(&loaded(dir.path(), text), &o, 29500).unwrap();
    let folder = dir.path().join("ckpt");
    for rank in &plan.ranks {
        assert_eq!(
            flag(&rank.argv, "--checkpoint-dir"),
            Some(folder.to_str().unwrap())
        );
        assert_eq!(flag(&rank.argv, "--checkpoint-every"), Some("5"));
        assert!(rank.argv.contains(&"--resume".to_string()));
    }
    // `auto`: from the checkpoint if there is one; `false`: no flag.
    for (resume, flag) in [("auto", Some("--resume=auto")), ("false", None)] {
        let text = text.replace("resume: true", &format!("resume: {resume}"));
        let plan = resolve(&loaded(dir.path(), &text), &o, 29500).unwrap();
        let given: Vec<&str> = plan.ranks[0]
            .argv
            .iter()
            .map(String::as_str)
            .filter(|a| a.starts_with("--resume"))
            .collect();
        assert_eq!(given, flag.into_iter().collect::<Vec<_>>(), "resume: {resume}");
    }
    // Bind-mounted at the same path, read-write, and made by the engine where it is missing.
    let mount = plan
        .mounts
        .iter()
        .find(|m| m.mount.source == folder)
        .expect("the checkpoint folder is mounted");
    assert_eq!(mount.mount.target, folder);
    assert!(!mount.mount.read_only && mount.mount.create);
    assert_eq!(mount.when_missing, WhenMissing::Create);
    for (text, key) in [
        ("resume: true\n", "resume"),
        ("checkpoint_every: 2\n", "checkpoint_every"),
        (
            "checkpoint_dir: ckpt\ncommand: [python3, train.py]\n",
            "checkpoint_dir",
        ),
        ("checkpoint_dir: 'ck:pt'\n", "ck:pt"),
    ] {
        let e = resolve_text(&format!("machines: [localhost]\n{text}"), &o)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("`{key}`")), "{text}: {e}");
    }
}

#[test]
fn slurm_ranks_share_one_command_that_reads_its_place_from_slurm() {
    let plan = resolve_text(
        "backend: slurm\nslurm: {nodes: 2, tasks_per_node: 2, gpus_per_task: 1}\nmodule: mlp\n\
         config_file: two.json\nslowdown: [{rank: 3, factor: 2}]\nenv: {NCCL_DEBUG: INFO}\n",
        &options(None, ContainerMode::PerRank),
    )
    .unwrap_err()
    .to_string();
    // A two-stage config over two ranks, but the job has four.
    assert!(
        plan.contains("slurm.nodes x slurm.tasks_per_node give 4 ranks"),
        "{plan}"
    );

    let plan = resolve_text(
        "backend: slurm\nslurm: {nodes: 2, tasks_per_node: 2, gpus_per_task: 1}\nmodule: mlp\n\
         slowdown: [{rank: 3, factor: 2}]\nenv: {NCCL_DEBUG: INFO}\n",
        &options(None, ContainerMode::PerRank),
    )
    .unwrap();
    assert_eq!(plan.world_size(), 4);
    assert_eq!(plan.hosts.len(), 2, "one placeholder per node");
    assert_eq!(plan.ranks[3].host, 1, "srun's block distribution");
    let argv = &plan.ranks[0].argv;
    assert!(
        plan.ranks.iter().all(|r| &r.argv == argv),
        "one command for all tasks"
    );
    assert_eq!(flag(argv, "--launcher"), Some("slurm"));
    assert_eq!(flag(argv, "--world-size"), Some("4"));
    assert_eq!(
        flag(argv, "--device"),
        Some("cuda"),
        "GPUs asked of Slurm mean CUDA"
    );
    assert_eq!(flag(argv, "--slowdown"), Some("3=2"));
    for absent in ["--rank", "--master-addr", "--master-port", "--local-rank"] {
        assert_eq!(flag(argv, absent), None, "{absent} is Slurm's to give");
    }
    assert_eq!(plan.ranks[0].env.get("RANK"), None);
    assert_eq!(plan.ranks[0].env["NCCL_DEBUG"], "INFO");

    let mut chosen = options(None, ContainerMode::PerRank);
    chosen.master_port = Some(4100);
    let plan = resolve_text("backend: slurm\nmodule: mlp\n", &chosen).unwrap();
    // The caller resolves with the user's port (resolve_text's 29500 here).
    assert_eq!(flag(&plan.ranks[0].argv, "--master-port"), Some("29500"));
    assert_eq!(flag(&plan.ranks[0].argv, "--device"), Some("cpu"));
}

#[test]
fn slurm_refuses_what_it_would_ignore() {
    let o = options(None, ContainerMode::PerRank);
    for (text, says) in [
        (
            "backend: slurm\nmachines: [localhost]\nmodule: mlp\n",
            "Slurm places the ranks",
        ),
        ("backend: slurm\ncommand: [echo]\n", "does not set"),
        (
            "backend: slurm\nmaster_addr: n1\nmodule: mlp\n",
            "remove `master_addr`",
        ),
        (
            "backend: slurm\nslurm: {nodes: 0}\nmodule: mlp\n",
            "nodes must be at least 1",
        ),
        (
            "backend: slurm\nslurm: {options: ['--nodes=3']}\nmodule: mlp\n",
            "sets itself",
        ),
        (
            "backend: slurm\nslowdown: [{host: slurm-node-0, factor: 2}]\nmodule: mlp\n",
            "names a `rank`",
        ),
        (
            "machines: [localhost]\nslurm: {nodes: 1}\nmodule: mlp\n",
            "only with `backend: slurm`",
        ),
    ] {
        let e = match resolve_text(text, &o) {
            Err(e) => format!("{e}: {}", crate::error::error_chain(&e)),
            Ok(_) => panic!("{text} resolved"),
        };
        assert!(e.contains(says), "{text}: {e}");
    }
}

#[test]
fn deterministic_reaches_every_rank_and_is_refused_with_a_command() {
    let plan = plan_per_rank("machines: [localhost, localhost]\nmodule: mlp\ndeterministic: true\n");
    for rank in &plan.ranks {
        assert!(
            rank.argv.iter().any(|a| a == "--deterministic"),
            "{:?}",
            rank.argv
        );
    }
    let plan = plan_per_rank("machines: [localhost]\nmodule: mlp\ndeterministic: false\n");
    assert!(!plan.ranks[0].argv.iter().any(|a| a == "--deterministic"));
    let bad = resolve_text(
        "machines: [localhost]\ncommand: [python, train.py]\ndeterministic: true\n",
        &options(None, ContainerMode::PerRank),
    )
    .map(|_| ())
    .unwrap_err()
    .to_string();
    assert!(
        bad.contains("exp.yml:3") && bad.contains("`deterministic` is the runtime's"),
        "{bad}"
    );
}

/// A runtime switch the YAML turns on with `key: true`: `flag` on every rank's command line and
/// on none without it; refused beside `deterministic` (at the key's line, saying why) and beside
/// `command:` (the ranks are not the runtime).
fn a_switch_reaches_every_rank_and_is_refused_beside_deterministic(key: &str, flag: &str) {
    let plan = plan_per_rank(&format!(
        "machines: [localhost, localhost]\nmodule: vgg16\n{key}: true\n"
    ));
    for rank in &plan.ranks {
        assert!(rank.argv.iter().any(|a| a == flag), "{:?}", rank.argv);
    }
    let plan = plan_per_rank("machines: [localhost]\nmodule: vgg16\n");
    assert!(!plan.ranks[0].argv.iter().any(|a| a == flag));
    let refuse = |text: &str| {
        resolve_text(text, &options(None, ContainerMode::PerRank))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let both = refuse(&format!(
        "machines: [localhost]\nmodule: vgg16\ndeterministic: true\n{key}: true\n"
    ));
    assert!(
        both.contains("exp.yml:4") && both.contains("`deterministic` rules that out"),
        "{both}"
    );
    let command = refuse(&format!(
        "machines: [localhost]\ncommand: [python, train.py]\n{key}: true\n"
    ));
    assert!(
        command.contains("exp.yml:3") && command.contains(&format!("`{key}` is the runtime's")),
        "{command}"
    );
}

#[test]
fn fused_kernels_reach_every_rank_and_are_refused_beside_deterministic() {
    a_switch_reaches_every_rank_and_is_refused_beside_deterministic("fused_kernels", "--fused-kernels");
}

#[test]
fn cudnn_benchmark_reaches_every_rank_and_is_refused_beside_deterministic() {
    a_switch_reaches_every_rank_and_is_refused_beside_deterministic("cudnn_benchmark", "--cudnn-benchmark");
}

#[test]
fn an_image_folders_transform_and_loader_threads_reach_every_rank() {
    let plan = plan_per_rank(
        "machines: [localhost, localhost]\nmodule: resnet50\ndata_dir: imagenet/train\naugment: none\ndata_workers: 6\n",
    );
    for rank in &plan.ranks {
        assert_eq!(flag(&rank.argv, "--augment"), Some("none"));
        assert_eq!(flag(&rank.argv, "--data-workers"), Some("6"));
    }
    let plan = plan_per_rank("machines: [localhost]\nmodule: resnet50\ndata_dir: imagenet/train\n");
    assert_eq!(
        flag(&plan.ranks[0].argv, "--augment"),
        None,
        "the runtime's default"
    );
    assert_eq!(flag(&plan.ranks[0].argv, "--data-workers"), None);
    for (text, line, says) in [
        ("data_workers: 0\n", 3, "nonzero"),
        ("augment: random\n", 3, "`crop-flip`"),
        (
            "command: [python, train.py]\ndata_workers: 2\n",
            4,
            "`data_workers` is the runtime's",
        ),
    ] {
        let bad = refusal(&format!("machines: [localhost]\nmodule: mlp\n{text}"));
        assert!(
            bad.contains(&format!("exp.yml:{line}")) && bad.contains(says),
            "{text}: {bad}"
        );
    }
}

#[test]
fn each_rank_traces_into_its_container_or_straight_into_the_record() {
    let text = "machines: [localhost, localhost]\nmodule: mlp\nprofiler_trace: true\n";
    let record = tempfile::tempdir().unwrap();
    let mut docker = plan_per_rank(text);
    docker.keep_traces_in(record.path());
    let mut process = resolve_text(text, &options(Some(Backend::Process), ContainerMode::PerRank)).unwrap();
    // Checked before the record exists with a folder where records go; written into the record's.
    // One path for every rank, each replacing `{rank}` (Slurm's tasks share one argument vector).
    assert_eq!(
        flag(&process.ranks[1].argv, "--profiler-trace").map(PathBuf::from),
        Some(absolute(Path::new(
            "experiments/<UTC time>_exp/traces/rank-{rank}.json"
        )))
    );
    process.keep_traces_in(record.path());
    let kept = record.path().join("traces");
    for rank in 0..2 {
        assert_eq!(
            flag(&docker.ranks[rank].argv, "--profiler-trace"),
            Some("/tmp/stagehand-traces/rank-{rank}.json"),
            "in the container, whence the driver copies it"
        );
        assert_eq!(
            flag(&process.ranks[rank].argv, "--profiler-trace").map(PathBuf::from),
            Some(kept.join("rank-{rank}.json"))
        );
        let once = process.ranks[rank]
            .argv
            .iter()
            .filter(|a| *a == "--profiler-trace")
            .count();
        assert_eq!(once, 1);
    }
    for plan in [&docker, &process] {
        assert_eq!(plan.traces_dir.as_deref(), Some(kept.as_path()));
    }
    // A restart keeps them where they were.
    let again = process.restarted(true);
    assert_eq!(again.ranks[0].argv, {
        let mut argv = process.ranks[0].argv.clone();
        argv.push("--resume=auto".into());
        argv
    });

    let mut plain = plan_per_rank("machines: [localhost]\nmodule: mlp\n");
    assert!(!plain.profiler_trace);
    plain.keep_traces_in(record.path());
    assert_eq!(plain.traces_dir, None, "nothing to gather");
    assert_eq!(flag(&plain.ranks[0].argv, "--profiler-trace"), None);
    let command = resolve_text(
        "machines: [localhost]\ncommand: [python, train.py]\nprofiler_trace: true\n",
        &options(None, ContainerMode::PerRank),
    )
    .unwrap_err()
    .to_string();
    assert!(
        command.contains("exp.yml:3") && command.contains("`profiler_trace` is the runtime's"),
        "{command}"
    );
    // How many iterations it records: passed on beside the trace, and refused without one or
    // at 0, at its line.
    let steps =
        plan_per_rank("machines: [localhost]\nmodule: mlp\nprofiler_trace: true\nprofiler_steps: 20\n");
    assert_eq!(flag(&steps.ranks[0].argv, "--profiler-steps"), Some("20"));
    assert_eq!(
        flag(&docker.ranks[0].argv, "--profiler-steps"),
        None,
        "the runtime's default"
    );
    for (text, says) in [
        ("profiler_steps: 20\n", "add `profiler_trace: true` or drop it"),
        (
            "profiler_trace: false\nprofiler_steps: 20\n",
            "add `profiler_trace: true` or drop it",
        ),
        ("profiler_trace: true\nprofiler_steps: 0\n", "nonzero"),
    ] {
        let text = format!("machines: [localhost]\nmodule: mlp\n{text}");
        let err = refusal(&text);
        let line = text.lines().count();
        assert!(
            err.contains(&format!("exp.yml:{line}")) && err.contains(says),
            "{text}: {err}"
        );
    }
}

/// What a user's editor or indentation can slip into a file: a byte-order mark is read past, an
/// `env:` name a process cannot take and two NCCL ranks on one GPU are refused at their key's
/// line, and a negative value reaches the runtime as a value, not as a flag.
#[test]
fn a_bom_bad_env_names_shared_gpus_and_negative_values_are_handled() {
    let dir = tempfile::tempdir().unwrap();
    let l = loaded(dir.path(), "\u{feff}module: mlp\nmachines: [localhost]\n");
    assert_eq!(l.file.module.as_deref(), Some("mlp"));
    assert_eq!(l.locate("module").map(|at| at.line), Some(1));

    for name in ["BAD=KEY", "", "with space"] {
        let text = format!("machines: [localhost]\nmodule: mlp\nenv: {{{name:?}: '1'}}\n");
        let e = refusal(&text);
        assert!(
            e.contains("exp.yml:3:1") && e.contains("is not an environment variable's name"),
            "{name:?}: {e}"
        );
    }
    // What the driver gives each rank itself is not the file's to set: it would be overridden.
    for name in ["RANK", "MASTER_PORT"] {
        let text = format!("machines: [localhost]\nmodule: mlp\nenv: {{{name}: '1'}}\n");
        let e = refusal(&text);
        assert!(
            e.contains("exp.yml:3:1")
                && e.contains(&format!(
                    "env sets {name}, which the driver gives each rank itself"
                )),
            "{name}: {e}"
        );
    }

    let shared = "machines: ['node1:0', 'node1:1', 'node1:0']\nmodule: mlp\n";
    let e = refusal(shared);
    assert!(
        e.contains("exp.yml:1:1")
            && e.contains("ranks 0 and 2 both get GPU 0 of `node1`, and NCCL refuses two ranks on one GPU"),
        "{e}"
    );
    let o = options(None, ContainerMode::PerRank);
    resolve_text(&format!("{shared}distributed_backend: gloo\n"), &o).unwrap();
    resolve_text("machines: ['node1:0', 'node2:0']\nmodule: mlp\n", &o).unwrap();

    let plan = plan_per_rank("machines: [localhost]\nmodule: mlp\nlr: -0.5\ndata_dir: -data\n");
    let argv = &plan.ranks[0].argv;
    assert!(argv.contains(&"--lr=-0.5".to_string()), "{argv:?}");
    // A data folder is given whole, so it never reads as a flag.
    assert!(
        flag(argv, "--data").is_some_and(|d| d.starts_with('/') && d.ends_with("/-data")),
        "{argv:?}"
    );
    assert_eq!(flag(argv, "--batch-size"), None);
}

/// The runtime's refusal names its flag; the check adds the experiment key behind it and the
/// line it is written on, aliases included, and nothing for a flag the file does not write.
#[test]
fn a_refusal_names_the_key_and_line_behind_its_flag() {
    use crate::experiment::key_of_flag;
    assert_eq!(key_of_flag("lr"), "learning_rate");
    assert_eq!(key_of_flag("batch-size"), "batch_size");
    assert_eq!(key_of_flag("stage-config"), "config_file");
    let dir = tempfile::tempdir().unwrap();
    let l = loaded(dir.path(), "machines: [localhost]\nmodel: mlp\nlr: 0\n");
    assert_eq!(l.locate("learning_rate").map(|at| at.line), Some(3));
    assert_eq!(l.locate("module").map(|at| at.line), Some(2));
    assert_eq!(l.locate("batch_size"), None);
}

/// Every runtime flag the driver writes from a key maps back to that key ([`key_of_flag`]), so a
/// refusal naming the flag is located at the key: the table of renamed flags cannot drift from
/// the flags written without a test failing. The flags the driver adds of its own (a rank's
/// place, its device) have no key.
#[test]
fn every_flag_written_from_a_key_maps_back_to_a_key() {
    use crate::experiment::key_of_flag;
    let driver_own = [
        "rank",
        "world-size",
        "master-addr",
        "master-port",
        "local-rank",
        "device",
    ];
    let experiments = [
        "machines: [localhost, localhost]\nmodule: mlp\nlayers: 2\nhidden: 8\nimage_size: 8\n\
         num_classes: 10\nbatch_size: 8\niterations: 3\nlearning_rate: 0.1\n\
         learning_rate_policy: step\noptimizer: adam\nseed: 1\nweight_decay: 0.0001\n\
         threads: 1\nprecision: bf16\nconfig_file: two.json\nschedule: gpipe\nmicrobatches: 2\n\
         distributed_backend: gloo\ncheckpoint_dir: ckpt\ncheckpoint_every: 1\n\
         validate_every: 1\nvalidation_batches: 1\ncompress_activations: true\n\
         deterministic: true\nprofiler_trace: true\nprofiler_steps: 2\nhost_memory: keep\n\
         bucket_mb: 5\ncompress: auto\nslowdown: [{rank: 1, factor: 2}]\ndata_dir: images\n\
         data_workers: 2\n",
        "machines: [localhost, localhost]\nmodule: vgg16\nchannels_last: true\ncudnn_benchmark: true\n\
         epochs: 1\nepoch_samples: 64\nlr_warmup_epochs: 1\nreduce: 'partial:1'\nsync_every: 2\n\
         overlap_reduce: 'off'\nprecision: fp16\nfp16_init_scale: 1024\n",
    ];
    let scratch = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for text in experiments {
        let plan = plan_per_rank(text);
        for arg in &plan.ranks[1].argv[1..] {
            let Some(name) = arg.strip_prefix("--") else {
                continue;
            };
            let name = name.split('=').next().unwrap();
            if driver_own.contains(&name) {
                continue;
            }
            let key = key_of_flag(name);
            let path = scratch.path().join("one-key.yml");
            std::fs::write(&path, format!("machines: [localhost]\n{key}: 1\n")).unwrap();
            let said = match crate::config::load(&path) {
                Ok(_) => String::new(),
                Err(e) => crate::error::error_chain(&e),
            };
            assert!(
                !said.contains("unknown field"),
                "--{name} maps to `{key}`: {said}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} flags written");
}

/// A data folder, with a format prefix or without, is given to every rank whole (absolute, the
/// prefix kept) and mounted at the same path whether or not it is on this machine: the data may
/// live on the hosts alone, and preflight names a host that lacks it.
#[test]
fn a_data_folder_is_mounted_and_given_whole_whatever_its_format() {
    let folder_of = |plan: &Experiment| -> Vec<PathBuf> {
        plan.mounts
            .iter()
            .filter(|m| m.when_missing == WhenMissing::Fail && m.mount.read_only)
            .map(|m| m.mount.source.clone())
            .collect()
    };
    for (data, prefix) in [
        ("cifar10:/srv/cifar", "cifar10:"),
        ("imagefolder:/srv/imagenet", "imagefolder:"),
        ("/srv/imagenet", ""),
    ] {
        let plan = plan_per_rank(&format!(
            "machines: [localhost, localhost]\nmodule: resnet50\ndata_dir: '{data}'\n"
        ));
        for rank in &plan.ranks {
            assert_eq!(flag(&rank.argv, "--data"), Some(data));
        }
        let folder = PathBuf::from(&data[prefix.len()..]);
        assert_eq!(folder_of(&plan), std::slice::from_ref(&folder), "{data}");
        assert_eq!(plan.mounts[0].mount.target, folder);
    }
    // A relative folder is the experiment file's neighbour.
    let plan = plan_per_rank("machines: [localhost]\nmodule: resnet50\ndata_dir: cifar10:data/cifar\n");
    let given = flag(&plan.ranks[0].argv, "--data").unwrap();
    let folder = Path::new(given.strip_prefix("cifar10:").unwrap());
    assert!(folder.is_absolute() && folder.ends_with("data/cifar"), "{given}");
    assert_eq!(folder_of(&plan), [folder.to_path_buf()]);
    // Synthetic data is nowhere.
    let plan = plan_per_rank("machines: [localhost]\nmodule: mlp\ndata_dir: synthetic\n");
    assert_eq!(flag(&plan.ranks[0].argv, "--data"), Some("synthetic"));
    assert!(folder_of(&plan).is_empty());
}

/// A flag's value is read back in either form the arguments are written in.
#[test]
fn a_flags_value_is_read_back_in_either_form() {
    let argv: Vec<String> = ["runtime", "--layers", "6", "--lr=-0.5", "--hidden"]
        .map(String::from)
        .to_vec();
    assert_eq!(flag_value(&argv, "--layers"), Some("6"));
    assert_eq!(flag_value(&argv, "--lr"), Some("-0.5"));
    assert_eq!(
        flag_value(&argv, "--hidden"),
        None,
        "a flag with no value after it"
    );
    assert_eq!(flag_value(&argv, "--seed"), None);
}
