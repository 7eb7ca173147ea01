#!/usr/bin/env python3
"""Launch latency with the runtime image, side by side with Docker itself: the driver, from its
start until it reports every rank's container started (its whole preflight included: the
training request checked by this machine's runtime, each host's engine, image and mounts,
`runtime info` and the request in a container of the image, the master port, and with several
hosts every host reaching it), against `docker run -d` of the very same containers (image,
command, environment, host network; the argv the driver resolved), all at once, each until the
engine has started it.

The driver's run is interrupted once every rank started (it removes its containers, exit 130);
the reference's containers are removed with `docker rm -f`. Rounds alternate which goes first.
The first, untimed run builds the runtime image when this source version has none yet (minutes),
and sends it to the hosts that lack it.

    scripts/bench-launch [--hosts localhost,localhost] [--rounds 5]

`--hosts` lists one rank per entry. Hosts other than `localhost` are SSH hosts (say the test
bed's, `scripts/testbed up 2` then `--hosts th1,th2`), and the reference runs `ssh HOST docker
run -d ...` for each, all at once, as PipeDream's launcher did one at a time.

Prints each side's median and the ratio (driver / docker) and writes bench/out/launch_runtime.json.
"""
import argparse
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from side_by_side import alternate, free_port, write_json

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "target" / "release" / "driver"


def experiment(work, hosts, name):
    path = work / f"{name}.yml"
    machines = ", ".join(hosts)
    path.write_text(
        f"name: {name}\nmachines: [{machines}]\nmodule: mlp\nbatch_size: 8\niterations: 1000000\n"
        "learning_rate: 0.01\noptimizer: sgd\nseed: 0\ndevice: cpu\nthreads: 1\ndata_dir: synthetic\n"
        "env: {OMP_NUM_THREADS: '1'}\n"
    )
    return path


def driver_launch(driver, config, out, ranks):
    """Seconds from the driver's start until it reported every rank started; then interrupts it and
    returns the record folder too."""
    env = {k: v for k, v in os.environ.items() if k != "STAGEHAND_RUNTIME"}
    started = time.monotonic()
    child = subprocess.Popen(
        [driver, "--config-file", config, "--output-dir", out, "-v", "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    seen, elapsed, lines = 0, None, []
    for line in child.stderr:
        lines.append(line)
        if line.startswith("driver: rank ") and " started on " in line:
            seen += 1
            if seen == ranks:
                elapsed = time.monotonic() - started
                child.send_signal(signal.SIGINT)
    code = child.wait()
    if elapsed is None or code != 130:
        sys.exit(f"the driver did not start {ranks} ranks (exit {code}):\n{''.join(lines[-20:])}")
    record = max(Path(out).iterdir(), key=lambda p: p.stat().st_mtime)
    return elapsed, record


def on(host, argv):
    """`argv` run on `host`: here, or through ssh (which hands its arguments to the remote shell
    as one string, so each is quoted)."""
    if host == "localhost":
        return argv
    return ["ssh", host, " ".join(shlex.quote(a) for a in argv)]


def docker_launch(image, ranks, tag):
    """Seconds until `docker run -d` of every rank (the driver's argv and environment, a new
    master port) returned, all started at once, each on its host; the containers are removed
    afterwards."""
    port = str(free_port())

    def one(rank):
        argv = list(rank["argv"])
        argv[argv.index("--master-port") + 1] = port
        env = dict(rank["env"], MASTER_PORT=port)
        cmd = ["docker", "run", "-d", "--network", "host", "--name", f"{tag}-r{rank['rank']}"]
        for k, v in sorted(env.items()):
            cmd += ["-e", f"{k}={v}"]
        out = subprocess.run(on(rank["on"], cmd + [image] + argv), capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"docker run failed on {rank['on']}: {out.stderr}")

    started = time.monotonic()
    with ThreadPoolExecutor(len(ranks)) as pool:
        list(pool.map(one, ranks))
    elapsed = time.monotonic() - started
    for rank in ranks:
        name = f"{tag}-r{rank['rank']}"
        subprocess.run(on(rank["on"], ["docker", "rm", "-f", name]), capture_output=True)
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="localhost,localhost", help="one rank per entry")
    parser.add_argument("--driver", type=Path, default=DRIVER, help="the driver binary to time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "launch_runtime.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stagehand-bench-launch-"))
    records = work / "records"
    hosts = args.hosts.split(",")
    config = experiment(work, hosts, "bench-launch")
    print("warm-up run (builds the runtime image if this source has none yet) ...", file=sys.stderr)
    _, record = driver_launch(args.driver, config, records, len(hosts))
    plan = json.loads((record / "config.resolved.json").read_text())["plan"]
    image = json.loads((record / "hosts.json").read_text())[0]["image"]
    ranks = [dict(r, on=plan["hosts"][r["host"]]["name"]) for r in plan["ranks"]]
    counter = itertools.count()

    def ours():
        seconds, _ = driver_launch(args.driver, config, records, len(hosts))
        print(f"driver {seconds:.3f} s", file=sys.stderr)
        return seconds

    def reference():
        seconds = docker_launch(image, ranks, f"bench-launch-{os.getpid()}-{next(counter)}")
        print(f"docker {seconds:.3f} s", file=sys.stderr)
        return seconds

    dockers, drivers, ratio = alternate(args.rounds, reference, ours)
    result = {
        "hosts": hosts,
        "rounds": args.rounds,
        "image": image,
        "driver_s": drivers,
        "docker_s": dockers,
        "driver_median_s": statistics.median(drivers),
        "docker_median_s": statistics.median(dockers),
        "ratio": ratio,
    }
    write_json(args.json, result)
    print(f"{'hosts':>24} {'driver (s)':>11} {'docker run (s)':>15} {'driver / docker':>16}")
    print(f"{args.hosts:>24} {result['driver_median_s']:11.3f} {result['docker_median_s']:15.3f} {ratio:16.2f}")


if __name__ == "__main__":
    main()
