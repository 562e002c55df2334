"""Time to accuracy (the `tta` profile of bench/e2e/e2e.py): the stop rule the trainers apply and
the figures derived from a finished row. Pure functions on evaluation records, standard library
only: worker.py decides with them inside the training loop, e2e.py and report.py compute the
per-row and per-seed figures with them, and the tests drive them with synthetic sequences.

An evaluation record is a dict {"step", "seconds", "loss"} as worker.py writes it: "seconds" is
rank 0's cumulative training time up to that step (timed steps only, evaluation excluded).

The rule (bench/README.md "Time to accuracy"): the baseline of a (task, rate, seed) trains a fixed
horizon; its final loss (the mean of its last WINDOW evaluations) is the target, its training time
and its step count are the caps. Every other row of that seed stops after the first evaluation at
which

  - the mean of WINDOW consecutive evaluations (the last one and the WINDOW - 1 before it) first
    came to or below the target, and extra_steps more steps have run since ("target"); or
  - the step count reached the baseline's ("steps"); or
  - the next evaluation period would end after the baseline's training time ("time": the period
    is projected from the step time of the one before, so the row does not run longer than the
    baseline, give or take one period's change in step time).
"""

import math

# Evaluations averaged into one loss: the final loss (e2e.py's FINAL_EVALS) and the running mean
# the stop rule compares with the target. One evaluation moves by several per cent from one step to
# the next with SGD's noise; three of them at the profile's cadence span 30 (MLP) or 45 (LM) steps.
WINDOW = 3

# A row may train up to this many times its baseline's steps. Its time cap (the baseline's
# training time) is what binds: a compressed row is 4 to 10 times faster per step than DDP and may
# need more steps than DDP to reach DDP's loss, which is the trade time to accuracy measures. The
# step cap only bounds a row whose steps are faster still.
STEP_CAP_FACTOR = 10

# The stop reasons, as broadcast between the ranks (0: go on).
REASONS = ("target", "steps", "time")
_EPS = 1e-9


def reason_code(reason):
    """The integer worker.py broadcasts for a stop reason (None: go on)."""
    return 0 if reason is None else REASONS.index(reason) + 1


def reason_of(code):
    return None if code == 0 else REASONS[code - 1]


def is_eval_step(step, eval_every, max_steps):
    """Whether `step` (1-based) is an evaluation step: every eval_every steps and the last one. The
    same on every rank, so every rank takes part in the broadcast of the same steps."""
    return step % eval_every == 0 or step == max_steps


def next_eval_step(step, eval_every, max_steps):
    """The evaluation step after `step`."""
    return min((step // eval_every + 1) * eval_every, max_steps)


def running_mean(evals, i, window=WINDOW):
    """The mean loss of evals[i] and the window - 1 evaluations before it (fewer at the start)."""
    part = evals[max(0, i - window + 1):i + 1]
    return sum(e["loss"] for e in part) / len(part)


def first_reached(evals, target, window=WINDOW):
    """Index of the first evaluation at which the mean of `window` consecutive evaluations (it and
    the ones before) is at most `target`, or None. Needs `window` evaluations: a single early lucky
    evaluation does not count."""
    if target is None:
        return None
    for i in range(window - 1, len(evals)):
        if running_mean(evals, i, window) <= target + _EPS * abs(target):
            return i
    return None


def stop_decision(evals, target, extra_steps, cap_seconds, max_steps, eval_every, window=WINDOW):
    """The decision after the evaluation evals[-1] (taken at its step): a stop reason ("target",
    "steps", "time") or None to go on. The reasons are checked in that order, so a row that reaches
    the target plus its extra steps on its last allowed step says "target"."""
    if not evals:
        return None
    last = evals[-1]
    step, seconds = last["step"], last["seconds"]
    i = first_reached(evals, target, window)
    if i is not None and step >= evals[i]["step"] + extra_steps:
        return "target"
    if step >= max_steps:
        return "steps"
    if cap_seconds is not None:
        if seconds >= cap_seconds:
            return "time"
        if len(evals) >= 2 and step > evals[-2]["step"]:
            per_step = (seconds - evals[-2]["seconds"]) / (step - evals[-2]["step"])
        else:
            per_step = seconds / step
        projected = seconds + (next_eval_step(step, eval_every, max_steps) - step) * per_step
        if projected > cap_seconds:
            return "time"
    return None


# ------------------------------------------------------------------------------------------------
# Figures of a finished row
# ------------------------------------------------------------------------------------------------
def training_seconds(row):
    """A finished row's training time: its rank-0 timed steps, summed (its last evaluation's
    "seconds", evaluations being taken at the last step)."""
    if row.get("step_seconds"):
        return float(sum(row["step_seconds"]))
    return row["eval"][-1]["seconds"] if row.get("eval") else 0.0


def row_figures(row, base, window=WINDOW):
    """The time-to-accuracy figures of a finished row against the finished baseline of its
    (task, rate, seed) (the baseline against itself too):

    target: the baseline's final loss; cap_seconds, cap_steps: its training time and steps.
    steps_to_target, time_to_target: the step and training time of the first evaluation whose
      running mean (`window` evaluations) is at most the target; None if none is.
    equal_steps: the largest evaluation step the row shares with the baseline (the baseline's
      final step if the row ran that far); loss_at_equal_steps: the row's evaluation loss there,
      base_loss_at_equal_steps the baseline's, delta_loss_at_equal_steps the difference (row -
      baseline, same seed).
    loss_at_equal_time: the row's running-mean evaluation loss at the baseline's training time
      when the row ran that long (at_baseline_time True: it trained at least as long, or the
      time cap stopped it, i.e. its next period would have passed that time), else at its last
      evaluation (at_baseline_time False); equal_time_seconds: that evaluation's time.
    wire_bytes_per_step_per_rank: as measured (the link's bytes / steps run / ranks).
    dense_share: the share of elements sent dense over the row's timed steps (lightwire rows:
      the hook's counters, from every reply's layers; None for the other rows).
    stop_reason, stop_step: why and after which step the row stopped (None for a fixed-step row).
    """
    target = base["final_loss"]
    cap_seconds = training_seconds(base)
    cap_steps = base["eval"][-1]["step"] if base.get("eval") else base.get("steps")
    evals = row["eval"]
    fig = {"target": target, "cap_seconds": cap_seconds, "cap_steps": cap_steps,
           "steps_to_target": None, "time_to_target": None, "equal_steps": None,
           "loss_at_equal_steps": None, "base_loss_at_equal_steps": None,
           "delta_loss_at_equal_steps": None, "loss_at_equal_time": None,
           "equal_time_seconds": None, "at_baseline_time": None,
           "wire_bytes_per_step_per_rank": row.get("wire_bytes_per_step_per_rank"),
           "dense_share": row.get("dense_share")}
    stop = row.get("stop") or {}
    fig["stop_reason"], fig["stop_step"] = stop.get("reason"), stop.get("step")
    if not evals:
        return fig
    i = first_reached(evals, target, window)
    if i is not None:
        fig["steps_to_target"], fig["time_to_target"] = evals[i]["step"], evals[i]["seconds"]
    base_at = {e["step"]: e for e in base["eval"]}
    shared = [e for e in evals if e["step"] in base_at]
    if shared:
        e = shared[-1]
        fig["equal_steps"] = e["step"]
        fig["loss_at_equal_steps"] = e["loss"]
        fig["base_loss_at_equal_steps"] = base_at[e["step"]]["loss"]
        fig["delta_loss_at_equal_steps"] = e["loss"] - base_at[e["step"]]["loss"]
    ran_long = (training_seconds(row) >= cap_seconds * (1 - 1e-6)
                or fig["stop_reason"] == "time")
    if ran_long:
        within = [j for j, e in enumerate(evals) if e["seconds"] <= cap_seconds * (1 + 1e-6)]
        j = within[-1] if within else 0
    else:
        j = len(evals) - 1
    fig["loss_at_equal_time"] = running_mean(evals, j, window)
    fig["equal_time_seconds"] = evals[j]["seconds"]
    fig["at_baseline_time"] = ran_long
    return fig


# The figures averaged over seeds (report.py's tables), and the final loss and step time.
SEED_FIGURES = ("steps_to_target", "time_to_target", "loss_at_equal_steps",
                "delta_loss_at_equal_steps", "loss_at_equal_time", "wire_bytes_per_step_per_rank",
                "dense_share", "final_loss", "median_step_seconds")


def mean_sd(values):
    """{"mean", "sd", "n"} of the values that are not None: sd is the sample standard deviation
    (n - 1 in the denominator), None below two values; mean None without any."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(xs)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0}
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n >= 2 else None
    if sd is not None and sd <= 1e-12 * abs(m):
        sd = 0.0  # equal values but for floating-point rounding
    return {"mean": m, "sd": sd, "n": n}


def seed_summary(rows):
    """Per (task, rate, config), in order of first appearance: the seeds, how many rows finished,
    reached the target and were compared at the baseline's time, and mean_sd over the finished
    rows' seeds of every SEED_FIGURES figure. rows: every row (finished or not) with its "tta"
    figures (row_figures) on the finished ones."""
    groups = {}
    for r in rows:
        groups.setdefault((r["task"], r["rate"], r["config"]), []).append(r)
    out = []
    for (task, rate, config), rs in groups.items():
        done = [r for r in rs if r.get("status") == "ok" and r.get("tta")]
        entry = {"task": task, "rate": rate, "config": config, "label": rs[0].get("label", config),
                 "seeds": [r.get("seed", 0) for r in rs], "finished": len(done),
                 "reached": sum(1 for r in done if r["tta"]["steps_to_target"] is not None),
                 "at_baseline_time": sum(1 for r in done if r["tta"]["at_baseline_time"]),
                 "equal_steps": sorted({r["tta"]["equal_steps"] for r in done
                                        if r["tta"]["equal_steps"] is not None})}
        for key in SEED_FIGURES:
            entry[key] = mean_sd([(r["tta"].get(key) if key in r["tta"] else r.get(key))
                                  for r in done])
        out.append(entry)
    return out
