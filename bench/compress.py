#!/usr/bin/env python3
"""Sparse transfers (SparsePipedream) on a two-stage pipeline of `runtime` ranks over c10d Gloo
(loopback, CPU): `--compress auto` (each activation and gradient in its smallest form by measured
density, rebuilt bit for bit) against `--compress off` (dense), same model, data and settings.
Runs alternate in one go (the first swaps every round). For each side it prints the bytes each
stage sent per iteration (stage 0: activations and targets, stage 1: gradients) against their
dense size, and the median step time of the last stage after warm-up, and the ratio of step times.

    scripts/bench-compress [--model vgg16] [--batch-size 16] [--image-size 32] [--microbatches 2]
                           [--iterations 6] [--rounds 3] [--threads 1]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from side_by_side import free_port, rank_iterations, rotate, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = Path(os.environ.get("STAGEHAND_RUNTIME", ROOT / "target" / "release" / "runtime"))


def model_args(args):
    return ["--model", args.model, "--batch-size", str(args.batch_size), "--image-size", str(args.image_size)]


def halves(args, folder):
    """A stage config cutting the model's modules in two halves."""
    check = subprocess.run([str(RUNTIME), "--check", *model_args(args)], capture_output=True, text=True, check=True)
    modules = json.loads(check.stdout)["modules"]
    config = {
        "module_to_stage_map": [0 if m < modules // 2 else 1 for m in range(modules)],
        "stage_to_rank_map": {"0": [0], "1": [1]},
    }
    path = Path(folder) / "halves.json"
    path.write_text(json.dumps(config))
    return path


def run(args, config, compress):
    """One two-rank run: (median step time, stage 0's sent and dense bytes, stage 1's) after warm-up."""
    port = str(free_port())
    cmd = [
        str(RUNTIME), *model_args(args), "--iterations", str(args.iterations), "--lr", "0.01",
        "--momentum", "0.9", "--data", "synthetic", "--threads", str(args.threads),
        "--stage-config", str(config), "--schedule", "1f1b", "--microbatches", str(args.microbatches),
        "--backend", "gloo", "--compress", compress, "--world-size", "2", "--master-port", port,
    ]
    its = rank_iterations(cmd, 2, f"compress {compress}", args.warmup)
    med = lambda rank, key: statistics.median(i[key] for i in its[rank])
    return (
        med(1, "time_s"),
        med(0, "sent_bytes"), med(0, "sent_dense_bytes"),
        med(1, "sent_bytes"), med(1, "sent_dense_bytes"),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = halves(args, folder)
        figures = rotate(args.rounds, {"off": lambda: run(args, config, "off"), "auto": lambda: run(args, config, "auto")})
    med = lambda side, k: statistics.median(r[k] for r in figures[side])
    mib = lambda b: b / (1 << 20)
    for side in ["off", "auto"]:
        print(
            f"{args.model} batch {args.batch_size} image {args.image_size}, {args.microbatches} microbatches, "
            f"compress {side}: step {med(side, 0) * 1000:.0f} ms; per iteration stage 0 sent "
            f"{mib(med(side, 1)):.2f} MiB of {mib(med(side, 2)):.2f} dense ({med(side, 1) / med(side, 2):.0%}), "
            f"stage 1 sent {mib(med(side, 3)):.2f} MiB of {mib(med(side, 4)):.2f} ({med(side, 3) / med(side, 4):.0%})",
            flush=True,
        )
    print(f"step time auto / off: {med('auto', 0) / med('off', 0):.3f}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
