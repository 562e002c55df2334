#!/usr/bin/env python3
"""Step speed against DDP, as medians of interleaved repetitions (bench/README.md "Step speed").

The same real DDP training as bench/e2e/e2e.py (W trainer processes on the CPU, lightwire rows
through their sidecars, in a network namespace whose loopback is limited with tc tbf), but for
speed only: every configuration trains a short fixed number of steps, the configurations run in
turn, and the whole round is repeated, so that every configuration's repetitions are spread over
the same stretch of time and a slow spell of the machine falls on all of them. Each repetition
gives, per configuration, its median step time and its speed against DDP's median step of the
same repetition (DDP's step / the row's step: above 1 is faster); the report is the median of
those ratios over the repetitions with their minimum and maximum, and the CPU seconds a step of
every trainer together and of every sidecar together (medians over the repetitions): on a machine
whose cores are the bottleneck, the step follows their sum.

    $PYTHON bench/e2e/speed.py [--tasks mlp] [--rates 10gbit,unlimited]
        [--configs ddp,lightwire_none,lightwire_fp16] [--repeats 3] [--steps 40]
        [--bucket-cap-mb MB] [--json FILE]

`unlimited` is the namespace's loopback without a qdisc. Needs root (ip netns, tc). Each run
takes its steps plus about 10 s of start; with the defaults one (task, rate) takes about 3 min on
the 2-core development VM.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import e2e  # noqa: E402  (the namespace, the sidecars and one run of a configuration)

DEFAULT_CONFIGS = "ddp,lightwire_none,lightwire_fp16"


def ratios(rows_by_rep, config):
    """DDP's median step over `config`'s, per repetition where both finished."""
    out = []
    for rows in rows_by_rep:
        base, row = rows.get("ddp"), rows.get(config)
        if base and row and base["status"] == "ok" and row["status"] == "ok":
            out.append(base["median_step_seconds"] / row["median_step_seconds"])
    return out


def summary(rows_by_rep, configs):
    """Per configuration: its median step over repetitions and the speed ratios against DDP."""
    table = []
    for c in configs:
        steps = [rows[c]["median_step_seconds"] for rows in rows_by_rep
                 if c in rows and rows[c]["status"] == "ok"]
        r = ratios(rows_by_rep, c)
        errors = [rows[c]["error"] for rows in rows_by_rep if c in rows and rows[c]["status"] != "ok"]
        ok = [rows[c] for rows in rows_by_rep if c in rows and rows[c]["status"] == "ok"]
        trainer_cpu = [r["trainer_cpu_seconds_per_step"] for r in ok
                       if r.get("trainer_cpu_seconds_per_step") is not None]
        sidecar_cpu = [r["sidecar_cpu_seconds_per_step"] for r in ok
                       if r.get("sidecar_cpu_seconds_per_step") is not None]
        table.append({"config": c, "repetitions": len(steps),
                      "median_step_seconds": statistics.median(steps) if steps else None,
                      "step_seconds": steps, "speed_vs_ddp": r,
                      "speed_median": statistics.median(r) if r else None,
                      "speed_min": min(r) if r else None, "speed_max": max(r) if r else None,
                      "errors": errors,
                      # CPU seconds a step, every trainer (every sidecar) together: medians.
                      "trainer_cpu_seconds_per_step":
                          statistics.median(trainer_cpu) if trainer_cpu else None,
                      "sidecar_cpu_seconds_per_step":
                          statistics.median(sidecar_cpu) if sidecar_cpu else None,
                      # Per repetition: the final loss, and what carried the steps (lightwire
                      # rows: the trainers' process group in codec auto's direct windows, the
                      # sidecars dense or compressed) with codec auto's decisions.
                      "final_loss": [r.get("final_loss") for r in ok],
                      "carried": [carried_counts(r) for r in ok],
                      # Per repetition: the median step of each way that carried steps.
                      "step_seconds_by": [seconds_by(r) for r in ok],
                      "decisions": [r.get("decisions") for r in ok]})
    return table


def carried_counts(row):
    """{"direct", "dense", "compressed", "fallback"}: the steps of a row carried each way."""
    out = {"direct": 0, "dense": 0, "compressed": 0, "fallback": 0}
    for c in row.get("carried") or []:
        out[way(c)] += 1
    return out


def way(step):
    """What carried one step of a row's "carried" list."""
    if step["by"] != "sidecar":
        return step["by"]
    return "dense" if step["dense_share"] > 0.999 else "compressed"


def seconds_by(row):
    """{way: median step seconds} over the steps each way carried (carried_counts' ways)."""
    by = {}
    for c in row.get("carried") or []:
        by.setdefault(way(c), []).append(c["seconds"])
    return {k: statistics.median(v) for k, v in by.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="mlp", help="comma-separated: mlp, lm")
    p.add_argument("--rates", default="10gbit,unlimited",
                   help="comma-separated tc rates (e.g. 10gbit), or unlimited")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated configuration names of e2e.py --list (ddp first)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the configurations (>= 1)")
    p.add_argument("--steps", type=int, default=40, help="training steps of every run (>= 10)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--size", choices=("full", "smoke"), default="full",
                   help="the tasks' size (smoke: tiny models, for the test suite)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket_cap_mb in every run (default DDP's own, 25): smaller "
                        "buckets, more of them in flight at once")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    by_name = {c[0]: c for c in e2e.ALL_CONFIGS}
    names = args.configs.split(",")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        e2e.die("--configs: unknown %s (e2e.py --list)" % ", ".join(unknown))
    if names[0] != "ddp":
        e2e.die("--configs: ddp first (every ratio is against DDP's run of the same repetition)")
    if args.repeats < 1 or args.steps < 10:
        e2e.die("--repeats >= 1 and --steps >= 10")
    rates = args.rates.split(",")
    for r in rates:
        e2e.rate_bits(r)
    if os.geteuid() != 0:
        e2e.die("needs root (ip netns, tc)")
    binary, python = e2e.executables(True)
    profile = {"steps": {t: args.steps for t in ("mlp", "lm")},
               "eval_every": {t: args.steps for t in ("mlp", "lm")},
               "world_size": args.world_size, "size": args.size, "timeout": 900,
               "bucket_cap_mb": args.bucket_cap_mb}
    results = {"version": 1, "command": " ".join(["bench/e2e/speed.py"] + sys.argv[1:]),
               "commit": e2e.git_commit(), "machine": e2e.machine_info(binary, python),
               "steps": args.steps, "repeats": args.repeats, "size": args.size,
               "world_size": args.world_size, "bucket_cap_mb": args.bucket_cap_mb, "groups": []}
    started = time.monotonic()
    ns = e2e.Namespace()
    work = tempfile.mkdtemp(prefix="lightwire-speed-")
    try:
        for task in args.tasks.split(","):
            for rate in rates:
                ns.limit(rate)
                reps = []
                for rep in range(args.repeats):
                    rows = {}
                    for n in names:
                        e2e.log("%s at %s, repetition %d/%d: %s" % (task, rate, rep + 1,
                                                                     args.repeats, n))
                        rows[n] = e2e.run_config(ns, binary, python, profile, task, rate,
                                                 by_name[n], work)
                    reps.append(rows)
                table = summary(reps, names)
                results["groups"].append({"task": task, "rate": rate, "table": table})
                e2e.log("%s at %s: speed against DDP, median of %d interleaved repetitions "
                        "[min, max]:" % (task, rate, args.repeats))
                for t in table:
                    if t["speed_median"] is None:
                        e2e.log("  %-24s no finished repetition: %s" % (t["config"], t["errors"][:1]))
                        continue
                    cpu = "CPU s/step: trainers %.3f" % t["trainer_cpu_seconds_per_step"] if \
                        t["trainer_cpu_seconds_per_step"] is not None else ""
                    if t["sidecar_cpu_seconds_per_step"] is not None:
                        cpu += ", sidecars %.3f" % t["sidecar_cpu_seconds_per_step"]
                    e2e.log("  %-24s %.3f s/step  %.3fx  [%.3f, %.3f]  %s" % (
                        t["config"], t["median_step_seconds"], t["speed_median"], t["speed_min"],
                        t["speed_max"], cpu))
    finally:
        ns.close()
    results["elapsed_seconds"] = time.monotonic() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        e2e.log("results: %s" % args.json)
    bad = [t for g in results["groups"] for t in g["table"] if t["repetitions"] < args.repeats]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
