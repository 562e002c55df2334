#!/usr/bin/env python3
"""One configuration of the end-to-end benchmark (bench/e2e/e2e.py runs it inside the network
namespace): W PyTorch DDP trainer processes (gloo, CPU, one thread each) train one task of
bench/e2e/tasks.py for a fixed number of steps (or, given a target, until the time-to-accuracy
stop rule of bench/e2e/tta.py says so), gradients averaged by plain DDP, by one of PyTorch's
communication hooks, or by lightwire sidecars (one per rank, through
lightwire.torch.ddp_comm_hook). Rank 0 times every step, evaluates the model every few steps
(outside the timed steps), counts the bytes that crossed the namespace's loopback during the timed
steps, and writes one JSON object.

    $PYTHON bench/e2e/worker.py SPEC_JSON OUT_JSON

SPEC_JSON: {"task", "size", "seed", "world_size", "steps", "eval_every", "kind" ("ddp" |
"torch_hook" | "lightwire"), "hook" ("fp16" | "allreduce" | "powersgd" for torch_hook; "flat", "serial" or null for lightwire), "powersgd_rank",
"powersgd_start", "optimizer" ("task": the task's own; "lightwire_sgd": lightwire.torch.SGD with
the task's SGD settings; "helper": lightwire.torch.SGD when the task trains with SGD; either is
lightwire.torch.AdamW with the task's settings when the task trains with AdamW), "sockets" (lightwire: one Unix socket per rank), "store_dir"}; for the time-to-accuracy stop rule also
"target" (the loss), "extra_steps" and "cap_seconds" ("steps" is then the cap on steps): without
"target" every step up to "steps" runs. Progress goes to stderr.
"""

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))

LO_TX = "/sys/class/net/lo/statistics/tx_bytes"

# The rank that evaluates the model and decides the time-to-accuracy stop; the others learn its
# decision from a broadcast.
EVAL_RANK = 0
# Seconds a gloo collective may wait for the other ranks (init_process_group's timeout): far above
# a step's compute skew and an evaluation (a second or two), far below gloo's default 30 minutes.
GLOO_TIMEOUT_S = 300


def log(msg):
    print("e2e worker: %s" % msg, file=sys.stderr, flush=True)


def lo_tx_bytes():
    """Bytes sent on this network namespace's loopback so far (every byte between ranks)."""
    with open(LO_TX) as f:
        return int(f.read())


def attach_hook(spec, ddp, dist):
    """Registers the configuration's communication hook; returns the lightwire hook state or
    None."""
    if spec["kind"] == "torch_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        if spec["hook"] == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif spec["hook"] == "allreduce":
            # DDP's own allreduce, but from a Python hook: what any Python hook costs a step.
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif spec["hook"] == "powersgd":
            # PowerSGD from the spec's start step, the sidecar's (start_powerSGD_iter must be > 1
            # with error feedback and warm start: DDP rebuilds its buckets after the first step);
            # vanilla allreduce before.
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=spec.get("powersgd_rank", 1),
                start_powerSGD_iter=max(2, spec.get("powersgd_start", 10)), use_error_feedback=True, warm_start=True, random_seed=0)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            raise ValueError("unknown hook %r" % spec["hook"])
        return None
    if spec["kind"] == "lightwire":
        import lightwire
        from lightwire.torch import LightwireHookState, ddp_comm_hook
        sock = spec["sockets"][dist.get_rank()]
        # Per layer (the hook's default with a module: every parameter its own tensor), unless
        # the row is about DDP's flat buckets (hook "flat": one tensor per bucket).
        flat = spec.get("hook") == "flat"
        # Hook "serial": one bucket at the sidecar at a time (the hook's max_workers=1).
        state = LightwireHookState(client=lightwire.Client(socket_path=sock, timeout=300.0),
                                   process_group=dist.group.WORLD,
                                   module=None if flat else ddp, per_layer=not flat,
                                   max_workers=1 if spec.get("hook") == "serial" else 4)
        ddp.register_comm_hook(state, ddp_comm_hook)
        return state
    return None


def sidecar_wire_bytes(hook_state):
    """This rank's sidecar's lightwire_wire_bytes_total (sent, received), from its /metrics."""
    if hook_state is None:
        return (0.0, 0.0)
    sent = received = 0.0
    for line in hook_state.client.metrics().splitlines():
        if line.startswith('lightwire_wire_bytes_total{direction="sent"}'):
            sent = float(line.split()[-1])
        elif line.startswith('lightwire_wire_bytes_total{direction="received"}'):
            received = float(line.split()[-1])
    return (sent, received)


def train(rank, spec, out_path):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import tasks
    import tta as stop_rule

    os.environ["LOCAL_RANK"] = "0"  # each rank has a sidecar of its own: trainer 0 there
    torch.set_num_threads(1)
    world = spec["world_size"]
    # A collective that hangs (PyTorch's PowerSGD hook over gloo does, once it starts
    # compressing) fails after GLOO_TIMEOUT_S instead of gloo's 30 minutes: the rank raises, the
    # parent stops the others, and the row fails with the error rather than at the run's timeout.
    dist.init_process_group("gloo", init_method="file://" + os.path.join(spec["store_dir"], "store"),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    task = tasks.make_task(spec["task"], spec["size"], spec["seed"])
    torch.manual_seed(spec["seed"])
    model = task.model()
    cap = spec.get("bucket_cap_mb")
    ddp = nn.parallel.DistributedDataParallel(model, **({} if cap is None else
                                                        {"bucket_cap_mb": cap}))
    hook_state = attach_hook(spec, ddp, dist)
    opt = task.optimizer(ddp.parameters())
    if hook_state is not None:
        group = opt.param_groups[0]
        if spec.get("optimizer") in ("helper", "lightwire_sgd") and isinstance(opt,
                                                                           torch.optim.AdamW):
            # Adam's preconditioning in front of the error-feedback codecs, the sidecar's
            # momentum as Adam's first moment (docs/codecs.md "Adam with sparse codecs"); every
            # other layer steps as AdamW does.
            from lightwire.torch import AdamW
            opt = AdamW(ddp.parameters(), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                        weight_decay=group["weight_decay"], hook_state=hook_state)
        elif spec.get("optimizer") == "lightwire_sgd" or (spec.get("optimizer") == "helper"
                                                           and isinstance(opt, torch.optim.SGD)):
            # The sidecar applies DGC's momentum to the tensors it compresses: momentum stays in
            # the optimizer everywhere else (docs/codecs.md "Momentum with dgc"). Where no codec
            # applies momentum it steps exactly as torch.optim.SGD; it declares its momentum, so
            # that codec auto may take a rung with momentum correction (docs/policies.md).
            if not isinstance(opt, torch.optim.SGD):
                raise ValueError("task %s trains with %s: dgc's momentum correction needs momentum "
                                 "SGD or AdamW (docs/codecs.md)" % (spec["task"],
                                                                    type(opt).__name__))
            from lightwire.torch import SGD
            opt = SGD(ddp.parameters(), lr=group["lr"], momentum=group["momentum"],
                      weight_decay=group["weight_decay"], hook_state=hook_state)
        else:
            hook_state.optimizer = opt  # the hook refuses a setup applying momentum twice
    steps, every = spec["steps"], spec["eval_every"]
    # The time-to-accuracy stop rule (bench/e2e/tta.py) when the spec has a target; without one,
    # every step up to `steps` runs, as before.
    tta = spec.get("target") is not None
    stop_reason, last_step = None, 0
    step_seconds, losses, evals = [], [], []
    elapsed = 0.0
    dist.barrier()
    tx0 = lo_tx_bytes() if rank == EVAL_RANK else 0
    elements0 = (hook_state.sidecar_elements, hook_state.dense_elements) if hook_state else None
    wire0 = sidecar_wire_bytes(hook_state)
    cpu = 0.0  # this process's CPU time (every thread: gloo's, the hook's) in the timed steps
    # What carried each step (rank 0, lightwire rows): the process group in a direct window
    # (codec auto), the sidecars (with the share of elements they sent dense), or a fallback.
    carried = []
    for step in range(1, steps + 1):
        if hook_state is not None:
            before = (hook_state.direct_steps, hook_state.sidecar_elements,
                      hook_state.dense_elements, hook_state.fallbacks)
        x, y = task.batch(rank, step)
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(ddp, x, y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        cpu += time.process_time() - c0
        value = loss.item()
        last_step = step
        if hook_state is not None:
            # The loss feeds the sidecars' rollback policy (docs/policies.md).
            hook_state.client.report(step, loss=value, trainer=0)
        evaluating = stop_rule.is_eval_step(step, every, steps)
        if rank == EVAL_RANK:
            if hook_state is not None:
                total = hook_state.sidecar_elements - before[1]
                by = ("fallback" if hook_state.fallbacks > before[3] else
                      "direct" if hook_state.direct_steps > before[0] else "sidecar")
                timing = hook_state._timing
                carried.append({"step": step, "by": by, "seconds": dt,
                                "hook_compute": timing[0] if timing else None,
                                "hook_overlap": timing[1] if timing else None,
                                "hook_direct": hook_state._direct_s, "hook_tail": hook_state._tail_s,
                                "dense_share": (hook_state.dense_elements - before[2]) / total
                                if total else 1.0})
            elapsed += dt
            step_seconds.append(dt)
            losses.append(value)
            if evaluating:
                e = task.evaluate(model)  # outside the timed step
                evals.append({"step": step, "seconds": elapsed, "loss": e["loss"],
                              "accuracy": e.get("accuracy")})
                log("%s step %d/%d: loss %.4f, eval loss %.4f, %.3f s/step" % (
                    spec["config"], step, steps, value, e["loss"], dt))
        if tta and evaluating:
            # Decided by the evaluating rank and broadcast, at evaluation steps only (the same steps
            # on every rank): every rank stops after the same step. After backward() returns, DDP
            # (and the lightwire hook's completions) have no collective left in flight on the
            # group, so this one cannot interleave with theirs.
            flag = torch.zeros(1, dtype=torch.int32)
            if rank == EVAL_RANK:
                flag[0] = stop_rule.reason_code(stop_rule.stop_decision(
                    evals, spec["target"], spec.get("extra_steps", 0), spec.get("cap_seconds"),
                    steps, every))
            dist.broadcast(flag, src=EVAL_RANK)
            stop_reason = stop_rule.reason_of(int(flag.item()))
            if stop_reason is not None:
                if rank == EVAL_RANK:
                    log("%s: stopped after step %d (%s)" % (spec["config"], step, stop_reason))
                break
    # Every rank's last step, for the results: the check that they all stopped after the same one.
    mine = torch.tensor([last_step], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine)
    cpu_all = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(cpu_all)
    # Every sidecar's own bytes over the timed steps (sent, received): how evenly the ranks work.
    wire = None
    if hook_state is not None:
        mine = torch.tensor([b - a for a, b in zip(wire0, sidecar_wire_bytes(hook_state))],
                            dtype=torch.float64)
        wire = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(wire, mine)
    dist.barrier()
    if rank == EVAL_RANK:
        tx = lo_tx_bytes() - tx0
        sorted_s = sorted(step_seconds)
        result = {
            "step_seconds": step_seconds, "loss": losses, "eval": evals,
            "final_loss": evals[-1]["loss"], "final_accuracy": evals[-1]["accuracy"],
            "median_step_seconds": sorted_s[len(sorted_s) // 2],
            "wire_bytes_per_step_per_rank": tx / last_step / world,
            "parameters": task.parameters(), "batch": task.batch_size,
            "task_title": task.title, "steps_run": last_step,
            "rank_steps": [int(t.item()) for t in gathered],
            "optimizer": "%s.%s" % (type(opt).__module__, type(opt).__qualname__),
            # Every trainer's CPU time in the timed steps, summed, per step.
            "trainer_cpu_seconds_per_step": float(cpu_all.item()) / last_step,
        }
        if tta:
            i = stop_rule.first_reached(evals, spec["target"])
            result["stop"] = {"reason": stop_reason, "step": last_step,
                              "target": spec["target"], "extra_steps": spec.get("extra_steps", 0),
                              "cap_seconds": spec.get("cap_seconds"), "max_steps": steps,
                              "reached_step": None if i is None else evals[i]["step"],
                              "reached_seconds": None if i is None else evals[i]["seconds"]}
        if hook_state is not None:
            result["fallbacks"] = hook_state.fallbacks
            result["direct_steps"] = sum(1 for c in carried if c["by"] == "direct")
            result["carried"] = carried
            # The share of elements sent dense over the timed steps (the hook's counters).
            total = hook_state.sidecar_elements - elements0[0]
            result["dense_share"] = ((hook_state.dense_elements - elements0[1]) / total
                                     if total else None)
            reply = hook_state.last_reply or {}
            result["sidecar"] = {k: reply.get(k) for k in ("codec", "ratio", "mode", "device")}
            result["sidecar_wire_bytes"] = {"sent": [float(t[0]) for t in wire],
                                            "received": [float(t[1]) for t in wire]}
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out_path + ".tmp", out_path)  # whole, for the parent watching for it
    if hook_state is not None:
        hook_state.close()
    # Every rank leaves together: a rank tearing gloo down while another is still writing its
    # results or closing its hook can abort the other at exit (its pair threads see the peer go).
    dist.barrier()
    dist.destroy_process_group()


def _entry(rank, spec, out_path):
    # A hung run is killed by e2e.py after SIGUSR1, which makes every rank print its stacks.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        train(rank, spec, out_path)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # noqa: the other ranks are stuck in collectives: the parent kills them


def rank_context():
    """The multiprocessing context the ranks start from: a fork server that imported torch once
    (the parent does not need it), so each rank is a fresh process as with "spawn" without
    importing torch again (about 2 CPU-seconds a rank)."""
    import multiprocessing
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel"])
    return ctx


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    ctx = rank_context()
    procs = [ctx.Process(target=_entry, args=(r, spec, argv[2])) for r in range(spec["world_size"])]
    for p in procs:
        p.start()
    failed = None
    written = None  # when rank 0 wrote the results
    # A rank that fails leaves the others waiting in a collective: stop them all. Ranks that do
    # not exit once the results are written (a hang in the process group's teardown) are
    # stopped too: their work is done.
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(0.2)
            if p.exitcode not in (None, 0) and failed is None:
                failed = p
        if written is None and os.path.exists(argv[2]):
            written = time.monotonic()
        if failed is not None or (written is not None and time.monotonic() - written > 30):
            if failed is None:
                log("the trainers did not exit 30 s after writing their results: stopped")
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGUSR1)  # where they hang, for the log
                time.sleep(1)
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
    for p in procs:
        p.join()
    if failed is not None:
        log("rank %d exited with %s" % (procs.index(failed), failed.exitcode))
        return 1
    return 0 if os.path.exists(argv[2]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
