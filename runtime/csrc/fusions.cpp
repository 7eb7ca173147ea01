// The runtime's fused kernels (csrc/kernels/fusions.cu) as autograd operations, part of the CUDA
// bridge (libstagehand_cuda.so): a convolution followed by its bias and ReLU, 2x2 max pooling,
// and a convolution followed by its bias, ReLU and pool, each running one hand-written kernel
// per pass where ATen runs two or three (and a pool over the fused bias and ReLU one kernel
// back through all three), wherever the tensors suit them
// (CUDA, bfloat16, channels_last, channels a multiple of 8) and falling back to ATen's own
// operations, with the same results, wherever they do not. Tests let the CPU stand in for a GPU:
// the same kernels, compiled as C++, run there with the launches a GPU gets (fusions_cpu.cpp).
//
// The kernels are compiled once per device, on first use, with NVRTC, and loaded and launched
// through the CUDA driver: both libraries are opened with dlopen (NVRTC from the folder that holds
// the CUDA runtime libtorch loaded), so the bridge links neither. A device whose compile or load
// failed falls back to ATen for good, and says why once on stderr.
//
// Every entry point keeps bridge.hpp's rule: nullptr on success or a malloc'd message.

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "bridge.hpp"
#include "fusions_cpu.hpp"
#include "fusions_kernels.hpp"
// FUSIONS_SOURCE: csrc/kernels/fusions.cu as a string (written by build.rs).
#include "fusions_source.h"

namespace {

// The few NVRTC and driver entry points used, by their C signatures (handles as void*, results as
// int: nvrtcResult and CUresult are enums whose success is 0).
struct Nvrtc {
  int (*create)(void** prog, const char* src, const char* name, int n, const char* const* headers,
                const char* const* include_names) = nullptr;
  int (*compile)(void* prog, int n, const char* const* options) = nullptr;
  int (*log_size)(void* prog, size_t* size) = nullptr;
  int (*log)(void* prog, char* log) = nullptr;
  int (*cubin_size)(void* prog, size_t* size) = nullptr;
  int (*cubin)(void* prog, char* cubin) = nullptr;
  int (*destroy)(void** prog) = nullptr;
  const char* (*error)(int result) = nullptr;
};

struct Driver {
  int (*load)(void** module, const void* image) = nullptr;
  int (*function)(void** function, void* module, const char* name) = nullptr;
  int (*launch)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                unsigned shared, void* stream, void** params, void** extra) = nullptr;
  int (*error)(int result, const char** text) = nullptr;
  int (*resident)(int* blocks, void* f, int block_size, size_t shared) = nullptr;
};

template <typename F>
void bind(void* library, const char* name, F& slot, const std::string& from) {
  slot = reinterpret_cast<F>(dlsym(library, name));
  TORCH_CHECK(slot != nullptr, from, " has no ", name);
}

// The folder of the loaded CUDA runtime (libcudart): NVRTC's libraries sit beside it in the
// nvidia wheels torch depends on, and in a CUDA toolkit's lib64.
std::string cudart_folder() {
  Dl_info info{};
  TORCH_CHECK(dladdr(reinterpret_cast<void*>(&cudaGetDevice), &info) != 0 && info.dli_fname != nullptr,
              "cannot tell where the CUDA runtime library is");
  std::string path(info.dli_fname);
  auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// Opens `name` from `folder` (or, failing that, wherever the loader finds it).
void* open_library(const std::string& folder, const std::string& name) {
  void* handle = dlopen((folder + "/" + name).c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
  }
  TORCH_CHECK(handle != nullptr, "cannot load ", name, " (looked in ", folder, " and the loader's path): ",
              dlerror());
  return handle;
}

const Nvrtc& nvrtc() {
  static const Nvrtc api = [] {
    Nvrtc n;
    auto folder = cudart_folder();
    // NVRTC opens its builtins by name; loaded first, by path, they are found.
    open_library(folder, "libnvrtc-builtins.so.13.0");
    void* library = open_library(folder, "libnvrtc.so.13");
    const std::string from = "libnvrtc.so.13";
    bind(library, "nvrtcCreateProgram", n.create, from);
    bind(library, "nvrtcCompileProgram", n.compile, from);
    bind(library, "nvrtcGetProgramLogSize", n.log_size, from);
    bind(library, "nvrtcGetProgramLog", n.log, from);
    bind(library, "nvrtcGetCUBINSize", n.cubin_size, from);
    bind(library, "nvrtcGetCUBIN", n.cubin, from);
    bind(library, "nvrtcDestroyProgram", n.destroy, from);
    bind(library, "nvrtcGetErrorString", n.error, from);
    return n;
  }();
  return api;
}

const Driver& driver() {
  static const Driver api = [] {
    Driver d;
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(library != nullptr, "cannot load the NVIDIA driver's libcuda.so.1: ", dlerror());
    const std::string from = "libcuda.so.1";
    bind(library, "cuModuleLoadData", d.load, from);
    bind(library, "cuModuleGetFunction", d.function, from);
    bind(library, "cuLaunchKernel", d.launch, from);
    bind(library, "cuGetErrorString", d.error, from);
    bind(library, "cuOccupancyMaxActiveBlocksPerMultiprocessor", d.resident, from);
    return d;
  }();
  return api;
}

// fusions.cu compiled to machine code for compute capability `arch` (90 for sm_90).
std::string compile(int arch) {
  const auto& n = nvrtc();
  void* prog = nullptr;
  int result = n.create(&prog, FUSIONS_SOURCE, "fusions.cu", 0, nullptr, nullptr);
  TORCH_CHECK(result == 0, "nvrtcCreateProgram: ", n.error(result));
  std::string arch_option = "--gpu-architecture=sm_" + std::to_string(arch);
  std::array<const char*, 2> options{"--std=c++17", arch_option.c_str()};
  result = n.compile(prog, static_cast<int>(options.size()), options.data());
  std::string cubin;
  if (result == 0) {
    size_t size = 0;
    n.cubin_size(prog, &size);
    cubin.resize(size);
    n.cubin(prog, cubin.data());
  }
  size_t log_size = 0;
  n.log_size(prog, &log_size);
  std::string log(log_size, '\0');
  n.log(prog, log.data());
  n.destroy(&prog);
  TORCH_CHECK(result == 0, "compiling csrc/kernels/fusions.cu for sm_", arch, ": ", n.error(result), "\n", log);
  return cubin;
}

// A kernel loaded on one device, and the most blocks a launch of it takes there: as many as the
// device holds at once, so that a grid is one wave. The kernels stride over their work, a block
// doing as much as any other; blocks past what the multiprocessors hold would wait for a second,
// partial wave, as 8 a multiprocessor did for the kernels whose registers let 5 or 6 stay.
struct Loaded {
  void* function = nullptr;
  unsigned blocks = 0;
};

// The kernels, loaded on one device.
struct Kernels {
#define SH_SLOT(name) Loaded name;
  SH_FUSED_KERNELS(SH_SLOT)
#undef SH_SLOT
};

// Every kernel of fusions.cu, by name, and where Kernels keeps it once loaded.
#define SH_ENTRY(name) {#name, &Kernels::name},
constexpr std::pair<const char*, Loaded Kernels::*> kKernels[] = {SH_FUSED_KERNELS(SH_ENTRY)};
#undef SH_ENTRY

// fusions.cu compiled for `arch`, holding every kernel of kKernels (a name the source misspelt,
// or left C++-mangled, would only fail at load time on a GPU).
std::string compile_all(int arch) {
  auto cubin = compile(arch);
  for (const auto& [name, slot] : kKernels) {
    // The symbol table's strings end, and follow another's end, with a NUL.
    std::string symbol = std::string(1, '\0') + name + '\0';
    TORCH_CHECK(cubin.find(symbol) != std::string::npos, "csrc/kernels/fusions.cu compiled for sm_", arch,
                " has no kernel ", name);
  }
  return cubin;
}

constexpr unsigned kThreads = 256;

// The shared memory of a launch that sums `channels` channels: a float for each.
constexpr unsigned channel_sums_bytes(int64_t channels) {
  return static_cast<unsigned>(channels * sizeof(float));
}

// The most shared memory a launch asks: the sums of the most channels the kernels take, 8 a
// thread (suits).
constexpr unsigned kMostShared = channel_sums_bytes(8 * kThreads);

void check_driver(int result, const char* what) {
  if (result != 0) {
    const char* text = nullptr;
    driver().error(result, &text);
    TORCH_CHECK(false, what, ": ", text != nullptr ? text : "unknown CUDA driver error");
  }
}

// The device's kernels, compiled and loaded on first use; nullptr where that failed (said once).
const Kernels* kernels(c10::DeviceIndex device) {
  static std::mutex lock;
  static std::unordered_map<int, std::unique_ptr<Kernels>> loaded;
  std::lock_guard<std::mutex> guard(lock);
  auto found = loaded.find(device);
  if (found != loaded.end()) {
    return found->second.get();
  }
  std::unique_ptr<Kernels> k;
  try {
    c10::cuda::CUDAGuard on(device);
    const auto* props = at::cuda::getDeviceProperties(device);
    auto cubin = compile_all(props->major * 10 + props->minor);
    // The runtime API made the device's primary context current; the module loads into it.
    void* module = nullptr;
    check_driver(driver().load(&module, cubin.data()), "loading the fused kernels");
    auto made = std::make_unique<Kernels>();
    for (const auto& [name, slot] : kKernels) {
      Loaded& kernel = made.get()->*slot;
      check_driver(driver().function(&kernel.function, module, name), name);
      int resident = 0;
      check_driver(driver().resident(&resident, kernel.function, static_cast<int>(kThreads), kMostShared), name);
      TORCH_CHECK(resident > 0, name, ": a multiprocessor holds no block of ", kThreads, " threads");
      kernel.blocks = static_cast<unsigned>(props->multiProcessorCount) * static_cast<unsigned>(resident);
    }
    k = std::move(made);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "runtime: the fused kernels are off on cuda:%d, ATen's kernels run instead: %s\n",
                 static_cast<int>(device), e.what());
  }
  auto* result = k.get();
  loaded.emplace(device, std::move(k));
  return result;
}

// The kernels of the device that holds `t`.
const Kernels* kernels_of(const at::Tensor& t) {
  return kernels(static_cast<c10::DeviceIndex>(t.get_device()));
}

// Whether this thread's CPU tensors stand in for a GPU's (shc_fusions_cpu_stand_in, for tests):
// the same autograd operations, the same choices of when to use them and the same kernels with
// the same launches, run on this thread (fusions_cpu.cpp) instead of a GPU.
thread_local bool cpu_stand_in = false;

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The most 16-byte vectors a tensor the kernels take may hold: their indices are 32-bit, and an
// index plus a grid's stride must stay below 2^32 (fusions.cu).
constexpr int64_t kMaxVectors = (int64_t{1} << 31) - 1;

// Whether the kernels can take `t`: bfloat16 on a GPU, channels_last and dense, channels a
// multiple of 8 whose vectors divide a block's threads, 16-byte aligned, at most kMaxVectors.
bool suits(const at::Tensor& t) {
  return (t.is_cuda() || (cpu_stand_in && t.is_cpu())) && t.scalar_type() == at::kBFloat16 && t.dim() == 4 &&
      t.size(1) % 8 == 0 && t.size(1) / 8 <= static_cast<int64_t>(kThreads) && kThreads % (t.size(1) / 8) == 0 &&
      t.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned(t) && t.numel() > 0 && t.numel() / 8 <= kMaxVectors;
}

// A count or length as a kernel takes it (32-bit): within kMaxVectors, as suits made sure.
uint32_t kernel_int(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= kMaxVectors, "a fused kernel's count ", n, " is over 2^31 - 1");
  return static_cast<uint32_t>(n);
}

// An incoming gradient as the kernels read it: channels_last, dense and 16-byte aligned (a copy
// where it is not).
at::Tensor dense(const at::Tensor& t) {
  auto d = t.contiguous(at::MemoryFormat::ChannelsLast);
  return aligned(d) ? d : d.clone(at::MemoryFormat::ChannelsLast);
}

// The name `kernel` is loaded by.
const char* name_of(Loaded Kernels::*kernel) {
  for (const auto& [name, slot] : kKernels) {
    if (slot == kernel) {
      return name;
    }
  }
  TORCH_CHECK(false, "a kernel missing from kKernels");
}

// The stand-in's grid: two blocks at most, so that the tests' tensors take several passes of
// each kernel's grid-stride loop.
constexpr unsigned kStandInBlocks = 2;

// Launches `kernel` with kThreads a block, over `work` items (one a thread until the grid runs
// out, then striding): no more blocks than the work fills, at most the device's grid. On a GPU
// on the current stream; for the CPU stand-in, on this thread (fusions_cpu.cpp).
void launch(Loaded Kernels::*kernel, const at::Tensor& on, int64_t work, unsigned shared, std::vector<void*> params) {
  const char* name = name_of(kernel);
  TORCH_CHECK(shared <= kMostShared, name, ": ", shared, " bytes of shared memory, over the ", kMostShared,
              " the grids were sized for");
  auto grid = [work](unsigned most) {
    auto wanted = (work + kThreads - 1) / kThreads;
    return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(most, wanted)));
  };
  if (on.is_cpu()) {
    return sh::cpu_kernels::launch(name, grid(kStandInBlocks), kThreads, shared, params.data());
  }
  const Kernels* k = kernels_of(on);
  TORCH_CHECK(k != nullptr, name, ": the fused kernels are off on this device");
  const Loaded& loaded = k->*kernel;
  auto stream = at::cuda::getCurrentCUDAStream();
  check_driver(driver().launch(loaded.function, grid(loaded.blocks), 1, 1, kThreads, 1, 1, shared, stream.stream(),
                               params.data(), nullptr),
               name);
}

// The kernels' launches: each writes into tensors it is given.

void bias_relu(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& y) {
  auto n8 = kernel_int(x.numel() / 8);
  auto c8 = kernel_int(x.size(1) / 8);
  void* x_ptr = x.data_ptr();
  void* b_ptr = bias.data_ptr();
  void* y_ptr = y.data_ptr();
  launch(&Kernels::bias_relu, x, n8, 0, {&x_ptr, &b_ptr, &y_ptr, &n8, &c8});
}

// db: float [channels], zeroed.
void relu_bias_backward(const at::Tensor& gy, const at::Tensor& y, const at::Tensor& g, const at::Tensor& db) {
  auto rows = kernel_int(y.numel() / y.size(1));
  auto c8 = kernel_int(y.size(1) / 8);
  void* gy_ptr = gy.data_ptr();
  void* y_ptr = y.data_ptr();
  void* g_ptr = g.data_ptr();
  void* db_ptr = db.data_ptr();
  auto shared = channel_sums_bytes(y.size(1));
  launch(&Kernels::relu_bias_backward, y, int64_t{rows} * c8, shared, {&gy_ptr, &y_ptr, &g_ptr, &db_ptr, &rows, &c8});
}

// A 2x2 pool's output for the input `x`, and its winners' bytes, [n, oh, ow, c] (undefined
// without `windows`).
std::pair<at::Tensor, at::Tensor> pooled_outputs(const at::Tensor& x, bool windows) {
  auto n = x.size(0), c = x.size(1), oh = x.size(2) / 2, ow = x.size(3) / 2;
  auto y = at::empty({n, c, oh, ow}, x.options(), at::MemoryFormat::ChannelsLast);
  auto win = windows ? at::empty({n, oh, ow, c}, x.options().dtype(at::kByte)) : at::Tensor();
  return {y, win};
}

// A pooled tensor's [n, c, oh, ow] as the pool kernels take it: its pixels (n * oh * ow), ow, and
// its channels' vectors.
struct PooledShape {
  uint32_t outs, ow, c8;

  // The launch's work: a thread for each (pixel, channel group).
  int64_t work() const { return int64_t{outs} * c8; }
};

PooledShape pooled_shape(const at::Tensor& y) {
  return {kernel_int(y.numel() / y.size(1)), kernel_int(y.size(3)), kernel_int(y.size(1) / 8)};
}

// x pooled, and which of each window's four won: a byte per output, [n, oh, ow, c].
std::pair<at::Tensor, at::Tensor> pool_forward(const at::Tensor& x) {
  auto [y, win] = pooled_outputs(x, true);
  auto shape = pooled_shape(y);
  void* x_ptr = x.data_ptr();
  void* y_ptr = y.data_ptr();
  void* win_ptr = win.data_ptr();
  launch(&Kernels::pool_forward, x, shape.work(), 0, {&x_ptr, &y_ptr, &win_ptr, &shape.outs, &shape.ow, &shape.c8});
  return {y, win};
}

// relu(conv + bias[c]) pooled, and (with `windows`) which of each window's four won, as
// pool_forward of bias_relu's output gives them; bias 16-byte aligned.
std::pair<at::Tensor, at::Tensor> bias_relu_pool(const at::Tensor& conv, const at::Tensor& bias, bool windows) {
  auto [y, win] = pooled_outputs(conv, windows);
  auto shape = pooled_shape(y);
  void* x_ptr = conv.data_ptr();
  void* b_ptr = bias.data_ptr();
  void* y_ptr = y.data_ptr();
  void* win_ptr = windows ? win.data_ptr() : nullptr;
  launch(&Kernels::bias_relu_pool, conv, shape.work(), 0,
         {&x_ptr, &b_ptr, &y_ptr, &win_ptr, &shape.outs, &shape.ow, &shape.c8});
  return {y, win};
}

void pool_backward(const at::Tensor& gy, const at::Tensor& win, const at::Tensor& gx) {
  auto shape = pooled_shape(gy);
  void* gy_ptr = gy.data_ptr();
  void* win_ptr = win.data_ptr();
  void* gx_ptr = gx.data_ptr();
  launch(&Kernels::pool_backward, gy, shape.work(), 0, {&gy_ptr, &win_ptr, &gx_ptr, &shape.outs, &shape.ow, &shape.c8});
}

// gy and y: the pool's output's gradient and the pool's output; db: float [channels], zeroed.
void pool_relu_bias_backward(const at::Tensor& gy, const at::Tensor& y, const at::Tensor& win, const at::Tensor& g,
                             const at::Tensor& db) {
  auto shape = pooled_shape(y);
  void* gy_ptr = gy.data_ptr();
  void* y_ptr = y.data_ptr();
  void* win_ptr = win.data_ptr();
  void* g_ptr = g.data_ptr();
  void* db_ptr = db.data_ptr();
  auto shared = channel_sums_bytes(y.size(1));
  launch(&Kernels::pool_relu_bias_backward, y, shape.work(), shared,
         {&gy_ptr, &y_ptr, &win_ptr, &g_ptr, &db_ptr, &shape.outs, &shape.ow, &shape.c8});
}

// The bias as the kernels read it, 16 bytes at a time: dense and aligned (a view at an odd offset
// would not do).
at::Tensor kernel_bias(const at::Tensor& bias) {
  auto b = bias.contiguous();
  return aligned(b) ? b : b.clone();
}

// The gradients of the convolution's output (`sizes`) and of the bias (`bias_dtype`) from those of
// a 2x2 pool over relu(conv + bias): `grad` of the pool's output `y`, `win` its winners.
torch::autograd::variable_list pool_relu_bias_grads(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& win,
                                                    at::IntArrayRef sizes, at::ScalarType bias_dtype) {
  if (!grad.defined()) {
    return {at::Tensor(), at::Tensor()};
  }
  auto gy = dense(grad.to(y.scalar_type()));
  auto g = at::empty(sizes, y.options(), at::MemoryFormat::ChannelsLast);
  auto db = at::zeros({y.size(1)}, y.options().dtype(at::kFloat));
  pool_relu_bias_backward(gy, y, win, g, db);
  return {g, db.to(bias_dtype)};
}

// relu(conv + bias[c]) and its backward: ReLU's and the bias's gradient in one pass. The
// convolution's own backward (ATen's) gives the rest.
struct BiasRelu : torch::autograd::Function<BiasRelu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& conv, const at::Tensor& bias) {
    auto out = at::empty_like(conv, at::MemoryFormat::ChannelsLast);
    bias_relu(conv, kernel_bias(bias), out);
    ctx->save_for_backward({out});
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias.scalar_type());
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto y = ctx->get_saved_variables()[0];
    auto bias_dtype = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor()};
    }
    auto gy = dense(grads[0].to(y.scalar_type()));
    auto g = at::empty_like(y, at::MemoryFormat::ChannelsLast);
    auto db = at::zeros({y.size(1)}, y.options().dtype(at::kFloat));
    relu_bias_backward(gy, y, g, db);
    return {g, db.to(bias_dtype)};
  }
};

// 2x2 max pooling with stride 2 that keeps which of each window's four won, a byte per output.
struct MaxPool2x2 : torch::autograd::Function<MaxPool2x2> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    auto [y, win] = pool_forward(x);
    ctx->saved_data["win"] = win;
    ctx->saved_data["sizes"] = x.sizes().vec();
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    if (!grads[0].defined()) {
      return {at::Tensor()};
    }
    auto win = ctx->saved_data["win"].toTensor();
    auto sizes = ctx->saved_data["sizes"].toIntVector();
    auto gy = dense(grads[0].to(at::kBFloat16));
    auto gx = at::empty(sizes, gy.options(), at::MemoryFormat::ChannelsLast);
    pool_backward(gy, win, gx);
    return {gx};
  }
};

// The backward of a 2x2 max pool over BiasRelu's output, straight to that BiasRelu's inputs (the
// convolution's output and the bias): the pool's, the ReLU's and the bias's backward in one
// kernel, where BiasRelu's own backward would read the pool's full-size gradient and BiasRelu's
// full-size output again. The pool's output decides the ReLU's mask (each window's winner is the
// only place the pool's gradient reaches, and there the pool's output is the ReLU's), so
// BiasRelu's output need not be kept for the backward at all.
struct PoolReluBiasBackward : torch::autograd::Node {
  torch::autograd::SavedVariable pooled;  // the pool's output
  at::Tensor win;
  std::vector<int64_t> sizes;  // of BiasRelu's output, the pool's input
  at::ScalarType bias_dtype = at::kBFloat16;

  std::string name() const override {
    return "PoolReluBiasBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(win.defined(), "PoolReluBiasBackward ran twice (its saved tensors are freed after the first)");
    return pool_relu_bias_grads(grads[0], pooled.unpack(shared_from_this()), win, sizes, bias_dtype);
  }

  void release_variables() override {
    pooled.reset_data();
    win.reset();
  }
};

// max_pool2x2 of `x` with PoolReluBiasBackward as its backward, when `x` is BiasRelu's output as
// it came (not changed in place since) and a gradient is being recorded; nothing otherwise.
std::optional<at::Tensor> pool_over_bias_relu(const at::Tensor& x) {
  if (!torch::autograd::GradMode::is_enabled() || x.output_nr() != 0) {
    return std::nullopt;
  }
  auto* bias_relu = dynamic_cast<torch::autograd::CppNode<BiasRelu>*>(x.grad_fn().get());
  if (bias_relu == nullptr) {
    return std::nullopt;
  }
  // Detached: the pool's forward records nothing; the node below is its backward.
  auto [y, win] = pool_forward(x.detach());
  auto node = std::shared_ptr<PoolReluBiasBackward>(new PoolReluBiasBackward(), torch::autograd::deleteNode);
  // BiasRelu's own edges: to the convolution's output and to the bias.
  node->set_next_edges(torch::autograd::edge_list(bias_relu->next_edges()));
  node->win = win;
  node->sizes = x.sizes().vec();
  node->bias_dtype = static_cast<at::ScalarType>(bias_relu->ctx_.saved_data["bias_dtype"].toInt());
  torch::autograd::set_history(y, node);
  node->pooled = torch::autograd::SavedVariable(y, /*is_output=*/true);
  return y;
}

// A 2x2 max pool over relu(conv + bias[c]) in one kernel, the full-size activation never made,
// and its backward in one kernel too (the one PoolReluBiasBackward runs): a convolution's bias,
// ReLU and pool, where all three are one layer's.
struct BiasReluPool : torch::autograd::Function<BiasReluPool> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& conv, const at::Tensor& bias) {
    auto [y, win] = bias_relu_pool(conv, kernel_bias(bias), true);
    ctx->save_for_backward({y});
    ctx->saved_data["win"] = win;
    ctx->saved_data["sizes"] = conv.sizes().vec();
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias.scalar_type());
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto y = ctx->get_saved_variables()[0];
    auto win = ctx->saved_data["win"].toTensor();
    auto sizes = ctx->saved_data["sizes"].toIntVector();
    auto bias_dtype = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
    return pool_relu_bias_grads(grads[0], y, win, sizes, bias_dtype);
  }
};

// The autocast dtype for `x`'s device, if autocast is on there.
std::optional<at::ScalarType> autocast_dtype(const at::Tensor& x) {
  auto type = x.device().type();
  if (!at::autocast::is_autocast_enabled(type)) {
    return std::nullopt;
  }
  return at::autocast::get_autocast_dtype(type);
}

bool usable(const at::Tensor& t) {
  return suits(t) && !at::globalContext().deterministicAlgorithms() && (t.is_cpu() || kernels_of(t) != nullptr);
}

// A convolution's input, weight and bias: after the casts conv2d's autocast policy makes (lower
// precision), through autocast's own cache, and whether the fused kernels may take its output
// (the bias added after the convolution) by their dtypes and devices.
struct ConvInputs {
  at::Tensor x, weight, bias;
  bool fusable;

  ConvInputs(at::Tensor x_, at::Tensor weight_, at::Tensor bias_)
      : x(std::move(x_)), weight(std::move(weight_)), bias(std::move(bias_)) {
    if (auto dtype = autocast_dtype(x)) {
      auto type = x.device().type();
      x = at::autocast::cached_cast(*dtype, x, type);
      weight = at::autocast::cached_cast(*dtype, weight, type);
      bias = at::autocast::cached_cast(*dtype, bias, type);
    }
    fusable = (x.is_cuda() || (cpu_stand_in && x.is_cpu())) && x.scalar_type() == at::kBFloat16 &&
        bias.scalar_type() == at::kBFloat16 && !at::globalContext().deterministicAlgorithms();
  }
};

// relu(conv + bias[c]) of a convolution's output `conv` (made without its bias).
at::Tensor bias_relu_of(at::Tensor conv, const at::Tensor& bias) {
  if (!usable(conv)) {
    // What ATen's convolution does with a bias (added after the convolution), then the ReLU.
    return conv.add_(bias.view({1, -1, 1, 1})).relu_();
  }
  return BiasRelu::apply(conv, bias);
}

at::Tensor conv_bias_relu(at::Tensor x, at::Tensor weight, at::Tensor bias, at::IntArrayRef stride,
                          at::IntArrayRef padding) {
  ConvInputs in(std::move(x), std::move(weight), std::move(bias));
  if (!in.fusable) {
    return at::conv2d(in.x, in.weight, in.bias, stride, padding).relu_();
  }
  return bias_relu_of(at::conv2d(in.x, in.weight, std::nullopt, stride, padding), in.bias);
}

bool poolable(const at::Tensor& x) {
  return usable(x) && x.size(2) % 2 == 0 && x.size(3) % 2 == 0;
}

at::Tensor max_pool2x2(const at::Tensor& x) {
  if (poolable(x)) {
    if (auto pooled = pool_over_bias_relu(x)) {
      return *pooled;
    }
    return MaxPool2x2::apply(x);
  }
  return at::max_pool2d(x, {2, 2}, {2, 2}, {0, 0}, {1, 1}, false);
}

// max_pool2x2(conv_bias_relu(...)), with the same values and gradients: the bias, the ReLU and the
// pool in one kernel each way where the convolution's output suits them; without a gradient to
// record, the pool's winners are not kept.
at::Tensor conv_bias_relu_pool(at::Tensor x, at::Tensor weight, at::Tensor bias, at::IntArrayRef stride,
                               at::IntArrayRef padding) {
  ConvInputs in(std::move(x), std::move(weight), std::move(bias));
  if (!in.fusable) {
    return max_pool2x2(at::conv2d(in.x, in.weight, in.bias, stride, padding).relu_());
  }
  auto conv = at::conv2d(in.x, in.weight, std::nullopt, stride, padding);
  if (!poolable(conv)) {
    return max_pool2x2(bias_relu_of(conv, in.bias));
  }
  bool recorded = torch::autograd::GradMode::is_enabled() && (conv.requires_grad() || in.bias.requires_grad());
  if (!recorded) {
    return bias_relu_pool(conv, kernel_bias(in.bias), false).first;
  }
  return BiasReluPool::apply(conv, in.bias);
}

// One of the fused operations that start with a convolution (`op`: conv_bias_relu or
// conv_bias_relu_pool), as the entry points take it: tensor handles, a `stride` and `padding` for
// both dimensions, and a new tensor handle in `out`.
template <typename Op>
char* convolve(Op op, const void* x, const void* weight, const void* bias, int64_t stride, int64_t padding,
               void** out) {
  *out = nullptr;
  return sh::guarded([&] {
    auto y = op(*static_cast<const at::Tensor*>(x), *static_cast<const at::Tensor*>(weight),
                *static_cast<const at::Tensor*>(bias), at::IntArrayRef{stride, stride},
                at::IntArrayRef{padding, padding});
    *out = new at::Tensor(std::move(y));
  });
}

}  // namespace

extern "C" {

// relu(conv2d(x, weight, bias)) with a 3x3-style `stride` and `padding` (one value for both
// dimensions), fused where the tensors suit; a new tensor handle in `out`.
char* shc_conv_bias_relu(const void* x, const void* weight, const void* bias, int64_t stride, int64_t padding,
                         void** out) {
  return convolve(conv_bias_relu, x, weight, bias, stride, padding, out);
}

// max_pool2d(relu(conv2d(x, weight, bias)), 2, 2) with `stride` and `padding` as
// shc_conv_bias_relu's, fused where the tensors suit; a new tensor handle in `out`.
char* shc_conv_bias_relu_pool(const void* x, const void* weight, const void* bias, int64_t stride, int64_t padding,
                              void** out) {
  return convolve(conv_bias_relu_pool, x, weight, bias, stride, padding, out);
}

// max_pool2d(x, 2, 2), fused where the tensor suits; a new tensor handle in `out`.
char* shc_max_pool2x2(const void* x, void** out) {
  *out = nullptr;
  return sh::guarded([&] {
    *out = new at::Tensor(max_pool2x2(*static_cast<const at::Tensor*>(x)));
  });
}

// Compiles the fused kernels for compute capability `arch` (no GPU needed) and gives the size of
// the machine code in `bytes`: what the first use on a device does before loading it.
char* shc_fusions_compile(int64_t arch, size_t* bytes) {
  *bytes = 0;
  return sh::guarded([&] { *bytes = compile_all(static_cast<int>(arch)).size(); });
}

// Whether this thread's CPU tensors in bfloat16 and channels_last take the fused operations, their
// kernels run on the CPU (fusions_cpu.cpp): tests of the kernels and the autograd operations
// without a GPU.
void shc_fusions_cpu_stand_in(int on) {
  cpu_stand_in = on != 0;
}

// The name of the autograd node that made `t` ("" for a leaf or a tensor made without a
// gradient), NUL-terminated in `name`: what the tests ask of which backward a fused operation
// chose.
char* shc_grad_fn_name(const void* t, char* name, size_t len) {
  return sh::guarded([&] {
    TORCH_CHECK(len > 0, "no room for a name");
    const auto& fn = static_cast<const at::Tensor*>(t)->grad_fn();
    std::string text = fn ? fn->name() : std::string();
    size_t n = std::min(text.size(), len - 1);
    std::memcpy(name, text.data(), n);
    name[n] = '\0';
  });
}

}  // extern "C"
