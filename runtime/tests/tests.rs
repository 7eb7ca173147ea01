//! Integration tests of the `runtime` binary: real processes, real libtorch, PyTorch's c10d.

mod bundle;
mod checkpoint;
mod compress;
mod cuda;
mod devices;
mod distributed;
mod init;
mod init_from;
mod optim;
mod p2p_order;
mod partial;
mod precision;
mod reduce;
mod single;
mod util;
mod validation;
