//! An ImageFolder tree as torchvision reads it: one subfolder per class (sorted names give the
//! class indices), JPEG or PNG files inside. Images are decoded and resized by tch's image
//! helpers on a background thread that keeps the next batches ready.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread;

use tch::Tensor;

use super::{normalize, permutation, BatchRequest, Batches, DataError};
use crate::models::InputKind;

const PREFETCH: usize = 2;
const EXTENSIONS: &[&str] = &["jpg", "jpeg", "png"];

/// The class subfolders of `dir`, sorted by name.
pub fn class_dirs(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let entries = std::fs::read_dir(dir).map_err(DataError::io(dir))?;
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    if dirs.is_empty() {
        return Err(DataError::malformed(
            dir,
            "expected one subfolder of images per class, found no subfolders",
        ));
    }
    dirs.sort();
    Ok(dirs)
}

/// The images in `dir`'s class folders.
pub fn count(dir: &Path) -> Result<u64, DataError> {
    Ok(samples(dir)?.len() as u64)
}

fn samples(dir: &Path) -> Result<Vec<(PathBuf, i64)>, DataError> {
    let mut samples = Vec::new();
    for (label, class) in class_dirs(dir)?.iter().enumerate() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(class)
            .map_err(DataError::io(class))?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
            })
            .collect();
        files.sort();
        samples.extend(files.into_iter().map(|f| (f, label as i64)));
    }
    if samples.is_empty() {
        return Err(DataError::malformed(
            dir,
            "found no .jpg, .jpeg or .png files in the class subfolders",
        ));
    }
    Ok(samples)
}

pub struct ImageFolder {
    batches: Receiver<Result<(Tensor, Tensor), DataError>>,
    device: tch::Device,
}

impl ImageFolder {
    pub fn open(dir: &Path, request: BatchRequest) -> Result<ImageFolder, DataError> {
        let InputKind::Image { size, .. } = request.input else {
            return Err(DataError::WrongKind {
                what: "ImageFolder",
                input: request.input,
            });
        };
        let all = samples(dir)?;
        let mine: Vec<_> = all
            .into_iter()
            .skip(request.shard.index)
            .step_by(request.shard.count)
            .collect();
        if mine.is_empty() {
            return Err(DataError::malformed(
                dir,
                format!("too few images for {} replicas", request.shard.count),
            ));
        }
        // Decode the first image now, so a broken tree fails at start rather than mid-run.
        drop(load(&mine[0].0, size)?);
        let (tx, rx) = mpsc::sync_channel(PREFETCH);
        thread::Builder::new()
            .name("imagefolder".into())
            .spawn(move || produce(mine, request, size, tx))
            .map_err(DataError::io(dir))?;
        Ok(ImageFolder {
            batches: rx,
            device: request.device,
        })
    }
}

fn load(path: &Path, size: i64) -> Result<Tensor, DataError> {
    tch::vision::image::load_and_resize(path, size, size)
        .map_err(|e| DataError::malformed(path, format!("cannot decode image: {e}")))
}

/// Runs on the loader thread until the training loop drops its receiver.
fn produce(
    samples: Vec<(PathBuf, i64)>,
    request: BatchRequest,
    size: i64,
    tx: SyncSender<Result<(Tensor, Tensor), DataError>>,
) {
    let mut epoch = 0u64;
    let mut order: Vec<usize> = Vec::new();
    let mut cursor = 0usize;
    loop {
        let mut images = Vec::with_capacity(request.batch_size);
        let mut labels = Vec::with_capacity(request.batch_size);
        let mut failed = None;
        while images.len() < request.batch_size {
            if cursor == order.len() {
                order = permutation(samples.len(), request.seed.wrapping_add(epoch));
                cursor = 0;
                epoch += 1;
            }
            let (path, label) = &samples[order[cursor]];
            cursor += 1;
            match load(path, size) {
                Ok(image) => {
                    images.push(image);
                    labels.push(*label);
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let batch = match failed {
            Some(e) => Err(e),
            None => Ok((normalize(&Tensor::stack(&images, 0)), Tensor::from_slice(&labels))),
        };
        let stop = batch.is_err();
        if tx.send(batch).is_err() || stop {
            return;
        }
    }
}

impl Batches for ImageFolder {
    fn next_batch(&mut self) -> Result<(Tensor, Tensor), DataError> {
        let (images, labels) = self
            .batches
            .recv()
            .expect("the image loader thread ends only after an error")?;
        Ok((images.to_device(self.device), labels.to_device(self.device)))
    }
}
