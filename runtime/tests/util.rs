//! Harness for the runtime's integration tests: runs the real `runtime` binary and parses its
//! stdout as the metrics contract.

use std::path::Path;
use std::process::{Command, Output};

use stagehand_contract::metrics::Validation;
use stagehand_contract::{Event, Iteration, Start, Summary};

/// The runtime under test: this build's, or the binary `STAGEHAND_TEST_RUNTIME` names (a test binary
/// carried to a GPU machine without a toolchain, by scripts/gpu-kit, runs the runtime it carries).
pub fn runtime() -> Command {
    match std::env::var_os("STAGEHAND_TEST_RUNTIME") {
        Some(path) => Command::new(path),
        None => Command::new(env!("CARGO_BIN_EXE_runtime")),
    }
}

/// A finished run with its events.
pub struct Run {
    pub output: Output,
    pub events: Vec<Event>,
}

impl Run {
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }

    pub fn start(&self) -> &Start {
        self.events
            .iter()
            .find_map(|e| match e {
                Event::Start(s) => Some(s),
                _ => None,
            })
            .expect("a start event")
    }

    pub fn iterations(&self) -> Vec<&Iteration> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::Iteration(i) => Some(i),
                _ => None,
            })
            .collect()
    }

    /// Its validation passes (`--validate-every`), in order.
    pub fn validations(&self) -> Vec<&Validation> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::Validation(v) => Some(v),
                _ => None,
            })
            .collect()
    }

    pub fn summary(&self) -> &Summary {
        self.events
            .iter()
            .find_map(|e| match e {
                Event::Summary(s) => Some(s),
                _ => None,
            })
            .expect("a summary event")
    }

    pub fn losses(&self) -> Vec<f64> {
        self.iterations()
            .iter()
            .map(|i| i.loss.expect("a single process knows its loss"))
            .collect()
    }

    pub fn accuracies(&self) -> Vec<f64> {
        self.iterations()
            .iter()
            .map(|i| i.accuracy.expect("a rank that knows its loss knows its accuracy"))
            .collect()
    }

    /// Top-5 accuracies, of a model with class logits.
    pub fn top5_accuracies(&self) -> Vec<f64> {
        self.iterations()
            .iter()
            .map(|i| i.accuracy_top5.expect("class logits report top-5 beside top-1"))
            .collect()
    }
}

/// Runs `runtime` with `args`; every stdout line must be a metrics event.
pub fn run(args: &[&str]) -> Run {
    let mut cmd = runtime();
    cmd.args(args);
    run_command(cmd)
}

/// Runs a `runtime` command made by [`runtime`] (its arguments and environment set).
pub fn run_command(mut cmd: Command) -> Run {
    let output = cmd.output().expect("runtime starts");
    let stdout = String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8");
    let events = stdout
        .lines()
        .map(|line| {
            Event::parse_line(line).unwrap_or_else(|| panic!("stdout line is not a metrics event: {line}"))
        })
        .collect();
    Run { output, events }
}

/// Runs `runtime` and asserts it succeeded.
pub fn run_ok(args: &[&str]) -> Run {
    let run = run(args);
    assert!(
        run.output.status.success(),
        "runtime {args:?} failed:\n{}",
        run.stderr()
    );
    run
}

/// Writes CIFAR-10 binary records (label `i % 10`, pixels equal to `label * 20`).
pub fn write_cifar(dir: &Path, records: usize) {
    let mut bytes = Vec::new();
    for i in 0..records {
        let label = (i % 10) as u8;
        bytes.push(label);
        bytes.extend(std::iter::repeat_n(label * 20, 3072));
    }
    std::fs::write(dir.join("data_batch_1.bin"), bytes).unwrap();
}

/// Writes an ImageFolder tree of PNGs: `classes` subfolders of `per_class` images each, each
/// image its own level plus a left-to-right ramp (so crops and mirrors change what a model sees).
pub fn write_image_folder(dir: &Path, classes: usize, per_class: usize) {
    for c in 0..classes {
        let class = dir.join(format!("class_{c}"));
        std::fs::create_dir_all(&class).unwrap();
        for i in 0..per_class {
            let ramp = tch::Tensor::arange(24, (tch::Kind::Int64, tch::Device::Cpu)).view([1, 1, 24]);
            let image = (ramp.expand([3, 20, 24], false) + (c * 60 + i) as i64).to_kind(tch::Kind::Uint8);
            tch::vision::image::save(&image, class.join(format!("{i}.png"))).unwrap();
        }
    }
}

/// The stage config of two stages, the mlp's first three modules and its last three, one rank
/// each, written into `dir`; its path.
pub fn two_stages(dir: &Path) -> String {
    let path = dir.join("two.json");
    std::fs::write(
        &path,
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    // Drawn below the kernel's ephemeral range (32768 and up here), as the driver draws its
    // master ports: a port the kernel handed out for `:0` is free again once released, for any
    // of the tests' many outgoing connections to take as its own while the ranks start. Under
    // the driver's range (30000 up), so that its tests do not draw the same, and under 29000,
    // clear of the default master port (29500).
    let draw = std::collections::hash_map::RandomState::new();
    for n in 0..64u64 {
        let port = 20_000 + (std::hash::BuildHasher::hash_one(&draw, n) % 9_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `world` ranks of `runtime` as local processes on a fresh port, each with `args` plus its
/// launch flags, and waits for all (killing them after `limit`).
pub fn run_ranks(world: usize, args: &[&str], limit: std::time::Duration) -> Vec<Run> {
    run_ranks_each(world, |_| args.iter().map(|a| a.to_string()).collect(), limit)
}

/// [`run_ranks`] with each rank's own `args(rank)`.
pub fn run_ranks_each(
    world: usize,
    args: impl Fn(usize) -> Vec<String>,
    limit: std::time::Duration,
) -> Vec<Run> {
    let port = free_port().to_string();
    let world_s = world.to_string();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let own = args(rank);
            let rank = rank.to_string();
            runtime()
                .args(&own)
                .args([
                    "--world-size",
                    &world_s,
                    "--rank",
                    &rank,
                    "--master-port",
                    &port,
                    "--comm-timeout",
                    "30",
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("runtime starts")
        })
        .collect();
    let deadline = std::time::Instant::now() + limit;
    children
        .into_iter()
        .map(|mut child| {
            loop {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let output = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            let events = stdout.lines().filter_map(Event::parse_line).collect();
            Run { output, events }
        })
        .collect()
}

/// [`run_ranks`], asserting every rank succeeded (`what` says which run failed).
pub fn run_ranks_ok(world: usize, args: &[&str], limit: std::time::Duration, what: &str) -> Vec<Run> {
    let runs = run_ranks(world, args, limit);
    assert_every_rank_succeeded(what, &runs);
    runs
}

/// Asserts that every rank of `runs` succeeded; where one did not, shows every rank's end (the
/// rank that failed first may only say another never came).
pub fn assert_every_rank_succeeded(what: &str, runs: &[Run]) {
    if runs.iter().any(|run| !run.output.status.success()) {
        let ends: Vec<String> = runs
            .iter()
            .enumerate()
            .map(|(rank, run)| format!("rank {rank} ({}):\n{}", run.output.status, run.stderr()))
            .collect();
        panic!("{what}: a rank failed:\n{}", ends.join("\n"));
    }
}

/// Runs the runtime with `args`, which must fail; returns its stdout and stderr together.
pub fn refused(args: &[&str]) -> String {
    let output = runtime().args(args).output().unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "{args:?} was accepted:\n{all}");
    all
}

/// A command line's words.
pub fn words(text: &str) -> Vec<&str> {
    text.split_whitespace().collect()
}

/// One rank's parameters from a `--save-params` folder.
pub fn rank_params(dir: &Path, rank: usize) -> std::collections::BTreeMap<String, tch::Tensor> {
    tch::Tensor::read_safetensors(dir.join(format!("rank-{rank}.safetensors")))
        .unwrap()
        .into_iter()
        .collect()
}

/// Reads a `--save-params` folder into one map of parameter name to tensor, over every rank.
pub fn read_params(dir: &Path) -> std::collections::BTreeMap<String, tch::Tensor> {
    let mut params = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        for (name, tensor) in tch::Tensor::read_safetensors(entry.unwrap().path()).unwrap() {
            params.insert(name, tensor);
        }
    }
    params
}

/// Asserts that two `--save-params` folders hold the same parameters, bit for bit.
pub fn assert_same_params(a: &Path, b: &Path, what: &str) {
    let (a, b) = (read_params(a), read_params(b));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, t) in &a {
        assert!(t.equal(&b[name]), "{what}: {name} differs");
    }
}

/// The complete events (`"ph": "X"`) of a Chrome trace `--profiler-trace` wrote.
pub fn trace_events(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let trace: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    trace["traceEvents"]
        .as_array()
        .unwrap_or_else(|| panic!("{} has no traceEvents", path.display()))
        .iter()
        .filter(|e| e["ph"] == "X")
        .cloned()
        .collect()
}

/// The names of a trace's `ProfilerStep#N` scopes, in order: the iterations it recorded.
pub fn trace_steps(events: &[serde_json::Value]) -> Vec<String> {
    let mut steps: Vec<(f64, String)> = events
        .iter()
        .filter_map(|e| {
            let name = e["name"].as_str()?;
            // On a GPU, Kineto mirrors each step's scope on the GPU's timeline: not a step.
            (name.starts_with("ProfilerStep#") && e["cat"] != "gpu_user_annotation")
                .then(|| (e["ts"].as_f64().unwrap(), name.to_string()))
        })
        .collect();
    steps.sort_by(|a, b| a.0.total_cmp(&b.0));
    steps.into_iter().map(|(_, name)| name).collect()
}
