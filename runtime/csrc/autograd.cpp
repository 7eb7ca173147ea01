// Autograd entry points tch does not expose, as a C ABI for runtime/src/train/autograd.rs:
// backward from a tensor with an incoming gradient (what a pipeline stage does with the gradient
// its successor sent), and dropping a parameter's gradient (PyTorch's zero_grad(set_to_none=True),
// cheaper than zeroing: no memset, and the next backward writes instead of accumulating).
//
// Tensors are tch's handles, which are pointers to at::Tensor. Every entry point returns nullptr
// on success or a malloc'd message (bridge.hpp's rule; free it with sh_error_free); no C++
// exception crosses into Rust.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/autograd.h>

#include "bridge.hpp"

extern "C" {

char* sh_backward_with_grad(const at::Tensor* output, const at::Tensor* grad) {
  return sh::guarded([&] { torch::autograd::backward({*output}, {*grad}); });
}

char* sh_grad_to_none(at::Tensor* param) {
  return sh::guarded([&] { param->mutable_grad().reset(); });
}

}  // extern "C"
