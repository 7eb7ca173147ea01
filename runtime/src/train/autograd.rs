//! Autograd operations beyond tch's `backward()`.

use tch::{Kind, Tensor};

/// Backward from `output` given the gradient of the loss with respect to it (a pipeline stage's
/// backward with the gradient its successor sent).
pub fn backward_with_grad(output: &Tensor, grad: &Tensor) {
    (output * grad).sum(Kind::Float).backward();
}
