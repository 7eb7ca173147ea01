//! One binary for CPUs and GPUs: `runtime info`, CUDA loaded at run time, a clear refusal where
//! CUDA cannot be had, and the GPU tests.
//!
//! The GPU tests run wherever `runtime info` reports a CUDA device. Elsewhere each prints a line
//! starting with `SKIPPED` (see them with `--nocapture`; scripts/test also says so at the end) and
//! checks what can be checked without a GPU.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::util::{run_ok, run_ranks, runtime, trace_events, trace_steps, words};

/// `runtime info`'s line, parsed.
fn info(env: &[(&str, &str)]) -> Value {
    let output = runtime().arg("info").envs(env.iter().copied()).output().unwrap();
    assert!(
        output.status.success(),
        "runtime info failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "one line: {stdout}");
    serde_json::from_str(&stdout).unwrap()
}

/// The number of CUDA devices, or None (after saying so) when this machine has none.
fn gpus(test: &str) -> Option<usize> {
    let info = info(&[]);
    let count = info["cuda_devices"].as_u64().unwrap() as usize;
    if count == 0 {
        eprintln!(
            "SKIPPED {test}: no CUDA device here ({})",
            info["cuda_devices_error"]
                .as_str()
                .or(info["cuda_error"].as_str())
                .unwrap_or("no reason given")
        );
        return None;
    }
    Some(count)
}

#[test]
fn info_says_cuda_and_nccl_are_loaded() {
    let info = info(&[]);
    assert!(info["torch"].as_str().unwrap().starts_with("2."), "{info}");
    if let Ok(expected) = std::env::var("STAGEHAND_TORCH_VERSION") {
        assert_eq!(info["torch"], expected.as_str(), "{info}");
    }
    let devices = info["devices"].as_array().unwrap();
    assert_eq!(
        info["cuda_devices"].as_u64().unwrap() as usize,
        devices.len(),
        "{info}"
    );
    // The Linux x86-64 torch wheels ship libtorch_cuda and NCCL: the runtime built against one
    // must load both, GPU or not.
    if cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        assert_eq!(info["cuda"], true, "{info}");
        assert_eq!(info["nccl"], true, "{info}");
        assert!(info["nccl_version"].as_str().unwrap().starts_with("2."), "{info}");
    }
    if devices.is_empty() {
        assert!(info["cuda_devices_error"].is_string(), "why no device: {info}");
    }
}

/// A copy of libtorch's folder without libtorch_cuda.so (symbolic links), like an image that
/// carries only what libtorch_cpu needs.
fn cpu_only_torch(dir: &Path) -> String {
    let torch_lib = PathBuf::from(info(&[])["torch_lib"].as_str().unwrap());
    let lib = dir.join("lib");
    std::fs::create_dir(&lib).unwrap();
    for entry in std::fs::read_dir(&torch_lib).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "libtorch_cuda.so" {
            std::os::unix::fs::symlink(entry.path(), lib.join(entry.file_name())).unwrap();
        }
    }
    // libtorch_cpu itself needs the CUDA runtime and CUPTI (as the CPU image keeps them).
    let cu13 = torch_lib.join("../../nvidia/cu13/lib");
    format!("{}:{}", lib.display(), cu13.display())
}

#[test]
fn without_libtorch_cuda_the_same_binary_trains_on_the_cpu_and_says_why_not_cuda() {
    let tmp = tempfile::tempdir().unwrap();
    let path = cpu_only_torch(tmp.path());
    let env = [("LD_LIBRARY_PATH", path.as_str())];
    let info = info(&env);
    assert_eq!(
        (info["cuda"].clone(), info["nccl"].clone()),
        (Value::Bool(false), Value::Bool(false)),
        "{info}"
    );
    assert!(
        info["cuda_error"].as_str().unwrap().contains("libtorch_cuda.so"),
        "{info}"
    );
    assert!(
        info["torch_lib"]
            .as_str()
            .unwrap()
            .starts_with(tmp.path().to_str().unwrap()),
        "{info}"
    );

    let cuda = runtime()
        .args(["--model", "mlp", "--device", "cuda", "--iterations", "1"])
        .envs(env)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&cuda.stderr);
    assert_eq!(cuda.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("CUDA is unavailable") && stderr.contains("libtorch_cuda.so"),
        "{stderr}"
    );
    assert!(stderr.contains("use --device cpu"), "{stderr}");

    let cpu = runtime()
        .args([
            "--model",
            "mlp",
            "--layers",
            "2",
            "--hidden",
            "16",
            "--image-size",
            "8",
        ])
        .args(["--batch-size", "8", "--iterations", "2", "--threads", "1"])
        .envs(env)
        .output()
        .unwrap();
    assert!(cpu.status.success(), "{}", String::from_utf8_lossy(&cpu.stderr));
}

#[test]
fn a_cuda_device_that_is_not_there_is_a_bad_argument() {
    let count = info(&[])["cuda_devices"].as_u64().unwrap();
    let device = format!("cuda:{count}");
    for args in [
        vec!["--model", "mlp", "--device", device.as_str()],
        vec!["profile", "--model", "mlp", "--device", device.as_str()],
    ] {
        let out = runtime().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        let sees = match std::env::var_os("CUDA_VISIBLE_DEVICES") {
            Some(_) => "this process sees",
            None => "this machine has",
        };
        assert!(
            stderr.contains(&format!("{device} requested but {sees} {count} CUDA device(s)")),
            "{args:?}: {stderr}"
        );
    }
    // Shown one GPU at most, a process has no cuda:1, and the error says what hid the others.
    let out = runtime()
        .args(["--model", "mlp", "--device", "cuda:1"])
        .env("CUDA_VISIBLE_DEVICES", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("cuda:1 requested but this process sees")
            && stderr.contains("CUDA_VISIBLE_DEVICES=0 shows it those it lists"),
        "{stderr}"
    );
}

#[test]
fn nccl_on_a_cpu_device_is_a_bad_argument() {
    let out = runtime()
        .args(["--model", "mlp", "--backend", "nccl", "--device", "cpu"])
        .args(["--world-size", "2", "--rank", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("nccl needs CUDA tensors"), "{stderr}");
}

/// Small settings of every model, for a few steps on one GPU.
const MODELS: [&str; 4] = [
    "--model mlp --layers 3 --hidden 64 --image-size 16",
    "--model vgg16 --image-size 32 --num-classes 10",
    "--model resnet50 --image-size 32 --num-classes 10",
    "--model transformer --layers 2 --hidden 64 --heads 4 --seq-len 16 --vocab-size 100",
];

#[test]
fn gpu_every_model_trains_and_reports_its_memory() {
    let Some(_) = gpus("gpu_every_model_trains_and_reports_its_memory") else {
        return;
    };
    for model in MODELS {
        let mut args: Vec<&str> = model.split_whitespace().collect();
        args.extend([
            "--device",
            "cuda",
            "--batch-size",
            "8",
            "--iterations",
            "3",
            "--lr",
            "0.01",
        ]);
        let run = run_ok(&args);
        for it in run.iterations() {
            assert!(it.loss.unwrap().is_finite(), "{model}: {it:?}");
            let allocated = it.gpu_peak_allocated_bytes.expect("CUDA figures on CUDA");
            let reserved = it.gpu_peak_reserved_bytes.expect("CUDA figures on CUDA");
            assert!(allocated > 0 && reserved >= allocated, "{model}: {it:?}");
            assert_eq!(it.peak_mem_bytes, Some(allocated), "{model}");
            assert!(it.host_peak_rss_bytes.unwrap() > 0, "{model}");
        }
    }
}

#[test]
fn gpu_cpu_and_cuda_agree_on_the_first_loss() {
    let Some(_) = gpus("gpu_cpu_and_cuda_agree_on_the_first_loss") else {
        return;
    };
    for model in MODELS {
        let base: Vec<&str> = model.split_whitespace().collect();
        let first = |device: &str| {
            let mut args = base.clone();
            args.extend([
                "--device",
                device,
                "--batch-size",
                "8",
                "--iterations",
                "1",
                "--seed",
                "5",
                // Dropout draws its masks from each device's own generator.
                "--dropout",
                "0",
            ]);
            run_ok(&args).losses()[0]
        };
        let (cpu, cuda) = (first("cpu"), first("cuda"));
        // Same parameters and data (made on the CPU from the seed); the kernels differ. Matmuls
        // stay float32 (libtorch leaves TF32 off for them), so the mlp's and the transformer's
        // losses agree to float32 rounding over their depth, well inside 1e-3 relative. cuDNN's
        // convolutions run in TF32 by default (as in PyTorch): each rounds its inputs to 11
        // significant bits (2^-11 relative), and over vgg16's and resnet50's convolutions such
        // errors, in random directions, stay within about 1e-2 of the loss.
        let convolutional = model.contains("vgg16") || model.contains("resnet50");
        let tolerance = if convolutional { 1e-2 } else { 1e-3 };
        assert!(
            (cpu - cuda).abs() <= tolerance * cpu.abs(),
            "{model}: cpu {cpu} vs cuda {cuda}"
        );
    }
}

/// An image folder's batches reach the GPU (pinned by the loader threads, copied without holding
/// up the training thread) as they reach the CPU: the same images, crops and mirrors (drawn on
/// the CPU from the seed), so the first loss agrees to float32 rounding (the mlp's matmuls stay
/// float32 on the GPU), and training goes on.
#[test]
fn gpu_an_image_folder_trains_on_the_gpu_as_on_the_cpu() {
    let Some(_) = gpus("gpu_an_image_folder_trains_on_the_gpu_as_on_the_cpu") else {
        return;
    };
    let folder = tempfile::tempdir().unwrap();
    crate::util::write_image_folder(folder.path(), 3, 4);
    let path = folder.path().to_str().unwrap();
    let losses = |device: &str| {
        let args = format!(
            "--model mlp --image-size 16 --batch-size 8 --iterations 3 --seed 5 --data-workers 2 \
             --device {device} --data"
        );
        run_ok(&[words(&args), vec![path]].concat()).losses()
    };
    let (cpu, cuda) = (losses("cpu"), losses("cuda"));
    assert_eq!(cuda.len(), 3, "{cuda:?}");
    assert!(
        (cpu[0] - cuda[0]).abs() <= 1e-3 * cpu[0].abs(),
        "cpu {cpu:?} vs cuda {cuda:?}"
    );
}

/// `runtime profile --device cuda` measures every module on the GPU (each time taken once the GPU
/// has run the work), in the arithmetic it is given, as on the CPU: float32 activations, or
/// bfloat16 ones (half the bytes) with `--precision bf16 --channels-last`.
#[test]
fn gpu_profile_measures_every_module_on_the_gpu() {
    let Some(_) = gpus("gpu_profile_measures_every_module_on_the_gpu") else {
        return;
    };
    for (arithmetic, bytes) in [("fp32", 4), ("bf16 channels_last", 2)] {
        let mut args = vec!["--device", "cuda"];
        if arithmetic != "fp32" {
            args.extend(["--precision", "bf16", "--channels-last"]);
        }
        let profile = crate::single::profile_resnet50(&args);
        assert_eq!(profile.device, "cuda:0");
        assert_eq!(profile.arithmetic(), arithmetic);
        crate::single::assert_profiled_resnet50(&profile, bytes);
    }
}

/// GPUs that talk through the CPU: two stages on one GPU over Gloo, whose tensors cross through
/// pinned host buffers, train as the same model in one process does.
#[test]
fn gpu_a_gloo_pipeline_on_one_gpu_stages_through_host_memory() {
    let Some(_) = gpus("gpu_a_gloo_pipeline_on_one_gpu_stages_through_host_memory") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let config = crate::util::two_stages(tmp.path());
    let base = "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --iterations 5 --lr 0.05 --seed 3 --device cuda:0";
    let single = run_ok(&base.split_whitespace().collect::<Vec<_>>()).losses();
    let mut args: Vec<&str> = base.split_whitespace().collect();
    let config = config.as_str();
    args.extend([
        "--backend",
        "gloo",
        "--stage-config",
        config,
        "--schedule",
        "1f1b",
        "--microbatches",
        "4",
    ]);
    let runs = run_ranks(2, &args, std::time::Duration::from_secs(120));
    for run in &runs {
        assert!(run.output.status.success(), "{}", run.stderr());
    }
    let last = runs.iter().max_by_key(|r| r.start().stage).unwrap().losses();
    for (a, b) in last.iter().zip(&single) {
        // float32 on one device, summed in another order: far inside 1e-4 relative.
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{last:?} vs {single:?}");
    }
}

/// A validation pass on the GPU measures what it measures on the CPU, and a two-stage pipeline
/// of ranks on the GPU (over Gloo, through host memory) what one process there does: the pass's
/// tallies are summed on the device and read once.
#[test]
fn gpu_a_validation_pass_measures_what_the_cpu_and_one_process_do() {
    let Some(_) = gpus("gpu_a_validation_pass_measures_what_the_cpu_and_one_process_do") else {
        return;
    };
    let base = "--model mlp --layers 4 --hidden 64 --image-size 8 --batch-size 16 --iterations 2 \
                --lr 0.05 --seed 3 --validate-every 1 --microbatches 4";
    let passes =
        |run: &crate::util::Run| -> Vec<f64> { run.validations().iter().map(|v| v.figures.loss).collect() };
    let on = |device: &str| run_ok(&[&words(base)[..], &["--device", device]].concat());
    let (cpu, cuda) = (passes(&on("cpu")), passes(&on("cuda:0")));
    assert_eq!(cpu.len(), 2);
    for (a, b) in cpu.iter().zip(&cuda) {
        // As the first loss's: float32 matmuls on both, rounded differently, after two steps.
        assert!((a - b).abs() <= 1e-3 * a.abs(), "cpu {cpu:?} vs cuda {cuda:?}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let config = crate::util::two_stages(tmp.path());
    let mut args = words(base);
    args.extend(["--device", "cuda:0", "--backend", "gloo", "--stage-config"]);
    args.push(&config);
    let runs = run_ranks(2, &args, std::time::Duration::from_secs(120));
    for run in &runs {
        assert!(run.output.status.success(), "{}", run.stderr());
    }
    let piped = passes(runs.iter().max_by_key(|r| r.start().stage).unwrap());
    assert_eq!(piped.len(), cuda.len());
    for (a, b) in piped.iter().zip(&cuda) {
        // float32 on one device, summed in another order: far inside 1e-4 relative.
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{piped:?} vs {cuda:?}");
    }
    // With --cuda-graph the passes run eagerly between the replays (the step is captured at the
    // fourth iteration), on the weights the replays updated in place: what the eager run
    // measured after the same steps.
    let longer = crate::distributed::with_value(&words(base), "--iterations", "8");
    let longer = crate::distributed::with_value(&longer, "--validate-every", "2");
    let eager = run_ok(&[&longer[..], &["--device", "cuda:0"]].concat());
    let graphed = run_ok(&[&longer[..], &["--device", "cuda:0", "--cuda-graph"]].concat());
    assert!(
        graphed.stderr().contains("captured in a CUDA graph"),
        "{}",
        graphed.stderr()
    );
    let (eager, graphed) = (passes(&eager), passes(&graphed));
    assert_eq!(eager.len(), 4, "{eager:?}");
    assert_eq!(graphed.len(), eager.len(), "{graphed:?}");
    // The mlp is well conditioned (gpu_a_step_replayed_from_a_cuda_graph_trains_as_the_eager_step
    // says how far): a GPU's rounding between runs stays far below 1e-3.
    for (a, b) in eager.iter().zip(&graphed) {
        assert!(
            (a - b).abs() <= 1e-3 * a.abs(),
            "eager {eager:?} vs graphed {graphed:?}"
        );
    }
    // The passes follow training: a pass that read the weights before the replays' updates
    // would repeat the same loss.
    assert!(graphed.windows(2).all(|w| w[0] != w[1]), "{graphed:?}");
}

/// Replicas on one GPU, over Gloo: the all-reduce started from CUDA autograd's hooks during the
/// backward (`--overlap-reduce on`, the default on GPUs), in buckets of one tensor and of all,
/// trains exactly as the all-reduce after the backward (reduce.rs says why bit for bit).
#[test]
fn gpu_an_overlapped_all_reduce_on_a_gpu_trains_as_one_after_the_backward() {
    let Some(_) = gpus("gpu_an_overlapped_all_reduce_on_a_gpu_trains_as_one_after_the_backward") else {
        return;
    };
    let base = format!("{} --device cuda:0 --backend gloo", crate::reduce::MLP);
    let dp = ["--schedule", "gpipe", "--microbatches", "4"];
    crate::reduce::overlap_matches_after_backward(
        "mlp on cuda:0, 2 replicas over gloo",
        2,
        &base,
        &dp,
        &["0.01", "25"],
    );
}

#[test]
fn gpu_nccl_on_two_ranks_of_one_gpu_is_a_clear_error() {
    let Some(count) = gpus("gpu_nccl_on_two_ranks_of_one_gpu_is_a_clear_error") else {
        return;
    };
    if count > 1 {
        eprintln!("SKIPPED gpu_nccl_on_two_ranks_of_one_gpu_is_a_clear_error: needs exactly one GPU");
        return;
    }
    let runs = run_ranks(
        2,
        &[
            "--model",
            "mlp",
            "--device",
            "cuda:0",
            "--backend",
            "nccl",
            "--iterations",
            "2",
        ],
        std::time::Duration::from_secs(120),
    );
    for run in &runs {
        assert_eq!(run.output.status.code(), Some(1), "{}", run.stderr());
        assert!(run.stderr().contains("nccl"), "{}", run.stderr());
    }
}

#[test]
fn gpu_a_stage_over_two_gpus_trains_as_on_one() {
    let Some(count) = gpus("gpu_a_stage_over_two_gpus_trains_as_on_one") else {
        return;
    };
    if count < 2 {
        eprintln!(
            "SKIPPED gpu_a_stage_over_two_gpus_trains_as_on_one: needs two GPUs, this machine has {count}"
        );
        return;
    }
    // resnet50 in two runs of even measured cost, with batch norms, bf16 autocast on both GPUs and
    // the activation crossing between them; against the whole model on cuda:0.
    let args = [
        "--model",
        "resnet50",
        "--image-size",
        "64",
        "--batch-size",
        "16",
        "--iterations",
        "3",
        "--seed",
        "1",
        "--precision",
        "bf16",
    ];
    let one = run_ok(&[&args[..], &["--device", "cuda:0"]].concat());
    let two = run_ok(&[&args[..], &["--devices", "cuda:0,cuda:1"]].concat());
    assert!(two.stderr().contains("cuda:1 (modules"), "{}", two.stderr());
    // The same kernels on the same numbers when both GPUs are of one model; cuDNN may pick
    // another algorithm per device, whose sums round differently: bf16's 8-bit mantissa bounds the
    // first loss's difference at about 2^-8 relative.
    let (a, b) = (one.losses()[0], two.losses()[0]);
    assert!((a - b).abs() <= a.abs() * 2f64.powi(-7), "{a} vs {b}");
}

/// `--cuda-graph`: the step captured once and replayed trains as the eager step does, every
/// model, with a learning rate that changes every iteration (read from the device by the replays),
/// fresh data each iteration (copied into the graph's inputs), dropout reseeded per iteration
/// (the transformer), batch norms' running statistics (resnet50), several microbatches, bf16 with
/// channels_last, and fp16, whose gradient scaler skips steps and rescales on the device.
#[test]
fn gpu_a_step_replayed_from_a_cuda_graph_trains_as_the_eager_step() {
    let Some(_) = gpus("gpu_a_step_replayed_from_a_cuda_graph_trains_as_the_eager_step") else {
        return;
    };
    // The mlps and the transformer are well conditioned here: a change of 2e-6 in the learning
    // rate moves their eight losses by at most 7e-6 relative (measured on the CPU), so the
    // rounding in which a GPU's kernels may differ between runs stays far below 1e-3. resnet50
    // at batch 8 is not: the same change moves its losses 10% apart by the fourth iteration, and
    // two eager runs on an H100 already differed by 0.6% at the third (45.43 against 45.17). Its
    // runs are therefore --deterministic, so that eager and replayed steps compute the same
    // kernels on the same values and any difference is the graph's.
    let cases: [(&str, f64); 6] = [
        ("--model mlp --layers 3 --hidden 64 --image-size 16", 1e-3),
        ("--model resnet50 --image-size 32 --num-classes 10 --deterministic", 1e-3),
        ("--model transformer --layers 2 --hidden 64 --heads 4 --seq-len 16 --vocab-size 100 --dropout 0.1", 1e-3),
        ("--model mlp --layers 3 --hidden 64 --image-size 16 --microbatches 4 --optimizer adamw", 1e-3),
        // bf16's 8-bit mantissa: an algorithm picked otherwise rounds at about 2^-8 relative.
        (
            "--model resnet50 --image-size 32 --num-classes 10 --precision bf16 --channels-last --deterministic",
            2f64.powi(-7),
        ),
        // fp16's 11-bit mantissa: likewise at about 2^-11 relative, with room.
        (
            "--model resnet50 --image-size 32 --num-classes 10 --precision fp16 --channels-last --deterministic",
            2f64.powi(-8),
        ),
    ];
    for (model, tolerance) in cases {
        let mut args = words(model);
        // 4 epochs of 2 iterations: a one-epoch warm-up, then the polynomial policy's decay.
        args.extend(words(
            "--device cuda --batch-size 8 --epochs 4 --epoch-samples 16 --lr 0.05 --seed 7 \
             --lr-policy polynomial --lr-warmup-epochs 1",
        ));
        let eager = run_ok(&args);
        args.push("--cuda-graph");
        let graphed = run_ok(&args);
        assert!(
            graphed.stderr().contains("captured in a CUDA graph"),
            "{model}: {}",
            graphed.stderr()
        );
        assert!(graphed.start().config.cuda_graph, "{model}");
        let (a, b) = (eager.iterations(), graphed.iterations());
        assert_eq!(a.len(), b.len(), "{model}");
        let rates: Vec<f64> = a.iter().map(|it| it.lr.unwrap()).collect();
        assert!(
            rates.windows(2).any(|w| w[0] != w[1]),
            "{model}: the rate never changed: {rates:?}"
        );
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.lr, y.lr, "{model}: iteration {}", x.iteration);
            // fp16: the replays skip and rescale as the eager steps did.
            assert_eq!(x.loss_scale, y.loss_scale, "{model}: iteration {}", x.iteration);
            assert_eq!(
                x.step_skipped, y.step_skipped,
                "{model}: iteration {}",
                x.iteration
            );
            let (lx, ly) = (x.loss.unwrap(), y.loss.unwrap());
            assert!(
                (lx - ly).abs() <= tolerance * lx.abs(),
                "{model}: iteration {}: eager {lx} vs graphed {ly}",
                x.iteration
            );
        }
        // Different batches each iteration: a replay that kept reading the captured batch would
        // repeat one loss.
        let losses = graphed.losses();
        assert!(
            losses[4..].windows(2).all(|w| w[0] != w[1]),
            "{model}: {losses:?}"
        );
    }
}

/// `--deterministic` on a GPU: two runs give the same losses bit for bit, where cuDNN and cuBLAS
/// would otherwise be free to round differently from run to run (resnet50 at batch 8 turns such
/// differences into losses 0.6% apart within three iterations). Each model trains under it, so
/// none of their operators lacks a deterministic version (one that did would fail the run).
/// vgg16 at 224x224, where its adaptive pool is the identity and skipped: CUDA's backward of
/// that pool has no deterministic version, so other image sizes fail naming it, as
/// torchvision's vgg16 does under torch.use_deterministic_algorithms(True).
#[test]
fn gpu_deterministic_runs_repeat_bit_for_bit() {
    let Some(_) = gpus("gpu_deterministic_runs_repeat_bit_for_bit") else {
        return;
    };
    let cases = [
        ("--model resnet50 --image-size 32 --num-classes 10", "0.05"),
        (
            "--model resnet50 --image-size 32 --num-classes 10 --precision bf16 --channels-last",
            "0.05",
        ),
        ("--model vgg16 --image-size 224 --num-classes 10", "0.001"),
        (
            "--model transformer --layers 2 --hidden 64 --heads 4 --seq-len 16 --vocab-size 100 --dropout 0.1",
            "0.05",
        ),
    ];
    for (model, lr) in cases {
        let mut args = words(model);
        args.extend(words(
            "--device cuda --batch-size 8 --iterations 6 --seed 7 --deterministic --lr",
        ));
        args.push(lr);
        let (a, b) = (run_ok(&args), run_ok(&args));
        assert!(a.start().config.deterministic, "{model}");
        assert_eq!(a.losses(), b.losses(), "{model}");
        assert!(
            a.losses().iter().all(|l| l.is_finite()),
            "{model}: {:?}",
            a.losses()
        );
    }
}

/// `--cudnn-benchmark` on a GPU: cuDNN times its algorithms and trains with the fastest, which
/// compute the same convolutions: the first loss (a forward before any step) agrees with the
/// default algorithms' to TF32's rounding (cuDNN convolutions run in TF32 by default, 10 bits of
/// mantissa, about 1e-3 relative per product; over a mean of 8 losses 1e-2 is ample).
#[test]
fn gpu_cudnn_benchmark_trains_with_the_convolutions_it_times() {
    let Some(_) = gpus("gpu_cudnn_benchmark_trains_with_the_convolutions_it_times") else {
        return;
    };
    let args = words(
        "--model resnet50 --image-size 64 --num-classes 10 --batch-size 8 --iterations 4 --device cuda",
    );
    let plain = run_ok(&args);
    let timed = run_ok(&[&args[..], &["--cudnn-benchmark"]].concat());
    assert!(timed.start().config.cudnn_benchmark);
    let (a, b) = (plain.losses()[0], timed.losses()[0]);
    assert!((a - b).abs() <= 1e-2 * a.abs(), "first losses {a} and {b}");
    assert!(
        timed.losses().iter().all(|l| l.is_finite()),
        "{:?}",
        timed.losses()
    );
}

/// `--fused-kernels` on a GPU: vgg16 in bf16 + channels_last runs the runtime's own kernels
/// (csrc/kernels/fusions.cu) for its convolutions' bias and ReLU and its pools, forward and
/// backward (each block's last bias, ReLU and pool one kernel each way), instead of ATen's, and
/// trains as with ATen's. The kernels compute ATen's values bit
/// for bit but for the bias gradients, sums in another order (bench/fusion_probe.py checks each
/// kernel so on a GPU); bf16 rounds at 2^-8 relative, so the losses of a few iterations stay
/// within 2^-6 of ATen's run, where a misplaced bias, channel or pooling window would move them
/// far more. The same holds with the step replayed from a CUDA graph.
#[test]
fn gpu_the_fused_kernels_train_vgg16_as_atens_kernels_do() {
    let Some(_) = gpus("gpu_the_fused_kernels_train_vgg16_as_atens_kernels_do") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args = words(
        "--model vgg16 --image-size 32 --num-classes 10 --batch-size 8 --iterations 4 --lr 0.01 \
         --seed 7 --device cuda --precision bf16 --channels-last --warmup 1",
    );
    let aten = run_ok(&args);
    assert!(!aten.start().config.fused_kernels);
    let trace = dir.path().join("fused.json");
    let mut fused_args = args.clone();
    fused_args.extend(["--fused-kernels", "--profiler-trace", trace.to_str().unwrap()]);
    let fused = run_ok(&fused_args);
    assert!(fused.start().config.fused_kernels);
    assert!(
        !fused.stderr().contains("fused kernels are off"),
        "the kernels did not load: {}",
        fused.stderr()
    );
    let close = |a: &[f64], b: &[f64], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!(
                x.is_finite() && (x - y).abs() <= 2f64.powi(-6) * y.abs(),
                "{what}: {a:?} against {b:?}"
            );
        }
    };
    close(&fused.losses(), &aten.losses(), "fused against ATen");

    // The traced iterations ran the fused kernels, and ATen's pooling not at all. Every pool and
    // the convolution before it are in the one stage, so each pool took the one kernel through
    // the bias, the ReLU and the pool each way.
    let events = trace_events(&trace);
    let kernels: Vec<&str> = events
        .iter()
        .filter(|e| e["cat"] == "kernel")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for name in [
        "bias_relu",
        "relu_bias_backward",
        "bias_relu_pool",
        "pool_relu_bias_backward",
    ] {
        assert!(
            kernels.contains(&name),
            "no {name} kernel in {} kernels",
            kernels.len()
        );
    }
    for (name, apart) in [
        (
            "pool_forward",
            "a pool ran apart from the bias and ReLU before it",
        ),
        (
            "pool_backward",
            "a pool's backward ran apart from the ReLU's before it",
        ),
    ] {
        assert!(!kernels.contains(&name), "{apart}");
    }
    assert!(
        !kernels.iter().any(|k| k.contains("max_pool")),
        "ATen's pooling ran: {:?}",
        kernels
            .iter()
            .filter(|k| k.contains("max_pool"))
            .collect::<Vec<_>>()
    );

    let mut graphed_args = args.clone();
    graphed_args.extend(["--fused-kernels", "--cuda-graph"]);
    let graphed = run_ok(&graphed_args);
    assert!(
        graphed.stderr().contains("captured in a CUDA graph"),
        "{}",
        graphed.stderr()
    );
    close(
        &graphed.losses(),
        &aten.losses(),
        "fused and graphed against ATen",
    );
}

/// `--profiler-trace` on a GPU records the GPU's side as well (CUPTI through Kineto): every
/// traced iteration launches its kernels, each convolution's at least, and they are in the trace,
/// as are the waits for the device (one process waits once an iteration, for its loss, and never
/// between its parts); under `--cuda-graph` it records the replays, one graph launch per iteration
/// after the capture.
#[test]
fn gpu_the_profiler_trace_holds_the_kernels_of_each_step() {
    let Some(_) = gpus("gpu_the_profiler_trace_holds_the_kernels_of_each_step") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let count = |events: &[Value], cat: &str, name: Option<&str>| {
        events
            .iter()
            .filter(|e| e["cat"] == cat && name.is_none_or(|n| e["name"].as_str().unwrap().contains(n)))
            .count()
    };
    let resnet = "--model resnet50 --image-size 32 --num-classes 10 --batch-size 8 --device cuda \
                  --precision bf16 --channels-last --warmup 1";
    let eager = dir.path().join("eager.json");
    let mut args = words(resnet);
    args.extend(["--iterations", "4", "--profiler-trace", eager.to_str().unwrap()]);
    run_ok(&args);
    let events = trace_events(&eager);
    assert_eq!(
        trace_steps(&events),
        ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    );
    // resnet50 has 53 convolutions, each at least a kernel forward and one backward.
    let kernels = count(&events, "kernel", None);
    assert!(kernels >= 3 * 2 * 53, "{kernels} kernels in 3 iterations");
    assert!(
        count(&events, "cuda_runtime", Some("LaunchKernel")) > 0,
        "launches recorded"
    );
    // The forward, backward and step each launch kernels within their scopes (the backward's
    // from autograd's device thread, while the training thread waits in its scope).
    let calls = |name: &str| -> Vec<f64> {
        events
            .iter()
            .filter(|e| e["cat"] == "cuda_runtime" && e["name"].as_str().unwrap().contains(name))
            .map(|e| e["ts"].as_f64().unwrap())
            .collect()
    };
    // How many of `calls` each of `part`'s scopes holds, a scope per iteration.
    let within = |part: &str, calls: &[f64]| -> Vec<usize> {
        events
            .iter()
            .filter(|e| e["cat"] == "user_annotation" && e["name"] == part)
            .map(|e| {
                let (a, d) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
                calls.iter().filter(|&&t| a <= t && t <= a + d).count()
            })
            .collect()
    };
    let launches = calls("LaunchKernel");
    for part in ["forward", "backward", "step"] {
        let within = within(part, &launches);
        assert_eq!(within.len(), 3, "{part}: a scope per iteration");
        assert!(
            within.iter().all(|&n| n > 0),
            "{part}: kernels launched within it: {within:?}"
        );
    }
    // One process queues its forward, backward and step back to back and waits for the device
    // once an iteration, for its loss and accuracy: no part of the iteration, nor the `sync` scope
    // before the step, waits for the stream.
    let waits = calls("Synchronize");
    assert!(waits.len() >= 3, "a wait for the loss each iteration: {waits:?}");
    for part in ["forward", "backward", "sync", "step"] {
        let within = within(part, &waits);
        assert_eq!(within.len(), 3, "{part}: a scope per iteration");
        assert!(
            within.iter().all(|&n| n == 0),
            "{part} waited for the device: {within:?} waits"
        );
    }

    let graphed = dir.path().join("graph.json");
    let mut args = words(resnet);
    args.extend([
        "--iterations",
        "7",
        "--cuda-graph",
        "--profiler-trace",
        graphed.to_str().unwrap(),
    ]);
    run_ok(&args);
    let events = trace_events(&graphed);
    assert_eq!(
        trace_steps(&events),
        ["ProfilerStep#4", "ProfilerStep#5", "ProfilerStep#6"]
    );
    assert_eq!(
        count(&events, "cuda_runtime", Some("cudaGraphLaunch")),
        3,
        "one replay a step"
    );
    eprintln!(
        "the graphed trace holds {} kernels (CUPTI reports a graph's kernels where it can)",
        count(&events, "kernel", None)
    );
}

/// `runtime info` says what NCCL's InfiniBand transport would find: the kernel's verbs devices,
/// the device files, and whether libibverbs loads (with the loader's words when it does not).
#[test]
fn info_says_what_rdma_would_find_here() {
    let rdma = &info(&[])["rdma"];
    let mut listed: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    listed.sort();
    let devices: Vec<String> = rdma["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect();
    assert_eq!(devices, listed, "{rdma}");
    assert_eq!(
        rdma["device_files"],
        Path::new("/dev/infiniband").is_dir(),
        "{rdma}"
    );
    match rdma["ibverbs"].as_bool().unwrap() {
        true => assert!(rdma["ibverbs_error"].is_null(), "{rdma}"),
        false => assert!(
            rdma["ibverbs_error"].as_str().unwrap().contains("libibverbs"),
            "{rdma}"
        ),
    }
    // Debian's libibverbs1 puts the library here; where it is, it loads.
    if Path::new("/usr/lib/x86_64-linux-gnu/libibverbs.so.1").exists() {
        assert_eq!(rdma["ibverbs"], true, "{rdma}");
    }
}
