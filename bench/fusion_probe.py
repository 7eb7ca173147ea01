#!/usr/bin/env python3
"""What fused kernels would save on vgg16's work between its convolutions, on a GPU.

vgg16 in bf16 + channels_last trails torch.compile (0.74x on an H200) although its convolutions
take the same time on both sides: the rest of a step, ATen's one kernel per operation, takes
about 10 ms against Inductor's 4 (bench/results/trace-vgg16-bf16-channels_last-h200-*.txt). This
probe runs, for every convolution and pool of vgg16 at batch 64 and 224x224 (bf16, channels_last),
what the runtime's step runs there today, ATen's kernels, against four hand-written kernels that
each do one pass over memory:

- `bias_relu` (13 per step): the convolution's bias add and the ReLU, in place; ATen: `add_` of
  the broadcast bias, then `relu_`.
- `relu_bias_backward` (8): ReLU's backward and the bias gradient (the per-channel sum) in one
  pass; ATen: `threshold_backward`, then `sum` over all but the channels.
- `pool_forward` (5): 2x2 max pooling with stride 2 that keeps a byte per output (which of the
  window's four won) instead of ATen's int64 index; ATen: `max_pool2d_with_indices`.
- `pool_relu_bias_backward` (5): the pool's backward, the ReLU's before it and the bias gradient
  of the convolution before that, in one pass; ATen: `max_pool2d_with_indices_backward`,
  `threshold_backward`, `sum`.

Each hand-written kernel's results are checked against ATen's first: the activations and input
gradients bit for bit (one rounding of the same float sum, and the ReLU commutes with rounding), the
bias gradients, sums of a million products or more in another order, to 2^-7 of the sum of their
terms' magnitudes, then rounded like ATen's to bf16. Times are CUDA-event medians over --repeats
runs of every layer, per step (each kind's layers summed).

    python3 bench/fusion_probe.py [--repeats 20] [--json FILE]

It needs a CUDA GPU, PyTorch and CuPy (which compiles the kernels with NVRTC); without them it
says so and exits 2. It measures kernels, not the runtime: the runtime does not run these yet.
"""
import argparse
import json
import statistics
import sys
import warnings

KERNELS = r"""
typedef unsigned short bf16;
typedef unsigned long long ptr;

__device__ __forceinline__ float to_float(bf16 h) { return __uint_as_float(((unsigned int)h) << 16); }

// Round to nearest even, as c10::BFloat16's conversion does (NaN kept quiet).
__device__ __forceinline__ bf16 to_bf16(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}

// ReLU as clamp_min(x, 0): NaN stays NaN.
__device__ __forceinline__ float relu(float x) { return (x != x || x > 0.f) ? x : 0.f; }

// y[m, c] = relu(y[m, c] + bias[c]) in place, 8 channels (16 bytes) a thread; c8 = channels / 8.
extern "C" __global__ void bias_relu(ptr y_, ptr bias_, long long n8, int c8) {
  uint4* y = (uint4*)y_;
  const uint4* bias = (const uint4*)bias_;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n8;
       i += (long long)gridDim.x * blockDim.x) {
    uint4 v = y[i];
    uint4 b = bias[i % c8];
    bf16* vs = (bf16*)&v;
    const bf16* bs = (const bf16*)&b;
#pragma unroll
    for (int k = 0; k < 8; ++k) vs[k] = to_bf16(relu(to_float(vs[k]) + to_float(bs[k])));
    y[i] = v;
  }
}

// Adds a thread's 8 channel sums into the block's, then the block's into db (float[channels]).
__device__ __forceinline__ void add_channel_sums(float* part, const float* acc, int cg, int channels, float* db) {
#pragma unroll
  for (int k = 0; k < 8; ++k) atomicAdd(&part[cg * 8 + k], acc[k]);
  __syncthreads();
  for (int i = threadIdx.x; i < channels; i += blockDim.x) atomicAdd(&db[i], part[i]);
}

// g = gy where y > 0 (threshold_backward of ReLU's output y), db[c] += sum over rows of g; rows
// of m, 8 channels a thread; blockDim.x a multiple of c8; db zeroed by the caller.
extern "C" __global__ void relu_bias_backward(ptr gy_, ptr y_, ptr g_, ptr db_, long long m, int c8) {
  extern __shared__ float part[];
  const uint4* gy = (const uint4*)gy_;
  const uint4* y = (const uint4*)y_;
  uint4* g = (uint4*)g_;
  for (int i = threadIdx.x; i < c8 * 8; i += blockDim.x) part[i] = 0.f;
  __syncthreads();
  const int cg = threadIdx.x % c8, rows = blockDim.x / c8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (long long r = blockIdx.x * (long long)rows + threadIdx.x / c8; r < m; r += (long long)gridDim.x * rows) {
    long long i = r * c8 + cg;
    uint4 a = gy[i], b = y[i], o;
    const bf16* as = (const bf16*)&a;
    const bf16* bs = (const bf16*)&b;
    bf16* os = (bf16*)&o;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      bf16 v = (to_float(bs[k]) <= 0.f) ? (bf16)0 : as[k];
      os[k] = v;
      acc[k] += to_float(v);
    }
    g[i] = o;
  }
  add_channel_sums(part, acc, cg, c8 * 8, (float*)db_);
}

// 2x2 max pool, stride 2, channels_last x[n, h, w, c] -> y[n, h/2, w/2, c], and which of the
// window's four won (0..3, row-major), a byte per output. The first maximum wins and a NaN wins,
// as ATen's kernel decides.
extern "C" __global__ void pool_forward(ptr x_, ptr y_, ptr win_, long long outs8, int ow, int c8) {
  const uint4* x = (const uint4*)x_;
  uint4* y = (uint4*)y_;
  uint2* win = (uint2*)win_;
  const long long row = 2LL * ow * c8;  // one input row, in 8-channel groups
  for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < outs8;
       o += (long long)gridDim.x * blockDim.x) {
    long long cg = o % c8, p = o / c8, j = p % ow, nh = p / ow;  // nh = n * (h / 2) + i
    long long base = nh * 2 * row + 2 * j * c8 + cg;
    uint4 v[4] = {x[base], x[base + c8], x[base + row], x[base + row + c8]};
    uint4 out;
    uint2 w;
    bf16* os = (bf16*)&out;
    unsigned char* ws = (unsigned char*)&w;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      bf16 kept = ((const bf16*)&v[0])[k];
      float best = to_float(kept);
      int at = 0;
#pragma unroll
      for (int q = 1; q < 4; ++q) {
        bf16 h = ((const bf16*)&v[q])[k];
        float f = to_float(h);
        if (f > best || f != f) {  // ATen's test: a later NaN wins too
          best = f;
          kept = h;
          at = q;
        }
      }
      os[k] = kept;
      ws[k] = (unsigned char)at;
    }
    y[o] = out;
    win[o] = w;
  }
}

// The pool's backward, the ReLU's before it and that convolution's bias gradient: gx at the
// window's winner is gy where the pooled value y > 0 (there x = y), 0 elsewhere; db[c] += the
// sum of gx. Outputs of outs8 = n * oh * ow * c8; blockDim.x a multiple of c8; db zeroed.
extern "C" __global__ void pool_relu_bias_backward(ptr gy_, ptr y_, ptr win_, ptr gx_, ptr db_,
                                                   long long outs, int ow, int c8) {
  extern __shared__ float part[];
  const uint4* gy = (const uint4*)gy_;
  const uint4* y = (const uint4*)y_;
  const uint2* win = (const uint2*)win_;
  uint4* gx = (uint4*)gx_;
  for (int i = threadIdx.x; i < c8 * 8; i += blockDim.x) part[i] = 0.f;
  __syncthreads();
  const int cg = threadIdx.x % c8, per_block = blockDim.x / c8;
  const long long row = 2LL * ow * c8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (long long p = blockIdx.x * (long long)per_block + threadIdx.x / c8; p < outs;
       p += (long long)gridDim.x * per_block) {
    long long o = p * c8 + cg, j = p % ow, nh = p / ow;
    long long base = nh * 2 * row + 2 * j * c8 + cg;
    uint4 a = gy[o], b = y[o];
    uint2 w = win[o];
    const bf16* as = (const bf16*)&a;
    const bf16* bs = (const bf16*)&b;
    const unsigned char* ws = (const unsigned char*)&w;
    uint4 out[4];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      bf16 v = (to_float(bs[k]) <= 0.f) ? (bf16)0 : as[k];
      acc[k] += to_float(v);
#pragma unroll
      for (int q = 0; q < 4; ++q) ((bf16*)&out[q])[k] = (ws[k] == q) ? v : (bf16)0;
    }
    gx[base] = out[0];
    gx[base + c8] = out[1];
    gx[base + row] = out[2];
    gx[base + row + c8] = out[3];
  }
  add_channel_sums(part, acc, cg, c8 * 8, (float*)db_);
}
"""

# vgg16's convolutions at 224x224: (channels, side), a pool after those marked.
LAYERS = [(64, 224, False), (64, 224, True), (128, 112, False), (128, 112, True),
          (256, 56, False), (256, 56, False), (256, 56, True), (512, 28, False), (512, 28, False),
          (512, 28, True), (512, 14, False), (512, 14, False), (512, 14, True)]
BLOCK = 256


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
    module = cupy.RawModule(code=KERNELS, options=("--std=c++17",))
    kernel = {name: module.get_function(name) for name in
              ("bias_relu", "relu_bias_backward", "pool_forward", "pool_relu_bias_backward")}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * 8
    # PyTorch's current stream, so CUDA events on it time the kernels (as they ran on the H200 of
    # 2026-11-29; CuPy 14 calls ExternalStream deprecated).
    warnings.filterwarnings("ignore", message="ExternalStream is deprecated", category=DeprecationWarning)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    n = args.batch_size
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        t = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t

    def launch(name, blocks, shared, *params):
        # Every parameter typed as the kernel declares it: pointers and counts 64-bit, the rest int.
        with stream:
            kernel[name]((blocks,), (BLOCK,), tuple(p if isinstance(p, cupy.uint64) else
                                                    cupy.int64(p) if isinstance(p, Long) else cupy.int32(p)
                                                    for p in params), shared_mem=shared)

    class Long(int):
        pass

    def ptr(t):
        return cupy.uint64(t.data_ptr())

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

    def record(kind, layers, aten_ms, fused_ms):
        results[kind] = {"layers": layers, "aten_ms": aten_ms, "fused_ms": fused_ms, "ratio": aten_ms / fused_ms}
        print(f"{kind:24s} {layers:2d} layers  ATen {aten_ms:6.3f} ms  fused {fused_ms:6.3f} ms  "
              f"({aten_ms / fused_ms:.2f}x)", flush=True)

    # Forward: bias and ReLU after each convolution.
    cases = []
    for c, side, _ in LAYERS:
        conv = randn(n, c, side, side)
        bias = randn(c)
        ours = conv.clone()
        launch("bias_relu", grid, 0, ptr(ours), ptr(bias), Long(conv.numel() // 8), c // 8)
        theirs = conv.clone().add_(bias.view(1, c, 1, 1)).relu_()
        assert torch.equal(ours, theirs), f"bias_relu differs from ATen at {c}x{side}"
        cases.append((conv, bias, ours))

    def aten_bias_relu():
        for conv, bias, out in cases:
            out.copy_(conv)
        for conv, bias, out in cases:
            out.add_(bias.view(1, -1, 1, 1)).relu_()

    def fused_bias_relu():
        for conv, bias, out in cases:
            out.copy_(conv)
        for conv, bias, out in cases:
            launch("bias_relu", grid, 0, ptr(out), ptr(bias), Long(out.numel() // 8), out.size(1) // 8)

    def copies():
        for conv, bias, out in cases:
            out.copy_(conv)

    copy_ms = timed(copies)
    record("bias_relu", len(cases), timed(aten_bias_relu) - copy_ms, timed(fused_bias_relu) - copy_ms)
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
        launch("relu_bias_backward", grid, c * 4, ptr(gy), ptr(y), ptr(g), ptr(db), Long(gy.numel() // c), c // 8)
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
            launch("relu_bias_backward", grid, db.numel() * 4, ptr(gy), ptr(y), ptr(g), ptr(db),
                   Long(gy.numel() // db.numel()), db.numel() // 8)

    record("relu_bias_backward", len(cases), timed(aten_relu_bias_backward), timed(fused_relu_bias_backward))
    del cases

    # The pools, forward and backward (with the ReLU and bias before them).
    cases = []
    for c, side, pooled in LAYERS:
        if not pooled:
            continue
        x = randn(n, c, side, side).relu_()
        oh = side // 2
        y = torch.empty(n, c, oh, oh, device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)
        win = torch.empty(n, oh, oh, c, device="cuda", dtype=torch.uint8)
        launch("pool_forward", grid, 0, ptr(x), ptr(y), ptr(win), Long(y.numel() // 8), oh, c // 8)
        y_ref, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
        assert torch.equal(y, y_ref), f"pool_forward differs from ATen at {c}x{side}"
        gy = randn(n, c, oh, oh)
        gx = torch.empty_like(x)
        db = torch.zeros(c, device="cuda")
        launch("pool_relu_bias_backward", grid, c * 4, ptr(gy), ptr(y), ptr(win), ptr(gx), ptr(db),
               Long(y.numel() // c), oh, c // 8)
        gx_ref = aten.threshold_backward(
            aten.max_pool2d_with_indices_backward(gy, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx), x, 0)
        assert torch.equal(gx, gx_ref), f"pool_relu_bias_backward's gradient differs from ATen's at {c}x{side}"
        close_sums(db, gx_ref.sum((0, 2, 3)), gx_ref, f"pool_relu_bias_backward at {c}x{side}")
        cases.append((x, y, win, idx, gy, gx, db))

    def aten_pool_forward():
        for x, *_ in cases:
            aten.max_pool2d_with_indices(x, [2, 2], [2, 2])

    def fused_pool_forward():
        for x, y, win, *_ in cases:
            launch("pool_forward", grid, 0, ptr(x), ptr(y), ptr(win), Long(y.numel() // 8), y.size(3), y.size(1) // 8)

    def aten_pool_backward():
        for x, y, win, idx, gy, gx, db in cases:
            g = aten.max_pool2d_with_indices_backward(gy, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
            aten.threshold_backward(g, x, 0).sum((0, 2, 3))

    def fused_pool_backward():
        for x, y, win, idx, gy, gx, db in cases:
            db.zero_()
            launch("pool_relu_bias_backward", grid, db.numel() * 4, ptr(gy), ptr(y), ptr(win), ptr(gx), ptr(db),
                   Long(y.numel() // db.numel()), y.size(3), db.numel() // 8)

    record("pool_forward", len(cases), timed(aten_pool_forward), timed(fused_pool_forward))
    record("pool_relu_bias_backward", len(cases), timed(aten_pool_backward), timed(fused_pool_backward))
    aten_ms = sum(r["aten_ms"] for r in results.values())
    fused_ms = sum(r["fused_ms"] for r in results.values())
    print(f"{'all':24s}            ATen {aten_ms:6.3f} ms  fused {fused_ms:6.3f} ms  "
          f"(saves {aten_ms - fused_ms:.3f} ms a step; {torch.cuda.get_device_name(0)}, batch {n})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "batch_size": n, "kinds": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
