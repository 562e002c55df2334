#!/usr/bin/env python3
"""Dense allreduce: torch.distributed over gloo against `lightwire bench exchange`, same machine,
same run. Prints seconds per step and algorithm bandwidth of both and the ratio lightwire / gloo.
Method and figures: bench/README.md. Progress goes to stderr; never passes or fails on time.

    $PYTHON bench/exchange_vs_gloo.py [--world-size 4] [--elements 25000000] [--steps 5]
        [--second-codec "dgc --density 0.01" | --second-codec ""]

The lightwire executable comes from $LIGHTWIRE_BIN (default build-release/proxy/lightwire).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time


def log(msg):
    print(f"exchange_vs_gloo: {msg}", file=sys.stderr, flush=True)


def _gloo_worker(rank, world_size, store_path, elements, steps, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size)
    g = torch.Generator().manual_seed(rank + 1)
    pristine = torch.rand(elements, generator=g, dtype=torch.float32) * 2 - 1
    x = pristine.clone()
    times = []
    for step in range(steps + 1):  # the first is the warm-up
        x.copy_(pristine)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        t1 = time.perf_counter()
        # The step ends when the last rank is done: gather every rank's end time (untimed).
        t = torch.tensor([t0, t1], dtype=torch.float64)
        all_t = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(all_t, t)
        if step > 0:
            # perf_counter is CLOCK_MONOTONIC, shared by the processes of one machine.
            times.append(max(v[1].item() for v in all_t) - max(v[0].item() for v in all_t))
        if rank == 0:
            log(f"gloo step {step}/{steps}{' (warm-up)' if step == 0 else ''}: "
                f"{times[-1] if step else t1 - t0:.4f} s")
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def run_gloo(world_size, elements, steps):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lightwire-gloo-") as d:
        store = os.path.join(d, "store")
        out = os.path.join(d, "times.json")
        mp.spawn(_gloo_worker, args=(world_size, store, elements, steps, out), nprocs=world_size,
                 join=True)
        with open(out) as f:
            times = sorted(json.load(f))
    sps = times[len(times) // 2]  # the median (the upper one for an even count)
    return {"seconds_per_step": sps, "algbw_gbps": 4 * elements / sps / 1e9}


def run_lightwire(binary, world_size, elements, steps, codec_args):
    cmd = [binary, "bench", "exchange", "--world-size", str(world_size), *codec_args,
           "--elements", str(elements), "--steps", str(steps), "--json"]
    log("running " + " ".join(shlex.quote(c) for c in cmd))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # its progress goes to our stderr
    if p.returncode != 0:
        raise SystemExit(f"exchange_vs_gloo: {cmd[0]} exited with {p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--elements", type=int, default=25_000_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--second-codec", default="dgc --density 0.01",
                    help='codec and parameters of a second lightwire run ("" = none)')
    ap.add_argument("--json", action="store_true", help="also print every result as JSON")
    a = ap.parse_args()
    if a.world_size < 2 or a.elements < 1 or a.steps < 1:
        ap.error("--world-size >= 2, --elements >= 1 and --steps >= 1")
    binary = os.environ.get("LIGHTWIRE_BIN", "build-release/proxy/lightwire")
    if not os.access(binary, os.X_OK):
        ap.error(f"no lightwire executable at {binary} (build it, or set LIGHTWIRE_BIN)")

    log(f"gloo allreduce: world size {a.world_size}, {a.elements} fp32 elements, "
        f"{a.steps} timed steps")
    gloo = run_gloo(a.world_size, a.elements, a.steps)
    rows = [("gloo allreduce (dense)", gloo, None)]
    runs = [["--codec", "none"]]
    if a.second_codec.strip():
        second = shlex.split(a.second_codec)
        runs.append(["--codec", *second])
    for codec_args in runs:
        r = run_lightwire(binary, a.world_size, a.elements, a.steps, codec_args)
        rows.append(("lightwire " + " ".join(codec_args[1:]), r, r))

    print(f"world size {a.world_size}, {a.elements} fp32 elements ({4 * a.elements / 1e6:.1f} MB), "
          f"median of {a.steps} steps after one warm-up")
    print(f"{'':28} {'s/step':>9} {'algbw GB/s':>11} {'wire MB/rank':>13} {'x gloo':>8}")
    for name, r, lw in rows:
        wire = f"{lw['wire_bytes_per_rank'] / 1e6:13.2f}" if lw else f"{'-':>13}"
        ratio = gloo["seconds_per_step"] / r["seconds_per_step"]
        print(f"{name:28} {r['seconds_per_step']:9.4f} {r['algbw_gbps']:11.3f} {wire} "
              f"{ratio:8.2f}")
    print("x gloo = gloo's seconds per step / this row's (> 1: faster than gloo)")
    if a.json:
        print(json.dumps({"gloo": gloo, "lightwire": [lw for _, _, lw in rows if lw]}))


if __name__ == "__main__":
    main()
