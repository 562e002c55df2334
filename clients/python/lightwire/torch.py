"""PyTorch DDP communication hook that averages gradient buckets through the sidecar.

    import lightwire.torch as lwt
    state = lwt.LightwireHookState(module=ddp_model)
    ddp_model.register_comm_hook(state, lwt.ddp_comm_hook)

Per layer (``module`` given; docs/api.md "Layouts: one tensor per layer"): each bucket goes with
its layout -- every parameter's name (from the module's named parameters), element offset and
shape -- so the sidecar compresses every parameter as a tensor of its own: its own codec (rules
match parameter names and sizes), its own codec state and selection. The bucket is named by a
hash of its parameters' names (``{name_prefix}.{16 hex digits}``): DDP rebuilds its buckets after
the first iteration, so a bucket's index does not name the same parameters throughout. Every
tensor's step number is the training iteration. ``per_layer=False`` sends each bucket as one flat
tensor named ``{name_prefix}.{bucket index}``.

Each CPU bucket goes over the shared-memory path (docs/api.md, Form 2): the flattened gradient is
copied once into a segment registered with the sidecar, the sidecar writes the mean over all
trainers back in place, and the hook's future resolves to a tensor viewing that segment (DDP
copies it into the parameters' gradients; the hook copies nothing back).

Each CUDA bucket goes over CUDA IPC (docs/cuda.md): it is copied (device to device) into a tensor
of its own, registered once with the sidecar through PyTorch's IPC export, an interprocess event
is recorded after the copy, and the sidecar writes the mean in place before it replies. When the
sidecar has no CUDA driver (409 failed_precondition), CUDA buckets go through host shared memory
instead, for the rest of the run.

Failures (docs/api.md "When the sidecar fails, the trainer goes on"): with ``on_error="fallback"``
(default) a failed step (an error reply, a timeout or an unreachable sidecar) is logged, counted in
``state.fallbacks``, reported to the sidecar (``/v1/report``) when it can be reached, and the bucket
is averaged by the process group's own allreduce instead (as PyTorch's ``allreduce_hook``); the next
call tries the sidecar again. With ``on_error="raise"`` the future carries the exception.

Durable state (docs/policies.md "Durable state: checkpoints"): the sidecars' codec state (residuals,
momentum) and policy state belong with the trainer's own checkpoint. ``save_state(step)`` next to
``torch.save`` and ``load_state(step)`` next to ``torch.load`` keep them together:

    if rank == 0:
        torch.save({"model": ..., "optim": ..., "step": step}, path)
        lwt.save_state(step, hook_state=state)      # every sidecar saves its state after `step`
    ...
    ckpt = torch.load(path)                         # after a restart, on every rank
    lwt.load_state(ckpt["step"], hook_state=state)  # every rank, each on its own sidecar

Every rank must fall back at the same step, or the fallback allreduce waits for ranks that never
join it. A step fails on the sidecar for all its trainers together (they all get the same 5xx
reply, e.g. 503 while it stops or 504 when a trainer is missing), so they fall back together. A
rank that cannot reach the sidecar at all (its socket is gone, a connection fails) while the
others got their replies falls back alone: its allreduce then waits for the process group's
timeout. With one sidecar per node this happens only if the sidecar dies between its replies to
two local trainers of the same step.
"""

import concurrent.futures
import hashlib
import logging
import math
import os
import threading
import time

import torch
import torch.distributed as dist

from ._errors import LightwireError, SidecarUnavailable
from ._shm import ShmSegment
from .client import Client, LayoutHashes

log = logging.getLogger("lightwire.torch")

# Hook states made per name_prefix in this process: the k-th one's stream (see LightwireHookState).
_streams_made = {}
_streams_lock = threading.Lock()

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# Characters a tensor name may hold as they are (docs/api.md); ':' is the escape character.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-")


def tensor_name(parameter_name):
    """The tensor name of a parameter: its name with every byte outside ``A-Z a-z 0-9 _ . / -``
    (':' included) written as ``:`` and two lower-case hex digits. Deterministic and one-to-one,
    and the identity for the names PyTorch modules give (``layers.0.weight``)."""
    out = []
    for b in parameter_name.encode("utf-8"):
        c = chr(b)
        out.append(c if c in _NAME_CHARS else ":%02x" % b)
    return "".join(out)


def _parameter_names(module):
    """id(parameter) -> tensor name, from the module's named parameters (a DDP wrapper's inner
    module: no ``module.`` prefix). Tied parameters appear once, under their first name."""
    inner = getattr(module, "module", None)
    if isinstance(module, torch.nn.parallel.DistributedDataParallel) and inner is not None:
        module = inner
    return {id(p): tensor_name(n) for n, p in module.named_parameters()}


class MomentumConflict(LightwireError):
    """The optimizer would apply momentum to a gradient the sidecar already applied it to (dgc's
    momentum correction), or combine it with the sidecar's momentum in a way nothing defines.
    Raised by the hook's future (never turned into a fallback) and by ``SGD.step``."""

    def __init__(self, message):
        super().__init__(None, "momentum_conflict", message)


_DENSE_MODES = ("bypass", "full_sync", "dense")


def _dense_elements(reply):
    """(elements, elements exchanged dense) of a bucket's reply: a layer (or a flat bucket) is
    dense when its codec is `none` or its step's mode is a dense one."""
    if not isinstance(reply, dict):
        return 0, 0
    parts = reply.get("layers") or [reply]
    total = dense = 0
    for p in parts:
        n = int(p.get("elements", 0) or 0)
        total += n
        if p.get("codec") == "none" or p.get("mode") in _DENSE_MODES:
            dense += n
    return total, dense


def _group_of(optimizer, parameter):
    for group in optimizer.param_groups:
        if any(q is parameter for q in group["params"]):
            return group
    return None


_warned_zero_momentum = set()


def _check_optimizer(optimizer, parameter, momentum, name):
    """Refuses (MomentumConflict) an optimizer that would apply momentum again to ``parameter``,
    whose gradient the sidecar returns with momentum ``momentum`` already applied."""
    what = "the sidecar applies momentum %g to %s (dgc momentum correction)" % (
        momentum, "layer %r" % name if name else "this bucket")
    if isinstance(optimizer, SGD):
        return  # its step() reads the sidecar's momentum per parameter
    if optimizer is None:
        raise MomentumConflict(
            "%s, so the optimizer must not apply momentum to it again: build it with "
            "lightwire.torch.SGD(params, lr, momentum=%g, hook_state=state), or declare yours with "
            "LightwireHookState(optimizer=...) so that the hook can check it" % (what, momentum))
    group = _group_of(optimizer, parameter)
    if group is None:
        return  # not this optimizer's parameter
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("momentum", 0) != 0:
            raise MomentumConflict(
                "%s and the optimizer (torch.optim.SGD, momentum %g) applies momentum again: "
                "momentum twice. Use lightwire.torch.SGD(params, lr, momentum=%g, "
                "hook_state=state): momentum stays with the optimizer exactly where the sidecar "
                "does not apply it" % (what, group["momentum"], momentum))
        key = id(optimizer)
        if key not in _warned_zero_momentum:
            _warned_zero_momentum.add(key)
            log.warning("lightwire: %s; the optimizer (torch.optim.SGD, momentum 0) then gives "
                        "weight decay and the densely exchanged layers no momentum at all: "
                        "lightwire.torch.SGD keeps it there", what)
        return
    if isinstance(optimizer, AdamW):
        optimizer._check_sidecar_momentum(parameter, momentum, what)
        return  # its step reads the sidecar's momentum per parameter
    raise MomentumConflict(
        "%s; %s with it is not defined (it would apply its own moment estimates to gradients the "
        "sidecar applied momentum to). Use lightwire.torch.SGD, or with Adam "
        "lightwire.torch.AdamW (docs/codecs.md \"Adam with sparse codecs\")"
        % (what, type(optimizer).__name__))


# The codecs that send a selection of the elements, with error feedback.
_SELECTION_CODECS = ("topk", "dgc", "threshold", "randomk")
_warned_adaptive = set()


def _warn_adaptive_selection(optimizer, reply):
    """Warns once per optimizer when an optimizer other than SGD (Adam and the like) gets a
    result a selection codec made: error feedback keeps the sum of the updates only for a
    linear optimizer, and Adam's normalisation shrinks the accumulated spikes (docs/codecs.md
    "Choosing"; measured: 37 % behind DDP's loss on a transformer)."""
    if optimizer is None or isinstance(optimizer, torch.optim.SGD) or id(optimizer) in \
            _warned_adaptive or not isinstance(reply, dict):
        return
    # lightwire.torch.AdamW sends the preconditioned update of the codecs it names.
    covered = optimizer.precondition_codecs if isinstance(optimizer, AdamW) else ()
    sparse = [p.get("name") for p in (reply.get("layers") or [reply])
              if isinstance(p, dict) and p.get("codec") in _SELECTION_CODECS
              and p.get("codec") not in covered and p.get("mode") not in _DENSE_MODES]
    if not sparse:
        return
    _warned_adaptive.add(id(optimizer))
    log.warning("lightwire: %s trains layers the sidecar sends with a selection codec (%s%s): "
                "under an adaptive optimizer sparse codecs with error feedback train far slower "
                "than the same gradients dense; use lightwire.torch.AdamW, which sends the "
                "preconditioned update instead, or qsgd or fp16 for them (docs/codecs.md \"Adam "
                "with sparse codecs\")", type(optimizer).__name__,
                ", ".join(map(str, sparse[:3])), ", ..." if len(sparse) > 3 else "")


def _closure_loss(closure):
    """An optimizer step's closure, evaluated with gradients on (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SGD(torch.optim.SGD):
    """Momentum SGD that shares momentum with the sidecar the way Deep Gradient Compression does
    (docs/codecs.md "Momentum with dgc"):

    - a parameter whose gradient the sidecar returns with momentum applied (dgc with momentum
      correction; ``hook_state.sidecar_momentum(p) > 0``) gets that gradient as it is, plus the
      weight-decay term ``weight_decay * p`` with momentum of its own (buffer
      ``weight_decay_buffer``);
    - every other parameter (densely exchanged layers, other codecs) gets plain momentum SGD,
      exactly as ``torch.optim.SGD`` computes it (buffer ``momentum_buffer``).

    ``hook_state``: the ``LightwireHookState`` of the model's hook; the optimizer declares itself
    there. ``momentum`` must equal the sidecar's dgc momentum for the parameters it applies it to,
    and those take neither ``nesterov`` nor ``dampening`` (the sidecar's momentum correction is
    heavy-ball momentum): ``step`` raises MomentumConflict otherwise. A step the hook fell back for
    (the process group's allreduce averaged the bucket) or a dense step of the sidecar (bypass,
    full sync, PowerSGD before its start step) is applied by the same rule: the parameter's
    gradient as averaged, no momentum of the optimizer's on it. When a parameter moves from one
    side to the other (``codec: auto`` switching its layer to or from a rung with momentum
    correction), its momentum starts afresh there.
    """

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 *, hook_state):
        if hook_state is None or not hasattr(hook_state, "sidecar_momentum"):
            raise TypeError("lightwire.torch.SGD needs hook_state= (the model's LightwireHookState)")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)
        self.hook_state = hook_state
        hook_state.optimizer = self

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, m = group["lr"], group["momentum"]
            damp, wd, nesterov = group["dampening"], group["weight_decay"], group["nesterov"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                owned = self.hook_state.sidecar_momentum(p)
                state = self.state[p]
                d_p = p.grad
                # codec auto moves a layer between a rung whose sidecar owns its momentum and
                # others: the velocity of one side means nothing to the other, so momentum starts
                # afresh on the side it moves to (docs/policies.md "What a switch does").
                if state.get("sidecar_owned", owned > 0) != (owned > 0):
                    state.pop("momentum_buffer", None)
                    state.pop("weight_decay_buffer", None)
                state["sidecar_owned"] = owned > 0
                if owned > 0:
                    if owned != m or nesterov or damp != 0:
                        raise MomentumConflict(
                            "the sidecar applies momentum %g to a parameter of shape %s; "
                            "lightwire.torch.SGD then needs momentum=%g (got %g), no nesterov and "
                            "dampening 0 (got %s, %g)" % (owned, list(p.shape), owned, m,
                                                         nesterov, damp))
                    if wd != 0:
                        term = p.mul(wd)
                        buf = state.get("weight_decay_buffer")
                        if buf is None:
                            buf = state["weight_decay_buffer"] = torch.clone(term).detach()
                        else:
                            buf.mul_(m).add_(term)
                        d_p = d_p.add(buf)
                    p.add_(d_p, alpha=-lr)
                    continue
                # torch.optim.SGD's own arithmetic (single-tensor), so that a model without
                # sidecar momentum trains exactly as with it.
                if wd != 0:
                    d_p = d_p.add(p, alpha=wd)
                if m != 0:
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = torch.clone(d_p).detach()
                    else:
                        buf.mul_(m).add_(d_p, alpha=1 - damp)
                    d_p = d_p.add(buf, alpha=m) if nesterov else buf
                p.add_(d_p, alpha=-lr)
        return loss


# The codecs whose tensors lightwire.torch.AdamW preconditions on each rank before the exchange:
# the ones that send a selection of a tensor's elements each step and keep the rest in error
# feedback (docs/codecs.md "Adam with sparse codecs"). Not powersgd: Adam's normalised update is
# far from low-rank, and preconditioned PowerSGD trained worse than on the gradient (measured).
PRECONDITIONED_CODECS = ("topk", "dgc", "threshold", "randomk")

# What lightwire.torch.AdamW sent for a layer (its state's "local_mode" and "update_sent"): Adam's
# whole update, or the scaled gradient the sidecar's momentum accumulates. Numbers, not strings:
# torch's Optimizer.load_state_dict rebuilds every iterable in the state, strings included.
_UPDATE, _CORRECTED = 1, 2


class AdamW(torch.optim.AdamW):
    """AdamW that sends what Adam makes of each rank's gradient, not the gradient, through the
    sidecar's error-feedback codecs (docs/codecs.md "Adam with sparse codecs").

    Error feedback keeps the sum of what a tensor sends equal to the sum of its inputs; that is the
    sum of the updates only when the update is linear in the input. Adam's is not (it divides by
    the root of the second moment), so a sparse codec applied to Adam's *gradient* releases each
    element's accumulated gradient as one spike that Adam then shrinks. This optimizer moves the
    preconditioning in front of the exchange for the tensors the sidecar sends with a codec of
    ``precondition`` (default ``PRECONDITIONED_CODECS``), as the reply of the step before named it.
    In the hook, before the bucket is sent, each rank updates Adam's second moment of *its own*
    gradient, ``v ← β2·v + (1−β2)·g²`` (bias-corrected: ``v̂``), and

    - where the sidecar applies momentum (dgc's momentum correction, ``momentum`` = ``betas[0]``)
      sends ``g / (√v̂ + eps)``: the sidecar accumulates it with momentum and sends the largest
      accumulated elements, as Deep Gradient Compression does for SGD; ``step`` applies the
      average ``ū`` as ``p ← p·(1 − lr·wd) − lr·(1 − β1)·ū``;
    - elsewhere (error feedback alone: ``topk``, ``dgc`` with momentum 0, ...) also
      updates the first moment, ``m ← β1·m + (1−β1)·g``, and sends Adam's update
      ``m̂ / (√v̂ + eps)``; ``step`` applies the average as ``p ← p·(1 − lr·wd) − lr·ū``.

    Every other parameter (the densely exchanged layers, the tensors of other codecs, and every
    tensor on the first step, before a reply named its codec) is stepped exactly as
    ``torch.optim.AdamW`` steps it, on the averaged gradient. A tensor that begins to be
    preconditioned carries on from the moments it was stepped with so far; one whose treatment
    changes again (its codec or momentum changed) starts Adam's moments afresh, the same on every
    rank. Dense steps of a preconditioned tensor (bypass, full sync, PowerSGD before its start
    step, the hook's fallback allreduce) average what the ranks sent exactly, and ``step`` applies
    it by the same rule.

    ``hook_state``: the ``LightwireHookState`` of the model's hook; the optimizer declares itself
    there and the hook calls it for every bucket. One backward pass per ``step`` (accumulate with
    DDP's ``no_sync``). ``amsgrad`` and ``maximize`` are refused (not defined for a preconditioned
    tensor); Adam without weight decay is this with ``weight_decay=0``. Where the sidecar applies
    momentum, it must equal ``betas[0]`` (``MomentumConflict`` otherwise).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, hook_state, precondition=PRECONDITIONED_CODECS,
                 maximize=False):
        if hook_state is None or not hasattr(hook_state, "sidecar_codec"):
            raise TypeError("lightwire.torch.AdamW needs hook_state= (the model's "
                            "LightwireHookState)")
        if amsgrad or maximize:
            raise ValueError("lightwire.torch.AdamW: %s is not defined for a tensor preconditioned "
                             "before the exchange; use torch.optim.AdamW with a dense codec"
                             % ("amsgrad" if amsgrad else "maximize"))
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False)
        self.hook_state = hook_state
        self.precondition_codecs = frozenset(precondition)
        hook_state.optimizer = self

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._groups = None  # id(parameter) -> its group, rebuilt on the next lookup

    def __setstate__(self, state):  # load_state_dict replaces the groups
        super().__setstate__(state)
        self._groups = None

    def _group_of(self, parameter):
        if self._groups is None:
            self._groups = {id(q): g for g in self.param_groups for q in g["params"]}
        return self._groups.get(id(parameter))

    def _check_sidecar_momentum(self, parameter, momentum, what):
        """Raises MomentumConflict unless this optimizer defines the sidecar's ``momentum`` on
        ``parameter`` (``what`` says where it comes from)."""
        group = self._group_of(parameter)
        if group is None:
            return
        if self.hook_state.sidecar_codec(parameter) not in self.precondition_codecs:
            raise MomentumConflict(
                "%s, and lightwire.torch.AdamW does not precondition its codec %r "
                "(precondition=%s): Adam's moments on a gradient that carries momentum are "
                "defined nowhere" % (what, self.hook_state.sidecar_codec(parameter),
                                     sorted(self.precondition_codecs)))
        if group["betas"][0] != momentum:
            raise MomentumConflict(
                "%s; lightwire.torch.AdamW then needs betas[0] = %g (got %g): the sidecar's "
                "momentum is Adam's first moment there" % (what, momentum, group["betas"][0]))

    @torch.no_grad()
    def _precondition_bucket(self, params, flat):
        """Called by the hook with a bucket's parameters and its flat gradient (in their order,
        back to back): replaces the gradient of every parameter to precondition by what Adam
        makes of it (see the class)."""
        offset = 0
        for p in params:
            n = p.numel()
            g = flat[offset:offset + n]
            offset += n
            group = self._group_of(p)
            if group is None:
                continue
            state = self.state[p]
            if self.hook_state.sidecar_codec(p) not in self.precondition_codecs:
                if "local_exp_avg_sq" in state:
                    del self.state[p]  # no longer preconditioned: Adam afresh, alike on every rank
                continue
            # The sidecar's momentum was checked against betas[0] on the reply that named it.
            mode = _CORRECTED if self.hook_state.sidecar_momentum(p) > 0 else _UPDATE
            if state.get("local_mode", mode) != mode:
                del self.state[p]  # the sidecar's momentum came or went: afresh
                state = self.state[p]
            self._precondition(state, g, group, mode)

    def _dense_bucket(self, params):
        """Called by the hook for a bucket averaged as it is this step (a direct window of codec
        auto): a parameter preconditioned until now steps as torch.optim.AdamW from here, its
        moments carried on (the first moment is the sidecar's where it applied momentum: zeros
        then); preconditioning takes them back when the layer returns to a selection codec."""
        for p in params:
            state = self.state.get(p)
            if not state or "local_exp_avg_sq" not in state:
                continue
            first = state.pop("local_exp_avg", None)
            state["exp_avg"] = (first.view_as(p) if first is not None
                                else torch.zeros_like(p, memory_format=torch.preserve_format))
            state["exp_avg_sq"] = state.pop("local_exp_avg_sq").view_as(p)
            state.pop("local_mode", None)
            state.pop("update_sent", None)

    def _precondition(self, state, g, group, mode):
        beta1, beta2 = group["betas"]
        if "local_exp_avg_sq" not in state:
            # torch.optim.AdamW's "step" (a tensor) stays: its load_state_dict reads it from
            # every parameter's state.
            if "exp_avg" in state:  # stepped on the average until now: its moments carry on
                state["local_exp_avg"] = state.pop("exp_avg").view(-1)
                state["local_exp_avg_sq"] = state.pop("exp_avg_sq").view(-1)
            else:
                state["local_exp_avg"] = torch.zeros_like(g)
                state["local_exp_avg_sq"] = torch.zeros_like(g)
                state["step"] = torch.tensor(0.0)
            state["local_mode"] = mode
            if mode == _CORRECTED:
                del state["local_exp_avg"]  # the sidecar keeps the first moment
        v = state["local_exp_avg_sq"]
        state["step"] += 1
        step = state["step"].item()
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        if mode == _CORRECTED:
            g.div_(denom)
        else:
            m = state["local_exp_avg"]
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            torch.div(m, denom, out=g)
            g.div_(1 - beta1 ** step)
        state["update_sent"] = mode

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        held = []
        try:
            for group in self.param_groups:
                lr, wd, beta1 = group["lr"], group["weight_decay"], group["betas"][0]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    sent = state.pop("update_sent", None)
                    if sent is None:
                        if "local_exp_avg_sq" in state:
                            raise RuntimeError(
                                "lightwire.torch.AdamW: a parameter of shape %s preconditioned "
                                "before has a gradient that did not pass through the hook this "
                                "step (one backward pass through the DDP hook per step; "
                                "accumulate with no_sync)" % list(p.shape))
                        continue
                    # What the ranks sent, averaged: applied as it comes.
                    p.mul_(1 - lr * wd)
                    p.add_(p.grad, alpha=-lr * (1 - beta1) if sent == _CORRECTED else -lr)
                    held.append((p, p.grad))
                    p.grad = None
            super().step()  # every other parameter: torch.optim.AdamW's own arithmetic
        finally:
            for p, g in held:
                p.grad = g
        return loss


class _Slot(object):
    """One bucket index's shared-memory segment and the tensor viewing it."""

    __slots__ = ("segment", "view", "dtype", "numel")

    def __init__(self, numel, dtype):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.segment = ShmSegment(nbytes)
        self.dtype = dtype
        self.numel = numel
        self.view = torch.frombuffer(self.segment.buf, dtype=dtype, count=numel)


class _CudaSlot(object):
    """One CUDA bucket index's device tensor, registered with the sidecar through CUDA IPC, and
    the interprocess event recorded after each copy into it (the sidecar orders its reads after
    it). The sidecar writes the mean back in place before it replies."""

    __slots__ = ("view", "dtype", "numel", "event", "buffer_id", "device")

    def __init__(self, numel, dtype, device):
        self.view = torch.empty(numel, dtype=dtype, device=device)
        self.dtype = dtype
        self.numel = numel
        self.device = device
        self.event = torch.cuda.Event(interprocess=True)
        self.buffer_id = None


class LightwireHookState(object):
    """State of ``ddp_comm_hook``.

    ``client``: a ``lightwire.Client`` (default: one from ``LIGHTWIRE_SOCKET``).
    ``on_error``: ``"fallback"`` or ``"raise"``. ``process_group``: the group of the fallback
    allreduce (default: the default group). ``module``: the model (or its DDP wrapper); given,
    buckets go per layer (``per_layer``, default: whether ``module`` is given; see the module's
    documentation). ``name_prefix``: bucket names are ``f"{name_prefix}.{hash of the parameter
    names}"`` per layer, ``f"{name_prefix}.{bucket_index}"`` flat. ``trainer``: the local trainer index when env
    ``LOCAL_RANK`` is unset (default 0). ``max_workers``: threads making HTTP calls (default 4):
    several buckets of an iteration are with the sidecar at once. Every sidecar of the job must run
    the steps in the same order, whatever order the requests reach them in, so the hook numbers
    its buckets per iteration in DDP's launch order (the same on every rank) and sends each with
    its place (docs/api.md "Buckets in flight"); the sidecars run them in that order. The
    numbering is the hook state's ``stream``: ``name_prefix``, and for the k-th hook state of the
    same ``name_prefix`` made in this process (k > 0) ``f"{name_prefix}/{k}"`` -- the same on every
    rank when every rank makes its hook states in the same order; two models in one process need
    distinct ``name_prefix`` anyway when their parameter names can coincide. A bucket the hook
    numbered but could not send (a local error, a refusal) is cancelled (``POST /v1/cancel``) so
    that the ones after it do not wait for it. Buckets of a hook called outside DDP (no
    ``bucket.is_last()``) carry no place: use ``max_workers=1`` there.

    ``agree``: before using a bucket's result, every rank tells the others whether its sidecar
    answered (a MIN allreduce on the process group); when one did not, every rank falls back for
    that bucket, together. Without it, a sidecar failing after the exchange but before answering
    its trainer (it crashed between two answers) leaves that rank alone in its fallback
    allreduce, which then pairs with another bucket's collective or waits for the process group's
    timeout. The cost is one small collective per iteration: the buckets' answers are held until
    the iteration's last bucket (``bucket.is_last()``) has its answer too, then one allreduce of
    one flag per bucket decides each, and the iteration's futures complete together (DDP waits for
    all of them at the end of backward anyway). Buckets that cannot say whether they are the last
    (a hook called outside DDP) agree one by one. An iteration whose last bucket never came (its
    backward pass raised) is dropped when the next one starts, its futures failed. ``agreements``
    counts the collectives (the figures: clients/python/README.md).

    ``codec: auto``: every bucket carries the trainer's compute of the last iteration that falls
    to it (``compute_s``) and the part its exchange can hide behind (``overlap_s``); when the
    sidecars answer with a ``direct`` window (every layer is best exchanged dense), the hook
    averages the buckets of those steps with the process group itself, as DDP would
    (``direct_steps`` counts them), and comes back to the sidecar after it.

    ``optimizer``: the trainer's optimizer, so that the hook can refuse one that would apply
    momentum a second time to a gradient the sidecar already applied it to (dgc with momentum
    correction); ``SGD`` of this module declares itself. See ``SGD``.

    Counters: ``fallbacks`` (buckets averaged by the process group instead), ``sidecar_steps``
    (buckets averaged by the sidecar), ``fallbacks_reported``, ``sidecar_elements`` and
    ``dense_elements`` (the elements of those buckets, and of them the ones exchanged dense:
    codec ``none`` or a dense step; ``dense_share()`` is their ratio); ``last_reply`` is the last
    Form 2 reply (codec, ratio, durations), ``last_error`` the last failure.
    """

    def __init__(self, client=None, on_error="fallback", process_group=None, name_prefix="bucket",
                 trainer=None, max_workers=4, agree=True, module=None, per_layer=None,
                 optimizer=None):
        if on_error not in ("fallback", "raise"):
            raise ValueError("on_error must be 'fallback' or 'raise', got %r" % (on_error,))
        if per_layer is None:
            per_layer = module is not None
        if per_layer and module is None:
            raise ValueError("lightwire: per_layer=True needs module= (the model, or its DDP "
                             "wrapper): the layers are named by its named parameters")
        self.per_layer = bool(per_layer)
        self._names = _parameter_names(module) if self.per_layer else {}
        self._layouts = {}         # tuple of parameter ids -> (bucket name, layout)
        self._layouts_sent = LayoutHashes()  # the layout hash its sidecar holds, per bucket
        # Momentum (see SGD): the optimizer the trainer declared (SGD declares itself), and the
        # momentum the sidecar applies to each parameter's gradient, from the last reply naming it.
        self.optimizer = optimizer
        self._momentum = {}        # id(parameter) -> the sidecar's momentum (0: none)
        self._codec = {}           # id(parameter) -> its codec, from the last reply naming it
        self._momentum_checked = set()
        self.iteration = None      # per layer: the training iteration of the buckets being sent
        self._seen = set()         # ... and the bucket indices sent in it
        self.client = client if client is not None else Client()
        self.on_error = on_error
        self.agree = bool(agree)
        self.process_group = process_group
        self.name_prefix = name_prefix
        with _streams_lock:
            made = _streams_made.get(name_prefix, 0)
            _streams_made[name_prefix] = made + 1
        self.stream = name_prefix if made == 0 else "%s/%d" % (name_prefix, made)
        self._restart_order()
        env = os.environ.get("LOCAL_RANK")
        self.trainer = int(env) if env not in (None, "") else (0 if trainer is None else int(trainer))
        self.steps = {}            # bucket index -> next step number
        self.first_step = 0        # the step number of a bucket's first call (load_state sets it)
        self.fallbacks = 0
        self.fallbacks_reported = 0
        self.agreements = 0        # agreement collectives (one per iteration, see agree)
        self._held = []            # the iteration's answered buckets, until its last one
        self._flags = {}           # the agreement's tensors, by (length, device): see _all_ok
        self.sidecar_steps = 0
        # Elements the sidecar averaged, and of those the ones it exchanged dense (codec `none`,
        # or a dense step: bypass, full sync, before PowerSGD's start), from every reply.
        self.sidecar_elements = 0
        self.dense_elements = 0
        self.last_reply = None
        self.last_error = None
        # codec auto (docs/policies.md "codec: auto"): the compute of the last iteration (from its
        # last future's completion to the next iteration's last bucket launch), the part of it
        # the exchange can hide behind (first to last bucket launch), shared among the buckets by
        # their elements and sent with each; and the window of steps the sidecars gave to the
        # process group (the direct rung), from the replies: (from, until) or None.
        self._launches = {}        # bucket index -> (launch time, elements) this iteration
        self._timing = None        # (compute_s, overlap_s, elements) of the last iteration
        self._iteration_end = None  # when the last iteration's last future completed
        self._last_launch = None   # this iteration's last bucket launch
        self._direct_s = None      # what the process group added beyond compute (direct windows)
        self._tail_s = None        # ... and the sidecars (the last iteration through them)
        self._direct = None
        # Direct buckets whose collective has not completed, and whether the iteration's last one
        # was launched: the iteration ends when both say so (the process group may complete a
        # later, smaller bucket before an earlier one).
        self._direct_pending = 0
        self._direct_last_launched = False
        self.direct_steps = 0      # buckets the process group averaged in a direct window
        self._slots = {}           # bucket index -> _Slot
        self._cuda_slots = {}      # bucket index -> _CudaSlot
        # CUDA buckets go through CUDA IPC while the sidecar takes it; after a refusal (no CUDA
        # driver there) through shared memory, copied to and from the host.
        self.cuda_ipc = True
        self._lock = threading.Lock()
        # HTTP calls of numbered buckets run in max_workers threads (the sidecars order them by
        # their places); buckets without a place go one at a time, in launch order, through one
        # thread of their own. Completions (and fallback collectives) run in one thread, in the
        # order DDP launched the buckets (the same on every rank), so fallback allreduces are
        # issued in the same order on every rank.
        self._http = concurrent.futures.ThreadPoolExecutor(max(1, int(max_workers)),
                                                           thread_name_prefix="lightwire-http")
        self._serial = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lightwire-http1")
        self._ordered = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lightwire-complete")

    @property
    def last_step(self):
        """The sidecar step number of the last iteration the hook sent (None before the first):
        what ``save_state`` takes after that iteration's optimizer step."""
        if self.per_layer:
            return self.iteration
        if not self.steps:
            return None
        return max(self.steps.values()) - 1

    def _next_step(self, index):
        """The step number of bucket ``index``'s call. Flat buckets: one counter per bucket index.
        Per layer: the training iteration, which moves on when an index comes again (DDP sends
        each bucket once per iteration; after its rebuild the buckets and their count change)."""
        if not self.per_layer:
            step = self.steps.get(index, self.first_step)
            self.steps[index] = step + 1
            return step
        if self.iteration is None or index in self._seen:
            self.iteration = self.first_step if self.iteration is None else self.iteration + 1
            self._seen = set()
        self._seen.add(index)
        self.steps[index] = self.iteration + 1
        return self.iteration

    def _restart_order(self):
        """The place of the next bucket in the stream (docs/api.md "Buckets in flight"): position
        0 of iteration 0, no bucket index numbered in it yet."""
        self._order_iteration = 0
        self._order_position = 0
        self._order_seen = set()

    def _place(self, index, last, sent):
        """Hook thread: (stream, iteration, position) of bucket ``index`` (None when DDP cannot
        say which bucket is an iteration's last, or for a bucket not sent to the sidecar). Buckets
        sent to the sidecar are numbered 0, 1, ... per iteration in launch order; an iteration ends
        after its last bucket, or, when that never came (its backward pass raised), when an index
        comes again."""
        if last is None:
            return None
        if index in self._order_seen:
            self._next_order_iteration()
        self._order_seen.add(index)
        place = None
        if sent:
            place = (self.stream, self._order_iteration, self._order_position)
            self._order_position += 1
        if last:
            self._next_order_iteration()
        return place

    def _next_order_iteration(self):
        self._order_iteration += 1
        self._order_position = 0
        self._order_seen = set()

    def _pool(self, place):
        """The threads a bucket's request goes through (see max_workers)."""
        return self._http if place is not None else self._serial

    def _cancel(self, place, name, step):
        """HTTP thread: the sidecar is told that ``place`` will not come (best effort: an
        unreachable sidecar has nothing waiting on it)."""
        if place is None:
            return
        try:
            self.client.cancel(place, name=name, step=step)
        except LightwireError as e:
            log.debug("lightwire: cancelling %s: %s", place, e)

    def _bucket_layout(self, bucket, numel):
        """(bucket name, layout) of a bucket's parameters, computed once per parameter set."""
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        got = self._layouts.get(key)
        if got is not None:
            return got
        layout, offset = [], 0
        for p in params:
            name = self._names.get(id(p))
            if name is None:
                raise TypeError("lightwire: a parameter of bucket %d (shape %s) is not among the "
                                "named parameters of the module given to LightwireHookState"
                                % (bucket.index(), list(p.shape)))
            layout.append({"name": name, "offset": offset, "shape": [int(d) for d in p.shape]})
            offset += p.numel()
        if offset != numel:
            raise ValueError("lightwire: bucket %d's parameters hold %d elements, its buffer %d"
                             % (bucket.index(), offset, numel))
        digest = hashlib.sha1("\n".join(e["name"] for e in layout).encode()).hexdigest()[:16]
        got = ("%s.%s" % (self.name_prefix, digest), layout)
        self._layouts[key] = got
        return got

    def dense_share(self):
        """The share of the elements the sidecar averaged that it exchanged dense (None before
        the first reply)."""
        if self.sidecar_elements == 0:
            return None
        return self.dense_elements / self.sidecar_elements

    # ------------------------------------------------------------------ momentum

    def sidecar_momentum(self, parameter):
        """The momentum the sidecar applies to ``parameter``'s gradient before it averages it (dgc's
        momentum correction; the reply's ``momentum``), from the last reply that named it; 0.0 when
        it applies none (the optimizer owns momentum) or no reply named it yet."""
        return self._momentum.get(id(parameter), 0.0)

    def declared_momentum(self):
        """The momentum this hook tells the sidecars its optimizer takes back from them (request
        field ``momentum``), so that ``codec: auto`` may move layers onto a rung with dgc's
        momentum correction: ``lightwire.torch.SGD`` with one momentum in (0, 1) for all its
        groups (no nesterov, no dampening), or ``lightwire.torch.AdamW`` with one ``betas[0]`` and
        dgc among the codecs it preconditions; None for any other optimizer (such rungs are then
        never taken for this job, docs/policies.md "codec: auto")."""
        opt = self.optimizer
        if isinstance(opt, SGD):
            kinds = {(g["momentum"], bool(g["nesterov"]), g["dampening"]) for g in opt.param_groups}
            if len(kinds) == 1:
                m, nesterov, dampening = kinds.pop()
                if 0 < m < 1 and not nesterov and dampening == 0:
                    return float(m)
        elif isinstance(opt, AdamW) and "dgc" in opt.precondition_codecs:
            betas = {g["betas"][0] for g in opt.param_groups}
            if len(betas) == 1:
                m = betas.pop()
                if 0 < m < 1:
                    return float(m)
        return None

    def sidecar_codec(self, parameter):
        """The codec the sidecar sends ``parameter`` with (the reply's ``codec`` for its layer, or
        for its flat bucket), from the last reply that named it; None before any did."""
        return self._codec.get(id(parameter))

    def _note_momentum(self, params, reply):
        """Records what a bucket's reply says of each parameter's momentum and codec and checks
        the optimizer against it (raises MomentumConflict)."""
        layers = reply.get("layers") if isinstance(reply, dict) else None
        if layers is None or len(layers) != len(params):  # a flat bucket: one entry for all
            layers = [reply if isinstance(reply, dict) else {}] * len(params)
        for p, e in zip(params, layers):
            m, name = float(e.get("momentum", 0.0)), e.get("name")
            self._momentum[id(p)] = m
            self._codec[id(p)] = e.get("codec")
            if m > 0 and (id(p), m) not in self._momentum_checked:
                _check_optimizer(self.optimizer, p, m, name)
                self._momentum_checked.add((id(p), m))

    # ------------------------------------------------------------------ segments

    def _slot(self, index, numel, dtype):
        slot = self._slots.get(index)
        if slot is not None and slot.numel == numel and slot.dtype == dtype:
            return slot
        if slot is not None:  # DDP rebuilt its buckets: a new size
            self._drop_slot(index, slot)
        slot = _Slot(numel, dtype)
        self._slots[index] = slot
        return slot

    def _drop_slot(self, index, slot):
        self._slots.pop(index, None)
        bid = slot.segment.buffer_id
        slot.segment.buffer_id = None
        if bid is not None:
            try:
                self.client.release_buffer(bid)
            except LightwireError as e:
                log.debug("lightwire: releasing buffer %s: %s", bid, e)
        slot.segment.close()

    def _cuda_slot(self, index, numel, dtype, device):
        slot = self._cuda_slots.get(index)
        if slot is not None and slot.numel == numel and slot.dtype == dtype and slot.device == device:
            return slot
        if slot is not None:
            self._drop_cuda_slot(index, slot)
        slot = _CudaSlot(numel, dtype, device)
        self._cuda_slots[index] = slot
        return slot

    def _drop_cuda_slot(self, index, slot):
        self._cuda_slots.pop(index, None)
        bid, slot.buffer_id = slot.buffer_id, None
        if bid is not None:
            try:
                self.client.release_buffer(bid)
            except LightwireError as e:
                log.debug("lightwire: releasing buffer %s: %s", bid, e)

    def close(self):
        """Wait for the calls in flight, release and unlink every segment, stop the threads."""
        self._http.shutdown(wait=True)
        self._serial.shutdown(wait=True)
        self._ordered.shutdown(wait=True)
        for index, slot in list(self._slots.items()):
            self._drop_slot(index, slot)
        for index, slot in list(self._cuda_slots.items()):
            self._drop_cuda_slot(index, slot)

    # ------------------------------------------------------------------ one bucket

    def _send(self, buffer_id, name, step, dtype, shape, layout, timing=None, place=None):
        """Form 2 of one bucket, its layout sent once (``LayoutHashes``: then only its hash, and
        the layout again to a sidecar that restarted)."""
        momentum = self.declared_momentum()

        def emit(layout, layout_hash):
            reply = self.client.emit_gradient_shm(buffer_id, name=name, step=step, dtype=dtype,
                                                  shape=shape, trainer=self.trainer, layout=layout,
                                                  layout_hash=layout_hash, timing=timing,
                                                  order=place, momentum=momentum)
            return reply, reply.get("layout_hash") if isinstance(reply, dict) else None

        if layout is None:
            return emit(None, None)[0]
        return self._layouts_sent.send(name, layout, emit)

    def _emit(self, slot, name, step, shape, layout=None, timing=None, place=None):
        """Runs in an HTTP thread: register if needed, then Form 2. Returns the reply."""
        seg = slot.segment
        for attempt in (0, 1):
            if seg.buffer_id is None:
                self.client.register_buffer(seg)
            try:
                return self._send(seg.buffer_id, name, step, _DTYPES[slot.dtype], shape, layout,
                                  timing, place)
            except SidecarUnavailable:
                # The sidecar went away; a restarted one knows none of our ids (nor can they be
                # released): register again on the next call.
                seg.buffer_id = None
                raise
            except LightwireError as e:
                if e.error == "shutting_down":
                    seg.buffer_id = None
                elif e.status == 404 and e.error == "not_found" and attempt == 0:
                    seg.buffer_id = None  # a sidecar that does not know our buffer: register again
                    continue
                raise

    def _emit_cuda(self, slot, name, step, shape, layout=None, timing=None, place=None):
        """As _emit, for a CUDA slot (its event was recorded by the caller's stream)."""
        from .client import cuda_ipc_spec
        for attempt in (0, 1):
            if slot.buffer_id is None:
                doc = cuda_ipc_spec(slot.view, event=slot.event)
                slot.buffer_id = str(self.client._json("POST", "/v1/buffers", doc).json()["id"])
            try:
                return self._send(slot.buffer_id, name, step, _DTYPES[slot.dtype], shape, layout,
                                  timing, place)
            except SidecarUnavailable:
                slot.buffer_id = None
                raise
            except LightwireError as e:
                if e.error == "shutting_down":
                    slot.buffer_id = None
                elif e.status == 404 and e.error == "not_found" and attempt == 0:
                    slot.buffer_id = None
                    continue
                raise

    # ------------------------------------------------------------------ codec auto

    def _launched(self, index, numel, last):
        """Hook thread: notes bucket ``index``'s launch; returns its (compute_s, overlap_s) share
        of the last iteration, or None before one was measured."""
        now = time.perf_counter()
        if index in self._launches:  # a new iteration: the previous one had no last bucket
            self._launches = {}
        self._launches[index] = (now, numel)
        timing = self._timing
        if last:
            first = min(t for t, _ in self._launches.values())
            total = sum(n for _, n in self._launches.values())
            end = self._iteration_end
            if end is not None and end < first:
                self._timing = (now - end, now - first, total)
            self._launches = {}
            self._last_launch = now
        if timing is None or timing[2] <= 0:
            return None
        share = float(numel) / timing[2]
        direct = None if self._direct_s is None else self._direct_s * share
        tail = None if self._tail_s is None else self._tail_s * share
        return (timing[0] * share, min(timing[1], timing[0]) * share, direct, tail)

    def _ended(self, direct=False):
        """The iteration's last future completed (ordered thread, or a direct collective's). In a
        direct window, what the process group added beyond the compute (from the last bucket's
        launch to here) joins the running figure the sidecars model the direct rung with."""
        now = time.perf_counter()
        self._iteration_end = now
        if self._last_launch is None or now < self._last_launch:
            return
        tail = now - self._last_launch
        if direct:
            self._direct_s = tail if self._direct_s is None else 0.5 * self._direct_s + 0.5 * tail
            # The sidecars' figure is of the iterations through them: the first after a window
            # must not carry one from before it.
            self._tail_s = None
        else:
            self._tail_s = tail  # the last iteration's: the sidecars keep one mean per rung

    def _note_direct(self, reply):
        window = reply.get("direct") if isinstance(reply, dict) else None
        if isinstance(window, dict):
            try:
                self._direct = (int(window["from"]), int(window["until"]))
            except (KeyError, TypeError, ValueError):
                pass

    def _in_direct(self, step):
        w = self._direct
        return (w is not None and w[0] <= step < w[1] and dist.is_available()
                and dist.is_initialized())

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _all_ok(self, oks, device):
        """Every rank's `oks` (one per bucket), MIN-reduced element by element in one collective
        (the same order on every rank: the ordered thread runs completions in DDP's launch order,
        and DDP has the same buckets on every rank)."""
        if not dist.is_initialized():
            return oks  # the hook called outside DDP: no one to agree with
        group = self._group()
        if dist.get_world_size(group) == 1:
            return oks
        on = torch.device(device if dist.get_backend(group) == "nccl" else "cpu")
        # One tensor per length, never a fresh one per collective, and kept beyond this state:
        # see _AGREEMENT_TENSORS.
        key = (len(oks), str(on))
        flags = self._flags.get(key)
        if flags is None:
            flags = self._flags[key] = torch.empty(len(oks), dtype=torch.int32, device=on)
            _AGREEMENT_TENSORS.append(flags)
            del _AGREEMENT_TENSORS[:-64]  # a handful of int32 each
        flags.copy_(torch.tensor([1 if ok else 0 for ok in oks], dtype=torch.int32))
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group, async_op=True).wait()
        with self._lock:
            self.agreements += 1
        return [bool(f) for f in flags.tolist()]

    def _complete(self, http_future, fut, slot, bucket_buffer, step, params=(), last=None,
                  first=False):
        """Runs in the ordered thread: resolve the hook's future; with agreement, once the
        iteration's last bucket (`last`: bucket.is_last(), None when unknown) has answered too.
        `first`: the iteration's first bucket (index 0, which DDP launches first)."""
        try:
            reply, error = http_future.result(), None
        except Exception as e:
            reply, error = None, e
        held = (reply, error, fut, slot, bucket_buffer, step, params)
        if not self.agree:
            self._resolve(*held)
            if last:
                self._ended()
            return
        if first and self._held:
            # An iteration whose last bucket never came (its backward pass raised): nobody waits
            # for its buckets any more, and agreeing on them with this iteration's would pair
            # them with the other ranks' flags of other buckets.
            stale, self._held = self._held, []
            for h in stale:
                h[2].set_exception(RuntimeError(
                    "lightwire: bucket of step %d abandoned: its iteration's last bucket never "
                    "came (the backward pass stopped early)" % h[5]))
        if last is None and not self._held:
            batch = [held]  # a bucket that cannot tell whether it is the last: alone
        else:
            self._held.append(held)
            if not last:
                return
            batch, self._held = self._held, []
        try:
            oks = self._all_ok([h[1] is None for h in batch], bucket_buffer.device)
        except Exception as e2:  # the process group itself failed: nothing left to try
            for h in batch:
                h[2].set_exception(e2)
            return
        for h, all_ok in zip(batch, oks):
            reply, error = h[0], h[1]
            if error is None and not all_ok:
                error = LightwireError(None, "peer_fallback",
                                       "another rank's sidecar did not answer this bucket's step "
                                       "%d; every rank falls back together" % h[5])
            self._resolve(reply, error, *h[2:])
        if last:
            self._ended()

    def _resolve(self, reply, error, fut, slot, bucket_buffer, step, params):
        """Ordered thread: the bucket's result, or its fallback."""
        if error is not None:
            self._failed(error, fut, bucket_buffer, step)
            return
        self._note_direct(reply)
        try:
            self._note_momentum(params, reply)
            _warn_adaptive_selection(self.optimizer, reply)
        except MomentumConflict as e:  # a setup error: never hidden by a fallback
            self.last_error = e
            fut.set_exception(e)
            return
        total, dense = _dense_elements(reply)
        with self._lock:
            self.sidecar_steps += 1
            self.sidecar_elements += total
            self.dense_elements += dense
            self.last_reply = reply
        pending = self.fallbacks - self.fallbacks_reported
        if pending > 0:
            self._report_fallbacks(step, pending)
        result = slot.view.view(bucket_buffer.shape)
        if result.device != bucket_buffer.device:  # a CUDA bucket through shared memory
            result = result.to(bucket_buffer.device)
        fut.set_result(result)

    def _failed(self, e, fut, bucket_buffer, step):
        self.last_error = e
        if self.on_error == "raise" or not isinstance(e, (LightwireError, OSError, ValueError, TypeError)):
            fut.set_exception(e)
            return
        with self._lock:
            self.fallbacks += 1
        log.warning("lightwire: step %d failed (%s); this bucket falls back to the process "
                    "group's allreduce (%d fallbacks so far)", step, e, self.fallbacks)
        try:
            group = self._group()
            world = dist.get_world_size(group)
            bucket_buffer.div_(world)
            dist.all_reduce(bucket_buffer, group=group, async_op=True).wait()
        except Exception as e2:  # the fallback itself failed: nothing left to try
            fut.set_exception(e2)
            return
        self._report_fallbacks(step, self.fallbacks - self.fallbacks_reported)
        fut.set_result(bucket_buffer)

    def _report_fallbacks(self, step, count):
        if count <= 0:
            return
        try:
            self.client.report(step, fallbacks=count, trainer=self.trainer)
        except LightwireError:
            return  # unreachable: reported with the next successful step
        with self._lock:
            self.fallbacks_reported += count


# The agreement's tensors of every hook state, the newest 64, kept beyond the state's life. gloo's
# worker thread drops its reference to a collective's tensor a moment after the waiter wakes, under
# the process group's lock. Were that the last reference to a tensor Python made, freeing it would
# need the GIL in that thread; and a process group destroyed meanwhile by a thread that holds the
# GIL (destroy_process_group, or the DDP model freed after it, which frees the group) waits for
# that lock: both wait forever. Seen with torch 1.13 at the end of two-rank training runs (2 of
# about 30 on a loaded machine) when every collective had a fresh tensor.
_AGREEMENT_TENSORS = []


def ddp_comm_hook(state, bucket):
    """DDP communication hook: ``ddp_model.register_comm_hook(state, ddp_comm_hook)`` with a
    ``LightwireHookState``. Returns a ``torch.futures.Future`` of the bucket's averaged
    gradient (the sidecar divides by the number of trainers, as DDP expects)."""
    buf = bucket.buffer()
    index = bucket.index()
    params = bucket.parameters()
    is_last = getattr(bucket, "is_last", None)
    last = bool(is_last()) if callable(is_last) else None  # the iteration's last bucket
    step = state._next_step(index)
    timing = state._launched(index, buf.numel(), last)
    direct = state._in_direct(step)
    place = state._place(index, last, not direct)
    if direct:
        return _direct(state, buf, last, params)
    fut = torch.futures.Future()
    name, layout = "%s.%d" % (state.name_prefix, index), None
    try:
        if buf.dtype not in _DTYPES or buf.device.type not in ("cpu", "cuda"):
            raise TypeError("lightwire: bucket %d has dtype %s on %s; the sidecar takes CPU or "
                            "CUDA float32, float16 or bfloat16" % (index, buf.dtype, buf.device))
        flat = buf.view(-1) if buf.is_contiguous() else buf.reshape(-1)
        precondition = getattr(state.optimizer, "_precondition_bucket", None)
        if precondition is not None:  # lightwire.torch.AdamW: the updates, not the gradients
            precondition(params, flat)
            if flat.data_ptr() != buf.data_ptr():
                buf.copy_(flat.view(buf.shape))  # the fallback allreduce averages the same
        if state.per_layer:
            name, layout = state._bucket_layout(bucket, flat.numel())
        if buf.device.type == "cuda" and state.cuda_ipc:
            slot = state._cuda_slot(index, flat.numel(), buf.dtype, buf.device)
            slot.view.copy_(flat)  # device to device, on the current stream
            slot.event.record()    # the sidecar's copy waits for it
            http_future = state._pool(place).submit(_placed, state, place, name, step,
                                                    _emit_cuda_or_degrade, state, slot, index,
                                                    flat, name, step, layout, timing, place)
            state._ordered.submit(_complete_cuda, state, http_future, fut, buf, step, params,
                                  last, index == 0)
            return fut
        slot = state._slot(index, flat.numel(), buf.dtype)
        slot.view.copy_(flat)  # the only copy (CUDA buckets: to the host)
    except (OSError, ValueError, TypeError) as e:  # e.g. /dev/shm full: this bucket falls back
        if place is not None:  # the buckets after it must not wait for it
            state._http.submit(state._cancel, place, name, step)
        done = concurrent.futures.Future()
        done.set_exception(e)
        state._ordered.submit(state._complete, done, fut, None, buf, step, params, last,
                              index == 0)
        return fut
    http_future = state._pool(place).submit(_placed, state, place, name, step, state._emit, slot,
                                            name, step, [flat.numel()], layout, timing, place)
    state._ordered.submit(state._complete, http_future, fut, slot, buf, step, params, last,
                          index == 0)
    return fut


def _direct(state, buf, last, params):
    """A bucket of a direct window (codec auto): averaged by the process group, as DDP's own
    allreduce would, the sidecar out of the data path. lightwire.torch.AdamW steps those
    parameters as torch.optim.AdamW does (their gradients are averaged as they are)."""
    dense = getattr(state.optimizer, "_dense_bucket", None)
    if dense is not None:
        dense(params)
    group = state._group()
    buf.div_(dist.get_world_size(group))
    with state._lock:
        state.direct_steps += 1
        state._direct_pending += 1
        if last:
            state._direct_last_launched = True
    work = dist.all_reduce(buf, group=group, async_op=True)

    def done(f):
        with state._lock:
            state._direct_pending -= 1
            end = state._direct_pending == 0 and state._direct_last_launched
            if end:
                state._direct_last_launched = False
        if end:
            state._ended(direct=True)
        return f.value()[0]
    return work.get_future().then(done)


def _placed(state, place, name, step, emit, *args):
    """HTTP thread: ``emit(*args)``; when it fails, its place is cancelled first (a step that
    ran and failed has passed its place already: the cancel then changes nothing)."""
    try:
        return emit(*args)
    except Exception:
        state._cancel(place, name, step)
        raise


def _emit_cuda_or_degrade(state, slot, index, flat, name, step, layout=None, timing=None,
                          place=None):
    """HTTP thread: the CUDA IPC path; if the sidecar cannot open CUDA IPC handles (409
    failed_precondition: no CUDA driver there), every later CUDA bucket goes through shared
    memory, and this one does now. Returns (slot used, reply)."""
    try:
        return slot, state._emit_cuda(slot, name, step, [flat.numel()], layout, timing, place)
    except LightwireError as e:
        if not (e.status == 409 and e.error == "failed_precondition" and slot.buffer_id is None):
            raise
        log.warning("lightwire: the sidecar cannot take CUDA IPC buffers (%s); CUDA buckets go "
                    "through host shared memory instead", e)
        state.cuda_ipc = False
    host = state._slot(index, flat.numel(), slot.dtype)
    torch.cuda.current_stream(slot.device).synchronize()
    host.view.copy_(slot.view)
    return host, state._emit(host, name, step, [flat.numel()], layout, timing, place)


def _complete_cuda(state, http_future, fut, bucket_buffer, step, params=(), last=None,
                   first=False):
    """Ordered thread: unwrap (slot, reply) and resolve as _complete does."""
    done = concurrent.futures.Future()
    slot = None
    try:
        slot, reply = http_future.result()
        done.set_result(reply)
    except Exception as e:
        done.set_exception(e)  # _complete agrees with the other ranks, then falls back
    state._complete(done, fut, slot, bucket_buffer, step, params, last, first)


def _client_of(client, hook_state):
    if client is not None:
        return client
    if hook_state is not None:
        return hook_state.client
    from .client import default_client
    return default_client()


def save_state(step, client=None, hook_state=None):
    """Checkpoints the sidecars' state as it stands after ``step`` (``POST /v1/checkpoint``); call
    it next to ``torch.save``.

    ``step`` is the sidecar step number of the last exchange (with ``ddp_comm_hook``:
    ``hook_state.last_step``; iteration i, counted from 0 over the iterations whose gradients were
    synchronised, is step i). Call it after the optimizer step of ``step`` and before the next
    iteration's backward pass sends any gradient: on rank 0 only (as DDP trainers usually save)
    or on every rank -- the sidecar asked saves at once and tells the others, which save theirs
    (their state after ``step``) when the request reaches them with the next step. Asked too late
    (a later step already completed at that sidecar), it raises ``LightwireError`` 409 and saves
    nothing.

    ``client``: the sidecar to ask (default: ``hook_state.client``, else the default client from
    ``LIGHTWIRE_SOCKET``). Returns the reply ``{"step", "path", "peers"}``.
    """
    return _client_of(client, hook_state).checkpoint(int(step))


def load_state(step, client=None, hook_state=None):
    """Restores the sidecar's state of ``step`` (``POST /v1/resume``); call it next to
    ``torch.load``, on EVERY rank, each with its own sidecar, after restarting the trainers (and
    the sidecars, if they restarted) from a checkpoint taken with ``save_state(step)``.

    The sidecar asked tells the others, which resume from their own checkpoint of ``step`` too;
    calling it on every rank before the first backward pass makes sure no step runs before they
    have (the sidecars compare the step they resumed from with every step and fail one on every
    rank, ``409 resume_mismatch``, when they disagree). The next step of every tensor is ``step + 1``; with ``hook_state`` (a
    ``LightwireHookState``) the hook's step counters are set to continue from there.

    Raises ``LightwireError``: 404 when that sidecar has no checkpoint of ``step``, 409 when the
    file cannot be used (corrupted, another job, rank or world size: the message says which).
    Returns the reply ``{"step", "next_step"}``.
    """
    reply = _client_of(client, hook_state).resume(int(step))
    if hook_state is not None:
        hook_state.steps = {}
        hook_state.first_step = int(step) + 1
        hook_state.iteration = None
        hook_state._seen = set()
        # The sidecars forget the streams' places when they resume: number afresh.
        hook_state._restart_order()
    return reply
