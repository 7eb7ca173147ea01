// Threads of the runtime's own that must not spread their ATen work over libtorch's intra-op
// threads: the image loader's workers, of which there are already several, each doing its
// operators one at a time beside the training thread's.
//
// libtorch's CPU build parallelises with OpenMP, whose thread count is a per-thread setting:
// each thread takes libtorch's (`at::set_num_threads`, `--threads`) the first time it runs an
// operator. Taking it first here and then setting this thread's own to 1 makes every operator
// this thread runs single-threaded, without changing the process-wide count the training
// thread's operators use. A libtorch without OpenMP has no such setting, and nothing changes.

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include "bridge.hpp"

extern "C" void sh_keep_this_thread_serial() {
  // libtorch's own per-thread initialisation, which would otherwise undo what follows later.
  (void)at::get_num_threads();
  using set_fn = void (*)(int);
  static const auto omp_set_num_threads =
      reinterpret_cast<set_fn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (omp_set_num_threads != nullptr) {
    omp_set_num_threads(1);
  }
}
