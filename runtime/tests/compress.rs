//! Sparse transfers (`--compress auto`): activations and gradients cross stages in their
//! smallest form and are rebuilt bit for bit, so a pipeline and a hybrid train exactly as with
//! `--compress off` (equal losses and parameters, no tolerance), while the metrics show fewer bytes
//! sent where the activations are sparse (after a ReLU).

use std::time::Duration;

use crate::util::{assert_same_params, run, run_ranks, Run};

const LIMIT: Duration = Duration::from_secs(120);

fn ok(runs: Vec<Run>) -> Vec<Run> {
    for r in &runs {
        assert!(r.output.status.success(), "{}", r.stderr());
    }
    runs
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
        let mut by_mode = Vec::new();
        for mode in ["off", "auto"] {
            let params = tmp.path().join(format!("{name}-{mode}"));
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
                    "--compress",
                    mode,
                    "--save-params",
                    params.to_str().unwrap(),
                ][..],
                extra,
            ]
            .concat();
            let runs = ok(run_ranks(world, &args, LIMIT));
            by_mode.push((params.clone(), runs));
        }
        let [(off_params, off), (auto_params, auto)] = <[_; 2]>::try_from(by_mode).ok().unwrap();
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
