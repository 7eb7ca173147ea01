"""What every benchmark here shares: runs a reference and ours alternately (which goes first swaps
every round, so drift hits both alike), takes medians, and writes the results as JSON."""
import json
import socket
import statistics


def alternate(rounds, reference, ours):
    """Calls `reference()` and `ours()` `rounds` times each, alternating the order; returns the
    reference's figures, ours, and the ratio of the medians (ours / reference)."""
    theirs, mine = [], []
    for r in range(rounds):
        pair = [(reference, theirs), (ours, mine)]
        for run, figures in pair if r % 2 == 0 else pair[::-1]:
            figures.append(run())
    return theirs, mine, statistics.median(mine) / statistics.median(theirs)


def throughput(times, batch, warmup):
    """Samples per second over the iterations after `warmup`."""
    kept = times[warmup:]
    return batch * len(kept) / sum(kept)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path, value):
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=2))
