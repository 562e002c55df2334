"""The client against the real sidecar (skipped when `lightwire serve` is not built)."""

import os
import threading

import numpy as np
import pytest

import lightwire
from lightwire import LightwireError, ShmSegment

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def test_health_and_status(sidecar):
    c = sidecar.client()
    assert c.healthz()
    st = c.status()
    assert isinstance(st, dict)
    assert st["peer_tls"] is None  # world size 1: no peer links, no TLS


def test_sighup_without_tls_changes_nothing(sidecar):
    """SIGHUP reloads the peer TLS files; without TLS it is logged and ignored (its default
    action would end the process, and with it the job's step)."""
    import signal
    import time
    sidecar.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "SIGHUP received: nothing to reload (peer.tls is off)" not in sidecar.stderr():
        assert sidecar.proc.poll() is None, sidecar.stderr()
        assert time.monotonic() < deadline, sidecar.stderr()
        time.sleep(0.02)
    c = sidecar.client()
    assert c.healthz()
    x = np.arange(8, dtype=np.float32)
    assert np.array_equal(c.emit_gradient(x, "after-sighup", 0), x)
    assert sidecar.proc.poll() is None


def test_numpy_codec_none_is_identity(sidecar):
    c = sidecar.client()
    rng = np.random.default_rng(3)
    for step, (dtype, shape) in enumerate([("float32", (1000,)), ("float16", (33, 7)), ("float32", (2, 3, 4))]):
        a = rng.standard_normal(shape).astype(dtype)
        out = c.emit_gradient(a, name="np.%s" % dtype, step=step)
        assert out.dtype == a.dtype and out.shape == a.shape
        assert out.tobytes() == a.tobytes()
    assert c.last_figures["codec"] == "none"


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_codec_none_is_identity_bit_for_bit(sidecar, dtype):
    c = sidecar.client()
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        t = (torch.randn(64, 17, generator=g) * 10 ** step).to(getattr(torch, dtype))
        out = c.emit_gradient(t, name="t." + dtype, step=step)
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out.view(torch.int16 if dtype != "float32" else torch.int32),
                           t.view(torch.int16 if dtype != "float32" else torch.int32))


def test_form2_shm_in_place(sidecar):
    c = sidecar.client()
    with ShmSegment(4096) as seg:
        bid = c.register_buffer(seg)
        a = np.frombuffer(seg.buf, dtype=np.float32, count=1024)
        rng = np.random.default_rng(5)
        for step in range(3):
            x = rng.standard_normal(256).astype(np.float32)
            a[256:512] = x
            reply = c.emit_gradient_shm(bid, name="shm.t", step=step, shape=[256], offset=1024)
            assert reply["name"] == "shm.t" and reply["step"] == step and reply["elements"] == 256
            assert reply["codec"] == "none"
            assert a[256:512].tobytes() == x.tobytes()
        del a
        c.release_buffer(seg)


def test_bad_requests(sidecar):
    c = sidecar.client()
    with pytest.raises(LightwireError) as ei:
        c.emit_gradient_shm("b999", name="x", step=0, shape=[4])
    assert (ei.value.status, ei.value.error) == (404, "not_found")
    with pytest.raises(LightwireError) as ei:
        c.release_buffer("b999")
    assert ei.value.status == 404
    with ShmSegment(64) as seg:
        c.register_buffer(seg)
        with pytest.raises(LightwireError) as ei:  # 32 floats do not fit a 64-byte buffer
            c.emit_gradient_shm(seg.buffer_id, name="x", step=0, shape=[32])
        assert (ei.value.status, ei.value.error) == (400, "invalid_argument")
        c.release_buffer(seg)
    # Shape that does not match the byte count (raw form).
    with pytest.raises(LightwireError) as ei:
        c.request("POST", "/v1/emit_gradient?name=x&step=0&shape=3,3",
                  body=np.zeros(8, np.float32).tobytes(), headers={"Content-Type": "application/octet-stream"})
    assert (ei.value.status, ei.value.error) == (400, "invalid_argument")
    with pytest.raises(LightwireError) as ei:
        c.register_buffer("/lightwire-does-not-exist", size=64)
    assert (ei.value.status, ei.value.error) == (400, "invalid_argument")
    with pytest.raises(LightwireError) as ei:
        c.request("GET", "/no/such/route")
    assert ei.value.status == 404
    assert c.healthz()  # still serving


def test_report(sidecar):
    c = sidecar.client(trainer=0)
    assert c.report(1, loss=0.5) == {}
    assert c.report(2, fallbacks=1) == {}
    assert c.report(3, reward=-2.5) == {}  # a reward may be negative
    assert c.status()["last_report"] == {"step": 3, "trainer": 0, "reward": -2.5}
    with pytest.raises(LightwireError) as ei:
        c.request("POST", "/v1/report", body=b"{not json", headers={"Content-Type": "application/json"})
    assert ei.value.status == 400
    # A reward that is not a finite number: 400 naming it, and the report is not taken.
    for body, says in [(b'{"step": 4, "reward": 1e999}', "report field 'reward' must be finite"),
                       (b'{"step": 4, "reward": "high"}', "report field 'reward' must be a number")]:
        with pytest.raises(LightwireError) as ei:
            c.request("POST", "/v1/report", body=body, headers={"Content-Type": "application/json"})
        assert (ei.value.status, ei.value.error) == (400, "invalid_argument")
        assert says in ei.value.message, ei.value.message
    assert c.status()["last_report"] == {"step": 3, "trainer": 0, "reward": -2.5}


def test_two_local_trainers_get_the_mean(sidecar_factory):
    sc = sidecar_factory(local_trainers=2)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(500).astype(np.float32) for _ in range(2)]
    results = [None, None]
    errors = []

    def trainer(i):
        try:
            c = sc.client(trainer=i)
            for step in range(3):
                results[i] = c.emit_gradient(xs[i] * (step + 1), name="shared", step=step)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    expect = (xs[0] * 3 + xs[1] * 3) / 2
    np.testing.assert_allclose(results[0], expect, rtol=1e-6, atol=1e-6)
    assert results[0].tobytes() == results[1].tobytes()


def test_tcp_control_listener(sidecar_factory):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sc = sidecar_factory(control_tcp="127.0.0.1:%d" % port)
    c = lightwire.Client(url="http://127.0.0.1:%d" % port, timeout=(2.0, 10.0))
    assert c.healthz()
    a = np.arange(10, dtype=np.float32)
    assert c.emit_gradient(a, name="tcp", step=0).tobytes() == a.tobytes()
    assert sc.client().healthz()  # the Unix socket serves as well
    c.close()


def test_reconnects_after_idle_timeout(sidecar_factory):
    import time
    sc = sidecar_factory(extra=["--idle-timeout", "0.3"])
    c = sc.client()
    a = np.ones(8, np.float32)
    assert c.emit_gradient(a, name="idle", step=0).tobytes() == a.tobytes()
    first = c._local.conn
    time.sleep(0.8)  # the sidecar closes the idle keep-alive connection
    assert c.emit_gradient(a, name="idle", step=1).tobytes() == a.tobytes()
    assert c._local.conn is not first


def test_client_waits_out_a_busy_listener(sidecar_factory):
    """A connection over the Unix socket's budget gets 503 `busy` with Retry-After; the client
    sends the request again once a place is free, within its connect timeout."""
    import threading
    import time
    sc = sidecar_factory(extra=["--unix-max-connections", "1"])
    holder = sc.client()
    assert holder.healthz()  # a completed request: its connection is never evicted
    waiting = lightwire.Client(socket_path=sc.socket, timeout=(5.0, 10.0))
    threading.Timer(1.2, holder.close).start()  # the place frees up after a while
    t0 = time.monotonic()
    a = np.arange(4, dtype=np.float32)
    assert waiting.emit_gradient(a, name="busy", step=0).tobytes() == a.tobytes()
    assert time.monotonic() - t0 >= 1.0
    # Without a place within the connect timeout, the caller gets the refusal.
    waiting.close()
    holder2 = sc.client()
    assert holder2.healthz()
    impatient = lightwire.Client(socket_path=sc.socket, timeout=(1.5, 10.0))
    with pytest.raises(lightwire.LightwireError) as e:
        impatient.request("GET", "/healthz")
    assert e.value.status == 503 and e.value.error == "busy"
    assert "limits.unix.max_connections" in e.value.message
    # A large body: the sidecar closes before the client has sent it all, and the client still
    # reads the refusal rather than reporting a broken connection.
    with pytest.raises(lightwire.LightwireError) as e:
        impatient.emit_gradient(np.zeros(1 << 20, np.float32), name="busy", step=1)
    assert e.value.status == 503 and e.value.error == "busy"
    impatient.close()
    holder2.close()


def test_a_body_the_memory_cannot_hold_is_refused_not_a_crash(sidecar_factory):
    """Under an address-space limit (ulimit -v, or strict overcommit), bodies whose declared
    lengths the sidecar cannot reserve are answered 503 `busy` with Retry-After, counted as
    `body_memory`, and the sidecar serves on."""
    import resource
    import socket
    sc = sidecar_factory()
    client = sc.client()
    assert client.healthz()
    with open("/proc/%d/status" % sc.proc.pid) as f:
        vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:")][0]
    declared = 600 << 20  # two do not fit under the limit; limits.max_body_bytes is 1 GiB
    resource.prlimit(sc.proc.pid, resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
    head = ("POST /v1/emit_gradient?name=big&step=0&dtype=float32&shape=%d HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
            % (declared // 4, declared)).encode()
    conns, replies = [], []
    try:
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5.0)
            s.connect(sc.socket)
            s.sendall(head + b"\0" * 4096)
            conns.append(s)
        for s in conns[1:]:
            replies.append(s.recv(4096).decode("utf-8", "replace"))
    finally:
        for s in conns:
            s.close()
    for r in replies:
        assert r.startswith("HTTP/1.1 503"), r
        assert "Retry-After: 1" in r and '"busy"' in r and "out of memory" in r, r
    assert sc.proc.poll() is None, sc.stderr()
    assert client.healthz()
    a = np.arange(8, dtype=np.float32)
    assert client.emit_gradient(a, name="small", step=0).tobytes() == a.tobytes()
    text = client.metrics()
    assert 'lightwire_limit_hits_total{limit="body_memory",listener="unix"} 2' in text, text
    client.close()


def test_connection_budgets_over_the_open_file_limit_refuse_to_start(tmp_path):
    import resource
    import subprocess
    from conftest import LIGHTWIRE_BIN

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))

    sock = str(tmp_path / "lw.sock")
    proc = subprocess.run(
        [LIGHTWIRE_BIN, "serve", "--socket", sock,
         "--control-tcp", "127.0.0.1:0", "--admin-listen", "", "--state-dir", ""],
        preexec_fn=low_limit, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "open files are limited to 300" in proc.stderr, proc.stderr
    assert "limits.unix.max_connections" in proc.stderr
    assert not os.path.exists(sock)
    # Budgets that fit start.
    proc = subprocess.Popen(
        [LIGHTWIRE_BIN, "serve", "--socket", sock,
         "--control-tcp", "", "--admin-listen", "", "--state-dir", "", "--unix-max-connections",
         "100"], preexec_fn=low_limit, stderr=subprocess.PIPE, text=True)
    try:
        c = lightwire.Client(socket_path=sock, timeout=(1.0, 5.0))
        c.wait_ready(timeout=20)
        assert c.healthz()
        c.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_listener_budget_keys_in_help_check_config_and_docs(tmp_path):
    import re
    import subprocess
    from conftest import LIGHTWIRE_BIN, REPO
    keys = {"limits.header_timeout_s": "--header-timeout", "limits.min_body_rate": "--min-body-rate",
            "limits.unix.max_connections": "--unix-max-connections",
            "limits.unix.max_per_uid": "--unix-max-per-uid",
            "limits.control_tcp.max_connections": "--control-tcp-max-connections",
            "limits.control_tcp.max_per_source": "--control-tcp-max-per-source",
            "limits.admin.max_connections": "--admin-max-connections",
            "limits.admin.max_per_source": "--admin-max-per-source"}
    help_text = subprocess.run([LIGHTWIRE_BIN, "serve", "--help"], capture_output=True,
                               text=True).stdout
    with open(os.path.join(REPO, "docs", "configuration.md")) as f:
        docs = f.read()
    for key, flag in keys.items():
        # The flag, then its description ending in [key, ...] on the next line.
        assert re.search(r"  %s [^\n]*\n[^\n]*\[%s," % (re.escape(flag), re.escape(key)),
                         help_text), key
        assert "| `%s` |" % key in docs, key
    good = tmp_path / "good.yaml"
    good.write_text("limits:\n  header_timeout_s: 5\n  min_body_rate: 0\n"
                    "  unix: {max_connections: 10, max_per_uid: 2}\n"
                    "  control_tcp: {max_connections: 20, max_per_source: 4}\n"
                    "  admin: {max_connections: 8, max_per_source: 2}\n")
    r = subprocess.run([LIGHTWIRE_BIN, "serve", "--check-config", str(good)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    for body, named in (("limits:\n  admin: {max_connections: 0}\n", "limits.admin.max_connections"),
                        ("limits:\n  unix: {max_per_uid: -1}\n", "limits.unix.max_per_uid"),
                        ("limits:\n  header_timeout_s: 0\n", "limits.header_timeout_s"),
                        ("limits:\n  max_connections: 5\n", "limits.max_connections")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(body)
        r = subprocess.run([LIGHTWIRE_BIN, "serve", "--check-config", str(bad)],
                           capture_output=True, text=True)
        assert r.returncode != 0 and named in r.stderr + r.stdout, (body, r.stderr)


def test_check_config_refuses_bias_correction_without_momentum_and_bad_values(tmp_path):
    import subprocess
    from conftest import LIGHTWIRE_BIN
    cases = (("codec: dgc\n    bias_correction: true\n", "needs momentum > 0"),
             ("codec: dgc\n    momentum: 0.9\n    bias_correction: maybe\n",
              "compression.default.bias_correction must be true or false"))
    for body, message in cases:
        bad = tmp_path / "bad.yaml"
        bad.write_text("compression:\n  default:\n    " + body)
        r = subprocess.run([LIGHTWIRE_BIN, "serve", "--check-config", str(bad)],
                           capture_output=True, text=True)
        assert r.returncode != 0 and message in r.stderr + r.stdout, (body, r.stderr)
    good = tmp_path / "good.yaml"
    good.write_text("compression:\n  default:\n    codec: dgc\n    momentum: 0.9\n"
                    "    bias_correction: true\n")
    r = subprocess.run([LIGHTWIRE_BIN, "serve", "--check-config", str(good)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
