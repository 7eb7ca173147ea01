//! The layers the model families are made of, initialised as PyTorch initialises them.
//!
//! Random values are drawn on the CPU, from libtorch's CPU generator (which [`super::ModelDef`]
//! seeds for each module), and copied to the var store's device, so one seed gives the same
//! parameters on every device. Layers are created with constant values, which draw nothing, and
//! are then overwritten weight first, bias second, the order of PyTorch's `reset_parameters`.
//!
//! The rules, and where they come from:
//! - [`linear`]: torch.nn.Linear's `reset_parameters`, weight `kaiming_uniform_(a=sqrt(5))`
//!   (gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in)), bias
//!   U(-1/sqrt(fan_in), 1/sqrt(fan_in)). Not tch's default, which uses the ReLU gain (sqrt(6)
//!   times wider).
//! - [`linear_normal`]: torchvision's VGG classifier (std 0.01, bias 0) and BERT's
//!   `_init_weights` (std 0.02, bias 0).
//! - [`conv2d`]: torchvision's VGG and ResNet, `kaiming_normal_(mode="fan_out",
//!   nonlinearity="relu")`, std sqrt(2 / fan_out), bias 0.
//! - [`batch_norm2d`], [`layer_norm`]: weight 1, bias 0 (torch.nn's default, and what torchvision
//!   and BERT set again).
//! - [`embedding_normal`]: BERT's N(0, 0.02).
//!
//! runtime/tests/init.rs checks every model's parameters against statistics PyTorch generates.

use tch::nn::{self, Init};
use tch::{Device, Kind, Tensor};

/// The distribution a parameter's initial values are drawn from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Draw {
    /// U(-bound, bound), as `Tensor.uniform_`.
    Uniform { bound: f64 },
    /// N(0, std^2), as `Tensor.normal_`.
    Normal { std: f64 },
}

impl Draw {
    /// Overwrites `param` (on any device) with values drawn on the CPU.
    fn fill(self, param: &mut Tensor) {
        let mut values = Tensor::empty(param.size(), (Kind::Float, Device::Cpu));
        let _ = match self {
            Draw::Uniform { bound } => values.uniform_(-bound, bound),
            Draw::Normal { std } => values.normal_(0.0, std),
        };
        tch::no_grad(|| param.copy_(&values));
    }
}

/// torch.nn.Linear's default weight: `kaiming_uniform_(a=sqrt(5))`.
fn torch_default_weight(fan_in: i64) -> Draw {
    let a = 5f64.sqrt();
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    Draw::Uniform {
        bound: gain * (3.0 / fan_in as f64).sqrt(),
    }
}

/// torch.nn.Linear's default bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
fn torch_default_bias(fan_in: i64) -> Draw {
    Draw::Uniform {
        bound: 1.0 / (fan_in as f64).sqrt(),
    }
}

/// A linear layer with parameters of zeros: the constructors below fill them.
fn zero_linear(p: nn::Path, d_in: i64, d_out: i64, bias: bool) -> nn::Linear {
    let config = nn::LinearConfig {
        ws_init: Init::Const(0.0),
        bs_init: Some(Init::Const(0.0)),
        bias,
    };
    nn::linear(p, d_in, d_out, config)
}

/// A linear layer as torch.nn.Linear initialises it.
pub fn linear(p: nn::Path, d_in: i64, d_out: i64) -> nn::Linear {
    let mut linear = zero_linear(p, d_in, d_out, true);
    torch_default_weight(d_in).fill(&mut linear.ws);
    if let Some(bs) = &mut linear.bs {
        torch_default_bias(d_in).fill(bs);
    }
    linear
}

/// A linear layer with weight N(0, std^2) and, if it has one, a bias of zeros.
pub fn linear_normal(p: nn::Path, d_in: i64, d_out: i64, std: f64, bias: bool) -> nn::Linear {
    let mut linear = zero_linear(p, d_in, d_out, bias);
    Draw::Normal { std }.fill(&mut linear.ws);
    linear
}

/// A 2-d convolution with parameters of zeros: the constructors below fill them.
fn zero_conv2d(
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
        ws_init: Init::Const(0.0),
        bs_init: Init::Const(0.0),
        ..Default::default()
    };
    nn::conv2d(p, c_in, c_out, kernel, config)
}

/// A 2-d convolution with torchvision's init (Kaiming normal, fan-out, ReLU gain); a bias, if
/// asked for, of zeros.
pub fn conv2d(
    p: nn::Path,
    c_in: i64,
    c_out: i64,
    kernel: i64,
    stride: i64,
    padding: i64,
    bias: bool,
) -> nn::Conv2D {
    let mut conv = zero_conv2d(p, c_in, c_out, kernel, stride, padding, bias);
    let fan_out = c_out * kernel * kernel;
    Draw::Normal {
        std: (2.0 / fan_out as f64).sqrt(),
    }
    .fill(&mut conv.ws);
    conv
}

/// A 2-d convolution with a bias, as torch.nn.Conv2d initialises it (the default torchvision's
/// AlexNet keeps).
pub fn conv2d_default(
    p: nn::Path,
    c_in: i64,
    c_out: i64,
    kernel: i64,
    stride: i64,
    padding: i64,
) -> nn::Conv2D {
    let mut conv = zero_conv2d(p, c_in, c_out, kernel, stride, padding, true);
    let fan_in = c_in * kernel * kernel;
    torch_default_weight(fan_in).fill(&mut conv.ws);
    if let Some(bs) = &mut conv.bs {
        torch_default_bias(fan_in).fill(bs);
    }
    conv
}

/// 2-d batch norm with weight 1 and bias 0 (running mean 0, running variance 1).
pub fn batch_norm2d(p: nn::Path, channels: i64) -> nn::BatchNorm {
    let config = nn::BatchNormConfig {
        ws_init: Init::Const(1.0),
        bs_init: Init::Const(0.0),
        ..Default::default()
    };
    nn::batch_norm2d(p, channels, config)
}

/// Layer norm over the last dimension, weight 1 and bias 0.
pub fn layer_norm(p: nn::Path, hidden: i64, eps: f64) -> nn::LayerNorm {
    let config = nn::LayerNormConfig {
        eps,
        ws_init: Init::Const(1.0),
        bs_init: Init::Const(0.0),
        ..Default::default()
    };
    nn::layer_norm(p, vec![hidden], config)
}

/// An embedding table with entries N(0, std^2) and no padding row.
pub fn embedding_normal(p: nn::Path, rows: i64, dim: i64, std: f64) -> nn::Embedding {
    let config = nn::EmbeddingConfig {
        ws_init: Init::Const(0.0),
        ..Default::default()
    };
    let mut embedding = nn::embedding(p, rows, dim, config);
    Draw::Normal { std }.fill(&mut embedding.ws);
    embedding
}

/// Dropout that is a no-op when `p` is zero or outside training.
pub fn dropout(xs: Tensor, p: f64, train: bool) -> Tensor {
    if p > 0.0 && train {
        xs.dropout(p, train)
    } else {
        xs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_default_bound_is_one_over_sqrt_fan_in() {
        // kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3), bound sqrt(1/3) * sqrt(3/fan_in).
        let Draw::Uniform { bound } = torch_default_weight(400) else {
            panic!("a uniform draw")
        };
        assert!((bound - 0.05).abs() < 1e-15, "{bound}");
        assert_eq!(torch_default_bias(400), Draw::Uniform { bound: 0.05 });
    }
}
