//! Sparse transfers (`--compress auto`): activations and gradients cross stages in their
//! smallest form and are rebuilt bit for bit, so a pipeline and a hybrid train exactly as with
//! `--compress off` (equal losses and parameters, no tolerance), while the metrics show fewer bytes
//! sent where the activations are sparse (after a ReLU).

use std::path::{Path, PathBuf};
use std::time::Duration;

use stagehand_contract::metrics::ValidationFigures;

use crate::util::{assert_same_params, run, run_ranks, Run};

const LIMIT: Duration = Duration::from_secs(120);

fn ok(runs: Vec<Run>) -> Vec<Run> {
    for r in &runs {
        assert!(r.output.status.success(), "{}", r.stderr());
    }
    runs
}

/// `world` ranks run `args` with `--compress off`, then `auto`, each saving its parameters in a
/// folder of `tmp` named after `name` and the mode: (that folder, the runs) of each mode.
fn off_and_auto(tmp: &Path, name: &str, world: usize, args: &[&str]) -> [(PathBuf, Vec<Run>); 2] {
    ["off", "auto"].map(|mode| {
        let params = tmp.join(format!("{name}-{mode}"));
        let compress = ["--compress", mode, "--save-params", params.to_str().unwrap()];
        let runs = ok(run_ranks(world, &[args, &compress[..]].concat(), LIMIT));
        (params, runs)
    })
}

#[test]
fn compressed_transfers_train_bit_for_bit_as_dense_ones_with_fewer_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        // A pipeline of two ranks, and a hybrid (stage 0 replicated) whose replicas send to one
        // rank; each in fp32 and with the 16-bit kinds (bf16 autocast; float16 on the wire).
        (
            "pipeline",
            2,
            r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
            &[][..],
        ),
        (
            "hybrid-bf16",
            3,
            r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#,
            &["--precision", "bf16"][..],
        ),
        (
            "pipeline-fp16-wire",
            2,
            r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#,
            &["--compress-activations"][..],
        ),
    ];
    for (name, world, map, extra) in cases {
        let config = tmp.path().join(format!("{name}.json"));
        std::fs::write(&config, map).unwrap();
        let args: Vec<&str> = [
            &[
                "--model",
                "mlp",
                "--layers",
                "4",
                "--hidden",
                "128",
                "--image-size",
                "8",
                "--batch-size",
                "16",
                "--threads",
                "1",
                "--seed",
                "5",
                "--iterations",
                "3",
                "--momentum",
                "0.9",
                "--schedule",
                "1f1b",
                "--microbatches",
                "4",
                "--stage-config",
                config.to_str().unwrap(),
            ][..],
            extra,
        ]
        .concat();
        let [(off_params, off), (auto_params, auto)] = off_and_auto(tmp.path(), name, world, &args);
        assert_eq!(off[world - 1].losses(), auto[world - 1].losses(), "{name}");
        assert_same_params(&off_params, &auto_params, name);
        // Stage 0 sends activations after a ReLU (about half zero at initialisation): the bitmask
        // form weighs well under the dense bytes; `off` sends exactly the dense bytes.
        for it in off[0].iterations() {
            assert_eq!(it.sent_bytes, it.sent_dense_bytes, "{name}");
            assert!(it.sent_bytes > 0, "{name}");
        }
        for it in auto[0].iterations() {
            assert!(
                (it.sent_bytes as f64) < 0.8 * it.sent_dense_bytes as f64,
                "{name}: {} of {} dense bytes",
                it.sent_bytes,
                it.sent_dense_bytes
            );
        }
    }
}

#[test]
fn compressed_transfers_need_gloo() {
    let out = run(&[
        "--model",
        "mlp",
        "--device",
        "cuda:0",
        "--backend",
        "nccl",
        "--compress",
        "auto",
        "--iterations",
        "1",
    ]);
    assert_eq!(out.output.status.code(), Some(2), "{}", out.stderr());
    assert!(out.stderr().contains("--backend gloo"), "{}", out.stderr());
}

/// PipeDream with replicated stages takes framed messages, whose payloads' receives are posted
/// only once their headers are in: a replica's step (a collective) would otherwise wait on a
/// payload the next stage takes only after a step of its own, itself waiting on that replica
/// (three replicas of stage 0 timed out in their first iteration). Replicas upstream, then
/// downstream, train and validate bit for bit as with `--compress off`; sparse_mlp, whose COO
/// activations always travel framed, trains on replicas too.
#[test]
fn pipedream_takes_compressed_transfers_with_replicated_stages() {
    let tmp = tempfile::tempdir().unwrap();
    let base = [
        "--layers",
        "4",
        "--hidden",
        "1024",
        "--image-size",
        "8",
        "--batch-size",
        "48",
        "--microbatches",
        "6",
        "--threads",
        "1",
        "--seed",
        "3",
        "--iterations",
        "3",
        "--momentum",
        "0.9",
        "--schedule",
        "pipedream",
        // A validation pass between iterations 2 and 3: payload sends still in flight are waited
        // for before it.
        "--validate-every",
        "2",
    ];
    let splits = [
        ("upstream", 4, r#"{"0": [0, 1, 2], "1": [3]}"#),
        ("downstream", 3, r#"{"0": [0], "1": [1, 2]}"#),
    ];
    for (name, world, ranks) in splits {
        let config = tmp.path().join(format!("{name}.json"));
        std::fs::write(
            &config,
            format!(r#"{{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {ranks}}}"#),
        )
        .unwrap();
        let mlp = ["--model", "mlp", "--stage-config", config.to_str().unwrap()];
        let args = [&base[..], &mlp[..]].concat();
        let [(off_params, off), (auto_params, auto)] = off_and_auto(tmp.path(), name, world, &args);
        assert_eq!(off[world - 1].losses().len(), 3, "{name}");
        assert_eq!(off[world - 1].losses(), auto[world - 1].losses(), "{name}");
        let passes = |runs: &[Run]| -> Vec<(u64, ValidationFigures)> {
            runs[world - 1]
                .validations()
                .iter()
                .map(|v| (v.iteration, v.figures))
                .collect()
        };
        assert_eq!(passes(&off).len(), 2, "{name}");
        assert_eq!(passes(&off), passes(&auto), "{name}");
        assert_same_params(&off_params, &auto_params, name);
        for it in auto[0].iterations() {
            assert!(
                it.sent_bytes < it.sent_dense_bytes,
                "{name}: nothing was compressed"
            );
        }
    }
    let config = tmp.path().join("sparse.json");
    std::fs::write(
        &config,
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#,
    )
    .unwrap();
    let sparse = [
        "--model",
        "sparse_mlp",
        "--active-units",
        "8",
        "--stage-config",
        config.to_str().unwrap(),
    ];
    let args = [&base[..], &sparse[..]].concat();
    let runs = ok(run_ranks(3, &args, LIMIT));
    let losses = runs[2].losses();
    assert_eq!(losses.len(), 3);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

/// sparse_mlp's hidden layers hand on sparse COO tensors (k-winners-take-all), and its backward
/// makes COO gradients for them: cut into stages, both cross as COO, whatever `--compress` says,
/// and are rebuilt as the same COO tensors. So a pipeline trains bit for bit as one process
/// running the same microbatches (each microbatch's forward and backward are the same kernels on
/// the same tensors, and gradients accumulate in the same order), and the bytes sent are the COO
/// entries' (two int64 indices and a float32 value each) plus each message's header, well under
/// the dense tensors'.
#[test]
fn sparse_coo_activations_and_gradients_cross_stages_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let base = [
        "--model",
        "sparse_mlp",
        "--layers",
        "4",
        "--hidden",
        "128",
        "--active-units",
        "8",
        "--image-size",
        "8",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--seed",
        "9",
        "--iterations",
        "3",
        "--momentum",
        "0.9",
        "--microbatches",
        "4",
    ];
    let single = tmp.path().join("single");
    fn with_params<'a>(base: &[&'a str], dir: &'a std::path::Path) -> Vec<&'a str> {
        [base, &["--save-params", dir.to_str().unwrap()]].concat()
    }
    let one = ok(vec![run(&with_params(&base, &single))]);
    // Three stages: the middle one receives COO activations and sends COO ones on.
    let config = tmp.path().join("three.json");
    std::fs::write(
        &config,
        r#"{"module_to_stage_map": [0,0,1,1,2,2], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2]}}"#,
    )
    .unwrap();
    for (schedule, compress) in [("1f1b", "off"), ("gpipe", "auto")] {
        let what = format!("{schedule}, --compress {compress}");
        let params = tmp.path().join(format!("{schedule}-{compress}"));
        let args = [
            &with_params(&base, &params)[..],
            &[
                "--stage-config",
                config.to_str().unwrap(),
                "--schedule",
                schedule,
                "--compress",
                compress,
            ],
        ]
        .concat();
        let runs = ok(run_ranks(3, &args, LIMIT));
        assert_eq!(runs[2].losses(), one[0].losses(), "{what}");
        assert_same_params(&single, &params, &what);
        // Per microbatch of 4 samples at most 4 x 8 entries of 20 bytes and a 32-byte header
        // cross each boundary each way (a ReLU's zeros drop out); dense they would be 4 x 128
        // float32 elements, 2048 bytes. Stage 0 sends activations (and the targets, 4 int64 a
        // microbatch), stage 1 activations, targets and gradients, stage 2 gradients.
        let (coo_most, dense, targets) = (4 * (32 + 4 * 8 * 20), 4 * 2048, 4 * 4 * 8);
        let expected = [
            (coo_most + targets, dense + targets),
            (2 * coo_most + targets, 2 * dense + targets),
            (coo_most, dense),
        ];
        for (rank, (run, (most, dense))) in runs.iter().zip(expected).enumerate() {
            for it in run.iterations() {
                assert!(
                    it.sent_bytes > 0 && it.sent_bytes <= most,
                    "{what}: rank {rank} sent {} bytes, at most {most} expected",
                    it.sent_bytes
                );
                assert_eq!(it.sent_dense_bytes, dense, "{what}: rank {rank}");
            }
        }
    }
}
