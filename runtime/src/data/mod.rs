//! Training data: where batches come from (synthetic, CIFAR-10 binary, an ImageFolder tree) and
//! the [`Batches`] stream the training loop pulls from.

mod cifar;
mod image_folder;
mod synthetic;

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use tch::{Device, Tensor};

use crate::models::InputKind;

/// The `--data` argument, parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSpec {
    /// Deterministic data made from the seed.
    Synthetic,
    /// A folder of CIFAR-10 binary files (`data_batch_N.bin`).
    Cifar10(PathBuf),
    /// A folder with one subfolder of images per class.
    ImageFolder(PathBuf),
}

/// A dataset that is missing or malformed; the message names the path and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("--data: {spec:?} is not `synthetic`, `cifar10:DIR`, `imagefolder:DIR` or an existing folder")]
    BadSpec { spec: String },
    #[error("--data: {path}: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("--data: cannot read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--data: {what} data does not fit model input {input:?}")]
    WrongKind { what: &'static str, input: InputKind },
}

impl DataError {
    pub(crate) fn malformed(path: &Path, reason: impl Into<String>) -> DataError {
        DataError::Malformed {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
        move |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

impl DataSpec {
    /// Parses `synthetic`, `cifar10:DIR`, `imagefolder:DIR`, or a folder whose layout tells the
    /// format. An image folder split as ImageNet's is (`train/` beside `val/`, each a folder per
    /// class) means its `train/`, as PipeDream's `--data_dir` does.
    pub fn parse(text: &str) -> Result<DataSpec, DataError> {
        if text == "synthetic" {
            return Ok(DataSpec::Synthetic);
        }
        if let Some(dir) = text.strip_prefix("cifar10:") {
            return Ok(DataSpec::Cifar10(dir.into()));
        }
        if let Some(dir) = text.strip_prefix("imagefolder:") {
            return Ok(DataSpec::ImageFolder(image_folder::training_split(Path::new(
                dir,
            ))));
        }
        let path = Path::new(text);
        if path.is_dir() {
            return Ok(if cifar::looks_like(path) {
                DataSpec::Cifar10(path.into())
            } else {
                DataSpec::ImageFolder(image_folder::training_split(path))
            });
        }
        Err(DataError::BadSpec {
            spec: text.to_string(),
        })
    }

    /// Samples in the dataset (once over is an epoch); synthetic data, which has no size of its
    /// own, counts as PipeDream's synthetic dataset.
    pub fn samples(&self) -> Result<u64, DataError> {
        match self {
            DataSpec::Synthetic => Ok(stagehand_contract::defaults::SYNTHETIC_EPOCH_SAMPLES),
            DataSpec::Cifar10(dir) => cifar::count(dir),
            DataSpec::ImageFolder(dir) => image_folder::count(dir),
        }
    }

    /// Classes the dataset defines, if it fixes them.
    pub fn num_classes(&self) -> Result<Option<i64>, DataError> {
        match self {
            DataSpec::Synthetic => Ok(None),
            DataSpec::Cifar10(_) => Ok(Some(cifar::CLASSES)),
            DataSpec::ImageFolder(dir) => Ok(Some(image_folder::class_dirs(dir)?.len() as i64)),
        }
    }
}

impl fmt::Display for DataSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSpec::Synthetic => write!(f, "synthetic"),
            DataSpec::Cifar10(dir) => write!(f, "cifar10:{}", dir.display()),
            DataSpec::ImageFolder(dir) => write!(f, "imagefolder:{}", dir.display()),
        }
    }
}

/// Which part of the data a rank reads: replicas of a stage read disjoint shards.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };
}

/// How images become the model's input (`--augment`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Augment {
    /// Each dataset's training recipe, half of the images mirrored: for an image folder
    /// torchvision's `RandomResizedCrop(size)` and `RandomHorizontalFlip()` (ImageNet training's,
    /// and PipeDream's), for CIFAR-10 `RandomCrop(32, padding=4)` and `RandomHorizontalFlip()`.
    CropFlip,
    /// The same input each epoch: an image folder's images through torchvision's `Resize(size)`
    /// and `CenterCrop(size)`; CIFAR-10's as they are.
    None,
}

impl Augment {
    /// Its `--augment` spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            Augment::CropFlip => "crop-flip",
            Augment::None => "none",
        }
    }
}

/// What every batch source needs to know.
#[derive(Debug, Clone)]
pub struct BatchRequest {
    pub input: InputKind,
    pub batch_size: usize,
    pub seed: u64,
    pub shard: Shard,
    pub device: Device,
    /// An image folder's transform (other data has none).
    pub augment: Augment,
    /// Threads decoding an image folder's images.
    pub workers: usize,
    /// The rows of each batch this rank uses, where it uses only some (a replica of the first
    /// stage takes its own microbatches of every minibatch); `None` for all. An image folder
    /// decodes only these and leaves the other rows zero.
    pub rows: Option<Vec<Range<usize>>>,
}

/// An endless stream of `(input, target)` batches on the requested device.
pub trait Batches: Send {
    fn next_batch(&mut self) -> Result<(Tensor, Tensor), DataError>;

    /// Passes over the next `batches` batches (those a resumed run's iterations already took),
    /// leaving the stream where taking them would have.
    fn skip(&mut self, batches: u64) -> Result<(), DataError> {
        for _ in 0..batches {
            drop(self.next_batch()?);
        }
        Ok(())
    }

    /// The rows of each batch that hold data, where only some do (`BatchRequest::rows`).
    fn rows(&self) -> Option<&[Range<usize>]> {
        None
    }
}

/// Opens the dataset described by `spec` as a stream of batches.
pub fn open(spec: &DataSpec, request: BatchRequest) -> Result<Box<dyn Batches>, DataError> {
    match spec {
        DataSpec::Synthetic => Ok(Box::new(synthetic::Synthetic::new(request))),
        DataSpec::Cifar10(dir) => Ok(Box::new(cifar::Cifar10::open(dir, request)?)),
        DataSpec::ImageFolder(dir) => Ok(Box::new(image_folder::ImageFolder::open(dir, request)?)),
    }
}

/// The held-out split of a dataset, found once (an image folder's `val/` and its classes checked
/// at start, not at each pass): where a validation pass reads.
#[derive(Debug, Clone)]
pub enum HeldOut {
    /// Samples of the same classes or rule, drawn apart from the training pool.
    Synthetic,
    /// The folder whose `test_batch.bin` holds CIFAR-10's test split.
    Cifar10(PathBuf),
    /// An image folder's `val/` beside its `train/`, with the same class folders.
    ImageFolder(PathBuf),
}

impl DataSpec {
    /// The held-out split beside this training data: CIFAR-10's `test_batch.bin`, an image
    /// folder's `val/` beside its `train/`, or synthetic samples drawn apart from the pool.
    pub fn held_out(&self) -> Result<HeldOut, DataError> {
        Ok(match self {
            DataSpec::Synthetic => HeldOut::Synthetic,
            DataSpec::Cifar10(dir) => HeldOut::Cifar10(dir.clone()),
            DataSpec::ImageFolder(dir) => HeldOut::ImageFolder(image_folder::validation_split(dir)?),
        })
    }
}

impl HeldOut {
    /// The split as a stream of batches in a fixed order, the same each time it is opened.
    /// Images are transformed as for evaluation (`--augment none`), whatever the training's
    /// augmentation.
    pub fn open(&self, request: BatchRequest) -> Result<Box<dyn Batches>, DataError> {
        let request = BatchRequest {
            augment: Augment::None,
            ..request
        };
        match self {
            HeldOut::Synthetic => Ok(Box::new(synthetic::Synthetic::held_out(request))),
            HeldOut::Cifar10(dir) => Ok(Box::new(cifar::Cifar10::open_test(dir, request)?)),
            HeldOut::ImageFolder(val) => Ok(Box::new(image_folder::ImageFolder::open(val, request)?)),
        }
    }

    /// Whole minibatches of `batch_size` in a validation pass: `asked` when given (no more than
    /// the split holds), else all the split holds (synthetic data, which has no size,
    /// [`synthetic::HELD_OUT_BATCHES`]).
    pub fn batches(&self, batch_size: usize, asked: Option<u64>) -> Result<u64, DataError> {
        let (samples, path) = match self {
            HeldOut::Synthetic => return Ok(asked.unwrap_or(synthetic::HELD_OUT_BATCHES)),
            HeldOut::Cifar10(dir) => (cifar::test_count(dir)?, dir),
            HeldOut::ImageFolder(val) => (image_folder::count(val)?, val),
        };
        let whole = samples / batch_size as u64;
        match asked {
            Some(n) if n > whole => Err(DataError::malformed(
                path,
                format!(
                    "--validation-batches {n} of --batch-size {batch_size} asks for {} samples, but \
                     the held-out split has {samples}: give at most {whole}",
                    n * batch_size as u64
                ),
            )),
            Some(n) => Ok(n),
            None if whole == 0 => Err(DataError::malformed(
                path,
                format!(
                    "the held-out split has {samples} samples, fewer than one minibatch of \
                     --batch-size {batch_size}"
                ),
            )),
            None => Ok(whole),
        }
    }
}

/// ImageNet's per-channel mean and standard deviation, which torchvision models expect.
fn normalize(images: &Tensor) -> Tensor {
    let opts = (tch::Kind::Float, images.device());
    let mean = Tensor::from_slice(&[0.485f32, 0.456, 0.406])
        .to_device(opts.1)
        .view([1, 3, 1, 1]);
    let std = Tensor::from_slice(&[0.229f32, 0.224, 0.225])
        .to_device(opts.1)
        .view([1, 3, 1, 1]);
    (images.to_kind(opts.0) / 255.0 - mean) / std
}

/// Resizes a float `[n, 3, h, w]` batch to `size` x `size` if it is not already.
fn resize(images: Tensor, size: i64) -> Tensor {
    let dims = images.size();
    if dims[2] == size && dims[3] == size {
        images
    } else {
        images.upsample_bilinear2d([size, size], false, None, None)
    }
}

/// A permutation of `0..n` from `seed`, made without touching libtorch's global generator (which
/// dropout and initialisation use), so data order never changes the model's random stream.
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut draws = SplitMix::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (draws.next_u64() % (i as u64 + 1)) as usize);
    }
    order
}

/// An image `[3, h, w]` mirrored left to right if `flip` (torchvision's `hflip`), else as it is.
fn mirrored(image: Tensor, flip: bool) -> Tensor {
    if flip {
        image.flip([2])
    } else {
        image
    }
}

/// The seed of the random transform of the sample at `position` of the stream (samples taken
/// since its start): the same whoever makes the batch.
pub(super) fn sample_seed(seed: u64, position: u64) -> u64 {
    SplitMix::new(seed ^ 0x5eed_da7a).next_u64() ^ position.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// splitmix64: the data's own random numbers, apart from libtorch's generator.
pub struct SplitMix {
    state: u64,
}

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[low, high)`, from the top 53 bits of a draw.
    pub fn uniform(&mut self, low: f64, high: f64) -> f64 {
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        low + (high - low) * unit
    }

    /// `RandomHorizontalFlip`'s draw: true for half of the draws.
    pub fn coin(&mut self) -> bool {
        self.uniform(0.0, 1.0) < 0.5
    }

    /// Uniform in `0..n` (`n` > 0), by multiply and shift (biased by less than `n / 2^64`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests;
