// The C ABI between the runtime's Rust `comm` module and PyTorch's own c10d in libtorch_cpu.so:
// TCPStore, PrefixStore and ProcessGroupGloo, and the operations every group runs. NCCL groups
// are created by cuda_bridge.cpp, loaded at run time, and used through the same functions.
//
// Rules this file keeps:
// - Every entry point returns nullptr on success or a malloc'd error message (free it with
//   sh_error_free); no C++ exception ever crosses into Rust.
// - The process groups are only constructed here and then used through the virtual
//   c10d::Backend / c10d::Work interface. Debian's gloo headers are an older commit than the gloo
//   compiled into libtorch, so nothing here touches gloo types beyond passing the device that
//   libtorch itself created back to libtorch.
// - Tensors arrive as `at::Tensor*` (what tch's `Tensor::as_ptr()` points at).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <torch/version.h>

#include "bridge.hpp"

namespace {

using sh::dup_message;
using sh::guarded;
using sh::millis;
using sh::prefixed;

// c10d's FlightRecorder (a process-wide singleton that every ProcessGroupGloo::enqueue, send and
// recv writes to) updates a std::map before taking its own mutex (FlightRecorderDetail.hpp,
// recordWithResetEnabled), so two threads issuing operations on different groups at once can
// corrupt it (seen as a SIGSEGV in _Rb_tree_insert_and_rebalance). Every call that issues an
// operation goes through this lock; they only enqueue, so it is held for microseconds. Never hold
// it around anything that blocks (group construction, waits).
std::mutex& issue_mutex() {
  static std::mutex mutex;
  return mutex;
}

// What every call that issues an operation holds: the issue lock, and PyTorch's profiler kept
// out. Under `--profiler-trace` a backend opens a profiler record ("gloo:recv", "nccl:send", ...)
// when it issues an operation and closes it when the operation ends, on whatever thread and
// whenever that is. The runtime posts receives ahead and lets sends and all-reduce buckets run on,
// so operations issued while the profiler records may end after it stopped and freed what the
// record points into. A rank died of "malloc(): ... corrupted" right after writing its trace in 2
// of 60 two-rank runs that stopped tracing mid-run, and all 60 had left "gloo:recv" open. The
// trace keeps the runtime's own `receive` and `sync` scopes, which time the waits on those
// operations, and on a GPU CUPTI's kernels.
struct Issuing {
  std::lock_guard<std::mutex> lock{issue_mutex()};
  at::DisableRecordFunctionGuard unrecorded;
};

void finish_work(sh_pg* pg, std::vector<c10::intrusive_ptr<c10d::Work>> works, sh_work** out) {
  for (const auto& work : works) {
    TORCH_CHECK(work, "the backend returned no work handle");
  }
  *out = new sh_work{std::move(works), pg->backend};
}

void finish_work(sh_pg* pg, c10::intrusive_ptr<c10d::Work> work, sh_work** out) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.push_back(std::move(work));
  finish_work(pg, std::move(works), out);
}

}  // namespace

extern "C" {

void sh_error_free(char* message) {
  std::free(message);
}

// The torch version these headers (and so this runtime) were built against.
const char* sh_torch_version(void) {
  return TORCH_VERSION;
}

// While it lives, c10's log shows only fatal messages, unless TORCH_CPP_LOG_LEVEL chooses a level:
// a client's connection attempts each log a warning with a C++ stack trace while rank 0 is not yet
// listening, and the runtime says once, itself, why a rendezvous failed.
class QuietConnecting {
 public:
  QuietConnecting() : before_(FLAGS_caffe2_log_level) {
    if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr) {
      FLAGS_caffe2_log_level = c10::GLOG_FATAL;
    }
  }
  ~QuietConnecting() {
    FLAGS_caffe2_log_level = before_;
  }
  QuietConnecting(const QuietConnecting&) = delete;
  QuietConnecting& operator=(const QuietConnecting&) = delete;

 private:
  int before_;
};

// `listen_fd` >= 0 (master only): a bound, listening socket the store takes over.
char* sh_store_connect(
    const char* host,
    uint16_t port,
    int64_t world_size,
    int is_master,
    int64_t timeout_ms,
    int listen_fd,
    sh_store** out) {
  *out = nullptr;
  return guarded([&] {
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_master != 0;
    opts.numWorkers = static_cast<std::size_t>(world_size);
    opts.waitWorkers = true;
    opts.timeout = millis(timeout_ms);
    if (listen_fd >= 0) {
      opts.masterListenFd = listen_fd;
    }
    std::optional<QuietConnecting> quiet;
    if (is_master == 0) {
      quiet.emplace();
    }
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    quiet.reset();
    uint16_t bound = store->getPort();
    *out = new sh_store{std::move(store), bound};
  });
}

uint16_t sh_store_port(const sh_store* store) {
  return store->port;
}

void sh_store_free(sh_store* store) {
  delete store;
}

char* sh_store_set(sh_store* store, const char* key, const uint8_t* data, size_t len) {
  return guarded([&] {
    std::vector<uint8_t> value(data, data + len);
    store->store->set(std::string(key), value);
  });
}

// On success *data is malloc'd (free with sh_bytes_free).
char* sh_store_get(sh_store* store, const char* key, uint8_t** data, size_t* len) {
  *data = nullptr;
  *len = 0;
  return guarded([&] {
    std::vector<uint8_t> value = store->store->get(std::string(key));
    auto* buffer = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
    TORCH_CHECK(buffer != nullptr, "out of memory");
    if (!value.empty()) {
      std::memcpy(buffer, value.data(), value.size());
    }
    *data = buffer;
    *len = value.size();
  });
}

// Adds `delta` to the integer stored at `key` (0 when absent) and returns the sum; `delta` 0
// reads a counter without waiting.
char* sh_store_add(sh_store* store, const char* key, int64_t delta, int64_t* out) {
  *out = 0;
  return guarded([&] { *out = store->store->add(std::string(key), delta); });
}

// Whether every one of `n` keys is set, without waiting.
char* sh_store_check(sh_store* store, const char* const* keys, size_t n, int* out) {
  *out = 0;
  return guarded([&] {
    std::vector<std::string> names(keys, keys + n);
    *out = store->store->check(names) ? 1 : 0;
  });
}

// Sets `key` to `desired` if it is absent (`expected` empty) or holds `expected`; either way
// returns the value the key holds afterwards (malloc'd, free with sh_bytes_free).
char* sh_store_compare_set(
    sh_store* store,
    const char* key,
    const uint8_t* expected,
    size_t expected_len,
    const uint8_t* desired,
    size_t desired_len,
    uint8_t** data,
    size_t* len) {
  *data = nullptr;
  *len = 0;
  return guarded([&] {
    std::vector<uint8_t> want(expected, expected + expected_len);
    std::vector<uint8_t> next(desired, desired + desired_len);
    std::vector<uint8_t> value = store->store->compareSet(std::string(key), want, next);
    auto* buffer = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
    TORCH_CHECK(buffer != nullptr, "out of memory");
    if (!value.empty()) {
      std::memcpy(buffer, value.data(), value.size());
    }
    *data = buffer;
    *len = value.size();
  });
}

void sh_bytes_free(uint8_t* data) {
  std::free(data);
}

// Exactly one of `hostname` / `interface` is non-null: the address or network interface this
// rank's gloo device binds to, which the other ranks must be able to reach.
char* sh_pg_gloo(
    sh_store* store,
    const char* prefix,
    const char* hostname,
    const char* interface,
    int64_t rank,
    int64_t size,
    int64_t timeout_ms,
    sh_pg** out) {
  *out = nullptr;
  return guarded([&] {
    auto options = c10d::ProcessGroupGloo::Options::create(millis(timeout_ms));
    if (interface != nullptr) {
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForInterface(std::string(interface)));
    } else {
      TORCH_CHECK(hostname != nullptr, "neither a hostname nor an interface for the gloo device");
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(std::string(hostname)));
    }
    c10::intrusive_ptr<c10d::Backend> backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
        prefixed(store, prefix), static_cast<int>(rank), static_cast<int>(size), options);
    *out = new sh_pg{std::move(backend), millis(timeout_ms)};
  });
}

void sh_pg_free(sh_pg* pg) {
  delete pg;
}

char* sh_pg_send(sh_pg* pg, const void* tensor, int64_t dst, int64_t tag, sh_work** out) {
  *out = nullptr;
  return guarded([&] {
    Issuing issuing;
    std::vector<at::Tensor> tensors{*static_cast<const at::Tensor*>(tensor)};
    finish_work(
        pg, pg->backend->send(tensors, static_cast<int>(dst), static_cast<int>(tag)), out);
  });
}

char* sh_pg_recv(sh_pg* pg, void* tensor, int64_t src, int64_t tag, sh_work** out) {
  *out = nullptr;
  return guarded([&] {
    Issuing issuing;
    std::vector<at::Tensor> tensors{*static_cast<at::Tensor*>(tensor)};
    finish_work(
        pg, pg->backend->recv(tensors, static_cast<int>(src), static_cast<int>(tag)), out);
  });
}

// c10d's allreduce wants tensors of one dtype and shape; allreduce_coalesced allows different
// shapes of one dtype. So: one coalesced all-reduce per dtype, in order of first appearance (the
// same on every rank that passes the same list), and a plain one for a dtype with a single tensor.
char* sh_pg_all_reduce_sum(sh_pg* pg, const void* const* tensors, size_t n, sh_work** out) {
  *out = nullptr;
  return guarded([&] {
    Issuing issuing;
    std::vector<std::vector<at::Tensor>> groups;
    for (size_t i = 0; i < n; ++i) {
      const auto& tensor = *static_cast<const at::Tensor*>(tensors[i]);
      auto same = [&](const std::vector<at::Tensor>& group) {
        return group.front().scalar_type() == tensor.scalar_type() &&
            group.front().device() == tensor.device();
      };
      auto it = std::find_if(groups.begin(), groups.end(), same);
      if (it == groups.end()) {
        groups.push_back({tensor});
      } else {
        it->push_back(tensor);
      }
    }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& group : groups) {
      if (group.size() == 1) {
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        opts.timeout = pg->timeout;
        works.push_back(pg->backend->allreduce(group, opts));
      } else {
        c10d::AllreduceCoalescedOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        opts.timeout = pg->timeout;
        works.push_back(pg->backend->allreduce_coalesced(group, opts));
      }
    }
    finish_work(pg, std::move(works), out);
  });
}

char* sh_pg_barrier(sh_pg* pg, sh_work** out) {
  *out = nullptr;
  return guarded([&] {
    Issuing issuing;
    c10d::BarrierOptions opts;
    opts.timeout = pg->timeout;
    finish_work(pg, pg->backend->barrier(opts), out);
  });
}

// Waits at most `timeout_ms`; a timeout or a failed peer is an error. NCCL's work is only ordered
// before what the current CUDA stream runs next (Work::wait without a timeout): given a timeout,
// ProcessGroupNCCL's wait blocks the host until the GPU has finished the operation instead
// (ProcessGroupNCCL.hpp, WorkNCCL::wait), which would keep the host from queueing compute behind
// it. A stuck NCCL operation is caught by the group's watchdog after the group's timeout.
char* sh_work_wait(sh_work* work, int64_t timeout_ms) {
  return guarded([&] {
    if (work->backend->getBackendName() == "nccl") {
      for (auto& one : work->works) {
        one->wait(::kNoTimeout);
      }
      return;
    }
    auto deadline = std::chrono::steady_clock::now() + millis(timeout_ms);
    for (auto& one : work->works) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      bool done = one->wait(std::max(left, std::chrono::milliseconds(1)));
      TORCH_CHECK(done, "timed out after ", timeout_ms, "ms");
    }
  });
}

// Ends a Gloo point-to-point work's wait on another thread at once, as not completed (c10d's
// Send/RecvWork::abort: gloo's abortWaitSend/abortWaitRecv, which leave the group usable, where a
// wait that times out fails it). Anything else is left alone: NCCL's abort tears down the
// communicator.
char* sh_work_abort(sh_work* work) {
  return guarded([&] {
    TORCH_CHECK(work->backend->getBackendName() == "gloo", "only Gloo's operations can be aborted");
    for (auto& one : work->works) {
      one->abort();
    }
  });
}

void sh_work_free(sh_work* work) {
  delete work;
}

}  // extern "C"
