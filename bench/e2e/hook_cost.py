#!/usr/bin/env python3
"""What the lightwire hook's direct path costs a DDP step, without sidecars (bench/README.md
"`codec: auto` on the unlimited link").

W trainer processes (gloo, the loopback) train the e2e MLP for a number of steps three ways, in
turn, repeated: DDP's own allreduce (C++), DDP through PyTorch's Python `allreduce_hook`, and DDP
through the lightwire hook with every step in a direct window (codec auto's `direct` rung: the
process group averages each bucket, the sidecar out of the data path; no sidecar runs, none is
asked). Each run's figure is the median of its steps after the first 10; the report is, per way,
the median over the repetitions of that figure and of DDP's over it (speed against DDP: above 1
is faster), and the trainers' CPU seconds a step, all ranks together.

    $PYTHON bench/e2e/hook_cost.py [--repeats 4] [--steps 60] [--world-size 4] [--size full]
        [--json FILE]

About 2 minutes with the defaults on the 2-core development VM.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))

WAYS = ("ddp", "python_hook", "lightwire_direct")


def trainer(rank, world, way, store, steps, size, queue):
    import torch
    import torch.distributed as dist
    import tasks
    torch.set_num_threads(1)
    # A file store (no port to race for); gloo's pairs still connect over the loopback.
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    task = tasks.make_task("mlp", size=size, seed=0)
    import worker
    ddp = torch.nn.parallel.DistributedDataParallel(task.model())
    # The hooks as the e2e rows register them (worker.attach_hook): PyTorch's allreduce_hook, or
    # the lightwire hook per layer with no sidecar — every step in a direct window, about which
    # the hook never asks one.
    spec = {"ddp": {"kind": "ddp"},
            "python_hook": {"kind": "torch_hook", "hook": "allreduce"},
            "lightwire_direct": {"kind": "lightwire", "hook": None,
                                 "sockets": ["/nonexistent"] * world}}[way]
    state = worker.attach_hook(spec, ddp, dist)
    if state is not None:
        state._direct = (0, 1 << 62)
    opt = task.optimizer(ddp.parameters())
    seconds = []
    cpu0 = time.process_time()
    for step in range(1, steps + 1):
        x, y = task.batch(rank, step)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        task.loss(ddp, x, y).backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
    dist.all_reduce(cpu)
    if rank == 0:
        if way == "lightwire_direct" and state.direct_steps == 0:
            raise RuntimeError("the lightwire hook averaged no bucket in its direct path")
        queue.put({"median_step_seconds": statistics.median(seconds[10:]),
                   "trainer_cpu_seconds_per_step": cpu.item() / steps})
    # Every rank leaves together (as in worker.py): a rank tearing gloo down while the other is
    # still in the last collective can abort it ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--size", choices=("full", "smoke"), default="full",
                   help="the MLP's size (smoke: tiny, for the test suite)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.repeats < 1 or args.steps < 20 or args.world_size < 2:
        sys.exit("hook_cost.py: --repeats >= 1, --steps >= 20, --world-size >= 2")
    import worker
    ctx = worker.rank_context()  # the e2e ranks' fork server
    runs = {w: [] for w in WAYS}
    work = tempfile.mkdtemp(prefix="lightwire-hook-cost-")
    try:
        for rep in range(args.repeats):
            for way in WAYS:
                queue = ctx.Queue()
                store = os.path.join(work, "store-%d-%s" % (rep, way))
                procs = [ctx.Process(target=trainer, args=(r, args.world_size, way, store,
                                                           args.steps, args.size, queue))
                         for r in range(args.world_size)]
                for proc in procs:
                    proc.start()
                for proc in procs:
                    proc.join()
                failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
                if failed:
                    sys.exit("hook_cost.py: %s: a trainer exited with %s" % (way, failed[0]))
                run = queue.get(timeout=10)
                runs[way].append(run)
                print("repetition %d/%d %-17s %.4f s/step, trainers' CPU %.3f s/step" % (
                    rep + 1, args.repeats, way, run["median_step_seconds"],
                    run["trainer_cpu_seconds_per_step"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = []
    for way in WAYS:
        ratios = [d["median_step_seconds"] / r["median_step_seconds"]
                  for d, r in zip(runs["ddp"], runs[way])]
        table.append({"way": way,
                      "median_step_seconds": statistics.median(
                          r["median_step_seconds"] for r in runs[way]),
                      "speed_vs_ddp": ratios, "speed_median": statistics.median(ratios),
                      "speed_min": min(ratios), "speed_max": max(ratios),
                      "trainer_cpu_seconds_per_step": statistics.median(
                          r["trainer_cpu_seconds_per_step"] for r in runs[way])})
    print("speed against DDP, median of %d interleaved repetitions [min, max]:" % args.repeats)
    for t in table:
        print("  %-17s %.4f s/step  %.3fx  [%.3f, %.3f]  trainers' CPU %.3f s/step" % (
            t["way"], t["median_step_seconds"], t["speed_median"], t["speed_min"],
            t["speed_max"], t["trainer_cpu_seconds_per_step"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": 1, "command": " ".join(["bench/e2e/hook_cost.py"] + sys.argv[1:]),
                       "world_size": args.world_size, "steps": args.steps,
                       "repeats": args.repeats, "table": table, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
