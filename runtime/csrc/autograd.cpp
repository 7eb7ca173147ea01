// Autograd entry points tch does not expose, as a C ABI for runtime/src/train/autograd.rs:
// backward from a tensor with an incoming gradient (what a pipeline stage does with the gradient
// its successor sent), and dropping a parameter's gradient (PyTorch's zero_grad(set_to_none=True),
// cheaper than zeroing: no memset, and the next backward writes instead of accumulating).
//
// Tensors are tch's handles, which are pointers to at::Tensor. Every entry point returns nullptr
// on success or a malloc'd message (free it with sh_error_free from c10d_bridge.cpp); no C++
// exception crosses into Rust.

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/autograd.h>

namespace {

char* copy_message(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, message.c_str(), message.size() + 1);
  }
  return out;
}

template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const std::exception& e) {
    return copy_message(e.what());
  } catch (...) {
    return copy_message("unknown C++ exception");
  }
}

}  // namespace

extern "C" {

char* sh_backward_with_grad(const at::Tensor* output, const at::Tensor* grad) {
  return guarded([&] { torch::autograd::backward({*output}, {*grad}); });
}

char* sh_grad_to_none(at::Tensor* param) {
  return guarded([&] { param->mutable_grad().reset(); });
}

}  // extern "C"
