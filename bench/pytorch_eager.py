#!/usr/bin/env python3
"""The PyTorch reference for bench/runtime_vs_pytorch.py: trains one model the way `runtime` does
(same model layout and parameter count, the runtime's synthetic pool of 4 batches made once on the
device, SGD with momentum, autocast around the forward and the loss, the same timing points) and
prints one JSON object: the per-iteration seconds, losses, parameter count and peak memory.

Eager by default; `--compile` wraps the model in `torch.compile` (its first iterations compile:
the caller leaves them out). `--count-params` only builds the model and prints its parameter count.

`--ddp` makes the process one rank of data parallelism as PyTorch users run it: torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the model wrapped in
DistributedDataParallel (gradients all-reduced in its buckets of `--bucket-mb` MiB, overlapped
with the backward), gloo on a CPU and nccl on a GPU; `--batch-size` is then the rank's share and
its data pool is drawn from `--seed` plus its rank. Every rank prints its JSON object.
"""
import argparse
import contextlib
import json
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn

# The runtime's defaults (runtime/src/config.rs) for what a model reads and was not given.
DEFAULTS = {
    "mlp": dict(layers=4, hidden=1024, num_classes=10, image_size=32, dropout=0.0),
    "transformer": dict(layers=12, hidden=768, heads=12, seq_len=128, vocab_size=30522, dropout=0.1),
    "vgg16": dict(num_classes=1000, image_size=224, dropout=0.5),
    "resnet50": dict(num_classes=1000, image_size=224, dropout=0.0),
}
POOL_BATCHES = 4


def mlp(a):
    layers, d_in = [], 3 * a.image_size * a.image_size
    for _ in range(a.layers):
        layers += [nn.Linear(d_in, a.hidden), nn.ReLU()]
        d_in = a.hidden
    return nn.Sequential(nn.Flatten(), *layers, nn.Linear(d_in, a.num_classes))


# The runtime's `--model transformer` (runtime/src/models/transformer.rs): BERT's layout and
# parameter names, post-LayerNorm encoder layers, exact GELU, LayerNorm eps 1e-12, N(0, 0.02)
# weights and zero biases, position embeddings for `seq_len` positions, two token types (all
# zero), attention dropout inside scaled_dot_product_attention, and a token-level head whose
# decoder is not tied to the word embeddings.
LAYER_NORM_EPS = 1e-12


class BertEmbeddings(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden)
        self.position_embeddings = nn.Embedding(a.seq_len, a.hidden)
        self.token_type_embeddings = nn.Embedding(2, a.hidden)
        self.LayerNorm = nn.LayerNorm(a.hidden, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(a.dropout)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        token_types = torch.zeros_like(positions)
        xs = self.word_embeddings(ids) + self.position_embeddings(positions)
        xs = xs + self.token_type_embeddings(token_types)
        return self.dropout(self.LayerNorm(xs))


class BertSelfAttention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.query = nn.Linear(a.hidden, a.hidden)
        self.key = nn.Linear(a.hidden, a.hidden)
        self.value = nn.Linear(a.hidden, a.hidden)
        self.heads, self.p = a.heads, a.dropout

    def forward(self, xs):
        batch, seq, hidden = xs.shape

        def split(t):
            return t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

        q, k, v = split(self.query(xs)), split(self.key(xs)), split(self.value(xs))
        p = self.p if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return context.transpose(1, 2).reshape(batch, seq, hidden)


class BertSelfOutput(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.dense = nn.Linear(a.hidden, a.hidden)
        self.LayerNorm = nn.LayerNorm(a.hidden, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(a.dropout)

    def forward(self, xs, residual):
        return self.LayerNorm(self.dropout(self.dense(xs)) + residual)


class BertAttention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.self = BertSelfAttention(a)
        self.output = BertSelfOutput(a)

    def forward(self, xs):
        return self.output(self.self(xs), xs)


class BertIntermediate(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.dense = nn.Linear(a.hidden, 4 * a.hidden)

    def forward(self, xs):
        return F.gelu(self.dense(xs))


class BertOutput(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.dense = nn.Linear(4 * a.hidden, a.hidden)
        self.LayerNorm = nn.LayerNorm(a.hidden, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(a.dropout)

    def forward(self, xs, residual):
        return self.LayerNorm(self.dropout(self.dense(xs)) + residual)


class BertLayer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = BertAttention(a)
        self.intermediate = BertIntermediate(a)
        self.output = BertOutput(a)

    def forward(self, xs):
        xs = self.attention(xs)
        return self.output(self.intermediate(xs), xs)


class BertEncoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(a) for _ in range(a.layers))

    def forward(self, xs):
        for layer in self.layer:
            xs = layer(xs)
        return xs


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.dense = nn.Linear(a.hidden, a.hidden)
        self.LayerNorm = nn.LayerNorm(a.hidden, eps=LAYER_NORM_EPS)

    def forward(self, xs):
        return self.LayerNorm(F.gelu(self.dense(xs)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.transform = BertPredictionHeadTransform(a)
        self.decoder = nn.Linear(a.hidden, a.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(a.vocab_size))

    def forward(self, xs):
        return self.decoder(self.transform(xs)) + self.bias


class BertOnlyMLMHead(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.predictions = BertLMPredictionHead(a)

    def forward(self, xs):
        return self.predictions(xs)


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, a):
        super().__init__()
        self.embeddings = BertEmbeddings(a)
        self.encoder = BertEncoder(a)
        self.cls = BertOnlyMLMHead(a)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids):
        return self.cls(self.encoder(self.embeddings(ids)))


def build(a):
    if a.model == "mlp":
        return mlp(a)
    if a.model == "transformer":
        return Transformer(a)
    try:
        import torchvision
    except ModuleNotFoundError:
        raise SystemExit(f"pytorch_eager.py: {a.model} is torchvision's, which this Python lacks; run "
                         "scripts/bench-runtime (it installs torchvision==0.26.0) or pip install it")

    if a.model == "vgg16":
        return torchvision.models.vgg16(num_classes=a.num_classes, dropout=a.dropout)
    if a.model == "resnet50":
        return torchvision.models.resnet50(num_classes=a.num_classes)
    raise SystemExit(f"pytorch_eager.py: unknown model {a.model}")


def synthetic_pool(a, device):
    """The runtime's synthetic data (runtime/src/data/synthetic.rs), same generator and seed:
    images are a class's 4x4 prototype, upsampled, plus noise; a token's target is (id*7+3) mod
    vocab. Made once on the CPU, then moved to the device."""
    torch.manual_seed(a.seed * 7919 + 1)
    pool = []
    if a.model == "transformer":
        for _ in range(POOL_BATCHES):
            ids = torch.randint(a.vocab_size, (a.batch_size, a.seq_len))
            pool.append((ids, (ids * 7 + 3) % a.vocab_size))
    else:
        prototypes = torch.randn(a.num_classes, 3, 4, 4)
        for _ in range(POOL_BATCHES):
            labels = torch.randint(a.num_classes, (a.batch_size,))
            base = F.interpolate(prototypes[labels], size=(a.image_size, a.image_size), mode="nearest")
            images = base + torch.randn(a.batch_size, 3, a.image_size, a.image_size) * 0.5
            if a.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            pool.append((images, labels))
    return [(x.to(device), y.to(device)) for x, y in pool]


def loss_of(model_name, output, target):
    if model_name == "transformer":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.cross_entropy(output, target)


def peaks(device):
    memory = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        memory["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        memory["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return memory


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(DEFAULTS))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--image-size", type=int)
    p.add_argument("--num-classes", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--threads", type=int)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: torch.autocast(device, torch.bfloat16) around the forward and the loss")
    p.add_argument("--channels-last", action="store_true",
                   help="model.to(memory_format=torch.channels_last) and channels_last images")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark = True, as `runtime --cudnn-benchmark` sets it")
    p.add_argument("--compile", action="store_true", help="train torch.compile(model)")
    p.add_argument("--compile-mode", default="default", help="torch.compile's mode")
    p.add_argument("--profiler-trace", metavar="FILE",
                   help="record torch.profiler over the iterations after --warmup (each a "
                        "ProfilerStep#N) and write its Chrome trace here, as `runtime --profiler-trace` does")
    p.add_argument("--warmup", type=int, default=1,
                   help="iterations before --profiler-trace starts recording (the runtime's --warmup)")
    p.add_argument("--ddp", action="store_true",
                   help="one rank of DistributedDataParallel, from torchrun's environment variables")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (with --ddp)")
    p.add_argument("--count-params", action="store_true",
                   help="only build the model and print its parameter count")
    a = p.parse_args()
    for key, value in DEFAULTS[a.model].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


def main():
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(a.seed)
    model = build(a)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if a.count_params:
        print(json.dumps({"model": a.model, "num_params": num_params}))
        return

    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        # torch.cuda.set_device and the memory statistics want an index; "cuda" means the current one.
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    model = model.to(device)
    if a.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    rank = 0
    if a.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank = dist.get_rank()
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=a.bucket_mb)
    a.seed += rank
    pool = synthetic_pool(a, device)
    step_model = torch.compile(model, mode=a.compile_mode) if a.compile else model

    def autocast():
        if a.precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    profiler = None

    def part(name):
        """The iteration's forward, backward or step, as a scope of the trace (the runtime's)."""
        return torch.profiler.record_function(name) if profiler is not None else contextlib.nullcontext()

    times, losses = [], []
    for i in range(a.iterations):
        if a.profiler_trace and i == a.warmup:
            # What `runtime --profiler-trace` records: operators with their inputs' shapes, and on
            # a GPU its kernels.
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            profiler.__enter__()
        # Each traced iteration is a ProfilerStep#N scope, as the runtime marks them.
        scope = torch.profiler.record_function(f"ProfilerStep#{i}") if profiler is not None else None
        if scope is not None:
            scope.__enter__()
        t0 = time.perf_counter()
        x, y = pool[i % len(pool)]
        opt.zero_grad()
        with part("forward"), autocast():
            loss = loss_of(a.model, step_model(x), y)
        with part("backward"):
            loss.backward()
        with part("step"):
            opt.step()
        losses.append(loss.item())  # waits for the GPU: the iteration's kernels are in its time
        times.append(time.perf_counter() - t0)
        if scope is not None:
            scope.__exit__(None, None, None)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(a.profiler_trace)
    print(json.dumps({
        "times": times,
        "losses": losses,
        "threads": torch.get_num_threads(),
        "num_params": num_params,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **peaks(device),
    }), flush=True)
    if a.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
