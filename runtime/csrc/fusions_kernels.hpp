// Every kernel of csrc/kernels/fusions.cu, by its extern "C" name: fusions.cpp compiles, loads
// and launches these, and fusions_cpu.cpp runs the same on the CPU, both from this one list.
// SH_FUSED_KERNELS(X) expands to X(name) for each.

#pragma once

#define SH_FUSED_KERNELS(X)        \
  X(bias_relu)                     \
  X(relu_bias_backward)            \
  X(pool_forward)                  \
  X(pool_backward)                 \
  X(pool_relu_bias_backward)       \
  X(bias_relu_pool)
