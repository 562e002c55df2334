"""Momentum with dgc (docs/codecs.md "Momentum with dgc"): two real DDP trainers, each with its own
sidecar, per layer, dgc with momentum correction and lightwire.torch.SGD, against an independent
implementation of Deep Gradient Compression's algorithm written here (momentum correction and
accumulation, exact top-k selection, momentum factor masking, the densely exchanged 1-D tensors
with momentum after averaging, weight decay with momentum of its own) -- bit for bit. Then the
setups that would apply momentum twice, or combine it with an undefined optimizer, refused."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lightwire  # noqa: E402
import lightwire.torch as lwt  # noqa: E402
import ddp_helpers as H  # noqa: E402

WORLD = 2
STEPS = 12
DENSITY = 0.1
MOMENTUM = 0.9
LR = 0.1
WD = 1e-3
# Policies off (no anomaly bypass, rollback or full sync; no min_magnitude floor) and every layer
# of at least two dimensions compressed, however small: the run is the algorithm alone.
DGC_ARGS = ["--momentum", str(MOMENTUM), "--anomaly", "false", "--rollback", "false",
            "--full-sync-every", "0", "--min-magnitude", "0", "--dense-max-elements", "0"]
SIDECAR_ARGS = ["--density", str(DENSITY)] + DGC_ARGS


@pytest.fixture
def pg(tmp_path):
    H.init_pg(tmp_path)
    yield
    H.destroy_pg()


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.LayerNorm(40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 5))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 6, generator=g), torch.randn(16, 5, generator=g)


def _loss(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def _trainer(rank, store_dir, sockets, out_dir, make_optimizer=None, steps=STEPS):
    """One DDP rank through its own sidecar: records, per step, its local gradients (from a copy
    of the model with the same parameters) and the parameters after the optimizer's step.
    make_optimizer(parameters, hook_state): the optimizer (default: lightwire.torch.SGD)."""
    import copy
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    H.init_pg(store_dir, rank=rank, world_size=WORLD)
    out = {"grads": [], "params": [], "replies": []}
    try:
        net = DDP(_model())
        state = lwt.LightwireHookState(
            client=lightwire.Client(socket_path=sockets[rank], timeout=(2.0, 20.0)), module=net,
            on_error="raise")
        net.register_comm_hook(state, lwt.ddp_comm_hook)
        if make_optimizer is None:
            opt = lwt.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD,
                          hook_state=state)
        else:
            opt = make_optimizer(net.parameters(), state)
        shadow = copy.deepcopy(net.module)
        try:
            for step in range(steps):
                x, y = _batch(rank, step)
                shadow.load_state_dict(net.module.state_dict())
                shadow.zero_grad()
                _loss(shadow, x, y).backward()
                out["grads"].append([p.grad.detach().clone() for p in shadow.parameters()])
                opt.zero_grad()
                _loss(net, x, y).backward()
                opt.step()
                out["params"].append([p.detach().clone() for p in net.parameters()])
                out["replies"].append(state.last_reply)
        finally:
            state.close()
        out["momentum"] = [state.sidecar_momentum(p) for p in net.parameters()]
    finally:
        torch.save(out, os.path.join(out_dir, "rank%d.pt" % rank))
        H.destroy_pg()


def _f32(a):
    return np.asarray(a, dtype=np.float32)


class _Dgc(object):
    """Deep Gradient Compression for one tensor of one worker (Lin et al., Algorithm 1 with
    momentum correction and momentum factor masking), exact top-k selection: the k = round(d·n)
    largest |v|, ties to the lower index."""

    def __init__(self, n, momentum=MOMENTUM):
        self.u = np.zeros(n, np.float32)
        self.v = np.zeros(n, np.float32)
        self.momentum = np.float32(momentum)

    def step(self, g):
        n = g.size
        self.u = _f32(_f32(self.momentum * self.u) + g)          # momentum correction
        self.v = _f32(self.v + self.u)                           # local accumulation
        k = min(n, max(1, int(np.floor(DENSITY * n + 0.5))))
        mag = np.abs(self.v)
        order = np.lexsort((np.arange(n), -mag.astype(np.float64)))  # larger first, then index
        sel = np.sort(order[:k])
        values = self.v[sel].copy()
        self.v[sel] = 0.0                                        # sent: cleared
        self.u[sel] = 0.0                                        # momentum factor masking
        return sel, values


def _reference(grads):
    """The parameters after every step, from every rank's recorded local gradients."""
    net = _model()
    params = [p.detach().clone() for p in net.parameters()]
    dgc = [[_Dgc(p.numel()) for p in params] for _ in range(WORLD)]
    momentum_buf = [None] * len(params)   # dense tensors: momentum SGD after averaging
    wd_buf = [None] * len(params)         # compressed tensors: momentum on weight decay only
    half = np.float32(1.0 / WORLD)
    out = []
    for step in range(STEPS):
        for i, p in enumerate(params):
            local = [grads[r][step][i].reshape(-1).numpy() for r in range(WORLD)]
            if p.dim() >= 2:
                avg = np.zeros(p.numel(), np.float32)
                for r in range(WORLD):
                    sel, values = dgc[r][i].step(local[r])
                    avg[sel] = _f32(avg[sel] + _f32(half * values))
                d = torch.from_numpy(avg).reshape(p.shape)
                term = p.mul(WD)
                if wd_buf[i] is None:
                    wd_buf[i] = term.clone()
                else:
                    wd_buf[i].mul_(MOMENTUM).add_(term)
                p.add_(d.add(wd_buf[i]), alpha=-LR)
            else:
                total = local[0].copy()
                for r in range(1, WORLD):
                    total = _f32(total + local[r])
                d = torch.from_numpy(_f32(total * half)).reshape(p.shape)
                d = d.add(p, alpha=WD)
                if momentum_buf[i] is None:
                    momentum_buf[i] = d.clone()
                else:
                    momentum_buf[i].mul_(MOMENTUM).add_(d)
                p.add_(momentum_buf[i], alpha=-LR)
        out.append([p.clone() for p in params])
    return out


def _ulps(a, b):
    ia = a.numpy().view(np.int32).astype(np.int64)
    ib = b.numpy().view(np.int32).astype(np.int64)
    return int(np.abs(ia - ib).max()) if ia.size else 0


NAMES = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]


def train_two_ranks(tmp_path_factory, job, sidecar_args, make_optimizer=None, steps=STEPS,
                    codec="dgc"):
    """WORLD sidecars (`codec` with `sidecar_args`) and one _trainer each: returns every rank's
    record (skips when the sidecar cannot run here)."""
    from conftest import Cluster, _serve_available
    ok, reason = _serve_available()
    if not ok:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp(job)
    cl = Cluster(tmp_path_factory, WORLD, codec=codec, codec_args=sidecar_args, peer_timeout=10,
                 job_id=job)
    try:
        cl.start()
        store = tmp / "store"
        store.mkdir()
        failed = H.run_ranks(_trainer, (str(store), [sc.socket for sc in cl.sidecars], str(tmp),
                                        make_optimizer, steps), WORLD, 120)
        if failed:
            pytest.fail("%s; sidecars:\n%s" % (failed, cl.stderr()))
    finally:
        cl.stop()
    runs = [torch.load(str(tmp / ("rank%d.pt" % r))) for r in range(WORLD)]
    for r in range(WORLD):
        assert len(runs[r]["params"]) == steps, "rank %d stopped early" % r
    return runs


def assert_bit_for_bit(runs, want):
    """Every rank's parameters after every step equal each other's and the reference's."""
    for step in range(len(want)):
        for i, name in enumerate(NAMES):
            got0, got1 = runs[0]["params"][step][i], runs[1]["params"][step][i]
            assert torch.equal(got0, got1), "step %d %s: the ranks differ" % (step, name)
            assert torch.equal(got0, want[step][i]), (
                "step %d %s: %d ulp from the reference" % (step, name, _ulps(got0, want[step][i])))


def test_dgc_momentum_per_layer_equals_the_papers_algorithm(tmp_path_factory):
    runs = train_two_ranks(tmp_path_factory, "momentum", SIDECAR_ARGS)
    # The sidecar says which parameters it applies momentum to: the 2-D ones.
    reply = runs[0]["replies"][-1]
    layers = {l["name"]: (l["codec"], l["momentum"]) for l in reply["layers"]}
    assert layers == {"0.weight": ("dgc", MOMENTUM), "0.bias": ("none", 0.0),
                      "1.weight": ("none", 0.0), "1.bias": ("none", 0.0),
                      "3.weight": ("dgc", MOMENTUM), "3.bias": ("none", 0.0)}, layers
    assert runs[0]["momentum"] == [MOMENTUM, 0.0, 0.0, 0.0, MOMENTUM, 0.0]
    assert_bit_for_bit(runs, _reference([run["grads"] for run in runs]))


# codec auto: a rung with momentum correction is taken only where the trainers' optimizers declared
# that they leave momentum to the sidecar; `none@50` makes the dgc rungs win on this loopback.
AUTO_ARGS = ["--auto-ladder", "none@50,dgc:0.1:0.9,dgc:0.1", "--auto-period", "2",
             "--auto-critical-steps", "0", "--auto-critical-change", "1e6", "--warmup-steps",
             "0"] + DGC_ARGS[2:]


def _torch_sgd(params, state):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _auto_layers(run):
    reply = run["replies"][-1]
    return {l["name"]: (l["codec"], l["momentum"]) for l in reply["layers"]}


def test_auto_takes_momentum_correction_only_where_the_optimizer_declares_it(tmp_path_factory):
    # lightwire.torch.SGD declares its momentum (0.9): the layers move to dgc with momentum
    # correction, and the optimizer leaves their momentum to the sidecar.
    runs = train_two_ranks(tmp_path_factory, "auto-declared", AUTO_ARGS, steps=16, codec="auto")
    layers = _auto_layers(runs[0])
    assert layers["0.weight"] == ("dgc", MOMENTUM), layers
    assert layers["3.weight"] == ("dgc", MOMENTUM), layers
    assert runs[0]["momentum"][0] == MOMENTUM
    for step in range(16):
        for a, b in zip(runs[0]["params"][step], runs[1]["params"][step]):
            assert torch.equal(a, b), "step %d: the ranks differ" % step
    # torch.optim.SGD with momentum declares nothing: the same ladder gives error feedback alone
    # (the optimizer keeps momentum), never the rung it would refuse (MomentumConflict).
    runs = train_two_ranks(
        tmp_path_factory, "auto-undeclared", AUTO_ARGS, steps=16, codec="auto",
        make_optimizer=_torch_sgd)
    layers = _auto_layers(runs[0])
    assert layers["0.weight"] == ("dgc", 0.0), layers
    assert layers["3.weight"] == ("dgc", 0.0), layers
    assert all(m == 0.0 for m in runs[0]["momentum"])


def test_the_hook_declares_the_momentum_its_optimizer_takes_back():
    w, b = _params()
    client = lightwire.Client(socket_path="/nonexistent")

    def declared(make):
        s = lwt.LightwireHookState(client=client)
        s._http.shutdown(wait=False)
        s._ordered.shutdown(wait=False)
        opt = make(s)
        if opt is not None and s.optimizer is None:
            s.optimizer = opt
        return s.declared_momentum()

    assert declared(lambda s: None) is None
    assert declared(lambda s: torch.optim.SGD([w, b], lr=0.1, momentum=0.9)) is None
    assert declared(lambda s: lwt.SGD([w, b], lr=0.1, momentum=0.9, hook_state=s)) == 0.9
    assert declared(lambda s: lwt.SGD([w, b], lr=0.1, momentum=0.0, hook_state=s)) is None
    assert declared(lambda s: lwt.SGD([w, b], lr=0.1, momentum=0.9, nesterov=True,
                                      hook_state=s)) is None
    assert declared(lambda s: lwt.SGD([{"params": [w], "momentum": 0.9},
                                       {"params": [b], "momentum": 0.95}], lr=0.1,
                                      hook_state=s)) is None  # no single momentum
    assert declared(lambda s: lwt.SGD([{"params": [w]}, {"params": [b], "weight_decay": 0.0}],
                                      lr=0.1, momentum=0.9, weight_decay=1e-4,
                                      hook_state=s)) == 0.9
    assert declared(lambda s: lwt.AdamW([w, b], lr=1e-3, hook_state=s)) == 0.9
    assert declared(lambda s: lwt.AdamW([w, b], lr=1e-3, precondition=("topk",),
                                        hook_state=s)) is None


# ------------------------------------------------------------------------------------------------
# The optimizer helper alone: its arithmetic, the dense-step rule, and the refusals
# ------------------------------------------------------------------------------------------------
class _Owner(object):
    """A hook state's momentum view: the sidecar applies `m` to the parameters in `owned`."""

    def __init__(self, owned, m):
        self.owned, self.m, self.optimizer = {id(p) for p in owned}, m, None

    def sidecar_momentum(self, p):
        return self.m if id(p) in self.owned else 0.0


def _params():
    torch.manual_seed(5)
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(3))
    return w, b


def test_sgd_without_sidecar_momentum_is_torch_sgd():
    w1, b1 = _params()
    w2, b2 = _params()
    ref = torch.optim.SGD([w1, b1], lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True)
    ours = lwt.SGD([w2, b2], lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True,
                   hook_state=_Owner([], 0.9))
    for s in range(5):
        g = torch.Generator().manual_seed(s)
        gw, gb = torch.randn(4, 3, generator=g), torch.randn(3, generator=g)
        for (w, b), opt in (((w1, b1), ref), ((w2, b2), ours)):
            w.grad, b.grad = gw.clone(), gb.clone()
            opt.step()
        assert torch.equal(w1, w2) and torch.equal(b1, b2), s


def test_sgd_with_sidecar_momentum_keeps_it_on_weight_decay_only():
    """An owned parameter gets its averaged gradient as it is (the sidecar applied momentum) plus
    weight decay with momentum of its own; a step the hook fell back for, or a dense step of the
    sidecar, is applied by the same rule: no momentum of the optimizer's on the gradient."""
    w, b = _params()
    owner = _Owner([w], 0.9)
    opt = lwt.SGD([w, b], lr=0.1, momentum=0.9, weight_decay=0.01, hook_state=owner)
    assert owner.optimizer is opt
    w0, b0 = w.detach().clone(), b.detach().clone()
    wd_buf, mom_buf = None, None
    for s in range(4):
        g = torch.Generator().manual_seed(10 + s)
        gw, gb = torch.randn(4, 3, generator=g), torch.randn(3, generator=g)
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        term = w0.mul(0.01)
        wd_buf = term.clone() if wd_buf is None else wd_buf.mul_(0.9).add_(term)
        w0.add_(gw.add(wd_buf), alpha=-0.1)
        d = gb.add(b0, alpha=0.01)
        mom_buf = d.clone() if mom_buf is None else mom_buf.mul_(0.9).add_(d)
        b0.add_(mom_buf, alpha=-0.1)
        assert torch.equal(w, w0), s
        assert torch.equal(b, b0), s
    assert "momentum_buffer" not in opt.state[w]
    assert "weight_decay_buffer" not in opt.state[b]


def test_sgd_starts_momentum_afresh_when_a_parameter_changes_sides():
    """codec auto moves a layer to a rung with momentum correction and back: while the sidecar
    owns its momentum the optimizer applies none of its own; when it gives it back, the
    optimizer's momentum starts afresh (the velocity before the move means nothing now)."""
    w, _ = _params()
    owner = _Owner([], 0.9)
    opt = lwt.SGD([w], lr=0.1, momentum=0.9, hook_state=owner)
    ones = torch.ones(4, 3)
    for _ in range(3):  # the optimizer's own momentum builds up
        w.grad = ones.clone()
        opt.step()
    assert not torch.equal(opt.state[w]["momentum_buffer"], ones)
    owner.owned = {id(w)}  # the sidecar owns it now: the gradient as it comes
    before = w.detach().clone()
    w.grad = ones.clone()
    opt.step()
    assert torch.equal(w, before - 0.1 * ones)
    assert "momentum_buffer" not in opt.state[w]
    owner.owned = set()  # back with the optimizer: its momentum from zero, not the old velocity
    before = w.detach().clone()
    w.grad = ones.clone()
    opt.step()
    assert torch.equal(w, before - 0.1 * ones)
    assert torch.equal(opt.state[w]["momentum_buffer"], ones)


def test_sgd_refuses_what_the_sidecars_momentum_does_not_define():
    for kw, what in (({"momentum": 0.5}, "momentum=0.9"), ({"nesterov": True}, "nesterov"),
                     ({"dampening": 0.1}, "dampening")):
        w, b = _params()
        args = dict({"momentum": 0.9}, **kw)
        opt = lwt.SGD([w, b], lr=0.1, hook_state=_Owner([w], 0.9), **args)
        w.grad, b.grad = torch.ones(4, 3), torch.ones(3)
        before = w.detach().clone()
        with pytest.raises(lwt.MomentumConflict, match=what):
            opt.step()
        assert torch.equal(w, before)
    with pytest.raises(TypeError, match="hook_state"):
        lwt.SGD(_params(), lr=0.1, hook_state=None)


def _momentum_reply(names, momenta):
    return {"name": "bucket.x", "momentum": momenta[0] if len(set(momenta)) == 1 else None,
            "layers": [{"name": n, "momentum": m} for n, m in zip(names, momenta)]}


def test_the_hook_refuses_momentum_twice_and_undefined_optimizers():
    w, b = _params()
    client = lightwire.Client(socket_path="/nonexistent")
    reply = _momentum_reply(["fc.weight", "fc.bias"], [0.9, 0.0])

    def state_with(optimizer):
        s = lwt.LightwireHookState(client=client, optimizer=optimizer)
        s._http.shutdown(wait=False)
        s._ordered.shutdown(wait=False)
        return s

    # No optimizer declared: refused, naming the layer and the helper.
    with pytest.raises(lwt.MomentumConflict, match="'fc.weight'.*lightwire.torch.SGD"):
        state_with(None)._note_momentum([w, b], reply)
    # torch.optim.SGD with momentum on that parameter: momentum twice.
    with pytest.raises(lwt.MomentumConflict, match="momentum twice"):
        state_with(torch.optim.SGD([w, b], lr=0.1, momentum=0.9))._note_momentum([w, b], reply)
    # Adam: undefined.
    with pytest.raises(lwt.MomentumConflict, match="Adam with it is not defined"):
        state_with(torch.optim.Adam([w, b]))._note_momentum([w, b], reply)
    # Momentum 0 in a torch.optim.SGD: allowed (weight decay and dense layers lose momentum).
    s = state_with(torch.optim.SGD([w, b], lr=0.1))
    s._note_momentum([w, b], reply)
    assert s.sidecar_momentum(w) == 0.9 and s.sidecar_momentum(b) == 0.0
    # lightwire.torch.SGD declares itself; the ownership stays until a reply says otherwise (a
    # fallback step sends no reply).
    s = state_with(None)
    lwt.SGD([w, b], lr=0.1, momentum=0.9, hook_state=s)
    s._note_momentum([w, b], reply)
    assert s.sidecar_momentum(w) == 0.9
    s._note_momentum([w, b], _momentum_reply(["fc.weight", "fc.bias"], [0.0, 0.0]))
    assert s.sidecar_momentum(w) == 0.0
    # Without momentum anywhere nothing is checked.
    state_with(torch.optim.Adam([w, b]))._note_momentum(
        [w, b], _momentum_reply(["fc.weight", "fc.bias"], [0.0, 0.0]))


def test_an_adaptive_optimizer_with_a_selection_codec_is_warned_once(caplog):
    w, b = _params()
    sparse = {"name": "bucket.x", "layers": [
        {"name": "fc.weight", "codec": "dgc", "mode": "compressed"},
        {"name": "fc.bias", "codec": "none", "mode": "compressed"}]}
    dense = {"name": "bucket.x", "layers": [
        {"name": "fc.weight", "codec": "dgc", "mode": "full_sync"},
        {"name": "fc.bias", "codec": "qsgd", "mode": "compressed"}]}
    adam = torch.optim.AdamW([w, b])
    with caplog.at_level("WARNING", logger="lightwire"):
        lwt._warn_adaptive_selection(adam, dense)  # no layer sent sparse: nothing to say
        assert not caplog.records
        lwt._warn_adaptive_selection(adam, sparse)
        lwt._warn_adaptive_selection(adam, sparse)  # once per optimizer
        assert len(caplog.records) == 1
        msg = caplog.records[0].getMessage()
        assert "AdamW" in msg and "fc.weight" in msg and "fc.bias" not in msg
        assert "lightwire.torch.AdamW" in msg and "qsgd or fp16" in msg
        # SGD (momentum or not) is what error feedback is for: no warning.
        lwt._warn_adaptive_selection(torch.optim.SGD([w, b], lr=0.1, momentum=0.9), sparse)
        lwt._warn_adaptive_selection(None, sparse)
        assert len(caplog.records) == 1


def test_a_flat_bucket_reply_covers_every_parameter_of_the_bucket():
    w, b = _params()
    s = lwt.LightwireHookState(client=lightwire.Client(socket_path="/nonexistent"))
    s._http.shutdown(wait=False)
    s._ordered.shutdown(wait=False)
    lwt.SGD([w, b], lr=0.1, momentum=0.9, hook_state=s)
    s._note_momentum([w, b], {"name": "bucket.0", "codec": "dgc", "momentum": 0.9})
    assert s.sidecar_momentum(w) == 0.9 and s.sidecar_momentum(b) == 0.9


# ------------------------------------------------------------------------------------------------
# Per-layer state across DDP's bucket rebuild and a sidecar restart from a checkpoint
# ------------------------------------------------------------------------------------------------
def _single_rank_run(sc, steps, first=0, saved=None, save_at=None):
    """Trains _model() with DDP (one rank), per layer through `sc`, dgc with momentum correction
    and lightwire.torch.SGD, for steps first..steps-1. `saved`: (model, optimizer state) to
    continue from (after lwt.load_state). Returns (parameters after each step, what was saved at
    step `save_at`)."""
    import copy
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = _model()
    if saved is not None:
        net.load_state_dict(saved[0])
    ddp = DDP(net)
    state = lwt.LightwireHookState(client=sc.client(), module=ddp, on_error="raise")
    ddp.register_comm_hook(state, lwt.ddp_comm_hook)
    opt = lwt.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD, hook_state=state)
    if saved is not None:
        opt.load_state_dict(saved[1])
        lwt.load_state(first - 1, hook_state=state)
    params, snapshot = [], None
    try:
        for step in range(first, steps):
            x, y = _batch(0, step)
            opt.zero_grad()
            _loss(ddp, x, y).backward()
            opt.step()
            params.append([p.detach().clone() for p in ddp.parameters()])
            if step == save_at:
                lwt.save_state(step, hook_state=state)
                snapshot = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()))
    finally:
        state.close()
    return params, snapshot


def test_per_layer_state_survives_a_restart_bit_for_bit(sidecar_factory, pg):
    sc = sidecar_factory(codec="dgc", density=DENSITY, extra=DGC_ARGS)
    first, saved = _single_rank_run(sc, STEPS, save_at=4)
    assert saved is not None
    # Per layer, each parameter's state is its own tensor's: named by the parameter, not by the
    # bucket DDP put it in (DDP rebuilds its buckets after the first iteration).
    tensors = {t["name"] for t in sc.client().status()["tensors"]}
    assert tensors == {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"}, tensors
    # A new sidecar process on the same state directory, a new DDP model and optimizer from the
    # trainer's checkpoint: the run continues exactly as the first one did.
    sc.kill()
    sc.start()
    again, _ = _single_rank_run(sc, STEPS, first=5, saved=saved)
    assert len(again) == STEPS - 5
    for k, (a, b) in enumerate(zip(first[5:], again)):
        for i, (pa, pb) in enumerate(zip(a, b)):
            assert torch.equal(pa, pb), "step %d, parameter %d: the continuation differs" % (5 + k, i)
