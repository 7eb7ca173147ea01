// Runs csrc/kernels/fusions.cu's kernels on the CPU, as written, for the tests: the CPU stand-in
// of csrc/fusions.cpp launches them here with the grid, block and shared memory a GPU gets, so
// their indexing, masks, sums and launch shapes are tested where there is no GPU.
//
// A block's threads run in turn on the calling thread, each as a fiber (ucontext) of its own:
// a thread runs until it reaches __syncthreads() or returns, then the next; when every thread of
// the block waits at the barrier, they all go on. Blocks run one after another. So what this
// checks is what a kernel computes, not how a GPU's memory orders it: a race a GPU could show,
// this may not.
//
// fusions_cpu.cpp compiles the kernels' source as C++, with none of libtorch's or CUDA's headers
// in sight, so the kernels' own names (uint4, relu ...) clash with nothing.

#pragma once

namespace sh::cpu_kernels {

// The shared memory a block may take: CUDA's default limit without an opt-in, 48 KiB.
constexpr unsigned kMaxShared = 48 * 1024;

// The threads a block may have, as on every GPU since compute capability 2.0.
constexpr unsigned kMaxThreads = 1024;

// Runs fusions.cu's kernel `name` over `blocks` blocks of `threads` threads each, with `shared`
// bytes of dynamic shared memory, its parameters given as cuLaunchKernel takes them (a pointer
// to each). Throws std::runtime_error naming what is wrong: an unknown kernel, a grid or block
// a GPU would refuse, more shared memory than kMaxShared, a barrier that some of a block's
// threads reached after others had returned, or shared memory written past `shared` bytes.
void launch(const char* name, unsigned blocks, unsigned threads, unsigned shared, void** params);

}  // namespace sh::cpu_kernels
