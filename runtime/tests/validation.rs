//! Validation passes (`--validate-every`): every split and schedule measures what one process
//! measures on the same weights, over each dataset's held-out split, in evaluation mode.

use std::path::Path;

use stagehand_contract::metrics::Validation;

use crate::distributed::{args, assert_close, write, LIMIT, MLP};
use crate::util::{run, run_ok, run_ranks, two_stages, words, write_cifar, write_image_folder, Run};

/// Samples in a pass of the MLP's arguments: the 4 synthetic minibatches of 16.
const PASS_SAMPLES: u64 = 64;

/// The passes of a split run's last stage, every rank of it reporting the same; the other
/// stages report none.
fn last_stage_passes<'a>(what: &str, runs: &'a [Run]) -> Vec<&'a Validation> {
    for (rank, run) in runs.iter().enumerate() {
        assert!(
            run.output.status.success(),
            "{what}: rank {rank} failed:\n{}",
            run.stderr()
        );
    }
    let last = runs.iter().map(|r| r.start().stage).max().unwrap();
    let mut reports = runs
        .iter()
        .filter(|r| r.start().stage == last)
        .map(Run::validations);
    let first = reports.next().unwrap();
    for other in reports {
        assert_eq!(other.len(), first.len(), "{what}");
        for (a, b) in first.iter().zip(&other) {
            assert_eq!(
                a.figures, b.figures,
                "{what}: the last stage's replicas report one pass"
            );
        }
    }
    for run in runs.iter().filter(|r| r.start().stage != last) {
        assert!(
            run.validations().is_empty(),
            "{what}: only the last stage reports a pass"
        );
    }
    first
}

/// A split's passes against one process's. The loss is a mean over the pass's 64 samples that
/// the split sums from microbatch means in another order, so it matches to float32 rounding
/// (the 1e-4 relative of `assert_close`); a lost, doubled or misrouted microbatch moves it by a
/// sixteenth. An accuracy counts samples whose logits match one process's to rounding: a sample
/// within rounding of a tie may go either way, so one sample's share, 1/64, is allowed.
fn assert_same_passes(what: &str, ours: &[&Validation], reference: &[&Validation]) {
    let iterations = |v: &[&Validation]| v.iter().map(|p| p.iteration).collect::<Vec<_>>();
    assert_eq!(
        iterations(ours),
        iterations(reference),
        "{what}: passes after these iterations"
    );
    let losses = |v: &[&Validation]| v.iter().map(|p| p.figures.loss).collect::<Vec<_>>();
    assert_close(what, &losses(ours), &losses(reference));
    for (a, b) in ours.iter().zip(reference) {
        assert_eq!(a.figures.samples, PASS_SAMPLES, "{what}");
        let top5 = (a.figures.accuracy_top5.unwrap(), b.figures.accuracy_top5.unwrap());
        for (x, y) in [(a.figures.accuracy, b.figures.accuracy), top5] {
            assert!(
                (x - y).abs() <= 1.0 / 64.0 + 1e-12,
                "{what}: accuracies {:?} vs {:?}",
                a.figures,
                b.figures
            );
        }
    }
}

/// Every split and schedule that trains as one process does also validates as it does: the same
/// passes after the same iterations (every second, and the last), over the same held-out
/// samples, with the same figures. Replicas of the first stage each take their own microbatches
/// of a pass, replicas of the last each measure theirs and sum; PipeDream drains at each pass.
#[test]
fn every_split_and_schedule_validates_as_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let every = ["--validate-every", "2", "--microbatches", "4"];
    let single = run_ok(&args(&words(MLP), &every));
    let reference = single.validations();
    assert_eq!(
        reference.iter().map(|p| p.iteration).collect::<Vec<_>>(),
        [1, 3, 4],
        "after iterations 2 and 4 done, and the last"
    );
    // The held-out samples are not the training pool's: what the model learned of the classes
    // shows on them, but they are other samples (the pass's loss is not the iteration's).
    let last = reference.last().unwrap();
    assert!(last.figures.loss < reference[0].figures.loss, "{reference:?}");
    assert_ne!(Some(last.figures.loss), single.iterations().last().unwrap().loss);
    assert_eq!(single.summary().validation, Some(last.figures));
    assert_eq!(single.losses(), run_ok(&args(&words(MLP), &every[2..])).losses());
    assert_eq!(single.start().config.validate_every, Some(2));
    assert_eq!(single.start().config.validation_batches, Some(4));

    let config = |name: &str, json: &str| write(tmp.path(), name, json);
    let two = two_stages(tmp.path());
    let three = config(
        "three.json",
        r#"{"module_to_stage_map": [0,0,1,1,2,2], "stage_to_rank_map": {"0": [0], "1": [1], "2": [2]}}"#,
    );
    let first_replicated = config(
        "2-1.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1], "1": [2]}}"#,
    );
    let last_replicated = config(
        "1-2.json",
        r#"{"module_to_stage_map": [0,0,0,0,1,1], "stage_to_rank_map": {"0": [0], "1": [1,2]}}"#,
    );
    let uneven = config(
        "3-1.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0,1,2], "1": [3]}}"#,
    );
    // One microbatch in flight per stage: PipeDream trains as one process does.
    let depth1 = config(
        "depth1.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}, "stage_to_depth_map": {"0": 1, "1": 1}}"#,
    );
    let cases: Vec<(&str, usize, Vec<&str>)> = vec![
        (
            "2 stages, gpipe",
            2,
            vec!["--stage-config", &two, "--schedule", "gpipe"],
        ),
        (
            "2 stages, 1f1b, pair groups",
            2,
            vec![
                "--stage-config",
                &two,
                "--schedule",
                "1f1b",
                "--p2p-groups",
                "pairs",
            ],
        ),
        (
            "3 stages, 1f1b",
            3,
            vec!["--stage-config", &three, "--schedule", "1f1b"],
        ),
        (
            "stage 0 on 2 replicas, gpipe",
            3,
            vec!["--stage-config", &first_replicated, "--schedule", "gpipe"],
        ),
        (
            "stage 1 on 2 replicas, 1f1b",
            3,
            vec!["--stage-config", &last_replicated, "--schedule", "1f1b"],
        ),
        (
            "stage 0 on 3 replicas, gpipe",
            4,
            vec!["--stage-config", &uneven, "--schedule", "gpipe"],
        ),
        ("data parallel on 2 ranks", 2, vec![]),
        (
            "pipedream, one microbatch in flight",
            2,
            vec!["--stage-config", &depth1, "--schedule", "pipedream"],
        ),
    ];
    for (what, world, split) in cases {
        let extra = [&every[..], &split].concat();
        let reference = match split.contains(&"pipedream") {
            // One process's pipedream is its synchronous training.
            true => run_ok(&args(
                &words(MLP),
                &[&every[..], &["--schedule", "pipedream"]].concat(),
            )),
            false => run_ok(&args(&words(MLP), &every)),
        };
        let runs = run_ranks(world, &args(&words(MLP), &extra), LIMIT);
        assert_same_passes(what, &last_stage_passes(what, &runs), &reference.validations());
        let last = runs.iter().max_by_key(|r| r.start().stage).unwrap();
        assert_close(what, &last.losses(), &reference.losses());
    }
}

/// PipeDream with microbatches in flight drains at each pass, as at a checkpoint: every pass
/// comes, after the iterations it should, and the run ends.
#[test]
fn pipedream_drains_for_each_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let two = write(
        tmp.path(),
        "two.json",
        r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1,2]}}"#,
    );
    let base = args(
        &words(MLP),
        &[
            "--stage-config",
            &two,
            "--schedule",
            "pipedream",
            "--microbatches",
            "4",
            "--validate-every",
            "2",
        ],
    );
    let six = crate::distributed::with_value(&base, "--iterations", "6");
    let runs = run_ranks(3, &six, LIMIT);
    let what = "pipedream, stage 1 on 2 replicas";
    let got = last_stage_passes(what, &runs);
    assert_eq!(
        got.iter().map(|p| p.iteration).collect::<Vec<_>>(),
        [1, 3, 5],
        "{what}"
    );
    for pass in &got {
        assert!(pass.figures.loss.is_finite(), "{what}: {pass:?}");
        assert_eq!(pass.figures.samples, PASS_SAMPLES, "{what}");
    }
}

/// A pass runs in evaluation mode. A transformer trained at a learning rate of 1e-30 keeps its
/// weights to float32 resolution (each moves by 1e-30 times its gradient, below half an ulp of
/// any weight or activation that is not zero, and a zero bias's 1e-30 vanishes in the sums it
/// joins), so its passes must agree whatever its dropout: with 0.5 and with none, and from one
/// pass to the next, to the 1e-4 relative `assert_close` allows. A pass with dropout on would
/// drop half the units and move the loss by far more.
#[test]
fn a_pass_runs_without_dropout() {
    let transformer = |dropout: &str| {
        run_ok(&words(&format!(
            "--model transformer --layers 1 --hidden 32 --heads 2 --seq-len 8 --vocab-size 64 \
             --dropout {dropout} --batch-size 8 --threads 1 --iterations 2 --lr 1e-30 --validate-every 1"
        )))
    };
    let (dropped, kept) = (transformer("0.5"), transformer("0"));
    let loss = |run: &Run| {
        run.validations()
            .iter()
            .map(|p| p.figures.loss)
            .collect::<Vec<_>>()
    };
    assert_eq!(loss(&dropped).len(), 2, "{}", dropped.stderr());
    assert_close("dropout 0.5 against none", &loss(&dropped), &loss(&kept));
    assert_close(
        "one pass against the next",
        &loss(&dropped)[1..],
        &loss(&dropped)[..1],
    );
    // Training does drop units: the same batch's loss differs with dropout on.
    let training = (dropped.losses()[0], kept.losses()[0]);
    assert!(
        (training.0 - training.1).abs() > 1e-3 * training.1,
        "{training:?}"
    );
    let first = dropped.validations()[0].figures;
    assert_eq!(first.accuracy_top5, None, "per-token accuracy is top-1 alone");
    assert_eq!(first.samples, 32, "4 minibatches of 8 sequences");
}

/// CIFAR-10's held-out split is `test_batch.bin`, all its whole minibatches by default; an image
/// folder's is `val/` beside `train/`. A run is refused before it connects, saying what to give,
/// where the split is missing, too small or unlike the training split.
#[test]
fn each_dataset_validates_on_its_held_out_split() {
    let tmp = tempfile::tempdir().unwrap();
    let cifar = tmp.path().join("cifar");
    std::fs::create_dir_all(&cifar).unwrap();
    write_cifar(&cifar, 40);
    let cifar_args = |extra: &[&str]| -> Vec<String> {
        let spec = format!("cifar10:{}", cifar.display());
        let mut all: Vec<String> = words(
            "--model mlp --layers 2 --hidden 16 --image-size 8 --batch-size 8 --threads 1 \
             --iterations 2 --validate-every 2",
        )
        .into_iter()
        .map(String::from)
        .collect();
        all.extend(["--data".into(), spec]);
        all.extend(extra.iter().map(|s| s.to_string()));
        all
    };
    let as_strs = |v: &[String]| v.iter().map(String::as_str).collect::<Vec<_>>().join(" ");
    let missing = run(&words(&as_strs(&cifar_args(&[]))));
    assert_eq!(missing.output.status.code(), Some(2), "{}", missing.stderr());
    assert!(
        missing.stderr().contains("no test_batch.bin in this folder"),
        "{}",
        missing.stderr()
    );

    // 20 held-out records: two whole minibatches of 8.
    let training = std::fs::read(cifar.join("data_batch_1.bin")).unwrap();
    std::fs::write(cifar.join("test_batch.bin"), &training[..20 * 3073]).unwrap();
    let ran = run_ok(&words(&as_strs(&cifar_args(&[]))));
    assert_eq!(ran.validations().len(), 1);
    assert_eq!(ran.validations()[0].figures.samples, 16);
    assert_eq!(ran.start().config.validation_batches, Some(2));
    let too_many = run(&words(&as_strs(&cifar_args(&["--validation-batches", "3"]))));
    assert_eq!(too_many.output.status.code(), Some(2), "{}", too_many.stderr());
    assert!(
        too_many
            .stderr()
            .contains("--validation-batches 3 of --batch-size 8 asks for 24 samples, but the held-out split has 20: give at most 2"),
        "{}",
        too_many.stderr()
    );

    let images = tmp.path().join("images");
    write_image_folder(&images.join("train"), 3, 4);
    write_image_folder(&images.join("val"), 3, 2);
    let image_args = |dir: &Path| {
        format!(
            "--model mlp --layers 2 --hidden 16 --image-size 8 --batch-size 3 --threads 1 \
             --iterations 1 --validate-every 1 --data {}",
            dir.display()
        )
    };
    let ran = run_ok(&words(&image_args(&images)));
    assert_eq!(
        ran.validations()[0].figures.samples,
        6,
        "val/'s 6 images, two minibatches of 3"
    );
    // A val/ without one of train/'s classes would relabel the rest.
    std::fs::remove_dir_all(images.join("val").join("class_2")).unwrap();
    let relabelled = run(&words(&image_args(&images)));
    assert_eq!(
        relabelled.output.status.code(),
        Some(2),
        "{}",
        relabelled.stderr()
    );
    assert!(
        relabelled.stderr().contains("its class folders are not those of"),
        "{}",
        relabelled.stderr()
    );
    let flat = tmp.path().join("flat");
    write_image_folder(&flat, 3, 4);
    let unsplit = run(&words(&image_args(&flat)));
    assert!(
        unsplit.stderr().contains("no validation split"),
        "{}",
        unsplit.stderr()
    );
}

/// What cannot validate is refused before anything starts, saying what to change.
#[test]
fn a_pass_that_cannot_run_is_refused() {
    let cases: &[(&str, &str)] = &[
        ("--validate-every 0", "--validate-every: must be at least 1"),
        (
            "--validate-every 2 --validation-batches 0",
            "--validation-batches: must be at least 1",
        ),
        ("--validation-batches 2", "--validate-every"),
        (
            "--validate-every 2 --world-size 2 --reduce partial:1",
            "--validate-every: not with --reduce partial:K",
        ),
    ];
    for (extra, expected) in cases {
        let refused = run(&words(&format!("--model mlp --iterations 2 {extra}")));
        assert_eq!(
            refused.output.status.code(),
            Some(2),
            "{extra}: {}",
            refused.stderr()
        );
        assert!(
            refused.stderr().contains(expected),
            "{extra}: {}",
            refused.stderr()
        );
    }
}

/// A run resumed where a pass was due runs that pass before training (a rank stopped by SIGTERM
/// writes its checkpoint, and stops, before the pass of its iteration): the figures the run never
/// stopped measured there, bit for bit (the same weights, data and operations in one thread), and
/// then the passes still to come.
#[test]
fn a_resumed_run_makes_the_pass_due_where_it_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let base = args(&words(MLP), &["--validate-every", "2"]);
    let whole = run_ok(&crate::distributed::with_value(&base, "--iterations", "6"));
    let stopped = args(
        &crate::distributed::with_value(&base, "--iterations", "4"),
        &["--checkpoint-dir", ckpt.to_str().unwrap()],
    );
    run_ok(&stopped);
    let resumed = run_ok(&args(
        &crate::distributed::with_value(&stopped, "--iterations", "6"),
        &["--resume"],
    ));
    let whole = whole.validations();
    let resumed = resumed.validations();
    assert_eq!(whole.iter().map(|p| p.iteration).collect::<Vec<_>>(), [1, 3, 5]);
    assert_eq!(resumed.iter().map(|p| p.iteration).collect::<Vec<_>>(), [3, 5]);
    for (ours, theirs) in resumed.iter().zip(&whole[1..]) {
        assert_eq!(ours.figures, theirs.figures);
    }
}

/// A pass changes nothing: a resnet50 trains to the same losses, bit for bit, with a pass after
/// every iteration as without any, and its last pass measures what a lone pass at the end does
/// (batch norm's running statistics, which a pass reads, are not updated by the passes before).
#[test]
fn a_pass_leaves_training_and_later_passes_as_they_were() {
    let resnet = "--model resnet50 --image-size 32 --batch-size 4 --threads 1 --iterations 3";
    let every = |n: &str| {
        run_ok(&args(
            &words(resnet),
            &["--validate-every", n, "--validation-batches", "1"],
        ))
    };
    let (each, last) = (every("1"), every("3"));
    assert_eq!(each.validations().len(), 3);
    assert_eq!(last.validations().len(), 1);
    assert_eq!(each.losses(), run_ok(&words(resnet)).losses());
    assert_eq!(each.validations()[2].figures, last.validations()[0].figures);
}
