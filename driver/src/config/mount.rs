//! A `mounts` entry: `SRC:DST[:ro]` as with `docker run -v`, or `{source, target, read_only}`.

use std::fmt;
use std::path::PathBuf;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// A bind mount into every container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mount {
    /// Path on the host (relative paths are against the experiment file).
    pub source: PathBuf,
    /// Path inside the container; must be absolute.
    pub target: PathBuf,
    /// Mount read-only.
    pub read_only: bool,
    /// The engine creates the source folder if it is missing (the driver's own mounts, such as
    /// the checkpoint folder; a user's mount must exist).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub create: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MountMapping {
    source: PathBuf,
    #[serde(default)]
    target: Option<PathBuf>,
    #[serde(default)]
    read_only: bool,
}

impl Mount {
    fn from_short(text: &str) -> Result<Mount, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let (source, target, read_only) = match parts.as_slice() {
            [s] => (*s, *s, false),
            [s, t] => (*s, *t, false),
            [s, t, "ro"] => (*s, *t, true),
            [s, t, "rw"] => (*s, *t, false),
            _ => {
                return Err(format!(
                    "mount `{text}`: expected `SOURCE[:TARGET[:ro|rw]]` or a mapping with source, target, read_only"
                ))
            }
        };
        Mount::checked(source.into(), target.into(), read_only)
    }

    fn checked(source: PathBuf, target: PathBuf, read_only: bool) -> Result<Mount, String> {
        if !target.is_absolute() {
            return Err(format!(
                "mount target `{}` must be an absolute path",
                target.display()
            ));
        }
        Ok(Mount {
            source,
            target,
            read_only,
            create: false,
        })
    }
}

impl<'de> Deserialize<'de> for Mount {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MountVisitor;

        impl<'de> Visitor<'de> for MountVisitor {
            type Value = Mount;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`SOURCE:TARGET[:ro]` or a mapping with source, target, read_only")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Mount, E> {
                Mount::from_short(v).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Mount, A::Error> {
                let m = MountMapping::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let target = m.target.unwrap_or_else(|| m.source.clone());
                Mount::checked(m.source, target, m.read_only).map_err(de::Error::custom)
            }
        }

        deserializer.deserialize_any(MountVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_style_strings_parse() {
        let m = Mount::from_short("/data:/data:ro").unwrap();
        assert!(m.read_only);
        assert_eq!(m.target, PathBuf::from("/data"));
        assert!(Mount::from_short("/a:rel").is_err());
        assert!(Mount::from_short("/a:/b:maybe").is_err());
    }
}
