"""A real PyTorch DDP training run through a lightwire sidecar (the README's main job).

Starts --trainers processes (gloo, CPU) that train a small MLP classifier on a learnable synthetic
dataset; every gradient bucket goes through the sidecar via lightwire.torch.ddp_comm_hook (shared
memory, one copy in). Rank 0 prints a line every --every steps: loss, accuracy, the codec, its
compression ratio and the bytes it would send. Usage (the sidecar must be running):

    PYTHONPATH=clients/python python3 clients/python/examples/train_ddp.py --socket PATH
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
from lightwire.torch import LightwireHookState, ddp_comm_hook


def make_data(seed, n=4096, dim=64, classes=8):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 0.35
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + torch.randn(n, dim, generator=g)
    return x, labels


def train(rank, args, store_path):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=args.trainers)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 8))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    state = LightwireHookState(client=lightwire.Client(socket_path=args.socket, timeout=30.0),
                               process_group=dist.group.WORLD)
    ddp.register_comm_hook(state, ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    x, y = make_data(seed=rank)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(100 + rank)
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, x.shape[0], (args.batch,), generator=g)
        opt.zero_grad()
        out = ddp(x[idx])
        loss = loss_fn(out, y[idx])
        loss.backward()
        opt.step()
        if rank == 0 and (step % args.every == 0 or step == 1):
            with torch.no_grad():
                acc = (ddp(x).argmax(1) == y).float().mean().item()
            r = state.last_reply or {}
            print(f"step {step:4d}  loss {loss.item():.4f}  acc {acc:.3f}  "
                  f"codec {r.get('codec', '-')}  ratio {r.get('ratio', 0):.1f}  "
                  f"bytes {r.get('raw_bytes', 0)} -> {r.get('wire_bytes', 0)}  "
                  f"fallbacks {state.fallbacks}  ({time.monotonic() - t0:.1f} s)", flush=True)
            state.client.report(step, loss=loss.item(), trainer=0)
    dist.barrier()
    state.close()  # releases and unlinks the shared-memory segments
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=os.environ.get("LIGHTWIRE_SOCKET"))
    p.add_argument("--trainers", type=int, default=2, help="local trainer processes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(train, args=(args, os.path.join(d, "store")), nprocs=args.trainers, join=True)


if __name__ == "__main__":
    main()
