"""codec auto with real DDP trainers (gloo) and 3 sidecars on loopback (docs/policies.md "codec:
auto"): the rungs are decided alike on every sidecar from the link their exchanges measure and the
compute the hooks report; on an unlimited loopback every layer is best exchanged dense, so the job
takes the `direct` rung (the trainers' own process group) in windows, and the training follows
plain DDP."""

import os

import pytest

torch = pytest.importorskip("torch")

import lightwire  # noqa: E402
import lightwire.torch as lwt  # noqa: E402
import ddp_helpers as H  # noqa: E402

WORLD = 3
STEPS = 60
HIDDEN = (128, 128)  # a 128 x 128 layer (16 Ki elements): above the layers kept dense
# Decisions every 2 steps; the job tries direct once (not measured yet, and every rung lossless)
# and takes it again when measured twice as fast as the sidecars' rungs (tolerance 1: on this
# loopback the 16 Ki-element layer's exchange is latency-bound); both rungs are lossless.
AUTO = ["--auto-period", "2", "--auto-hysteresis", "1", "--auto-critical-steps", "0",
        "--auto-probe-every", "8", "--auto-tolerance", "1", "--auto-ladder", "direct,none"]


def _train(socket, rank, steps, out):
    """Trains with plain DDP (socket None) or through the sidecar at `socket` (the hook's state
    goes to out["state"])."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    X, y = H.task(rank, WORLD)
    net = DDP(H.model(hidden=HIDDEN), bucket_cap_mb=0.02)
    if socket is not None:
        out["state"] = lwt.LightwireHookState(
            client=lightwire.Client(socket_path=socket, timeout=(2.0, 20.0)), module=net)
        net.register_comm_hook(out["state"], lwt.ddp_comm_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        losses.append(H.sgd_step(net, opt, X, y))
    return losses


def _trainer(rank, store_dir, sockets, out_dir, steps):
    H.init_pg(store_dir, rank=rank, world_size=WORLD)
    out = {}
    try:
        out["plain"] = _train(None, rank, steps, {})
        made = {}
        try:
            out["auto"] = _train(sockets[rank], rank, steps, made)
        finally:
            if "state" in made:
                made["state"].close()
        state = made["state"]
        out.update(fallbacks=state.fallbacks, direct_steps=state.direct_steps,
                   sidecar_steps=state.sidecar_steps, last_reply=state.last_reply)
        torch.save(out, os.path.join(out_dir, "rank%d.pt" % rank))
    finally:
        H.destroy_pg()


def _status(sc):
    return lightwire.Client(socket_path=sc.socket).status()


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    from conftest import Cluster, _serve_available
    ok, reason = _serve_available()
    if not ok:
        pytest.skip(reason)
    tmp_path = tmp_path_factory.mktemp("auto")
    cl = Cluster(tmp_path_factory, WORLD, codec="auto", codec_args=AUTO, peer_timeout=10,
                 job_id="auto-direct")
    try:
        cl.start()
        store = tmp_path / "store"
        store.mkdir()
        failed = H.run_ranks(_trainer, (str(store), [sc.socket for sc in cl.sidecars],
                                        str(tmp_path), STEPS), WORLD, 150)
        if failed:
            pytest.fail("DDP %s; sidecars:\n%s" % (failed, cl.stderr()))
        r = [torch.load(str(tmp_path / ("rank%d.pt" % i))) for i in range(WORLD)]
        statuses = [_status(sc) for sc in cl.sidecars]
        import subprocess
        from conftest import LIGHTWIRE_BIN
        cli = subprocess.run([LIGHTWIRE_BIN, "status", "--socket", cl.sidecars[0].socket],
                             capture_output=True, text=True, timeout=30)
        statuses[0]["cli"] = cli.stdout + cli.stderr
        cl.stop()
        return r, statuses
    finally:
        cl.kill_all()


def test_direct_windows_taken_on_a_fast_link(auto_run):
    r, _ = auto_run
    for ri in r:
        assert ri["fallbacks"] == 0
        # Some steps went through the sidecars (measuring the link), the rest were direct.
        assert ri["sidecar_steps"] > 0 and ri["direct_steps"] > 0
    assert len({(ri["direct_steps"], ri["sidecar_steps"]) for ri in r}) == 1


def test_training_follows_plain_ddp(auto_run):
    r, _ = auto_run
    for ri in r:
        # Every rung taken here is lossless (direct, none): the same losses up to summation order.
        assert max(abs(a - b) for a, b in zip(ri["plain"], ri["auto"])) < 1e-4
        assert ri["auto"][-1] < 0.8 * ri["auto"][0]


def test_decisions_identical_on_every_sidecar(auto_run):
    _, statuses = auto_run
    logs = [[(d["seq"], d["step"], d["tensor"], d["kind"]) for d in s["policies"]["log"]]
            for s in statuses]
    assert logs[0] and all(log == logs[0] for log in logs)
    assert any(kind == "direct" for _, _, _, kind in logs[0])
    rungs = [{k: v["rung"] for k, v in s["policies"]["auto"]["layers"].items()} for s in statuses]
    assert rungs[0] and all(x == rungs[0] for x in rungs)
    # The layer's explanation names its inputs.
    text = next(iter(statuses[0]["policies"]["auto"]["layers"].values()))["text"]
    assert "link" in text and "MB/s" in text and "compute" in text
    # `lightwire status` prints the direct window and each layer's explanation.
    assert "auto     direct window" in statuses[0]["cli"]
    assert text in statuses[0]["cli"]


def test_the_hook_reports_no_tail_from_before_a_direct_window():
    """The tail the hook reports is of the last iteration through the sidecars: after a direct
    window, the first request carries none (not the figure from before the window)."""
    s = lwt.LightwireHookState(client=lightwire.Client(socket_path="/nonexistent"))
    s._http.shutdown(wait=False)
    s._ordered.shutdown(wait=False)
    s._launched(0, 100, True)
    s._ended()                    # an iteration through the sidecars: its tail
    s._launched(0, 100, True)
    assert s._launched(0, 100, True)[3] is not None
    s._ended(direct=True)         # a direct iteration
    s._launched(0, 100, True)
    timing = s._launched(0, 100, True)
    assert timing[2] is not None  # the direct figure
    assert timing[3] is None      # no tail: none measured since the window
