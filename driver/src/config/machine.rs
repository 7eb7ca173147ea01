//! A `machines` entry: PipeDream's `host:gpu` string (one rank on that GPU), a bare `host` (one
//! CPU rank), or a mapping with SSH details and a list of GPUs (one rank per GPU). `localhost` and
//! `local` mean the local engine; any other host is reached over SSH.

use std::fmt;
use std::path::PathBuf;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// One machine entry, normalised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Machine {
    /// `localhost`/`local` for the local engine, otherwise an SSH destination.
    pub host: String,
    /// SSH user, if not the destination's default.
    pub user: Option<String>,
    /// SSH port, if not 22.
    pub port: Option<u16>,
    /// SSH identity file.
    pub identity_file: Option<PathBuf>,
    /// GPUs, one rank each; empty means one CPU rank.
    pub gpus: Vec<u32>,
    /// How the SSH host key is checked.
    pub host_key_check: HostKeyCheck,
    /// The Docker socket on the host.
    pub docker_socket: Option<PathBuf>,
}

/// SSH host key checking, as `ssh -o StrictHostKeyChecking`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostKeyCheck {
    /// The key must already be in known_hosts (the default).
    #[default]
    Strict,
    /// An unknown host's key is added; a changed key is still refused.
    AcceptNew,
}

/// The mapping form, kept strict so a typo is an error.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineMapping {
    host: String,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    identity_file: Option<PathBuf>,
    #[serde(default)]
    gpus: Vec<u32>,
    #[serde(default)]
    host_key_check: HostKeyCheck,
    #[serde(default)]
    docker_socket: Option<PathBuf>,
}

impl Machine {
    /// Parses `host` or `host:gpu`.
    fn from_short(text: &str) -> Result<Machine, String> {
        let text = text.trim();
        let (host, gpus) = match text.rsplit_once(':') {
            Some((host, gpu)) => {
                let gpu = gpu.parse::<u32>().map_err(|_| {
                    format!(
                        "machine `{text}`: `{gpu}` is not a GPU index; expected `host:gpu` such as `node1:0`"
                    )
                })?;
                (host, vec![gpu])
            }
            None => (text, Vec::new()),
        };
        if host.is_empty() {
            return Err(format!(
                "machine `{text}` has an empty host; expected `host:gpu` or `host`"
            ));
        }
        if host.contains(':') {
            return Err(format!(
                "machine `{text}`: a `host:gpu` string holds one `:`; give an IPv6 address in the \
                 mapping form, `{{host: \"fe80::1\", gpus: [0]}}`"
            ));
        }
        check_host(host).map_err(|why| format!("machine `{text}`: {why}"))?;
        Ok(Machine {
            host: host.to_string(),
            user: None,
            port: None,
            identity_file: None,
            gpus,
            host_key_check: HostKeyCheck::Strict,
            docker_socket: None,
        })
    }

    /// A machine known only by a name, such as a Slurm node before Slurm picks it.
    pub fn placeholder(host: String) -> Machine {
        Machine {
            host,
            user: None,
            port: None,
            identity_file: None,
            gpus: Vec::new(),
            host_key_check: HostKeyCheck::Strict,
            docker_socket: None,
        }
    }

    /// Whether this entry means the local Docker engine.
    pub fn is_local(&self) -> bool {
        matches!(self.host.as_str(), "localhost" | "local")
    }
}

/// Whether `host` can be an SSH destination (a host name, an IP address or an ssh_config alias,
/// with `user@` if given): letters, digits and `.-_@:%[]`, not starting with `-`, which ssh would
/// read as an option (`-oProxyCommand=...`). A space, as in `localhost - localhost` from a list
/// item indented under the one before, names no host.
fn check_host(host: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || ".-_@:%[]".contains(c);
    if host.starts_with('-') {
        return Err(format!(
            "`{host}` is not a host: a host never starts with `-` (ssh would read it as an option)"
        ));
    }
    if host.chars().any(char::is_whitespace) {
        return Err(format!(
            "`{host}` is not a host: a host has no spaces (a list item indented under the one before \
             joins the two: give each `- host` the same indentation)"
        ));
    }
    match host.chars().find(|&c| !allowed(c)) {
        Some(c) => Err(format!(
            "`{host}` is not a host: {c:?} is not in a host name, IP address or ssh_config alias \
             (letters, digits and `.-_@`; an IPv6 address in the mapping form, `{{host: \"fe80::1\"}}`)"
        )),
        None => Ok(()),
    }
}

impl<'de> Deserialize<'de> for Machine {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MachineVisitor;

        impl<'de> Visitor<'de> for MachineVisitor {
            type Value = Machine;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "`host:gpu`, `host`, or a mapping with host, user, port, identity_file, gpus, \
                     host_key_check, docker_socket",
                )
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Machine, E> {
                Machine::from_short(v).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Machine, A::Error> {
                let m = MachineMapping::deserialize(de::value::MapAccessDeserializer::new(map))?;
                if m.host.trim().is_empty() {
                    return Err(de::Error::custom("machine mapping has an empty host"));
                }
                check_host(&m.host).map_err(|why| de::Error::custom(format!("machine mapping: {why}")))?;
                Ok(Machine {
                    host: m.host,
                    user: m.user,
                    port: m.port,
                    identity_file: m.identity_file,
                    gpus: m.gpus,
                    host_key_check: m.host_key_check,
                    docker_socket: m.docker_socket,
                })
            }
        }

        deserializer.deserialize_any(MachineVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipedream_strings_name_one_gpu() {
        let m = Machine::from_short("node1:3").unwrap();
        assert_eq!((m.host.as_str(), m.gpus.as_slice()), ("node1", &[3][..]));
        assert!(Machine::from_short("localhost").unwrap().gpus.is_empty());
        assert!(Machine::from_short("local").unwrap().is_local());
        assert!(!Machine::from_short("node1").unwrap().is_local());
    }

    /// What ssh would read as an option, or what names no host (a mis-indented list item joins
    /// two), is refused; names, addresses and aliases pass.
    #[test]
    fn a_host_is_a_name_an_address_or_an_alias_and_never_an_option() {
        for good in [
            "node1",
            "gpu-box_2.lab.example",
            "10.0.0.7",
            "ann@node1",
            "node1:3",
        ] {
            assert!(Machine::from_short(good).is_ok(), "{good}");
        }
        let refused = |text: &str| Machine::from_short(text).unwrap_err();
        let option = refused("-oProxyCommand=touch x");
        assert!(option.contains("never starts with `-`"), "{option}");
        let joined = refused("localhost - localhost");
        assert!(
            joined.contains("has no spaces") && joined.contains("indentation"),
            "{joined}"
        );
        let shell = refused("node;rm");
        assert!(shell.contains("';' is not in a host name"), "{shell}");
        let v6 = refused("fe80::1");
        assert!(v6.contains("mapping form"), "{v6}");
        let mapped: Machine = serde_norway::from_str("{host: \"fe80::1\", gpus: [0]}").unwrap();
        assert_eq!(mapped.host, "fe80::1");
        let option = serde_norway::from_str::<Machine>("{host: -oProxyCommand=x}").unwrap_err();
        assert!(option.to_string().contains("never starts with `-`"), "{option}");
    }

    #[test]
    fn bad_gpu_indices_say_what_was_expected() {
        let err = Machine::from_short("node1:x").unwrap_err();
        assert!(err.contains("`x` is not a GPU index"), "{err}");
        assert!(Machine::from_short(":0").is_err());
    }
}
