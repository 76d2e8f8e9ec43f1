"""The peer measurement of archipelago's serving bench: Hugging Face `transformers`' `generate`, greedy,
with its KV cache, on the same GPT-2 weights (float32, CPU, `torch.inference_mode()`), to print
beside archipelago's figures in the same window (run one right after the other; quote ratios).

    bash scripts/peers_venv.sh hf      # torch 2.9.0, transformers 4.57.6
    ~/.cache/archipelago-peers/hf/bin/python scripts/serve_peer.py --model-dir DIR \
        --prompts prompts.json --max-tokens 64 [--threads N] [--warmup 2] [--batch-sizes 1,16]

DIR is a `save_pretrained` directory of a `GPT2LMHeadModel` (`model.safetensors`, `config.json`);
prompts.json a JSON list of prompts, each a list of token ids. Every sequence gets exactly
`--max-tokens` new tokens (`min_new_tokens` = `max_new_tokens`, so EOS never stops one early).

Batch size 1: each prompt alone. A `LogitsProcessor` stamps `time.perf_counter()` at every step,
when that step's logits are ready and just before its token is picked, so the time to first token
is prefill + first token from the call to `generate`, and the inter-token latencies are the gaps
between stamps. Reports generated tokens/s over the whole run (all new tokens / all wall time),
TTFT p50/p99, inter-token latency p50/p99, and decode-only tokens/s (tokens after the first / time
after the first).

Batch size B > 1: the prompts in groups of B (the last group filled from the start of the list),
left-padded with id 0 under attention mask 0; reports generated tokens/s, the first step's
(prefill's) latency and the per-step decode latency p50/p99.

`--warmup K` runs the first K prompts alone, and one group per batch size B > 1, before measuring
(none counted). Prints one JSON object on stdout, progress on stderr; `--tokens-out FILE` also
writes batch 1's generated ids (one list per prompt), to hold beside archipelago's greedy output.
Needs the `hf` environment of `scripts/peers_venv.sh`; neither the build nor the tests run it.
"""

import argparse
import json
import sys
import time

import numpy as np
import torch
import transformers


class Stamps(transformers.LogitsProcessor):
    """Appends `time.perf_counter()` each time `generate` has a step's logits; changes nothing."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def ms_percentiles(seconds):
    values = np.asarray(seconds, dtype=np.float64) * 1e3
    return round(float(np.percentile(values, 50)), 3), round(float(np.percentile(values, 99)), 3)


def generate(model, input_ids, attention_mask, new_tokens):
    """One `generate` call; (output ids, start time, per-step stamps, end time)."""
    stamps = Stamps()
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        logits_processor=transformers.LogitsProcessorList([stamps]),
    )
    end = time.perf_counter()
    if out.shape[1] != input_ids.shape[1] + new_tokens or len(stamps.times) != new_tokens:
        raise SystemExit(f"generate made {out.shape[1] - input_ids.shape[1]} tokens in "
                         f"{len(stamps.times)} steps, not {new_tokens}")
    return out, start, stamps.times, end


def alone(model, prompt, new_tokens):
    ids = torch.tensor([prompt], dtype=torch.long)
    return generate(model, ids, torch.ones_like(ids), new_tokens)


def padded_group(prompts):
    """Left-pads with id 0 under attention mask 0."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def batch_1(model, prompts, new_tokens, warmup, tokens_out):
    for i, prompt in enumerate(prompts[:warmup]):
        log(f"warmup {i + 1}/{warmup} (batch 1)")
        alone(model, prompt, new_tokens)
    ttft, itl, wall, decode_wall, generated = [], [], 0.0, 0.0, []
    for i, prompt in enumerate(prompts):
        out, start, times, end = alone(model, prompt, new_tokens)
        ttft.append(times[0] - start)
        itl.extend(np.diff(times).tolist())
        wall += end - start
        decode_wall += end - times[0]
        generated.append(out[0, len(prompt):].tolist())
        log(f"batch 1: prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens): "
            f"TTFT {ttft[-1] * 1e3:.1f} ms, {new_tokens / (end - start):.1f} tokens/s")
    if tokens_out:
        with open(tokens_out, "w") as f:
            json.dump(generated, f)
    ttft_p50, ttft_p99 = ms_percentiles(ttft)
    result = dict(
        sequences=len(prompts),
        new_tokens=len(prompts) * new_tokens,
        wall_s=round(wall, 4),
        tokens_per_s=round(len(prompts) * new_tokens / wall, 2),
        ttft_ms_p50=ttft_p50,
        ttft_ms_p99=ttft_p99,
    )
    if itl:
        itl_p50, itl_p99 = ms_percentiles(itl)
        result.update(
            itl_ms_p50=itl_p50,
            itl_ms_p99=itl_p99,
            decode_tokens_per_s=round(len(prompts) * (new_tokens - 1) / decode_wall, 2),
        )
    return result


def batch_b(model, prompts, new_tokens, size, warmup):
    groups = (len(prompts) + size - 1) // size
    filled = [prompts[i % len(prompts)] for i in range(groups * size)]
    if warmup > 0:
        log(f"warmup 1 group (batch {size})")
        generate(model, *padded_group(filled[:size]), new_tokens)
    prefill, steps, wall = [], [], 0.0
    for g in range(groups):
        ids, mask = padded_group(filled[g * size:(g + 1) * size])
        _, start, times, end = generate(model, ids, mask, new_tokens)
        prefill.append(times[0] - start)
        steps.extend(np.diff(times).tolist())
        wall += end - start
        log(f"batch {size}: group {g + 1}/{groups} (width {ids.shape[1]}): "
            f"{size * new_tokens / (end - start):.1f} tokens/s")
    prefill_p50, prefill_p99 = ms_percentiles(prefill)
    result = dict(
        groups=groups,
        sequences=groups * size,
        new_tokens=groups * size * new_tokens,
        wall_s=round(wall, 4),
        tokens_per_s=round(groups * size * new_tokens / wall, 2),
        prefill_ms_p50=prefill_p50,
        prefill_ms_p99=prefill_p99,
    )
    if steps:
        step_p50, step_p99 = ms_percentiles(steps)
        result.update(step_ms_p50=step_p50, step_ms_p99=step_p99)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="save_pretrained directory of a GPT2LMHeadModel")
    parser.add_argument("--prompts", required=True, help="JSON list of prompts, each a list of token ids")
    parser.add_argument("--max-tokens", type=int, required=True, help="new tokens per sequence, exactly")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--warmup", type=int, default=2, help="prompts run alone before measuring")
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated, e.g. 1,16")
    parser.add_argument("--tokens-out", help="writes batch 1's generated ids here (JSON)")
    args = parser.parse_args()
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        parser.error("--batch-sizes must list positive sizes")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {threads}")

    with open(args.prompts) as f:
        prompts = json.load(f)
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise SystemExit(f"{args.prompts}: want a non-empty JSON list of non-empty lists of token ids")

    model = transformers.GPT2LMHeadModel.from_pretrained(args.model_dir).to(torch.float32).eval()
    config = model.config
    longest = max(len(p) for p in prompts)
    if longest + args.max_tokens > config.n_positions:
        raise SystemExit(f"the longest prompt ({longest} tokens) + {args.max_tokens} new tokens passes the "
                         f"model's {config.n_positions} positions")
    if max(max(p) for p in prompts) >= config.vocab_size or min(min(p) for p in prompts) < 0:
        raise SystemExit(f"a prompt holds an id outside the model's vocabulary of {config.vocab_size}")
    log(f"{args.model_dir}: {config.n_layer} layers, d {config.n_embd}, {config.n_head} heads, "
        f"vocab {config.vocab_size}, {config.n_positions} positions; {len(prompts)} prompts")

    report = {
        "peer": "transformers",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": threads,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "model": dict(n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head,
                      vocab_size=config.vocab_size, n_positions=config.n_positions,
                      dtype="float32", device="cpu"),
    }
    with torch.inference_mode():
        for size in sizes:
            if size == 1:
                report["batch_1"] = batch_1(model, prompts, args.max_tokens, args.warmup, args.tokens_out)
            else:
                report[f"batch_{size}"] = batch_b(model, prompts, args.max_tokens, size, args.warmup)
    with open("/proc/loadavg") as f:
        report["load_avg"] = f.read().strip()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
