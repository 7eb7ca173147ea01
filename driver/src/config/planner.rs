//! `config_file: auto` and the `planner:` section: the experiment's stage config either comes from
//! a file or is planned at launch from a profile taken on the first machine.

use std::fmt;
use std::path::PathBuf;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where the stage config comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageConfigRef {
    /// Profile the model on the first machine and plan the stages for the experiment's machines.
    Auto,
    /// A PipeDream stage config JSON, relative to the experiment file.
    File(PathBuf),
}

impl StageConfigRef {
    /// The file, when one is named.
    pub fn file(&self) -> Option<&PathBuf> {
        match self {
            StageConfigRef::Auto => None,
            StageConfigRef::File(path) => Some(path),
        }
    }
}

impl Serialize for StageConfigRef {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            StageConfigRef::Auto => serializer.serialize_str("auto"),
            StageConfigRef::File(path) => path.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for StageConfigRef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RefVisitor;

        impl Visitor<'_> for RefVisitor {
            type Value = StageConfigRef;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a stage config JSON file, or `auto` to plan one at launch")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<StageConfigRef, E> {
                match v.trim() {
                    "" => Err(E::custom(
                        "config_file is empty; name a stage config JSON, or write `auto`",
                    )),
                    "auto" => Ok(StageConfigRef::Auto),
                    path => Ok(StageConfigRef::File(PathBuf::from(path))),
                }
            }
        }

        deserializer.deserialize_str(RefVisitor)
    }
}

/// How `config_file: auto` plans; every key is optional.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerSettings {
    /// GB/s between ranks on one machine (default 10 for GPUs, 2 for CPU ranks over loopback).
    #[serde(default, deserialize_with = "positive")]
    pub intra_host_gbps: Option<f64>,
    /// GB/s between machines (default 1.25, i.e. 10 Gb Ethernet).
    #[serde(default, deserialize_with = "positive")]
    pub inter_host_gbps: Option<f64>,
    /// Memory per worker in GiB; no limit when absent.
    #[serde(default, deserialize_with = "positive")]
    pub memory_gib: Option<f64>,
    /// One rank per stage: no replicated stages.
    #[serde(default)]
    pub straight: bool,
    /// Use this profile (from `runtime profile`) instead of profiling at launch; relative to the
    /// experiment file. Its batch size must be the experiment's microbatch size.
    #[serde(default)]
    pub profile: Option<PathBuf>,
    /// Timed repeats per module when profiling at launch (default 5).
    #[serde(default)]
    pub repeats: Option<u32>,
}

fn positive<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<f64>, D::Error> {
    let value = Option::<f64>::deserialize(deserializer)?;
    match value {
        Some(v) if !(v.is_finite() && v > 0.0) => {
            Err(de::Error::custom(format!("{v} is not a positive number")))
        }
        _ => Ok(value),
    }
}
