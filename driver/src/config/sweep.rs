//! The experiment file's `sweep:` section: experiment keys and the values each takes, in the
//! order written (the first key is what a sweep's plot puts on its x axis).

use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
