//! An ImageFolder tree as torchvision reads it: one subfolder per class (sorted names give the
//! class indices), its images (JPEG, PNG, BMP, PPM, PGM) anywhere below it, decoded to RGB.
//!
//! Images are decoded and transformed by a pool of worker threads (`--data-workers`, as
//! `DataLoader`'s `num_workers`), each making whole batches: worker `k` of `n` makes batches
//! `k`, `k + n`, ... and keeps the next few ready, and the training loop takes them in order. What
//! a batch holds depends only on the seed and the batch's place in the stream (its samples follow
//! the epoch's permutation, and each sample's crop and flip are drawn from the seed and its
//! position), never on the number of workers or which finished first. Skipping batches (a resumed
//! run's) decodes nothing, and neither do the rows of a batch this rank does not use (the other
//! replicas' microbatches), which stay zero.
//!
//! The transforms are torchvision's, done with the same libtorch operator as torchvision's v2
//! transforms on a uint8 tensor (`interpolate(..., mode="bilinear", antialias=True)`):
//! [`Augment::CropFlip`] is `RandomResizedCrop(size)` then `RandomHorizontalFlip()` (ImageNet
//! training's, and PipeDream's), [`Augment::None`] is `Resize(size)` then `CenterCrop(size)`
//! (ImageNet evaluation's at the model's size). Batches travel to the device as bytes and are
//! normalised there; for a GPU the workers pin them, and the copy does not hold up the training
//! thread.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread;

use tch::Tensor;

use super::{
    mirrored, normalize, permutation, sample_seed, Augment, BatchRequest, Batches, DataError, SplitMix,
};
use crate::models::InputKind;

/// Batches each worker keeps ready beyond the one it is making.
const PREFETCH: usize = 2;
/// torchvision's image extensions that the decoders here read (JPEG through zune-jpeg, the
/// rest through stb_image), and those they do not.
const EXTENSIONS: &[&str] = &[".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm"];
const UNREADABLE: &[&str] = &[".tif", ".tiff", ".webp"];

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

/// Subfolders that name a dataset's splits rather than classes.
const SPLITS: &[&str] = &["train", "val", "validation", "test"];

/// `dir/train` where `dir` is split as ImageNet's is (its subfolders are splits, `train` among
/// them), as PipeDream reads its `--data_dir`; otherwise `dir` itself.
pub fn training_split(dir: &Path) -> PathBuf {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return dir.to_path_buf();
    };
    let subfolders: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let split =
        subfolders.iter().any(|f| f == "train") && subfolders.iter().all(|f| SPLITS.contains(&f.as_str()));
    if split {
        dir.join("train")
    } else {
        dir.to_path_buf()
    }
}

/// The held-out split of the training split `train`: its sibling `val/` (or `validation/`) in
/// a folder split as ImageNet's is, with the same class folders (class indices come from their
/// sorted names, so a missing one would relabel the rest).
pub fn validation_split(train: &Path) -> Result<PathBuf, DataError> {
    let sibling = train
        .parent()
        .filter(|_| train.file_name().is_some_and(|n| n == "train"))
        .and_then(|parent| {
            ["val", "validation"]
                .iter()
                .map(|name| parent.join(name))
                .find(|dir| dir.is_dir())
        });
    let Some(val) = sibling else {
        return Err(DataError::malformed(
            train,
            "no validation split: a validation pass over an image folder reads the `val/` beside \
             its `train/` (give the folder that holds both, split as ImageNet's is)",
        ));
    };
    let names = |dir: &Path| -> Result<Vec<std::ffi::OsString>, DataError> {
        Ok(class_dirs(dir)?
            .iter()
            .filter_map(|d| d.file_name().map(|n| n.to_os_string()))
            .collect())
    };
    if names(&val)? != names(train)? {
        return Err(DataError::malformed(
            &val,
            format!(
                "its class folders are not those of {}: the classes' indices come from their \
                 sorted names, so both splits need the same ones",
                train.display()
            ),
        ));
    }
    Ok(val)
}

/// The images in `dir`'s class folders. The listing is kept for [`ImageFolder::open`] of the
/// same folder to take, so a run that counts its epoch walks the tree once (ImageNet's is a
/// million files, seconds to list on a network filesystem).
pub fn count(dir: &Path) -> Result<u64, DataError> {
    let all = samples(dir)?;
    let n = all.len() as u64;
    let mut listed = LISTED.lock().unwrap_or_else(|e| e.into_inner());
    listed.retain(|(of, _)| of != dir);
    listed.push((dir.to_path_buf(), all));
    Ok(n)
}

/// The listings [`count`] made and no [`ImageFolder::open`] took yet, by folder (a run has one).
static LISTED: Mutex<Vec<(PathBuf, Samples)>> = Mutex::new(Vec::new());

/// Each image's path and class index, in torchvision's order.
type Samples = Vec<(PathBuf, i64)>;

/// `dir`'s samples: the listing [`count`] kept of it (taken, so it is not held twice), else a
/// new walk.
fn listed(dir: &Path) -> Result<Samples, DataError> {
    let kept = {
        let mut listed = LISTED.lock().unwrap_or_else(|e| e.into_inner());
        let at = listed.iter().position(|(of, _)| of == dir);
        at.map(|i| listed.swap_remove(i).1)
    };
    match kept {
        Some(all) => Ok(all),
        None => samples(dir),
    }
}

#[cfg(test)]
thread_local! {
    /// The walks of class folders this thread made, for tests to count.
    pub(super) static WALKS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// torchvision's `ImageFolder` samples: each class folder walked as `sorted(os.walk(class_dir,
/// followlinks=True))` (folders in the order of their paths, files by name within each), the
/// files whose names end, in any case, in an image extension; a class with none is an error, as
/// it is there. Of torchvision's extensions, TIFF and WebP are refused by name, not left out: the
/// decoders here do not read them, and leaving them out would train on fewer images than
/// PyTorch does.
pub(super) fn samples(dir: &Path) -> Result<Samples, DataError> {
    #[cfg(test)]
    WALKS.with(|w| w.set(w.get() + 1));
    let mut samples = Vec::new();
    let mut empty = Vec::new();
    for (label, class) in class_dirs(dir)?.iter().enumerate() {
        let mut folders = Vec::new();
        walk(class, &mut folders, &mut Vec::new())?;
        folders.sort_by(|a, b| a.0.cmp(&b.0));
        let before = samples.len();
        for (_, mut files) in folders {
            files.sort_by(|a: &(String, PathBuf), b| a.0.cmp(&b.0));
            for (name, path) in files {
                let lower = name.to_ascii_lowercase();
                if let Some(ext) = UNREADABLE.iter().find(|e| lower.ends_with(*e)) {
                    return Err(DataError::malformed(
                        &path,
                        format!(
                            "{ext} images are not decoded here (JPEG, PNG, BMP, PPM and PGM are); \
                             convert them, to PNG say, or move them out of the folder"
                        ),
                    ));
                }
                if EXTENSIONS.iter().any(|e| lower.ends_with(*e)) {
                    samples.push((path, label as i64));
                }
            }
        }
        if samples.len() == before {
            empty.push(
                class
                    .file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            );
        }
    }
    if !empty.is_empty() {
        return Err(DataError::malformed(
            dir,
            format!(
                "found no images for the classes {} (files ending in {})",
                empty.join(", "),
                EXTENSIONS.join(", ")
            ),
        ));
    }
    Ok(samples)
}

/// The folders under `dir` (itself included, symbolic links followed, each real folder once),
/// each with its files as (name, path), for [`samples`] to sort as Python's `os.walk` lists them.
fn walk(
    dir: &Path,
    out: &mut Vec<(String, Vec<(String, PathBuf)>)>,
    seen: &mut Vec<PathBuf>,
) -> Result<(), DataError> {
    let real = std::fs::canonicalize(dir).map_err(DataError::io(dir))?;
    if seen.contains(&real) {
        return Ok(());
    }
    seen.push(real);
    let mut files = Vec::new();
    let mut subfolders = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(DataError::io(dir))? {
        let entry = entry.map_err(DataError::io(dir))?;
        let path = entry.path();
        // The entry's type comes with the listing; only a link needs a look at what it names
        // (ImageNet's million files are not each asked for their metadata).
        let kind = entry.file_type().map_err(DataError::io(&path))?;
        if kind.is_dir() || (kind.is_symlink() && path.is_dir()) {
            subfolders.push(path);
        } else {
            let name = path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            files.push((name, path));
        }
    }
    out.push((dir.to_string_lossy().into_owned(), files));
    for sub in subfolders {
        walk(&sub, out, seen)?;
    }
    Ok(())
}

type Batch = Result<(Tensor, Tensor), DataError>;

/// What every worker reads: the shard's samples and how to make a batch of them.
struct Source {
    samples: Vec<(PathBuf, i64)>,
    batch_size: usize,
    seed: u64,
    size: i64,
    augment: Augment,
    /// The rows of each batch to decode; `None` for all.
    rows: Option<Vec<Range<usize>>>,
    /// The CUDA device the batches go to, for which the workers pin them (page-locked host
    /// memory, which the copy to the GPU reads without staging and without holding up the
    /// training thread); `None` on the CPU.
    pin: Option<tch::Device>,
}

pub struct ImageFolder {
    dir: PathBuf,
    source: Arc<Source>,
    workers: usize,
    /// The next batch the training loop takes (batches since the stream's start).
    next: u64,
    /// The running workers, started at the first batch taken after an open or a skip.
    pool: Option<Pool>,
    device: tch::Device,
}

/// Worker threads making batches `first + k`, `first + k + n`, ... (worker `k` of `n`).
struct Pool {
    first: u64,
    receivers: Vec<Receiver<Batch>>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Drop for Pool {
    /// Stops the workers and waits for them (each finishes at most the batch it is making): no
    /// thread of the pool is left running libtorch operators, at the process's exit least of all.
    fn drop(&mut self) {
        self.receivers.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl ImageFolder {
    pub fn open(dir: &Path, request: BatchRequest) -> Result<ImageFolder, DataError> {
        let InputKind::Image { size, .. } = request.input else {
            return Err(DataError::WrongKind {
                what: "ImageFolder",
                input: request.input,
            });
        };
        let all = listed(dir)?;
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
        drop(decode(&mine[0].0)?);
        Ok(ImageFolder {
            dir: dir.to_path_buf(),
            source: Arc::new(Source {
                samples: mine,
                batch_size: request.batch_size,
                seed: request.seed,
                size,
                augment: request.augment,
                rows: request.rows,
                pin: request.device.is_cuda().then_some(request.device),
            }),
            workers: request.workers.max(1),
            next: 0,
            pool: None,
            device: request.device,
        })
    }

    /// The receiver of batch `next`, starting the workers there if none are running.
    fn receiver(&mut self) -> Result<&Receiver<Batch>, DataError> {
        if self.pool.is_none() {
            let mut pool = Pool {
                first: self.next,
                receivers: Vec::with_capacity(self.workers),
                threads: Vec::with_capacity(self.workers),
            };
            let stride = self.workers as u64;
            for k in 0..self.workers {
                let (tx, rx) = mpsc::sync_channel(PREFETCH);
                let source = Arc::clone(&self.source);
                let first = pool.first + k as u64;
                let thread = thread::Builder::new()
                    .name(format!("imagefolder-{k}"))
                    .spawn(move || work(&source, first, stride, tx))
                    .map_err(DataError::io(&self.dir))?;
                pool.receivers.push(rx);
                pool.threads.push(thread);
            }
            self.pool = Some(pool);
        }
        let pool = self.pool.as_ref().expect("just started");
        let worker = (self.next - pool.first) % pool.receivers.len() as u64;
        Ok(&pool.receivers[worker as usize])
    }
}

/// Runs on a worker thread until the training loop drops its receiver or a batch fails.
fn work(source: &Source, first: u64, stride: u64, tx: SyncSender<Batch>) {
    // Each worker makes one image at a time: its operators stay on this thread rather than
    // spreading over the training's intra-op threads.
    crate::ffi::keep_this_thread_serial();
    // Pinned for the rank's GPU, made current here first: CUDA would otherwise make this thread's
    // calls on GPU 0, and a context there costs another rank's memory. Unpinned if that fails.
    let pin = source
        .pin
        .filter(|&device| crate::cuda::bind_device(device).is_ok());
    let mut order = Order::default();
    let mut index = first;
    loop {
        let batch = source.batch(index, &mut order).map(|(images, labels)| match pin {
            Some(device) => (images.f_pin_memory(device).unwrap_or(images), labels),
            None => (images, labels),
        });
        let stop = batch.is_err();
        if tx.send(batch).is_err() || stop {
            return;
        }
        index += stride;
    }
}

/// One epoch's permutation of the samples, kept while batches stay in that epoch.
#[derive(Default)]
struct Order {
    epoch: Option<u64>,
    order: Vec<usize>,
}

impl Source {
    /// Batch `index` of the stream: the samples at positions `index * batch_size ..` of the
    /// epochs' permutations laid end to end, as uint8 images and their labels.
    fn batch(&self, index: u64, order: &mut Order) -> Batch {
        let n = self.samples.len() as u64;
        let start = index * self.batch_size as u64;
        let mut images = Vec::with_capacity(self.batch_size);
        let mut labels = Vec::with_capacity(self.batch_size);
        for (row, position) in (start..start + self.batch_size as u64).enumerate() {
            let epoch = position / n;
            if order.epoch != Some(epoch) {
                order.order = permutation(self.samples.len(), self.seed.wrapping_add(epoch));
                order.epoch = Some(epoch);
            }
            let (path, label) = &self.samples[order.order[(position % n) as usize]];
            labels.push(*label);
            if self
                .rows
                .as_ref()
                .is_some_and(|rows| !rows.iter().any(|r| r.contains(&row)))
            {
                images.push(Tensor::zeros(
                    [3, self.size, self.size],
                    (tch::Kind::Uint8, tch::Device::Cpu),
                ));
                continue;
            }
            let image = decode(path)?;
            let mut draws = SplitMix::new(sample_seed(self.seed, position));
            images.push(transform(&image, self.size, self.augment, &mut draws));
        }
        Ok((Tensor::stack(&images, 0), Tensor::from_slice(&labels)))
    }
}

/// The file's image as uint8 `[3, height, width]` (grey, CMYK and RGBA images become RGB). JPEGs,
/// told by their first bytes rather than their names, are decoded by zune-jpeg (SIMD, about 1.4
/// times stb_image's speed here); PNGs, and any JPEG it declines, by stb_image (tch's decoder).
pub(super) fn decode(path: &Path) -> Result<Tensor, DataError> {
    let bytes = std::fs::read(path).map_err(DataError::io(path))?;
    if bytes.starts_with(&[0xff, 0xd8]) {
        if let Some(image) = decode_jpeg(&bytes) {
            return Ok(image);
        }
    }
    tch::vision::image::load_from_memory(&bytes)
        .map_err(|e| DataError::malformed(path, format!("cannot decode image: {e}")))
}

/// A JPEG's pixels by zune-jpeg, or `None` where it cannot decode them.
pub(super) fn decode_jpeg(bytes: &[u8]) -> Option<Tensor> {
    use zune_core::{bytestream::ZCursor, colorspace::ColorSpace, options::DecoderOptions};

    let options = DecoderOptions::default().jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    let pixels = decoder.decode().ok()?;
    let info = decoder.info()?;
    let (height, width) = (i64::from(info.height), i64::from(info.width));
    if decoder.output_colorspace()? != ColorSpace::RGB || pixels.len() as i64 != height * width * 3 {
        return None;
    }
    Some(
        Tensor::from_slice(&pixels)
            .view([height, width, 3])
            .permute([2, 0, 1]),
    )
}

/// A crop of an image: top, left, height, width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crop {
    pub top: i64,
    pub left: i64,
    pub height: i64,
    pub width: i64,
}

/// The image's `augment` transform to `size` x `size`, as uint8 `[3, size, size]`.
pub(super) fn transform(image: &Tensor, size: i64, augment: Augment, draws: &mut SplitMix) -> Tensor {
    let (_, height, width) = image.size3().expect("a decoded image is [3, h, w]");
    match augment {
        Augment::CropFlip => {
            let (crop, flip) = crop_and_flip(height, width, draws);
            resized_crop(image, crop, size, flip)
        }
        Augment::None => {
            let (h, w) = resized_shorter_side(height, width, size);
            let resized = resize(image, h, w);
            let top = round_half_even((h - size) as f64 / 2.0);
            let left = round_half_even((w - size) as f64 / 2.0);
            resized.narrow(1, top, size).narrow(2, left, size).contiguous()
        }
    }
}

/// A sample's `RandomResizedCrop` and whether `RandomHorizontalFlip` mirrors it (half do).
pub fn crop_and_flip(height: i64, width: i64, draws: &mut SplitMix) -> (Crop, bool) {
    let crop = random_resized_crop(height, width, draws);
    (crop, draws.coin())
}

/// `crop` of `image` resized to `size` x `size`, then mirrored left to right if `flip`: what
/// torchvision's `resized_crop` and `hflip` make of a uint8 image tensor.
pub fn resized_crop(image: &Tensor, crop: Crop, size: i64, flip: bool) -> Tensor {
    let cropped = image
        .narrow(1, crop.top, crop.height)
        .narrow(2, crop.left, crop.width);
    mirrored(resize(&cropped, size, size), flip)
}

/// torchvision's bilinear resize with antialiasing of a uint8 `[3, h, w]` image.
fn resize(image: &Tensor, height: i64, width: i64) -> Tensor {
    image
        .unsqueeze(0)
        .internal_upsample_bilinear2d_aa([height, width], false, None, None)
        .squeeze_dim(0)
}

/// torchvision's `Resize(size)` output size: the shorter side becomes `size`, the longer keeps
/// the aspect ratio (rounded down).
fn resized_shorter_side(height: i64, width: i64, size: i64) -> (i64, i64) {
    if width <= height {
        (size * height / width, size)
    } else {
        (size, size * width / height)
    }
}

/// torchvision's `RandomResizedCrop` parameters (scale 0.08 to 1 of the area, aspect ratio 3/4
/// to 4/3 drawn log-uniformly, ten tries, then the central crop), drawn from `draws`.
pub fn random_resized_crop(height: i64, width: i64, draws: &mut SplitMix) -> Crop {
    let area = (height * width) as f64;
    let (log_low, log_high) = ((3.0f64 / 4.0).ln(), (4.0f64 / 3.0).ln());
    for _ in 0..10 {
        let target = area * draws.uniform(0.08, 1.0);
        let ratio = draws.uniform(log_low, log_high).exp();
        let w = round_half_even((target * ratio).sqrt());
        let h = round_half_even((target / ratio).sqrt());
        if 0 < w && w <= width && 0 < h && h <= height {
            let top = draws.below((height - h + 1) as u64) as i64;
            let left = draws.below((width - w + 1) as u64) as i64;
            return Crop {
                top,
                left,
                height: h,
                width: w,
            };
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (h, w) = if in_ratio < 3.0 / 4.0 {
        (round_half_even(width as f64 / (3.0 / 4.0)), width)
    } else if in_ratio > 4.0 / 3.0 {
        (height, round_half_even(height as f64 * (4.0 / 3.0)))
    } else {
        (height, width)
    };
    Crop {
        top: (height - h) / 2,
        left: (width - w) / 2,
        height: h,
        width: w,
    }
}

/// Python's `round`: halves go to the even neighbour.
fn round_half_even(x: f64) -> i64 {
    x.round_ties_even() as i64
}

impl Batches for ImageFolder {
    fn next_batch(&mut self) -> Result<(Tensor, Tensor), DataError> {
        let batch = self.receiver()?.recv().unwrap_or_else(|_| {
            Err(DataError::malformed(
                &self.dir,
                "an image loader thread stopped without a batch (it panicked: see above)",
            ))
        });
        self.next += 1;
        let (images, labels) = match batch {
            Ok(batch) => batch,
            Err(e) => {
                // The failed worker has stopped: a later call starts the pool afresh.
                self.pool = None;
                return Err(e);
            }
        };
        // From pinned memory (on a GPU) the copy is queued on the stream and the training thread
        // goes on; the normalisation after it is queued behind it.
        let images = images.to_device_(self.device, tch::Kind::Uint8, self.device.is_cuda(), false);
        Ok((normalize(&images), labels.to_device(self.device)))
    }

    fn skip(&mut self, batches: u64) -> Result<(), DataError> {
        if batches > 0 {
            self.pool = None;
            self.next += batches;
        }
        Ok(())
    }

    fn rows(&self) -> Option<&[Range<usize>]> {
        self.source.rows.as_deref()
    }
}
