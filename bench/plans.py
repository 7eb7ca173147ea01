#!/usr/bin/env python3
"""Plans proven by running them: `driver plan`'s pick against its runner-up (the best split of
another stage shape), the straight pipeline and pure data parallelism, each run by `runtime` on
the same ranks in one go, with the planner's prediction beside each measurement.

    scripts/bench-plans [--model mlp] [--workers 2] [--hosts 1] [--link-mbit 100] [--rounds 3]

The model is profiled first (`runtime profile`, at the microbatch size and thread count the runs
use), then planned for --schedule (`driver plan --schedule S --alternatives 1`, once more with
`--straight`), and every plan runs that schedule: 1f1b by default, whose prediction includes the
pipeline's fill and drain at --microbatches and one update per minibatch; pipedream's is the
steady state with an update per microbatch. Measured = the median seconds per iteration
(one minibatch) of the last rank, after --warmup iterations, then the median over rounds; the
plans take turns, their order rotating each round.

--hosts H (H > 1, as root) puts the ranks on H network namespaces, consecutive ranks on one,
joined by a bridge whose every link is rate-limited to --link-mbit with `tc` (tbf): ranks on one
namespace talk over its own stack, ranks on two cross the limit. The planner is told the same
two levels: --bandwidth inside a host, the link rate between hosts.

It prints, per plan, predicted and measured ms per minibatch and the prediction's error, marks
the fastest measured, and says whether the pick was fastest and every prediction within 15%.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from side_by_side import free_port, rotate, write_json

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "target" / "release" / "runtime"
DRIVER = ROOT / "target" / "release" / "driver"
TOLERANCE = 0.15

MODELS = {
    # argv that sizes the model the same way for profile and training.
    "mlp": ["--image-size", "32", "--num-classes", "10", "--hidden", "2048"],
    "resnet50": ["--image-size", "64", "--num-classes", "10"],
    "vgg16": ["--image-size", "32", "--num-classes", "10"],
}


def run(argv, **kw):
    done = subprocess.run(argv, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


class Namespaces:
    """H network namespaces on one bridge, each link rate-limited; removed on exit. The bridge
    lives in a namespace of its own (a switch), out of reach of the machine's firewall, which
    on a Docker host drops bridged traffic it did not set up."""

    def __init__(self, hosts, mbit):
        self.hosts, self.mbit = hosts, mbit
        self.tag = f"shp{os.getpid() % 10000}"
        self.bridge = f"{self.tag}br"
        self.switch = f"{self.tag}sw"
        self.names = [f"{self.tag}h{i}" for i in range(hosts)]
        self.addresses = [f"10.213.{os.getpid() % 200}.{i + 1}" for i in range(hosts)]

    def __enter__(self):
        ip, sw = ["ip"], ["ip", "-n", self.switch]
        try:
            run(ip + ["netns", "add", self.switch])
            run(sw + ["link", "add", self.bridge, "type", "bridge"])
            run(sw + ["link", "set", self.bridge, "up"])
            for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
                outside, inside = f"{self.tag}o{i}", f"{self.tag}i{i}"
                run(ip + ["netns", "add", ns])
                run(ip + ["link", "add", outside, "type", "veth", "peer", "name", inside])
                run(ip + ["link", "set", inside, "netns", ns])
                run(ip + ["link", "set", outside, "netns", self.switch])
                run(sw + ["link", "set", outside, "master", self.bridge, "up"])
                run(ip + ["-n", ns, "addr", "add", f"{addr}/24", "dev", inside])
                run(ip + ["-n", ns, "link", "set", inside, "up"])
                run(ip + ["-n", ns, "link", "set", "lo", "up"])
                rate = [f"{self.mbit}mbit", "burst", "256kb", "latency", "100ms"]
                run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", outside, "root", "tbf",
                     "rate"] + rate)
                run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inside, "root", "tbf", "rate"] + rate)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for ns in self.names + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def wrap(self, rank, world, argv):
        host = rank * self.hosts // world
        return ["ip", "netns", "exec", self.names[host]] + argv


def run_plan(args, config, world, namespaces):
    """Runs one plan on `world` ranks; returns the last rank's median seconds per iteration."""
    port = str(free_port())
    master = namespaces.addresses[0] if namespaces else "127.0.0.1"
    argv = [str(RUNTIME), "--model", args.model, *MODELS[args.model],
            "--batch-size", str(args.microbatch * args.microbatches), "--microbatches", str(args.microbatches),
            "--iterations", str(args.iterations), "--threads", str(args.threads), "--schedule", args.schedule,
            "--stage-config", str(config), "--dropout", "0"]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=master, MASTER_PORT=port,
                   LOCAL_RANK="0")
        cmd = namespaces.wrap(rank, world, argv) if namespaces else argv
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a rank failed ({p.returncode}):\n{err[-3000:]}")
    events = [json.loads(line) for line in outs[-1][0].splitlines() if line.startswith("{")]
    times = [e["time_s"] for e in events if e["event"] == "iteration"][args.warmup:]
    return statistics.median(times)


def shape(stages):
    return "-".join(str(s["replicas"]) for s in stages)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", choices=sorted(MODELS))
    p.add_argument("--workers", type=int, default=2, help="ranks (default 2: this machine's cores)")
    p.add_argument("--hosts", type=int, default=1, help="network namespaces to spread the ranks over")
    p.add_argument("--link-mbit", type=int, default=100, help="rate of each host's link, with --hosts")
    p.add_argument("--bandwidth", type=float, default=1.0, help="GB/s the planner assumes inside a host")
    p.add_argument("--microbatch", type=int, default=32, help="samples per microbatch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "pipedream"])
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="per rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    # A TERM unwinds like Ctrl-C, so the namespaces are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.hosts > 1 and args.workers % args.hosts:
        raise SystemExit("--workers must be a multiple of --hosts")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        profile = tmp / "profile.json"
        run([str(RUNTIME), "profile", "--model", args.model, *MODELS[args.model], "--batch-size",
             str(args.microbatch), "--threads", str(args.threads), "--dropout", "0", "--output", str(profile)])
        network = ["--bandwidth", str(args.bandwidth)]
        if args.hosts > 1:
            network = ["--level", f"{args.workers // args.hosts}:{args.bandwidth}",
                       "--bandwidth", str(args.link_mbit / 8000)]
        plan = [str(DRIVER), "plan", "--profile", str(profile), "--workers", str(args.workers),
                "--microbatches", str(args.microbatches), *network]
        plan += ["--schedule", args.schedule]
        run(plan + ["--alternatives", "1", "-o", str(tmp / "pick.json"), "--prediction", str(tmp / "pick.pred.json")])
        run(plan + ["--straight", "-o", str(tmp / "straight.json"), "--prediction", str(tmp / "straight.pred.json")])
        pick = json.loads((tmp / "pick.pred.json").read_text())
        straight = json.loads((tmp / "straight.pred.json").read_text())
        modules = pick["stages"][-1]["end_module"]
        data_parallel = {"module_to_stage_map": [0] * modules,
                         "stage_to_rank_map": {"0": list(range(args.workers))}}
        (tmp / "dp.json").write_text(json.dumps(data_parallel))
        key = "time_per_minibatch_s" if args.schedule == "pipedream" else "flushing_time_per_minibatch_s"
        candidates = {f"pick {shape(pick['stages'])}": (tmp / "pick.json", pick[key])}
        if pick["alternatives"]:
            alt = pick["alternatives"][0]
            (tmp / "runner_up.json").write_text(json.dumps(alt["stage_config"]))
            candidates[f"runner-up {shape(alt['stages'])}"] = (tmp / "runner_up.json", alt[key])
        shapes = {name.split()[-1] for name in candidates}
        if shape(straight["stages"]) not in shapes:
            candidates[f"straight {shape(straight['stages'])}"] = (tmp / "straight.json", straight[key])
        if str(args.workers) not in shapes and pick["data_parallel_time_s"] is not None:
            candidates[f"data-parallel {args.workers}"] = (tmp / "dp.json", pick["data_parallel_time_s"])

        namespaces = Namespaces(args.hosts, args.link_mbit) if args.hosts > 1 else None
        if namespaces:
            namespaces.__enter__()
        try:
            runs = {name: (lambda c=config: run_plan(args, c, args.workers, namespaces))
                    for name, (config, _) in candidates.items()}
            figures = rotate(args.rounds, runs)
        finally:
            if namespaces:
                namespaces.__exit__(None, None, None)

    measured = {name: statistics.median(f) for name, f in figures.items()}
    fastest = min(measured, key=measured.get)
    where = f"{args.hosts} hosts at {args.link_mbit} Mbit/s" if args.hosts > 1 else "one host"
    print(f"{args.model}, {args.workers} ranks on {where}, {args.microbatches} microbatches of {args.microbatch}, "
          f"{args.threads} thread(s) per rank, schedule {args.schedule}")
    print(f"{'plan':<22} {'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    results = []
    for name, (_, predicted) in candidates.items():
        error = predicted / measured[name] - 1
        mark = "  <- fastest" if name == fastest else ""
        print(f"{name:<22} {predicted * 1e3:>13.1f} {measured[name] * 1e3:>12.1f} {error:>+7.0%}{mark}")
        results.append(dict(plan=name, predicted_s=predicted, measured_s=figures[name], error=error))
    pick_name = next(iter(candidates))
    off = [r["plan"] for r in results if abs(r["error"]) > TOLERANCE]
    print("the pick measured fastest" if fastest == pick_name else f"NOT as planned: {fastest} measured fastest")
    print(f"every prediction within {TOLERANCE:.0%}" if not off else
          f"predictions off by more than {TOLERANCE:.0%}: {', '.join(off)}")
    write_json(args.json, dict(model=args.model, workers=args.workers, hosts=args.hosts, link_mbit=args.link_mbit,
                               microbatches=args.microbatches, microbatch=args.microbatch, schedule=args.schedule,
                               results=results,
                               pick_fastest=fastest == pick_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
