#!/usr/bin/env python3
"""Memory of the sidecars per codec, for sizing (docs/deploy.md "Sizing").

Starts a job of --world-size sidecars on loopback for each row, one trainer per sidecar handing one
2-D tensor of --elements fp32 values (rows x cols, so PowerSGD factorises it) through a registered
shared-memory segment (the DDP hook's path; --path http: as the request body), --steps times. Every row pins what it runs: warm-up and
the PowerSGD start step off, so each step really runs the row's codec; the bench checks every
reply's codec and mode, and each sidecar's lightwire_state_bytes against the formula of
docs/deploy.md "Sizing".

Measured per sidecar: its own memory (RssAnon: the segment the trainer writes is shared memory,
RssShmem, not counted; with --path http the body the sidecar holds is its own) sampled every few
milliseconds from before the first step to after the last, peak minus the idle figure (after start, before any step), as a multiple of the tensor; VmHWM minus
RssShmem as a cross-check. The worst sidecar of the job is reported. One extra row, `model`, is a
model of --model-tensors tensors of --elements / --model-tensors values each (dgc with momentum),
each its own tensor with its own state.

    $PYTHON bench/memory.py [--elements 25000000] [--world-size 4] [--steps 4] [--path shm|http]
                            [--rows none,fp16,...] [--json FILE] [--no-state-check] [--bin ...]
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "clients", "python"))

import numpy as np  # noqa: E402

import lightwire  # noqa: E402

# name -> (codec flags, targets: peak own memory minus idle, as a multiple of the tensor)
ROWS = {
    "none": (["--codec", "none"], 1.2),
    "fp16": (["--codec", "fp16"], 1.2),
    "qsgd": (["--codec", "qsgd"], 1.2),
    "topk": (["--codec", "topk", "--density", "0.01"], 2.2),
    "dgc": (["--codec", "dgc", "--density", "0.01"], 2.2),
    "dgc-momentum": (["--codec", "dgc", "--density", "0.01", "--momentum", "0.9"], 3.2),
    "powersgd": (["--codec", "powersgd"], 2.2),
    "model": (["--codec", "dgc", "--density", "0.01", "--momentum", "0.9"], 3.2),
}
EXPECT_CODEC = {"dgc-momentum": "dgc", "model": "dgc"}

POWERSGD_META = 8


def isqrt_ceil(n):
    r = int(n ** 0.5)
    while r * r < n:
        r += 1
    while r > 0 and (r - 1) * (r - 1) >= n:
        r -= 1
    return r


def state_bytes(row, n, shape, rank=1):
    """The codec state of one tensor of n elements with `shape` (docs/deploy.md "Sizing")."""
    if row in ("none", "fp16", "qsgd"):
        return 0
    if row in ("topk", "dgc"):
        return 4 * n
    if row in ("dgc-momentum", "model"):
        return 8 * n
    if row == "powersgd":
        if len(shape) >= 2:
            rows = shape[0]
            cols = n // rows
        else:
            cols = isqrt_ceil(n)
            rows = -(-n // cols)
        return 4 * (n + POWERSGD_META + cols * min(rank, rows, cols))
    raise ValueError(row)


def free_ports(count):
    socks, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def status_kb(pid, field):
    with open("/proc/%d/status" % pid) as f:
        m = re.search(r"%s:\s+(\d+)" % field, f.read())
    return int(m.group(1)) if m else 0


class Sampler(threading.Thread):
    """Samples RssAnon of every pid until stopped; keeps each one's peak (kB)."""

    def __init__(self, pids, every=0.005):
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.peak = {p: 0 for p in pids}
        self.stop_ = threading.Event()

    def run(self):
        while not self.stop_.is_set():
            for p in self.pids:
                try:
                    self.peak[p] = max(self.peak[p], status_kb(p, "RssAnon"))
                except OSError:
                    pass
            time.sleep(self.every)

    def stop(self):
        self.stop_.set()
        self.join()


def gauge(text, name):
    """The value of an unlabelled (or first) sample of metric `name` in an exposition, 0 if none."""
    m = re.search(r"^%s(?:\{[^}]*\})? (\S+)" % name, text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for_socket(proc, sock, what, timeout=60.0):
    """Waits until `proc` (a starting sidecar) has created its socket `sock`."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("%s: a sidecar did not start" % what)
        time.sleep(0.05)


def stop(procs):
    """Terminates every process of `procs` (Popen), then waits for each (killed after 30 s)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def shape_of(n):
    for rows in (5000, 4096, 1000, 500, 100):
        if n % rows == 0 and n // rows > 1:
            return [rows, n // rows]
    return [n]


def run_row(binary, row, n, world, steps, tensors, timeout, check_state=True, path="shm"):
    flags, target = ROWS[row]
    d = tempfile.mkdtemp(prefix="lw-mem-")
    ports = free_ports(world)
    procs = []
    env = dict(os.environ, LIGHTWIRE_PEER__SECRET="memory-bench-secret")
    env.pop("LIGHTWIRE_SOCKET", None)
    try:
        for r in range(world):
            sock = os.path.join(d, "s%d.sock" % r)
            args = [binary, "serve", "--socket", sock, "--control-tcp", "", "--admin-listen", "",
                    "--state-dir", "", "--warmup-steps", "0", "--powersgd-start-step", "0",
                    "--rank", str(r), "--world-size", str(world), "--job-id", "memory-bench",
                    "--peer-listen", "127.0.0.1:%d" % ports[r],
                    "--peers", ",".join("127.0.0.1:%d" % p for p in ports)] + flags
            if world == 1:
                args = [binary, "serve", "--socket", sock, "--control-tcp", "", "--admin-listen",
                        "", "--state-dir", "", "--warmup-steps", "0", "--powersgd-start-step",
                        "0"] + flags
            log = open(os.path.join(d, "s%d.log" % r), "wb")
            procs.append((subprocess.Popen(args, stdout=log, stderr=log, env=env), sock, log))
        clients = []
        for p, sock, _ in procs:
            try:
                wait_for_socket(p, sock, "memory")
            except RuntimeError as e:
                raise SystemExit("%s (logs in %s)" % (e, d))
            c = lightwire.Client(socket_path=sock, timeout=timeout)
            c.wait_ready(timeout=60)
            clients.append(c)
        pids = [p.pid for p, _, _ in procs]
        idle = {pid: status_kb(pid, "RssAnon") for pid in pids}
        per = n // tensors
        shape = shape_of(per)
        segs, bids = [], []
        for r, c in enumerate(clients):
            seg = lightwire.ShmSegment(n * 4)
            view = np.frombuffer(seg.buf, dtype=np.float32, count=n)
            np.random.default_rng(r).standard_normal(dtype=np.float32, out=view)
            segs.append((seg, view))
            bids.append(c.register_buffer(seg))
        sampler = Sampler(pids)
        sampler.start()
        errors, replies, times = [], [[] for _ in clients], []

        def trainer(r):
            try:
                c, bid = clients[r], bids[r]
                for step in range(steps):
                    t0 = time.monotonic()
                    for t in range(tensors):
                        name = "w" if tensors == 1 else "layer%03d.weight" % t
                        if path == "shm":
                            rep = c.emit_gradient_shm(bid, name=name, step=step, shape=shape,
                                                      offset=t * per * 4)
                        else:  # the tensor as the request body
                            part = segs[r][1][t * per:(t + 1) * per].reshape(shape)
                            c.emit_gradient(part, name, step)
                            rep = c.last_figures
                        replies[r].append(rep)
                    if r == 0:
                        times.append(time.monotonic() - t0)
                    # The result overwrote the gradient: the next step sends a fresh one.
                    np.random.default_rng(100 * step + r).standard_normal(dtype=np.float32,
                                                                          out=segs[r][1])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append("rank %d: %s" % (r, e))

        threads = [threading.Thread(target=trainer, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.05)
        sampler.stop()
        if errors:
            raise SystemExit("memory: %s: %s" % (row, "; ".join(errors)))
        want = EXPECT_CODEC.get(row, row)
        for r, reps in enumerate(replies):
            for rep in reps:
                if rep.get("codec") != want or rep.get("mode") != "compressed":
                    raise SystemExit("memory: %s: rank %d step %s ran %s (%s), not %s compressed"
                                     % (row, r, rep.get("step"), rep.get("codec"),
                                        rep.get("mode"), want))
        states = []
        for c in clients:
            states.append(gauge(c.metrics(), "lightwire_state_bytes"))
        expect = tensors * state_bytes(row, per, shape)
        for r, s in enumerate(states):
            if check_state and int(s) != expect:
                raise SystemExit("memory: %s: rank %d holds %d state bytes, the formula says %d"
                                 % (row, r, int(s), expect))
        hwm = {pid: status_kb(pid, "VmHWM") - status_kb(pid, "RssShmem") for pid in pids}
        for r, c in enumerate(clients):
            c.release_buffer(bids[r])
            c.close()
        peak_over_idle = max(sampler.peak[pid] - idle[pid] for pid in pids) * 1024
        return {"row": row, "flags": " ".join(flags), "path": path, "elements": n,
                "tensors": tensors,
                "shape": shape, "world_size": world, "steps": steps,
                "idle_mb": max(idle.values()) / 1024.0,
                "peak_anon_mb": max(sampler.peak.values()) / 1024.0,
                "peak_over_idle_mb": peak_over_idle / 1e6,
                "hwm_minus_shmem_mb": max(hwm.values()) / 1024.0,
                "state_mb": max(states) / 1e6, "state_formula_mb": expect / 1e6,
                "ratio": peak_over_idle / (4.0 * n), "target": target,
                "met": peak_over_idle / (4.0 * n) <= target,
                "step_s": min(times) if times else None}
    finally:
        stop([p for p, _, _ in procs])
        for _, _, log in procs:
            log.close()
        for seg in locals().get("segs", []):
            try:
                seg[0].close()
            except Exception:  # noqa: BLE001 - best effort
                pass
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=25_000_000, help="fp32 elements (default 25M)")
    ap.add_argument("--world-size", type=int, default=4, help="sidecars of the job (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="steps per row (default 4)")
    ap.add_argument("--rows", default=",".join(ROWS), help="rows to run (default all: %s)"
                    % ",".join(ROWS))
    ap.add_argument("--model-tensors", type=int, default=100,
                    help="tensors of the `model` row (default 100)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--json", help="also write the rows to this file (JSON list)")
    ap.add_argument("--path", choices=["shm", "http"], default="shm",
                    help="how each trainer hands its tensor over: a registered shared-memory "
                    "segment (the DDP hook's path, default) or the request body")
    ap.add_argument("--no-state-check", action="store_true",
                    help="do not check lightwire_state_bytes against the formula (to measure a "
                    "build from before the one-copy state, whose state was double-buffered)")
    ap.add_argument("--bin", default=os.environ.get("LIGHTWIRE_BIN") or
                    os.path.join(REPO, "build-release", "proxy", "lightwire"))
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error("--rows: unknown %s (known: %s)" % (", ".join(unknown), ", ".join(ROWS)))
    if args.elements < args.model_tensors or args.world_size < 1 or args.steps < 1:
        ap.error("--elements must be >= --model-tensors; --world-size and --steps >= 1")
    if not os.access(args.bin, os.X_OK):
        ap.error("no sidecar binary at %s (build it or pass --bin)" % args.bin)
    mb = args.elements * 4 / 1e6
    # The machine must hold it without swapping (a swapped page is not resident: the figures would
    # be wrong): every sidecar at up to its target plus slack, the segments, the trainer's copies.
    need = (args.world_size * (max(ROWS[r][1] for r in rows) + 0.3) + args.world_size + 0.5) * mb * 1e6
    with open("/proc/meminfo") as f:
        avail = int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1)) * 1024
    if need > avail:
        ap.error("about %.1f GB needed, %.1f GB available: fewer --elements, --world-size or --rows"
                 % (need / 1e9, avail / 1e9))
    print("tensor of %d fp32 elements (%.0f MB), %d sidecar(s), one trainer each, %d steps, %s"
          % (args.elements, mb, args.world_size, args.steps,
             "shared memory" if args.path == "shm" else "request bodies"), flush=True)
    print("%-13s %8s %9s %9s %9s %9s %11s %7s %5s %7s" % (
        "row", "idle MB", "peak MB", "+idle MB", "HWM MB", "state MB", "own/tensor", "target",
        "met", "step s"), flush=True)
    out = []
    for row in rows:
        tensors = args.model_tensors if row == "model" else 1
        print("memory: %s ..." % row, file=sys.stderr, flush=True)
        r = run_row(args.bin, row, args.elements, args.world_size, args.steps, tensors,
                    args.timeout, check_state=not args.no_state_check, path=args.path)
        out.append(r)
        print("%-13s %8.0f %9.0f %9.0f %9.0f %9.0f %10.2fx %6.1fx %5s %7.3f" % (
            row, r["idle_mb"], r["peak_anon_mb"], r["peak_over_idle_mb"],
            r["hwm_minus_shmem_mb"], r["state_mb"], r["ratio"], r["target"],
            "yes" if r["met"] else "NO", r["step_s"] or 0), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
