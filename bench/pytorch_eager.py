#!/usr/bin/env python3
"""The PyTorch eager reference for bench/runtime_vs_pytorch.py: trains one model the way
`runtime` does (same model layout, synthetic pool of 4 batches, SGD with momentum, same timing
points) and prints one JSON object with the per-iteration seconds."""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn


def mlp(args):
    layers, d_in = [], 3 * args.image_size * args.image_size
    for _ in range(args.layers):
        layers += [nn.Linear(d_in, args.hidden), nn.ReLU()]
        d_in = args.hidden
    return nn.Sequential(nn.Flatten(), *layers, nn.Linear(d_in, args.num_classes))


def build(args):
    if args.model == "mlp":
        return mlp(args)
    import torchvision

    if args.model == "vgg16":
        return torchvision.models.vgg16(num_classes=args.num_classes, dropout=args.dropout)
    if args.model == "resnet50":
        return torchvision.models.resnet50(num_classes=args.num_classes)
    raise SystemExit(f"unknown model {args.model}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--image-size", type=int, required=True)
    p.add_argument("--num-classes", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    pool = [
        (torch.randn(shape), torch.randint(args.num_classes, (args.batch_size,))) for _ in range(4)
    ]
    times, losses = [], []
    for i in range(args.iterations):
        t0 = time.perf_counter()
        x, y = pool[i % len(pool)]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    print(json.dumps({"times": times, "losses": losses, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
