"""The training tasks of the end-to-end benchmark (bench/e2e/tasks.py): sizes, determinism, and
that a few optimiser steps learn something. CPU only, a few seconds."""

import importlib.util
import math
import os

import pytest

torch = pytest.importorskip("torch")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TASKS_PY = os.path.join(REPO, "bench", "e2e", "tasks.py")


def _load():
    spec = importlib.util.spec_from_file_location("e2e_tasks", TASKS_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tasks = _load()


def _nparams(model):
    return sum(p.numel() for p in model.parameters())


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", ["mlp", "lm"])
def test_smoke_task(name):
    task = tasks.make_task(name, "smoke", seed=3)
    assert task.name == name and task.title and task.batch_size > 0
    assert task.has_accuracy == (name == "mlp")

    torch.manual_seed(7)
    model = task.model()
    assert task.parameters() == _nparams(model)
    torch.manual_seed(7)
    assert _same_state(model, task.model()), "model() is not deterministic under torch.manual_seed"

    # Batches: deterministic in (seed, rank, step), also across task instances; differ per rank
    # and per step; sized batch_size.
    x, y = task.batch(0, 5)
    assert x.shape[0] == y.shape[0] == task.batch_size
    x2, y2 = tasks.make_task(name, "smoke", seed=3).batch(0, 5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, task.batch(1, 5)[0]), "ranks get the same data"
    assert not torch.equal(x, task.batch(0, 6)[0]), "steps get the same data"
    assert not torch.equal(x, tasks.make_task(name, "smoke", seed=4).batch(0, 5)[0])

    # evaluate: finite, restores the training mode, deterministic.
    model.train()
    ev = task.evaluate(model)
    assert model.training
    assert math.isfinite(ev["loss"])
    if task.has_accuracy:
        assert 0.0 <= ev["accuracy"] <= 1.0
    else:
        assert ev["accuracy"] is None
    assert task.evaluate(model) == ev

    # A few optimiser steps on one fixed batch lower the training loss on it.
    opt = task.optimizer(model.parameters())
    first = None
    for _ in range(20):
        opt.zero_grad()
        loss = task.loss(model, x, y)
        assert loss.dim() == 0 and math.isfinite(loss.item())
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
    assert task.loss(model, x, y).item() < 0.9 * first


def test_lm_eval_mode_matches_train_mode():
    """Dropout is off, so eval() and train() compute the same loss (no inference fast path)."""
    task = tasks.make_task("lm", "smoke")
    torch.manual_seed(0)
    model = task.model()
    x, y = task.batch(0, 0)
    with torch.no_grad():
        train_loss = task.loss(model, x, y).item()
        model.eval()
        eval_loss = task.loss(model, x, y).item()
    assert abs(train_loss - eval_loss) < 1e-5


def test_full_sizes():
    mlp = tasks.make_task("mlp")
    assert abs(mlp.parameters() - 5.3e6) <= 0.1 * 5.3e6
    assert mlp.batch_size == 64
    lm = tasks.make_task("lm")
    assert 3e6 <= lm.parameters() <= 5e6
    torch.manual_seed(0)
    assert lm.parameters() == _nparams(lm.model())


def test_unknown():
    with pytest.raises(ValueError):
        tasks.make_task("cnn")
    with pytest.raises(ValueError):
        tasks.make_task("mlp", "huge")


def _ddp_worker(rank, world, store, name, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    try:
        task = tasks.make_task(name, "smoke")
        torch.manual_seed(0)
        net = DDP(task.model())  # find_unused_parameters=False: every parameter must get a grad
        opt = task.optimizer(net.parameters())
        for step in range(3):
            x, y = task.batch(rank, step)
            opt.zero_grad()
            task.loss(net, x, y).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        if rank == 0:
            task.evaluate(net)  # on one rank only: must not run a collective
        torch.save(flat, os.path.join(out_dir, "params-%d.pt" % rank))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["mlp", "lm"])
def test_ddp_two_ranks(name, tmp_path):
    """DDP over gloo: no unused parameters, the ranks stay equal, evaluate() on the DDP wrapper
    involves no collective (so rank 0 alone may call it)."""
    import torch.multiprocessing as mp
    from conftest import START_METHOD
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "store"), name, str(tmp_path)),
                       nprocs=2, join=True, start_method=START_METHOD)
    p0, p1 = (torch.load(str(tmp_path / ("params-%d.pt" % r))) for r in range(2))
    assert torch.equal(p0, p1)
