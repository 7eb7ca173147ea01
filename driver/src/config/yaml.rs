//! Reading an experiment file: the only place that knows which YAML crate is used, so it can be
//! swapped. Every error carries `file:line:column` and what was expected there.

use std::fmt;
use std::path::{Path, PathBuf};

use super::ExperimentFile;

/// A parsed experiment file with what is needed to point back into it.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The path as given.
    pub path: PathBuf,
    /// The text as read, kept for the record (`config.given.yml`).
    pub text: String,
    /// The typed content.
    pub file: ExperimentFile,
    /// For a sweep point, whose `text` is written by the sweep: where its keys are written.
    pub point: Option<Box<PointOrigin>>,
}

/// Where a sweep point's keys are written: the keys it sets by where their values come from, and
/// the rest in the experiment file as given.
#[derive(Debug, Clone)]
pub struct PointOrigin {
    /// The experiment file's text as read.
    pub given: String,
    /// The keys (canonical) the point sets, each with where its value is written.
    pub set: Vec<(String, SetBy)>,
}

/// Where a sweep point's value for a key is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetBy {
    /// In the file's `sweep:` section, at this line.
    Section(Location),
    /// On the command line, with `--grid`.
    Grid,
}

/// A position in the experiment file, 1-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Line, from 1.
    pub line: usize,
    /// Column, from 1.
    pub column: usize,
}

/// What is wrong with an experiment file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read experiment file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{}: {message}", path.display(), Position(*location))]
    Invalid {
        path: PathBuf,
        location: Option<Location>,
        message: String,
    },
}

/// Renders `line:column`, or `?` when the YAML crate gave no position.
struct Position(Option<Location>);

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.0 {
            Some(l) => write!(f, "{}:{}", l.line, l.column),
            None => f.write_str("1:1"),
        }
    }
}

/// A byte-order mark.
const BOM: char = '\u{feff}';

/// Reads and parses an experiment file.
pub fn load(path: &Path) -> Result<Loaded, ConfigError> {
    let mut text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    // The byte-order mark editors on Windows start a UTF-8 file with: not YAML's to read.
    if text.starts_with(BOM) {
        text.drain(..BOM.len_utf8());
    }
    let file = parse(path, &text)?;
    Ok(Loaded {
        path: path.to_path_buf(),
        text,
        file,
        point: None,
    })
}

/// Parses experiment YAML; `path` is only used in messages.
pub fn parse(path: &Path, text: &str) -> Result<ExperimentFile, ConfigError> {
    let blank = text.lines().all(|l| {
        let l = l.trim();
        l.is_empty() || l.starts_with('#') || l == "---"
    });
    if blank {
        return Err(ConfigError::Invalid {
            path: path.to_path_buf(),
            location: Some(Location { line: 1, column: 1 }),
            message: "the file holds no experiment keys; give `module:` and the ranks' \
                      `machines:` (one `host:gpu` or `localhost` per rank), or `backend: slurm`"
                .into(),
        });
    }
    from_str(path, text)
}

/// Parses YAML into `T`, errors located in `path`.
fn from_str<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigError> {
    serde_norway::from_str(text).map_err(|e| {
        let location = e.location().map(|l| Location {
            line: l.line(),
            column: l.column(),
        });
        // The crate places a repeated key at its mapping's start: the second writing is where.
        let repeated = e.to_string().strip_prefix("duplicate field `").and_then(|rest| {
            let (key, _) = rest.split_once('`')?;
            let mut written = top_level_keys(text)
                .into_iter()
                .filter(|(k, _)| super::canonical_key(k) == key);
            written.nth(1).map(|(_, at)| at)
        });
        let location = repeated.or(location);
        ConfigError::Invalid {
            path: path.to_path_buf(),
            location,
            message: describe(&e.to_string(), text, location),
        }
    })
}

/// The whole file as a generic document, for a sweep to set keys in.
pub fn parse_document(path: &Path, text: &str) -> Result<serde_json::Value, ConfigError> {
    from_str(path, text)
}

/// A document as YAML text.
pub fn to_text(document: &serde_json::Value) -> String {
    serde_norway::to_string(document).expect("JSON values serialize as YAML")
}

/// One value as YAML reads it (`32` a number, `gpipe` a string, `true` a boolean), for grid
/// values given on the command line.
pub fn parse_scalar(text: &str) -> serde_json::Value {
    serde_norway::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_string()))
}

/// Where the `sweep:` section of a block-style document writes `key` (in any spelling), or the
/// section's own line when it is written in flow style or not found; `None` without a section.
pub fn locate_sweep_key(text: &str, key: &str) -> Option<Location> {
    let section = top_level_keys(text)
        .into_iter()
        .find(|(written, _)| super::canonical_key(written) == "sweep")?
        .1;
    let inside = text
        .lines()
        .enumerate()
        .skip(section.line)
        .take_while(|(_, line)| {
            let trimmed = line.trim_start();
            trimmed.is_empty() || trimmed.starts_with('#') || trimmed.len() < line.len()
        });
    // The section's keys are the lines at its first line's indentation.
    let mut indent = None;
    let written = inside.into_iter().find_map(|(i, line)| {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            return None;
        }
        if *indent.get_or_insert(line.len() - trimmed.len()) != line.len() - trimmed.len() {
            return None;
        }
        let (written, _) = trimmed.split_once(':')?;
        let written = written.trim_end().trim_matches(|c| c == '\'' || c == '"');
        (super::canonical_key(written) == key).then(|| Location {
            line: i + 1,
            column: line.len() - trimmed.len() + 1,
        })
    });
    Some(written.unwrap_or(section))
}

/// The top-level keys of a document as written, in order, each where it is written: the lines
/// that start with `key:` in block style, or the keys of the outermost `{...}` in flow style
/// (quoted strings skipped). Keys written twice appear twice.
fn top_level_keys(text: &str) -> Vec<(String, Location)> {
    let flow = text
        .lines()
        .map(str::trim)
        .find(|l| !(l.is_empty() || l.starts_with('#') || *l == "---"))
        .is_some_and(|l| l.starts_with('{'));
    if !flow {
        return text
            .lines()
            .enumerate()
            .filter_map(|(i, line)| {
                let (written, _) = line.split_once(':')?;
                let written = written.trim_end();
                let top_level = !written.is_empty()
                    && !written.starts_with(|c: char| c.is_whitespace() || c == '#' || c == '-');
                top_level.then(|| {
                    (
                        written.to_string(),
                        Location {
                            line: i + 1,
                            column: 1,
                        },
                    )
                })
            })
            .collect();
    }
    let mut keys = Vec::new();
    let (mut depth, mut quote, mut start) = (0usize, None::<char>, None::<(usize, Location)>);
    let (mut line, mut column) = (1, 0);
    for (i, c) in text.char_indices() {
        column += 1;
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '#') if depth == 0 => {}
            (None, '{' | '[') => {
                depth += 1;
                if depth == 1 && c == '{' {
                    start = Some((
                        i + 1,
                        Location {
                            line,
                            column: column + 1,
                        },
                    ));
                }
            }
            (None, '}' | ']') => depth = depth.saturating_sub(1),
            (None, ',') if depth == 1 => {
                start = Some((
                    i + 1,
                    Location {
                        line,
                        column: column + 1,
                    },
                ))
            }
            (None, ':') if depth == 1 => {
                if let Some((from, mut at)) = start.take() {
                    let written = &text[from..i];
                    let key = written.trim();
                    // Where the key itself starts, past the spaces and line breaks before it.
                    for skipped in written[..written.len() - written.trim_start().len()].chars() {
                        match skipped {
                            '\n' => {
                                at = Location {
                                    line: at.line + 1,
                                    column: 1,
                                }
                            }
                            _ => at.column += 1,
                        }
                    }
                    if !key.is_empty() {
                        keys.push((key.trim_matches(|c| c == '\'' || c == '"').to_string(), at));
                    }
                }
            }
            _ => {}
        }
        if c == '\n' {
            line += 1;
            column = 0;
        }
    }
    keys
}

/// A message about a value checked against the experiment keys, in the file's words.
pub fn describe_value_error(message: &str) -> String {
    describe(message, "", None)
}

/// The crate's message without its trailing ` at line N column M` (we print the position first,
/// as compilers do), with serde's jargon turned into what a user of the file reads and a hint
/// where one helps.
fn describe(message: &str, text: &str, location: Option<Location>) -> String {
    let mut message = strip_position(message).replace("invalid type: ", "wrong type: ");
    message = message.replace(
        "expected struct ExperimentFile",
        "expected a mapping of experiment keys such as `machines:`",
    );
    for (int, most) in [
        ("u16", u64::from(u16::MAX)),
        ("u32", u64::from(u32::MAX)),
        ("u64", u64::MAX),
    ] {
        message = message.replace(
            &format!("expected {int}"),
            &format!("expected a whole number from 0 to {most}"),
        );
    }
    let line = location
        .and_then(|l| text.lines().nth(l.line.saturating_sub(1)))
        .unwrap_or("");
    if line.starts_with(|c: char| c.is_whitespace()) && line.contains('\t') {
        message.push_str("; indent with spaces, YAML does not allow tabs");
    } else if message.contains("did not find expected key")
        || message.contains("mapping values are not allowed")
    {
        message.push_str("; check this line's indentation against the lines above it");
    } else if let Some(hint) = did_you_mean(&message) {
        // The closest key says what to write; the whole list (some 80 keys at the top level)
        // would bury it.
        if let Some((unknown, _)) = message.split_once(", expected one of ") {
            message = unknown.to_string();
        }
        message.push_str(&hint);
    } else if let Some((unknown, list)) = message.split_once(", expected one of ") {
        if list.matches('`').count() / 2 > LISTED_KEYS {
            message = format!("{unknown}, not an experiment key (driver/README.md lists them all)");
        }
    }
    message
}

/// How many expected keys an unknown key's error lists at most; past that it points at the
/// README's list.
const LISTED_KEYS: usize = 12;

/// Removes ` at line N column M` wherever the crate put it.
fn strip_position(message: &str) -> String {
    let Some(start) = message.find(" at line ") else {
        return message.to_string();
    };
    let rest = &message[start + " at line ".len()..];
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let after_line = &rest[digits(rest)..];
    match after_line.strip_prefix(" column ") {
        Some(col) => format!("{}{}", &message[..start], &col[digits(col)..]),
        None => message.to_string(),
    }
}

/// For `unknown field `x`, expected one of ...`, suggests the closest expected key.
fn did_you_mean(message: &str) -> Option<String> {
    let rest = message.split("unknown field `").nth(1)?;
    let (unknown, rest) = rest.split_once('`')?;
    let candidates = rest.split('`').skip(1).step_by(2);
    let (distance, best) = candidates.map(|c| (edit_distance(unknown, c), c)).min()?;
    (distance <= 2).then(|| format!("; did you mean `{best}`?"))
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

impl Loaded {
    /// Where a top-level key is written (in any of its spellings: `model:` for `module`), for
    /// errors found after parsing (cross-field checks). A sweep point's keys are located where
    /// the user wrote them: in the experiment file, its `sweep:` section, or (`None`) `--grid`.
    pub fn locate(&self, key: &str) -> Option<Location> {
        let text = match &self.point {
            Some(point) => match point.set.iter().find(|(k, _)| k == key) {
                Some((_, SetBy::Section(at))) => return Some(*at),
                Some((_, SetBy::Grid)) => return None,
                None => &point.given,
            },
            None => &self.text,
        };
        top_level_keys(text)
            .into_iter()
            .find(|(written, _)| super::canonical_key(written) == key)
            .map(|(_, at)| at)
    }

    /// Where a top-level key is written, as people read it: `` `lr` at FILE:LINE ``, or
    /// `` `lr` from --grid `` for a sweep point's value given on the command line; `None` when
    /// the file does not write it.
    pub fn written(&self, key: &str) -> Option<String> {
        let by_grid = self
            .point
            .as_ref()
            .is_some_and(|p| p.set.iter().any(|(k, by)| k == key && *by == SetBy::Grid));
        if by_grid {
            return Some(format!("`{key}` from --grid"));
        }
        let at = self.locate(key)?;
        Some(format!("`{key}` at {}:{}", self.path.display(), at.line))
    }

    /// An error about a top-level key, located where the key is written.
    pub fn error_at(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.clone(),
            location: self.locate(key),
            message: message.into(),
        }
    }

    /// The directory relative paths in the file are resolved against.
    pub fn base_dir(&self) -> PathBuf {
        match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    }
}
