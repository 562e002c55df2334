"""Buckets in flight (docs/api.md "Buckets in flight"): steps sent with their place in a stream run
in that order on every sidecar, whatever order they arrive in; a cancelled place holds up nothing;
the DDP hook sends several buckets at once through real sidecars and still matches plain DDP; two
hook states in one process number apart."""

import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import lightwire  # noqa: E402
import lightwire.torch as lwt  # noqa: E402
from lightwire._shm import ShmSegment  # noqa: E402
import ddp_helpers as H  # noqa: E402

N = 4096  # elements per tensor: above the chunk size, so the ring has several owners


def _cluster(tmp_path_factory, job, peer_timeout=3):
    from conftest import Cluster, _serve_available
    ok, reason = _serve_available()
    if not ok:
        pytest.skip(reason)
    cl = Cluster(tmp_path_factory, 2, codec="none", peer_timeout=peer_timeout, job_id=job)
    cl.start()
    return cl


class _Rank(object):
    """One trainer's view of its sidecar: a registered segment per tensor."""

    def __init__(self, sidecar, rank, names):
        self.client = lightwire.Client(socket_path=sidecar.socket, timeout=(2.0, 30.0))
        self.segments = {}
        for i, name in enumerate(names):
            seg = ShmSegment(N * 4)
            self.client.register_buffer(seg)
            view = torch.frombuffer(seg.buf, dtype=torch.float32, count=N)
            view.copy_(torch.full((N,), float(10 * rank + i + 1)))
            self.segments[name] = (seg, view)

    def send(self, name, step, order, results, delay=0.0):
        """In a thread of its own: the tensor's request (after `delay`), its outcome into
        results[name]."""
        def run():
            time.sleep(delay)
            client = lightwire.Client(socket_path=self.client.socket_path, timeout=(2.0, 30.0))
            t0 = time.monotonic()
            try:
                client.emit_gradient_shm(self.segments[name][0], name=name, step=step,
                                         order=order)
                results[name] = ("ok", time.monotonic() - t0)
            except lightwire.LightwireError as e:
                results[name] = (e, time.monotonic() - t0)
            finally:
                client.close()
        t = threading.Thread(target=run)
        t.start()
        return t

    def close(self):
        for seg, _ in self.segments.values():
            self.client.release_buffer(seg.buffer_id)
            seg.close()
        self.client.close()


def _opposite_orders(cluster, ordered):
    """Rank 0 sends b then (0.3 s later) a; rank 1 sends a then b. Returns each rank's results."""
    ranks = [_Rank(cluster[r], r, ["a", "b"]) for r in range(2)]
    results = [{}, {}]
    place = (lambda p: ("s", 0, p)) if ordered else (lambda p: None)
    threads = [ranks[0].send("b", 0, place(1), results[0]),
               ranks[0].send("a", 0, place(0), results[0], delay=0.3),
               ranks[1].send("a", 0, place(0), results[1]),
               ranks[1].send("b", 0, place(1), results[1], delay=0.3)]
    for t in threads:
        t.join(60)
    values = [{n: ranks[r].segments[n][1].clone() for n in ("a", "b")} for r in range(2)]
    for r in ranks:
        r.close()
    return results, values


def test_steps_sent_in_opposite_orders_run_in_their_places_on_every_sidecar(tmp_path_factory):
    cl = _cluster(tmp_path_factory, "inflight-order")
    try:
        results, values = _opposite_orders(cl, ordered=True)
        for r in range(2):
            for name in ("a", "b"):
                assert results[r][name][0] == "ok", (r, name, results[r][name], cl.stderr())
                # The mean of the two ranks' values (1 and 11 for a, 2 and 12 for b).
                want = 6.0 if name == "a" else 7.0
                assert torch.equal(values[r][name], torch.full((N,), want))
            # Neither waited for an exchange deadline (peer.timeout_s 3 s).
            assert max(t for _, t in results[r].values()) < 2.5, results
    finally:
        cl.kill_all()


def test_without_places_opposite_orders_wait_for_each_other_until_the_deadline(tmp_path_factory):
    """The same requests without `order`: each sidecar runs the first to arrive, and the two wait
    for each other until peer.timeout_s -- what the places are for."""
    cl = _cluster(tmp_path_factory, "inflight-none")
    try:
        results, _ = _opposite_orders(cl, ordered=False)
        failed = [(r, n) for r in range(2) for n in ("a", "b") if results[r][n][0] != "ok"]
        assert failed, results
        assert max(results[r][n][1] for r, n in failed) >= 2.5, results
    finally:
        cl.kill_all()


def test_a_cancelled_place_fails_its_step_everywhere_at_once_and_holds_up_nothing(
        tmp_path_factory):
    cl = _cluster(tmp_path_factory, "inflight-cancel", peer_timeout=10)
    try:
        ranks = [_Rank(cl[r], r, ["a", "b"]) for r in range(2)]
        results = [{}, {}]
        # Rank 1 sends both places; rank 0 sends only position 1 and cancels position 0 (its
        # trainer failed before sending it).
        threads = [ranks[1].send("a", 0, ("s", 0, 0), results[1]),
                   ranks[1].send("b", 0, ("s", 0, 1), results[1]),
                   ranks[0].send("b", 0, ("s", 0, 1), results[0])]
        time.sleep(0.3)
        assert ranks[0].client.cancel(("s", 0, 0), name="a", step=0) is True
        for t in threads:
            t.join(60)
        assert results[0]["b"][0] == "ok", (results, cl.stderr())
        assert results[1]["b"][0] == "ok", (results, cl.stderr())
        err, took = results[1]["a"]
        assert isinstance(err, lightwire.LightwireError), results
        assert err.status == 502 and "cancelled" in err.message, err
        assert took < 5.0, took  # told at once, not at peer.timeout_s (10 s)
        assert torch.equal(ranks[0].segments["b"][1], torch.full((N,), 7.0))
        # The place has passed: cancelling it again changes nothing.
        assert ranks[0].client.cancel(("s", 0, 0)) is False
        for r in ranks:
            r.close()
    finally:
        cl.kill_all()


WORLD = 2
STEPS = 40


def _train(states, rank):
    """Two models in one process (an actor and a critic, say), each with its own hook state,
    stepped one after the other; 3 buckets per model per iteration once DDP rebuilt them."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    X, y = H.task(rank, WORLD)
    nets = []
    for k, state in enumerate(states):
        net = DDP(H.model(seed=k, hidden=H.MANY_BUCKETS), bucket_cap_mb=0.01)
        if state is not None:
            net.register_comm_hook(state, lwt.ddp_comm_hook)
        nets.append((net, torch.optim.SGD(net.parameters(), lr=0.05)))
    losses = []
    for _ in range(STEPS):
        for net, opt in nets:
            losses.append(H.sgd_step(net, opt, X, y))
    return losses


def _trainer(rank, store_dir, sockets, out_dir):
    H.init_pg(store_dir, rank=rank, world_size=WORLD)
    out = {}
    try:
        out["plain"] = _train([None, None], rank)
        states = [lwt.LightwireHookState(client=lightwire.Client(socket_path=sockets[rank],
                                                                 timeout=(2.0, 20.0)),
                                         name_prefix=prefix, max_workers=4)
                  for prefix in ("actor", "critic")]
        twin = lwt.LightwireHookState(client=states[0].client, name_prefix="actor")
        out["streams"] = [s.stream for s in states] + [twin.stream]
        twin.close()
        try:
            out["sidecar"] = _train(states, rank)
        finally:
            for s in states:
                s.close()
        out["fallbacks"] = sum(s.fallbacks for s in states)
        out["sidecar_steps"] = sum(s.sidecar_steps for s in states)
        out["errors"] = [repr(s.last_error) for s in states if s.last_error is not None]
    finally:
        torch.save(out, os.path.join(out_dir, "rank%d.pt" % rank))
        H.destroy_pg()


def test_ddp_hook_with_buckets_in_flight_follows_plain_ddp(tmp_path_factory):
    """2 DDP ranks, each with its own sidecar; two models per process with their own hook states
    (streams "actor" and "critic"), 3 buckets each per iteration sent by 4 threads at once."""
    cl = _cluster(tmp_path_factory, "inflight-ddp", peer_timeout=10)
    tmp = tmp_path_factory.mktemp("inflight")
    try:
        store = tmp / "store"
        store.mkdir()
        failed = H.run_ranks(_trainer, (str(store), [sc.socket for sc in cl.sidecars], str(tmp)),
                             WORLD, 150)
        if failed:
            pytest.fail("DDP %s; sidecars:\n%s" % (failed, cl.stderr()))
        r = [torch.load(str(tmp / ("rank%d.pt" % i))) for i in range(WORLD)]
        for i in range(WORLD):
            assert r[i]["errors"] == [] and r[i]["fallbacks"] == 0, (r[i], cl.stderr())
            assert r[i]["streams"] == ["actor", "critic", "actor/1"]
            # 2 models x (1 bucket in the first iteration, 3 from the second on).
            assert r[i]["sidecar_steps"] == 2 * (1 + 3 * (STEPS - 1))
            assert max(abs(a - b) for a, b in zip(r[i]["plain"], r[i]["sidecar"])) < 1e-5
        cl.stop()
    finally:
        cl.kill_all()
