// The optimizer step as a C ABI for runtime/src/stage/optim/fused.rs: PyTorch's fused multi-tensor
// kernels (`_fused_sgd_`, `_fused_adam_`, `_fused_adamw_`) over all of a stage's parameters at
// once, as `torch.optim.SGD/Adam/AdamW(fused=True)` call them. Hyper-parameters, the learning rate
// included, travel as doubles, so a step copies nothing from host to device and never waits for
// the stream (a step captured in a CUDA graph takes the learning rate as a 0-dim float32 tensor on
// the device instead, which the kernels read when they run, as torch.optim does with a tensor lr); Adam's step counts are float tensors on the parameters' device that
// `_foreach_add_` increments there.
//
// Parameters are updated through `variable_data()` aliases (what Python's `.data` gives): the same
// storage under a new version counter. PipeDream's weight stashing steps the weights while other
// microbatches' autograd graphs that saved them still wait for their backward; bumping the
// parameters' own version counters would make those backwards fail.
//
// Every entry point returns nullptr on success or a malloc'd message (free it with sh_error_free
// from c10d_bridge.cpp); no C++ exception crosses into Rust. Tensors arrive as `at::Tensor*`
// (what tch's `Tensor::as_ptr()` points at); the caller passes only parameters with a gradient.
//
// fp16's gradient scaler skips a step on the device: a non-null `found_inf` (a one-element float32
// tensor, exactly 1.0 when some gradient held an inf or a nan) makes the kernels leave parameters
// and state untouched, and Adam's step counts are decremented by it again, as torch.optim's fused
// path does. Nothing reads the flag on the host, so a step neither waits for the stream nor breaks
// a CUDA graph capture.

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_sub.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "bridge.hpp"

namespace {

using sh::guarded;

// One kernel launch's worth of tensors: the fused kernels take one device and one dtype per call
// (torch.optim groups the same way, `_group_tensors_by_device_and_dtype`). Column 0 holds the
// parameters' aliases, column 1 their gradients, then the optimizer's state lists.
struct Group {
  c10::Device device;
  c10::ScalarType dtype;
  std::vector<std::vector<at::Tensor>> columns;
};

// Whether `a` and `b` lay their elements out in memory in the same order, as the CPU kernels
// assume when they walk parameter, gradient and state as flat arrays. Strides of size-1
// dimensions do not matter (autograd's layout contract ignores them too).
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || !a.is_non_overlapping_and_dense() ||
      !b.is_non_overlapping_and_dense()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) {
      return false;
    }
  }
  return true;
}

// The parameter alias, its gradient, its state tensors shaped like it (`like_param`) and its
// step count (if `step` is defined), checked against the fused kernels' assumptions, appended to
// the group of the parameter's device and dtype.
void add_to_group(std::vector<Group>& groups, const at::Tensor* param,
                  std::vector<at::Tensor> like_param, at::Tensor step = at::Tensor()) {
  TORCH_CHECK(param != nullptr && param->defined(), "the optimizer got an undefined parameter");
  const at::Tensor& grad = param->grad();
  TORCH_CHECK(grad.defined(), "the optimizer got a parameter without a gradient");
  TORCH_CHECK(!grad.is_sparse(), "the fused optimizer does not take sparse gradients");
  TORCH_CHECK(grad.device() == param->device() && grad.scalar_type() == param->scalar_type(),
              "a gradient is on ", grad.device(), " as ", grad.scalar_type(),
              ", its parameter on ", param->device(), " as ", param->scalar_type());
  // Autograd's layout contract gives a dense parameter's gradient the parameter's layout.
  TORCH_CHECK(same_layout(grad, *param),
              "a gradient's layout differs from its parameter's: sizes ", grad.sizes(), " strides ",
              grad.strides(), " for a parameter of sizes ", param->sizes(), " strides ",
              param->strides());
  for (const auto& s : like_param) {
    TORCH_CHECK(same_layout(s, *param) && s.device() == param->device() &&
                    s.scalar_type() == param->scalar_type(),
                "an optimizer state tensor differs from its parameter in layout, device or dtype");
  }
  if (step.defined()) {
    TORCH_CHECK(step.dim() == 0 && step.scalar_type() == at::kFloat &&
                    step.device() == param->device(),
                "a step count must be a 0-dim float32 tensor on its parameter's device");
    like_param.push_back(std::move(step));
  }
  auto device = param->device();
  auto dtype = param->scalar_type();
  Group* group = nullptr;
  for (auto& g : groups) {
    if (g.device == device && g.dtype == dtype) {
      group = &g;
    }
  }
  if (group == nullptr) {
    groups.push_back(
        Group{device, dtype, std::vector<std::vector<at::Tensor>>(2 + like_param.size())});
    group = &groups.back();
  }
  group->columns[0].emplace_back(param->variable_data());
  // The CUDA kernels want identical strides; a size-1 dimension's may differ, so the gradient is
  // viewed with the parameter's (the same memory).
  group->columns[1].push_back(grad.strides() == param->strides()
                                  ? grad
                                  : grad.as_strided(param->sizes(), param->strides(),
                                                    grad.storage_offset()));
  for (size_t k = 0; k < like_param.size(); ++k) {
    group->columns[2 + k].push_back(std::move(like_param[k]));
  }
}

// A learning-rate tensor as the fused kernels read it: one float32 value on the parameters' device.
void check_lr(const at::Tensor& lr, c10::Device device) {
  TORCH_CHECK(lr.defined() && lr.dim() == 0 && lr.scalar_type() == at::kFloat &&
                  lr.device() == device,
              "a learning-rate tensor must be a 0-dim float32 tensor on ", device);
}

// The skip flag as the kernels read it: one float32 value on the group's device (copied there
// from the flag's own device for a stage over several devices, as torch.optim does).
std::optional<at::Tensor> flag_on(const at::Tensor* found_inf, c10::Device device) {
  if (found_inf == nullptr) {
    return std::nullopt;
  }
  TORCH_CHECK(found_inf->defined() && found_inf->numel() == 1 &&
                  found_inf->scalar_type() == at::kFloat,
              "a skip flag must be a one-element float32 tensor");
  return found_inf->device() == device ? found_inf->reshape({}) : found_inf->reshape({}).to(device);
}

const at::Tensor& state_at(const at::Tensor* const* list, size_t i, const char* what) {
  TORCH_CHECK(list != nullptr && list[i] != nullptr && list[i]->defined(), "missing ", what,
              " for parameter ", i);
  return *list[i];
}

}  // namespace

extern "C" {

// torch.optim.SGD(fused=True) with dampening 0 over `count` parameters. With momentum,
// `momentum_buffers` has one tensor per parameter (shaped like it), which the kernel blends the
// gradient (plus weight decay) into; a new buffer is zeros, which makes the blend exactly torch's
// first step (0 * momentum + g is g). Without momentum, `momentum_buffers` is ignored (may be
// null). A non-null `lr_tensor` (0-dim float32 on the parameters' device) is read for the
// learning rate instead of `lr`; a non-null `found_inf` may skip the step (see above).
char* sh_fused_sgd_step(const at::Tensor* const* params, const at::Tensor* const* momentum_buffers,
                        size_t count, double lr, const at::Tensor* lr_tensor, double momentum,
                        double weight_decay, bool nesterov, const at::Tensor* found_inf) {
  return guarded([&] {
    TORCH_CHECK(!nesterov || momentum > 0.0, "nesterov momentum needs a momentum above 0");
    const bool with_buffers = momentum != 0.0;
    c10::NoGradGuard no_grad;
    std::vector<Group> groups;
    for (size_t i = 0; i < count; ++i) {
      std::vector<at::Tensor> state;
      if (with_buffers) {
        state.push_back(state_at(momentum_buffers, i, "momentum buffer"));
      }
      add_to_group(groups, params[i], std::move(state));
    }
    for (auto& g : groups) {
      auto buffers = with_buffers ? at::TensorList(g.columns[2]) : at::TensorList();
      auto flag = flag_on(found_inf, g.device);
      if (lr_tensor != nullptr) {
        check_lr(*lr_tensor, g.device);
        at::_fused_sgd_(g.columns[0], g.columns[1], buffers, weight_decay, momentum, *lr_tensor,
                        /*dampening=*/0.0, nesterov, /*maximize=*/false, /*is_first_step=*/false,
                        /*grad_scale=*/std::nullopt, flag);
      } else {
        at::_fused_sgd_(g.columns[0], g.columns[1], buffers, weight_decay, momentum, lr,
                        /*dampening=*/0.0, nesterov, /*maximize=*/false, /*is_first_step=*/false,
                        /*grad_scale=*/std::nullopt, flag);
      }
    }
  });
}

// torch.optim.Adam(fused=True), or AdamW when `decoupled_weight_decay`, without amsgrad, over
// `count` parameters with their first and second moments (shaped like the parameter) and their
// step counts (0-dim float32 tensors on the parameter's device, incremented here before the
// update, as torch does, and decremented by `found_inf` after it). A non-null `lr_tensor` is read
// for the learning rate, and a non-null `found_inf` may skip the step, as in SGD.
char* sh_fused_adam_step(const at::Tensor* const* params, const at::Tensor* const* exp_avgs,
                         const at::Tensor* const* exp_avg_sqs, const at::Tensor* const* steps,
                         size_t count, double lr, const at::Tensor* lr_tensor, double beta1,
                         double beta2, double eps, double weight_decay,
                         bool decoupled_weight_decay, const at::Tensor* found_inf) {
  return guarded([&] {
    c10::NoGradGuard no_grad;
    std::vector<Group> groups;
    for (size_t i = 0; i < count; ++i) {
      add_to_group(groups, params[i],
                   {state_at(exp_avgs, i, "first moment"), state_at(exp_avg_sqs, i, "second moment")},
                   state_at(steps, i, "step count"));
    }
    for (auto& g : groups) {
      at::_foreach_add_(g.columns[4], 1);
      auto& p = g.columns;
      auto flag = flag_on(found_inf, g.device);
      const std::optional<at::Tensor> no_scale;
      if (lr_tensor != nullptr) {
        check_lr(*lr_tensor, g.device);
        if (decoupled_weight_decay) {
          at::_fused_adamw_(p[0], p[1], p[2], p[3], /*max_exp_avg_sqs=*/{}, p[4], *lr_tensor, beta1,
                            beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false,
                            no_scale, flag);
        } else {
          at::_fused_adam_(p[0], p[1], p[2], p[3], /*max_exp_avg_sqs=*/{}, p[4], *lr_tensor, beta1,
                           beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false,
                           no_scale, flag);
        }
      } else if (decoupled_weight_decay) {
        at::_fused_adamw_(p[0], p[1], p[2], p[3], /*max_exp_avg_sqs=*/{}, p[4], lr, beta1, beta2,
                          weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, no_scale,
                          flag);
      } else {
        at::_fused_adam_(p[0], p[1], p[2], p[3], /*max_exp_avg_sqs=*/{}, p[4], lr, beta1, beta2,
                         weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, no_scale, flag);
      }
      if (flag.has_value()) {
        // A skipped step does not count (torch.optim.Adam's fused path undoes its increment so).
        std::vector<at::Tensor> flags(p[4].size(), *flag);
        at::_foreach_sub_(p[4], flags);
      }
    }
  });
}

}  // extern "C"
