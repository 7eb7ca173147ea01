// csrc/kernels/fusions.cu's kernels, compiled as C++ and run on the CPU for the tests (see
// fusions_cpu.hpp). The kernels' source is included as it is: what CUDA gives it is defined
// here, for one CPU thread at a time.

#include "fusions_cpu.hpp"
#include "fusions_kernels.hpp"

// The kernels read 16-byte vectors through pointers to their 2-byte halves, as CUDA code does;
// C++'s aliasing rules do not allow it, so this file's optimizer must not assume them.
#pragma GCC optimize("no-strict-aliasing")

#include <ucontext.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// What a kernel sees of CUDA. Thread-local: tests on several threads launch at once.
namespace gpu {

struct Dim {
  unsigned x = 0, y = 0, z = 0;
};

thread_local Dim threadIdx, blockIdx, blockDim, gridDim;

// The block's shared memory. A kernel declares it `extern __shared__ float part[]`, which
// (with __shared__ as thread_local below) names this array; a kernel naming another would leave
// an undefined symbol, which the bridge's link refuses (-z defs).
alignas(16) thread_local float part[sh::cpu_kernels::kMaxShared / sizeof(float)];

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

struct alignas(8) uint2 {
  unsigned x, y;
};

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// One thread runs at a time (a block's in turn, the blocks one after another), so an atomic add
// is a plain one.
inline float atomicAdd(float* at, float value) {
  float old = *at;
  *at = old + value;
  return old;
}

void __syncthreads();

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ thread_local
// The kernels' extern "C" names stay inside the bridge.
#pragma GCC visibility push(hidden)
#include "kernels/fusions.cu"
#pragma GCC visibility pop
#undef __shared__
#undef __forceinline__
#undef __device__
#undef __global__

}  // namespace gpu

// A kernel called with cuLaunchKernel's parameters: a pointer to each argument.
using Kernel = void (*)(void**);

template <typename... A, std::size_t... I>
void call_with(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
  std::tuple<A...> args;
  (std::memcpy(&std::get<I>(args), params[I], sizeof(A)), ...);
  std::apply(kernel, args);
}

template <typename... A>
void call(void (*kernel)(A...), void** params) {
  call_with(kernel, params, std::index_sequence_for<A...>{});
}

template <auto K>
void invoke(void** params) {
  call(K, params);
}

struct Entry {
  const char* name;
  Kernel kernel;
};

// Every kernel of fusions.cu, by the name fusions.cpp launches it by.
#define SH_ENTRY(name) {#name, invoke<gpu::name>},
constexpr Entry kKernels[] = {SH_FUSED_KERNELS(SH_ENTRY)};
#undef SH_ENTRY

// Each of a block's threads is a fiber with a stack of its own.
constexpr std::size_t kStack = 64 * 1024;

enum class State { ready, waiting, done };

// The block being run on this thread: its fibers and where each stands.
struct Block {
  Kernel kernel = nullptr;
  void** params = nullptr;
  ucontext_t scheduler{};
  std::vector<ucontext_t> fibers;
  std::vector<State> states;
  unsigned current = 0;
};

thread_local Block* running = nullptr;

// The block barrier: this thread waits, and the scheduler runs the next.
void gpu::__syncthreads() {
  Block& block = *running;
  unsigned me = block.current;
  block.states[me] = State::waiting;
  if (swapcontext(&block.fibers[me], &block.scheduler) != 0) {
    std::abort();  // nothing to unwind to from a fiber
  }
}

// A thread of the block: the kernel, start to end; returning resumes the scheduler (uc_link).
void fiber_main() {
  Block& block = *running;
  block.kernel(block.params);
  block.states[block.current] = State::done;
}

// Runs every thread of the block, each until it waits at the barrier or returns, and again
// while any waits.
void run_block(Block& block, const char* name, unsigned threads, std::vector<char>& stacks) {
  block.fibers.assign(threads, ucontext_t{});
  block.states.assign(threads, State::ready);
  for (unsigned t = 0; t < threads; ++t) {
    ucontext_t& fiber = block.fibers[t];
    if (getcontext(&fiber) != 0) {
      throw std::runtime_error("getcontext failed");
    }
    fiber.uc_stack.ss_sp = stacks.data() + t * kStack;
    fiber.uc_stack.ss_size = kStack;
    fiber.uc_link = &block.scheduler;
    makecontext(&fiber, fiber_main, 0);
  }
  for (;;) {
    unsigned waiting = 0, done = 0;
    for (unsigned t = 0; t < threads; ++t) {
      if (block.states[t] == State::done) {
        ++done;
        continue;
      }
      block.states[t] = State::ready;
      block.current = t;
      gpu::threadIdx = {t, 0, 0};
      if (swapcontext(&block.scheduler, &block.fibers[t]) != 0) {
        throw std::runtime_error("swapcontext failed");
      }
      block.states[t] == State::done ? ++done : ++waiting;
    }
    if (waiting == 0) {
      return;
    }
    if (done > 0) {
      throw std::runtime_error(std::string(name) + ": " + std::to_string(waiting) + " of a block's " +
                               std::to_string(threads) + " threads reached __syncthreads() after the others had returned");
    }
  }
}

}  // namespace

namespace sh::cpu_kernels {

void launch(const char* name, unsigned blocks, unsigned threads, unsigned shared, void** params) {
  Kernel kernel = nullptr;
  for (const auto& entry : kKernels) {
    if (std::strcmp(entry.name, name) == 0) {
      kernel = entry.kernel;
    }
  }
  if (kernel == nullptr) {
    throw std::runtime_error(std::string("the CPU stand-in has no kernel ") + name);
  }
  if (blocks == 0 || threads == 0 || threads > kMaxThreads) {
    throw std::runtime_error(std::string(name) + ": " + std::to_string(blocks) + " blocks of " + std::to_string(threads) +
                             " threads, where a GPU takes 1 block or more of 1 to " + std::to_string(kMaxThreads));
  }
  if (shared > kMaxShared) {
    throw std::runtime_error(std::string(name) + ": " + std::to_string(shared) + " bytes of shared memory, over " +
                             std::to_string(kMaxShared));
  }
  thread_local std::vector<char> stacks;
  if (stacks.size() < threads * kStack) {
    stacks.resize(threads * kStack);
  }
  Block block;
  block.kernel = kernel;
  block.params = params;
  struct Running {
    explicit Running(Block* b) { running = b; }
    ~Running() { running = nullptr; }
  } on(&block);
  gpu::gridDim = {blocks, 1, 1};
  gpu::blockDim = {threads, 1, 1};
  auto* bytes = reinterpret_cast<unsigned char*>(gpu::part);
  for (unsigned b = 0; b < blocks; ++b) {
    gpu::blockIdx = {b, 0, 0};
    // Every byte 0xff: a float read before it is written is a NaN, and shows.
    std::memset(bytes, 0xff, sizeof gpu::part);
    run_block(block, name, threads, stacks);
    for (std::size_t i = shared; i < sizeof gpu::part; ++i) {
      if (bytes[i] != 0xff) {
        throw std::runtime_error(std::string(name) + ": shared memory written at byte " + std::to_string(i) +
                                 ", past the " + std::to_string(shared) + " the launch gave");
      }
    }
  }
}

}  // namespace sh::cpu_kernels
