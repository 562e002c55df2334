"""Several real sidecars of one job exchanging compressed gradients over loopback TCP
(docs/exchange.md): results equal the numpy reference (tests/reference/lwref.py) computed here in
the documented ring order, bit for bit, on every rank; refusals (wrong secret, wrong job);
a peer killed mid-step and restarted."""

import http.client
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import LIGHTWIRE_BIN, REPO, make_pki, metric_total

sys.path.insert(0, os.path.join(REPO, "tests", "reference"))
xxhash = pytest.importorskip("xxhash")
import lwref  # noqa: E402

import lightwire  # noqa: E402

N = 3000
SHAPE = (60, 50)           # powersgd: the tensor is sent as a matrix (shape= query parameter)
CHUNK = 1024               # several chunks, so the ring owner c mod W matters
STEPS = 3
TENSOR = "layer.0.weight"
JOB = "lw-test-job"
SUMMABLE = ("none", "fp16", "bf16", "randomk")

# (test id, codec, flags, lwref config overrides)
CODECS = {
    "none": ("none", [], {}),
    "fp16": ("fp16", [], {}),
    "bf16": ("bf16", [], {}),
    "topk": ("topk", ["--density", "0.05"], {"density": 0.05}),
    "randomk": ("randomk", ["--density", "0.05"], {"density": 0.05}),
    "threshold": ("threshold", ["--threshold", "1.0"], {"threshold": 1.0}),
    "dgc": ("dgc", ["--density", "0.05"], {"density": 0.05}),
    "dgc_momentum": ("dgc", ["--density", "0.05", "--momentum", "0.9"], {"density": 0.05, "momentum": 0.9}),
    "dgc_bias_correction": ("dgc", ["--density", "0.05", "--momentum", "0.9", "--bias-correction",
                                    "true"],
                            {"density": 0.05, "momentum": 0.9, "bias_correction": True}),
    "qsgd8": ("qsgd", ["--bits", "8"], {"bits": 8}),
    "qsgd4": ("qsgd", ["--bits", "4"], {"bits": 4}),
    "terngrad": ("terngrad", [], {}),
    "signsgd": ("signsgd", [], {}),
    "onebit": ("onebit", [], {}),
    "powersgd": ("powersgd", ["--approx-rank", "1"], {"approx_rank": 1}),
}
SUBSET = ("none", "topk", "qsgd8", "powersgd")
CASES = [(3, k) for k in CODECS] + [(w, k) for w in (2, 4, 5) for k in SUBSET]


def ref_cfg(name, **kw):
    c = {"name": name, "density": None, "ratio": None, "bits": 8, "bucket_size": 512,
         "momentum": 0.0, "clip_norm": 0.0, "sample_fraction": 0.01, "sparse_values": "fp32",
         "error_feedback": None, "threshold": None, "approx_rank": 1}
    c.update(kw)
    return c


def job_seed(job_id):
    return xxhash.xxh3_64_intdigest(job_id.encode("utf-8")) & 0xFFFFFFFF


def add(codec, a, b):
    """Compressed-domain sum a + b of one chunk (docs/exchange.md: addPayloads(received, own))."""
    if codec == "none":
        assert a[:16] == b[:16] and len(a) == len(b)
        va = np.frombuffer(a[16:], dtype="<f4").astype(np.float32)
        vb = np.frombuffer(b[16:], dtype="<f4").astype(np.float32)
        with np.errstate(all="ignore"):
            return a[:16] + (va + vb).astype(np.float32).astype("<f4").tobytes()
    if codec == "powersgd":
        return lwref.powersgd_add(a, b)
    return lwref.add_payloads(codec, a, b)


def ring_sum(codec, payloads, c):
    """The reduction chain of chunk c: ((p[o+1] + p[o+2]) + ...) + p[o], o = c mod W."""
    W = len(payloads)
    o = c % W
    s = payloads[(o + 1) % W]
    for k in range(2, W + 1):
        s = add(codec, s, payloads[(o + k) % W])
    return s


class Reference(object):
    """What every sidecar of a W-rank job must return, step after step (state committed)."""

    def __init__(self, cfg, world, local_trainers, n=N, chunk=CHUNK, job_id=JOB, name=TENSOR, shape=None,
                 sparse="allgather"):
        self.cfg, self.W, self.lt, self.n = cfg, world, local_trainers, n
        # peer.sparse allreduce (topk, dgc): each chunk's global selection (determinism §4.6b)
        self.select_globally = sparse == "allreduce" and cfg["name"] in ("topk", "dgc") and world > 1
        self.seed = job_seed(job_id)
        self.name = name
        self.shape = shape
        self.weight = np.float32(1.0 / (world * local_trainers))
        if cfg["name"] == "powersgd":
            self.ranks = [lwref.PowerSGD(cfg["approx_rank"], n) for _ in range(world)]
        else:
            self.ranks = [lwref.Codec(cfg, n) for _ in range(world)]
            self.chunking = lwref.chunk_ranges(n, chunk, lwref.codec_alignment(cfg))

    def step(self, inputs, step):
        """inputs[rank]: that node's local sum (float32, n). Returns the decoded float32 result."""
        codec = self.cfg["name"]
        W = self.W
        out = np.zeros(self.n, dtype=np.float32)
        if codec == "powersgd":
            sent0 = [self.ranks[r].begin(inputs[r], "fp32", self.seed, self.name, step, self.shape)
                     for r in range(W)]
            red0 = ring_sum("powersgd", sent0, 0)   # one chunk, owner 0
            sent1 = [self.ranks[r].round1(red0) for r in range(W)]
            red1 = ring_sum("powersgd", sent1, 0)
            lwref.powersgd_decode(red0, red1, self.n, self.cfg["approx_rank"], self.weight, out)
            for r in range(W):
                self.ranks[r].finish(red0, red1, self.weight)
            return out
        payloads = [self.ranks[r].step(inputs[r], "fp32", self.chunking, self.seed, self.name, step, r, None,
                                       defer_sent=self.select_globally)[0]
                    for r in range(W)]
        cid = lwref.CODEC_ID[codec]
        if self.select_globally:
            floor = lwref.global_min_key(self.cfg, W)
            k = 0 if floor else lwref.selection_size(self.n, lwref.effective_density(self.cfg, None))
            entries = [lwref.layer_entries(p, cid, self.chunking) for p in payloads]
            selected = [lwref.global_selection(cid, [p[c] for p in payloads], m, floor, k, entries)
                        for c, (b, m) in enumerate(self.chunking)]
            for (b, m), p in zip(self.chunking, selected):
                lwref.decode_payload(p, cid, self.weight, out, b, m)
            for r in range(W):
                self.ranks[r].settle(payloads[r], selected, self.chunking)
            return out
        for c, (b, m) in enumerate(self.chunking):
            if codec in SUMMABLE:
                lwref.decode_payload(ring_sum(codec, [p[c] for p in payloads], c), cid, self.weight, out, b, m)
            else:
                for r in range(W):
                    lwref.decode_payload(payloads[r][c], cid, self.weight, out, b, m)
        return out


def trainer_input(world, rank, trainer, step, n=N):
    rng = np.random.default_rng([world, rank, trainer, step, 7])
    return rng.standard_normal(n).astype(np.float32)


def run_trainers(cluster, jobs, timeout=30.0):
    """jobs: {(rank, trainer): [(step, array), ...]}: one thread per trainer, raw emit_gradient
    through its rank's sidecar, steps in order. Returns {(rank, trainer): {step: result or
    exception}} and the seconds each call took."""
    results = {key: {} for key in jobs}
    elapsed = {key: {} for key in jobs}

    def work(key):
        rank, trainer = key
        c = cluster[rank].client(timeout=(2.0, 20.0), trainer=trainer if cluster.local_trainers > 1 else None)
        try:
            for step, x in jobs[key]:
                t0 = time.monotonic()
                try:
                    results[key][step] = c.emit_gradient(x, TENSOR, step)
                except lightwire.LightwireError as e:
                    results[key][step] = e
                elapsed[key][step] = time.monotonic() - t0
        except BaseException as e:  # pragma: no cover - reported by the caller
            results[key]["crash"] = e
        finally:
            c.close()

    threads = [threading.Thread(target=work, args=(key,), daemon=True) for key in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [key for key, t in zip(jobs, threads) if t.is_alive()]
    assert not hung, "trainers %s still waiting after %.0f s; stderr:\n%s" % (hung, timeout, cluster.stderr())
    for key in jobs:
        assert "crash" not in results[key], results[key]["crash"]
    return results, elapsed


def assert_bitwise(got, want, what):
    g = np.ascontiguousarray(got, dtype=np.float32).reshape(-1).view(np.uint32)
    w = np.ascontiguousarray(want, dtype=np.float32).reshape(-1).view(np.uint32)
    if not np.array_equal(g, w):
        bad = np.nonzero(g != w)[0]
        i = int(bad[0])
        pytest.fail("%s: %d of %d elements differ; first at %d: got %r (0x%08x), want %r (0x%08x)"
                    % (what, len(bad), len(w), i, float(g.view(np.float32)[i]), int(g[i]),
                       float(w.view(np.float32)[i]), int(w[i])))


def check_exchange(cluster_factory, world, key, local_trainers=1, steps=STEPS, extra=(),
                   **cluster_kw):
    codec, flags, over = CODECS[key]
    cl = cluster_factory(world, codec=codec, codec_args=flags, local_trainers=local_trainers,
                         extra=extra, **cluster_kw)
    shape = SHAPE if codec == "powersgd" else None
    ref = Reference(ref_cfg(codec, **over), world, local_trainers, shape=shape)
    jobs = {}
    for r in range(world):
        for t in range(local_trainers):
            xs = []
            for s in range(steps):
                x = trainer_input(world, r, t, s)
                xs.append((s, x.reshape(shape) if shape else x))
            jobs[(r, t)] = xs
    results, _ = run_trainers(cl, jobs)
    for s in range(steps):
        local = []
        for r in range(world):
            acc = trainer_input(world, r, 0, s)
            for t in range(1, local_trainers):
                acc = (acc + trainer_input(world, r, t, s)).astype(np.float32)  # trainer order, fp32
            local.append(acc)
        want = ref.step(local, s)
        first = None
        for (r, t), got in sorted(results.items()):
            res = got[s]
            assert not isinstance(res, Exception), "W=%d %s step %d rank %d trainer %d: %s\n%s" % (
                world, key, s, r, t, res, cl.stderr())
            assert res.dtype == np.float32 and res.size == N
            if first is None:
                first = res
            assert_bitwise(res, first, "W=%d %s step %d: rank %d trainer %d vs rank 0" % (world, key, s, r, t))
        assert_bitwise(first, want, "W=%d %s step %d: sidecars vs reference" % (world, key, s))
        assert np.any(want != 0)
    return cl


@pytest.mark.parametrize("world,key", CASES, ids=["W%d-%s" % c for c in CASES])
def test_exchange_matches_reference(cluster_factory, world, key):
    check_exchange(cluster_factory, world, key)


@pytest.mark.parametrize("key", ["none", "topk"])
def test_two_local_trainers_per_node(cluster_factory, key):
    check_exchange(cluster_factory, 2, key, local_trainers=2)


@pytest.mark.parametrize("key", ["none", "fp16"])
def test_elementwise_codec_tensor_of_one_chunk_is_split_among_the_ranks(cluster_factory, key):
    """A tensor of fewer chunks than ranks, codec none or fp16: the sidecar cuts it into W chunks of
    ⌈n / W⌉ elements (docs/exchange.md "One step"), so every rank owns one, and the result is
    the reference's with that chunking — which differs from the one-chunk chain's order."""
    W, n = 3, 200_000
    codec, flags, over = CODECS[key]
    cl = cluster_factory(W, codec=codec, codec_args=flags, chunk_elements=1 << 20)
    split = Reference(ref_cfg(codec, **over), W, 1, n=n, chunk=(n + W - 1) // W)
    whole = Reference(ref_cfg(codec, **over), W, 1, n=n, chunk=1 << 20)
    assert len(split.chunking) == W and len(whole.chunking) == 1
    jobs = {(r, 0): [(s, trainer_input(W, r, 0, s, n)) for s in range(2)] for r in range(W)}
    results, _ = run_trainers(cl, jobs)
    for s in range(2):
        inputs = [trainer_input(W, r, 0, s, n) for r in range(W)]
        want, other = split.step(inputs, s), whole.step(inputs, s)
        assert np.any(want.view(np.uint32) != other.view(np.uint32))  # the order shows
        for r in range(W):
            got = results[(r, 0)][s]
            assert not isinstance(got, Exception), "%s\n%s" % (got, cl.stderr())
            assert_bitwise(got, want, "%s step %d rank %d vs the split reference" % (key, s, r))


def test_peers_template_and_secret_file(cluster_factory):
    """As docker/k8s configures the sidecars: peer.peers is one template with {rank} (here
    127.0.{rank}.1:PORT, each rank on its own loopback address) and the job secret is read from a
    file (peer.secret_file, with a trailing newline as `echo` writes it). The sidecars find and
    admit each other and the results are exact; /v1/status shows the expanded peers and no
    secret."""
    cl = check_exchange(cluster_factory, 3, "dgc", peers_template=True, secret_file=True)
    port = cl.ports[0]
    for r in range(3):
        c = cl[r].client()
        try:
            peer = c.status()["config"]["peer"]
        finally:
            c.close()
        assert peer["peers"] == ",".join("127.0.%d.1:%d" % (i, port) for i in range(3)), peer
        assert peer["secret"] == "<redacted>" and peer["secret_file"].endswith("peer-secret")
        assert "other users may read" not in cl[r].stderr()


UCX_CASES = [(3, "none"), (3, "topk"), (3, "qsgd8"), (3, "powersgd"), (2, "dgc"), (4, "fp16")]


@pytest.mark.parametrize("tls", ["tcp", "sm,tcp"])
@pytest.mark.parametrize("world,key", UCX_CASES, ids=["W%d-%s" % c for c in UCX_CASES])
def test_exchange_over_ucx(cluster_factory, monkeypatch, world, key, tls):
    """The same results through the `ucx` transport (UCX_TLS as given; with sm,tcp the connection
    manager still picks tcp on loopback, docs/peer-protocol.md)."""
    monkeypatch.setenv("UCX_TLS", tls)
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    check_exchange(cluster_factory, world, key, extra=["--transport", "ucx"])


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------
def _admin_get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


REFUSALS = [("secret", 2), ("secret", 0), ("job_id", 0), ("job_id", 2)]


@pytest.mark.parametrize("what,bad_rank", REFUSALS, ids=["%s-rank%d" % c for c in REFUSALS])
def test_refused_peer_never_ready(cluster_factory, what, bad_rank):
    """A sidecar with the wrong secret or job id is never accepted: nobody becomes ready, the
    handshakes are counted in lightwire_auth_failures_total, and /readyz names the peers it
    waits for. peer-protocol.md: the server counts every handshake that does not complete, the
    client only wrong answers (bad MAC, wrong job in the CHALLENGE) -- so a wrong job id on the
    *server* side (rank 2, the higher rank) is counted by rank 2 only: its clients just see the
    connection closed."""
    W = 3
    cl = cluster_factory(W, start=False)
    bad = cl[bad_rank]
    if what == "secret":
        bad.secret = os.urandom(16).hex()
    else:
        bad.job_id = "another-job"
    cl.launch()
    others = [r for r in range(W) if r != bad_rank]
    counting = [bad_rank] if (what, bad_rank) == ("job_id", 2) else others
    deadline = time.monotonic() + 20.0
    while True:
        counts = [metric_total(cl[r].metrics_text(), "lightwire_auth_failures_total") for r in range(W)]
        if all(counts[r] > 0 for r in counting):
            break
        assert time.monotonic() < deadline, "auth failures counted %r, expected > 0 on ranks %r\n%s" % (
            counts, counting, cl.stderr())
        time.sleep(0.1)
    time.sleep(0.5)
    for r in range(W):
        assert cl[r].proc.poll() is None, cl.stderr()
        status, body = cl[r].readyz()
        assert status == 503, (r, status, body)
    status, body = bad.readyz()
    for r in others:
        assert str(r) in body, body  # names the peers it waits for
    # The admin listener serves the same figures.
    port = cl[counting[0]].admin_port()
    st, text = _admin_get(port, "/metrics")
    assert st == 200 and metric_total(text, "lightwire_auth_failures_total") > 0, text
    st, text = _admin_get(cl[others[0]].admin_port(), "/readyz")
    assert st == 503 and str(bad_rank) in text, text
    logs = cl.stderr()
    assert cl.secret not in logs and bad.secret not in logs
    # Restarted with the job's settings, the bad rank joins and everyone becomes ready.
    bad.kill()
    bad.secret, bad.job_id = cl.secret, cl.job_id
    cl.launch([bad_rank]).wait_ready()


# ------------------------------------------------------------------------------------------------
# A peer killed mid-step, then restarted
# ------------------------------------------------------------------------------------------------
def test_peer_killed_mid_step_then_rejoins(cluster_factory):
    W = 3
    cl = cluster_factory(W, codec="none", peer_timeout=3)
    ref = Reference(ref_cfg("none"), W, 1)
    # Step 0: everyone.
    res, _ = run_trainers(cl, {(r, 0): [(0, trainer_input(W, r, 0, 0))] for r in range(W)})
    want = ref.step([trainer_input(W, r, 0, 0) for r in range(W)], 0)
    for r in range(W):
        assert_bitwise(res[(r, 0)][0], want, "step 0 rank %d" % r)
    # Step 1: ranks 0 and 1 send, rank 2 is killed while they wait for it.
    box = {}

    def survivors():
        box["res"] = run_trainers(cl, {(r, 0): [(1, trainer_input(W, r, 0, 1))] for r in range(2)})

    t = threading.Thread(target=survivors, daemon=True)
    t.start()
    time.sleep(0.5)
    cl[2].proc.send_signal(signal.SIGKILL)
    cl[2].proc.wait()
    t.join(40)
    assert not t.is_alive()
    res, elapsed = box["res"]
    for r in range(2):
        e = res[(r, 0)][1]
        assert isinstance(e, lightwire.LightwireError), "rank %d got %r" % (r, e)
        assert e.status in (502, 504), "rank %d: %s" % (r, e)
        assert elapsed[(r, 0)][1] < 3 + 5, "rank %d answered after %.1f s" % (r, elapsed[(r, 0)][1])
    # The survivors are no longer ready.
    deadline = time.monotonic() + 10
    while any(cl[r].readyz()[0] != 503 for r in range(2)):
        assert time.monotonic() < deadline, [cl[r].readyz() for r in range(2)]
        time.sleep(0.05)
    # Same rank, same port: it rejoins and a later step succeeds with the right result.
    cl[2].kill()  # reaps the killed process's bookkeeping
    cl.launch([2]).wait_ready()
    # It took the job's step state from its peers (docs/peer-protocol.md "After the handshake",
    # STATE): step 0 is over for the job (step 1 failed everywhere), so a trainer resending step 0
    # there is refused at once.
    c = cl[2].client(timeout=(2.0, 20.0))
    deadline = time.monotonic() + 10
    while True:
        tensors = {t["name"]: t for t in c.status()["tensors"]}
        if TENSOR in tensors:
            break
        assert time.monotonic() < deadline, (c.status(), cl.stderr([2]))
        time.sleep(0.05)
    assert tensors[TENSOR]["last_committed_step"] == 0, tensors
    with pytest.raises(lightwire.LightwireError) as stale:
        c.emit_gradient(trainer_input(W, 2, 0, 0), TENSOR, 0)
    assert stale.value.status == 409, stale.value
    c.close()
    assert "took the job's step state from rank" in cl[2].stderr()
    res, _ = run_trainers(cl, {(r, 0): [(2, trainer_input(W, r, 0, 2))] for r in range(W)})
    want = ref.step([trainer_input(W, r, 0, 2) for r in range(W)], 2)
    for r in range(W):
        assert not isinstance(res[(r, 0)][2], Exception), (r, res[(r, 0)][2], cl.stderr())
        assert_bitwise(res[(r, 0)][2], want, "step 2 after the rejoin, rank %d" % r)


# ------------------------------------------------------------------------------------------------
# Rendezvous: only rank 0's address is configured
# ------------------------------------------------------------------------------------------------
def test_rendezvous_then_restart_on_another_port(cluster_factory):
    """Ranks 1..W-1 listen on OS-chosen ports and learn each other's addresses from rank 0
    (--rendezvous); results are the ring's; a restarted rank comes back on a new port and the job
    goes on."""
    W = 3
    cl = cluster_factory(W, codec="topk", codec_args=["--density", "0.05"], rendezvous=True)
    ref = Reference(ref_cfg("topk", density=0.05), W, 1)
    for step in (0, 1):
        res, _ = run_trainers(cl, {(r, 0): [(step, trainer_input(W, r, 0, step))] for r in range(W)})
        want = ref.step([trainer_input(W, r, 0, step) for r in range(W)], step)
        for r in range(W):
            assert not isinstance(res[(r, 0)][step], Exception), (r, res[(r, 0)][step], cl.stderr())
            assert_bitwise(res[(r, 0)][step], want, "step %d rank %d" % (step, r))
    assert "rendezvous complete: all 3 ranks registered" in cl[0].stderr()
    # Rank 1 restarts (a new OS-chosen port): rank 0 tells rank 2, which connects to it again.
    cl[1].proc.send_signal(signal.SIGKILL)
    cl[1].proc.wait()
    cl[1].kill()
    cl.launch([1]).wait_ready()
    # Its codec state (topk's error-feedback residual) starts fresh; the others keep theirs.
    ref.ranks[1] = lwref.Codec(ref.cfg, ref.n)
    step = 2
    res, _ = run_trainers(cl, {(r, 0): [(step, trainer_input(W, r, 0, step))] for r in range(W)})
    want = ref.step([trainer_input(W, r, 0, step) for r in range(W)], step)
    for r in range(W):
        assert not isinstance(res[(r, 0)][step], Exception), (r, res[(r, 0)][step], cl.stderr())
        assert_bitwise(res[(r, 0)][step], want, "step %d after the restart, rank %d" % (step, r))


# ------------------------------------------------------------------------------------------------
# TLS certificates renewed in place (SIGHUP)
# ------------------------------------------------------------------------------------------------
def test_tls_certificates_renewed_with_sighup(cluster_factory, tmp_path):
    """Two sidecars over mutual TLS. Rank 1's certificate, key and CA files are replaced by renewed
    ones (another CA here, to tell them apart) and it gets SIGHUP: it logs the new certificate, the
    expiry gauge follows, the connection that is up stays up and steps go on. A rank 0 that
    reconnects with the old CA's certificate is refused; once renewed too (SIGHUP) it connects.
    A broken renewal is logged and changes nothing: the files loaded before stay in use."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    old, old_ca = make_pki(str(tmp_path), "old", ["node0", "node1"], 30)
    new, new_ca = make_pki(str(tmp_path), "new", ["node0", "node1"], 90)
    cl = cluster_factory(2, codec="none", start=False)
    files = []
    for r in range(2):
        d = tmp_path / ("rank%d" % r)
        d.mkdir()
        f = (str(d / "node.pem"), str(d / "node.key"), str(d / "ca.pem"))
        files.append(f)
        cl[r].extra = ["--peer-tls", "--peer-tls-cert", f[0], "--peer-tls-key", f[1],
                       "--peer-tls-ca", f[2]]

    def install(r, pki, ca):
        cert, key = pki["node%d" % r]
        for src, dst in zip((cert, key, ca), files[r]):
            shutil.copyfile(src, dst)
        os.chmod(files[r][1], 0o600)

    def expiry_days(r):
        v = metric_total(cl[r].metrics_text(), "lightwire_peer_tls_certificate_expiry_timestamp_seconds")
        return (v - time.time()) / 86400.0

    def wait_log(r, text, timeout=10.0):
        deadline = time.monotonic() + timeout
        while text not in cl[r].stderr():
            assert time.monotonic() < deadline, "rank %d never logged %r:\n%s" % (r, text, cl.stderr())
            time.sleep(0.05)

    def step(s):
        jobs = {(r, 0): [(s, trainer_input(2, r, 0, s))] for r in range(2)}
        results, _ = run_trainers(cl, jobs)
        for key, res in results.items():
            assert not isinstance(res[s], Exception), (key, res[s], cl.stderr())
        assert np.array_equal(results[(0, 0)][s], results[(1, 0)][s])

    for r in range(2):
        install(r, old, old_ca)
    cl.start()
    step(0)
    assert 29 < expiry_days(1) <= 30
    # Rank 1 renewed: the link stays up, the new certificate is in force.
    install(1, new, new_ca)
    cl[1].proc.send_signal(signal.SIGHUP)
    wait_log(1, "peer TLS reloaded: certificate %s (/CN=new node1)" % files[1][0])
    assert 89 < expiry_days(1) <= 90
    # /v1/status and `lightwire status` show the certificate in force.
    c = cl[1].client()
    try:
        tls = c.status()["peer_tls"]
    finally:
        c.close()
    assert tls["subject"] == "/CN=new node1" and tls["certificate"] == files[1][0], tls
    assert 89 < (tls["not_after_unix"] - time.time()) / 86400 <= 90, tls
    assert tls["not_after"].endswith("Z") and len(tls["not_after"]) == 20, tls
    out = subprocess.run([LIGHTWIRE_BIN, "status", "--socket", cl[1].socket], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=30).stdout
    line = [x for x in out.splitlines() if x.startswith("tls ")]
    assert line and "/CN=new node1 (%s), valid until %s" % (files[1][0], tls["not_after"]) in line[0] \
        and "days left" in line[0], out
    step(1)
    # Rank 0 reconnects with the old CA's certificate: refused both ways.
    refused = metric_total(cl[1].metrics_text(), "lightwire_auth_failures_total")
    cl.kill9(0)
    cl.launch([0])
    deadline = time.monotonic() + 10
    while metric_total(cl[1].metrics_text(), "lightwire_auth_failures_total") < refused + 1:
        assert time.monotonic() < deadline, cl.stderr()
        time.sleep(0.05)
    assert cl[0].readyz()[0] == 503
    # Renewed too: its next attempt connects (no restart needed).
    install(0, new, new_ca)
    cl[0].proc.send_signal(signal.SIGHUP)
    wait_log(0, "peer TLS reloaded")
    cl.wait_ready()
    step(2)
    # A broken renewal of rank 1: logged with the file's name; the loaded files stay in force.
    with open(files[1][1], "w") as f:
        f.write("-----BEGIN PRIVATE KEY-----\nnot a key\n")
    cl[1].proc.send_signal(signal.SIGHUP)
    wait_log(1, "peer TLS not reloaded, the previous certificate stays in use: "
                "peer.tls.key_file %s" % files[1][1])
    cl.kill9(0)
    cl.launch([0]).wait_ready()
    step(3)
    assert 89 < expiry_days(1) <= 90


def test_bucket_with_another_layout_on_one_rank_fails_everywhere_at_once(cluster_factory):
    """A bucket's layers are one exchange carrying the layout's hash (docs/exchange.md "A bucket's
    layers in one exchange"): a rank whose trainer sent another layout under the same bucket name
    fails the bucket on every rank at once (not at the peer deadline), and nothing is committed;
    a bucket of one layout everywhere then runs, bitwise identical on both ranks."""
    from lightwire._shm import ShmSegment
    cl = cluster_factory(2, codec="none", peer_timeout=20)
    n = 12
    same = [{"name": "fc.weight", "offset": 0, "shape": [2, 3]},
            {"name": "fc.bias", "offset": 6, "shape": [2]},
            {"name": "out.weight", "offset": 8, "shape": [4]}]
    other = [dict(same[0], shape=[6])] + same[1:]  # the same names, another shape: another hash
    segs, clients = [], []
    for r in range(2):
        c = cl[r].client(timeout=(2.0, 30.0))
        seg = ShmSegment(n * 4)
        c.register_buffer(seg)
        segs.append(seg)
        clients.append(c)
    results, elapsed = [None, None], [None, None]

    def emit(r, step, layout, bucket="bucket.x"):
        np.frombuffer(segs[r].buf, dtype=np.float32)[:] = trainer_input(2, r, 0, step, n)
        t0 = time.monotonic()
        try:
            results[r] = clients[r].emit_gradient_shm(segs[r], bucket, step, shape=[n],
                                                      layout=layout)
        except lightwire.LightwireError as e:
            results[r] = e
        elapsed[r] = time.monotonic() - t0

    try:
        threads = [threading.Thread(target=emit, args=(r, 0, other if r == 1 else same))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for r in range(2):
            e = results[r]
            assert isinstance(e, lightwire.LightwireError), (r, e, cl.stderr())
            assert e.status == 502 and e.error == "exchange_failed", (r, e)
            assert "bucket 'bucket.x' step 0" in e.message, e.message
            assert "must send a bucket with the same layout" in e.message, e.message
            assert elapsed[r] < 10, "rank %d failed after %.1f s: at the deadline, not at once" % (
                r, elapsed[r])
        for r in range(2):
            status = clients[r].status()
            assert all(t["last_committed_step"] is None for t in status["tensors"]), status
        # (Rank 1's sidecar keeps the layout bucket.x was first sent with: a bucket of the right
        # layout goes under another name.)
        threads = [threading.Thread(target=emit, args=(r, 1, same, "bucket.y")) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not isinstance(results[0], Exception), results[0]
        assert not isinstance(results[1], Exception), results[1]
        assert [l["name"] for l in results[0]["layers"]] == ["fc.weight", "fc.bias", "out.weight"]
        got = [np.frombuffer(s.buf, dtype=np.float32).copy() for s in segs]
        assert_bitwise(got[0], got[1], "rank 0 vs rank 1")
        want = (trainer_input(2, 1, 0, 1, n) + trainer_input(2, 0, 0, 1, n)) * np.float32(0.5)
        np.testing.assert_allclose(got[0], want, rtol=1e-6)
    finally:
        for c in clients:
            c.close()
        for s in segs:
            s.close()
            s.unlink()
