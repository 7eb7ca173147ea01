//! `resume:` — whether the ranks start from the latest checkpoint in `checkpoint_dir`: `true`
//! (it must be there), `false`, or `auto` (from it if there is one, else afresh).

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// `false`: start afresh.
    No,
    /// `true`: the runtime's `--resume`; the checkpoint must be there.
    Required,
    /// `auto`: the runtime's `--resume=auto`; afresh while the folder holds no checkpoint.
    Auto,
}

impl Resume {
    /// The runtime's flag, if any.
    pub fn as_flag(self) -> Option<&'static str> {
        match self {
            Resume::No => None,
            Resume::Required => Some("--resume"),
            Resume::Auto => Some("--resume=auto"),
        }
    }
}

impl Serialize for Resume {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Resume::No => serializer.serialize_bool(false),
            Resume::Required => serializer.serialize_bool(true),
            Resume::Auto => serializer.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Resume {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ResumeVisitor;

        impl Visitor<'_> for ResumeVisitor {
            type Value = Resume;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("true, false or auto")
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Resume, E> {
                Ok(match v {
                    true => Resume::Required,
                    false => Resume::No,
                })
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Resume, E> {
                match v.trim() {
                    "auto" => Ok(Resume::Auto),
                    "true" => Ok(Resume::Required),
                    "false" => Ok(Resume::No),
                    other => Err(E::custom(format!(
                        "{other:?} is not true, false or auto; write true (the checkpoint must be \
                         there), false, or auto (from the checkpoint if there is one, else afresh)"
                    ))),
                }
            }
        }

        deserializer.deserialize_any(ResumeVisitor)
    }
}
