#!/usr/bin/env python3
"""Agent-RL benchmark: the example trainer clients/python/examples/agent_rl.py (GRPO on a byte-level
policy, tasks from the store stand-in, the whole model's gradient through `emit_gradient`) with 4
trainers and 4 sidecars on a 1 Gbit/s link in a network namespace, every row in the same run.
Needs root (`ip netns`, `tc ... tbf` on the namespace's loopback, as bench/e2e/e2e.py). Figures
only: it never passes or fails on them. Method and results: docs/agent-rl.md "Measured".

    /usr/bin/python3 bench/agent_rl.py                 # every row (about 25 min on 2 cores)
    /usr/bin/python3 bench/agent_rl.py --rows none,dgc --seeds 0
    /usr/bin/python3 bench/agent_rl.py --smoke         # tiny model, 2 trainers: that it runs

First the step is measured (dense, `--calibrate-steps` steps) on the unlimited and on the
limited link, so the share of a dense step the exchange takes is known. Then the rows, on the
limited link: dense (`none`) and dgc 1 % (error feedback, per layer, the sidecar's defaults) for
every seed; qsgd 4 bits, and the parameter-server rows (sync and bounded staleness, S = 2, dgc 1 %,
one random trainer per step twice as slow) for the first seed. A dense row trains `--steps`
optimizer steps, the others 2 or 2.5 times as many (`--list`): about the dense rows' wall-clock
time, so that a row that steps faster is judged after about the same training time; rank 0
evaluates the fixed held-out prompts greedily every `--eval-every` steps
(left out of the time axis); a row's final reward is the mean of its last 3 evaluations. The
target reward is the dense rows' mean final minus max(0.01, 2 sigma) of their finals; a row's time
to target is the first evaluation at which the mean of its last 3 evaluations reaches it.

Options: --rate 1gbit  --steps N  --seeds 0,1,2  --rows NAME,...  --out-dir DIR (default docs)
--results FILE (default DIR/benchmarks/agent-rl.json)  --example-args "ARGS" (more arguments for
every run of the example: the profile's fields, e.g. "--prompts 4 --lr 3e-4")  --list.
$LIGHTWIRE_BIN: the executable (default build-release/proxy/lightwire); $PYTHON: the trainers'
interpreter (default /usr/bin/python3).
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "e2e"))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

from e2e import Namespace, Sidecars, git_commit, log  # noqa: E402

EXAMPLE = os.path.join(ROOT, "clients", "python", "examples", "agent_rl.py")
POLICIES_OFF = ["--anomaly", "false", "--rollback", "false", "--full-sync-every", "0"]
DGC = ["--codec", "dgc", "--density", "0.01"]
PS = ["--topology", "ps"]
BOUNDED = PS + ["--synchrony", "bounded-staleness", "--staleness", "2"]

# name: (label, sidecar arguments, trainer arguments, every seed?, steps as a multiple of --steps)
# The compressed rows train more steps: about as long as a dense row in wall-clock time, so that
# each row's final reward is taken after about the same training time (a row that steps faster
# is not cut off before it has used the time the dense row had).
ROWS = [
    ("none", "dense (none)", ["--codec", "none"], [], True, 1.0),
    ("dgc", "dgc 1 %", DGC, [], True, 2.5),
    ("qsgd4", "qsgd 4 bits", ["--codec", "qsgd", "--bits", "4"], [], False, 2.0),
    ("ps_sync", "ps sync, dgc 1 %, straggler", DGC + PS, ["--straggler"], False, 2.0),
    ("ps_bounded", "ps bounded staleness S=2, dgc 1 %, straggler", DGC + BOUNDED,
     ["--straggler"], False, 2.0),
]
EVAL_WINDOW = 3


def run_example(ns, binary, python, world, sidecar_args, trainer_args, seed, steps, work, tag,
                profile_args):
    """One run of the example in the namespace against W fresh sidecars; its results JSON."""
    d = os.path.join(work, tag)
    os.makedirs(d, exist_ok=True)
    sidecars = Sidecars(ns, binary, world, list(sidecar_args) + POLICIES_OFF, d)
    out = os.path.join(d, "result.json")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "clients", "python"),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("LIGHTWIRE_BIN", None)
    cmd = [python, EXAMPLE, "--sockets", ",".join(sidecars.sockets), "--seed", str(seed),
           "--steps", str(steps), "--out", out] + list(profile_args) + list(trainer_args)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(ns.cmd(cmd), env=env, capture_output=True, text=True)
    finally:
        sidecars.close()
    if proc.returncode != 0:
        raise RuntimeError("%s failed:\n%s\n%s\nsidecar 0: %s" % (
            tag, proc.stdout[-3000:], proc.stderr[-3000:], sidecars.tail(0)))
    with open(out) as f:
        result = json.load(f)
    result["wall_s"] = time.monotonic() - t0
    result["stdout_tail"] = proc.stdout.strip().splitlines()[-2:]
    return result


def step_seconds(result):
    """The median optimizer step of a run (every rank's steps after the first)."""
    times = []
    for rank in result["ranks"]:
        rows = rank["rows"]
        times += [b["t"] - a["t"] for a, b in zip(rows, rows[1:])]
    return statistics.median(times)


def running(evals):
    """(step, t, mean of the last EVAL_WINDOW rewards) after each evaluation."""
    out = []
    for i in range(len(evals)):
        w = evals[max(0, i - EVAL_WINDOW + 1):i + 1]
        out.append((evals[i]["step"], evals[i]["t"], sum(e["reward"] for e in w) / len(w)))
    return out


def phase_seconds(result, key):
    """The median over every rank's steps of one phase ("compute_s": rollouts, loss and backward;
    "exchange_s": the sidecar's average)."""
    return statistics.median(r[key] for rank in result["ranks"] for r in rank["rows"])


def row_figures(result):
    s = result["summary"]
    evals = result["ranks"][0]["evals"]
    return {"final_reward": s["final_reward"], "start_reward": s["start_reward"],
            "steps": s["steps"], "train_seconds": s["train_seconds"],
            "steps_per_second": s["steps_per_second"],
            "wire_bytes_per_step": s["wire_bytes_per_step"],
            "raw_bytes_per_step": s["raw_bytes_per_step"], "evals": evals,
            "median_step_s": step_seconds(result), "median_compute_s": phase_seconds(
                result, "compute_s"), "median_exchange_s": phase_seconds(result, "exchange_s"),
            "wall_s": result["wall_s"]}


def time_to(evals, target):
    """(step, seconds) of the first evaluation at which the mean of the last EVAL_WINDOW
    evaluations reaches `target` (a full window: the start's evaluation alone does not count)."""
    for i, (step, t, mean) in enumerate(running(evals)):
        if i + 1 >= EVAL_WINDOW and mean >= target:
            return step, t
    return None, None


def plot(rows, target, path_time, path_steps):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for path, key, xlabel in ((path_time, 1, "training time (s, evaluations left out)"),
                              (path_steps, 0, "optimizer step")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, label, runs in rows:
            for i, r in enumerate(runs):
                pts = running(r["evals"])
                ax.plot([p[key] for p in pts], [p[2] for p in pts], label=label if i == 0 else None,
                        color="C%d" % [row[0] for row in ROWS].index(name), alpha=0.85,
                        linewidth=1.4)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target reward")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out reward (mean of last %d evaluations)" % EVAL_WINDOW)
        ax.set_title("agent-RL example, 4 trainers, 1 Gbit/s link")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rows", default=",".join(r[0] for r in ROWS))
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--calibrate-steps", type=int, default=12)
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--results")
    ap.add_argument("--example-args", default="",
                    help="more arguments for every run of the example (the profile's fields, "
                         "e.g. \"--prompts 4 --lr 3e-4\")")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        for name, label, sc, tr, every, factor in ROWS:
            print("%-11s %s  (sidecars: %s%s; %g x --steps)" % (
                name, label, " ".join(sc), "; trainers: " + " ".join(tr) if tr else "", factor))
        return 0
    if os.geteuid() != 0:
        sys.exit("bench/agent_rl.py needs root (a network namespace with a rate-limited loopback)")
    binary = os.path.abspath(os.environ.get("LIGHTWIRE_BIN",
                                            os.path.join(ROOT, "build-release/proxy/lightwire")))
    python = os.environ.get("PYTHON", "/usr/bin/python3")
    seeds = [int(s) for s in args.seeds.split(",")]
    wanted = args.rows.split(",")
    world, steps = args.world_size, args.steps
    profile = ["--profile", "bench"]
    if args.smoke:
        world, steps, seeds = 2, 6, seeds[:1]
        profile = ["--profile", "short", "--eval-every", "3"]
        args.calibrate_steps = 4
    profile += args.example_args.split()
    results_path = args.results or os.path.join(args.out_dir, "benchmarks", "agent-rl.json")
    work = tempfile.mkdtemp(prefix="agent-rl-bench-")
    ns = Namespace()
    t_start = time.monotonic()
    out = {"date": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(), "rate": args.rate, "world_size": world, "steps": steps,
           "seeds": seeds, "example_args": profile, "rows": {}}
    try:
        # The warm start once, outside the timed runs (the example caches it).
        subprocess.run([python, EXAMPLE, "--warm-only"] + profile, check=True,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "clients", "python")))
        calib = {}
        for rate in ("unlimited", args.rate):
            ns.limit(rate)
            r = run_example(ns, binary, python, world, ["--codec", "none"], [], 0,
                            args.calibrate_steps, work, "calibrate-" + rate,
                            profile + ["--eval-every", str(10 ** 6)])
            calib[rate] = step_seconds(r)
            calib[rate + "_compute"] = phase_seconds(r, "compute_s")
            calib[rate + "_exchange"] = phase_seconds(r, "exchange_s")
            facts = r["summary"]
            log("dense step, %s: %.3f s" % (rate, calib[rate]))
        share = 1.0 - calib["unlimited"] / calib[args.rate]
        out["calibration"] = {"step_s_unlimited": calib["unlimited"],
                              "step_s_limited": calib[args.rate], "exchange_share": share,
                              "compute_s_unlimited": calib["unlimited_compute"],
                              "exchange_s_unlimited": calib["unlimited_exchange"],
                              "compute_s_limited": calib[args.rate + "_compute"],
                              "exchange_s_limited": calib[args.rate + "_exchange"],
                              "params": facts["params"],
                              "flops_per_token": facts["flops_per_token"],
                              "zero_share": facts["zero_share"]}
        log("the dense exchange is %.0f %% of a dense step at %s (%d parameters, %.1f MFLOP per "
            "token, %.2f %% of the gradient's elements exactly zero)" % (
                100 * share, args.rate, facts["params"], facts["flops_per_token"] / 1e6,
                100 * facts["zero_share"]))
        ns.limit(args.rate)
        for name, label, sidecar_args, trainer_args, every, factor in ROWS:
            if name not in wanted:
                continue
            runs = []
            row_steps = steps if args.smoke else int(round(steps * factor))
            for seed in (seeds if every else seeds[:1]):
                tag = "%s-seed%d" % (name, seed)
                log("row %s (%s), seed %d, %d steps ..." % (name, label, seed, row_steps))
                r = run_example(ns, binary, python, world, sidecar_args, trainer_args, seed,
                                row_steps, work, tag, profile)
                fig = row_figures(r)
                log("  final reward %.3f (start %.3f), %.2f steps/s, %.0f wire bytes/step" % (
                    fig["final_reward"], fig["start_reward"], fig["steps_per_second"],
                    fig["wire_bytes_per_step"]))
                runs.append(fig)
            out["rows"][name] = {"label": label, "sidecar_args": sidecar_args,
                                 "trainer_args": trainer_args, "steps": row_steps, "runs": runs}
    finally:
        ns.close()
    # The target, and each row's time to it.
    dense = [r["final_reward"] for r in out["rows"].get("none", {}).get("runs", [])]
    target = None
    if dense:
        sigma = statistics.stdev(dense) if len(dense) > 1 else 0.0
        allowance = max(0.01, 2 * sigma)
        target = statistics.mean(dense) - allowance
        out["target"] = {"dense_mean": statistics.mean(dense), "dense_sigma": sigma,
                         "allowance": allowance, "reward": target}
        for row in out["rows"].values():
            for r in row["runs"]:
                r["target_step"], r["target_seconds"] = time_to(r["evals"], target)
    out["duration_s"] = time.monotonic() - t_start
    os.makedirs(os.path.dirname(results_path), exist_ok=True)
    with open(results_path, "w") as f:
        json.dump(out, f, indent=1)
    if not args.smoke:
        plot([(n, out["rows"][n]["label"], out["rows"][n]["runs"]) for n, *_ in ROWS
              if n in out["rows"]], target,
             os.path.join(args.out_dir, "agent-rl-reward-time.png"),
             os.path.join(args.out_dir, "agent-rl-reward-steps.png"))
    print(report(out))
    return 0


def report(out):
    lines = ["rate %s, %d trainers, %d steps, seeds %s; %.0f min" % (
        out["rate"], out["world_size"], out["steps"], out["seeds"], out["duration_s"] / 60)]
    c = out.get("calibration")
    if c:
        lines.append("dense step %.3f s unlimited, %.3f s limited: the exchange %.0f %% of it" % (
            c["step_s_unlimited"], c["step_s_limited"], 100 * c["exchange_share"]))
        if "compute_s_limited" in c:
            lines.append("  trainers' own split (median): compute %.3f s, exchange call %.3f s "
                         "unlimited; %.3f s and %.3f s limited" % (
                             c["compute_s_unlimited"], c["exchange_s_unlimited"],
                             c["compute_s_limited"], c["exchange_s_limited"]))
    t = out.get("target")
    if t:
        lines.append("target reward %.3f (dense mean %.3f - max(0.01, 2 x sigma %.3f))" % (
            t["reward"], t["dense_mean"], t["dense_sigma"]))
    lines.append("%-11s %6s %8s %8s %9s %12s %9s %9s %14s" % (
        "row", "steps", "start", "final", "steps/s", "wire B/step", "compute", "exchange",
        "to target (s)"))
    for name, row in out["rows"].items():
        for r in row["runs"]:
            lines.append("%-11s %6d %8.3f %8.3f %9.3f %12.0f %9.3f %9.3f %14s" % (
                name, r["steps"], r["start_reward"], r["final_reward"], r["steps_per_second"],
                r["wire_bytes_per_step"], r.get("median_compute_s", float("nan")),
                r.get("median_exchange_s", float("nan")),
                "-" if r.get("target_seconds") is None else "%.1f" % r["target_seconds"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
