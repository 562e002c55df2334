"""`lightwire status` against a real sidecar, and `--log-format json`."""
import json
import subprocess

import numpy as np
import pytest

from conftest import LIGHTWIRE_BIN, free_tcp_port


def status(*args, timeout=20):
    return subprocess.run([LIGHTWIRE_BIN, "status", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, text=True)


def drive(sc, steps, name="layer1.weight", n=5000):
    c = sc.client()
    try:
        rng = np.random.default_rng(3)
        for s in range(steps):
            c.emit_gradient(rng.standard_normal(n).astype(np.float32), name, s)
        c.report(steps - 1, loss=0.75)
    finally:
        c.close()


def test_status_summarises_a_running_sidecar(sidecar_factory):
    port = free_tcp_port()
    sc = sidecar_factory(codec="topk", density=0.1, control_tcp="127.0.0.1:%d" % port,
                         extra=["--full-sync-every", "3"])
    drive(sc, 8)
    r = status("--socket", sc.socket)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "rank 0 of 1" in out
    assert "8 ok, 0 failed" in out
    assert "codec=topk density=0.1" in out
    assert "settings v0 from step 0, known-good" in out
    # The decision log: full-syncs at steps 3 and 6.
    assert "step 3  layer1.weight  full_sync: periodic" in out
    assert "step 6  layer1.weight  full_sync: periodic" in out
    assert "layer1.weight" in out and "5000" in out
    assert '"loss":7.5E-1' in out
    # The same through the TCP control listener, and the raw JSON.
    r2 = status("--url", "http://127.0.0.1:%d" % port)
    assert r2.returncode == 0, r2.stderr
    assert "8 ok, 0 failed" in r2.stdout
    r3 = status("--socket", sc.socket, "--json")
    assert r3.returncode == 0, r3.stderr
    doc = json.loads(r3.stdout)
    assert doc["steps"]["ok"] == 8
    assert [e["step"] for e in doc["policies"]["log"]] == [3, 6]


def test_status_errors_are_clear(tmp_path):
    r = status("--socket", str(tmp_path / "nothing.sock"), "--timeout", "2")
    assert r.returncode == 1
    assert "cannot read the status of unix:" in r.stderr and "nothing.sock" in r.stderr
    r = status("--url", "http://127.0.0.1:%d" % free_tcp_port(), "--timeout", "2")
    assert r.returncode == 1 and "Connection refused" in r.stderr, r.stderr
    r = status("--url", "ftp://x:1")
    assert r.returncode == 2 and "http://HOST:PORT" in r.stderr
    r = status("--url", "http://127.0.0.1:1", "--socket", "/tmp/x.sock")
    assert r.returncode == 2 and "not both" in r.stderr


def test_json_logs_are_one_object_per_line(sidecar_factory, monkeypatch):
    # An unknown LIGHTWIRE_* variable: its warning comes before anything else, in JSON too.
    monkeypatch.setenv("LIGHTWIRE_NO_SUCH_KEY", "1")
    sc = sidecar_factory(codec="topk", density=0.1, extra=["--log-format", "json",
                                                           "--full-sync-every", "2"])
    drive(sc, 5, name='odd"name'.replace('"', "_"))
    sc.stop()
    with open(sc.stderr_path, encoding="utf-8") as f:
        lines = [l for l in f.read().splitlines() if l.strip()]
    assert lines, "no log lines"
    for line in lines:
        rec = json.loads(line)  # every line is one JSON object
        assert set(rec) == {"time", "level", "msg"}, rec
        assert rec["time"].endswith("Z")
    msgs = [json.loads(l)["msg"] for l in lines]
    assert any("full_sync" in m for m in msgs)
    # Quotes in messages stay valid JSON (tensor names cannot hold them; paths and reasons can).
    assert any("serving" in m for m in msgs)
    assert any("LIGHTWIRE_NO_SUCH_KEY" in m for m in msgs)


def test_no_per_step_lines_at_info(sidecar_factory):
    """Info logs events, not steps: 60 steps of two tensors add no line at all."""
    sc = sidecar_factory(codec="topk", density=0.1, extra=["--log-format", "json",
                                                           "--full-sync-every", "0"])
    with open(sc.stderr_path, encoding="utf-8") as f:
        before = len([l for l in f.read().splitlines() if l.strip()])
    c = sc.client()
    try:
        rng = np.random.default_rng(5)
        for s in range(60):
            for name in ("a", "b"):
                c.emit_gradient(rng.standard_normal(3000).astype(np.float32), name, s)
            c.report(s, loss=1.0)
    finally:
        c.close()
    status("--socket", sc.socket)
    with open(sc.stderr_path, encoding="utf-8") as f:
        after = [json.loads(l) for l in f.read().splitlines() if l.strip()]
    assert len(after) == before, [r["msg"] for r in after[before:]]


def _serve(tmp_path, admin, *extra):
    sock = str(tmp_path / ("s%d.sock" % free_tcp_port()))
    proc = subprocess.Popen(
        [LIGHTWIRE_BIN, "serve", "--socket", sock, "--control-tcp", "", "--admin-listen", admin,
         "--state-dir", str(tmp_path / "state"), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, sock


def _wait_socket(path, proc, seconds=20):
    import os
    import time
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the sidecar did not create its socket"
        time.sleep(0.05)


def health(*args, env=None, timeout=20):
    import os
    e = dict(os.environ)
    e.pop("LIGHTWIRE_ADMIN__LISTEN", None)
    e.update(env or {})
    return subprocess.run([LIGHTWIRE_BIN, "health", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, text=True, env=e)


def test_health_probes_the_admin_listener(tmp_path):
    """`lightwire health` (the image's HEALTHCHECK, docs/deploy.md): 0 when /healthz or /readyz
    answers 200, 1 when it answers otherwise or nothing answers, 2 on usage errors."""
    port = free_tcp_port()
    proc, sock = _serve(tmp_path, "127.0.0.1:%d" % port)
    try:
        _wait_socket(sock, proc)
        # The admin address the sidecar was given through the environment, wildcard -> loopback.
        env = {"LIGHTWIRE_ADMIN__LISTEN": "0.0.0.0:%d" % port}
        r = health(env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "http://127.0.0.1:%d/healthz: ok" % port
        r = health("--ready", env=env)
        assert r.returncode == 0 and r.stdout.strip().endswith("/readyz: ready"), r
        assert health("--quiet", "--url", "http://127.0.0.1:%d" % port).stdout == ""
        # The control socket serves the same routes.
        r = health("--socket", sock, "--ready")
        assert r.returncode == 0 and "unix:%s/readyz: ready" % sock in r.stdout, r
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # Nothing listens any more.
    r = health("--url", "http://127.0.0.1:%d" % port, "--timeout", "2")
    assert r.returncode == 1 and "Connection refused" in r.stderr, r.stderr
    r = health("--url", "ftp://x:1")
    assert r.returncode == 2 and "http://HOST:PORT" in r.stderr
    r = health("--url", "http://127.0.0.1:1", "--socket", "/tmp/x.sock")
    assert r.returncode == 2 and "not both" in r.stderr


def test_health_ready_waits_for_the_peers(tmp_path):
    """A sidecar whose peer is not up is alive (healthz 200) but not ready (readyz 503)."""
    admin, p0, p1 = free_tcp_port(), free_tcp_port(), free_tcp_port()
    proc, sock = _serve(tmp_path, "127.0.0.1:%d" % admin, "--rank", "0", "--world-size", "2",
                        "--peers", "127.0.0.1:%d,127.0.0.1:%d" % (p0, p1),
                        "--peer-listen", "127.0.0.1:%d" % p0, "--secret", "health-test")
    try:
        _wait_socket(sock, proc)
        url = "http://127.0.0.1:%d" % admin
        r = health("--url", url)
        assert r.returncode == 0, r.stderr
        r = health("--url", url, "--ready")
        assert r.returncode == 1, r
        assert "/readyz: HTTP 503" in r.stderr, r.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_status_shows_the_streams_of_ordered_steps(sidecar_factory):
    sc = sidecar_factory()
    c = sc.client()
    try:
        assert c.cancel(("model.a", 3, 1)) is True
    finally:
        c.close()
    r = status("--socket", sc.socket)
    assert r.returncode == 0, r.stderr
    assert "streams (steps run in the trainers' order)" in r.stdout
    assert "model.a  nothing run yet, 0 waiting, 1 cancelled ahead" in r.stdout
