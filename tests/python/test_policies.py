"""The policies of docs/policies.md driven through real sidecars of one job (ring topology over
loopback, docs/exchange.md) by a scripted trainer per rank: anomaly bypass, periodic full-sync,
rollback of PUT /v1/config settings (by cosine and by reported loss), the warm-up and phase
schedules, delayed sync, and durable state (checkpoint, resume, hostile files, a rank restarted
mid-job). Every decision must be taken at the same step on every rank: the tests compare the step
replies' `mode` and `settings`, the metrics and the decision logs (/v1/status policies.log) across
ranks.

The trainers use Form 2 (a registered shared-memory buffer, docs/api.md): its JSON reply carries
the step's `mode` and `settings`, which the raw form's headers do not."""

import concurrent.futures
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

from conftest import REPO

from lightwire import LightwireError, ShmSegment

sys.path.insert(0, os.path.join(REPO, "tests", "reference"))
import lwref  # noqa: E402

N = 4000                # elements of the default test tensor (4 chunks of 1024)
CHUNK = 1024            # the cluster's --chunk-elements
TENSOR = "layer.0.weight"
TOPK = ["--density", "0.1"]


# ------------------------------------------------------------------------------------------------
# The scripted trainers
# ------------------------------------------------------------------------------------------------
class Outcome(object):
    """One rank's answer to one step: `reply` (Form 2 JSON) and `result` (a copy of the averaged
    tensor), or `error` (a LightwireError)."""

    __slots__ = ("rank", "reply", "result", "error")

    def __init__(self, rank, reply=None, result=None, error=None):
        self.rank, self.reply, self.result, self.error = rank, reply, result, error

    @property
    def mode(self):
        return None if self.reply is None else self.reply.get("mode")

    @property
    def settings(self):
        return None if self.reply is None else self.reply.get("settings")

    def __repr__(self):
        if self.error is not None:
            return "rank %d: %s" % (self.rank, self.error)
        r = dict(self.reply)
        r.pop("durations_us", None)
        return "rank %d: %s" % (self.rank, r)


class Trainers(object):
    """One trainer per rank of `cluster`, each with its own client and a shared-memory segment per
    tensor; step() sends one step of one tensor on the given ranks at once and waits for all."""

    def __init__(self, cluster, timeout=20.0):
        self.cl = cluster
        self.timeout = timeout
        self.clients = [cluster[r].client(timeout=(2.0, timeout)) for r in range(len(cluster))]
        self.segs = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(len(cluster))

    def forget_buffers(self, rank):
        """The sidecar of `rank` restarted: its buffer ids are gone; register again."""
        for (r, _), seg in self.segs.items():
            if r == rank:
                seg.buffer_id = None
        self.clients[rank].close()

    def _segment(self, rank, name, nbytes):
        seg = self.segs.get((rank, name))
        if seg is None or seg.size < nbytes:
            if seg is not None:
                seg.close()
            seg = self.segs[(rank, name)] = ShmSegment(nbytes)
        if seg.buffer_id is None:
            self.clients[rank].register_buffer(seg)
        return seg

    def _one(self, rank, name, step, x):
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        try:
            seg = self._segment(rank, name, x.nbytes)
            view = np.frombuffer(seg.buf, dtype=np.float32, count=x.size)
            view[:] = x
            reply = self.clients[rank].emit_gradient_shm(seg, name=name, step=step, shape=[x.size])
            out = view.copy()
            del view
            return Outcome(rank, reply=reply, result=out)
        except LightwireError as e:
            return Outcome(rank, error=e)

    def step(self, step, inputs, name=TENSOR, ranks=None):
        """inputs[r]: rank r's gradient. Returns [Outcome] in rank order (of `ranks`)."""
        ranks = list(range(len(self.cl))) if ranks is None else list(ranks)
        futs = [self.pool.submit(self._one, r, name, step, inputs[r]) for r in ranks]
        done, pending = concurrent.futures.wait(futs, timeout=self.timeout + 10)
        assert not pending, "step %d of %s: ranks still waiting after %.0f s\n%s" % (
            step, name, self.timeout + 10, self.cl.stderr())
        return [f.result() for f in futs]

    def close(self):
        self.pool.shutdown(wait=True)
        for c in self.clients:
            c.close()
        for seg in self.segs.values():
            seg.buffer_id = None  # the sidecars may be gone; unlinking is ours
            seg.close()
        self.segs = {}


@pytest.fixture
def trainers_for():
    made = []

    def make(cluster, **kw):
        t = Trainers(cluster, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def grad(rank, step, n=N, seed=0):
    return np.random.default_rng([seed, rank, step]).standard_normal(n).astype(np.float32)


def grads(world, step, n=N, seed=0):
    return [grad(r, step, n, seed) for r in range(world)]


def ok(outcomes, cl, what=""):
    """Asserts every rank succeeded; returns the outcomes."""
    bad = [o for o in outcomes if o.error is not None]
    assert not bad, "%s: %s\n%s" % (what, bad, cl.stderr())
    return outcomes


def assert_same_result(outcomes, what):
    first = outcomes[0].result
    for o in outcomes[1:]:
        assert_bitwise(o.result, first, "%s: rank %d vs rank %d" % (what, o.rank, outcomes[0].rank))


def assert_bitwise(got, want, what):
    g = np.ascontiguousarray(got, dtype=np.float32).reshape(-1).view(np.uint32)
    w = np.ascontiguousarray(want, dtype=np.float32).reshape(-1).view(np.uint32)
    assert g.shape == w.shape, "%s: %d elements, expected %d" % (what, g.size, w.size)
    if not np.array_equal(g, w):
        bad = np.nonzero(g != w)[0]
        i = int(bad[0])
        pytest.fail("%s: %d of %d elements differ; first at %d: got %r (0x%08x), want %r (0x%08x)"
                    % (what, len(bad), len(w), i, float(g.view(np.float32)[i]), int(g[i]),
                       float(w.view(np.float32)[i]), int(w[i])))


def modes(outcomes):
    return [o.mode for o in outcomes]


# ------------------------------------------------------------------------------------------------
# Status and metrics
# ------------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric(text, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`; None when there is none."""
    total = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(3))
    return total


def metrics_of(cl, ranks=None):
    ranks = range(len(cl)) if ranks is None else ranks
    return [cl[r].metrics_text() for r in ranks]


def status_of(cl, rank):
    c = cl[rank].client(timeout=(2.0, 10.0))
    try:
        return c.status()
    finally:
        c.close()


def policies_of(cl, rank):
    st = status_of(cl, rank)
    assert "policies" in st, "no 'policies' in /v1/status of rank %d: %s" % (rank, sorted(st))
    return st["policies"]


def tensor_status(cl, rank, name=TENSOR):
    for t in status_of(cl, rank)["tensors"]:
        if t["name"] == name:
            return t
    raise AssertionError("tensor %r not in /v1/status of rank %d" % (name, rank))


def logs_of(cl, ranks=None):
    ranks = range(len(cl)) if ranks is None else ranks
    return [policies_of(cl, r)["log"] for r in ranks]


def assert_same_logs(cl, ranks=None):
    """The decision logs of every rank are identical; returns rank 0's (of `ranks`)."""
    ranks = list(range(len(cl))) if ranks is None else list(ranks)
    logs = logs_of(cl, ranks)
    for r, log in zip(ranks[1:], logs[1:]):
        assert log == logs[0], "decision log of rank %d differs from rank %d's:\n%s" % (
            r, ranks[0], log_diff(log, logs[0]))
    return logs[0]


def log_diff(got, want):
    """A short account of how decision log `got` differs from `want`."""
    if got == want:
        return "(identical)"
    g = {e["seq"]: e for e in got}
    w = {e["seq"]: e for e in want}
    out = []
    for seq in sorted(set(g) | set(w)):
        if g.get(seq) != w.get(seq):
            out.append("seq %d: got %s, want %s" % (seq, g.get(seq), w.get(seq)))
    return "\n".join(out) or "(same entries, different order)"


def entries(log, kind):
    return [e for e in log if e["kind"] == kind]


def make_cluster(cluster_factory, world, codec="topk", codec_args=TOPK, extra=(), **kw):
    return cluster_factory(world, codec=codec, codec_args=list(codec_args), extra=list(extra), **kw)


# ------------------------------------------------------------------------------------------------
# a. NaN/Inf: flagged, nothing committed, bypass for K steps on every rank
# ------------------------------------------------------------------------------------------------
def run_steps(tr, cl, steps, make_inputs, name=TENSOR):
    out = {}
    for s in steps:
        out[s] = ok(tr.step(s, make_inputs(s), name=name), cl, "step %d" % s)
    return out


NONFINITE_CODECS = {
    # topk selects a NaN first (its key is above +Inf): the result holds it.
    "topk": ("topk", TOPK),
    # random-k with error feedback most likely does not pick the NaN's index: the result is
    # finite, but the NaN is in the step's global statistics and would poison the residual.
    "randomk_ef": ("randomk", ["--density", "0.01", "--error-feedback", "true"]),
}


@pytest.mark.parametrize("key", sorted(NONFINITE_CODECS))
def test_nonfinite_bypass_and_no_commit(cluster_factory, trainers_for, key):
    """docs/policies.md "Anomalies": a step whose global statistics show NaN/Inf is flagged in the
    reply on every rank and commits no codec state; every rank bypasses compression for K steps."""
    W, K, BAD = 3, 5, 50
    codec, codec_args = NONFINITE_CODECS[key]
    flags = ["--bypass-steps", str(K)]
    cl = make_cluster(cluster_factory, W, codec=codec, codec_args=codec_args, extra=flags)
    # The twin job: the same steps, except that step 50 never happens there.
    twin = make_cluster(cluster_factory, W, codec=codec, codec_args=codec_args, extra=flags)
    tr, tw = trainers_for(cl), trainers_for(twin)

    def inputs(s):
        xs = grads(W, s)
        if s == BAD:
            xs[1] = xs[1].copy()
            xs[1][123] = np.nan
        return xs

    after = list(range(BAD + K + 1, BAD + K + 4))  # compressed again
    run_steps(tw, twin, list(range(BAD)), inputs)
    twin_after = run_steps(tw, twin, after, inputs)

    run_steps(tr, cl, list(range(BAD)), inputs)
    committed = [tensor_status(cl, r)["last_committed_step"] for r in range(W)]
    assert committed == [BAD - 1] * W, committed

    res = ok(tr.step(BAD, inputs(BAD)), cl, "step %d (NaN at rank 1)" % BAD)
    assert modes(res) == ["compressed"] * W, res
    # Nothing committed at step 50 (its state would hold the NaN).
    committed = [tensor_status(cl, r)["last_committed_step"] for r in range(W)]
    assert committed == [BAD - 1] * W, (
        "last_committed_step after the NaN step (rank 1, index 123): %r; replies %r" % (committed, res))
    texts = metrics_of(cl)
    r50 = [metric(t, "lightwire_residual_norm") for t in texts]  # what step 50 held back before it
    assert all(v is not None and np.isfinite(v) for v in r50), r50
    assert r50[0] == r50[1] == r50[2], r50
    assert [o.reply["nonfinite"] for o in res] == [True] * W, (
        "the step's gradients hold a NaN (rank 1, index 123): every rank must flag the step: %r" % res)
    if codec == "topk":
        for o in res:  # the non-finite result is returned, as plain averaging would
            assert np.isnan(o.result[123]), (o.rank, o.result[123])
    assert [metric(t, "lightwire_anomalies_total", kind="nonfinite") for t in texts] == [1.0] * W
    assert [metric(t, "lightwire_bypass_active") for t in texts] == [1.0] * W
    for r in range(W):
        assert policies_of(cl, r)["bypass_until"] == BAD + K + 1

    # Steps 51..50+K: dense on every rank; the residual the state held after step 49 is intact
    # (the step-50 state, with its NaN, was never committed; bypass steps leave it alone).
    for s in range(BAD + 1, BAD + K + 1):
        res = ok(tr.step(s, inputs(s)), cl, "step %d" % s)
        assert modes(res) == ["bypass"] * W, "step %d: %r" % (s, res)
        assert [o.reply["nonfinite"] for o in res] == [False] * W
        assert_same_result(res, "bypass step %d" % s)
        # Dense: the ring allreduce of the plain fp32 gradients, bit for bit.
        assert_bitwise(res[0].result, ring_mean_none(inputs(s), W), "bypass step %d vs the dense mean" % s)
        texts = metrics_of(cl)
        got = [metric(t, "lightwire_residual_norm") for t in texts]
        assert got == r50, "step %d: residual norm %r, expected the step-49 state's %r" % (s, got, r50)
        assert [metric(t, "lightwire_bypass_active") for t in texts] == \
            [1.0 if s < BAD + K else 0.0] * W, (s, texts[0])
    # 51+K: compressed again, and (topk + error feedback) exactly as if step 50 had never been.
    for s in after:
        res = ok(tr.step(s, inputs(s)), cl, "step %d" % s)
        assert modes(res) == ["compressed"] * W, "step %d: %r" % (s, res)
        for o, t in zip(res, twin_after[s]):
            assert t.mode == "compressed"
            assert_bitwise(o.result, t.result, "step %d rank %d vs the twin job without step %d"
                           % (s, o.rank, BAD))
    texts = metrics_of(cl)
    assert [metric(t, "lightwire_anomalies_total", kind="nonfinite") for t in texts] == [1.0] * W
    assert [metric(t, "lightwire_anomalies_total") for t in texts] == [1.0] * W
    assert [metric(t, "lightwire_steps_total", result="nonfinite") for t in texts] == [1.0] * W
    log = assert_same_logs(cl)
    anomalies = entries(log, "anomaly")
    assert len(anomalies) == 1 and anomalies[0]["step"] == BAD, log
    assert "nonfinite" in anomalies[0]["detail"], anomalies


# ------------------------------------------------------------------------------------------------
# b. Norm explosion and vanishing against the baseline
# ------------------------------------------------------------------------------------------------
def test_explosion_and_vanishing(cluster_factory, trainers_for):
    W, K = 3, 3
    EXPLODE, VANISH = 12, 24
    cl = make_cluster(cluster_factory, W, extra=["--bypass-steps", str(K), "--baseline-steps", "5"])
    tr = trainers_for(cl)

    def inputs(s):
        xs = grads(W, s)
        if s == EXPLODE:
            xs[2] = (xs[2] * np.float32(1000)).astype(np.float32)  # one rank's gradient x1000
        if s == VANISH:
            xs = [(x * np.float32(1e-6)).astype(np.float32) for x in xs]  # everyone's x1e-6
        return xs

    want_modes = {}
    for s in range(VANISH + K + 3):
        bypass = EXPLODE < s <= EXPLODE + K or VANISH < s <= VANISH + K
        want_modes[s] = "bypass" if bypass else "compressed"
    seen = {}
    for s in range(VANISH + K + 3):
        res = ok(tr.step(s, inputs(s)), cl, "step %d" % s)
        seen[s] = modes(res)
        assert_same_result(res, "step %d" % s)
        if s == EXPLODE:
            texts = metrics_of(cl)
            assert [metric(t, "lightwire_anomalies_total", kind="explosion") for t in texts] == [1.0] * W
        if s == VANISH:
            texts = metrics_of(cl)
            assert [metric(t, "lightwire_anomalies_total", kind="vanishing") for t in texts] == [1.0] * W
    wrong = {s: m for s, m in seen.items() if m != [want_modes[s]] * W}
    assert not wrong, "modes per step (expected bypass at %d..%d and %d..%d): %r" % (
        EXPLODE + 1, EXPLODE + K, VANISH + 1, VANISH + K, wrong)
    texts = metrics_of(cl)
    for kind, n in (("explosion", 1.0), ("vanishing", 1.0), ("nonfinite", 0.0)):
        assert [metric(t, "lightwire_anomalies_total", kind=kind) for t in texts] == [n] * W, kind
    log = assert_same_logs(cl)
    an = entries(log, "anomaly")
    assert [(e["step"], e["detail"].split(":")[0]) for e in an] == \
        [(EXPLODE, "explosion"), (VANISH, "vanishing")], log


# ------------------------------------------------------------------------------------------------
# c. Rollback of PUT /v1/config settings: by cosine, by reported loss
# ------------------------------------------------------------------------------------------------
ROLLBACK_FLAGS = ["--baseline-steps", "3", "--patience", "3", "--known-good-steps", "2",
                  "--cooldown-steps", "5", "--full-sync-every", "0"]


def settings_per_step(history):
    return {s: [o.settings for o in res] for s, res in history.items()}


def check_rollback(cl, history, put_step, rollback_from, W):
    """Settings version 0 up to put_step, 1 from put_step + 1, 2 (a copy of 0) from
    rollback_from, on every rank; one rollback counted and logged everywhere."""
    per = settings_per_step(history)
    want = {s: [0 if s <= put_step else 1 if s < rollback_from else 2] * W for s in per}
    wrong = {s: v for s, v in per.items() if v != want[s]}
    assert not wrong, ("settings versions per step (PUT before step %d: version 1 expected from "
                       "step %d, the rollback's version 2 from step %d): %r"
                       % (put_step, put_step + 1, rollback_from, wrong))
    texts = metrics_of(cl)
    assert [metric(t, "lightwire_rollbacks_total") for t in texts] == [1.0] * W
    log = assert_same_logs(cl)
    rb = entries(log, "rollback")
    assert len(rb) == 1 and rb[0]["step"] == rollback_from - 1, log
    st = entries(log, "settings")
    assert len(st) == 1 and st[0]["step"] == put_step, log
    for r in range(W):
        versions = policies_of(cl, r)["settings"]
        assert [v["from_step"] for v in versions] == [0, put_step + 1, rollback_from], versions
        assert [v["known_good"] for v in versions] == [True, False, True], versions
        assert "rollback" in versions[2]["why"] and "0" in versions[2]["why"], versions


def test_rollback_by_cosine(cluster_factory, trainers_for):
    W, PUT = 3, 8
    cl = make_cluster(cluster_factory, W, codec_args=["--density", "0.5"], extra=ROLLBACK_FLAGS)
    tr = trainers_for(cl)
    history = {}
    c0 = cl[0].client()
    for s in range(PUT + 12):
        if s == PUT:
            reply = c0.put_config({"default": {"codec": "topk", "density": 0.0005}})
            assert reply.get("applied") is False and "proposal" in reply, reply
        history[s] = res = ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
        assert_same_result(res, "step %d" % s)
        assert modes(res) == ["compressed"] * W, (s, res)
    c0.close()
    # Version 1 from step PUT + 1. Its cosine (of step PUT + 1) travels with step PUT + 2, so the
    # signal degrades from there; after `patience` (3) degraded steps -- PUT + 2, + 3, + 4 -- the
    # rollback takes effect at the step after: PUT + 5.
    check_rollback(cl, history, PUT, PUT + 5, W)
    wb = {s: history[s][0].reply["wire_bytes"] for s in history}
    assert wb[PUT + 1] * 50 < wb[PUT], wb        # density 0.0005 vs 0.5
    assert wb[PUT + 5] > 20 * wb[PUT + 4], wb    # back to 0.5
    cos = [metric(t, "lightwire_cosine_similarity") for t in metrics_of(cl)]
    assert cos[0] == cos[1] == cos[2] and cos[0] > 0.5, cos
    assert "cosine" in entries(assert_same_logs(cl), "rollback")[0]["detail"]


def run_reporting(cluster_factory, trainers_for, W, PUT, report, extra=()):
    """Steps 0 .. PUT + 9 of a W-rank job (topk at density 0.5, ROLLBACK_FLAGS and `extra`),
    settings of density 0.4 proposed before step PUT (version 1 from PUT + 1), and after each step
    s every rank's trainer reporting `report(s, rank)` (the fields of POST /v1/report): what it
    reports of step s travels with step s + 1. Returns the cluster and every step's outcomes."""
    cl = make_cluster(cluster_factory, W, codec_args=["--density", "0.5"],
                      extra=ROLLBACK_FLAGS + list(extra))
    tr = trainers_for(cl)
    clients = [cl[r].client() for r in range(W)]
    history = {}
    for s in range(PUT + 10):
        if s == PUT:
            reply = clients[0].put_config({"default": {"codec": "topk", "density": 0.4}})
            assert reply.get("applied") is False and "proposal" in reply, reply
        history[s] = res = ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
        assert_same_result(res, "step %d" % s)
        for r in range(W):
            assert clients[r].report(s, **report(s, r)) == {}
    for c in clients:
        c.close()
    return cl, history


def test_rollback_by_loss(cluster_factory, trainers_for):
    W, PUT = 2, 8
    # From step PUT + 1 (the first with version 1) the loss triples.
    cl, history = run_reporting(cluster_factory, trainers_for, W, PUT,
                                lambda s, r: {"loss": 1.0 + 0.01 * r if s <= PUT else 3.0})
    # Losses of PUT + 1, + 2, + 3 arrive with steps PUT + 2, + 3, + 4: three degraded steps,
    # then version 2 from PUT + 5.
    check_rollback(cl, history, PUT, PUT + 5, W)
    log = assert_same_logs(cl)
    assert "loss" in entries(log, "rollback")[0]["detail"], log


@pytest.mark.parametrize("after, rolls_back", [(7.0, True), (9.5, False), (40.0, False)],
                         ids=["drop", "drop-within", "rise"])
def test_rollback_by_reward(cluster_factory, trainers_for, after, rolls_back):
    """A reported reward (higher is better) that drops below its baseline by more than
    policies.reward_drop rolls the settings back, as a loss that rises does; a smaller drop, or a
    rise, does not (docs/policies.md "Settings versions and rollback")."""
    W, PUT = 2, 8
    # From step PUT + 1 (version 1) the reward moves to `after` on both ranks, from about 10.
    cl, history = run_reporting(
        cluster_factory, trainers_for, W, PUT,
        lambda s, r: {"reward": (10.0 if s <= PUT else after) + 0.01 * r},
        extra=["--reward-drop", "1"])
    # The job's mean reward, the same on every rank: that of step PUT + 8, which travelled with
    # the last step.
    texts = metrics_of(cl)
    rewards = [metric(t, "lightwire_reward") for t in texts]
    assert rewards[0] == rewards[1] == pytest.approx(after + 0.005), rewards
    if rolls_back:
        # Rewards of PUT + 1, + 2, + 3 arrive with steps PUT + 2, + 3, + 4: three degraded
        # steps, then version 2 from PUT + 5.
        check_rollback(cl, history, PUT, PUT + 5, W)
        rb = entries(assert_same_logs(cl), "rollback")
        assert "reported reward" in rb[0]["detail"] and "a drop of more than 1" in rb[0]["detail"], rb
        return
    per = settings_per_step(history)
    assert all(v == [0 if s <= PUT else 1] * W for s, v in per.items()), per
    assert [metric(t, "lightwire_rollbacks_total") for t in texts] == [0.0] * W
    log = assert_same_logs(cl)
    assert not entries(log, "rollback") and not entries(log, "degraded"), log


@pytest.mark.parametrize("synchrony", ["sync", "bounded-staleness"])
def test_reward_drop_under_the_parameter_server(cluster_factory, trainers_for, synchrony):
    """The parameter-server topology: with peer.synchrony sync a reward drop beyond
    policies.reward_drop is judged as on the ring (here with nothing older to revert to: logged as
    degraded); under bounded staleness rollback is off (docs/policies.md "Rollback under bounded
    staleness: off"), so the same drop is judged by no one, and the sidecars say so at start. The
    job's mean reward reaches lightwire_reward either way."""
    W, DROP = 2, 8
    cl = make_cluster(cluster_factory, W,
                      extra=ROLLBACK_FLAGS + ["--reward-drop", "1", "--topology", "ps",
                                              "--ps-rank", "0", "--synchrony", synchrony,
                                              "--straggler-wait", "10"])
    tr = trainers_for(cl)
    clients = [cl[r].client() for r in range(W)]
    for s in range(DROP + 8):
        ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
        for r in range(W):
            assert clients[r].report(s, reward=10.0 if s < DROP else 2.0) == {}
    for c in clients:
        c.close()
    rewards = [metric(t, "lightwire_reward") for t in metrics_of(cl)]
    assert rewards == [2.0] * W, rewards
    for r in range(W):
        log = policies_of(cl, r)["log"]
        judged = entries(log, "degraded") + entries(log, "rollback")
        if synchrony == "sync":
            assert judged and "reported reward 2 against a baseline of 10" in judged[0]["detail"], log
        else:
            assert not judged, log
            assert "so anomaly bypass, rollback and the adaptive schedule are off" in cl[r].stderr()


# ------------------------------------------------------------------------------------------------
# d. Periodic full-sync
# ------------------------------------------------------------------------------------------------
def test_full_sync_cadence(cluster_factory, trainers_for):
    W, EVERY, STEPS = 3, 5, 17
    cl = make_cluster(cluster_factory, W, extra=["--full-sync-every", str(EVERY)])
    tr = trainers_for(cl)
    seen = {}
    for s in range(STEPS):
        res = ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
        seen[s] = modes(res)
        assert_same_result(res, "step %d" % s)
        if seen[s][0] == "full_sync":
            assert res[0].reply["wire_bytes"] >= 4 * N, res  # dense
    want = {s: ["full_sync" if s in (5, 10, 15) else "compressed"] * W for s in range(STEPS)}
    assert seen == want, {s: m for s, m in seen.items() if m != want[s]}
    texts = metrics_of(cl)
    assert [metric(t, "lightwire_full_syncs_total", reason="periodic") for t in texts] == [3.0] * W
    assert [metric(t, "lightwire_full_syncs_total", reason="divergence") for t in texts] == [0.0] * W
    log = assert_same_logs(cl)
    assert [e["step"] for e in entries(log, "full_sync")] == [5, 10, 15], log


def test_full_sync_flushes_residuals(cluster_factory, trainers_for):
    """A full-sync sends what the error-feedback residuals held back and empties them: over steps
    0..N (N a full-sync step) the results add up to the inputs (nothing lost, nothing sent twice),
    and the residual the next step starts from is zero."""
    W, EVERY = 2, 5
    cl = make_cluster(cluster_factory, W, extra=["--full-sync-every", str(EVERY)])
    tr = trainers_for(cl)
    sent = np.zeros(N, np.float64)    # W x the sum of the results: what all ranks sent
    given = np.zeros(N, np.float64)   # the sum of all inputs
    for s in range(2 * EVERY + 2):
        xs = grads(W, s)
        res = ok(tr.step(s, xs), cl, "step %d" % s)
        sent += W * res[0].result.astype(np.float64)
        given += np.sum(np.stack(xs).astype(np.float64), axis=0)
        residual = [metric(t, "lightwire_residual_norm") for t in metrics_of(cl)]
        if s in (EVERY + 1, 2 * EVERY + 1):
            # This step's record says what the state held before it: after the full-sync, 0.
            assert residual == [0.0] * W, "step %d: residual norm %r after the full-sync at %d" % (
                s, residual, s - 1)
        if s in (EVERY, 2 * EVERY):
            assert res[0].mode == "full_sync"
            err = np.max(np.abs(sent - given))
            assert err < 1e-3, ("after the full-sync at step %d the results do not add up to the "
                                "inputs: max |sum(results)*W - sum(inputs)| = %g (residuals lost or "
                                "sent twice)" % (s, err))


# ------------------------------------------------------------------------------------------------
# e. Schedules: DGC warm-up, training-phase schedule (exact payload sizes, exact results)
# ------------------------------------------------------------------------------------------------
class TopkRef(object):
    """topk with error feedback (docs/determinism.md), per rank, vectorised: payload sizes
    (docs/wire-format.md, sparse layout) and the result every rank returns."""

    def __init__(self, world, n, min_magnitude=1e-6, chunk=CHUNK):
        self.W, self.n = world, n
        self.e = [np.zeros(n, np.float32) for _ in range(world)]
        self.mk = lwref.min_magnitude_key(min_magnitude)
        self.chunks = lwref.chunk_ranges(n, chunk, 1)
        self.weight = np.float32(1.0 / world)

    def payload_bytes(self, sel):
        total = 0
        for b, m in self.chunks:
            idx = sel[(sel >= b) & (sel < b + m)] - b
            nnz = len(idx)
            gaps = np.diff(np.concatenate([[-1], idx])) - 1 if nnz else np.zeros(0, np.int64)
            w = int(gaps.max()).bit_length() if nnz else 0
            g = ((nnz * w + 7) // 8 + 3) // 4 * 4
            total += 24 + g + 4 * nnz
        return total

    def step(self, inputs, density):
        out = np.zeros(self.n, np.float32)
        sizes, ks = [], []
        for r in range(self.W):
            with np.errstate(all="ignore"):
                a = (inputs[r] + self.e[r]).astype(np.float32)
            keys = lwref.key_of(a)
            k = lwref.selection_size(self.n, density)
            sel = lwref.topk_select(keys, k)
            if self.mk:
                sel = sel[keys[sel] >= self.mk]
            sizes.append(self.payload_bytes(sel))
            ks.append(k)
            out[sel] = (out[sel] + (self.weight * a[sel]).astype(np.float32)).astype(np.float32)
            e = a.copy()
            e[sel] = np.float32(0)
            self.e[r] = e
        return out, sizes, ks


def check_schedule(cluster_factory, trainers_for, flags, density_of, steps, n):
    W = 2
    cl = make_cluster(cluster_factory, W, codec_args=["--density", "0.01"], extra=flags)
    tr = trainers_for(cl)
    ref = TopkRef(W, n)
    for s in range(steps):
        xs = grads(W, s, n=n, seed=5)
        res = ok(tr.step(s, xs), cl, "step %d" % s)
        d = density_of(s)
        want, sizes, ks = ref.step(xs, d)
        assert ks == [int(np.floor(d * n + 0.5))] * W
        assert modes(res) == ["compressed"] * W, res
        got = [o.reply["wire_bytes"] for o in res]
        assert got == sizes, ("step %d: wire bytes %r, expected %r for density %g (k = %d of %d)"
                              % (s, got, sizes, d, ks[0], n))
        for o in res:
            assert_bitwise(o.result, want, "step %d rank %d vs the topk reference at density %g"
                           % (s, o.rank, d))


def test_warmup_schedule(cluster_factory, trainers_for):
    n, steps, base = 40000, 10, 0.01
    stage = [0.25, 0.0625, 0.015625, 0.00390625, 0.0009765625]

    def density_of(s):
        return max(base, stage[s * 5 // steps]) if s < steps else base

    assert [density_of(s) for s in range(12)] == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                                                  base, base, base, base, base, base]
    check_schedule(cluster_factory, trainers_for, ["--warmup-steps", str(steps)], density_of, 12, n)


def test_phase_schedule(cluster_factory, trainers_for):
    n, total, base = 40000, 20, 0.01

    def density_of(s):
        f = s / total
        return min(1.0, base * 4) if (f < 0.2 or f >= 0.8) else base

    check_schedule(cluster_factory, trainers_for, ["--total-steps", str(total)], density_of, total + 2, n)


# ------------------------------------------------------------------------------------------------
# f. Delayed sync (a rule's sync_every)
# ------------------------------------------------------------------------------------------------
def ring_mean_none(payload_inputs, world, chunk=CHUNK):
    """The ring allreduce of codec `none` (docs/exchange.md): chunk c's sum
    ((p[o+1] + p[o+2]) + ...) + p[o], o = c mod W, in fp32, then x fp32(1/W)."""
    n = payload_inputs[0].size
    out = np.zeros(n, np.float32)
    w = np.float32(1.0 / world)
    for c, (b, m) in enumerate(lwref.chunk_ranges(n, chunk, 1)):
        o = c % world
        s = payload_inputs[(o + 1) % world][b:b + m].astype(np.float32)
        for k in range(2, world + 1):
            s = (s + payload_inputs[(o + k) % world][b:b + m]).astype(np.float32)
        out[b:b + m] = (np.float32(0) + (w * s).astype(np.float32)).astype(np.float32)
    return out


def test_delayed_sync(cluster_factory, trainers_for, tmp_path):
    W, EVERY, STEPS = 3, 3, 10
    cfg = tmp_path / "lightwire.yaml"
    cfg.write_text("compression:\n"
                   "  rules:\n"
                   "    - pattern: \"delayed.*\"\n"
                   "      codec: none\n"
                   "      sync_every: %d\n"
                   "      group: delayed\n" % EVERY)
    cl = make_cluster(cluster_factory, W, extra=["--config", str(cfg)])
    tr = trainers_for(cl)
    acc = [np.zeros(N, np.float32) for _ in range(W)]
    skips = 0
    for s in range(STEPS):
        xs = grads(W, s, seed=3)
        res = ok(tr.step(s, xs, name="delayed.w"), cl, "delayed.w step %d" % s)
        other = ok(tr.step(s, grads(W, s, seed=4)), cl, "%s step %d" % (TENSOR, s))
        assert modes(other) == ["compressed"] * W, other
        if (s + 1) % EVERY != 0:
            skips += 1
            assert modes(res) == ["skip"] * W, "step %d: %r" % (s, res)
            for o in res:
                assert not np.any(o.result), "step %d rank %d: a skipped step returns zeros" % (s, o.rank)
            acc = [(a + x).astype(np.float32) for a, x in zip(acc, xs)]
        else:
            assert modes(res) == ["compressed"] * W, "step %d: %r" % (s, res)
            sent = [(x + a).astype(np.float32) for x, a in zip(xs, acc)]
            want = ring_mean_none(sent, W)
            for o in res:
                assert_bitwise(o.result, want, "step %d rank %d: mean of the accumulated sums" % (s, o.rank))
            acc = [np.zeros(N, np.float32) for _ in range(W)]
    texts = metrics_of(cl)
    assert [metric(t, "lightwire_skipped_steps_total") for t in texts] == [float(skips)] * W
    assert all(metric(t, "lightwire_compression_ratio", group="delayed") is not None for t in texts), texts[0]


# ------------------------------------------------------------------------------------------------
# g. Checkpoint at one sidecar, resume everywhere: bitwise the same steps again
# ------------------------------------------------------------------------------------------------
DGC = ["--density", "0.1", "--momentum", "0.9"]


def restart_all(cl, tr, extra=None):
    for r in range(len(cl)):
        cl.kill9(r)
        tr.forget_buffers(r)
    cl.restart(list(range(len(cl))), extra=extra)


def test_checkpoint_resume_bitwise(cluster_factory, trainers_for):
    W, CK, LAST = 2, 10, 20
    cl = make_cluster(cluster_factory, W, codec="dgc", codec_args=DGC)
    tr = trainers_for(cl)
    first = {}
    for s in range(1, LAST + 1):
        first[s] = ok(tr.step(s, grads(W, s, seed=9)), cl, "step %d" % s)
        assert_same_result(first[s], "step %d" % s)
        if s == CK:
            c = cl[0].client()
            reply = lightwire_torch_or_client_save(c, CK)
            c.close()
            assert reply["step"] == CK, reply
            want = os.path.join(cl[0].state_dir, "trainer", "lw-test-job.rank0.step%d.lwck" % CK)
            assert os.path.realpath(reply["path"]) == os.path.realpath(want), reply
            assert os.path.exists(want)
            assert not os.path.exists(os.path.join(cl[1].state_dir, "trainer",
                                                   "lw-test-job.rank1.step%d.lwck" % CK))
    # Rank 1 saved its own when the request reached it with step 11.
    f1 = os.path.join(cl[1].state_dir, "trainer", "lw-test-job.rank1.step%d.lwck" % CK)
    assert os.path.exists(f1), os.listdir(cl[1].state_dir)
    texts = metrics_of(cl)
    assert [metric(t, "lightwire_checkpoints_total", result="ok") for t in texts] == [1.0] * W
    # Both sidecars crash; fresh ones on the same state dirs; every trainer resumes from step 10.
    restart_all(cl, tr)
    for r in range(W):
        c = cl[r].client()
        reply = c.resume(CK)
        c.close()
        assert reply.get("step") == CK, reply
        assert policies_of(cl, r)["resumed_from"] == CK
    for s in range(CK + 1, LAST + 1):
        again = ok(tr.step(s, grads(W, s, seed=9)), cl, "replayed step %d" % s)
        assert modes(again) == modes(first[s]), (s, again, first[s])
        for o, f in zip(again, first[s]):
            assert_bitwise(o.result, f.result, "step %d rank %d after resume(%d)" % (s, o.rank, CK))
    assert_same_logs(cl)

    # Resumed at one sidecar only: it tells the others (STATE frames), which resume from their own
    # checkpoint of the same step, and the replay is the same again.
    restart_all(cl, tr)
    c = cl[0].client()
    c.resume(CK)
    c.close()
    deadline = time.time() + 10
    while policies_of(cl, 1)["resumed_from"] != CK:
        assert time.time() < deadline, "rank 1 did not resume after rank 0 did: %s" % cl.stderr([1])
        time.sleep(0.05)
    for s in range(CK + 1, CK + 4):
        res = ok(tr.step(s, grads(W, s, seed=9)), cl, "step %d after a resume at rank 0 only" % s)
        for o, f in zip(res, first[s]):
            assert_bitwise(o.result, f.result,
                           "step %d rank %d after a resume at rank 0 only" % (s, o.rank))


def lightwire_torch_or_client_save(client, step):
    """save_state of lightwire.torch when torch is there (what trainers call), else the client."""
    try:
        import lightwire.torch as lwt
    except ImportError:  # pragma: no cover
        return client.checkpoint(step)
    return lwt.save_state(step, client=client)


def test_rank_restarted_after_a_resume(cluster_factory, trainers_for):
    """After a job-wide resume, a sidecar that crashes and restarts mid-job rejoins and the job goes
    on (the step it resumed from is the job's; its restart must not read as a resume mismatch)."""
    W, CK = 2, 4
    cl = make_cluster(cluster_factory, W, codec="dgc", codec_args=DGC)
    tr = trainers_for(cl)
    for s in range(CK + 1):
        ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
    c = cl[0].client()
    c.checkpoint(CK)
    c.close()
    ok(tr.step(CK + 1, grads(W, CK + 1)), cl, "step %d" % (CK + 1))
    restart_all(cl, tr)
    for r in range(W):
        c = cl[r].client()
        c.resume(CK)
        c.close()
    for s in range(CK + 1, CK + 4):
        ok(tr.step(s, grads(W, s)), cl, "step %d after the resume" % s)
    cl.kill9(1)
    tr.forget_buffers(1)
    cl.restart(1)
    for s in range(CK + 4, CK + 7):
        res = ok(tr.step(s, grads(W, s)), cl, "step %d after rank 1 restarted" % s)
        assert_same_result(res, "step %d" % s)
    assert_same_logs(cl)


def _checkpoint_steps(directory, rank):
    """Steps of rank's checkpoint files in `directory`, most recently written last."""
    pat = re.compile(r"lw-test-job\.rank%d\.step(\d+)\.lwck$" % rank)
    found = []
    for name in os.listdir(directory):
        m = pat.match(name)
        if m:
            found.append((os.stat(os.path.join(directory, name)).st_mtime_ns, int(m.group(1))))
    return [step for _, step in sorted(found)]


def test_trainer_checkpoints_kept_and_a_restart_after_resume(cluster_factory, trainers_for):
    """state.keep_trainer 2 keeps the two most recently written trainer checkpoints. After every
    trainer resumes from step 6, the periodic checkpoint of step 9 that the abandoned run wrote is
    older than the file resumed from: a sidecar that crashes before the resumed run writes one of
    its own restores step 6, not step 9 of the abandoned run. Periodic checkpoints go on in the
    resumed run even below the abandoned run's last one."""
    W = 2
    cl = make_cluster(cluster_factory, W, codec="dgc", codec_args=DGC,
                      extra=["--checkpoint-every", "5", "--trainer-checkpoint-keep", "2"])
    tr = trainers_for(cl)
    for s in range(1, 12):
        ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
        if s in (2, 4, 6, 8):
            c = cl[0].client()
            c.checkpoint(s)
            c.close()
    for r in range(W):
        assert _checkpoint_steps(os.path.join(cl[r].state_dir, "trainer"), r) == [6, 8], r
        assert _checkpoint_steps(cl[r].state_dir, r) == [4, 9], r
    restart_all(cl, tr)
    resumed_at = time.time_ns()
    for r in range(W):
        c = cl[r].client()
        assert c.resume(6)["step"] == 6
        c.close()
    # The file resumed from now counts as the most recently written.
    for r in range(W):
        assert _checkpoint_steps(os.path.join(cl[r].state_dir, "trainer"), r) == [8, 6], r
    for s in (7, 8):
        ok(tr.step(s, grads(W, s)), cl, "step %d after the resume" % s)
    cl.kill9(1)
    tr.forget_buffers(1)
    cl.restart(1)
    err = cl[1].stderr()
    assert "restored the codec state of step 6 from" in err, err
    assert "step 9 from" not in err, err
    for s in (9, 10, 11):
        res = ok(tr.step(s, grads(W, s)), cl, "step %d after rank 1 restarted" % s)
        assert_same_result(res, "step %d" % s)
    # Step 10 wrote the periodic checkpoint of step 9 again, in the resumed run, on both ranks.
    for r in range(W):
        assert _checkpoint_steps(cl[r].state_dir, r)[-1] == 9, r
        path = os.path.join(cl[r].state_dir, "lw-test-job.rank%d.step9.lwck" % r)
        assert os.stat(path).st_mtime_ns >= resumed_at - 10**9, r


# ------------------------------------------------------------------------------------------------
# h. Hostile checkpoint files
# ------------------------------------------------------------------------------------------------
def flip_byte(path, offset=None):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if offset is None else offset
        data[i] ^= 0x5A
        f.seek(0)
        f.write(data)


def drive_single(sc, steps, n=N):
    c = sc.client()
    try:
        out = {}
        for s in steps:
            out[s] = c.emit_gradient(grad(0, s, n), TENSOR, s)
        return out
    finally:
        c.close()


def lwck_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".lwck")) if os.path.isdir(d) else []


def test_hostile_checkpoints_at_start(sidecar_factory):
    a = sidecar_factory(codec="topk", density=0.1, extra=["--job-id", "job-a"])
    drive_single(a, range(4))
    a.stop()  # SIGTERM: the state after step 3 is saved
    files = lwck_files(a.state_dir)
    assert files == ["job-a.rank0.step3.lwck"], files
    path = os.path.join(a.state_dir, files[0])
    good = open(path, "rb").read()

    # Corrupted: refused, naming the file.
    flip_byte(path)
    a.spawn()
    rc, err = a.wait_exit()
    assert rc != 0, err
    assert path in err or files[0] in err, err
    assert "corrupt" in err or "checksum" in err, err
    # --fresh-state: starts anyway.
    a.extra = ["--job-id", "job-a", "--fresh-state"]
    a.start()
    assert drive_single(a, [0])  # a fresh job
    a.kill()

    # Of another job, under this job's newest file name: refused, naming the file and the job.
    b = sidecar_factory(codec="topk", density=0.1, extra=["--job-id", "job-b"])
    drive_single(b, range(6))
    b.stop()
    (bfile,) = lwck_files(b.state_dir)
    with open(path, "wb") as f:
        f.write(good)  # the good one is step 3; the impostor is newer
    impostor = os.path.join(a.state_dir, "job-a.rank0.step5.lwck")
    with open(impostor, "wb") as f:
        f.write(open(os.path.join(b.state_dir, bfile), "rb").read())
    a.extra = ["--job-id", "job-a"]
    a.spawn()
    rc, err = a.wait_exit()
    assert rc != 0, err
    assert "job-a.rank0.step5.lwck" in err and "job-b" in err, err
    a.extra = ["--job-id", "job-a", "--fresh-state"]
    a.start()
    a.stop()


def test_resume_from_hostile_trainer_checkpoint(sidecar_factory):
    sc = sidecar_factory(codec="topk", density=0.1, extra=["--job-id", "job-a"])
    c = sc.client()
    drive_single(sc, range(4))
    reply = c.checkpoint(3)
    path = reply["path"]
    assert os.path.exists(path), reply
    drive_single(sc, range(4, 6))
    # Too late for step 2 (step 5 completed here): 409, nothing saved.
    with pytest.raises(LightwireError) as ei:
        c.checkpoint(2)
    assert ei.value.status == 409, ei.value
    # No such checkpoint: 404.
    with pytest.raises(LightwireError) as ei:
        c.resume(7)
    assert ei.value.status == 404, ei.value
    # Corrupted: 409 naming the problem; the sidecar keeps serving and its state is untouched.
    flip_byte(path)
    with pytest.raises(LightwireError) as ei:
        c.resume(3)
    e = ei.value
    assert e.status == 409, e
    assert "corrupt" in e.message or "checksum" in e.message, e
    assert c.healthz()
    out = drive_single(sc, [6])
    assert out[6].shape == (N,)
    assert tensor_status_single(c)["last_committed_step"] == 6
    # Another job's file under this name: 409 naming the job.
    other = sidecar_factory(codec="topk", density=0.1, extra=["--job-id", "job-z"])
    oc = other.client()
    drive_single(other, range(4))
    opath = oc.checkpoint(3)["path"]
    oc.close()
    with open(path, "wb") as f:
        f.write(open(opath, "rb").read())
    with pytest.raises(LightwireError) as ei:
        c.resume(3)
    assert ei.value.status == 409 and "job-z" in ei.value.message, ei.value
    drive_single(sc, [7])
    c.close()


def tensor_status_single(c, name=TENSOR):
    for t in c.status()["tensors"]:
        if t["name"] == name:
            return t
    raise AssertionError(name)


# ------------------------------------------------------------------------------------------------
# i. A rank killed mid-job rejoins: the job's step and policy state from its peers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("W", [3, 2])
def test_rank_rejoins_with_the_jobs_policy_state(cluster_factory, trainers_for, W):
    """With W = 2 the restarted rank hears the job state from one peer only (with 3, a second
    peer's state could hide what the first one's handling lost)."""
    KILLED = 1
    flags = ["--checkpoint-every", "5", "--full-sync-every", "4", "--bypass-steps", "2"]
    cl = make_cluster(cluster_factory, W, extra=flags)
    tr = trainers_for(cl)

    def inputs(s):
        xs = grads(W, s, seed=11)
        if s in (6, 15):
            xs[0] = xs[0].copy()
            xs[0][5] = np.inf
        return xs

    history = {}
    for s in range(1, 13):
        history[s] = ok(tr.step(s, inputs(s)), cl, "step %d" % s)
    before = assert_same_logs(cl)
    assert entries(before, "anomaly") and entries(before, "full_sync"), before
    # Periodic checkpoints (the state after steps 4 and 9) are on disk.
    files = lwck_files(cl[KILLED].state_dir)
    assert "lw-test-job.rank1.step9.lwck" in files, files
    cl.kill9(KILLED)
    tr.forget_buffers(KILLED)
    cl.restart(KILLED)
    err = cl[KILLED].stderr()
    assert "restored the codec state of step 9" in err, err
    # It took the job's policy state (log, baselines, settings) from its peers.
    got = logs_of(cl, [KILLED])[0]
    assert got == before, ("the restarted rank's decision log is not the job's (it must take the "
                           "job's policy state from its peers, not from its checkpoint of step 9):\n"
                           + log_diff(got, before))
    for s in range(13, 21):
        history[s] = res = ok(tr.step(s, inputs(s)), cl, "step %d after the rejoin" % s)
        assert len(set(modes(res))) == 1, (s, res)
        assert_same_result(res, "step %d after the rejoin" % s)
    log = assert_same_logs(cl)
    assert [e["step"] for e in entries(log, "full_sync")] == [4, 8, 12, 16, 20], log
    assert [e["step"] for e in entries(log, "anomaly")] == [6, 15], log
    assert [o.mode for o in history[16]] == ["full_sync"] * W
    assert [o.mode for o in history[17]] == ["bypass"] * W


# ------------------------------------------------------------------------------------------------
# Atomicity around restarts and late trainers: decisions stay identical only if every step
# succeeds or fails on every rank alike (docs/architecture.md "Atomic steps")
# ------------------------------------------------------------------------------------------------
def test_late_trainer_step_fails_everywhere(cluster_factory, trainers_for):
    """Rank 1's trainer sends step 3 and its sidecar gives up at the exchange deadline (rank 0's
    trainer is late). When rank 0's trainer then sends step 3, it must fail there too: a success
    would commit codec state and policy decisions on rank 0 only."""
    W = 2
    cl = make_cluster(cluster_factory, W, peer_timeout=1)
    tr = trainers_for(cl, timeout=8.0)
    for s in range(1, 3):
        ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
    (early,) = tr.step(3, grads(W, 3), ranks=[1])
    assert early.error is not None and early.error.status in (502, 504), early
    (late,) = tr.step(3, grads(W, 3), ranks=[0])
    assert late.error is not None, (
        "step 3 failed on rank 1 (%s) but succeeded on rank 0: %r\n%s" % (early.error, late, cl.stderr()))
    committed = [tensor_status(cl, r)["last_committed_step"] for r in range(W)]
    assert committed == [2, 2], committed
    res = ok(tr.step(4, grads(W, 4)), cl, "step 4")
    assert_same_result(res, "step 4")
    assert_same_logs(cl)


def test_restarted_rank_saves_no_checkpoint_before_the_job_state(cluster_factory, trainers_for):
    """A restarted sidecar whose trainer sends a step before the peers' job state has arrived (here
    rank 0 is stopped meanwhile): that step fails, and it must not write a periodic checkpoint of
    state it does not have yet -- an empty 'newest' file that the restore then takes instead of
    its real last checkpoint (steps 1, 3 here: --checkpoint-every 2)."""
    W = 2
    cl = make_cluster(cluster_factory, W, extra=["--checkpoint-every", "2"], peer_timeout=2)
    tr = trainers_for(cl, timeout=8.0)
    for s in range(1, 6):
        ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
    assert lwck_files(cl[1].state_dir) == ["lw-test-job.rank1.step1.lwck", "lw-test-job.rank1.step3.lwck"]
    cl.kill9(1)
    tr.forget_buffers(1)
    os.kill(cl[0].proc.pid, signal.SIGSTOP)
    try:
        cl.launch([1])
        (o,) = tr.step(6, grads(W, 6), ranks=[1])
        assert o.error is not None and o.error.status == 502, o  # rank 0 is not there
    finally:
        os.kill(cl[0].proc.pid, signal.SIGCONT)
    cl.wait_ready()
    (o0,) = tr.step(6, grads(W, 6), ranks=[0])
    assert o0.error is not None, "step 6 failed on rank 1 but succeeded on rank 0: %r" % o0
    for s in (7, 8):
        res = ok(tr.step(s, grads(W, s)), cl, "step %d after the restart" % s)
        assert_same_result(res, "step %d after the restart" % s)
    err = cl[1].stderr()
    assert "0 tensor(s) written" not in err, (
        "the restarted rank wrote a checkpoint before it had any state:\n%s" % err)
    assert "restored the codec state of step 3 " in err, err
    assert_same_logs(cl)


def test_restarted_rank_step_in_flight_when_the_job_state_arrives(cluster_factory, trainers_for):
    """Trainers do not wait for /readyz: right after a restart, the new sidecar may be exchanging a
    step (waiting for its peers' data) when its peers' job state arrives and it takes in its own
    codec state from its checkpoint. It must not wedge: that step ends (here at the exchange
    deadline: rank 0's trainer never sends it), the sidecar becomes ready and the job goes on.
    Rank 1's trainer retries as soon as a step is refused for want of a connection, so that one
    is in flight when the connection comes up; three restarts, as the window is narrow."""
    W = 2
    cl = make_cluster(cluster_factory, W, extra=["--checkpoint-every", "5"], peer_timeout=2)
    tr = trainers_for(cl, timeout=10.0)
    s = 1
    for _ in range(6):  # periodic checkpoint of step 4 on disk
        ok(tr.step(s, grads(W, s)), cl, "step %d" % s)
        s += 1
    for attempt in range(3):
        cl.kill9(1)
        tr.forget_buffers(1)
        cl.launch([1])
        deadline = time.monotonic() + 10
        while True:
            (o,) = tr.step(s, grads(W, s), ranks=[1])
            assert o.error is None or o.error.status is not None, (
                "restart %d: rank 1 gave no answer to step %d: %r\n%s" % (attempt, s, o, cl.stderr()))
            if o.error is None or "not connected" not in o.error.message:
                break
            assert time.monotonic() < deadline, cl.stderr()
        s += 1
        cl.wait_ready(timeout=10)
        res = ok(tr.step(s, grads(W, s)), cl, "restart %d, step %d once ready" % (attempt, s))
        assert_same_result(res, "restart %d, step %d" % (attempt, s))
        s += 1
    assert_same_logs(cl)
