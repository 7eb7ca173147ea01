#!/usr/bin/env python3
"""Data parallelism: `runtime` replicas (`--world-size N`, no stage config) against PyTorch's
DistributedDataParallel (bench/pytorch_eager.py --ddp, launched as torchrun would: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), same models, shapes, threads per rank, SGD with momentum
and synthetic pools of 4 batches, c10d Gloo on loopback. Runs alternate in one go (the order
rotating every round); it prints the median samples/s of each (the whole minibatch, all replicas
together, over rank 0's iterations after --warmup) and their ratio, runtime / DDP.

    scripts/bench-ddp [--models mlp,resnet50] [--replicas 2] [--rounds 3] [--runtime-flags=...]
                      [--baseline-runtime PATH]

`--batch-size` is the whole minibatch (the runtime's meaning); each DDP rank takes its share.
Each side runs its defaults: DDP overlaps its all-reduce with the backward, the runtime does not
on CPUs (its `--overlap-reduce auto`; `--runtime-flags=--overlap-reduce=on` runs it as DDP does).
Both sides' parameter counts are printed and must be equal. The runtime binary is
$STAGEHAND_RUNTIME, else this checkout's target/release/runtime. `--baseline-runtime PATH` adds
another runtime binary (an earlier build, say) as a third side, the order of the three rotating
every round, and prints the runtime against it too: a change's effect, measured side by side.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from runtime_vs_pytorch import APPLIES, KEEP_TUNABLES, SHAPES, RunFailed, check_params, shape_flags
from side_by_side import free_port, rank_iterations, rotate, throughput, write_json

ROOT = Path(__file__).resolve().parent.parent
EAGER = Path(__file__).resolve().parent / "pytorch_eager.py"
MOMENTUM = 0.9


def common(model, s, args):
    return ["--model", model, *shape_flags(s), "--momentum", str(MOMENTUM),
            "--iterations", str(args.iterations), "--threads", str(args.threads)]


def run_ddp(model, s, args):
    """One DDP run of --replicas ranks; rank 0's samples/s for the whole minibatch."""
    share = dict(s, batch=s["batch"] // args.replicas)
    cmd = [sys.executable, str(EAGER), "--ddp", "--bucket-mb", str(args.bucket_mb), *common(model, share, args)]
    port = str(free_port())
    extra = {"GLIBC_TUNABLES": KEEP_TUNABLES} if args.reference_malloc == "keep" else {}
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.replicas), LOCAL_RANK=str(r),
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra))
        for r in range(args.replicas)
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"a DDP rank failed ({model}, exit {p.returncode}):\n{err[-3000:]}")
    times = json.loads(outs[0][0].splitlines()[-1])["times"]
    return throughput(times, s["batch"], args.warmup)


def run_ours(model, s, args, runtime, waits):
    """One run of --replicas ranks of `runtime`; rank 0's samples/s for the whole minibatch. Adds
    rank 0's `reduce.wait_s` of each timed iteration to the list `waits`."""
    cmd = [str(runtime), *common(model, s, args), "--data", "synthetic",
           "--bucket-mb", str(args.bucket_mb), "--world-size", str(args.replicas),
           "--master-port", str(free_port()), *args.runtime_flags.split()]
    its = rank_iterations(cmd, args.replicas, f"{model}, {args.replicas} replicas", args.warmup)[0]
    waits.extend(i["reduce"]["wait_s"] for i in its)
    return s["batch"] * len(its) / sum(i["time_s"] for i in its)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,resnet50", help=f"comma-separated from {', '.join(APPLIES)}")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-size", type=int, help="the whole minibatch [default: the CPU's of bench-runtime]")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="both sides' bucket size [default: 25]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="per rank")
    p.add_argument("--reference-malloc", choices=["default", "keep"], default="default",
                   help="DDP's ranks on glibc's default malloc settings, or on those the runtime's "
                        "--host-memory keep makes [default: default]")
    p.add_argument("--runtime-flags", default="", help="more flags for every runtime rank")
    p.add_argument("--runtime", type=Path,
                   default=Path(os.environ.get("STAGEHAND_RUNTIME", ROOT / "target" / "release" / "runtime")))
    p.add_argument("--baseline-runtime", type=Path, metavar="PATH",
                   help="another runtime binary, run as a third side with the same flags")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.device = "cpu"
    if args.replicas < 2:
        p.error(f"--replicas {args.replicas}: data parallelism needs 2 or more")
    if args.iterations <= args.warmup:
        p.error(f"--iterations {args.iterations} leaves nothing to time after --warmup {args.warmup}")

    results, failed = [], False
    baseline = args.baseline_runtime is not None
    print(f"{'model':<12} {'batch':>5} {'DDP s/s':>9} {'runtime s/s':>12} {'ratio':>6}"
          + (f" {'baseline s/s':>13} {'vs baseline':>12}" if baseline else ""))
    for model in args.models.split(","):
        if model not in APPLIES:
            p.error(f"--models: unknown model {model!r}; known: {', '.join(APPLIES)}")
        s = dict(SHAPES["cpu"][model], **({"batch": args.batch_size} if args.batch_size else {}))
        if s["batch"] % args.replicas:
            p.error(f"{model}: a minibatch of {s['batch']} does not split into {args.replicas} equal shares")
        try:
            check_params(model, s, args)
        except RunFailed as e:
            print(f"{model}: {e}", file=sys.stderr)
            failed = True
            continue
        waits = {"runtime": []}
        sides = {"ddp": lambda: run_ddp(model, s, args),
                 "runtime": lambda: run_ours(model, s, args, args.runtime, waits["runtime"])}
        if baseline:
            waits["baseline"] = []
            sides["baseline"] = lambda: run_ours(model, s, args, args.baseline_runtime, waits["baseline"])
        figures = rotate(args.rounds, sides)
        med = {side: statistics.median(runs) for side, runs in figures.items()}
        row = dict(model=model, batch=s["batch"], replicas=args.replicas, threads=args.threads,
                   runtime_flags=args.runtime_flags, **figures, ratio=med["runtime"] / med["ddp"])
        line = f"{model:<12} {s['batch']:>5} {med['ddp']:>9.1f} {med['runtime']:>12.1f} {row['ratio']:>6.2f}"
        if baseline:
            row["baseline_runtime"] = str(args.baseline_runtime)
            row["vs_baseline"] = med["runtime"] / med["baseline"]
            line += f" {med['baseline']:>13.1f} {row['vs_baseline']:>12.2f}"
        # The step's wait for the all-reduce after the backward (the runtime's own metrics).
        row["reduce_wait_s"] = waits
        results.append(row)
        print(line, flush=True)
        print("    all-reduce wait a step, median of rank 0's timed iterations: " + ", ".join(
            f"{side} {statistics.median(w) * 1000:.1f} ms" for side, w in row["reduce_wait_s"].items()), flush=True)
        write_json(args.json, results)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
