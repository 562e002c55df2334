"""bench/soak/soak.py: its verdict functions on made-up samples, a 20-second smoke of the real job
(3 sidecars, 2 trainers each) judged by the same verdict, and the cleanup on Ctrl-C (no process
or shared-memory segment left behind)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import LIGHTWIRE_BIN, REPO, _serve_available

sys.path.insert(0, os.path.join(REPO, "bench", "soak"))
import soak  # noqa: E402

PYTHON = os.environ.get("PYTHON", sys.executable)
SOAK = os.path.join(REPO, "bench", "soak", "soak.py")


def samples(rss, fds, t0=0.0):
    return [{"t": t0 + i, "rss_kib": r, "fds": f, "threads": 4} for i, (r, f) in enumerate(zip(rss, fds))]


def sidecar(rank, rss, fds, errors=None, rate=5.0):
    return {"rank": rank, "samples": samples(rss, fds), "errors": errors or {"steps_failed": 0},
            "log_errors": 0, "peer_down_samples": 0, "last_rate": rate}


def test_rss_growth_compares_medians_of_the_first_and_last_fifth():
    # 20 samples: windows of 4; a spike in one does not move its median
    rss = [100, 500, 100, 100] + [100] * 12 + [101, 90, 101, 101]
    first, last, growth = soak.rss_growth(rss)
    assert (first, last) == (100, 101) and growth == pytest.approx(0.01)
    assert soak.rss_growth([100] * 8 + [103, 103])[2] == pytest.approx(0.03)
    assert soak.rss_growth([]) == (None, None, None)


def test_fd_check_baseline_is_the_end_of_warm_up():
    s = [(t, 10 if t < 8 else 12) for t in range(20)]       # 12 from t=8, warm-up ends at 10
    assert soak.fd_check(s, 10.0) == (12, 12, 12)
    s = [(t, 12 if t == 15 else 10) for t in range(20)]     # one sample above the baseline
    assert soak.fd_check(s, 10.0) == (10, 12, 10)


def test_judge_passes_a_clean_run_and_names_each_failure():
    rss, fds = [100] * 30, [35] * 30
    ok = soak.judge([sidecar(0, rss, fds), sidecar(1, rss, fds)], {}, [], warm_end=10.0)
    assert ok["pass"] and ok["errors_total"] == 0, ok
    bad = soak.judge([sidecar(0, rss[:20] + [110] * 10, fds), sidecar(1, rss, fds[:20] + [36] * 10,
                                                                      errors={"http_5xx": 2}, rate=0.0)],
                     {"409 conflict": 1}, ["trainer 0/1: exit 1"], warm_end=10.0)
    failed = {k for k, c in bad["checks"].items() if not c["pass"]}
    assert failed == {"errors", "rss_growth", "fds", "alive", "progress"}, bad
    assert bad["errors_total"] == 3
    assert "409 conflict 1" in bad["checks"]["errors"]["detail"]
    assert "rank 1: http_5xx 2" in bad["checks"]["errors"]["detail"]
    assert soak.judge([sidecar(0, rss[:20] + [101] * 10, fds)], {}, [], 10.0, rss_limit=0.5)["pass"] is False


def test_sidecar_counters_from_an_exposition():
    text = "\n".join([
        '# TYPE lightwire_steps_total counter',
        'lightwire_steps_total{result="ok"} 120',
        'lightwire_steps_total{result="failed"} 1',
        'lightwire_steps_total{result="nonfinite"} 0',
        'lightwire_http_requests_total{route="/v1/emit_gradient",code="200"} 240',
        'lightwire_http_requests_total{route="/v1/emit_gradient",code="409"} 2',
        'lightwire_http_requests_total{route="/readyz",code="503"} 1',
        'lightwire_auth_failures_total 0',
        'lightwire_peer_up{peer="1"} 1',
        'lightwire_peer_up{peer="2"} 0',
    ])
    errors, info = soak.sidecar_counters(soak.parse_metrics(text))
    assert errors["steps_failed"] == 1 and errors["http_4xx"] == 2 and errors["http_5xx"] == 1
    assert info["tensor_steps_ok"] == 120 and (info["peers_up"], info["peers"]) == (1, 2)
    assert info["http_errors"] == {"/v1/emit_gradient 409": 2, "/readyz 503": 1}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open("/proc/%d/stat" % pid) as f:  # a zombie not yet reaped by init is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _assert_nothing_left(pids):
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "soak left processes behind"
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith("lightwire-%d-" % p) for p in pids)]
    assert not left, "soak left shared-memory segments behind: %s" % left


def _need_binary():
    ok, why = _serve_available()
    if not ok:
        pytest.skip(why)


def test_soak_smoke_20s_passes_the_verdict(tmp_path):
    _need_binary()
    out = str(tmp_path / "soak.json")
    # Short periods so that every allocate-once path (first trainer checkpoint, periodic
    # checkpoint, full-sync) falls within the 10-s warm-up. This run checks the harness end to
    # end, not for leaks: its judged window is 10 s (two 1-s samples per compared fifth), where
    # the heap's high-water mark still rises in steps with the requests in flight at once (+4.4 %
    # seen on a loaded machine). The leak verdict is the test command's 2-minute soak (60 s
    # judged, the 2 % limit) and the 30-minute run; judge() itself is tested above.
    cmd = [PYTHON, SOAK, "--duration", "20", "--warmup", "10", "--interval", "5", "--checkpoint-every", "4",
           "--full-sync-every", "10", "--periodic-checkpoint-every", "15", "--rss-limit", "25",
           "--bin", LIGHTWIRE_BIN, "--json", out]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180)
    text = r.stdout.decode("utf-8", "replace")
    assert r.returncode == 0, text[-6000:]
    assert "VERDICT: PASS" in text
    with open(out) as f:
        doc = json.load(f)
    assert doc["verdict"]["pass"] and doc["verdict"]["errors_total"] == 0
    assert all(t["finished"] and t["steps"] > 10 and t["checks"]["exact"] > 0 for t in doc["trainers"])
    churn = {k: sum(t["churn"][k] for t in doc["trainers"]) for k in doc["trainers"][0]["churn"]}
    assert all(v > 0 for v in churn.values()), churn
    paths = {k: sum(t["paths"][k] for t in doc["trainers"]) for k in ("http", "shm")}
    assert paths["http"] > 0 and paths["shm"] > 0, paths
    assert not os.path.exists(doc["work_dir"]), "the work directory of a passing run is removed"
    _assert_nothing_left(doc["pids"]["sidecars"] + doc["pids"]["trainers"])


def test_soak_ctrl_c_stops_every_child():
    _need_binary()
    p = subprocess.Popen([PYTHON, SOAK, "--duration", "120", "--interval", "2", "--bin", LIGHTWIRE_BIN],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids = []
    try:
        lines = []
        for raw in p.stdout:  # until the first report line
            line = raw.decode("utf-8", "replace")
            lines.append(line)
            if line.startswith("soak: pids:"):
                pids = [int(w) for w in line.replace(",", " ").split() if w.isdigit()]
            if "rank 0: steps" in line:
                break
        assert pids, "".join(lines)
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=60)[0].decode("utf-8", "replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, rest
    assert "interrupted" in rest
    _assert_nothing_left(pids)
