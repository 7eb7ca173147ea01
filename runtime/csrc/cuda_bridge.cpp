// The CUDA half of the bridge: a shared object (libstagehand_cuda.so) that build.rs links against
// libtorch_cuda, c10_cuda and NCCL, and that the runtime embeds and loads at run time once
// libtorch_cuda itself has loaded (src/cuda/). It also holds CUDA graphs (a stage's whole training
// step captured once and replayed, `--cuda-graph`). The runtime binary keeps no link to any CUDA
// library, so it starts where only libtorch_cpu's libraries exist and says why CUDA is missing.
//
// Every entry point keeps bridge.hpp's rule: nullptr on success or a malloc'd message.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "bridge.hpp"

namespace {

c10::DeviceIndex checked_device(int64_t device) {
  auto count = c10::cuda::device_count();
  TORCH_CHECK(
      device >= 0 && device < count, "cuda:", device, " does not exist (this machine has ", count,
      " CUDA device(s))");
  return static_cast<c10::DeviceIndex>(device);
}

}  // namespace

// A CUDA graph and the side stream it is captured and replayed on. From its creation until it is
// freed that stream is the creating thread's current stream on the device (captures cannot use
// the default stream, and the eager iterations before the capture warm up cuBLAS and cuDNN on it,
// as PyTorch's recipe for whole-network capture asks). Autograd runs each backward kernel on the
// stream its forward ran on, so backward passes follow.
struct shc_graph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream stream;
  c10::cuda::CUDAStream previous;
  // Between capture_begin and capture_end.
  bool capturing = false;
  // The autocast cache's setting before the capture (a capture runs without it: a cached cast
  // weight made during the capture would be freed with the cache while the graph still reads it).
  bool autocast_cache = true;

  shc_graph(c10::cuda::CUDAStream stream, c10::cuda::CUDAStream previous)
      : stream(stream), previous(previous) {}
};

extern "C" {

// CUDA devices visible to this process (0 without a driver or a GPU).
int64_t shc_device_count(void) {
  return static_cast<int64_t>(c10::cuda::device_count());
}

// Why there are no devices, when the CUDA runtime says so ("" when it has no complaint).
char* shc_device_count_error(void) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess) {
    return nullptr;
  }
  (void)cudaGetLastError();
  return sh::dup_message(std::string(cudaGetErrorString(status)));
}

// The device's marketing name into `name` (NUL-terminated, truncated to `len`).
char* shc_device_name(int64_t device, char* name, size_t len) {
  return sh::guarded([&] {
    TORCH_CHECK(len > 0, "no room for a name");
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(checked_device(device));
    std::string text(props->name);
    size_t n = std::min(text.size(), len - 1);
    std::memcpy(name, text.data(), n);
    name[n] = '\0';
  });
}

// Makes `device` this thread's current device (and creates its context there, not on cuda:0).
char* shc_set_device(int64_t device) {
  return sh::guarded([&] { c10::cuda::set_device(checked_device(device)); });
}

// Waits for the work queued on the calling thread's current stream of `device`: its compute, and
// the transfers a Work::wait has ordered that stream after. Not the whole device
// (cudaDeviceSynchronize): NCCL's own streams hold receives posted ahead of time, which wait for
// peers that may themselves be waiting for this rank's next send (two pipeline stages would
// deadlock), and the buckets an all-reduce still runs behind compute.
char* shc_synchronize(int64_t device) {
  return sh::guarded([&] { c10::cuda::getCurrentCUDAStream(checked_device(device)).synchronize(); });
}

// The caching allocator's peak allocated and reserved bytes on `device` since the last reset.
char* shc_memory_peaks(int64_t device, int64_t* allocated, int64_t* reserved) {
  *allocated = 0;
  *reserved = 0;
  return sh::guarded([&] {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(checked_device(device));
    auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *allocated = stats.allocated_bytes[all].peak;
    *reserved = stats.reserved_bytes[all].peak;
  });
}

// NCCL's version as major * 10000 + minor * 100 + patch (NCCL's own encoding since 2.9).
char* shc_nccl_version(int64_t* version) {
  *version = 0;
  return sh::guarded([&] {
    int v = 0;
    ncclResult_t status = ncclGetVersion(&v);
    TORCH_CHECK(status == ncclSuccess, "ncclGetVersion failed: ", ncclGetErrorString(status));
    *version = v;
  });
}

// An NCCL group of `size` ranks bound to `device`: its communicators are created there, eagerly,
// so a mistake such as two ranks on one GPU fails here rather than at the first operation.
char* shc_pg_nccl(
    sh_store* store,
    const char* prefix,
    int64_t rank,
    int64_t size,
    int64_t device,
    int64_t timeout_ms,
    sh_pg** out) {
  *out = nullptr;
  return sh::guarded([&] {
    auto index = checked_device(device);
    c10::cuda::set_device(index);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = sh::millis(timeout_ms);
    auto bound = at::Device(at::kCUDA, index);
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        sh::prefixed(store, prefix), static_cast<int>(rank), static_cast<int>(size), options);
    backend->setBoundDeviceId(bound);
    backend->eagerConnectSingleDevice(bound);
    *out = new sh_pg{backend, sh::millis(timeout_ms)};
  });
}

// A new graph for `device`, whose side stream becomes the calling thread's current stream there
// (after everything queued so far has run).
char* shc_graph_new(int64_t device, shc_graph** out) {
  *out = nullptr;
  return sh::guarded([&] {
    auto index = checked_device(device);
    c10::cuda::CUDAGuard guard(index);
    c10::cuda::device_synchronize();
    auto previous = c10::cuda::getCurrentCUDAStream(index);
    auto stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    c10::cuda::setCurrentCUDAStream(stream);
    *out = new shc_graph(stream, previous);
  });
}

// Starts capturing what the calling thread (and autograd's threads, for backward passes begun
// during the capture) queue on the graph's stream, with the autocast cache off. Nothing captured
// runs until the first replay. The graph allocates from a memory pool of its own, so what the
// eager iterations before it left cached in the allocator's pool is given back to the device
// first, as torch.cuda.graph does on entering: otherwise the GPU holds the step's memory twice
// (on an H100, vgg16's graphed run reserved 24.9 GiB against its eager run's 10.8).
char* shc_graph_begin(shc_graph* g) {
  return sh::guarded([&] {
    TORCH_CHECK(!g->capturing, "a CUDA graph capture is already under way");
    c10::cuda::CUDAGuard guard(g->stream.device_index());
    c10::cuda::device_synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    g->autocast_cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    g->graph.capture_begin();
    g->capturing = true;
  });
}

// Ends the capture and instantiates the graph.
char* shc_graph_end(shc_graph* g) {
  return sh::guarded([&] {
    TORCH_CHECK(g->capturing, "no CUDA graph capture is under way");
    g->capturing = false;
    at::autocast::set_autocast_cache_enabled(g->autocast_cache);
    c10::cuda::CUDAGuard guard(g->stream.device_index());
    g->graph.capture_end();
  });
}

// Runs the captured work once more on the graph's stream, with the random generators' state as
// it is now (a reseeded generator gives the replay its seed).
char* shc_graph_replay(shc_graph* g) {
  return sh::guarded([&] {
    TORCH_CHECK(!g->capturing, "a CUDA graph cannot replay during its capture");
    c10::cuda::CUDAGuard guard(g->stream.device_index());
    g->graph.replay();
  });
}

// Frees the graph: ends a capture an error left open (its partial graph is dropped), waits for
// the stream and gives the thread its previous current stream back.
void shc_graph_free(shc_graph* g) {
  if (g == nullptr) {
    return;
  }
  try {
    c10::cuda::CUDAGuard guard(g->stream.device_index());
    if (g->capturing) {
      g->capturing = false;
      at::autocast::set_autocast_cache_enabled(g->autocast_cache);
      try {
        g->graph.capture_end();
      } catch (...) {
        // An invalidated capture fails to end; the graph is dropped either way.
      }
    }
    g->stream.synchronize();
    c10::cuda::setCurrentCUDAStream(g->previous);
  } catch (...) {
    // Freeing never throws into Rust; a device lost here is reported by the next CUDA call.
  }
  delete g;
}

}  // extern "C"
