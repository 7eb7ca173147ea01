"""Launch and image distribution on the multi-host test bed (scripts/testbed), side by side.

Two ratios, each of medians over alternating rounds:

- distribution: sending an image from th1 to three hosts at once against sending it to one
  (the driver's build-once-and-stream path; a receiver's `image_seconds` in hosts.json, the
  slowest receiver for three). Before every round the receivers' images are deleted, so each load
  writes every layer.
- launch: a whole driver run of `sleep 1` on three hosts against one (wall time of the driver,
  preflight included), the image already everywhere.

The image is a build context made here (FROM stagehand-torch:2.11.0-cpu, about 0.7 GB, plus a
one-line layer whose build argument changes every round, so every round builds anew on th1 in a
second and sends the whole image). Only th1 gets the torch image (`docker save | ssh th1 docker
load`).

    scripts/bench-testbed [--rounds 3]

Prints a table and writes bench/out/testbed_launch.json. Takes the bed (5 hosts); leaves it down.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "target" / "release" / "driver"
TESTBED = ROOT / "scripts" / "testbed"
TORCH_IMAGE = "stagehand-torch:2.11.0-cpu"
LOCK = "/run/lock/stagehand-testbed-tests.lock"


def sh(*args, input=None, check=True):
    out = subprocess.run(args, input=input, capture_output=True)
    if check and out.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed: {out.stderr.decode(errors='replace')}")
    return out


def ssh(host, *command):
    return sh("ssh", "-o", "ConnectTimeout=3", host, *command)


def load_torch_image(host):
    save = subprocess.Popen(["docker", "save", TORCH_IMAGE], stdout=subprocess.PIPE)
    load = subprocess.run(["ssh", host, "docker", "load", "-q"], stdin=save.stdout, capture_output=True)
    save.wait()
    if save.returncode != 0 or load.returncode != 0:
        sys.exit(f"moving {TORCH_IMAGE} to {host} failed: {load.stderr.decode(errors='replace')}")


def wipe_images(host):
    """Deletes every image on `host` (the bed's engines hold nothing else)."""
    ids = ssh(host, "docker", "images", "-aq").stdout.decode().split()
    if ids:
        sh("ssh", host, "docker", "rmi", "-f", *sorted(set(ids)), check=False)


def run_driver(work, name, body):
    exp = work / f"{name}.yml"
    exp.write_text(f"name: {name}\n{body}")
    started = time.monotonic()
    out = subprocess.run(
        [DRIVER, "--config-file", exp, "--output-dir", work / "records", "-q", "--no-progress"],
        capture_output=True,
        env={k: v for k, v in os.environ.items() if k != "STAGEHAND_RUNTIME"},
    )
    wall = time.monotonic() - started
    if out.returncode != 0:
        sys.exit(f"driver run {name} failed ({out.returncode}): {out.stderr.decode(errors='replace')}")
    record = sorted((work / "records").glob(f"*_{name}"))[-1]
    hosts = json.loads((record / "hosts.json").read_text())
    return wall, {h["host"]: h for h in hosts}


def distribute(work, context, tag, receivers):
    machines = ", ".join(["th1"] + receivers)
    body = (
        f"machines: [{machines}]\ncontainer: {{build: '{context}', args: {{ROUND: '{tag}'}}}}\n"
        "command: ['true']\n"
    )
    _, hosts = run_driver(work, f"dist-{tag}", body)
    for r in receivers:
        if hosts[r].get("image_received_from") != "th1":
            sys.exit(f"{r} did not receive the image from th1: {hosts[r]}")
    return max(hosts[r]["image_seconds"] for r in receivers)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import fcntl

    lock = open(LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    work = Path(tempfile.mkdtemp(prefix="stagehand-bench-testbed-"))
    context = work / "ctx"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {TORCH_IMAGE}\nARG ROUND\nRUN echo \"$ROUND\" > /round\n")
    try:
        sh(TESTBED, "up", "5")
        load_torch_image("th1")
        one, three = [], []
        for r in range(args.rounds):
            order = [("one", ["th2"]), ("three", ["th3", "th4", "th5"])]
            if r % 2:
                order.reverse()
            for which, receivers in order:
                for h in receivers:
                    wipe_images(h)
                seconds = distribute(work, context, f"r{r}-{which}", receivers)
                (one if which == "one" else three).append(seconds)
                print(f"round {r}: to {len(receivers)} host(s) {seconds:.1f} s", file=sys.stderr)

        # Launch: the last image is on th1 and th3..th5; put it on th2 too, then time runs.
        distribute(work, context, "launch", ["th2", "th3"])
        launch1, launch3 = [], []
        for r in range(args.rounds):
            order = [("one", "th1"), ("three", "th1, th2, th3")]
            if r % 2:
                order.reverse()
            for which, machines in order:
                body = (
                    f"machines: [{machines}]\ncontainer: {{build: '{context}', args: {{ROUND: 'launch'}}}}\n"
                    "command: [sleep, '1']\n"
                )
                wall, _ = run_driver(work, f"launch-{r}-{which}", body)
                (launch1 if which == "one" else launch3).append(wall)
    finally:
        subprocess.run([TESTBED, "down"], capture_output=True)
        lock.close()

    result = {
        "rounds": args.rounds,
        "image_bytes_note": f"{TORCH_IMAGE} plus one small layer",
        "distribute_to_1_s": one,
        "distribute_to_3_s": three,
        "distribute_ratio": statistics.median(three) / statistics.median(one),
        "launch_1_host_s": launch1,
        "launch_3_hosts_s": launch3,
        "launch_ratio": statistics.median(launch3) / statistics.median(launch1),
    }
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "testbed_launch.json").write_text(json.dumps(result, indent=2))
    print(f"{'':24} {'1 host':>10} {'3 hosts':>10} {'ratio':>7} {'target':>7}")
    print(
        f"{'image distribution (s)':24} {statistics.median(one):10.1f} {statistics.median(three):10.1f} "
        f"{result['distribute_ratio']:7.2f} {'<= 1.5':>7}"
    )
    print(
        f"{'launch, driver wall (s)':24} {statistics.median(launch1):10.1f} {statistics.median(launch3):10.1f} "
        f"{result['launch_ratio']:7.2f} {'<= 1.2':>7}"
    )


if __name__ == "__main__":
    main()
