#!/usr/bin/env python3
"""Steps factors of the quantising rungs predicted from the gradient noise scale, per layer of an
e2e task (bench/README.md "Steps factors from the gradient noise scale").

`codec: auto` weighs each rung by a steps factor (docs/policies.md "codec: auto"): how many steps
it needs to reach the loss a lossless exchange reaches in one. For an unbiased quantiser the
noise-scale model of large-batch training predicts it from quantities a sidecar could measure:
the number of steps to a loss grows as 1 + V/|G|^2, V being the variance of the averaged gradient
and G its expectation. Quantising each of the W ranks' gradients g_i adds the quantiser's expected
error e_i to it, sum(e_i)/W^2 to the average, so

    steps factor = 1 + (sum_i e_i / W^2) / E|mean_i g_i|^2.

This script trains a task in one process as W ranks would (each rank's batch, the exact average
applied with the task's optimizer), and per layer accumulates sum_i |g_i|^2, |mean g_i|^2 and the
exact expected error of QSGD at 4 and 8 bits (bucket 512, per-bucket L2 norms, s = 2^(b-1) - 1
levels: per value (norm/s)^2 p(1-p), p the fractional part of |x| s / norm) over each window of
steps. It prints per layer the noise ratio sum|g_i|^2 / (W |mean|^2) (1: identical ranks; at least 1, about W
when the ranks' gradients are mostly independent noise), QSGD's relative error sum e_i / sum |g_i|^2 and the predicted factors, and the
element-weighted mean of each window.

    $PYTHON bench/e2e/noise_scale.py [--tasks mlp,lm] [--steps 40] [--window 10] [--world-size 4]
        [--size full] [--seed 0] [--json FILE]

About 3 minutes with the defaults on the 2-core development VM.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BITS = (4, 8)
BUCKET = 512


def qsgd_error(x, bits, bucket=BUCKET):
    """QSGD's expected squared error on `x` (flattened, buckets of `bucket` values, L2 norms)."""
    import torch
    s = (1 << (bits - 1)) - 1
    v = x.flatten().double()
    pad = (-v.numel()) % bucket
    if pad:
        v = torch.cat([v, torch.zeros(pad, dtype=torch.float64)])
    v = v.view(-1, bucket)
    norm = v.norm(dim=1, keepdim=True)
    u = v.abs() / norm.clamp_min(1e-300) * s
    p = u - u.floor()
    return ((norm / s) ** 2 * p * (1 - p)).sum().item()


def run_task(name, size, seed, world, steps, window, out):
    import torch
    import tasks
    torch.manual_seed(seed)
    task = tasks.make_task(name, size=size, seed=seed)
    model = task.model()
    opt = task.optimizer(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    windows = []
    acc = None
    first = 0
    for step in range(steps):
        if acc is None:
            first = step + 1
            acc = {n: {"sum_g2": 0.0, "mean_g2": 0.0, "err": {b: 0.0 for b in BITS}} for n in names}
        grads = []
        for r in range(world):
            model.zero_grad()
            x, y = task.batch(r, step)
            task.loss(model, x, y).backward()
            grads.append([p.grad.detach().clone() for p in params])
        for i, n in enumerate(names):
            gs = [g[i] for g in grads]
            mean = sum(gs) / world
            a = acc[n]
            a["sum_g2"] += sum((g.double() ** 2).sum().item() for g in gs)
            a["mean_g2"] += (mean.double() ** 2).sum().item()
            for b in BITS:
                a["err"][b] += sum(qsgd_error(g, b) for g in gs)
            params[i].grad = mean
        opt.step()
        if (step + 1) % window == 0 or step + 1 == steps:
            rows = []
            for n, p in zip(names, params):
                a = acc[n]
                row = {"layer": n, "elements": p.numel(),
                       "noise_ratio": a["sum_g2"] / (world * a["mean_g2"]) if a["mean_g2"] else None}
                for b in BITS:
                    row["qsgd%d_relative_error" % b] = a["err"][b] / a["sum_g2"] if a["sum_g2"] else None
                    row["qsgd%d_factor" % b] = (1 + a["err"][b] / world ** 2 / a["mean_g2"]
                                                if a["mean_g2"] else None)
                rows.append(row)
            total = sum(r["elements"] for r in rows if r["qsgd4_factor"] is not None)
            mean = {"qsgd%d_factor" % b: sum(r["qsgd%d_factor" % b] * r["elements"] for r in rows
                                              if r["qsgd%d_factor" % b] is not None) / total
                    for b in BITS}
            windows.append({"last_step": step + 1, "layers": rows, "weighted": mean})
            print("%s, steps %d-%d (%d ranks): element-weighted predicted factor qsgd 4 bits %.2f, "
                  "8 bits %.4f" % (name, first, step + 1, world, mean["qsgd4_factor"],
                                   mean["qsgd8_factor"]), flush=True)
            for r in rows:
                print("  %-36s %9d  noise %.2f  qsgd4 error %.3f factor %.2f  qsgd8 factor %.4f" % (
                    r["layer"], r["elements"], r["noise_ratio"] or 0, r["qsgd4_relative_error"] or 0,
                    r["qsgd4_factor"] or 0, r["qsgd8_factor"] or 0))
            acc = None
    out.append({"task": name, "title": task.title, "world_size": world, "seed": seed,
                "windows": windows})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="mlp,lm")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--size", default="full", choices=("full", "smoke"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.window < 1 or args.world_size < 2:
        ap.error("--steps and --window must be >= 1, --world-size >= 2")
    import torch
    torch.set_num_threads(1)
    out = []
    for name in [t for t in args.tasks.split(",") if t]:
        run_task(name, args.size, args.seed, args.world_size, args.steps, args.window, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bucket": BUCKET, "tasks": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
