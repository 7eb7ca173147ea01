//! Planning from a profile file: what is written, what is printed, and the errors.

use stagehand_contract::{ModuleProfile, Profile, StageConfig, PROFILE_VERSION};

use super::*;

fn profile() -> Profile {
    let module = |index: usize, name: &str, compute: f64, params: u64| ModuleProfile {
        index,
        name: name.into(),
        forward_s: compute / 3.0,
        backward_s: 2.0 * compute / 3.0,
        optimizer_s: 0.0,
        activation_bytes: 1 << 20,
        compressed_activation_bytes: Some(1 << 19),
        param_bytes: params,
        output_shape: vec![8, 32768],
    };
    Profile {
        format_version: PROFILE_VERSION,
        model: "toy".into(),
        batch_size: 8,
        device: "cpu".into(),
        threads: 1,
        repeats: 3,
        precision: "fp32".into(),
        channels_last: false,
        sizes: Default::default(),
        modules: vec![
            module(0, "a", 0.010, 1 << 10),
            module(1, "b", 0.010, 1 << 10),
            module(2, "heavy", 0.040, 1 << 10),
            module(3, "c", 0.010, 1 << 10),
            module(4, "loss", 0.0001, 0),
        ],
    }
}

fn options(dir: &std::path::Path) -> PartitionOptions {
    let path = dir.join("profile.json");
    std::fs::write(&path, serde_json::to_string(&profile()).unwrap()).unwrap();
    PartitionOptions {
        profile: path,
        request: PlanRequest {
            workers: 3,
            levels: vec![(3, 1e9)],
            memory_bytes: None,
            straight: true,
            microbatches: 4,
            alternatives: 0,
            schedule: None,
            compress_activations: false,
        },
        output: Some(dir.join("stages.json")),
        prediction: Some(dir.join("prediction.json")),
        explain: false,
    }
}

#[test]
fn writes_a_stage_config_the_runtime_accepts_and_the_predictions() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    run(&opts).unwrap();
    let config =
        StageConfig::from_json(&std::fs::read_to_string(dir.path().join("stages.json")).unwrap()).unwrap();
    let plan = config.validate(5, 3).unwrap();
    // Straight on 3 workers: the heavy module stands alone.
    assert!(plan.stages.iter().any(|s| s.modules == (2..3)), "{plan:?}");
    let prediction: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("prediction.json")).unwrap()).unwrap();
    // 4 microbatches of the heavy module's 40 ms.
    assert!(
        (prediction["time_per_minibatch_s"].as_f64().unwrap() - 0.160).abs() < 1e-9,
        "{prediction}"
    );
    assert_eq!(prediction["workers"], 3);
    assert!(
        prediction["speedup_over_data_parallel"].as_f64().unwrap() < 1.0,
        "straight loses to DP here"
    );
}

/// Compressed activations go forward in half the bytes and their gradients come back whole:
/// on a link slow enough that a boundary is the bottleneck, the plan's time is 3/4 of the
/// uncompressed one. Memory (what stages keep for backward) is unchanged.
#[test]
fn compressed_activations_are_planned_at_the_bytes_they_cross_in() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path());
    // 4 microbatches of 1 MiB each way at 10 MB/s: 0.84 s per boundary against 0.16 s of compute.
    opts.request.levels = vec![(3, 1e7)];
    let (_, plain_plan, plain) = solve(&opts).unwrap();
    opts.request.compress_activations = true;
    let (source, plan, compressed) = solve(&opts).unwrap();
    let boundary = 4.0 * 2.0 * (1 << 20) as f64 / 1e7;
    assert!((plain.time_per_minibatch_s - boundary).abs() < 1e-9, "{plain:?}");
    assert!(
        (compressed.time_per_minibatch_s - 0.75 * boundary).abs() < 1e-9,
        "{compressed:?}"
    );
    let memory = |p: &Prediction| p.stages.iter().map(|s| s.memory_bytes).collect::<Vec<_>>();
    assert_eq!(memory(&plain), memory(&compressed));
    assert_eq!(plain_plan.stages.len(), plan.stages.len());
    let text = render_source(&source, &plan, &compressed);
    assert!(
        text.starts_with("toy at 4 microbatches of 8 in fp32 on 3 workers, activations sent in fp16:"),
        "{text}"
    );

    // A profile that does not say what its activations weigh compressed (an older runtime's)
    // cannot be planned for compression: refused with what to do.
    let mut old = profile();
    for m in &mut old.modules {
        m.compressed_activation_bytes = None;
    }
    std::fs::write(&opts.profile, serde_json::to_string(&old).unwrap()).unwrap();
    let message = solve(&opts).unwrap_err().to_string();
    assert!(
        message.contains("does not record what activations weigh compressed"),
        "{message}"
    );
    assert!(message.contains("runtime profile"), "{message}");
    opts.request.compress_activations = false;
    solve(&opts).unwrap();
}

#[test]
fn runner_ups_are_slower_shapes_with_stage_configs_the_runtime_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path());
    opts.request.straight = false;
    opts.request.alternatives = 3;
    run(&opts).unwrap();
    let prediction: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("prediction.json")).unwrap()).unwrap();
    let chosen = prediction["time_per_minibatch_s"].as_f64().unwrap();
    let runner_ups = prediction["alternatives"].as_array().unwrap();
    assert_eq!(runner_ups.len(), 3, "{prediction}");
    let mut last = chosen;
    for alternative in runner_ups {
        let time = alternative["time_per_minibatch_s"].as_f64().unwrap();
        assert!(time >= last, "{prediction}");
        last = time;
        let config: StageConfig = serde_json::from_value(alternative["stage_config"].clone()).unwrap();
        config.validate(5, 3).unwrap();
    }
    let (source, plan, prediction) = solve(&opts).unwrap();
    let text = render_source(&source, &plan, &prediction);
    assert_eq!(text.matches("x the plan's").count(), 3, "{text}");
}

#[test]
fn the_plan_renders_for_people() {
    let dir = tempfile::tempdir().unwrap();
    let (source, plan, prediction) = solve(&options(dir.path())).unwrap();
    let Source::Runtime(profile) = &source else {
        panic!("a JSON profile is the runtime's")
    };
    let text = render(profile, &plan, &prediction);
    assert_eq!(text, render_source(&source, &plan, &prediction));
    insta::assert_snapshot!(text);
}

#[test]
fn the_explanation_marks_the_bottleneck_and_its_shares() {
    let dir = tempfile::tempdir().unwrap();
    let (_, plan, _) = solve(&options(dir.path())).unwrap();
    let text = explain(&plan, None);
    insta::assert_snapshot!(text);
    // Straight on 3 workers: the heavy module's stage is the bottleneck, and only its line says so.
    let marked: Vec<&str> = text.lines().filter(|l| l.contains("bottleneck")).collect();
    assert_eq!(marked.len(), 1, "{text}");
    assert!(marked[0].contains("stage 1:"), "{text}");
}

/// Planned for 1F1B, the explanation is of the time with fill and drain: 3 stages at 4
/// microbatches stretch compute over 6 slots instead of 4, x 1.50. The heavy stage's 4 x 40 ms
/// become 240 ms; its optimizer step (a tenth of its compute here) is not stretched.
#[test]
fn the_explanation_of_a_flushing_plan_stretches_compute_not_the_update() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path());
    let mut stepped = profile();
    stepped.modules[2].optimizer_s = 0.016;
    std::fs::write(&opts.profile, serde_json::to_string(&stepped).unwrap()).unwrap();
    opts.request.schedule = Some(Schedule::OneFOneB);
    let (_, plan, prediction) = solve(&opts).unwrap();
    assert!(
        (prediction.flushing_time_per_minibatch_s - (0.24 + 0.016)).abs() < 1e-9,
        "{prediction:?}"
    );
    assert!(
        (prediction.time_per_minibatch_s - (0.16 + 0.016)).abs() < 1e-9,
        "{prediction:?}"
    );
    let text = explain(&plan, opts.request.flushing());
    assert!(
        text.starts_with(
            "why: per minibatch, each worker of a stage spends (share of the predicted 256.0 ms with \
             GPipe/1F1B at 4 microbatches, whose fill and drain stretch compute and transfers x 1.50):"
        ),
        "{text}"
    );
    let marked: Vec<&str> = text.lines().filter(|l| l.contains("bottleneck")).collect();
    assert_eq!(marked.len(), 1, "{text}");
    assert!(
        marked[0].starts_with("  stage 1: compute 160.0 ms x 1.50 (94%) + optimizer 16.0 ms (6%)"),
        "{text}"
    );
    assert!(
        marked[0].contains("= stage 256.0 ms (100%) <- bottleneck"),
        "{text}"
    );
}

#[test]
fn more_microbatches_make_replication_cheaper_and_change_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path());
    opts.request.straight = false;
    // 256 MiB of weights per module: at 1 GB/s their all-reduce (once per minibatch) costs far
    // more than one microbatch's compute, and far less than 64 microbatches'.
    let mut heavy_weights = profile();
    for m in &mut heavy_weights.modules[..4] {
        m.param_bytes = 1 << 28;
    }
    std::fs::write(&opts.profile, serde_json::to_string(&heavy_weights).unwrap()).unwrap();
    let most_replicas = |m: usize, opts: &mut PartitionOptions| {
        opts.request.microbatches = m;
        let (_, plan, _) = solve(opts).unwrap();
        plan.stages.iter().map(|s| s.replicas).max().unwrap()
    };
    assert_eq!(
        most_replicas(1, &mut opts),
        1,
        "one microbatch: a straight pipeline"
    );
    assert!(
        most_replicas(64, &mut opts) > 1,
        "64 microbatches: some stage replicated"
    );
}

#[test]
fn errors_name_the_file_and_what_to_change() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path());
    opts.request.workers = 9;
    let err = solve(&opts).err().unwrap();
    assert!(
        err.to_string()
            .contains("a straight pipeline of 9 workers needs at least 9 modules"),
        "{err}"
    );
    std::fs::write(&opts.profile, "{\"format_version\": 7}").unwrap();
    let err = solve(&opts).err().unwrap();
    assert!(
        err.to_string()
            .contains("profile.json: profile format version 7 is not 1"),
        "{err}"
    );
    opts.profile = dir.path().join("missing.json");
    let err = solve(&opts).err().unwrap();
    assert!(err.to_string().starts_with("cannot read the profile"), "{err}");
}

/// A small graph in PipeDream's format: an input, a convolution, two residual blocks (two
/// convolutions and a sum each), a classifier.
fn pipedream_graph() -> String {
    let node = |id: usize, layer: &str, ms: f64, activation: f64, params: f64| {
        format!(
            "node{id} -- {layer} -- forward_compute_time={ms:.3}, backward_compute_time={:.3}, activation_size={activation:.3}, parameter_size={params:.3}\n",
            2.0 * ms
        )
    };
    let mut text = node(1, "Input", 1.0, 1e7, 0.0) + &node(2, "Conv2d(3, 64)", 8.0, 4e7, 1e4);
    for (a, b, add) in [(3, 4, 5), (6, 7, 8)] {
        text += &node(a, "Conv2d(64, 64)", 6.0, 4e7, 1e5);
        text += &node(b, "Conv2d(64, 64)", 6.0, 4e7, 1e5);
        text += &node(add, "Add(inplace)", 0.1, 4e7, 0.0);
    }
    text += &node(9, "Linear(64, 10)", 0.5, 1e4, 1e3);
    for (x, y) in [
        (1, 2),
        (2, 3),
        (3, 4),
        (4, 5),
        (2, 5),
        (5, 6),
        (6, 7),
        (7, 8),
        (5, 8),
        (8, 9),
    ] {
        text += &format!("\tnode{x} -- node{y}\n");
    }
    text
}

#[test]
fn a_pipedream_graph_is_planned_over_its_layers_and_written_back_partitioned() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path());
    let folder = dir.path().join("resnet_toy");
    std::fs::create_dir(&folder).unwrap();
    opts.profile = folder.join("graph.txt");
    std::fs::write(&opts.profile, pipedream_graph()).unwrap();
    opts.request.workers = 4;
    opts.request.levels = vec![(4, 1e10)];
    run(&opts).unwrap();
    // The output is PipeDream's graph with a stage per node, stages in the graph's order, and no
    // cut inside a residual block: both convolutions and the sum share a stage.
    let written =
        stagehand_planner::Graph::parse(&std::fs::read_to_string(dir.path().join("stages.json")).unwrap())
            .unwrap();
    let stage = |id: &str| {
        written
            .nodes
            .iter()
            .find(|n| n.id == id)
            .and_then(|n| n.stage_id)
            .unwrap()
    };
    let stages: Vec<usize> = (1..=9).map(|i| stage(&format!("node{i}"))).collect();
    assert!(
        stages.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1),
        "{stages:?}"
    );
    assert_eq!(
        *stages.last().unwrap(),
        3,
        "a straight plan over 4 workers: {stages:?}"
    );
    for block in [[3, 4, 5], [6, 7, 8]] {
        assert!(
            block.iter().all(|&i| stages[i - 1] == stages[block[0] - 1]),
            "{stages:?}"
        );
    }
    let prediction: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("prediction.json")).unwrap()).unwrap();
    assert_eq!(prediction["model"], "resnet_toy");
    assert!(prediction["batch_size"].is_null());
    assert_eq!(prediction["stages"][0]["first"], "node1 Input");
    // A runtime plan cannot take it: config_file: auto needs the runtime's modules.
    let err = read_profile(&opts.profile).unwrap_err().to_string();
    assert!(err.contains("profile the model with `runtime profile`"), "{err}");
    // A line PipeDream's format does not allow is named.
    std::fs::write(
        &opts.profile,
        pipedream_graph().replace("activation_size=10000.000", "activation_size=big"),
    )
    .unwrap();
    let err = solve(&opts).err().unwrap().to_string();
    assert!(
        err.ends_with("graph.txt: as PipeDream's graph.txt: line 9: activation_size: `big` is not a number"),
        "{err}"
    );
}

/// The profile's message for `profile`, written where `opts` reads it.
fn refusal(opts: &PartitionOptions, text: &str) -> String {
    std::fs::write(&opts.profile, text).unwrap();
    let err = solve(opts).expect_err("a nonsense profile is refused");
    assert!(matches!(err, PartitionError::Profile { .. }), "{err:?}");
    err.to_string()
}

/// Measurements no device makes (negative, NaN, infinite or absurdly large times and sizes) and
/// modules out of their order planned silently (a negative time as 0) or as nonsense (a
/// pebibyte-sized output, a NaN speedup); refused, naming the file, the module or line, the
/// field, and what is allowed.
#[test]
fn nonsense_profiles_are_refused_naming_the_entry_and_what_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    let with = |change: &dyn Fn(&mut Profile)| {
        let mut p = profile();
        change(&mut p);
        serde_json::to_string(&p).unwrap()
    };
    let times = "times must be finite numbers of seconds from 0 to 1e6 (eleven and a half days)";
    let cases: Vec<(String, String)> = vec![
        (
            with(&|p| p.modules[1].forward_s = -0.5),
            format!("profile.json: modules[1] (`b`): forward_s is -0.5; {times}"),
        ),
        (
            with(&|p| p.modules[3].backward_s = 2e6),
            format!("profile.json: modules[3] (`c`): backward_s is 2000000; {times}"),
        ),
        (
            with(&|p| p.modules[2].forward_s = 1e300),
            format!("profile.json: modules[2] (`heavy`): forward_s is 1e300; {times}"),
        ),
        (
            with(&|p| p.modules[0].optimizer_s = -1e-3),
            format!("profile.json: modules[0] (`a`): optimizer_s is -0.001; {times}"),
        ),
        (
            with(&|p| p.modules[2].param_bytes = u64::MAX),
            "profile.json: modules[2] (`heavy`): param_bytes is 18446744073709551615; sizes must be bytes \
             from 0 to 2^50 (a pebibyte)"
                .into(),
        ),
        (
            with(&|p| p.modules[4].compressed_activation_bytes = Some((1 << 50) + 1)),
            "profile.json: modules[4] (`loss`): compressed_activation_bytes is 1125899906842625; sizes must"
                .into(),
        ),
        (
            with(&|p| p.modules[2].index = 1),
            "profile.json: modules[2] (`heavy`): index 1 repeats modules[1]'s (`b`); `runtime profile` \
             numbers the modules 0, 1, 2, ... in order, each its position in the list"
                .into(),
        ),
        (
            with(&|p| p.modules[4].index = 7),
            "profile.json: modules[4] (`loss`): index 7, not 4; `runtime profile` numbers".into(),
        ),
        (
            with(&|p| {
                for m in &mut p.modules {
                    (m.forward_s, m.backward_s) = (0.0, 0.0);
                }
            }),
            "profile.json: its modules' forward_s and backward_s add up to 0 s; a model's forward and \
             backward take time"
                .into(),
        ),
        (
            with(&|p| p.modules.clear()),
            "profile.json: it lists no modules; `runtime profile` writes one entry per module".into(),
        ),
        (
            "model,forward_s\nmlp,0.1\n".into(),
            "profile.json: it is neither a profile `runtime profile` writes (JSON, starting with `{`) nor \
             PipeDream's graph.txt"
                .into(),
        ),
    ];
    for (text, expected) in cases {
        let message = refusal(&opts, &text);
        assert!(
            message.contains(&expected),
            "{message:?} does not contain {expected:?}"
        );
    }

    // JSON has no NaN or infinity (Python's json module writes them anyway), nor numbers beyond
    // f64: the line, the column and the field are named, and what is allowed.
    let plain = with(&|p| p.modules[1].forward_s = 0.25);
    for bad in ["NaN", "Infinity", "-Infinity", "1e400"] {
        let message = refusal(
            &opts,
            &plain.replacen("\"forward_s\":0.25", &format!("\"forward_s\":{bad}"), 1),
        );
        assert!(message.contains("profile.json: line 1 column "), "{message}");
        assert!(
            message.contains(&format!(
                "forward_s is `{bad}`, not a number JSON can hold; times must be finite numbers of \
                 seconds from 0 to 1e6, sizes bytes from 0 to 2^50"
            )),
            "{message}"
        );
    }
    // In a profile as `runtime profile` writes it, pretty, the line is the field's.
    let pretty = serde_json::to_string_pretty(&serde_json::from_str::<Profile>(&plain).unwrap())
        .unwrap()
        .replacen("\"forward_s\": 0.25", "\"forward_s\": NaN", 1);
    let line = pretty.lines().position(|l| l.contains("NaN")).unwrap() + 1;
    let message = refusal(&opts, &pretty);
    assert!(
        message.contains(&format!("profile.json: line {line} column ")),
        "{message}"
    );
    // Other broken JSON says what serde says.
    assert!(refusal(&opts, "{\"format_version\": 1,").contains("not JSON"));
    // The same measurements in PipeDream's graph are refused alike, by line.
    let graph = dir.path().join("graph.txt");
    let graph_opts = PartitionOptions {
        profile: graph.clone(),
        ..opts.clone()
    };
    for (bad, expected) in [
        (
            pipedream_graph().replacen("forward_compute_time=1.000", "forward_compute_time=-1.000", 1),
            "graph.txt: as PipeDream's graph.txt: line 1: forward_compute_time is `-1.000`; it must be a \
             finite number of milliseconds from 0 to 1e9 (eleven and a half days)",
        ),
        (
            pipedream_graph().replacen("parameter_size=10000.000", "parameter_size=nan", 1),
            "graph.txt: as PipeDream's graph.txt: line 2: parameter_size is `nan`; it must be a finite \
             number of bytes from 0 to 2^50 (a pebibyte)",
        ),
    ] {
        let message = refusal(&graph_opts, &bad);
        assert!(
            message.ends_with(expected),
            "{message:?} does not end with {expected:?}"
        );
    }
    let idle = pipedream_graph()
        .lines()
        .map(|l| match l.starts_with('\t') {
            true => format!("{l}\n"),
            false => {
                let (head, _) = l.split_once("-- forward_compute_time").unwrap();
                format!(
                    "{head}-- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=1.000, \
                     parameter_size=1.000\n"
                )
            }
        })
        .collect::<String>();
    let message = refusal(&graph_opts, &idle);
    assert!(
        message.contains("graph.txt: as PipeDream's graph.txt: its nodes' forward_compute_time and"),
        "{message}"
    );
    // The profile itself plans.
    std::fs::write(&opts.profile, serde_json::to_string(&profile()).unwrap()).unwrap();
    solve(&opts).unwrap();
}

/// The planner's tables grow as workers^3: `--workers 10000` asked for 8 TB and aborted.
/// Refused, saying how many workers would do, with `driver plan`'s exit code for bad input.
#[test]
fn too_many_workers_to_plan_over_are_refused_saying_how_many_would_do() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path());
    opts.request.straight = false;
    opts.request.workers = 10_000;
    opts.request.levels = vec![(10_000, 1e9)];
    let err = solve(&opts).err().unwrap();
    let PartitionError::Plan(stagehand_planner::PlanError::TooMuchMemory { fits, .. }) = &err else {
        panic!("{err:?}")
    };
    let message = err.to_string();
    assert!(
        message.starts_with("planning 5 modules on 10000 workers needs "),
        "{message}"
    );
    assert!(
        message.ends_with(&format!(
            "GiB for the planner's tables, over its limit of 1 GiB; lower --workers (up to {fits} stay within \
             the limits)"
        )),
        "{message}"
    );
    assert!(*fits > 3 && *fits < 10_000, "{message}");
}
