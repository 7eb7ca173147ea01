#!/usr/bin/env python3
"""Benchmark: training on an image folder, where decoding the images is the work, against PyTorch
doing the same.

Both sides train the same tiny MLP (its step costs little next to decoding: what is measured is
how fast each side turns JPEG files into normalised batches and keeps the model fed) on the same
folder of JPEGs, with the same transform (torchvision's RandomResizedCrop and RandomHorizontalFlip,
ImageNet training's), batch size, image size, loader workers and intra-op threads:

- ours: `runtime --data DIR --data-workers W` (decoding threads);
- PyTorch: a `DataLoader` with `num_workers=W` (worker processes) over torchvision's
  `ImageFolder`, decoded by PIL (torchvision's default loader: the transforms then resize with
  PIL) and, as a second reference, by `torchvision.io.decode_image` (the transforms on tensors).

Runs alternate, the order rotating each round; each side's throughput is images per second over
the iterations after the warm-up (the first iterations start the workers); the ratios are of
medians (ours / theirs). Results go to stdout and, with --out, to a JSON file.

The folder is made once (random smooth images plus noise, of ImageNet-like sizes, as JPEGs of
quality 90) under --folder, and reused.

Needs torchvision (scripts/bench-data installs it into the torch venv).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from side_by_side import rotate, throughput, write_json  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def make_folder(folder, images, classes, seed):
    """`images` JPEGs in `classes` class folders, unless the folder already holds them."""
    import torch
    import torch.nn.functional as F
    from torchvision.io import encode_jpeg, write_file

    done = folder / f".made-{images}-{classes}-{seed}"
    if done.exists():
        return
    g = torch.Generator().manual_seed(seed)
    for i in range(images):
        h, w = (int(torch.randint(300, 501, (1,), generator=g)) for _ in range(2))
        base = torch.rand(1, 3, 8, 8, generator=g) * 255
        smooth = F.interpolate(base, size=(h, w), mode="bilinear", align_corners=False)[0]
        noisy = (smooth + torch.randn(3, h, w, generator=g) * 8).clamp(0, 255).to(torch.uint8)
        path = folder / f"class_{i % classes}" / f"{i:05}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(str(path), encode_jpeg(noisy, quality=90))
    done.touch()


def reference(a):
    """One PyTorch run (in this process): prints the per-iteration seconds as JSON."""
    import torch
    from torch import nn
    from torchvision import datasets
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms import v2

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    transform = v2.Compose([
        v2.RandomResizedCrop(a.image_size),
        v2.RandomHorizontalFlip(),
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])
    if a.reference == "tensor":
        dataset = datasets.ImageFolder(a.folder, transform=transform,
                                       loader=lambda p: decode_image(p, mode=ImageReadMode.RGB))
    else:
        dataset = datasets.ImageFolder(a.folder, transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=a.batch_size, shuffle=True,
                                         num_workers=a.workers, drop_last=True,
                                         persistent_workers=True)
    classes = len(dataset.classes)
    d_in = 3 * a.image_size * a.image_size
    model = nn.Sequential(nn.Flatten(), nn.Linear(d_in, a.hidden), nn.ReLU(), nn.Linear(a.hidden, classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    t0 = time.perf_counter()
    while len(times) < a.iterations:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            now = time.perf_counter()
            times.append(now - t0)
            t0 = now
            if len(times) == a.iterations:
                break
    print(json.dumps({"times": times, "torch": torch.__version__}))


def run_reference(a, kind):
    cmd = [sys.executable, __file__, "--reference", kind, *common(a)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"PyTorch ({kind}) failed:\n{out.stderr}")
    times = json.loads(out.stdout.strip().splitlines()[-1])["times"]
    return throughput(times, a.batch_size, a.warmup)


def run_ours(a):
    cmd = [str(a.runtime), "--model", "mlp", "--layers", "1", "--hidden", str(a.hidden),
           "--image-size", str(a.image_size), "--data", f"imagefolder:{a.folder}",
           "--data-workers", str(a.workers), "--augment", "crop-flip",
           "--batch-size", str(a.batch_size), "--iterations", str(a.iterations),
           "--threads", str(a.threads), "--seed", str(a.seed), "--lr", "0.01", "--momentum", "0.9"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"runtime failed:\n{out.stderr}")
    times = [json.loads(line)["time_s"] for line in out.stdout.splitlines()
             if '"event":"iteration"' in line]
    return throughput(times, a.batch_size, a.warmup)


def common(a):
    return ["--folder", str(a.folder), "--image-size", str(a.image_size), "--batch-size",
            str(a.batch_size), "--iterations", str(a.iterations), "--workers", str(a.workers),
            "--threads", str(a.threads), "--hidden", str(a.hidden), "--seed", str(a.seed)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpus = len(os.sched_getaffinity(0))
    p.add_argument("--folder", type=Path, default=Path.home() / ".cache/stagehand/bench-images")
    p.add_argument("--images", type=int, default=512, help="JPEGs in the folder [512]")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--iterations", type=int, default=14)
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the throughput")
    p.add_argument("--workers", type=int, default=min(4, cpus),
                   help="loader workers on both sides [4, or the CPUs if fewer]")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on both sides [1]")
    p.add_argument("--hidden", type=int, default=16, help="the MLP's hidden width [16]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runtime", type=Path,
                   default=Path(os.environ.get("STAGEHAND_RUNTIME", HERE.parent / "target/release/runtime")),
                   help="the runtime binary [$STAGEHAND_RUNTIME, else this checkout's target/release/runtime]")
    p.add_argument("--references", default="pil,tensor",
                   help="PyTorch's loaders to compare with: pil, tensor or both [pil,tensor]")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    p.add_argument("--reference", choices=["pil", "tensor"], help=argparse.SUPPRESS)
    return p.parse_args()


def main():
    a = parse_args()
    if a.reference:
        return reference(a)
    a.folder.mkdir(parents=True, exist_ok=True)
    make_folder(a.folder, a.images, a.classes, a.seed)
    kinds = [k for k in a.references.split(",") if k]
    runs = {"ours": lambda: run_ours(a)}
    for kind in kinds:
        runs[f"pytorch-{kind}"] = lambda kind=kind: run_reference(a, kind)
    figures = rotate(a.rounds, runs)
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"image folder of {a.images} JPEGs, batch {a.batch_size} at {a.image_size}x{a.image_size}, "
          f"{a.workers} loader workers, {a.threads} intra-op thread(s), {a.rounds} rounds")
    for name, values in figures.items():
        print(f"  {name:16} {medians[name]:8.1f} images/s  (runs: {', '.join(f'{v:.1f}' for v in values)})")
    ratios = {k: medians["ours"] / medians[f"pytorch-{k}"] for k in kinds}
    for kind, ratio in ratios.items():
        print(f"  ours / pytorch-{kind}: {ratio:.2f}x")
    if a.out:
        write_json(a.out, {"settings": {k: str(v) for k, v in vars(a).items()},
                           "images_per_s": figures, "medians": medians, "ratios": ratios})


if __name__ == "__main__":
    main()
