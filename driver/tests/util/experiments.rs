//! Experiments of the real runtime that both test binaries run, on the process backend (`local`)
//! and on the local engine (`integration`), and the checks of their records.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{interrupt, lines, local_context, runtime, wait_for_record, Harness, Run};

/// A 2-stage MLP pipeline (gloo over loopback), 3 iterations of GPipe on `backend`.
pub fn two_stage_mlp(h: &Harness, backend: &str) -> PathBuf {
    std::fs::write(
        h.dir.path().join("mlp_2stage.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    h.config(&format!(
        "backend: {backend}\nmachines: [localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: mlp\n\
         config_file: mlp_2stage.json\nschedule: gpipe\nmicrobatches: 2\nbatch_size: 8\niterations: 3\n\
         distributed_backend: gloo\nthreads: 1\n",
        local_context().display()
    ))
}

/// A 2+1 hybrid MLP under PipeDream's schedule with 3 microbatches, which the runtime refuses:
/// they must be a multiple of stage 0's two replicas. `microbatches: 4` (replaced in the file)
/// makes it valid.
pub fn refused_pipedream_mlp(h: &Harness) -> PathBuf {
    std::fs::write(
        h.dir.path().join("mlp_hybrid.json"),
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#,
    )
    .unwrap();
    h.config(&format!(
        "machines: [localhost, localhost, localhost]\ncontainer: {{build: '{}'}}\nmodule: mlp\n\
         config_file: mlp_hybrid.json\nschedule: pipedream\nmicrobatches: 3\nbatch_size: 12\n\
         iterations: 2\ndistributed_backend: gloo\nthreads: 1\n",
        local_context().display()
    ))
}

/// The pipeline ran to the end, and the summary's time shares per stage are what the ranks' own
/// iteration lines in metrics.jsonl say.
pub fn check_pipeline_run(h: &Harness, run: &Run) {
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 3);
    assert!(summary["throughput"]["samples_per_sec_mean"].as_f64().unwrap() > 0.0);
    let stages = summary["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{summary}");

    // Independently of the driver's aggregation: each stage's compute, comm and idle seconds
    // summed over every iteration line of its ranks, and which ranks reported for it.
    let mut seconds: BTreeMap<u64, [f64; 3]> = BTreeMap::new();
    let mut ranks: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    let mut last_stage_end = None;
    for line in lines(&dir.join("metrics.jsonl")) {
        let event: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line}: {e}"));
        if event["event"] == "summary" && event["stage"] == 1 {
            last_stage_end = Some(event.clone());
        }
        if event["event"] != "iteration" {
            continue;
        }
        let stage = event["stage"].as_u64().unwrap();
        let sums = seconds.entry(stage).or_default();
        for (sum, key) in sums.iter_mut().zip(["compute_s", "comm_wait_s", "idle_s"]) {
            *sum += event[key].as_f64().unwrap();
        }
        ranks
            .entry(stage)
            .or_default()
            .insert(event["rank"].as_u64().unwrap());
    }
    assert_eq!(seconds.keys().copied().collect::<Vec<_>>(), [0, 1], "{seconds:?}");
    for stage in stages {
        let number = stage["stage"].as_u64().unwrap();
        let sums = seconds[&number];
        let total: f64 = sums.iter().sum();
        for (key, part) in ["compute_share", "comm_share", "idle_share"].iter().zip(sums) {
            // The same f64 values summed, in another order at most: equal but for rounding.
            let expected = part / total;
            let got = stage[key].as_f64().unwrap();
            assert!(
                (got - expected).abs() < 1e-9,
                "stage {number} {key}: summary {got}, the ranks' lines {expected} ({sums:?})"
            );
        }
        let reported: BTreeSet<u64> = stage["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap())
            .collect();
        assert_eq!(reported, ranks[&number], "stage {number}'s ranks");
    }
    assert_eq!(ranks[&0], BTreeSet::from([0]), "rank 0 runs stage 0");
    assert_eq!(ranks[&1], BTreeSet::from([1]), "rank 1 runs stage 1");
    // The record's loss and accuracies are the last stage's one rank's at its last iteration.
    let end = last_stage_end.expect("rank 1's summary line");
    for key in ["final_loss", "final_accuracy", "final_accuracy_top5"] {
        assert!(end[key].as_f64().is_some(), "rank 1 reports {key}: {end}");
        assert_eq!(summary[key], end[key], "{key}");
    }
    // The second stage cannot start a minibatch before the first stage's activations arrive: some
    // of its time is waiting, whatever the machine's load.
    let waiting = stages[1]["comm_share"].as_f64().unwrap() + stages[1]["idle_share"].as_f64().unwrap();
    assert!(waiting > 0.0, "stage 1 never waited: {}", stages[1]);
}

/// A small MLP on two CPU ranks, planned at launch.
pub fn auto_mlp(h: &Harness, backend: &str, extra: &str) -> PathBuf {
    h.config(&format!(
        "backend: {backend}\nmachines: [localhost, localhost]\ncontainer: {{build: '{}'}}\n\
         module: mlp\nlayers: 3\nhidden: 256\nconfig_file: auto\nbatch_size: 16\nmicrobatches: 4\n\
         iterations: 3\ndistributed_backend: gloo\nthreads: 1\n{extra}",
        local_context().display()
    ))
}

/// A JSON file of a record.
pub fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}
/// The record holds the profile, the prediction and the stage config, the summary the plan, and
/// every rank ran with the planned stage config.
pub fn check_planned_run(h: &Harness, run: &Run) -> (std::path::PathBuf, Value) {
    assert_eq!(run.code(), 0, "{}", run.stderr());
    assert!(
        run.stderr()
            .contains("driver: profiling mlp at batch 4 on localhost (cpu)"),
        "{}",
        run.stderr()
    );
    assert!(
        run.stderr().contains("predicted time per minibatch"),
        "{}",
        run.stderr()
    );
    let (dir, summary) = h.summary();
    assert_eq!(summary["status"], "succeeded");
    assert_eq!(summary["iterations_done"], 3);

    let profile = json(&dir.join("profile.json"));
    assert_eq!(profile["model"], "mlp");
    assert_eq!(profile["batch_size"], 4, "profiled at the microbatch size");
    let modules = profile["modules"].as_array().unwrap();
    assert!(modules.len() >= 4, "{profile}");
    assert!(modules.iter().all(|m| m["forward_s"].as_f64().unwrap() >= 0.0));

    let stages = json(&dir.join("stage_config.json"));
    let map = stages["module_to_stage_map"].as_array().unwrap();
    assert_eq!(map.len(), modules.len(), "one stage per module of the profile");
    let prediction = json(&dir.join("plan.json"));
    assert_eq!(prediction["workers"], 2);
    assert_eq!(prediction["microbatches"], 4);

    let plan = &summary["plan"];
    let replicas: Vec<u64> = plan["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .collect();
    assert_eq!(replicas.iter().sum::<u64>(), 2, "{plan}");
    assert_eq!(
        replicas.len(),
        stages["stage_to_rank_map"].as_object().unwrap().len()
    );
    assert_eq!(plan["microbatches"], 4);
    assert!(plan["predicted_time_per_iteration_s"].as_f64().unwrap() > 0.0);
    assert_eq!(plan["profiled_on"], "localhost (cpu)");
    // The stage shares in the summary come from the ranks' own reports of their stage.
    assert_eq!(
        summary["stages"].as_array().unwrap().len(),
        replicas.len(),
        "{summary}"
    );

    // Every rank was given the planned file and the microbatches.
    let resolved = json(&dir.join("config.resolved.json"));
    let stage_config = dir.join("stage_config.json");
    for rank in resolved["plan"]["ranks"].as_array().unwrap() {
        let argv: Vec<&str> = rank["argv"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let at = argv
            .iter()
            .position(|a| *a == "--stage-config")
            .expect("--stage-config");
        assert_eq!(
            std::path::Path::new(argv[at + 1]),
            stage_config.canonicalize().unwrap()
        );
        assert!(argv.windows(2).any(|w| w == ["--microbatches", "4"]), "{argv:?}");
    }
    assert_eq!(resolved["experiment"]["config_file"], "auto");
    (dir, summary)
}

/// A PipeDream experiment as PipeDream's own would read, for AlexNet on two ranks: its keys
/// (`module: models.alexnet.gpus=2`, `epochs`, `learning_rate_policy`, `synthetic_data`,
/// `weight_decay`, `model_type`, `print_frequency`, the `false` ones PipeDream's configs all
/// carry) and the partitioned model's folder in PipeDream's formats
/// (`__init__.py`, a stage file per stage module, `hybrid_conf.json`): stage 0 holds the first
/// two convolutions with their pools, stage 1 the rest.
pub fn pipedream_alexnet(h: &Harness, backend: &str) -> PathBuf {
    let folder = h.dir.path().join("models").join("alexnet").join("gpus=2");
    std::fs::create_dir_all(&folder).unwrap();
    let pool = "MaxPool2d(kernel_size=3, stride=2, padding=0, dilation=1, ceil_mode=False)";
    let stage0 = [
        "Conv2d(3, 64, kernel_size=(11, 11), stride=(4, 4), padding=(2, 2))",
        "ReLU(inplace=True)",
        pool,
        "Conv2d(64, 192, kernel_size=(5, 5), stride=(1, 1), padding=(2, 2))",
        "ReLU(inplace=True)",
        pool,
    ];
    let stage1 = [
        "Conv2d(192, 384, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))",
        "ReLU(inplace=True)",
        "Conv2d(384, 256, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))",
        "ReLU(inplace=True)",
        "Conv2d(256, 256, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))",
        "ReLU(inplace=True)",
        pool,
        "Dropout(p=0.5)",
        "Linear(in_features=9216, out_features=4096, bias=True)",
        "ReLU(inplace=True)",
        "Dropout(p=0.5)",
        "Linear(in_features=4096, out_features=4096, bias=True)",
        "ReLU(inplace=True)",
        "Linear(in_features=4096, out_features=1000, bias=True)",
    ];
    for (index, layers) in [(0, &stage0[..]), (1, &stage1[..])] {
        let mut text = format!(
            "import torch\n\n\nclass Stage{index}(torch.nn.Module):\n    def __init__(self):\n        super(Stage{index}, self).__init__()\n"
        );
        for (n, layer) in layers.iter().enumerate() {
            text += &format!("        self.layer{} = torch.nn.{layer}\n", n + 2);
        }
        text += "\n    def forward(self, input0):\n        out0 = input0.clone()\n        return out0\n";
        std::fs::write(folder.join(format!("stage{index}.py")), text).unwrap();
    }
    std::fs::write(
        folder.join("__init__.py"),
        "from .stage0 import Stage0\nfrom .stage1 import Stage1\n\ndef arch():\n    return \"alexnet\"\n\n\
         def model(criterion):\n    return [\n        (Stage0(), [\"input0\"], [\"out0\"]),\n        \
         (Stage1(), [\"out0\"], [\"out1\"]),\n        (criterion, [\"out1\"], [\"loss\"])\n    ]\n",
    )
    .unwrap();
    std::fs::write(
        folder.join("hybrid_conf.json"),
        r#"{"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    h.config(&format!(
        "backend: {backend}\nmodule: models.alexnet.gpus=2\nconfig_file: models/alexnet/gpus=2/hybrid_conf.json\n\
         container: {{build: '{}'}}\nmachines: [localhost, localhost]\nbatch_size: 4\nlearning_rate: 0.01\n\
         weight_decay: 0.0005\nepochs: 2\nepoch_samples: 4\nlearning_rate_policy: step\nsynthetic_data: true\n\
         model_type: image_classification\ndistributed_backend: gloo\nimage_size: 64\nschedule: 1f1b\n\
         microbatches: 2\nthreads: 1\nprint_frequency: 1\nverbose_frequency: 0\n\
         compress_activations: false\ncompress_in_gpu: false\ntranslation_model: false\n",
        local_context().display()
    ))
}

/// Interrupts (Ctrl-C) a long two-stage pipeline that checkpoints, on `backend`, once it has
/// trained a few iterations: every rank writes the checkpoint of one iteration and exits 143,
/// the run is recorded as interrupted, and `resume: true` continues from that iteration.
pub fn an_interrupted_run_checkpoints_every_rank_and_resumes(h: &Harness, backend: &str, mode: &[&str]) {
    let runtime = runtime();
    let mut args = vec!["--runtime", runtime.to_str().unwrap()];
    args.extend_from_slice(mode);
    let config = two_stage_mlp(h, backend);
    let text = std::fs::read_to_string(&config).unwrap();
    let long = text.replace("iterations: 3", "iterations: 1000000");
    std::fs::write(&config, format!("{long}checkpoint_dir: ckpt\n")).unwrap();
    let child = h.spawn(&config, &args);
    let record = wait_for_record(&h.records(), Duration::from_secs(120));
    let start = Instant::now();
    while lines(&record.join("metrics.jsonl"))
        .iter()
        .filter(|l| l.contains("\"iteration\"") && l.contains("\"rank\":1"))
        .count()
        < 3
    {
        assert!(start.elapsed() < Duration::from_secs(180), "no three iterations");
        std::thread::sleep(Duration::from_millis(100));
    }
    interrupt(&child);
    let (_, summary) = h.expect_stop(child, Instant::now(), Duration::from_secs(90), 130);
    assert_eq!(summary["status"], "interrupted", "{summary}");
    for r in summary["ranks"].as_array().unwrap() {
        assert_eq!(r["exit_code"], 143, "the rank checkpointed and exited: {r}");
    }
    let ckpt = h.dir.path().join("ckpt");
    let done = |rank: usize| -> u64 {
        let text = std::fs::read_to_string(ckpt.join(format!("rank-{rank}/latest"))).unwrap();
        serde_json::from_str::<Value>(&text).unwrap()["iterations_done"]
            .as_u64()
            .unwrap()
    };
    let k = done(0);
    assert_eq!(done(1), k, "both ranks checkpointed one iteration");
    assert!(k >= 3, "{k}");

    let first_record = record;
    let resumed = text.replace("iterations: 3", &format!("iterations: {}", k + 2));
    std::fs::write(&config, format!("{resumed}checkpoint_dir: ckpt\nresume: true\n")).unwrap();
    let run = h.run(&config, &args);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let second = std::fs::read_dir(h.records())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| *p != first_record)
        .expect("a second record");
    let mut iterations = BTreeSet::new();
    for line in lines(&second.join("metrics.jsonl")) {
        let event: Value = serde_json::from_str(&line).unwrap();
        if event["event"] == "iteration" {
            iterations.insert(event["iteration"].as_u64().unwrap());
        }
    }
    assert_eq!(iterations.into_iter().collect::<Vec<_>>(), [k, k + 1]);
}

/// Each iteration's loss on the last stage's rank (1) of a two-stage record: the last report of
/// each iteration, so a restarted run's resumed iterations replace the failed start's.
pub fn losses(record: &Path) -> BTreeMap<u64, f64> {
    let mut losses = BTreeMap::new();
    for line in lines(&record.join("metrics.jsonl")) {
        let event: Value = serde_json::from_str(&line).unwrap();
        if event["event"] == "iteration" && event["rank"] == 1 {
            losses.insert(
                event["iteration"].as_u64().unwrap(),
                event["loss"].as_f64().unwrap(),
            );
        }
    }
    losses
}

/// What the restart tests add to an experiment: a checkpoint every 5 iterations, one restart,
/// and rank 1's compute stretched to leave time to kill it between a checkpoint and the end.
pub const KILLABLE_AFTER_A_CHECKPOINT: &str =
    "checkpoint_dir: ckpt\ncheckpoint_every: 5\nmax_restarts: 1\nslowdown: [{rank: 1, factor: 40}]\n";

/// Waits until both ranks of the run recorded in `record` say they wrote a checkpoint (a
/// restart resumes from the checkpoint every rank holds).
pub fn wait_for_a_checkpoint_of_both_ranks(record: &Path, limit: Duration) {
    wait_until(limit, || {
        let lines = lines(&record.join("metrics.jsonl"));
        let wrote = |rank: &str| {
            lines
                .iter()
                .any(|l| l.contains(rank) && l.contains(r#""checkpointed":true"#))
        };
        (wrote(r#""rank":0"#) && wrote(r#""rank":1"#)).then_some(())
    });
}

/// A two-stage pipeline with `max_restarts: 1` whose rank 1 is killed (by `kill`, given the
/// rank's handle in the record) once both have written a checkpoint: the driver stops rank 0,
/// starts both again from their checkpoints, and the run succeeds with every iteration's loss
/// what a run never stopped gives, to the bit (the runtime's resume is exact). The record keeps
/// the failure under `restarts` and both starts' lines.
pub fn a_killed_rank_restarts_from_its_checkpoint(h: &Harness, backend: &str, kill: impl Fn(&str)) {
    let runtime = runtime();
    let args = ["--runtime", runtime.to_str().unwrap()];
    let config = two_stage_mlp(h, backend);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("iterations: 3", "iterations: 30");
    // Never stopped: the losses to match.
    std::fs::write(
        &config,
        format!("{text}checkpoint_dir: ckpt-reference\ncheckpoint_every: 5\n"),
    )
    .unwrap();
    let run = h.run(&config, &args);
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let reference = h.summary().0;
    let expected = losses(&reference);
    assert_eq!(expected.len(), 30);

    std::fs::write(&config, format!("{text}{KILLABLE_AFTER_A_CHECKPOINT}")).unwrap();
    let child = h.spawn(&config, &args);
    let record = wait_until(Duration::from_secs(120), || {
        std::fs::read_dir(h.records())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| *p != reference)
    });
    wait_for_a_checkpoint_of_both_ranks(&record, Duration::from_secs(120));
    let summary = json(&record.join("summary.json"));
    let handle = summary["ranks"][1]["handle"]
        .as_str()
        .expect("rank 1 started")
        .to_string();
    let killed_at = lines(&record.join("metrics.jsonl"))
        .iter()
        .filter(|l| l.contains(r#""event":"iteration""#) && l.contains(r#""rank":1"#))
        .count();
    assert!(killed_at < 30, "rank 1 ran to the end before it could be killed");
    kill(&handle);
    let out = super::wait_for_recorded_run(child, Duration::from_secs(180), &record);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");

    let summary = json(&record.join("summary.json"));
    let resumed = assert_restarted_once_from_a_checkpoint(&summary, 30);
    assert!(
        stderr.contains(&format!(
            "starting every rank again, from their checkpoints of {resumed} iterations done; restart 1 of 1"
        )),
        "{stderr}"
    );
    for r in summary["ranks"].as_array().unwrap() {
        assert_eq!(r["exit_code"], 0, "the second start's ranks: {r}");
    }
    // The second start began at the checkpoint: its first iteration is `resumed`.
    let iterations: Vec<u64> = lines(&record.join("metrics.jsonl"))
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["event"] == "iteration" && e["rank"] == 1)
        .map(|e| e["iteration"].as_u64().unwrap())
        .collect();
    // The first start ran 0..m (m at least `resumed`, the checkpoint written before the kill),
    // the second `resumed`..30.
    let again = iterations.iter().rposition(|&i| i == resumed).unwrap();
    assert!(again >= resumed as usize, "{iterations:?}");
    assert_eq!(
        iterations[..again],
        (0..again as u64).collect::<Vec<_>>(),
        "{iterations:?}"
    );
    assert_eq!(
        iterations[again..],
        (resumed..30).collect::<Vec<_>>(),
        "{iterations:?}"
    );
    assert_eq!(
        losses(&record),
        expected,
        "the restarted run's losses against a run never stopped"
    );
    let log = std::fs::read_to_string(record.join("rank-1.log")).unwrap();
    assert!(
        log.contains(&format!("--- driver: every rank started again, from the checkpoints of {resumed} iterations done (restart 1 of 1) ---")),
        "{log}"
    );
}

/// Polls `found` every 50 ms until it gives a value, failing after `limit`.
pub fn wait_until<T>(limit: Duration, mut found: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = found() {
            return value;
        }
        assert!(start.elapsed() < limit, "not seen within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The events of the Chrome trace at `path`.
pub fn trace_events(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let trace: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    trace["traceEvents"]
        .as_array()
        .expect("a traceEvents list")
        .clone()
}

/// The names of a trace's `ProfilerStep#N` scopes, sorted.
pub fn trace_steps(events: &[Value]) -> Vec<&str> {
    let mut steps: Vec<&str> = events
        .iter()
        .filter_map(|e| e["name"].as_str().filter(|n| n.starts_with("ProfilerStep#")))
        .collect();
    steps.sort();
    steps
}

/// `config` with every rank's profiler trace asked for.
pub fn traced(config: &Path) -> PathBuf {
    let text = std::fs::read_to_string(config).unwrap();
    std::fs::write(config, format!("{text}profiler_trace: true\n")).unwrap();
    config.to_path_buf()
}

/// A run of [`two_stage_mlp`] with `profiler_trace: true` kept each rank's trace in the record:
/// PyTorch's profiler over the two iterations after the runtime's one-iteration warm-up, each
/// microbatch's forward and backward marked, and the summary saying so.
pub fn check_traces_kept(h: &Harness, run: &Run) {
    assert_eq!(run.code(), 0, "{}", run.stderr());
    let (dir, summary) = h.summary();
    assert_eq!(summary["traces"]["dir"], "traces", "{summary}");
    assert_every_trace_kept(&summary, &run.stderr(), 2);
    // Each rank's lines of the traced iterations say the profiler slowed them; none being left
    // after the warm-up, the record measures them.
    let mut profiled = BTreeSet::new();
    for line in lines(&dir.join("metrics.jsonl")) {
        let event: Value = serde_json::from_str(&line).unwrap();
        if event["event"] == "iteration" && event["profiled"] == true {
            profiled.insert((
                event["rank"].as_u64().unwrap(),
                event["iteration"].as_u64().unwrap(),
            ));
        }
    }
    assert_eq!(
        profiled,
        BTreeSet::from([(0, 1), (0, 2), (1, 1), (1, 2)]),
        "(rank, iteration) said profiled"
    );
    assert_eq!(summary["throughput"]["iterations_measured"], 2, "{summary}");
    for (rank, events) in assert_ranks_traced_steps_1_and_2(&dir, 2).iter().enumerate() {
        let named = |name: &str| {
            events
                .iter()
                .filter(|e| e["cat"] == "user_annotation" && e["name"] == name)
                .count()
        };
        // Two traced iterations of two microbatches each.
        assert_eq!((named("forward"), named("backward")), (4, 4), "rank {rank}");
    }
    let kept: Vec<String> = std::fs::read_dir(dir.join("traces"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept.len(), 2, "nothing but the traces: {kept:?}");
    // The record tabulates as it is: bench/trace_table.py takes the record for its ranks' traces.
    let table = std::process::Command::new("python3")
        .arg(super::workspace().join("bench/trace_table.py"))
        .arg(&dir)
        .output()
        .expect("python3 runs bench/trace_table.py");
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&table.stderr)
    );
    let header = text.lines().find(|l| l.contains("rank-0")).unwrap_or_default();
    assert!(header.contains("rank-1"), "a column per rank:\n{text}");
    assert!(text.contains("forward") && text.contains("backward"), "{text}");
}

/// The run `summary` records succeeded with all its `iterations` after one restart, for a rank
/// that failed, from a checkpoint (`checkpoint_every: 5`) written before its end; returns the
/// iteration it resumed from.
pub fn assert_restarted_once_from_a_checkpoint(summary: &Value, iterations: u64) -> u64 {
    assert_eq!(summary["status"], "succeeded", "{summary}");
    assert!(summary["failure"].is_null(), "{summary}");
    assert_eq!(summary["iterations_done"], iterations, "{summary}");
    let restarts = summary["restarts"].as_array().expect("the restart is recorded");
    assert_eq!(restarts.len(), 1, "{summary}");
    let cause = &restarts[0]["failure"]["cause"];
    assert_eq!(cause["kind"], "rank_failed", "{summary}");
    let resumed = restarts[0]["resume_from"]
        .as_u64()
        .expect("resumed from a checkpoint");
    assert!(
        resumed >= 5 && resumed.is_multiple_of(5) && resumed < iterations,
        "{summary}"
    );
    resumed
}

/// A two-stage pipeline tracing 2 iterations (`profiler_steps: 2`) of many more, whose rank 1
/// is killed (by `kill`, given the rank's handle in the record) once both ranks said they wrote
/// their trace: the run fails, and the record still keeps both traces whole, the killed rank's
/// too (a container's copied out of it before it is removed).
pub fn a_failed_runs_traces_are_kept(h: &Harness, backend: &str, kill: impl Fn(&str)) {
    let runtime = runtime();
    let config = traced_until_killed(&traced(&two_stage_mlp(h, backend)));
    let child = h.spawn(&config, &["--runtime", runtime.to_str().unwrap()]);
    a_rank_killed_after_tracing_leaves_every_trace(h, child, 2, |rank| {
        kill(rank["handle"].as_str().expect("rank 1 started"))
    });
}

/// Makes the traced experiment `config` (`iterations: 3`) run until a rank is killed, its ranks
/// tracing iterations 1 and 2 only.
pub fn traced_until_killed(config: &Path) -> PathBuf {
    let text = std::fs::read_to_string(config)
        .unwrap()
        .replace("iterations: 3", "iterations: 100000");
    assert!(text.contains("iterations: 100000"), "{text}");
    std::fs::write(config, format!("{text}profiler_steps: 2\n")).unwrap();
    config.to_path_buf()
}

/// Waits until each of the `ranks` ranks of `h`'s driver `child` has
/// written its profiler trace, hands rank 1's entry in the summary to `kill`, and checks that the
/// run failed for a rank (the killed one, or a peer that lost it first) with every rank's trace,
/// iterations 1 and 2, kept in the record.
pub fn a_rank_killed_after_tracing_leaves_every_trace(
    h: &Harness,
    child: Child,
    ranks: usize,
    kill: impl Fn(&Value),
) {
    let record = wait_for_record(&h.records(), Duration::from_secs(120));
    for rank in 0..ranks {
        super::wait_for_text(
            &record.join(format!("rank-{rank}.log")),
            "profiler trace in",
            Duration::from_secs(180),
        );
    }
    kill(&json(&record.join("summary.json"))["ranks"][1]);
    let out = super::wait_for_recorded_run(child, Duration::from_secs(180), &record);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let summary = json(&record.join("summary.json"));
    assert_eq!(summary["status"], "failed", "{summary}");
    assert_eq!(summary["failure"]["cause"]["kind"], "rank_failed", "{summary}");
    assert_every_trace_kept(&summary, &stderr, ranks);
    assert_ranks_traced_steps_1_and_2(&record, ranks);
}

/// The run's `summary` lists a trace for each of its first `ranks` ranks and none missing, and the
/// driver's `stderr` named every one of them.
pub fn assert_every_trace_kept(summary: &Value, stderr: &str, ranks: usize) {
    let all: Vec<usize> = (0..ranks).collect();
    assert_eq!(summary["traces"]["ranks"], serde_json::json!(all), "{summary}");
    assert!(summary["traces"].get("missing").is_none(), "{summary}");
    let names: Vec<String> = all.iter().map(|r| format!("rank-{r}.json")).collect();
    let said = format!("driver: profiler traces {} in", names.join(", "));
    assert!(stderr.contains(&said), "{stderr}");
}

/// Each of the first `ranks` ranks' traces in `record` holds iterations 1 and 2: the two after the
/// runtime's one-iteration warm-up. Returns each rank's events.
pub fn assert_ranks_traced_steps_1_and_2(record: &Path, ranks: usize) -> Vec<Vec<Value>> {
    (0..ranks)
        .map(|rank| {
            let events = trace_events(&record.join(format!("traces/rank-{rank}.json")));
            assert_eq!(
                trace_steps(&events),
                ["ProfilerStep#1", "ProfilerStep#2"],
                "rank {rank}"
            );
            events
        })
        .collect()
}
