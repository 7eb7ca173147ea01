//! Small building blocks shared by the model families.

use tch::nn::{self, Init};
use tch::Tensor;

/// torchvision's convolution init: Kaiming normal, fan-out, for a following ReLU.
pub const KAIMING_FAN_OUT: Init = Init::Kaiming {
    dist: nn::init::NormalOrUniform::Normal,
    fan: nn::init::FanInOut::FanOut,
    non_linearity: nn::init::NonLinearity::ReLU,
};

/// A 2-d convolution with torchvision's init; `bias` as given.
pub fn conv2d(
    p: nn::Path,
    c_in: i64,
    c_out: i64,
    kernel: i64,
    stride: i64,
    padding: i64,
    bias: bool,
) -> nn::Conv2D {
    let config = nn::ConvConfig {
        stride,
        padding,
        bias,
        ws_init: KAIMING_FAN_OUT,
        bs_init: Init::Const(0.0),
        ..Default::default()
    };
    nn::conv2d(p, c_in, c_out, kernel, config)
}

/// Dropout that is a no-op when `p` is zero or outside training.
pub fn dropout(xs: Tensor, p: f64, train: bool) -> Tensor {
    if p > 0.0 && train {
        xs.dropout(p, train)
    } else {
        xs
    }
}
