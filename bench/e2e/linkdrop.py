#!/usr/bin/env python3
"""codec auto when the link slows down mid-run (bench/README.md "codec auto"): the 4-rank
training of bench/e2e (its MLP or LM) with `lightwire auto`, the namespace's loopback at a fast
rate (default 10gbit) until the trainers pass a step, then changed live (`tc qdisc change`) to a
slow one (default 1gbit). Reports, per step, what carried it (the process group in a direct
window, or the sidecars with which share of dense elements), the step the link dropped after, the
first step after it that the sidecars compressed harder, and the sidecars' decision log.

Needs root (a network namespace; as bench/e2e/e2e.py). Usage:
    python3 bench/e2e/linkdrop.py [--task mlp] [--steps 120] [--drop-after 40]
        [--from-rate 10gbit] [--to-rate 1gbit] [--json FILE]
"""

import argparse
import json
import os
import re
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import e2e  # noqa: E402


# The default ladder's labels (docs/policies.md "codec: auto"), least lossy first.
LADDER = ["direct", "none", "fp16", "bf16", "qsgd 8 bits", "qsgd 4 bits", "dgc 1 % momentum 0.9",
          "dgc 1 %", "topk 1 %"]


def rung_rank(label):
    return LADDER.index(label) if label in LADDER else -1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="mlp", choices=("mlp", "lm"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--drop-after", type=int, default=40,
                   help="the link slows down once the trainers report this step")
    p.add_argument("--from-rate", default="10gbit")
    p.add_argument("--to-rate", default="1gbit")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--rereport", metavar="RESULT",
                   help="recompute the figures of an earlier result (its row) and rewrite it")
    args = p.parse_args()
    if args.rereport:
        with open(args.rereport) as f:
            old = json.load(f)
        drop = old.get("drop_after_trainer_step", old.get("drop_after_step"))
        report(summarize(old["row"], drop, old["task"], old["from_rate"], old["to_rate"]),
               args.rereport)
        return 0
    if args.drop_after >= args.steps:
        e2e.die("--drop-after must be below --steps")
    binary, python = e2e.executables(True)
    profile = dict(e2e.PROFILES["full"])
    profile.update(tasks=[args.task], world_size=args.world_size,
                   steps={args.task: args.steps},
                   # Progress lines every 5 steps: the drop follows one within 5 steps.
                   eval_every={args.task: 5})
    config = next(c for c in e2e.ALL_CONFIGS if c[0] == "lightwire_auto")
    ns = e2e.Namespace()
    dropped = {}
    lock = threading.Lock()

    def on_progress(step):
        with lock:
            if "step" in dropped or step < args.drop_after:
                return
            ns.limit(args.to_rate)
            dropped["step"] = step
            e2e.log("link dropped to %s after step %d" % (args.to_rate, step))

    try:
        ns.limit(args.from_rate)
        work = tempfile.mkdtemp(prefix="lightwire-linkdrop-")
        row = e2e.run_config(ns, binary, python, profile, args.task, args.from_rate, config, work,
                             on_progress=on_progress)
    finally:
        ns.close()
    if row["status"] != "ok":
        e2e.die("the run failed: %s" % row["error"])
    result = summarize(row, dropped.get("step"), args.task, args.from_rate, args.to_rate)
    report(result, args.json)
    return 0


def summarize(row, drop, task, from_rate, to_rate):
    """The run's figures: the drop, the first move to heavier compression after it."""
    # The trainers number their steps from 1, the sidecars from 0: the drop came after sidecar
    # step drop - 1. The first decision after it that moved a layer to a more lossy rung of the
    # default ladder, and the step that rung took effect.
    moved = None
    for d in row.get("decisions", []):
        m = re.match(r"(.+?) -> (.+?) from step (\d+)", d.get("detail", ""))
        if d.get("kind") != "auto" or not m or drop is None or d["step"] < drop - 1:
            continue
        if rung_rank(m.group(2)) > rung_rank(m.group(1)):
            moved = {"decided": d["step"], "from": int(m.group(3)), "tensor": d["tensor"],
                     "detail": d["detail"]}
            break
    return {"task": task, "from_rate": from_rate, "to_rate": to_rate,
            "drop_after_trainer_step": drop,
            "drop_after_sidecar_step": None if drop is None else drop - 1,
            "first_heavier": moved,
            "steps_to_react": None if moved is None or drop is None else moved["from"] - (drop - 1),
            "row": row}


def report(result, json_path):
    row, drop, moved = result["row"], result["drop_after_trainer_step"], result["first_heavier"]
    carried = row.get("carried") or []
    e2e.log("link %s -> %s after sidecar step %s; the first move to heavier compression takes "
            "effect at step %s (%s steps later): %s" % (
                result["from_rate"], result["to_rate"], None if drop is None else drop - 1,
                moved and moved["from"], result["steps_to_react"], moved and moved["detail"]))
    for c in carried:
        if c["step"] % 5 == 0 or (drop is not None and drop - 2 <= c["step"] <= drop + 25):
            e2e.log("  step %3d: %-7s dense share %.3f  %.3f s" % (
                c["step"], c["by"], c["dense_share"], c["seconds"]))
    for d in row.get("decisions", []):
        e2e.log("  decision step %s %s %s: %s" % (d["step"], d["tensor"], d["kind"], d["detail"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
