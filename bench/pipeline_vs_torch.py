#!/usr/bin/env python3
"""Samples/s of `runtime`'s pipeline against PyTorch's own torch.distributed.pipelining
(ScheduleGPipe, Schedule1F1B) on the same model split, microbatches, threads and gloo on
loopback. Runs alternate in one go; prints the median throughput of each and their ratio.

    scripts/bench-pipeline [--models mlp,resnet50] [--schedules gpipe,1f1b] [--rounds 3]

Throughput of one run = batch * iterations / seconds on the last stage's rank, over the
iterations after --warmup.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from side_by_side import alternate, free_port, throughput, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "target" / "release" / "runtime"
WORKER = Path(__file__).resolve().parent / "torch_pipeline_worker.py"

# Per model: batch, image size, classes, lr and the module-to-stage map (loss last) of 2 stages.
SETUPS = {
    "mlp": dict(batch=64, image=32, classes=10, lr=0.01, split=[0, 0, 0, 1, 1, 1]),
    # conv1, maxpool, 16 blocks, avgpool, fc, loss = 21 modules; cut before layer3.2 for balance.
    "resnet50": dict(batch=16, image=64, classes=10, lr=0.01, split=[0] * 10 + [1] * 11),
}


def run_ranks(commands, env_extra):
    """Starts one process per command with the rank environment; returns the last one's stdout."""
    port = str(free_port())
    procs = []
    for rank, cmd in enumerate(commands):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(commands)), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, LOCAL_RANK=str(rank), **env_extra)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a rank failed ({p.returncode}):\n{err[-3000:]}")
    return outs[-1][0]


def run_torch(model, s, schedule, args):
    cmd = [sys.executable, str(WORKER), "--model", model, "--batch-size", str(s["batch"]),
           "--microbatches", str(args.microbatches), "--iterations", str(args.iterations),
           "--image-size", str(s["image"]), "--num-classes", str(s["classes"]), "--threads", str(args.threads),
           "--lr", str(s["lr"]), "--schedule", schedule, "--module-to-stage", ",".join(map(str, s["split"]))]
    out = run_ranks([cmd, cmd], {})
    return json.loads(out)["times"]


def run_ours(model, s, schedule, args, config):
    cmd = [str(RUNTIME), "--model", model, "--batch-size", str(s["batch"]), "--microbatches", str(args.microbatches),
           "--iterations", str(args.iterations), "--image-size", str(s["image"]), "--num-classes", str(s["classes"]),
           "--threads", str(args.threads), "--lr", str(s["lr"]), "--schedule", schedule, "--stage-config", config,
           "--dropout", "0"]
    out = run_ranks([cmd, cmd], {})
    events = [json.loads(line) for line in out.splitlines()]
    return [e["time_s"] for e in events if e["event"] == "iteration"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,resnet50")
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="per rank")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    results = []
    print(f"{'model':<10} {'schedule':<9} {'torch s/s':>10} {'runtime s/s':>12} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            s = SETUPS[model]
            config = Path(tmp) / f"{model}.json"
            config.write_text(json.dumps({"module_to_stage_map": s["split"], "stage_to_rank_map": {"0": [0], "1": [1]}}))
            for schedule in args.schedules.split(","):
                theirs, ours, ratio = alternate(
                    args.rounds,
                    lambda: throughput(run_torch(model, s, schedule, args), s["batch"], args.warmup),
                    lambda: throughput(run_ours(model, s, schedule, args, str(config)), s["batch"], args.warmup),
                )
                t, o = statistics.median(theirs), statistics.median(ours)
                results.append(dict(model=model, schedule=schedule, microbatches=args.microbatches,
                                    threads=args.threads, torch=theirs, runtime=ours, ratio=ratio))
                print(f"{model:<10} {schedule:<9} {t:>10.1f} {o:>12.1f} {ratio:>6.2f}", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
