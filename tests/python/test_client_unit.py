"""Client tests: transport, errors and tensor bytes against the real sidecar (skipped when
`lightwire serve` is not built); URL parsing, environment and shared memory need none."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import lightwire
from lightwire import LightwireError, SidecarUnavailable, ShmSegment
from lightwire._tensor import to_wire
from lightwire.client import _error_from

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _open_fds(c):
    """The sidecar's open descriptors (its /metrics), read over `c`'s own connection."""
    for line in c.metrics().splitlines():
        if line.startswith("process_open_fds "):
            return int(float(line.split()[1]))
    raise AssertionError("no process_open_fds in /metrics")


def _settled_fds(c, timeout=3.0):
    """process_open_fds once two readings agree (earlier clients' closes have been seen)."""
    deadline = time.monotonic() + timeout
    prev = _open_fds(c)
    while True:
        time.sleep(0.05)
        cur = _open_fds(c)
        if cur == prev or time.monotonic() > deadline:
            return cur
        prev = cur


def _tensor(c, name):
    for t in c.status()["tensors"]:
        if t["name"] == name:
            return t
    raise AssertionError("tensor %r not in /v1/status" % name)


def test_keepalive_one_connection_per_thread(sidecar):
    c = sidecar.client()
    base = _settled_fds(c)  # counts this client's one connection
    conn = c._local.conn
    for _ in range(5):
        assert c.healthz()
        assert c.emit_gradient(np.ones(4, np.float32), name="ka", step=_) is not None
    assert c._local.conn is conn  # one connection for all of them
    assert _open_fds(c) == base  # the sidecar saw no new connection
    seen = []

    def other():
        seen.append((_open_fds(c), c._local.conn))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen[0][0] == base + 1  # a second thread gets its own connection
    assert seen[0][1] is not conn
    assert _open_fds(c) == base + 1 and c._local.conn is conn  # the first one is still in use
    c.close()
    probe = sidecar.client()
    deadline = time.monotonic() + 3
    while _open_fds(probe) != base and time.monotonic() < deadline:  # close() closed both
        time.sleep(0.05)
    assert _open_fds(probe) == base
    probe.close()


def test_missing_socket_is_unavailable(tmp_path):
    c = lightwire.Client(socket_path=os.path.join(str(tmp_path), "none.sock"), timeout=1)
    with pytest.raises(SidecarUnavailable) as ei:
        c.status()
    assert isinstance(ei.value, LightwireError) and ei.value.status is None
    assert not c.healthz()


def test_read_timeout_is_unavailable(sidecar):
    c = sidecar.client(timeout=(1.0, 0.5))
    assert c.healthz()
    os.kill(sidecar.proc.pid, signal.SIGSTOP)  # the sidecar stalls: accepts nothing, answers nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(SidecarUnavailable) as ei:
            c.status()
        assert ei.value.error == "timeout" and ei.value.status is None
        assert 0.4 <= time.monotonic() - t0 < 3
        assert c._local.conn is None  # the timed-out connection was dropped
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    assert c.healthz()  # a fresh connection after the timed-out one
    c.close()


def test_stopped_server_is_unavailable(sidecar):
    c = sidecar.client(timeout=2)
    assert c.healthz()
    sidecar.stop()  # SIGTERM: exits 0 and removes its socket
    with pytest.raises(SidecarUnavailable) as ei:
        c.status()
    assert ei.value.status is None
    assert not c.healthz()


def test_error_body_parsed(shared_sidecar):
    c = shared_sidecar.client()
    assert c.healthz()
    conn = c._local.conn
    with pytest.raises(LightwireError) as ei:
        c.release_buffer("b999999")
    e = ei.value
    assert (e.status, e.error) == (404, "not_found") and "b999999" in e.message
    assert not isinstance(e, SidecarUnavailable)
    with pytest.raises(LightwireError) as ei:
        c.request("GET", "/no/such/route")
    assert (ei.value.status, ei.value.error) == (404, "not_found") and ei.value.message
    assert c.healthz() and c._local.conn is conn  # the connection survives error replies
    c.close()


def test_error_from_non_json_body():
    # The sidecar always answers JSON errors; a proxy in between may not.
    e = _error_from(502, b"bad gateway\n")
    assert (e.status, e.error, e.message) == (502, "http_502", "bad gateway")
    e = _error_from(503, b"")
    assert (e.status, e.error, e.message) == (503, "http_503", "Service Unavailable")
    e = _error_from(400, b'{"error": "invalid_argument", "message": "m"}')
    assert (e.status, e.error, e.message) == (400, "invalid_argument", "m")


def test_tcp_url_parsing():
    c = lightwire.Client(url="http://127.0.0.1:4780")
    assert (c._host, c._port) == ("127.0.0.1", 4780)
    with pytest.raises(ValueError):
        lightwire.Client(url="https://x")


def test_socket_from_env(monkeypatch):
    monkeypatch.setenv("LIGHTWIRE_SOCKET", "/tmp/x.sock")
    assert lightwire.Client().socket_path == "/tmp/x.sock"
    assert lightwire.Client(socket_path="/tmp/y.sock").socket_path == "/tmp/y.sock"
    monkeypatch.delenv("LIGHTWIRE_SOCKET")
    assert lightwire.Client().socket_path == "/run/lightwire/lightwire.sock"


@pytest.mark.parametrize("dtype", ["float32", "float16", ">f4"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), ()])
def test_numpy_wire_and_round_trip(shared_sidecar, dtype, shape):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(shape).astype(dtype)
    w = to_wire(a)
    wire_dtype = "float16" if dtype == "float16" else "float32"
    assert w.dtype == wire_dtype
    assert bytes(w.body) == np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
    c = shared_sidecar.client(trainer=0)
    # Legal name characters, sent literally; one tensor per case on the shared sidecar.
    name = "t.x:y/z-1.%s.%s" % (dtype.replace(">", "be"), "_".join(map(str, shape)) or "scalar")
    out = c.emit_gradient(a, name=name, step=3)
    assert isinstance(out, np.ndarray) and out.shape == a.shape and out.dtype == a.dtype.newbyteorder("=")
    assert out.tobytes() == a.astype(out.dtype).tobytes()  # codec none: bit for bit
    t = _tensor(c, name)
    assert (t["elements"], t["dtype"], t["last_step"], t["codec"]) == (a.size, wire_dtype, 3, "none")
    c.close()


def test_numpy_noncontiguous_and_bad_dtype(shared_sidecar):
    c = shared_sidecar.client()
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    out = c.emit_gradient(a, name="np.nc", step=0)
    np.testing.assert_array_equal(out, a)
    assert out.flags.c_contiguous and out.shape == (4, 3)
    with pytest.raises(TypeError):
        c.emit_gradient(np.zeros(3, np.float64), name="x", step=0)
    with pytest.raises(TypeError):
        c.emit_gradient([1.0, 2.0], name="x", step=0)
    c.close()


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(5,), (4, 3), (2, 1, 3)])
def test_torch_wire_and_round_trip(shared_sidecar, dtype, shape):
    g = torch.Generator().manual_seed(2)
    t = torch.randn(shape, generator=g).to(getattr(torch, dtype))
    w = to_wire(t)
    assert w.dtype == dtype and w.shape == shape and w.nbytes == t.numel() * t.element_size()
    bits = t.view(torch.int16) if dtype != "float32" else t.view(torch.int32)
    assert bytes(w.body) == bits.numpy().tobytes()
    c = shared_sidecar.client()
    name = "w.%s.%s" % (dtype, "_".join(map(str, shape)))
    out = c.emit_gradient(t, name=name, step=1)
    assert isinstance(out, torch.Tensor) and out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.int16 if dtype != "float32" else torch.int32), bits)
    assert _tensor(c, name)["dtype"] == dtype
    c.close()


@needs_torch
def test_torch_noncontiguous_requires_grad(shared_sidecar):
    c = shared_sidecar.client()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t().requires_grad_()
    out = c.emit_gradient(t, name="torch.nc", step=0)
    assert torch.equal(out, t.detach()) and not out.requires_grad and out.shape == (4, 3)
    with pytest.raises(TypeError):
        c.emit_gradient(torch.zeros(2, dtype=torch.float64), name="x", step=0)
    c.close()


def test_form2_and_buffers(shared_sidecar):
    c = shared_sidecar.client()
    with ShmSegment(64) as seg:
        assert seg.shm_name.startswith("/") and not seg.name.startswith("/")
        bid = c.register_buffer(seg)
        assert seg.buffer_id == bid
        # Registered over the Unix socket: the sidecar knows this process as the owner.
        assert {"id": bid, "name": seg.shm_name, "size": 64, "kind": "shm", "pid": os.getpid()} \
            in c.status()["buffers"]
        a = np.frombuffer(seg.buf, dtype=np.float32, count=16)
        a[:] = np.arange(16)
        reply = c.emit_gradient_shm(seg, name="b.0", step=0)
        assert reply["elements"] == 16 and reply["name"] == "b.0" and reply["codec"] == "none"
        np.testing.assert_array_equal(a, np.arange(16, dtype=np.float32))
        del a
        c.release_buffer(seg)
        assert seg.buffer_id is None
        assert bid not in [b["id"] for b in c.status()["buffers"]]
        with pytest.raises(LightwireError) as ei:
            c.release_buffer(bid)
        assert ei.value.status == 404
        with pytest.raises(ValueError):
            c.emit_gradient_shm(seg, name="b.0", step=1)  # no longer registered
    assert not os.path.exists("/dev/shm/" + seg.name)
    c.close()


def test_module_level_default_client(shared_sidecar, monkeypatch):
    import lightwire.client as lc
    monkeypatch.setenv("LIGHTWIRE_SOCKET", shared_sidecar.socket)
    monkeypatch.setattr(lc, "_default", None)
    out = lightwire.emit_gradient(np.ones(3, np.float32), name="m", step=0)
    np.testing.assert_array_equal(out, np.ones(3, np.float32))
    assert lightwire.report(0, loss=1.5) == {}
    assert lc._default.socket_path == shared_sidecar.socket
    assert lc.default_client() is lc._default
    last = lc._default.status()["last_report"]
    assert last.get("step") == 0 and last.get("loss") == 1.5, last
    lc._default.close()


SHM_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from lightwire import ShmSegment
    if sys.argv[2] == "leak":
        print(ShmSegment(128).name)  # never closed: resource_tracker removes it at exit
        sys.exit(0)
    segs = [ShmSegment(4096) for _ in range(3)]
    names = [s.name for s in segs]
    for s in segs:
        assert os.path.exists("/dev/shm/" + s.name)
    view = segs[0].buf[:8]          # a live export: close() must still unlink, quietly
    for s in segs:
        s.close()
        s.close()                   # idempotent
        s.unlink()
    for n in names:
        assert not os.path.exists("/dev/shm/" + n), n
    del view
    with ShmSegment(100, name="/lightwire-test-%d" % os.getpid()) as s:
        assert s.shm_name == "/lightwire-test-%d" % os.getpid() and s.size == 100
    print(" ".join(names))
""")


def _run_shm_script(mode):
    client_dir = os.path.dirname(os.path.dirname(lightwire.__file__))
    r = subprocess.run([sys.executable, "-c", SHM_SCRIPT, client_dir, mode], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=60)
    return r.returncode, r.stdout.decode().split(), r.stderr.decode()


def test_shm_lifecycle_unlinked_once_no_tracker_warnings():
    rc, names, err = _run_shm_script("normal")
    assert rc == 0, err
    assert err == "", err  # no resource_tracker warning, no KeyError from a double unregister
    assert len(names) == 3 and not any(os.path.exists("/dev/shm/" + n) for n in names)


def test_shm_leaked_segment_removed_by_tracker():
    rc, names, err = _run_shm_script("leak")
    assert rc == 0, err
    assert "Traceback" not in err and err.count("leaked shared_memory") == 1, err
    assert not os.path.exists("/dev/shm/" + names[0])


# ------------------------------------------------------------------------------------------------
# Durable state and settings (docs/policies.md): checkpoint, resume, put_config, report
# ------------------------------------------------------------------------------------------------
def test_checkpoint_and_resume(sidecar_factory):
    sc = sidecar_factory(codec="topk", density=0.1)
    c = sc.client()
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(500).astype(np.float32) for _ in range(6)]
    for s in range(4):
        c.emit_gradient(xs[s], name="ck", step=s)
    reply = c.checkpoint(3)
    assert reply["step"] == 3 and set(reply) >= {"step", "path", "peers"}, reply
    assert os.path.dirname(os.path.realpath(reply["path"])) == \
        os.path.realpath(os.path.join(sc.state_dir, "trainer")), reply
    assert os.path.exists(reply["path"])
    first = [c.emit_gradient(xs[s], name="ck", step=s) for s in (4, 5)]
    with pytest.raises(LightwireError) as ei:  # step 5 completed: the state after 2 is gone
        c.checkpoint(2)
    assert ei.value.status == 409
    assert c.resume(3) == {"step": 3, "next_step": 4}
    assert _tensor(c, "ck")["last_committed_step"] == 3
    # topk with error feedback: the same steps again give the same bits.
    again = [c.emit_gradient(xs[s], name="ck", step=s) for s in (4, 5)]
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()
    with pytest.raises(LightwireError) as ei:
        c.resume(99)
    assert (ei.value.status, ei.value.error) == (404, "not_found"), ei.value
    with pytest.raises(LightwireError) as ei:
        c.checkpoint(-1)
    assert ei.value.status == 400
    c.close()


def test_put_config_returns_the_proposal(sidecar):
    c = sidecar.client()
    with ShmSegment(4 * 64) as seg:
        c.register_buffer(seg)
        np.frombuffer(seg.buf, dtype=np.float32)[:] = 1.0
        assert c.emit_gradient_shm(seg, name="pc", step=0)["settings"] == 0
        reply = c.put_config({"default": {"codec": "fp16"}})
        assert reply["applied"] is False and isinstance(reply["proposal"], int), reply
        # The proposal travels with the next step (1) and takes effect at the one after it (2).
        r1 = c.emit_gradient_shm(seg, name="pc", step=1)
        r2 = c.emit_gradient_shm(seg, name="pc", step=2)
        assert (r1["settings"], r1["codec"]) == (0, "none"), r1
        assert (r2["settings"], r2["codec"]) == (1, "fp16"), r2
        assert r2["mode"] == "compressed"
        c.release_buffer(seg)
    versions = c.status()["policies"]["settings"]
    assert [v["from_step"] for v in versions] == [0, 2], versions
    with pytest.raises(LightwireError) as ei:
        c.put_config({"default": {"codec": "nonsense"}})
    assert ei.value.status == 400
    c.close()


def test_report_loss_reaches_the_policies(sidecar):
    c = sidecar.client()
    assert c.report(4, loss=0.25) == {}
    assert c.report(5, fallbacks=2, trainer=0) == {}
    with pytest.raises(LightwireError) as ei:
        c.report(6, loss=float("nan"))
    assert ei.value.status == 400
    c.close()


def test_module_level_checkpoint_and_resume(sidecar, monkeypatch):
    import lightwire.client as lc
    monkeypatch.setenv("LIGHTWIRE_SOCKET", sidecar.socket)
    monkeypatch.setattr(lc, "_default", None)
    lightwire.emit_gradient(np.ones(3, np.float32), name="m", step=0)
    assert lc.checkpoint(0)["step"] == 0
    assert lc.resume(0)["next_step"] == 1
    lc._default.close()


class _FakeBucket(object):
    """What ddp_comm_hook uses of a torch.distributed.GradBucket (`last`: what is_last() says;
    None: a bucket without is_last())."""

    def __init__(self, index, buf, last=None):
        self._index, self._buf = index, buf
        if last is not None:
            self.is_last = lambda: last

    def index(self):
        return self._index

    def buffer(self):
        return self._buf

    def parameters(self):
        return []


@needs_torch
def test_torch_save_state_and_load_state(sidecar):
    import lightwire.torch as lwt
    c = sidecar.client()
    state = lwt.LightwireHookState(client=c, trainer=0)
    try:
        assert state.last_step is None
        for i in range(3):
            fut = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.full((16,), float(i))))
            assert torch.equal(fut.wait(), torch.full((16,), float(i)))
        assert state.last_step == 2 and state.sidecar_steps == 3
        reply = lwt.save_state(state.last_step, hook_state=state)
        assert reply["step"] == 2 and os.path.exists(reply["path"])
        fut = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.ones(16)))  # step 3
        fut.wait()
        # A restart from the step-2 checkpoint: the hook's counters continue at step 3.
        assert lwt.load_state(2, hook_state=state) == {"step": 2, "next_step": 3}
        assert state.steps == {} and state.first_step == 3
        fut = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.full((16,), 7.0)))
        assert torch.equal(fut.wait(), torch.full((16,), 7.0))
        assert state.fallbacks == 0 and state.last_step == 3
        assert _tensor(c, "bucket.0")["last_committed_step"] == 3
        with pytest.raises(LightwireError) as ei:
            lwt.load_state(40, client=c)
        assert ei.value.status == 404
    finally:
        state.close()
        c.close()


@needs_torch
def test_hook_holds_an_iterations_buckets_until_its_last_and_drops_an_abandoned_one(sidecar):
    """With agreement the iteration's futures complete once its last bucket has answered; an
    iteration whose last bucket never comes (its backward pass stopped) is dropped when the next
    one starts, its futures failed, instead of being agreed on with the next one's."""
    import lightwire.torch as lwt
    c = sidecar.client()
    state = lwt.LightwireHookState(client=c, trainer=0)
    try:
        a = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.full((8,), 1.0), last=False))
        b = lwt.ddp_comm_hook(state, _FakeBucket(1, torch.full((4,), 2.0), last=True))
        assert torch.equal(b.wait(), torch.full((4,), 2.0))
        assert a.done() and torch.equal(a.wait(), torch.full((8,), 1.0))
        # Iteration 2 stops after its first bucket; iteration 3 runs whole.
        lost = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.full((8,), 3.0), last=False))
        x = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.full((8,), 4.0), last=False))
        y = lwt.ddp_comm_hook(state, _FakeBucket(1, torch.full((4,), 5.0), last=True))
        assert torch.equal(y.wait(), torch.full((4,), 5.0))
        assert torch.equal(x.wait(), torch.full((8,), 4.0))
        with pytest.raises(Exception, match="abandoned"):
            lost.wait()
        assert state.fallbacks == 0
    finally:
        state.close()
        c.close()


@needs_torch
def test_hook_cancels_a_numbered_bucket_it_could_not_send(sidecar):
    """Buckets go with their place in the hook's stream (docs/api.md "Buckets in flight"); one
    that fails before it is sent (here a dtype the sidecar does not take) is cancelled, so the
    bucket after it runs at once instead of waiting limits.step_timeout_s for it."""
    import lightwire.torch as lwt
    c = sidecar.client()
    state = lwt.LightwireHookState(client=c, trainer=0)
    try:
        t0 = time.monotonic()
        bad = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.zeros(8, dtype=torch.float64),
                                                   last=False))
        good = lwt.ddp_comm_hook(state, _FakeBucket(1, torch.full((4,), 2.0), last=True))
        assert torch.equal(good.wait(), torch.full((4,), 2.0))
        assert time.monotonic() - t0 < 10
        with pytest.raises(Exception):
            bad.wait()  # no process group to fall back to
        streams = {s["stream"]: s for s in c.status()["streams"]}
        assert streams[state.stream]["last"] == {"iteration": 0, "position": 1}
        assert streams[state.stream]["waiting_steps"] == 0
        # The next iteration starts at position 0 again.
        again = lwt.ddp_comm_hook(state, _FakeBucket(0, torch.full((8,), 3.0), last=True))
        assert torch.equal(again.wait(), torch.full((8,), 3.0))
        streams = {s["stream"]: s for s in c.status()["streams"]}
        assert streams[state.stream]["last"] == {"iteration": 1, "position": 0}
    finally:
        state.close()
        c.close()


def test_wait_ready(tmp_path, sidecar):
    # Nothing there: waits, then fails naming the reason.
    c = lightwire.Client(socket_path=str(tmp_path / "none.sock"), timeout=2)
    notes = []
    t0 = time.monotonic()
    with pytest.raises(lightwire.SidecarUnavailable) as e:
        c.wait_ready(timeout=0.6, interval=0.1, progress=notes.append)
    assert 0.5 <= time.monotonic() - t0 < 5
    assert e.value.error == "not_ready" and "not ready after" in str(e.value)
    assert "none.sock" in str(e.value)
    # A sidecar of world size 1 is ready at once.
    with sidecar.client() as c:
        c.wait_ready(timeout=10)


def test_tensor_name_escapes_only_what_the_api_refuses():
    lwt = pytest.importorskip("lightwire.torch")
    assert lwt.tensor_name("layers.0.attn.in_proj_weight") == "layers.0.attn.in_proj_weight"
    assert lwt.tensor_name("a b") == "a:20b"
    assert lwt.tensor_name("a:b") == "a:3ab"
    assert lwt.tensor_name("\u00e9") == ":c3:a9"
    names = ["a b", "a:20b", "a:3a20b", "a_b", "a.b", "a/b", "a-b", "ab"]
    assert len({lwt.tensor_name(n) for n in names}) == len(names)


@needs_torch
def test_hook_counts_the_elements_exchanged_dense():
    import lightwire.torch as lwt
    state = lwt.LightwireHookState(client=lightwire.Client(socket_path="/nonexistent"))
    try:
        assert state.dense_share() is None
        per_layer = {"name": "bucket.x", "layers": [
            {"name": "w", "codec": "dgc", "mode": "compressed", "elements": 300},
            {"name": "b", "codec": "none", "mode": "compressed", "elements": 20},
            {"name": "v", "codec": "dgc", "mode": "bypass", "elements": 80}]}
        assert lwt._dense_elements(per_layer) == (400, 100)
        assert lwt._dense_elements({"codec": "powersgd", "mode": "dense", "elements": 50}) == (50, 50)
        assert lwt._dense_elements({"codec": "topk", "mode": "compressed", "elements": 50}) == (50, 0)
        assert lwt._dense_elements(None) == (0, 0)
    finally:
        state.close()


def test_buffer_pool_gauges(sidecar):
    """lightwire_buffer_pool_bytes (docs/metrics.md): a large body's string is kept for the next
    large body once its reply is written, and the gauge shows it; without peers the receive pool
    is empty."""
    from conftest import metric_total
    c = sidecar.client(trainer=0)
    text = c.metrics()
    assert metric_total(text, "lightwire_buffer_pool_bytes", 'pool="request_bodies"') == 0, text
    a = np.arange(1 << 18, dtype=np.float32)  # a 1 MiB body
    for step in (1, 2, 3):
        out = c.emit_gradient(a, name="pooled", step=step)
        assert out.tobytes() == a.tobytes()
    text = c.metrics()
    kept = metric_total(text, "lightwire_buffer_pool_bytes", 'pool="request_bodies"')
    # One string of at least the body's size (reused at every step: not one per step).
    assert (1 << 20) <= kept < 3 << 20, text
    assert metric_total(text, "lightwire_buffer_pool_bytes", 'pool="receive"') == 0
    c.close()
