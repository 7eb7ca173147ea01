//! PipeDream's stage-config JSON (`module_to_stage_map`, `stage_to_rank_map`,
//! `stage_to_depth_map`), read as is, and its validation into a [`StagePlan`].
//!
//! A stage is a contiguous slice of the model's module list (the loss is the last module) run by
//! one or more ranks; several ranks on one stage replicate it (data parallelism inside the stage).

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// The file as PipeDream writes it. Stage ids are JSON object keys, hence strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageConfig {
    /// For each module of the model (the loss last), the stage that runs it.
    pub module_to_stage_map: Vec<usize>,
    /// For each stage, the ranks that run it.
    pub stage_to_rank_map: BTreeMap<String, Vec<usize>>,
    /// For each stage, how many microbatches it admits before its first backward (warm-up depth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_to_depth_map: Option<BTreeMap<String, usize>>,
    /// Ours, not PipeDream's: for each module (the loss last), which of its rank's devices
    /// (`--devices`, counted from 0) holds it, so one rank's stage spans several GPUs of its host.
    /// Within each stage the entries start at 0 and never decrease (each device holds one
    /// contiguous run of the stage's modules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module_to_device_map: Option<Vec<usize>>,
    /// Ours, not PipeDream's: Bundle-style hybrids. Every rank in one bundle; a bundle holds
    /// ranks of every stage, and the microbatches its ranks of one stage send go to its ranks of
    /// the next (so with stages 0: [0, 1, 2, 3] and 1: [4, 5], bundles [[0, 2, 4], [1, 3, 5]]:
    /// shape 4,2 as two bundles of two fronts feeding one rear). A replicated stage reduces its
    /// gradients within each bundle to the bundle's lowest rank of that stage (its master), the
    /// masters all-reduce among themselves and send the sum back: data-parallel groups that are
    /// not all the replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundles: Option<Vec<Vec<usize>>>,
}

/// What is wrong with a stage config; each names the entry to change.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StageConfigError {
    #[error("stage config is not valid JSON of PipeDream's format: {0}")]
    Json(String),
    /// A layer profile given where a stage config goes.
    #[error(
        "this is a layer profile (what `runtime profile` writes), not a stage config: plan one from \
         it with `driver plan --profile FILE`, or give it to an experiment as `config_file: auto` \
         with `planner: {{profile: FILE}}`"
    )]
    IsAProfile,
    #[error(
        "module_to_stage_map has {got} entries but the model has {expected} modules (the loss included); \
         `runtime modules --model NAME` lists them"
    )]
    ModuleCount { got: usize, expected: usize },
    #[error(
        "module_to_stage_map[{index}] is stage {stage}, but stages must be numbered from 0 and cover \
         contiguous runs of modules in order (stage {expected} expected there)"
    )]
    NotContiguous {
        index: usize,
        stage: usize,
        expected: String,
    },
    #[error("stage_to_rank_map key {key:?} is not a stage number")]
    BadStageKey { key: String },
    #[error("stage {stage} runs modules but has no entry in stage_to_rank_map")]
    StageWithoutRanks { stage: usize },
    #[error("stage_to_rank_map names stage {stage}, which no module is mapped to")]
    UnknownStage { stage: usize },
    #[error("rank {rank} appears in both stage {first} and stage {second} of stage_to_rank_map")]
    RankInTwoStages {
        rank: usize,
        first: usize,
        second: usize,
    },
    #[error("rank {rank} in stage {stage} of stage_to_rank_map is outside 0..{world_size} (the world size)")]
    RankOutOfRange {
        rank: usize,
        stage: usize,
        world_size: usize,
    },
    #[error(
        "rank {rank} is in no stage of stage_to_rank_map; ranks 0..{world_size} must each run one stage"
    )]
    RankUnassigned { rank: usize, world_size: usize },
    #[error("stage_to_depth_map key {key:?} is not a stage of this config")]
    BadDepthKey { key: String },
    #[error("module_to_device_map has {got} entries but module_to_stage_map has {expected}; give one device per module")]
    DeviceMapLength { got: usize, expected: usize },
    #[error(
        "module_to_device_map[{index}] is device {device}, but within stage {stage} the devices must start \
         at 0 and go up by at most one from module to module ({expected} expected there)"
    )]
    DeviceMapOrder {
        index: usize,
        stage: usize,
        device: usize,
        expected: String,
    },
    #[error("bundles: rank {rank} is in bundle {first} and bundle {second}; put each rank in one bundle")]
    BundleRankTwice {
        rank: usize,
        first: usize,
        second: usize,
    },
    #[error("bundles: rank {rank} is outside 0..{world_size} (the world size)")]
    BundleRankOutOfRange { rank: usize, world_size: usize },
    #[error("bundles: rank {rank} is in no bundle; every rank must be in one")]
    BundleRankMissing { rank: usize },
    #[error("bundles: bundle {bundle} has no rank of stage {stage}; a bundle holds every stage (a front and a rear part)")]
    BundleWithoutStage { bundle: usize, stage: usize },
    #[error(
        "bundles: microbatch {microbatch} goes from rank {from} (stage {stage}, bundle {from_bundle}) to rank {to} \
         (stage {next}, bundle {to_bundle}); replicas take microbatches round-robin in stage_to_rank_map's order, \
         so order the ranks (or regroup the bundles) so that each bundle's traffic stays inside it",
        next = stage + 1
    )]
    BundleCrossed {
        microbatch: usize,
        stage: usize,
        from: usize,
        from_bundle: usize,
        to: usize,
        to_bundle: usize,
    },
}

/// One validated stage.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// Stage number, from 0.
    pub id: usize,
    /// The modules it runs.
    pub modules: Range<usize>,
    /// The ranks that run it, in the order given (replicas).
    pub ranks: Vec<usize>,
    /// Warm-up depth, if the config gave one.
    pub depth: Option<usize>,
    /// With `module_to_device_map`: the modules each of the rank's devices holds, in order.
    pub device_parts: Option<Vec<Range<usize>>>,
    /// With `bundles`: this stage's ranks in each bundle (ascending), in the bundles' order; the
    /// first of each is the bundle's master for this stage.
    pub bundles: Option<Vec<Vec<usize>>>,
}

/// A validated stage config for a given model and world size.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    /// Stages in pipeline order.
    pub stages: Vec<Stage>,
    /// Total ranks.
    pub world_size: usize,
}

impl StageConfig {
    /// Parses PipeDream's JSON.
    pub fn from_json(text: &str) -> Result<StageConfig, StageConfigError> {
        serde_json::from_str(text).map_err(|e| {
            // A layer profile given where a stage config goes: say what it is and where it goes.
            let value = serde_json::from_str::<serde_json::Value>(text).ok();
            let profile = value
                .as_ref()
                .is_some_and(|v| v.get("format_version").is_some() && v.get("modules").is_some());
            match profile {
                true => StageConfigError::IsAProfile,
                false => StageConfigError::Json(e.to_string()),
            }
        })
    }

    /// Checks the config against the model's module count and the world size.
    pub fn validate(&self, num_modules: usize, world_size: usize) -> Result<StagePlan, StageConfigError> {
        let map = &self.module_to_stage_map;
        if map.len() != num_modules {
            return Err(StageConfigError::ModuleCount {
                got: map.len(),
                expected: num_modules,
            });
        }
        let mut ranges: Vec<Range<usize>> = Vec::new();
        for (index, &stage) in map.iter().enumerate() {
            let current = ranges.len().checked_sub(1);
            if Some(stage) == current {
                ranges.last_mut().expect("current stage exists").end = index + 1;
            } else if stage == ranges.len() {
                ranges.push(index..index + 1);
            } else {
                let expected = match current {
                    Some(c) => format!("{c} or {}", c + 1),
                    None => "0".to_string(),
                };
                return Err(StageConfigError::NotContiguous {
                    index,
                    stage,
                    expected,
                });
            }
        }

        let mut ranks_of: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (key, ranks) in &self.stage_to_rank_map {
            let stage =
                parse_stage_key(key).ok_or_else(|| StageConfigError::BadStageKey { key: key.clone() })?;
            if stage >= ranges.len() {
                return Err(StageConfigError::UnknownStage { stage });
            }
            ranks_of.insert(stage, ranks.clone());
        }
        let mut owner: Vec<Option<usize>> = vec![None; world_size];
        for (&stage, ranks) in &ranks_of {
            for &rank in ranks {
                let slot = owner.get_mut(rank).ok_or(StageConfigError::RankOutOfRange {
                    rank,
                    stage,
                    world_size,
                })?;
                if let Some(first) = *slot {
                    return Err(StageConfigError::RankInTwoStages {
                        rank,
                        first,
                        second: stage,
                    });
                }
                *slot = Some(stage);
            }
        }
        if let Some(rank) = owner.iter().position(Option::is_none) {
            return Err(StageConfigError::RankUnassigned { rank, world_size });
        }

        let mut depths: BTreeMap<usize, usize> = BTreeMap::new();
        for (key, &depth) in self.stage_to_depth_map.iter().flatten() {
            match parse_stage_key(key) {
                Some(stage) if stage < ranges.len() => depths.insert(stage, depth),
                _ => return Err(StageConfigError::BadDepthKey { key: key.clone() }),
            };
        }

        if let Some(devices) = &self.module_to_device_map {
            if devices.len() != map.len() {
                return Err(StageConfigError::DeviceMapLength {
                    got: devices.len(),
                    expected: map.len(),
                });
            }
        }
        let stages = ranges
            .into_iter()
            .enumerate()
            .map(|(id, modules)| {
                let ranks = ranks_of.remove(&id).filter(|r| !r.is_empty());
                let ranks = ranks.ok_or(StageConfigError::StageWithoutRanks { stage: id })?;
                let device_parts = self.device_parts(id, &modules)?;
                Ok(Stage {
                    id,
                    modules,
                    ranks,
                    depth: depths.get(&id).copied(),
                    device_parts,
                    bundles: None,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut plan = StagePlan { stages, world_size };
        if let Some(bundles) = &self.bundles {
            let per_stage = bundle_stages(&plan, bundles)?;
            for (stage, groups) in plan.stages.iter_mut().zip(per_stage) {
                stage.bundles = Some(groups);
            }
        }
        Ok(plan)
    }
}

/// Each stage's ranks per bundle, checked: every rank in one bundle, every bundle holding every
/// stage, and the round-robin traffic between consecutive stages staying inside bundles.
fn bundle_stages(plan: &StagePlan, bundles: &[Vec<usize>]) -> Result<Vec<Vec<Vec<usize>>>, StageConfigError> {
    let world_size = plan.world_size;
    let mut bundle_of: Vec<Option<usize>> = vec![None; world_size];
    for (b, bundle) in bundles.iter().enumerate() {
        for &rank in bundle {
            let slot = bundle_of
                .get_mut(rank)
                .ok_or(StageConfigError::BundleRankOutOfRange { rank, world_size })?;
            if let Some(first) = *slot {
                return Err(StageConfigError::BundleRankTwice {
                    rank,
                    first,
                    second: b,
                });
            }
            *slot = Some(b);
        }
    }
    let bundle_of: Vec<usize> = bundle_of
        .iter()
        .enumerate()
        .map(|(rank, b)| b.ok_or(StageConfigError::BundleRankMissing { rank }))
        .collect::<Result<_, _>>()?;
    let mut per_stage = Vec::with_capacity(plan.stages.len());
    for stage in &plan.stages {
        let groups: Vec<Vec<usize>> = bundles
            .iter()
            .map(|bundle| {
                let mut ranks: Vec<usize> = bundle
                    .iter()
                    .copied()
                    .filter(|r| stage.ranks.contains(r))
                    .collect();
                ranks.sort_unstable();
                ranks
            })
            .collect();
        if let Some(bundle) = groups.iter().position(Vec::is_empty) {
            return Err(StageConfigError::BundleWithoutStage {
                bundle,
                stage: stage.id,
            });
        }
        per_stage.push(groups);
    }
    // Microbatch g runs on ranks[g % replicas] of each stage: every residue of the replica
    // counts' least common multiple is one pairing.
    for pair in plan.stages.windows(2) {
        let (a, b) = (&pair[0].ranks, &pair[1].ranks);
        for g in 0..lcm(a.len(), b.len()) {
            let (from, to) = (a[g % a.len()], b[g % b.len()]);
            if bundle_of[from] != bundle_of[to] {
                return Err(StageConfigError::BundleCrossed {
                    microbatch: g,
                    stage: pair[0].id,
                    from,
                    from_bundle: bundle_of[from],
                    to,
                    to_bundle: bundle_of[to],
                });
            }
        }
    }
    Ok(per_stage)
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

impl StageConfig {
    /// Stage `stage`'s modules per device, from `module_to_device_map` (checked for length).
    fn device_parts(
        &self,
        stage: usize,
        modules: &Range<usize>,
    ) -> Result<Option<Vec<Range<usize>>>, StageConfigError> {
        let Some(devices) = &self.module_to_device_map else {
            return Ok(None);
        };
        let mut parts: Vec<Range<usize>> = Vec::new();
        for index in modules.clone() {
            let device = devices[index];
            match parts.len().checked_sub(1) {
                Some(current) if device == current => parts[current].end = index + 1,
                _ if device == parts.len() => parts.push(index..index + 1),
                current => {
                    return Err(StageConfigError::DeviceMapOrder {
                        index,
                        stage,
                        device,
                        expected: match current {
                            Some(c) => format!("{c} or {}", c + 1),
                            None => "0".to_string(),
                        },
                    })
                }
            }
        }
        Ok(Some(parts))
    }
}

fn parse_stage_key(key: &str) -> Option<usize> {
    key.trim().parse().ok()
}

impl StagePlan {
    /// Every rank holds the whole model: pure data parallelism.
    pub fn data_parallel(num_modules: usize, world_size: usize) -> StagePlan {
        StagePlan {
            stages: vec![Stage {
                id: 0,
                modules: 0..num_modules,
                ranks: (0..world_size).collect(),
                depth: None,
                device_parts: None,
                bundles: None,
            }],
            world_size,
        }
    }

    /// The stage that `rank` runs. Panics if the rank is outside the plan, which validation rules out.
    pub fn stage_of_rank(&self, rank: usize) -> &Stage {
        self.stages
            .iter()
            .find(|s| s.ranks.contains(&rank))
            .unwrap_or_else(|| panic!("rank {rank} is in no stage of a validated plan"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(json: &str, modules: usize, world: usize) -> Result<StagePlan, StageConfigError> {
        StageConfig::from_json(json).and_then(|c| c.validate(modules, world))
    }

    #[test]
    fn pipedreams_hybrid_example_validates() {
        let p = plan(
            r#"{"module_to_stage_map": [0,1,1], "stage_to_rank_map": {"0": [0,1,2], "1": [3]}}"#,
            3,
            4,
        )
        .unwrap();
        assert_eq!(p.stages.len(), 2);
        assert_eq!(p.stages[0].modules, 0..1);
        assert_eq!(p.stages[1].modules, 1..3);
        assert_eq!(p.stages[0].ranks, vec![0, 1, 2]);
        assert_eq!(p.stage_of_rank(3).id, 1);
    }

    #[test]
    fn device_map_splits_each_stage_over_its_ranks_devices() {
        let p = plan(
            r#"{"module_to_stage_map": [0,0,0,1,1], "stage_to_rank_map": {"0": [0], "1": [1]},
                "module_to_device_map": [0,1,1,0,0]}"#,
            5,
            2,
        )
        .unwrap();
        assert_eq!(p.stages[0].device_parts, Some(vec![0..1, 1..3]));
        let one_part: Vec<std::ops::Range<usize>> = std::iter::once(3..5).collect();
        assert_eq!(p.stages[1].device_parts, Some(one_part));
        let e = plan(
            r#"{"module_to_stage_map": [0,0,1], "stage_to_rank_map": {"0": [0], "1": [1]},
                "module_to_device_map": [0,1,1]}"#,
            3,
            2,
        )
        .unwrap_err();
        assert_eq!(
            e,
            StageConfigError::DeviceMapOrder {
                index: 2,
                stage: 1,
                device: 1,
                expected: "0".into()
            }
        );
        assert!(
            e.to_string().contains("module_to_device_map[2] is device 1"),
            "{e}"
        );
        let e = plan(
            r#"{"module_to_stage_map": [0,0], "stage_to_rank_map": {"0": [0]}, "module_to_device_map": [0]}"#,
            2,
            1,
        )
        .unwrap_err();
        assert_eq!(e, StageConfigError::DeviceMapLength { got: 1, expected: 2 });
    }

    #[test]
    fn bundles_group_each_stages_ranks_and_keep_traffic_inside() {
        // Shape 4,2: two bundles of two fronts and one rear.
        let p = plan(
            r#"{"module_to_stage_map": [0,0,1], "stage_to_rank_map": {"0": [0,1,2,3], "1": [4,5]},
                "bundles": [[0,2,4],[1,3,5]]}"#,
            3,
            6,
        )
        .unwrap();
        assert_eq!(p.stages[0].bundles, Some(vec![vec![0, 2], vec![1, 3]]));
        assert_eq!(p.stages[1].bundles, Some(vec![vec![4], vec![5]]));
        let no = |json: &str, world: usize| plan(json, 3, world).unwrap_err();
        let two = r#"{"module_to_stage_map": [0,0,1], "stage_to_rank_map": {"0": [0,1,2,3], "1": [4,5]}, "bundles": "#;
        // Microbatch 1 goes from rank 1 to rank 5: [[0,1,4],[2,3,5]] crosses.
        assert_eq!(
            no(&format!("{two}[[0,1,4],[2,3,5]]}}"), 6),
            StageConfigError::BundleCrossed {
                microbatch: 1,
                stage: 0,
                from: 1,
                from_bundle: 0,
                to: 5,
                to_bundle: 1
            }
        );
        assert_eq!(
            no(&format!("{two}[[0,2,4],[1,3]]}}"), 6),
            StageConfigError::BundleRankMissing { rank: 5 }
        );
        assert_eq!(
            no(&format!("{two}[[0,2,4,5],[1,3,5]]}}"), 6),
            StageConfigError::BundleRankTwice {
                rank: 5,
                first: 0,
                second: 1
            }
        );
        assert_eq!(
            no(&format!("{two}[[0,2,4,5],[1,3,9]]}}"), 6),
            StageConfigError::BundleRankOutOfRange {
                rank: 9,
                world_size: 6
            }
        );
        assert_eq!(
            no(&format!("{two}[[0,1,2,3,4,5],[]]}}"), 6),
            StageConfigError::BundleWithoutStage { bundle: 1, stage: 0 }
        );
        let message = no(&format!("{two}[[0,1,4],[2,3,5]]}}"), 6).to_string();
        assert!(
            message.contains("rank 1 (stage 0, bundle 0) to rank 5 (stage 1, bundle 1)"),
            "{message}"
        );
    }

    #[test]
    fn depth_map_is_carried() {
        let p = plan(
            r#"{"module_to_stage_map": [0,0,1], "stage_to_rank_map": {"0": [0], "1": [1]}, "stage_to_depth_map": {"0": 2, "1": 1}}"#,
            3,
            2,
        )
        .unwrap();
        assert_eq!(p.stages[0].depth, Some(2));
        assert_eq!(p.stages[1].depth, Some(1));
    }

    #[test]
    fn each_inconsistency_names_the_wrong_entry() {
        use StageConfigError::*;
        let cases: &[(&str, usize, usize, StageConfigError)] = &[
            (
                r#"{"module_to_stage_map": [0,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
                3,
                2,
                ModuleCount { got: 2, expected: 3 },
            ),
            (
                r#"{"module_to_stage_map": [0,1,0], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
                3,
                2,
                NotContiguous {
                    index: 2,
                    stage: 0,
                    expected: "1 or 2".into(),
                },
            ),
            (
                r#"{"module_to_stage_map": [1,1,1], "stage_to_rank_map": {"1": [0]}}"#,
                3,
                1,
                NotContiguous {
                    index: 0,
                    stage: 1,
                    expected: "0".into(),
                },
            ),
            (
                r#"{"module_to_stage_map": [0,1,1], "stage_to_rank_map": {"0": [0]}}"#,
                3,
                1,
                StageWithoutRanks { stage: 1 },
            ),
            (
                r#"{"module_to_stage_map": [0,1,1], "stage_to_rank_map": {"0": [0], "1": []}}"#,
                3,
                1,
                StageWithoutRanks { stage: 1 },
            ),
            (
                r#"{"module_to_stage_map": [0,1,1], "stage_to_rank_map": {"0": [0], "1": [0]}}"#,
                3,
                1,
                RankInTwoStages {
                    rank: 0,
                    first: 0,
                    second: 1,
                },
            ),
            (
                r#"{"module_to_stage_map": [0,1,1], "stage_to_rank_map": {"0": [0], "1": [2]}}"#,
                3,
                2,
                RankOutOfRange {
                    rank: 2,
                    stage: 1,
                    world_size: 2,
                },
            ),
            (
                r#"{"module_to_stage_map": [0,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
                3,
                3,
                RankUnassigned {
                    rank: 2,
                    world_size: 3,
                },
            ),
            (
                r#"{"module_to_stage_map": [0,0,0], "stage_to_rank_map": {"0": [0], "2": [1]}}"#,
                3,
                2,
                UnknownStage { stage: 2 },
            ),
            (
                r#"{"module_to_stage_map": [0,0,0], "stage_to_rank_map": {"zero": [0]}}"#,
                3,
                1,
                BadStageKey { key: "zero".into() },
            ),
            (
                r#"{"module_to_stage_map": [0,0,0], "stage_to_rank_map": {"0": [0]}, "stage_to_depth_map": {"4": 1}}"#,
                3,
                1,
                BadDepthKey { key: "4".into() },
            ),
        ];
        for (json, modules, world, expected) in cases {
            assert_eq!(&plan(json, *modules, *world).unwrap_err(), expected, "{json}");
        }
    }

    #[test]
    fn unknown_keys_and_bad_json_are_rejected() {
        let err = StageConfig::from_json(
            r#"{"module_to_stage_map": [0], "stage_to_rank_map": {"0": [0]}, "stages": 1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `stages`"), "{err}");
        assert!(matches!(
            StageConfig::from_json("[1,2]"),
            Err(StageConfigError::Json(_))
        ));
        // A layer profile is named as one, with where it goes.
        let profile = r#"{"format_version": 1, "model": "mlp", "batch_size": 8, "modules": []}"#;
        let err = StageConfig::from_json(profile).unwrap_err();
        assert!(matches!(err, StageConfigError::IsAProfile), "{err}");
        assert!(err.to_string().contains("driver plan --profile"), "{err}");
    }

    #[test]
    fn data_parallel_plan_puts_every_rank_on_one_stage() {
        let p = StagePlan::data_parallel(5, 3);
        assert_eq!(p.stages.len(), 1);
        assert_eq!(p.stage_of_rank(2).modules, 0..5);
    }
}
