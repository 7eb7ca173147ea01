// Autograd entry points tch does not expose, as a C ABI for runtime/src/stage/autograd.rs:
// backward from a tensor with an incoming gradient (what a pipeline stage does with the gradient
// its successor sent), dropping a parameter's gradient (PyTorch's zero_grad(set_to_none=True),
// cheaper than zeroing: no memset, and the next backward writes instead of accumulating), making
// a given tensor a parameter's gradient (DDP's gradient_as_bucket_view: a view into the flat
// buffer its bucket is all-reduced in), and a parameter's post-accumulate-grad hook calling back
// into Rust (what DDP's reducer listens to: the moment a backward has finished writing a
// parameter's gradient).
//
// Tensors are tch's handles, which are pointers to at::Tensor. Every entry point returns nullptr
// on success or a malloc'd message (bridge.hpp's rule; free it with sh_error_free); no C++
// exception crosses into Rust.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>

#include "bridge.hpp"

// Called with the hook's context and the index it was registered with; returns nullptr or a
// malloc'd message, which fails the backward that ran the hook.
typedef char* (*sh_grad_ready_fn)(void* context, int64_t index);

namespace {

// Runs on the thread autograd runs the parameter's AccumulateGrad on (the calling thread for CPU
// parameters, the device's autograd thread for CUDA ones), after the gradient is written.
struct RustGradReady : torch::autograd::PostAccumulateGradHook {
  RustGradReady(sh_grad_ready_fn fn, void* context, int64_t index)
      : fn(fn), context(context), index(index) {}

  void operator()(const torch::autograd::Variable& /*param*/) override {
    char* error = fn(context, index);
    if (error != nullptr) {
      std::string message(error);
      std::free(error);
      TORCH_CHECK(false, message);
    }
  }

  sh_grad_ready_fn fn;
  void* context;
  int64_t index;
};

}  // namespace

extern "C" {

char* sh_backward_with_grad(const at::Tensor* output, const at::Tensor* grad) {
  return sh::guarded([&] { torch::autograd::backward({*output}, {*grad}); });
}

char* sh_grad_to_none(at::Tensor* param) {
  return sh::guarded([&] { param->mutable_grad().reset(); });
}

// What autograd accumulates into from then on: `grad` itself, not a copy. It must match the
// parameter's shape, dtype and device (AccumulateGrad adds into it in place).
char* sh_set_grad(const at::Tensor* param, const at::Tensor* grad) {
  return sh::guarded([&] {
    TORCH_CHECK(param->is_leaf() && param->requires_grad(), "a gradient is set on a parameter");
    TORCH_CHECK(grad->sizes() == param->sizes() && grad->dtype() == param->dtype() &&
                    grad->device() == param->device(),
                "a parameter's gradient must have its shape, dtype and device: ", param->sizes(), " ",
                param->dtype(), " ", param->device(), " against ", grad->sizes(), " ", grad->dtype(), " ",
                grad->device());
    param->mutable_grad() = *grad;
  });
}

// Replaces `param`'s post-accumulate-grad hook with one calling `fn(context, index)`; the hook
// lives with the parameter (not with its AccumulateGrad node, which autograd may recreate), so it
// survives weight stashing's set_data. A null `fn` removes it.
char* sh_set_grad_ready_hook(const at::Tensor* param, sh_grad_ready_fn fn, void* context, int64_t index) {
  return sh::guarded([&] {
    TORCH_CHECK(param->is_leaf() && param->requires_grad(), "a grad-ready hook needs a parameter");
    std::unique_ptr<torch::autograd::PostAccumulateGradHook> hook;
    if (fn != nullptr) {
      hook = std::make_unique<RustGradReady>(fn, context, index);
    }
    torch::autograd::impl::set_post_acc_grad_hooks(*param, std::move(hook));
  });
}

}  // extern "C"
