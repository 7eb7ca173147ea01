//! Command-line arguments. The clap types stop here: [`Cli::into_command`] turns them into the
//! validated [`crate::config`] types the rest of the runtime works with.

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{
    Command, ConfigError, DeviceSpec, ModelChoice, ModulesConfig, OptimizerKind, TrainConfig,
};
use crate::data::DataSpec;

/// One training process (rank) of a model split across ranks.
///
/// stdout carries one JSON metrics object per line (docs/metrics.md); human-readable text goes to
/// stderr.
#[derive(Debug, Parser)]
#[command(
    name = "runtime",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Sub>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Print the model's module list (index, name, parameters, output shape), to write stage configs by hand.
    Modules(ModulesArgs),
}

#[derive(Debug, Args)]
struct ModelArgs {
    /// Model to train: mlp, vgg16, vgg16_bn, resnet50, resnet101, resnet152 or transformer.
    #[arg(long, required = true)]
    model: Option<String>,
    /// Output classes of image models [default: from the dataset, else 1000; 10 for mlp].
    #[arg(long)]
    num_classes: Option<i64>,
    /// Side of the square input images [default: 224; 32 for mlp and CIFAR-10].
    #[arg(long)]
    image_size: Option<i64>,
    /// Hidden layers (mlp, default 4) or encoder layers (transformer, default 12).
    #[arg(long)]
    layers: Option<usize>,
    /// Hidden width (mlp, default 1024) or hidden size (transformer, default 768).
    #[arg(long)]
    hidden: Option<i64>,
    /// Attention heads of the transformer [default: 12].
    #[arg(long)]
    heads: Option<i64>,
    /// Sequence length of the transformer [default: 128].
    #[arg(long)]
    seq_len: Option<i64>,
    /// Vocabulary size of the transformer [default: 30522].
    #[arg(long)]
    vocab_size: Option<i64>,
    /// Dropout probability [default: 0.5 for VGG's classifier, 0.1 for the transformer, 0 otherwise].
    #[arg(long)]
    dropout: Option<f64>,
}

#[derive(Debug, Args)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Samples per iteration (minibatch).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Iterations (optimizer steps) to run.
    #[arg(long, default_value_t = 10)]
    iterations: u64,
    /// Learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    optimizer: OptimizerArg,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// Weight decay (L2 penalty).
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Seed for parameters and synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Data: `synthetic`, `cifar10:DIR` (CIFAR-10 binary files), `imagefolder:DIR` (a subfolder of
    /// images per class), or a DIR whose format is recognised.
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Intra-op threads for libtorch [default: libtorch's own choice].
    #[arg(long)]
    threads: Option<usize>,
    /// Leading iterations left out of the summary's throughput.
    #[arg(long, default_value_t = 1)]
    warmup: u64,
}

#[derive(Debug, Args)]
struct ModulesArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Batch size used to compute output shapes.
    #[arg(long, default_value_t = 1)]
    batch_size: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OptimizerArg {
    Sgd,
    Adam,
}

impl Cli {
    /// Validates the arguments into the command to run.
    pub fn into_command(self) -> Result<Command, ConfigError> {
        match self.command {
            Some(Sub::Modules(m)) => Ok(Command::Modules(ModulesConfig {
                model: m.model.into_choice(None)?,
                batch_size: positive("--batch-size", m.batch_size)?,
                json: m.json,
            })),
            None => self.train.into_config().map(Command::Train),
        }
    }
}

impl TrainArgs {
    fn into_config(self) -> Result<TrainConfig, ConfigError> {
        let data = DataSpec::parse(&self.data)?;
        let model = self.model.into_choice(Some(&data))?;
        let optimizer = match self.optimizer {
            OptimizerArg::Sgd => OptimizerKind::Sgd {
                momentum: self.momentum,
                weight_decay: self.weight_decay,
            },
            OptimizerArg::Adam => OptimizerKind::Adam {
                weight_decay: self.weight_decay,
            },
        };
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(ConfigError::Invalid {
                flag: "--lr",
                reason: format!("{} is not a positive number", self.lr),
            });
        }
        Ok(TrainConfig {
            model,
            batch_size: positive("--batch-size", self.batch_size)?,
            iterations: self.iterations,
            lr: self.lr,
            optimizer,
            seed: self.seed,
            data,
            device: DeviceSpec::parse(&self.device)?,
            threads: self.threads.map(|t| positive("--threads", t)).transpose()?,
            warmup: self.warmup,
        })
    }
}

impl ModelArgs {
    fn into_choice(self, data: Option<&DataSpec>) -> Result<ModelChoice, ConfigError> {
        let name = self.model.expect("clap requires --model");
        ModelChoice::resolve(
            name,
            data,
            crate::config::ModelOverrides {
                num_classes: self.num_classes,
                image_size: self.image_size,
                layers: self.layers,
                hidden: self.hidden,
                heads: self.heads,
                seq_len: self.seq_len,
                vocab_size: self.vocab_size,
                dropout: self.dropout,
            },
        )
    }
}

fn positive(flag: &'static str, value: usize) -> Result<usize, ConfigError> {
    if value == 0 {
        return Err(ConfigError::Invalid {
            flag,
            reason: "must be at least 1".to_string(),
        });
    }
    Ok(value)
}
