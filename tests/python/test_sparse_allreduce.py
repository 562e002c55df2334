"""The sparse allreduce (docs/exchange.md "Sparse allreduce") through real sidecars: 3 sidecars of
one job (`--sparse allreduce`), topk 1 % with error feedback, a trainer each sending its gradient
over HTTP for several steps. Every rank's result against an independent implementation of the rule
written here with numpy (each rank's exact top-k of gradient + residual; each chunk's owner sums
the selections in rank order, keeps the chunk's share of k by magnitude; what a rank sent and the
selection dropped stays in its residual) -- bit for bit, identical on every rank, at most k
non-zeros; and the same job with `--sparse allgather` for the contrast (up to W x k)."""

import threading

import numpy as np
import pytest

from conftest import Cluster, _serve_available

WORLD = 3
N = 20000
CHUNK = 1024
DENSITY = 0.01
STEPS = 4
ARGS = ["--density", str(DENSITY), "--min-magnitude", "0", "--full-sync-every", "0",
        "--warmup-steps", "0", "--anomaly", "false", "--rollback", "false"]


def _gradient(rank, step):
    g = np.random.default_rng(1000 * step + rank)
    return (g.standard_normal(N) * (1 + rank)).astype(np.float32)


def _run(cluster):
    """Every rank's results, [step][rank]."""
    import lightwire
    out = [[None] * WORLD for _ in range(STEPS)]
    errors = []

    def trainer(rank):
        c = lightwire.Client(socket_path=cluster[rank].socket, timeout=(2.0, 20.0))
        try:
            for step in range(STEPS):
                out[step][rank] = c.emit_gradient(_gradient(rank, step), name="w", step=step)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append("rank %d: %r" % (rank, e))
        finally:
            c.close()

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, "%s\n%s" % (errors, cluster.stderr())
    return out


def _reference():
    """The rule, plainly: per step, per rank acc = g + e (fp32) and its exact top-k; per chunk the
    sum of the selected values in rank order from +0 (fp32), the k_c = floor(k end / n) -
    floor(k begin / n) largest magnitudes (ties: the lower index) kept; the result is +0 + (1/W)
    * sum there (fp32); e = acc, less the values sent and kept."""
    k = max(1, min(N, int(np.floor(DENSITY * N + 0.5))))
    w = np.float32(1.0) / np.float32(WORLD)
    residual = [np.zeros(N, np.float32) for _ in range(WORLD)]
    results = []
    for step in range(STEPS):
        acc = [(_gradient(r, step) + residual[r]).astype(np.float32) for r in range(WORLD)]
        sent = []
        for r in range(WORLD):
            order = np.lexsort((np.arange(N), -np.abs(acc[r]).astype(np.float64)))
            mask = np.zeros(N, bool)
            mask[order[:k]] = True
            sent.append(mask)
        result = np.zeros(N, np.float32)
        kept = np.zeros(N, bool)
        for begin in range(0, N, CHUNK):
            end = min(N, begin + CHUNK)
            s = np.zeros(end - begin, np.float32)
            for r in range(WORLD):
                m = sent[r][begin:end]
                s[m] = s[m] + acc[r][begin:end][m]
            k_c = k * end // N - k * begin // N
            cand = np.nonzero(s != 0)[0]
            cand = cand[np.lexsort((cand, -np.abs(s[cand]).astype(np.float64)))][:k_c]
            kept[begin + cand] = True
            result[begin + cand] = np.float32(0) + w * s[cand]
        for r in range(WORLD):
            e = acc[r].copy()
            gone = sent[r] & kept
            e[gone] = e[gone] - acc[r][gone]
            residual[r] = e
        results.append(result)
    return results, k


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ok, reason = _serve_available()
    if not ok:
        pytest.skip(reason)
    out = {}
    for mode in ("allreduce", "allgather"):
        cl = Cluster(tmp_path_factory, WORLD, codec="topk", codec_args=ARGS + ["--sparse", mode],
                     chunk_elements=CHUNK, peer_timeout=10, job_id="sparse-" + mode)
        try:
            cl.start()
            out[mode] = _run(cl)
            cl.stop()
        finally:
            cl.kill_all()
    return out


def test_allreduce_matches_the_rule_bit_for_bit_on_every_rank(runs):
    want, k = _reference()
    for step in range(STEPS):
        for rank in range(WORLD):
            got = np.asarray(runs["allreduce"][step][rank], np.float32)
            assert got.tobytes() == want[step].tobytes(), (step, rank, np.nonzero(got != want[step])[0][:10])
        assert 0 < np.count_nonzero(want[step]) <= k


def test_allgather_carries_every_rank_selection(runs):
    """The allgather's result holds the union of the ranks' selections: more than k entries."""
    _, k = _reference()
    for step in range(STEPS):
        first = np.asarray(runs["allgather"][step][0], np.float32)
        for rank in range(WORLD):
            assert np.asarray(runs["allgather"][step][rank], np.float32).tobytes() == first.tobytes()
        assert k < np.count_nonzero(first) <= WORLD * k
