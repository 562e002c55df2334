"""The decision log of a deterministic policy job, as JSON on stdout, to compare two builds
(bench/README.md "Statistics along the ring"): 4 sidecars, dgc 2 % with a warm-up, the adaptive
ratio, full-syncs every 10 steps, losses reported; a NaN on one rank at step 17, an explosion of
one tensor at step 25, a settings change from rank 1 at step 12 and a checkpoint asked by rank 3
at step 20. Prints every rank's log. LIGHTWIRE_BIN picks the build:

    LIGHTWIRE_BIN=A/proxy/lightwire $PYTHON bench/decision_log.py > a.json
"""
import json
import os
import pathlib
import sys
import tempfile
import threading

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "clients", "python"), os.path.join(REPO, "tests", "python")]
from conftest import Cluster  # noqa: E402
import lightwire  # noqa: E402


class TempDirs:
    """What Cluster asks of pytest's tmp_path_factory."""

    def __init__(self):
        self.d = tempfile.mkdtemp(prefix="lw-declog-")

    def mktemp(self, name):
        return pathlib.Path(tempfile.mkdtemp(prefix=name, dir=self.d))


W, STEPS, N = 4, 40, 30000
cl = Cluster(TempDirs(), W, codec="dgc", codec_args=["--density", "0.02", "--adaptive", "true",
             "--full-sync-every", "10", "--warmup-steps", "6"], chunk_elements=8192, peer_timeout=20,
             job_id="declog")
cl.start()


def grad(r, s, t):
    g = np.random.default_rng(1000 * s + 10 * r + t).standard_normal(N).astype(np.float32)
    g *= np.float32(1 + 0.1 * r) * np.float32(0.97 ** s)
    if s == 17 and r == 2 and t == 0: g[5] = np.nan
    if s == 25 and t == 1: g *= np.float32(1e4)
    return g


errs = []


def trainer(r):
    c = lightwire.Client(socket_path=cl[r].socket, timeout=(2.0, 30.0))
    try:
        for s in range(STEPS):
            if s == 12 and r == 1:
                c.put_config({"default": {"codec": "dgc", "density": 0.05}})
            if s == 20 and r == 3:
                c.checkpoint(19)
            for t, name in enumerate(("a", "b")):
                c.emit_gradient(grad(r, s, t), name=name, step=s)
            c.report(s, loss=float(3.0 * 0.95 ** s + 0.01 * r))
    except Exception as e:  # noqa: BLE001 -- reported in the output
        errs.append(repr(e))


ths = [threading.Thread(target=trainer, args=(r,)) for r in range(W)]
for t in ths:
    t.start()
for t in ths:
    t.join(300)
logs = []
for r in range(W):
    c = lightwire.Client(socket_path=cl[r].socket, timeout=(2.0, 20.0))
    logs.append([(d["step"], d["tensor"], d["kind"], d["detail"]) for d in c.status()["policies"]["log"]])
    c.close()
cl.stop()
cl.kill_all()
print(json.dumps({"errors": errs, "logs": logs}))
