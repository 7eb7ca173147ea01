// The CUDA half of the bridge: a shared object (libstagehand_cuda.so) that build.rs links against
// libtorch_cuda, c10_cuda and NCCL, and that the runtime embeds and loads at run time once
// libtorch_cuda itself has loaded (src/cuda/). The runtime binary keeps no link to any CUDA
// library, so it starts where only libtorch_cpu's libraries exist and says why CUDA is missing.
//
// Every entry point keeps bridge.hpp's rule: nullptr on success or a malloc'd message.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include <ATen/cuda/CUDAContext.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
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

// Waits for all work queued on `device` (every stream, NCCL's included).
char* shc_synchronize(int64_t device) {
  return sh::guarded([&] {
    c10::cuda::CUDAGuard guard(checked_device(device));
    c10::cuda::device_synchronize();
  });
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

}  // extern "C"
