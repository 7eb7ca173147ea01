//! The `container` key: an image name to use as is (PipeDream's meaning), or `{build: DIR}` for a
//! build context, or `{image: NAME}`.

use std::fmt;
use std::path::PathBuf;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// Where the image comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Container {
    /// An image that already exists on every host.
    Image(String),
    /// A build context directory (with a `Dockerfile`), relative to the experiment file.
    Build(PathBuf),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ContainerMapping {
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    build: Option<PathBuf>,
}

impl<'de> Deserialize<'de> for Container {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContainerVisitor;

        impl<'de> Visitor<'de> for ContainerVisitor {
            type Value = Container;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an image name, `{image: NAME}` or `{build: DIR}`")
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
                match (m.image, m.build) {
                    (Some(image), None) => Ok(Container::Image(image)),
                    (None, Some(dir)) => Ok(Container::Build(dir)),
                    _ => Err(de::Error::custom(
                        "container mapping needs exactly one of `image` and `build`",
                    )),
                }
            }
        }

        deserializer.deserialize_any(ContainerVisitor)
    }
}
