//! The grid: axes from the experiment file's `sweep:` section and `--grid`, checked against the
//! experiment keys, and expanded into points (the cartesian product, the last axis fastest, each
//! repeated).

use crate::config::{self, Axis};

/// A grid that cannot run; nothing has started.
#[derive(Debug, thiserror::Error)]
pub enum GridError {
    #[error("no grid: give --grid KEY=V1,V2 or a `sweep:` section in the experiment file")]
    Empty,
    #[error("grid key `{key}`: {message}")]
    Key { key: String, message: String },
    #[error("grid value `{value}` for `{key}`: {message}")]
    Value {
        key: String,
        value: String,
        message: String,
    },
    #[error(
        "the grid has {points} points ({shape}), more than the {MAX_POINTS} a sweep may run; \
         give fewer values"
    )]
    TooLarge { points: u128, shape: String },
}

/// The most points a grid may have (before its repetitions): a sweep rewrites its index after
/// every point, and a grid past this is a typo (a million points wrote a 318 MB index in 10 s
/// without running one).
pub const MAX_POINTS: u128 = 10_000;

/// One run of the sweep: a value for every axis, and which repetition.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// Position in the sweep, from 0.
    pub index: usize,
    /// The axes' keys and this point's values, in axis order.
    pub settings: Vec<(String, serde_json::Value)>,
    /// Repetition, from 0.
    pub repeat: u32,
}

/// The file's axes with the command line's: a `--grid` key replaces the file's axis of that key
/// in place, other `--grid` keys come after. Values from the command line are read as YAML
/// scalars (`32` a number, `gpipe` a string). A key given twice on the command line (under any
/// spelling) is refused: the second would drop the first's values.
pub fn combine(file: &[Axis], command_line: &[(String, Vec<String>)]) -> Result<Vec<Axis>, GridError> {
    let mut axes = file.to_vec();
    for (i, (key, values)) in command_line.iter().enumerate() {
        let values: Vec<serde_json::Value> = values.iter().map(|v| config::parse_scalar(v)).collect();
        let canonical = config::canonical_key(key);
        if let Some((first, _)) = command_line[..i]
            .iter()
            .find(|(k, _)| config::canonical_key(k) == canonical)
        {
            return Err(GridError::Key {
                key: key.clone(),
                message: format!(
                    "is given twice with --grid (as `{first}` too); give all its values in one: \
                     --grid {key}=V1,V2"
                ),
            });
        }
        match axes
            .iter_mut()
            .find(|a| config::canonical_key(&a.key) == canonical)
        {
            Some(axis) => axis.values = values,
            None => axes.push(Axis {
                key: key.clone(),
                values,
            }),
        }
    }
    Ok(axes)
}

/// Checks every key and value against the experiment file's keys and types.
pub fn check(axes: &[Axis]) -> Result<(), GridError> {
    if axes.is_empty() {
        return Err(GridError::Empty);
    }
    let points = axes
        .iter()
        .fold(1u128, |n, a| n.saturating_mul(a.values.len() as u128));
    if points > MAX_POINTS {
        let shape = axes
            .iter()
            .map(|a| format!("{} {}", a.values.len(), a.key))
            .collect::<Vec<_>>()
            .join(" x ");
        return Err(GridError::TooLarge { points, shape });
    }
    for (i, axis) in axes.iter().enumerate() {
        let canonical = config::canonical_key(&axis.key);
        if axes[..i]
            .iter()
            .any(|a| config::canonical_key(&a.key) == canonical)
        {
            return Err(GridError::Key {
                key: axis.key.clone(),
                message: "is given twice (under another spelling)".into(),
            });
        }
        for value in &axis.values {
            if let Err(message) = config::check_grid_value(&axis.key, value) {
                if message.contains("unknown field") {
                    let hint = message
                        .split_once("; did you mean")
                        .map(|(_, h)| format!("; did you mean{h}"))
                        .unwrap_or_default();
                    return Err(GridError::Key {
                        key: axis.key.clone(),
                        message: format!("is not an experiment key{hint}"),
                    });
                }
                return Err(if message.contains("set by the sweep") {
                    GridError::Key {
                        key: axis.key.clone(),
                        message,
                    }
                } else {
                    GridError::Value {
                        key: axis.key.clone(),
                        value: config::value_text(value),
                        message,
                    }
                });
            }
        }
    }
    Ok(())
}

/// Every point, the last axis varying fastest, each point's repetitions together.
pub fn expand(axes: &[Axis], repeat: u32) -> Vec<Point> {
    let mut combinations: Vec<Vec<(String, serde_json::Value)>> = vec![Vec::new()];
    for axis in axes {
        combinations = combinations
            .into_iter()
            .flat_map(|prefix| {
                axis.values.iter().map(move |v| {
                    let mut settings = prefix.clone();
                    settings.push((axis.key.clone(), v.clone()));
                    settings
                })
            })
            .collect();
    }
    combinations
        .into_iter()
        .flat_map(|settings| (0..repeat).map(move |r| (settings.clone(), r)))
        .enumerate()
        .map(|(index, (settings, repeat))| Point {
            index,
            settings,
            repeat,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn axis(key: &str, values: &[serde_json::Value]) -> Axis {
        Axis {
            key: key.into(),
            values: values.to_vec(),
        }
    }

    fn grid(args: &[(&str, &str)]) -> Vec<(String, Vec<String>)> {
        args.iter()
            .map(|(k, v)| (k.to_string(), v.split(',').map(str::to_string).collect()))
            .collect()
    }

    #[test]
    fn the_product_varies_the_last_axis_fastest_and_repeats_each_point() {
        let axes = [
            axis("batch_size", &[json!(32), json!(64)]),
            axis("schedule", &[json!("gpipe"), json!("1f1b")]),
        ];
        let points = expand(&axes, 2);
        assert_eq!(points.len(), 8);
        let label = |p: &Point| {
            let s: Vec<String> = p.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{} {} r{}", p.index, s.join(" "), p.repeat)
        };
        let labels: Vec<String> = points.iter().map(label).collect();
        assert_eq!(
            labels[..4],
            [
                r#"0 batch_size=32 schedule="gpipe" r0"#,
                r#"1 batch_size=32 schedule="gpipe" r1"#,
                r#"2 batch_size=32 schedule="1f1b" r0"#,
                r#"3 batch_size=32 schedule="1f1b" r1"#,
            ]
        );
        assert_eq!(labels[7], r#"7 batch_size=64 schedule="1f1b" r1"#);
    }

    #[test]
    fn command_line_values_read_as_yaml_and_replace_the_files_axis() {
        let file = [axis("model", &[json!("mlp")]), axis("iterations", &[json!(3)])];
        let axes = combine(
            &file,
            &grid(&[
                ("module", "mlp,resnet18"),
                ("batch_size", "16,32"),
                ("schedule", "1f1b"),
            ]),
        )
        .unwrap();
        assert_eq!(axes.len(), 4, "{axes:?}");
        assert_eq!(axes[0].key, "model", "kept in place, under the file's spelling");
        assert_eq!(axes[0].values, [json!("mlp"), json!("resnet18")]);
        assert_eq!(axes[2].values, [json!(16), json!(32)]);
        assert_eq!(expand(&axes, 1).len(), 4);
        check(&axes).unwrap();
    }

    #[test]
    fn bad_keys_and_values_are_refused_with_what_to_change() {
        let cases: &[(&str, &[(&str, &str)])] = &[
            ("unknown_key", &[("batch_sise", "32,64")]),
            ("wrong_type", &[("batch_size", "32,lots")]),
            ("negative", &[("iterations", "-1")]),
            ("unknown_schedule", &[("schedule", "gpipe,zigzag")]),
            ("set_by_sweep", &[("log_directory", "/tmp")]),
            ("alias_twice", &[("model", "mlp"), ("module", "mlp")]),
        ];
        for (name, args) in cases {
            let axes: Vec<Axis> = grid(args)
                .into_iter()
                .map(|(k, v)| axis(&k, &v.iter().map(|s| config::parse_scalar(s)).collect::<Vec<_>>()))
                .collect();
            let message = check(&axes).expect_err(name).to_string();
            insta::assert_snapshot!(format!("grid_{name}"), message);
        }
        assert!(matches!(check(&[]), Err(GridError::Empty)));
    }

    #[test]
    fn a_key_given_twice_on_the_command_line_or_a_grid_too_large_is_refused() {
        for twice in [
            &[("batch_size", "8"), ("batch_size", "16")][..],
            &[("lr", "0.1,0.01"), ("learning_rate", "0.5")],
        ] {
            let said = combine(&[], &grid(twice)).expect_err("refused").to_string();
            assert!(said.contains("is given twice with --grid"), "{said}");
        }
        let thousand: Vec<serde_json::Value> = (0..1000).map(|i| json!(i)).collect();
        let axes = [axis("seed", &thousand), axis("threads", &thousand[..11])];
        assert_eq!(
            check(&axes).expect_err("too large").to_string(),
            "the grid has 11000 points (1000 seed x 11 threads), more than the 10000 a sweep may run; \
             give fewer values"
        );
        check(&axes[..1]).unwrap();
    }
}
