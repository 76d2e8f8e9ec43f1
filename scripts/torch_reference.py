"""The PyTorch reference for archipelago's benchmarks: the same workloads (WORKLOADS.md), the same
batch, f32, Adam lr 1e-3 (eps 1e-5, as burn's), timed the same way (5 warm-up + 30 timed steps,
median step time; a step waits for its loss). Prints one JSON line per run.

- gpt-tiny and gpt-151m (d=1024, 12 layers, 16 heads, ctx 1024): pre-LayerNorm blocks, fused qkv,
  GELU (erf) MLP 4d, learned positions, final LayerNorm, untied head without bias, no dropout,
  materialised causal attention (no fused kernel), as archipelago computes it.
- mlp-8x1024: 8 × (Linear(1024, 1024) + ReLU) → Linear(1024, 10), cross-entropy, batch 64.

    python3 scripts/torch_reference.py --device cpu --threads 1 --models gpt-tiny,mlp-8x1024
    python3 scripts/torch_reference.py --device cpu --threads 1 --dp 2 --models mlp-8x1024  # DDP, gloo
    python3 scripts/torch_reference.py --device cuda --models gpt-tiny,gpt-151m --tf32 off

Two more modes share weights and data with archipelago through safetensors files (PyTorch's
names and layouts, as `archipelago export` writes and `--init` reads them; see
scripts/torch_fixture.py):

    /work/peers-venv/bin/python scripts/torch_reference.py --fixture integration-tests/fixtures/torch
    /work/peers-venv/bin/python scripts/torch_reference.py --check-export model.safetensors \
        [--export-model gpt:vocab=16,ctx=8,d=16,layers=2,heads=2]  # default: the file's metadata
"""

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

GPTS = {
    "gpt-tiny": (dict(vocab=256, ctx=128, d=256, layers=4, heads=4), 16),
    "gpt-151m": (dict(vocab=256, ctx=1024, d=1024, layers=12, heads=16), 8),
}


class Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=1e-5)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def attention(self, x, mask):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(2, 3) / math.sqrt(d // h) + mask
        y = torch.softmax(scores, dim=3) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x, mask):
        x = x + self.attention(self.ln1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = torch.triu(torch.full((t, t), -1e9, device=tokens.device), diagonal=1)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.ln_f(x))


def mlp():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def workload(name, device, rank, dp):
    """The model, a loss function of it, the per-rank batch and the tokens (or samples) per step."""
    gen = torch.Generator(device="cpu").manual_seed(rank)
    if name in GPTS:
        spec, batch = GPTS[name]
        model = Gpt(**spec).to(device)
        tokens = torch.randint(0, spec["vocab"], (batch // dp, spec["ctx"] + 1), generator=gen).to(device)

        def loss(m):
            logits = m(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, spec["vocab"]), tokens[:, 1:].reshape(-1))

        return model, loss, batch * spec["ctx"], "tokens_per_s"
    if name == "mlp-8x1024":
        model = mlp().to(device)
        x = torch.randn(64 // dp, 1024, generator=gen).to(device)
        y = torch.randint(0, 10, (64 // dp,), generator=gen).to(device)
        return model, (lambda m: F.cross_entropy(m(x), y)), 64, "samples_per_s"
    raise SystemExit(f"unknown model {name}")


def run(name, args, rank=0):
    device = args.device if args.device == "cpu" else f"cuda:{rank}"
    model, loss_fn, per_step, unit = workload(name, device, rank, args.dp)
    params = sum(p.numel() for p in model.parameters())
    if args.dp > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    autocast_dtype = {"off": None, "bf16": torch.bfloat16, "f16": torch.float16}[args.autocast]
    device_type = "cpu" if args.device == "cpu" else "cuda"
    scaler = torch.amp.GradScaler(device_type, enabled=autocast_dtype == torch.float16)
    times = []
    for step in range(args.warmup + args.timed):
        start = time.perf_counter()
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = loss_fn(model)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        value = loss.item()  # waits for the step, as archipelago's step report does
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if args.dp > 1:
        # The slowest rank's step, as archipelago quotes it.
        t = torch.tensor(times)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        times = t.tolist()
    step_s = statistics.median(times)
    return {
        "model": name,
        "params": params,
        "dp": args.dp,
        "device": args.device,
        "threads_per_rank": torch.get_num_threads(),
        "tf32": args.tf32,
        "autocast": args.autocast,
        "median_step_s": step_s,
        unit: per_step / step_s,
        "final_loss": value,
        "torch": torch.__version__,
        "load_avg": list(os.getloadavg()),
    }


def rank_main(rank, args, port):
    torch.set_num_threads(args.threads)
    backend = "gloo" if args.device == "cpu" else "nccl"
    torch.distributed.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.dp
    )
    for name in args.models.split(","):
        out = run(name, args, rank)
        if rank == 0:
            print(json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", default="gpt-tiny,mlp-8x1024")
    p.add_argument("--dp", type=int, default=1, help="ranks (DistributedDataParallel: gloo on CPU, NCCL on GPUs)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (archipelago: 1 per CPU actor)")
    p.add_argument("--tf32", choices=["on", "off"], default="off")
    p.add_argument("--autocast", choices=["off", "bf16", "f16"], default="off",
                   help="mixed precision: the forward and loss under torch.autocast in this dtype (f16 adds a GradScaler)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timed", type=int, default=30)
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--fixture", metavar="DIR", help="write the reference fixture (tiny mlp and gpt, SGD and AdamW) to DIR")
    p.add_argument("--check-export", metavar="FILE", help="load an `archipelago export` file (strict) and run a forward")
    p.add_argument("--export-model", metavar="SPEC", help="with --check-export: the model spec (default: the one the file's metadata names)")
    args = p.parse_args()
    if args.fixture or args.check_export:
        import torch_fixture

        if args.fixture:
            torch_fixture.write_fixture(args.fixture, Gpt)
        if args.check_export:
            print(json.dumps(torch_fixture.check_export(args.check_export, Gpt, args.export_model)), flush=True)
        return
    torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"
    torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    if args.dp > 1:
        torch.multiprocessing.spawn(rank_main, args=(args, args.port), nprocs=args.dp)
        return
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        print(json.dumps(run(name, args)), flush=True)


if __name__ == "__main__":
    main()
