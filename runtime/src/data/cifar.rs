//! CIFAR-10 in its binary format: `data_batch_N.bin` files of 3073-byte records (a label byte,
//! then 32x32 red, green and blue planes).
//!
//! tch's `vision::cifar::load_dir` insists on all six files of 10,000 records each; this reader
//! accepts any whole number of records in whichever training files exist, so small extracts and
//! test fixtures load too, and says which file is wrong when one is.

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::{
    mirrored, normalize, permutation, resize, sample_seed, Augment, BatchRequest, Batches, DataError,
    SplitMix,
};
use crate::models::InputKind;

pub const CLASSES: i64 = 10;
const SIDE: i64 = 32;
const RECORD: usize = 1 + 3 * (SIDE * SIDE) as usize;
/// `RandomCrop(32, padding=4)`'s padding.
const PAD: i64 = 4;

fn train_files(dir: &Path) -> Vec<PathBuf> {
    (1..=5)
        .map(|i| dir.join(format!("data_batch_{i}.bin")))
        .filter(|p| p.is_file())
        .collect()
}

/// CIFAR-10's held-out split: `test_batch.bin` beside the training files.
fn test_files(dir: &Path) -> Vec<PathBuf> {
    Some(dir.join("test_batch.bin"))
        .filter(|p| p.is_file())
        .into_iter()
        .collect()
}

/// One of CIFAR-10's splits: its files in a folder, and what to say when there are none.
struct Split {
    files: fn(&Path) -> Vec<PathBuf>,
    missing: &'static str,
}

const TRAIN: Split = Split {
    files: train_files,
    missing: "no data_batch_1.bin ... data_batch_5.bin in this folder",
};

const TEST: Split = Split {
    files: test_files,
    missing: "no test_batch.bin in this folder: a validation pass over CIFAR-10 reads its test split there",
};

impl Split {
    /// The split's files in `dir`, at least one.
    fn files_in(&self, dir: &Path) -> Result<Vec<PathBuf>, DataError> {
        let files = (self.files)(dir);
        match files.is_empty() {
            true => Err(DataError::malformed(dir, self.missing)),
            false => Ok(files),
        }
    }

    /// The split's images in `dir`, from its files' sizes alone.
    fn count(&self, dir: &Path) -> Result<u64, DataError> {
        let mut records = 0;
        for file in self.files_in(dir)? {
            records += std::fs::metadata(&file).map_err(DataError::io(&file))?.len() / RECORD as u64;
        }
        Ok(records)
    }
}

/// The training images in `dir`'s files, from their sizes alone.
pub fn count(dir: &Path) -> Result<u64, DataError> {
    TRAIN.count(dir)
}

/// The held-out images in `dir`'s `test_batch.bin`, from its size alone.
pub fn test_count(dir: &Path) -> Result<u64, DataError> {
    TEST.count(dir)
}

/// Whether `dir` holds CIFAR-10 binary training files.
pub fn looks_like(dir: &Path) -> bool {
    !train_files(dir).is_empty()
}

pub struct Cifar10 {
    images: Tensor,
    labels: Tensor,
    order: Tensor,
    cursor: i64,
    epoch: u64,
    request: BatchRequest,
    size: i64,
    /// Samples taken since the stream's start: the position of the next batch's first.
    taken: u64,
}

impl Cifar10 {
    /// The training split: `data_batch_1.bin` to `data_batch_5.bin`, those that exist.
    pub fn open(dir: &Path, request: BatchRequest) -> Result<Cifar10, DataError> {
        Cifar10::open_split(dir, TRAIN, request)
    }

    /// The held-out split: `test_batch.bin`.
    pub fn open_test(dir: &Path, request: BatchRequest) -> Result<Cifar10, DataError> {
        Cifar10::open_split(dir, TEST, request)
    }

    fn open_split(dir: &Path, split: Split, request: BatchRequest) -> Result<Cifar10, DataError> {
        let InputKind::Image { size, .. } = request.input else {
            return Err(DataError::WrongKind {
                what: "CIFAR-10",
                input: request.input,
            });
        };
        if !dir.is_dir() {
            return Err(DataError::malformed(
                dir,
                "expected a folder of CIFAR-10 binary files (data_batch_1.bin ...)",
            ));
        }
        let files = split.files_in(dir)?;
        let mut bytes = Vec::new();
        for file in &files {
            let content = std::fs::read(file).map_err(DataError::io(file))?;
            if content.is_empty() || content.len() % RECORD != 0 {
                return Err(DataError::malformed(
                    file,
                    format!(
                        "{} bytes is not a whole number of {RECORD}-byte CIFAR-10 records",
                        content.len()
                    ),
                ));
            }
            bytes.extend_from_slice(&content);
        }
        let records = Tensor::from_slice(&bytes).view([-1, RECORD as i64]);
        let labels = records.select(1, 0).to_kind(Kind::Int64);
        if labels.max().int64_value(&[]) >= CLASSES {
            return Err(DataError::malformed(dir, "a record has a label byte above 9"));
        }
        // Replicas read disjoint, interleaved shards.
        let shard = Tensor::arange_start_step(
            request.shard.index as i64,
            labels.size()[0],
            request.shard.count as i64,
            (Kind::Int64, tch::Device::Cpu),
        );
        if shard.size()[0] == 0 {
            return Err(DataError::malformed(
                dir,
                format!("too few records for {} replicas", request.shard.count),
            ));
        }
        let images = records
            .narrow(1, 1, RECORD as i64 - 1)
            .view([-1, 3, SIDE, SIDE])
            .index_select(0, &shard);
        let labels = labels.index_select(0, &shard);
        let mut data = Cifar10 {
            order: Tensor::new(),
            images,
            labels,
            cursor: 0,
            epoch: 0,
            request,
            size,
            taken: 0,
        };
        data.shuffle();
        Ok(data)
    }

    fn shuffle(&mut self) {
        let order = permutation(
            self.labels.size()[0] as usize,
            self.request.seed.wrapping_add(self.epoch),
        );
        self.order = Tensor::from_slice(&order.into_iter().map(|i| i as i64).collect::<Vec<_>>());
        self.cursor = 0;
        self.epoch += 1;
    }
}

impl Batches for Cifar10 {
    fn next_batch(&mut self) -> Result<(Tensor, Tensor), DataError> {
        let n = self.order.size()[0];
        let batch = self.request.batch_size as i64;
        let mut picked = Vec::new();
        let mut count = 0;
        while count < batch {
            if self.cursor == n {
                self.shuffle();
            }
            let take = (batch - count).min(n - self.cursor);
            picked.push(self.order.narrow(0, self.cursor, take));
            self.cursor += take;
            count += take;
        }
        let index = Tensor::cat(&picked, 0);
        let mut images = self.images.index_select(0, &index);
        if self.request.augment == Augment::CropFlip {
            images = random_crop_and_flip(&images, self.request.seed, self.taken);
        }
        self.taken += batch as u64;
        let images = resize(normalize(&images), self.size);
        let labels = self.labels.index_select(0, &index);
        Ok((
            images.to_device(self.request.device),
            labels.to_device(self.request.device),
        ))
    }
}

/// torchvision's `RandomCrop(32, padding=4)` (zeros around the image) and
/// `RandomHorizontalFlip()` of uint8 images `[n, 3, 32, 32]`, CIFAR-10 training's recipe; each
/// sample's offsets and mirror are drawn from the seed and its position, `first` being the
/// first's.
fn random_crop_and_flip(images: &Tensor, seed: u64, first: u64) -> Tensor {
    let padded = images.constant_pad_nd([PAD, PAD, PAD, PAD]);
    let rows: Vec<Tensor> = (0..images.size()[0])
        .map(|j| {
            let mut draws = SplitMix::new(sample_seed(seed, first + j as u64));
            let top = draws.below(2 * PAD as u64 + 1) as i64;
            let left = draws.below(2 * PAD as u64 + 1) as i64;
            mirrored(
                padded.get(j).narrow(1, top, SIDE).narrow(2, left, SIDE),
                draws.coin(),
            )
        })
        .collect();
    Tensor::stack(&rows, 0)
}
