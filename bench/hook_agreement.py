#!/usr/bin/env python3
"""The cost of the DDP hook's per-bucket agreement (``LightwireHookState(agree=True)``).

Each bucket's agreement is one one-element MIN allreduce on the trainers' process group. This
times that collective over gloo among W processes on loopback: median and p99 of 500 after 50
warm-up calls, for W = 2 and 4.

    $PYTHON bench/hook_agreement.py [--worlds 2,4] [--calls 500]
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, store, calls, results):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    try:
        flag = torch.ones(1, dtype=torch.int32)
        for _ in range(50):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True).wait()
            times.append(time.perf_counter() - t0)
        times.sort()
        if rank == 0:
            results.put((times[len(times) // 2], times[int(len(times) * 0.99)]))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="process counts, comma-separated")
    ap.add_argument("--calls", type=int, default=500, help="timed calls per process count")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for world in (int(w) for w in args.worlds.split(",")):
        if world < 2:
            ap.error("--worlds: at least 2 processes")
        with tempfile.TemporaryDirectory() as d:
            results = ctx.Queue()
            procs = [ctx.Process(target=run, args=(r, world, os.path.join(d, "store"), args.calls,
                                                   results)) for r in range(world)]
            for p in procs:
                p.start()
            median, p99 = results.get(timeout=600)
            for p in procs:
                p.join()
        print("world %d: one-element MIN allreduce (gloo, loopback): median %.0f us, p99 %.0f us"
              % (world, median * 1e6, p99 * 1e6), flush=True)


if __name__ == "__main__":
    main()
