"""DDP with the lightwire hook against the real sidecar (skipped when it is not built): equality\nwith plain DDP, fallback and recovery, raise mode, error replies, segment re-creation."""

import logging
import os
import re

import pytest

torch = pytest.importorskip("torch")

import lightwire  # noqa: E402
import lightwire.torch as lwt  # noqa: E402
import ddp_helpers as H  # noqa: E402
from conftest import START_METHOD, metric_total  # noqa: E402


@pytest.fixture
def pg(tmp_path):
    H.init_pg(tmp_path)
    yield
    H.destroy_pg()


def _shm_segments():
    """This process's hook segments still in /dev/shm."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("lightwire-%d-" % os.getpid())]


def _fallbacks_total(sc):
    """The sidecar's lightwire_fallbacks_total (the fallbacks trainers reported to it)."""
    total = 0.0
    for line in sc.client().metrics().splitlines():
        if line.startswith("lightwire_fallbacks_total"):
            total += float(line.rsplit(None, 1)[1])
    return total


def _state(sc, **kw):
    return lwt.LightwireHookState(client=sc.client(timeout=(2.0, 10.0)), **kw)


def _no_fallback(state):
    """on_step callback: stop at the first fallback instead of training on without the sidecar."""
    def check(i):
        if state.fallbacks:
            raise AssertionError("step %d fell back: %r" % (i - 1, state.last_error))
    return check


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    H.init_pg(tmp_path_factory.mktemp("plain"))
    try:
        losses, params = H.train()
    finally:
        H.destroy_pg()
    assert losses[-1] <= 0.5 * losses[0], "the task must be learnable: plain SGD loss must halve"
    return losses, params


def test_codec_none_equals_plain_sgd(sidecar, pg, plain_losses):
    state = _state(sidecar)
    try:
        losses, params = H.train(state, on_step=_no_fallback(state))
    finally:
        state.close()
    assert state.fallbacks == 0 and state.sidecar_steps == H.STEPS
    assert state.last_reply["codec"] == "none"
    # close() released the segments at the sidecar and unlinked them.
    assert sidecar.client().status()["buffers"] == []
    assert not _shm_segments()
    for i, (a, b) in enumerate(zip(plain_losses[0], losses)):
        assert abs(a - b) <= 1e-5, "step %d: plain %r, hook %r" % (i, a, b)


def _layer_state(sc, made, **kw):
    """A function of the DDP model making a per-layer hook state (kept in `made`)."""
    def make(net):
        made.append(lwt.LightwireHookState(client=sc.client(timeout=(2.0, 10.0)), module=net, **kw))
        return made[-1]
    return make


def _close(made):
    for state in made:
        state.close()


def test_per_layer_codec_none_equals_plain_sgd(sidecar, pg, plain_losses):
    made = []
    try:
        losses, _ = H.train(_layer_state(sidecar, made))
    finally:
        _close(made)
    state = made[0]
    assert state.per_layer and state.fallbacks == 0 and state.sidecar_steps == H.STEPS
    assert state.last_step == H.STEPS - 1
    reply = state.last_reply
    assert re.fullmatch(r"bucket\.[0-9a-f]{16}", reply["name"]), reply["name"]
    assert sorted(l["name"] for l in reply["layers"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(l["step"] == H.STEPS - 1 for l in reply["layers"])
    # Every parameter is a tensor of the sidecar's, of its own size; the bucket is not.
    tensors = {t["name"]: t["elements"] for t in sidecar.client().status()["tensors"]}
    assert tensors == {"0.weight": 16 * 64, "0.bias": 64, "2.weight": 64, "2.bias": 1}
    for i, (a, b) in enumerate(zip(plain_losses[0], losses)):
        assert abs(a - b) <= 1e-5, "step %d: plain %r, hook %r" % (i, a, b)


def test_per_layer_rules_choose_each_parameters_codec(sidecar_factory, pg, plain_losses, tmp_path):
    config = tmp_path / "rules.yaml"
    # (dense_max_elements 0: this model's weights, 1024 and 64 elements, are compressed too.)
    config.write_text('compression:\n  layers:\n    dense_max_elements: 0\n  rules:\n'
                      '    - pattern: "*.bias"\n      codec: none\n')
    sc = sidecar_factory(codec="fp16", config=str(config))
    made = []
    try:
        losses, _ = H.train(_layer_state(sc, made))
    finally:
        _close(made)
    reply = made[0].last_reply
    assert reply["codec"] == "mixed"
    codecs = {l["name"]: l["codec"] for l in reply["layers"]}
    assert codecs == {"0.weight": "fp16", "0.bias": "none", "2.weight": "fp16", "2.bias": "none"}
    # fp16 rounding of the weights' gradients: plain SGD's losses early on (the rounding
    # compounds over the steps, so later ones wander), and as low a loss at the end.
    plain = plain_losses[0]
    assert losses != plain
    for i in range(20):
        assert abs(plain[i] - losses[i]) <= 1e-3 * plain[i], (i, plain[i], losses[i])
    assert losses[-1] <= 1.05 * plain[-1], (plain[-1], losses[-1])


def test_per_layer_needs_the_module():
    with pytest.raises(ValueError, match="module="):
        lwt.LightwireHookState(client=lightwire.Client(socket_path="/nonexistent"), per_layer=True)


def test_dgc_density_001_learns(sidecar_factory, pg, plain_losses):
    sc = sidecar_factory(codec="dgc", density=0.01)
    state = _state(sc)
    try:
        losses, _ = H.train(state, on_step=_no_fallback(state))
    finally:
        state.close()
    assert state.fallbacks == 0
    assert state.last_reply["codec"] == "dgc"
    plain = plain_losses[0]
    plain_fall = plain[0] - plain[-1]
    assert plain_fall >= 0.5 * plain[0]
    assert losses[0] - losses[-1] >= 0.9 * plain_fall, (losses[0], losses[-1], plain[0], plain[-1])


def test_sidecar_stopped_mid_training_falls_back_then_recovers(sidecar, pg, plain_losses, caplog):
    state = _state(sidecar)
    seen = {}

    def on_step(i):
        if i == 1:
            assert state.fallbacks == 0, state.last_error
        if i == 100:
            sidecar.stop()  # SIGTERM: exits 0, removes its socket
        elif i == 150:
            seen["fallbacks_at_restart"] = state.fallbacks
            seen["sidecar_steps_at_restart"] = state.sidecar_steps
            sidecar.start()  # same socket path

    try:
        with caplog.at_level(logging.WARNING, logger="lightwire.torch"):
            losses, _ = H.train(state, on_step=on_step)
    finally:
        state.close()
    assert "falls back" in caplog.text
    assert _fallbacks_total(sidecar) == 50  # all reported to the restarted sidecar
    assert seen["fallbacks_at_restart"] == 50  # one bucket, steps 100..149
    assert state.fallbacks == 50  # stopped growing after the restart
    assert state.sidecar_steps - seen["sidecar_steps_at_restart"] == H.STEPS - 150
    assert state.fallbacks_reported == state.fallbacks  # reported to the restarted sidecar
    # Training went on throughout; with codec none the fallback is exact too.
    for a, b in zip(plain_losses[0], losses):
        assert abs(a - b) <= 1e-5


def _two_trainers(rank, store_dir, socket_path, out_dir, steps, bucket_cap_mb, hidden):
    os.environ["LOCAL_RANK"] = str(rank)
    H.init_pg(store_dir, rank=rank, world_size=2)
    try:
        kw = dict(rank=rank, world_size=2, steps=steps, bucket_cap_mb=bucket_cap_mb, hidden=hidden)
        plain, p_plain = H.train(**kw)
        state = lwt.LightwireHookState(client=lightwire.Client(socket_path=socket_path, timeout=(2.0, 10.0)))
        no_fallback, flags = _no_fallback(state), []

        def on_step(i):
            no_fallback(i)
            flags.append({k: id(t) for k, t in state._flags.items()})
        try:
            hooked, p_hooked = H.train(state, on_step=on_step, **kw)
            flags.append({k: id(t) for k, t in state._flags.items()})
            used = list(state._flags.values())
        finally:
            state.close()
        torch.save({"plain": plain, "hooked": hooked, "p_plain": p_plain, "p_hooked": p_hooked,
                    "fallbacks": state.fallbacks, "trainer": state.trainer,
                    "sidecar_steps": state.sidecar_steps, "agreements": state.agreements,
                    "buckets": dict(state.steps), "flags": flags,
                    "flags_retired": [any(t is r for r in lwt._AGREEMENT_TENSORS) for t in used]},
                   os.path.join(out_dir, "rank%d.pt" % rank))
    finally:
        H.destroy_pg()


def _run_two_trainers(sidecar_factory, tmp_path, steps=H.STEPS, bucket_cap_mb=25, hidden=(64,)):
    """Two trainers (two ranks of DDP) of one sidecar; returns each one's outcome."""
    import torch.multiprocessing as mp
    sc = sidecar_factory(local_trainers=2)
    store = tmp_path / "store2"
    store.mkdir()
    mp.start_processes(_two_trainers, args=(str(store), sc.socket, str(tmp_path), steps,
                                            bucket_cap_mb, hidden),
                       nprocs=2, join=True, start_method=START_METHOD)
    return [torch.load(str(tmp_path / ("rank%d.pt" % i))) for i in range(2)]


def test_two_trainers_get_the_mean(sidecar_factory, tmp_path):
    r = _run_two_trainers(sidecar_factory, tmp_path)
    for i in range(2):
        assert r[i]["trainer"] == i and r[i]["fallbacks"] == 0 and r[i]["sidecar_steps"] == H.STEPS
        for a, b in zip(r[i]["plain"], r[i]["hooked"]):
            assert abs(a - b) <= 1e-5
        assert torch.allclose(r[i]["p_plain"], r[i]["p_hooked"], atol=1e-5)
    # Both ranks applied the same (mean) gradient: identical parameters.
    assert torch.equal(r[0]["p_hooked"], r[1]["p_hooked"])
    assert r[0]["hooked"] != r[1]["hooked"]  # different shards, so the mean mattered


def test_hook_raise_mode(sidecar, pg):
    state = _state(sidecar, on_error="raise")

    def on_step(i):
        if i == 2:
            sidecar.stop()

    try:
        with pytest.raises(Exception, match="unavailable|No such file|lightwire.sock"):
            H.train(state, steps=4, on_step=on_step)
    finally:
        state.close()
    assert state.sidecar_steps == 2 and state.fallbacks == 0
    assert isinstance(state.last_error, lightwire.SidecarUnavailable)


def test_hook_fallback_on_error_reply(sidecar, pg):
    first = _state(sidecar)
    try:
        H.train(first, steps=5, on_step=_no_fallback(first))
    finally:
        first.close()
    # A second trainer state with the same tensor names starts again at step 0: the sidecar
    # answers 409 (the step goes backwards) and every bucket falls back to the process group.
    plain, _ = H.train(steps=5)
    state = _state(sidecar)
    try:
        losses, _ = H.train(state, steps=5)
    finally:
        state.close()
    nb = len(state.steps)
    assert nb >= 1 and state.fallbacks == 5 * nb and state.sidecar_steps == 0
    e = state.last_error
    assert isinstance(e, lightwire.LightwireError) and (e.status, e.error) == (409, "conflict")
    assert "backwards" in e.message
    assert state.fallbacks_reported == state.fallbacks  # the sidecar was reachable
    assert _fallbacks_total(sidecar) == state.fallbacks
    assert losses == plain  # world size 1: the fallback allreduce is exact
    assert losses[-1] < losses[0]


class _Bucket(object):
    def __init__(self, index, tensor):
        self._i, self._t = index, tensor

    def index(self):
        return self._i

    def buffer(self):
        return self._t

    def parameters(self):
        return []


def test_segment_recreated_when_bucket_size_changes(sidecar):
    c = sidecar.client()
    state = _state(sidecar, name_prefix="grads")
    try:
        for step, n in enumerate((10, 10, 24, 24)):
            t = torch.arange(n, dtype=torch.float32) * (step + 1)
            out = lwt.ddp_comm_hook(state, _Bucket(0, t)).wait()
            assert torch.equal(out, t) and out.shape == t.shape
            if step == 1:
                old = state._slots[0].segment
                old_id = old.buffer_id
                assert c.status()["buffers"] == [{"id": old_id, "name": old.shm_name, "size": 40, "kind": "shm",
                                                  "pid": os.getpid()}]
        new = state._slots[0].segment
        assert new is not old and old.buffer_id is None and new.buffer_id not in (None, old_id)
        assert not os.path.exists("/dev/shm/" + old.name) and os.path.exists("/dev/shm/" + new.name)
        # The old registration was released, the new one is the only buffer.
        assert c.status()["buffers"] == [{"id": new.buffer_id, "name": new.shm_name, "size": 96, "kind": "shm",
                                          "pid": os.getpid()}]
        assert state.steps == {0: 4} and state.sidecar_steps == 4 and state.fallbacks == 0
        assert state.last_reply["name"] == "grads.0" and state.last_reply["step"] == 3
        assert state.last_reply["elements"] == 24
    finally:
        state.close()
    assert not os.path.exists("/dev/shm/" + new.name)
    assert c.status()["buffers"] == []


def test_one_agreement_per_iteration_with_several_buckets(sidecar_factory, tmp_path):
    """Several buckets per iteration: the ranks agree once per iteration (one flag per bucket in
    one collective), every bucket is the sidecar's, and training equals plain DDP."""
    r = _run_two_trainers(sidecar_factory, tmp_path, steps=20, bucket_cap_mb=0.01,
                          hidden=H.MANY_BUCKETS)
    for i in range(2):
        assert len(r[i]["buckets"]) >= 3, r[i]["buckets"]  # the rebuilt buckets
        assert r[i]["sidecar_steps"] == sum(r[i]["buckets"].values()) > 20, r[i]
        assert r[i]["agreements"] == 20, r[i]  # not one per bucket
        # Each agreement of a length reuses one tensor, which outlives the closed hook state:
        # gloo must never drop the last reference to it (lightwire/torch.py, _AGREEMENT_TENSORS).
        seen = {}
        for step in r[i]["flags"]:
            for key, ident in step.items():
                assert seen.setdefault(key, ident) == ident, (key, r[i]["flags"])
        assert len(seen) == 2, seen  # the first iteration's buckets and the rebuilt ones
        assert r[i]["flags_retired"] == [True, True], r[i]["flags_retired"]
        for a, b in zip(r[i]["plain"], r[i]["hooked"]):
            assert abs(a - b) <= 1e-5
    assert torch.equal(r[0]["p_hooked"], r[1]["p_hooked"])


def _split_outcome(rank, store_dir, socket_path, out_dir, agree, timeout_s, bucket_cap_mb=25,
                   hidden=(64,)):
    """Rank 0 has a working sidecar (world size 1: it answers with rank 0's own gradient);
    rank 1's sidecar does not exist. Every bucket's step succeeds on rank 0 and fails on rank 1."""
    import datetime
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + os.path.join(store_dir, "store"), rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s))
    sock = socket_path if rank == 0 else os.path.join(out_dir, "no-sidecar.sock")
    state = lwt.LightwireHookState(client=lightwire.Client(socket_path=sock, timeout=(2.0, 10.0)),
                                   agree=agree)
    result = {"fallbacks": None, "error": None}
    try:
        losses, params = H.train(state, steps=5, rank=rank, world_size=2,
                                 bucket_cap_mb=bucket_cap_mb, hidden=hidden)
        result.update(params=params, losses=losses, fallbacks=state.fallbacks,
                      sidecar_steps=state.sidecar_steps, last_error=repr(state.last_error),
                      agreements=state.agreements, buckets=dict(state.steps))
    except Exception as e:  # without agreement: the lone fallback times out
        result["error"] = repr(e)
    finally:
        state.close()
    torch.save(result, os.path.join(out_dir, "rank%d.pt" % rank))
    try:
        torch.distributed.destroy_process_group()
    except Exception:
        pass


def _run_split(sidecar, tmp_path, agree, timeout_s, bucket_cap_mb=25, hidden=(64,)):
    import torch.multiprocessing as mp
    store = tmp_path / "store"
    store.mkdir()
    mp.start_processes(_split_outcome, args=(str(store), sidecar.socket, str(tmp_path), agree,
                                             timeout_s, bucket_cap_mb, hidden),
                       nprocs=2, join=True, start_method=START_METHOD)
    return [torch.load(str(tmp_path / ("rank%d.pt" % i))) for i in range(2)]


def test_ranks_fall_back_together_when_only_one_sidecar_fails(sidecar, tmp_path):
    """One rank's sidecar answers, the other's does not (a sidecar that died between the exchange
    and its answer looks the same to the trainers). With agreement (the default) both ranks fall
    back for every bucket, together: identical parameters, no hang, both count the fallbacks, and
    rank 0's error says another rank failed."""
    r = _run_split(sidecar, tmp_path, True, 60)
    for i in range(2):
        assert r[i]["error"] is None, r[i]["error"]
        assert r[i]["sidecar_steps"] == 0 and r[i]["fallbacks"] == 5, r[i]
    assert torch.equal(r[0]["params"], r[1]["params"])
    assert "peer_fallback" in r[0]["last_error"], r[0]["last_error"]
    assert "SidecarUnavailable" in r[1]["last_error"], r[1]["last_error"]
    assert _fallbacks_total(sidecar) == 5  # rank 0 reported its fallbacks to its sidecar


def test_ranks_fall_back_together_bucket_by_bucket_with_one_agreement_per_iteration(sidecar,
                                                                                     tmp_path):
    """The same with several buckets per iteration: every bucket of every iteration falls back
    on both ranks, decided by one collective per iteration."""
    r = _run_split(sidecar, tmp_path, True, 60, bucket_cap_mb=0.01, hidden=H.MANY_BUCKETS)
    for i in range(2):
        assert r[i]["error"] is None, r[i]["error"]
        buckets = sum(r[i]["buckets"].values())
        assert buckets > 5 and r[i]["fallbacks"] == buckets and r[i]["sidecar_steps"] == 0, r[i]
        assert r[i]["agreements"] == 5, r[i]
    assert torch.equal(r[0]["params"], r[1]["params"])
    assert "peer_fallback" in r[0]["last_error"], r[0]["last_error"]


def test_without_agreement_a_lone_fallback_is_stuck(sidecar, tmp_path):
    """The same with agree=False: rank 1 falls back alone and its allreduce finds no partner
    until the process group's timeout (5 s here; 30 min by default), which is why agreement is
    the default. Neither rank finishes. The first rank whose collective times out leaves and
    closes its gloo connections, so the other one may see "Connection closed by peer" just
    before its own deadline instead of a timeout; at least one of them timed out."""
    r = _run_split(sidecar, tmp_path, False, 5)
    for i in range(2):
        e = r[i]["error"]
        assert e is not None and ("Timed out" in e or "Connection closed by peer" in e), r[i]
    assert any("Timed out" in r[i]["error"] for i in range(2)), r


def test_per_layer_sends_each_layout_once_and_again_to_a_restarted_sidecar(sidecar, pg,
                                                                           plain_losses):
    """A bucket's layout goes with its first request; later ones name it by its hash. A sidecar
    that restarted holds no layouts (404 unknown_layout): the hook sends the layout again, and
    training goes on without a fallback, as plain SGD."""
    made, sent = [], []  # sent: (phase, bucket name, "layout" | "hash")
    phase = ["before"]
    make = _layer_state(sidecar, made)

    def make_spied(net):
        state = make(net)
        real = state.client.emit_gradient_shm

        def spy(*a, **kw):
            kind = "layout" if kw.get("layout") is not None else "hash"
            assert kw.get("layout") is None or kw.get("layout_hash") is None
            sent.append((phase[0], kw["name"], kind))
            return real(*a, **kw)
        state.client.emit_gradient_shm = spy
        return state

    def on_step(i):
        if i == H.STEPS // 2:
            sidecar.stop()
            sidecar.start()
            phase[0] = "after"

    try:
        losses, _ = H.train(make_spied, on_step=on_step)
    finally:
        _close(made)
    state = made[0]
    assert state.fallbacks == 0 and state.sidecar_steps == H.STEPS
    for when in ("before", "after"):
        names = {n for p, n, _ in sent if p == when}
        assert names, when
        for name in names:
            kinds = [k for p, n, k in sent if p == when and n == name]
            if when == "before":
                assert kinds[0] == "layout" and set(kinds[1:]) <= {"hash"}, (name, kinds)
            else:
                # The hash first (the sidecar does not know it: 404), then the layout once.
                assert "layout" in kinds and kinds.count("layout") == 1, (name, kinds)
                assert set(kinds[kinds.index("layout") + 1:]) <= {"hash"}, (name, kinds)
    assert sum(1 for _, _, k in sent if k == "hash") >= H.STEPS - 4
    for i, (a, b) in enumerate(zip(plain_losses[0], losses)):
        assert abs(a - b) <= 1e-5, "step %d: plain %r, hook %r" % (i, a, b)


def test_no_sync_accumulation_sends_once_per_optimizer_step(sidecar, pg):
    """Micro-batch accumulation: under DDP's no_sync() the hook is not called, so the sidecar
    gets one request per bucket and optimizer step (docs/api.md "Micro-batch accumulation"), and
    the update is the accumulated gradient's (codec none, one trainer: plain accumulation)."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    steps, micro = 5, 3
    X, y = H.task()
    chunks = list(zip(X.chunk(micro), y.chunk(micro)))

    def run(with_hook):
        torch.manual_seed(H.SEED)
        net = DDP(H.model())
        state = _state(sidecar) if with_hook else None
        if state is not None:
            net.register_comm_hook(state, lwt.ddp_comm_hook)
        opt = torch.optim.SGD(net.parameters(), lr=H.LR)
        try:
            for _ in range(steps):
                opt.zero_grad()
                for i, (xb, yb) in enumerate(chunks):
                    if i + 1 < micro:  # forward and backward inside no_sync(): DDP decides in
                        with net.no_sync():  # the forward whether the backward reduces
                            (F.mse_loss(net(xb), yb) / micro).backward()
                    else:  # the last micro-batch: DDP reduces, the hook sends
                        (F.mse_loss(net(xb), yb) / micro).backward()
                opt.step()
        finally:
            if state is not None:
                state.close()
        return state, torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def emits():
        return metric_total(sidecar.client().metrics(), "lightwire_http_requests_total",
                            'route="/v1/emit_gradient"')

    before = emits()
    state, hooked = run(True)
    assert state.fallbacks == 0 and state.sidecar_steps == steps
    assert emits() - before == steps  # one bucket (a small model): one request per step
    _, plain = run(False)
    assert torch.allclose(hooked, plain, rtol=0, atol=1e-6), (hooked - plain).abs().max()
