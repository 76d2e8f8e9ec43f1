"""The independent PyTorch reference of archipelago's training step, as a checked-in fixture.

`write_fixture(DIR)` trains a tiny mlp and a tiny gpt in PyTorch for 5 steps, each twice: plain
SGD, and AdamW with global-norm gradient clipping, linear warmup and cosine decay. It writes the
initial weights and the batches as safetensors files (PyTorch's names and layouts, the names of
`dataflow/src/param_names.rs`), and PyTorch's per-step losses, gradient norms and learning rates
(`expected.json`) and final weights (`{model}.{optimizer}.final.safetensors`). The Rust test
(integration-tests/tests/optimizer_equivalence.rs) trains the same from the same files with
`--init` and `--data` and compares element by element.

Archipelago's definitions, followed here exactly (read from actors/src/optim/ and
dataflow/src/optimizer/):
- loss: mean cross-entropy over the global batch (over every token for a gpt);
- batch of step s (from 1) with global batch b: file rows (s*b + j) mod n, j in 0..b;
- SGD: p -= lr*g;
- AdamW (torch.optim.AdamW's form): p *= 1 - lr*wd; m, v moments; bias corrections 1 - beta^t;
  p -= lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps); eps 1e-8, betas (0.9, 0.999);
  weight decay only for parameters of 2 or more dimensions (no decay for biases and LayerNorm);
- clipping: factor min(1, max_norm/(||g|| + 1e-6)) over every gradient (torch's clip_grad_norm_);
- schedule: LambdaLR with lambda(i) = factor(i + 1), factor(t) = t/w for t <= w, then
  f + (1 - f)*0.5*(1 + cos(pi*p)), p = min(1, (t - w)/(total - w)).

`check_export(FILE)` loads an exported file into the matching torch model with
`load_state_dict(strict=True)` and runs a forward.
"""

import json
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

STEPS = 5

MODELS = {
    "mlp": {"spec": "mlp:in=8,hidden=16,layers=2,out=4", "batch": 8},
    "gpt": {"spec": "gpt:vocab=16,ctx=8,d=16,layers=2,heads=2", "batch": 4},
}

OPTIMIZERS = {
    "sgd": {"optimizer": "sgd", "lr": 0.1},
    "adamw": {
        "optimizer": "adamw",
        "lr": 0.01,
        "weight_decay": 0.1,
        "clip_grad_norm": 0.4,
        "warmup_steps": 2,
        "lr_schedule": "cosine",
        "lr_final_fraction": 0.1,
    },
}


class Mlp(nn.Module):
    """`layers` x (Linear + ReLU), then the output Linear: `layers.{k}` is the k-th Linear."""

    def __init__(self, input, hidden, layers, out):
        super().__init__()
        widths = [input] + [hidden] * layers + [out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def parse_spec(spec):
    """The keyword arguments of a parametric spec (`mlp:in=8,...` or `gpt:vocab=16,...`)."""
    named = {
        "mlp-8x1024": "mlp:in=1024,hidden=1024,layers=8,out=10",
        "gpt-tiny": "gpt:vocab=256,ctx=128,d=256,layers=4,heads=4",
    }
    spec = named.get(spec, spec)
    kind, args = spec.split(":", 1)
    kv = {k: int(v) for k, v in (pair.split("=") for pair in args.split(","))}
    if kind == "mlp":
        kv["input"] = kv.pop("in")
    return kind, kv


def build(spec, gpt_class):
    kind, kv = parse_spec(spec)
    return kind, (Mlp(**kv) if kind == "mlp" else gpt_class(**kv)), kv


def initial_weights(model, gen):
    """Seeded weights, perturbed away from the defaults so that a misplaced LayerNorm or a
    transposed matrix shows: Linear U(+-1/sqrt(in)), embeddings N(0, 0.02), LayerNorm weight
    1 + N(0, 0.1) and bias N(0, 0.1)."""
    out = {}
    for name, p in model.state_dict().items():
        if ".ln" in name or name.startswith("ln_f"):
            base = 1.0 if name.endswith("weight") else 0.0
            value = base + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.startswith(("tok.", "pos.")):
            value = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            fan_in = p.shape[1] if p.dim() == 2 else model.state_dict()[name.replace("bias", "weight")].shape[1]
            bound = 1.0 / math.sqrt(fan_in)
            value = (torch.rand(p.shape, generator=gen) * 2 - 1) * bound
        out[name] = value.float().contiguous()
    return out


def batches(kind, kv, batch, gen):
    rows = STEPS * batch
    if kind == "mlp":
        return {
            "inputs": torch.randn(rows, kv["input"], generator=gen),
            "targets": torch.randint(0, kv["out"], (rows,), generator=gen),
        }
    return {"tokens": torch.randint(0, kv["vocab"], (rows, kv["ctx"] + 1), generator=gen)}


def step_rows(step, batch, rows):
    return torch.tensor([(step * batch + j) % rows for j in range(batch)])


def loss_of(kind, model, data, idx):
    if kind == "mlp":
        return F.cross_entropy(model(data["inputs"][idx]), data["targets"][idx])
    tokens = data["tokens"][idx]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def schedule_factor(o, t):
    w = o.get("warmup_steps", 0)
    if t <= w:
        return t / w
    if o.get("lr_schedule", "constant") == "constant":
        return 1.0
    f = o["lr_final_fraction"]
    p = min(1.0, (t - w) / (STEPS - w)) if STEPS > w else 1.0
    shape = 0.5 * (1 + math.cos(math.pi * p)) if o["lr_schedule"] == "cosine" else 1 - p
    return f + (1 - f) * shape


def train(kind, model, data, batch, o):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    if o["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=o["lr"])
    else:
        groups = [
            {"params": decay, "weight_decay": o["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: schedule_factor(o, i + 1))
    rows = len(next(iter(data.values())))
    record = {"losses": [], "grad_norms": [], "lrs": [], "clip_factors": []}
    for step in range(1, STEPS + 1):
        loss = loss_of(kind, model, data, step_rows(step, batch, rows))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
        factor = 1.0
        if "clip_grad_norm" in o:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_grad_norm"])
            factor = min(1.0, o["clip_grad_norm"] / (norm + 1e-6))
        record["losses"].append(loss.item())
        record["grad_norms"].append(norm)
        record["lrs"].append(opt.param_groups[0]["lr"])
        record["clip_factors"].append(factor)
        opt.step()
        sched.step()
    return record


def write_fixture(out_dir, gpt_class):
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    expected = {"steps": STEPS, "torch": torch.__version__, "models": {}}
    for name, m in MODELS.items():
        gen = torch.Generator().manual_seed(17 if name == "mlp" else 29)
        kind, model, kv = build(m["spec"], gpt_class)
        init = initial_weights(model, gen)
        data = batches(kind, kv, m["batch"], gen)
        save_file(init, os.path.join(out_dir, f"{name}.init.safetensors"), metadata={"format": "pt", "model": m["spec"]})
        save_file(data, os.path.join(out_dir, f"{name}.data.safetensors"))
        runs = {}
        for oname, o in OPTIMIZERS.items():
            _, model, _ = build(m["spec"], gpt_class)
            model.load_state_dict(init, strict=True)
            runs[oname] = {"flags": o, **train(kind, model, data, m["batch"], o)}
            final = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            save_file(final, os.path.join(out_dir, f"{name}.{oname}.final.safetensors"))
        expected["models"][name] = {"spec": m["spec"], "batch": m["batch"], "runs": runs}
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


def infer_spec(state, heads):
    """The model spec of an exported state dict, from its names and shapes (a gpt's head count is
    not in its weights: `heads` gives it)."""
    if "tok.weight" in state:
        if heads is None:
            raise SystemExit("a gpt's head count is not in its weights: give --export-model gpt:...,heads=H")
        vocab, d = state["tok.weight"].shape
        ctx = state["pos.weight"].shape[0]
        layers = sum(1 for k in state if k.endswith(".qkv.weight"))
        return f"gpt:vocab={vocab},ctx={ctx},d={d},layers={layers},heads={heads}"
    linears = sum(1 for k in state if re.match(r"^layers\.\d+\.weight$", k))
    first, last = state["layers.0.weight"], state[f"layers.{linears - 1}.weight"]
    return f"mlp:in={first.shape[1]},hidden={first.shape[0]},layers={linears - 1},out={last.shape[0]}"


def check_export(path, gpt_class, spec=None):
    """Loads `path` (strict) into the torch model `spec` names (by default the one its names and
    shapes describe); runs one forward on a random batch."""
    state = load_file(path)
    if spec is None:
        # An `archipelago export` names its model in the file's metadata (a gpt's heads are
        # not in its weights); older files are described from their names and shapes.
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            spec = (f.metadata() or {}).get("archipelago_model")
    if spec is None:
        spec = infer_spec(state, heads=None)
    kind, model, kv = build(spec, gpt_class)
    model.load_state_dict(state, strict=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if kind == "mlp":
            x = torch.randn(4, kv["input"], generator=gen)
            y = torch.randint(0, kv["out"], (4,), generator=gen)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        else:
            tokens = torch.randint(0, kv["vocab"], (2, kv["ctx"] + 1), generator=gen)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, kv["vocab"]), tokens[:, 1:].reshape(-1))
    return {
        "file": path,
        "model": spec,
        "tensors": len(state),
        "params": sum(v.numel() for v in state.values()),
        "strict_load": "ok",
        "logits_shape": list(logits.shape),
        "finite": bool(torch.isfinite(logits).all()),
        "loss_on_random_batch": loss.item(),
    }
