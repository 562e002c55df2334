"""The time-to-accuracy profile of bench/e2e/e2e.py (--tta): the stop rule and the per-row and
per-seed figures of bench/e2e/tta.py on synthetic evaluation sequences, the profile's plan and time
estimate, report.py's tta page on synthetic results, and a smoke run (tiny models, 2 ranks, 2
seeds, 3 configurations) that checks that every rank of a row stops after the same step and that
the results carry the figures. The smoke run needs root, network namespaces and the sidecar
(skipped otherwise, saying why); the synthetic tests need only matplotlib."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
E2E_DIR = os.path.join(REPO, "bench", "e2e")
PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tta = _load("e2e_tta", os.path.join(E2E_DIR, "tta.py"))
e2e = _load("e2e_main", os.path.join(E2E_DIR, "e2e.py"))


def evals_of(losses, every=10, seconds_per_step=1.0, start=0):
    """Evaluation records every `every` steps with the given losses, at a constant step time."""
    return [{"step": (start + i + 1) * every, "seconds": (start + i + 1) * every * seconds_per_step,
             "loss": x} for i, x in enumerate(losses)]


def simulate(loss_at, target, extra_steps, cap_seconds, max_steps, every, step_seconds):
    """The worker's loop on paper: one evaluation per evaluation step, the decision after each.
    loss_at(step) -> evaluation loss; step_seconds(step) -> that step's time. Returns (stop step,
    reason, evals)."""
    evals, elapsed = [], 0.0
    for step in range(1, max_steps + 1):
        elapsed += step_seconds(step)
        if not tta.is_eval_step(step, every, max_steps):
            continue
        evals.append({"step": step, "seconds": elapsed, "loss": loss_at(step)})
        reason = tta.stop_decision(evals, target, extra_steps, cap_seconds, max_steps, every)
        if reason is not None:
            return step, reason, evals
    raise AssertionError("the rule never stopped (it must, at max_steps)")


# ------------------------------------------------------------------------------------------------
# The stop rule
# ------------------------------------------------------------------------------------------------
def test_reached_at_the_first_running_mean_at_or_below_the_target():
    # Running means (window 3) from index 2: 1.5, 1.2333, 1.4333, 1.1 (== target: reached), 1.05.
    ev = evals_of([2.0, 0.5, 2.0, 1.2, 1.1, 1.0, 0.95])
    assert tta.first_reached(ev, 1.1) == 5
    # A single low evaluation does not count, nor a mean of fewer than three: three are needed.
    assert tta.first_reached(evals_of([0.5, 2.0, 2.0, 2.0]), 0.6) is None
    assert tta.first_reached(ev, 1.3) == 3  # (2.0 + 0.5) / 2 = 1.25 at index 1 is not a mean of 3
    assert tta.first_reached(ev, 1.0999) == 6
    assert tta.first_reached(ev, 0.5) is None
    assert tta.first_reached(ev, None) is None
    assert tta.running_mean(ev, 4) == pytest.approx((2.0 + 1.2 + 1.1) / 3)
    assert tta.running_mean(ev, 0) == 2.0  # fewer than 3 at the start


def test_target_then_extra_steps():
    # Loss 3 - step/100: the running mean at step s is 3 - (s - 10)/100; <= 2.0 first at s = 110.
    loss = lambda s: 3.0 - s / 100.0  # noqa: E731
    one = lambda s: 0.1  # noqa: E731
    step, reason, ev = simulate(loss, 2.0, 30, 1e9, 400, 10, one)
    assert tta.first_reached(ev, 2.0) == 10 and ev[10]["step"] == 110
    assert (step, reason) == (140, "target")  # reached at 110, 3 periods more
    assert simulate(loss, 2.0, 0, 1e9, 400, 10, one)[:2] == (110, "target")
    # Extra steps that are not a multiple of the period: the first evaluation after them.
    assert simulate(loss, 2.0, 25, 1e9, 400, 10, one)[:2] == (140, "target")
    # Before the extra steps have run, the rule goes on although the target is reached.
    assert tta.stop_decision(ev[:13], 2.0, 30, 1e9, 400, 10) is None


def test_cap_by_steps():
    never = lambda s: 5.0  # noqa: E731
    one = lambda s: 0.1  # noqa: E731
    assert simulate(never, 2.0, 30, 1e9, 400, 10, one)[:2] == (400, "steps")
    # A cap that is not a multiple of the period: the last step is an evaluation step too.
    assert simulate(never, 2.0, 30, 1e9, 95, 10, one)[:2] == (95, "steps")
    # Reached on the last allowed step, extra steps not run: "steps", not "target".
    loss = lambda s: 3.0 - s / 100.0  # noqa: E731
    assert simulate(loss, 2.0, 30, 1e9, 120, 10, one)[:2] == (120, "steps")
    # Reached with the extra steps done exactly on the last step: "target" comes first.
    assert simulate(loss, 2.0, 10, 1e9, 120, 10, one)[:2] == (120, "target")


def test_cap_by_time_never_passes_the_baseline_time():
    never = lambda s: 5.0  # noqa: E731
    # 1 s a step, cap 55 s: after step 50 (50 s) the next period would end at 60 s: stop there.
    step, reason, ev = simulate(never, 2.0, 30, 55.0, 400, 10, lambda s: 1.0)
    assert (step, reason) == (50, "time") and ev[-1]["seconds"] <= 55.0
    # Exactly at the cap: the period that ends on it runs.
    assert simulate(never, 2.0, 30, 60.0, 400, 10, lambda s: 1.0)[:2] == (60, "time")
    # The projection follows the step time of the period before: slower from step 31 on.
    step, reason, ev = simulate(never, 2.0, 30, 100.0, 400, 10,
                                lambda s: 1.0 if s <= 30 else 3.0)
    assert (step, reason) == (50, "time")  # 30 + 20 * 3 = 90 s; 90 + 30 > 100
    assert ev[-1]["seconds"] == pytest.approx(90.0)
    # The first evaluation projects from its own mean step time; a row already past the cap stops.
    assert tta.stop_decision(evals_of([5.0], seconds_per_step=2.0), 2.0, 0, 25.0, 400, 10) == "time"
    assert tta.stop_decision(evals_of([5.0], seconds_per_step=2.0), 2.0, 0, 40.0, 400, 10) is None
    assert tta.stop_decision(evals_of([5.0, 5.0], seconds_per_step=3.0), 2.0, 0, 30.0, 400,
                             10) == "time"
    # No cap (cap_seconds None): only the target and the steps stop it.
    assert simulate(never, 2.0, 30, None, 70, 10, lambda s: 100.0)[:2] == (70, "steps")
    # The reason codes round-trip (what the worker broadcasts).
    for r in (None,) + tta.REASONS:
        assert tta.reason_of(tta.reason_code(r)) == r
    assert tta.reason_code(None) == 0


# ------------------------------------------------------------------------------------------------
# The figures of a row and over seeds
# ------------------------------------------------------------------------------------------------
BASE_LOSSES = [2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.25, 1.2, 1.15, 1.1]  # steps 10 ... 100


def base_row(losses=BASE_LOSSES, seconds_per_step=1.0, seed=0):
    ev = evals_of(losses, seconds_per_step=seconds_per_step)
    n = ev[-1]["step"]
    return {"task": "mlp", "rate": "1gbit", "config": "ddp", "label": "DDP", "baseline": True,
            "status": "ok", "seed": seed, "eval": ev, "step_seconds": [seconds_per_step] * n,
            "final_loss": sum(e["loss"] for e in ev[-3:]) / 3, "steps": n,
            "wire_bytes_per_step_per_rank": 30e6, "median_step_seconds": seconds_per_step}


def other_row(losses, seconds_per_step, reason, config="lightwire_dgc", seed=0, wire=1e6):
    ev = evals_of(losses, seconds_per_step=seconds_per_step)
    n = ev[-1]["step"]
    return {"task": "mlp", "rate": "1gbit", "config": config, "label": config, "baseline": False,
            "status": "ok", "seed": seed, "eval": ev, "step_seconds": [seconds_per_step] * n,
            "final_loss": sum(e["loss"] for e in ev[-3:]) / 3, "steps": n,
            "stop": None if reason is None else {"reason": reason, "step": n},
            "wire_bytes_per_step_per_rank": wire, "median_step_seconds": seconds_per_step}


def test_row_figures_stopped_on_the_target():
    base = base_row()
    assert base["final_loss"] == pytest.approx(1.15)
    # Reaches 1.15 in running mean at step 60 ((1.2 + 1.15 + 1.1) / 3), 3 periods more: step 90,
    # at 0.2 s/step (18 s of the baseline's 100).
    row = other_row([2.1, 1.7, 1.4, 1.2, 1.15, 1.1, 1.1, 1.05, 1.0], 0.2, "target")
    f = tta.row_figures(row, base)
    assert f["target"] == pytest.approx(1.15) and f["cap_seconds"] == 100 and f["cap_steps"] == 100
    assert f["steps_to_target"] == 60 and f["time_to_target"] == pytest.approx(12.0)
    assert f["equal_steps"] == 90 and f["loss_at_equal_steps"] == 1.0
    assert f["base_loss_at_equal_steps"] == 1.15
    assert f["delta_loss_at_equal_steps"] == pytest.approx(-0.15)
    # It stopped long before the baseline's time: at its last evaluation, flagged so.
    assert f["at_baseline_time"] is False and f["equal_time_seconds"] == pytest.approx(18.0)
    assert f["loss_at_equal_time"] == pytest.approx((1.1 + 1.05 + 1.0) / 3)
    assert f["wire_bytes_per_step_per_rank"] == 1e6 and f["dense_share"] is None
    assert f["stop_reason"] == "target" and f["stop_step"] == 90


def test_row_figures_time_capped_and_longer_than_the_baseline():
    base = base_row()
    # Stopped by the time cap at step 40 (2.4 s/step: 96 s): compared at the baseline's time.
    row = other_row([2.2, 2.0, 1.9, 1.8], 2.4, "time")
    f = tta.row_figures(row, base)
    assert f["steps_to_target"] is None and f["time_to_target"] is None
    assert f["at_baseline_time"] is True and f["equal_time_seconds"] == pytest.approx(96.0)
    assert f["loss_at_equal_time"] == pytest.approx((2.0 + 1.9 + 1.8) / 3)
    assert f["equal_steps"] == 40 and f["delta_loss_at_equal_steps"] == pytest.approx(1.8 - 1.5)
    # A fixed-step row that ran 120 steps at 1.5 s/step (180 s): equal steps at the baseline's
    # final step (100), equal time at its last evaluation within 100 s (step 60, 90 s).
    row = other_row([2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.2, 1.1, 1.0, 0.9, 0.8, 0.7], 1.5, None)
    f = tta.row_figures(row, base)
    assert f["equal_steps"] == 100 and f["loss_at_equal_steps"] == 0.9
    assert f["at_baseline_time"] is True and f["equal_time_seconds"] == pytest.approx(90.0)
    assert f["loss_at_equal_time"] == pytest.approx((1.5 + 1.4 + 1.3) / 3)
    assert f["stop_reason"] is None
    # The baseline against itself: the target is its own final running mean, at its own time.
    f = tta.row_figures(base, base)
    assert f["at_baseline_time"] is True and f["loss_at_equal_time"] == pytest.approx(1.15)
    assert f["steps_to_target"] == 100 and f["delta_loss_at_equal_steps"] == 0


def test_mean_sd_and_seed_summary():
    assert tta.mean_sd([1.0, 1.2, 1.4]) == {"mean": pytest.approx(1.2), "sd": pytest.approx(0.2),
                                            "n": 3}
    assert tta.mean_sd([2.0, None]) == {"mean": 2.0, "sd": None, "n": 1}
    assert tta.mean_sd([None]) == {"mean": None, "sd": None, "n": 0}
    rows = []
    for seed, (shift, spp) in enumerate([(0.0, 1.0), (0.1, 1.1), (-0.1, 0.9)]):
        base = base_row([x + shift for x in BASE_LOSSES], spp, seed)
        # Reaches the target in seeds 0 and 1; seed 2's row stops at the steps cap without.
        if seed < 2:
            losses = [x + shift for x in [2.1, 1.7, 1.4, 1.2, 1.15, 1.1, 1.1, 1.05, 1.0]]
            row = other_row(losses, 0.2 * (1 + seed), "target", seed=seed, wire=1e6 * (1 + seed))
        else:
            row = other_row([3.0] * 10, 0.2, "steps", seed=seed, wire=3e6)
        pair = [base, row]
        for r in pair:
            r["tta"] = tta.row_figures(r, base)
        rows += pair
    rows.append({"task": "mlp", "rate": "1gbit", "config": "ddp_fp16", "label": "fp16",
                 "status": "failed", "seed": 0, "tta": None})
    s = {e["config"]: e for e in tta.seed_summary(rows)}
    assert list(s) == ["ddp", "lightwire_dgc", "ddp_fp16"]
    d = s["lightwire_dgc"]
    assert d["seeds"] == [0, 1, 2] and d["finished"] == 3 and d["reached"] == 2
    assert d["steps_to_target"] == {"mean": 60.0, "sd": 0.0, "n": 2}
    assert d["time_to_target"]["mean"] == pytest.approx((12.0 + 24.0) / 2)
    assert d["time_to_target"]["sd"] == pytest.approx(math.sqrt(2 * 6.0 ** 2))
    assert d["wire_bytes_per_step_per_rank"]["mean"] == pytest.approx(2e6)
    assert d["wire_bytes_per_step_per_rank"]["sd"] == pytest.approx(1e6)
    assert d["dense_share"] == {"mean": None, "sd": None, "n": 0}
    assert d["equal_steps"] == [90, 100]
    # DDP's final loss over seeds: 1.15 + (0, 0.1, -0.1): sd 0.1 (the accuracy tolerance).
    b = s["ddp"]["final_loss"]
    assert b["mean"] == pytest.approx(1.15) and b["sd"] == pytest.approx(0.1) and b["n"] == 3
    assert s["ddp_fp16"]["finished"] == 0 and s["ddp_fp16"]["final_loss"]["mean"] is None


# ------------------------------------------------------------------------------------------------
# The profile: seeds, plan, estimate
# ------------------------------------------------------------------------------------------------
def test_profile_seeds_and_plan():
    prof = e2e.PROFILES["tta"]
    assert prof["steps"] == {"mlp": 400, "lm": 300} and prof["configs"][0] == "ddp"
    by_name = {c[0]: c for c in e2e.ALL_CONFIGS}
    assert "--approx-rank" in by_name["lightwire_powersgd4"][4]
    assert by_name["lightwire_powersgd4"][4][by_name["lightwire_powersgd4"][4].index(
        "--approx-rank") + 1] == "4"
    # The fixed-step profiles keep their configurations.
    assert "lightwire_powersgd4" not in [c[0] for c in e2e.CONFIGS]
    assert "lightwire_dgc_flat" in prof["configs"] and by_name["lightwire_dgc_flat"][3] == "flat"
    multi = {"ddp", "lightwire_dgc", "lightwire_topk", "lightwire_qsgd4", "lightwire_powersgd4"}
    for name in prof["configs"]:
        want = [0, 1, 2] if name in multi else [0]
        assert e2e.seeds_for(prof, name, [0, 1, 2]) == want, name
    configs = [by_name[n] for n in prof["configs"]]
    plan = e2e.plan_runs(prof, configs, [0, 1, 2])
    assert len(plan) == 3 * len(multi) + (len(configs) - len(multi)) == 24
    for seed in (0, 1, 2):
        rows = [p for p in plan if p[2] == seed]
        assert rows[0][3][0] == "ddp", "each seed's baseline runs first"
        assert {p[3][0] for p in rows} == (set(prof["configs"]) if seed == 0 else multi)
    # Fixed-step profiles: one seed, every configuration, in order.
    quick = e2e.plan_runs(e2e.PROFILES["quick"], e2e.CONFIGS, [0])
    assert [p[3][0] for p in quick] == [c[0] for c in e2e.CONFIGS]
    assert e2e.seeds_for({"config_seeds": {"*": "all"}}, "x", [4, 5]) == [4, 5]
    with pytest.raises(ValueError):
        e2e.seeds_for({"config_seeds": {"x": "some"}}, "x", [0])
    # A task's own rules win over the profile's: here the error-feedback dgc row trains every seed
    # on the LM, one seed on the MLP.
    per_task = dict(prof, tasks=["lm", "mlp"],
                    task_config_seeds={"lm": {"lightwire_dgc_ef": "all"}})
    both = e2e.plan_runs(per_task, configs, [0, 1, 2])
    assert [p[2] for p in both if p[0] == "lm" and p[3][0] == "lightwire_dgc_ef"] == [0, 1, 2]
    assert [p[2] for p in both if p[0] == "mlp" and p[3][0] == "lightwire_dgc_ef"] == [0]


def test_estimate():
    prof = dict(e2e.PROFILES["tta"], tasks=["mlp"], steps={"mlp": 400}, eval_every={"mlp": 10})
    table = {("mlp", "1gbit"): {"ddp": 1.0, "fast": 0.1, "faster": 0.05, "slow": 2.0,
                                "unknown": None}}
    cfg = lambda n: (n, n, "lightwire", None, [])  # noqa: E731
    ev = e2e.EVAL_SECONDS["mlp"]
    start = e2e.ROW_START_SECONDS
    plan = [("mlp", "1gbit", 0, cfg("ddp")), ("mlp", "1gbit", 0, cfg("fast")),
            ("mlp", "1gbit", 0, cfg("faster")), ("mlp", "1gbit", 0, cfg("slow")),
            ("mlp", "1gbit", 0, cfg("unknown"))]
    est = e2e.estimate_seconds(prof, plan, table)
    assert tta.STEP_CAP_FACTOR == 10
    base = 400 + start + 40 * ev
    fast = 400 + start + 400 * ev          # the baseline's 400 s: 4000 steps at 0.1 s
    faster = 200 + start + 400 * ev        # the step cap: 10 x 400 steps at 0.05 s
    slow = 400 + start + 20 * ev           # the baseline's 400 s: 200 steps, 20 evaluations
    assert est["rows"] == 5 and est["baseline"] == pytest.approx(base)
    assert est["at_most"] == pytest.approx(base + fast + faster + slow + base)
    assert est["worst"] == pytest.approx(5 * base)
    # A rate without figures uses the 1 Gbit/s ones, and says so.
    est = e2e.estimate_seconds(prof, [("mlp", "500mbit", 0, cfg("ddp"))], table)
    assert est["at_most"] == pytest.approx(base) and "500mbit" in est["notes"][0]
    # "Expected": a row measured before takes what it took then (its mean over seeds, at most its
    # cap); the others their at-most figure.
    results = {"runs": [
        {"task": "mlp", "rate": "1gbit", "config": "fast", "status": "ok",
         "step_seconds": [0.1] * 300},
        {"task": "mlp", "rate": "1gbit", "config": "fast", "status": "ok",
         "step_seconds": [0.1] * 500},
        {"task": "mlp", "rate": "1gbit", "config": "slow", "status": "ok",
         "step_seconds": [2.0] * 400},  # longer than its cap now: the cap
        {"task": "mlp", "rate": "1gbit", "config": "faster", "status": "failed",
         "step_seconds": [0.05] * 3}]}
    measured = e2e.measured_row_seconds(results)
    assert measured[("mlp", "1gbit", "fast")] == (pytest.approx(40.0), 400)
    assert ("mlp", "1gbit", "faster") not in measured
    est = e2e.estimate_seconds(prof, plan, table, measured=measured)
    assert est["measured_rows"] == 2
    assert est["expected"] == pytest.approx(base + (40 + start + 40 * ev) + faster + slow + base)


def test_tta_stop_spec_from_the_baseline():
    base = base_row()
    spec = e2e.tta_stop_spec(base, 30)
    assert spec == {"target": pytest.approx(1.15), "extra_steps": 30, "cap_seconds": 100.0,
                    "steps": 10 * 100}


# ------------------------------------------------------------------------------------------------
# report.py on synthetic tta results
# ------------------------------------------------------------------------------------------------
def synthetic_results():
    rows = []
    for seed, shift in enumerate([0.0, 0.02, -0.02]):
        base = base_row([x + shift for x in BASE_LOSSES], 1.0, seed)
        others = [other_row([x + shift for x in [2.1, 1.7, 1.4, 1.2, 1.15, 1.1, 1.1, 1.05, 1.0]],
                            0.2, "target", seed=seed)]
        if seed == 0:
            others.append(other_row([2.0, 1.9, 1.8, 1.7, 1.6, 1.55, 1.5, 1.45, 1.42, 1.4], 0.5,
                                    "steps", config="lightwire_topk", seed=0))
            others.append({"task": "mlp", "rate": "1gbit", "config": "ddp_powersgd",
                           "label": "DDP + PowerSGD hook", "kind": "torch_hook", "baseline": False,
                           "status": "failed", "error": "gloo::EnforceNotMet", "seed": 0})
        group = [base] + others
        for r in group:
            r.setdefault("kind", "lightwire" if r["config"].startswith("lightwire") else "ddp")
            if r["status"] == "ok":
                r.update(loss=[e["loss"] for e in r["eval"]] * 10, final_accuracy=None,
                         task_title="MLP classifier (synthetic)", rate_bits_per_second=1e9)
        e2e.add_time_to_baseline(group)
        e2e.add_tta_figures(group)
        rows += group
    return {"version": 1, "profile": "tta", "command": "bench/e2e/e2e.py --tta", "world_size": 4,
            "runs": rows, "tta": {"horizon": {"mlp": 100}, "eval_every": {"mlp": 10},
                                  "extra_evals": 3, "window": 3, "seeds": [0, 1, 2],
                                  "estimate": {"at_most": 3000.0, "rows": 7}}}


@pytest.fixture
def report():
    pytest.importorskip("matplotlib")
    return _load("e2e_report_tta", os.path.join(E2E_DIR, "report.py"))


def test_tta_report_tables(report, tmp_path):
    res = synthetic_results()
    paths = report.write_report(res, str(tmp_path), "results-tta.json")
    names = sorted(os.path.relpath(p, str(tmp_path)) for p in paths)
    assert names == ["BENCHMARKS-tta.md"] + ["benchmarks/tta-mlp-1gbit-%s.png" % k
                                             for k in ("loss-step", "loss-time", "step-time")]
    assert not (tmp_path / "BENCHMARKS.md").exists(), "the fixed-step page is left alone"
    # Another invocation's results, kept beside them, get a page and plots of their own.
    other = sorted(os.path.relpath(p, str(tmp_path))
                   for p in report.write_report(res, str(tmp_path), "results-tta-seed0.json"))
    assert other == ["BENCHMARKS-tta-seed0.md"] + [
        "benchmarks/tta-seed0-mlp-1gbit-%s.png" % k for k in ("loss-step", "loss-time", "step-time")]
    assert "results-tta-seed0.json" in (tmp_path / "BENCHMARKS-tta-seed0.md").read_text("utf-8")
    md = (tmp_path / "BENCHMARKS-tta.md").read_text(encoding="utf-8")
    # DDP's spread over seeds, prominently: final losses 1.15 + (0, 0.02, -0.02): sigma 0.02.
    assert "**DDP's final loss over 3 seeds: 1.150 \u00b1 0.020**" in md
    assert "seed 1: target 1.170, cap 100 s / 100 steps" in md
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and "(n = " in line:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0]] = cells
    dgc = rows["lightwire_dgc"]
    assert dgc[1] == "0, 1, 2 (n = 3)" and dgc[2] == "3 of 3"
    assert dgc[3] == "60.0 \u00b1 0" and dgc[4] == "12.0 \u00b1 0"
    # Loss at equal steps (step 90): 1.0 + (0, 0.02, -0.02): 1.000 ± 0.020.
    assert dgc[5] == "1.000 \u00b1 0.020 at step 90"
    assert dgc[6] == "-0.1500 \u00b1 0.0000" and dgc[8] == "0 of 3" and dgc[10] == "\u2014"
    topk = rows["lightwire_topk"]
    assert topk[1] == "0 (n = 1)" and topk[2] == "0 of 1" and topk[3] == "\u2014"
    assert "\u00b1" not in topk[5], "one seed: no spread"
    assert rows["DDP + PowerSGD hook"][1] == "0 (n = 0)"
    # Every row, per seed, with the failed one's error under the table.
    assert "| lightwire_dgc | 2 | ok | 90 (target) | 60 | 12.0 |" in md
    assert "| lightwire_topk | 0 | ok | 100 (steps) | \u2014 | not reached |" in md
    assert "gloo::EnforceNotMet" in md
    assert "from the hook's counters (`LightwireHookState.dense_share`" in md
    # Duplicates are per seed: the same configuration and seed twice is refused.
    res["runs"].append(dict(res["runs"][1]))
    with pytest.raises(report.ReportError, match="appears twice .* with seed 0"):
        report.write_report(res, str(tmp_path / "dup"))


def test_tta_loss_time_plot_has_the_target(report, tmp_path, monkeypatch):
    res = synthetic_results()
    seen = {}
    finish = report._finish

    def capture(plt, fig, ax, path, runs):
        if path.endswith("loss-time.png"):
            seen["lines"] = [(l.get_label(), list(l.get_ydata()), list(l.get_xdata()))
                             for l in ax.get_lines()]
        return finish(plt, fig, ax, path, runs)

    monkeypatch.setattr(report, "_finish", capture)
    report.write_report(res, str(tmp_path), "r.json")
    lines = {label: (y, x) for label, y, x in seen["lines"]}
    target = [k for k in lines if k.startswith("target, seed 0: DDP's final loss (1.150)")]
    assert target and all(v == pytest.approx(1.15) for v in lines[target[0]][0])
    mean = [k for k in lines if k.startswith("mean target over 3 seeds (1.150")]
    assert mean, list(lines)
    cap = [k for k in lines if k.startswith("time cap, seed 0")]
    assert cap and all(v == pytest.approx(100.0) for v in lines[cap[0]][1])
    # The first seed's rows are labelled; the rows drawn are running means.
    y, x = lines["lightwire_dgc"]
    assert y[2] == pytest.approx((2.1 + 1.7 + 1.4) / 3) and x[-1] == pytest.approx(18.0)


# ------------------------------------------------------------------------------------------------
# The smoke run
# ------------------------------------------------------------------------------------------------
SMOKE_CONFIGS = ["ddp", "ddp_fp16", "lightwire_dgc"]


def test_tta_smoke_every_rank_stops_after_the_same_step(tmp_path):
    from conftest import LIGHTWIRE_BIN
    from test_e2e_bench import skip_unless_e2e_runs
    skip_unless_e2e_runs()
    results = tmp_path / "results.json"
    env = dict(os.environ, LIGHTWIRE_BIN=LIGHTWIRE_BIN, PYTHON=PYTHON)
    r = subprocess.run([PYTHON, os.path.join(E2E_DIR, "e2e.py"), "--tta", "--smoke", "--seeds",
                        "0,1", "--configs", ",".join(SMOKE_CONFIGS), "--out-dir", str(tmp_path),
                        "--results", str(results)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "e2e: estimate: at most" in r.stderr
    data = json.loads(results.read_text())
    prof = e2e.PROFILES["tta-smoke"]
    horizon, every = prof["steps"]["mlp"], prof["eval_every"]["mlp"]
    extra = prof["extra_evals"] * every
    assert data["profile"] == "tta-smoke" and data["world_size"] == 2
    assert data["tta"]["seeds"] == [0, 1] and data["tta"]["horizon"] == {"mlp": horizon}
    order = [(row["config"], row["seed"]) for row in data["runs"]]
    # ddp_fp16 is not in the profile's multi-seed set: seed 0 only; each seed's baseline first.
    assert order == [("ddp", 0), ("ddp_fp16", 0), ("lightwire_dgc", 0), ("ddp", 1),
                     ("lightwire_dgc", 1)]
    bases = {row["seed"]: row for row in data["runs"] if row["baseline"]}
    for row in data["runs"]:
        name = "%s seed %d" % (row["config"], row["seed"])
        assert row["status"] == "ok", (name, row.get("error"))
        n = row["steps"]
        assert row["rank_steps"] == [n, n], "%s: the ranks stopped after different steps" % name
        assert len(row["step_seconds"]) == n == row["eval"][-1]["step"], name
        fig = row["tta"]
        for key in ("steps_to_target", "time_to_target", "loss_at_equal_steps",
                    "loss_at_equal_time", "at_baseline_time", "wire_bytes_per_step_per_rank",
                    "dense_share", "equal_steps", "delta_loss_at_equal_steps"):
            assert key in fig, (name, key)
        if row["kind"] == "lightwire":
            # The smoke model's layers are all small (at most 4096 elements): all dense.
            assert fig["dense_share"] == 1.0, (name, fig["dense_share"])
        else:
            assert fig["dense_share"] is None, name
        assert fig["wire_bytes_per_step_per_rank"] > 0
        base = bases[row["seed"]]
        assert fig["target"] == pytest.approx(base["final_loss"])
        if row["baseline"]:
            assert n == horizon and "stop" not in row
            continue
        stop = row["stop"]
        assert stop["step"] == n and stop["reason"] in tta.REASONS, (name, stop)
        assert stop["target"] == pytest.approx(base["final_loss"])
        assert stop["cap_seconds"] == pytest.approx(tta.training_seconds(base))
        assert n <= tta.STEP_CAP_FACTOR * base["steps"], (name, n)
        if stop["reason"] == "target":
            assert stop["reached_step"] is not None
            assert stop["reached_step"] + extra <= n < stop["reached_step"] + extra + every
        elif stop["reason"] == "steps":
            assert n == horizon
        # The worker's decisions are the pure rule's: replayed on its evaluations, it goes on at
        # every one but the last and stops there for the same reason.
        ev = row["eval"]
        replay = [tta.stop_decision(ev[:i + 1], stop["target"], stop["extra_steps"],
                                    stop["cap_seconds"], stop["max_steps"], every)
                  for i in range(len(ev))]
        assert replay[:-1] == [None] * (len(ev) - 1) and replay[-1] == stop["reason"], (name, replay)
    summary = {e["config"]: e for e in data["tta"]["summary"]}
    assert summary["ddp"]["final_loss"]["n"] == 2 and summary["ddp"]["final_loss"]["sd"] is not None
    assert summary["ddp_fp16"]["seeds"] == [0]
    md = (tmp_path / "BENCHMARKS-tta.md").read_text(encoding="utf-8")
    assert "DDP's final loss over 2 seeds" in md
    assert not (tmp_path / "BENCHMARKS.md").exists()
    assert len(list((tmp_path / "benchmarks").glob("tta-*.png"))) == 3
