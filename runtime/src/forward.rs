//! `runtime forward`: the whole model once on given weights and inputs, no training: the output
//! and the loss, written for comparison with PyTorch's on the same weights (`--init-from`'s test,
//! and a user's check that a model of ours is the one they train in PyTorch).

use std::io::Write;

use anyhow::Context;
use tch::{Device, Kind, Tensor};

use crate::config::ForwardConfig;
use crate::models::ModelDef;
use crate::stage::{weights, Stage};
use crate::train::Refused;

pub fn run(config: &ForwardConfig, out: &mut impl Write) -> anyhow::Result<()> {
    if let Some(threads) = config.threads {
        tch::set_num_threads(threads as i32);
    }
    crate::cuda::bind_device(config.device.tch()).map_err(anyhow::Error::msg)?;
    let device = config.device.tch();
    let model = ModelDef::named(&config.model.name, &config.model.options)?;
    let mut stage = Stage::build(&model, 0..model.num_modules(), 0, device);
    // Weights or inputs that are not there or do not fit are bad arguments (exit 2), as in
    // training.
    let loaded = stage
        .init_from(&config.init_from)
        .map_err(|e| Refused::error(anyhow::Error::msg(e)))?;
    let inputs = weights::read(&config.input)
        .map_err(|e| Refused::error(anyhow::anyhow!("--input {}: {e}", config.input.display())))?;
    let take = |name: &str| {
        inputs.get(name).map(|t| t.to_device(device)).ok_or_else(|| {
            Refused::error(anyhow::anyhow!(
                "--input {}: no tensor `{name}`; it needs `input` and `target`",
                config.input.display()
            ))
        })
    };
    let (input, target) = (take("input")?, take("target")?);
    let (output, loss) = tch::no_grad(|| -> anyhow::Result<(Tensor, Tensor)> {
        let output = stage.forward(&input, config.train);
        let loss = stage
            .loss(&output, &target)
            .expect("the whole model ends with its loss")
            .context("computing the loss")?;
        Ok((output, loss))
    })?;
    let (output, loss) = (output.to_device(Device::Cpu), loss.to_device(Device::Cpu));
    Tensor::write_safetensors(
        &[("output", &output), ("loss", &loss.reshape([1]))],
        &config.output,
    )
    .with_context(|| format!("writing {}", config.output.display()))?;
    let line = serde_json::json!({
        "model": model.name,
        "tensors_loaded": loaded,
        "output_shape": output.size(),
        "loss": loss.to_kind(Kind::Double).double_value(&[]),
    });
    writeln!(out, "{line}")?;
    Ok(())
}
