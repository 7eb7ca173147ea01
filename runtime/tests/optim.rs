//! The optimizer flags end to end: every optimizer trains a model, and impossible combinations
//! are refused before training. (The update rules themselves are checked against torch.optim by
//! the unit tests in src/stage/optim/.)

use crate::util::{run, run_ok};

fn mlp_losses(optimizer_args: &[&str]) -> (String, Vec<f64>) {
    let mut args = vec![
        "--model",
        "mlp",
        "--batch-size",
        "8",
        "--iterations",
        "8",
        "--threads",
        "1",
        "--seed",
        "1",
    ];
    args.extend_from_slice(optimizer_args);
    let run = run_ok(&args);
    (run.start().config.optimizer.clone(), run.losses())
}

#[test]
fn every_optimizer_trains() {
    for (args, name) in [
        (
            &["--optimizer", "sgd", "--lr", "0.01", "--weight-decay", "0.001"][..],
            "sgd",
        ),
        (&["--optimizer", "sgd", "--lr", "0.01", "--nesterov"][..], "sgd"),
        (
            &["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0"][..],
            "sgd",
        ),
        (
            &["--optimizer", "adam", "--lr", "0.001", "--weight-decay", "0.01"][..],
            "adam",
        ),
        (
            &["--optimizer", "adamw", "--lr", "0.001", "--weight-decay", "0.01"][..],
            "adamw",
        ),
    ] {
        let (reported, losses) = mlp_losses(args);
        assert_eq!(reported, name, "{args:?}");
        // Synthetic data cycles 4 batches: the second pass over them has a lower mean loss.
        let first: f64 = losses[..4].iter().sum::<f64>() / 4.0;
        let last: f64 = losses[4..].iter().sum::<f64>() / 4.0;
        assert!(last < first, "{args:?}: loss did not fall: {losses:?}");
    }
}

#[test]
fn impossible_optimizer_flags_are_refused() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--nesterov", "--momentum", "0"],
            "--nesterov: needs a --momentum above 0",
        ),
        (
            &["--optimizer", "adam", "--nesterov"],
            "--nesterov: applies to --optimizer sgd only",
        ),
        (
            &["--momentum=-0.5"],
            "--momentum: -0.5 is not a number of at least 0",
        ),
        (
            &["--weight-decay=-1"],
            "--weight-decay: -1 is not a number of at least 0",
        ),
        (
            &["--optimizer", "adam-w"],
            "invalid value 'adam-w' for '--optimizer",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["--model", "mlp"];
        args.extend_from_slice(extra);
        let out = run(&args);
        let stderr = out.stderr();
        assert_eq!(out.output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: {stderr:?} lacks {expected:?}"
        );
        assert!(out.events.is_empty(), "{args:?}: no metrics on a bad argument");
    }
}
