//! Integration tests of the `runtime` binary: real processes, real libtorch, PyTorch's c10d.

mod distributed;
mod init;
mod single;
mod util;
