// What the two halves of the C++ bridge share: the handles the Rust side holds (`sh_store`,
// `sh_pg`, `sh_work`) and the rule that no C++ exception crosses into Rust.
//
// `c10d_bridge.cpp` is linked into the runtime (libtorch_cpu only); `cuda_bridge.cpp` is a
// separate shared object, loaded at run time after libtorch_cuda (see src/cuda/), that creates
// NCCL groups handed back as the same `sh_pg` handles. Both are compiled with the same flags
// against the same headers, so these layouts agree.

#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

struct sh_store {
  c10::intrusive_ptr<c10d::Store> store;
  uint16_t port;
};

struct sh_pg {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
};

struct sh_work {
  // One operation, or several for an all-reduce over tensors of several dtypes.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // The backend outlives its pending work even if the Rust side drops the group first.
  c10::intrusive_ptr<c10d::Backend> backend;
};

namespace sh {

// A malloc'd copy (the Rust side frees it with sh_error_free, i.e. std::free).
inline char* dup_message(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, message.c_str(), message.size() + 1);
  }
  return out;
}

// A c10::Error's what() carries a C++ backtrace; users need the first line's reason only.
inline std::string first_line(const char* text) {
  std::string message(text == nullptr ? "" : text);
  auto end = message.find('\n');
  if (end != std::string::npos) {
    message.resize(end);
  }
  return message.empty() ? std::string("unknown error") : message;
}

// Runs `body`, turning any exception into an error message (nullptr on success).
template <typename F>
char* guarded(F&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return dup_message(first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return dup_message(first_line(e.what()));
  } catch (...) {
    return dup_message("unknown C++ exception");
  }
}

inline std::chrono::milliseconds millis(int64_t ms) {
  return std::chrono::milliseconds(ms);
}

inline c10::intrusive_ptr<c10d::Store> prefixed(sh_store* store, const char* prefix) {
  TORCH_CHECK(store != nullptr, "no store");
  return c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), store->store);
}

}  // namespace sh
