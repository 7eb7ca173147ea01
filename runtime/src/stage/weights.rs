//! Weights from PyTorch (`--init-from FILE`): a state dict saved by `torch.save(model.state_dict())`
//! (its zip archive, read by `torch_save.rs`) or a safetensors file, under
//! torchvision's and BERT's names, which are the runtime's. Each rank takes the tensors of its own
//! modules; names the model does not have (`num_batches_tracked`, another stage's modules) are
//! left alone, and a `module.` prefix (a state dict saved from DDP) is dropped.

use std::collections::HashMap;
use std::path::Path;

use tch::Tensor;

use super::Stage;

/// The named tensors of `path`: safetensors by its extension, otherwise `torch.save`'s zip
/// archive, or libtorch's own `save_multi` format.
pub fn read(path: &Path) -> Result<HashMap<String, Tensor>, String> {
    let named = match path.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => Tensor::read_safetensors(path).map_err(|e| e.to_string()),
        _ => super::torch_save::read(path)
            .or_else(|zip| Tensor::load_multi(path).map_err(|_| zip))
            .map_err(|e| {
                format!(
                    "neither a torch.save state dict nor a safetensors file (name it .safetensors if \
                     it is one): {e}"
                )
            }),
    }
    .map_err(|e| format!("--init-from {}: {e}", path.display()))?;
    let prefixed = !named.is_empty() && named.iter().all(|(n, _)| n.starts_with("module."));
    Ok(named
        .into_iter()
        .map(|(name, t)| match prefixed {
            true => (name["module.".len()..].to_string(), t),
            false => (name, t),
        })
        .collect())
}

impl Stage {
    /// Copies the stage's parameters and buffers from `named` (read from `source`): every one of
    /// them must be there with its shape; values are converted to the parameter's kind.
    /// Returns how many tensors were taken.
    pub fn load_named(&mut self, named: &HashMap<String, Tensor>, source: &Path) -> Result<usize, String> {
        let ours = self.variables();
        if !ours.is_empty() && !ours.iter().any(|(name, _)| named.contains_key(name)) {
            let mut theirs: Vec<&String> = named.keys().collect();
            theirs.sort();
            return Err(format!(
                "--init-from {}: none of its {} tensors is named as this model's (it has {}; this \
                 stage needs {}, ...); give a state dict of the model with torchvision's or BERT's names",
                source.display(),
                named.len(),
                theirs
                    .iter()
                    .take(3)
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                ours.iter()
                    .take(3)
                    .map(|(n, _)| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        for (name, mut tensor) in ours.iter().map(|(n, t)| (n, t.shallow_clone())) {
            let Some(value) = named.get(name) else {
                return Err(format!(
                    "--init-from {}: no tensor `{name}`, which this rank's modules need; give a state \
                     dict of the whole model (each rank takes its own modules)",
                    source.display()
                ));
            };
            if value.size() != tensor.size() {
                return Err(format!(
                    "--init-from {}: `{name}` has shape {:?}, the model's has {:?}; check the model's \
                     size flags (--num-classes, --hidden, ...) against the weights",
                    source.display(),
                    value.size(),
                    tensor.size()
                ));
            }
            tch::no_grad(|| tensor.f_copy_(&value.to_kind(tensor.kind())))
                .map_err(|e| format!("--init-from {}: `{name}`: {e}", source.display()))?;
        }
        Ok(ours.len())
    }
}
