// The runtime's hand-written CUDA kernels for what lies between vgg16's convolutions (bf16,
// channels_last: a tensor [n, c, h, w] laid out as [n, h, w, c], 8 channels in 16 bytes), compiled
// at run time with NVRTC (csrc/fusions.cpp) and timed against ATen by bench/fusion_probe.py.
// Each does one pass over memory where ATen takes two or three kernels:
//   bias_relu           the convolution's bias and the ReLU (ATen: add_ of the broadcast bias, relu_)
//   relu_bias_backward  ReLU's backward and the bias gradient (threshold_backward, then sum)
//   pool_forward        2x2 max pool, stride 2, keeping a byte per output (which of the window won)
//                       where ATen keeps an int64 index
//   pool_backward       its backward from those bytes (ATen zero-fills, then scatters by index)
//   bias_relu_pool      bias_relu, then pool_forward, in one pass: the full-size activation
//                       between them is neither written nor read again (ATen: add_, relu_,
//                       max_pool2d_with_indices)
//   pool_relu_bias_backward
//                       the pool's backward when its input is bias_relu's output: the pool's,
//                       the ReLU's and the bias's backward in one pass (ATen: the pool's
//                       backward, threshold_backward, sum)
// No header is included: NVRTC compiles this alone. Every kernel's grid strides over its work;
// the launches' shapes are fusions.cpp's. The tests compile this file as C++ too and run it on
// the CPU (csrc/fusions_cpu.cpp, which defines what CUDA gives a kernel): a kernel added here
// goes in csrc/fusions_kernels.hpp's list, and shared memory is the one array `part`.
//
// Indices are 32-bit and count 16-byte vectors (8 channels): the launches take tensors of fewer
// than 2^31 vectors (fusions.cpp's suits), so an index plus a grid's stride stays below 2^32.
// Dividing a 32-bit index by a row's length takes a few instructions where a 64-bit one calls a
// routine of dozens. A block's threads are a multiple of c8, the channels' vectors a pixel
// (suits again), so the vector a thread takes in its pixel, threadIdx.x % c8, is the same on
// every pass of its grid-stride loop.
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

// ReLU's backward from its output y: g where y > 0, else 0 (threshold_backward).
__device__ __forceinline__ bf16 relu_backward(bf16 g, bf16 y) { return (to_float(y) <= 0.f) ? (bf16)0 : g; }

// Zeroes the block's per-channel sums (shared, float[channels]) before any thread adds to them.
__device__ __forceinline__ void zero_channel_sums(float* part, unsigned channels) {
  for (unsigned i = threadIdx.x; i < channels; i += blockDim.x) part[i] = 0.f;
  __syncthreads();
}

// The (pixel, 8-channel group) pairs a thread takes in a grid-stride loop over pixels: its group
// cg, the same on every pass (a block's threads are a multiple of c8), its first pixel, and the
// pixels a pass of the whole grid covers. Pixel p's group cg is vector p * c8 + cg.
struct PixelStride {
  unsigned cg, first, stride;
};

__device__ __forceinline__ PixelStride pixel_stride(unsigned c8) {
  const unsigned per_block = blockDim.x / c8;
  return {threadIdx.x % c8, blockIdx.x * per_block + threadIdx.x / c8, gridDim.x * per_block};
}

// One input row of a 2x2 pool's channels_last input, in 8-channel groups (c8 a pixel, ow
// outputs a row).
__device__ __forceinline__ unsigned input_row(unsigned ow, unsigned c8) { return 2u * ow * c8; }

// Where output p's 2x2 window starts in that input, for the channel group cg; the window's four
// are base, base + c8, base + row and base + row + c8.
__device__ __forceinline__ unsigned window_base(unsigned p, unsigned row, unsigned ow, unsigned c8, unsigned cg) {
  unsigned nh = p / ow, j = p - nh * ow;  // nh = n * (h / 2) + i
  return nh * 2u * row + 2u * j * c8 + cg;
}

// A window's four values (8 channels each), row-major, from base, base + c8, base + row and
// base + row + c8 (window_base's layout).
__device__ __forceinline__ void load_window(const uint4* x, unsigned base, unsigned row, unsigned c8, uint4* v) {
  v[0] = x[base];
  v[1] = x[base + c8];
  v[2] = x[base + row];
  v[3] = x[base + row + c8];
}

// A window's gradient: v[k] at the winner of channel k (ws[k], 0..3 row-major), 0 at the other
// three.
__device__ __forceinline__ void scatter_window(uint4* g, unsigned base, unsigned row, unsigned c8, const bf16* v,
                                               const unsigned char* ws) {
  uint4 out[4];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
#pragma unroll
    for (int q = 0; q < 4; ++q) ((bf16*)&out[q])[k] = (ws[k] == q) ? v[k] : (bf16)0;
  }
  g[base] = out[0];
  g[base + c8] = out[1];
  g[base + row] = out[2];
  g[base + row + c8] = out[3];
}

// relu(v + b), 8 channels, each rounded to bf16 once (as ATen's add_, then relu_, round).
__device__ __forceinline__ uint4 bias_relu8(uint4 v, uint4 b) {
  bf16* vs = (bf16*)&v;
  const bf16* bs = (const bf16*)&b;
#pragma unroll
  for (int k = 0; k < 8; ++k) vs[k] = to_bf16(relu(to_float(vs[k]) + to_float(bs[k])));
  return v;
}

// y[m, c] = relu(x[m, c] + bias[c]) (y may be x), 8 channels (16 bytes) a thread; c8 = channels / 8.
extern "C" __global__ void bias_relu(ptr x_, ptr bias_, ptr y_, unsigned n8, unsigned c8) {
  const uint4* x = (const uint4*)x_;
  uint4* y = (uint4*)y_;
  const uint4 b = ((const uint4*)bias_)[threadIdx.x % c8];  // bias[i % c8] for each i below
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += gridDim.x * blockDim.x) {
    y[i] = bias_relu8(x[i], b);
  }
}

// Adds a thread's 8 channel sums into the block's, then the block's into db (float[channels]).
__device__ __forceinline__ void add_channel_sums(float* part, const float* acc, unsigned cg, unsigned channels,
                                                 float* db) {
#pragma unroll
  for (int k = 0; k < 8; ++k) atomicAdd(&part[cg * 8 + k], acc[k]);
  __syncthreads();
  for (unsigned i = threadIdx.x; i < channels; i += blockDim.x) atomicAdd(&db[i], part[i]);
}

// g = gy where y > 0 (threshold_backward of ReLU's output y), db[c] += sum over rows of g; rows
// of m, 8 channels a thread; blockDim.x a multiple of c8; db zeroed by the caller.
extern "C" __global__ void relu_bias_backward(ptr gy_, ptr y_, ptr g_, ptr db_, unsigned m, unsigned c8) {
  extern __shared__ float part[];
  const uint4* gy = (const uint4*)gy_;
  const uint4* y = (const uint4*)y_;
  uint4* g = (uint4*)g_;
  zero_channel_sums(part, c8 * 8);
  const PixelStride t = pixel_stride(c8);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (unsigned r = t.first; r < m; r += t.stride) {
    const unsigned i = r * c8 + t.cg;
    uint4 a = gy[i], b = y[i], o;
    const bf16* as = (const bf16*)&a;
    const bf16* bs = (const bf16*)&b;
    bf16* os = (bf16*)&o;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      bf16 v = relu_backward(as[k], bs[k]);
      os[k] = v;
      acc[k] += to_float(v);
    }
    g[i] = o;
  }
  add_channel_sums(part, acc, t.cg, c8 * 8, (float*)db_);
}

// The maximum of a 2x2 window's four values v (row-major), 8 channels, into out, and which of
// the four won, a byte a channel, into w. The first maximum wins and a NaN wins, as ATen's
// kernel decides.
__device__ __forceinline__ void pool_window(const uint4* v, uint4& out, uint2& w) {
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
}

// 2x2 max pool, stride 2, channels_last x[n, h, w, c] -> y[n, h/2, w/2, c], and which of the
// window's four won (0..3, row-major), a byte per output ([n, h/2, w/2, c]). Threads take
// (output pixel, 8-channel group) pairs; outs = n * oh * ow.
extern "C" __global__ void pool_forward(ptr x_, ptr y_, ptr win_, unsigned outs, unsigned ow, unsigned c8) {
  const uint4* x = (const uint4*)x_;
  uint4* y = (uint4*)y_;
  uint2* win = (uint2*)win_;
  const unsigned row = input_row(ow, c8);
  const PixelStride t = pixel_stride(c8);
  for (unsigned p = t.first; p < outs; p += t.stride) {
    const unsigned o = p * c8 + t.cg;
    uint4 v[4];
    load_window(x, window_base(p, row, ow, c8, t.cg), row, c8, v);
    uint4 out;
    uint2 w;
    pool_window(v, out, w);
    y[o] = out;
    win[o] = w;
  }
}

// pool_forward of relu(x + bias[c]), where x is the convolution's output: the values pooled are
// bias_relu's, bit for bit, but never stored full-size. win_ may be 0 (no backward to come): then
// the winners are not stored either.
extern "C" __global__ void bias_relu_pool(ptr x_, ptr bias_, ptr y_, ptr win_, unsigned outs, unsigned ow,
                                          unsigned c8) {
  const uint4* x = (const uint4*)x_;
  uint4* y = (uint4*)y_;
  uint2* win = (uint2*)win_;
  const unsigned row = input_row(ow, c8);
  const PixelStride t = pixel_stride(c8);
  const uint4 b = ((const uint4*)bias_)[t.cg];
  for (unsigned p = t.first; p < outs; p += t.stride) {
    const unsigned o = p * c8 + t.cg;
    uint4 v[4];
    load_window(x, window_base(p, row, ow, c8, t.cg), row, c8, v);
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = bias_relu8(v[q], b);
    uint4 out;
    uint2 w;
    pool_window(v, out, w);
    y[o] = out;
    if (win != 0) win[o] = w;
  }
}

// The pool's backward: gx at each window's winner is gy, 0 at the other three (the windows do not
// overlap, so ATen's float accumulation of one term rounds back to gy). outs = n * oh * ow.
extern "C" __global__ void pool_backward(ptr gy_, ptr win_, ptr gx_, unsigned outs, unsigned ow, unsigned c8) {
  const uint4* gy = (const uint4*)gy_;
  const uint2* win = (const uint2*)win_;
  uint4* gx = (uint4*)gx_;
  const unsigned row = input_row(ow, c8);
  const PixelStride t = pixel_stride(c8);
  for (unsigned p = t.first; p < outs; p += t.stride) {
    const unsigned o = p * c8 + t.cg;
    uint4 a = gy[o];
    uint2 w = win[o];
    scatter_window(gx, window_base(p, row, ow, c8, t.cg), row, c8, (const bf16*)&a, (const unsigned char*)&w);
  }
}

// The backward of a 2x2 pool (stride 2) over relu(conv + bias), through the ReLU to the
// convolution's output, and the bias gradient: g at each window's winner is gy where the pooled
// value y (the winner's own value) is > 0, and 0 at the other three; db[c] += the sum of g. The
// pool's input itself is not read: the winner's value decides the ReLU's mask, as
// threshold_backward decides it from the same value. Threads take (output, 8-channel group)
// pairs; blockDim.x a multiple of c8; outs = n * oh * ow; db zeroed by the caller.
extern "C" __global__ void pool_relu_bias_backward(ptr gy_, ptr y_, ptr win_, ptr g_, ptr db_, unsigned outs,
                                                   unsigned ow, unsigned c8) {
  extern __shared__ float part[];
  const uint4* gy = (const uint4*)gy_;
  const uint4* y = (const uint4*)y_;
  const uint2* win = (const uint2*)win_;
  uint4* g = (uint4*)g_;
  zero_channel_sums(part, c8 * 8);
  const unsigned row = input_row(ow, c8);
  const PixelStride t = pixel_stride(c8);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (unsigned p = t.first; p < outs; p += t.stride) {
    const unsigned o = p * c8 + t.cg;
    uint4 a = gy[o], b = y[o];
    uint2 w = win[o];
    const bf16* as = (const bf16*)&a;
    const bf16* bs = (const bf16*)&b;
    bf16 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = relu_backward(as[k], bs[k]);
      acc[k] += to_float(v[k]);
    }
    scatter_window(g, window_base(p, row, ow, c8, t.cg), row, c8, v, (const unsigned char*)&w);
  }
  add_channel_sums(part, acc, t.cg, c8 * 8, (float*)db_);
}
