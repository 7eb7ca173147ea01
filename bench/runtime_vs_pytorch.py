#!/usr/bin/env python3
"""Samples/s of `runtime` against PyTorch (the venv's torch) training the same model on the same
device with the same data and settings, one process each side: a synthetic pool of 4 batches
made once on the device by the runtime's rule (same generator and seed), SGD with momentum 0.9 and
the same lr (PyTorch: torch.optim.SGD with its defaults), the same batch, shapes, threads and
iterations. Runs alternate (the order rotates every round) in one go so drift on the
machine hits every side alike; prints the median of each side and the ratio runtime / reference.

    scripts/bench-runtime                   # CPU, fp32: runtime vs eager on mlp, vgg16, resnet50, transformer
    scripts/bench-runtime --device cuda     # GPU: resnet50, vgg16, transformer in both modes below

Modes (the arithmetic both sides use) and their references:
  fp32                 runtime vs PyTorch eager in fp32.
  bf16+channels_last   runtime `--precision bf16 --channels-last` vs eager with
                       `torch.autocast(device, torch.bfloat16)` around the forward and the loss,
                       `model.to(memory_format=torch.channels_last)` and channels_last images, AND vs
                       `torch.compile(model)` with the same settings. (channels_last changes
                       nothing for the transformer, which has no 4-d tensors.)
On the GPU both modes run by default; on the CPU fp32 alone, in today's output format.
On the GPU the runtime runs twice in every mode, as two sides of the rotation: kernel by kernel
(`eager` in the runtime column) and with `--cuda-graph` (`graph`: after 3 eager iterations, each
step replayed from a CUDA graph captured once); `--cuda-graph off|on` keeps one of them. Each is
compared with every reference.
Host memory: the runtime keeps what a step frees for the next iteration (`--host-memory keep`, its
default: glibc's malloc neither unmaps big blocks nor trims its heap), where PyTorch in Python
runs on glibc's defaults, which map, fault in and zero much of that memory again every iteration.
`--host-memory release|both` runs the runtime on glibc's defaults instead, or both ways (the
second side labelled `+rel`), to show what keeping buys; `--reference-malloc keep` runs the
PyTorch references under the same malloc settings (through GLIBC_TUNABLES), to show the runtime's
lead without it.
`--precision bf16` and/or `--channels-last` pick one mode instead (on the CPU too: CPU autocast
bf16, a smoke test of the GPU modes' code paths). `--references eager,compile` overrides which
references run (default: eager in fp32, eager and compile in bf16 modes).

Shapes: on the GPU torchvision's defaults, resnet50 and vgg16 at batch 64 on 224x224 images with
1000 classes, and the BERT-base-sized transformer (12 layers, hidden 768, 12 heads, vocabulary
30522) at batch 32, sequence 128; on the CPU small inputs keep runs short (see SHAPES). Options
such as --batch-size or --hidden override them for every model they apply to.

Timing: throughput of one run = batch * iterations / seconds over the iterations after --warmup;
every iteration ends when the loss has reached the host (on CUDA, after the GPU ran it all).
torch.compile's runs first do --compile-warmup iterations (the first compiles the forward and the
backward) that are not timed, then as many timed iterations as the other sides keep. Both sides
keep libtorch's defaults otherwise (cudnn.benchmark off, unless --cudnn-benchmark turns it on for
every side; TF32 on for cuDNN convolutions, off for matmuls).

Memory: peaks over each run (warm-up and compilation included), the largest over the rounds. On
CUDA, the runtime's `summary` gpu_peak_allocated_bytes / gpu_peak_reserved_bytes and PyTorch's
torch.cuda.max_memory_allocated / max_memory_reserved; on the CPU the peak resident set of each
process.

Parameters: before timing a model, its parameter count in PyTorch (torchvision's vgg16/resnet50;
bench/pytorch_eager.py's plain torch.nn transformer, the runtime's BERT layout) and the runtime's
`start` event `num_params` are printed (stderr) and must be equal, else the model fails.

Targets (issue 13): the runtime at least 1.0x eager for every model in every mode, and with bf16 +
channels_last at least torch.compile's throughput (e.g. resnet50 at batch 64 on an H100: 2085
samples/s measured for torch.compile).

Rounds: every side of a model and mode runs once per round, the order rotating; rounds go
breadth first (round 1 of every model and mode, then round 2 of each, ...), so that what stops the
benchmark early leaves figures for all of them. `--deadline SECONDS` is such a stop: a round starts
only if it would end within SECONDS of the start by the time the same model and mode's last round
took (a first round, while any time is left); the table says which got fewer rounds, and their
rows `rounds_done` and `cut_by_deadline`. scripts/gpu-checks uses it to fit a lent GPU's minutes.

Traces: `--trace-dir DIR` times nothing: it runs every side once, --warmup iterations (torch.compile:
--compile-warmup) and then --trace-steps more under PyTorch's profiler (`runtime --profiler-trace`,
`pytorch_eager.py --profiler-trace`), and prints bench/trace_table.py's tables of the traces side by
side: on a GPU, each side's GPU busy and idle time per step, its kernels by kind and the kernels
that take the most time; on the CPU, its operators' self time. What one side does that another
does not shows there. `scripts/gpu-checks profile` runs it.

--json FILE gets every figure (a list, one object per model and mode), rewritten after every
round, so a benchmark killed midway leaves the rounds it finished.
A failed run or a parameter mismatch is reported, recorded and makes the exit code 1; the other
models still run. `--device cuda` without a usable GPU exits 2 with the reason. The runtime binary
is $STAGEHAND_RUNTIME, else this checkout's target/release/runtime (--runtime overrides both).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import trace_table
from side_by_side import rotate_round, throughput, write_json

ROOT = Path(__file__).resolve().parent.parent
EAGER = Path(__file__).resolve().parent / "pytorch_eager.py"

# Per device and model: batch, input shape, lr (and sizes both sides are told explicitly).
SHAPES = {
    "cpu": {
        "mlp": dict(batch=64, image=32, classes=10, lr=0.01),
        "vgg16": dict(batch=16, image=32, classes=10, lr=0.001, dropout=0.5),
        "resnet50": dict(batch=16, image=64, classes=10, lr=0.01),
        "transformer": dict(batch=8, seq_len=64, layers=2, hidden=256, heads=4, vocab_size=8192,
                            lr=0.01, dropout=0.1),
    },
    "cuda": {
        "mlp": dict(batch=64, image=32, classes=10, lr=0.01),
        "vgg16": dict(batch=64, image=224, classes=1000, lr=0.001, dropout=0.5),
        "resnet50": dict(batch=64, image=224, classes=1000, lr=0.01),
        "transformer": dict(batch=32, seq_len=128, layers=12, hidden=768, heads=12, vocab_size=30522,
                            lr=0.01, dropout=0.1),
    },
}
# Which overrides each model reads.
IMAGE_KEYS = ("batch", "image", "classes", "lr", "dropout")
APPLIES = {
    "mlp": IMAGE_KEYS + ("layers", "hidden"),
    "vgg16": IMAGE_KEYS,
    "resnet50": IMAGE_KEYS,
    "transformer": ("batch", "seq_len", "layers", "hidden", "heads", "vocab_size", "lr", "dropout"),
}
# The flag both `runtime` and pytorch_eager.py take for each shape key.
FLAGS = {
    "batch": "--batch-size", "image": "--image-size", "classes": "--num-classes",
    "layers": "--layers", "hidden": "--hidden", "heads": "--heads", "seq_len": "--seq-len",
    "vocab_size": "--vocab-size", "lr": "--lr", "dropout": "--dropout",
}
MOMENTUM = 0.9
GIB = 1 << 30


@dataclass(frozen=True)
class Mode:
    precision: str
    channels_last: bool

    @property
    def name(self):
        return self.precision + ("+channels_last" if self.channels_last else "")

    def flags(self):
        return (["--precision", self.precision] if self.precision != "fp32" else []) + (
            ["--channels-last"] if self.channels_last else []
        )


class RunFailed(Exception):
    pass


# glibc's malloc settings that the runtime's `--host-memory keep` makes (mallopt M_MMAP_MAX 0,
# M_TRIM_THRESHOLD -1), as tunables a reference process reads at start-up.
KEEP_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=" + str(2**63 - 1)


def run_json_lines(cmd, env=None):
    """Runs `cmd` (with `env` added to the environment); its stdout as a list of JSON objects, or
    RunFailed with the reason."""
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-3:] or ["(no stderr)"]
        raise RunFailed(f"exit {proc.returncode}: {' '.join(cmd)}\n    " + "\n    ".join(last))
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def shape_flags(s):
    return [f for key, value in s.items() for f in (FLAGS[key], str(value))]


def common_flags(s, mode, args, iterations):
    return shape_flags(s) + mode.flags() + [
        "--momentum", str(MOMENTUM), "--iterations", str(iterations),
        "--threads", str(args.threads), "--device", args.device,
    ] + (["--cudnn-benchmark"] if args.cudnn_benchmark else [])


def memory_of(record):
    keys = ("gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "host_peak_rss_bytes")
    return {k: record.get(k) for k in keys}


def run_runtime(model, s, mode, args, flags, trace=None):
    """One run of the runtime; with `trace`, a short one (--warmup, then --trace-steps iterations)
    that writes its profiler trace there."""
    iterations = args.iterations if trace is None else args.warmup + args.trace_steps
    cmd = [str(args.runtime), "--model", model, *common_flags(s, mode, args, iterations),
           "--warmup", str(args.warmup)] + flags
    if trace is not None:
        cmd += ["--profiler-trace", str(trace), "--profiler-steps", str(args.trace_steps)]
    events = run_json_lines(cmd)
    start = next(e for e in events if e["event"] == "start")
    summary = next(e for e in events if e["event"] == "summary")
    times = [e["time_s"] for e in events if e["event"] == "iteration"]
    return dict(sps=throughput(times, s["batch"], args.warmup), params=start["num_params"],
                memory=memory_of(summary))


def run_pytorch(model, s, mode, args, compiled, trace=None):
    warmup = args.compile_warmup if compiled else args.warmup
    iterations = warmup + (args.iterations - args.warmup if trace is None else args.trace_steps)
    cmd = [sys.executable, str(EAGER), "--model", model, *common_flags(s, mode, args, iterations)]
    if compiled:
        cmd += ["--compile", "--compile-mode", args.compile_mode]
    if trace is not None:
        cmd += ["--warmup", str(warmup), "--profiler-trace", str(trace)]
    env = {"GLIBC_TUNABLES": KEEP_TUNABLES} if args.reference_malloc == "keep" else None
    out = run_json_lines(cmd, env)[-1]
    return dict(sps=throughput(out["times"], s["batch"], warmup), params=out["num_params"],
                memory=memory_of(out), device_name=out["device_name"])


def check_params(model, s, args):
    """Both sides' parameter counts, printed; RunFailed unless they are equal."""
    theirs = run_json_lines([sys.executable, str(EAGER), "--model", model, *shape_flags(s),
                             "--count-params"])[-1]["num_params"]
    events = run_json_lines([str(args.runtime), "--model", model, *shape_flags(s),
                             "--iterations", "0", "--threads", str(args.threads),
                             "--device", args.device])
    ours = next(e for e in events if e["event"] == "start")["num_params"]
    same = "equal" if ours == theirs else "MISMATCH"
    print(f"{model}: parameters: runtime {ours:,}, pytorch {theirs:,} ({same})", file=sys.stderr, flush=True)
    if ours != theirs:
        raise RunFailed(f"the runtime has {ours} parameters, the PyTorch reference {theirs}: "
                        "not the same model")
    return dict(runtime=ours, pytorch=theirs)


def require_cuda(args):
    """Exits 2, saying why, unless both the runtime and the venv's torch see the device."""
    index = int(args.device.partition(":")[2] or 0)
    try:
        info = run_json_lines([str(args.runtime), "info"])[-1]
    except RunFailed as e:
        print(f"bench-runtime: --device {args.device}: `runtime info` failed: {e}", file=sys.stderr)
        sys.exit(2)
    if info.get("cuda_devices", 0) <= index:
        reason = info.get("cuda_error") or info.get("cuda_devices_error") or "no such device"
        print(f"bench-runtime: --device {args.device}: the runtime sees {info.get('cuda_devices', 0)} "
              f"CUDA device(s) here ({reason}); run on a machine with a GPU, or without --device for "
              "the CPU comparison", file=sys.stderr)
        sys.exit(2)
    probe = "import torch; print(torch.cuda.device_count())"
    count = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() or 0)
    if count <= index:
        print(f"bench-runtime: --device {args.device}: the runtime sees it, but the torch of "
              f"{sys.executable} sees {count} CUDA device(s)", file=sys.stderr)
        sys.exit(2)
    return info["devices"][index] if index < len(info.get("devices", [])) else args.device


def gib(value):
    return "-" if value is None else f"{value / GIB:.2f}"


def mem_text(memory, cuda):
    if cuda:
        return f"{gib(memory['gpu_peak_allocated_bytes'])}/{gib(memory['gpu_peak_reserved_bytes'])}"
    return gib(memory["host_peak_rss_bytes"])


def peak(runs):
    """The largest of each memory figure over the rounds."""
    keys = runs[0]["memory"].keys()
    return {k: max((r["memory"][k] for r in runs if r["memory"][k] is not None), default=None) for k in keys}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--models", help="comma-separated [default: mlp,vgg16,resnet50,transformer on the CPU, "
                                    "resnet50,vgg16,transformer on the GPU]")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="run this mode only (with --channels-last if given)")
    p.add_argument("--channels-last", action="store_true", help="run the channels_last mode only")
    p.add_argument("--references", default="auto",
                   help="comma-separated from eager,compile [default: eager in fp32, eager and "
                        "compile in bf16 modes]")
    p.add_argument("--rounds", type=int, help="runs of each side [default: 3]")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="start no round of a model and mode that would end more than SECONDS after "
                        "the start, by the time its last round took (a first round starts while "
                        "any time is left); rounds run breadth first, so every model gets its "
                        "first round before any gets a second")
    p.add_argument("--iterations", type=int, help="iterations per run [default: 12 CPU, 40 GPU]")
    p.add_argument("--warmup", type=int, help="leading iterations not timed [default: 2 CPU, 10 GPU]")
    p.add_argument("--compile-warmup", type=int,
                   help="torch.compile's untimed leading iterations, compilation included [default: 10]")
    p.add_argument("--compile-mode", default="default", help="torch.compile's mode [default: default]")
    p.add_argument("--cuda-graph", choices=["off", "on", "both"],
                   help="the runtime without `--cuda-graph` (off), with it (on), or both, each "
                        "against the same references [default: both on the GPU, off on the CPU]")
    p.add_argument("--host-memory", choices=["keep", "release", "both"], default="keep",
                   help="the runtime's --host-memory: keep (its default), release (glibc's "
                        "defaults), or both, each against the same references [default: keep]")
    p.add_argument("--reference-malloc", choices=["default", "keep"], default="default",
                   help="the PyTorch references on glibc's default malloc settings, or on those "
                        "the runtime's --host-memory keep makes [default: default]")
    p.add_argument("--fused-kernels", action="store_true",
                   help="the runtime's sides with --fused-kernels (its own CUDA kernels for vgg16's bias, "
                        "ReLU and pools; bench/fusion_probe.py times them alone) [default: off]")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="every side with cuDNN's benchmark on (runtime --cudnn-benchmark, "
                        "torch.backends.cudnn.benchmark = True) [default: off, libtorch's default]")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    for key, flag in FLAGS.items():
        real = key in ("lr", "dropout")
        p.add_argument(flag, dest=key, type=float if real else int, metavar="X" if real else "N",
                       help="override for every model that reads it")
    p.add_argument("--runtime", type=Path,
                   default=Path(os.environ.get("STAGEHAND_RUNTIME", ROOT / "target" / "release" / "runtime")))
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--trace-dir", type=Path, metavar="DIR",
                   help="instead of timing: run every side of every model and mode once, for "
                        "--warmup iterations and then --trace-steps more under PyTorch's profiler, "
                        "write each trace to DIR/MODEL-MODE-SIDE.json and print bench/trace_table.py's "
                        "tables of them side by side (also in DIR/MODEL-MODE.txt)")
    p.add_argument("--trace-steps", type=int, default=5, metavar="N",
                   help="iterations each --trace-dir run records [default: 5]")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    if not (cuda or args.device == "cpu"):
        p.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    args.models = (args.models or ("resnet50,vgg16,transformer" if cuda else "mlp,vgg16,resnet50,transformer")).split(",")
    for model in args.models:
        if model not in APPLIES:
            p.error(f"--models: unknown model {model!r}; known: {', '.join(APPLIES)}")
    if args.precision or args.channels_last:
        args.modes = [Mode(args.precision or "fp32", args.channels_last)]
    else:
        args.modes = [Mode("fp32", False)] + ([Mode("bf16", True)] if cuda else [])
    for ref in [] if args.references == "auto" else args.references.split(","):
        if ref not in ("eager", "compile"):
            p.error(f"--references: unknown reference {ref!r}; expected eager or compile")
    args.rounds = args.rounds or 3
    args.iterations = args.iterations or (40 if cuda else 12)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    args.compile_warmup = args.compile_warmup if args.compile_warmup is not None else 10
    args.cuda_graph = args.cuda_graph or ("both" if cuda else "off")
    if args.cuda_graph != "off" and not cuda:
        p.error("--cuda-graph: CUDA graphs need --device cuda")
    if args.deadline is not None and args.deadline <= 0:
        p.error(f"--deadline {args.deadline:g}: expected a number of seconds above 0")
    if args.iterations <= args.warmup:
        p.error(f"--iterations {args.iterations} leaves nothing to time after --warmup {args.warmup}")
    if args.trace_steps < 1:
        p.error(f"--trace-steps {args.trace_steps}: expected 1 or more")
    if not args.runtime.is_file():
        p.error(f"no runtime binary at {args.runtime}: build it (scripts/setup.sh), or set "
                "STAGEHAND_RUNTIME or --runtime")
    if args.fused_kernels and not args.device.startswith("cuda"):
        p.error("--fused-kernels runs CUDA kernels: use --device cuda")
    return args


def runtime_sides(args):
    """The runtime's sides: (name, label, its flags). The first, `runtime`, is the plain runtime
    (or the graphed one alone with --cuda-graph on); the others' figures go under their names."""
    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    memories = {"keep": ["keep"], "release": ["release"], "both": ["keep", "release"]}[args.host_memory]
    sides = []
    for graph in graphs:
        for memory in memories:
            released = memory == "release" and len(memories) > 1
            name = ("graph" if graph and len(graphs) > 1 else "runtime") + ("_release" if released else "")
            label = ("graph" if graph else "eager") + ("+rel" if released else "")
            flags = (["--cuda-graph"] if graph else []) + (
                ["--host-memory", "release"] if memory == "release" else []) + (
                ["--fused-kernels"] if args.fused_kernels else [])
            sides.append((name, label, flags))
    return sides


def references(mode, args):
    if args.references != "auto":
        return args.references.split(",")
    return ["eager"] if mode.precision == "fp32" else ["eager", "compile"]


def shape(model, args):
    s = dict(SHAPES["cuda" if args.device.startswith("cuda") else "cpu"][model])
    for key in APPLIES[model]:
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    return s


def input_text(s):
    return f"seq {s['seq_len']}" if "seq_len" in s else f"{s['image']}px"


@dataclass
class Case:
    """One model in one mode: its runs (reference and runtime sides by name), its row of the JSON
    (rewritten after each round) and the figures of the rounds done so far."""
    model: str
    shape: dict
    mode: Mode
    refs: list
    sides: list
    runs: dict
    row: dict
    figures: dict
    round_s: float = 0.0
    error: str = ""
    cut: bool = False

    @property
    def done(self):
        """Rounds run to the end."""
        return len(self.figures[self.refs[0]])


def cases_of(args, device_name, results):
    """Every model's cases, its parameter counts checked first, each case's row added to `results`
    (no rounds done yet); a model whose counts fail is recorded there with its error and has no
    cases. Returns the cases and the number of models that failed."""
    cases, failed = [], 0
    for model in args.models:
        s = shape(model, args)
        try:
            params = check_params(model, s, args)
        except RunFailed as e:
            print(f"{model}: {e}", file=sys.stderr, flush=True)
            results.append(dict(model=model, **s, device=args.device, error=str(e)))
            write_json(args.json, results)
            failed += 1
            continue
        for mode in args.modes:
            refs = references(mode, args)
            runs = {ref: (lambda m=mode, c=(ref == "compile"), model=model, s=s: run_pytorch(model, s, m, args, c))
                    for ref in refs}
            sides = runtime_sides(args)
            for side, _, flags in sides:
                runs[side] = lambda m=mode, f=flags, model=model, s=s: run_runtime(model, s, m, args, f)
            row = dict(model=model, **s, threads=args.threads, device=args.device, device_name=device_name,
                       mode=mode.name, precision=mode.precision, channels_last=mode.channels_last,
                       cuda_graph=args.cuda_graph, host_memory=args.host_memory,
                       cudnn_benchmark=args.cudnn_benchmark, fused_kernels=args.fused_kernels,
                       reference_malloc=args.reference_malloc,
                       momentum=MOMENTUM, rounds=args.rounds, iterations=args.iterations,
                       warmup=args.warmup, params=params, rounds_done=0, deadline_s=args.deadline,
                       cut_by_deadline=False)
            results.append(row)
            cases.append(Case(model, s, mode, refs, sides, runs, row, {name: [] for name in runs}))
    return cases, failed


def summarise(case, args):
    """The case's row from the rounds done so far: medians, ratios and peaks of every side.
    Returns what each runtime side prints: (label, median, memory, ratios)."""
    row, refs, figures = case.row, case.refs, case.figures
    row["rounds_done"] = case.done
    row["references"] = {}
    for ref in refs:
        theirs = [r["sps"] for r in figures[ref]]
        row["references"][ref] = dict(samples_per_sec=theirs, median=statistics.median(theirs),
                                      memory=peak(figures[ref]))
        if ref == "compile":
            row["references"][ref].update(compile_mode=args.compile_mode, compile_warmup=args.compile_warmup)
    # Each runtime side against every reference: the plain runtime's figures under today's keys
    # (runtime, runtime_median, ratio in references), the others' under their names (`graph`,
    # `runtime_release`, `graph_release`).
    printed = []
    for side, label, _ in case.sides:
        ours = [r["sps"] for r in figures[side]]
        median, memory = statistics.median(ours), peak(figures[side])
        ratios = {ref: median / row["references"][ref]["median"] for ref in refs}
        if side == "runtime":
            row.update(runtime=ours, runtime_median=median, runtime_memory=memory)
            for ref in refs:
                row["references"][ref]["ratio"] = ratios[ref]
        else:
            row[side] = dict(samples_per_sec=ours, median=median, memory=memory, ratios=ratios)
        printed.append((label, median, memory, ratios))
    if "eager" in refs and "runtime" in row:  # the keys of today's JSON
        row.update(pytorch=row["references"]["eager"]["samples_per_sec"],
                   ratio=row["references"]["eager"]["ratio"])
    return printed


def trace_case(case, args):
    """Every side of `case` once under PyTorch's profiler, the runtime's first and torch.compile's
    (which compiles first) last, then the tables of their traces, printed and written beside
    them (rewritten after each side, so a run cut short leaves the sides it traced). Returns the
    number of sides that failed."""
    base = f"{case.model}-{case.mode.name.replace('+', '-')}"
    table_path = args.trace_dir / f"{base}.txt"
    order = [n for n in case.runs if n not in ("eager", "compile")] + [n for n in ("eager", "compile") if n in case.runs]
    traces, failed, text = [], 0, None
    for name in order:
        path = args.trace_dir / f"{base}-{name}.json"
        started = time.monotonic()
        try:
            if name in ("eager", "compile"):
                run_pytorch(case.model, case.shape, case.mode, args, name == "compile", trace=path)
            else:
                flags = next(f for side, _, f in case.sides if side == name)
                run_runtime(case.model, case.shape, case.mode, args, flags, trace=path)
            traces.append(trace_table.read(name, path))
            text = trace_table.render(traces, top=30)
        except (RunFailed, trace_table.TraceError) as e:
            print(f"{case.model} {case.mode.name} {name}: {e}", file=sys.stderr, flush=True)
            failed += 1
            continue
        table_path.write_text(text + "\n")
        print(f"{case.model} {case.mode.name}: traced {name} ({time.monotonic() - started:.0f} s): {path}",
              file=sys.stderr, flush=True)
    if text is not None:
        print(f"\n== {case.model} {case.mode.name} ==\n{text}", flush=True)
    return failed


def run_round(case, r, deadline):
    """Round `r` of `case` (every side once, the order rotated by `r`), unless the deadline would
    pass before it ends by the time its last round took. True when it ran."""
    if deadline is not None and time.monotonic() + case.round_s > deadline:
        case.cut = True
        return False
    started = time.monotonic()
    figures = rotate_round(r, case.runs)
    params = case.row["params"]["runtime"]
    for name, run in figures.items():
        if run["params"] != params:
            raise RunFailed(f"a {name} run had {run['params']} parameters, not {params}")
    for name, run in figures.items():
        case.figures[name].append(run)
    case.round_s = time.monotonic() - started
    return True


def main():
    started = time.monotonic()
    args = parse_args()
    deadline = None if args.deadline is None else started + args.deadline
    cuda = args.device.startswith("cuda")
    device_name = require_cuda(args) if cuda else "cpu"
    # Today's CPU table, kept as it was for comparisons with earlier figures.
    legacy = (not cuda and args.modes == [Mode("fp32", False)] and references(args.modes[0], args) == ["eager"]
              and len(runtime_sides(args)) == 1 and args.reference_malloc == "default")

    results = []
    cases, failed = cases_of(args, device_name, results)
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        for case in cases:
            failed += trace_case(case, args)
        sys.exit(1 if failed else 0)
    # Breadth first: every case's first round before any case's second, so a deadline (or a
    # kill) leaves a figure for every case rather than three for the first; the JSON is rewritten
    # after every round.
    for r in range(args.rounds):
        for case in cases:
            if case.error:
                continue
            try:
                ran = run_round(case, r, deadline)
            except RunFailed as e:
                print(f"{case.model} {case.mode.name}: {e}", file=sys.stderr, flush=True)
                case.error = case.row["error"] = str(e)
                failed += 1
                ran = False
            if case.done:
                summarise(case, args)
            case.row["cut_by_deadline"] = case.cut
            if ran:
                medians = ", ".join(f"{name} {statistics.median(run['sps'] for run in runs):.1f}"
                                    for name, runs in case.figures.items())
                print(f"{case.model} {case.mode.name}: round {r + 1} of {args.rounds} "
                      f"({case.round_s:.0f} s), median samples/s: {medians}", file=sys.stderr, flush=True)
            write_json(args.json, results)

    if legacy:
        print(f"{'model':<10} {'batch':>5} {'image':>5} {'pytorch s/s':>12} {'runtime s/s':>12} {'ratio':>6}")
    else:
        mem = "peak GiB alloc/reserved" if cuda else "peak RSS GiB"
        print(f"device: {device_name}; peak memory: {mem}; ratio = runtime / reference")
        print(f"{'model':<11} {'mode':<18} {'batch':>5} {'input':>7} {'runtime':<9} {'reference':<9} "
              f"{'ref s/s':>9} {'runtime s/s':>11} {'ratio':>6} {'ref peak':>11} {'runtime peak':>12}")
    for case in cases:
        if case.error or not case.done:
            continue
        s, row = case.shape, case.row
        for label, median, memory, ratios in summarise(case, args):
            for ref in case.refs:
                r = row["references"][ref]
                if legacy:
                    image = s.get("image", s.get("seq_len"))
                    print(f"{case.model:<10} {s['batch']:>5} {image:>5} {r['median']:>12.1f} "
                          f"{median:>12.1f} {ratios[ref]:>6.2f}")
                else:
                    print(f"{case.model:<11} {case.mode.name:<18} {s['batch']:>5} {input_text(s):>7} "
                          f"{label:<9} {ref:<9} {r['median']:>9.1f} {median:>11.1f} "
                          f"{ratios[ref]:>6.2f} {mem_text(r['memory'], cuda):>11} "
                          f"{mem_text(memory, cuda):>12}")
    for case in (c for c in cases if c.cut):
        print(f"{case.model} {case.mode.name}: {case.done} of {args.rounds} rounds before the deadline "
              f"(--deadline {args.deadline:g} s)" + ("; not run" if case.done == 0 else ""))
    sys.stdout.flush()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
