#!/usr/bin/env python3
"""Sparse transfers (SparsePipedream) on a two-stage pipeline of `runtime` ranks over c10d Gloo
(loopback, CPU): `--compress auto` (each activation and gradient in its smallest form by measured
density, rebuilt bit for bit) against `--compress off` (dense), same model, data and settings.
Runs alternate in one go (the first swaps every round). For each side it prints the bytes each
stage sent per iteration (stage 0: activations and targets, stage 1: gradients) against their
dense size, the median step time of the last stage after warm-up and each stage's compute and
waits (on transfers, or on the other stage) in it, and the ratio of step times.

`--link-mbit R` runs the two ranks in two network namespaces of their own joined by a veth pair
whose two ends each send at most R Mbit/s (`tc` token bucket), as two hosts on a slow link would;
it needs root (network namespaces, `ip` and `tc`) and removes the namespaces at its end. Without
it the ranks talk over loopback, where compression only costs.

    scripts/bench-compress [--model vgg16] [--batch-size 16] [--image-size 32] [--microbatches 2]
                           [--iterations 6] [--rounds 3] [--threads 1] [--link-mbit 50]
                           [--layers 4 --hidden 4096 (--model mlp)]
"""
import argparse
import contextlib
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
    sizes = [
        word for flag, value in [("--layers", args.layers), ("--hidden", args.hidden)] if value is not None
        for word in (flag, str(value))
    ]
    return ["--model", args.model, "--batch-size", str(args.batch_size), "--image-size", str(args.image_size), *sizes]


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


@contextlib.contextmanager
def shaped_link(mbit):
    """Two network namespaces joined by a veth pair, each end sending at most `mbit` Mbit/s;
    yields (the address of rank 0's end, a function giving rank R's command prefix). Removed at
    the end, whatever happened."""
    if os.geteuid() != 0:
        raise SystemExit("--link-mbit needs root: it makes network namespaces and shapes their link with tc")
    tag = f"shc{os.getpid()}"
    spaces = [f"{tag}a", f"{tag}b"]
    ends = [f"{tag}x", f"{tag}y"]
    addresses = ["10.231.0.1", "10.231.0.2"]
    sh = lambda *argv: subprocess.run(argv, check=True, capture_output=True, text=True)
    try:
        for space in spaces:
            sh("ip", "netns", "add", space)
        sh("ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for space, end, address in zip(spaces, ends, addresses):
            inside = ["ip", "netns", "exec", space]
            sh("ip", "link", "set", end, "netns", space)
            sh(*inside, "ip", "addr", "add", f"{address}/24", "dev", end)
            sh(*inside, "ip", "link", "set", end, "up")
            sh(*inside, "ip", "link", "set", "lo", "up")
            # A bucket of 64 KiB and half a second of queue: TCP keeps the link busy, as on a
            # switched link of that rate.
            sh(*inside, "tc", "qdisc", "add", "dev", end, "root", "tbf", "rate", f"{mbit}mbit",
               "burst", "64kb", "latency", "500ms")
        yield addresses[0], lambda rank: ["ip", "netns", "exec", spaces[rank]]
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"could not set up the shaped link ({' '.join(e.cmd)}): {e.stderr.strip()}")
    finally:
        for space in spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True)


def run(args, config, compress, link):
    """One two-rank run: (median step time, stage 0's sent and dense bytes, stage 1's, each
    stage's median compute and time waiting, on transfers or the other stage) after warm-up;
    `link` is (master address, command prefix) for a shaped link, or None for loopback."""
    port = str(free_port())
    cmd = [
        str(RUNTIME), *model_args(args), "--iterations", str(args.iterations), "--lr", "0.01",
        "--momentum", "0.9", "--data", "synthetic", "--threads", str(args.threads),
        "--stage-config", str(config), "--schedule", "1f1b", "--microbatches", str(args.microbatches),
        "--backend", "gloo", "--compress", compress, "--world-size", "2", "--master-port", port,
    ]
    prefix = lambda rank: []
    if link:
        cmd += ["--master-addr", link[0]]
        prefix = link[1]
    its = rank_iterations(cmd, 2, f"compress {compress}", args.warmup, prefix=prefix)
    med = lambda rank, key: statistics.median(i[key] for i in its[rank])
    # Waits on transfers and on the other stage (bubbles) alike.
    waiting = lambda rank: statistics.median(i["comm_wait_s"] + i["idle_s"] for i in its[rank])
    return (
        med(1, "time_s"),
        med(0, "sent_bytes"), med(0, "sent_dense_bytes"),
        med(1, "sent_bytes"), med(1, "sent_dense_bytes"),
        med(0, "compute_s"), waiting(0),
        med(1, "compute_s"), waiting(1),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--layers", type=int, help="the MLP's layers (the runtime's default if not given)")
    p.add_argument("--hidden", type=int, help="the MLP's width (the runtime's default if not given)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--link-mbit", type=float, help="run the ranks on two ends of a link of this rate")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    link_mbit = args.link_mbit
    if link_mbit is not None and not link_mbit > 0:
        p.error(f"--link-mbit {link_mbit}: give a rate above 0 (Mbit/s)")
    with tempfile.TemporaryDirectory() as folder, (
        shaped_link(link_mbit) if link_mbit else contextlib.nullcontext()
    ) as link:
        config = halves(args, folder)
        sides = {side: (lambda side=side: run(args, config, side, link)) for side in ["off", "auto"]}
        figures = rotate(args.rounds, sides)
    where = f"a {link_mbit:g} Mbit/s link" if link_mbit else "loopback"
    med = lambda side, k: statistics.median(r[k] for r in figures[side])
    mib = lambda b: b / (1 << 20)
    for side in ["off", "auto"]:
        print(
            f"{args.model} batch {args.batch_size} image {args.image_size}, {args.microbatches} microbatches, "
            f"{where}, compress {side}: step {med(side, 0) * 1000:.0f} ms; per iteration stage 0 sent "
            f"{mib(med(side, 1)):.2f} MiB of {mib(med(side, 2)):.2f} dense ({med(side, 1) / med(side, 2):.0%}), "
            f"stage 1 sent {mib(med(side, 3)):.2f} MiB of {mib(med(side, 4)):.2f} ({med(side, 3) / med(side, 4):.0%}); "
            f"compute / waiting: stage 0 {med(side, 5) * 1000:.0f} / {med(side, 6) * 1000:.0f} ms, "
            f"stage 1 {med(side, 7) * 1000:.0f} / {med(side, 8) * 1000:.0f} ms",
            flush=True,
        )
    print(f"step time auto / off: {med('auto', 0) / med('off', 0):.3f}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
