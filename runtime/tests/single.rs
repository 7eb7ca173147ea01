//! One process holding the whole model: every model learns, the metrics contract, bad input.

use crate::util::{
    refused, run, run_command, run_ok, runtime, trace_events, trace_steps, words, write_cifar,
    write_image_folder,
};

/// Synthetic data cycles a pool of 4 batches: the first and the last 4 iterations see the same
/// batches, and a model that learns has a lower mean loss on the last pass than on the first.
fn assert_learns(batch_size: &str, iterations: usize, model_args: &[&str]) {
    assert_learns_at("32", batch_size, iterations, model_args)
}

fn assert_learns_at(image_size: &str, batch_size: &str, iterations: usize, model_args: &[&str]) {
    let iterations_text = iterations.to_string();
    let mut args = vec![
        "--batch-size",
        batch_size,
        "--iterations",
        &iterations_text,
        "--image-size",
        image_size,
    ];
    args.extend_from_slice(&[
        "--num-classes",
        "10",
        "--threads",
        "2",
        "--seed",
        "1",
        "--dropout",
        "0",
    ]);
    args.extend_from_slice(model_args);
    let run = run_ok(&args);
    let losses = run.losses();
    assert_eq!(losses.len(), iterations);
    let first: f64 = losses[..4].iter().sum::<f64>() / 4.0;
    let last: f64 = losses[iterations - 4..].iter().sum::<f64>() / 4.0;
    assert!(last < first, "{model_args:?}: loss did not fall: {losses:?}");
    assert!(losses.iter().all(|l| l.is_finite()));
    // Class logits report top-5 beside top-1, at least as high; the transformer's tokens top-1
    // alone.
    let classifies_images = !model_args.contains(&"transformer");
    for i in run.iterations() {
        let top1 = i.accuracy.expect("a single process knows its accuracy");
        match (i.accuracy_top5, classifies_images) {
            (Some(top5), true) => assert!(top1 <= top5, "{model_args:?}: {i:?}"),
            (None, false) => {}
            (top5, _) => panic!("{model_args:?}: top-5 {top5:?} reported for the wrong model"),
        }
    }
}

#[test]
fn mlp_learns() {
    assert_learns("8", 8, &["--model", "mlp", "--lr", "0.01"]);
}

#[test]
fn alexnet_learns() {
    assert_learns_at(
        "64",
        "8",
        8,
        &["--model", "alexnet", "--optimizer", "adam", "--lr", "0.0001"],
    );
}

#[test]
fn vgg16_learns() {
    assert_learns(
        "4",
        8,
        &["--model", "vgg16", "--optimizer", "adam", "--lr", "0.0001"],
    );
}

#[test]
fn vgg16_bn_learns() {
    assert_learns(
        "4",
        8,
        &["--model", "vgg16_bn", "--optimizer", "adam", "--lr", "0.0001"],
    );
}

#[test]
fn resnet50_learns() {
    assert_learns(
        "8",
        8,
        &["--model", "resnet50", "--optimizer", "adam", "--lr", "0.001"],
    );
}

#[test]
fn resnet101_learns() {
    // Deep networks with batch norm on 8 samples are noisy: three passes over the pool, a gentler rate.
    assert_learns(
        "8",
        12,
        &["--model", "resnet101", "--optimizer", "adam", "--lr", "0.0001"],
    );
}

#[test]
fn resnet152_learns() {
    // Deep networks with batch norm on 8 samples are noisy: three passes over the pool, a gentler
    // rate. torchvision's fc init starts the loss at chance (tch's wider one started it above and
    // the first steps only shrank the logits): at 1e-4 twelve steps move the loss less than the
    // batches differ, at 3e-4 the last pass is 0.6 below the first.
    assert_learns(
        "8",
        12,
        &["--model", "resnet152", "--optimizer", "adam", "--lr", "0.0003"],
    );
}

#[test]
fn transformer_learns() {
    assert_learns(
        "8",
        8,
        &[
            "--model",
            "transformer",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--seq-len",
            "16",
            "--vocab-size",
            "100",
            "--optimizer",
            "adam",
            "--lr",
            "0.003",
        ],
    );
}

#[test]
fn metrics_follow_the_contract() {
    let run = run_ok(&[
        "--model",
        "mlp",
        "--iterations",
        "5",
        "--batch-size",
        "16",
        "--warmup",
        "2",
        "--threads",
        "1",
    ]);
    let start = run.start();
    assert_eq!(start.schema_version, stagehand_contract::SCHEMA_VERSION);
    assert_eq!(
        (start.rank, start.world_size, start.stage, start.num_stages),
        (0, 1, 0, 1)
    );
    // mlp: 4 hidden layers, the head, the loss.
    assert_eq!(
        (start.num_modules, start.first_module, start.end_module),
        (6, 0, 6)
    );
    let expected_params = 3072 * 1024 + 1024 + 3 * (1024 * 1024 + 1024) + 1024 * 10 + 10;
    assert_eq!(
        (start.num_params, start.stage_params),
        (expected_params, expected_params)
    );
    assert_eq!(start.config.threads, 1);
    assert_eq!(start.config.batch_size, 16);

    let iterations = run.iterations();
    assert_eq!(
        iterations.iter().map(|i| i.iteration).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    for i in &iterations {
        assert_eq!(i.samples, 16);
        // One process has no peers: nothing of its time is communication, and its compute is a
        // part of the iteration's wall-clock time (the runtime measures both separately).
        assert_eq!(i.comm_wait_s, 0.0, "{i:?}");
        assert!(i.compute_s > 0.0 && i.compute_s <= i.time_s, "{i:?}");
        assert_eq!(i.reduce, Default::default(), "no replicas, no all-reduce: {i:?}");
        assert!((i.samples_per_sec - 16.0 / i.time_s).abs() < 1e-6 * i.samples_per_sec);
        assert!(i.peak_mem_bytes.unwrap() > 0);
    }
    let summary = run.summary();
    assert_eq!((summary.iterations, summary.warmup_iterations), (5, 2));
    assert_eq!(summary.comm_wait_s, 0.0);
    let kept: Vec<f64> = iterations[2..].iter().map(|i| i.samples_per_sec).collect();
    let mean = kept.iter().sum::<f64>() / 3.0;
    assert!((summary.samples_per_sec_mean - mean).abs() < 1e-6 * mean);
    assert_eq!(summary.final_loss, iterations[4].loss);
    assert!(
        run.stderr()
            .contains("rank 0 of 1: stage 0 of 1 (modules 0..6) of mlp"),
        "human text goes to stderr"
    );
}

/// A run of a few seconds at most.
const SHORT_MLP: [&str; 8] = [
    "--model",
    "mlp",
    "--iterations",
    "3",
    "--batch-size",
    "8",
    "--threads",
    "1",
];

/// `--profiler-trace` writes PyTorch's profiler trace of the iterations after the warm-up, each a
/// `ProfilerStep#N` holding that iteration's operators, to the path with `{rank}` replaced, and
/// the `start` event says where; a run with no iteration after the warm-up is refused.
#[test]
fn the_profiler_trace_holds_each_iteration_after_the_warm_up() {
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("traces/rank-{rank}.json");
    let template = template.to_str().unwrap();
    let mlp = ["--model", "mlp", "--batch-size", "8", "--threads", "1"];
    let run = run_ok(
        &[
            &mlp[..],
            &["--iterations", "4", "--warmup", "1", "--profiler-trace", template],
        ]
        .concat(),
    );
    let path = dir.path().join("traces/rank-0.json");
    assert_eq!(run.start().config.profiler_trace.as_deref(), Some(path.as_path()));
    assert_eq!(run.start().config.profiler_steps, Some(5), "the default");
    let events = trace_events(&path);
    // The default 5 steps, cut short where the run ended.
    assert_eq!(
        trace_steps(&events),
        ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    );
    // The mlp's forward is 5 linear layers (4 hidden and the head), one addmm each, and its
    // backward a matrix product for each weight: per traced iteration, and none from the warm-up.
    let count = |name: &str| {
        events
            .iter()
            .filter(|e| e["cat"] == "cpu_op" && e["name"] == name)
            .count()
    };
    assert_eq!(count("aten::addmm"), 5 * 3, "forwards");
    assert!(count("aten::mm") >= 5 * 3, "backwards: {}", count("aten::mm"));
    assert_eq!(count("aten::_fused_sgd_"), 3, "one fused step per iteration");
    // Every operator lies within a step.
    let steps: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e["name"].as_str().unwrap().starts_with("ProfilerStep#"))
        .map(|e| {
            let ts = e["ts"].as_f64().unwrap();
            (ts, ts + e["dur"].as_f64().unwrap())
        })
        .collect();
    for e in events.iter().filter(|e| e["cat"] == "cpu_op") {
        let ts = e["ts"].as_f64().unwrap();
        assert!(
            steps.iter().any(|&(a, b)| a <= ts && ts <= b),
            "{} at {ts} is outside every step {steps:?}",
            e["name"]
        );
    }
    // Each iteration's forward, backward and step are scopes of the trace, in that order.
    let mut parts: Vec<(f64, &str)> = events
        .iter()
        .filter(|e| e["cat"] == "user_annotation")
        .filter_map(|e| {
            let name = e["name"].as_str().unwrap();
            ["forward", "backward", "step"]
                .contains(&name)
                .then(|| (e["ts"].as_f64().unwrap(), name))
        })
        .collect();
    parts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let parts: Vec<&str> = parts.into_iter().map(|(_, name)| name).collect();
    assert_eq!(parts, ["forward", "backward", "step"].repeat(3));
    // The recorded iterations' lines say so; with no other after the warm-up, the summary's
    // throughput is theirs.
    let profiled = |run: &crate::util::Run| -> Vec<u64> {
        run.iterations()
            .iter()
            .filter(|i| i.profiled)
            .map(|i| i.iteration)
            .collect()
    };
    let mean_of = |run: &crate::util::Run, measured: std::ops::Range<usize>| {
        let rates: Vec<f64> = run.iterations()[measured]
            .iter()
            .map(|i| i.samples_per_sec)
            .collect();
        rates.iter().sum::<f64>() / rates.len() as f64
    };
    assert_eq!(profiled(&run), [1, 2, 3]);
    let mean = mean_of(&run, 1..4);
    assert!((run.summary().samples_per_sec_mean - mean).abs() < 1e-6 * mean);
    // Two recorded, and the one after waits on the trace being written: the summary measures
    // the iterations after those.
    let two = dir.path().join("two.json");
    let run = run_ok(
        &[
            &mlp[..],
            &["--iterations", "7", "--warmup", "1", "--profiler-steps", "2"],
            &["--profiler-trace", two.to_str().unwrap()],
        ]
        .concat(),
    );
    assert_eq!(
        trace_steps(&trace_events(&two)),
        ["ProfilerStep#1", "ProfilerStep#2"]
    );
    assert_eq!(profiled(&run), [1, 2, 3]);
    let mean = mean_of(&run, 4..7);
    assert!(
        (run.summary().samples_per_sec_mean - mean).abs() < 1e-6 * mean,
        "{} is not the mean of iterations 4 to 6, {mean}",
        run.summary().samples_per_sec_mean
    );
    // Without the flag nothing is written, the start event says none, and no line is profiled.
    let plain = run_ok(&SHORT_MLP);
    assert_eq!(plain.start().config.profiler_trace, None);
    assert_eq!(plain.start().config.profiler_steps, None);
    assert!(profiled(&plain).is_empty());

    // A path the run cannot write fails it before it trains.
    let blocker = dir.path().join("a-file");
    std::fs::write(&blocker, "").unwrap();
    let unwritable = blocker.join("trace.json");
    let failed = crate::util::run(
        &[
            &mlp[..],
            &[
                "--iterations",
                "2",
                "--profiler-trace",
                unwritable.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert_eq!(failed.output.status.code(), Some(1), "{}", failed.stderr());
    assert!(
        failed.stderr().contains("--profiler-trace: cannot create"),
        "{}",
        failed.stderr()
    );
    assert!(failed.iterations().is_empty(), "failed before training");

    let why = refused(
        &[
            &mlp[..],
            &["--iterations", "2", "--warmup", "2", "--profiler-trace", template],
        ]
        .concat(),
    );
    assert!(
        why.contains("--profiler-trace") && why.contains("--warmup 2") && why.contains("raise --iterations"),
        "{why}"
    );
}

/// `--profiler-steps N` records N iterations after the warm-up, and the trace is written as soon
/// as they have run: a run that is still training has it whole, and keeps it when it dies.
#[test]
fn the_profiler_trace_is_written_once_its_steps_have_run() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    // Far more iterations than the test waits for: it is killed once its trace is written.
    let mut child = runtime()
        .args(["--model", "mlp", "--batch-size", "8", "--threads", "1"])
        .args([
            "--iterations",
            "1000000",
            "--warmup",
            "2",
            "--profiler-steps",
            "2",
        ])
        .arg("--profiler-trace")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its events, read as they come (a full pipe would stall it), by a thread of their own.
    let stdout = child.stdout.take().unwrap();
    let events = std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let start = lines.next().unwrap().unwrap();
        let iterations = lines.map_while(Result::ok).count();
        (start, iterations)
    });
    let (said, lines) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = said.send(line);
        }
    });
    let written = loop {
        match lines.recv_timeout(std::time::Duration::from_secs(300)) {
            Ok(line) if line.contains("profiler trace in") => break line,
            Ok(_) => {}
            Err(e) => {
                let _ = child.kill();
                panic!("no 'profiler trace in' line from the runtime: {e}");
            }
        }
    };
    assert!(written.contains(path.to_str().unwrap()), "{written}");
    // Read while the run goes on: whole, and of the 2 iterations after the 2 of the warm-up.
    let during = std::fs::read(&path).unwrap();
    assert_eq!(
        trace_steps(&trace_events(&path)),
        ["ProfilerStep#2", "ProfilerStep#3"]
    );
    assert!(child.try_wait().unwrap().is_none(), "the run goes on training");
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        during,
        "the trace stays as written"
    );
    let (start, iterations) = events.join().unwrap();
    let start: stagehand_contract::Event = serde_json::from_str(&start).unwrap();
    let stagehand_contract::Event::Start(start) = start else {
        panic!("the first event is not the start: {start:?}");
    };
    assert_eq!(start.config.profiler_steps, Some(2));
    assert!(
        iterations >= 4,
        "the trace was written after iteration 3: {iterations} iterations"
    );

    for (args, said) in [
        (
            &["--profiler-steps", "0", "--profiler-trace", "t.json"][..],
            "--profiler-steps",
        ),
        (&["--profiler-steps", "3"][..], "--profiler-trace"),
    ] {
        let why = refused(&[&["--model", "mlp", "--iterations", "4"][..], args].concat());
        assert!(why.contains(said), "{args:?}: {why}");
    }
}

/// `--host-memory` says what becomes of freed host memory, the `start` event says what was done
/// (the environment's malloc settings win over the flag), and neither changes a number.
#[test]
fn host_memory_is_kept_released_or_left_to_the_environment() {
    let args = SHORT_MLP;
    let with = |extra: &[&str], tunables: Option<&str>| {
        let mut cmd = runtime();
        cmd.args(args).args(extra);
        for name in [
            "GLIBC_TUNABLES",
            "MALLOC_MMAP_MAX_",
            "MALLOC_MMAP_THRESHOLD_",
            "MALLOC_TRIM_THRESHOLD_",
            "MALLOC_TOP_PAD_",
            "MALLOC_ARENA_MAX",
        ] {
            cmd.env_remove(name);
        }
        if let Some(t) = tunables {
            cmd.env("GLIBC_TUNABLES", t);
        }
        let run = run_command(cmd);
        assert!(run.output.status.success(), "{extra:?}: {}", run.stderr());
        (run.start().config.host_memory.clone(), run.losses())
    };
    let (kept, kept_losses) = with(&[], None);
    let (released, released_losses) = with(&["--host-memory", "release"], None);
    let (left, left_losses) = with(&["--host-memory", "keep"], Some("glibc.malloc.trim_threshold=0"));
    assert_eq!(
        (kept.as_str(), released.as_str(), left.as_str()),
        ("keep", "release", "environment")
    );
    assert_eq!(kept_losses, released_losses);
    assert_eq!(kept_losses, left_losses);
    let refused = run(&[&args[..], &["--host-memory", "free"]].concat());
    assert_eq!(refused.output.status.code(), Some(2));
    assert!(refused.stderr().contains("keep") && refused.stderr().contains("release"));
}

/// `--deterministic` is recorded and leaves a CPU run's arithmetic as it was (libtorch's CPU
/// kernels already repeat for a given thread count); a cuBLAS workspace setting under which GPU
/// runs could vary is refused before anything runs, naming the variable and the values that do.
#[test]
fn deterministic_runs_say_so_and_refuse_a_varying_cublas_workspace() {
    let args = [
        "--model",
        "resnet50",
        "--image-size",
        "32",
        "--num-classes",
        "10",
        "--batch-size",
        "4",
        "--iterations",
        "3",
        "--threads",
        "1",
    ];
    let with = |extra: &[&str], workspace: Option<&str>| {
        let mut cmd = runtime();
        cmd.args(args).args(extra);
        match workspace {
            Some(value) => cmd.env("CUBLAS_WORKSPACE_CONFIG", value),
            None => cmd.env_remove("CUBLAS_WORKSPACE_CONFIG"),
        };
        run_command(cmd)
    };
    let plain = with(&[], None);
    let deterministic = with(&["--deterministic"], None);
    let kept = with(&["--deterministic"], Some(":16:8"));
    for (run, what) in [
        (&plain, "plain"),
        (&deterministic, "--deterministic"),
        (&kept, ":16:8"),
    ] {
        assert!(run.output.status.success(), "{what}: {}", run.stderr());
    }
    assert!(!plain.start().config.deterministic);
    assert!(deterministic.start().config.deterministic);
    assert_eq!(plain.losses(), deterministic.losses());
    assert_eq!(plain.losses(), kept.losses());
    let refused = with(&["--deterministic"], Some(":0:0"));
    assert_eq!(refused.output.status.code(), Some(2), "{}", refused.stderr());
    let why = refused.stderr();
    assert!(
        why.contains("--deterministic")
            && why.contains("CUBLAS_WORKSPACE_CONFIG=:0:0")
            && why.contains(":4096:8"),
        "{why}"
    );
    assert!(
        refused.events.is_empty(),
        "refused before training: {:?}",
        refused.events.len()
    );
}

/// `--cudnn-benchmark` is recorded and, on a CPU, where there is no cuDNN to time, changes no
/// result; beside `--deterministic` it is refused before anything runs.
#[test]
fn cudnn_benchmark_is_recorded_and_refused_beside_deterministic() {
    let args =
        words("--model resnet50 --image-size 32 --num-classes 10 --batch-size 4 --iterations 3 --threads 1");
    let plain = run_ok(&args);
    let benchmarked = run_ok(&[&args[..], &["--cudnn-benchmark"]].concat());
    assert!(!plain.start().config.cudnn_benchmark);
    assert!(benchmarked.start().config.cudnn_benchmark);
    assert_eq!(plain.losses(), benchmarked.losses());
    let why = refused(&[&args[..], &["--cudnn-benchmark", "--deterministic"]].concat());
    assert!(
        why.contains("--cudnn-benchmark") && why.contains("--deterministic"),
        "{why}"
    );
}

#[test]
fn same_seed_same_losses_other_seed_other_losses() {
    let args = SHORT_MLP;
    let a = run_ok(&[&args[..], &["--seed", "5"]].concat()).losses();
    let b = run_ok(&[&args[..], &["--seed", "5"]].concat()).losses();
    let c = run_ok(&[&args[..], &["--seed", "6"]].concat()).losses();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn trains_on_cifar_and_image_folder_data() {
    let cifar = tempfile::tempdir().unwrap();
    write_cifar(cifar.path(), 40);
    let spec = format!("cifar10:{}", cifar.path().display());
    let run = run_ok(&[
        "--model",
        "mlp",
        "--data",
        &spec,
        "--iterations",
        "3",
        "--batch-size",
        "16",
    ]);
    assert_eq!(run.start().config.data, spec);
    assert_eq!(run.iterations().len(), 3);
    // An epoch is the dataset once over: 40 images are 2 whole batches of 16.
    let epochs = run_ok(&[
        "--model",
        "mlp",
        "--data",
        &spec,
        "--epochs",
        "2",
        "--batch-size",
        "16",
    ]);
    assert_eq!(epochs.iterations().len(), 4);

    let folder = tempfile::tempdir().unwrap();
    write_image_folder(folder.path(), 3, 4);
    let path = folder.path().to_str().unwrap();
    let run = run_ok(&[
        "--model",
        "resnet50",
        "--data",
        path,
        "--image-size",
        "32",
        "--iterations",
        "2",
        "--batch-size",
        "4",
    ]);
    assert_eq!(run.start().config.data, format!("imagefolder:{path}"));
    // ResNet-50 with the dataset's 3 classes: the fc layer is 2048 x 3 + 3.
    assert_eq!(run.start().num_params, 25_557_032 - 2048 * 997 - 997);
    // ImageNet training's transform, on as many loader threads as PipeDream's (fewer CPUs, fewer).
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert_eq!(run.start().config.augment.as_deref(), Some("crop-flip"));
    assert_eq!(run.start().config.data_workers, Some(cpus.min(4)));
    let chosen = run_ok(&[
        "--model",
        "mlp",
        "--data",
        path,
        "--iterations",
        "2",
        "--batch-size",
        "4",
        "--augment",
        "none",
        "--data-workers",
        "3",
    ]);
    assert_eq!(chosen.start().config.augment.as_deref(), Some("none"));
    assert_eq!(chosen.start().config.data_workers, Some(3));
    assert_eq!(chosen.iterations().len(), 2);
    // Synthetic data has no images to transform, and only an image folder decodes as it goes:
    // the flags are refused there, not ignored. CIFAR-10 is taken as it is unless asked.
    for flag in [["--augment", "none"], ["--data-workers", "2"]] {
        let text = refused(&["--model", "mlp", "--iterations", "1", flag[0], flag[1]]);
        assert!(text.contains(&format!("drop {}", flag[0])), "{text}");
    }
    let text = refused(&["--model", "mlp", "--data", &spec, "--data-workers", "2"]);
    assert!(text.contains("drop --data-workers"), "{text}");
    assert_eq!(epochs.start().config.augment.as_deref(), Some("none"));
    let cropped = run_ok(&[
        "--model",
        "mlp",
        "--data",
        &spec,
        "--iterations",
        "2",
        "--batch-size",
        "16",
        "--augment",
        "crop-flip",
    ]);
    assert_eq!(cropped.start().config.augment.as_deref(), Some("crop-flip"));
    assert_ne!(
        cropped.losses(),
        epochs.losses()[..2],
        "the crops change what the model sees"
    );
    assert_eq!(epochs.start().config.data_workers, None);
}

/// Epochs and PipeDream's learning-rate policies: the run's length follows the epoch, each
/// iteration reports its rate, and the optimizer really steps with it.
#[test]
fn epochs_and_learning_rate_policies_set_each_iterations_rate() {
    let common = [
        "--model",
        "mlp",
        "--batch-size",
        "8",
        "--threads",
        "1",
        "--lr",
        "0.05",
    ];
    // Epochs of 16 samples are 2 iterations of 8; 3 epochs are 6 iterations.
    let step = run_ok(
        &[
            &common[..],
            &[
                "--epochs",
                "3",
                "--epoch-samples",
                "16",
                "--lr-policy",
                "step",
                "--lr-step-epochs",
                "1",
            ],
        ]
        .concat(),
    );
    let rates: Vec<f64> = step.iterations().iter().map(|i| i.lr.unwrap()).collect();
    let expected = [0.05, 0.05, 0.005, 0.005, 0.0005, 0.0005];
    assert_eq!(rates.len(), 6);
    for (got, want) in rates.iter().zip(expected) {
        assert!((got - want).abs() <= 1e-12 * want, "{rates:?}");
    }
    let config = &step.start().config;
    assert_eq!((config.iterations, config.lr_policy.as_str()), (6, "step"));
    assert_eq!(config.epoch_iterations, Some(2));
    // The same run at a constant rate shares the first epoch's losses (the same parameters
    // and data) and parts once the step policy has cut the rate.
    let constant = run_ok(&[&common[..], &["--iterations", "6"]].concat());
    assert!(constant.iterations().iter().all(|i| i.lr == Some(0.05)));
    let (a, b) = (step.losses(), constant.losses());
    assert_eq!(a[..3], b[..3], "iteration 2 reports the loss before its own step");
    assert_ne!(a[3..], b[3..]);
    // A warm-up of one epoch rises linearly: 1/2 then 2/2 of the rate, then polynomial decay
    // over 4 epochs: (1 - 1/4)^2 in epoch 1.
    let warm = run_ok(
        &[
            &common[..],
            &[
                "--epochs",
                "4",
                "--epoch-samples",
                "16",
                "--lr-policy",
                "polynomial",
                "--lr-warmup-epochs",
                "1",
            ],
        ]
        .concat(),
    );
    let rates: Vec<f64> = warm.iterations().iter().map(|i| i.lr.unwrap()).collect();
    for (got, want) in rates
        .iter()
        .zip([0.025, 0.05, 0.05 * 0.5625, 0.05 * 0.5625, 0.05 * 0.25])
    {
        assert!((got - want).abs() <= 1e-12, "{rates:?}");
    }
    // With synthetic data and no --epoch-samples an epoch is PipeDream's 1000000 samples.
    let pipedream = run_ok(&[&common[..], &["--iterations", "2", "--lr-policy", "exponential"]].concat());
    assert_eq!(pipedream.start().config.epoch_iterations, Some(125_000));
}

/// Each bad argument exits 2 with one stderr line that names what to change.
#[test]
fn bad_arguments_give_one_line_reasons() {
    let cifar = tempfile::tempdir().unwrap();
    write_cifar(cifar.path(), 10);
    let cifar_spec = format!("cifar10:{}", cifar.path().display());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--model", "inception_v3"],
            "--model: unknown model \"inception_v3\"",
        ),
        (
            vec!["--model", "alexnet", "--image-size", "32"],
            "--image-size: alexnet needs images of at least 63 pixels",
        ),
        (
            vec!["--model", "mlp", "--batch-size", "0"],
            "--batch-size: must be at least 1",
        ),
        (
            vec!["--model", "mlp", "--device", "gpu"],
            "--device: \"gpu\" is not cpu, cuda or cuda:N",
        ),
        (
            vec!["--model", "mlp", "--lr=-1"],
            "--lr: -1 is not a positive number",
        ),
        (
            vec!["--model", "mlp", "--data", "/no/such/data"],
            "\"/no/such/data\" is not `synthetic`",
        ),
        (
            vec!["--model", "mlp", "--data", &cifar_spec, "--num-classes", "5"],
            "fewer than the 10 classes",
        ),
        (
            vec!["--model", "mlp", "--optimizer", "lbfgs"],
            "invalid value 'lbfgs' for '--optimizer",
        ),
        (vec!["--iterations", "3"], "--model"),
        (
            vec!["--model", "mlp", "--bucket-mb", "0"],
            "--bucket-mb: 0 is not a positive size",
        ),
        (
            vec!["--model", "mlp", "--bucket-mb=-2"],
            "--bucket-mb: -2 is not a positive size",
        ),
        (
            vec!["--model", "mlp", "--epochs", "1", "--iterations", "3"],
            "'--epochs <EPOCHS>' cannot be used with '--iterations <ITERATIONS>'",
        ),
        (
            vec![
                "--model",
                "mlp",
                "--epochs",
                "1",
                "--epoch-samples",
                "10",
                "--batch-size",
                "16",
            ],
            "--epoch-samples: an epoch of 10 samples holds no whole batch of 16",
        ),
        (
            vec!["--model", "mlp", "--lr-policy", "cosine"],
            "invalid value 'cosine' for '--lr-policy",
        ),
        (
            vec!["--model", "mlp", "--lr-policy", "step", "--lr-step-factor", "0"],
            "--lr-step-factor: 0 is not a positive number",
        ),
        (
            vec!["--model", "mlp", "--comm-timeout", "1e30"],
            "--comm-timeout: 1000000000000000000000000000000 s is longer than the 10000000 s",
        ),
        // What the plan's check refuses is a bad argument in a run too, as under --check.
        (
            vec!["--model", "mlp", "--batch-size", "8", "--microbatches", "3"],
            "--batch-size 8 is not divisible by --microbatches 3",
        ),
        (
            vec!["--model", "mlp", "--world-size", "3", "--batch-size", "32"],
            "--batch-size 32 is not divisible by --microbatches 3 (--microbatches defaults to the 3 \
             replicas of a stage",
        ),
    ];
    for (args, expected) in cases {
        let out = runtime().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: not one line: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: {stderr:?} lacks {expected:?}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: no metrics on a bad argument");
    }
}

#[test]
fn missing_or_malformed_datasets_name_the_path() {
    let out = run(&["--model", "mlp", "--data", "cifar10:/no/such/cifar"]);
    assert_eq!(out.output.status.code(), Some(2));
    assert!(
        out.stderr().contains("/no/such/cifar") && out.stderr().contains("CIFAR-10"),
        "{}",
        out.stderr()
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data_batch_1.bin"), [1u8; 5000]).unwrap();
    let out = run(&[
        "--model",
        "mlp",
        "--data",
        &format!("cifar10:{}", dir.path().display()),
    ]);
    assert_eq!(out.output.status.code(), Some(2));
    assert!(
        out.stderr()
            .contains("data_batch_1.bin: 5000 bytes is not a whole number"),
        "{}",
        out.stderr()
    );
}

#[test]
fn modules_lists_every_module_with_shapes() {
    let out = runtime()
        .args(["modules", "--model", "vgg16", "--image-size", "32"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("features.0"), "{text}");
    assert!(text.contains("classifier.6"));
    assert!(
        text.trim_end()
            .ends_with("23 modules (the loss last), 138357544 parameters"),
        "{text}"
    );

    let out = runtime()
        .args(["modules", "--model", "resnet50", "--json", "--batch-size", "2"])
        .output()
        .unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        rows.len(),
        2 + 16 + 2 + 1,
        "conv1, maxpool, 16 blocks, avgpool, fc, loss"
    );
    assert_eq!(rows[0]["output_shape"], serde_json::json!([2, 64, 112, 112]));
    assert_eq!(rows[rows.len() - 2]["output_shape"], serde_json::json!([2, 1000]));
    let total: u64 = rows.iter().map(|r| r["params"].as_u64().unwrap()).sum();
    assert_eq!(total, 25_557_032);
}

/// `runtime profile` of resnet50 at batch 2 on 32x32 images, one repeat, two threads, with
/// `extra` flags: the profile it wrote.
pub(crate) fn profile_resnet50(extra: &[&str]) -> stagehand_contract::Profile {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("profile.json");
    let out = runtime()
        .args([
            "profile",
            "--model",
            "resnet50",
            "--image-size",
            "32",
            "--batch-size",
            "2",
        ])
        .args([
            "--repeats",
            "1",
            "--threads",
            "2",
            "--output",
            path.to_str().unwrap(),
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    stagehand_contract::Profile::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// What every profile of [`profile_resnet50`] holds, in any arithmetic and on any device:
/// resnet50's 20 modules and the loss, each module's output in `bytes` per element (what would
/// cross a stage boundary), a forward and a backward time (every module but the first trains
/// through its input, and the first has weights), and float32 parameters (autocast casts copies,
/// so replicas all-reduce as many bytes in any arithmetic).
pub(crate) fn assert_profiled_resnet50(profile: &stagehand_contract::Profile, bytes: u64) {
    assert_eq!(
        profile.modules.len(),
        21,
        "conv1, maxpool, 16 blocks, avgpool, fc, loss"
    );
    let (loss, modules) = profile.modules.split_last().unwrap();
    assert_eq!(loss.name, "loss");
    assert_eq!(modules[2].name, "layer1.0");
    assert_eq!(modules[0].output_shape, [2, 64, 16, 16]);
    for m in modules {
        let elements: i64 = m.output_shape.iter().product();
        assert_eq!(m.activation_bytes, elements as u64 * bytes, "{}", m.name);
        assert!(m.forward_s > 0.0 && m.backward_s > 0.0, "{}: {m:?}", m.name);
    }
    assert_eq!(modules.iter().map(|m| m.param_bytes).sum::<u64>(), 25_557_032 * 4);
}

#[test]
fn profile_measures_every_module() {
    let profile = profile_resnet50(&[]);
    assert_eq!(
        (profile.precision.as_str(), profile.channels_last),
        ("fp32", false)
    );
    assert_eq!(
        (profile.model.as_str(), profile.batch_size, profile.threads),
        ("resnet50", 2, 2)
    );
    assert_profiled_resnet50(&profile, 4);
    for m in &profile.modules {
        let elements: i64 = m.output_shape.iter().product();
        // --compress-activations sends a float32 activation in float16.
        assert_eq!(
            m.compressed_activation_bytes,
            Some(elements as u64 * 2),
            "{}",
            m.name
        );
    }
    let loss = profile.modules.last().unwrap();
    assert_eq!(loss.activation_bytes, 4, "one float32");
    assert!(loss.forward_s > 0.0 && loss.backward_s > 0.0, "{loss:?}");
}

/// `--channels-last` on a model without convolutions is warned of in a profile too, as in a run.
#[test]
fn a_profile_warns_of_channels_last_without_convolutions() {
    let out = runtime()
        .args([
            "profile",
            "--model",
            "mlp",
            "--layers",
            "1",
            "--hidden",
            "16",
            "--image-size",
            "8",
        ])
        .args([
            "--batch-size",
            "2",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--channels-last",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("runtime: warning: --channels-last does nothing for mlp, which has no convolutions"),
        "{stderr}"
    );
}

/// A profile for a bf16 channels_last run measures what such a run computes: the activations
/// that would cross a stage boundary are bfloat16 (half a float32's bytes), and the profile says
/// how it computed so the driver can refuse it for a run that computes otherwise.
#[test]
fn profile_measures_in_the_arithmetic_it_is_given() {
    let profile = profile_resnet50(&["--precision", "bf16", "--channels-last"]);
    assert_eq!(
        (profile.precision.as_str(), profile.channels_last),
        ("bf16", true)
    );
    assert_profiled_resnet50(&profile, 2);
    let (_, modules) = profile.modules.split_last().unwrap();
    for m in modules {
        // Compression leaves what is not float32 as it is.
        assert_eq!(
            m.compressed_activation_bytes,
            Some(m.activation_bytes),
            "{}",
            m.name
        );
    }
}

/// Each iteration reports the top-1 and top-5 accuracies of its training samples: shares of the
/// minibatch (whole numbers of its 16 samples, which double arithmetic divides exactly), near
/// chance for the untrained model and every sample once it has learnt the synthetic pool's four
/// batches (images drawn around a prototype per class). Accuracy and loss come from the same
/// logits: a mean cross-entropy L over 16 samples bounds each sample's by 16 L, so where 16 L <
/// ln 2 every sample's class has probability above 1/2, the highest, and both accuracies must be
/// 100%. A sample in the top 1 is in the top 5, and over five classes every sample is. The
/// summary's are the last iteration's.
#[test]
fn accuracy_rises_from_chance_to_every_sample_as_the_model_learns() {
    let mlp = "--model mlp --layers 2 --hidden 64 --image-size 8 --batch-size 16 --threads 1 --seed 3";
    let args: Vec<&str> = mlp
        .split_whitespace()
        .chain(["--lr", "0.05", "--iterations", "40"])
        .collect();
    let run = run_ok(&args);
    let (losses, accuracies, top5) = (run.losses(), run.accuracies(), run.top5_accuracies());
    for ((loss, a), a5) in losses.iter().zip(&accuracies).zip(&top5) {
        for share in [a, a5] {
            assert!((0.0..=1.0).contains(share), "{accuracies:?} {top5:?}");
            assert_eq!(
                (share * 16.0).round() / 16.0,
                *share,
                "a whole number of samples: {accuracies:?} {top5:?}"
            );
        }
        assert!(a <= a5, "top-1 {accuracies:?} against top-5 {top5:?}");
        if 16.0 * loss < std::f64::consts::LN_2 {
            assert_eq!((*a, *a5), (1.0, 1.0), "loss {loss}: {accuracies:?} {top5:?}");
        }
    }
    assert!(
        accuracies[0] <= 0.5,
        "the untrained model guesses: {accuracies:?}"
    );
    assert!(
        losses[36..].iter().all(|l| 16.0 * l < std::f64::consts::LN_2),
        "the pool's batches learnt: {losses:?}"
    );
    assert_eq!(run.summary().final_accuracy, Some(accuracies[39]));
    assert_eq!(run.summary().final_accuracy_top5, Some(top5[39]));

    // Over five classes every target is in the top five, untrained or not, while the untrained
    // model misses some sample's top-1: the two figures are not one.
    let five: Vec<&str> = mlp
        .split_whitespace()
        .chain(["--num-classes", "5", "--lr", "0.05", "--iterations", "3"])
        .collect();
    let run = run_ok(&five);
    assert_eq!(run.top5_accuracies(), [1.0; 3]);
    assert!(run.accuracies()[0] < 1.0, "{:?}", run.accuracies());
}

/// A panic (here libtorch refusing an allocation inside tch) ends the rank with one line saying
/// what failed and, for memory, what to lower, not pages of C++ frames, and exits 1 as a run
/// that failed (not 101, a bug's); `RUST_BACKTRACE` keeps Rust's report. (It was a batch size
/// that wrapped to a negative dimension, now refused.)
#[test]
fn a_panic_is_one_line_unless_a_backtrace_is_asked_for() {
    let args = [
        "--model",
        "mlp",
        "--iterations",
        "1",
        "--threads",
        "1",
        // Sizes each within bounds whose first weight (2^20 x 3 * 2^32) is 54 PB: past any
        // machine's memory and past the address space, so its allocation fails whatever the
        // kernel's overcommit policy, inside tch.
        "--layers",
        "2",
        "--hidden",
        "1048576",
        "--image-size",
        "65536",
    ];
    let out = runtime()
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a run that failed, not a bug: {stderr}"
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("runtime: error: ")
            && last.contains("can't allocate memory")
            && last.ends_with("lower --batch-size or the model's sizes"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("frame #") && !stderr.contains("panicked at"),
        "{stderr}"
    );
    let asked = runtime().args(args).env("RUST_BACKTRACE", "1").output().unwrap();
    assert!(String::from_utf8_lossy(&asked.stderr).contains("panicked at"));
}

/// `runtime reach connect` exits with the contract's code for a name that resolves nowhere, so
/// that the driver's preflight says to change `master_addr:`, not to open the port; a port that
/// nobody answers on is an ordinary failure.
#[test]
fn reach_tells_a_master_name_that_does_not_resolve_from_a_closed_port() {
    use stagehand_contract::exit_codes::{FAILED, UNRESOLVED};
    let connect = |host: &str, port: &str| {
        runtime()
            .args([
                "reach",
                "connect",
                "--host",
                host,
                "--port",
                port,
                "--seconds",
                "0.3",
            ])
            .output()
            .unwrap()
    };
    let out = connect("stagehand-master.invalid", "29500");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(i32::from(UNRESOLVED)), "{stderr}");
    assert!(
        stderr.contains("cannot resolve stagehand-master.invalid"),
        "{stderr}"
    );
    let port = std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let out = connect("127.0.0.1", &port);
    assert_eq!(
        out.status.code(),
        Some(i32::from(FAILED)),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
