"""The demo's trainer (clients/python/examples/train_ddp.py) with --to-baseline-loss, as
scripts/demo.sh runs it on its limited link: plain DDP first, then 2 trainers through 2 real
sidecars (dgc with momentum correction) until their loss reaches DDP's final loss. Here on the
loopback as it is (no namespace): the outcome — the step at which each run reaches the target —
does not depend on timing (fixed seeds, fixed summation orders), the seconds do."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(REPO, "clients", "python", "examples", "train_ddp.py")


def test_to_baseline_loss_reports_when_lightwire_reached_ddps_final_loss(cluster_factory):
    cl = cluster_factory(2, codec="dgc", codec_args=["--density", "0.05", "--momentum", "0.9"])
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "clients", "python"),
               OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, TRAINER, "--sockets", ",".join(sc.socket for sc in cl.sidecars),
         "--trainers", "2", "--hidden", "256", "--steps", "60", "--every", "0",
         "--to-baseline-loss"],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    target = re.search(r"plain DDP's final loss: ([0-9.]+) \(mean of its last 20 steps\), first "
                       r"reached at step (\d+)", text)
    assert target, text
    ddp_row = re.search(r"^plain DDP +(\d+) +([0-9.]+) +(\d+)$", text, re.M)
    ours_row = re.search(r"^lightwire +(\d+) +([0-9.]+) +(\d+)$", text, re.M)
    assert ddp_row and ours_row, text
    assert int(ddp_row.group(1)) == int(target.group(2))
    # lightwire stopped at the first multiple of 5 at or after the step it reached the target,
    # within 3 × the baseline's steps; it sent fewer bytes per node and step than DDP's dense
    # gradients (the host's loopback counts other traffic too, so only the order is checked).
    assert 20 <= int(ours_row.group(1)) <= 180
    assert int(ours_row.group(3)) < int(ddp_row.group(3))
    assert re.search(r"lightwire reached plain DDP's final loss [0-9.]+x sooner \([0-9.]+ s "
                     r"against [0-9.]+ s\), sending [0-9]+x fewer bytes per step", text), text


def test_a_negative_min_step_seconds_is_refused():
    """--min-step-seconds (the container test's pace) refuses a negative value before starting
    anything."""
    r = subprocess.run([sys.executable, TRAINER, "--min-step-seconds", "-1", "--sockets", "/x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--min-step-seconds must be >= 0" in r.stderr, r.stderr
