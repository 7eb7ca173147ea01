#!/usr/bin/env python3
"""One rank of the torch.distributed.pipelining reference for bench/pipeline_vs_torch.py.

Builds the model as the same module list `runtime` uses (`runtime modules --model NAME` lists
it), keeps the modules of its stage, and trains with ScheduleGPipe or Schedule1F1B over gloo.
The last rank prints one JSON object with the per-iteration seconds."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def module_list(args):
    """The model as `runtime` splits it: one entry per module, the loss excluded."""
    if args.model == "mlp":
        mods, d_in = [], 3 * args.image_size * args.image_size
        for _ in range(args.layers):
            mods.append(nn.Sequential(nn.Flatten(), nn.Linear(d_in, args.hidden), nn.ReLU()))
            d_in = args.hidden
        return mods + [nn.Sequential(nn.Flatten(), nn.Linear(d_in, args.num_classes))]
    import torchvision

    if args.model == "resnet50":
        m = torchvision.models.resnet50(num_classes=args.num_classes)
        mods = [nn.Sequential(m.conv1, m.bn1, m.relu), m.maxpool]
        for layer in (m.layer1, m.layer2, m.layer3, m.layer4):
            mods.extend(layer)
        return mods + [nn.Sequential(m.avgpool, nn.Flatten()), m.fc]
    if args.model == "vgg16":
        m = torchvision.models.vgg16(num_classes=args.num_classes, dropout=args.dropout)
        mods, feats, i = [], list(m.features), 0
        while i < len(feats):
            if isinstance(feats[i], nn.Conv2d):
                mods.append(nn.Sequential(feats[i], feats[i + 1]))
                i += 2
            else:
                mods.append(feats[i])
                i += 1
        cls = list(m.classifier)
        return mods + [
            nn.Sequential(m.avgpool, nn.Flatten()),
            nn.Sequential(*cls[0:3]),
            nn.Sequential(*cls[3:6]),
            cls[6],
        ]
    raise SystemExit(f"unknown model {args.model}")


def main():
    p = argparse.ArgumentParser()
    for name, kind in [("model", str), ("batch-size", int), ("microbatches", int), ("iterations", int),
                       ("image-size", int), ("num-classes", int), ("threads", int), ("lr", float),
                       ("schedule", str), ("module-to-stage", str)]:
        p.add_argument(f"--{name}", type=kind, required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dropout", type=float, default=0.0)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    stage_of = [int(s) for s in args.module_to_stage.split(",")][:-1]  # the loss is not a module here
    mods = [m for m, s in zip(module_list(args), stage_of) if s == rank]
    submod = nn.Sequential(*mods)
    stage = PipelineStage(submod, rank, world, torch.device("cpu"))
    cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = cls(stage, args.microbatches, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(submod.parameters(), lr=args.lr, momentum=0.9)
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    pool = [(torch.randn(shape), torch.randint(args.num_classes, (args.batch_size,))) for _ in range(4)]
    times = []
    for i in range(args.iterations):
        x, y = pool[i % 4]
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            losses = []
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == world - 1:
        print(json.dumps({"times": times}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
