// Mixed precision and memory formats, as a C ABI for runtime/src/stage/amp.rs: PyTorch's own
// autocast (the same per-op casting policy `torch.autocast` applies), GradScaler's two kernels
// (unscale with an inf/nan check, and the scale update), and channels_last, none of which tch
// exposes.
//
// Tensors are tch's handles (pointers to at::Tensor). Every entry point follows bridge.hpp's rule:
// nullptr on success or a malloc'd message.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include "bridge.hpp"

namespace {

at::DeviceType device_type(int cuda) {
  return cuda != 0 ? at::kCUDA : at::kCPU;
}

at::ScalarType low_precision(int code) {
  TORCH_CHECK(code == 0 || code == 1, "unknown autocast dtype code ", code);
  return code == 0 ? at::kBFloat16 : at::kHalf;
}

}  // namespace

extern "C" {

// Turns autocast on for the calling thread on the CPU (`cuda` 0) or CUDA (1), casting to bfloat16
// (`dtype` 0) or float16 (1), as entering `torch.autocast(...)` does.
char* sh_autocast_enter(int cuda, int dtype) {
  return sh::guarded([&] {
    auto device = device_type(cuda);
    at::autocast::set_autocast_dtype(device, low_precision(dtype));
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::increment_nesting();
  });
}

// Leaves it, as leaving `torch.autocast(...)` does (the cast cache is dropped on the way out).
char* sh_autocast_exit(int cuda) {
  return sh::guarded([&] {
    at::autocast::set_autocast_enabled(device_type(cuda), false);
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
  });
}

// GradScaler.unscale_: multiplies every gradient by `inv_scale` and sets `found_inf` to 1 when any
// of them holds an inf or a nan (in place; one multi-tensor kernel per device and dtype).
char* sh_amp_unscale(
    const void* const* grads,
    size_t n,
    void* found_inf,
    const void* inv_scale) {
  return sh::guarded([&] {
    std::vector<at::Tensor> list;
    list.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      list.push_back(*static_cast<const at::Tensor*>(grads[i]));
    }
    at::_amp_foreach_non_finite_check_and_unscale_(
        list, *static_cast<at::Tensor*>(found_inf), *static_cast<const at::Tensor*>(inv_scale));
  });
}

// GradScaler.update: backs the scale off after an inf/nan, grows it after `interval` clean steps.
char* sh_amp_update_scale(
    void* scale,
    void* growth_tracker,
    const void* found_inf,
    double growth,
    double backoff,
    int64_t interval) {
  return sh::guarded([&] {
    at::_amp_update_scale_(
        *static_cast<at::Tensor*>(scale), *static_cast<at::Tensor*>(growth_tracker),
        *static_cast<const at::Tensor*>(found_inf), growth, backoff, interval);
  });
}

// Puts a 4-dimensional parameter's data in channels_last layout, in place (as
// `module.to(memory_format=torch.channels_last)` does); other tensors are left alone.
char* sh_channels_last_param(void* param) {
  return sh::guarded([&] {
    auto& tensor = *static_cast<at::Tensor*>(param);
    if (tensor.dim() == 4) {
      tensor.set_data(tensor.contiguous(at::MemoryFormat::ChannelsLast));
    }
  });
}

// A channels_last copy of a 4-dimensional tensor (the tensor itself otherwise), as a new handle
// the caller owns (tch's Tensor::from_ptr).
char* sh_channels_last(const void* input, void** out) {
  *out = nullptr;
  return sh::guarded([&] {
    const auto& tensor = *static_cast<const at::Tensor*>(input);
    auto result = tensor.dim() == 4 ? tensor.contiguous(at::MemoryFormat::ChannelsLast) : tensor;
    *out = new at::Tensor(std::move(result));
  });
}

}  // extern "C"
