"""bench/e2e/report.py on synthetic results: tables, failed rows, targets, plots, malformed input.
Needs matplotlib (Debian's python3-matplotlib: run with /usr/bin/python3); no sidecar, no torch."""

import copy
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REPORT_PY = os.path.join(REPO, "bench", "e2e", "report.py")


def _load_report():
    spec = importlib.util.spec_from_file_location("e2e_report", REPORT_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _load_report()

STEPS = 40
EVAL_EVERY = 10


def ok_run(task, rate, config, label, kind, median, final_loss, wire, accuracy=0.8, ttb=None,
           start_loss=2.3, baseline=False):
    """A finished run whose loss decays from start_loss to about final_loss."""
    step_seconds = [median * (1.0 + 0.05 * ((i * 7) % 5 - 2) / 2.0) for i in range(STEPS)]
    loss = [final_loss + (start_loss - final_loss) * math.exp(-i / 8.0) + 0.05 * ((i * 3) % 4 - 1.5)
            for i in range(STEPS)]
    evals = []
    for step in range(EVAL_EVERY, STEPS + 1, EVAL_EVERY):
        evals.append({"step": step, "seconds": median * step,
                      "loss": final_loss + (start_loss - final_loss) * math.exp(-step / 8.0),
                      "accuracy": None if accuracy is None else accuracy * step / STEPS})
    evals[-1]["loss"] = final_loss
    return {
        "task": task, "task_title": TITLES[task], "parameters": PARAMS[task], "batch": 64,
        "rate": rate, "rate_bits_per_second": RATES[rate], "config": config, "label": label,
        "kind": kind, "baseline": baseline, "status": "ok", "error": None, "steps": STEPS,
        "step_seconds": step_seconds, "loss": loss, "eval": evals, "final_loss": final_loss,
        "final_accuracy": accuracy, "median_step_seconds": median,
        "wire_bytes_per_step_per_rank": wire, "time_to_baseline_loss": ttb,
    }


def bad_run(task, rate, config, label, kind, status, error):
    return {"task": task, "rate": rate, "config": config, "label": label, "kind": kind,
            "status": status, "error": error}


TITLES = {"mlp": "MLP classifier 512-2048-2048-10 (5.3M parameters), synthetic data",
          "lm": "Transformer language model (4.1M parameters), license texts"}
PARAMS = {"mlp": 5271562, "lm": 4100000}
RATES = {"1gbit": 1e9, "10gbit": 1e10}

POWERSGD_ERROR = ("Traceback (most recent call last):\n  File \"worker.py\", line 3\n"
                  "RuntimeError: | PowerSGD ``hook`` hung")


def results(dgc_median, dgc_loss):
    """Two groups. The MLP group's dgc_policies run has the given median step and final loss
    against DDP (0.40 s, loss 0.500) and the fp16 hook (0.21 s, loss 0.505)."""
    mlp = [
        ok_run("mlp", "1gbit", "ddp", "DDP over gloo", "ddp", 0.40, 0.500, 21.1e6, ttb=16.0,
               baseline=True),
        ok_run("mlp", "1gbit", "ddp_fp16", "DDP + fp16 hook", "torch_hook", 0.21, 0.505, 10.6e6,
               ttb=None),
        bad_run("mlp", "1gbit", "ddp_powersgd", "DDP + PowerSGD hook", "torch_hook", "failed",
                POWERSGD_ERROR),
        ok_run("mlp", "1gbit", "lightwire_none", "lightwire none", "lightwire", 0.45, 0.500, 21.2e6,
               ttb=18.0),
        bad_run("mlp", "1gbit", "lightwire_qsgd4", "lightwire qsgd 4 bits", "lightwire", "timeout",
                "no step finished within 300 s"),
        ok_run("mlp", "1gbit", "lightwire_topk", "lightwire topk 1 %", "lightwire", 0.05, 0.560,
               0.42e6, ttb=None),
        ok_run("mlp", "1gbit", "lightwire_dgc_policies", "lightwire dgc + policies", "lightwire",
               dgc_median, dgc_loss, 0.21e6, ttb=2.1),
    ]
    lm = [
        ok_run("lm", "10gbit", "ddp", "DDP over gloo", "ddp", 0.30, 4.00, 16.4e6, accuracy=None,
               ttb=12.0, start_loss=8.0, baseline=True),
        ok_run("lm", "10gbit", "lightwire_dgc_policies", "lightwire dgc + policies", "lightwire",
               0.35, 4.02, 0.16e6, accuracy=None, ttb=None, start_loss=8.0),
        bad_run("lm", "10gbit", "ddp_fp16", "DDP + fp16 hook", "torch_hook", "failed",
                "gloo: connection reset"),
    ]
    return {
        "version": 1, "profile": "full", "command": "/usr/bin/python3 bench/e2e/e2e.py --out r.json",
        "date": "2026-11-30T19:00:00Z", "commit": "abc1234-dirty", "elapsed_seconds": 540.2,
        "machine": {"cpus": 2, "cpu_model": "Intel(R) Xeon(R) Processor", "memory_gib": 23.4,
                    "kernel": "6.1.0-13-amd64", "os": "Debian GNU/Linux 12", "python": "3.11.2",
                    "torch": "1.13.0a0", "lightwire_bin": "build-release/proxy/lightwire"},
        "world_size": 4,
        "runs": mlp + lm,
    }


def write(tmp_path, res, name="results.json"):
    out = tmp_path / "docs"
    paths = report.write_report(res, str(out), source=name)
    return out, paths, (out / "BENCHMARKS.md").read_text(encoding="utf-8")


def section(md, start, end):
    i = md.index(start)
    j = md.index(end, i + len(start)) if end else len(md)
    return md[i:j]


def table_row(md, group_heading, label):
    grp = md[md.index(group_heading):]
    for line in grp.splitlines():
        if line.startswith("| ") and label in line:
            return [c.strip() for c in line.strip().strip("|").split(" | ")]
    raise AssertionError("no row %r under %r" % (label, group_heading))


def test_files_and_links(tmp_path):
    out, paths, md = write(tmp_path, results(0.05, 0.505))
    expect = set()
    for stem in ("mlp-1gbit", "lm-10gbit"):
        for kind in ("loss-step", "loss-time", "step-time"):
            expect.add(str(out / "benchmarks" / ("%s-%s.png" % (stem, kind))))
    expect.add(str(out / "BENCHMARKS.md"))
    assert set(paths) == expect
    for p in paths:
        assert os.path.getsize(p) > 0
        if p.endswith(".png"):
            with open(p, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(links) == 6
    for link in links:
        assert link.startswith("benchmarks/")
        assert (out / link).is_file(), link
    assert "generated by bench/e2e/report.py from results.json" in md
    assert "/usr/bin/python3 bench/e2e/e2e.py --out r.json" in md
    assert "`bench/e2e/e2e.py --quick`" in md
    assert "Intel(R) Xeon(R) Processor" in md and "abc1234" in md and "uncommitted" in md
    # Groups in order of appearance, sections in order.
    assert md.index("## Machine and run") < md.index("### MLP classifier") < md.index("### Transformer")
    assert md.index("### Transformer") < md.index("## Targets") < md.index("## Method")


def test_table_rows_failed_and_timeout(tmp_path):
    out, paths, md = write(tmp_path, results(0.05, 0.505))
    g = "### MLP classifier"
    base = table_row(md, g, "DDP over gloo")
    assert base[2] == "0.400" and "baseline" in base[0] and base[3] == "1.00\u00d7"
    fp16 = table_row(md, g, "DDP + fp16 hook")
    assert fp16[3] == "1.90\u00d7"           # 0.40 / 0.21
    assert fp16[4] == "10.6 MB"
    assert fp16[6] == "+1.00 %"
    assert fp16[7] == "80.0 %"
    assert fp16[8] == "not reached"
    dgc = table_row(md, g, "lightwire dgc + policies")
    assert dgc[3] == "8.00\u00d7" and dgc[4] == "210 KB" and dgc[8] == "2.10"
    # Every run has a row, failed ones with their status and dashes.
    failed = table_row(md, g, "DDP + PowerSGD hook")
    assert failed[1].startswith("failed [") and all(c == "\u2014" for c in failed[2:])
    timeout = table_row(md, g, "lightwire qsgd 4 bits")
    assert timeout[1].startswith("timeout [") and all(c == "\u2014" for c in timeout[2:])
    n_rows = sum(1 for line in section(md, g, "### Transformer").splitlines()
                 if line.startswith("| ") and not line.startswith("| configuration")
                 and not line.startswith("| :--"))
    assert n_rows == 7
    # The errors are shown under the table, verbatim (backticks and pipes included).
    grp = section(md, g, "### Transformer")
    assert "RuntimeError: | PowerSGD ``hook`` hung" in grp
    assert "no step finished within 300 s" in grp
    # The LM group has no accuracy column (all null) and its own failed row.
    lm = section(md, "### Transformer", "## Targets")
    assert "accuracy" not in lm.splitlines()[4]
    assert "gloo: connection reset" in lm
    assert table_row(md, "### Transformer", "DDP + fp16 hook")[1].startswith("failed")


def test_targets_met(tmp_path):
    # 0.40 / 0.05 = 8x faster than DDP, loss +1 % (within 2 %); faster than fp16 at equal loss.
    t = report.evaluate_targets(results(0.05, 0.505)["runs"][:7])
    assert t["a"]["met"] is True and t["b"]["met"] is True
    out, paths, md = write(tmp_path, results(0.05, 0.505))
    targets = section(md, "## Targets", "## Method")
    mlp = section(targets, "### MLP", "### Transformer")
    assert mlp.count("**met**") == 2 and "not met" not in mlp
    # Where lightwire loses: none slower (0.45 > 0.40), topk 12 % worse, qsgd4 timed out.
    assert "lightwire none: slower per step than the baseline" in mlp
    assert "lightwire topk 1 %: final loss +12.00 % higher" in mlp
    assert "lightwire qsgd 4 bits did not finish (timeout" in mlp
    lm = section(targets, "### Transformer", None)
    # LM: fp16 hook failed -> (b) cannot be evaluated; dgc slower than DDP -> (a) not met.
    assert "**not evaluated**" in lm and "**not met**" in lm
    assert "lightwire dgc + policies: slower per step than the baseline" in lm


def test_targets_not_met(tmp_path):
    # 0.40 / 0.25 = 1.6x, loss +3 % -> (a) not met on both counts; slower than fp16 (0.21 s)
    # with a higher loss -> (b) not met.
    res = results(0.25, 0.515)
    t = report.evaluate_targets(res["runs"][:7])
    assert t["a"]["met"] is False and not t["a"]["fast"] and not t["a"]["close"]
    assert t["b"]["met"] is False and not t["b"]["faster"] and not t["b"]["loss_ok"]
    out, paths, md = write(tmp_path, res)
    mlp = section(md, "## Targets", "### Transformer")
    mlp = mlp[mlp.index("### MLP"):]
    assert mlp.count("**not met**") == 2
    assert "Speed-up below 5" in mlp and "more than 2 % above" in mlp
    assert "Not faster per step than the fp16 hook; final loss above the fp16 hook's" in mlp
    assert "lightwire dgc + policies: final loss +3.00 % higher" in mlp


def test_target_boundaries():
    # Exactly 5x and exactly +2 %: met. Lower loss than the baseline: fine however much lower.
    runs = results(0.08, 0.51)["runs"][:7]
    assert report.evaluate_targets(runs)["a"]["met"] is True
    runs = results(0.08, 0.30)["runs"][:7]
    assert report.evaluate_targets(runs)["a"]["met"] is True
    runs = results(0.0801, 0.30)["runs"][:7]
    assert report.evaluate_targets(runs)["a"]["met"] is False
    # The dgc run failed: not met, with the reason.
    runs = results(0.05, 0.5)["runs"][:7]
    runs[6] = bad_run("mlp", "1gbit", "lightwire_dgc_policies", "lightwire dgc + policies",
                      "lightwire", "failed", "boom")
    t = report.evaluate_targets(runs)
    assert t["a"]["met"] is False and "failed" in t["a"]["reason"]


def test_formatting():
    assert report.fmt_bytes(123456.0) == "123 KB"
    assert report.fmt_bytes(999_700.0) == "1.00 MB"
    assert report.fmt_bytes(512) == "512 B"
    assert report.fmt_sig(0.041234) == "0.0412"
    assert report.fmt_sig(9.996) == "10.0"
    assert report.fmt_sig(12345.0) == "12300"
    assert report.fmt_rate(1e9) == "1 Gbit/s" and report.fmt_rate(2.5e10) == "25 Gbit/s"


def test_cli_ok_and_malformed(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(results(0.05, 0.505)))
    r = subprocess.run([sys.executable, REPORT_PY, str(good), "--out-dir", str(tmp_path / "o")],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "BENCHMARKS.md").is_file()
    assert b"wrote" in r.stderr
    assert "from good.json" in (tmp_path / "o" / "BENCHMARKS.md").read_text(encoding="utf-8")

    cases = {
        "notjson.json": ("{\"version\": 1, ", "not valid JSON"),
        "version.json": (json.dumps({"version": 2, "runs": []}), "version"),
    }
    broken = copy.deepcopy(results(0.05, 0.505))
    del broken["runs"][0]["median_step_seconds"]
    cases["nomedian.json"] = (json.dumps(broken), "median_step_seconds")
    broken = copy.deepcopy(results(0.05, 0.505))
    broken["runs"][1]["eval"][0]["loss"] = "low"
    cases["evalloss.json"] = (json.dumps(broken), "eval[0]")
    for name, (text, needle) in cases.items():
        p = tmp_path / name
        p.write_text(text)
        out = tmp_path / ("out-" + name)
        r = subprocess.run([sys.executable, REPORT_PY, str(p), "--out-dir", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        assert r.returncode != 0, name
        err = r.stderr.decode()
        assert "report: error:" in err and needle in err and name in err, err
        assert not (out / "BENCHMARKS.md").exists()
    with pytest.raises(report.ReportError):
        report.write_report({"version": 1}, str(tmp_path / "x"))


def test_group_without_successful_runs(tmp_path):
    # Every run failed (no figures at all): rows and plots are still written, targets not evaluated.
    res = results(0.05, 0.505)
    res["runs"] = [bad_run("mlp", "1gbit", "ddp", "DDP over gloo", "ddp", "failed", "gloo died"),
                   bad_run("mlp", "1gbit", "lightwire_dgc_policies", "lightwire dgc + policies",
                           "lightwire", "timeout", None)]
    out, paths, md = write(tmp_path, res)
    assert len(paths) == 4
    assert table_row(md, "### mlp", "DDP over gloo")[1] == "failed [1]"
    assert table_row(md, "### mlp", "lightwire dgc + policies")[1] == "timeout"
    assert "gloo died" in md and "**not evaluated**" in md


def test_group_heading_names_each_rows_optimizer():
    runs = [dict(ok_run("lm", "1gbit", "ddp", "DDP over gloo", "ddp", 0.8, 2.0, 2e7,
                        baseline=True), optimizer="torch.optim.adamw.AdamW"),
            dict(ok_run("lm", "1gbit", "lightwire_dgc", "dgc", "lightwire", 0.4, 2.1, 8e5),
                 optimizer="lightwire.torch.AdamW"),
            dict(ok_run("lm", "1gbit", "lightwire_topk", "topk", "lightwire", 0.4, 2.1, 8e5),
                 optimizer="lightwire.torch.AdamW"),
            ok_run("lm", "1gbit", "old", "an older result", "lightwire", 0.4, 2.1, 8e5)]
    facts = report.model_facts(runs)
    assert facts[-1] == ("optimizer torch.optim.adamw.AdamW (ddp); lightwire.torch.AdamW "
                         "(lightwire_dgc, lightwire_topk)")
    assert not any("optimizer" in f for f in report.model_facts(runs[3:]))


def _speed(none, fp16, auto, auto_loss):
    """speed.py's results: one MLP group at 10 Gbit/s with the given ratios against DDP."""
    def row(config, ratio, loss=1.5):
        return {"config": config, "repetitions": 3, "median_step_seconds": 0.17 / ratio,
                "speed_median": ratio, "speed_min": ratio - 0.01, "speed_max": ratio + 0.02,
                "final_loss": [loss] * 3}
    return {"version": 1, "command": "bench/e2e/speed.py --tasks mlp --rates 10gbit",
            "commit": "abc1234", "repeats": 3, "steps": 40, "bucket_cap_mb": None,
            "groups": [{"task": "mlp", "rate": "10gbit", "table": [
                row("ddp", 1.0), row("lightwire_none", none), row("lightwire_fp16", fp16),
                row("lightwire_auto", auto, auto_loss)]}]}


def test_speed_section_tables_and_targets(tmp_path):
    out = tmp_path / "docs"
    sp = _speed(0.95, 1.25, 0.99, 1.5 * 1.004)
    report.write_report(results(0.05, 0.505), str(out), source="r.json",
                        speed=[("speed-mlp.json", sp)])
    md = (out / "BENCHMARKS.md").read_text(encoding="utf-8")
    part = section(md, "## Step speed against DDP", "## Method")
    assert "speed-mlp.json" in part and "bench/e2e/speed.py --tasks mlp" in part
    row = table_row(part, "From `speed-mlp.json`", "`lightwire_none`")
    assert row[4] == "0.950 [0.940, 0.970]", row
    row = table_row(part, "From `speed-mlp.json`", "`lightwire_auto`")
    assert row[6] == "+0.40 %", row
    # The targets, from the figures: none below 0.98x, fp16 above 1x, auto above 0.97x within
    # +0.5 % of DDP's loss.
    assert re.search(r"`lightwire_none`, mlp at 10gbit .*\*\*not met\*\* \(0\.950", part)
    assert re.search(r"`lightwire_fp16`, mlp at 10gbit .*\*\*met\*\* \(1\.25", part)
    assert re.search(r"`lightwire_auto`, mlp at 10gbit .*\*\*met\*\* \(0\.990", part)
    # auto fast enough but with a loss 1 % above DDP's: not met.
    report.write_report(results(0.05, 0.505), str(out), source="r.json",
                        speed=[("s.json", _speed(0.99, 1.25, 1.1, 1.5 * 1.01))])
    md = (out / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert re.search(r"`lightwire_auto`, mlp at 10gbit .*\*\*not met\*\*", md)
    assert re.search(r"`lightwire_none`, mlp at 10gbit .*\*\*met\*\*", md)
    # Without speed results the page has no such section; a malformed one writes nothing.
    report.write_report(results(0.05, 0.505), str(out), source="r.json")
    assert "## Step speed" not in (out / "BENCHMARKS.md").read_text(encoding="utf-8")
    bad = _speed(0.95, 1.25, 0.99, 1.5)
    bad["groups"][0]["table"][1]["speed_median"] = "fast"
    with pytest.raises(report.ReportError, match="speed_median"):
        report.write_report(results(0.05, 0.505), str(tmp_path / "bad"), source="r.json",
                            speed=[("s.json", bad)])
    assert not (tmp_path / "bad" / "BENCHMARKS.md").exists()
