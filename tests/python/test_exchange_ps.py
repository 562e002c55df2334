"""Several real sidecars of one job exchanging through a parameter-server sidecar (`--topology ps`,
docs/exchange.md "The ps topology"): results equal the numpy reference (tests/reference/lwref.py)
computed here in the documented order, bit for bit, on every rank -- the server (rank 1, itself a
worker with a trainer of its own) sums summable payloads in the compressed domain in rank order,
and decodes the others into a dense sum in rank order which it re-compresses with a codec and
state of its own (momentum 0, no clipping, Philox stream W)."""

import os
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tests", "reference"))
pytest.importorskip("xxhash")
import lwref  # noqa: E402

import lightwire  # noqa: E402
import test_exchange as tx  # noqa: E402  (helpers only: a module object is not collected)

PS_RANK = 1
PS_FLAGS = ["--topology", "ps", "--ps-rank", str(PS_RANK)]
CASES = [(3, k) for k in tx.CODECS] + [(w, k) for w in (2, 4, 5) for k in tx.SUBSET]


def rank_sum(codec, payloads):
    """The server's compressed-domain sum of one chunk: ((p[0] + p[1]) + p[2]) + ..."""
    s = payloads[0]
    for p in payloads[1:]:
        s = tx.add(codec, s, p)
    return s


class PsReference(tx.Reference):
    """What every sidecar of a W-rank `ps` job returns, step after step (state committed)."""

    def __init__(self, cfg, world, local_trainers, bounded=False, **kw):
        super().__init__(cfg, world, local_trainers, **kw)
        self.bounded = bounded  # bounded staleness, everyone on time: always re-compressed
        self.server = None
        if cfg["name"] != "powersgd" and (bounded or cfg["name"] not in tx.SUMMABLE):
            # The server's own codec: the tensor's settings, momentum 0, no clipping.
            self.server = lwref.Codec(dict(cfg, momentum=0.0, clip_norm=0.0), self.n)

    def step(self, inputs, step):
        codec = self.cfg["name"]
        W = self.W
        out = np.zeros(self.n, dtype=np.float32)
        if codec == "powersgd":
            sent0 = [self.ranks[r].begin(inputs[r], "fp32", self.seed, self.name, step, self.shape)
                     for r in range(W)]
            red0 = rank_sum("powersgd", sent0)
            sent1 = [self.ranks[r].round1(red0) for r in range(W)]
            red1 = rank_sum("powersgd", sent1)
            lwref.powersgd_decode(red0, red1, self.n, self.cfg["approx_rank"], self.weight, out)
            for r in range(W):
                self.ranks[r].finish(red0, red1, self.weight)
            return out
        payloads = [self.ranks[r].step(inputs[r], "fp32", self.chunking, self.seed, self.name, step, r, None)[0]
                    for r in range(W)]
        cid = lwref.CODEC_ID[codec]
        if self.server is None:
            for c, (b, m) in enumerate(self.chunking):
                lwref.decode_payload(rank_sum(codec, [p[c] for p in payloads]), cid, self.weight, out, b, m)
            return out
        dense = np.zeros(self.n, dtype=np.float32)
        for r in range(W):
            for c, (b, m) in enumerate(self.chunking):
                lwref.decode_payload(payloads[r][c], cid, np.float32(1.0), dense, b, m)
        # Re-compressed on the server: Philox stream W (no worker's), the server's state committed.
        sent = self.server.step(dense, "fp32", self.chunking, self.seed, self.name, step, W, None)[0]
        for c, (b, m) in enumerate(self.chunking):
            lwref.decode_payload(sent[c], cid, self.weight, out, b, m)
        return out


def check_ps(cluster_factory, world, key, local_trainers=1, steps=tx.STEPS, extra=(), bounded=False):
    codec, flags, over = tx.CODECS[key]
    cl = cluster_factory(world, codec=codec, codec_args=flags, local_trainers=local_trainers,
                         extra=PS_FLAGS + list(extra))
    shape = tx.SHAPE if codec == "powersgd" else None
    ref = PsReference(tx.ref_cfg(codec, **over), world, local_trainers, bounded=bounded, shape=shape)
    jobs = {}
    for r in range(world):
        for t in range(local_trainers):
            xs = []
            for s in range(steps):
                x = tx.trainer_input(world, r, t, s)
                xs.append((s, x.reshape(shape) if shape else x))
            jobs[(r, t)] = xs
    results, _ = tx.run_trainers(cl, jobs)
    for s in range(steps):
        local = []
        for r in range(world):
            acc = tx.trainer_input(world, r, 0, s)
            for t in range(1, local_trainers):
                acc = (acc + tx.trainer_input(world, r, t, s)).astype(np.float32)  # trainer order, fp32
            local.append(acc)
        want = ref.step(local, s)
        first = None
        for (r, t), got in sorted(results.items()):
            res = got[s]
            assert not isinstance(res, Exception), "W=%d %s step %d rank %d trainer %d: %s\n%s" % (
                world, key, s, r, t, res, cl.stderr())
            assert res.dtype == np.float32 and res.size == tx.N
            if first is None:
                first = res
            tx.assert_bitwise(res, first, "W=%d %s step %d: rank %d trainer %d vs rank 0" % (world, key, s, r, t))
        tx.assert_bitwise(first, want, "W=%d %s step %d: sidecars vs reference" % (world, key, s))
        assert np.any(want != 0)
    return cl


@pytest.mark.parametrize("world,key", CASES, ids=["W%d-%s" % c for c in CASES])
def test_ps_matches_reference(cluster_factory, world, key):
    check_ps(cluster_factory, world, key)


@pytest.mark.parametrize("key", ["none", "topk"])
def test_ps_two_local_trainers_per_node(cluster_factory, key):
    check_ps(cluster_factory, 2, key, local_trainers=2)


@pytest.mark.parametrize("key", ["none", "fp16", "topk", "qsgd4"])
def test_ps_bounded_staleness_everyone_on_time(cluster_factory, key):
    """bounded-staleness with every sidecar on time (a straggler wait far longer than any step):
    every step holds every contribution, and the server always decodes and re-compresses (the
    summable codecs too)."""
    check_ps(cluster_factory, 3, key, bounded=True,
             extra=["--synchrony", "bounded-staleness", "--staleness", "2", "--straggler-wait", "10"])


def test_ps_bounded_staleness_refuses_powersgd(cluster_factory):
    W = 2
    codec, flags, _ = tx.CODECS["powersgd"]
    cl = cluster_factory(W, codec=codec, codec_args=flags,
                         extra=PS_FLAGS + ["--synchrony", "bounded-staleness"])
    jobs = {(r, 0): [(0, tx.trainer_input(W, r, 0, 0).reshape(tx.SHAPE))] for r in range(W)}
    results, _ = tx.run_trainers(cl, jobs)
    for r in range(W):
        e = results[(r, 0)][0]
        assert isinstance(e, lightwire.LightwireError), "rank %d got %r" % (r, e)
        assert e.status == 502, "rank %d: %s" % (r, e)
        assert "powersgd needs peer.synchrony sync" in str(e), "rank %d: %s" % (r, e)
