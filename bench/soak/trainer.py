"""One load-generating trainer of the soak (started by soak.py, one process per local trainer of
each sidecar): runs steps back to back, every tensor of workload.TENSORS per step, through the
Python client, and checks every reply.

Each tensor of a step goes either as a raw HTTP body (Form 1) or through a registered POSIX
shared-memory buffer (Form 2), alternating with the step, the tensor and the trainer, so a step
often mixes both paths between the trainers of one sidecar. Churn: the client reconnects, one
shared-memory buffer is released and a new one registered, the loss is reported, /v1/status and
/metrics are read, and trainer 0 of rank 0 asks for a checkpoint, each at its own period.

Counters go to a JSON file (--stats, replaced atomically about twice a second). The trainer stops
after the step written in the --stop file (all trainers stop after the same step, so no step is
left half sent), or at SIGTERM/SIGINT.
"""

import argparse
import json
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "clients", "python"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import lightwire  # noqa: E402
import workload  # noqa: E402

STATS_EVERY_S = 0.5
LAST_ERRORS = 8


class Stop(BaseException):
    """SIGTERM/SIGINT: leave at once."""


def _stop(signum, frame):
    raise Stop()


class Trainer(object):
    def __init__(self, args):
        self.args = args
        self.g = args.rank * args.local_trainers + args.trainer
        self.total = args.sidecars * args.local_trainers
        self.bases = workload.bases()
        self.client = None
        self.segments = {}   # tensor index -> registered ShmSegment
        self.stats = {"pid": os.getpid(), "rank": args.rank, "trainer": args.trainer, "steps": 0,
                      "tensor_steps": 0, "errors": 0, "errors_by_kind": {}, "last_errors": [],
                      "checks": {"exact": 0, "finite": 0}, "paths": {"http": 0, "shm": 0}, "modes": {},
                      "churn": {"reconnects": 0, "shm_replaced": 0, "reports": 0, "status_reads": 0,
                                "checkpoints": 0}, "finished": False, "fatal": None}
        self.last_write = 0.0
        self.next_checkpoint = time.monotonic() + (args.first_checkpoint if args.first_checkpoint is not None
                                                   else args.checkpoint_every)

    # ------------------------------------------------------------------ bookkeeping

    def write_stats(self, force=False):
        now = time.monotonic()
        if not force and now - self.last_write < STATS_EVERY_S:
            return
        self.last_write = now
        self.stats["time"] = time.time()
        tmp = self.args.stats + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats, f)
        os.replace(tmp, self.args.stats)

    def error(self, what, step, e):
        """Counts one error (any exception or wrong result) and remembers its message."""
        if isinstance(e, lightwire.LightwireError):
            kind = "%s %s" % (e.status if e.status is not None else "-", e.error)
        else:
            kind = type(e).__name__
        s = self.stats
        s["errors"] += 1
        s["errors_by_kind"][kind] = s["errors_by_kind"].get(kind, 0) + 1
        s["last_errors"] = (s["last_errors"] + ["step %d %s: %s" % (step, what, e)])[-LAST_ERRORS:]
        self.write_stats(force=True)
        time.sleep(0.05)  # no busy loop against a sidecar that is gone

    def guarded(self, what, step, fn):
        """fn() with any exception counted as an error; returns its result or None."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every failure is an error of the soak
            self.error(what, step, e)
            return None

    # ------------------------------------------------------------------ resources

    def connect(self):
        if self.client is not None:
            self.client.close()
        self.client = lightwire.Client(socket_path=self.args.socket, url=self.args.url or None,
                                       timeout=(5.0, 60.0), trainer=self.args.trainer)

    def register(self, idx):
        seg = lightwire.ShmSegment(workload.nbytes(workload.TENSORS[idx]))
        try:
            self.client.register_buffer(seg)
        except BaseException:
            seg.close()
            raise
        self.segments[idx] = seg

    def release(self, idx):
        seg = self.segments.pop(idx)
        try:
            self.client.release_buffer(seg)
        finally:
            seg.close()

    def close_all(self, release):
        for idx in list(self.segments):
            if release:
                self.guarded("release buffer", self.stats["steps"], lambda: self.release(idx))
            else:
                self.segments.pop(idx).close()
        if self.client is not None:
            self.client.close()

    # ------------------------------------------------------------------ one tensor

    def emit(self, idx, step):
        spec = workload.TENSORS[idx]
        name, n, dtype = spec[0], spec[1], spec[2]
        a, b = workload.coefficients(self.g, step, idx)
        use_shm = (step + idx + self.args.trainer) % 2 == 0
        if use_shm:
            if idx not in self.segments:
                self.register(idx)
            seg = self.segments[idx]
            view = np.frombuffer(seg.buf, dtype=dtype, count=n)
            try:
                workload.input_into(view, self.bases[name], a, b)
                reply = self.client.emit_gradient_shm(seg, name, step, dtype=dtype, shape=[n])
                if reply.get("nonfinite") or reply.get("elements") != n:
                    raise workload.CheckFailed("%s step %d: reply %r" % (name, step, reply))
                mode = reply.get("mode", "?")
                self.stats["modes"][mode] = self.stats["modes"].get(mode, 0) + 1
                done = workload.check(spec, idx, step, self.total, view, self.bases[name])
            finally:
                del view  # the segment can be unmapped once no array views it
        else:
            x = np.empty(n, dtype=dtype)
            workload.input_into(x, self.bases[name], a, b)
            got = self.client.emit_gradient(x, name, step)
            if self.client.last_figures.get("nonfinite"):
                raise workload.CheckFailed("%s step %d: the reply says nonfinite" % (name, step))
            done = workload.check(spec, idx, step, self.total, got, self.bases[name])
        self.stats["paths"]["shm" if use_shm else "http"] += 1
        self.stats["checks"][done] += 1
        self.stats["tensor_steps"] += 1

    # ------------------------------------------------------------------ churn between steps

    def churn(self, step):
        a, churn = self.args, self.stats["churn"]
        if step % a.report_every == 0:
            loss = 1.0 + 0.01 * (step % 7)
            if self.guarded("report", step, lambda: self.client.report(step, loss=loss)) is not None:
                churn["reports"] += 1
        if a.trainer == a.local_trainers - 1 and step % a.status_every == 0:
            if self.guarded("status", step, lambda: (self.client.status(), self.client.metrics())) is not None:
                churn["status_reads"] += 1
        if self.g == 0 and a.checkpoint_every > 0 and time.monotonic() >= self.next_checkpoint:
            self.next_checkpoint = time.monotonic() + a.checkpoint_every
            if self.guarded("checkpoint", step, lambda: self.client.checkpoint(step)) is not None:
                churn["checkpoints"] += 1
        if step % a.shm_churn_every == 0:
            idx = (step // a.shm_churn_every) % len(workload.TENSORS)
            if idx in self.segments:
                if self.guarded("replace buffer", step, lambda: (self.release(idx), self.register(idx))) is not None:
                    churn["shm_replaced"] += 1
        if step % a.reconnect_every == 0:
            self.connect()
            churn["reconnects"] += 1

    def stop_step(self):
        try:
            with open(self.args.stop) as f:
                return int(f.read().strip() or "-1")
        except (OSError, ValueError):
            return None

    def run(self):
        self.connect()
        step = 0
        stop_at = None
        while stop_at is None or step <= stop_at:
            for idx in range(len(workload.TENSORS)):
                self.guarded("emit %s" % workload.TENSORS[idx][0], step, lambda: self.emit(idx, step))
            self.stats["steps"] = step + 1
            if stop_at is None:
                stop_at = self.stop_step()
            if stop_at is None or step < stop_at:
                self.churn(step)
            self.write_stats()
            step += 1
        self.close_all(release=True)
        self.stats["finished"] = True
        self.write_stats(force=True)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="the sidecar's control Unix socket")
    p.add_argument("--url", default="", help="http://127.0.0.1:PORT: use the TCP control listener instead")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--trainer", type=int, required=True)
    p.add_argument("--sidecars", type=int, required=True)
    p.add_argument("--local-trainers", type=int, required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--checkpoint-every", type=float, default=30.0, help="seconds (trainer 0 of rank 0; 0 = never)")
    p.add_argument("--first-checkpoint", type=float, default=None, help="seconds (default: --checkpoint-every)")
    p.add_argument("--reconnect-every", type=int, default=25, help="steps")
    p.add_argument("--shm-churn-every", type=int, default=10, help="steps")
    p.add_argument("--report-every", type=int, default=5, help="steps")
    p.add_argument("--status-every", type=int, default=20, help="steps")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    t = Trainer(args)
    try:
        t.run()
    except Stop:
        t.close_all(release=False)
        t.write_stats(force=True)
    except BaseException:
        t.stats["fatal"] = traceback.format_exc()[-2000:]
        t.write_stats(force=True)
        t.close_all(release=False)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
