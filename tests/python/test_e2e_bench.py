"""bench/e2e/e2e.py end to end at smoke size: real DDP trainers and real sidecars in a network
namespace with a rate-limited loopback, PyTorch's hooks and lightwire's, the results JSON and the
report (docs/BENCHMARKS.md's generator) with its plots. Needs root and network namespaces
(skipped otherwise, saying why); the figures themselves are not asserted (benchmarks never pass or
fail on time)."""

import json
import math
import os
import subprocess

import pytest

from conftest import LIGHTWIRE_BIN, REPO, _serve_available

PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")
CONFIGS = ["ddp", "ddp_fp16", "ddp_powersgd", "lightwire_powersgd", "lightwire_dgc_policies"]  # in e2e.py order


def _netns_available():
    if os.geteuid() != 0:
        return False, "needs root (ip netns, tc)"
    name = "lightwire-probe-%d" % os.getpid()
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, "ip netns unavailable: %s" % e
    if r.returncode != 0:
        return False, "cannot create a network namespace: %s" % r.stderr.strip()
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True, ""


def skip_unless_e2e_runs():
    """Skips the calling test when the sidecar cannot serve or no network namespace can be made."""
    for check in (_serve_available, _netns_available):
        ok, why = check()
        if not ok:
            pytest.skip(why)


def test_e2e_smoke_runs_every_kind_and_writes_the_report(tmp_path):
    skip_unless_e2e_runs()
    results = tmp_path / "results.json"
    env = dict(os.environ, LIGHTWIRE_BIN=LIGHTWIRE_BIN, PYTHON=PYTHON)
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "e2e.py"), "--smoke",
                        "--configs", ",".join(CONFIGS), "--out-dir", str(tmp_path), "--results",
                        str(results)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(results.read_text())
    assert data["profile"] == "smoke" and data["world_size"] == 2
    rows = {row["config"]: row for row in data["runs"]}
    assert list(rows) == CONFIGS, "every configuration has a row, in order"
    for name, row in rows.items():
        if name == "ddp_powersgd" and row["status"] != "ok":
            # PyTorch's PowerSGD hook may not run on CPU/gloo in some versions: the row says why.
            assert row["error"], row
            continue
        assert row["status"] == "ok", (name, row.get("error"))
        assert len(row["step_seconds"]) == 3 and len(row["loss"]) == 3, name
        assert all(math.isfinite(v) for v in row["loss"]), name
        assert row["eval"][-1]["step"] == 3 and math.isfinite(row["final_loss"]), name
        assert row["wire_bytes_per_step_per_rank"] > 0, "%s sent nothing on the link" % name
        if row["kind"] == "lightwire":
            assert row["fallbacks"] == 0, "%s: buckets fell back to gloo" % name
            assert row["sidecar"]["codec"] in ("dgc", "powersgd", "none"), row["sidecar"]
    assert rows["ddp"]["baseline"] and rows["ddp"]["time_to_baseline_loss"] is not None
    # Each row records its optimizer: the task's own without the sidecar, its lightwire helper
    # (lightwire.torch.SGD, as users would) through it.
    assert rows["ddp"]["optimizer"] == "torch.optim.sgd.SGD"
    assert rows["lightwire_dgc_policies"]["optimizer"] == "lightwire.torch.SGD"
    assert rows["lightwire_powersgd"]["optimizer"] == "lightwire.torch.SGD"
    md = (tmp_path / "BENCHMARKS.md").read_text()
    for row in rows.values():
        assert row["label"] in md, row["label"]
    pngs = sorted(p.name for p in (tmp_path / "benchmarks").glob("*.png"))
    assert len(pngs) == 3, pngs
    for png in pngs:
        assert "benchmarks/" + png in md, png


def test_e2e_smoke_trains_the_lm_with_the_adamw_helper(tmp_path):
    """The LM trains with AdamW: its lightwire rows take lightwire.torch.AdamW, dgc's momentum
    correction included (Adam's first moment there), and no bucket falls back."""
    skip_unless_e2e_runs()
    results = tmp_path / "results.json"
    env = dict(os.environ, LIGHTWIRE_BIN=LIGHTWIRE_BIN, PYTHON=PYTHON)
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "e2e.py"), "--smoke",
                        "--tasks", "lm", "--configs", "ddp,lightwire_dgc,lightwire_topk",
                        "--out-dir", str(tmp_path), "--results", str(results)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["config"]: row for row in json.loads(results.read_text())["runs"]}
    assert rows["ddp"]["optimizer"] == "torch.optim.adamw.AdamW"
    for name in ("lightwire_dgc", "lightwire_topk"):
        assert rows[name]["status"] == "ok", (name, rows[name].get("error"))
        assert rows[name]["optimizer"] == "lightwire.torch.AdamW", rows[name]
        assert rows[name]["fallbacks"] == 0, name
        assert all(math.isfinite(v) for v in rows[name]["loss"]), name


def test_speed_bench_smoke_interleaves_repetitions_and_reports_ratios(tmp_path):
    """bench/e2e/speed.py at smoke size: every configuration trains once per repetition, and each
    row's speed against DDP is summarised over the repetitions (no speed is asserted)."""
    skip_unless_e2e_runs()
    out = tmp_path / "speed.json"
    env = dict(os.environ, LIGHTWIRE_BIN=LIGHTWIRE_BIN, PYTHON=PYTHON)
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "speed.py"), "--size", "smoke",
                        "--world-size", "2", "--steps", "10", "--repeats", "2", "--rates",
                        "unlimited,1gbit", "--configs", "ddp,lightwire_none", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(g["task"], g["rate"]) for g in data["groups"]] == [("mlp", "unlimited"), ("mlp", "1gbit")]
    for g in data["groups"]:
        rows = {t["config"]: t for t in g["table"]}
        assert list(rows) == ["ddp", "lightwire_none"]
        assert rows["ddp"]["speed_vs_ddp"] == [1.0, 1.0]
        t = rows["lightwire_none"]
        assert t["repetitions"] == 2 and len(t["step_seconds"]) == 2 and not t["errors"], t
        assert len(t["speed_vs_ddp"]) == 2 and all(v > 0 for v in t["speed_vs_ddp"]), t
        assert t["speed_min"] <= t["speed_median"] <= t["speed_max"], t
        assert t["trainer_cpu_seconds_per_step"] > 0 and t["sidecar_cpu_seconds_per_step"] > 0, t
        assert rows["ddp"]["trainer_cpu_seconds_per_step"] > 0
        assert rows["ddp"]["sidecar_cpu_seconds_per_step"] is None  # no sidecars
        # Each repetition's loss and what carried its steps (all of them: through the sidecars).
        assert len(t["final_loss"]) == 2 and all(v > 0 for v in t["final_loss"]), t
        assert t["carried"] == [{"direct": 0, "dense": 10, "compressed": 0, "fallback": 0}] * 2, t
        # ... and the median step of each way that carried steps.
        assert [sorted(b) for b in t["step_seconds_by"]] == [["dense"]] * 2, t
        assert all(b["dense"] > 0 for b in t["step_seconds_by"]), t
    assert "median of 2 interleaved repetitions" in r.stderr
    # The order of the runs: the configurations in turn, repetition after repetition.
    order = [line.split(": ")[-1] for line in r.stderr.splitlines() if ", repetition " in line]
    assert order == ["ddp", "lightwire_none"] * 4, order


def test_hook_cost_bench_smoke(tmp_path):
    """bench/e2e/hook_cost.py at smoke size: DDP, DDP through PyTorch's Python hook and through the
    lightwire hook's direct path (no sidecar) train in turn; each way's speed against DDP is
    summarised (no speed is asserted; the script fails if the lightwire hook averaged nothing)."""
    out = tmp_path / "hook.json"
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "hook_cost.py"), "--size", "smoke",
                        "--world-size", "2", "--steps", "20", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [t["way"] for t in data["table"]] == ["ddp", "python_hook", "lightwire_direct"]
    for t in data["table"]:
        assert t["median_step_seconds"] > 0 and t["trainer_cpu_seconds_per_step"] > 0, t
        assert len(t["speed_vs_ddp"]) == 1 and t["speed_vs_ddp"][0] > 0, t
    assert data["table"][0]["speed_vs_ddp"] == [1.0]
    assert "median of 1 interleaved repetitions" in r.stdout


def test_noise_scale_bench_smoke(tmp_path):
    """bench/e2e/noise_scale.py at smoke size: per layer and window the noise ratio (between 1 and
    W in expectation, for independent ranks), QSGD's relative error and the predicted steps factors
    (at least 1; 4 bits above 8 bits)."""
    out = tmp_path / "noise.json"
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "noise_scale.py"), "--size",
                        "smoke", "--steps", "3", "--window", "2", "--world-size", "2", "--json",
                        str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [t["task"] for t in data["tasks"]] == ["mlp", "lm"]
    for t in data["tasks"]:
        assert [w["last_step"] for w in t["windows"]] == [2, 3], t["windows"]
        for w in t["windows"]:
            assert 1 <= w["weighted"]["qsgd8_factor"] < w["weighted"]["qsgd4_factor"], w["weighted"]
            for row in w["layers"]:
                if row["noise_ratio"] is None:  # a layer whose gradient is exactly zero
                    continue
                assert row["noise_ratio"] >= 1 - 1e-9, row
                assert row["qsgd4_factor"] >= row["qsgd8_factor"] >= 1, row


def test_dgc_masking_bench_smoke(tmp_path):
    """bench/e2e/dgc_masking.py at smoke size: every variant trains both tasks to finite losses;
    with every element sent every step by one rank, dgc without masking is momentum SGD itself
    (the MLP's evaluations equal the dense run's bit for bit), while masking, which clears the
    momentum of every element it sends, does not."""
    out = tmp_path / "masking.json"
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "dgc_masking.py"), "--tasks",
                        "mlp,lm", "--size", "smoke", "--steps", "6", "--eval-every", "3",
                        "--variants", "dense,mask,biascorr,nomask", "--world-size", "1",
                        "--density", "1", "--warmup", "0", "--dense-max-elements", "0",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(x["task"], x["variant"]) for x in runs] == [
        (t, v) for t in ("mlp", "lm") for v in ("dense", "mask", "biascorr", "nomask")]
    for x in runs:
        assert [e[0] for e in x["evals"]] == [3, 6], x
        assert all(math.isfinite(e[1]) for e in x["evals"]), x
    mlp = {x["variant"]: x["evals"] for x in runs if x["task"] == "mlp"}
    assert mlp["nomask"] == mlp["dense"], mlp
    assert mlp["mask"] != mlp["dense"], mlp
    assert "final eval loss" in r.stdout
    bad = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "dgc_masking.py"),
                          "--variants", "mask,other"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--variants" in bad.stderr, bad.stderr


def test_region_shares_bench_smoke(tmp_path):
    """bench/e2e/region_shares.py, 2 steps of the MLP at W = 2: per layer of several regions and
    per share rule the share of the global top-k the regions kept and of its magnitude, in (0, 1];
    the owners' load under each assignment of the regions to owners, the busiest rank against
    the mean."""
    out = tmp_path / "regions.json"
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "e2e", "region_shares.py"), "--tasks",
                        "mlp", "--world-size", "2", "--steps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(t["task"], t["world_size"]) for t in data] == [("mlp", 2)]
    assert data[0]["layers"], data
    for row in data[0]["layers"]:
        assert row["regions"] > 1, row
        for rule in ("sent", "length"):
            assert 0 < row[rule]["overlap_min"] <= row[rule]["overlap"] <= 1, row
            assert 0 < row[rule]["mass_min"] <= row[rule]["mass"] <= 1 + 1e-9, row
    # The busiest rank moves at least the mean and at most every entry of the W ranks, whoever
    # owns the regions: by the names' hash, balanced by length, or by the previous selections.
    load = data[0]["owner_load"]
    assert sorted(load) == ["hash", "length", "previous"], load
    for rule in load.values():
        assert 1 <= rule["max_over_mean"] <= rule["max_over_mean_worst"] <= 2, load


def test_memory_bench_smoke(tmp_path):
    """bench/memory.py at a tiny size: a job of four sidecars per row, every row's fields; the
    bench itself refuses a reply of another codec or mode and state bytes off the formula (so a
    clean exit means each row ran its codec with the documented state). The HTTP path runs too.
    The figures themselves are not asserted."""
    ok, why = _serve_available()
    if not ok:
        pytest.skip(why)
    out = str(tmp_path / "memory.json")
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "memory.py"), "--elements", "200000",
                        "--steps", "2", "--model-tensors", "4", "--bin", LIGHTWIRE_BIN, "--json",
                        out], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out) as f:
        rows = json.load(f)
    assert [x["row"] for x in rows] == ["none", "fp16", "qsgd", "topk", "dgc", "dgc-momentum",
                                        "powersgd", "model"]
    for x in rows:
        assert x["elements"] == 200000 and x["world_size"] == 4 and x["path"] == "shm", x
        assert x["peak_anon_mb"] > 0 and x["step_s"] > 0 and x["ratio"] > 0, x
        assert x["state_mb"] == x["state_formula_mb"], x
        assert len(x["shape"]) == 2, x  # 2-D: PowerSGD factorises it
    assert {x["row"]: x["tensors"] for x in rows}["model"] == 4
    assert [x["row"] for x in rows if x["state_mb"] == 0] == ["none", "fp16", "qsgd"]
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "memory.py"), "--elements", "200000",
                        "--steps", "2", "--world-size", "2", "--rows", "dgc-momentum", "--path",
                        "http", "--bin", LIGHTWIRE_BIN], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "request bodies" in r.stdout and "dgc-momentum" in r.stdout
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "memory.py"), "--elements", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--elements must be >= --model-tensors" in r.stderr
    r = subprocess.run([PYTHON, os.path.join(REPO, "bench", "memory.py"), "--rows", "zip"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--rows: unknown zip" in r.stderr
