#!/usr/bin/env python3
"""The runtime's fused CUDA kernels (`--fused-kernels`) against ATen's, on vgg16's layers, on a GPU.

vgg16 in bf16 + channels_last trails torch.compile (0.74x on an H200) although its convolutions
take the same time on both sides: the rest of a step, ATen's one kernel per operation, takes
about 10 ms against Inductor's 4 (bench/results/trace-vgg16-bf16-channels_last-h200-*.txt). This
probe runs, for every convolution and pool of vgg16 at batch 64 and 224x224 (bf16, channels_last),
what the runtime runs there with ATen's kernels against what it runs with its own
(runtime/csrc/kernels/fusions.cu, compiled here by CuPy's NVRTC as the runtime compiles it):

- `bias_relu` (8 per step): the convolution's bias add and the ReLU where no pool follows;
  ATen: `add_` of the broadcast bias, then `relu_`.
- `bias_relu_pool` (5): the bias add, the ReLU and the 2x2 pool after them in one pass, the
  full-size activation never written (what the runtime runs where a block's last convolution and
  its pool are in one stage); ATen: `add_`, `relu_`, `max_pool2d_with_indices`.
- `bias_relu + pool_forward` (5, not in the total): the same work as two kernels, what the
  runtime runs where a stage ends between the convolution and its pool.
- `relu_bias_backward` (8): ReLU's backward and the bias gradient (the per-channel sum) in one
  pass; ATen: `threshold_backward`, then `sum` over all but the channels.
- `pool_forward` (5, not in the total: `bias_relu_pool` does its work): 2x2 max pooling with
  stride 2 that keeps a byte per output (which of the window's four won) instead of ATen's int64
  index; ATen: `max_pool2d_with_indices`.
- `pool_relu_bias_backward` (5): the pool's backward from those bytes, the ReLU's and the bias's
  before it, in one pass (what the runtime runs where a pool follows its fused bias and ReLU, as
  everywhere in vgg16); ATen: `max_pool2d_with_indices_backward`, `threshold_backward`, `sum`.
- `pool_backward + relu_bias_backward` (5, not in the total): the same work as two kernels, what
  the runtime runs where the pool's input is not the fused ReLU's output as it came.

Each kernel's results are checked against ATen's first: the activations and input gradients bit
for bit (one rounding of the same float sum, and the ReLU commutes with rounding), the bias
gradients, sums of a million terms or more in another order, to 2^-7 of the sum of their terms'
magnitudes after rounding to bf16 as ATen's are. Times are CUDA-event medians over --repeats runs
of every layer, per step (each kind's layers summed). The kernels run in the grids the runtime
gives them, as many blocks as the GPU holds at once (each kernel's registers decide how many a
multiprocessor holds; the probe prints them), and are timed again in grids of 8 blocks a
multiprocessor, as the runtime launched them before 2026-12-06.

    python3 bench/fusion_probe.py [--repeats 20] [--json FILE]

It needs a CUDA GPU, PyTorch and CuPy; without them it says so and exits 2. It times kernels, not
the runtime: bench/runtime_vs_pytorch.py --fused-kernels times the runtime with them.
"""
import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

# The runtime's kernels, as it compiles them (csrc/fusions.cpp).
KERNELS_PATH = Path(__file__).resolve().parent.parent / "runtime/csrc/kernels/fusions.cu"

# vgg16's convolutions at 224x224: (channels, side), a pool after those marked.
LAYERS = [(64, 224, False), (64, 224, True), (128, 112, False), (128, 112, True),
          (256, 56, False), (256, 56, False), (256, 56, True), (512, 28, False), (512, 28, False),
          (512, 28, True), (512, 14, False), (512, 14, False), (512, 14, True)]
BLOCK = 256
# The most shared memory a launch asks (csrc/fusions.cpp's kMostShared): a float for each of at
# most 8 channels a thread.
MOST_SHARED = 8 * BLOCK * 4
# CUDA's CU_FUNC_ATTRIBUTE_NUM_REGS.
NUM_REGS = 4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20, help="timed runs of each side [default: 20]")
    p.add_argument("--json", help="also write the figures here")
    return p.parse_args()


def main():
    args = parse_args()
    try:
        import torch
        import cupy
    except ImportError as e:
        print(f"fusion_probe: needs PyTorch and CuPy: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fusion_probe: no CUDA GPU here", file=sys.stderr)
        return 2
    aten = torch.ops.aten
    module = cupy.RawModule(code=KERNELS_PATH.read_text(), options=("--std=c++17",))
    kernel = {name: module.get_function(name) for name in
              ("bias_relu", "relu_bias_backward", "pool_forward", "pool_backward", "pool_relu_bias_backward",
               "bias_relu_pool")}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # As the runtime launches them (csrc/fusions.cpp): a grid of as many blocks as the device holds
    # at once, given each kernel's registers and the most shared memory a launch asks. Each kind
    # is timed in grids of 8 blocks a multiprocessor too, as the runtime launched them before
    # 2026-12-06 (a second, partial wave where fewer stay).
    driver = cupy.cuda.driver
    resident = {name: driver.occupancyMaxActiveBlocksPerMultiprocessor(f.ptr, BLOCK, MOST_SHARED)
                for name, f in kernel.items()}
    for name, f in kernel.items():
        print(f"{name:24s} {driver.funcGetAttribute(NUM_REGS, f.ptr):3d} registers a thread, "
              f"{resident[name]} blocks of {BLOCK} a multiprocessor", flush=True)
    one_wave = {name: sms * r for name, r in resident.items()}
    eight = {name: sms * 8 for name in kernel}
    grid = dict(one_wave)
    # PyTorch's current stream, so CUDA events on it time the kernels (as they ran on the H200 of
    # 2026-11-29; CuPy 14 calls ExternalStream deprecated).
    warnings.filterwarnings("ignore", message="ExternalStream is deprecated", category=DeprecationWarning)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    n = args.batch_size
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        t = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t

    def launch(name, shared, *params):
        # Every parameter typed as the kernel declares it: pointers 64-bit, counts and lengths
        # 32-bit unsigned.
        with stream:
            kernel[name]((grid[name],), (BLOCK,), tuple(p if isinstance(p, cupy.uint64) else cupy.uint32(p)
                                                    for p in params), shared_mem=shared)

    def ptr(t):
        return cupy.uint64(t.data_ptr())

    def pixels(t):
        # n * h * w of an [n, c, h, w] tensor: the pool kernels' count, and relu_bias_backward's.
        return t.numel() // t.size(1)

    def pooled(y):
        # The pool kernels' last three parameters for their pooled tensor y: its pixels, its row's
        # length, and its channels' 16-byte vectors (runtime/csrc/fusions.cpp's pooled_shape).
        return pixels(y), y.size(3), y.size(1) // 8

    def timed(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def close_sums(ours, theirs, terms, what):
        # Float sums in another order: within 2^-7 of the terms' magnitudes, after bf16 rounding.
        bound = terms.float().abs().sum((0, 2, 3)) * 2.0 ** -7 + 1e-30
        err = (ours.to(torch.bfloat16).float() - theirs.float()).abs()
        assert bool((err <= bound).all()), f"{what}: bias gradients off by up to {float((err / bound).max()):.2f} of the bound"

    results = {}

    def record(kind, layers, aten_ms, fused, in_step=True):
        # `fused` runs the kind's kernels over its layers: timed in one wave, then in grids of 8
        # blocks a multiprocessor.
        fused_ms = timed(fused)
        grid.update(eight)
        eight_ms = timed(fused)
        grid.update(one_wave)
        results[kind] = {"layers": layers, "aten_ms": aten_ms, "fused_ms": fused_ms, "ratio": aten_ms / fused_ms,
                         "fused_8_a_multiprocessor_ms": eight_ms, "in_step": in_step}
        print(f"{kind:36s} {layers:2d} layers  ATen {aten_ms:6.3f} ms  fused {fused_ms:6.3f} ms  "
              f"({aten_ms / fused_ms:.2f}x; 8 blocks a multiprocessor {eight_ms:6.3f} ms)"
              f"{'' if in_step else '  (not in the total)'}", flush=True)

    # Forward: bias and ReLU after each convolution, and the pool after those a pool follows.
    # ATen's run in place on the convolution's output (a copy of it each time, whose time is taken
    # off); the kernels write new tensors.
    cases = []
    for c, side, pooled in LAYERS:
        conv = randn(n, c, side, side)
        bias = randn(c)
        ours = torch.empty_like(conv)
        launch("bias_relu", 0, ptr(conv), ptr(bias), ptr(ours), conv.numel() // 8, c // 8)
        theirs = conv.clone().add_(bias.view(1, c, 1, 1)).relu_()
        assert torch.equal(ours, theirs), f"bias_relu differs from ATen at {c}x{side}"
        pool = None
        if pooled:
            oh = side // 2
            y = torch.empty(n, c, oh, oh, device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)
            win = torch.empty(n, oh, oh, c, device="cuda", dtype=torch.uint8)
            launch("bias_relu_pool", 0, ptr(conv), ptr(bias), ptr(y), ptr(win), *pooled(y))
            assert torch.equal(y, aten.max_pool2d_with_indices(theirs, [2, 2], [2, 2])[0]), \
                f"bias_relu_pool differs from ATen at {c}x{side}"
            y2, win2 = torch.empty_like(y), torch.empty_like(win)
            launch("pool_forward", 0, ptr(ours), ptr(y2), ptr(win2), *pooled(y))
            assert torch.equal(win, win2), f"bias_relu_pool's winners differ from pool_forward's at {c}x{side}"
            pool = (y, win)
        cases.append((conv, bias, ours, torch.empty_like(conv), pool))

    def only(pooled):
        return [case for case in cases if (case[4] is not None) == pooled]

    def copies(pooled):
        for conv, bias, ours, scratch, _ in only(pooled):
            scratch.copy_(conv)

    def aten_bias_relu(pooled):
        for conv, bias, ours, scratch, _ in only(pooled):
            y = scratch.copy_(conv).add_(bias.view(1, -1, 1, 1)).relu_()
            if pooled:
                aten.max_pool2d_with_indices(y, [2, 2], [2, 2])

    def fused_bias_relu(pooled):
        for conv, bias, ours, scratch, _ in only(pooled):
            launch("bias_relu", 0, ptr(conv), ptr(bias), ptr(ours), conv.numel() // 8, conv.size(1) // 8)

    def fused_bias_relu_then_pool():
        fused_bias_relu(True)
        for conv, bias, ours, scratch, (y, win) in only(True):
            launch("pool_forward", 0, ptr(ours), ptr(y), ptr(win), *pooled(y))

    def fused_bias_relu_pool():
        for conv, bias, ours, scratch, (y, win) in only(True):
            launch("bias_relu_pool", 0, ptr(conv), ptr(bias), ptr(y), ptr(win), *pooled(y))

    record("bias_relu", len(only(False)), timed(lambda: aten_bias_relu(False)) - timed(lambda: copies(False)),
           lambda: fused_bias_relu(False))
    aten_pooled = timed(lambda: aten_bias_relu(True)) - timed(lambda: copies(True))
    record("bias_relu_pool", len(only(True)), aten_pooled, fused_bias_relu_pool)
    record("bias_relu + pool_forward", len(only(True)), aten_pooled, fused_bias_relu_then_pool, in_step=False)
    del cases

    # Backward of the ReLU and the bias, where no pool follows.
    cases = []
    for c, side, pooled in LAYERS:
        if pooled:
            continue
        y = randn(n, c, side, side).relu_()
        gy = randn(n, c, side, side)
        g = torch.empty_like(gy)
        db = torch.zeros(c, device="cuda")
        launch("relu_bias_backward", c * 4, ptr(gy), ptr(y), ptr(g), ptr(db), pixels(gy), c // 8)
        g_ref = aten.threshold_backward(gy, y, 0)
        assert torch.equal(g, g_ref), f"relu_bias_backward's gradient differs from ATen's at {c}x{side}"
        close_sums(db, g_ref.sum((0, 2, 3)), g_ref, f"relu_bias_backward at {c}x{side}")
        cases.append((gy, y, g, db))

    def aten_relu_bias_backward():
        for gy, y, g, db in cases:
            aten.threshold_backward(gy, y, 0).sum((0, 2, 3))

    def fused_relu_bias_backward():
        for gy, y, g, db in cases:
            db.zero_()
            launch("relu_bias_backward", db.numel() * 4, ptr(gy), ptr(y), ptr(g), ptr(db),
                   pixels(gy), db.numel() // 8)

    record("relu_bias_backward", len(cases), timed(aten_relu_bias_backward), fused_relu_bias_backward)
    del cases

    # The pools, forward and backward, with the backward of the ReLU and bias before them: one
    # kernel (pool_relu_bias_backward) where the pool's input is the fused ReLU's output, as in
    # vgg16, and two (pool_backward, relu_bias_backward) where it is not; ATen runs three (the
    # pool's backward, threshold_backward, sum).
    cases = []
    for c, side, pooled in LAYERS:
        if not pooled:
            continue
        x = randn(n, c, side, side).relu_()
        oh = side // 2
        y = torch.empty(n, c, oh, oh, device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)
        win = torch.empty(n, oh, oh, c, device="cuda", dtype=torch.uint8)
        launch("pool_forward", 0, ptr(x), ptr(y), ptr(win), *pooled(y))
        y_ref, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
        assert torch.equal(y, y_ref), f"pool_forward differs from ATen at {c}x{side}"
        gy = randn(n, c, oh, oh)
        gx_ref = aten.max_pool2d_with_indices_backward(gy, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
        g_ref = aten.threshold_backward(gx_ref, x, 0)
        # One kernel, from the pooled values alone.
        g1 = torch.empty_like(x)
        db1 = torch.zeros(c, device="cuda")
        launch("pool_relu_bias_backward", c * 4, ptr(gy), ptr(y), ptr(win), ptr(g1), ptr(db1),
               *pooled(y))
        assert torch.equal(g1, g_ref), f"pool_relu_bias_backward's gradient differs from ATen's at {c}x{side}"
        close_sums(db1, g_ref.sum((0, 2, 3)), g_ref, f"pool_relu_bias_backward at {c}x{side}")
        # Two kernels.
        gx, g = torch.empty_like(x), torch.empty_like(x)
        db = torch.zeros(c, device="cuda")
        launch("pool_backward", 0, ptr(gy), ptr(win), ptr(gx), *pooled(y))
        assert torch.equal(gx, gx_ref), f"pool_backward differs from ATen at {c}x{side}"
        launch("relu_bias_backward", c * 4, ptr(gx), ptr(x), ptr(g), ptr(db), pixels(x), c // 8)
        assert torch.equal(g, g_ref), f"relu_bias_backward after the pool differs from ATen at {c}x{side}"
        close_sums(db, g_ref.sum((0, 2, 3)), g_ref, f"the bias gradient before the pool at {c}x{side}")
        cases.append((x, y, win, idx, gy, gx, g, db))

    def aten_pool_forward():
        for x, *_ in cases:
            aten.max_pool2d_with_indices(x, [2, 2], [2, 2])

    def fused_pool_forward():
        for x, y, win, *_ in cases:
            launch("pool_forward", 0, ptr(x), ptr(y), ptr(win), *pooled(y))

    def aten_pool_backward():
        for x, y, win, idx, gy, gx, g, db in cases:
            gx_ = aten.max_pool2d_with_indices_backward(gy, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
            aten.threshold_backward(gx_, x, 0).sum((0, 2, 3))

    def fused_pool_relu_bias_backward():
        for x, y, win, idx, gy, gx, g, db in cases:
            db.zero_()
            launch("pool_relu_bias_backward", db.numel() * 4, ptr(gy), ptr(y), ptr(win), ptr(g), ptr(db),
                   *pooled(y))

    def fused_pool_backward_then_relu():
        for x, y, win, idx, gy, gx, g, db in cases:
            launch("pool_backward", 0, ptr(gy), ptr(win), ptr(gx), *pooled(y))
            db.zero_()
            launch("relu_bias_backward", db.numel() * 4, ptr(gx), ptr(x), ptr(g), ptr(db),
                   pixels(x), db.numel() // 8)

    record("pool_forward", len(cases), timed(aten_pool_forward), fused_pool_forward, in_step=False)
    aten_backward = timed(aten_pool_backward)
    record("pool_relu_bias_backward", len(cases), aten_backward, fused_pool_relu_bias_backward)
    record("pool_backward + relu_bias_backward", len(cases), aten_backward, fused_pool_backward_then_relu,
           in_step=False)
    step = [r for r in results.values() if r["in_step"]]
    aten_ms = sum(r["aten_ms"] for r in step)
    fused_ms = sum(r["fused_ms"] for r in step)
    eight_ms = sum(r["fused_8_a_multiprocessor_ms"] for r in step)
    print(f"{'all':36s}            ATen {aten_ms:6.3f} ms  fused {fused_ms:6.3f} ms  "
          f"(saves {aten_ms - fused_ms:.3f} ms a step; 8 blocks a multiprocessor {eight_ms:6.3f} ms; "
          f"{torch.cuda.get_device_name(0)}, batch {n})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "batch_size": n, "kinds": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
