#!/usr/bin/env python3
"""Bundle-style hybrid parallelism against flat data parallelism and the plain hybrid pipeline, on
the same six `runtime` ranks over c10d Gloo (loopback, CPU), same model, data and settings, in
rounds whose order rotates:

- data parallel: every rank holds the whole model, one all-reduce over six replicas;
- pipeline 4,2: the model in two stages, four replicas of the front, two of the rear, each stage
  all-reducing over all its replicas;
- bundles 4,2: the same stages as two bundles of two fronts and one rear
  (`"bundles": [[0,2,4],[1,3,5]]`): a front's gradients go to its bundle's master, the two
  masters all-reduce, and send the sum back.

For each it prints samples/s (the minibatch over the median iteration time of rank 0, after
warm-up), the reduce's wait a step (the median over ranks of each rank's median `reduce.wait_s`)
and the bytes all ranks sent per iteration: between stages (activations, gradients, targets:
exact) and for the gradient reduce (exact for the bundles' point-to-point messages, a ring
all-reduce's share for each all-reduce), and of those the bytes that cross bundles.

`--baseline-runtime PATH` adds the bundles run by another runtime binary (an earlier build, say)
as a fourth side, in the same rotation: a change's effect on the bundles, side by side.

    scripts/bench-bundle [--hidden 512] [--batch-size 96] [--iterations 8] [--rounds 3]
                         [--baseline-runtime PATH]
"""
import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from side_by_side import free_port, rank_iterations, rotate, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = Path(os.environ.get("STAGEHAND_RUNTIME", ROOT / "target" / "release" / "runtime"))
WORLD = 6
BUNDLES = [[0, 2, 4], [1, 3, 5]]


def stage_config(folder, bundles):
    config = {
        "module_to_stage_map": [0, 0, 0, 1, 1, 1],
        "stage_to_rank_map": {"0": [0, 1, 2, 3], "1": [4, 5]},
    }
    if bundles:
        config["bundles"] = BUNDLES
    path = Path(folder) / ("bundles.json" if bundles else "pipeline.json")
    path.write_text(json.dumps(config))
    return path


def run(args, what, config, runtime=RUNTIME):
    """One run: (samples/s, stage bytes, reduce bytes, bytes crossing bundles, reduce wait in
    seconds) per iteration."""
    cmd = [
        str(runtime), "--model", "mlp", "--layers", "4", "--hidden", str(args.hidden), "--image-size", "16",
        "--batch-size", str(args.batch_size), "--iterations", str(args.iterations), "--lr", "0.02",
        "--data", "synthetic", "--threads", "1", "--backend", "gloo", "--world-size", str(WORLD),
        "--master-port", str(free_port()),
    ]
    if config:
        cmd += ["--stage-config", str(config), "--microbatches", "4"]
    else:
        cmd += ["--microbatches", str(WORLD)]
    its = rank_iterations(cmd, WORLD, what, args.warmup)
    time = statistics.median(i["time_s"] for i in its[0])
    per_iteration = lambda key: sum(statistics.median(key(i) for i in rank) for rank in its)
    stages = per_iteration(lambda i: i["sent_bytes"])
    reduce = per_iteration(lambda i: i["reduce"]["sent_bytes"])
    # Across bundles only the masters' all-reduce goes (stage 0's masters are ranks 0 and 1,
    # stage 1's are both its ranks); every other reduce byte and every stage byte stays inside.
    crossing = sum(statistics.median(i["reduce"]["sent_bytes"] for i in its[r]) for r in (0, 1, 4, 5))
    if what.startswith("bundles 4,2"):
        member = lambda r: statistics.median(i["reduce"]["sent_bytes"] for i in its[r])
        crossing -= member(2) + member(3)  # each master's messages to its member stay inside
    else:
        crossing = None
    wait = statistics.median(statistics.median(i["reduce"]["wait_s"] for i in rank) for rank in its)
    return args.batch_size / time, stages, reduce, crossing, wait


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--baseline-runtime", type=Path, metavar="PATH",
                   help="another runtime binary whose bundles run as a fourth side")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        pipeline, bundles = stage_config(folder, False), stage_config(folder, True)
        sides = {
            "data parallel": lambda: run(args, "data parallel", None),
            "pipeline 4,2": lambda: run(args, "pipeline 4,2", pipeline),
            "bundles 4,2": lambda: run(args, "bundles 4,2", bundles),
        }
        if args.baseline_runtime:
            baseline = "bundles 4,2 (baseline)"
            sides[baseline] = lambda: run(args, baseline, bundles, args.baseline_runtime)
        figures = rotate(args.rounds, sides)
    mib = lambda b: b / (1 << 20)
    print(f"mlp hidden {args.hidden}, batch {args.batch_size}, {WORLD} ranks, medians of {args.rounds} rounds", flush=True)
    for side, runs in figures.items():
        med = lambda k: statistics.median(r[k] for r in runs)
        crossing = f", {mib(med(3)):.2f} MiB of it across bundles" if runs[0][3] is not None else ""
        print(
            f"{side}: {med(0):.0f} samples/s; per iteration {mib(med(1)):.2f} MiB between stages, "
            f"{mib(med(2)):.2f} MiB for the reduce{crossing}; reduce wait {1e3 * med(4):.1f} ms",
            flush=True,
        )
    if args.baseline_runtime:
        med = lambda side: statistics.median(r[0] for r in figures[side])
        print(f"bundles against the baseline runtime ({args.baseline_runtime}): "
              f"{med('bundles 4,2') / med('bundles 4,2 (baseline)'):.2f}x", flush=True)
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
