//! Data sources against tiny datasets written in their real formats.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use super::*;

fn request(input: InputKind, batch_size: usize, shard: Shard) -> BatchRequest {
    BatchRequest {
        input,
        batch_size,
        seed: 3,
        shard,
        device: Device::Cpu,
        augment: Augment::None,
        workers: 1,
        rows: None,
    }
}

const IMAGE32: InputKind = InputKind::Image {
    size: 32,
    classes: 10,
};

/// Writes `records` CIFAR-10 records whose label is `index % 10` and whose pixels all equal the label.
fn write_cifar(dir: &Path, file: &str, records: usize) {
    let mut bytes = Vec::new();
    for i in 0..records {
        let label = (i % 10) as u8;
        bytes.push(label);
        bytes.extend(std::iter::repeat_n(label * 20, 3072));
    }
    std::fs::write(dir.join(file), bytes).unwrap();
}

#[test]
fn specs_parse_and_folders_are_recognised() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(DataSpec::parse("synthetic").unwrap(), DataSpec::Synthetic);
    assert_eq!(
        DataSpec::parse("cifar10:/x").unwrap(),
        DataSpec::Cifar10("/x".into())
    );
    assert_eq!(
        DataSpec::parse(dir.path().to_str().unwrap()).unwrap(),
        DataSpec::ImageFolder(dir.path().into())
    );
    write_cifar(dir.path(), "data_batch_1.bin", 3);
    assert_eq!(
        DataSpec::parse(dir.path().to_str().unwrap()).unwrap(),
        DataSpec::Cifar10(dir.path().into())
    );
    // A folder split as ImageNet's means its training split, as PipeDream's --data_dir does,
    // whether named as a folder or as imagefolder:; one with a class that happens to be called
    // train beside others is a folder of classes.
    let imagenet = tempfile::tempdir().unwrap();
    for split in ["train", "val"] {
        for class in ["n01", "n02"] {
            std::fs::create_dir_all(imagenet.path().join(split).join(class)).unwrap();
        }
    }
    let root = imagenet.path().to_str().unwrap();
    for text in [root.to_string(), format!("imagefolder:{root}")] {
        assert_eq!(
            DataSpec::parse(&text).unwrap(),
            DataSpec::ImageFolder(imagenet.path().join("train")),
            "{text}"
        );
    }
    std::fs::create_dir(imagenet.path().join("cat")).unwrap();
    assert_eq!(
        DataSpec::parse(root).unwrap(),
        DataSpec::ImageFolder(imagenet.path().into())
    );
    let err = DataSpec::parse("/no/such/dir").unwrap_err();
    assert!(
        err.to_string().contains("\"/no/such/dir\" is not `synthetic`"),
        "{err}"
    );
}

#[test]
fn synthetic_batches_are_deterministic_and_shaped() {
    let tokens = InputKind::Tokens {
        seq_len: 8,
        vocab: 50,
    };
    let mut a = open(&DataSpec::Synthetic, request(tokens, 4, Shard::WHOLE)).unwrap();
    let mut b = open(&DataSpec::Synthetic, request(tokens, 4, Shard::WHOLE)).unwrap();
    let (xa, ya) = a.next_batch().unwrap();
    let (xb, _) = b.next_batch().unwrap();
    assert!(xa.equal(&xb));
    assert_eq!(xa.size(), [4, 8]);
    assert!(ya.equal(&((&xa * 7 + 3).remainder(50))));
    let mut other = open(
        &DataSpec::Synthetic,
        request(tokens, 4, Shard { index: 1, count: 2 }),
    )
    .unwrap();
    assert!(
        !other.next_batch().unwrap().0.equal(&xa),
        "replicas must see different data"
    );
    let mut images = open(&DataSpec::Synthetic, request(IMAGE32, 2, Shard::WHOLE)).unwrap();
    let (x, y) = images.next_batch().unwrap();
    assert_eq!(
        (x.size(), y.size(), y.kind()),
        (vec![2, 3, 32, 32], vec![2], Kind::Int64)
    );
}

#[test]
fn cifar_reads_whole_records_and_shards_them() {
    let dir = tempfile::tempdir().unwrap();
    write_cifar(dir.path(), "data_batch_1.bin", 10);
    write_cifar(dir.path(), "data_batch_2.bin", 10);
    let spec = DataSpec::Cifar10(dir.path().into());
    let mut whole = open(&spec, request(IMAGE32, 20, Shard::WHOLE)).unwrap();
    let (x, y) = whole.next_batch().unwrap();
    assert_eq!(x.size(), [20, 3, 32, 32]);
    let mut labels = Vec::<i64>::try_from(&y).unwrap();
    labels.sort();
    assert_eq!(
        labels,
        (0..20).map(|i| i / 2).collect::<Vec<i64>>(),
        "one epoch is every record once"
    );
    // Pixels follow labels: the normalised red channel is a function of the label.
    let red = x.select(1, 0).mean_dim(&[1i64, 2][..], false, Kind::Float);
    let expected = (y.to_kind(Kind::Float) * 20.0 / 255.0 - 0.485) / 0.229;
    assert!(red.allclose(&expected, 1e-4, 1e-4, false));

    let mut half = open(&spec, request(IMAGE32, 10, Shard { index: 1, count: 2 })).unwrap();
    let labels = Vec::<i64>::try_from(&half.next_batch().unwrap().1).unwrap();
    assert!(
        labels.iter().all(|l| l % 2 == 1),
        "shard 1 of 2 holds the odd records: {labels:?}"
    );
}

#[test]
fn cifar_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let spec = DataSpec::Cifar10(dir.path().into());
    let err = open(&spec, request(IMAGE32, 2, Shard::WHOLE)).err().unwrap();
    assert!(err.to_string().contains("no data_batch_1.bin"), "{err}");
    std::fs::write(dir.path().join("data_batch_1.bin"), [0u8; 100]).unwrap();
    let err = open(&spec, request(IMAGE32, 2, Shard::WHOLE)).err().unwrap();
    let text = err.to_string();
    assert!(
        text.contains("data_batch_1.bin") && text.contains("100 bytes is not a whole number"),
        "{text}"
    );
}

/// Writes `per_class` PNGs per class, each image filled with the class's value plus its index.
fn write_image_folder(root: &Path, classes: &[(&str, usize)], per_class: usize) {
    for &(class, value) in classes {
        let dir = root.join(class);
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..per_class {
            let image = Tensor::full([3, 12, 10], (value + i) as i64, (Kind::Uint8, Device::Cpu));
            tch::vision::image::save(&image, dir.join(format!("{i}.png"))).unwrap();
        }
    }
}

#[test]
fn image_folder_loads_resizes_and_labels_by_sorted_folder() {
    let dir = tempfile::tempdir().unwrap();
    write_image_folder(dir.path(), &[("b_dog", 100), ("a_cat", 0)], 2);
    let spec = DataSpec::ImageFolder(dir.path().into());
    assert_eq!(spec.num_classes().unwrap(), Some(2));
    let input = InputKind::Image { size: 16, classes: 2 };
    let mut batches = open(&spec, request(input, 4, Shard::WHOLE)).unwrap();
    let (x, y) = batches.next_batch().unwrap();
    assert_eq!(x.size(), [4, 3, 16, 16]);
    // Sorted names give a_cat label 0 (pixels 0 or 1) and b_dog label 1 (pixels 100 or 101).
    let raw = (x.select(1, 0).mean_dim(&[1i64, 2][..], false, Kind::Float) * 0.229 + 0.485) * 255.0;
    for (pixel, label) in Vec::<f64>::try_from(&raw)
        .unwrap()
        .iter()
        .zip(Vec::<i64>::try_from(&y).unwrap())
    {
        assert!(
            (pixel - 100.0 * label as f64).abs() < 1.5,
            "pixel {pixel} with label {label}"
        );
    }
}

/// A run that counts its epoch (`samples`) and then loads the folder walks the tree once: the
/// loader takes the count's listing, and a second loader walks it again.
#[test]
fn an_image_folder_counted_then_opened_is_walked_once() {
    use super::image_folder::WALKS;

    let dir = tempfile::tempdir().unwrap();
    write_image_folder(dir.path(), &[("a", 0), ("b", 100)], 3);
    let spec = DataSpec::ImageFolder(dir.path().into());
    let input = InputKind::Image { size: 8, classes: 2 };
    let walks = || WALKS.with(|w| w.get());
    let before = walks();
    assert_eq!(spec.samples().unwrap(), 6);
    let mut once = open(&spec, request(input, 6, Shard::WHOLE)).unwrap();
    assert_eq!(walks() - before, 1);
    let mut again = open(&spec, request(input, 6, Shard::WHOLE)).unwrap();
    assert_eq!(walks() - before, 2);
    // The kept listing is the walk's: both loaders make the same batch.
    let (x1, y1) = once.next_batch().unwrap();
    let (x2, y2) = again.next_batch().unwrap();
    assert!(x1.equal(&x2) && y1.equal(&y2));
}

#[test]
fn image_folder_errors_say_what_was_expected() {
    let dir = tempfile::tempdir().unwrap();
    let spec = DataSpec::ImageFolder(dir.path().into());
    let err = spec.num_classes().unwrap_err();
    assert!(
        err.to_string()
            .contains("expected one subfolder of images per class"),
        "{err}"
    );
    std::fs::create_dir(dir.path().join("cat")).unwrap();
    std::fs::write(dir.path().join("cat").join("notes.txt"), "x").unwrap();
    let err = open(&spec, request(IMAGE32, 2, Shard::WHOLE)).err().unwrap();
    assert!(
        err.to_string().contains("found no images for the classes cat"),
        "{err}"
    );
    std::fs::write(dir.path().join("cat").join("broken.png"), "not a png").unwrap();
    let err = open(&spec, request(IMAGE32, 2, Shard::WHOLE)).err().unwrap();
    assert!(
        err.to_string().contains("broken.png") && err.to_string().contains("cannot decode"),
        "{err}"
    );
    let missing = DataSpec::ImageFolder(dir.path().join("nope"));
    let err = missing.num_classes().unwrap_err();
    assert!(
        err.to_string().contains("cannot read") && err.to_string().contains("nope"),
        "{err}"
    );
}

/// A random uint8 image `[3, height, width]`, the same for the same seed.
fn random_image(height: i64, width: i64, seed: i64) -> Tensor {
    crate::models::seeded(seed, || {
        Tensor::randint(256, [3, height, width], (Kind::Uint8, Device::Cpu))
    })
}

/// The torch venv's python (`STAGEHAND_TORCH_VENV`, which scripts/env.sh sets, else setup.sh's
/// default place).
fn torch_python() -> std::path::PathBuf {
    let venv = std::env::var_os("STAGEHAND_TORCH_VENV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").expect("HOME is set");
            Path::new(&home).join(".cache/stagehand/torch-2.11.0")
        });
    let python = venv.join("bin/python");
    assert!(
        python.is_file(),
        "no torch venv at {}; run scripts/setup.sh",
        venv.display()
    );
    python
}

/// The loader's transforms give torchvision's bytes: for random crops (down- and upsampling,
/// mirrored or not) and for Resize then CenterCrop (tall, wide and square images), each image
/// decoded from the PNG the loader reads, against fixtures/transforms/reference.py.
#[test]
fn image_transforms_give_torchvisions_bytes() {
    use super::image_folder::{crop_and_flip, decode, transform};

    let dir = tempfile::tempdir().unwrap();
    let shapes = [(37, 53), (64, 48), (20, 20), (9, 120), (151, 7)];
    let mut cases = Vec::new();
    let mut ours = Vec::new();
    for (i, &(height, width)) in shapes.iter().enumerate() {
        let image = random_image(height, width, i as i64);
        let png = dir.path().join(format!("{i}.png"));
        tch::vision::image::save(&image, &png).unwrap();
        let decoded = decode(&png).unwrap();
        assert!(
            decoded.equal(&image),
            "PNG is lossless: the loader reads back the image"
        );
        let raw = dir.path().join(format!("{i}.raw"));
        std::fs::write(&raw, Vec::<u8>::try_from(image.flatten(0, -1)).unwrap()).unwrap();
        // Upsampling (64 from small crops) and downsampling (16), three draws each.
        for (j, size) in [16i64, 64].into_iter().enumerate() {
            for seed in 0..3u64 {
                let seed = seed + 10 * j as u64 + 100 * i as u64;
                let (crop, flip) = crop_and_flip(height, width, &mut SplitMix::new(seed));
                let out = dir.path().join(format!("{i}-{size}-{seed}.out"));
                cases.push(serde_json::json!({
                    "raw": raw, "shape": [3, height, width], "size": size,
                    "crop": [crop.top, crop.left, crop.height, crop.width], "flip": flip, "out": out,
                }));
                let mine = transform(&decoded, size, Augment::CropFlip, &mut SplitMix::new(seed));
                ours.push((
                    out,
                    mine,
                    format!("{height}x{width} {crop:?} flip {flip} to {size}"),
                ));
            }
        }
        for size in [16i64, 5] {
            let out = dir.path().join(format!("{i}-{size}-center.out"));
            cases.push(serde_json::json!({
                "raw": raw, "shape": [3, height, width], "size": size, "crop": null, "out": out,
            }));
            let mine = transform(&decoded, size, Augment::None, &mut SplitMix::new(0));
            ours.push((
                out,
                mine,
                format!("{height}x{width} resized and center-cropped to {size}"),
            ));
        }
    }
    let flips = cases.iter().filter(|c| c["flip"] == true).count();
    assert!(
        flips > 0 && flips < 30,
        "the draws mirror some crops and not others: {flips} of 30"
    );
    let cases_file = dir.path().join("cases.json");
    std::fs::write(&cases_file, serde_json::to_vec(&cases).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transforms/reference.py");
    let run = std::process::Command::new(torch_python())
        .arg(&script)
        .arg(&cases_file)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    eprintln!("reference.py: {}", String::from_utf8_lossy(&run.stdout).trim());
    for (out, mine, what) in ours {
        let size = mine.size()[1];
        assert_eq!(mine.size(), [3, size, size], "{what}");
        let theirs = std::fs::read(&out).unwrap();
        let mine = Vec::<u8>::try_from(mine.contiguous().flatten(0, -1)).unwrap();
        assert_eq!(mine.len(), theirs.len(), "{what}");
        let differ = mine.iter().zip(&theirs).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ,
            0,
            "{what}: {differ} of {} bytes differ from torch's",
            mine.len()
        );
    }
}

/// torchvision's RandomResizedCrop rules: a crop inside the image, of 8% to all of its area at
/// an aspect ratio from 3/4 to 4/3 (up to the rounding of its sides), and the central crop at the
/// nearest allowed ratio when ten draws find none (a strip far wider or taller than 4/3).
#[test]
fn random_resized_crops_keep_torchvisions_ranges() {
    use super::image_folder::{random_resized_crop, Crop};

    let mut draws = SplitMix::new(7);
    for (height, width) in [(375i64, 500i64), (32, 32), (240, 200)] {
        let mut areas = (f64::MAX, 0.0f64);
        for _ in 0..2000 {
            let c = random_resized_crop(height, width, &mut draws);
            assert!(c.height > 0 && c.width > 0, "{c:?}");
            assert!(c.top + c.height <= height && c.left + c.width <= width, "{c:?}");
            let fraction = (c.height * c.width) as f64 / (height * width) as f64;
            areas = (areas.0.min(fraction), areas.1.max(fraction));
            // Each side is rounded to a whole pixel, so the ratio may stray by half a pixel on each.
            let ratio = c.width as f64 / c.height as f64;
            let slack = 1.0 / c.height.min(c.width) as f64;
            let whole = c.height == height && c.width == width;
            assert!(
                whole || (ratio >= 0.75 * (1.0 - slack) - 1e-9 && ratio <= 4.0 / 3.0 * (1.0 + slack) + 1e-9),
                "{c:?} of {height}x{width}: ratio {ratio}"
            );
        }
        assert!(
            areas.0 < 0.12 && areas.0 >= 0.07,
            "{height}x{width}: smallest area {}",
            areas.0
        );
        assert!(areas.1 > 0.9, "{height}x{width}: largest area {}", areas.1);
    }
    let wide = random_resized_crop(2, 100, &mut draws);
    assert_eq!(
        wide,
        Crop {
            top: 0,
            left: 48,
            height: 2,
            width: 3
        }
    );
    let tall = random_resized_crop(100, 1, &mut draws);
    assert_eq!(
        tall,
        Crop {
            top: 49,
            left: 0,
            height: 1,
            width: 1
        }
    );
}

/// An image folder's stream is the seed's, whatever the workers: one worker and three give the
/// same bytes batch for batch; each epoch takes every image once; skipping batches lands where
/// taking them would; and the next epoch's crops differ from the first's.
#[test]
fn image_folder_batches_are_the_seeds_whatever_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    // Ten images of sizes that vary, each its own class, so labels tell which image a row is.
    for class in 0..10i64 {
        let folder = dir.path().join(format!("c{class}"));
        std::fs::create_dir_all(&folder).unwrap();
        let image = random_image(20 + 3 * class, 30 - class, 50 + class);
        tch::vision::image::save(&image, folder.join("x.png")).unwrap();
    }
    let spec = DataSpec::ImageFolder(dir.path().into());
    let input = InputKind::Image {
        size: 16,
        classes: 10,
    };
    let stream = |workers: usize| {
        let request = BatchRequest {
            augment: Augment::CropFlip,
            workers,
            ..request(input, 4, Shard::WHOLE)
        };
        open(&spec, request).unwrap()
    };
    let take = |mut s: Box<dyn Batches>, n: usize| -> Vec<(Tensor, Tensor)> {
        (0..n).map(|_| s.next_batch().unwrap()).collect()
    };
    let one = take(stream(1), 10);
    let three = take(stream(3), 10);
    for (i, ((x1, y1), (x3, y3))) in one.iter().zip(&three).enumerate() {
        assert_eq!(x1.size(), [4, 3, 16, 16]);
        assert!(
            x1.equal(x3) && y1.equal(y3),
            "batch {i} differs between 1 and 3 workers"
        );
    }
    // 40 rows are four epochs of the ten images: each epoch is every label once.
    let labels: Vec<i64> = one
        .iter()
        .flat_map(|(_, y)| Vec::<i64>::try_from(y).unwrap())
        .collect();
    for epoch in labels.chunks(10) {
        let mut sorted = epoch.to_vec();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>(), "an epoch: {epoch:?}");
    }
    assert_ne!(labels[..10], labels[10..20], "each epoch has its own order");
    // Image 0's rows in the first two epochs: crops are drawn afresh each time it comes.
    let rows: Vec<Tensor> = labels
        .iter()
        .enumerate()
        .filter(|(_, &l)| l == 0)
        .map(|(p, _)| one[p / 4].0.get((p % 4) as i64))
        .collect();
    assert!(
        !rows[0].equal(&rows[1]),
        "image 0 is cropped differently in epochs 1 and 2"
    );
    // Skipping 3 batches, then taking, gives batches 3 and 4; so does skipping after taking.
    let mut skipped = stream(2);
    skipped.skip(3).unwrap();
    let mut later = stream(2);
    drop(later.next_batch().unwrap());
    later.skip(2).unwrap();
    for s in [&mut skipped, &mut later] {
        for expected in &one[3..5] {
            let (x, y) = s.next_batch().unwrap();
            assert!(
                x.equal(&expected.0) && y.equal(&expected.1),
                "a skip lands where taking would"
            );
        }
    }
}

/// A file that fails to decode mid-stream is an error naming it, from whichever worker met it.
#[test]
fn an_image_that_breaks_mid_stream_is_named() {
    let dir = tempfile::tempdir().unwrap();
    write_image_folder(dir.path(), &[("a", 0)], 6);
    // The first image (the one checked at open) is whole; a later one is not.
    std::fs::write(dir.path().join("a").join("5.png"), b"not a png").unwrap();
    let spec = DataSpec::ImageFolder(dir.path().into());
    let input = InputKind::Image { size: 8, classes: 1 };
    let request = BatchRequest {
        workers: 2,
        ..request(input, 2, Shard::WHOLE)
    };
    let mut batches = open(&spec, request).unwrap();
    let err = (0..3)
        .find_map(|_| batches.next_batch().err())
        .expect("one of the first three batches holds 5.png");
    assert!(
        err.to_string().contains("5.png") && err.to_string().contains("cannot decode"),
        "{err}"
    );
}

/// A loader worker runs its operators on its own thread alone, and the training thread keeps
/// libtorch's thread count: OpenMP's count is per thread.
#[test]
fn a_loader_thread_is_serial_and_leaves_the_others_their_threads() {
    let before = tch::get_num_threads();
    let worker = std::thread::spawn(|| {
        let inherited = tch::get_num_threads();
        crate::ffi::keep_this_thread_serial();
        (inherited, tch::get_num_threads())
    })
    .join()
    .unwrap();
    assert_eq!(
        worker,
        (before, 1),
        "a new thread takes libtorch's count, then runs alone"
    );
    assert_eq!(tch::get_num_threads(), before, "this thread keeps its count");
    let other = std::thread::spawn(tch::get_num_threads).join().unwrap();
    assert_eq!(
        other, before,
        "later threads take libtorch's count, not the worker's"
    );
}

/// JPEGs decode to what stb_image (the decoder PNGs go through) makes of them, up to the rounding
/// two conforming decoders may differ by (the inverse DCT's and the chroma upsampling's); a grey
/// JPEG becomes three equal channels; a PNG named .jpg is still read (ImageNet has one).
#[test]
fn jpegs_decode_as_stb_does_up_to_rounding_and_grey_ones_become_rgb() {
    use super::image_folder::{decode, decode_jpeg};

    let dir = tempfile::tempdir().unwrap();
    // A smooth image, as photographs mostly are: a low-resolution random image upsampled.
    let small = random_image(6, 8, 9).to_kind(Kind::Float).unsqueeze(0);
    let smooth = small
        .upsample_bilinear2d([90, 120], false, None, None)
        .squeeze_dim(0)
        .to_kind(Kind::Uint8);
    let jpeg = dir.path().join("smooth.jpg");
    tch::vision::image::save(&smooth, &jpeg).unwrap();
    let ours = decode(&jpeg).unwrap();
    let zune = decode_jpeg(&std::fs::read(&jpeg).unwrap()).expect("zune-jpeg decodes stb's JPEGs");
    assert!(ours.equal(&zune), "a JPEG goes through zune-jpeg");
    let stb = tch::vision::image::load(&jpeg).unwrap();
    assert_eq!(ours.size(), [3, 90, 120]);
    let difference = (ours.to_kind(Kind::Float) - stb.to_kind(Kind::Float)).abs();
    let (mean, max) = (
        difference.mean(Kind::Float).double_value(&[]),
        difference.max().double_value(&[]),
    );
    eprintln!("zune-jpeg against stb_image: mean {mean}, max {max}");
    assert!(
        mean < 1.0 && max <= 8.0,
        "JPEG decoders differ by mean {mean}, max {max}"
    );
    let grey = dir.path().join("grey.jpg");
    tch::vision::image::save(&smooth.narrow(0, 0, 1), &grey).unwrap();
    assert!(
        decode_jpeg(&std::fs::read(&grey).unwrap()).is_some(),
        "zune-jpeg decodes grey JPEGs"
    );
    let grey = decode(&grey).unwrap();
    assert_eq!(grey.size(), [3, 90, 120]);
    assert!(
        grey.get(0).equal(&grey.get(1)) && grey.get(0).equal(&grey.get(2)),
        "grey is R = G = B"
    );
    let png_named_jpg = dir.path().join("really.jpg");
    tch::vision::image::save(&smooth, dir.path().join("really.png")).unwrap();
    std::fs::rename(dir.path().join("really.png"), &png_named_jpg).unwrap();
    assert!(
        decode(&png_named_jpg).unwrap().equal(&smooth),
        "a PNG is lossless, whatever its name"
    );
}

/// A CMYK JPEG (ImageNet has a few dozen; this one written by PIL, its left half cyan and its
/// right half yellow) decodes to RGB, as PIL's `convert("RGB")` gives (0, 255, 255) and
/// (255, 255, 0): a JPEG's colours are approximate, hence the margin.
#[test]
fn a_cmyk_jpeg_decodes_to_rgb() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images/cmyk.jpg");
    let image = super::image_folder::decode(&path).unwrap();
    assert_eq!(image.size(), [3, 12, 20]);
    let zune = super::image_folder::decode_jpeg(&std::fs::read(&path).unwrap());
    assert!(zune.is_some_and(|z| z.equal(&image)), "zune-jpeg decodes CMYK");
    let pixel = |x: i64| -> Vec<i64> {
        Vec::<i64>::try_from(image.select(2, x).select(1, 5).to_kind(Kind::Int64)).unwrap()
    };
    for (x, expected) in [(2, [0, 255, 255]), (17, [255, 255, 0])] {
        let got = pixel(x);
        assert!(
            got.iter().zip(expected).all(|(g, e)| (g - e).abs() <= 24),
            "pixel at x = {x}: {got:?}, expected about {expected:?}"
        );
    }
}

/// The samples are torchvision's ImageFolder's: images anywhere below a class folder, folders in
/// the order of their paths and files by name within each (`sorted(os.walk(...))`), extensions
/// in any case, BMP, PPM and PGM read too, linked folders followed; TIFF (which torchvision lists and nothing here
/// decodes) is refused by name, and so is a class without images.
#[test]
fn image_folder_samples_are_torchvisions_walk() {
    use super::image_folder::samples;

    let dir = tempfile::tempdir().unwrap();
    let image = random_image(6, 5, 1);
    let a = dir.path().join("a");
    for sub in ["sub", "sub2", "sub/deeper"] {
        std::fs::create_dir_all(a.join(sub)).unwrap();
    }
    for file in ["z.png", "sub/b.png", "sub2/c.PNG", "sub/deeper/d.png", "b.bmp"] {
        tch::vision::image::save(&image, a.join(file)).unwrap();
    }
    let mut ppm = b"P6\n5 6\n255\n".to_vec();
    ppm.extend(Vec::<u8>::try_from(image.permute([1, 2, 0]).flatten(0, -1)).unwrap());
    std::fs::write(a.join("x.ppm"), ppm).unwrap();
    std::fs::write(a.join("notes.txt"), "not an image").unwrap();
    // A folder linked in is walked as os.walk(followlinks=True) walks it.
    let elsewhere = tempfile::tempdir().unwrap();
    tch::vision::image::save(&image, elsewhere.path().join("l.png")).unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), a.join("link")).unwrap();
    std::fs::create_dir(dir.path().join("b")).unwrap();
    let mut pgm = b"P5\n5 6\n255\n".to_vec();
    pgm.extend(Vec::<u8>::try_from(image.get(0).flatten(0, -1)).unwrap());
    std::fs::write(dir.path().join("b").join("y.pgm"), pgm).unwrap();

    let found: Vec<(String, i64)> = samples(dir.path())
        .unwrap()
        .into_iter()
        .map(|(p, l)| (p.strip_prefix(dir.path()).unwrap().display().to_string(), l))
        .collect();
    let expected = [
        ("a/b.bmp", 0),
        ("a/x.ppm", 0),
        ("a/z.png", 0),
        ("a/link/l.png", 0),
        ("a/sub/b.png", 0),
        ("a/sub/deeper/d.png", 0),
        ("a/sub2/c.PNG", 0),
        ("b/y.pgm", 1),
    ];
    let expected: Vec<(String, i64)> = expected.iter().map(|(p, l)| (p.to_string(), *l)).collect();
    assert_eq!(found, expected);
    // Every one of them decodes: the PPM to the image, the PGM to its grey made RGB.
    for (path, _) in samples(dir.path()).unwrap() {
        let decoded = super::image_folder::decode(&path).unwrap();
        assert_eq!(decoded.size(), [3, 6, 5], "{}", path.display());
    }
    assert!(super::image_folder::decode(&a.join("x.ppm"))
        .unwrap()
        .equal(&image));

    std::fs::write(a.join("sub").join("scan.TIF"), "tiff").unwrap();
    let err = samples(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("scan.TIF") && err.contains(".tif images are not decoded here"),
        "{err}"
    );
    std::fs::remove_file(a.join("sub").join("scan.TIF")).unwrap();
    std::fs::create_dir(dir.path().join("c")).unwrap();
    let err = samples(dir.path()).unwrap_err().to_string();
    assert!(err.contains("found no images for the classes c"), "{err}");
}

/// CIFAR-10 with `--augment crop-flip`: each image is torchvision's RandomCrop(32, padding=4)
/// of itself (zeros around), mirrored or not, at offsets drawn per sample; without it the
/// images are as they are. Found by trying every placement against the same batch unaugmented
/// (the order of the samples does not depend on the transform).
#[test]
fn cifar_crops_and_flips_as_torchvisions_random_crop_with_padding() {
    let dir = tempfile::tempdir().unwrap();
    // Random pixels, so that a placement is told apart from every other.
    let images = random_image(640, 32, 4).view([20, 3 * 32 * 32]);
    let labels = Tensor::arange(20, (Kind::Int64, Device::Cpu))
        .remainder(10)
        .to_kind(Kind::Uint8)
        .view([20, 1]);
    let records = Tensor::cat(&[labels, images], 1);
    std::fs::write(
        dir.path().join("data_batch_1.bin"),
        Vec::<u8>::try_from(records.flatten(0, -1)).unwrap(),
    )
    .unwrap();
    let spec = DataSpec::Cifar10(dir.path().into());
    let raw = |x: &Tensor| {
        let mean = Tensor::from_slice(&[0.485f32, 0.456, 0.406]).view([1, 3, 1, 1]);
        let std = Tensor::from_slice(&[0.229f32, 0.224, 0.225]).view([1, 3, 1, 1]);
        ((x * std + mean) * 255.0).round().to_kind(Kind::Uint8)
    };
    let batches = |augment: Augment| {
        let mut stream = open(
            &spec,
            BatchRequest {
                augment,
                ..request(IMAGE32, 10, Shard::WHOLE)
            },
        )
        .unwrap();
        (0..2)
            .map(|_| raw(&stream.next_batch().unwrap().0))
            .collect::<Vec<_>>()
    };
    let (plain, cropped) = (batches(Augment::None), batches(Augment::CropFlip));
    assert_eq!(
        cropped,
        batches(Augment::CropFlip),
        "the same seed, the same crops"
    );
    let mut placements = std::collections::BTreeSet::new();
    let mut flips = 0;
    for (plain, cropped) in plain.iter().zip(&cropped) {
        for j in 0..10 {
            let padded = plain.get(j).constant_pad_nd([4, 4, 4, 4]);
            let found = (0..9)
                .flat_map(|top| (0..9).map(move |left| (top, left)))
                .flat_map(|(top, left)| [(top, left, false), (top, left, true)])
                .find(|&(top, left, flip)| {
                    let crop = padded.narrow(1, top, 32).narrow(2, left, 32);
                    let crop = if flip { crop.flip([2]) } else { crop };
                    crop.equal(&cropped.get(j))
                });
            let (top, left, flip) =
                found.unwrap_or_else(|| panic!("sample {j} is no padded crop of its image"));
            placements.insert((top, left));
            flips += flip as usize;
        }
    }
    assert!(placements.len() > 5, "offsets vary: {placements:?}");
    assert!((3..=17).contains(&flips), "about half of 20 mirrored: {flips}");
}
