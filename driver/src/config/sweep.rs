//! The experiment file's `sweep:` section: experiment keys and the values each takes, in the
//! order written (the first key is what a sweep's plot puts on its x axis); and a point's file,
//! the experiment file with the point's values set.

use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::yaml::{PointOrigin, SetBy};
use super::{canonical_key, yaml, ConfigError, ExperimentFile, Loaded};

/// Grid axes, in the order written.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sweep {
    /// Each key and its values.
    pub axes: Vec<Axis>,
}

/// One experiment key and the values a sweep gives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Axis {
    /// An experiment file key (`batch_size`, `schedule`, ...).
    pub key: String,
    /// The values, as they would be written in the file.
    pub values: Vec<serde_json::Value>,
}

impl Serialize for Sweep {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.axes.len()))?;
        for axis in &self.axes {
            map.serialize_entry(&axis.key, &axis.values)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Sweep {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Sweep, D::Error> {
        struct SweepVisitor;
        impl<'de> Visitor<'de> for SweepVisitor {
            type Value = Sweep;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a mapping of experiment keys to lists of values, e.g. `batch_size: [32, 64]`")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Sweep, A::Error> {
                let mut axes: Vec<Axis> = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let values: Vec<serde_json::Value> = map.next_value()?;
                    if values.is_empty() {
                        return Err(serde::de::Error::custom(format!(
                            "sweep key `{key}` has no values; list at least one"
                        )));
                    }
                    if axes.iter().any(|a| a.key == key) {
                        return Err(serde::de::Error::custom(format!(
                            "sweep key `{key}` is listed twice"
                        )));
                    }
                    axes.push(Axis { key, values });
                }
                Ok(Sweep { axes })
            }
        }
        deserializer.deserialize_map(SweepVisitor)
    }
}

/// Keys a sweep sets itself, so a grid may not.
const SET_BY_THE_SWEEP: [&str; 3] = ["name", "log_directory", "sweep"];

/// Whether `value` is valid for the experiment key `key`, as a grid would set it; the message
/// says what is wrong.
pub fn check_grid_value(key: &str, value: &serde_json::Value) -> Result<(), String> {
    if SET_BY_THE_SWEEP.contains(&key) {
        return Err(format!(
            "`{key}` is set by the sweep itself and cannot be a grid key"
        ));
    }
    let mut probe = serde_json::Map::new();
    probe.insert("machines".into(), serde_json::json!(["localhost"]));
    probe.insert(key.to_string(), value.clone());
    match serde_json::from_value::<ExperimentFile>(serde_json::Value::Object(probe)) {
        Ok(_) => Ok(()),
        Err(e) => Err(yaml::describe_value_error(&e.to_string())),
    }
}

/// The experiment file with a sweep point's values set: `overrides` replace the keys they name
/// (under any spelling), `name` is the point's, and the `sweep:` section is gone. A
/// `checkpoint_dir` becomes the point's own folder inside it, under the sweep's (`DIR/<sweep>/<name>`,
/// `sweep` the sweep folder's name): points sharing one would overwrite each other's checkpoints
/// and, with `resume`, start from another point's, and a later sweep of the same file from an
/// earlier sweep's. Where the file does not say `resume`, a point that checkpoints resumes from
/// its own checkpoint when there is one (`resume: auto`): a point run again (`driver sweep
/// --resume`) goes on from where it was stopped.
pub fn with_overrides(
    loaded: &Loaded,
    name: &str,
    sweep: &str,
    overrides: &[(String, serde_json::Value)],
) -> Result<Loaded, ConfigError> {
    let mut document = yaml::parse_document(&loaded.path, &loaded.text)?;
    let map = document
        .as_object_mut()
        .ok_or_else(|| loaded.error_at("machines", "expected a mapping of experiment keys"))?;
    map.remove("sweep");
    for (key, value) in overrides {
        let canonical = canonical_key(key);
        map.retain(|k, _| canonical_key(k) != canonical);
        map.insert(canonical.to_string(), value.clone());
    }
    map.insert("name".into(), serde_json::Value::String(name.to_string()));
    if let Some(serde_json::Value::String(dir)) = map.get_mut("checkpoint_dir") {
        *dir = std::path::Path::new(dir.as_str())
            .join(sweep)
            .join(name)
            .to_string_lossy()
            .into_owned();
        if !map.keys().any(|k| canonical_key(k) == "resume") {
            map.insert("resume".into(), serde_json::Value::String("auto".into()));
        }
    }
    let settings: Vec<String> = overrides
        .iter()
        .map(|(k, v)| format!("{k}={}", value_text(v)))
        .collect();
    let text = format!(
        "# sweep point {name} ({}) of {}\n{}",
        settings.join(" "),
        loaded.path.display(),
        yaml::to_text(&document)
    );
    let file = yaml::parse(&loaded.path, &text)?;
    let given = match &loaded.point {
        Some(point) => point.given.clone(),
        None => loaded.text.clone(),
    };
    // A value the file's `sweep:` section lists is located there; any other came with `--grid`.
    let set = overrides
        .iter()
        .map(|(key, value)| {
            let canonical = canonical_key(key);
            let in_section = loaded.file.sweep.as_ref().is_some_and(|sweep| {
                sweep
                    .axes
                    .iter()
                    .any(|a| canonical_key(&a.key) == canonical && a.values.contains(value))
            });
            let by = match yaml::locate_sweep_key(&given, canonical).filter(|_| in_section) {
                Some(at) => SetBy::Section(at),
                None => SetBy::Grid,
            };
            (canonical.to_string(), by)
        })
        .collect();
    Ok(Loaded {
        path: loaded.path.clone(),
        text,
        file,
        point: Some(Box::new(PointOrigin { given, set })),
    })
}

/// A value as a person writes it: strings bare, everything else as JSON.
pub fn value_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}
