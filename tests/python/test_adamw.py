"""Adam with sparse codecs (docs/codecs.md "Adam with sparse codecs"): lightwire.torch.AdamW
preconditions, on each rank, the tensors the sidecar sends with an error-feedback codec and sends
what Adam makes of each rank's gradient instead of the gradient. Two real DDP trainers, each with
its own sidecar, per layer, dgc with momentum correction (Adam's β1) and with error feedback alone,
against an independent implementation written here; then the optimizer alone: torch.optim.AdamW's
arithmetic where nothing is preconditioned, the dense-step rule, a codec change, its saved state,
and the refusals."""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lightwire  # noqa: E402
import lightwire.torch as lwt  # noqa: E402
from test_momentum import (DENSITY, WORLD, _Dgc, _f32, _model, assert_bit_for_bit,  # noqa: E402
                           train_two_ranks)

STEPS = 10
LR = 0.01
WD = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8
# dgc, policies off, every 2-D layer compressed; "--momentum" is added per test.
SIDECAR_ARGS = ["--density", str(DENSITY), "--anomaly", "false", "--rollback", "false",
                "--full-sync-every", "0", "--min-magnitude", "0", "--dense-max-elements", "0"]


def _make_adamw(parameters, hook_state):
    return lwt.AdamW(parameters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                     hook_state=hook_state)


class _Moments(object):
    """Adam's moment estimates of one tensor (fp32, torch.optim.AdamW's order of operations)."""

    def __init__(self, like):
        self.m, self.v, self.t = torch.zeros_like(like), torch.zeros_like(like), 0

    def copy(self):
        c = _Moments(self.m)
        c.m, c.v, c.t = self.m.clone(), self.v.clone(), self.t
        return c

    def update(self, g, first=True):
        """Returns (m, denom, bias correction 1) after folding in g (the first moment too, unless
        `first` is False)."""
        b1, b2 = BETAS
        self.t += 1
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (self.v.sqrt() / math.sqrt(1 - b2 ** self.t)).add_(EPS)
        if first:
            self.m.mul_(b1).add_(g, alpha=1 - b1)
        return self.m, denom, 1 - b1 ** self.t


def _sparse_average(dgc, inputs):
    """The mean over the ranks of what each rank's dgc (error feedback, exact selection) sends."""
    half = np.float32(1.0 / WORLD)
    avg = np.zeros(inputs[0].numel(), np.float32)
    for r in range(WORLD):
        sel, values = dgc[r].step(inputs[r].reshape(-1).numpy())
        avg[sel] = _f32(avg[sel] + _f32(half * values))
    return torch.from_numpy(avg).reshape(inputs[0].shape)


def _reference(grads, momentum):
    """The parameters after every step, from every rank's recorded local gradients: step 0 is
    AdamW on the averaged (dgc-sparsified, for the 2-D tensors) gradient -- no reply has named a
    codec yet; from step 1 every 2-D tensor is preconditioned per rank (moments carried on from
    the averaged ones): with dgc's momentum correction (`momentum` = β1) g / (√v̂ + eps) goes
    through dgc and the average is applied times lr·(1 − β1); with error feedback alone (momentum
    0) Adam's update m̂ / (√v̂ + eps) goes through it and the average is applied times lr. The 1-D
    tensors are AdamW on the dense average throughout."""
    net = _model()
    params = [p.detach().clone() for p in net.parameters()]
    dgc = [[_Dgc(p.numel(), momentum=momentum) for p in params] for _ in range(WORLD)]
    shared = [_Moments(p) for p in params]
    local = [[None] * len(params) for _ in range(WORLD)]
    half = np.float32(1.0 / WORLD)
    out = []
    for step in range(STEPS):
        for i, p in enumerate(params):
            g = [grads[r][step][i] for r in range(WORLD)]
            if p.dim() >= 2 and step >= 1:
                updates = []
                for r in range(WORLD):
                    if local[r][i] is None:
                        local[r][i] = shared[i].copy()
                    if momentum > 0:
                        _, denom, _ = local[r][i].update(g[r], first=False)
                        updates.append(g[r].div(denom))
                    else:
                        m, denom, bc1 = local[r][i].update(g[r])
                        updates.append(torch.div(m, denom).div_(bc1))
                p.mul_(1 - LR * WD)
                p.add_(_sparse_average([d[i] for d in dgc], updates),
                       alpha=-LR * (1 - BETAS[0]) if momentum > 0 else -LR)
                continue
            if p.dim() >= 2:
                avg = _sparse_average([d[i] for d in dgc], g)
            else:
                total = g[0].numpy().copy()
                for r in range(1, WORLD):
                    total = _f32(total + g[r].numpy())
                avg = torch.from_numpy(_f32(total * half)).reshape(p.shape)
            p.mul_(1 - LR * WD)
            m, denom, bc1 = shared[i].update(avg)
            p.addcdiv_(m, denom, value=-LR / bc1)
        out.append([p.clone() for p in params])
    return out


@pytest.mark.parametrize("momentum", [BETAS[0], 0.0], ids=["momentum_correction",
                                                        "error_feedback"])
def test_adamw_per_layer_equals_adam_preconditioned_before_the_exchange(tmp_path_factory,
                                                                       momentum):
    runs = train_two_ranks(tmp_path_factory, "adamw", SIDECAR_ARGS + ["--momentum", str(momentum)],
                           _make_adamw, STEPS)
    layers = {l["name"]: (l["codec"], l["momentum"]) for l in runs[0]["replies"][-1]["layers"]}
    assert layers == {"0.weight": ("dgc", momentum), "0.bias": ("none", 0.0),
                      "1.weight": ("none", 0.0), "1.bias": ("none", 0.0),
                      "3.weight": ("dgc", momentum), "3.bias": ("none", 0.0)}, layers
    assert_bit_for_bit(runs, _reference([run["grads"] for run in runs], momentum))


# ------------------------------------------------------------------------------------------------
# The optimizer alone
# ------------------------------------------------------------------------------------------------
class _Codecs(object):
    """A hook state's codec view: the sidecar sends the parameters in `sparse` with dgc, applying
    momentum `momentum` to them."""

    def __init__(self, sparse, momentum=0.0):
        self.sparse, self.momentum, self.optimizer = {id(p) for p in sparse}, momentum, None

    def sidecar_codec(self, p):
        return "dgc" if id(p) in self.sparse else "none"

    def sidecar_momentum(self, p):
        return self.momentum if id(p) in self.sparse else 0.0


def _params():
    torch.manual_seed(7)
    return torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(4))


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 4, generator=g), torch.randn(4, generator=g)


def _hook_then_step(opt, params, grads):
    """What the hook and DDP do for one rank alone: precondition the flat bucket, write the
    (here: unaveraged) result into the gradients, step."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    opt._precondition_bucket(params, flat)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view(p.shape).clone()
        offset += p.numel()
    opt.step()
    return flat


def test_adamw_without_preconditioned_tensors_is_torch_adamw():
    w1, b1 = _params()
    w2, b2 = _params()
    ref = torch.optim.AdamW([w1, b1], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ours = _make_adamw([w2, b2], _Codecs([]))
    for s in range(6):
        gw, gb = _grads(s)
        w1.grad, b1.grad = gw.clone(), gb.clone()
        ref.step()
        _hook_then_step(ours, [w2, b2], [gw, gb])
        assert torch.equal(w1, w2) and torch.equal(b1, b2), s


def test_adamw_sends_the_update_and_applies_the_average_as_it_comes():
    """A preconditioned tensor: the bucket carries m̂/(√v̂ + eps) of the rank's own gradient (its
    moments carried on from the averaged ones it was stepped with before), and step applies what
    comes back, with decoupled weight decay -- a dense step or the hook's fallback (the average of
    the updates) by the same rule. The other tensor stays torch.optim.AdamW."""
    w, b = _params()
    codecs = _Codecs([])
    opt = _make_adamw([w, b], codecs)
    assert codecs.optimizer is opt
    w_ref, b_ref = _params()
    ref = torch.optim.AdamW([w_ref, b_ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    gw, gb = _grads(0)  # the first step: no reply has named a codec yet
    _hook_then_step(opt, [w, b], [gw, gb])
    w_ref.grad, b_ref.grad = gw.clone(), gb.clone()
    ref.step()
    moments = _Moments(w)
    moments.m, moments.v, moments.t = (ref.state[w_ref]["exp_avg"].clone(),
                                       ref.state[w_ref]["exp_avg_sq"].clone(), 1)
    codecs.sparse = {id(w)}  # the reply of step 0 named w's codec: dgc
    for s in range(1, 5):
        gw, gb = _grads(s)
        before = w.detach().clone()
        flat = _hook_then_step(opt, [w, b], [gw, gb])
        m, denom, bc1 = moments.update(gw)
        update = torch.div(m, denom).div_(bc1)
        assert torch.equal(flat[:20].view(5, 4), update), s
        assert torch.equal(flat[20:], gb), s  # the dense tensor's gradient goes as it is
        assert torch.equal(w, before.mul(1 - LR * WD).add(update, alpha=-LR)), s
        b_ref.grad = gb.clone()
        ref.step()
        assert torch.equal(b, b_ref), s
    # The averaged update (a fallback allreduce, or a dense step) is applied by the same rule.
    gw, gb = _grads(9)
    flat = torch.cat([gw.reshape(-1), gb])
    opt._precondition_bucket([w, b], flat)
    other = torch.full((5, 4), 0.25)
    w.grad, b.grad = (flat[:20].view(5, 4) + other) / 2, flat[20:].clone()
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w, before.mul(1 - LR * WD).add((flat[:20].view(5, 4) + other) / 2,
                                                      alpha=-LR))


def test_adamw_with_the_sidecars_momentum_sends_the_scaled_gradient():
    """Where the sidecar applies momentum β1 (dgc's momentum correction), a rank sends
    g / (√v̂ + eps) with its own second moment, and step applies the average times lr·(1 − β1)."""
    w, b = _params()
    codecs = _Codecs([w], momentum=BETAS[0])
    opt = _make_adamw([w, b], codecs)
    moments = _Moments(w)
    for s in range(4):
        gw, gb = _grads(s)
        before = w.detach().clone()
        flat = _hook_then_step(opt, [w, b], [gw, gb])
        _, denom, _ = moments.update(gw, first=False)
        assert torch.equal(flat[:20].view(5, 4), gw.div(denom)), s
        assert torch.equal(w, before.mul(1 - LR * WD).add(gw.div(denom),
                                                          alpha=-LR * (1 - BETAS[0]))), s
    assert "local_exp_avg" not in opt.state[w]  # the first moment is the sidecar's
    codecs.momentum = 0.0  # the sidecar's momentum went (PUT /v1/config): Adam's moments afresh
    gw, gb = _grads(7)
    flat = _hook_then_step(opt, [w, b], [gw, gb])
    fresh = _Moments(w)
    m, denom, bc1 = fresh.update(gw)
    assert torch.equal(flat[:20].view(5, 4), torch.div(m, denom).div_(bc1))


def test_adamw_restarts_the_moments_of_a_tensor_no_longer_preconditioned():
    w, b = _params()
    codecs = _Codecs([w])
    opt = _make_adamw([w, b], codecs)
    for s in range(3):
        _hook_then_step(opt, [w, b], list(_grads(s)))
    assert opt.state[w]["step"].item() == 3 and "exp_avg" not in opt.state[w]
    codecs.sparse = set()  # its codec changed (PUT /v1/config): AdamW afresh, alike on every rank
    w_ref = torch.nn.Parameter(w.detach().clone())
    ref = torch.optim.AdamW([w_ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for s in range(3, 6):
        gw, gb = _grads(s)
        _hook_then_step(opt, [w, b], [gw, gb])
        w_ref.grad = gw.clone()
        ref.step()
        assert torch.equal(w, w_ref), s
    assert "local_exp_avg" not in opt.state[w]


def test_adamw_steps_a_direct_window_as_torch_adamw_with_its_moments_carried_on():
    """codec auto's direct window: the process group averages the bucket as it is (no
    preconditioning), and AdamW steps those parameters as torch.optim.AdamW from the moments it
    had; back with the sidecar it preconditions from them again."""
    w, b = _params()
    codecs = _Codecs([w])
    opt = _make_adamw([w, b], codecs)
    for s in range(3):
        _hook_then_step(opt, [w, b], list(_grads(s)))
    m = opt.state[w]["local_exp_avg"].view(5, 4).clone()
    v = opt.state[w]["local_exp_avg_sq"].view(5, 4).clone()
    # torch.optim.AdamW from the same parameter, moments and step count.
    w_ref = torch.nn.Parameter(w.detach().clone())
    ref = torch.optim.AdamW([w_ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ref.state[w_ref] = {"step": opt.state[w]["step"].clone(), "exp_avg": m.clone(),
                        "exp_avg_sq": v.clone()}
    for s in range(3, 5):  # two steps of a direct window: the hook calls _dense_bucket
        gw, gb = _grads(s)
        opt._dense_bucket([w, b])
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()  # no "did not pass through the hook" refusal
        w_ref.grad = gw.clone()
        ref.step()
        assert torch.equal(w, w_ref), s
    # Back with the sidecar (dgc): preconditioned from the moments of the window.
    gw, gb = _grads(5)
    expect = _Moments(w)
    expect.m = ref.state[w_ref]["exp_avg"].clone()
    expect.v = ref.state[w_ref]["exp_avg_sq"].clone()
    expect.t = int(ref.state[w_ref]["step"].item())
    flat = _hook_then_step(opt, [w, b], [gw, gb])
    mm, denom, bc1 = expect.update(gw)
    assert torch.equal(flat[:20].view(5, 4), torch.div(mm, denom).div_(bc1))


def test_adamw_refuses_what_it_does_not_define():
    w, b = _params()
    with pytest.raises(TypeError, match="hook_state"):
        lwt.AdamW([w, b], hook_state=None)
    for kw in ({"amsgrad": True}, {"maximize": True}):
        with pytest.raises(ValueError, match=list(kw)[0]):
            lwt.AdamW([w, b], hook_state=_Codecs([]), **kw)
    # A preconditioned tensor whose gradient this step did not pass through the hook.
    codecs = _Codecs([w])
    opt = _make_adamw([w, b], codecs)
    _hook_then_step(opt, [w, b], list(_grads(0)))
    w.grad = torch.ones(5, 4)
    with pytest.raises(RuntimeError, match="did not pass through the hook"):
        opt.step()
    # dgc's momentum correction: defined where it is Adam's β1 on a preconditioned codec.
    s = lwt.LightwireHookState(client=lightwire.Client(socket_path="/nonexistent"))
    s._http.shutdown(wait=False)
    s._ordered.shutdown(wait=False)
    opt = _make_adamw([w, b], s)

    def reply(m):
        return {"name": "bucket.x", "layers": [
            {"name": "fc.weight", "codec": "dgc", "momentum": m},
            {"name": "fc.bias", "codec": "none", "momentum": 0.0}]}
    s._note_momentum([w, b], reply(BETAS[0]))
    with pytest.raises(lwt.MomentumConflict, match=r"betas\[0\] = 0.5 \(got 0.9\)"):
        s._note_momentum([w, b], reply(0.5))
    opt.precondition_codecs = frozenset(["topk"])
    s._momentum_checked.clear()
    with pytest.raises(lwt.MomentumConflict, match="does not precondition its codec 'dgc'"):
        s._note_momentum([w, b], reply(BETAS[0]))


def test_the_hook_learns_each_parameters_codec_and_adamw_is_not_warned(caplog):
    w, b = _params()
    s = lwt.LightwireHookState(client=lightwire.Client(socket_path="/nonexistent"))
    s._http.shutdown(wait=False)
    s._ordered.shutdown(wait=False)
    opt = _make_adamw([w, b], s)
    assert s.sidecar_codec(w) is None
    reply = {"name": "bucket.x", "layers": [
        {"name": "fc.weight", "codec": "dgc", "mode": "compressed", "momentum": 0.0},
        {"name": "fc.bias", "codec": "none", "mode": "compressed", "momentum": 0.0}]}
    s._note_momentum([w, b], reply)
    assert s.sidecar_codec(w) == "dgc" and s.sidecar_codec(b) == "none"
    with caplog.at_level("WARNING", logger="lightwire"):
        lwt._warn_adaptive_selection(opt, reply)
        assert not caplog.records
        # A codec it is told not to precondition is warned about as for any Adam.
        opt.precondition_codecs = frozenset(["powersgd"])
        lwt._warn_adaptive_selection(opt, reply)
        assert len(caplog.records) == 1
    # A flat bucket's codec covers every parameter of the bucket.
    s._note_momentum([w, b], {"name": "bucket.0", "codec": "topk", "momentum": 0.0})
    assert s.sidecar_codec(w) == "topk" and s.sidecar_codec(b) == "topk"


@pytest.mark.parametrize("momentum", [BETAS[0], 0.0], ids=["momentum_correction",
                                                        "error_feedback"])
def test_adamw_continues_bit_for_bit_from_its_state_dict(momentum):
    """The per-rank moments and the layer's mode belong to the optimizer's state: a trainer
    restarted from torch.save(opt.state_dict()) continues exactly."""
    w, b = _params()
    opt = _make_adamw([w, b], _Codecs([w], momentum=momentum))
    for s in range(3):
        _hook_then_step(opt, [w, b], list(_grads(s)))
    saved = copy.deepcopy(opt.state_dict())
    w2 = torch.nn.Parameter(w.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = _make_adamw([w2, b2], _Codecs([w2], momentum=momentum))
    opt2.load_state_dict(saved)
    for s in range(3, 6):
        _hook_then_step(opt, [w, b], list(_grads(s)))
        _hook_then_step(opt2, [w2, b2], list(_grads(s)))
        assert torch.equal(w, w2) and torch.equal(b, b2), s
