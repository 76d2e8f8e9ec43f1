"""Ray's and Monarch's figures for the messaging workloads of WORKLOADS.md, to print beside
`archipelago bench --actor-api-only` in the same window (run one right after the other; quote ratios).

Workloads (tiny payload unless said): one caller -> one actor synchronous round trips per second;
one caller -> one actor with 1000 calls in flight; one caller -> 8 actors pipelined (1000 in flight
in all); one call whose argument is a 64 MiB float32 tensor (GB/s); and Ray only, the compiled
chain driver -> A -> B -> driver of tiny calls, one iteration at a time, as Ray Compiled Graph
(`experimental_compile`) and as classic calls (microseconds per iteration). Ray and Monarch actors
run in processes of their own, so every figure here is across processes on 127.0.0.1.
Prints one JSON line per figure, with /proc/loadavg.

    /work/peers-venv/bin/python scripts/actor_peers.py --system ray
    /work/monarch-venv/bin/python scripts/actor_peers.py --system monarch

Needs `ray==2.60.0` (with numpy) or `torchmonarch==0.7.0` (with torch) in the interpreter that runs it;
neither is needed by the build or the tests.
"""

import argparse
import json
import time

import numpy as np

TENSOR_BYTES = 64 << 20


def emit(system, workload, value, unit, **extra):
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(json.dumps(dict(system=system, workload=workload, value=round(value, 2), unit=unit, loadavg=load, **extra)),
          flush=True)


def timed(fn, seconds):
    """Runs `fn` (which returns how many operations it did) until `seconds` passed; ops per second."""
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += fn()
    return done / (time.perf_counter() - start)


def ray_figures(seconds):
    import ray
    from ray.dag import InputNode

    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR")

    @ray.remote
    class Echo:
        def ping(self, x):
            return x

        def size(self, a):
            return a.nbytes

    one = Echo.remote()
    ray.get(one.ping.remote(0))
    emit("ray", "sync_calls_per_s", timed(lambda: (ray.get(one.ping.remote(0)), 1)[1], seconds), "calls/s")
    emit("ray", "in_flight_1000_calls_per_s",
         timed(lambda: (ray.get([one.ping.remote(0) for _ in range(1000)]), 1000)[1], seconds), "calls/s")
    eight = [Echo.remote() for _ in range(8)]
    ray.get([a.ping.remote(0) for a in eight])
    emit("ray", "one_to_8_calls_per_s",
         timed(lambda: (ray.get([eight[i % 8].ping.remote(0) for i in range(1000)]), 1000)[1], seconds), "calls/s")
    tensor = np.ones(TENSOR_BYTES // 4, dtype=np.float32)
    ray.get(one.size.remote(tensor))
    emit("ray", "tensor_64mib_gb_per_s",
         timed(lambda: (ray.get(one.size.remote(tensor)), 1)[1], seconds) * TENSOR_BYTES / 1e9, "GB/s")

    a, b = Echo.remote(), Echo.remote()
    ray.get([a.ping.remote(0), b.ping.remote(0)])
    iterations = 2000
    start = time.perf_counter()
    for i in range(iterations):
        ray.get(b.ping.remote(a.ping.remote(i)))
    emit("ray", "chain_classic_us_per_iter", (time.perf_counter() - start) / iterations * 1e6, "us")
    with InputNode() as x:
        dag = b.ping.bind(a.ping.bind(x))
    compiled = dag.experimental_compile()
    for i in range(100):
        ray.get(compiled.execute(i))
    iterations = 10000
    start = time.perf_counter()
    for i in range(iterations):
        ray.get(compiled.execute(i))
    emit("ray", "chain_compiled_us_per_iter", (time.perf_counter() - start) / iterations * 1e6, "us")
    compiled.teardown()
    ray.shutdown()


def monarch_figures(seconds):
    import torch
    from monarch.actor import Actor, endpoint, this_host

    class Echo(Actor):
        @endpoint
        def ping(self, x: int) -> int:
            return x

        @endpoint
        def nbytes(self, t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

    procs = this_host().spawn_procs(per_host={"procs": 8})
    mesh = procs.spawn("echo", Echo)
    one = mesh.slice(procs=0)
    one.ping.call_one(0).get()
    emit("monarch", "sync_calls_per_s", timed(lambda: (one.ping.call_one(0).get(), 1)[1], seconds), "calls/s")

    def in_flight(targets):
        futures = [targets[i % len(targets)].ping.call_one(0) for i in range(1000)]
        for f in futures:
            f.get()
        return 1000

    emit("monarch", "in_flight_1000_calls_per_s", timed(lambda: in_flight([one]), seconds), "calls/s")
    eight = [mesh.slice(procs=i) for i in range(8)]
    for actor in eight:
        actor.ping.call_one(0).get()
    emit("monarch", "one_to_8_calls_per_s", timed(lambda: in_flight(eight), seconds), "calls/s")
    tensor = torch.ones(TENSOR_BYTES // 4, dtype=torch.float32)
    one.nbytes.call_one(tensor).get()
    emit("monarch", "tensor_64mib_gb_per_s",
         timed(lambda: (one.nbytes.call_one(tensor).get(), 1)[1], seconds) * TENSOR_BYTES / 1e9, "GB/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=["ray", "monarch"], required=True)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each figure is measured")
    args = parser.parse_args()
    (ray_figures if args.system == "ray" else monarch_figures)(args.seconds)


if __name__ == "__main__":
    main()
