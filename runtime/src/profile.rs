//! `runtime profile`: measures each module of a model (forward and backward seconds, median of
//! several repeats; output activation bytes; parameter bytes) and writes the profile JSON the
//! planner reads (`stagehand_contract::Profile`).

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use stagehand_contract::{ModuleProfile, Profile, PROFILE_VERSION};
use tch::{Device, Kind, Tensor};

use crate::config::{OptimizerKind, ProfileConfig};
use crate::host_memory;
use crate::models::{InputKind, ModelDef};
use crate::stage::{backward_with_grad, Optimizer, Stage};

/// A timing boundary; a device's fault is left to the next operation to report (profiling has no
/// error path of its own).
fn sync(device: Device) {
    let _ = crate::cuda::synchronize(device);
}

/// Median seconds of `repeats` runs of `f` after one warm-up run; `f` returns the seconds it
/// wants counted (so set-up inside it stays untimed).
fn median_seconds(repeats: usize, mut f: impl FnMut() -> f64) -> f64 {
    f();
    median((0..repeats).map(|_| f()).collect())
}

/// The median: the middle value, or the mean of the two middle ones (an even count's upper one
/// alone would keep the slower of two repeats).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    match n % 2 {
        1 => times[n / 2],
        _ => (times[n / 2 - 1] + times[n / 2]) / 2.0,
    }
}

fn timed(device: Device, f: impl FnOnce()) -> f64 {
    sync(device);
    let started = Instant::now();
    f();
    sync(device);
    started.elapsed().as_secs_f64()
}

/// Bytes `t` weighs crossing a stage boundary: a sparse COO tensor's entries and header as
/// they travel (pipeline/sparse.rs), a dense tensor's elements.
fn bytes(t: &Tensor) -> u64 {
    bytes_as(t, t.kind())
}

/// The bytes `t` weighs with its values in `kind`.
fn bytes_as(t: &Tensor, kind: Kind) -> u64 {
    match t.is_sparse() {
        true => crate::pipeline::coo_wire_bytes(t, kind),
        false => (t.numel() * kind.elt_size_in_bytes()) as u64,
    }
}

/// What `t` weighs crossing a stage boundary under `--compress-activations`: a float32
/// activation travels in float16, anything else as it is (the pipeline's wire kind).
fn compressed_bytes(t: &Tensor) -> u64 {
    match t.kind() {
        Kind::Float => bytes_as(t, Kind::Half),
        kind => bytes_as(t, kind),
    }
}

/// Median seconds of an SGD-with-momentum step over `params` (gradients set to ones; the
/// momentum buffers exist after the warm-up step, as in training).
fn optimizer_seconds(params: Vec<Tensor>, repeats: usize, device: Device) -> f64 {
    if params.is_empty() {
        return 0.0;
    }
    let mut optimizer = Optimizer::new(
        OptimizerKind::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        },
        1e-6,
        params.iter().map(Tensor::shallow_clone).collect(),
    );
    median_seconds(repeats, || {
        for p in &params {
            p.sum(Kind::Float).backward();
        }
        timed(device, || {
            optimizer
                .step()
                .unwrap_or_else(|e| panic!("profiling the optimizer step: {e}"))
        })
    })
}

/// Measures every module of the model.
pub fn measure(config: &ProfileConfig) -> anyhow::Result<Profile> {
    host_memory::apply(config.host_memory);
    if let Some(threads) = config.threads {
        tch::set_num_threads(threads as i32);
    }
    crate::cuda::bind_device(config.device.tch()).map_err(anyhow::Error::msg)?;
    let device = config.device.tch();
    let model = ModelDef::named(&config.model.name, &config.model.options)?;
    let param_bytes: Vec<u64> = model.param_counts().iter().map(|n| n * 4).collect();
    // Each module a stage of its own, so its parameters (and their optimizer step) are its own
    // and it computes as a training run's stage does (autocast, channels_last); the last one holds
    // no layers, only the loss.
    let stages = (0..model.num_modules())
        .map(|i| {
            let mut stage = Stage::build(&model, i..i + 1, 0, device);
            stage
                .set_arithmetic(config.precision, config.channels_last)
                .map(|()| stage)
                .map_err(|e| anyhow::anyhow!("--precision/--channels-last: {e}"))
        })
        .collect::<anyhow::Result<Vec<Stage>>>()?;
    let (loss_stage, layers) = stages.split_last().expect("a model has a loss");
    let batch = config.batch_size as i64;
    let (mut xs, target) = crate::models::seeded(0, || match model.input {
        InputKind::Image { size, classes } => (
            Tensor::randn([batch, 3, size, size], (Kind::Float, device)),
            Tensor::randint(classes, [batch], (Kind::Int64, device)),
        ),
        InputKind::Tokens { seq_len, vocab } => (
            Tensor::randint(vocab, [batch, seq_len], (Kind::Int64, device)),
            Tensor::randint(vocab, [batch, seq_len], (Kind::Int64, device)),
        ),
    });
    let mut modules = Vec::with_capacity(model.num_modules());
    for (index, layer) in layers.iter().enumerate() {
        // Inputs after the first carry gradients, as they do inside a model.
        let input = if index > 0 && xs.is_floating_point() {
            xs.detach().set_requires_grad(true)
        } else {
            xs.detach()
        };
        let forward_s = median_seconds(config.repeats, || {
            timed(device, || drop(layer.forward(&input, true)))
        });
        let output = layer.forward(&input, true);
        let backward_s = if output.requires_grad() {
            // A sparse output's gradient is sparse on the same entries (what a sparse product
            // sends back).
            let grad = match output.is_sparse() {
                true => output.detach() * 1.0,
                false => crate::models::seeded(1, || output.randn_like()),
            };
            median_seconds(config.repeats, || {
                let out = layer.forward(&input, true);
                timed(device, || {
                    backward_with_grad(&out, &grad).expect("a module's own output takes its gradient")
                })
            })
        } else {
            0.0
        };
        let optimizer_s = optimizer_seconds(layer.params(), config.repeats, device);
        modules.push(ModuleProfile {
            index,
            name: model.module_name(index).to_string(),
            forward_s,
            backward_s,
            optimizer_s,
            // The output in the kind autocast computed it in: what crosses a stage boundary.
            activation_bytes: bytes(&output),
            compressed_activation_bytes: Some(compressed_bytes(&output)),
            param_bytes: param_bytes[index],
            output_shape: output.size(),
        });
        xs = output.detach();
    }
    let input = xs.detach().set_requires_grad(true);
    let loss_of = || {
        loss_stage
            .loss(&input, &target)
            .expect("the last stage ends the model")
            .context("computing the loss")
    };
    let forward_s = median_seconds(config.repeats, || timed(device, || drop(loss_of())));
    let backward_s = median_seconds(config.repeats, || match loss_of() {
        Ok(loss) => timed(device, || loss.backward()),
        Err(_) => 0.0,
    });
    let loss = loss_of()?;
    modules.push(ModuleProfile {
        index: layers.len(),
        name: "loss".into(),
        forward_s,
        backward_s,
        optimizer_s: 0.0,
        activation_bytes: bytes(&loss),
        compressed_activation_bytes: Some(compressed_bytes(&loss)),
        param_bytes: 0,
        output_shape: loss.size(),
    });
    Ok(Profile {
        format_version: PROFILE_VERSION,
        model: model.name.clone(),
        batch_size: config.batch_size,
        device: config.device.to_string(),
        threads: tch::get_num_threads() as usize,
        repeats: config.repeats,
        precision: config.precision.to_string(),
        channels_last: config.channels_last,
        // Dropout sizes nothing a profile measures.
        sizes: crate::models::size_flags(&model.name)
            .iter()
            .filter(|&&flag| flag != "--dropout")
            .filter_map(|flag| Some((flag.to_string(), config.model.options.value_of(flag)?)))
            .collect(),
        modules,
    })
}

pub fn run(config: &ProfileConfig, out: &mut impl Write) -> anyhow::Result<()> {
    if config.channels_last && !crate::models::has_convolutions(&config.model.name) {
        eprintln!(
            "runtime: warning: --channels-last does nothing for {}, which has no convolutions; drop it",
            config.model.name
        );
    }
    let profile = measure(config)?;
    let text = serde_json::to_string_pretty(&profile)?;
    match &config.output {
        Some(path) => {
            std::fs::write(path, text + "\n")
                .with_context(|| format!("--output: cannot write {}", path.display()))?;
            let total: f64 = profile.modules.iter().map(|m| m.forward_s + m.backward_s).sum();
            eprintln!(
                "runtime: profiled {} modules of {} at batch {}: {:.1} ms per iteration; wrote {}",
                profile.modules.len(),
                profile.model,
                profile.batch_size,
                total * 1e3,
                path.display()
            );
        }
        None => writeln!(out, "{text}")?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(vec![0.084, 1.007]), (0.084 + 1.007) / 2.0);
        assert_eq!(super::median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
