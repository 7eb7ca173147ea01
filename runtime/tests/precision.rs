//! `--precision` and `--channels-last`: PyTorch's autocast in one process and across stages, the
//! fp16 gradient scaler, and the channels_last layout.

use std::time::Duration;

use stagehand_contract::{Event, P2pOp, P2pTensor};

use crate::util::{run, run_ok, run_ranks, Run};

const LIMIT: Duration = Duration::from_secs(120);

/// A small MLP for 5 iterations: the fifth sees the first one's batch again (a pool of 4).
const MLP: &str =
    "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --threads 1 --seed 3 --iterations 5 --lr 0.05";

fn args<'a>(base: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    base.split_whitespace().chain(extra.iter().copied()).collect()
}

/// The MLP on two stages of one rank each, 4 microbatches, in `precision`.
fn two_stages(precision: &str, schedule: &str, extra: &[&str]) -> Vec<Run> {
    two_stages_of(MLP, precision, schedule, extra)
}

/// `base` (the MLP's arguments) on two stages, as [`two_stages`].
fn two_stages_of(base: &str, precision: &str, schedule: &str, extra: &[&str]) -> Vec<Run> {
    let tmp = tempfile::tempdir().unwrap();
    let config = crate::util::two_stages(tmp.path());
    let mut flags = vec!["--precision", precision, "--stage-config", config.as_str()];
    flags.extend(["--schedule", schedule, "--microbatches", "4"]);
    flags.extend(extra);
    run_ranks(2, &args(base, &flags), LIMIT)
}

fn last_stage(runs: &[Run]) -> &Run {
    for run in runs {
        assert!(run.output.status.success(), "{}", run.stderr());
    }
    runs.iter().max_by_key(|r| r.start().stage).unwrap()
}

/// bfloat16 keeps 8 significant bits: each rounding is within u = 2^-8 relative. A loss through
/// a few such roundings that need not cancel stays within a few u of the float32 one.
const BF16_LOSS: f64 = 8.0 / 256.0;

fn assert_within(what: &str, ours: &[f64], theirs: &[f64], rel: f64) {
    assert_eq!(ours.len(), theirs.len(), "{what}");
    for (a, b) in ours.iter().zip(theirs) {
        assert!((a - b).abs() <= rel * b.abs(), "{what}: {ours:?} vs {theirs:?}");
    }
}

#[test]
fn bf16_autocast_trains_close_to_fp32_and_crosses_stages_in_bf16() {
    let fp32 = run_ok(&args(MLP, &[])).losses();
    let single = run_ok(&args(MLP, &["--precision", "bf16"]));
    assert_eq!(single.start().config.precision, "bf16");
    let bf16 = single.losses();
    assert_ne!(fp32, bf16, "autocast changed nothing: is it on?");
    assert_within("bf16 vs fp32", &bf16, &fp32, BF16_LOSS);
    assert!(bf16[4] < bf16[0], "bf16 learns: {bf16:?}");

    let runs = two_stages("bf16", "1f1b", &["--trace"]);
    assert_within(
        "bf16 pipeline vs bf16 single process",
        &last_stage(&runs).losses(),
        &bf16,
        BF16_LOSS,
    );
    // Activations and gradients travel in the autocast dtype; targets stay integers.
    let mut seen = 0;
    for run in &runs {
        for event in &run.events {
            if let Event::P2p(p) = event {
                let expected = match p.tensor {
                    P2pTensor::Activation | P2pTensor::Gradient => "bfloat16",
                    P2pTensor::Target | P2pTensor::Header => "int64",
                };
                assert_eq!(p.dtype, expected, "{p:?}");
                seen += usize::from(p.op == P2pOp::Send && p.tensor == P2pTensor::Gradient);
            }
        }
    }
    assert_eq!(seen, 20, "5 iterations of 4 microbatches send a gradient each");
}

/// What a run's events say the gradient scaler did, per iteration: (scale after the step,
/// skipped); and checks they tell one story: the scale starts where the start event says (torch's
/// 2^16 by default), halves after each skipped step and holds otherwise (no growth before 2000
/// clean steps), and the summary counts the skipped ones.
fn scaler_story(run: &Run) -> Vec<(f64, bool)> {
    let story: Vec<(f64, bool)> = run
        .iterations()
        .iter()
        .map(|it| {
            (
                it.loss_scale.expect("fp16 reports its scale"),
                it.step_skipped.expect("and skips"),
            )
        })
        .collect();
    let mut scale = run
        .start()
        .config
        .fp16_init_scale
        .expect("fp16 says its first scale");
    for &(reported, skipped) in &story {
        if skipped {
            scale *= 0.5;
        }
        assert_eq!(reported, scale, "{story:?}");
    }
    let skipped = story.iter().filter(|(_, s)| *s).count() as u64;
    assert_eq!(run.summary().skipped_steps, Some(skipped), "{story:?}");
    story
}

#[test]
fn fp16_trains_with_its_gradient_scaler_in_one_process_and_a_pipeline() {
    let fp16 = run_ok(&args(MLP, &["--precision", "fp16"]));
    let single = fp16.losses();
    assert!(single.iter().all(|l| l.is_finite()), "{single:?}");
    assert!(single[4] < single[0], "fp16 learns: {single:?}");
    assert_eq!(fp16.start().config.fp16_init_scale, Some(65536.0));
    assert_eq!(scaler_story(&fp16).len(), 5);
    let fp32 = run_ok(&args(MLP, &[]));
    assert!(fp32
        .iterations()
        .iter()
        .all(|it| it.loss_scale.is_none() && it.step_skipped.is_none()));
    assert_eq!(fp32.summary().skipped_steps, None);
    assert_eq!(fp32.start().config.fp16_init_scale, None);

    let runs = two_stages("fp16", "gpipe", &[]);
    // Both stages skip the same steps with the same scale.
    let stories: Vec<_> = runs.iter().map(scaler_story).collect();
    assert_eq!(stories[0], stories[1]);
    // float16 keeps 11 significant bits, finer than bfloat16: the same bound holds.
    assert_within(
        "fp16 pipeline vs one process",
        &last_stage(&runs).losses(),
        &single,
        BF16_LOSS,
    );

    // PipeDream steps stages at different times, so they cannot agree on skipped steps.
    let tmp = tempfile::tempdir().unwrap();
    let config = crate::util::two_stages(tmp.path());
    let extra = [
        "--precision",
        "fp16",
        "--stage-config",
        config.as_str(),
        "--schedule",
        "pipedream",
        "--rank",
        "0",
        "--world-size",
        "2",
    ];
    let refused = run(&args(MLP, &extra));
    assert_eq!(refused.output.status.code(), Some(2), "{}", refused.stderr());
    assert!(
        refused.stderr().contains("use --precision bf16 with pipedream"),
        "{}",
        refused.stderr()
    );
}

/// A first loss scale far too large (2^24: the scaled gradients overflow float16) makes the
/// scaler skip the first steps, halving its scale each time, until the gradients fit; the skipped
/// steps leave the weights untouched: with a pool of 4 batches, iteration i >= 4 sees iteration
/// i - 4's batch, and while every step before it was skipped, its loss is that one's bit for bit.
/// Both stages of a pipeline skip the same steps.
#[test]
fn fp16_skips_the_steps_whose_scaled_gradients_overflow_and_leaves_the_weights() {
    let ten = MLP.replace("--iterations 5", "--iterations 10");
    let big = ["--precision", "fp16", "--fp16-init-scale", "16777216"];
    let single = run_ok(&args(&ten, &big));
    assert_eq!(single.start().config.fp16_init_scale, Some(16777216.0));
    let story = scaler_story(&single);
    let leading = story.iter().take_while(|(_, skipped)| *skipped).count();
    assert!(
        (4..10).contains(&leading),
        "2^24 overflows for at least 4 halvings (a first gradient of magnitude below 1/256 would \
         fit at 2^16), and the scale comes down: {story:?}"
    );
    let losses = single.losses();
    for i in 4..=leading {
        assert_eq!(
            losses[i],
            losses[i - 4],
            "iteration {i}: a skipped step moved the weights"
        );
    }
    assert_ne!(
        losses[leading + 1],
        losses[leading - 3],
        "the first step taken changed nothing: {losses:?}"
    );

    let runs = two_stages_of(&ten, "fp16", "gpipe", &big[2..]);
    let stories: Vec<_> = runs.iter().map(scaler_story).collect();
    assert_eq!(stories[0], stories[1], "the stages skip the same steps");
    assert!(stories[0][0].1, "{:?}", stories[0]);

    let refused = run(&args(MLP, &["--fp16-init-scale", "1024"]));
    assert_eq!(refused.output.status.code(), Some(2), "{}", refused.stderr());
    assert!(
        refused.stderr().contains("use it with --precision fp16"),
        "{}",
        refused.stderr()
    );
    let refused = run(&args(MLP, &["--precision", "fp16", "--fp16-init-scale", "0"]));
    assert_eq!(refused.output.status.code(), Some(2), "{}", refused.stderr());
    assert!(
        refused.stderr().contains("must be a positive float32 number"),
        "{}",
        refused.stderr()
    );
}

#[test]
fn channels_last_changes_the_layout_not_the_training() {
    let base = "--model vgg16 --image-size 32 --num-classes 10 --batch-size 4 --iterations 2 --lr 0.01 --threads 2 --seed 1";
    let plain = run_ok(&args(base, &[])).losses();
    let last = run_ok(&args(base, &["--channels-last"]));
    assert!(last.start().config.channels_last);
    // Only the convolutions' summation order changes: float32 rounding, far below 1e-3.
    assert_within("channels_last vs default", &last.losses(), &plain, 1e-3);
}

/// float16 keeps 11 significant bits: rounding each activation once, at the boundary, moves it
/// by at most u = 2^-11 relative, and a loss computed from it by a few u; 8u bounds that with
/// room, as for bfloat16 above.
const FP16_WIRE_LOSS: f64 = 8.0 / 2048.0;

#[test]
fn compressed_activations_cross_in_float16_and_train_close_to_float32() {
    let fp32 = last_stage(&two_stages("fp32", "1f1b", &[])).losses();
    let runs = two_stages("fp32", "1f1b", &["--trace", "--compress-activations"]);
    assert!(runs.iter().all(|r| r.start().config.compress_activations));
    let compressed = last_stage(&runs).losses();
    assert_ne!(compressed, fp32, "nothing was rounded: is the compression on?");
    assert_within("fp16 activations vs fp32", &compressed, &fp32, FP16_WIRE_LOSS);
    // Activations travel as float16, both ways of the channel agreeing; gradients stay float32.
    let mut activations = 0;
    for run in &runs {
        for event in &run.events {
            if let Event::P2p(p) = event {
                let expected = match p.tensor {
                    P2pTensor::Activation => "float16",
                    P2pTensor::Gradient => "float32",
                    P2pTensor::Target | P2pTensor::Header => "int64",
                };
                assert_eq!(p.dtype, expected, "{p:?}");
                activations += usize::from(p.tensor == P2pTensor::Activation);
            }
        }
    }
    assert_eq!(activations, 40, "20 activations, each sent and received");
}
