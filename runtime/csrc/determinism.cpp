// `--deterministic`: what `torch.use_deterministic_algorithms(True)` and
// `torch.backends.cudnn.deterministic = True` set in a Python process, with cuDNN's benchmark off
// (libtorch's default): every operator runs an algorithm that gives the same bits run after run
// on the same device, and an operator that has none fails naming itself rather than silently
// varying. cuBLAS takes its part from CUBLAS_WORKSPACE_CONFIG, which src/determinism.rs sets.
// `--cudnn-benchmark`, its opposite, is here too. All of it is ATen's global context, in
// libtorch_cpu, so this half needs no CUDA library.

#include <ATen/Context.h>

#include "bridge.hpp"

extern "C" char* sh_use_deterministic_algorithms() {
  return sh::guarded([] {
    auto& context = at::globalContext();
    context.setDeterministicAlgorithms(true, /*warn_only=*/false);
    context.setDeterministicCuDNN(true);
    context.setBenchmarkCuDNN(false);
  });
}

// `--cudnn-benchmark`: `torch.backends.cudnn.benchmark = True`: cuDNN times its algorithms for
// each new convolution shape on first use and keeps the fastest (PipeDream's runtime sets it).
extern "C" char* sh_benchmark_cudnn() {
  return sh::guarded([] { at::globalContext().setBenchmarkCuDNN(true); });
}

extern "C" bool sh_benchmarking_cudnn() {
  return at::globalContext().benchmarkCuDNN();
}

extern "C" bool sh_deterministic_algorithms() {
  auto& context = at::globalContext();
  return context.deterministicAlgorithms() && !context.deterministicAlgorithmsWarnOnly() &&
         context.deterministicCuDNN() && !context.benchmarkCuDNN();
}
