//! Integration tests of the `runtime` binary: real processes, real libtorch, PyTorch's c10d.

mod cuda;
mod distributed;
mod optim;
mod single;
mod util;
