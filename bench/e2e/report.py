#!/usr/bin/python3
"""Turns the results JSON of the end-to-end training benchmark (bench/e2e/e2e.py) into
docs/BENCHMARKS.md and its PNG plots under docs/benchmarks/.

    /usr/bin/python3 bench/e2e/report.py RESULTS_JSON [--out-dir docs] [--speed SPEED_JSON ...]

--out-dir defaults to the repository's docs/ directory (wherever this is run from). Writes
OUT/BENCHMARKS.md and, per (task, rate) group, OUT/benchmarks/<task>-<rate>-loss-step.png,
-loss-time.png and -step-time.png; --speed adds a section summarising results of
bench/e2e/speed.py (speed against DDP, final loss, the step-speed targets). Progress goes to stderr. A malformed results file exits with
status 2 and a message naming the offending field.

Results of the time-to-accuracy profile (`e2e.py --tta`: a top-level "tta" object, rows per
seed) make OUT/BENCHMARKS-tta.md and OUT/benchmarks/tta-<task>-<rate>-*.png instead, so that they
never replace the fixed-step page: per configuration the time-to-accuracy figures over the seeds
(mean ± standard deviation), every seed's row, and the loss against time with the target.

Importable: write_report(results, out_dir) -> [paths written]; it raises ReportError (a
ValueError) on malformed results. Needs only the standard library and matplotlib (Agg backend;
Debian's python3-matplotlib, so run it with /usr/bin/python3).
"""

import argparse
import json
import math
import os
import re
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tta  # noqa: E402  (bench/e2e/tta.py: the time-to-accuracy figures, standard library only)

SCHEMA_VERSION = 1
BASELINE_CONFIG = "ddp"
FP16_HOOK_CONFIG = "ddp_fp16"
TARGET_CONFIG = "lightwire_dgc_policies"
TARGET_SPEEDUP = 5.0          # target (a): at least this many times faster per step than DDP
TARGET_LOSS_TOLERANCE = 0.02  # target (a): final loss at most 2 % above DDP's
EMA_WEIGHT = 0.8              # smoothing of the rank-0 minibatch loss in the loss-step plot
DPI = 110
FIGSIZE = (9, 5)
DASH = "\u2014"               # em dash: "no figure"
TIMES = "\u00d7"              # multiplication sign
_EPS = 1e-9                   # tolerance of the target comparisons (floating-point noise only)


class ReportError(ValueError):
    """The results are malformed; the message names the field."""


def log(msg):
    print("report: %s" % msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
def _is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _need(obj, key, where, kinds, allow_none=False):
    if not isinstance(obj, dict) or key not in obj:
        raise ReportError("%s: missing field %r" % (where, key))
    v = obj[key]
    if v is None and allow_none:
        return v
    if kinds == "number":
        ok = _is_num(v)
        kinds_name = "a number"
    elif kinds == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
        kinds_name = "an integer"
    elif kinds == "str":
        ok = isinstance(v, str) and v != ""
        kinds_name = "a non-empty string"
    elif kinds == "list":
        ok = isinstance(v, list)
        kinds_name = "a list"
    elif kinds == "dict":
        ok = isinstance(v, dict)
        kinds_name = "an object"
    else:  # pragma: no cover
        raise AssertionError(kinds)
    if not ok:
        raise ReportError("%s: field %r must be %s%s, not %r"
                          % (where, key, kinds_name, " or null" if allow_none else "", v))
    return v


def _opt(obj, key, kinds, where):
    """An optional field: None when absent or null, else checked like _need."""
    if obj.get(key) is None:
        return None
    return _need(obj, key, where, kinds)


def validate(results):
    """Raises ReportError unless `results` follows schema version 1 (see e2e.py)."""
    if not isinstance(results, dict):
        raise ReportError("the top level must be a JSON object, not %s" % type(results).__name__)
    version = results.get("version")
    if version != SCHEMA_VERSION:
        raise ReportError("field 'version' is %r; this report reads version %d"
                          % (version, SCHEMA_VERSION))
    _need(results, "command", "top level", "str")
    _need(results, "world_size", "top level", "int")
    for key in ("profile", "date", "commit"):
        _opt(results, key, "str", "top level")
    _opt(results, "elapsed_seconds", "number", "top level")
    _opt(results, "machine", "dict", "top level")
    runs = _need(results, "runs", "top level", "list")
    if not runs:
        raise ReportError("field 'runs' is empty: nothing to report")
    by_seed = results.get("tta") is not None
    if by_seed:
        _need(results, "tta", "top level", "dict")
    seen = set()
    for i, run in enumerate(runs):
        where = "runs[%d]" % i
        if not isinstance(run, dict):
            raise ReportError("%s must be an object, not %r" % (where, run))
        for key in ("task", "rate", "config", "label", "kind", "status"):
            _need(run, key, where, "str")
        where = "runs[%d] (%s, %s, %s)" % (i, run["task"], run["rate"], run["config"])
        ident = (run["task"], run["rate"], run["config"])
        if by_seed:
            ident += (_need(run, "seed", where, "int"),)
        if ident in seen:
            raise ReportError("%s: configuration %r appears twice for task %r at rate %r%s"
                              % (where, run["config"], run["task"], run["rate"],
                                 " with seed %d" % run["seed"] if by_seed else ""))
        seen.add(ident)
        _opt(run, "error", "str", where)
        _opt(run, "notes", "str", where)
        _opt(run, "task_title", "str", where)
        _opt(run, "rate_bits_per_second", "number", where)
        _opt(run, "parameters", "number", where)
        _opt(run, "batch", "int", where)
        _opt(run, "steps", "int", where)
        if run.get("baseline") is not None and not isinstance(run["baseline"], bool):
            raise ReportError("%s: field 'baseline' must be true or false, not %r" % (where, run["baseline"]))
        if run["status"] != "ok":
            continue
        _need(run, "steps", where, "int")
        _need(run, "median_step_seconds", where, "number")
        if not run["median_step_seconds"] > 0:
            raise ReportError("%s: median_step_seconds must be positive, not %r"
                              % (where, run["median_step_seconds"]))
        _need(run, "final_loss", where, "number")
        _opt(run, "final_accuracy", "number", where)
        _need(run, "wire_bytes_per_step_per_rank", where, "number")
        _need(run, "time_to_baseline_loss", where, "number", allow_none=True)
        for key in ("step_seconds", "loss"):
            seq = _need(run, key, where, "list")
            for j, x in enumerate(seq):
                if not _is_num(x):
                    raise ReportError("%s: %s[%d] must be a number, not %r" % (where, key, j, x))
        evals = _need(run, "eval", where, "list")
        for j, ev in enumerate(evals):
            w = "%s: eval[%d]" % (where, j)
            if not isinstance(ev, dict):
                raise ReportError("%s must be an object, not %r" % (w, ev))
            _need(ev, "step", w, "int")
            _need(ev, "seconds", w, "number")
            _need(ev, "loss", w, "number")
            if ev.get("accuracy") is not None:
                _need(ev, "accuracy", w, "number")
        if by_seed and run.get("tta") is not None:
            fig = _need(run, "tta", where, "dict")
            for key in ("target", "cap_seconds"):
                _need(fig, key, where + ": tta", "number")
            for key in ("steps_to_target", "time_to_target", "loss_at_equal_steps",
                        "delta_loss_at_equal_steps", "loss_at_equal_time", "dense_share"):
                _need(fig, key, where + ": tta", "number", allow_none=True)


# ------------------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------------------
def fmt_sig(x, sig=3):
    """x with `sig` significant digits, never in exponent notation ("0.0412", "123", "12300")."""
    if x is None:
        return DASH
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    digits = sig - 1 - int(math.floor(math.log10(abs(x))))
    r = round(x, digits)
    if r != 0 and int(math.floor(math.log10(abs(r)))) != int(math.floor(math.log10(abs(x)))):
        digits -= 1  # 9.996 -> 10.0, not 10.00
        r = round(x, digits)
    if digits <= 0:
        return "%d" % int(r)
    return "%.*f" % (digits, r)


def fmt_bytes(n):
    """Decimal units with 3 significant digits: 512 B, 123 KB, 1.50 MB."""
    if n is None:
        return DASH
    if not math.isfinite(n):
        return str(n)
    units = [("B", 1.0), ("KB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12)]
    for i, (name, scale) in enumerate(units):
        v = n / scale
        text = fmt_sig(v, 3)
        if abs(float(text)) < 1000 or i == len(units) - 1:
            return "%s %s" % (text, name)
    return "%s B" % n  # pragma: no cover


def fmt_rate(bits):
    if bits is None:
        return None
    for name, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1)):
        if bits >= scale or scale == 1:
            text = fmt_sig(bits / scale, 3)
            if "." in text:
                text = text.rstrip("0").rstrip(".")  # 1 Gbit/s, not 1.00 Gbit/s
            return "%s %s" % (text, name)


def fmt_pct(frac):
    if frac is None:
        return DASH
    if not math.isfinite(frac):
        return str(frac)
    return "%+.2f %%" % (100.0 * frac)


def fmt_params(n):
    if n is None:
        return None
    if n >= 1e6:
        return "%sM parameters" % fmt_sig(n / 1e6, 2)
    if n >= 1e3:
        return "%sk parameters" % fmt_sig(n / 1e3, 2)
    return "%d parameters" % n


def md_cell(text):
    """Text safe inside a Markdown table cell."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def md_code_block(text):
    """A fenced code block whose fence is longer than any backtick run in `text`."""
    longest = max([len(m) for m in re.findall(r"`+", text)] + [0])
    fence = "`" * max(3, longest + 1)
    return "%s\n%s\n%s" % (fence, text.rstrip("\n"), fence)


def md_inline_code(text):
    longest = max([len(m) for m in re.findall(r"`+", text)] + [0])
    ticks = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return "%s%s%s%s%s" % (ticks, pad, text, pad, ticks)


def safe_name(s):
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s)


# ------------------------------------------------------------------------------------------------
# Figures derived from the data
# ------------------------------------------------------------------------------------------------
def ok(run):
    return run is not None and run.get("status") == "ok"


def model_facts(runs):
    """What a group's rows share about the model: its parameter count and batch per rank."""
    facts = []
    params = fmt_params(first_of(runs, "parameters"))
    if params:
        facts.append(params)
    batch = first_of(runs, "batch")
    if batch is not None:
        facts.append("batch %s per rank" % batch)
    # The optimizer of each row (results since the optimizer helpers record it).
    by_optimizer = {}
    for r in runs:
        if r.get("optimizer"):
            names = by_optimizer.setdefault(r["optimizer"], [])
            if r["config"] not in names:
                names.append(r["config"])
    if by_optimizer:
        facts.append("optimizer " + "; ".join("%s (%s)" % (o, ", ".join(n))
                                               for o, n in by_optimizer.items()))
    return facts


def status_cell(run, notes):
    """A row's status with a footnote mark for its error (a failed row) and for its notes; the
    footnotes are appended to `notes` as (number, row, "error" | "notes")."""
    marks = []
    if run.get("error") and not ok(run):
        notes.append((len(notes) + 1, run, "error"))
        marks.append("[%d]" % len(notes))
    if run.get("notes"):
        notes.append((len(notes) + 1, run, "notes"))
        marks.append("[%d]" % len(notes))
    return run["status"] + (" " + " ".join(marks) if marks else "")


def group_runs(runs):
    """[((task, rate), [runs in order])] in order of first appearance."""
    groups = {}
    for run in runs:
        groups.setdefault((run["task"], run["rate"]), []).append(run)
    return list(groups.items())


def find_baseline(runs):
    for run in runs:
        if run.get("baseline") is True:
            return run
    return find_config(runs, BASELINE_CONFIG)


def find_config(runs, config):
    for run in runs:
        if run["config"] == config:
            return run
    return None


def speedup(base, run):
    """Baseline median step / this median step; None when either is not ok."""
    if not (ok(base) and ok(run)):
        return None
    return base["median_step_seconds"] / run["median_step_seconds"]


def rel_loss(base, run):
    """(this final loss - the baseline's) / the baseline's; None when either is not ok."""
    if not (ok(base) and ok(run)):
        return None
    b, x = base["final_loss"], run["final_loss"]
    if b == 0:
        return 0.0 if x == 0 else math.copysign(float("inf"), x)
    return (x - b) / abs(b)


def first_of(runs, key):
    for run in runs:
        if run.get(key) is not None:
            return run[key]
    return None


def color_map(runs):
    """One color per configuration name, the same in every plot and group."""
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#b8860b", "#00008b", "#ff1493",
               "#006400", "#8b0000", "#4682b4", "#808000"]
    colors = {}
    for run in runs:
        if run["config"] not in colors:
            colors[run["config"]] = palette[len(colors) % len(palette)]
    return colors


def ema(values, weight):
    out, prev = [], None
    for v in values:
        if not math.isfinite(v):
            out.append(float("nan"))
            continue
        prev = v if prev is None else weight * prev + (1.0 - weight) * v
        out.append(prev)
    return out


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("report: matplotlib is not importable (%s); install Debian's "
                         "python3-matplotlib and run this with /usr/bin/python3" % e)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _style(run, colors):
    return dict(color=colors[run["config"]],
                linestyle="-" if run["kind"] == "lightwire" else "--",
                linewidth=2.2 if run.get("baseline") or run["config"] == BASELINE_CONFIG else 1.4)


def _title(ax, group_title, what):
    # Centred over the axes, which the legend beside them makes narrower than the figure: wrapped
    # to two lines of at most 72 characters, so that it stays inside the image.
    head = textwrap.wrap(group_title, 72)
    if len(head) > 2:
        head = [head[0], textwrap.shorten(" ".join(head[1:]), 72, placeholder="...")]
    ax.set_title("%s\n%s" % ("\n".join(head), what), fontsize=10)


def _finish(plt, fig, ax, path, runs):
    for r in runs:
        if not ok(r):  # a legend line without a handle: "X: failed, not shown"
            ax.plot([], [], linestyle="none", label="%s: %s, not shown" % (r["label"], r["status"]))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(True, which="major", alpha=0.3)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)


def _empty(ax, text="no successful run in this group"):
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#555555")


def plot_loss_step(plt, runs, title, colors, path):
    fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    ys = []
    for run in runs:
        if not ok(run):
            continue
        st = _style(run, colors)
        smooth = ema(run["loss"], EMA_WEIGHT)
        ax.plot(range(1, len(smooth) + 1), smooth, label=run["label"], **st)
        ys += [v for v in smooth if math.isfinite(v)]
        ev = run["eval"]
        if ev:
            ax.plot([e["step"] for e in ev], [e["loss"] for e in ev], linestyle="none", marker="o",
                    markersize=4.5, color=st["color"], markeredgecolor="white", markeredgewidth=0.6)
            ys += [e["loss"] for e in ev if math.isfinite(e["loss"])]
    if ys:
        ax.plot([], [], linestyle="none", marker="o", color="#555555", label="evaluation loss (markers)")
        if min(ys) > 0 and max(ys) / min(ys) > 10:
            ax.set_yscale("log")
    else:
        _empty(ax)
    ax.set_xlabel("training step")
    ax.set_ylabel("rank-0 minibatch loss\n(EMA smoothed, weight %.1f on the previous value)" % EMA_WEIGHT)
    _title(ax, title, "training loss per step")
    _finish(plt, fig, ax, path, runs)


def plot_loss_time(plt, runs, base, title, colors, path):
    fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    last_times = []
    for run in runs:
        if not ok(run) or not run["eval"]:
            continue
        st = _style(run, colors)
        ev = run["eval"]
        ax.plot([e["seconds"] for e in ev], [e["loss"] for e in ev], marker="o", markersize=3.5,
                label=run["label"], **st)
        last_times.append(ev[-1]["seconds"])
    if ok(base):
        ax.axhline(base["final_loss"], color="#333333", linewidth=0.8, linestyle=":",
                   label="baseline's final evaluation loss")
    if not last_times:
        _empty(ax)
    elif min(last_times) > 0 and max(last_times) / min(last_times) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("cumulative training time, rank 0 (s)")
    ax.set_ylabel("evaluation loss")
    _title(ax, title, "evaluation loss against training time")
    _finish(plt, fig, ax, path, runs)


def plot_step_time(plt, runs, base, title, colors, path):
    fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    labels = [r["label"] for r in runs]
    ypos = list(range(len(runs)))
    values = [r["median_step_seconds"] if ok(r) else 0.0 for r in runs]
    good = [v for r, v in zip(runs, values) if ok(r)]
    log_x = bool(good) and max(good) / min(good) > 20
    for y, run, v in zip(ypos, runs, values):
        is_base = run is base
        if ok(run):
            ax.barh(y, v, color=colors[run["config"]], edgecolor="black" if is_base else "none",
                    linewidth=1.6 if is_base else 0, hatch="//" if is_base else None, height=0.7)
            sp = speedup(base, run)
            text = "%s s" % fmt_sig(v, 3)
            if is_base:
                text += " (baseline)"
            elif sp is not None:
                text += " (%s%s)" % (fmt_sig(sp, 3), TIMES)
            ax.text(v, y, " " + text, va="center", ha="left", fontsize=8)
        else:
            ax.text(0.01, y, run["status"], transform=ax.get_yaxis_transform(), va="center",
                    ha="left", fontsize=8, color="#b00000")
    ax.set_yticks(ypos)
    ax.set_yticklabels(labels, fontsize=8.5)
    for tick, run in zip(ax.get_yticklabels(), runs):
        if run is base:
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    if good:
        if log_x:
            ax.set_xscale("log")
            ax.set_xlim(min(good) / 1.5, max(good) * 4)
        else:
            ax.set_xlim(0, max(good) * 1.3)
    else:
        _empty(ax)
    ax.set_xlabel("median training step time, rank 0 (s)%s" % (", log scale" if log_x else ""))
    _title(ax, title, "median step time (baseline hatched; speed-up against it in brackets)")
    ax.grid(True, axis="x", which="major", alpha=0.3)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------
def _group_title(task, rate, runs):
    title = first_of(runs, "task_title") or task
    bits = fmt_rate(first_of(runs, "rate_bits_per_second"))
    return "%s at %s" % (title, bits or rate), title


def _table(runs, base, notes):
    """Markdown table lines; footnotes (errors, notes) appended to `notes` as (n, run, kind)."""
    has_acc = any(ok(r) and r.get("final_accuracy") is not None for r in runs)
    head = ["configuration", "status", "median step (s)", "speed-up vs DDP", "wire per step per rank",
            "final loss", "loss vs DDP"]
    align = [":--", ":--", "--:", "--:", "--:", "--:", "--:"]
    if has_acc:
        head.append("accuracy")
        align.append("--:")
    head.append("time to DDP's final loss (s)")
    align.append("--:")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    for run in runs:
        status = status_cell(run, notes)
        label = run["label"]
        if run is base:
            label = "**%s** (baseline)" % md_cell(label)
        else:
            label = md_cell(label)
        if not ok(run):
            cells = [label, md_cell(status)] + [DASH] * (len(head) - 2)
        else:
            sp = speedup(base, run)
            rl = rel_loss(base, run)
            cells = [label, md_cell(status), fmt_sig(run["median_step_seconds"], 3),
                     (fmt_sig(sp, 3) + TIMES) if sp is not None else DASH,
                     fmt_bytes(run["wire_bytes_per_step_per_rank"]),
                     fmt_sig(run["final_loss"], 4),
                     fmt_pct(rl) if run is not base else "0 (baseline)"]
            if has_acc:
                acc = run.get("final_accuracy")
                cells.append(DASH if acc is None else "%.1f %%" % (100.0 * acc))
            t = run.get("time_to_baseline_loss")
            cells.append("not reached" if t is None else fmt_sig(t, 3))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _footnotes(notes):
    out = []
    for n, run, kind in notes:
        if kind == "error":
            out.append("[%d] %s, %s:" % (n, md_cell(run["label"]), run["status"]))
            out.append("")
            out.append(md_code_block(run["error"]))
        else:
            out.append("[%d] %s: %s" % (n, md_cell(run["label"]), run["notes"].strip()))
        out.append("")
    return out


def evaluate_targets(runs):
    """The end-to-end targets (docs/BENCHMARKS.md "Targets") for one group, from the data.

    Returns a dict: "a" and "b" (None when a configuration they compare is absent; else a dict with
    met (True/False/None = cannot be evaluated), reason and the figures), and "losses" (lines
    naming where lightwire loses against the DDP baseline)."""
    base = find_baseline(runs)
    fp16 = find_config(runs, FP16_HOOK_CONFIG)
    dgc = find_config(runs, TARGET_CONFIG)
    res = {"a": None, "b": None, "losses": [], "baseline": base, "fp16": fp16, "dgc": dgc}
    if dgc is not None and base is not None:
        a = {"met": None}
        if not ok(base):
            a["reason"] = "cannot be evaluated: the baseline run %s" % base["status"]
        elif not ok(dgc):
            a["met"] = False
            a["reason"] = "the %s run %s" % (dgc["label"], dgc["status"])
        else:
            sp = speedup(base, dgc)
            rl = rel_loss(base, dgc)
            fast = sp >= TARGET_SPEEDUP * (1 - _EPS)
            close = rl <= TARGET_LOSS_TOLERANCE + _EPS
            a.update(met=fast and close, speedup=sp, rel_loss=rl, fast=fast, close=close)
            why = []
            if not fast:
                why.append("speed-up below %g%s" % (TARGET_SPEEDUP, TIMES))
            if not close:
                why.append("final loss more than %g %% above the baseline's" % (100 * TARGET_LOSS_TOLERANCE))
            a["reason"] = "; ".join(why)
        res["a"] = a
    if dgc is not None and fp16 is not None:
        b = {"met": None}
        if not ok(fp16):
            b["reason"] = "cannot be evaluated: the %s run %s" % (fp16["label"], fp16["status"])
        elif not ok(dgc):
            b["met"] = False
            b["reason"] = "the %s run %s" % (dgc["label"], dgc["status"])
        else:
            faster = dgc["median_step_seconds"] < fp16["median_step_seconds"]
            loss_ok = dgc["final_loss"] <= fp16["final_loss"] + _EPS * abs(fp16["final_loss"])
            b.update(met=faster and loss_ok, speedup=speedup(fp16, dgc), faster=faster,
                     loss_ok=loss_ok, rel_loss=rel_loss(fp16, dgc))
            why = []
            if not faster:
                why.append("not faster per step than the fp16 hook")
            if not loss_ok:
                why.append("final loss above the fp16 hook's")
            b["reason"] = "; ".join(why)
        res["b"] = b
    if base is not None and ok(base):
        for run in runs:
            if run["kind"] != "lightwire":
                continue
            if not ok(run):
                res["losses"].append("%s did not finish (%s; error under the table)."
                                     % (run["label"], run["status"]))
                continue
            sp = speedup(base, run)
            rl = rel_loss(base, run)
            parts = []
            if run["median_step_seconds"] > base["median_step_seconds"]:
                parts.append("slower per step than the baseline (%s s against %s s, %s%s)"
                             % (fmt_sig(run["median_step_seconds"], 3),
                                fmt_sig(base["median_step_seconds"], 3), fmt_sig(sp, 3), TIMES))
            if not rl <= TARGET_LOSS_TOLERANCE:
                parts.append("final loss %s than the baseline's (%s against %s)"
                             % (fmt_pct(rl) + " higher" if math.isfinite(rl) else "higher",
                                fmt_sig(run["final_loss"], 4), fmt_sig(base["final_loss"], 4)))
            if parts:
                res["losses"].append("%s: %s." % (run["label"], "; ".join(parts)))
    return res


def _verdict(met):
    return {True: "**met**", False: "**not met**", None: "**not evaluated**"}[met]


def _targets_lines(group_title, runs):
    t = evaluate_targets(runs)
    base, fp16, dgc = t["baseline"], t["fp16"], t["dgc"]
    out = ["### %s" % group_title, ""]
    a, b = t["a"], t["b"]
    if a is not None:
        line = ("- %s against %s (target: at least %g%s faster per step, final loss at most %g %% "
                "above the baseline's): %s"
                % (dgc["label"], base["label"], TARGET_SPEEDUP, TIMES, 100 * TARGET_LOSS_TOLERANCE,
                   _verdict(a["met"])))
        if "speedup" in a:
            line += (". Speed-up %s%s (%s s against %s s per step); final loss %s against %s (%s)"
                     % (fmt_sig(a["speedup"], 3), TIMES, fmt_sig(dgc["median_step_seconds"], 3),
                        fmt_sig(base["median_step_seconds"], 3), fmt_sig(dgc["final_loss"], 4),
                        fmt_sig(base["final_loss"], 4), fmt_pct(a["rel_loss"])))
        if a.get("reason"):
            line += ". " + a["reason"][0].upper() + a["reason"][1:]
        out.append(line + ".")
    if b is not None:
        line = ("- %s against %s (target: faster per step at equal or lower final loss): %s"
                % (dgc["label"], fp16["label"], _verdict(b["met"])))
        if "speedup" in b:
            line += (". %s s against %s s per step (speed-up %s%s); final loss %s against %s (%s)"
                     % (fmt_sig(dgc["median_step_seconds"], 3), fmt_sig(fp16["median_step_seconds"], 3),
                        fmt_sig(b["speedup"], 3), TIMES, fmt_sig(dgc["final_loss"], 4),
                        fmt_sig(fp16["final_loss"], 4), fmt_pct(b["rel_loss"])))
        if b.get("reason"):
            line += ". " + b["reason"][0].upper() + b["reason"][1:]
        out.append(line + ".")
    if a is None and b is None:
        missing = [c for c, r in ((TARGET_CONFIG, dgc), (BASELINE_CONFIG, base)) if r is None]
        if dgc is not None and base is None and fp16 is None:
            missing.append(FP16_HOOK_CONFIG)
        out.append("- No target applies: this group has no %s run."
                   % " or ".join(md_inline_code(m) for m in missing))
    if base is None or not ok(base):
        out.append("- Where lightwire loses: cannot be said without a successful DDP baseline run.")
    elif not any(r["kind"] == "lightwire" for r in runs):
        out.append("- No lightwire configuration in this group.")
    elif t["losses"]:
        out.append("- Where lightwire loses against the DDP baseline (slower per step, or final "
                   "loss more than %g %% higher, or no result):" % (100 * TARGET_LOSS_TOLERANCE))
        out += ["  - " + s for s in t["losses"]]
    else:
        out.append("- Every lightwire configuration here was at least as fast per step as the DDP "
                   "baseline, with final loss at most %g %% above it." % (100 * TARGET_LOSS_TOLERANCE))
    out.append("")
    return out


def _machine_lines(results):
    m = results.get("machine") or {}

    def g(key):
        v = m.get(key)
        return "unknown" if v is None or v == "" else str(v)

    mem = m.get("memory_gib")
    commit = results.get("commit") or "unknown"
    if commit.endswith("-dirty"):
        commit_text = "%s (with uncommitted changes)" % md_inline_code(commit[:-len("-dirty")])
    else:
        commit_text = md_inline_code(commit)
    elapsed = results.get("elapsed_seconds")
    elapsed_text = ("unknown" if elapsed is None else
                    "%s s (%s min)" % (fmt_sig(elapsed, 3), fmt_sig(elapsed / 60.0, 2)))
    rows = [
        ("CPUs", g("cpus")),
        ("CPU model", g("cpu_model")),
        ("memory", "unknown" if not _is_num(mem) else "%s GiB" % fmt_sig(mem, 3)),
        ("kernel", g("kernel")),
        ("OS", g("os")),
        ("Python", g("python")),
        ("PyTorch", g("torch")),
        ("lightwire executable", md_inline_code(g("lightwire_bin"))),
        ("commit", commit_text),
        ("date", results.get("date") or "unknown"),
        ("profile", results.get("profile") or "unknown"),
        ("ranks (world size)", str(results["world_size"])),
        ("elapsed (whole benchmark)", elapsed_text),
    ]
    lines = ["| | |", "| :-- | :-- |"]
    lines += ["| %s | %s |" % (md_cell(k), md_cell(v)) for k, v in rows]
    return lines


def render_markdown(results, source, group_info, speed=()):
    """The text of BENCHMARKS.md. group_info: [(title, runs, base, {kind: relative png path})];
    speed: (file name, speed.py results) pairs for the step-speed section."""
    w = results["world_size"]
    L = []
    L.append("# End-to-end training benchmark")
    L.append("")
    L.append("<!-- generated by bench/e2e/report.py from %s; do not edit by hand -->" % source)
    L.append("")
    L.append(
        "Each row below is real PyTorch data-parallel training: %d trainer processes (ranks) on the "
        "CPU, one per rank, run inside a network namespace whose loopback interface is rate-limited "
        "with `tc` and a token bucket filter (`tbf`). Every byte exchanged between ranks crosses that "
        "one interface, so all ranks share a single link of the stated rate. The configurations "
        "are PyTorch's DistributedDataParallel over gloo (the baseline), DDP with PyTorch's "
        "communication hooks, and lightwire's codecs through its sidecar; each group of rows "
        "comes from the same run on the same machine, with the same seeds and data." % w)
    L.append("")
    L.append("Generated by `bench/e2e/report.py` from `%s`. The results were produced by this "
             "command (authoritative for these figures):" % source)
    L.append("")
    L.append(md_code_block(results["command"]))
    L.append("")
    L.append("To regenerate: `bench/e2e/e2e.py --quick` for the quick profile, `bench/e2e/e2e.py` "
             "for the full one; to redraw this page from a saved results file: "
             "`/usr/bin/python3 bench/e2e/report.py RESULTS_JSON --out-dir docs [--speed "
             "SPEED_JSON ...]` (the step-speed section from `bench/e2e/speed.py`'s results). The figures "
             "depend on the machine (CPU count above all); compare rows within a group rather than "
             "with other machines.")
    L.append("")
    L.append("## Machine and run")
    L.append("")
    L += _machine_lines(results)
    L.append("")
    L.append("## Results")
    L.append("")
    for title, runs, base, pngs in group_info:
        L.append("### %s" % title)
        L.append("")
        facts = model_facts(runs)
        steps = first_of(runs, "steps")
        if steps is not None:
            facts.append("%s training steps" % steps)
        facts.append("%d ranks" % w)
        if base is None:
            facts.append("no DDP baseline run in this group, so no speed-up or loss comparison")
        L.append(", ".join(facts) + ".")
        L.append("")
        notes = []
        L += _table(runs, base, notes)
        L.append("")
        if notes:
            L += _footnotes(notes)
        for kind, caption in (("loss-step", "training loss per step"),
                              ("loss-time", "evaluation loss against training time"),
                              ("step-time", "median step time")):
            L.append("![%s: %s](%s)" % (md_cell(title), caption, pngs[kind]))
            L.append("")
    L.append("## Targets")
    L.append("")
    L.append("The project's targets: lightwire `dgc` with the policies on (`%s`) at least %g%s "
             "faster per step than DDP over gloo with final loss within %g %% (lower is fine), and "
             "faster per step than PyTorch's fp16 compression hook (`%s`) at equal or lower final "
             "loss. They are set for the MLP at 1 Gbit/s; they are computed below for every group "
             "that has the configurations, from the figures above."
             % (TARGET_CONFIG, TARGET_SPEEDUP, TIMES, 100 * TARGET_LOSS_TOLERANCE, FP16_HOOK_CONFIG))
    L.append("")
    for title, runs, base, pngs in group_info:
        L += _targets_lines(title, runs)
    if speed:
        L += _speed_section(speed)
    L.append("## Method")
    L.append("")
    L.append("- **Median step (s)**: the median of rank 0's per-step training time (forward, "
             "backward, gradient exchange, optimizer step); evaluation is excluded.")
    L.append("- **Speed-up vs DDP**: the DDP baseline's median step divided by this row's.")
    L.append("- **Wire per step per rank**: bytes counted on the namespace's loopback interface "
             "during the timed steps, divided by the number of steps and by the world size. Every "
             "byte between ranks crosses that one link, protocol headers included; traffic between "
             "a trainer and its lightwire sidecar goes through Unix sockets and shared memory, not "
             "the link. 1 KB = 1000 bytes, 1 MB = 10^6 bytes.")
    L.append("- **Final loss**: the mean loss of the last three evaluations on a fixed evaluation "
             "set (the models of the last 10–15 % of the steps: one evaluation moves by several "
             "per cent from one step to the next with SGD's noise); **loss vs DDP** is (this final "
             "loss − the baseline's) / the baseline's. **Accuracy**: the mean of the same three "
             "evaluations' (classifier only).")
    L.append("- **Time to DDP's final loss**: the cumulative training time (rank 0, evaluation "
             "excluded) at the first evaluation whose loss is at most the DDP baseline's final "
             "loss; \"not reached\" when no evaluation got there.")
    L.append("- **Plots**: the loss-per-step plot shows rank 0's minibatch training loss smoothed "
             "with an exponential moving average (weight %.1f on the previous value), with the "
             "evaluation losses as markers; runs that did not finish are listed under each plot "
             "instead of drawn." % EMA_WEIGHT)
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------------
# Step speed (results of bench/e2e/speed.py)
# ------------------------------------------------------------------------------------------------
# The speed targets at a fast link, against DDP's step of the same repetition (median over the
# repetitions): per configuration (minimum ratio, the rates it applies at, the largest final loss
# above DDP's, relative; None: no loss condition).
SPEED_TARGETS = {
    "lightwire_none": (0.98, ("10gbit",), None),
    "lightwire_fp16": (1.0, ("10gbit",), None),
    "lightwire_auto": (0.97, ("10gbit", "unlimited"), 0.005),
}


def validate_speed(sp, where):
    """Raises ReportError unless `sp` looks like bench/e2e/speed.py's results."""
    _need(sp, "command", where, "str")
    _need(sp, "groups", where, "list")
    for gi, g in enumerate(sp["groups"]):
        gw = "%s: groups[%d]" % (where, gi)
        _need(g, "task", gw, "str")
        _need(g, "rate", gw, "str")
        _need(g, "table", gw, "list")
        for ri, row in enumerate(g["table"]):
            rw = "%s.table[%d]" % (gw, ri)
            _need(row, "config", rw, "str")
            for key in ("speed_median", "speed_min", "speed_max", "median_step_seconds"):
                _need(row, key, rw, "number", allow_none=True)
            _opt(row, "final_loss", "list", rw)


def _mean_loss(row):
    losses = [v for v in (row.get("final_loss") or []) if _is_num(v) and math.isfinite(v)]
    return sum(losses) / len(losses) if losses else None


def _speed_section(speed):
    """The step-speed section: per speed.py results file and (task, rate) group, every
    configuration's speed against DDP (median of the repetitions [min, max]) and final loss; then
    the speed targets, computed from those figures."""
    L = ["## Step speed against DDP (`bench/e2e/speed.py`)", ""]
    L.append("The rows above come from one run per configuration, one after the other. These come "
             "from `bench/e2e/speed.py`: the configurations trained in turn for a short fixed "
             "number of steps and the whole round repeated, each row's median step divided into "
             "DDP's median step of the same repetition (above 1: faster than DDP); the figure is "
             "the median of those ratios over the repetitions, [minimum, maximum]. Final loss: "
             "the mean over the repetitions of each one's final loss (its last 3 evaluations), "
             "against DDP's. Names are e2e.py's configurations (`bench/e2e/e2e.py --list`).")
    L.append("")
    verdicts = []
    for name, sp in speed:
        cap = sp.get("bucket_cap_mb")
        L.append("From `%s` (commit `%s`, %s repetitions of %s steps%s):"
                 % (name, sp.get("commit") or "?", sp.get("repeats", "?"), sp.get("steps", "?"),
                    ", DDP bucket cap %s MB" % fmt_sig(cap, 3) if cap else ""))
        L.append("")
        L.append(md_code_block(sp["command"]))
        L.append("")
        head = ["task", "link", "configuration", "median step (s)", "speed vs DDP [min, max]",
                "final loss", "vs DDP"]
        L.append("| " + " | ".join(head) + " |")
        L.append("| :-- | :-- | :-- | --: | --: | --: | --: |")
        for g in sp["groups"]:
            base = next((r for r in g["table"] if r["config"] == BASELINE_CONFIG), None)
            base_loss = _mean_loss(base) if base else None
            for row in g["table"]:
                loss = _mean_loss(row)
                rel = (loss - base_loss) / base_loss if (loss is not None and base_loss) else None
                sp_cell = DASH if row.get("speed_median") is None else "%s [%s, %s]" % (
                    fmt_sig(row["speed_median"], 3), fmt_sig(row["speed_min"], 3),
                    fmt_sig(row["speed_max"], 3))
                L.append("| " + " | ".join([
                    md_cell(g["task"]), md_cell(g["rate"]), "`%s`" % row["config"],
                    DASH if row.get("median_step_seconds") is None
                    else fmt_sig(row["median_step_seconds"], 3), sp_cell,
                    DASH if loss is None else fmt_sig(loss, 5),
                    DASH if rel is None or row is base else fmt_pct(rel)]) + " |")
                target = SPEED_TARGETS.get(row["config"])
                if target and g["rate"] in target[1] and row.get("speed_median") is not None:
                    least, _, loss_tol = target
                    fast = row["speed_median"] >= least - _EPS
                    close = loss_tol is None or (rel is not None and rel <= loss_tol + _EPS)
                    verdicts.append("- `%s`, %s at %s (`%s`): at least %g%s DDP's step speed%s: "
                                    "**%s** (%s%s%s)." % (
                                        row["config"], g["task"], g["rate"], name, least, TIMES,
                                        "" if loss_tol is None else
                                        " with a final loss at most %g %% above DDP's"
                                        % (100 * loss_tol),
                                        "met" if fast and close else "not met",
                                        fmt_sig(row["speed_median"], 3), TIMES,
                                        "" if rel is None else ", final loss %s" % fmt_pct(rel)))
        L.append("")
    if verdicts:
        L.append("The step-speed targets (4 ranks, at 10 Gbit/s and, for `codec: auto`, on the "
                 "unlimited loopback), computed from the tables above:")
        L.append("")
        L += verdicts
        L.append("")
    return L


# ------------------------------------------------------------------------------------------------
# Time to accuracy (results of e2e.py --tta)
# ------------------------------------------------------------------------------------------------
TTA_PAGE = "BENCHMARKS-tta.md"
TTA_PREFIX = "tta-"


def tta_names(source):
    """(page, image prefix) of a time-to-accuracy results file: results-tta.json gives
    BENCHMARKS-tta.md and tta-*.png; results-tta-NAME.json (another invocation of the profile, kept
    beside it: e2e.py --results) BENCHMARKS-tta-NAME.md and tta-NAME-*.png."""
    m = re.fullmatch(r"results-tta-([A-Za-z0-9_.-]+)\.json", os.path.basename(source or ""))
    if m is None:
        return TTA_PAGE, TTA_PREFIX
    return "BENCHMARKS-tta-%s.md" % m.group(1), "%s%s-" % (TTA_PREFIX, m.group(1))
PLUS_MINUS = "\u00b1"
SIGMA = "\u03c3"


def fmt_spread(agg, fmt=None, fmt_sd=None):
    """A seed summary figure (tta.mean_sd) as "mean ± σ" (σ to 2 significant digits unless
    fmt_sd says otherwise), the mean alone from one seed, a dash without any."""
    fmt = fmt or (lambda x: fmt_sig(x, 4))
    fmt_sd = fmt_sd or (lambda x: fmt_sig(x, 2))
    if agg is None or agg["mean"] is None:
        return DASH
    text = fmt(agg["mean"])
    if agg["sd"] is not None:
        text += " %s %s" % (PLUS_MINUS, fmt_sd(agg["sd"]))
    return text


def seed_groups(runs):
    """{seed: runs of that seed} in order of first appearance."""
    out = {}
    for r in runs:
        out.setdefault(r.get("seed", 0), []).append(r)
    return out


def first_seed_runs(runs):
    """The rows of the first seed (one per configuration, for the per-step plots)."""
    groups = seed_groups(runs)
    return groups[next(iter(groups))] if groups else []


def baselines_by_seed(runs):
    return {seed: find_baseline(rs) for seed, rs in seed_groups(runs).items()}


def plot_tta_loss_time(plt, runs, title, colors, path):
    """The running-mean evaluation loss (the stop rule's) against training time, every seed: the
    first seed's rows drawn and labelled, the other seeds' thin and unlabelled; the first seed's
    target (its baseline's final loss) and time cap, and the mean target over the seeds."""
    fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    groups = seed_groups(runs)
    first = next(iter(groups)) if groups else None
    last_times = []
    for seed, rs in groups.items():
        for run in rs:
            if not ok(run) or not run["eval"]:
                continue
            st = _style(run, colors)
            ev = run["eval"]
            xs = [e["seconds"] for e in ev]
            ys = [tta.running_mean(ev, i) for i in range(len(ev))]
            if seed == first:
                ax.plot(xs, ys, marker="o", markersize=3, label=run["label"], **st)
            else:
                st["linewidth"] = 0.8
                ax.plot(xs, ys, alpha=0.35, **st)
            last_times.append(xs[-1])
    bases = {s: b for s, b in baselines_by_seed(runs).items() if ok(b)}
    if first in bases:
        b = bases[first]
        ax.axhline(b["final_loss"], color="#333333", linewidth=1.0, linestyle=":",
                   label="target, seed %d: DDP's final loss (%s)" % (first, fmt_sig(b["final_loss"], 4)))
        ax.axvline(tta.training_seconds(b), color="#333333", linewidth=0.8, linestyle="-.",
                   label="time cap, seed %d: DDP's training time (%s s)"
                   % (first, fmt_sig(tta.training_seconds(b), 3)))
    if len(bases) > 1:
        m = tta.mean_sd([b["final_loss"] for b in bases.values()])
        ax.axhline(m["mean"], color="#999999", linewidth=1.0, linestyle="--",
                   label="mean target over %d seeds (%s %s %s)"
                   % (m["n"], fmt_sig(m["mean"], 4), PLUS_MINUS, fmt_sig(m["sd"], 2)))
    if len(groups) > 1:
        ax.plot([], [], color="#555555", linewidth=0.8, alpha=0.35,
                label="other seeds (thin, same colours)")
    if not last_times:
        _empty(ax)
    elif min(last_times) > 0 and max(last_times) / min(last_times) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("cumulative training time, rank 0 (s)")
    ax.set_ylabel("evaluation loss, running mean of %d evaluations" % tta.WINDOW)
    _title(ax, title, "time to accuracy: running-mean evaluation loss against training time")
    _finish(plt, fig, ax, path, [r for r in runs if r.get("seed", 0) == first])


def _tta_stopped(run):
    stop = run.get("stop")
    if stop:
        return "%d (%s)" % (stop["step"], stop["reason"] or "?")
    if run.get("baseline"):
        return "%s (horizon)" % run.get("steps")
    return str(run.get("steps")) if run.get("steps") is not None else DASH


def _tta_summary_table(summary):
    head = ["configuration", "seeds", "reached target", "steps to target", "time to target (s)",
            "loss at equal steps", "%s vs DDP at equal steps" % "\u0394", "loss at equal time",
            "at DDP's time", "wire per step per rank", "dense share", "median step (s)"]
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join([":--", ":--"] + ["--:"] * (len(head) - 2)) + " |"]
    for e in summary:
        n = e["finished"]
        label = md_cell(e["label"])
        if e["config"] == BASELINE_CONFIG:
            label = "**%s** (baseline)" % label
        seeds = "%s (n = %d)" % (", ".join(str(x) for x in e["seeds"]), n)
        if n == 0:
            lines.append("| " + " | ".join([label, seeds] + [DASH] * (len(head) - 2)) + " |")
            continue
        steps = e["equal_steps"]
        at = ("" if not steps else " at step %d" % steps[0] if len(steps) == 1
              else " at steps %d%s%d" % (steps[0], "\u2013", steps[-1]))
        cells = [label, seeds, "%d of %d" % (e["reached"], n),
                 fmt_spread(e["steps_to_target"], lambda x: fmt_sig(x, 3)),
                 fmt_spread(e["time_to_target"], lambda x: fmt_sig(x, 3)),
                 fmt_spread(e["loss_at_equal_steps"]) + at,
                 fmt_spread(e["delta_loss_at_equal_steps"], lambda x: "%+.4f" % x,
                            lambda x: "%.4f" % x),
                 fmt_spread(e["loss_at_equal_time"]),
                 "%d of %d" % (e["at_baseline_time"], n),
                 fmt_spread(e["wire_bytes_per_step_per_rank"], fmt_bytes, fmt_bytes),
                 fmt_spread(e["dense_share"], lambda x: "%.1f %%" % (100 * x)),
                 fmt_spread(e["median_step_seconds"], lambda x: fmt_sig(x, 3))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _tta_runs_table(runs, notes):
    head = ["configuration", "seed", "status", "stopped after step", "steps to target",
            "time to target (s)", "loss at equal steps", "loss at equal time", "training time (s)",
            "wire per step per rank", "median step (s)", "final loss"]
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join([":--", "--:", ":--"] + ["--:"] * (len(head) - 3)) + " |"]
    for run in runs:
        status = status_cell(run, notes)
        label = md_cell(run["label"]) if not run.get("baseline") else \
            "**%s** (baseline)" % md_cell(run["label"])
        fig = run.get("tta") if ok(run) else None
        if not ok(run) or fig is None:
            cells = [label, str(run.get("seed", 0)), md_cell(status)] + [DASH] * (len(head) - 3)
        else:
            eq_steps = DASH if fig["loss_at_equal_steps"] is None else "%s (step %d)" % (
                fmt_sig(fig["loss_at_equal_steps"], 4), fig["equal_steps"])
            eq_time = DASH if fig["loss_at_equal_time"] is None else "%s (%s)" % (
                fmt_sig(fig["loss_at_equal_time"], 4),
                "at DDP's time" if fig["at_baseline_time"] else
                "last evaluation, %s s" % fmt_sig(fig["equal_time_seconds"], 3))
            cells = [label, str(run.get("seed", 0)), md_cell(status), _tta_stopped(run),
                     DASH if fig["steps_to_target"] is None else str(fig["steps_to_target"]),
                     "not reached" if fig["time_to_target"] is None
                     else fmt_sig(fig["time_to_target"], 3),
                     eq_steps, eq_time, fmt_sig(tta.training_seconds(run), 3),
                     fmt_bytes(run["wire_bytes_per_step_per_rank"]),
                     fmt_sig(run["median_step_seconds"], 3), fmt_sig(run["final_loss"], 4)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _tta_baseline_lines(runs):
    """The DDP baseline's spread over seeds (the accuracy tolerance) and each seed's target."""
    bases = [(s, b) for s, b in baselines_by_seed(runs).items() if b is not None]
    done = [(s, b) for s, b in bases if ok(b)]
    if not done:
        return ["No finished DDP baseline in this group: no target, so the other rows did not "
                "run (or have no time-to-accuracy figures)."]
    m = tta.mean_sd([b["final_loss"] for s, b in done])
    if m["sd"] is not None:
        head = ("**DDP's final loss over %d seeds: %s %s %s** (%s: the sample standard deviation "
                "over seeds). It sets the accuracy tolerance: a row's loss within about %s of "
                "DDP's is within the seed-to-seed spread of DDP itself."
                % (m["n"], fmt_sig(m["mean"], 4), PLUS_MINUS, fmt_sig(m["sd"], 2), SIGMA, SIGMA))
    else:
        head = ("**DDP's final loss: %s, from one seed**: no standard deviation, so no accuracy "
                "tolerance from this run (--seeds with several seeds gives one)."
                % fmt_sig(m["mean"], 4))
    per = "; ".join("seed %d: target %s, cap %s s / %s steps" % (
        s, fmt_sig(b["final_loss"], 4), fmt_sig(tta.training_seconds(b), 3), b["steps"])
        for s, b in done)
    missing = [s for s, b in bases if not ok(b)]
    out = [head, "", "Targets and caps per seed: %s." % per]
    if missing:
        out.append("The baseline of seed%s %s did not finish: that seed's other rows have no target."
                   % ("s" if len(missing) > 1 else "", ", ".join(str(s) for s in missing)))
    return out


def render_tta_markdown(results, source, group_info):
    """The text of BENCHMARKS-tta.md. group_info: [(title, runs, {kind: relative png path})]."""
    w = results["world_size"]
    t = results["tta"]
    L = ["# End-to-end training benchmark: time to accuracy", "",
         "<!-- generated by bench/e2e/report.py from %s; do not edit by hand -->" % source, ""]
    horizon = ", ".join("%s %s steps, evaluated every %s" % (k, v, (t.get("eval_every") or {}).get(k))
                        for k, v in sorted((t.get("horizon") or {}).items()))
    L.append(
        "Real PyTorch data-parallel training as on the fixed-step page (BENCHMARKS.md): %d ranks on "
        "the CPU in a network namespace whose loopback is rate-limited with `tc`. Here each row "
        "trains until it reaches the DDP baseline's accuracy rather than for a fixed number of "
        "steps. Per task, rate and seed the DDP baseline trains the fixed horizon (%s); its final "
        "loss is the target of every other row of that seed and its training time the cap. A row "
        "stops once the running mean of %s consecutive evaluations is at most the target and %s "
        "more evaluation periods have run, or at the baseline's training time or step count, "
        "whichever comes first. Seeds: %s." % (
            w, horizon or "unknown", t.get("window", tta.WINDOW), t.get("extra_evals", "?"),
            ", ".join(str(x) for x in t.get("seeds") or []) or "unknown"))
    L.append("")
    L.append("Generated by `bench/e2e/report.py` from `%s`. The results were produced by this "
             "command (authoritative for these figures):" % source)
    L.append("")
    L.append(md_code_block(results["command"]))
    L.append("")
    est = t.get("estimate") or {}
    if est.get("at_most") is not None:
        L.append("Estimated beforehand: at most %s min for %s rows (every row to its cap); "
                 "measured: below." % (fmt_sig(est["at_most"] / 60.0, 3), est.get("rows")))
        L.append("")
    L.append("## Machine and run")
    L.append("")
    L += _machine_lines(results)
    L.append("")
    L.append("## Results")
    L.append("")
    for title, runs, pngs in group_info:
        L.append("### %s" % title)
        L.append("")
        facts = model_facts(runs)
        facts.append("%d ranks" % w)
        L.append(", ".join(facts) + ".")
        L.append("")
        L += _tta_baseline_lines(runs)
        L.append("")
        L.append("Per configuration, over its seeds (mean %s %s; the mean alone from one seed; "
                 "time and steps to the target over the seeds that reached it):" % (PLUS_MINUS, SIGMA))
        L.append("")
        L += _tta_summary_table(tta.seed_summary(runs))
        L.append("")
        L.append("Every row:")
        L.append("")
        notes = []
        L += _tta_runs_table(runs, notes)
        L.append("")
        if notes:
            L += _footnotes(notes)
        for kind, caption in (("loss-time", "running-mean evaluation loss against training time, "
                               "every seed, with the target"),
                              ("loss-step", "training loss per step, first seed"),
                              ("step-time", "median step time, first seed")):
            L.append("![%s: %s](%s)" % (md_cell(title), caption, pngs[kind]))
            L.append("")
    L.append("## Method")
    L.append("")
    L.append("- **Target and caps**: per (task, rate, seed), the DDP baseline's final loss (the "
             "mean of its last %d evaluations on the fixed evaluation set), its training time "
             "(rank 0's timed steps, evaluation excluded) and %d times its steps. Each seed draws its own "
             "task (the MLP's teacher network, evaluation set and batches) and initial weights, "
             "so each row is compared with the baseline of its own seed." % (tta.WINDOW,
                                                                        tta.STEP_CAP_FACTOR))
    L.append("- **Stop rule**: every rank of a row stops after the same step: rank 0 evaluates and "
             "decides at the evaluation steps only, and broadcasts its decision to the others "
             "over gloo. It stops once the mean of %d consecutive evaluations came to or below "
             "the target and the extra evaluation periods have run (*target*), at the step cap "
             "(*steps*), or when the next evaluation period, at the step time of the "
             "one before, would end after the baseline's training time (*time*). The "
             "evaluation cadence is the same for every row of a task." % tta.WINDOW)
    L.append("- **Steps and time to target**: the step and the cumulative training time of the "
             "first evaluation whose running mean of %d is at most the target; over the seeds, "
             "the mean of those that reached it (\"reached target\" counts them)." % tta.WINDOW)
    L.append("- **Loss at equal steps**: the row's evaluation loss at the largest evaluation step "
             "it shares with its baseline (the baseline's last step if it ran that far); "
             "**\u0394 vs DDP** is that loss minus the baseline's at the same step, same seed.")
    L.append("- **Loss at equal time**: the row's running-mean evaluation loss at the baseline's "
             "training time when it trained that long or the time cap stopped it (\"at DDP's "
             "time\"), else at its last evaluation (the row stopped earlier: on the target or at "
             "the step cap).")
    L.append("- **Wire per step per rank**: bytes counted on the namespace's loopback during the "
             "timed steps / the steps the row ran / the world size, as on the fixed-step page.")
    L.append("- **Dense share**: the share of the gradient elements the sidecar averaged that it "
             "sent dense over the timed steps, from the hook's counters (`LightwireHookState."
             "dense_share`: a layer, or a flat bucket, counts as dense when its reply says codec "
             "`none` or a dense mode: 1-D and small layers, PowerSGD before its start step, "
             "bypass and full-sync steps); %s for rows without the sidecar." % DASH)
    L.append("- **Spread**: mean %s %s over the seeds a configuration trained, %s the sample "
             "standard deviation (n %s 1 in the denominator); n counts the seeds with a finished "
             "row." % (PLUS_MINUS, SIGMA, SIGMA, "\u2212"))
    return "\n".join(L) + "\n"


def write_tta_report(results, out_dir, source):
    """write_report for time-to-accuracy results: OUT/BENCHMARKS-tta.md and
    OUT/benchmarks/tta-*.png (names from `source`: tta_names); returns the paths written."""
    page, prefix = tta_names(source)
    plt = _pyplot()
    img_dir = os.path.join(out_dir, "benchmarks")
    os.makedirs(img_dir, exist_ok=True)
    colors = color_map(results["runs"])
    written, group_info = [], []
    for (task, rate), runs in group_runs(results["runs"]):
        title, short = _group_title(task, rate, runs)
        first = first_seed_runs(runs)
        base = find_baseline(first)
        stem = "%s%s-%s" % (prefix, safe_name(task), safe_name(rate))
        pngs = {}
        for kind in ("loss-time", "loss-step", "step-time"):
            name = "%s-%s.png" % (stem, kind)
            path = os.path.join(img_dir, name)
            if kind == "loss-time":
                plot_tta_loss_time(plt, runs, title, colors, path)
            elif kind == "loss-step":
                plot_loss_step(plt, first, title, colors, path)
            else:
                plot_step_time(plt, first, base, title, colors, path)
            log("wrote %s" % path)
            written.append(path)
            pngs[kind] = "benchmarks/" + name
        group_info.append((title, runs, pngs))
    md = render_tta_markdown(results, source, group_info)
    md_path = os.path.join(out_dir, page)
    tmp = md_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(md)
    os.replace(tmp, md_path)
    log("wrote %s" % md_path)
    written.append(md_path)
    return written


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------
def write_report(results, out_dir, source="the results JSON", speed=()):
    """Writes OUT/BENCHMARKS.md and OUT/benchmarks/*.png (time-to-accuracy results:
    OUT/BENCHMARKS-tta.md and OUT/benchmarks/tta-*.png); returns the paths written.

    `source`: the results file's name for the generated-by line. `speed`: (file name, results of
    bench/e2e/speed.py) pairs, summarised in a section of the fixed-step page. Raises ReportError
    when `results` or a speed result is malformed (nothing is written then)."""
    validate(results)
    for name, sp in speed:
        validate_speed(sp, name)
    if results.get("tta") is not None:
        return write_tta_report(results, out_dir, source)
    plt = _pyplot()
    img_dir = os.path.join(out_dir, "benchmarks")
    os.makedirs(img_dir, exist_ok=True)
    colors = color_map(results["runs"])
    written = []
    group_info = []
    for (task, rate), runs in group_runs(results["runs"]):
        title, short = _group_title(task, rate, runs)
        base = find_baseline(runs)
        stem = "%s-%s" % (safe_name(task), safe_name(rate))
        pngs = {}
        for kind in ("loss-step", "loss-time", "step-time"):
            name = "%s-%s.png" % (stem, kind)
            path = os.path.join(img_dir, name)
            if kind == "loss-step":
                plot_loss_step(plt, runs, title, colors, path)
            elif kind == "loss-time":
                plot_loss_time(plt, runs, base, title, colors, path)
            else:
                plot_step_time(plt, runs, base, title, colors, path)
            log("wrote %s" % path)
            written.append(path)
            pngs[kind] = "benchmarks/" + name
        group_info.append((title, runs, base, pngs))
    md = render_markdown(results, source, group_info, speed)
    md_path = os.path.join(out_dir, "BENCHMARKS.md")
    tmp = md_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(md)
    os.replace(tmp, md_path)
    log("wrote %s" % md_path)
    written.append(md_path)
    return written


def main(argv=None):
    repo = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    ap = argparse.ArgumentParser(description="Render the e2e benchmark results JSON as "
                                 "docs/BENCHMARKS.md and PNG plots.")
    ap.add_argument("results", help="results JSON written by bench/e2e/e2e.py")
    ap.add_argument("--out-dir", default=os.path.join(repo, "docs"),
                    help="directory for BENCHMARKS.md and benchmarks/*.png (default: the "
                         "repository's docs/)")
    ap.add_argument("--speed", nargs="+", default=[], metavar="SPEED_JSON",
                    help="results of bench/e2e/speed.py to summarise in the fixed-step page's "
                         "step-speed section")
    args = ap.parse_args(argv)
    loaded = []
    for path in [args.results] + args.speed:
        try:
            with open(path, "r", encoding="utf-8") as f:
                loaded.append(json.load(f))
        except OSError as e:
            print("report: error: cannot read %s: %s" % (path, e.strerror or e), file=sys.stderr)
            return 2
        except (ValueError, UnicodeDecodeError) as e:
            print("report: error: %s is not valid JSON: %s" % (path, e), file=sys.stderr)
            return 2
    results = loaded[0]
    speed = [(os.path.basename(p), sp) for p, sp in zip(args.speed, loaded[1:])]
    try:
        write_report(results, args.out_dir, source=os.path.basename(args.results), speed=speed)
    except ReportError as e:
        print("report: error: %s: malformed results: %s" % (args.results, e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
