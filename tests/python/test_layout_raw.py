"""A bucket's layout inline on the raw-body path (docs/api.md "Form 1: raw body", "Layouts: one
tensor per layer") against real sidecars: every layer a tensor of its own, the layout sent once
and then named by its hash, sent again to a sidecar that restarted; bad layouts refused without a
trace; two sidecars averaging a bucket sent with its layout."""

import threading

import numpy as np
import pytest

import lightwire
from lightwire import LightwireError

# A 2-D weight above compression.layers.dense_max_elements (8192) and a 1-D bias: with codec
# fp16 the weight goes fp16 and the bias dense (docs/configuration.md "Layers"), which only
# per-layer exchange tells apart.
LAYOUT = [{"name": "fc.weight", "offset": 0, "shape": [100, 100]},
          {"name": "fc.bias", "offset": 10000, "shape": [100]}]
N = 10100
RAW = {"Content-Type": "application/octet-stream"}


def bucket(seed):
    # Values fp16 cannot hold exactly, so that its rounding shows.
    return (np.random.default_rng(seed).standard_normal(N) * 0.3 + 0.01).astype(np.float32)


def state(c):
    """What a refused request must not change: the tensors and the step counts."""
    st = c.status()
    return st["tensors"], st["steps"]


class Recording(lightwire.Client):
    """A client that records the query of every emit_gradient request it sends."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.queries = []

    def request(self, method, path, *a, **kw):
        if path.startswith("/v1/emit_gradient?"):
            self.queries.append(dict(p.split("=", 1) for p in path.split("?", 1)[1].split("&")))
        return super().request(method, path, *a, **kw)


def test_layout_inline_gives_one_tensor_per_layer_then_the_hash_alone(sidecar_factory):
    sc = sidecar_factory(codec="fp16")
    c = sc.client()
    x = bucket(1)
    out = c.emit_gradient(x, "bucket.raw", 0, layout=LAYOUT)
    assert out.shape == x.shape and out.dtype == np.float32
    h = c.last_figures["layout_hash"]
    assert isinstance(h, str) and len(h) == 16 and int(h, 16) >= 0
    assert c.last_figures["codec"] == "mixed"  # fp16 and none
    assert c.last_figures["raw_bytes"] == 4 * N
    assert out[10000:].tobytes() == x[10000:].tobytes()  # the bias: dense, exact
    np.testing.assert_allclose(out[:10000], x[:10000].astype(np.float16), rtol=0, atol=0)
    assert not np.array_equal(out[:10000], x[:10000])
    tensors = {t["name"]: t for t in c.status()["tensors"]}
    assert set(tensors) == {"fc.weight", "fc.bias"}, tensors
    assert tensors["fc.weight"]["codec"] == "fp16" and tensors["fc.bias"]["codec"] == "none"
    assert tensors["fc.weight"]["elements"] == 10000

    # The same bucket as one flat tensor would go fp16 whole: the bias too.
    flat = c.emit_gradient(x, "flat.raw", 0)
    assert c.last_figures["codec"] == "fp16" and c.last_figures["layout_hash"] is None
    assert not np.array_equal(flat[10000:], x[10000:])

    # Sent once: the hash alone from then on.
    y = bucket(2)
    out = c.emit_gradient(y, "bucket.raw", 1, layout_hash=h)
    assert c.last_figures["layout_hash"] == h
    assert out[10000:].tobytes() == y[10000:].tobytes()
    tensors = {t["name"]: t for t in c.status()["tensors"]}
    assert tensors["fc.weight"]["last_committed_step"] == 1
    assert tensors["fc.bias"]["last_committed_step"] == 1


def test_a_restarted_sidecar_answers_unknown_layout_and_emit_layers_sends_it_again(
        sidecar_factory):
    sc = sidecar_factory(codec="fp16")
    c = Recording(socket_path=sc.socket, timeout=(5.0, 10.0))
    x = bucket(3)
    c.emit_layers(x, "bucket.r", 0, LAYOUT)
    h = c.last_figures["layout_hash"]
    c.emit_layers(x, "bucket.r", 1, LAYOUT)
    assert "layout_bytes" in c.queries[0] and "layout_hash" not in c.queries[0]
    assert c.queries[1].get("layout_hash") == h and "layout_bytes" not in c.queries[1]

    sc.stop()
    sc.start()
    c.close()
    with pytest.raises(LightwireError) as ei:
        c.emit_gradient(x, "bucket.r", 2, layout_hash=h)
    assert (ei.value.status, ei.value.error) == (404, "unknown_layout")
    assert "send the bucket with its 'layout' once" in ei.value.message
    assert c.status()["tensors"] == []  # nothing ran
    del c.queries[:]
    out = c.emit_layers(x, "bucket.r", 2, LAYOUT)
    assert [("layout_hash" in q, "layout_bytes" in q) for q in c.queries] == [
        (True, False), (False, True)]
    assert c.last_figures["layout_hash"] == h
    assert out[10000:].tobytes() == x[10000:].tobytes()
    c.emit_layers(x, "bucket.r", 3, LAYOUT)
    assert "layout_hash" in c.queries[-1] and "layout_bytes" not in c.queries[-1]


def test_bad_layouts_and_layout_bytes_are_refused_and_change_nothing(sidecar):
    c = sidecar.client()
    x = bucket(4)
    c.emit_gradient(x, "bucket.b", 0, layout=LAYOUT)
    h = c.last_figures["layout_hash"]
    before = state(c)
    good = b'[{"name":"a","offset":0,"shape":[10100]}]'
    cases = [
        ("bucket.c", good[:-3], "malformed layout JSON"),
        ("bucket.c", b'{"name":"a"}', "must be an array"),
        ("bucket.c", b'[{"name":"a","offset":0,"shape":[10000]}]', "hold 10000 elements"),
        ("bucket.c", b'[{"name":"a","offset":0,"shape":[10100],"x":1}]', "unknown field 'x'"),
        # Another layout under a bucket name that has one.
        ("bucket.b", good, "was first sent with another layout"),
    ]
    for name, prefix, needle in cases:
        with pytest.raises(LightwireError) as ei:
            c.request("POST", "/v1/emit_gradient?name=%s&step=1&layout_bytes=%d" % (name, len(prefix)),
                      body=prefix + x.tobytes(), headers=RAW)
        assert (ei.value.status, ei.value.error) == (400, "invalid_argument"), prefix
        assert needle in ei.value.message, ei.value.message
    body = good + x.tobytes()
    other = ("1" if h[0] == "0" else "0") + h[1:]  # another hash
    for query, sent, needle in [
            ("layout_bytes=%d" % (len(body) + 1), body, "the body has only %d bytes" % len(body)),
            ("layout_bytes=%d" % (4 << 20 | 1), body, "must be 1 to 4194304"),
            ("layout_bytes=0", body, "must be 1 to 4194304"),
            ("layout_bytes=%d&layout_hash=%s" % (len(good), h), body,
             "is not the hash of the layout"),
            ("layout_hash=%s" % other, x.tobytes(), "was sent with layout %s" % h)]:
        with pytest.raises(LightwireError) as ei:
            c.request("POST", "/v1/emit_gradient?name=bucket.b&step=1&" + query, body=sent,
                      headers=RAW)
        assert (ei.value.status, ei.value.error) == (400, "invalid_argument"), query
        assert needle in ei.value.message, ei.value.message
    assert state(c) == before
    # The refusals left the bucket's layout as it was: the hash still names it.
    c.emit_gradient(x, "bucket.b", 1, layout_hash=h)
    assert c.last_figures["layout_hash"] == h


def test_two_sidecars_average_a_bucket_sent_with_its_layout(cluster_factory):
    cl = cluster_factory(2, codec="none")
    clients = [cl[r].client(timeout=(2.0, 30.0)) for r in range(2)]
    results, errors = [None, None], []

    def emit(r, step):
        try:
            results[r] = clients[r].emit_layers(bucket(10 * step + r), "bucket.two", step, LAYOUT)
        except Exception as e:  # reported below
            errors.append((r, e))

    try:
        for step in range(2):  # the layout, then its hash
            threads = [threading.Thread(target=emit, args=(r, step)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, (errors, cl.stderr())
            assert results[0].tobytes() == results[1].tobytes()
            want = (bucket(10 * step) + bucket(10 * step + 1)) * np.float32(0.5)
            np.testing.assert_allclose(results[0], want, rtol=1e-6)
        hashes = [c.last_figures["layout_hash"] for c in clients]
        assert hashes[0] == hashes[1] and hashes[0] is not None
        for c in clients:
            assert {t["name"] for t in c.status()["tensors"]} == {"fc.weight", "fc.bias"}
    finally:
        for c in clients:
            c.close()
