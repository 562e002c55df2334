#!/usr/bin/env python3
"""How far the sparse allreduce's per-region selection is from a global top-k, on the gradients
of an e2e task, under two rules for a region's share (bench/README.md "Sparse allreduce against
the allgather").

The sparse allreduce (docs/exchange.md "Sparse allreduce") cuts a layer into regions (the ring's
chunks: ceil(n / W) elements, at least 64 Ki, at most compression.chunk_elements), and each
region's owner keeps the largest of its summed values — how many is its share:
  - `sent` (what the sidecars do): the region's part of k by the entries the ranks sent for it,
    which with topk (every rank sends exactly k) is their mean count for the region;
  - `length`: k · length / n, the same fraction of every region (the first rule built).
Where a layer's large values crowd into some regions, `length` keeps smaller ones elsewhere
instead.

W ranks train the task in one process (each its own batch), each with topk's error feedback at
`--density`: a rank selects the top-k of gradient + residual, the selections are summed, and the
step applies the `sent` rule's selection, settling each rank's residual with it. At every step
and for every layer of more than one region it also takes, from the same sums, the global top-k
of the whole layer and the `length` rule's selection, and prints per rule the element-weighted
share of the global selection kept (overlap) and of its summed magnitude (mass). It also
counts, per step, the entries every rank moves (in and out) under three assignments of the
regions to owners, and prints how much busier the busiest rank is than the mean one:
  - `hash`: rank (XXH3-64 of the layer's name + region) mod W (here the parameter's name), what
    the sidecars do outside a bucket and in a bucket's first pass;
  - `length`: the model's regions balanced by their lengths (the layout alone);
  - `previous`: the regions balanced by the entries of their previous step's selections (the
    first step: by length), what the sidecars do in a bucket (docs/exchange.md "Which rank owns a
    region"; here the whole model as one bucket).

    $PYTHON bench/e2e/region_shares.py [--tasks mlp,lm] [--world-size 4,16] [--steps 30]
        [--density 0.01] [--chunk-elements 1048576] [--json FILE]

About 6 minutes with the defaults on the 2-core development VM.
"""

import argparse
import json
import math
import os
import sys

import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIN_REGION = 1 << 16  # kRingSplitMinElements


def regions(n, world, chunk_elements):
    """The regions of a layer of n elements among `world` sidecars: (begin, end) pairs."""
    size = min(chunk_elements, max(MIN_REGION, math.ceil(n / world)))
    return [(b, min(n, b + size)) for b in range(0, n, size)]


def top(values, k):
    """Indices of the k largest |values|."""
    import torch
    if k <= 0:
        return torch.zeros(0, dtype=torch.long)
    k = min(k, values.numel())
    return torch.topk(values.abs(), k, sorted=False).indices


RULES = ("sent", "length")
OWNER_RULES = ("hash", "length", "previous")


def balance(weights, world):
    """Owners by longest-processing-time: the units by weight, largest first (ties: in order),
    each to the rank with the least weight so far (ties: the lowest rank)."""
    load = [0] * world
    owner = [0] * len(weights)
    for u in sorted(range(len(weights)), key=lambda u: (-weights[u], u)):
        r = min(range(world), key=lambda q: (load[q], q))
        owner[u] = r
        load[r] += weights[u] + 1
    return owner


def run(task_name, world, steps, density, chunk_elements, seed, out):
    import torch
    import tasks
    torch.manual_seed(seed)
    task = tasks.make_task(task_name, size="full", seed=seed)
    model = task.model()
    opt = task.optimizer(model.parameters())
    named = [(n, p) for n, p in model.named_parameters()]
    residual = [[torch.zeros_like(p).flatten() for _, p in named] for _ in range(world)]
    totals = {rule: {"overlap": 0.0, "mass": 0.0} for rule in RULES}
    elements = 0
    per_layer = {}
    # per owner rule, per step: the largest rank's entries moved over the mean rank's
    imbalance = {rule: [] for rule in OWNER_RULES}
    prev_shares = None  # the previous step's selected entries per (layer, region)
    units = [(i, c, e - b) for i, (_, p) in enumerate(named)
             for c, (b, e) in enumerate(regions(p.numel(), world, chunk_elements))]
    by_length = balance([u[2] for u in units], world)
    for step in range(steps):
        moved = {rule: [0] * world for rule in OWNER_RULES}
        by_prev = (balance([prev_shares[(i, c)] for i, c, _ in units], world)
                   if prev_shares is not None else by_length)
        owners = {"hash": None,
                  "length": {(i, c): o for (i, c, _), o in zip(units, by_length)},
                  "previous": {(i, c): o for (i, c, _), o in zip(units, by_prev)}}
        shares_now = {}
        grads = []
        for r in range(world):
            model.zero_grad()
            x, y = task.batch(r, step)
            task.loss(model, x, y).backward()
            grads.append([p.grad.detach().flatten().clone() for _, p in named])
        for i, (name, p) in enumerate(named):
            n = p.numel()
            k = max(1, min(n, math.floor(density * n + 0.5)))
            acc = [grads[r][i] + residual[r][i] for r in range(world)]
            sent = torch.zeros(world, n, dtype=torch.bool)
            for r in range(world):
                sent[r, top(acc[r], k)] = True
            sums = torch.zeros(n)
            for r in range(world):
                sums[sent[r]] += acc[r][sent[r]]
            regs = regions(n, world, chunk_elements)

            # Entries each rank sent for each region; the layer's cap K = min(k, D // W).
            counts = [[int(sent[r, b:e].sum().item()) for b, e in regs] for r in range(world)]
            layer_d = sum(map(sum, counts))
            cap = min(k, layer_d // world)

            def sent_share(c):
                d_c = sum(counts[r][c] for r in range(world))
                return d_c * cap // layer_d if layer_d else 0

            # The entries each rank moves (in and out) for this layer: region c's owner, rank
            # (key + c) mod W, receives the others' contributions and sends its share to each.
            key = xxhash.xxh3_64_intdigest(name.encode())
            for c in range(len(regs)):
                share = sent_share(c)
                shares_now[(i, c)] = share
                for rule in OWNER_RULES:
                    owner = ((key % world + c % world) % world if owners[rule] is None
                             else owners[rule][(i, c)])
                    for r in range(world):
                        if r == owner:
                            moved[rule][r] += sum(counts[q][c] for q in range(world) if q != r)
                            moved[rule][r] += share * (world - 1)
                        else:
                            moved[rule][r] += counts[r][c] + share

            def keep(rule):
                kept = torch.zeros(n, dtype=torch.bool)
                for c, (b, e) in enumerate(regs):
                    if rule == "length":
                        share = k * e // n - k * b // n
                    else:
                        share = sent_share(c)
                    nz = int((sums[b:e] != 0).sum().item())
                    kept[b + top(sums[b:e], min(share, nz))] = True
                return kept
            kept = {rule: keep(rule) for rule in RULES}
            if len(regs) > 1:
                glob = torch.zeros(n, dtype=torch.bool)
                glob[top(sums, min(k, int((sums != 0).sum().item())))] = True
                g_mass = max(1e-30, sums[glob].abs().sum().item())
                row = per_layer.setdefault(name, {"elements": n, "regions": len(regs),
                                                  **{rule: {"overlap": [], "mass": []}
                                                     for rule in RULES}})
                elements += n
                for rule in RULES:
                    both = (kept[rule] & glob).sum().item() / max(1, glob.sum().item())
                    mass = sums[kept[rule]].abs().sum().item() / g_mass
                    row[rule]["overlap"].append(both)
                    row[rule]["mass"].append(mass)
                    totals[rule]["overlap"] += both * n
                    totals[rule]["mass"] += mass * n
            for r in range(world):
                gone = sent[r] & kept["sent"]
                e = acc[r].clone()
                e[gone] = 0.0
                residual[r][i] = e
            mean = torch.where(kept["sent"], sums / world, torch.zeros(n))
            p.grad = mean.view_as(p)
        opt.step()
        prev_shares = shares_now
        for rule in OWNER_RULES:
            imbalance[rule].append(max(moved[rule]) * world / max(1, sum(moved[rule])))
    layers = []
    for n, v in per_layer.items():
        row = {"layer": n, "elements": v["elements"], "regions": v["regions"]}
        for rule in RULES:
            row[rule] = {"overlap": sum(v[rule]["overlap"]) / len(v[rule]["overlap"]),
                         "overlap_min": min(v[rule]["overlap"]),
                         "mass": sum(v[rule]["mass"]) / len(v[rule]["mass"]),
                         "mass_min": min(v[rule]["mass"])}
        layers.append(row)
    result = {"task": task_name, "world_size": world, "steps": steps, "density": density,
              "layers": layers,
              "owner_load": {rule: {"max_over_mean": sum(v) / len(v), "max_over_mean_worst": max(v)}
                             for rule, v in imbalance.items()}}
    for rule in RULES:
        result[rule] = {key: totals[rule][key] / elements if elements else None
                        for key in ("overlap", "mass")}
    out.append(result)
    print("%s, W = %d, %d steps, density %g (element-weighted over the layers of more than one "
          "region): shares by the ranks' counts keep %.1f %% of the global top-k and %.2f %% of its "
          "magnitude; shares by length %.1f %% and %.2f %%"
          % (task_name, world, steps, density, 100 * (result["sent"]["overlap"] or 0),
             100 * (result["sent"]["mass"] or 0), 100 * (result["length"]["overlap"] or 0),
             100 * (result["length"]["mass"] or 0)), flush=True)
    for rule in OWNER_RULES:
        print("  entries a rank moves (in and out) per step, owners by %s, the busiest rank against "
              "the mean: %.2f on average over the steps, at most %.2f"
              % (rule, result["owner_load"][rule]["max_over_mean"],
                 result["owner_load"][rule]["max_over_mean_worst"]), flush=True)
    for r in layers:
        print("  %-34s %8d elements, %2d regions: by counts overlap %.3f mass %.4f; by length "
              "overlap %.3f mass %.4f" % (r["layer"], r["elements"], r["regions"],
                                          r["sent"]["overlap"], r["sent"]["mass"],
                                          r["length"]["overlap"], r["length"]["mass"]), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="mlp,lm")
    ap.add_argument("--world-size", default="4,16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--chunk-elements", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.world_size.split(",") if w]
    if args.steps < 1 or not worlds or min(worlds) < 2 or not 0 < args.density <= 1:
        ap.error("--steps >= 1, --world-size >= 2, 0 < --density <= 1")
    import torch
    torch.set_num_threads(1)
    out = []
    for name in [t for t in args.tasks.split(",") if t]:
        for w in worlds:
            run(name, w, args.steps, args.density, args.chunk_elements, args.seed, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
