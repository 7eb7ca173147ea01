"""What every benchmark here shares: runs a reference and ours alternately (which goes first swaps
every round, so drift hits both alike), takes medians, and writes the results as JSON."""
import json
import socket
import statistics
import subprocess


def alternate(rounds, reference, ours):
    """Calls `reference()` and `ours()` `rounds` times each, alternating the order; returns the
    reference's figures, ours, and the ratio of the medians (ours / reference)."""
    theirs, mine = [], []
    for r in range(rounds):
        pair = [(reference, theirs), (ours, mine)]
        for run, figures in pair if r % 2 == 0 else pair[::-1]:
            figures.append(run())
    return theirs, mine, statistics.median(mine) / statistics.median(theirs)


def rotate(rounds, runs):
    """Calls every function of the dict `runs` once per round, `rounds` times, the order rotating
    by one each round (with two, the same A B, B A order as `alternate`); returns the figures of
    each name, in call order."""
    figures = {name: [] for name in runs}
    for r in range(rounds):
        for name, figure in rotate_round(r, runs).items():
            figures[name].append(figure)
    return figures


def rotate_round(r, runs):
    """Round `r` of `rotate`: every function of `runs` called once, the order rotated by `r`;
    returns each name's figure."""
    names = list(runs)
    shift = r % len(names)
    return {name: runs[name]() for name in names[shift:] + names[:shift]}


def throughput(times, batch, warmup):
    """Samples per second over the iterations after `warmup`."""
    kept = times[warmup:]
    return batch * len(kept) / sum(kept)


def rank_iterations(cmd, world, what, warmup=0, timeout=1800, prefix=lambda rank: []):
    """Runs `world` ranks of the runtime command `cmd` (each given `--rank R`, and run through
    `prefix(R)`'s words first, e.g. `ip netns exec NS`; `cmd` holds the world size and a free
    master port) and returns each rank's iteration events after `warmup`; a failed rank stops the
    benchmark with its stderr, `what` saying which run it was."""
    procs = [
        subprocess.Popen(
            prefix(r) + cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"runtime failed ({what}):\n{err}")
    return [
        [json.loads(line) for line in out.splitlines() if '"event":"iteration"' in line][warmup:]
        for out, _ in outs
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path, value):
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=2))
