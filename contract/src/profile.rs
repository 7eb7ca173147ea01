//! The layer profile `runtime profile` writes and `driver plan` reads: per module of a model,
//! measured compute times and the bytes that decide communication and memory (PipeDream's
//! profiler measured the same quantities).

use serde::{Deserialize, Serialize};

/// Version of the profile format.
pub const PROFILE_VERSION: u32 = 1;

/// A model's measured profile at one batch size on one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Version of this format; see [`PROFILE_VERSION`].
    pub format_version: u32,
    /// Model name as given to `--model`.
    pub model: String,
    /// Samples per measured batch: the microbatch size the plan is for (`driver plan
    /// --microbatches M` scales the costs to minibatches of M of them).
    pub batch_size: usize,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// Intra-op threads used.
    pub threads: usize,
    /// Measured repeats per module (the times are medians).
    pub repeats: usize,
    /// The arithmetic measured (`runtime profile --precision`): `fp32`, `bf16` or `fp16`, as a
    /// training run's `--precision`. Profiles written before it was recorded are fp32.
    #[serde(default = "fp32")]
    pub precision: String,
    /// Whether parameters and image inputs were in channels_last layout (`--channels-last`).
    #[serde(default)]
    pub channels_last: bool,
    /// The model's size flags as measured, defaults included (`--layers` 6, `--hidden` 1024,
    /// `--image-size` 224, ...): a plan for a model of other sizes would rest on another model's
    /// costs. Absent from profiles written before it was recorded.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub sizes: std::collections::BTreeMap<String, serde_json::Value>,
    /// The modules in order, the loss last.
    pub modules: Vec<ModuleProfile>,
}

fn fp32() -> String {
    "fp32".into()
}

/// How a run computes, as profiles and plans name it: `fp32`, `bf16 channels_last`, ...
pub fn arithmetic(precision: &str, channels_last: bool) -> String {
    match channels_last {
        true => format!("{precision} channels_last"),
        false => precision.to_string(),
    }
}

impl Profile {
    /// How the profile computed ([`arithmetic`]).
    pub fn arithmetic(&self) -> String {
        arithmetic(&self.precision, self.channels_last)
    }
}

/// One module's measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleProfile {
    pub index: usize,
    pub name: String,
    /// Median seconds of the forward pass.
    pub forward_s: f64,
    /// Median seconds of the backward pass.
    pub backward_s: f64,
    /// Median seconds of one optimizer step (SGD with momentum) over the module's parameters.
    #[serde(default)]
    pub optimizer_s: f64,
    /// Bytes of the module's output (what crosses a stage boundary after it).
    pub activation_bytes: u64,
    /// Bytes of the output as it crosses under `--compress-activations` (float32 sent as
    /// float16). Profiles written before it was recorded lack it: planned as uncompressed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compressed_activation_bytes: Option<u64>,
    /// Bytes of the module's parameters (what replicas all-reduce and stashes copy).
    pub param_bytes: u64,
    /// Shape of the output at this batch size.
    pub output_shape: Vec<i64>,
}

impl Profile {
    /// Parses a profile, refusing other format versions with a clear message.
    pub fn from_json(text: &str) -> Result<Profile, String> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        match value.get("format_version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(PROFILE_VERSION) => {}
            Some(v) => {
                return Err(format!(
                    "profile format version {v} is not {PROFILE_VERSION}; re-run `runtime profile` with this version"
                ))
            }
            None => return Err("no format_version: not a profile written by `runtime profile`".into()),
        }
        serde_json::from_value(value).map_err(|e| format!("malformed profile: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Profile {
        Profile {
            format_version: PROFILE_VERSION,
            model: "mlp".into(),
            batch_size: 8,
            device: "cpu".into(),
            threads: 1,
            repeats: 3,
            precision: "bf16".into(),
            channels_last: true,
            sizes: [("--hidden", 128), ("--layers", 1)]
                .into_iter()
                .map(|(flag, value)| (flag.to_string(), value.into()))
                .collect(),
            modules: vec![ModuleProfile {
                index: 0,
                name: "layers.0".into(),
                forward_s: 0.001,
                backward_s: 0.002,
                optimizer_s: 0.0005,
                activation_bytes: 4096,
                compressed_activation_bytes: Some(2048),
                param_bytes: 1024,
                output_shape: vec![8, 128],
            }],
        }
    }

    #[test]
    fn profiles_round_trip() {
        let text = serde_json::to_string(&profile()).unwrap();
        assert_eq!(Profile::from_json(&text).unwrap(), profile());
    }

    #[test]
    fn profiles_that_do_not_say_their_arithmetic_are_fp32() {
        let mut value = serde_json::to_value(profile()).unwrap();
        let fields = value.as_object_mut().unwrap();
        fields.remove("precision");
        fields.remove("channels_last");
        fields.remove("sizes");
        let read = Profile::from_json(&value.to_string()).unwrap();
        assert_eq!((read.precision.as_str(), read.channels_last), ("fp32", false));
        assert!(read.sizes.is_empty(), "a profile from before sizes were recorded");
        assert_eq!(read.arithmetic(), "fp32");
        assert_eq!(profile().arithmetic(), "bf16 channels_last");
    }

    #[test]
    fn other_versions_and_garbage_are_refused_clearly() {
        let mut value = serde_json::to_value(profile()).unwrap();
        value["format_version"] = 9.into();
        let err = Profile::from_json(&value.to_string()).unwrap_err();
        assert!(err.contains("format version 9 is not 1"), "{err}");
        assert!(Profile::from_json("{}")
            .unwrap_err()
            .contains("no format_version"));
        assert!(Profile::from_json("[").unwrap_err().starts_with("not JSON"));
    }
}
