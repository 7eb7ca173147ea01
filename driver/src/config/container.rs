//! The `container` key: an image name (PipeDream's meaning: what the ranks run on; the runtime
//! image is built on it unless it holds the runtime, experiment/mod.rs), `{image: NAME}`, or a
//! build: `{build: DIR, dockerfile: FILE, args: {NAME: VALUE}}`. Without `build`, a mapping with
//! `dockerfile` or `args` adjusts the default build, the runtime image from the workspace's source.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// Where the image comes from. Serialized as it is written, so a record's copy reads back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Container {
    /// An image that already exists on every host.
    Image(String),
    /// An image built by the driver.
    Build(Build),
}

/// A build the driver runs through the Docker API, once per source version.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Build {
    /// The context folder, relative to the experiment file; `None` for the workspace's source
    /// (the runtime image).
    pub dir: Option<PathBuf>,
    /// The Dockerfile, relative to the context (default `Dockerfile`, or
    /// `docker/runtime/Dockerfile` for the runtime image).
    pub dockerfile: Option<String>,
    /// Build arguments (`ARG`s), over the defaults.
    pub args: BTreeMap<String, String>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct ContainerMapping {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    build: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dockerfile: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    args: BTreeMap<String, String>,
}

impl Serialize for Container {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Container::Image(name) => serializer.serialize_str(name),
            Container::Build(b) => ContainerMapping {
                image: None,
                build: b.dir.clone(),
                dockerfile: b.dockerfile.clone(),
                args: b.args.clone(),
            }
            .serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Container {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContainerVisitor;

        impl<'de> Visitor<'de> for ContainerVisitor {
            type Value = Container;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an image name, `{image: NAME}` or `{build: DIR, dockerfile: FILE, args: {..}}`")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Container, E> {
                if v.trim().is_empty() {
                    return Err(E::custom(
                        "container is empty; expected an image name or `{build: DIR}`",
                    ));
                }
                Ok(Container::Image(v.to_string()))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Container, A::Error> {
                let m = ContainerMapping::deserialize(de::value::MapAccessDeserializer::new(map))?;
                if let Some(f) = &m.dockerfile {
                    if f.trim().is_empty() || f.starts_with('/') || f.split('/').any(|p| p == "..") {
                        return Err(de::Error::custom(format!(
                            "dockerfile `{f}` must be a path inside the build folder, like `docker/Dockerfile`"
                        )));
                    }
                }
                if let Some(name) = m
                    .args
                    .keys()
                    .find(|k| k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                {
                    return Err(de::Error::custom(format!(
                        "build argument `{name}` is not a valid ARG name (letters, digits and `_`)"
                    )));
                }
                match (m.image, m.build, m.dockerfile.is_some() || !m.args.is_empty()) {
                    (Some(image), None, false) => Ok(Container::Image(image)),
                    (Some(_), _, _) => Err(de::Error::custom(
                        "container has `image` and build keys; give an image to use as is, or \
                         `build`/`dockerfile`/`args` to build one, not both",
                    )),
                    (None, dir, _) => Ok(Container::Build(Build {
                        dir,
                        dockerfile: m.dockerfile,
                        args: m.args,
                    })),
                }
            }
        }

        deserializer.deserialize_any(ContainerVisitor)
    }
}
