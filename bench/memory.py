#!/usr/bin/env python3
"""Memory of one sidecar per codec, for sizing (docs/deploy.md "Sizing").

Starts one sidecar (world size 1) per codec, sends one tensor of --elements fp32 values three times
through the Python client, and prints the sidecar's resident memory before and after, its peak
(VmHWM), its codec state (lightwire_state_bytes) and the fastest of the three steps. The resident
memory is split into the sidecar's own (RssAnon) and mapped shared memory (RssShmem: with --path
shm, the trainer's segment, one physical copy that both processes count). --path http
sends the tensor as the request body; --path shm (what the DDP hook does) writes it into a
registered shared-memory segment and sends its buffer id, so the sidecar holds no body. Loopback
only, nothing left behind.

    $PYTHON bench/memory.py [--elements 25000000] [--path http|shm|both] [--bin ...]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "clients", "python"))

import numpy as np  # noqa: E402

import lightwire  # noqa: E402

CODECS = [
    ("none", []),
    ("fp16", []),
    ("qsgd", []),
    ("topk", ["--density", "0.01"]),
    ("dgc", ["--density", "0.01"]),
    ("dgc", ["--density", "0.01", "--momentum", "0.9"]),
    ("powersgd", []),
]


def status_mb(pid, field):
    with open("/proc/%d/status" % pid) as f:
        return int(re.search(r"%s:\s+(\d+)" % field, f.read()).group(1)) / 1024.0


def measure(binary, codec, extra, elements, path):
    d = tempfile.mkdtemp(prefix="lw-mem-")
    sock = os.path.join(d, "s.sock")
    p = subprocess.Popen([binary, "serve", "--socket", sock, "--control-tcp", "", "--admin-listen",
                          "", "--state-dir", "", "--codec", codec] + extra,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("memory: the sidecar did not start: %s"
                                 % p.stderr.read().decode(errors="replace")[-2000:])
            time.sleep(0.05)
        idle = status_mb(p.pid, "VmRSS")
        g = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
        times = []
        with lightwire.Client(socket_path=sock, timeout=600) as c:
            if path == "shm":
                seg = lightwire.ShmSegment(g.nbytes)
                bid = c.register_buffer(seg)
                np.frombuffer(seg.buf, dtype=np.float32, count=elements)[:] = g
            for step in range(3):
                t0 = time.monotonic()
                if path == "shm":
                    c.emit_gradient_shm(bid, name="w", step=step, shape=[elements])
                else:
                    c.emit_gradient(g, "w", step)
                times.append(time.monotonic() - t0)
            m = c.metrics()
            # With the segment still registered (mapped by the sidecar), as during training.
            rss, anon, shmem = (status_mb(p.pid, f) for f in ("VmRSS", "RssAnon", "RssShmem"))
            if path == "shm":
                c.release_buffer(seg)
                seg.close()
        state = float(re.search(r"^lightwire_state_bytes(?:\{[^}]*\})? (\S+)", m, re.M).group(1))
        return {"codec": codec, "params": " ".join(extra), "elements": elements, "path": path,
                "idle_rss_mb": idle, "rss_mb": rss,
                # Of which the trainer's shared-memory segment (one physical copy, counted in the
                # RSS of both processes) and the sidecar's own memory.
                "shmem_mb": shmem, "anon_mb": anon,
                "peak_rss_mb": status_mb(p.pid, "VmHWM"), "state_mb": state / 1e6,
                "step_s": min(times)}
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=25_000_000, help="fp32 elements (default 25M)")
    ap.add_argument("--bin", default=os.environ.get("LIGHTWIRE_BIN") or
                    os.path.join(REPO, "build-release", "proxy", "lightwire"))
    ap.add_argument("--path", choices=["http", "shm", "both"], default="both",
                    help="how the trainer hands the tensor over (default both)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args()
    if args.elements < 1:
        ap.error("--elements must be >= 1")
    if not os.access(args.bin, os.X_OK):
        ap.error("no sidecar binary at %s (build it or pass --bin)" % args.bin)
    mb = args.elements * 4 / 1e6
    if not args.json:
        print("one tensor of %d fp32 elements (%.0f MB), one trainer, world size 1" %
              (args.elements, mb))
        print("%-34s %5s %9s %9s %9s %9s %9s %9s %11s %8s" % (
            "codec", "path", "idle MB", "RSS MB", "anon MB", "shmem MB", "peak MB", "state MB",
            "peak/tensor", "step s"))
    paths = ["http", "shm"] if args.path == "both" else [args.path]
    for codec, extra in CODECS:
        for path in paths:
            print("memory: %s %s (%s) ..." % (codec, " ".join(extra), path), file=sys.stderr,
                  flush=True)
            r = measure(args.bin, codec, extra, args.elements, path)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print("%-34s %5s %9.0f %9.0f %9.0f %9.0f %9.0f %9.0f %10.1fx %8.3f" % (
                    (codec + " " + r["params"]).strip(), path, r["idle_rss_mb"], r["rss_mb"],
                    r["anon_mb"], r["shmem_mb"], r["peak_rss_mb"], r["state_mb"],
                    r["peak_rss_mb"] / mb, r["step_s"]), flush=True)


if __name__ == "__main__":
    main()
