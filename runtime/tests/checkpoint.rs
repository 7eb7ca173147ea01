//! Checkpoints that resume exactly: a run stopped after a checkpoint and resumed gives the
//! losses and final parameters of a run never stopped, bit for bit (the same operations on the
//! same numbers in the same order: nothing here is a tolerance), in one process and as a
//! pipeline; a checkpoint of another run is refused with what differs.

use std::path::Path;
use std::time::Duration;

use crate::util::{assert_same_params, run, run_ok, run_ranks, write_image_folder, Run};

const LIMIT: Duration = Duration::from_secs(120);

/// The MLP with momentum (state that must survive) for `iterations`, one thread, fixed seed.
fn mlp(iterations: &str, extra: &[&str]) -> Vec<String> {
    // Another model's flags (`--model`, its sizes) replace the MLP's.
    let base = if extra.contains(&"--model") {
        "--batch-size 16 --threads 1 --seed 3 --lr 0.05"
    } else {
        "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --threads 1 --seed 3 --lr 0.05"
    };
    let mut args: Vec<String> = base.split_whitespace().map(String::from).collect();
    args.extend(["--iterations".to_string(), iterations.to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A small transformer with dropout, whose masks a resumed run must draw as the run never
/// stopped did.
const DROPOUT_TRANSFORMER: [&str; 14] = [
    "--model",
    "transformer",
    "--layers",
    "2",
    "--heads",
    "2",
    "--hidden",
    "32",
    "--seq-len",
    "8",
    "--vocab-size",
    "50",
    "--dropout",
    "0.3",
];

/// Two stages of three modules, one rank each.
const PIPELINE: &str = r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0], "1": [1]}}"#;
/// The same with the first stage replicated on two ranks.
const HYBRID: &str =
    r#"{"module_to_stage_map": [0,0,0,1,1,1], "stage_to_rank_map": {"0": [0, 1], "1": [2]}}"#;

/// A test's scratch folder holding the stage config `map`, and the paths of what its runs write.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new(map: &str) -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("stages.json"), map).unwrap();
        Scratch { dir }
    }

    /// `name` in the folder.
    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    /// `name` in the folder, as an argument.
    fn arg(&self, name: &str) -> String {
        self.path(name).to_str().unwrap().to_string()
    }
}

impl Scratch {
    /// Two ranks of its stage config, 1F1B with 4 microbatches, training the MLP for
    /// `iterations` with `extra`.
    fn pipeline(&self, iterations: &str, extra: &[&str]) -> Vec<Run> {
        let config = self.arg("stages.json");
        let pipeline = [
            "--stage-config",
            &config,
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
        ];
        run_ranks(
            2,
            &strs(&mlp(iterations, &[&pipeline[..], extra].concat())),
            LIMIT,
        )
    }
}

/// What the pipeline resume tests start from: a run of 6 iterations never stopped (its
/// parameters in `whole`, its losses returned) and one of 4 that checkpointed every 2 in `ckpt`.
fn checkpointed_every_two_up_to_4() -> (Scratch, Vec<f64>) {
    let scratch = Scratch::new(PIPELINE);
    let never_stopped = all_succeeded(&scratch.pipeline("6", &["--save-params", &scratch.arg("whole")]));
    let every_two = [
        "--checkpoint-dir",
        &scratch.arg("ckpt"),
        "--checkpoint-every",
        "2",
    ];
    all_succeeded(&scratch.pipeline("4", &every_two));
    (scratch, never_stopped)
}

/// The last stage's losses, once every rank has succeeded.
fn all_succeeded(runs: &[Run]) -> Vec<f64> {
    for run in runs {
        assert!(run.output.status.success(), "{}", run.stderr());
    }
    runs[1].losses()
}

/// The iterations of the checkpoint folders rank `rank` holds, ascending.
fn held(ckpt: &Path, rank: usize) -> Vec<u64> {
    let mut held: Vec<u64> = std::fs::read_dir(ckpt.join(format!("rank-{rank}")))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_prefix("iter-").and_then(|k| k.parse().ok())
        })
        .collect();
    held.sort_unstable();
    held
}

#[test]
fn a_resumed_run_continues_exactly_where_the_checkpoint_left_it() {
    // Adam on a transformer with dropout: its masks are drawn afresh each iteration from the
    // run's seed, so the resumed run draws the ones the uninterrupted run drew.
    let transformer = [&["adam"][..], &DROPOUT_TRANSFORMER].concat();
    // A convolutional model in channels_last: its momentum buffers are restored in its
    // parameters' layout, which the fused kernels need.
    let channels_last = [
        "sgd",
        "--model",
        "vgg16",
        "--image-size",
        "32",
        "--num-classes",
        "10",
        "--channels-last",
    ];
    for optimizer in [&["sgd"][..], &transformer[..], &channels_last] {
        let tmp = tempfile::tempdir().unwrap();
        let (whole, resumed) = (tmp.path().join("whole"), tmp.path().join("resumed"));
        let ckpt = tmp.path().join("ckpt");
        let (w, r, c) = (
            whole.to_str().unwrap(),
            resumed.to_str().unwrap(),
            ckpt.to_str().unwrap(),
        );
        fn with<'a>(optimizer: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
            [&["--optimizer"][..], optimizer, extra].concat()
        }
        let never_stopped = run_ok(&strs(&mlp("6", &with(optimizer, &["--save-params", w])))).losses();
        // Stopped after 3 iterations (its checkpoint written at the end), then resumed to 6.
        let first = run_ok(&strs(&mlp("3", &with(optimizer, &["--checkpoint-dir", c]))));
        assert_eq!(first.losses(), never_stopped[..3], "{optimizer:?}");
        assert!(ckpt.join("rank-0/latest").is_file());
        let second = run_ok(&strs(&mlp(
            "6",
            &with(
                optimizer,
                &["--checkpoint-dir", c, "--resume", "--save-params", r],
            ),
        )));
        let iterations: Vec<u64> = second.iterations().iter().map(|i| i.iteration).collect();
        assert_eq!(
            iterations,
            [3, 4, 5],
            "{optimizer:?}: it runs the iterations left"
        );
        assert_eq!(second.losses(), never_stopped[3..], "{optimizer:?}");
        assert_same_params(&whole, &resumed, "resumed");
        // The checkpoint moved on to the end, the one it resumed from kept beside it.
        assert_eq!(held(&ckpt, 0), [3, 6], "{optimizer:?}");
    }
}

/// A run on an image folder resumes on the batches it stopped before: the resumed run passes
/// over those the first took (decoding none), so its images, random crops and mirrors included,
/// and its losses are those of a run never stopped.
#[test]
fn an_image_folder_run_resumes_on_the_batches_it_stopped_before() {
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    write_image_folder(&images, 3, 4);
    let (whole, resumed, ckpt) = (
        tmp.path().join("whole"),
        tmp.path().join("resumed"),
        tmp.path().join("ckpt"),
    );
    let arg = |p: &Path| p.to_str().unwrap().to_string();
    let data = [
        "--data".to_string(),
        arg(&images),
        "--data-workers".into(),
        "2".into(),
    ];
    let with = |extra: &[String]| [&data[..], extra].concat();
    let never_stopped = run_ok(&strs(&mlp(
        "6",
        &strs(&with(&["--save-params".into(), arg(&whole)])),
    )))
    .losses();
    let first = run_ok(&strs(&mlp(
        "3",
        &strs(&with(&["--checkpoint-dir".into(), arg(&ckpt)])),
    )));
    assert_eq!(first.losses(), never_stopped[..3]);
    let resume = with(&[
        "--checkpoint-dir".into(),
        arg(&ckpt),
        "--resume".into(),
        "--save-params".into(),
        arg(&resumed),
    ]);
    let second = run_ok(&strs(&mlp("6", &strs(&resume))));
    assert_eq!(
        second.losses(),
        never_stopped[3..],
        "the resumed run's batches are the ones it stopped before"
    );
    assert_same_params(&whole, &resumed, "resumed");
}

#[test]
fn a_pipeline_and_a_hybrid_resume_exactly_on_every_rank() {
    // Replicas of a transformer with dropout: each rank draws its masks afresh from its own seed
    // at its first microbatch of each iteration (the second replica's is not the iteration's
    // first), so the resumed run draws the ones the run never stopped drew.
    for (name, world, map) in [
        ("pipeline", 2, Some(PIPELINE)),
        ("hybrid", 3, Some(HYBRID)),
        ("replicas with dropout", 2, None),
    ] {
        let scratch = Scratch::new(map.unwrap_or("{}"));
        let [w, r, c, s] = &["whole", "resumed", "ckpt", "stages.json"].map(|name| scratch.arg(name));
        let pipeline: Vec<&str> = match map {
            Some(_) => vec!["--stage-config", s, "--schedule", "1f1b", "--microbatches", "4"],
            None => DROPOUT_TRANSFORMER.to_vec(),
        };
        let last = |runs: &[Run]| -> Vec<f64> {
            for run in runs {
                assert!(run.output.status.success(), "{name}: {}", run.stderr());
            }
            runs[world - 1].losses()
        };
        let never_stopped = last(&run_ranks(
            world,
            &strs(&mlp("6", &[&pipeline[..], &["--save-params", w]].concat())),
            LIMIT,
        ));
        // Checkpoints every 2 iterations; stopped after 4.
        let first = run_ranks(
            world,
            &strs(&mlp(
                "4",
                &[&pipeline[..], &["--checkpoint-dir", c, "--checkpoint-every", "2"]].concat(),
            )),
            LIMIT,
        );
        assert_eq!(last(&first), never_stopped[..4], "{name}");
        let second = run_ranks(
            world,
            &strs(&mlp(
                "6",
                &[
                    &pipeline[..],
                    &["--checkpoint-dir", c, "--resume", "--save-params", r],
                ]
                .concat(),
            )),
            LIMIT,
        );
        assert_eq!(last(&second), never_stopped[4..], "{name}");
        assert_same_params(&scratch.path("whole"), &scratch.path("resumed"), "resumed");
    }
}

/// What a rank killed while writing the checkpoint of iteration 4 leaves: `latest` still naming
/// the one of iteration 2, and a folder `iter-4` without its description, its optimizer state cut
/// short.
fn killed_while_writing_4(rank_dir: &Path) {
    let description = std::fs::read(rank_dir.join("iter-2/checkpoint.json")).unwrap();
    std::fs::write(rank_dir.join("latest"), description).unwrap();
    std::fs::remove_file(rank_dir.join("iter-4/checkpoint.json")).unwrap();
    let state = rank_dir.join("iter-4/optimizer.safetensors");
    let bytes = std::fs::read(&state).unwrap();
    std::fs::write(&state, &bytes[..bytes.len() / 2]).unwrap();
}

/// Ranks checkpoint one after another, so one killed while writing may be a checkpoint behind
/// the others. Each keeps the one before its latest; resuming, the ranks agree on the newest
/// iteration every rank holds, those ahead step back to it, and the run goes on exactly as one
/// never stopped. Under `--resume=auto`, a rank killed while writing its first leaves none, and
/// every rank starts afresh; under `--resume`, ranks with no iteration in common are refused,
/// with what each holds.
#[test]
fn ranks_a_checkpoint_apart_resume_from_the_newest_iteration_all_of_them_hold() {
    let (scratch, never_stopped) = checkpointed_every_two_up_to_4();
    let [whole, resumed, ckpt] = ["whole", "resumed", "ckpt"].map(|name| scratch.path(name));
    let [r, c] = &["resumed", "ckpt"].map(|name| scratch.arg(name));
    let ranks = |iterations: &str, extra: &[&str]| scratch.pipeline(iterations, extra);
    let ok = all_succeeded;
    let every_two = ["--checkpoint-dir", c, "--checkpoint-every", "2"];
    assert_eq!(held(&ckpt, 0), [2, 4], "the one before the latest stays");
    killed_while_writing_4(&ckpt.join("rank-1"));

    let second = ranks("6", &[&every_two[..], &["--resume", "--save-params", r]].concat());
    assert_eq!(ok(&second), never_stopped[2..], "from iteration 2, exactly");
    let said = second[0].stderr();
    assert!(said.contains("resuming from iteration 2"), "{said}");
    assert_same_params(&whole, &resumed, "resumed a checkpoint back");
    for rank in 0..2 {
        assert_eq!(held(&ckpt, rank), [4, 6], "rank {rank} wrote 4 and 6 anew");
    }

    // Nothing in common: rank 0 holds 4 and 6, rank 1 only 2 (and, written before two were
    // kept, names no previous one).
    std::fs::remove_dir_all(ckpt.join("rank-1")).unwrap();
    let only_2 = scratch.path("only-2");
    let c2 = only_2.to_str().unwrap();
    ok(&ranks("2", &["--checkpoint-dir", c2]));
    std::fs::rename(only_2.join("rank-1"), ckpt.join("rank-1")).unwrap();
    let refused = ranks("8", &[&every_two[..], &["--resume"]].concat());
    for run in &refused {
        assert!(!run.output.status.success());
    }
    let said = refused[0].stderr();
    assert!(
        said.contains(
            "no iteration has a checkpoint on every rank (iterations held: rank 0 6 and 4, rank 1 2)"
        ),
        "{said}"
    );

    // `--resume=auto` with a rank that holds none: every rank starts afresh, and the one that
    // held a checkpoint sets it aside.
    std::fs::remove_dir_all(ckpt.join("rank-1")).unwrap();
    let afresh = ranks("7", &["--checkpoint-dir", c, "--resume=auto"]);
    assert_eq!(ok(&afresh)[..6], never_stopped);
    assert!(
        afresh[0].stderr().contains("every rank starts afresh"),
        "{}",
        afresh[0].stderr()
    );
    assert_eq!(
        held(&ckpt, 0),
        [7],
        "rank 0's earlier checkpoints went at its first"
    );

    // A run without --resume sets aside what the folder holds, and says so.
    let again = ranks("1", &["--checkpoint-dir", c]);
    ok(&again);
    assert!(
        again[0].stderr().contains("the checkpoint of iteration 7 in"),
        "{}",
        again[0].stderr()
    );
    assert_eq!(held(&ckpt, 0), [1]);
}

/// Flips one bit in the middle of `path`: damage of the kind a disk or a copy does, which leaves
/// the file's length, and safetensors' header, as they were.
fn flip_a_bit(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let middle = bytes.len() - bytes.len() / 4;
    bytes[middle] ^= 0x10;
    std::fs::write(path, bytes).unwrap();
}

/// A checkpoint whose files are not as written (each file's length and CRC-32 are in its
/// description) is never loaded: the rank that holds it offers the one before it, the ranks
/// agree on that, and the run goes on exactly as one never stopped; with nothing whole to offer,
/// the resume is refused saying which file is damaged and how.
#[test]
fn a_damaged_checkpoint_is_passed_over_for_the_one_before_it_and_never_loaded() {
    let (scratch, never_stopped) = checkpointed_every_two_up_to_4();
    let [whole, resumed, ckpt] = ["whole", "resumed", "ckpt"].map(|name| scratch.path(name));
    let [r, c] = &["resumed", "ckpt"].map(|name| scratch.arg(name));
    let ranks = |iterations: &str, extra: &[&str]| scratch.pipeline(iterations, extra);
    let ok = all_succeeded;
    let every_two = ["--checkpoint-dir", c, "--checkpoint-every", "2"];
    let params_4 = ckpt.join("rank-1/iter-4/params.safetensors");
    flip_a_bit(&params_4);

    let second = ranks("6", &[&every_two[..], &["--resume", "--save-params", r]].concat());
    assert_eq!(ok(&second), never_stopped[2..], "from iteration 2, exactly");
    assert_same_params(&whole, &resumed, "resumed past a damaged checkpoint");
    let said = second[1].stderr();
    assert!(
        said.contains("the checkpoint of iteration 4 is damaged")
            && said.contains("holds other bytes than were written")
            && said.contains("params.safetensors")
            && said.contains("resumes from the one before it, of iteration 2"),
        "{said}"
    );
    for rank in 0..2 {
        assert_eq!(held(&ckpt, rank), [4, 6], "rank {rank} wrote 4 and 6 anew");
    }

    // Both of rank 0's damaged (one cut short, one changed): refused, naming both.
    let state_6 = ckpt.join("rank-0/iter-6/optimizer.safetensors");
    let bytes = std::fs::read(&state_6).unwrap();
    std::fs::write(&state_6, &bytes[..bytes.len() - 1]).unwrap();
    flip_a_bit(&ckpt.join("rank-0/iter-4/params.safetensors"));
    let refused = ranks("8", &[&every_two[..], &["--resume"]].concat());
    for run in &refused {
        assert!(!run.output.status.success(), "{}", run.stderr());
        assert!(run.events.is_empty(), "nothing trained: {}", run.stderr());
    }
    let said = refused[0].stderr();
    let bytes = bytes.len();
    assert!(
        said.contains("rank 0's checkpoint of iteration 6 is damaged")
            && said.contains(&format!("is {} bytes, {bytes} when it was written", bytes - 1))
            && said.contains("and so is the one before it, of iteration 4")
            && said.contains("start afresh without --resume"),
        "{said}"
    );
    let said = refused[1].stderr();
    assert!(
        said.contains("rank 0 none whole (its log says what is damaged), rank 1 6 and 4"),
        "{said}"
    );
    assert_eq!(held(&ckpt, 0), [4, 6], "a refused resume removes nothing");
}

/// `--resume=auto`: an empty folder starts afresh (the losses of a run without it), a folder with
/// a checkpoint goes on from there exactly, and one of another run is still refused.
#[test]
fn resume_auto_starts_afresh_or_goes_on_from_the_checkpoint_there() {
    let tmp = tempfile::tempdir().unwrap();
    let c = tmp.path().join("ckpt");
    let c = c.to_str().unwrap();
    let whole = run_ok(&strs(&mlp("5", &[])));
    let first = run_ok(&strs(&mlp("3", &["--checkpoint-dir", c, "--resume=auto"])));
    assert_eq!(first.losses(), whole.losses()[..3], "started afresh");
    let rest = run_ok(&strs(&mlp("5", &["--checkpoint-dir", c, "--resume=auto"])));
    let iterations: Vec<u64> = rest.iterations().iter().map(|i| i.iteration).collect();
    assert_eq!(iterations, [3, 4], "went on from the checkpoint of 3 iterations");
    assert!(
        rest.stderr().contains(&format!(
            "runtime: resuming from the checkpoint of iteration 3 in {c}: iterations 3 to 4 run"
        )),
        "says so: {}",
        rest.stderr()
    );
    assert_eq!(
        rest.losses(),
        whole.losses()[3..],
        "exactly as the run never stopped"
    );
    let other = run(&strs(&mlp(
        "6",
        &["--checkpoint-dir", c, "--resume=auto", "--optimizer", "adam"],
    )));
    assert!(!other.output.status.success());
    assert!(other.stderr().contains("is of another run"), "{}", other.stderr());
}

/// The iteration lines say after which iterations a whole checkpoint was written (every
/// `--checkpoint-every` and after the last), which is what a driver restarting the ranks
/// resumes from; a run without checkpoints says nothing of them.
#[test]
fn each_iteration_that_checkpointed_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let c = tmp.path().join("ckpt");
    let c = c.to_str().unwrap();
    let checkpointed = |run: &Run| -> Vec<u64> {
        run.iterations()
            .iter()
            .filter(|i| i.checkpointed)
            .map(|i| i.iteration)
            .collect()
    };
    let every_two = run_ok(&strs(&mlp(
        "5",
        &["--checkpoint-dir", c, "--checkpoint-every", "2"],
    )));
    assert_eq!(checkpointed(&every_two), [1, 3, 4]);
    assert!(tmp.path().join("ckpt/rank-0/iter-5").is_dir());
    assert!(checkpointed(&run_ok(&strs(&mlp("3", &[])))).is_empty());
}

#[test]
fn a_checkpoint_of_another_run_or_none_is_refused_with_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let c = tmp.path().join("ckpt");
    let c = c.to_str().unwrap();
    let refused = |args: &[String], expected: &str| {
        let out = run(&strs(args));
        let stderr = out.stderr();
        assert!(!out.output.status.success(), "{stderr}");
        assert!(out.events.is_empty(), "nothing trained: {stderr}");
        assert!(stderr.contains(expected), "{stderr:?} lacks {expected:?}");
    };
    refused(
        &mlp("3", &["--checkpoint-dir", c, "--resume"]),
        "no checkpoint of rank 0 in",
    );
    run_ok(&strs(&mlp("2", &["--checkpoint-dir", c])));
    // Resumed where it already ends: nothing to run, and it says so.
    let done = run_ok(&strs(&mlp("2", &["--checkpoint-dir", c, "--resume"])));
    assert!(done.iterations().is_empty());
    assert!(
        done.stderr()
            .contains("nothing left to run: the checkpoint it resumed from had done all 2 iterations"),
        "{}",
        done.stderr()
    );
    refused(
        &mlp("3", &["--checkpoint-dir", c, "--resume", "--optimizer", "adam"]),
        "is of another run: optimizer is \"sgd\" there, \"adam\" here",
    );
    refused(
        &mlp("1", &["--checkpoint-dir", c, "--resume"]),
        "--iterations 1 is fewer than the 2 iterations the checkpoint resumed from has done already",
    );
    refused(&mlp("3", &["--resume"]), "--checkpoint-dir");
    // Another size is another model: refused naming the size, as a bad argument (exit 2), where
    // loading the parameters would have failed on their shapes.
    let with = |from: &str, to: &str| -> Vec<String> {
        let args = mlp("3", &["--checkpoint-dir", c, "--resume"]);
        assert!(args.iter().any(|a| a == from), "{args:?}");
        args.into_iter()
            .map(|a| if a == from { to.to_string() } else { a })
            .collect()
    };
    refused(
        &with("64", "32"),
        "is of another run: --hidden is 64 there, 32 here",
    );
    assert_eq!(run(&strs(&with("64", "32"))).output.status.code(), Some(2));
    // Another rate goes on from the checkpoint, saying so.
    let went_on = run_ok(&strs(&with("0.05", "0.1")));
    assert_eq!(went_on.iterations().len(), 1, "{}", went_on.stderr());
    assert!(
        went_on
            .stderr()
            .contains("warning: resuming with --lr 0.1, where the checkpoint was written with 0.05"),
        "{}",
        went_on.stderr()
    );
}

#[test]
fn fp16_resumes_exactly_with_its_gradient_scaler_and_only_with_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, resumed, ckpt) = (
        tmp.path().join("whole"),
        tmp.path().join("resumed"),
        tmp.path().join("ckpt"),
    );
    let (w, r, c) = (
        whole.to_str().unwrap(),
        resumed.to_str().unwrap(),
        ckpt.to_str().unwrap(),
    );
    let fp16 = ["--precision", "fp16"];
    let never_stopped = run_ok(&strs(&mlp("6", &[&fp16[..], &["--save-params", w]].concat()))).losses();
    let first = run_ok(&strs(&mlp("3", &[&fp16[..], &["--checkpoint-dir", c]].concat())));
    assert_eq!(first.losses(), never_stopped[..3]);
    assert!(ckpt.join("rank-0/iter-3/scaler.safetensors").is_file());
    // Resuming it in fp32 would drop the scale: refused, naming what to give.
    let fp32 = run(&strs(&mlp("6", &["--checkpoint-dir", c, "--resume"])));
    assert!(!fp32.output.status.success());
    assert!(
        fp32.stderr().contains("resume with --precision fp16"),
        "{}",
        fp32.stderr()
    );
    let second = run_ok(&strs(&mlp(
        "6",
        &[
            &fp16[..],
            &["--checkpoint-dir", c, "--resume", "--save-params", r],
        ]
        .concat(),
    )));
    assert_eq!(second.losses(), never_stopped[3..]);
    assert_same_params(&whole, &resumed, "resumed");
}

/// Waits for `child` until `limit`, killing it then; returns its exit code and stderr.
fn finish(child: std::process::Child, limit: Duration) -> (Option<i32>, String) {
    let deadline = std::time::Instant::now() + limit;
    let mut child = child;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn latest_iteration(ckpt: &Path, rank: usize) -> u64 {
    let text = std::fs::read_to_string(ckpt.join(format!("rank-{rank}/latest"))).unwrap();
    let latest: serde_json::Value = serde_json::from_str(&text).unwrap();
    latest["iterations_done"].as_u64().unwrap()
}

#[test]
fn sigterm_to_one_rank_checkpoints_every_rank_at_one_iteration_and_resumes_exactly() {
    use std::io::BufRead;
    let scratch = Scratch::new(PIPELINE);
    let [whole, resumed, ckpt] = ["whole", "resumed", "ckpt"].map(|name| scratch.path(name));
    let [w, r, c, s] = &["whole", "resumed", "ckpt", "stages.json"].map(|name| scratch.arg(name));
    let pipeline = ["--stage-config", s, "--schedule", "1f1b", "--microbatches", "4"];
    // A run far longer than the test: it ends only by the signal.
    let port = crate::util::free_port().to_string();
    let mut children: Vec<std::process::Child> = (0..2)
        .map(|rank| {
            let mut args = mlp("1000000", &[&pipeline[..], &["--checkpoint-dir", c]].concat());
            args.extend(
                [
                    "--world-size",
                    "2",
                    "--rank",
                    &rank.to_string(),
                    "--master-port",
                    &port,
                    "--comm-timeout",
                    "60",
                ]
                .map(String::from),
            );
            crate::util::runtime()
                .args(&args)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Once the last stage has finished three iterations, rank 0 alone gets SIGTERM.
    // The reader keeps draining the rank's output to its end (a closed pipe would end the rank).
    let stdout = children[1].stdout.take().unwrap();
    let (three, trained) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut seen = 0;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains("\"event\":\"iteration\"") {
                seen += 1;
                if seen == 3 {
                    let _ = three.send(());
                }
            }
        }
    });
    assert!(
        trained.recv_timeout(LIMIT).is_ok(),
        "the pipeline trained three iterations"
    );
    let term = std::process::Command::new("kill")
        .args(["-TERM", &children[0].id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let mut ends = Vec::new();
    for child in children {
        ends.push(finish(child, LIMIT));
    }
    reader.join().unwrap();
    for (rank, (code, stderr)) in ends.iter().enumerate() {
        assert_eq!(*code, Some(143), "rank {rank}: {stderr}");
        assert!(
            stderr.contains("stopped by SIGTERM after "),
            "rank {rank}: {stderr}"
        );
    }
    let done = latest_iteration(&ckpt, 0);
    // Numbered as the iteration lines are, from 0.
    let said = match done {
        1 => "iteration 0".to_string(),
        n => format!("iterations 0 to {}", n - 1),
    };
    for (rank, (_, stderr)) in ends.iter().enumerate() {
        assert!(
            stderr.contains(&format!("stopped by SIGTERM after {said}; its checkpoint is in")),
            "rank {rank}: {stderr}"
        );
    }
    assert_eq!(
        latest_iteration(&ckpt, 1),
        done,
        "both ranks checkpointed one iteration"
    );
    assert!(done >= 3, "{done}");

    // Resumed to three iterations more, it equals a run never stopped.
    let total = (done + 3).to_string();
    let last = |runs: Vec<Run>| -> Vec<f64> {
        for run in &runs {
            assert!(run.output.status.success(), "{}", run.stderr());
        }
        runs[1].losses()
    };
    let never_stopped = last(run_ranks(
        2,
        &strs(&mlp(&total, &[&pipeline[..], &["--save-params", w]].concat())),
        LIMIT,
    ));
    let second = last(run_ranks(
        2,
        &strs(&mlp(
            &total,
            &[
                &pipeline[..],
                &["--checkpoint-dir", c, "--resume", "--save-params", r],
            ]
            .concat(),
        )),
        LIMIT,
    ));
    assert_eq!(second, never_stopped[done as usize..]);
    assert_same_params(&whole, &resumed, "resumed");
}

#[test]
fn pipedreams_pipeline_checkpoints_between_drained_segments_and_resumes_exactly() {
    // With checkpoints PipeDream's stream is cut every --checkpoint-every iterations and drained
    // there, so a checkpoint holds no microbatch in flight and no stashed weights; a run that is
    // stopped and resumed replays the same segments as one that is not.
    for (name, world, map) in [("pipeline", 2, PIPELINE), ("hybrid", 3, HYBRID)] {
        let scratch = Scratch::new(map);
        let [whole, resumed] = ["whole", "resumed"].map(|name| scratch.path(name));
        let [w, r, a, b, s] = &["whole", "resumed", "a", "b", "stages.json"].map(|name| scratch.arg(name));
        let pipeline = [
            "--stage-config",
            s,
            "--schedule",
            "pipedream",
            "--microbatches",
            "4",
            "--checkpoint-every",
            "3",
        ];
        let last = |runs: &[Run]| -> Vec<f64> {
            for run in runs {
                assert!(run.output.status.success(), "{name}: {}", run.stderr());
            }
            runs[world - 1].losses()
        };
        let never_stopped = last(&run_ranks(
            world,
            &strs(&mlp(
                "6",
                &[&pipeline[..], &["--checkpoint-dir", a, "--save-params", w]].concat(),
            )),
            LIMIT,
        ));
        let first = run_ranks(
            world,
            &strs(&mlp("3", &[&pipeline[..], &["--checkpoint-dir", b]].concat())),
            LIMIT,
        );
        assert_eq!(last(&first), never_stopped[..3], "{name}");
        let second = run_ranks(
            world,
            &strs(&mlp(
                "6",
                &[
                    &pipeline[..],
                    &["--checkpoint-dir", b, "--resume", "--save-params", r],
                ]
                .concat(),
            )),
            LIMIT,
        );
        assert_eq!(last(&second), never_stopped[3..], "{name}");
        assert_same_params(&whole, &resumed, "resumed");
        let segment = "PipeDream's segment";
        assert!(second.iter().all(|r| !r.stderr().contains(segment)), "{name}");
        // Segments of another length step otherwise from here on: the resume says so.
        let pipeline = [&pipeline[..6], &["--checkpoint-every", "2"]].concat();
        let third = run_ranks(
            world,
            &strs(&mlp(
                "8",
                &[&pipeline[..], &["--checkpoint-dir", b, "--resume"]].concat(),
            )),
            LIMIT,
        );
        last(&third);
        let said = "resuming with PipeDream's segment (from --checkpoint-every and --validate-every) 2, \
                    where the checkpoint was written with 3";
        assert!(
            third.iter().any(|r| r.stderr().contains(said)),
            "{name}: {}",
            third[0].stderr()
        );
    }
}

/// A run started afresh that fails before its first iteration (its data is not there) leaves
/// the earlier run's checkpoint as it was, so `--resume` still goes on from it exactly; a
/// checkpoint folder or `--save-params` folder this run cannot write fails it before its first
/// iteration, not after its last.
#[test]
fn a_run_that_fails_to_start_loses_no_checkpoint_and_an_unwritable_folder_fails_first() {
    let tmp = tempfile::tempdir().unwrap();
    let c = tmp.path().join("ckpt");
    let c = c.to_str().unwrap();
    let whole = run_ok(&strs(&mlp("4", &[])));
    run_ok(&strs(&mlp("2", &["--checkpoint-dir", c])));
    let missing = tmp.path().join("missing");
    let data = format!("cifar10:{}", missing.display());
    let failed = run(&strs(&mlp("4", &["--checkpoint-dir", c, "--data", &data])));
    assert!(!failed.output.status.success(), "{}", failed.stderr());
    assert!(!failed.stderr().contains("set aside"), "{}", failed.stderr());
    let resumed = run_ok(&strs(&mlp("4", &["--checkpoint-dir", c, "--resume"])));
    assert_eq!(resumed.losses(), whole.losses()[2..], "went on from iteration 2");

    // A folder under a file cannot be made, whoever runs the test (root included).
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    // It is a bad argument (exit 2), found by `--check` too.
    for flag in ["--checkpoint-dir", "--save-params"] {
        for folder in [file.clone(), file.join("dir")] {
            let folder = folder.to_str().unwrap();
            for check in [&[][..], &["--check"]] {
                let out = run(&strs(&mlp("3", &[&[flag, folder][..], check].concat())));
                let stderr = out.stderr();
                assert_eq!(
                    out.output.status.code(),
                    Some(2),
                    "{flag} {folder} {check:?}: {stderr}"
                );
                assert!(out.events.is_empty(), "{flag}: trained first: {stderr}");
                let said = format!("{flag}: {} is a file, not a folder", file.display());
                assert!(stderr.contains(&said), "{stderr}");
            }
        }
    }
}

/// A run started afresh where the folder holds another run's checkpoint (another optimizer, here) is
/// refused, by `--check` too, and the checkpoint stays whole: setting it aside would have removed
/// it at this run's first checkpoint. The same run started again afresh still replaces its own.
#[test]
fn starting_afresh_over_another_runs_checkpoint_is_refused_and_it_stays() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let c = ckpt.to_str().unwrap();
    let whole = run_ok(&strs(&mlp("4", &[])));
    run_ok(&strs(&mlp("2", &["--checkpoint-dir", c])));
    for check in [&[][..], &["--check"]] {
        let other = run(&strs(&mlp(
            "3",
            &[&["--checkpoint-dir", c, "--optimizer", "adam"][..], check].concat(),
        )));
        let stderr = other.stderr();
        assert_eq!(other.output.status.code(), Some(2), "{check:?}: {stderr}");
        assert!(other.events.is_empty(), "{check:?}: trained first: {stderr}");
        assert!(
            stderr.contains(&format!(
                "--checkpoint-dir: {c} holds the checkpoint of iteration 2 of another run (optimizer is \"sgd\" there, \"adam\" here)"
            )),
            "{stderr}"
        );
    }
    assert_eq!(held(&ckpt, 0), [2], "the other run's checkpoint stays");
    let resumed = run_ok(&strs(&mlp("4", &["--checkpoint-dir", c, "--resume"])));
    assert_eq!(resumed.losses(), whole.losses()[2..], "went on from iteration 2");

    // The same run again, afresh: its own checkpoint is set aside, as before.
    let again = run_ok(&strs(&mlp("3", &["--checkpoint-dir", c])));
    assert!(again.stderr().contains("is set aside"), "{}", again.stderr());
    assert_eq!(held(&ckpt, 0), [3]);
}

/// A rank whose reader went away (its driver killed outright: the kernel closes its pipes) takes
/// it as SIGTERM where it checkpoints: it stops after the checkpoint of the iteration it is in,
/// exit 143, rather than fail on the broken pipe and lose the iterations since the last one.
#[test]
fn a_rank_whose_output_went_away_stops_after_its_checkpoint() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let c = ckpt.to_str().unwrap();
    let mut child = crate::util::runtime()
        .args(mlp(
            "1000000",
            &["--checkpoint-dir", c, "--checkpoint-every", "1000000"],
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once it has trained, both its pipes' readers go, as a dead driver's do.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let trained = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains("\"event\":\"iteration\""));
    assert!(trained, "no iteration line");
    drop(lines);
    drop(child.stderr.take());
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still running 60 s after its output went away");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(143), "{status:?}");
    let latest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("rank-0/latest")).unwrap()).unwrap();
    assert!(latest["iterations_done"].as_u64().unwrap() >= 1, "{latest}");
}
