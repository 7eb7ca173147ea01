#!/usr/bin/env python3
"""Samples/s of `runtime` against PyTorch eager (the venv's torch) training the same model with the
same batch, image size, threads and iterations in one process. Runs alternate (ABBA order) in
one go so drift on the machine hits both sides alike; prints the median of each and their ratio.

    scripts/bench-runtime [--models mlp,vgg16,resnet50] [--rounds 3] ...

Throughput of one run = batch * iterations / seconds, over the iterations after --warmup.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from side_by_side import alternate, throughput, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "target" / "release" / "runtime"
EAGER = Path(__file__).resolve().parent / "pytorch_eager.py"

# Per model: batch, image size, classes, lr. Small inputs keep CPU runs short.
SHAPES = {
    "mlp": dict(batch=64, image=32, classes=10, lr=0.01),
    "vgg16": dict(batch=16, image=32, classes=10, lr=0.001),
    "resnet50": dict(batch=16, image=64, classes=10, lr=0.01),
}


def run_runtime(model, s, args):
    cmd = [
        str(RUNTIME), "--model", model, "--batch-size", str(s["batch"]),
        "--image-size", str(s["image"]), "--num-classes", str(s["classes"]),
        "--iterations", str(args.iterations), "--lr", str(s["lr"]), "--threads", str(args.threads),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    events = [json.loads(line) for line in out.splitlines()]
    return [e["time_s"] for e in events if e["event"] == "iteration"]


def run_pytorch(model, s, args):
    cmd = [
        sys.executable, str(EAGER), "--model", model, "--batch-size", str(s["batch"]),
        "--image-size", str(s["image"]), "--num-classes", str(s["classes"]),
        "--iterations", str(args.iterations), "--lr", str(s["lr"]), "--threads", str(args.threads),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["times"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,vgg16,resnet50")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()

    results = []
    print(f"{'model':<10} {'batch':>5} {'image':>5} {'pytorch s/s':>12} {'runtime s/s':>12} {'ratio':>6}")
    for model in args.models.split(","):
        s = SHAPES[model]
        eager, ours, ratio = alternate(
            args.rounds,
            lambda: throughput(run_pytorch(model, s, args), s["batch"], args.warmup),
            lambda: throughput(run_runtime(model, s, args), s["batch"], args.warmup),
        )
        e, o = statistics.median(eager), statistics.median(ours)
        results.append(dict(model=model, **s, threads=args.threads, pytorch=eager, runtime=ours, ratio=ratio))
        print(f"{model:<10} {s['batch']:>5} {s['image']:>5} {e:>12.1f} {o:>12.1f} {ratio:>6.2f}", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
