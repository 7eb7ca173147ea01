#!/usr/bin/env python3
"""Tables of what one training step does, side by side, from Chrome traces of PyTorch's profiler:
the runtime's (`runtime --profiler-trace FILE`) and the PyTorch references' (`bench/pytorch_eager.py
--profiler-trace FILE`, eager or `--compile`). Each trace's steps are its `ProfilerStep#N` scopes;
every figure is per step (the trace's total over its steps), so traces of different lengths
compare.

    bench/trace_table.py runtime=rt.json eager=eager.json compile=compile.json [--top 25]

With GPU activity in the traces (kernels, copies, memsets) the tables are of the GPU's time, a
step's being what was launched within it: per step, how long the GPU was busy (the union of its
kernels' intervals), how long the step's GPU work took from its first kernel's start to its last
kernel's end and the gaps between (the GPU idle within the step, as when the host waits or
launches too slowly), the kernel count, then the time by part of the iteration (`forward`,
`backward`, `step`: scopes both sides mark; a kernel belongs to the part that launched it), the
host's time in each part (the scopes' own durations, waits for peers in `receive` and `sync`
included), the time by kind of kernel (convolutions, GEMMs, elementwise, ...: a rule of thumb
on kernel names) and the kernels that take the most time, each with its count and time per step
in every trace. Without GPU activity, the tables are of the CPU operators (`aten::` ops) of the traced threads, by self
time (an operator's time less that of the operators it called), each in the part it ran in.

A record's folder of traces (`profiler_trace: true` in an experiment: `experiments/ID/traces`),
or the record itself, stands for every rank's trace in it, each labelled `rank-N`; a bare FILE
is labelled by its name:

    bench/trace_table.py experiments/20261127T101500Z_vgg16/traces

`--json FILE` writes the same figures for scripts.
"""
import argparse
import bisect
import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
# The parts of an iteration both sides mark with scopes of these names (the runtime's also
# `replay`, a whole step replayed from a CUDA graph, and across ranks `receive`, the wait for a
# peer's message and its unpacking, and `sync`, the wait for sends and all-reduces before the
# step); GPU work is its launch's part, CPU work its own.
PARTS = ("forward", "backward", "receive", "sync", "step", "replay")
CPU_CATEGORIES = {"cpu_op"}
STEP = re.compile(r"^ProfilerStep#(\d+)$")
# The category of the GPU timeline's copies of annotated scopes, steps among them.
GPU_STEP_CATEGORY = "gpu_user_annotation"

# Kinds of work by name, the first rule that matches (lower-cased names). Kernel names are the
# libraries' own; this is a reading aid, the per-name table is exact.
KINDS = [
    ("triton (torch.compile)", ("triton_",)),
    ("optimizer", ("multi_tensor_apply", "fused_sgd", "fused_adam", "_foreach_", "sgd", "adam")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("norm", ("batch_norm", "batchnorm", "layer_norm", "layernorm", "welford", "bn_")),
    ("convolution", ("conv", "cudnn", "fprop", "dgrad", "wgrad", "implicit_gemm", "winograd")),
    ("gemm", ("gemm", "cublas", "cutlass", "addmm", "aten::mm", "aten::bmm", "matmul", "linear")),
    ("pool", ("pool",)),
    ("softmax / loss", ("softmax", "nll_loss", "cross_entropy", "log_softmax")),
    ("copy / cast", ("memcpy", "copy", "_to_copy", "cast", "contiguous")),
    ("memset / fill", ("memset", "fill", "zero")),
    ("reduce", ("reduce", "sum", "mean")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "relu", "threshold", "gelu",
                     "dropout", "aten::add", "aten::mul", "aten::div", "where", "clamp", "pointwise")),
]


class TraceError(Exception):
    """A trace this script cannot read, with the reason."""


def kind_of(name):
    # ATen's elementwise kernels for same-dtype operands are `gpu_kernel_impl_nocast<...>`: that
    # "cast" is not a cast (a broadcast bias add is one of them).
    lower = name.lower().replace("_nocast", "")
    for kind, needles in KINDS:
        if any(n in lower for n in needles):
            return kind
    return "other"


def short_name(name, width=100):
    """A kernel's name to print: without `void `, its parameter list, namespaces every ATen kernel
    has, and template arguments below the first level."""
    text = name[5:] if name.startswith("void ") else name
    if text.endswith(")"):  # a signature: cut its parameter list
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                if i > 0 and text[i - 1] != " ":  # `f(...)`, not `Memcpy HtoD (...)`
                    text = text[:i]
                break
    for noise in ("(anonymous namespace)::", "at::native::"):
        text = text.replace(noise, "")
    out, depth = [], 0
    for ch in text:
        if ch == "<":
            depth += 1
            out.append("<" if depth == 1 else "…" if depth == 2 else "")
        elif ch == ">" and depth > 0:
            depth -= 1
            out.append(">" if depth == 0 else "")
        elif depth <= 1:
            out.append(ch)
    text = "".join(out)
    return text if len(text) <= width else text[: width - 1] + "…"


@dataclass
class Trace:
    label: str
    path: Path
    steps: int = 0
    step_ms: list = field(default_factory=list)
    gpu: bool = False
    busy_ms: float = 0.0  # per step
    span_ms: float = 0.0
    count: float = 0.0
    by_name: dict = field(default_factory=dict)  # name -> (count per step, ms per step)
    by_kind: dict = field(default_factory=dict)  # kind -> ms per step
    by_part: dict = field(default_factory=dict)  # part (or "other") -> ms per step
    part_wall: dict = field(default_factory=dict)  # part -> its scopes' host time, ms per step


class Parts:
    """Which part of an iteration a moment fell in, from the trace's part scopes."""

    def __init__(self, events):
        self.spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                            if e.get("cat") == "user_annotation" and e.get("name") in PARTS)
        self.starts = [a for a, _, _ in self.spans]

    def at(self, ts):
        i = bisect.bisect_right(self.starts, ts) - 1
        # Parts do not nest; the latest one to start before `ts` holds it if it had not ended.
        if i >= 0 and ts <= self.spans[i][1]:
            return self.spans[i][2]
        return "other"


def union_length(intervals):
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def self_times(events):
    """Each CPU operator's own time (its duration less its direct children's), per thread."""
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, children's time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                done, children = stack.pop()
                yield done, done["dur"] - children
            if stack:
                stack[-1][1] += e["dur"]
            stack.append([e, 0.0])
        while stack:
            done, children = stack.pop()
            yield done, done["dur"] - children


def read(label, path):
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path} is not a Chrome trace (no traceEvents list)")
    events = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
    # On a GPU, Kineto mirrors each step's scope on the GPU's timeline (`gpu_user_annotation`, a
    # span of microseconds where the step's first kernel ran): a step is the host's scope alone.
    steps = [e for e in events if STEP.match(str(e.get("name", ""))) and e.get("cat") != GPU_STEP_CATEGORY]
    if not steps:
        raise TraceError(f"{path} has no ProfilerStep#N scope; trace with "
                         "`runtime --profiler-trace` or `pytorch_eager.py --profiler-trace`")
    trace = Trace(label, Path(path), steps=len({e["name"] for e in steps}))
    trace.step_ms = [e["dur"] / 1000 for e in steps]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    trace.gpu = bool(gpu)
    n = trace.steps
    names = defaultdict(lambda: [0, 0.0])
    parts, by_part = Parts(events), defaultdict(float)
    if gpu:
        launched = {e["args"]["correlation"]: e["ts"] for e in events
                    if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
        for e in gpu:
            names[e["name"]][0] += 1
            names[e["name"]][1] += e["dur"]
            launch = launched.get(e.get("args", {}).get("correlation"))
            by_part["other" if launch is None else parts.at(launch)] += e["dur"]
        # Each step's GPU work is what was launched within it: its busy time is the union of that
        # work's intervals, its span from the first one's start to the last one's end.
        step_spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in steps)
        step_starts = [a for a, _ in step_spans]
        per_step = defaultdict(list)
        for e in gpu:
            launch = launched.get(e.get("args", {}).get("correlation"), e["ts"])
            i = bisect.bisect_right(step_starts, launch) - 1
            if i >= 0 and launch <= step_spans[i][1]:
                per_step[i].append((e["ts"], e["ts"] + e["dur"]))
        trace.busy_ms = sum(union_length(v) for v in per_step.values()) / 1000 / n
        trace.span_ms = sum(max(b for _, b in v) - min(a for a, _ in v) for v in per_step.values()) / 1000 / n
        trace.count = len(gpu) / n
    else:
        ops = [e for e in events if e.get("cat") in CPU_CATEGORIES]
        for e, own in self_times(ops):
            names[e["name"]][0] += 1
            names[e["name"]][1] += own
            by_part[parts.at(e["ts"])] += own
        trace.busy_ms = sum(v[1] for v in names.values()) / 1000 / n
        trace.count = len(ops) / n
    trace.by_name = {name: (c / n, us / 1000 / n) for name, (c, us) in names.items()}
    trace.by_part = {part: us / 1000 / n for part, us in by_part.items()}
    wall = defaultdict(float)
    for a, b, name in parts.spans:
        wall[name] += b - a
    trace.part_wall = {part: us / 1000 / n for part, us in wall.items()}
    kinds = defaultdict(float)
    for name, (_, ms) in trace.by_name.items():
        kinds[kind_of(name)] += ms
    trace.by_kind = dict(kinds)
    return trace


def table(rows, headers):
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w)
                       for i, (h, w) in enumerate(zip(headers, widths)))]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def render(traces, top):
    """The tables, as text; TraceError when some traces hold GPU activity and others not."""
    if len({t.gpu for t in traces}) > 1:
        raise TraceError("some traces have GPU activity and some not: "
                         + ", ".join(f"{t.label}: {'GPU' if t.gpu else 'CPU only'}" for t in traces))
    gpu = traces[0].gpu
    unit = "GPU" if gpu else "CPU self"
    out = [f"trace_table: {', '.join(f'{t.label}={t.path} ({t.steps} steps)' for t in traces)}"]
    labels = [t.label for t in traces]
    summary = [["step wall time, median (ms)"] + [f"{statistics.median(t.step_ms):.2f}" for t in traces]]
    if gpu:
        summary += [
            ["GPU busy (ms)"] + [f"{t.busy_ms:.2f}" for t in traces],
            ["GPU span (ms)"] + [f"{t.span_ms:.2f}" for t in traces],
            ["GPU idle within the span (ms)"] + [f"{t.span_ms - t.busy_ms:.2f}" for t in traces],
            ["kernels, copies, memsets"] + [f"{t.count:.0f}" for t in traces],
        ]
    else:
        summary += [
            ["operators' self time (ms)"] + [f"{t.busy_ms:.2f}" for t in traces],
            ["operators"] + [f"{t.count:.0f}" for t in traces],
        ]
    out += ["", "per step", table(summary, [""] + labels)]
    order = {p: i for i, p in enumerate(PARTS + ("other",))}
    parts = sorted({p for t in traces for p in t.by_part}, key=lambda p: order.get(p, len(order)))
    rows = [[p] + [f"{t.by_part.get(p, 0):.2f}" for t in traces] for p in parts]
    out += ["", f"{unit} ms per step by part (GPU work: the part that launched it)",
            table(rows, ["part"] + labels)]
    walls = sorted({p for t in traces for p in t.part_wall}, key=lambda p: order.get(p, len(order)))
    rows = [[p] + [f"{t.part_wall.get(p, 0):.2f}" for t in traces] for p in walls]
    out += ["", "host ms per step in each part (its scopes' own time: waits for peers or for the "
            "device included)", table(rows, ["part"] + labels)]
    kinds = sorted({k for t in traces for k in t.by_kind}, key=lambda k: -max(t.by_kind.get(k, 0) for t in traces))
    rows = [[k] + [f"{t.by_kind.get(k, 0):.2f}" for t in traces] for k in kinds]
    out += ["", f"{unit} ms per step by kind", table(rows, ["kind"] + labels)]
    names = sorted({n for t in traces for n in t.by_name},
                   key=lambda n: -max(t.by_name.get(n, (0, 0))[1] for t in traces))[:top]
    rows = []
    for n in names:
        row = [short_name(n)]
        for t in traces:
            c, ms = t.by_name.get(n, (0, 0.0))
            row.append(f"{c:g} / {ms:.3f}" if c else "-")
        rows.append(row)
    out += ["", f"top {len(names)} by {unit} time: count / ms per step",
            table(rows, ["name"] + labels)]
    return "\n".join(out)


RANK_TRACE = re.compile(r"rank-(\d+)\.json")


def sides(specs):
    """(label, path) of each trace the arguments name: LABEL=FILE; a FILE, labelled by its name;
    a record's `traces` folder (or the record), each `rank-N.json` in it labelled `rank-N`."""
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if sep and label and path:
            out.append((label, path))
            continue
        if sep:
            raise TraceError(f"expected LABEL=FILE, FILE or a folder of traces, not '{spec}'")
        path = Path(spec)
        if not path.is_dir():
            out.append((path.stem, spec))
            continue
        folder = path / "traces" if (path / "traces").is_dir() else path
        ranks = sorted((int(m.group(1)), f) for f in folder.iterdir() if (m := RANK_TRACE.fullmatch(f.name)))
        if not ranks:
            raise TraceError(f"{folder} holds no rank-N.json trace; an experiment writes them with "
                             "`profiler_trace: true`")
        out.extend((f"rank-{n}", str(f)) for n, f in ranks)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", metavar="LABEL=FILE|FILE|FOLDER")
    p.add_argument("--top", type=int, default=25, help="how many names the last table lists")
    p.add_argument("--json", type=Path, help="write the figures here too")
    a = p.parse_args(argv)
    traces = []
    try:
        for label, path in sides(a.traces):
            traces.append(read(label, path))
    except TraceError as e:
        raise SystemExit(f"trace_table: {e}")
    try:
        print(render(traces, a.top))
    except TraceError as e:
        raise SystemExit(f"trace_table: {e}")
    if a.json:
        a.json.write_text(json.dumps([{
            "label": t.label, "path": str(t.path), "steps": t.steps, "gpu": t.gpu,
            "step_ms": t.step_ms, "busy_ms": t.busy_ms, "span_ms": t.span_ms, "count": t.count,
            "by_kind": t.by_kind, "by_part": t.by_part, "part_wall": t.part_wall,
            "by_name": {n: {"count": c, "ms": ms} for n, (c, ms) in t.by_name.items()},
        } for t in traces], indent=1))


if __name__ == "__main__":
    sys.exit(main())
