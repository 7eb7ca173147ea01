//! Training: builds the stage a rank runs, pulls batches, runs the iterations, and reports each
//! one as a metrics event.

mod stage;

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context};
use stagehand_contract::{Event, Iteration, Start, Summary, SCHEMA_VERSION};

use crate::config::{DeviceSpec, TrainConfig};
use crate::data::{self, BatchRequest, Shard};
use crate::metrics::{peak_rss_bytes, Emitter, Throughput};
use crate::models::ModelDef;
pub use stage::Stage;

/// Checks that the requested device exists before anything is allocated on it.
fn check_device(device: DeviceSpec) -> anyhow::Result<()> {
    if let DeviceSpec::Cuda(index) = device {
        let count = tch::Cuda::device_count() as usize;
        if !tch::Cuda::is_available() || index >= count {
            bail!("--device: cuda:{index} requested but this machine has {count} CUDA device(s); use --device cpu");
        }
    }
    Ok(())
}

/// Trains one process holding the whole model.
pub fn run<W: Write>(config: &TrainConfig, out: &mut Emitter<W>) -> anyhow::Result<()> {
    if let Some(threads) = config.threads {
        tch::set_num_threads(threads as i32);
    }
    check_device(config.device)?;
    let device = config.device.tch();
    let model = ModelDef::named(&config.model.name, &config.model.options)?;
    let num_params: u64 = model.param_counts().iter().sum();
    let range = 0..model.num_modules();
    let mut stage = Stage::build(
        &model,
        range.clone(),
        config.seed,
        device,
        config.optimizer,
        config.lr,
    )
    .context("building the model")?;
    let request = BatchRequest {
        input: model.input,
        batch_size: config.batch_size,
        seed: config.seed,
        shard: Shard::WHOLE,
        device,
    };
    let mut batches = data::open(&config.data, request)?;

    out.emit(&Event::Start(Start {
        schema_version: SCHEMA_VERSION,
        rank: 0,
        world_size: 1,
        stage: 0,
        num_stages: 1,
        num_modules: model.num_modules(),
        num_params,
        first_module: range.start,
        end_module: range.end,
        stage_params: stage.num_params(),
        config: config.to_run_config(tch::get_num_threads() as usize),
    }))?;
    eprintln!(
        "runtime: training {} ({} parameters, {} modules) on {} with batch {} for {} iterations",
        model.name,
        num_params,
        model.num_modules(),
        config.device,
        config.batch_size,
        config.iterations
    );

    let mut throughput = Throughput::default();
    let (mut total, mut compute_total, mut idle_total) = (0.0, 0.0, 0.0);
    let mut last_loss = None;
    for iteration in 0..config.iterations {
        let started = Instant::now();
        let (input, target) = batches.next_batch()?;
        let data_wait = started.elapsed().as_secs_f64();

        stage.zero_grad();
        let output = stage.forward(&input, true);
        let loss = stage
            .loss(&output, &target)
            .expect("a whole model ends with its loss")
            .context("computing the loss")?;
        loss.backward();
        stage.step();
        let loss = loss.double_value(&[]);
        if !loss.is_finite() {
            bail!("loss became {loss} at iteration {iteration}; lower --lr");
        }

        let time_s = started.elapsed().as_secs_f64();
        let samples_per_sec = config.batch_size as f64 / time_s;
        if iteration >= config.warmup {
            throughput.push(samples_per_sec);
        }
        total += time_s;
        compute_total += time_s - data_wait;
        idle_total += data_wait;
        last_loss = Some(loss);
        out.emit(&Event::Iteration(Iteration {
            iteration,
            rank: 0,
            stage: 0,
            loss: Some(loss),
            samples: config.batch_size as u64,
            time_s,
            samples_per_sec,
            compute_s: time_s - data_wait,
            comm_wait_s: 0.0,
            idle_s: data_wait,
            peak_mem_bytes: peak_rss_bytes(),
        }))?;
    }

    let summary = Summary {
        rank: 0,
        stage: 0,
        iterations: config.iterations,
        warmup_iterations: config.warmup.min(config.iterations),
        samples_per_sec_mean: throughput.mean(),
        samples_per_sec_std: throughput.std(),
        time_s: total,
        compute_s: compute_total,
        comm_wait_s: 0.0,
        idle_s: idle_total,
        final_loss: last_loss,
        peak_mem_bytes: peak_rss_bytes(),
    };
    eprintln!(
        "runtime: done: {:.1} samples/s (std {:.1}), final loss {}",
        summary.samples_per_sec_mean,
        summary.samples_per_sec_std,
        last_loss.map_or("-".to_string(), |l| format!("{l:.4}"))
    );
    out.emit(&Event::Summary(summary))?;
    Ok(())
}
