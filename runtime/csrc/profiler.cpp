// `--profiler-trace`: PyTorch's own profiler (Kineto), as `torch.profiler.profile` drives it from
// Python, over the iterations after the warm-up, saved as the Chrome trace that
// `export_chrome_trace` writes. It records the operators this thread runs, with their inputs'
// shapes and dtypes (and the backward's, which the autograd engine runs on threads that inherit
// this one's profiler state), and on a GPU every kernel, copy and memset through CUPTI. Each
// iteration is a `ProfilerStep#N` user scope, as `prof.step()` marks them, so tools that read
// PyTorch's traces split it the same way, and its forward, backward and step are scopes of their
// own. Kineto lives in libtorch_cpu (which links CUPTI in the CUDA builds of torch), so this half
// needs nothing of libtorch_cuda.

#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_set>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "bridge.hpp"

namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// The open `ProfilerStep#N` scope of the thread that started the profiler.
std::unique_ptr<at::RecordFunction>& step_scope() {
  thread_local std::unique_ptr<at::RecordFunction> scope;
  return scope;
}

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> kinds{ActivityType::CPU};
  if (cuda) {
    kinds.insert(ActivityType::CUDA);
  }
  return kinds;
}

ProfilerConfig config() {
  // What torch.profiler.profile(record_shapes=True) records: operators with their inputs' shapes
  // and dtypes, and kernels; no memory, stacks or FLOPs.
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true);
}

}  // namespace

// Starts recording on this thread (and, with `cuda`, the GPU's activity).
extern "C" char* sh_profiler_start(bool cuda) {
  return sh::guarded([&] {
    TORCH_CHECK(!profiler::isProfilerEnabledInMainThread(), "the profiler is already recording");
    profiler::prepareProfiler(config(), activities(cuda));
    profiler::enableProfiler(config(), activities(cuda));
  });
}

// Ends the previous step's scope and opens `ProfilerStep#step`.
extern "C" char* sh_profiler_step(int64_t step) {
  return sh::guarded([&] {
    auto& scope = step_scope();
    scope.reset();
    scope = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (scope->isActive()) {
      scope->before("ProfilerStep#" + std::to_string(step));
    }
  });
}

// Opens a user scope named `name` (what `torch.profiler.record_function(name)` opens), to be
// ended by sh_profiler_scope_end on the same thread; null when nothing records.
extern "C" void* sh_profiler_scope_begin(const char* name) {
  try {
    auto scope = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (!scope->isActive()) {
      return nullptr;
    }
    scope->before(std::string_view(name));
    return scope.release();
  } catch (...) {
    return nullptr;  // a scope the profiler could not open is one the trace lacks, no more
  }
}

extern "C" void sh_profiler_scope_end(void* scope) {
  try {
    delete static_cast<at::RecordFunction*>(scope);
  } catch (...) {
  }
}

// Ends the last step's scope, stops recording and writes the Chrome trace to `path`.
extern "C" char* sh_profiler_stop(const char* path) {
  return sh::guarded([&] {
    step_scope().reset();
    auto result = profiler::disableProfiler();
    TORCH_CHECK(result != nullptr, "the profiler was not recording");
    result->save(std::string(path));
  });
}
