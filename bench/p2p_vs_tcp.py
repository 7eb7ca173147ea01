#!/usr/bin/env python3
"""Activation send/recv throughput between two `runtime` ranks (c10d gloo point-to-point on
loopback, 64 MiB float tensors by default) against a raw TCP stream on the same loopback
(iperf3, one stream, the same number of bytes). Runs alternate in one go; prints the median of
each in GB/s and their ratio.

    scripts/bench-p2p [--bytes 67108864] [--messages 20] [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from side_by_side import alternate, free_port, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "target" / "release" / "runtime"


def ours(args):
    port = str(free_port())
    cmd = [str(RUNTIME), "p2p-bench", "--bytes", str(args.bytes), "--rounds", str(args.messages)]
    procs = [
        subprocess.Popen(cmd, env=dict(os.environ, RANK=str(r), MASTER_PORT=port), stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("p2p-bench failed")
    return json.loads(outs[1])["gb_per_s"]


def tcp(args):
    port = str(free_port())
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", port], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    try:
        out = subprocess.run(
            ["iperf3", "-c", "127.0.0.1", "-p", port, "-n", str(args.bytes * args.messages), "-J"],
            check=True, capture_output=True, text=True,
        ).stdout
    finally:
        server.wait(timeout=30)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=int, default=64 << 20)
    p.add_argument("--messages", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    b, a, ratio = alternate(args.rounds, lambda: tcp(args), lambda: ours(args))
    o, t = statistics.median(a), statistics.median(b)
    print(f"message {args.bytes} bytes x {args.messages}: runtime (c10d gloo) {o:.2f} GB/s, "
          f"raw TCP (iperf3) {t:.2f} GB/s, ratio {ratio:.2f}")
    write_json(args.json, dict(bytes=args.bytes, runtime=a, tcp=b, ratio=ratio))


if __name__ == "__main__":
    main()
