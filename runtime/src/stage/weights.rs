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
/// archive, or libtorch's own `save_multi` format. A `module.` prefix on every name (a state dict
/// saved from DDP) is dropped.
pub fn read(path: &Path) -> Result<HashMap<String, Tensor>, String> {
    let named = match path.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => {
            // Opened first, so that a missing or unreadable file says so in words.
            std::fs::File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
            Tensor::read_safetensors(path).map_err(|e| safetensors_reason(&e.to_string()))
        }
        _ => super::torch_save::read(path)
            .or_else(|zip| Tensor::load_multi(path).map_err(|_| zip))
            .map_err(|e| {
                format!(
                    "neither a torch.save state dict nor a safetensors file (name it .safetensors if \
                     it is one): {e}"
                )
            }),
    }?;
    let prefixed = !named.is_empty() && named.iter().all(|(n, _)| n.starts_with("module."));
    Ok(named
        .into_iter()
        .map(|(name, t)| match prefixed {
            true => (name["module.".len()..].to_string(), t),
            false => (name, t),
        })
        .collect())
}

/// Why a safetensors file could not be read, in words: tch reports the safetensors crate's error
/// by its variant's name (`MetadataIncompleteBuffer`); the rest is kept as it is.
fn safetensors_reason(error: &str) -> String {
    let said = [
        (
            "MetadataIncompleteBuffer",
            "it is cut short (its header names more bytes than the file holds)",
        ),
        (
            "HeaderTooSmall",
            "it is cut short (shorter than a safetensors header)",
        ),
        (
            "InvalidHeader",
            "it is not a safetensors file (its header does not read as one)",
        ),
        (
            "HeaderTooLarge",
            "it is not a safetensors file (its header's length is not one's)",
        ),
        (
            "InvalidOffset",
            "its header's offsets do not fit its data: the file is damaged",
        ),
        (
            "TensorInvalidInfo",
            "its header's shapes do not fit its data: the file is damaged",
        ),
    ];
    said.iter()
        .find(|(variant, _)| error.contains(variant))
        .map_or_else(|| error.to_string(), |(_, words)| words.to_string())
}

/// Why named tensors do not fit a stage.
#[derive(Debug)]
pub(super) enum Misfit {
    /// A parameter or buffer of the stage has no tensor of its name.
    Missing(String),
    /// The tensor of a name has another shape than the stage's.
    Shape {
        name: String,
        theirs: Vec<i64>,
        ours: Vec<i64>,
    },
    /// libtorch could not copy it.
    Copy { name: String, error: String },
}

impl std::fmt::Display for Misfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Misfit::Missing(name) => write!(f, "no tensor `{name}`"),
            Misfit::Shape { name, theirs, ours } => {
                write!(f, "`{name}` has shape {theirs:?}, the model's has {ours:?}")
            }
            Misfit::Copy { name, error } => write!(f, "`{name}`: {error}"),
        }
    }
}

impl Stage {
    /// Copies every parameter and buffer of the stage from the tensor of its name in `named`,
    /// converted to the parameter's kind. Returns how many were copied.
    pub(super) fn copy_named(&mut self, named: &HashMap<String, Tensor>) -> Result<usize, Misfit> {
        let ours = self.variables();
        for (name, tensor) in &ours {
            let value = named.get(name).ok_or_else(|| Misfit::Missing(name.clone()))?;
            if value.size() != tensor.size() {
                return Err(Misfit::Shape {
                    name: name.clone(),
                    theirs: value.size(),
                    ours: tensor.size(),
                });
            }
            let mut target = tensor.shallow_clone();
            tch::no_grad(|| target.f_copy_(&value.to_kind(tensor.kind()))).map_err(|e| Misfit::Copy {
                name: name.clone(),
                error: e.to_string(),
            })?;
        }
        Ok(ours.len())
    }

    /// `--init-from path`: the stage's parameters and buffers from a PyTorch state dict. A file
    /// none of whose names is the model's is refused as a whole. Returns how many were taken.
    pub fn init_from(&mut self, path: &Path) -> Result<usize, String> {
        let source = path.display();
        let named = read(path).map_err(|e| format!("--init-from {source}: {e}"))?;
        let ours = self.variables();
        if !ours.is_empty() && !ours.iter().any(|(name, _)| named.contains_key(name)) {
            let mut theirs: Vec<&String> = named.keys().collect();
            theirs.sort();
            let first = |names: Vec<&String>| {
                names
                    .iter()
                    .take(3)
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(format!(
                "--init-from {source}: none of its {} tensors is named as this model's (it has {}; \
                 this stage needs {}, ...); give a state dict of the model with torchvision's or \
                 BERT's names",
                named.len(),
                first(theirs),
                first(ours.iter().map(|(n, _)| n).collect())
            ));
        }
        self.copy_named(&named).map_err(|misfit| {
            let advice = match misfit {
                Misfit::Missing(_) => {
                    ", which this rank's modules need; give a state dict of the whole model (each \
                     rank takes its own modules)"
                }
                Misfit::Shape { .. } => {
                    "; check the model's size flags (--num-classes, --hidden, ...) against the weights"
                }
                Misfit::Copy { .. } => "",
            };
            format!("--init-from {source}: {misfit}{advice}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_safetensors_file_that_cannot_be_read_says_why_in_words() {
        let dir = tempfile::tempdir().unwrap();
        let whole = dir.path().join("whole.safetensors");
        let named = [(
            "w".to_string(),
            Tensor::ones([64, 64], (tch::Kind::Float, tch::Device::Cpu)),
        )];
        Tensor::write_safetensors(&named, &whole).unwrap();
        assert_eq!(read(&whole).unwrap().len(), 1);
        let bytes = std::fs::read(&whole).unwrap();
        let cases = [
            (
                bytes[..bytes.len() / 2].to_vec(),
                "it is cut short (its header names more bytes",
            ),
            (
                bytes[..4].to_vec(),
                "it is cut short (shorter than a safetensors header)",
            ),
            (
                b"not a safetensors file at all".to_vec(),
                "it is not a safetensors file",
            ),
        ];
        for (content, expected) in cases {
            let path = dir.path().join("damaged.safetensors");
            std::fs::write(&path, content).unwrap();
            let said = read(&path).unwrap_err();
            assert!(said.starts_with(expected), "{said}");
        }
        let said = read(&dir.path().join("missing.safetensors")).unwrap_err();
        assert!(said.starts_with("cannot open it: No such file"), "{said}");
    }
}
