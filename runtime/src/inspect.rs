//! `runtime modules`: the model's module list with parameter counts and output shapes, so users
//! can write stage configs by hand.

use std::io::Write;

use serde::Serialize;
use tch::nn;

use crate::config::ModulesConfig;
use crate::models::ModelDef;

/// One row of the listing.
#[derive(Debug, Serialize)]
pub struct ModuleRow {
    pub index: usize,
    pub name: String,
    pub params: u64,
    pub output_shape: Vec<i64>,
}

/// Builds the whole model on the CPU and runs one batch through it to learn each output shape.
pub fn module_rows(model: &ModelDef, batch_size: usize) -> anyhow::Result<Vec<ModuleRow>> {
    let counts = model.param_counts();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let layers = model.build(&vs.root(), 0..model.num_modules(), 0);
    let mut rows = Vec::with_capacity(model.num_modules());
    let mut xs = model.example_input(batch_size as i64);
    tch::no_grad(|| {
        for (index, layer) in layers.iter().enumerate() {
            xs = layer.forward_t(&xs, false);
            rows.push(ModuleRow {
                index,
                name: model.module_name(index).to_string(),
                params: counts[index],
                output_shape: xs.size(),
            });
        }
    });
    rows.push(ModuleRow {
        index: layers.len(),
        name: "loss".into(),
        params: 0,
        output_shape: vec![],
    });
    Ok(rows)
}

pub fn run(config: &ModulesConfig, out: &mut impl Write) -> anyhow::Result<()> {
    let model = ModelDef::named(&config.model.name, &config.model.options)?;
    let rows = module_rows(&model, config.batch_size)?;
    if config.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(4).max(4);
    writeln!(
        out,
        "{:>5}  {:<width$}  {:>12}  output shape",
        "index", "name", "params"
    )?;
    for r in &rows {
        let shape = format!("{:?}", r.output_shape);
        writeln!(
            out,
            "{:>5}  {:<width$}  {:>12}  {shape}",
            r.index, r.name, r.params
        )?;
    }
    let total: u64 = rows.iter().map(|r| r.params).sum();
    writeln!(out, "{} modules (the loss last), {total} parameters", rows.len())?;
    Ok(())
}
