#!/usr/bin/env python3
"""Data parallelism on two `runtime` ranks (c10d Gloo on loopback, CPU): the gradient all-reduce
overlapped with the backward pass (`--overlap-reduce on`, DDP's buckets) against the same
all-reduce after the backward (`--overlap-reduce off`), same models, data and settings. Runs
alternate in one go (the first swaps every round); for each side it prints the median step time
(rank 0's iterations after warm-up), the median exposed all-reduce wait per step (`reduce.wait_s`:
the step's time on the all-reduce after the backward) and, overlapped, the window from the first
bucket started to the backward's end (`reduce.overlap_s`), and the ratio of step times.

    scripts/bench-overlap [--models resnet50,vgg16] [--batch-size 8] [--image-size 64]
                          [--bucket-mb 25] [--iterations 6] [--rounds 3] [--threads 1]
"""
import argparse
import os
import statistics
from pathlib import Path

from side_by_side import free_port, rank_iterations, rotate, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = Path(os.environ.get("STAGEHAND_RUNTIME", ROOT / "target" / "release" / "runtime"))


def run(args, model, overlap):
    """One two-rank run; rank 0's (step time, exposed wait, overlap window) medians after warm-up."""
    port = str(free_port())
    cmd = [
        str(RUNTIME), "--model", model, "--batch-size", str(args.batch_size),
        "--image-size", str(args.image_size), "--iterations", str(args.iterations),
        "--lr", "0.01", "--momentum", "0.9", "--data", "synthetic", "--threads", str(args.threads),
        "--schedule", "gpipe", "--microbatches", "2", "--bucket-mb", str(args.bucket_mb),
        "--overlap-reduce", overlap, "--world-size", "2", "--master-port", port,
    ]
    its = rank_iterations(cmd, 2, f"{model}, overlap {overlap}", args.warmup)[0]
    return (
        statistics.median(i["time_s"] for i in its),
        statistics.median(i["reduce"]["wait_s"] for i in its),
        statistics.median(i["reduce"]["overlap_s"] for i in its),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,vgg16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = {}
    for model in args.models.split(","):
        figures = rotate(args.rounds, {"off": lambda: run(args, model, "off"), "on": lambda: run(args, model, "on")})
        off, on = figures["off"], figures["on"]
        med = lambda runs, k: statistics.median(r[k] for r in runs)
        step_on, step_off = med(on, 0), med(off, 0)
        results[model] = {"on": on, "off": off}
        print(
            f"{model} batch {args.batch_size} image {args.image_size}, {args.bucket_mb} MiB buckets: "
            f"step overlapped {step_on * 1000:.0f} ms, after backward {step_off * 1000:.0f} ms, "
            f"ratio {step_on / step_off:.3f}; exposed all-reduce wait overlapped {med(on, 1) * 1000:.0f} ms, "
            f"after backward {med(off, 1) * 1000:.0f} ms; overlap window {med(on, 2) * 1000:.0f} ms",
            flush=True,
        )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
