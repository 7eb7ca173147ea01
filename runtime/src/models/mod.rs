//! Models as ordered lists of modules, the loss last (PipeDream's convention), so that any
//! contiguous slice of the list can become a pipeline stage.
//!
//! A [`ModelDef`] describes the model without allocating it; [`ModelDef::build`] builds a slice of
//! it into a var store. Each module is initialised from its own seed, so a stage holding modules
//! `a..b` gets exactly the parameters those modules have in the whole model: pipeline ranks and a
//! single process start from the same weights. Parameters are initialised as PyTorch does
//! (torch.nn's defaults, torchvision's and BERT's own rules; `layers.rs`) and drawn on the CPU
//! whatever the var store's device, so they are also the same on every device.

mod alexnet;
mod layers;
mod mlp;
mod resnet;
mod transformer;
mod vgg;

use std::ops::Range;
use std::sync::{Mutex, MutexGuard};

use tch::{nn, Kind, Tensor};

/// Sizes that the model families read; each family documents which ones it uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOptions {
    /// Output classes of image models.
    pub num_classes: i64,
    /// Side of the square input images.
    pub image_size: i64,
    /// Hidden layers (mlp) or encoder layers (transformer).
    pub layers: usize,
    /// Hidden width (mlp) or hidden size (transformer).
    pub hidden: i64,
    /// Attention heads (transformer).
    pub heads: i64,
    /// Sequence length (transformer).
    pub seq_len: i64,
    /// Vocabulary size (transformer).
    pub vocab_size: i64,
    /// Dropout probability.
    pub dropout: f64,
    /// Hidden units each layer of `sparse_mlp` keeps per sample.
    pub active_units: i64,
}

/// What a model consumes at its first module.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InputKind {
    /// Float images `[batch, 3, size, size]` with class targets `[batch]`.
    Image { size: i64, classes: i64 },
    /// Token ids `[batch, seq_len]` with a target token per position `[batch, seq_len]`.
    Tokens { seq_len: i64, vocab: i64 },
}

/// The last module of every model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Loss {
    /// Cross-entropy of logits `[batch, classes]` against `[batch]`.
    CrossEntropy,
    /// Cross-entropy of logits `[batch, seq, vocab]` against `[batch, seq]`, averaged per token.
    TokenCrossEntropy,
}

impl Loss {
    /// Mean loss of `output` against `target`; a shape mismatch is an error, not a panic.
    pub fn compute(self, output: &Tensor, target: &Tensor) -> Result<Tensor, tch::TchError> {
        match self {
            Loss::CrossEntropy => cross_entropy(output, target),
            Loss::TokenCrossEntropy => {
                let vocab = *output.size().last().unwrap_or(&1);
                cross_entropy(&output.f_reshape([-1, vocab])?, &target.f_reshape([-1])?)
            }
        }
    }

    /// Accuracy of `output` against `target`: the share of the targets the loss counts (all but
    /// `ignore_index`) whose class is among the top 1, and for class logits also the top
    /// [`TOP_K`], of their row's logits, a tie for the last place included (no logit is above
    /// the target's, or fewer than `TOP_K` are). A `[1]` (`[top-1]`) or `[2]` (`[top-1,
    /// top-5]`) `Double` tensor left on the device, 0 where the loss counts none. Both losses
    /// classify along the last dimension, so one rule serves both.
    ///
    /// Top-5 is the figure image classification reports beside top-1 (PipeDream's Prec@5); a
    /// token loss reports top-1 alone, as masked-language-model training does. There it would
    /// also cost: counting the logits above each target's took 14 ms on a CPU for the CPU
    /// benchmark's 512 tokens x 8192 classes (a 110 ms step), and `topk` 5 ms, against 0.07 ms
    /// for 64 images x 1000 classes. Top-1 alone compares the target's logit with the row's
    /// maximum (`amax`, 0.5 ms there) rather than the row's `argmax` with the target: the same
    /// but for ties, and a tenth of the time.
    pub fn accuracy(self, output: &Tensor, target: &Tensor) -> Result<Tensor, tch::TchError> {
        let classes = *output.size().last().unwrap_or(&1);
        let logits = output.f_reshape([-1, classes])?;
        let target = target.f_reshape([-1])?;
        let counted = target.f_ne(IGNORE_INDEX)?;
        // An ignored target reads class 0's logit, and is not counted.
        let picked = target.f_clamp_min(0)?.f_unsqueeze(1)?;
        let theirs = logits.f_gather(1, &picked, false)?;
        // Each k's hits, [k, targets].
        let hits = match self {
            Loss::CrossEntropy => {
                let above =
                    logits
                        .f_gt_tensor(&theirs)?
                        .f_sum_dim_intlist([-1].as_slice(), false, Kind::Int64)?;
                Tensor::f_stack(&[above.f_eq(0)?, above.f_lt(TOP_K)?], 0)?
            }
            Loss::TokenCrossEntropy => {
                let highest = logits.f_amax([-1].as_slice(), false)?;
                theirs.f_squeeze_dim(1)?.f_eq_tensor(&highest)?.f_unsqueeze(0)?
            }
        };
        hits.f_logical_and(&counted)?
            .f_sum_dim_intlist([1].as_slice(), false, Kind::Double)?
            .f_div(&counted.f_sum(Kind::Double)?.f_clamp_min(1.0)?)
    }
}

/// The wider of the two accuracies class logits report (top-5).
pub const TOP_K: i64 = 5;

/// The target that `cross_entropy` leaves out (torch's default `ignore_index`).
const IGNORE_INDEX: i64 = -100;

/// torch's `cross_entropy` (what `torch.nn.functional.cross_entropy` calls), mean over samples.
fn cross_entropy(logits: &Tensor, target: &Tensor) -> Result<Tensor, tch::TchError> {
    logits.f_cross_entropy_loss(target, None::<Tensor>, tch::Reduction::Mean, IGNORE_INDEX, 0.0)
}

/// Builds one module under a var-store path.
type Builder = Box<dyn Fn(&nn::Path) -> Box<dyn nn::ModuleT> + Send + Sync>;

/// A module of the model's list: its name (the torchvision/BERT path of its parameters) and how
/// to build it.
pub struct ModuleDef {
    pub name: String,
    build: Builder,
    /// How to build it and the module after it as one layer, where the model fuses the two (a
    /// convolution and the pool after it): the same parameters, drawn the same way, the next
    /// module having none, and the same computation, in fewer kernels.
    with_next: Option<Builder>,
}

impl ModuleDef {
    fn new<M, F>(name: impl Into<String>, build: F) -> ModuleDef
    where
        M: nn::ModuleT + 'static,
        F: Fn(&nn::Path) -> M + Send + Sync + 'static,
    {
        ModuleDef {
            name: name.into(),
            build: boxed(build),
            with_next: None,
        }
    }

    /// This module, built with the next (which has no parameters) as one layer by `build` where
    /// a stage holds both.
    fn fused_with_next<M, F>(mut self, build: F) -> ModuleDef
    where
        M: nn::ModuleT + 'static,
        F: Fn(&nn::Path) -> M + Send + Sync + 'static,
    {
        self.with_next = Some(boxed(build));
        self
    }
}

/// `build` as a [`Builder`]: the module it makes, boxed.
fn boxed<M, F>(build: F) -> Builder
where
    M: nn::ModuleT + 'static,
    F: Fn(&nn::Path) -> M + Send + Sync + 'static,
{
    Box::new(move |p| Box::new(build(p)))
}

/// A model: its modules in order, then the loss.
pub struct ModelDef {
    pub name: String,
    pub modules: Vec<ModuleDef>,
    pub loss: Loss,
    pub input: InputKind,
}

/// A model name the runtime does not know.
#[derive(Debug, thiserror::Error)]
#[error("unknown model {0:?}; known models: {known}", known = MODEL_NAMES.join(", "))]
pub struct UnknownModel(pub String);

/// Every model `--model` accepts.
pub const MODEL_NAMES: &[&str] = &[
    "mlp",
    "sparse_mlp",
    "alexnet",
    "vgg16",
    "vgg16_bn",
    "resnet50",
    "resnet101",
    "resnet152",
    "transformer",
];

/// Whether the model called `name` has convolutions (what `--channels-last` lays out).
pub fn has_convolutions(name: &str) -> bool {
    matches!(
        name,
        "alexnet" | "vgg16" | "vgg16_bn" | "resnet50" | "resnet101" | "resnet152"
    )
}

/// The size flags the model called `name` is built from (the others do nothing for it): what a
/// checkpoint of it must agree with, since another value changes its parameters' shapes, its
/// input or its arithmetic.
pub fn size_flags(name: &str) -> &'static [&'static str] {
    match name {
        "mlp" => &["--image-size", "--num-classes", "--layers", "--hidden"],
        "sparse_mlp" => &[
            "--image-size",
            "--num-classes",
            "--layers",
            "--hidden",
            "--active-units",
        ],
        "alexnet" | "vgg16" | "vgg16_bn" => &["--image-size", "--num-classes", "--dropout"],
        "resnet50" | "resnet101" | "resnet152" => &["--image-size", "--num-classes"],
        "transformer" => &[
            "--layers",
            "--hidden",
            "--heads",
            "--seq-len",
            "--vocab-size",
            "--dropout",
        ],
        _ => &[],
    }
}

impl ModelOptions {
    /// The value of size flag `flag` (`--hidden`, ...); `None` for a flag that sizes nothing.
    pub fn value_of(&self, flag: &str) -> Option<serde_json::Value> {
        Some(match flag {
            "--num-classes" => self.num_classes.into(),
            "--image-size" => self.image_size.into(),
            "--layers" => self.layers.into(),
            "--hidden" => self.hidden.into(),
            "--heads" => self.heads.into(),
            "--seq-len" => self.seq_len.into(),
            "--vocab-size" => self.vocab_size.into(),
            "--dropout" => self.dropout.into(),
            "--active-units" => self.active_units.into(),
            _ => return None,
        })
    }
}

impl ModelDef {
    /// The model called `name`, sized by `options`.
    pub fn named(name: &str, options: &ModelOptions) -> Result<ModelDef, UnknownModel> {
        let (modules, loss, input) = match name {
            "mlp" => mlp::modules(options),
            "sparse_mlp" => mlp::sparse_modules(options),
            "alexnet" => alexnet::alexnet(options),
            "vgg16" => vgg::vgg16(options, false),
            "vgg16_bn" => vgg::vgg16(options, true),
            "resnet50" => resnet::resnet(options, [3, 4, 6, 3]),
            "resnet101" => resnet::resnet(options, [3, 4, 23, 3]),
            "resnet152" => resnet::resnet(options, [3, 8, 36, 3]),
            "transformer" => transformer::modules(options),
            other => return Err(UnknownModel(other.to_string())),
        };
        Ok(ModelDef {
            name: name.to_string(),
            modules,
            loss,
            input,
        })
    }

    /// Whether its modules hand on sparse COO tensors (so a pipeline's messages vary in size).
    pub fn makes_sparse_activations(&self) -> bool {
        self.name == "sparse_mlp"
    }

    /// Modules in the list, the loss included.
    pub fn num_modules(&self) -> usize {
        self.modules.len() + 1
    }

    /// Name of module `index`, the loss being the last.
    pub fn module_name(&self, index: usize) -> &str {
        self.modules.get(index).map_or("loss", |m| m.name.as_str())
    }

    /// Builds modules `range` (indices into the list; the loss index builds nothing) under `root`,
    /// each initialised from a seed derived from `seed` and its index. Values are drawn on the CPU
    /// and copied to `root`'s device.
    pub fn build(&self, root: &nn::Path, range: Range<usize>, seed: u64) -> Vec<Box<dyn nn::ModuleT>> {
        let end = range.end.min(self.modules.len());
        (range.start..end)
            // Seeding and drawing are one step: libtorch has one CPU generator per process.
            .map(|index| seeded(module_seed(seed, index), || (self.modules[index].build)(root)))
            .collect()
    }

    /// Modules `range` as a stage runs them: the parameters and values [`Self::build`] gives,
    /// but a module the model fuses with the next (a convolution and its pool) built with it as
    /// one layer where `range` holds both. Fewer layers, then, than modules: for anything that
    /// runs or lists modules one by one, [`Self::build`].
    pub fn build_layers(&self, root: &nn::Path, range: Range<usize>, seed: u64) -> Vec<Box<dyn nn::ModuleT>> {
        let end = range.end.min(self.modules.len());
        let mut layers = Vec::with_capacity(end.saturating_sub(range.start));
        let mut index = range.start;
        while index < end {
            let module = &self.modules[index];
            let (build, taken) = match &module.with_next {
                Some(both) if index + 1 < end => (both, 2),
                _ => (&module.build, 1),
            };
            // The next module draws nothing (it has no parameters), so skipping its seeding
            // changes no value.
            layers.push(seeded(module_seed(seed, index), || build(root)));
            index += taken;
        }
        layers
    }

    /// Parameter count of each module, the loss (0) included. Builds each module alone in a
    /// scratch var store, so at most one module's parameters exist at a time.
    pub fn param_counts(&self) -> Vec<u64> {
        let mut counts: Vec<u64> = (0..self.modules.len())
            .map(|index| {
                let vs = nn::VarStore::new(tch::Device::Cpu);
                tch::no_grad(|| drop(self.build(&vs.root(), index..index + 1, 0)));
                count_params(&vs)
            })
            .collect();
        counts.push(0);
        counts
    }

    /// A deterministic input batch of the model's kind, for shape inference and listings.
    pub fn example_input(&self, batch: i64) -> Tensor {
        match self.input {
            InputKind::Image { size, .. } => {
                Tensor::zeros([batch, 3, size, size], (Kind::Float, tch::Device::Cpu))
            }
            InputKind::Tokens { seq_len, .. } => {
                Tensor::zeros([batch, seq_len], (Kind::Int64, tch::Device::Cpu))
            }
        }
    }
}

/// Trainable parameters in a var store.
pub fn count_params(vs: &nn::VarStore) -> u64 {
    vs.trainable_variables().iter().map(|t| t.numel() as u64).sum()
}

/// Held while a module is seeded and initialised, or data drawn from a seed ([`seeded`]), so that
/// two threads doing either (the unit tests do) do not draw from each other's seeds.
static CPU_GENERATOR: Mutex<()> = Mutex::new(());

/// Runs `draw` with libtorch's one CPU generator seeded with `seed` and no other thread seeding or
/// drawing through here meanwhile: what it draws depends on `seed` alone.
pub fn seeded<T>(seed: i64, draw: impl FnOnce() -> T) -> T {
    let _generator = hold_seeded(seed);
    draw()
}

/// libtorch's one CPU generator seeded with `seed` and held until the guard drops, as
/// [`seeded`] holds it for its closure (which must not be called meanwhile: the lock is not
/// reentrant).
pub fn hold_seeded(seed: i64) -> MutexGuard<'static, ()> {
    let generator = CPU_GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    generator
}

fn module_seed(seed: u64, index: usize) -> i64 {
    (seed.wrapping_mul(1_000_003).wrapping_add(index as u64) & (i64::MAX as u64)) as i64
}

#[cfg(test)]
mod tests;
