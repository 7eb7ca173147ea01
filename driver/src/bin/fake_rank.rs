//! `fake-rank`: a stand-in for the runtime in the driver's tests. It reads the torchrun-style rank
//! environment, prints `start`/`iteration`/`summary` metrics lines in the contract's format on
//! stdout and human text on stderr, and can fail or hang on request. Not installed for users.
//!
//! Usage: fake-rank info | [--iterations N] [--sleep-ms MS] [--fail-rank R] [--fail-at I] [--exit-code C]
//!                  [--hang] [--batch-size B] [--later-each-start FILE]
//!
//! `--later-each-start FILE` counts the failing rank's starts in FILE and fails one iteration
//! later on each: a failure that is not the same each time.

use std::time::Duration;

use stagehand_contract::{Event, Iteration, RunConfig, Start, Summary, SCHEMA_VERSION};

fn env_usize(name: &str) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn main() {
    let mut iterations = 3u64;
    let mut sleep_ms = 20u64;
    let mut fail_rank: Option<usize> = None;
    let mut fail_at = 0u64;
    let mut exit_code = 3i32;
    let mut hang = false;
    let mut batch_size = 8u64;
    let mut later_each_start = None;
    // The runtime's self-check, as the driver's preflight asks it (`runtime info`).
    if std::env::args().nth(1).as_deref() == Some("info") {
        println!(r#"{{"torch":"fake","cuda":false,"nccl":false,"cuda_devices":0,"devices":[]}}"#);
        return;
    }
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().expect("flag needs a value");
        match a.as_str() {
            "--iterations" => iterations = value().parse().expect("number"),
            "--sleep-ms" => sleep_ms = value().parse().expect("number"),
            "--fail-rank" => fail_rank = Some(value().parse().expect("number")),
            "--fail-at" => fail_at = value().parse().expect("number"),
            "--exit-code" => exit_code = value().parse().expect("number"),
            "--batch-size" => batch_size = value().parse().expect("number"),
            "--hang" => hang = true,
            "--later-each-start" => later_each_start = Some(std::path::PathBuf::from(value())),
            other => {
                eprintln!("fake-rank: unknown argument {other:?}");
                std::process::exit(2);
            }
        }
    }
    let rank = env_usize("RANK");
    if let (Some(file), true) = (&later_each_start, fail_rank == Some(rank)) {
        let starts: u64 = std::fs::read_to_string(file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        std::fs::write(file, (starts + 1).to_string()).expect("the starts file is writable");
        fail_at += starts;
    }
    let world_size = env_usize("WORLD_SIZE").max(1);
    eprintln!(
        "fake-rank {rank}/{world_size} master {}:{} local_rank {} run {}",
        std::env::var("MASTER_ADDR").unwrap_or_default(),
        std::env::var("MASTER_PORT").unwrap_or_default(),
        env_usize("LOCAL_RANK"),
        std::env::var("STAGEHAND_RUN_ID").unwrap_or_default(),
    );
    let start = Start {
        schema_version: SCHEMA_VERSION,
        rank,
        world_size,
        stage: 0,
        num_stages: 1,
        num_modules: 3,
        num_params: 100,
        first_module: 0,
        end_module: 3,
        stage_params: 100,
        first_iteration: 0,
        config: RunConfig {
            model: "fake".into(),
            batch_size: batch_size as usize,
            iterations,
            lr: 0.1,
            optimizer: "sgd".into(),
            seed: 0,
            data: "synthetic".into(),
            augment: None,
            data_workers: None,
            device: "cpu".into(),
            threads: 1,
            schedule: "none".into(),
            microbatches: 1,
            precision: "fp32".into(),
            fp16_init_scale: None,
            channels_last: false,
            cuda_graph: false,
            deterministic: false,
            cudnn_benchmark: false,
            fused_kernels: false,
            profiler_trace: None,
            profiler_steps: None,
            host_memory: "keep".into(),
            bucket_mb: 25.0,
            overlap_reduce: true,
            compress_activations: false,
            compress: "off".into(),
            p2p_groups: None,
            reduce: "all".into(),
            sync_every: None,
            lr_policy: "constant".into(),
            lr_warmup_epochs: 0,
            epoch_iterations: None,
            validate_every: None,
            validation_batches: None,
        },
    };
    println!("{}", Event::Start(start).to_line());
    let time_s = sleep_ms.max(1) as f64 / 1000.0;
    for i in 0..iterations {
        if fail_rank == Some(rank) && i == fail_at {
            eprintln!("fake-rank {rank}: failing on purpose at iteration {i}");
            std::process::exit(exit_code);
        }
        std::thread::sleep(Duration::from_millis(sleep_ms));
        let it = Iteration {
            iteration: i,
            rank,
            stage: 0,
            loss: Some(1.0 / (i + 1) as f64),
            accuracy: Some(1.0 - 1.0 / (i + 2) as f64),
            accuracy_top5: Some(1.0 - 1.0 / (i + 4) as f64),
            lr: Some(0.1),
            samples: batch_size,
            time_s,
            samples_per_sec: batch_size as f64 / time_s,
            compute_s: time_s * 0.7,
            comm_wait_s: time_s * 0.2,
            idle_s: time_s * 0.1,
            peak_mem_bytes: None,
            host_peak_rss_bytes: None,
            gpu_peak_allocated_bytes: None,
            gpu_peak_reserved_bytes: None,
            reduce: Default::default(),
            sent_bytes: 0,
            sent_dense_bytes: 0,
            partial_reduce: None,
            loss_scale: None,
            step_skipped: None,
            checkpointed: false,
            profiled: false,
        };
        println!("{}", Event::Iteration(it).to_line());
        eprintln!("fake-rank {rank}: iteration {i} done");
    }
    if hang {
        eprintln!("fake-rank {rank}: hanging");
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    let summary = Summary {
        rank,
        stage: 0,
        iterations,
        warmup_iterations: 1,
        samples_per_sec_mean: batch_size as f64 / time_s,
        samples_per_sec_std: 0.0,
        time_s: time_s * iterations as f64,
        compute_s: time_s * 0.7 * iterations as f64,
        comm_wait_s: time_s * 0.2 * iterations as f64,
        idle_s: time_s * 0.1 * iterations as f64,
        final_loss: Some(0.5),
        final_accuracy: Some(0.5),
        final_accuracy_top5: Some(0.75),
        peak_mem_bytes: None,
        host_peak_rss_bytes: None,
        gpu_peak_allocated_bytes: None,
        gpu_peak_reserved_bytes: None,
        skipped_steps: None,
        validation: None,
    };
    println!("{}", Event::Summary(summary).to_line());
}
