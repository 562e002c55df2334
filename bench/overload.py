#!/usr/bin/env python3
"""Overload benchmark: W PyTorch DDP trainers train through W sidecars (one each, the ring over
loopback TCP) while a real Prometheus scrapes the sidecars' admin listeners every second, first
undisturbed (baseline), then while an attacker holds slow connections open on every HTTP listener
of sidecar 0 (its control Unix socket, its TCP control listener, its admin listener), then after
it stopped (recovery). Figures only: it never passes or fails on them. Method and results:
bench/README.md "Overload". Loopback only (every address in 127.0.0.0/8); run as root or not.

    /usr/bin/python3 bench/overload.py           # 4 trainers, 1000 connections a listener (~5 min)
    /usr/bin/python3 bench/overload.py --smoke   # 2 trainers, 50 connections, short phases (~1 min)
    /usr/bin/python3 bench/overload.py --kinds fill --connections 20 --attack-seconds 60

What runs:
- W `lightwire serve` processes of one job (--rank/--world-size/--peers, LIGHTWIRE_PEER__SECRET,
  as tests/python/conftest.py's Cluster), each with a Unix socket and an admin listener on
  127.0.0.1; sidecar 0 also with a TCP control listener. Every listener keeps its default budget
  (docs/configuration.md `limits.unix.*`, `limits.control_tcp.*`, `limits.admin.*`); the header
  timeout is --header-timeout. Policies off, codec from --sidecar-args (default fp16).
- W trainer processes (this script, --role train): DDP over gloo on CPU (file store), an MLP
  512-1024-512-10 (1.05 M parameters) on random inputs labelled by a fixed random linear teacher,
  batch 64 per rank, SGD with momentum, lightwire.torch's DDP hook per layer on its own sidecar's
  Unix socket with the client's default timeouts, a POST /v1/report of the loss after every step
  (as bench/e2e/worker.py). They train from before the baseline until after the recovery; every
  step's end time places it in a phase. Rank 0 broadcasts the stop, so every rank stops after the
  same step.
- /usr/bin/prometheus scraping the W admin listeners every second (scrape timeout 1 s), the
  repository's alert rules (docker/prometheus/alerts.yml) loaded.
- A prober (--role probe): GET /healthz every 100 ms with a 2 s deadline on a new connection each
  time (connect, request, whole reply), on sidecar 0's admin listener from 127.0.1.1, on its TCP
  control listener from 127.0.1.2 and on its Unix socket.
- The attacker (--role attack), during the attack phase only: --connections connections on each of
  sidecar 0's three listeners, TCP ones from --sources addresses 127.0.0.2, 127.0.0.3, ... (more
  addresses than the admin budget over its per-source cap), its RLIMIT_NOFILE raised to the hard
  limit, one event loop (epoll). Connection i of a listener is of the i-th kind of --kinds, in
  turn: `silent` sends nothing; `trickle` sends "GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n" then one
  header byte a second; `late` sends nothing for 0.8 x the header timeout, then as `trickle`;
  `post` sends the headers of a POST /v1/report declaring a 1 GiB body (Content-Length:
  1073741824), then one body byte a second; `fill` (not in the default mix) as `post`, its
  declared length halved after each 429 and doubled (up to 1 GiB) after a connection that was not
  refused, so that together they hold limits.max_inflight_body_bytes to the byte. A connection
  that is cut (closed, reset, or answered) is opened again at once; a failed connect is tried
  again 10 ms later. The attacker records every connection's connect-to-cut time and how it ended
  (closed without a reply, reset, or the HTTP status of the reply), and, when it stops, the age of
  the connections still open.

Phases: the trainers start and take --warm-steps steps; the prober starts; baseline
(--baseline-seconds); attack (--attack-seconds, from the attacker's start to its SIGTERM);
recovery (--recovery-seconds, from the attacker's exit). Figures per phase: the trainers' steps
(rank 0's count and median step time), the hook's fallbacks (every rank, with their errors) and
the failed reports; the probes' p50/p99/max latency and failures; Prometheus's scrapes of each
target over the phase (count_over_time(up[...]) against the phase's seconds, failed ones:
count - sum_over_time(up[...]), and the longest scrape); the CPU seconds of every process group;
sidecar 0's RSS and open descriptors (1-s samples) and its lightwire_limit_hits_total{limit,
listener} and lightwire_http_requests_total{code} over the phase. The ALERTS series of
LightwireListenerLimits at the attack's end.

Everything shares the machine's cores: the attacker's CPU is taken from the trainers and the
sidecars, which a remote attacker's would not be. The CPU figures say how much.

Options: --baseline-seconds 60  --attack-seconds 180  --recovery-seconds 30  --connections 1000
(per listener)  --sources 60  --header-timeout 10 (passed to every sidecar)  --kinds
silent,trickle,late,post (and fill)  --world-size 4  --warm-steps 5  --sidecar-args "--codec fp16"
--token (a bearer token on every sidecar, security.token: the TCP control listener refuses
unauthenticated bodies from the headers; the prober sends it)  --results FILE (default
docs/benchmarks/overload.json)  --keep (keep the work directory)  --smoke (2 trainers, 50
connections, header timeout 3 s, phases 8/20/5 s). $LIGHTWIRE_BIN: the executable (default
build-release/proxy/lightwire); $PYTHON: the trainers' interpreter (default /usr/bin/python3).
Ctrl-C or SIGTERM stops every child (each in its own process group, killed by the kernel should
this script die first).
"""

import argparse
import array
import datetime
import errno
import heapq
import json
import logging
import os
import random
import re
import resource
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(HERE, "soak"))

from soak import signal_group, spawn as soak_spawn  # noqa: E402

PROMETHEUS = os.environ.get("LIGHTWIRE_PROMETHEUS") or "/usr/bin/prometheus"
ALERTS = os.path.join(ROOT, "docker", "prometheus", "alerts.yml")
JOB = "lightwire"
# As bench/e2e/e2e.py: every lightwire policy off, so that the figures are the listeners' alone.
POLICIES_OFF = ["--anomaly", "false", "--rollback", "false", "--full-sync-every", "0"]
GLOO_TIMEOUT_S = 300
KINDS = ("silent", "trickle", "late", "post", "fill")
DEFAULT_KINDS = ("silent", "trickle", "late", "post")
LISTENERS = ("unix", "control_tcp", "admin")
ONE_GIB = 1 << 30
PROBE_SOURCES = {"admin": "127.0.1.1", "control_tcp": "127.0.1.2"}
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)



def log(msg):
    print("overload: %s" % msg, file=sys.stderr, flush=True)


def percentile(values, p):
    """Nearest-rank percentile of a list (None when empty)."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-p * len(s) // 1)) - 1))
    return s[k]


def summary(values, scale=1.0, digits=4):
    """{n, p50, p99, max} of a list, each value times `scale`."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    r = lambda v: round(v * scale, digits)  # noqa: E731
    return {"n": len(values), "p50": r(percentile(values, 0.5)), "p99": r(percentile(values, 0.99)),
            "max": r(max(values))}


# ------------------------------------------------------------------------------------------------
# Trainer (--role train): one DDP rank
# ------------------------------------------------------------------------------------------------
class FallbackLog(logging.Handler):
    """Counts the hook's fallback warnings by their error ("429 limit_reached", ...)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons = {}

    def emit(self, record):
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 2 and "falls back" in str(record.msg):
            e = args[1]
            key = "%s %s" % (getattr(e, "status", None), getattr(e, "error", type(e).__name__))
            r = self.reasons.setdefault(key, {"n": 0, "first": time.time(),
                                              "example": str(e)[:300]})
            r["n"] += 1


def run_trainer(a):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    import lightwire
    from lightwire.torch import LightwireHookState, ddp_comm_hook

    os.environ["LOCAL_RANK"] = "0"  # each rank has a sidecar of its own: trainer 0 there
    torch.set_num_threads(1)
    fallback_log = FallbackLog()
    hook_log = logging.getLogger("lightwire.torch")
    hook_log.addHandler(fallback_log)
    hook_log.addHandler(logging.StreamHandler(sys.stderr))
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=a.rank,
                            world_size=a.world_size,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    client = lightwire.Client(socket_path=a.socket)  # the default timeouts: 5 s connect, 150 s read
    state = LightwireHookState(client=client, process_group=dist.group.WORLD, module=ddp)
    ddp.register_comm_hook(state, ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state.optimizer = opt
    teacher = torch.randn(512, 10, generator=torch.Generator().manual_seed(1))
    flag = torch.zeros(1, dtype=torch.int32)
    rows, report_errors, report_reasons = [], 0, {}
    step = 0
    while True:
        g = torch.Generator().manual_seed(1000003 * (a.rank + 1) + step)
        x = torch.randn(64, 512, generator=g)
        y = (x @ teacher).argmax(1)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        value = loss.item()
        try:
            client.report(step, loss=value, trainer=0)
        except lightwire.LightwireError as e:
            report_errors += 1
            key = "%s %s" % (e.status, e.error)
            r = report_reasons.setdefault(key, {"n": 0, "first": time.time(),
                                                "example": str(e)[:300]})
            r["n"] += 1
        step += 1
        rows.append([round(time.time(), 4), round(dt, 5), state.fallbacks, report_errors,
                     round(value, 5)])
        if a.rank == 0:
            if step == a.warm_steps:
                with open(a.warm_file, "w") as f:
                    f.write("%d\n" % step)
            if step % 10 == 0:
                with open(a.progress_file + ".tmp", "w") as f:
                    f.write("%d %d %d\n" % (step, state.fallbacks, report_errors))
                os.replace(a.progress_file + ".tmp", a.progress_file)
            flag[0] = 1 if os.path.exists(a.stop_file) else 0
        dist.broadcast(flag, src=0)
        if int(flag.item()):
            break
    out = {"rank": a.rank, "steps": step, "rows": rows, "fallbacks": state.fallbacks,
           "sidecar_steps": state.sidecar_steps, "report_errors": report_errors,
           "fallback_reasons": fallback_log.reasons, "report_reasons": report_reasons,
           "last_error": None if state.last_error is None else str(state.last_error)[:500]}
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(a.out + ".tmp", a.out)
    state.close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------
# Prober (--role probe): GET /healthz every 100 ms on each of sidecar 0's listeners
# ------------------------------------------------------------------------------------------------
def probe_once(target, timeout, token):
    """(seconds, HTTP status or None, error or None) of one GET /healthz on a new connection."""
    t0 = time.monotonic()
    deadline = t0 + timeout

    def left():
        return max(0.001, deadline - time.monotonic())

    s = None
    try:
        if target["unix"]:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(left())
            s.connect(target["unix"])
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((target["source"], 0))
            s.settimeout(left())
            s.connect((target["host"], target["port"]))
        auth = ("Authorization: Bearer %s\r\n" % token) if token else ""
        s.settimeout(left())
        s.sendall(("GET /healthz HTTP/1.1\r\nHost: x\r\n%sConnection: close\r\n\r\n" % auth)
                  .encode())
        data = b""
        need = None
        while True:
            s.settimeout(left())
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if need is None and b"\r\n\r\n" in data:
                head = data.split(b"\r\n\r\n", 1)[0]
                m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                need = len(head) + 4 + int(m.group(1)) if m else -1
            if need is not None and need >= 0 and len(data) >= need:
                break
        if not data.startswith(b"HTTP/1."):
            return time.monotonic() - t0, None, "no reply" if not data else "bad reply"
        status = int(data[9:12])
        return time.monotonic() - t0, status, None if status == 200 else "http_%d" % status
    except socket.timeout:
        return time.monotonic() - t0, None, "timeout"
    except OSError as e:
        return time.monotonic() - t0, None, errno.errorcode.get(e.errno, type(e).__name__)
    finally:
        if s is not None:
            s.close()


def run_prober(a):
    targets = json.loads(a.targets)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    lock = threading.Lock()
    out = open(a.out, "w")

    def loop(t):
        nxt = time.monotonic()
        while not stop.is_set():
            wall = time.time()
            lat, status, err = probe_once(t, a.timeout, a.token)
            with lock:
                out.write(json.dumps({"target": t["name"], "t": round(wall, 4),
                                      "lat": round(lat, 6), "status": status, "err": err}) + "\n")
                out.flush()
            nxt += a.interval
            now = time.monotonic()
            if nxt < now:
                nxt = now  # a probe longer than the interval: the next one at once
            stop.wait(nxt - now)

    threads = [threading.Thread(target=loop, args=(t,), daemon=True) for t in targets]
    for th in threads:
        th.start()
    while not stop.is_set():
        stop.wait(0.5)
    for th in threads:
        th.join(a.timeout + 1)
    out.close()
    return 0


# ------------------------------------------------------------------------------------------------
# Attacker (--role attack)
# ------------------------------------------------------------------------------------------------
class Conn(object):
    __slots__ = ("sock", "slot", "t0", "open", "rx", "closed", "sent")

    def __init__(self, sock, slot, t0):
        self.sock, self.slot, self.t0 = sock, slot, t0
        self.open = False
        self.rx = b""
        self.closed = False
        self.sent = 0


def run_attacker(a):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    targets = json.loads(a.targets)
    kinds = a.kinds.split(",")
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    sel = selectors.EpollSelector()
    heap, seq = [], [0]
    late_delay = 0.8 * a.header_timeout
    get_head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
    post_head = (b"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % ONE_GIB)
    # per target: counters and connect-to-cut seconds by (kind, outcome)
    stats = {t["name"]: {"connects": 0, "connect_errors": {}, "cuts": {}, "open_samples": [],
                         "oldest_open_samples": []} for t in targets}
    opened = {}  # fd -> Conn
    slots = []
    for ti, t in enumerate(targets):
        for i in range(a.connections):
            source = "127.0.0.%d" % (2 + i % a.sources) if not t["unix"] else None
            slots.append((ti, kinds[i % len(kinds)], source, len(slots)))
    # `fill`: each slot's declared body length, halved after a 429, doubled (up to 1 GiB) after
    # a connection that was not refused.
    fill_size = [ONE_GIB] * len(slots)

    def push(due, action, obj):
        seq[0] += 1
        heapq.heappush(heap, (due, seq[0], action, obj))

    def connect(slot):
        ti, kind, source, _ = slot
        t = targets[ti]
        st = stats[t["name"]]
        now = time.monotonic()
        s, err = None, 0
        try:
            if t["unix"]:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                s.bind((source, 0))
            s.setblocking(False)
            err = s.connect_ex(t["unix"] or (t["host"], t["port"]))
        except OSError as e:
            err = e.errno or -1
        if err not in (0, errno.EINPROGRESS):
            if s is not None:
                s.close()
            name = errno.errorcode.get(err, str(err))
            st["connect_errors"][name] = st["connect_errors"].get(name, 0) + 1
            push(now + 0.01, "connect", slot)
            return
        st["connects"] += 1
        c = Conn(s, slot, now)
        opened[s.fileno()] = c
        if err == 0:
            sel.register(s, selectors.EVENT_READ, c)
            established(c)
        else:
            sel.register(s, selectors.EVENT_WRITE, c)

    def established(c):
        c.open = True
        kind = c.slot[1]
        now = time.monotonic()
        if kind == "trickle":
            send(c, get_head)
            push(now + 1.0, "send", c)
        elif kind == "post":
            send(c, post_head)
            push(now + 1.0, "send", c)
        elif kind == "fill":
            send(c, post_head.replace(b"%d" % ONE_GIB, b"%d" % fill_size[c.slot[3]]))
            push(now + 1.0, "send", c)
        elif kind == "late":
            push(c.t0 + late_delay, "late", c)

    def send(c, data):
        try:
            c.sock.send(data)
            c.sent += len(data)
        except BlockingIOError:
            pass
        except OSError:
            cut(c, "reset")

    def cut(c, how):
        if c.closed:
            return
        c.closed = True
        now = time.monotonic()
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        opened.pop(c.sock.fileno(), None)
        c.sock.close()
        if c.rx.startswith(b"HTTP/1.") and len(c.rx) >= 12:
            outcome = "http_%s" % c.rx[9:12].decode("ascii", "replace")
        elif not c.open:
            outcome = "connect_failed"
        else:
            outcome = how
        name, kind = targets[c.slot[0]]["name"], c.slot[1]
        key = "%s/%s" % (kind, outcome)
        cuts = stats[name]["cuts"]
        if key not in cuts:
            cuts[key] = array.array("d")
        cuts[key].append(now - c.t0)
        if kind == "fill" and c.open:
            i = c.slot[3]
            fill_size[i] = (max(1, fill_size[i] // 2) if outcome == "http_429"
                            else min(ONE_GIB, fill_size[i] * 2))
        if not stop[0]:
            connect(c.slot)  # at once: the pressure stays on

    for slot in slots:
        connect(slot)
    next_sample = time.monotonic() + 1.0
    while not stop[0]:
        now = time.monotonic()
        timeout = min(0.1, max(0.0, heap[0][0] - now)) if heap else 0.1
        for key, mask in sel.select(timeout):
            c = key.data
            if c.closed:
                continue
            if not c.open:
                err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    st = stats[targets[c.slot[0]]["name"]]
                    name = errno.errorcode.get(err, str(err))
                    st["connect_errors"][name] = st["connect_errors"].get(name, 0) + 1
                    st["connects"] -= 1
                    c.closed = True
                    sel.unregister(c.sock)
                    opened.pop(c.sock.fileno(), None)
                    c.sock.close()
                    push(time.monotonic() + 0.01, "connect", c.slot)
                    continue
                sel.modify(c.sock, selectors.EVENT_READ, c)
                established(c)
                continue
            try:
                data = c.sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                cut(c, "reset")
                continue
            if not data:
                cut(c, "closed")
            elif len(c.rx) < 64:
                c.rx += data[:64]
        now = time.monotonic()
        while heap and heap[0][0] <= now and not stop[0]:
            _, _, action, obj = heapq.heappop(heap)
            if action == "connect":
                connect(obj)
            elif obj.closed:
                continue
            elif action == "late":
                send(obj, get_head)
                push(now + 1.0, "send", obj)
            elif action == "send":
                kind = obj.slot[1]
                send(obj, b" " if kind in ("post", "fill") else b"a")
                if not obj.closed:
                    push(now + 1.0, "send", obj)
        if now >= next_sample:
            next_sample += 1.0
            counts = {t["name"]: 0 for t in targets}
            oldest = {t["name"]: 0.0 for t in targets}
            for c in opened.values():
                if c.open and not c.closed:
                    name = targets[c.slot[0]]["name"]
                    counts[name] += 1
                    oldest[name] = max(oldest[name], now - c.t0)
            for name in counts:
                stats[name]["open_samples"].append(counts[name])
                stats[name]["oldest_open_samples"].append(round(oldest[name], 2))
    # The connections still open at the end: their ages.
    now = time.monotonic()
    at_end = {t["name"]: {} for t in targets}
    for c in list(opened.values()):
        if c.open and not c.closed:
            name, kind = targets[c.slot[0]]["name"], c.slot[1]
            at_end[name].setdefault(kind, []).append(now - c.t0)
        c.sock.close()
    out = {"header_timeout": a.header_timeout, "kinds": kinds, "connections": a.connections,
           "sources": a.sources, "targets": {}}
    for t in targets:
        st = stats[t["name"]]
        cuts = {}
        for key, values in sorted(st["cuts"].items()):
            v = list(values)
            s = summary(v, digits=3)
            s["over_header_timeout"] = sum(1 for x in v if x > a.header_timeout + 1.0)
            cuts[key] = s
        opens = st["open_samples"]
        out["targets"][t["name"]] = {
            "connects": st["connects"], "connect_errors": st["connect_errors"], "cuts": cuts,
            "cuts_total": sum(len(v) for v in st["cuts"].values()),
            "open_mean": round(sum(opens) / len(opens), 1) if opens else None,
            "open_min": min(opens) if opens else None, "open_max": max(opens) if opens else None,
            "oldest_open_max": max(st["oldest_open_samples"]) if opens else None,
            "open_at_end": {k: dict(summary(v, digits=2), over_header_timeout=sum(
                1 for x in v if x > a.header_timeout + 1.0)) for k, v in at_end[t["name"]].items()},
        }
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    return 0


# ------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """SIGINT/SIGTERM of this script."""


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def spawn(argv, log_path, env=None):
    """A child in its own process group, which the kernel kills should this script die first
    (bench/soak/soak.py's, with SIGKILL)."""
    return soak_spawn(argv, log_path, env, signal.SIGKILL)


def stop_procs(procs, sig, timeout):
    """`sig` to each running proc's group, up to `timeout` s in all, then SIGKILL; exit codes."""
    for p in procs:
        if p.poll() is None:
            signal_group(p, sig)
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait()
            codes.append("killed after %.0f s" % timeout)
    return codes


def ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError):
        return 32768


_ports_given = set()


def free_tcp_port():
    """A loopback port free a moment ago, below the ephemeral range (as tests/python/conftest.py):
    the attacker's and everyone's outgoing connections never take it meanwhile."""
    lo = ephemeral_low()
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in _ports_given:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
            _ports_given.add(port)
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free loopback port")


def proc_cpu(pid):
    """User + system CPU seconds of a process, its reaped children included (None: gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def machine_busy():
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def proc_rss_fds(pid):
    rss = fds = None
    try:
        with open("/proc/%d/status" % pid) as f:
            m = re.search(r"VmRSS:\s*(\d+)", f.read())
            rss = int(m.group(1)) * 1024 if m else None
        fds = len(os.listdir("/proc/%d/fd" % pid))
    except OSError:
        pass
    return rss, fds


def parse_metrics(text, names):
    """{name: {labels text: value}} of the samples of `names` in a Prometheus exposition."""
    out = {n: {} for n in names}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) in out:
            out[m.group(1)][m.group(2) or ""] = float(m.group(3))
    return out


def labels(text):
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', text or ""))


class Job(object):
    """Every process of one run, and their teardown."""

    def __init__(self, args, binary, python, work):
        self.a, self.binary, self.python, self.work = args, binary, python, work
        self.sidecars, self.trainers = [], []
        self.prometheus = self.prober = self.attacker = None

    def all_procs(self):
        return [p for p in ([self.attacker, self.prober] + self.trainers + [self.prometheus]
                            + self.sidecars) if p is not None]

    def kill_everything(self):
        for p in self.all_procs():
            if p.poll() is None:
                signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.all_procs():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(p, signal.SIGKILL)
                p.wait()

    # -- sidecars ---------------------------------------------------------------------------
    def start_sidecars(self):
        a, w = self.a, self.a.world_size
        self.peer_ports = [free_tcp_port() for _ in range(w)]
        self.admin_ports = [free_tcp_port() for _ in range(w)]
        self.control_port = free_tcp_port()
        self.sockets = [os.path.join(self.work, "sidecar%d.sock" % r) for r in range(w)]
        peers = ",".join("127.0.0.1:%d" % p for p in self.peer_ports)
        # $LIGHTWIRE_BIN names the executable for this script; to the sidecar every LIGHTWIRE_
        # variable is a configuration key (docs/configuration.md), so it is not passed on.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTWIRE_")}
        env["LIGHTWIRE_PEER__SECRET"] = os.urandom(16).hex()
        if a.token:
            env["LIGHTWIRE_SECURITY__TOKEN"] = a.token
        for r in range(w):
            cmd = [self.binary, "serve", "--job-id", "overload", "--rank", str(r), "--world-size",
                   str(w), "--peers", peers, "--peer-listen", "127.0.0.1:%d" % self.peer_ports[r],
                   "--socket", self.sockets[r],
                   "--control-tcp", "127.0.0.1:%d" % self.control_port if r == 0 else "",
                   "--admin-listen", "127.0.0.1:%d" % self.admin_ports[r], "--state-dir", "",
                   "--threads", "1", "--log-level", "warn",
                   "--header-timeout", "%g" % a.header_timeout] + POLICIES_OFF + shlex.split(
                       a.sidecar_args)
            self.sidecars.append(spawn(cmd, os.path.join(self.work, "sidecar%d.log" % r), env))
            if r == 0:
                self.sidecar_cmd0 = cmd
        import lightwire
        deadline = time.monotonic() + 60
        for r, sock in enumerate(self.sockets):
            while True:
                if self.sidecars[r].poll() is not None:
                    raise RuntimeError("sidecar %d exited with %s: %s" % (
                        r, self.sidecars[r].returncode, self.tail("sidecar%d.log" % r)))
                if os.path.exists(sock):
                    c = lightwire.Client(socket_path=sock, timeout=(1.0, 5.0))
                    try:
                        if c.request("GET", "/readyz").status == 200:
                            break
                    except lightwire.LightwireError:
                        pass
                    finally:
                        c.close()
                if time.monotonic() > deadline:
                    raise RuntimeError("sidecar %d not ready in 60 s: %s" % (
                        r, self.tail("sidecar%d.log" % r)))
                time.sleep(0.1)

    def tail(self, name, lines=8):
        try:
            with open(os.path.join(self.work, name), "rb") as f:
                return " | ".join(f.read().decode("utf-8", "replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def sidecar0_metrics(self):
        """sidecar 0's limit hits and requests by code (over its Unix socket)."""
        import lightwire
        c = lightwire.Client(socket_path=self.sockets[0], timeout=(5.0, 10.0))
        try:
            text = c.metrics()
        finally:
            c.close()
        return parse_metrics(text, ("lightwire_limit_hits_total", "lightwire_http_requests_total"))

    # -- Prometheus ---------------------------------------------------------------------------
    def start_prometheus(self):
        d = os.path.join(self.work, "prometheus")
        os.makedirs(d)
        self.prom_port = free_tcp_port()
        self.prom_url = "http://127.0.0.1:%d" % self.prom_port
        self.targets = ["127.0.0.1:%d" % p for p in self.admin_ports]
        cfg = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                          "evaluation_interval": "1s"},
               "rule_files": [ALERTS] if os.path.exists(ALERTS) else [],
               "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": self.targets}]}]}
        config = os.path.join(d, "prometheus.yml")
        with open(config, "w") as f:
            json.dump(cfg, f, indent=1)  # JSON is YAML
        self.prometheus = spawn([PROMETHEUS, "--config.file=" + config,
                                 "--storage.tsdb.path=" + os.path.join(d, "tsdb"),
                                 "--web.listen-address=127.0.0.1:%d" % self.prom_port],
                                os.path.join(self.work, "prometheus.log"))
        deadline = time.monotonic() + 60
        while True:
            if self.prometheus.poll() is not None:
                raise RuntimeError("prometheus exited: %s" % self.tail("prometheus.log"))
            try:
                with urllib.request.urlopen(self.prom_url + "/-/ready", timeout=1.0) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus not ready in 60 s: %s" % self.tail("prometheus.log"))
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while self.prom_value('count(up{job="%s"} == 1)' % JOB) != len(self.targets):
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus does not scrape every sidecar: %s" %
                                   self.tail("prometheus.log"))
            time.sleep(0.5)

    def prom_query(self, expr, at=None):
        params = {"query": expr}
        if at is not None:
            params["time"] = "%.3f" % at
        url = "%s/api/v1/query?%s" % (self.prom_url, urllib.parse.urlencode(params))
        try:
            with urllib.request.urlopen(url, timeout=20.0) as r:
                doc = json.loads(r.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            log("prometheus query %s failed: %s" % (expr, e))
            return []
        return doc.get("data", {}).get("result", []) if doc.get("status") == "success" else []

    def prom_value(self, expr):
        res = self.prom_query(expr)
        return float(res[0]["value"][1]) if res else None

    def scrapes(self, start, end):
        """Per target: scrapes over [start, end] (count_over_time(up)), failed ones, expected."""
        window = "%ds" % max(1, int(round(end - start)))
        out = {t: {"expected": int(round(end - start))} for t in self.targets}
        for key, expr in (("scrapes", "count_over_time(up{job=\"%s\"}[%s])"),
                          ("up", "sum_over_time(up{job=\"%s\"}[%s])"),
                          ("min_up", "min_over_time(up{job=\"%s\"}[%s])"),
                          ("max_duration_s", "max_over_time(scrape_duration_seconds{job=\"%s\"}"
                                             "[%s])"),
                          ("mean_duration_s", "avg_over_time(scrape_duration_seconds{job=\"%s\"}"
                                              "[%s])")):
            for r in self.prom_query(expr % (JOB, window), at=end):
                inst = r["metric"].get("instance")
                if inst in out:
                    out[inst][key] = round(float(r["value"][1]), 4)
        for inst, v in out.items():
            if "scrapes" in v and "up" in v:
                v["failed"] = int(round(v["scrapes"] - v["up"]))
                v["missing"] = max(0, v["expected"] - int(v["scrapes"]))
        return out

    # -- trainers, prober, attacker ------------------------------------------------------------
    def start_trainers(self):
        a = self.a
        self.store = os.path.join(self.work, "store")
        self.stop_file = os.path.join(self.work, "stop")
        self.warm_file = os.path.join(self.work, "warm")
        self.progress_file = os.path.join(self.work, "progress")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTWIRE_")}
        env.update(GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1")
        for r in range(a.world_size):
            cmd = [self.python, os.path.abspath(__file__), "--role", "train", "--rank", str(r),
                   "--world-size", str(a.world_size), "--socket", self.sockets[r], "--store",
                   self.store, "--stop-file", self.stop_file, "--warm-file", self.warm_file,
                   "--progress-file", self.progress_file, "--warm-steps", str(a.warm_steps),
                   "--out", os.path.join(self.work, "trainer%d.json" % r)]
            self.trainers.append(spawn(cmd, os.path.join(self.work, "trainer%d.log" % r), env))
        deadline = time.monotonic() + 300
        while not os.path.exists(self.warm_file):
            for r, p in enumerate(self.trainers):
                if p.poll() is not None:
                    raise RuntimeError("trainer %d exited with %s: %s" % (
                        r, p.returncode, self.tail("trainer%d.log" % r)))
            if time.monotonic() > deadline:
                raise RuntimeError("the trainers did not take %d steps in 300 s" % a.warm_steps)
            time.sleep(0.2)

    def progress(self):
        try:
            with open(self.progress_file) as f:
                step, fallbacks, report_errors = (int(x) for x in f.read().split())
            return "rank 0 at step %d, %d fallback(s), %d failed report(s)" % (
                step, fallbacks, report_errors)
        except (OSError, ValueError):
            return "rank 0: no progress yet"

    def start_prober(self):
        t = [{"name": "admin", "unix": None, "host": "127.0.0.1", "port": self.admin_ports[0],
              "source": PROBE_SOURCES["admin"]},
             {"name": "control_tcp", "unix": None, "host": "127.0.0.1", "port": self.control_port,
              "source": PROBE_SOURCES["control_tcp"]},
             {"name": "unix", "unix": self.sockets[0]}]
        self.probe_file = os.path.join(self.work, "probes.jsonl")
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "probe", "--targets",
               json.dumps(t), "--out", self.probe_file, "--interval", "0.1", "--timeout", "2"]
        if self.a.token:
            cmd += ["--token", self.a.token]
        self.prober = spawn(cmd, os.path.join(self.work, "prober.log"))

    def start_attacker(self):
        a = self.a
        t = [{"name": "unix", "unix": self.sockets[0]},
             {"name": "control_tcp", "unix": None, "host": "127.0.0.1", "port": self.control_port},
             {"name": "admin", "unix": None, "host": "127.0.0.1", "port": self.admin_ports[0]}]
        self.attack_file = os.path.join(self.work, "attack.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "attack", "--targets",
               json.dumps(t), "--out", self.attack_file, "--connections", str(a.connections),
               "--sources", str(a.sources), "--header-timeout", "%g" % a.header_timeout,
               "--kinds", a.kinds]
        self.attacker = spawn(cmd, os.path.join(self.work, "attacker.log"))

    def cpu(self):
        """CPU seconds so far per process group of the run, and the machine's busy share."""
        def total(procs):
            vals = [proc_cpu(p.pid) for p in procs if p is not None]
            vals = [v for v in vals if v is not None]
            return sum(vals) if vals else None
        busy, all_ = machine_busy()
        return {"sidecar0": total(self.sidecars[:1]), "other_sidecars": total(self.sidecars[1:]),
                "trainers": total(self.trainers), "attacker": total([self.attacker]),
                "prober": total([self.prober]), "prometheus": total([self.prometheus]),
                "_busy": busy, "_all": all_, "_t": time.monotonic()}


def cpu_delta(a, b):
    out = {}
    secs = b["_t"] - a["_t"]
    for k in a:
        if k.startswith("_"):
            continue
        if b.get(k) is not None:
            out[k] = round(b[k] - (a[k] or 0.0), 1)
    out["seconds"] = round(secs, 1)
    out["machine_busy_share"] = round((b["_busy"] - a["_busy"]) / max(1, b["_all"] - a["_all"]), 3)
    return out


def metrics_delta(m0, m1):
    """lightwire_limit_hits_total by listener and limit, requests by route and code: m1 - m0,
    the non-zero ones."""
    hits, reqs = {}, {}
    for lab, v in m1["lightwire_limit_hits_total"].items():
        d = v - m0["lightwire_limit_hits_total"].get(lab, 0.0)
        if d:
            la = labels(lab)
            hits.setdefault(la.get("listener") or "-", {})[la.get("limit")] = int(d)
    for lab, v in m1["lightwire_http_requests_total"].items():
        d = v - m0["lightwire_http_requests_total"].get(lab, 0.0)
        if d:
            la = labels(lab)
            reqs.setdefault(la.get("route", "?"), {})[la.get("code", "?")] = int(d)
    return {"limit_hits": hits, "requests": reqs}


def in_phase(t, phase):
    return phase["start"] <= t < phase["end"]


def trainer_figures(results, phases):
    """Per phase: rank 0's steps and median step time, every rank's fallbacks and failed reports
    (counter increases over the steps that ended in the phase)."""
    out = {}
    for name, ph in phases.items():
        fig = {"steps": None, "median_step_s": None, "p99_step_s": None, "fallbacks": 0,
               "report_errors": 0}
        for res in results:
            rows = res["rows"]
            inside = [i for i, r in enumerate(rows) if in_phase(r[0], ph)]
            if not inside:
                continue
            before = rows[inside[0] - 1] if inside[0] > 0 else [0, 0, 0, 0]
            last = rows[inside[-1]]
            fig["fallbacks"] += last[2] - before[2]
            fig["report_errors"] += last[3] - before[3]
            if res["rank"] == 0:
                times = [rows[i][1] for i in inside]
                fig["steps"] = len(inside)
                fig["median_step_s"] = round(percentile(times, 0.5), 4)
                fig["p99_step_s"] = round(percentile(times, 0.99), 4)
                fig["steps_per_s"] = round(len(inside) / (ph["end"] - ph["start"]), 2)
        out[name] = fig
    return out


def load_probes(path):
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # the last line, cut by SIGTERM
    return rows


def timeline(results, probes, phases, every=5.0):
    """Per `every` seconds from the baseline's start: rank 0's steps, every rank's fallbacks, and
    per listener the probes' failures and slowest answer."""
    t0 = phases["baseline"]["start"]
    end = max(ph["end"] for ph in phases.values())
    n = int((end - t0) // every) + 1
    rows = [{"t": round(i * every, 1), "steps": 0, "fallbacks": 0,
             "probe_failures": {}, "probe_max_ms": {}} for i in range(n)]
    for res in results:
        prev = None
        for r in res["rows"]:
            i = int((r[0] - t0) // every)
            if 0 <= i < n:
                if res["rank"] == 0:
                    rows[i]["steps"] += 1
                if prev is not None:
                    rows[i]["fallbacks"] += r[2] - prev[2]
            prev = r
    for p in probes:
        i = int((p["t"] - t0) // every)
        if 0 <= i < n:
            row = rows[i]
            if p["err"] is not None:
                row["probe_failures"][p["target"]] = row["probe_failures"].get(p["target"], 0) + 1
            else:
                row["probe_max_ms"][p["target"]] = round(max(
                    row["probe_max_ms"].get(p["target"], 0.0), p["lat"] * 1000.0), 1)
    return rows


def probe_figures(rows, phases):
    out = {}
    for target in ("admin", "control_tcp", "unix"):
        out[target] = {}
        for name, ph in phases.items():
            mine = [r for r in rows if r["target"] == target and in_phase(r["t"], ph)]
            ok = [r["lat"] for r in mine if r["err"] is None]
            errs = {}
            for r in mine:
                if r["err"] is not None:
                    errs[r["err"]] = errs.get(r["err"], 0) + 1
            s = summary(ok, scale=1000.0, digits=2)  # ms
            out[target][name] = {"probes": len(mine), "ok": len(ok),
                                 "failures": len(mine) - len(ok), "errors": errs,
                                 "p50_ms": s["p50"], "p99_ms": s["p99"], "max_ms": s["max"],
                                 "failed_at": [round(r["t"] - ph["start"], 2) for r in mine
                                               if r["err"] is not None][:20]}
        b, at = out[target].get("baseline"), out[target].get("attack")
        if b and at and b["p50_ms"] and at["p50_ms"]:
            out[target]["ratio_p50"] = round(at["p50_ms"] / b["p50_ms"], 2)
            out[target]["ratio_p99"] = round(at["p99_ms"] / b["p99_ms"], 2)
    return out


class Sampler(threading.Thread):
    """sidecar 0's RSS and descriptors once a second."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.samples, self.done = pid, [], threading.Event()

    def run(self):
        while not self.done.wait(1.0):
            rss, fds = proc_rss_fds(self.pid)
            self.samples.append((time.time(), rss, fds))

    def phase(self, ph):
        mine = [s for s in self.samples if in_phase(s[0], ph)]
        rss = [s[1] for s in mine if s[1] is not None]
        fds = [s[2] for s in mine if s[2] is not None]
        return {"rss_max_mb": round(max(rss) / 2**20, 1) if rss else None,
                "rss_last_mb": round(rss[-1] / 2**20, 1) if rss else None,
                "fds_max": max(fds) if fds else None, "fds_last": fds[-1] if fds else None}


def git_commit():
    try:
        c = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return c + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def wait_phase(job, seconds, name):
    """Sleeps `seconds`, a progress line every 15 s; fails early when a trainer or sidecar dies."""
    end = time.monotonic() + seconds
    next_log = time.monotonic() + 15
    while True:
        now = time.monotonic()
        if now >= end:
            return
        for r, p in enumerate(job.trainers):
            if p.poll() is not None:
                raise RuntimeError("trainer %d exited with %s during the %s: %s" % (
                    r, p.returncode, name, job.tail("trainer%d.log" % r)))
        for r, p in enumerate(job.sidecars):
            if p.poll() is not None:
                raise RuntimeError("sidecar %d exited with %s during the %s: %s" % (
                    r, p.returncode, name, job.tail("sidecar%d.log" % r)))
        if now >= next_log:
            next_log += 15
            log("%s: %.0f s left; %s" % (name, end - now, job.progress()))
        time.sleep(min(0.5, end - now))


def run(a, binary, python):
    work = tempfile.mkdtemp(prefix="lightwire-overload-")
    log("work directory %s" % work)
    job = Job(a, binary, python, work)
    t_start = time.monotonic()
    phases = {}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": git_commit(), "command": " ".join(
               shlex.quote(x) for x in ["bench/overload.py"] + sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "load_average_at_start":
                       open("/proc/loadavg").read().split()[0],
                       "nofile_hard": resource.getrlimit(resource.RLIMIT_NOFILE)[1]},
           "config": {"world_size": a.world_size, "connections_per_listener": a.connections,
                      "sources": a.sources, "header_timeout_s": a.header_timeout,
                      "kinds": a.kinds.split(","), "baseline_s": a.baseline_seconds,
                      "attack_s": a.attack_seconds, "recovery_s": a.recovery_seconds,
                      "sidecar_args": a.sidecar_args, "token": bool(a.token),
                      "probe": {"interval_s": 0.1, "timeout_s": 2.0,
                                "sources": PROBE_SOURCES},
                      "scrape_interval_s": 1, "scrape_timeout_s": 1}}
    keep = a.keep
    try:
        log("starting %d sidecars" % a.world_size)
        job.start_sidecars()
        out["config"]["sidecar0_command"] = " ".join(shlex.quote(x) for x in job.sidecar_cmd0)
        log("starting prometheus (scrapes every 1 s)")
        job.start_prometheus()
        log("starting %d trainers" % a.world_size)
        job.start_trainers()
        log("trainers warm (%d steps); starting the prober" % a.warm_steps)
        job.start_prober()
        sampler = Sampler(job.sidecars[0].pid)
        sampler.start()
        time.sleep(1.0)
        cpu = [job.cpu()]
        m = [job.sidecar0_metrics()]
        t = time.time()
        log("baseline: %g s" % a.baseline_seconds)
        wait_phase(job, a.baseline_seconds, "baseline")
        phases["baseline"] = {"start": t, "end": time.time()}
        cpu.append(job.cpu())
        m.append(job.sidecar0_metrics())
        log("attack: %g s, %d connections on each of sidecar 0's listeners (kinds %s)" % (
            a.attack_seconds, a.connections, a.kinds))
        t = time.time()
        job.start_attacker()
        wait_phase(job, a.attack_seconds, "attack")
        if job.attacker.poll() is not None:
            raise RuntimeError("the attacker exited early: %s" % job.tail("attacker.log"))
        cpu.append(job.cpu())  # the attacker's CPU before it exits
        t_end = time.time()
        code = stop_procs([job.attacker], signal.SIGTERM, 60)[0]
        phases["attack"] = {"start": t, "end": t_end}
        if code != 0:
            log("the attacker exited with %s: %s" % (code, job.tail("attacker.log")))
        m.append(job.sidecar0_metrics())
        t = time.time()
        log("recovery: %g s" % a.recovery_seconds)
        wait_phase(job, a.recovery_seconds, "recovery")
        phases["recovery"] = {"start": t, "end": time.time()}
        cpu.append(job.cpu())
        m.append(job.sidecar0_metrics())
        stop_procs([job.prober], signal.SIGTERM, 10)
        sampler.done.set()
        log("stopping the trainers")
        with open(job.stop_file, "w") as f:
            f.write("stop\n")
        deadline = time.monotonic() + 120
        codes = []
        for p in job.trainers:
            try:
                codes.append(p.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        codes = [c if c is not None else "no exit within 120 s" for c in codes]
        stop_procs(job.trainers, signal.SIGTERM, 10)
        time.sleep(2.5)  # the last scrapes of the recovery land
        log("querying prometheus")
        out["scrapes"] = {name: job.scrapes(ph["start"], ph["end"]) for name, ph in phases.items()}
        alerts = job.prom_query('ALERTS{alertname="LightwireListenerLimits"}',
                                at=phases["attack"]["end"])
        out["alerts_at_attack_end"] = [{k: r["metric"].get(k) for k in
                                        ("instance", "listener", "alertstate")} for r in alerts]
        stop_procs([job.prometheus], signal.SIGTERM, 15)
        sidecar_codes = stop_procs(job.sidecars, signal.SIGTERM, 20)
        # The figures.
        out["phases"] = {k: {"start": round(v["start"], 3), "end": round(v["end"], 3),
                             "seconds": round(v["end"] - v["start"], 1)} for k, v in phases.items()}
        results = []
        for r in range(a.world_size):
            path = os.path.join(work, "trainer%d.json" % r)
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
        out["training"] = {
            "exit_codes": codes, "all_exit_0": all(c == 0 for c in codes) and len(codes) > 0,
            "steps": [res["steps"] for res in results],
            "fallbacks": [res["fallbacks"] for res in results],
            "report_errors": [res["report_errors"] for res in results],
            "fallback_reasons": [res["fallback_reasons"] for res in results],
            "report_reasons": [res["report_reasons"] for res in results],
            "last_error": [res["last_error"] for res in results],
            "phases": trainer_figures(results, phases),
            "loss_first_last": ([results[0]["rows"][0][4], results[0]["rows"][-1][4]]
                                if results and results[0]["rows"] else None)}
        out["sidecar_exit_codes"] = sidecar_codes
        probes = load_probes(job.probe_file)
        out["probes"] = probe_figures(probes, phases)
        out["timeline_5s"] = timeline(results, probes, phases)
        with open(job.attack_file) as f:
            out["attacker"] = json.load(f)
        names = list(phases)
        out["cpu_seconds"] = {names[i]: cpu_delta(cpu[i], cpu[i + 1]) for i in range(len(names))}
        out["sidecar0"] = {name: dict(sampler.phase(ph), **metrics_delta(m[i], m[i + 1]))
                           for i, (name, ph) in enumerate(phases.items())}
        out["sidecar0_limit_hits_at_end"] = {}
        for lab, v in m[-1]["lightwire_limit_hits_total"].items():
            la = labels(lab)
            if v:
                out["sidecar0_limit_hits_at_end"].setdefault(la.get("listener") or "-", {})[
                    la.get("limit")] = int(v)
        out["duration_s"] = round(time.monotonic() - t_start, 1)
        os.makedirs(os.path.dirname(os.path.abspath(a.results)), exist_ok=True)
        with open(a.results, "w") as f:
            json.dump(out, f, indent=1)
        log("results: %s" % a.results)
        print(report(out))
        return 0
    except RuntimeError as e:
        keep = True
        log("failed: %s" % e)
        return 1
    except BaseException:
        keep = True
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        job.kill_everything()
        if keep:
            log("logs kept in %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)


def fmt(v, spec="%.1f"):
    return "-" if v is None else spec % v


def report(out):
    c = out["config"]
    tr = out["training"]
    lines = ["%d trainers; %d connections on each listener of sidecar 0 (kinds %s), TCP from %d "
             "addresses; header timeout %g s; phases %s; %.0f s in all" % (
                 c["world_size"], c["connections_per_listener"], ",".join(c["kinds"]),
                 c["sources"], c["header_timeout_s"],
                 ", ".join("%s %.0f s" % (k, v["seconds"]) for k, v in out["phases"].items()),
                 out["duration_s"]),
             "trainers: exit %s; steps %s; fallbacks %s; failed reports %s" % (
                 tr["exit_codes"], tr["steps"], tr["fallbacks"], tr["report_errors"]),
             "",
             "%-10s %6s %9s %9s %7s %10s %10s" % ("phase", "steps", "steps/s", "median s",
                                                  "p99 s", "fallbacks", "reports!")]
    for name, f in tr["phases"].items():
        lines.append("%-10s %6s %9s %9s %7s %10d %10d" % (
            name, fmt(f["steps"], "%d"), fmt(f.get("steps_per_s"), "%.2f"),
            fmt(f["median_step_s"], "%.4f"), fmt(f["p99_step_s"], "%.3f"), f["fallbacks"],
            f["report_errors"]))
    lines += ["", "probes of GET /healthz on sidecar 0 (new connection each, 2 s deadline)",
              "%-12s %-9s %7s %6s %9s %9s %9s  %s" % ("listener", "phase", "probes", "fail",
                                                     "p50 ms", "p99 ms", "max ms", "errors")]
    for target, phs in out["probes"].items():
        for name in out["phases"]:
            p = phs[name]
            lines.append("%-12s %-9s %7d %6d %9s %9s %9s  %s" % (
                target, name, p["probes"], p["failures"], fmt(p["p50_ms"], "%.2f"),
                fmt(p["p99_ms"], "%.2f"), fmt(p["max_ms"], "%.1f"),
                ",".join("%s:%d" % kv for kv in p["errors"].items()) or "-"))
        if "ratio_p50" in phs:
            lines.append("%-12s attack/baseline: p50 x%.2f, p99 x%.2f" % (
                target, phs["ratio_p50"], phs["ratio_p99"]))
    lines += ["", "Prometheus scrapes (1 s): scraped/expected, failed, longest scrape"]
    for name, targets in out["scrapes"].items():
        lines.append("%-9s %s" % (name, "  ".join(
            "%s %s/%s f%s %ss" % (t.split(":")[1], fmt(v.get("scrapes"), "%d"), v["expected"],
                                  fmt(v.get("failed"), "%d"), fmt(v.get("max_duration_s"), "%.3f"))
            for t, v in targets.items())))
    at = out["attacker"]
    lines += ["", "attacker: connect-to-cut seconds by listener, kind/outcome (header timeout "
              "%g s)" % at["header_timeout"],
              "%-12s %-22s %8s %8s %8s %8s %6s" % ("listener", "kind/outcome", "n", "p50", "p99",
                                                  "max", ">ht+1")]
    for name, t in at["targets"].items():
        for key, s in t["cuts"].items():
            lines.append("%-12s %-22s %8d %8s %8s %8s %6d" % (
                name, key, s["n"], fmt(s["p50"], "%.3f"), fmt(s["p99"], "%.3f"),
                fmt(s["max"], "%.2f"), s["over_header_timeout"]))
        lines.append("%-12s connects %d, connect errors %s, open mean %s (min %s, max %s); still "
                     "open at the end: %s" % (
                         name, t["connects"], t["connect_errors"] or "-", t["open_mean"],
                         t["open_min"], t["open_max"], ", ".join(
                             "%s %d (oldest %.1f s)" % (k, v["n"], v["max"])
                             for k, v in t["open_at_end"].items()) or "none"))
    lines += ["", "sidecar 0 limit hits during the attack (lightwire_limit_hits_total increase):"]
    for listener, hits in out["sidecar0"]["attack"]["limit_hits"].items():
        lines.append("  %-12s %s" % (listener, ", ".join("%s %d" % kv for kv in
                                                           sorted(hits.items()))))
    lines += ["sidecar 0 RSS max (MB) / descriptors max: " + ", ".join(
        "%s %s/%s" % (k, fmt(v["rss_max_mb"]), fmt(v["fds_max"], "%d"))
        for k, v in out["sidecar0"].items())]
    lines += ["CPU seconds: " + "; ".join("%s: %s" % (k, ", ".join(
        "%s %s" % (n, x) for n, x in v.items())) for k, v in out["cpu_seconds"].items())]
    if out.get("alerts_at_attack_end"):
        lines.append("ALERTS at the attack's end: " + ", ".join(
            "%s %s %s" % (x["instance"], x["listener"], x["alertstate"])
            for x in out["alerts_at_attack_end"]))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("main", "train", "probe", "attack"), default="main",
                   help=argparse.SUPPRESS)
    p.add_argument("--baseline-seconds", type=float)
    p.add_argument("--attack-seconds", type=float)
    p.add_argument("--recovery-seconds", type=float)
    p.add_argument("--connections", type=int, help="per listener of sidecar 0 (default 1000)")
    p.add_argument("--sources", type=int, default=60,
                   help="TCP source addresses 127.0.0.2, ... (default 60)")
    p.add_argument("--header-timeout", type=float,
                   help="seconds, every sidecar's --header-timeout (default 10)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                   help="the attacker's connection kinds, in turn (default %s; also fill)"
                   % ",".join(DEFAULT_KINDS))
    p.add_argument("--world-size", type=int)
    p.add_argument("--warm-steps", type=int, default=5)
    p.add_argument("--sidecar-args", default="--codec fp16")
    p.add_argument("--token", default="", help="a bearer token for every sidecar (security.token)")
    p.add_argument("--results", default=os.path.join(ROOT, "docs", "benchmarks", "overload.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--smoke", action="store_true",
                   help="2 trainers, 50 connections, header timeout 3 s, phases 8/20/5 s")
    # the roles' own arguments
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    for flag in ("--socket", "--store", "--stop-file", "--warm-file", "--progress-file", "--out",
                 "--targets"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=0.1, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=2.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "train":
        return run_trainer(a)
    if a.role == "probe":
        return run_prober(a)
    if a.role == "attack":
        return run_attacker(a)
    smoke = {"world_size": 2, "connections": 50, "header_timeout": 3.0, "baseline_seconds": 8.0,
             "attack_seconds": 20.0, "recovery_seconds": 5.0}
    full = {"world_size": 4, "connections": 1000, "header_timeout": 10.0,
            "baseline_seconds": 60.0, "attack_seconds": 180.0, "recovery_seconds": 30.0}
    for k, v in (smoke if a.smoke else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k in a.kinds.split(","):
        if k not in KINDS:
            p.error("--kinds: %s (got %r)" % (", ".join(KINDS), k))
    if a.world_size < 2 or a.connections < 0 or not 1 <= a.sources <= 250:
        p.error("--world-size >= 2, --connections >= 0, --sources 1..250")
    binary = os.path.abspath(os.environ.get("LIGHTWIRE_BIN", os.path.join(
        ROOT, "build-release", "proxy", "lightwire")))
    python = os.environ.get("PYTHON", "/usr/bin/python3")
    if not os.access(binary, os.X_OK):
        p.error("no lightwire executable at %s (bash scripts/build.sh release, or set "
                "LIGHTWIRE_BIN)" % binary)
    helptext = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True).stdout
    for flag in ("--header-timeout", "--admin-max-per-source"):
        if flag not in helptext:
            p.error("%s serve has no %s: it predates the per-listener connection budgets" % (
                binary, flag))
    if not os.access(PROMETHEUS, os.X_OK):
        p.error("no prometheus at %s (Debian's prometheus package, or set LIGHTWIRE_PROMETHEUS)"
                % PROMETHEUS)
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0:
        p.error("%s cannot import torch (set PYTHON)" % python)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(a, binary, python)
    except Interrupted as e:
        log("interrupted (%s); every child stopped" % e)
        return 130


if __name__ == "__main__":
    sys.exit(main())
