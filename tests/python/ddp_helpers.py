"""A small learnable task trained with DDP (gloo, CPU), with or without the lightwire hook."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 300
LR = 0.2
SEED = 0


def init_pg(store_dir, rank=0, world_size=1):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = os.path.join(str(store_dir), "store-%d" % os.getpid() if world_size == 1 else "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world_size)


def _rank_with_stacks(rank, fn, *args):
    """A trainer process: fn(rank, *args), its threads' Python stacks written to its standard
    error on SIGUSR1 (run_ranks asks for them before it kills a process that overran)."""
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fn(rank, *args)


def run_ranks(fn, args, nprocs, timeout_s):
    """Runs fn(rank, *args) in `nprocs` trainer processes and waits for them; returns None when
    they all ended within `timeout_s`, else writes the Python stacks of the ones left to standard
    error (with LW_GDB_ON_HANG=1 also gdb's native stacks), kills them and returns what to fail
    with."""
    import signal
    import time
    import torch.multiprocessing as mp
    from conftest import START_METHOD
    ctx = mp.start_processes(_rank_with_stacks, args=(fn,) + tuple(args), nprocs=nprocs,
                             join=False, start_method=START_METHOD)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            left = [p for p in ctx.processes if p.is_alive()]
            for p in left:
                os.kill(p.pid, signal.SIGUSR1)
            time.sleep(2)
            if os.environ.get("LW_GDB_ON_HANG"):  # and their native stacks, where gdb is
                import subprocess
                for p in left:
                    subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "thread apply all bt"],
                                   stdout=sys.stderr, stderr=subprocess.STDOUT, timeout=60)
            for p in left:
                p.kill()
            return "%d trainer processes still running after %d s (their stacks: standard error)" % (
                len(left), timeout_s)
    return None


def destroy_pg():
    if dist.is_initialized():
        dist.destroy_process_group()


def task(rank=0, world_size=1, seed=SEED):
    """Regression of a smooth function with a 16-64-1 MLP; each rank holds an equal shard."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(512, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.sin(X @ w) + 0.5 * X[:, :1] ** 2
    n = X.shape[0] // world_size
    return X[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def model(seed=SEED, hidden=(64,)):
    """An MLP 16-hidden...-1 with tanh between its layers."""
    torch.manual_seed(seed)
    widths, layers = (16,) + tuple(hidden), []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 1))


MANY_BUCKETS = (4096, 64)  # with bucket_cap_mb=0.01: 3 buckets from the second iteration on


def sgd_step(net, opt, X, y):
    """One full-batch step of MSE regression; returns the loss before it."""
    import torch.nn.functional as F
    opt.zero_grad()
    loss = F.mse_loss(net(X), y)
    loss.backward()
    opt.step()
    return loss.item()


def train(state=None, steps=STEPS, rank=0, world_size=1, on_step=None, bucket_cap_mb=25,
          hidden=(64,)):
    """Full-batch SGD (no momentum) on this rank's shard; returns (losses, final parameters).
    ``on_step(i)`` runs before step i. ``state``: a hook state, or a function of the DDP model
    returning one (a per-layer state needs the model). ``hidden``: the MLP's hidden widths
    (``MANY_BUCKETS`` with a small ``bucket_cap_mb`` gives DDP several buckets once it rebuilds
    them after the first iteration, whose first bucket holds at least 1 MB)."""
    import lightwire.torch as lwt
    torch.manual_seed(SEED)
    X, y = task(rank, world_size)
    net = DDP(model(hidden=hidden), bucket_cap_mb=bucket_cap_mb)
    if callable(state):
        state = state(net)
    if state is not None:
        net.register_comm_hook(state, lwt.ddp_comm_hook)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        opt.zero_grad()
        loss = F.mse_loss(net(X), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return losses, params
