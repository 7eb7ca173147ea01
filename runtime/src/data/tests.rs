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
        err.to_string().contains("found no .jpg, .jpeg or .png files"),
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
