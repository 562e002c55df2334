#!/usr/bin/env python3
"""Soak: a multi-sidecar lightwire job at full rate for a while, watched for leaks and errors.

Starts --sidecars real `lightwire serve` processes (ring topology over loopback TCP, one job
secret, a state directory and an admin listener each, --trainers local trainers each) and one
trainer process per local trainer (bench/soak/trainer.py, the Python client), which run steps back
to back: the tensors of bench/soak/workload.py (4 KiB .. 4 MiB, fp32 and fp16, codecs dgc with
momentum, topk, qsgd, fp16 and none by per-tensor rules) through both the raw HTTP body and the
registered shared-memory paths, with churn (reconnects, buffers released and registered again,
reports, /v1/status and /metrics reads, checkpoints) and a check of every result.

Every second it samples each sidecar's RSS (/proc/PID/status VmRSS), open descriptors
(/proc/PID/fd) and threads; every --interval seconds it prints one line per sidecar with its
trainers' steps and the error counters (the trainers' own and the sidecar's /metrics). At the end
it prints a summary table and a verdict; the exit status is 0 only when every check holds (see
definitions(), printed with the verdict and in docs/RELIABILITY.md "Soak").

Every child runs in its own process group and is stopped on exit, Ctrl-C or failure (and gets
SIGKILL/SIGTERM from the kernel should this script die without cleaning up).
"""

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "clients", "python"))
sys.path.insert(0, HERE)

import lightwire  # noqa: E402
import workload  # noqa: E402

RSS_LIMIT = 2.0           # growth allowed after warm-up, per cent (--rss-limit)
RSS_WINDOW = 0.2          # the compared windows: first and last 20 % of the samples after warm-up
SAMPLE_EVERY_S = 1.0      # /proc sampling period
FD_READINGS = 5           # /proc/PID/fd is read this many times per sample; the median is kept
FD_READING_GAP_S = 0.05
FD_BASELINE_S = 5.0       # the fd baseline is the highest sample of the last 5 s of warm-up
STOP_WAIT_S = 60.0        # trainers finishing their last steps
STOP_MARGIN_S = 2.0       # the common last step: this many seconds of steps past the fastest trainer
SIDECAR_STOP_S = 15.0     # sidecars exiting after SIGTERM


def definitions(rss_limit=RSS_LIMIT):
    """What each check of the verdict means (printed with it, and in docs/RELIABILITY.md)."""
    return {
        "errors": "zero errors of any kind: every trainer-side exception, error reply or wrong result "
                  "(codecs none/fp16: the exact mean of known integer inputs, bit for bit; others: a "
                  "finite result of the right dtype and size; no reply flagged nonfinite), and on every "
                  "sidecar lightwire_steps_total{result=failed|nonfinite}, lightwire_http_requests_total "
                  "with code >= 400, lightwire_auth_failures_total, lightwire_result_mismatches_total, "
                  "lightwire_checkpoints_total{result=failed} (all counted from when the job was ready), "
                  "samples with a peer down (lightwire_peer_up 0) and error/critical lines in its log",
        "rss_growth": "per sidecar, over the 1-s samples taken after warm-up: median of the last 20 %% "
                      "over median of the first 20 %%, minus 1; at most %g %%" % rss_limit,
        "fds": "per sidecar, each 1-s sample is the median of %d readings of /proc/PID/fd %.0f ms apart "
               "(a checkpoint file being written, under its temporary name, is not counted); the "
               "baseline is the highest sample of the last %.0f s of warm-up; no sample after warm-up "
               "may be above it" % (FD_READINGS, FD_READING_GAP_S * 1000, FD_BASELINE_S),
        "alive": "every sidecar and trainer runs until the end; the trainers stop after the same step "
                 "and exit 0; the sidecars exit 0 within %.0f s of SIGTERM" % SIDECAR_STOP_S,
        "progress": "every sidecar's trainers completed steps in the last interval (steps/s > 0)",
    }


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


class Interrupted(BaseException):
    """SIGINT/SIGTERM of this script."""


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


# --------------------------------------------------------------------------------------------
# child processes
# --------------------------------------------------------------------------------------------

def spawn(argv, log_path, env, death_signal):
    """A child in its own process group (Ctrl-C reaches only this script, which stops the children
    in order), which the kernel sends `death_signal` should this script die first."""
    def setup():
        _libc.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)

    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=setup)


def signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(procs, timeout, sig=signal.SIGTERM):
    """Sends `sig` (None: nothing, they are to exit by themselves) to the process group of each
    running proc and waits up to `timeout` s in all; those still there get SIGTERM, then SIGKILL
    5 s later. Returns {pid: exit status, or why it was killed}."""
    if sig is not None:
        for p in procs:
            if p.poll() is None:
                signal_group(p, sig)
    deadline = time.monotonic() + timeout
    codes = {}
    for p in procs:
        try:
            codes[p.pid] = p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[p.pid] = "no exit within %.0f s%s" % (timeout, " of %s" % signal.Signals(sig).name if sig else "")
            for last in (signal.SIGTERM, signal.SIGKILL):
                signal_group(p, last)
                try:
                    p.wait(5.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
        signal_group(p, signal.SIGKILL)  # whatever the leader left in its group
    return codes


def free_tcp_ports(n):
    """`n` distinct loopback TCP ports that were free a moment ago (all bound at once, then
    closed, so no two are the same)."""
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            socks[-1].bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTWIRE_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --------------------------------------------------------------------------------------------
# /proc and /metrics
# --------------------------------------------------------------------------------------------

_WRITING = re.compile(r"\.lwck\.tmp\.\d+$")  # a checkpoint file being written (renamed when done)


def fd_reading(pid):
    """(descriptors, {kind: count}) of a process. Kinds: socket, pipe, anon_inode:[...],
    /dev/shm/* (registered buffers), or the path of a file. A checkpoint file still being written
    (its temporary name) is not counted: a descriptor kept after the write would show the file's
    final name and count."""
    kinds = {}
    n = 0
    d = "/proc/%d/fd" % pid
    for fd in os.listdir(d):
        try:
            target = os.readlink(os.path.join(d, fd))
        except OSError:
            continue  # closed meanwhile
        if target.startswith(("socket:", "pipe:")):
            kind = target.split(":", 1)[0]
        elif target.startswith("/dev/shm/"):
            kind = "/dev/shm/*"
        else:
            kind = target
        kinds[kind] = kinds.get(kind, 0) + 1
        if not _WRITING.search(target):
            n += 1
    return n, kinds


_STATUS_FIELDS = {"VmRSS": "rss_kib", "RssAnon": "anon_kib", "RssShmem": "shmem_kib", "Threads": "threads"}


def proc_figures(pid):
    """{"rss_kib", "anon_kib", "shmem_kib", "threads", "fds", "fd_readings", "fd_kinds"} of a live
    process (anon_kib, shmem_kib: the heap's and the mapped shared-memory buffers' part of the
    RSS, to tell a heap leak from a buffer kept mapped). fds is the median of FD_READINGS
    readings FD_READING_GAP_S apart, so a descriptor open for less than about two gaps (a client
    reconnecting, a buffer being replaced) does not count."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            key = _STATUS_FIELDS.get(line.split(":", 1)[0])
            if key:
                out[key] = int(line.split()[1])
    readings = []
    for i in range(FD_READINGS):
        if i:
            time.sleep(FD_READING_GAP_S)
        n, kinds = fd_reading(pid)
        readings.append(n)
    out["fds"] = int(statistics.median(readings))
    out["fd_readings"] = readings
    out["fd_kinds"] = kinds
    return out


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """[(name, {label: value}, float)] of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric(samples, name, **labels):
    """Sum of the samples of `name` whose labels match; a label's wanted value may be a
    predicate."""
    total = 0.0
    for n, lab, v in samples:
        if n != name:
            continue
        if all((want(lab.get(k, "")) if callable(want) else lab.get(k) == want) for k, want in labels.items()):
            total += v
    return total


def _code_at_least(lo, hi):
    return lambda c: c.isdigit() and lo <= int(c) < hi


def sidecar_counters(samples):
    """(error counters, other figures) from one sidecar's /metrics."""
    errors = {
        "steps_failed": metric(samples, "lightwire_steps_total", result="failed"),
        "steps_nonfinite": metric(samples, "lightwire_steps_total", result="nonfinite"),
        "http_4xx": metric(samples, "lightwire_http_requests_total", code=_code_at_least(400, 500)),
        "http_5xx": metric(samples, "lightwire_http_requests_total", code=_code_at_least(500, 600)),
        "auth_failures": metric(samples, "lightwire_auth_failures_total"),
        "result_mismatches": metric(samples, "lightwire_result_mismatches_total"),
        "checkpoints_failed": metric(samples, "lightwire_checkpoints_total", result="failed"),
    }
    info = {
        "tensor_steps_ok": metric(samples, "lightwire_steps_total", result="ok"),
        "peers_up": metric(samples, "lightwire_peer_up"),
        "peers": sum(1 for n, _, _ in samples if n == "lightwire_peer_up"),
        "registered_buffers": metric(samples, "lightwire_registered_buffers"),
        "state_bytes": metric(samples, "lightwire_state_bytes"),
        "anomalies": metric(samples, "lightwire_anomalies_total"),
        "rollbacks": metric(samples, "lightwire_rollbacks_total"),
        "full_syncs": metric(samples, "lightwire_full_syncs_total"),
        "checkpoints_ok": metric(samples, "lightwire_checkpoints_total", result="ok"),
        "http_requests": metric(samples, "lightwire_http_requests_total"),
        "http_errors": {"%s %s" % (lab.get("route"), lab.get("code")): int(v) for n, lab, v in samples
                        if n == "lightwire_http_requests_total" and v
                        and _code_at_least(400, 600)(lab.get("code", ""))},
    }
    return {k: int(v) for k, v in errors.items()}, info


_LOG_LEVEL = re.compile(r'^\S+ (warn|warning|error|critical|err) ')


def log_problems(path):
    """{"error": [lines], "warn": [lines]} of a sidecar log (error and critical lines count as
    errors; warnings are only shown)."""
    out = {"error": [], "warn": []}
    try:
        with open(path, "r", errors="replace") as f:
            for line in f:
                m = _LOG_LEVEL.match(line)
                if m:
                    out["warn" if m.group(1).startswith("warn") else "error"].append(line.rstrip())
    except OSError:
        pass
    return out


# --------------------------------------------------------------------------------------------
# the verdict (pure functions over the recorded samples; also used by tests/python/test_soak.py)
# --------------------------------------------------------------------------------------------

def rss_growth(rss):
    """(first, last, growth) over the samples after warm-up (definitions()["rss_growth"])."""
    if not rss:
        return None, None, None
    k = max(1, int(round(len(rss) * RSS_WINDOW)))
    first = statistics.median(rss[:k])
    last = statistics.median(rss[-k:])
    return first, last, (last - first) / float(first)


def fd_check(samples, warm_end):
    """(baseline, max after warm-up, last) of one sidecar's samples [(t, fds)]."""
    before = [f for t, f in samples if warm_end - FD_BASELINE_S <= t <= warm_end]
    after = [f for t, f in samples if t > warm_end]
    if not before or not after:
        return None, None, None
    return max(before), max(after), after[-1]


def judge(per_sidecar, client_errors, problems, warm_end, rss_limit=RSS_LIMIT):
    """per_sidecar: [{"rank", "samples": [{"t", "rss_kib", "fds", ...}], "errors": {...},
    "log_errors": n, "peer_down_samples": n, "last_rate": steps/s}]. Returns the verdict dict:
    {"pass", "checks": {name: {"pass", "detail"}}, "sidecars": [figures]}."""
    checks = {}
    figures = []
    total_errors = sum(client_errors.values())
    rss_ok = fds_ok = progress_ok = True
    rss_detail, fd_detail, progress_detail, error_detail = [], [], [], []
    for sc in per_sidecar:
        after = [s for s in sc["samples"] if s["t"] > warm_end]
        first, last, growth = rss_growth([s["rss_kib"] for s in after])
        base, top, end = fd_check([(s["t"], s["fds"]) for s in sc["samples"]], warm_end)
        errs = dict(sc["errors"], log_errors=sc["log_errors"], peer_down_samples=sc["peer_down_samples"])
        n_errs = sum(errs.values())
        total_errors += n_errs
        if n_errs:
            error_detail.append("rank %d: %s" % (sc["rank"], ", ".join("%s %d" % kv for kv in errs.items() if kv[1])))
        if growth is None or 100 * growth > rss_limit:
            rss_ok = False
        rss_detail.append("rank %d %s" % (sc["rank"], "no samples" if growth is None
                                          else "%+.2f %%" % (100 * growth)))
        if base is None or top > base:
            fds_ok = False
        fd_detail.append("rank %d %s" % (sc["rank"], "no samples" if base is None else "%d -> max %d" % (base, top)))
        if not sc["last_rate"] > 0:
            progress_ok = False
        progress_detail.append("rank %d %.2f steps/s" % (sc["rank"], sc["last_rate"]))
        figures.append({"rank": sc["rank"], "rss_kib_warm": first, "rss_kib_end": last, "rss_growth": growth,
                        "fds_warm": base, "fds_max_after": top, "fds_end": end,
                        "threads_end": after[-1]["threads"] if after else None, "errors": errs})
    if client_errors:
        error_detail.insert(0, "trainers: %s" % ", ".join("%s %d" % kv for kv in sorted(client_errors.items())))
    checks["errors"] = {"pass": total_errors == 0, "detail": "; ".join(error_detail) or "none"}
    checks["rss_growth"] = {"pass": rss_ok, "detail": ", ".join(rss_detail)}
    checks["fds"] = {"pass": fds_ok, "detail": ", ".join(fd_detail)}
    checks["alive"] = {"pass": not problems, "detail": "; ".join(problems) or "all ran and exited cleanly"}
    checks["progress"] = {"pass": progress_ok, "detail": ", ".join(progress_detail)}
    return {"pass": all(c["pass"] for c in checks.values()), "checks": checks, "sidecars": figures,
            "errors_total": total_errors}


# --------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------

class Sidecar(object):
    def __init__(self, soak, rank):
        self.soak = soak
        self.rank = rank
        self.dir = os.path.join(soak.root, "r%d" % rank)
        os.makedirs(self.dir)
        self.socket = os.path.join(self.dir, "s.sock")
        self.state_dir = os.path.join(self.dir, "state")
        self.log = os.path.join(self.dir, "sidecar.log")
        self.proc = None
        self.admin_port = self.control_port = None
        self.samples = []
        self.errors = {}
        self.errors_at_start = {}   # the counters once ready (the readiness probes' 503s are not errors)
        self.info = {}
        self.peer_down_samples = 0
        self.history = [(0.0, 0)]   # (elapsed, steps) at each report
        self.last_rate = 0.0

    def argv(self):
        o = self.soak.opts
        peers = ",".join("127.0.0.1:%d" % p for p in self.soak.ports)
        return [o.bin, "serve", "--config", self.soak.config, "--job-id", "soak", "--socket", self.socket,
                "--control-tcp", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                "--local-trainers", str(o.trainers), "--threads", str(o.sidecar_threads),
                "--rank", str(self.rank), "--world-size", str(o.sidecars), "--transport", "tcp",
                "--topology", "ring", "--peer-listen", "127.0.0.1:%d" % self.soak.ports[self.rank],
                "--peers", peers, "--state-dir", self.state_dir, "--log-level", "info",
                "--full-sync-every", str(o.full_sync_every), "--checkpoint-every", str(o.periodic_checkpoint_every),
                "--checkpoint-keep", "2"]

    def start(self):
        env = clean_env()
        env["LIGHTWIRE_PEER__SECRET"] = self.soak.secret
        self.proc = spawn(self.argv(), self.log, env, signal.SIGKILL)

    def client(self, timeout=(2.0, 10.0)):
        return lightwire.Client(socket_path=self.socket, timeout=timeout)

    def admin(self):
        return lightwire.Client(url="http://127.0.0.1:%d" % self.admin_port, timeout=(2.0, 10.0))

    def ready(self):
        """True once /readyz is 200 (listener ports known from then on)."""
        if not os.path.exists(self.socket):
            return False
        c = self.client((1.0, 2.0))
        try:
            c.request("GET", "/readyz")
            listeners = c.status()["listeners"]
            self.admin_port, self.control_port = int(listeners["admin_port"]), int(listeners["control_tcp_port"])
            return True
        except lightwire.LightwireError:
            return False
        finally:
            c.close()

    def scrape(self):
        """Reads /metrics on the admin listener (a new connection each time: churn of that
        listener too). Returns False when it cannot."""
        c = self.admin()
        try:
            errors, self.info = sidecar_counters(parse_metrics(c.metrics()))
            self.errors = {k: v - self.errors_at_start.get(k, 0) for k, v in errors.items()}
            if self.info["peers_up"] < self.info["peers"]:
                self.peer_down_samples += 1
            return True
        except lightwire.LightwireError as e:
            self.scrape_error = str(e)
            return False
        finally:
            c.close()

    def prune_checkpoints(self, keep=2):
        """The trainer-driven checkpoint files are never pruned by the sidecar (docs/api.md);
        an operator removes old ones, as this does."""
        d = os.path.join(self.state_dir, "trainer")
        try:
            files = sorted((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getmtime)
        except OSError:
            return
        for f in files[:-keep]:
            try:
                os.unlink(f)
            except OSError:
                pass


class Trainer(object):
    def __init__(self, soak, sidecar, index):
        self.soak, self.sidecar, self.index = soak, sidecar, index
        name = "t%d-%d" % (sidecar.rank, index)
        self.stats_path = os.path.join(soak.root, name + ".json")
        self.log = os.path.join(soak.root, name + ".log")
        self.proc = None
        self.pid = None

    def start(self):
        o, sc = self.soak.opts, self.sidecar
        argv = [sys.executable, os.path.join(HERE, "trainer.py"), "--socket", sc.socket,
                "--rank", str(sc.rank), "--trainer", str(self.index), "--sidecars", str(o.sidecars),
                "--local-trainers", str(o.trainers), "--stats", self.stats_path, "--stop", self.soak.stop_file,
                "--checkpoint-every", str(o.checkpoint_every),
                "--first-checkpoint", str(min(o.checkpoint_every, o.warmup / 2))]
        if self.index % 2 == 1:
            argv += ["--url", "http://127.0.0.1:%d" % sc.control_port]  # the TCP control listener
        self.proc = spawn(argv, self.log, clean_env(), signal.SIGTERM)
        self.pid = self.proc.pid

    def stats(self):
        try:
            with open(self.stats_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"steps": 0, "errors": 0, "errors_by_kind": {}}


class Soak(object):
    def __init__(self, opts):
        self.opts = opts
        self.root = tempfile.mkdtemp(prefix="lw-soak-")
        self.config = os.path.join(self.root, "lightwire.yaml")
        with open(self.config, "w") as f:
            f.write(workload.config_yaml())
        self.stop_file = os.path.join(self.root, "stop")
        self.secret = os.urandom(16).hex()
        self.ports = free_tcp_ports(opts.sidecars)
        self.sidecars = [Sidecar(self, r) for r in range(opts.sidecars)]
        self.trainers = [Trainer(self, sc, t) for sc in self.sidecars for t in range(opts.trainers)]
        self.deaths = []
        self.intervals = []
        self.t0 = None

    # ------------------------------------------------------------------ start and stop

    def start(self, timeout=30.0):
        for sc in self.sidecars:
            sc.start()
        deadline = time.monotonic() + timeout
        for sc in self.sidecars:
            while not sc.ready():
                if sc.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("sidecar rank %d not ready (exit %s); log %s:\n%s"
                                       % (sc.rank, sc.proc.poll(), sc.log, tail(sc.log)))
                time.sleep(0.05)
        for sc in self.sidecars:
            if not sc.scrape():
                raise RuntimeError("sidecar rank %d: /metrics unreadable: %s" % (sc.rank, sc.scrape_error))
            sc.errors_at_start = dict(sc.errors)
            sc.errors = {}
        for t in self.trainers:
            t.start()
        self.t0 = time.monotonic()
        print("soak: pids: sidecars %s, trainers %s" % (" ".join(str(sc.proc.pid) for sc in self.sidecars),
                                                        " ".join(str(t.pid) for t in self.trainers)), flush=True)

    def stop_trainers(self):
        """All trainers stop after the same step (a few steps ahead of the fastest, so none has
        passed it): no step is left half sent. Returns problems (strings)."""
        stats = [t.stats() for t in self.trainers]
        rate = max([iv["rate"] for iv in self.intervals[-len(self.sidecars):]] or [1.0])
        stop_at = max(s.get("steps", 0) for s in stats) + int(rate * STOP_MARGIN_S) + 3
        with open(self.stop_file + ".tmp", "w") as f:
            f.write("%d\n" % stop_at)
        os.replace(self.stop_file + ".tmp", self.stop_file)
        codes = stop_all([t.proc for t in self.trainers], STOP_WAIT_S, sig=None)
        problems = []
        for t in self.trainers:
            s = t.stats()
            if codes[t.pid] != 0 or not s.get("finished"):
                problems.append("trainer %d/%d: exit %s, finished %s%s"
                                % (t.sidecar.rank, t.index, codes[t.pid], s.get("finished"),
                                   "; " + s["fatal"] if s.get("fatal") else ""))
        return problems

    def stop_sidecars(self):
        codes = stop_all([sc.proc for sc in self.sidecars], SIDECAR_STOP_S)
        return ["sidecar rank %d: exit %s after SIGTERM" % (sc.rank, codes[sc.proc.pid])
                for sc in self.sidecars if codes[sc.proc.pid] != 0]

    def kill_everything(self):
        stop_all([t.proc for t in self.trainers if t.proc], 10.0)
        stop_all([sc.proc for sc in self.sidecars if sc.proc], SIDECAR_STOP_S)
        for t in self.trainers:   # segments of a trainer that could not unlink them
            if t.pid is None:
                continue
            prefix = "lightwire-%d-" % t.pid
            for name in os.listdir("/dev/shm"):
                if name.startswith(prefix):
                    try:
                        os.unlink(os.path.join("/dev/shm", name))
                    except OSError:
                        pass

    # ------------------------------------------------------------------ watching

    def elapsed(self):
        return time.monotonic() - self.t0

    def sample(self):
        """One /proc sample of every sidecar; notes processes that died."""
        t = self.elapsed()
        for sc in self.sidecars:
            if sc.proc.poll() is not None:
                self.deaths.append("sidecar rank %d exited with %s at %.0f s" % (sc.rank, sc.proc.returncode, t))
                continue
            try:
                sc.samples.append(dict(proc_figures(sc.proc.pid), t=round(t, 2)))
            except OSError:
                pass  # exited between poll and read: seen at the next sample
        for tr in self.trainers:
            if tr.proc.poll() is not None:
                self.deaths.append("trainer %d/%d exited with %s at %.0f s; log %s:\n%s"
                                   % (tr.sidecar.rank, tr.index, tr.proc.returncode, t, tr.log, tail(tr.log)))

    def report(self):
        """One line per sidecar. Its rate: steps over the last --interval seconds (at least)."""
        t = self.elapsed()
        for sc in self.sidecars:
            mine = [tr.stats() for tr in self.trainers if tr.sidecar is sc]
            steps = min(s.get("steps", 0) for s in mine)
            client_errors = sum(s.get("errors", 0) for s in mine)
            scraped = sc.scrape()
            sc.prune_checkpoints()
            then = [h for h in sc.history if h[0] <= t - 0.99 * self.opts.interval] or sc.history[:1]
            rate = (steps - then[-1][1]) / max(1e-9, t - then[-1][0])
            sc.history.append((t, steps))
            sc.last_rate = rate
            fig = sc.samples[-1] if sc.samples else {}
            iv = {"t": round(t, 1), "rank": sc.rank, "steps": steps, "rate": round(rate, 3),
                  "client_errors": client_errors, "sidecar_errors": dict(sc.errors), "info": dict(sc.info),
                  "rss_kib": fig.get("rss_kib"), "fds": fig.get("fds"), "threads": fig.get("threads"),
                  "scraped": scraped}
            self.intervals.append(iv)
            errs = ", ".join("%s %d" % kv for kv in sorted(sc.errors.items()) if kv[1])
            print("[%6.0fs%s] rank %d: steps %6d (%5.2f/s)  rss %7.1f MiB  fds %3s  threads %3s | "
                  "errors: trainers %d, sidecar %d%s%s | peers up %d/%d, buffers %d, tensor steps ok %d"
                  % (t, " warm-up" if t <= self.opts.warmup else "", sc.rank, steps, rate,
                     (fig.get("rss_kib") or 0) / 1024.0, fig.get("fds"), fig.get("threads"), client_errors,
                     sum(sc.errors.values()), " (%s)" % errs if errs else "",
                     "" if scraped else " (metrics unreadable)", sc.info.get("peers_up", 0), sc.info.get("peers", 0),
                     sc.info.get("registered_buffers", 0), sc.info.get("tensor_steps_ok", 0)), flush=True)

    def run(self):
        o = self.opts
        print("soak: %d sidecars x %d local trainers, %s, duration %.0f s, warm-up %.0f s, interval %.0f s; "
              "work dir %s" % (o.sidecars, o.trainers, o.bin, o.duration, o.warmup, o.interval, self.root),
              flush=True)
        print("soak: tensors: %s" % ", ".join("%s %s[%d] %s" % (s[0], s[2], s[1], workload.codec_of(s))
                                               for s in workload.TENSORS), flush=True)
        self.start()
        next_sample, next_report = 0.0, o.interval
        while self.elapsed() < o.duration and not self.deaths:
            now = self.elapsed()
            if now < next_sample:
                time.sleep(min(next_sample, o.duration) - now)
                continue
            next_sample += SAMPLE_EVERY_S
            self.sample()
            if self.elapsed() >= next_report:
                next_report += o.interval
                self.report()
        if not self.deaths:
            self.sample()
            self.report()
        problems = list(self.deaths)
        run_end = self.elapsed()
        if not self.deaths:
            problems += self.stop_trainers()
        for sc in self.sidecars:    # the counters after the last step
            if sc.proc.poll() is None:
                sc.scrape()
        problems += self.stop_sidecars()
        return problems, run_end

    def verdict(self, problems):
        trainer_stats = [dict(t.stats(), rank=t.sidecar.rank, index=t.index) for t in self.trainers]
        client_errors = {}
        for s in trainer_stats:
            for k, v in s.get("errors_by_kind", {}).items():
                client_errors[k] = client_errors.get(k, 0) + v
        per_sidecar = []
        for sc in self.sidecars:
            logs = log_problems(sc.log)
            sc.log_lines = logs
            per_sidecar.append({"rank": sc.rank, "samples": sc.samples, "errors": sc.errors,
                                "log_errors": len(logs["error"]), "peer_down_samples": sc.peer_down_samples,
                                "last_rate": sc.last_rate})
        return judge(per_sidecar, client_errors, problems, self.opts.warmup, self.opts.rss_limit), trainer_stats


def tail(path, n=20):
    try:
        with open(path, "r", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def mib(kib):
    return "-" if kib is None else "%.1f" % (kib / 1024.0)


def summed(trainer_stats, key):
    """"k n, ..." of the counters `key` ({k: n}) added over the trainers."""
    total = {}
    for s in trainer_stats:
        for k, v in s.get(key, {}).items():
            total[k] = total.get(k, 0) + v
    return ", ".join("%s %d" % kv for kv in sorted(total.items()))


def print_summary(soak, verdict, trainer_stats, run_end):
    steps = {}
    for s in trainer_stats:
        steps[s["rank"]] = min(steps.get(s["rank"], 1 << 62), s.get("steps", 0))
    print()
    print("%-4s %8s %8s %12s %12s %8s %8s %8s %8s %8s %7s" % (
        "rank", "steps", "steps/s", "RSS warm MiB", "RSS end MiB", "growth", "fds warm", "fds max", "fds end",
        "threads", "errors"))
    for f in verdict["sidecars"]:
        print("%-4d %8d %8.2f %12s %12s %8s %8s %8s %8s %8s %7d" % (
            f["rank"], steps.get(f["rank"], 0), steps.get(f["rank"], 0) / max(1e-9, run_end),
            mib(f["rss_kib_warm"]), mib(f["rss_kib_end"]),
            "-" if f["rss_growth"] is None else "%+.2f%%" % (100 * f["rss_growth"]),
            f["fds_warm"], f["fds_max_after"], f["fds_end"], f["threads_end"], sum(f["errors"].values())))
    tensor_steps = sum(s.get("tensor_steps", 0) for s in trainer_stats)
    print("trainers: %d tensor emits checked (%s); paths: %s; modes (shared-memory replies): %s; churn: %s" % (
        tensor_steps, summed(trainer_stats, "checks"), summed(trainer_stats, "paths"),
        summed(trainer_stats, "modes"), summed(trainer_stats, "churn")))
    for s in trainer_stats:
        if s.get("last_errors"):
            print("trainer %d/%d errors: %s" % (s["rank"], s["index"], " | ".join(s["last_errors"][-3:])))
    for sc in soak.sidecars:
        for kind in ("error", "warn"):
            lines = getattr(sc, "log_lines", {}).get(kind, [])
            if lines:
                print("rank %d log, %d %s line(s), first: %s" % (sc.rank, len(lines), kind, lines[0]))
    print()
    for name, c in verdict["checks"].items():
        print("%-10s %s  %s" % (name, "ok  " if c["pass"] else "FAIL", c["detail"]))
        print("%-10s       (%s)" % ("", definitions(soak.opts.rss_limit)[name]))
    print()
    print("VERDICT: %s (%d sidecars, %.0f s, %d errors)" % (
        "PASS" if verdict["pass"] else "FAIL: " + ", ".join(n for n, c in verdict["checks"].items() if not c["pass"]),
        len(soak.sidecars), run_end, verdict["errors_total"]), flush=True)


def write_json(path, soak, verdict, trainer_stats, run_end):
    doc = {"command": [sys.executable] + sys.argv, "options": vars(soak.opts), "tensors": workload.TENSORS,
           "definitions": definitions(soak.opts.rss_limit), "verdict": verdict, "trainers": trainer_stats,
           "intervals": soak.intervals, "run_seconds": run_end, "work_dir": soak.root,
           "samples": {sc.rank: sc.samples for sc in soak.sidecars},
           "logs": {sc.rank: getattr(sc, "log_lines", {}) for sc in soak.sidecars},
           "pids": {"sidecars": [sc.proc.pid for sc in soak.sidecars], "trainers": [t.pid for t in soak.trainers]}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Exit status 0 only when the verdict is PASS; 2 on bad usage or a "
                                       "failed start; 130 when interrupted.")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before RSS and fds are judged (default 20%% of --duration, at most 120)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between report lines (default 10)")
    p.add_argument("--sidecars", type=int, default=3, help="sidecars of the job (default 3)")
    p.add_argument("--trainers", type=int, default=2, help="local trainers (processes) per sidecar (default 2)")
    p.add_argument("--sidecar-threads", type=int, default=1, help="each sidecar's --threads (default 1)")
    p.add_argument("--checkpoint-every", type=float, default=30.0,
                   help="seconds between POST /v1/checkpoint (default 30; 0 = none)")
    p.add_argument("--rss-limit", type=float, default=RSS_LIMIT,
                   help="RSS growth allowed after warm-up, per cent (default %g)" % RSS_LIMIT)
    p.add_argument("--full-sync-every", type=int, default=50,
                   help="the sidecars' policies.full_sync_every, steps (default 50: the first full-sync, "
                        "which allocates dense buffers once, falls within the warm-up)")
    p.add_argument("--periodic-checkpoint-every", type=int, default=75,
                   help="the sidecars' state.checkpoint_every, steps (default 75, kept: 2)")
    p.add_argument("--json", metavar="FILE", help="write every sample, interval and the verdict here")
    p.add_argument("--bin", default=os.environ.get("LIGHTWIRE_BIN")
                   or os.path.join(REPO, "build-release", "proxy", "lightwire"),
                   help="the lightwire binary (default $LIGHTWIRE_BIN, else build-release/proxy/lightwire)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, state) even on success")
    o = p.parse_args(argv)
    if o.warmup is None:
        o.warmup = min(120.0, 0.2 * o.duration)
    if o.sidecars < 2 or o.trainers < 1 or o.duration <= o.warmup or o.interval <= 0:
        p.error("need --sidecars >= 2, --trainers >= 1, --duration > --warmup, --interval > 0")
    if not os.access(o.bin, os.X_OK):
        p.error("no lightwire binary at %s (--bin or $LIGHTWIRE_BIN)" % o.bin)
    return o


def main(argv=None):
    opts = parse(argv)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    soak = Soak(opts)
    keep = True   # the work directory (logs, state) stays after a failure, and with --keep
    try:
        try:
            problems, run_end = soak.run()
        except RuntimeError as e:
            print("soak: %s" % e, file=sys.stderr)
            return 2
        verdict, trainer_stats = soak.verdict(problems)
        keep = opts.keep or not verdict["pass"]
        print_summary(soak, verdict, trainer_stats, run_end)
        if opts.json:
            write_json(opts.json, soak, verdict, trainer_stats, run_end)
        return 0 if verdict["pass"] else 1
    except Interrupted as e:
        keep = opts.keep
        print("soak: interrupted (%s); stopping every child" % e, file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        soak.kill_everything()
        if keep:
            print("soak: logs and state kept in %s" % soak.root, file=sys.stderr)
        else:
            shutil.rmtree(soak.root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
