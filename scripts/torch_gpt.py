"""The PyTorch reference for `archipelago bench --device cuda:0`: the same gpt (WORKLOADS.md's
gpt-tiny architecture: pre-LayerNorm blocks, fused qkv, GELU (erf) MLP 4d, learned positions,
final LayerNorm, untied head without bias, no dropout), the same batch, f32, Adam lr 1e-3;
prints one JSON line per model with the median step time and tokens/s over the timed steps.

    python3 scripts/torch_gpt.py --device cuda --tf32 off     # what archipelago computes (f32)
    python3 scripts/torch_gpt.py --device cuda --tf32 on      # PyTorch's TF32 tensor-core path
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        # Materialised scores and mask, as archipelago computes them (no fused attention).
        scores = q @ k.transpose(2, 3) / math.sqrt(d // h) + mask
        y = torch.softmax(scores, dim=3) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x, mask):
        x = x + self.attention(self.ln1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
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


def run(spec, batch, device, warmup, timed):
    model = Gpt(**spec).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, spec["vocab"], (batch, spec["ctx"] + 1), generator=gen).to(device)
    times = []
    for step in range(warmup + timed):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, spec["vocab"]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # waits for the step, as archipelago's step report does
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_step = batch * spec["ctx"]
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": spec,
        "params": params,
        "global_batch": batch,
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "final_loss": loss.item(),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--tf32", choices=["on", "off"], default="off")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timed", type=int, default=30)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = a.tf32 == "on"
    torch.backends.cudnn.allow_tf32 = a.tf32 == "on"
    models = [
        (dict(vocab=256, ctx=128, d=256, layers=4, heads=4), 16),
        (dict(vocab=256, ctx=1024, d=1024, layers=12, heads=16), 8),
    ]
    for spec, batch in models:
        out = run(spec, batch, a.device, a.warmup, a.timed)
        out.update(torch=torch.__version__, device=a.device, tf32=a.tf32)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
