#!/usr/bin/env python3
"""What dgc's momentum factor masking costs, and what undoing its bias would give back: W ranks
of an e2e task trained in one process, each compressed layer with a per-rank dgc of its own
(bench/README.md "dgc's momentum after masking").

dgc's momentum correction (docs/codecs.md "Momentum with dgc") keeps u <- m*u + g and v <- v + u
per element and sends the largest |v|; momentum factor masking clears u and v where an element was
sent. Cleared, u starts again from zero, as Adam's first moment does at its first step, but no
bias correction follows: an element sent at every step sends u = g, which the optimizers' rule
(lightwire.torch.SGD applies lr * u, lightwire.torch.AdamW lr * (1 - m) * u) turns into a tenth of
the step momentum gives a steadily moving element (at m = 0.9). The variants, per compressed layer
(the task's other layers step as its optimizer steps them, on the averaged gradient):

  dense     every layer on the averaged gradient: DDP (the baseline)
  mask      dgc as the sidecar runs it: u and v cleared where sent
  biascorr  as mask, and each step adds u / (1 - m^a) to v instead of u, a being the steps since
            the element was last sent (Adam's bias correction of a moment restarted from zero):
            an element sent at every step sends g / (1 - m), one held back long enough sends what
            mask sends
  nomask    v cleared where sent, u kept (momentum SGD's every term, delayed; no masking)

Selection is the exact top-k of |v| per layer and rank (the sidecar's sampled threshold keeps
0.8k-1.3k); the density follows the sidecar's warm-up (schedule.warmup_steps, 20 by default).
Layers the sidecar sends dense by default (1-D, at most 8192 elements) step densely. On the LM
(AdamW) every rank preconditions its own gradient as lightwire.torch.AdamW does (g / (sqrt(v2) +
eps), v2 the rank's own second moment) and the first step is plain AdamW, as the helper's is;
on the MLP (SGD with momentum) the compressed layers step as lightwire.torch.SGD steps them.

    $PYTHON bench/e2e/dgc_masking.py [--tasks lm] [--variants dense,mask,biascorr] [--seeds 0]
        [--steps 300] [--eval-every 20] [--density 0.01] [--warmup 20] [--world-size 4]
        [--dense-max-elements 8192] [--size full] [--json FILE]

On one core of the 2-core development VM: about 5 minutes per LM run of 300 steps; on the MLP
about 2 minutes dense and 7 per compressed run of 400 steps (its exact top-k over 4 M elements).
An invocation is one process: run two at once.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = ("dense", "mask", "biascorr", "nomask")
WARMUP_STAGES = (0.25, 0.0625, 0.015625, 0.00390625, 0.0009765625)
DENSE_MAX_ELEMENTS = 8192
DEFAULT_STEPS = {"mlp": 400, "lm": 300}


def step_density(step, density, warmup):
    """The density of step `step` (0-based) under the sidecar's warm-up (five equal stages)."""
    if warmup and step < warmup:
        return max(density, WARMUP_STAGES[min(4, step * 5 // warmup)])
    return density


class RankDgc(object):
    """One rank's dgc state of one layer (u, v and, for biascorr, c = (1 - m^a) / (1 - m))."""

    def __init__(self, like, variant, m):
        import torch
        self.variant, self.m = variant, m
        self.u = torch.zeros(like.numel())
        self.v = torch.zeros(like.numel())
        self.c = torch.zeros(like.numel()) if variant == "biascorr" else None

    def step(self, g, k):
        """Accumulates g (flat) and returns (indices, values) of the k largest |v|, then masks."""
        self.u.mul_(self.m).add_(g)
        if self.c is not None:
            self.c.mul_(self.m).add_(1.0)
            self.v.add_(self.u / (self.c * (1.0 - self.m)))
        else:
            self.v.add_(self.u)
        idx = self.v.abs().topk(k).indices
        values = self.v[idx].clone()
        self.v[idx] = 0
        if self.variant in ("mask", "biascorr"):
            self.u[idx] = 0
        if self.c is not None:
            self.c[idx] = 0
        return idx, values


def train(task_name, variant, seed, a):
    import torch
    import tasks
    torch.manual_seed(seed)
    task = tasks.make_task(task_name, size=a.size, seed=seed)
    model = task.model()
    params = list(model.parameters())
    opt = task.optimizer(params)
    group = opt.param_groups[0]
    adam = isinstance(opt, torch.optim.AdamW)
    lr, wd = group["lr"], group.get("weight_decay", 0.0)
    m = group["betas"][0] if adam else group["momentum"]
    compressed = [variant != "dense" and p.dim() > 1 and p.numel() > a.dense_max_elements
                  for p in params]
    ranks = [[RankDgc(p, variant, m) if c else None for p, c in zip(params, compressed)]
             for _ in range(a.world_size)]
    # Adam: each rank's own second moment of a compressed layer (lightwire.torch.AdamW).
    v2 = [[None] * len(params) for _ in range(a.world_size)]
    steps = a.steps or DEFAULT_STEPS[task_name]
    evals = []
    t0 = time.time()
    for step in range(steps):
        grads = []
        for r in range(a.world_size):
            model.zero_grad()
            x, y = task.batch(r, step)
            task.loss(model, x, y).backward()
            grads.append([p.grad.detach().clone() for p in params])
        density = step_density(step, a.density, a.warmup)
        sparse = {}
        with torch.no_grad():
            for i, p in enumerate(params):
                # lightwire.torch.AdamW steps every layer as AdamW on the first step (no reply
                # has named its codec yet).
                if not compressed[i] or (adam and step == 0):
                    p.grad = sum(g[i] for g in grads) / a.world_size
                    continue
                n = p.numel()
                k = max(1, int(density * n + 0.5))
                total = torch.zeros(n)
                for r in range(a.world_size):
                    g = grads[r][i].flatten()
                    if adam:
                        b2, eps = group["betas"][1], group["eps"]
                        if v2[r][i] is None:  # carries on from the moments of the dense step
                            v2[r][i] = opt.state[p]["exp_avg_sq"].flatten().clone()
                        v2[r][i].mul_(b2).addcmul_(g, g, value=1 - b2)
                        vhat = v2[r][i] / (1 - b2 ** (step + 1))
                        g = g / (vhat.sqrt() + eps)
                    idx, values = ranks[r][i].step(g, k)
                    total.index_add_(0, idx, values)
                sparse[i] = (total / a.world_size).view_as(p)
                p.grad = None
            opt.step()  # the dense layers (a layer without a gradient is left alone)
            for i, avg in sparse.items():
                p = params[i]
                if adam:  # lightwire.torch.AdamW: p <- p (1 - lr wd) - lr (1 - beta1) u
                    p.mul_(1 - lr * wd).add_(avg, alpha=-lr * (1 - m))
                else:     # lightwire.torch.SGD: p <- p - lr (u + b_wd); the MLP has no decay
                    p.add_(avg + wd * p, alpha=-lr)
        if (step + 1) % a.eval_every == 0 or step + 1 == steps:
            loss = task.evaluate(model)["loss"]
            evals.append([step + 1, loss])
            print("%s %-8s seed %d step %4d: eval loss %.4f  (%.0f s)" % (
                task_name, variant, seed, step + 1, loss, time.time() - t0), flush=True)
    return {"task": task_name, "variant": variant, "seed": seed, "density": a.density,
            "warmup": a.warmup, "world_size": a.world_size, "steps": steps, "evals": evals,
            "seconds": time.time() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="lm")
    ap.add_argument("--variants", default="dense,mask,biascorr")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=0, help="default: mlp 400, lm 300")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--dense-max-elements", type=int, default=DENSE_MAX_ELEMENTS,
                    help="layers of at most this many elements step densely (the sidecar's "
                         "compression.layers.dense_max_elements)")
    ap.add_argument("--size", default="full", choices=("full", "smoke"))
    ap.add_argument("--json", default=None, help="write every run's evaluations here")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error("--variants: a comma-separated list of %s (got %r)" % (", ".join(VARIANTS),
                                                                        a.variants))
    if (not 0 < a.density <= 1 or a.world_size < 1 or a.eval_every < 1 or a.steps < 0
            or a.dense_max_elements < 0):
        ap.error("--density in (0, 1], --world-size and --eval-every >= 1, --steps and "
                 "--dense-max-elements >= 0")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        ap.error("--seeds: comma-separated integers (got %r)" % a.seeds)
    import torch
    torch.set_num_threads(1)
    runs = []
    for task_name in [t for t in a.tasks.split(",") if t]:
        for seed in seeds:
            for variant in variants:
                runs.append(train(task_name, variant, seed, a))
                if a.json:  # after every run, so that a long invocation loses nothing
                    with open(a.json, "w") as f:
                        json.dump({"runs": runs}, f, indent=1)
    for task_name in sorted({r["task"] for r in runs}):
        for seed in seeds:
            rows = {r["variant"]: r for r in runs if r["task"] == task_name and r["seed"] == seed}
            base = rows.get("dense")
            for variant, r in rows.items():
                last = r["evals"][-1][1]
                delta = ("  %+.1f %% against dense" % (100 * (last / base["evals"][-1][1] - 1))
                         if base and variant != "dense" else "")
                print("%s seed %d %-8s final eval loss %.4f%s" % (task_name, seed, variant, last,
                                                                 delta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
