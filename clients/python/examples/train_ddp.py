"""A real PyTorch DDP training run through lightwire sidecars (the README's main job).

Starts --trainers processes (gloo, CPU) that train a small MLP classifier on a learnable synthetic
dataset; every gradient bucket goes through a sidecar via lightwire.torch.ddp_comm_hook (shared
memory, one copy in). With one socket all trainers share one sidecar (local trainers of one
node); with one socket per trainer each trainer has its own sidecar (one node each, the sidecars
exchange over TCP). Rank 0 prints a line every --every steps: loss, accuracy, the codec, its
compression ratio, the bytes sent per step and the step time. With --compare the same training
then runs as plain DDP (no compression) and the two are compared. With --to-baseline-loss, plain
DDP runs first (--steps) and lightwire then trains until its loss reaches DDP's final loss (the
mean of the last 20 steps' losses; at most 3 × --steps): the summary says how much sooner it got
there, and how many bytes per step each sent. --hidden sets the width of the MLP's two hidden
layers (256: 85 k parameters; 1024: 1.1 M, a gradient that a 1 Gbit/s link feels). Usage
(sidecars running):

    PYTHONPATH=clients/python python3 clients/python/examples/train_ddp.py --sockets A[,B,...]

Launched by torchrun (or with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as in the
containers of docker/), it is one trainer of the job instead: this process, init_method env://,
talking to the sidecar of LIGHTWIRE_SOCKET (or --sockets), which it first waits for
(GET /readyz). One line per trainer and node:

    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master_addr HOST --master_port 29500 \
        clients/python/examples/train_ddp.py --steps 300
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import lightwire
from lightwire.torch import SGD, LightwireHookState, ddp_comm_hook, save_state


def make_data(seed, n=4096, dim=64, classes=8):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234)) * 0.35
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + torch.randn(n, dim, generator=g)
    return x, labels


def codec_summary(reply):
    """The codecs of a bucket's reply: "dgc" for a flat bucket, "dgc 3 + none 3" (layers per
    codec) for one sent per layer."""
    layers = reply.get("layers")
    if not layers:
        return reply.get("codec", "-")
    count = {}
    for layer in layers:
        count[layer["codec"]] = count.get(layer["codec"], 0) + 1
    return " + ".join("%s %d" % (c, n) for c, n in sorted(count.items()))


def make_model(hidden):
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 8))


WINDOW = 20  # losses in the running mean that --to-baseline-loss compares


def lo_tx_bytes():
    """Bytes sent on the loopback so far: in a network namespace of the run's own (the demo's
    limited link), every byte the job put on the wire."""
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def first_reached(losses, target):
    """The first step (1-based) whose running mean of the last WINDOW losses is at most target."""
    for i in range(WINDOW, len(losses) + 1):
        if sum(losses[i - WINDOW:i]) / WINDOW <= target:
            return i
    return None


def train(rank, args, init_method, sockets, results, world_size=None, target=None):
    if init_method == "env://":
        os.environ.setdefault("LOCAL_RANK", "0")  # torchrun sets it: the trainer's index on the node
    else:
        os.environ["LOCAL_RANK"] = str(rank if len(sockets) == 1 else 0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world_size or args.trainers)
    model = make_model(args.hidden)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    state = None
    if sockets:
        sock = sockets[0] if len(sockets) == 1 else sockets[rank]
        client = lightwire.Client(socket_path=sock, timeout=60.0)
        # The sidecar may still be starting or waiting for its peers (containers start together).
        client.wait_ready(timeout=args.ready_timeout,
                          progress=lambda line: print("trainer %d: %s" % (rank, line), flush=True))
        state = LightwireHookState(client=client, process_group=dist.group.WORLD, module=ddp)
        ddp.register_comm_hook(state, ddp_comm_hook)
    if state is not None:
        # Momentum SGD that leaves momentum to the sidecar where it applies it (dgc's momentum
        # correction) and keeps it everywhere else (docs/codecs.md "Momentum with dgc").
        opt = SGD(ddp.parameters(), lr=args.lr, momentum=0.9, hook_state=state)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    x, y = make_data(seed=rank)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(100 + rank)
    tx0 = lo_tx_bytes()
    t0 = t_window = time.monotonic()
    wire = raw = 0
    label = "lightwire" if sockets else "plain DDP"
    losses, times = [], []
    shown = 0.0  # seconds spent on the progress lines (their accuracy): not training
    steps = args.steps if target is None else 3 * args.steps
    for step in range(1, steps + 1):
        step_start = time.monotonic()
        idx = torch.randint(0, x.shape[0], (args.batch,), generator=g)
        opt.zero_grad()
        loss = loss_fn(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if state is not None and state.last_reply:
            wire += state.last_reply.get("wire_bytes", 0)
            raw += state.last_reply.get("raw_bytes", 0)
        if state is not None:
            # The loss feeds the sidecars' rollback policy (docs/policies.md). A sidecar that is
            # away (restarting) misses it: training goes on, as the hook's fallback does.
            try:
                state.client.report(step, loss=loss.item(), trainer=0)
            except lightwire.LightwireError:
                pass
        if args.min_step_seconds > 0:  # a pace of at most one step per min_step_seconds
            time.sleep(max(0.0, step_start + args.min_step_seconds - time.monotonic()))
        losses.append(loss.item())
        times.append(time.monotonic() - t0 - shown)
        if target is not None and step % 5 == 0:
            # Rank 0 decides whether the target is reached (by the windows ending since the last
            # check: the earlier ones were checked then); every rank stops after the same step.
            recent = losses[-(WINDOW + 4):]
            flag = torch.tensor([1 if rank == 0 and first_reached(recent, target) else 0])
            dist.broadcast(flag, src=0)
            if flag.item():
                break
        if rank == 0 and args.every and (step % args.every == 0 or step == 1):
            t_shown = time.monotonic()
            with torch.no_grad():
                acc = (ddp(x).argmax(1) == y).float().mean().item()
            now = time.monotonic()
            n = 1 if step == 1 else args.every
            ms = (now - t_window) / n * 1e3
            t_window = now
            dense = sum(q.numel() * q.element_size() for q in model.parameters())
            r = (state.last_reply or {}) if state else {"codec": "dense", "wire_bytes": dense}
            print(f"{label:9s}  step {step:4d}  loss {loss.item():.4f}  acc {acc:.3f}  "
                  f"codec {codec_summary(r):14s}  mode {r.get('mode', '-'):10s}  "
                  f"ratio {r.get('ratio', 1.0):6.1f}  "
                  f"payload/step {r.get('wire_bytes', 0):8d} B  step {ms:6.1f} ms", flush=True)
            shown += time.monotonic() - t_shown
    if rank == 0 and state is not None:
        # Next to torch.save: every sidecar keeps its codec and policy state as of this step.
        try:
            reply = save_state(state.last_step, hook_state=state)
            print(f"{label:9s}  sidecar state saved with the model: {reply.get('path')} "
                  f"(peers: {reply.get('peers')})", flush=True)
        except lightwire.LightwireError as e:
            print(f"{label:9s}  sidecar state not saved: {e}", flush=True)
    if rank == 0:
        with torch.no_grad():
            acc = (ddp(x).argmax(1) == y).float().mean().item()
        results.put({"label": label, "loss": loss.item(), "acc": acc,
                     "seconds": time.monotonic() - t0, "raw": raw, "wire": wire,
                     "fallbacks": state.fallbacks if state else 0, "losses": losses,
                     "tx": lo_tx_bytes() - tx0,
                     "times": times, "steps": len(losses),
                     "dense": sum(q.numel() * q.element_size() for q in model.parameters())})
    dist.barrier()
    if state:
        state.close()  # releases and unlinks the shared-memory segments
    dist.destroy_process_group()


def run(args, sockets, target=None):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "store")
        procs = [ctx.Process(target=train, args=(r, args, init, sockets, results, None, target))
                 for r in range(args.trainers)]
        for p in procs:
            p.start()
        out = results.get(timeout=3600)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"trainer exited with {p.exitcode}")
    return out


class _Printer(object):
    """The results "queue" of one trainer launched by torchrun: rank 0 prints its line."""

    def put(self, r):
        print("\n%s: final loss %.4f  acc %.3f  %.1f s  %d fallbacks%s" % (
            r["label"], r["loss"], r["acc"], r["seconds"], r["fallbacks"],
            ("  compression %.1fx" % (r["raw"] / max(r["wire"], 1))) if r["raw"] else ""),
            flush=True)


def run_one(args, sockets):
    """One trainer of a torchrun-style job: RANK, WORLD_SIZE (and MASTER_ADDR/PORT) set."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 <= rank < world:
        raise SystemExit("RANK=%d is not below WORLD_SIZE=%d" % (rank, world))
    if len(sockets) > 1:
        raise SystemExit("launched by torchrun: one sidecar socket (--sockets or LIGHTWIRE_SOCKET)")
    # No socket: plain DDP, as --compare's baseline (LIGHTWIRE_SOCKET unset).
    train(rank, args, "env://", sockets, _Printer(), world_size=world)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sockets", default=os.environ.get("LIGHTWIRE_SOCKET", ""),
                   help="sidecar socket(s), comma-separated: one shared, or one per trainer")
    p.add_argument("--trainers", type=int, default=2, help="trainer processes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    p.add_argument("--compare", action="store_true", help="then train plain DDP and compare")
    p.add_argument("--to-baseline-loss", action="store_true",
                   help="plain DDP first; then lightwire until it reaches DDP's final loss")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the sidecar's GET /readyz")
    p.add_argument("--min-step-seconds", type=float, default=0.0,
                   help="a step takes at least this long (sleeping the rest): training that "
                        "lasts a known time however fast the machine (the container test)")
    args = p.parse_args()
    if args.min_step_seconds < 0:
        p.error("--min-step-seconds must be >= 0")
    sockets = [s for s in args.sockets.split(",") if s]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_one(args, sockets)
    if not sockets:
        raise SystemExit("give --sockets (or LIGHTWIRE_SOCKET)")
    if len(sockets) not in (1, args.trainers):
        raise SystemExit("--sockets: one socket, or one per trainer")
    if args.to_baseline_loss:
        return to_baseline_loss(args, sockets)
    ours = run(args, sockets)
    rows = [ours]
    if args.compare:
        print("\nthe same training without compression (plain DDP over gloo):", flush=True)
        rows.append(run(args, []))
    print("\n%-10s %10s %8s %10s %14s %10s" % ("run", "final loss", "acc", "time s",
                                               "payload/step B", "fallbacks"))
    for r in rows:
        sent = r["wire"] / r["steps"] if r["label"] == "lightwire" else r["dense"]
        print("%-10s %10.4f %8.3f %10.1f %14d %10d" % (r["label"], r["loss"], r["acc"],
                                                        r["seconds"], sent, r["fallbacks"]))
    if ours["raw"]:
        print("\ncompression: %.1fx fewer bytes per step than the dense gradient"
              % (ours["raw"] / max(ours["wire"], 1)))


def to_baseline_loss(args, sockets):
    """Plain DDP for --steps, then lightwire until its loss reaches DDP's final loss."""
    print("plain DDP (the baseline: every gradient sent dense over gloo), %d steps:" % args.steps,
          flush=True)
    ddp = run(args, [])
    target = sum(ddp["losses"][-WINDOW:]) / WINDOW
    ddp_step = first_reached(ddp["losses"], target)
    ddp_s = ddp["times"][ddp_step - 1]
    print("\nplain DDP's final loss: %.4f (mean of its last %d steps), first reached at step %d "
          "after %.1f s" % (target, WINDOW, ddp_step, ddp_s), flush=True)
    print("\nlightwire, until its loss reaches %.4f (at most %d steps):" % (target, 3 * args.steps),
          flush=True)
    ours = run(args, sockets, target=target)
    ours_step = first_reached(ours["losses"], target)
    # Every byte on the namespace's link (the job's only traffic), per node and step.
    sent = {r["label"]: r["tx"] / max(r["steps"], 1) / args.trainers for r in (ddp, ours)}
    per_step = sent["lightwire"]
    print("\n%-10s %22s %12s %18s" % ("run", "reached %.4f at step" % target, "after s",
                                       "sent B/node/step"))
    print("%-10s %22d %12.1f %18d" % ("plain DDP", ddp_step, ddp_s, sent["plain DDP"]))
    if ours_step is None:
        print("%-10s %22s %12s %18d" % ("lightwire", "not within %d" % ours["steps"], "-",
                                        per_step))
        print("\nlightwire did not reach plain DDP's final loss within %d steps (its loss: %.4f)"
              % (ours["steps"], sum(ours["losses"][-WINDOW:]) / WINDOW))
        return 1
    ours_s = ours["times"][ours_step - 1]
    print("%-10s %22d %12.1f %18d" % ("lightwire", ours_step, ours_s, per_step))
    print("\nlightwire reached plain DDP's final loss %.1fx sooner (%.1f s against %.1f s), "
          "sending %.0fx fewer bytes per step%s" % (
              ddp_s / ours_s, ours_s, ddp_s, sent["plain DDP"] / max(per_step, 1),
              (", %d fallbacks" % ours["fallbacks"]) if ours["fallbacks"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
