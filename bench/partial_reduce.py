#!/usr/bin/env python3
"""Partial reduce (SD-PIPE's) against the all-reduce, with a straggler: data-parallel `runtime`
replicas over c10d Gloo (loopback, CPU), one of them `--slowdown`ed, trained with `--reduce all`
and with `--reduce partial:K`, same model, data, seed and settings, in alternating rounds (the
order rotating every round).

Both runs are cut at the same wall time T: the moment the first replica of either run finished
its iterations, so until T every replica of both runs is training. For each side it prints the
samples all replicas took through a step by T per second, and the training loss at T (the mean
over replicas of each one's last three losses before T: the all-reduce reports its minibatch's,
a partial reduce each replica its own microbatches'), and the ratio of samples per second.

    scripts/bench-partial [--replicas 3] [--k 2] [--straggler 2] [--sync-every 10]
                          [--iterations 40] [--rounds 3] [--hidden 512] [--batch-size 96]
"""
import argparse
import os
import statistics
from pathlib import Path

from side_by_side import free_port, rank_iterations, rotate, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = Path(os.environ.get("STAGEHAND_RUNTIME", ROOT / "target" / "release" / "runtime"))


def run(args, reduce):
    """One run: every replica's iterations as (end time since its start, loss, samples)."""
    port = str(free_port())
    cmd = [
        str(RUNTIME), "--model", "mlp", "--layers", "4", "--hidden", str(args.hidden), "--image-size", "16",
        "--batch-size", str(args.batch_size), "--iterations", str(args.iterations), "--lr", "0.02",
        "--momentum", "0.9", "--data", "synthetic", "--threads", "1", "--backend", "gloo",
        "--world-size", str(args.replicas), "--master-port", port, "--reduce", reduce,
        "--sync-every", str(args.sync_every), "--slowdown", f"{args.replicas - 1}={args.straggler}",
    ]
    share = args.batch_size // args.replicas
    ranks = rank_iterations(cmd, args.replicas, f"--reduce {reduce}")
    timelines = []
    for its in ranks:
        clock, line = 0.0, []
        for i in its:
            clock += i["time_s"]
            line.append((clock, i["loss"], share))
        timelines.append(line)
    return timelines


def at(timelines, cut):
    """Samples per second up to `cut` over all replicas, and the loss at `cut`."""
    samples = sum(s for line in timelines for (t, _, s) in line if t <= cut)
    losses = []
    for line in timelines:
        before = [loss for (t, loss, _) in line if t <= cut and loss is not None][-3:]
        if before:
            losses.append(statistics.mean(before))
    return samples / cut, statistics.mean(losses)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--straggler", type=float, default=2.0, help="the last replica's slow-down factor")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    partial = f"partial:{args.k}"
    runs = rotate(args.rounds, {"all": lambda: run(args, "all"), partial: lambda: run(args, partial)})
    figures = {side: [] for side in runs}
    for r in range(args.rounds):
        pair = {side: runs[side][r] for side in runs}
        cut = min(line[-1][0] for timelines in pair.values() for line in timelines)
        for side, timelines in pair.items():
            figures[side].append((cut, *at(timelines, cut)))
    med = lambda side, k: statistics.median(f[k] for f in figures[side])
    print(
        f"mlp hidden {args.hidden}, batch {args.batch_size} over {args.replicas} replicas, the last "
        f"{args.straggler}x slower, {args.iterations} iterations, cut at T = {med('all', 0):.2f} s (median)",
        flush=True,
    )
    for side in runs:
        print(f"--reduce {side}: {med(side, 1):.0f} samples/s up to T, loss at T {med(side, 2):.4f}", flush=True)
    print(f"samples/s {partial} / all: {med(partial, 1) / med('all', 1):.2f}")
    write_json(args.json, {"args": vars(args) | {"json": None}, "figures": figures})


if __name__ == "__main__":
    main()
