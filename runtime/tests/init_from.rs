//! Weights from PyTorch (`--init-from`): PyTorch's reference models (fixtures/init_from/
//! reference.py, run here with the torch venv's python) save random weights with `torch.save`
//! and compute an output and loss on a fixed input; the runtime, given the same file and input,
//! computes the same, for resnet50 and vgg16 (torchvision's layouts) and the BERT-style
//! transformer; the weights reach every split, and files that do not fit are refused by name.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

use crate::util::{run, run_ranks, runtime};

/// The reference's sizes (reference.py's IMAGE, CLASSES, BERT), as runtime flags.
const MODELS: [(&str, &[&str]); 3] = [
    ("resnet50", &["--image-size", "32", "--num-classes", "10"]),
    ("vgg16", &["--image-size", "32", "--num-classes", "10"]),
    ("transformer", &TRANSFORMER),
];

/// reference.py's BERT: 2 layers of 64 wide with 4 heads, 16 tokens of 100.
const TRANSFORMER: [&str; 10] = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq-len",
    "16",
    "--vocab-size",
    "100",
];

/// The torch venv's python: `STAGEHAND_TORCH_VENV` (scripts/env.sh sets it), else the venv whose
/// libtorch the runtime loads (`runtime info`'s `torch_lib`, inside it).
fn python() -> PathBuf {
    if let Ok(venv) = std::env::var("STAGEHAND_TORCH_VENV") {
        return Path::new(&venv).join("bin/python");
    }
    let info = runtime().arg("info").output().unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let torch_lib = PathBuf::from(info["torch_lib"].as_str().unwrap());
    torch_lib
        .ancestors()
        .map(|dir| dir.join("bin/python"))
        .find(|python| python.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no torch venv around {}; run scripts/setup.sh",
                torch_lib.display()
            )
        })
}

/// The fixtures, generated once per test process into a temporary folder.
fn fixtures() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/init_from/reference.py");
        let python = python();
        let out = std::process::Command::new(&python)
            .arg(&script)
            .arg(dir.path())
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (scripts/setup.sh makes the torch venv)",
                    python.display()
                )
            });
        assert!(
            out.status.success(),
            "reference.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = dir.path().to_path_buf();
        (dir, path)
    })
    .1
}

fn model_args<'a>(name: &'a str, sizes: &[&'a str]) -> Vec<&'a str> {
    [&["--model", name][..], sizes].concat()
}

/// `runtime forward` of `model` with `weights` on the fixture input: (output, loss).
fn forward(model: &str, sizes: &[&str], weights: &Path, out: &Path) -> (Tensor, f64) {
    let output = runtime()
        .arg("forward")
        .args(model_args(model, sizes))
        .args(["--threads", "1", "--init-from"])
        .arg(weights)
        .arg("--input")
        .arg(fixtures().join(format!("{model}.data.pt")))
        .arg("-o")
        .arg(out)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{model}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let named = Tensor::read_safetensors(out).unwrap();
    let get = |n: &str| named.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    (get("output"), get("loss").double_value(&[0]))
}

/// PyTorch's output and loss (`<model>.expected.json`).
fn expected(model: &str) -> (Tensor, f64) {
    let text = std::fs::read_to_string(fixtures().join(format!("{model}.expected.json"))).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shape: Vec<i64> = v["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_i64().unwrap())
        .collect();
    let values: Vec<f32> = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    (
        Tensor::from_slice(&values).reshape(shape),
        v["loss"].as_f64().unwrap(),
    )
}

#[test]
fn each_models_output_and_loss_equal_pytorchs_on_the_same_weights() {
    let tmp = tempfile::tempdir().unwrap();
    for (model, sizes) in MODELS {
        let weights = fixtures().join(format!("{model}.pt"));
        let (output, loss) = forward(model, sizes, &weights, &tmp.path().join(format!("{model}.out")));
        let (reference, reference_loss) = expected(model);
        assert_eq!(output.size(), reference.size(), "{model}");
        // Both run libtorch's kernels on one thread, so most sums are formed in the same order;
        // where the two compute a step differently (the runtime's fused attention against
        // softmax(QK^T/sqrt(d))V, in-place ReLUs) results differ by float32 rounding: a few ulps
        // (2^-24 relative) per operation, grown through a few hundred operations, well under
        // 1e-4 of the outputs' scale. A tensor loaded under the wrong name, or left at its seeded
        // value, moves outputs by their whole scale (every value here is random).
        let scale = reference.abs().max().double_value(&[]).max(1.0);
        let diff = (&output - &reference).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-4 * scale,
            "{model}: outputs differ by {diff} (scale {scale})"
        );
        assert!(
            (loss - reference_loss).abs() <= 1e-4 * reference_loss.abs().max(1.0),
            "{model}: loss {loss} vs PyTorch's {reference_loss}"
        );
    }
}

#[test]
fn every_split_takes_its_own_modules_and_a_safetensors_copy_loads_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, sizes) = MODELS[0];
    let weights = fixtures().join(format!("{model}.pt"));
    let w = weights.to_str().unwrap();
    // Trained zero iterations from the file, the saved parameters are a safetensors state dict
    // of the same values: the forward from it is the forward from the .pt, bit for bit.
    let saved = tmp.path().join("saved");
    let base: Vec<&str> = [
        &model_args(model, sizes)[..],
        &["--batch-size", "4", "--threads", "1", "--init-from", w],
    ]
    .concat();
    let once = run(&[
        &base[..],
        &["--iterations", "0", "--save-params", saved.to_str().unwrap()],
    ]
    .concat());
    assert!(once.output.status.success(), "{}", once.stderr());
    let copy = saved.join("rank-0.safetensors");
    let (a, _) = forward(model, sizes, &weights, &tmp.path().join("a"));
    let (b, _) = forward(model, sizes, &copy, &tmp.path().join("b"));
    assert!(a.equal(&b), "the safetensors copy gives another output");

    // Two stages, each rank loading only its modules, train their first iteration on the
    // loss one rank gets from the same file.
    let config = tmp.path().join("stages.json");
    // resnet50's 21 modules (conv1, maxpool, 16 blocks, avgpool, fc, the loss), cut after layer2.
    let map: Vec<usize> = (0..21).map(|m| usize::from(m >= 9)).collect();
    std::fs::write(
        &config,
        serde_json::json!({"module_to_stage_map": map, "stage_to_rank_map": {"0": [0], "1": [1]}})
            .to_string(),
    )
    .unwrap();
    let train = [
        &base[..],
        &["--iterations", "1", "--microbatches", "2", "--lr", "0.001"],
    ]
    .concat();
    let single = run(&train);
    assert!(single.output.status.success(), "{}", single.stderr());
    let split = run_ranks(
        2,
        &[
            &train[..],
            &["--stage-config", config.to_str().unwrap(), "--schedule", "gpipe"],
        ]
        .concat(),
        std::time::Duration::from_secs(120),
    );
    for r in &split {
        assert!(r.output.status.success(), "{}", r.stderr());
    }
    let taken = |stderr: &str| -> usize {
        let line = stderr
            .lines()
            .find(|l| l.contains("parameters and buffers from"))
            .unwrap_or_else(|| panic!("{stderr}"));
        line.split_whitespace()
            .find_map(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("{line}"))
    };
    let (r0, r1, all) = (
        taken(&split[0].stderr()),
        taken(&split[1].stderr()),
        taken(&single.stderr()),
    );
    assert!(r0 > 0 && r1 > 0 && r0 + r1 == all, "{r0} + {r1} of {all}");
    assert_eq!(split[1].losses(), single.losses(), "the split's first loss");
}

#[test]
fn weights_that_do_not_fit_are_refused_naming_the_file_and_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join("junk.pt");
    std::fs::write(&junk, "not weights").unwrap();
    // A safetensors header naming 16 bytes of data, and none after it: a file cut short.
    let cut = tmp.path().join("cut.safetensors");
    let header = r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    std::fs::write(&cut, bytes).unwrap();
    let resnet = fixtures().join("resnet50.pt");
    let vgg = fixtures().join("vgg16.pt");
    let bert = fixtures().join("transformer.pt");
    let mut three_layers = [&["--model", "transformer"][..], &TRANSFORMER[..]].concat();
    let layers = three_layers.iter().position(|a| *a == "--layers").unwrap() + 1;
    three_layers[layers] = "3";
    let cases: [(Vec<&str>, &Path, &str); 5] = [
        // Ten classes saved, five asked for.
        (
            vec!["--model", "vgg16", "--image-size", "32", "--num-classes", "5"],
            &vgg,
            "`classifier.6.bias` has shape [10], the model's has [5]",
        ),
        // Two layers saved, three asked for.
        (three_layers, &bert, "no tensor `encoder.layer.2."),
        (
            vec!["--model", "vgg16", "--image-size", "32", "--num-classes", "10"],
            &resnet,
            "none of its 320 tensors is named as this model's",
        ),
        (
            vec!["--model", "mlp"],
            &junk,
            "neither a torch.save state dict nor a safetensors file",
        ),
        (
            vec!["--model", "mlp"],
            &cut,
            "it is cut short (its header names more bytes than the file holds)",
        ),
    ];
    for (args, file, expected) in cases {
        let out = run(&[
            &args[..],
            &["--iterations", "1", "--init-from", file.to_str().unwrap()],
        ]
        .concat());
        let stderr = out.stderr();
        assert_eq!(out.output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(expected), "{expected}: {stderr}");
        assert!(
            stderr.contains(file.to_str().unwrap()),
            "names the file: {stderr}"
        );
    }
    // `runtime forward` with inputs lacking what it reads: a bad argument too.
    let inputs = tmp.path().join("inputs.safetensors");
    Tensor::write_safetensors(&[("x", &Tensor::zeros([1], (Kind::Float, Device::Cpu)))], &inputs).unwrap();
    let out = runtime()
        .args([
            "forward",
            "--model",
            "vgg16",
            "--image-size",
            "32",
            "--num-classes",
            "10",
            "--init-from",
        ])
        .arg(&vgg)
        .arg("--input")
        .arg(&inputs)
        .arg("-o")
        .arg(tmp.path().join("out.safetensors"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("no tensor `input`; it needs `input` and `target`"),
        "{stderr}"
    );
}
