"""Fault injection with real `lightwire serve` processes on 127.0.0.1 and real sockets
(docs/RELIABILITY.md "Fault injection"): a sidecar killed (kill -9) or stopped (SIGSTOP) in the
middle of a step, a sidecar killed between its answers to two local trainers, a peer connection
reset or corrupted in the middle of a frame (through `fault_relay.FaultRelay`), a trainer killed
while it holds a registered buffer.

Every wait is bounded (client timeouts, join timeouts, polling deadlines), so a hang fails the test
instead of the suite. Short peer deadlines (--peer-timeout 2) keep the file fast. Expected results
come from the numpy reference of test_exchange.py, in the documented ring order, and are compared
bit for bit: no fault may ever produce a wrong gradient.
"""

import copy
import datetime
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import CLIENT_DIR, START_METHOD, poll_until
from fault_relay import FaultRelay
from test_exchange import TENSOR, lwref, Reference, assert_bitwise, ref_cfg, run_trainers, trainer_input

import lightwire  # noqa: E402

PEER_TIMEOUT = 2      # --peer-timeout of every cluster here: the exchange's deadline, in seconds
SLACK = 3.0           # what a failure may take beyond that deadline on a loaded 2-core machine
VICTIM = 2            # the rank killed or stopped in the 3-sidecar scenarios


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def metric(sc, name, **labels):
    """The sum of the samples of `name` in sidecar `sc`'s /metrics whose labels include `labels`."""
    want = ['%s="%s"' % kv for kv in labels.items()]
    c = sc.client(timeout=(1.0, 5.0))
    try:
        text = c.metrics()
    finally:
        c.close()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and all(w in line for w in want):
            total += float(line.rsplit(None, 1)[1])
    return total


def failed_steps(sc):
    return metric(sc, "lightwire_steps_total", result="failed")


def sent_bytes(sc):
    return metric(sc, "lightwire_wire_bytes_total", direction="sent")


def wait_until(pred, timeout, what, cluster=None):
    """Polls pred() until it returns something true (returned); fails after `timeout` seconds."""
    return poll_until(what, pred, timeout, diag=lambda: "" if cluster is None else
                      "stderr:\n" + cluster.stderr())


def tensor_status(sc, name=TENSOR):
    c = sc.client(timeout=(1.0, 5.0))
    try:
        return {t["name"]: t for t in c.status()["tensors"]}.get(name)
    finally:
        c.close()


def assert_alive(cl, ranks):
    for r in ranks:
        assert cl[r].proc is not None and cl[r].proc.poll() is None, (
            "sidecar rank %d died (exit %s); stderr:\n%s" % (r, cl[r].proc and cl[r].proc.poll(), cl.stderr()))


def emit_async(cl, step, ranks, n, timeout=30.0):
    """Starts one trainer thread per rank in `ranks` emitting step `step` of TENSOR (the inputs of
    test_exchange.trainer_input); returns join() -> ({rank: result or LightwireError},
    {rank: seconds the call took})."""
    box = {}
    jobs = {(r, 0): [(step, trainer_input(cl.world_size, r, 0, step, n))] for r in ranks}
    t = threading.Thread(target=lambda: box.update(out=run_trainers(cl, jobs, timeout=timeout)), daemon=True)
    t.start()

    def join():
        t.join(timeout + 5.0)
        assert "out" in box, "the trainers of step %d did not finish; stderr:\n%s" % (step, cl.stderr())
        res, elapsed = box["out"]
        return ({r: res[(r, 0)][step] for r in ranks}, {r: elapsed[(r, 0)][step] for r in ranks})
    return join


def step_ok(cl, ref, step, n):
    """Every rank emits step `step`; every reply must equal the reference bit for bit."""
    res, _ = emit_async(cl, step, range(cl.world_size), n)()
    want = ref.step([trainer_input(cl.world_size, r, 0, step, n) for r in range(cl.world_size)], step)
    for r in range(cl.world_size):
        assert not isinstance(res[r], Exception), "step %d rank %d: %r\n%s" % (step, r, res[r], cl.stderr())
        assert_bitwise(res[r], want, "step %d rank %d" % (step, r))
    return want


def assert_step_failed(res, names, cl, elapsed=None, within=None, statuses=(502,)):
    """Every rank in `names` ({rank: text its error must contain}) got an error reply with one of
    `statuses`, naming what it must (and, with `elapsed`, within `within` seconds)."""
    for r, needle in names.items():
        e = res[r]
        assert isinstance(e, lightwire.LightwireError) and e.status in statuses, (
            "rank %d: expected a %s error, got %r\n%s" % (r, statuses, e, cl.stderr()))
        assert needle in e.message, "rank %d: %r does not name %r" % (r, e.message, needle)
        if elapsed is not None:
            assert elapsed[r] <= within, "rank %d failed after %.1f s, more than %.1f s" % (
                r, elapsed[r], within)


def wait_exchanging(cl, ranks, since, nbytes, timeout=15.0):
    """Waits until each rank in `ranks` has sent at least `nbytes` more peer bytes than
    `since[rank]` (its first data frames of the step: it is inside the exchange)."""
    wait_until(lambda: all(sent_bytes(cl[r]) >= since[r] + nbytes for r in ranks), timeout,
               "ranks %s inside the exchange" % list(ranks), cl)


def via_relay(sc, peer, port):
    """Makes `sc` reach rank `peer` at 127.0.0.1:port (a relay) instead of its real address (the
    lower rank connects, so put the relay in the lower rank's list)."""
    base = sc.args

    def args():
        a = base()
        i = a.index("--peers") + 1
        addrs = a[i].split(",")
        addrs[peer] = "127.0.0.1:%d" % port
        a[i] = ",".join(addrs)
        return a
    sc.args = args


def peers_up(cl, ranks):
    return all(metric(cl[r], "lightwire_peer_up") == cl.world_size - 1 for r in ranks)


def run_script(code, *args):
    """Starts a Python child running `code` with the lightwire client importable (argv[1:] =
    args); its stdout is a pipe."""
    env = dict(os.environ, PYTHONPATH=CLIENT_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LIGHTWIRE_SOCKET", None)
    return subprocess.Popen([sys.executable, "-c", code] + [str(a) for a in args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def read_line(proc, timeout):
    """One line of the child's stdout, within `timeout` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child printed nothing within %.0f s" % timeout
    line = proc.stdout.readline()
    assert line, "the child exited (%s) without printing" % proc.poll()
    return line.decode()


def script_result(proc, timeout):
    """The JSON document the child printed last, once it exited within `timeout` seconds."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail("child still running after %.0f s; stderr:\n%s" % (timeout, err.decode()))
    lines = out.decode().strip().splitlines()
    assert lines, "child printed nothing (exit %d); stderr:\n%s" % (proc.returncode, err.decode())
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------------------
# 1. kill -9 of one of 3 sidecars mid-step
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sparse", ["allgather", "allreduce"])
def test_kill9_mid_step_fails_survivors_keeps_their_state_then_rejoins(cluster_factory, sparse):
    """Ranks 0 and 1 are inside the exchange of step 1 (their first frames are out) when rank 2 is
    killed with SIGKILL: both fail at once (well within the deadline) with 502 naming rank 2,
    stay alive, count the failed step, and commit nothing: with topk and error feedback, step 2
    after rank 2's restart (same rank, flags and port; fresh codec state) gives exactly what a job
    that never attempted step 1 gives -- and not what it would give had the survivors committed
    their step-1 residuals. Through the ring allgather and the sparse allreduce (whose settled
    residuals must not be committed either)."""
    n, chunk, W = 12000, 4096, 3
    cl = cluster_factory(W, codec="topk", codec_args=["--density", "0.05", "--sparse", sparse],
                         chunk_elements=chunk, peer_timeout=PEER_TIMEOUT)
    cfg = ref_cfg("topk", density=0.05)
    ref = Reference(cfg, W, 1, n=n, chunk=chunk, sparse=sparse)
    step_ok(cl, ref, 0, n)
    failed0 = [failed_steps(cl[r]) for r in range(W)]
    since = [sent_bytes(cl[r]) for r in range(W)]
    join = emit_async(cl, 1, [0, 1], n)
    wait_exchanging(cl, [0, 1], since, 2000)  # a step's first hop: ~3.5 KB of payloads and records
    t_kill = time.monotonic()
    cl.kill9(VICTIM)
    res, _ = join()
    took = time.monotonic() - t_kill
    assert_step_failed(res, {0: "rank 2", 1: "rank 2"}, cl)
    assert took <= PEER_TIMEOUT + SLACK, "the survivors failed %.1f s after the kill" % took
    assert_alive(cl, [0, 1])
    for r in (0, 1):
        assert failed_steps(cl[r]) == failed0[r] + 1
        assert tensor_status(cl[r])["last_committed_step"] == 0, tensor_status(cl[r])
    cl.launch([VICTIM]).wait_ready()
    wait_until(lambda: tensor_status(cl[VICTIM]), 10, "rank 2 told the job's step state", cl)
    ref.ranks[VICTIM] = lwref.Codec(cfg, n)  # its residual died with it
    # What the survivors would return had they committed step 1 (the test's teeth).
    committed = copy.deepcopy(ref)
    for r in (0, 1):
        committed.ranks[r].step(trainer_input(W, r, 0, 1, n), "fp32", ref.chunking, ref.seed, TENSOR, 1, r,
                                None)
    inputs2 = [trainer_input(W, r, 0, 2, n) for r in range(W)]
    want2 = step_ok(cl, ref, 2, n)
    assert not np.array_equal(want2, committed.step(inputs2, 2)), "the check cannot tell the states apart"
    step_ok(cl, ref, 3, n)


# ------------------------------------------------------------------------------------------------
# 1b. The same fault under a real DDP job: every rank falls back at the same step
# ------------------------------------------------------------------------------------------------
DDP_STEPS, KILL_STEP, REJOIN_STEP = 10, 3, 6


def _touch(d, name, text=""):
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))


def _wait_file(d, name, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(d, name)):
        if time.monotonic() > deadline:
            raise TimeoutError("%s not created within %.0f s" % (name, timeout))
        time.sleep(0.02)


def _ddp_rank(rank, world, sockets, gates):
    """One DDP rank (gloo, 60 s collective timeout) training ddp_helpers' task with the lightwire
    hook (on_error="fallback"). Gates (files in `gates`) let the test act at exact points: every
    rank waits before step KILL_STEP ("go-kill") and before REJOIN_STEP ("rejoined"); the victim's
    hook holds its step-KILL_STEP bucket until the test has killed its sidecar ("killed"). Saves
    the (fallbacks, sidecar_steps) history, the error of step KILL_STEP, losses and parameters."""
    import torch
    import torch.distributed as dist
    import lightwire.torch as lwt
    import ddp_helpers as H
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="file://" + os.path.join(gates, "store"), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    state = lwt.LightwireHookState(client=lightwire.Client(socket_path=sockets[rank], timeout=(2.0, 20.0)),
                                   on_error="fallback", trainer=0)
    out = {"history": []}
    real_hook = lwt.ddp_comm_hook

    def gated_hook(st, bucket):
        if rank == VICTIM and st.steps.get(bucket.index(), st.first_step) == KILL_STEP:
            _touch(gates, "victim-holds")
            _wait_file(gates, "killed")
        return real_hook(st, bucket)

    def on_step(i):
        out["history"].append((state.fallbacks, state.sidecar_steps))
        if i == KILL_STEP:
            _touch(gates, "rank%d-at-kill" % rank)
            _wait_file(gates, "go-kill")
        if i == KILL_STEP + 1:
            _touch(gates, "rank%d-past-kill" % rank, repr(time.time()))
            out["kill_error"] = repr(state.last_error)
        if i == REJOIN_STEP:
            _touch(gates, "rank%d-at-rejoin" % rank)
            _wait_file(gates, "rejoined")

    lwt.ddp_comm_hook = gated_hook  # ddp_helpers.train registers lwt.ddp_comm_hook
    try:
        out["losses"], out["params"] = H.train(state, steps=DDP_STEPS, rank=rank, world_size=world,
                                               on_step=on_step)
        out["history"].append((state.fallbacks, state.sidecar_steps))
    finally:
        state.close()
        torch.save(out, os.path.join(gates, "rank%d.pt" % rank))
        dist.destroy_process_group()


def test_ddp_hook_falls_back_on_every_rank_at_the_same_step(cluster_factory, tmp_path):
    """3 DDP ranks (gloo), one sidecar each. At step KILL_STEP ranks 0 and 1 are inside the
    exchange while rank 2's bucket is held back; rank 2's sidecar is killed (-9). Every rank falls
    back (process group allreduce) at exactly the same steps -- identical (fallbacks,
    sidecar_steps) histories, KILL_STEP..REJOIN_STEP-1 -- within the deadline, the survivors'
    errors name rank 2, training continues (identical parameters on every rank, the loss falls);
    the restarted sidecar (same rank and flags) rejoins and every later step goes through the
    sidecars on every rank."""
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as mp
    W = 3
    # 1153 parameters in chunks of 384: every rank starts a reduction chain, so each sends a
    # data frame as soon as it is inside the exchange (wait_exchanging sees it).
    cl = cluster_factory(W, codec="none", chunk_elements=384, peer_timeout=PEER_TIMEOUT)
    gates = str(tmp_path)
    ctx = mp.start_processes(_ddp_rank, args=(W, [sc.socket for sc in cl.sidecars], gates), nprocs=W,
                             join=False, start_method=START_METHOD)
    try:
        for r in range(W):
            _wait_file(gates, "rank%d-at-kill" % r, 90)
        since = [sent_bytes(cl[r]) for r in range(W)]
        _touch(gates, "go-kill")
        _wait_file(gates, "victim-holds", 30)
        wait_exchanging(cl, [0, 1], since, 1000)
        t_kill = time.time()
        cl.kill9(VICTIM)
        _touch(gates, "killed")
        for r in range(W):
            _wait_file(gates, "rank%d-past-kill" % r, 30)
            with open(os.path.join(gates, "rank%d-past-kill" % r)) as f:
                took = float(f.read()) - t_kill
            assert took <= PEER_TIMEOUT + SLACK, "rank %d finished step %d %.1f s after the kill" % (
                r, KILL_STEP, took)
        for r in range(W):
            _wait_file(gates, "rank%d-at-rejoin" % r, 60)
        assert_alive(cl, [0, 1])
        cl.launch([VICTIM]).wait_ready()
        _touch(gates, "rejoined")
        deadline = time.monotonic() + 90
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail("DDP ranks still running after 90 s; sidecars:\n%s" % cl.stderr())
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = [torch.load(os.path.join(gates, "rank%d.pt" % r)) for r in range(W)]
    fallen = REJOIN_STEP - KILL_STEP
    want = [(0, i) for i in range(KILL_STEP + 1)] + [(k, KILL_STEP) for k in range(1, fallen + 1)] + \
           [(fallen, KILL_STEP + i) for i in range(1, DDP_STEPS - REJOIN_STEP + 1)]
    for r in range(W):
        assert out[r]["history"] == want, "rank %d: (fallbacks, sidecar_steps) before each step %r" % (
            r, out[r]["history"])
        assert torch.equal(out[r]["params"], out[0]["params"]), "rank %d trained differently" % r
        assert out[r]["losses"][-1] < out[r]["losses"][0]
    for r in (0, 1):
        assert "502" in out[r]["kill_error"] and "rank 2" in out[r]["kill_error"], out[r]["kill_error"]
    assert "SidecarUnavailable" in out[VICTIM]["kill_error"], out[VICTIM]["kill_error"]
    for r in range(W):  # every hook reported its fallbacks (the victim's once its sidecar was back)
        assert metric(cl[r], "lightwire_fallbacks_total") == fallen, r
    for r in (0, 1):  # the survivors ran and failed every step of the outage
        assert failed_steps(cl[r]) == fallen, r


# ------------------------------------------------------------------------------------------------
# 2. A sidecar with two local trainers killed between its answers
# ------------------------------------------------------------------------------------------------
TRAINER_1 = r"""
import json, sys, time
import numpy as np
import lightwire
sock, n = sys.argv[1], int(sys.argv[2])
c = lightwire.Client(socket_path=sock, timeout=(2.0, 20.0), trainer=1)
x = np.random.default_rng([1, 0]).standard_normal(n).astype(np.float32)
t0 = time.monotonic()
try:
    y = c.emit_gradient(x, "big", 0)
    print(json.dumps({"ok": True, "took": time.monotonic() - t0}))
except lightwire.LightwireError as e:
    print(json.dumps({"ok": False, "kind": type(e).__name__, "error": str(e), "took": time.monotonic() - t0}))
"""


def test_killed_between_answers_to_two_local_trainers(sidecar_factory):
    """A sidecar serving 2 local trainers is killed after it answered trainer 0 and before trainer
    1 has its answer. Deterministic: trainer 1 (a child process) sends its part, the test sees it
    pending at the sidecar (/v1/status), then SIGSTOPs trainer 1, so it cannot read its reply; the
    reply (16 MiB) is far larger than the Unix socket's buffer, so the sidecar is still writing it
    when trainer 0 has read its whole answer and the sidecar is killed. Trainer 0's answer is the
    exact mean; trainer 1, resumed, gets a connection failure (SidecarUnavailable) at once, never
    a result and never a hang."""
    n = 4 << 20
    sc = sidecar_factory(local_trainers=2, extra=["--step-timeout", "20"])
    child = run_script(TRAINER_1, sc.socket, n)
    try:
        wait_until(lambda: (tensor_status(sc, "big") or {}).get("pending_steps") == 1, 20,
                   "trainer 1's part pending")
        child.send_signal(signal.SIGSTOP)
        x0 = np.random.default_rng([0, 0]).standard_normal(n).astype(np.float32)
        x1 = np.random.default_rng([1, 0]).standard_normal(n).astype(np.float32)
        c0 = sc.client(timeout=(2.0, 20.0), trainer=0)
        try:
            y0 = c0.emit_gradient(x0, "big", 0)
        finally:
            c0.close()
        assert_bitwise(y0, (x0 + x1) * np.float32(0.5), "trainer 0's answer")
        sc.kill()
        child.send_signal(signal.SIGCONT)
        t1 = time.monotonic()
        got = script_result(child, 25)
        assert not got["ok"] and got["kind"] == "SidecarUnavailable", got
        assert time.monotonic() - t1 < 10, got
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait(10)


def test_killed_while_two_local_trainers_wait(cluster_factory):
    """Both local trainers of rank 0 (2 sidecars, 2 trainers each) have sent their part and rank
    0 is inside the exchange (waiting for rank 1, whose trainers send nothing; peer deadline 30 s)
    when rank 0 is killed: both trainers get a connection failure (SidecarUnavailable) within a
    few seconds, long before any deadline; rank 1 stays alive."""
    cl = cluster_factory(2, local_trainers=2, peer_timeout=30)
    n = 3000
    results = {}

    def trainer(t):
        c = cl[0].client(timeout=(2.0, 40.0), trainer=t)
        t0 = time.monotonic()
        try:
            results[t] = c.emit_gradient(trainer_input(2, 0, t, 0, n), TENSOR, 0)
        except lightwire.LightwireError as e:
            results[t] = e
        results[t, "took"] = time.monotonic() - t0
        c.close()

    threads = [threading.Thread(target=trainer, args=(t,), daemon=True) for t in (0, 1)]
    threads[0].start()
    wait_until(lambda: (tensor_status(cl[0]) or {}).get("pending_steps") == 1, 20, "trainer 0's part pending", cl)
    threads[1].start()
    wait_until(lambda: (tensor_status(cl[0]) or {}).get("pending_steps") == 0, 20, "the step running", cl)
    t_kill = time.monotonic()
    cl.kill9(0)
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a trainer still waits 10 s after its sidecar was killed"
    for t in (0, 1):
        assert isinstance(results[t], lightwire.SidecarUnavailable), (t, results[t])
    assert time.monotonic() - t_kill < 10
    assert_alive(cl, [1])


# ------------------------------------------------------------------------------------------------
# 3 and 4. A peer connection reset or corrupted in the middle of a frame
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def relayed_pair(cluster_factory):
    """Two sidecars (codec none) whose connection goes through a FaultRelay: rank 0 (the
    connecting side) reaches rank 1 through it. Yields (cluster, relay, reference, n)."""
    n, chunk = 1 << 20, 1 << 16
    cl = cluster_factory(2, codec="none", chunk_elements=chunk, peer_timeout=PEER_TIMEOUT, start=False)
    relay = FaultRelay(cl.ports[1]).start()
    try:
        via_relay(cl[0], 1, relay.port)
        cl.start()
        assert relay.accepted >= 1, relay.accepted
        yield cl, relay, Reference(ref_cfg("none"), 2, 1, n=n, chunk=chunk), n
    finally:
        relay.close()


def faulty_step(cl, relay, ref, step, n, names):
    """Step `step` with a fault armed on the relay: it must fire, the step must fail on both
    ranks naming the peer (`names`) within the deadline, both sidecars must stay alive and count
    it, the connection must come back (lightwire_peer_up 1 on both sides), and the step after must
    be exact."""
    failed = [failed_steps(cl[r]) for r in range(2)]
    accepted = relay.accepted
    res, elapsed = emit_async(cl, step, [0, 1], n)()
    # The steps have returned, so the fault has happened; the relay's thread may not have marked
    # it yet (it resets the sockets first, and the sidecars can answer before it runs again).
    assert relay.wait_fired(5.0), "the fault never fired: %r" % relay.log
    for r in range(2):
        assert not isinstance(res[r], np.ndarray), "rank %d got a result from a broken step" % r
    assert_step_failed(res, names, cl, elapsed, PEER_TIMEOUT + SLACK)
    assert_alive(cl, [0, 1])
    for r in range(2):
        assert failed_steps(cl[r]) == failed[r] + 1
    wait_until(lambda: relay.accepted > accepted and peers_up(cl, [0, 1]), 15, "the connection back", cl)
    step_ok(cl, ref, step + 1, n)


def test_connection_reset_mid_frame(relayed_pair):
    """The relay resets (RST) both sides of the peer connection after 1 MiB of a 4 MiB tensor's
    frames from rank 0: the step fails cleanly on both sides with 502 naming the peer, nobody
    hangs or crashes, rank 0 reconnects (a new relayed connection, lightwire_peer_up back to 1 on
    both), and the next step is exact; then the same from rank 1's side."""
    cl, relay, ref, n = relayed_pair
    step_ok(cl, ref, 0, n)
    relay.reset_after("c2s", 1 << 20)
    faulty_step(cl, relay, ref, 1, n, {0: "rank 1", 1: "rank 0"})
    relay.reset_after("s2c", 1 << 20)
    faulty_step(cl, relay, ref, 3, n, {0: "rank 1", 1: "rank 0"})


@pytest.mark.parametrize("direction", ["c2s", "s2c"])
def test_corrupted_frame_is_refused(relayed_pair, direction):
    """The relay flips one byte inside the payload of a DATA frame: the receiver's XXH3 check
    refuses the frame (its step fails with 502 and a message naming the sender and the checksum),
    the sender's step fails too (naming the receiver), no trainer ever gets a wrong gradient,
    the connection comes back and the next step is exact. (There is no dedicated metric for
    refused frames: the failed step is counted in lightwire_steps_total{result="failed"}.)"""
    cl, relay, ref, n = relayed_pair
    step_ok(cl, ref, 0, n)
    relay.flip_payload(direction, 5000)
    receiver, sender = (1, 0) if direction == "c2s" else (0, 1)
    faulty_step(cl, relay, ref, 1, n, {receiver: "checksum", sender: "rank %d" % receiver})
    assert "payload checksum mismatch" in cl[receiver].stderr()


# ------------------------------------------------------------------------------------------------
# 5. A stalled peer (SIGSTOP)
# ------------------------------------------------------------------------------------------------
def test_stalled_peer_fails_step_within_deadline_then_recovers(cluster_factory):
    """Rank 2 of 3 is stopped (SIGSTOP) before step 1; its trainer's request waits in its socket.
    Rank 1 enters the exchange first (its deadline passes first, before rank 0 can tell it
    anything), then rank 0: both fail step 1 within the deadline (+ slack) with 502 naming rank
    2 -- rank 1 waits on rank 0, its ring predecessor, yet must name the silent rank -- and stay
    alive. After SIGCONT rank 2's trainer gets an error for step 1 too (never a result: the step
    failed elsewhere), the job becomes ready again, and step 2 is exact on every rank."""
    n, W = 3000, 3
    cl = cluster_factory(W, codec="none", peer_timeout=PEER_TIMEOUT)
    ref = Reference(ref_cfg("none"), W, 1, n=n)
    step_ok(cl, ref, 0, n)
    failed = [failed_steps(cl[r]) for r in range(W)]
    since = [sent_bytes(cl[r]) for r in range(W)]
    cl[VICTIM].proc.send_signal(signal.SIGSTOP)
    try:
        victim = emit_async(cl, 1, [VICTIM], n, timeout=40.0)
        first = emit_async(cl, 1, [1], n)
        wait_exchanging(cl, [1], since, 3000)
        res, elapsed = emit_async(cl, 1, [0], n)()
        got, took = first()
        res.update(got)
        elapsed.update(took)
        assert_step_failed(res, {0: "rank 2", 1: "rank 2"}, cl, elapsed, PEER_TIMEOUT + SLACK)
        assert_alive(cl, [0, 1])
    finally:
        cl[VICTIM].proc.send_signal(signal.SIGCONT)
    res, _ = victim()
    assert isinstance(res[VICTIM], lightwire.LightwireError), "rank 2's trainer got %r" % (res[VICTIM],)
    for r in range(W):
        assert failed_steps(cl[r]) == failed[r] + 1, r
    assert_alive(cl, range(W))
    cl.wait_ready()
    step_ok(cl, ref, 2, n)


# ------------------------------------------------------------------------------------------------
# 6. A trainer that dies holding a registered buffer
# ------------------------------------------------------------------------------------------------
HOLDER = r"""
import json, sys, time
import lightwire
from lightwire._shm import ShmSegment
seg = ShmSegment(1 << 20)
bid = lightwire.Client(socket_path=sys.argv[1], timeout=(2.0, 10.0)).register_buffer(seg)
print(json.dumps({"id": bid, "shm": seg.shm_name}), flush=True)
time.sleep(120)
"""


def test_buffers_of_a_killed_trainer_are_released(sidecar_factory):
    """A trainer process registers a shared-memory buffer over the Unix socket, then is killed
    (SIGKILL). Within a few seconds the sidecar releases it (lightwire_registered_buffers back
    down, /v1/status no longer lists it, lightwire_buffers_released_total{reason="owner_exited"}
    up by one) while it keeps the buffer of a live trainer (this process) and serves it exactly,
    before and after."""
    from lightwire._shm import ShmSegment
    sc = sidecar_factory()
    c = sc.client()
    mine = ShmSegment(4096 * 4)
    holder = run_script(HOLDER, sc.socket)
    try:
        c.register_buffer(mine)
        x = np.arange(4096, dtype=np.float32)

        def serve_me(step):
            np.frombuffer(mine.buf, dtype=np.float32)[:] = x + step
            c.emit_gradient_shm(mine, "live", step)
            assert_bitwise(np.frombuffer(mine.buf, dtype=np.float32), x + step, "live trainer step %d" % step)

        serve_me(0)
        held = json.loads(read_line(holder, 20))

        def listed():
            return {b["id"] for b in c.status()["buffers"]}
        assert listed() == {held["id"], mine.buffer_id}
        assert metric(sc, "lightwire_registered_buffers") == 2
        released0 = metric(sc, "lightwire_buffers_released_total", reason="owner_exited")
        holder.kill()
        holder.wait(10)
        wait_until(lambda: listed() == {mine.buffer_id}, 5, "the dead trainer's buffer released")
        assert metric(sc, "lightwire_registered_buffers") == 1
        assert metric(sc, "lightwire_buffers_released_total", reason="owner_exited") == released0 + 1
        serve_me(1)
        assert sc.proc.poll() is None
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        c.close()
        mine.close()
        for name in [n for n in os.listdir("/dev/shm") if n.startswith("lightwire-%d-" % holder.pid)]:
            os.unlink(os.path.join("/dev/shm", name))  # its resource tracker usually did it
