"""PyTorch gloo's collectives between two processes on 127.0.0.1, to print beside
`archipelago bench --data-paths-only` in the same window (run one right after the other; quote
ratios): all-reduce (sum) and all-gather of 64 MiB of float32, one thread per rank, median of
`--reps` after one warm-up. Bandwidth as archipelago's bench reports it: algbw = bytes / time.
Prints one JSON line per figure, with /proc/loadavg.

    ~/.cache/archipelago-peers/torch-ray/bin/python scripts/collective_peers.py

Needs torch (scripts/peers_venv.sh makes the environment); nothing in the build or tests does.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, args, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    n = args.bytes // 4
    x = torch.full((n,), float(rank))
    gathered = [torch.empty(n // 2) for _ in range(2)]
    figures = {}
    for name, op in [
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("all_gather", lambda: dist.all_gather(gathered, x[: n // 2])),
    ]:
        times = []
        for rep in range(args.reps + 1):
            dist.barrier()
            t = time.perf_counter()
            op()
            if rep > 0:
                times.append(time.perf_counter() - t)
        figures[name] = statistics.median(times)
    if rank == 0:
        out.put(figures)
        out.close()
        out.join_thread()
    # destroy_process_group() can hang at teardown here (torch 2.5.1, gloo): both ranks are done.
    dist.barrier()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=64 << 20)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, args.port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    figures = out.get()
    for proc in procs:
        proc.join()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    for name, s in figures.items():
        # all_gather moves half-size shards into a full-size result: its bytes are args.bytes.
        print(json.dumps(dict(system="torch gloo", collective=name, bytes=args.bytes, members=2,
                              median_s=round(s, 5), algbw_gb_per_s=round(args.bytes / s / 1e9, 3),
                              loadavg=load)), flush=True)


if __name__ == "__main__":
    main()
