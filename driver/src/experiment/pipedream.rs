//! PipeDream's partitioned models: `module: models.<model>.gpus=<N>` names the folder
//! `models/<model>/gpus=<N>/` that PipeDream's `convert_graph_to_model.py` wrote, whose
//! `__init__.py` lists the stage modules (`stage0.py`, ...) and the criterion in order, and whose
//! stage config (`config_file`, e.g. `hybrid_conf.json`) maps those modules to stages. This
//! module reads the layers each stage module defines and finds, for each, the run of the
//! runtime's modules that holds the same layers ([`stagehand_contract::architecture`]), so the
//! stage config can be rewritten over the runtime's modules with the same split.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use stagehand_contract::architecture::Layer;

/// A `module:` naming a PipeDream partitioned model: the runtime's model and the folder's name.
pub fn partitioned_module(module: &str) -> Option<(&str, &str)> {
    let rest = module.strip_prefix("models.")?;
    let (model, folder) = rest.split_once('.')?;
    (folder.starts_with("gpus=") && !model.is_empty()).then_some((model, folder))
}

/// One layer of a stage module, with where it is defined.
#[derive(Debug, Clone, PartialEq)]
pub struct DefinedLayer {
    pub layer: Layer,
    /// `stage1.py:12`.
    pub at: String,
}

/// PipeDream's modules in order: a stage module's layers, or `None` for the criterion.
pub type PipeDreamModules = Vec<(String, Option<Vec<DefinedLayer>>)>;

/// Reads the folder's `__init__.py` and its stage files.
pub fn read_folder(dir: &Path) -> Result<PipeDreamModules, String> {
    let init_path = dir.join("__init__.py");
    let init = std::fs::read_to_string(&init_path).map_err(|e| {
        format!(
            "cannot read {} (PipeDream's partitioned model): {e}",
            init_path.display()
        )
    })?;
    // `from .stage0 import Stage0`: the file of each class.
    let mut files: BTreeMap<String, String> = BTreeMap::new();
    for line in init.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if let ["from", module, "import", class] = parts[..] {
            if let Some(file) = module.strip_prefix('.') {
                files.insert(class.to_string(), format!("{file}.py"));
            }
        }
    }
    let body = init.split_once("def model(").map(|(_, b)| b).ok_or_else(|| {
        format!(
            "{}: no `def model(criterion)` listing the stages",
            init_path.display()
        )
    })?;
    let mut modules = Vec::new();
    for line in body.lines().skip(1) {
        let entry = line.trim();
        if entry.starts_with("def ") {
            break;
        }
        let Some(inner) = entry.strip_prefix('(') else {
            continue;
        };
        let head = inner.split(',').next().unwrap_or_default().trim();
        if let Some(class) = head.strip_suffix("()") {
            let file = files.get(class).ok_or_else(|| {
                format!(
                    "{}: {class} is not imported from a stage file",
                    init_path.display()
                )
            })?;
            modules.push((file.clone(), Some(read_stage(&dir.join(file))?)));
        } else {
            modules.push((head.to_string(), None));
        }
    }
    if modules.iter().all(|(_, m)| m.is_none()) {
        return Err(format!(
            "{}: `model()` lists no stage modules",
            init_path.display()
        ));
    }
    Ok(modules)
}

/// The layers a stage file defines (`self.layerN = torch.nn.X(...)`), in order.
fn read_stage(path: &Path) -> Result<Vec<DefinedLayer>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let mut layers = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let Some((_, call)) = line.trim().split_once("= torch.nn.") else {
            continue;
        };
        let at = format!("{name}:{}", i + 1);
        let Some((class, args)) = call.split_once('(') else {
            continue;
        };
        let args = args.strip_suffix(')').unwrap_or(args);
        if let Some(layer) = parse_layer(class, args).map_err(|e| format!("{at}: {e}: {}", line.trim()))? {
            layers.push(DefinedLayer { layer, at });
        }
    }
    Ok(layers)
}

/// The arguments of a constructor call, positional and `key=value`, split at top-level commas.
fn split_args(args: &str) -> (Vec<String>, BTreeMap<String, String>) {
    let (mut parts, mut depth, mut current) = (Vec::new(), 0, String::new());
    for c in args.chars() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    parts.push(current);
    let (mut positional, mut named) = (Vec::new(), BTreeMap::new());
    for part in parts.iter().map(|p| p.trim()).filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some((k, v)) => {
                named.insert(k.trim().to_string(), v.trim().to_string());
            }
            None => positional.push(part.to_string()),
        }
    }
    (positional, named)
}

fn parse_layer(class: &str, args: &str) -> Result<Option<Layer>, String> {
    let (positional, named) = split_args(args);
    let int = |index: usize, key: &str| -> Result<u32, String> {
        let text = positional
            .get(index)
            .or_else(|| named.get(key))
            .ok_or_else(|| format!("{class} without {key}"))?;
        // `(3, 3)` for a square kernel: its first side.
        let first = text
            .trim_start_matches('(')
            .split(',')
            .next()
            .unwrap_or_default()
            .trim();
        first
            .parse()
            .map_err(|_| format!("{class}: {key} `{text}` is not a whole number"))
    };
    let bias = named.get("bias").is_none_or(|b| b != "False");
    Ok(match class {
        "Conv2d" => Some(Layer::Conv {
            c_in: int(0, "in_channels")?,
            c_out: int(1, "out_channels")?,
            kernel: int(2, "kernel_size")?,
            bias,
        }),
        "Linear" => Some(Layer::Linear {
            d_in: int(0, "in_features")?,
            d_out: int(1, "out_features")?,
        }),
        "BatchNorm2d" => Some(Layer::BatchNorm {
            channels: int(0, "num_features")?,
        }),
        "MaxPool2d" => Some(Layer::MaxPool),
        _ => None,
    })
}

/// The runtime's `module_to_stage_map` for PipeDream's (`pipedream_map`, one stage per PipeDream
/// module, the criterion last): each of the runtime's modules takes the stage of the PipeDream
/// module holding its layers, the loss the criterion's. `ours` lists the layers of each of the
/// runtime's modules, `names` their names.
pub fn translate(
    pipedream_map: &[usize],
    modules: &PipeDreamModules,
    ours: &[Vec<Layer>],
    names: &dyn Fn(usize) -> String,
) -> Result<Vec<usize>, String> {
    if pipedream_map.len() != modules.len() {
        return Err(format!(
            "module_to_stage_map has {} entries, but the partitioned model has {} modules ({}); \
             the stage config and the folder do not belong together",
            pipedream_map.len(),
            modules.len(),
            modules
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut ours_map = Vec::with_capacity(ours.len() + 1);
    let mut next = 0;
    for (index, (file, layers)) in modules.iter().enumerate() {
        let Some(layers) = layers else { continue };
        if layers.is_empty() {
            return Err(format!(
                "{file} holds no layer (it only passes its input on), but each of the runtime's \
                 stages runs at least one module; re-partition with `driver plan` (or config_file: \
                 auto)"
            ));
        }
        // What this stage module still holds that the runtime's modules taken so far do not.
        let mut need: Vec<&DefinedLayer> = layers.iter().collect();
        while !need.is_empty() {
            let Some(module) = ours.get(next) else {
                let first = need[0];
                return Err(format!(
                    "{} {} has no counterpart in the runtime's model: its modules are used up",
                    first.at, first.layer
                ));
            };
            for layer in module {
                match need.iter().position(|d| d.layer == *layer) {
                    Some(at) => {
                        need.remove(at);
                    }
                    None if need.is_empty() => {
                        return Err(format!(
                            "{file} ends inside the runtime's module {}, whose {layer} is in the \
                             next stage module: PipeDream cut where several tensors cross (inside a \
                             residual block), and the runtime keeps such a module whole and sends \
                             one tensor between stages; re-partition with `driver plan` (or \
                             config_file: auto)",
                            names(next)
                        ));
                    }
                    None => {
                        let first = need[0];
                        return Err(format!(
                            "{file} and the runtime's modules do not line up: the runtime's module \
                             {} holds {layer}, which {file} does not have where {} {} is; PipeDream \
                             cut inside a module the runtime keeps whole, so re-partition with \
                             `driver plan` (or config_file: auto)",
                            names(next),
                            first.at,
                            first.layer
                        ));
                    }
                }
            }
            ours_map.push(pipedream_map[index]);
            next += 1;
        }
    }
    // Modules holding nothing a cut is fixed by (flattening, pooling to a size) go with the
    // last stage module before them; anything else left over is a layer PipeDream's lacks.
    if let Some(extra) = (next..ours.len()).find(|&i| !ours[i].is_empty()) {
        return Err(format!(
            "the runtime's module {} holds {}, which no stage module of the partitioned model has",
            names(extra),
            ours[extra][0]
        ));
    }
    let last_stage_module = (0..modules.len())
        .rev()
        .find(|&i| modules[i].1.is_some())
        .expect("a stage module exists");
    ours_map.resize(ours.len(), pipedream_map[last_stage_module]);
    ours_map.push(*pipedream_map.last().expect("checked non-empty"));
    Ok(ours_map)
}

/// Where the translated stage config is written: a file named by its content in this user's
/// cache (`$XDG_CACHE_HOME`, else `~/.cache`, else the temporary folder), so the same experiment
/// resolves to the same path and the records folder holds records only.
pub fn translated_path(text: &str) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache
        .join("stagehand")
        .join("stage-configs")
        .join(format!("pipedream-{:016x}.json", hasher.finish()))
}
