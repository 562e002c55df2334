#!/usr/bin/env python3
"""End-to-end benchmark: real PyTorch DDP training (W trainer processes, CPU) on a rate-limited
link, with PyTorch's own gradient communication against lightwire's, every configuration measured
in the same run. Writes the results JSON, docs/BENCHMARKS.md and its plots (bench/e2e/report.py).
Needs root: it creates a network namespace whose loopback is limited with `tc qdisc ... tbf`, so
every byte between the ranks shares one link of the given rate. Figures only: it never passes or
fails on time. Method: bench/README.md, docs/BENCHMARKS.md.

    /usr/bin/python3 bench/e2e/e2e.py --quick     # MLP at 1 Gbit/s, every configuration (~10 min)
    /usr/bin/python3 bench/e2e/e2e.py             # full: MLP and transformer LM, 1 and 10 Gbit/s
    /usr/bin/python3 bench/e2e/e2e.py --tta       # time to accuracy, MLP at 1 Gbit/s, seeds 0,1,2
    /usr/bin/python3 bench/e2e/e2e.py --tta --tasks lm

Options: --tasks mlp,lm  --rates 1gbit,10gbit  --configs NAME,...  --steps N  --world-size W
--seeds 0,1,2  --out-dir DIR (default docs)  --results FILE  --smoke (tiny models, 2 ranks, 3
steps: checks that everything runs; with --tta: the tta profile at that size)  --list (the
configurations). $LIGHTWIRE_BIN: the executable (default build-release/proxy/lightwire); $PYTHON:
the trainers' interpreter (default /usr/bin/python3).

--tta (time to accuracy, bench/README.md "Time to accuracy"): per task, rate and seed the `ddp`
baseline trains the fixed horizon; every other row of that seed trains until its running-mean
evaluation loss reaches the baseline's final loss, then a few evaluation periods more, never
longer than the baseline's training time nor more steps. It prints its time estimate first.
"""

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import tta  # noqa: E402  (bench/e2e/tta.py: the stop rule and the time-to-accuracy figures)

# Policies off for every lightwire row but the one that is about them, so each codec is measured
# alone (the sidecar's defaults turn the anomaly, rollback and full-sync policies on). The
# schedules (the DGC warm-up, the PowerSGD start step) stay at the sidecar's defaults.
POLICIES_OFF = ["--anomaly", "false", "--rollback", "false", "--full-sync-every", "0"]
# The PowerSGD start step of both PowerSGD implementations: `lightwire serve`'s default
# (schedule.powersgd_start_step), so that PyTorch's hook starts compressing at the same step.
POWERSGD_START = 20
# DGC's momentum correction: the sidecar applies momentum 0.9 (the tasks' SGD momentum) to the
# tensors it compresses with dgc, the trainer steps with lightwire.torch.SGD (docs/codecs.md
# "Momentum with dgc"). Every row whose sidecar arguments give dgc a momentum uses that optimizer.
DGC_MOMENTUM = ["--momentum", "0.9"]

# name: (label, kind, torch hook, sidecar arguments). The first is the baseline.
CONFIGS = [
    ("ddp", "DDP over gloo", "ddp", None, None),
    ("ddp_fp16", "DDP + PyTorch fp16_compress_hook", "torch_hook", "fp16", None),
    ("ddp_powersgd", "DDP + PyTorch PowerSGD hook (rank 1)", "torch_hook", "powersgd", None),
    ("lightwire_none", "lightwire none", "lightwire", None, ["--codec", "none"] + POLICIES_OFF),
    ("lightwire_fp16", "lightwire fp16", "lightwire", None, ["--codec", "fp16"] + POLICIES_OFF),
    ("lightwire_topk", "lightwire topk 1 %", "lightwire", None,
     ["--codec", "topk", "--density", "0.01"] + POLICIES_OFF),
    ("lightwire_dgc", "lightwire dgc 1 % (momentum correction)", "lightwire", None,
     ["--codec", "dgc", "--density", "0.01"] + DGC_MOMENTUM + POLICIES_OFF),
    ("lightwire_dgc_ef", "lightwire dgc 1 % (error feedback)", "lightwire", None,
     ["--codec", "dgc", "--density", "0.01"] + POLICIES_OFF),
    ("lightwire_qsgd4", "lightwire qsgd 4 bits", "lightwire", None,
     ["--codec", "qsgd", "--bits", "4"] + POLICIES_OFF),
    ("lightwire_qsgd8", "lightwire qsgd 8 bits", "lightwire", None,
     ["--codec", "qsgd", "--bits", "8"] + POLICIES_OFF),
    ("lightwire_powersgd", "lightwire powersgd (rank 1)", "lightwire", None,
     ["--codec", "powersgd", "--approx-rank", "1"] + POLICIES_OFF),
    # The policies (docs/policies.md): anomaly bypass, rollback on the reported loss, periodic
    # full-sync at its default period (and the schedules at their defaults, as every row).
    ("lightwire_dgc_policies", "lightwire dgc 1 % + policies", "lightwire", None,
     ["--codec", "dgc", "--density", "0.01"] + DGC_MOMENTUM + ["--anomaly", "true",
                                                               "--rollback", "true"]),
]

# Configurations outside the default list of the fixed-step profiles (whose rows stay as they
# were), for the profiles that name them and for --configs. PowerSGD at rank 4: rank 1's loss
# trails far behind at every horizon measured (bench/README.md), so time to accuracy tries a rank
# that may reach the target.
EXTRA_CONFIGS = [
    # DDP's allreduce from PyTorch's own Python hook: what a Python communication hook costs a
    # step by itself (codec auto's direct windows run through one, the lightwire hook).
    ("ddp_allreduce_hook", "DDP + PyTorch allreduce_hook (Python)", "torch_hook", "allreduce",
     None),
    ("lightwire_powersgd4", "lightwire powersgd (rank 4)", "lightwire", None,
     ["--codec", "powersgd", "--approx-rank", "4"] + POLICIES_OFF),
    # Every other lightwire row goes per layer (the hook's default); this one sends DDP's flat
    # buckets, one tensor each, for the comparison.
    ("lightwire_dgc_flat", "lightwire dgc 1 % (flat buckets)", "lightwire", "flat",
     ["--codec", "dgc", "--density", "0.01"] + DGC_MOMENTUM + POLICIES_OFF),
    # The schedules' defaults against none (what the defaults of docs/policies.md "Schedules"
    # were chosen from).
    ("lightwire_dgc_nowarmup", "lightwire dgc 1 % (momentum correction, no warm-up)", "lightwire",
     None, ["--codec", "dgc", "--density", "0.01", "--warmup-steps", "0"] + DGC_MOMENTUM
     + POLICIES_OFF),
    ("lightwire_powersgd4_start0", "lightwire powersgd (rank 4, from step 0)", "lightwire", None,
     ["--codec", "powersgd", "--approx-rank", "4", "--powersgd-start-step", "0"] + POLICIES_OFF),
    # How the equal-step cost of dgc depends on its density and warm-up (bench/README.md "Why
    # sparse Adam trails at equal steps").
    ("lightwire_dgc4", "lightwire dgc 4 % (momentum correction)", "lightwire", None,
     ["--codec", "dgc", "--density", "0.04"] + DGC_MOMENTUM + POLICIES_OFF),
    # Every element every step, through the same preconditioning (lightwire.torch.AdamW sends each
    # rank's own Adam update of a topk layer): what the per-rank second moment costs alone.
    ("lightwire_topk_all", "lightwire topk 100 % (every element)", "lightwire", None,
     ["--codec", "topk", "--density", "1"] + POLICIES_OFF),
    # codec auto with its defaults (docs/policies.md "codec: auto"): each layer's rung chosen at
    # run time from the measured link and the compute the hook reports, the trainers' own
    # process group (the direct rung) when every layer is best exchanged dense.
    ("lightwire_auto", "lightwire auto", "lightwire", None, ["--codec", "auto"] + POLICIES_OFF),
    # ... with one direct window for the whole run after the first steps (probe_every far beyond
    # the steps): what the hook's direct path costs against DDP, the sidecars beside the trainers
    # but out of the data path.
    ("lightwire_auto_direct", "lightwire auto (one long direct window)", "lightwire", None,
     ["--codec", "auto", "--auto-probe-every", "1000000"] + POLICIES_OFF),
    # ... with DGC's momentum correction as its most compressing rung (the sidecar owns a layer's
    # momentum while it is on that rung; the trainers step with lightwire.torch.SGD, which
    # declares its momentum).
    ("lightwire_auto_dgcm", "lightwire auto (dgc rung with momentum correction)", "lightwire",
     None, ["--codec", "auto", "--auto-ladder", "direct,none,fp16,qsgd:8,qsgd:4,dgc:0.01:0.9"]
     + POLICIES_OFF),
    # The hook with one bucket at the sidecar at a time (max_workers=1, as before buckets went in
    # flight together), against the default of several (bench/README.md "Buckets in flight").
    ("lightwire_none_serial", "lightwire none (one bucket at a time)", "lightwire", "serial",
     ["--codec", "none"] + POLICIES_OFF),
    ("lightwire_fp16_serial", "lightwire fp16 (one bucket at a time)", "lightwire", "serial",
     ["--codec", "fp16"] + POLICIES_OFF),
    # The sparse allreduce (docs/exchange.md "Sparse allreduce"): each chunk's owner keeps its
    # share of a global top-k of the summed selections (at most k entries, traffic flat in W)
    # instead of every rank's selection reaching every rank (up to W x k).
    ("lightwire_dgc_allreduce", "lightwire dgc 1 % (momentum correction, sparse allreduce)",
     "lightwire", None, ["--codec", "dgc", "--density", "0.01", "--sparse", "allreduce"]
     + DGC_MOMENTUM + POLICIES_OFF),
    # The sparse allreduce keeping 4k entries a step, about what the allgather's union of 4 ranks'
    # 1 % selections holds: whether a gap to the allgather is the entries a step or the algorithm.
    ("lightwire_dgc4_allreduce", "lightwire dgc 4 % (momentum correction, sparse allreduce)",
     "lightwire", None, ["--codec", "dgc", "--density", "0.04", "--sparse", "allreduce"]
     + DGC_MOMENTUM + POLICIES_OFF),
    ("lightwire_topk_allreduce", "lightwire topk 1 % (sparse allreduce)", "lightwire", None,
     ["--codec", "topk", "--density", "0.01", "--sparse", "allreduce"] + POLICIES_OFF),
    ("lightwire_dgc_warmup100", "lightwire dgc 1 % (momentum correction, warm-up 100)",
     "lightwire", None, ["--codec", "dgc", "--density", "0.01", "--warmup-steps", "100"]
     + DGC_MOMENTUM + POLICIES_OFF),
    # dgc's bias correction (docs/codecs.md "dgc's bias correction"): the momentum an element
    # restarts after it was sent is divided by 1 - m^a before it is accumulated.
    ("lightwire_dgc_bc", "lightwire dgc 1 % (momentum correction, bias-corrected)", "lightwire",
     None, ["--codec", "dgc", "--density", "0.01", "--bias-correction", "true"] + DGC_MOMENTUM
     + POLICIES_OFF),
]
ALL_CONFIGS = CONFIGS + EXTRA_CONFIGS

# The tta profile's rows, in run order: the baseline first, PowerSGD rank 4 next to rank 1.
TTA_CONFIGS = [n for c in CONFIGS for n in ([c[0], "lightwire_powersgd4"]
                                            if c[0] == "lightwire_powersgd" else [c[0]])]
TTA_CONFIGS.append("lightwire_dgc_flat")

# Which of --seeds each configuration of the tta profile trains: "all" of them, or the "first"
# only ("*": every configuration not named). The baseline must train every seed (each seed's
# rows stop against its own baseline); the spread over seeds is measured for the baseline and the
# compressed codecs whose time to accuracy is in question, one seed each for the others.
TTA_SEEDS = {"ddp": "all", "lightwire_dgc": "all", "lightwire_topk": "all",
             "lightwire_qsgd4": "all", "lightwire_powersgd4": "all", "lightwire_auto": "all",
             "lightwire_auto_dgcm": "all", "lightwire_dgc_allreduce": "all",
             "lightwire_dgc4_allreduce": "all", "lightwire_dgc_bc": "all", "*": "first"}
# Per task, where it differs (task name -> rules as TTA_SEEDS's, which win over those). None
# now: under AdamW (the LM) dgc's momentum correction is Adam's first moment with
# lightwire.torch.AdamW (docs/codecs.md "Adam with sparse codecs"), so lightwire_dgc is the dgc
# row of both tasks.
TTA_TASK_SEEDS = {}

PROFILES = {
    # tasks, rates, steps and evaluation period per task, world size, model size, seconds a run
    # may take. The steps: the MLP's loss falls clearly from step 20 on and still falls at 100;
    # the LM's comes off its first plateau around step 100 (bench/e2e/tasks.py).
    "quick": {"tasks": ["mlp"], "rates": ["1gbit"], "steps": {"mlp": 80},
              "eval_every": {"mlp": 5}, "world_size": 4, "size": "full", "timeout": 600},
    "full": {"tasks": ["mlp", "lm"], "rates": ["1gbit", "10gbit"], "steps": {"mlp": 100, "lm": 100},
             "eval_every": {"mlp": 5, "lm": 10}, "world_size": 4, "size": "full", "timeout": 900},
    "smoke": {"tasks": ["mlp"], "rates": ["1gbit"], "steps": {"mlp": 3, "lm": 3},
              "eval_every": {"mlp": 1, "lm": 1}, "world_size": 2, "size": "smoke", "timeout": 240},
    # Time to accuracy. "steps": the baseline's horizon (every other row may train up to
    # TTA_STEP_CAP_FACTOR times as many steps: the baseline's time is the cap that binds);
    # "extra_evals": evaluation periods a row trains on once it reached the target (the loss just
    # after it, not only the crossing); "config_seeds": which seeds each row trains; "budget":
    # the seconds one invocation should take (the estimate warns above it). One task per
    # invocation: the MLP's and the LM's baselines alone take about 23 and 21 minutes for three
    # seeds. The evaluation cadence is the same for every row of a task, so that the rows'
    # evaluation steps are the baseline's (loss at equal steps compares the same steps):
    #   MLP every 10 steps: 40 evaluations over 400 steps; the stop rule's resolution is 10 steps
    #   (about 2 s of a compressed row at 0.21 s/step, under 0.5 % of the baseline's 456 s) and
    #   its running mean of 3 spans 30 steps (7.5 % of the horizon). One evaluation (512 samples,
    #   forward only) takes 0.16 s, outside the timed steps: 6 s a row.
    #   LM every 15 steps: 20 evaluations over 300 steps. One evaluation (64 windows of 64 bytes,
    #   8 times a step's tokens, forward only) takes 0.95 s, more than two steps' computation:
    #   every 10 steps would add 30 s a row, where 15 add 19. Its loss moves less per step once
    #   off its first plateau (about step 100), so the mean of 3 over 45 steps (15 % of the
    #   horizon) still places the crossing within one 15-step period.
    "tta": {"tasks": ["mlp"], "rates": ["1gbit"], "steps": {"mlp": 400, "lm": 300},
            "eval_every": {"mlp": 10, "lm": 15}, "world_size": 4, "size": "full", "timeout": 1200,
            "tta": True, "extra_evals": 3, "seeds": [0, 1, 2], "configs": TTA_CONFIGS,
            "config_seeds": TTA_SEEDS, "task_config_seeds": TTA_TASK_SEEDS, "budget": 3600},
    # The same at smoke size: the test suite's check that the rule stops every rank together.
    "tta-smoke": {"tasks": ["mlp"], "rates": ["1gbit"], "steps": {"mlp": 16, "lm": 16},
                  "eval_every": {"mlp": 2, "lm": 2}, "world_size": 2, "size": "smoke",
                  "timeout": 240, "tta": True, "extra_evals": 1, "seeds": [0, 1],
                  "configs": TTA_CONFIGS, "config_seeds": TTA_SEEDS, "budget": 600},
}

# Seconds per training step for the tta profile's time estimate: docs/BENCHMARKS.md's median
# steps (W = 4, 2 cores, 100-step runs), per task and rate; None where it has no figure (the row
# is then assumed to run to its cap: the baseline's time). Rates without figures use the 1 Gbit/s
# ones (an overestimate on a faster link, an underestimate on a slower one: the estimate says so).
STEP_SECONDS = {
    ("mlp", "1gbit"): {"ddp": 1.14, "ddp_fp16": 0.678, "ddp_powersgd": None, "lightwire_none": 1.05,
                       "lightwire_fp16": 0.63, "lightwire_topk": 0.229, "lightwire_dgc": 0.21,
                       "lightwire_qsgd4": 0.393, "lightwire_qsgd8": 0.621,
                       "lightwire_powersgd": 0.251, "lightwire_powersgd4": None,
                       "lightwire_dgc_policies": 0.213},
    ("mlp", "10gbit"): {"ddp": 0.265, "ddp_fp16": 0.504, "ddp_powersgd": None,
                        "lightwire_none": 0.291, "lightwire_fp16": 0.313, "lightwire_topk": 0.213,
                        "lightwire_dgc": 0.203, "lightwire_qsgd4": 0.264,
                        "lightwire_qsgd8": 0.243, "lightwire_powersgd": 0.25,
                        "lightwire_powersgd4": None, "lightwire_dgc_policies": 0.215},
    ("lm", "1gbit"): {"ddp": 1.32, "ddp_fp16": 1.11, "ddp_powersgd": None, "lightwire_none": 1.27,
                      "lightwire_fp16": 1.02, "lightwire_topk": 0.805, "lightwire_dgc": 0.816,
                      "lightwire_qsgd4": 0.907, "lightwire_qsgd8": 0.981,
                      "lightwire_powersgd": 0.793, "lightwire_powersgd4": None,
                      "lightwire_dgc_policies": 0.804},
    ("lm", "10gbit"): {"ddp": 0.81, "ddp_fp16": 0.992, "ddp_powersgd": None, "lightwire_none": 0.825,
                       "lightwire_fp16": 0.917, "lightwire_topk": 0.789, "lightwire_dgc": 0.788,
                       "lightwire_qsgd4": 0.831, "lightwire_qsgd8": 0.825,
                       "lightwire_powersgd": 0.828, "lightwire_powersgd4": None,
                       "lightwire_dgc_policies": 0.788},
}
# Seconds a row takes besides its timed steps: one evaluation on rank 0 (measured alone, one
# thread: the MLP's 512 samples 0.16 s, the LM's 64 windows 0.95 s), and the start (4 trainers and
# their sidecars): the full profile's 3160 s elapsed against about 2640 s of timed steps and 280 s
# of evaluations over its 44 rows (docs/BENCHMARKS.md) leaves about 6 s a row.
EVAL_SECONDS = {"mlp": 0.16, "lm": 0.95}
# The tta results the estimate's "expected" figure takes each row's last duration from.
LAST_TTA_RESULTS = os.path.join(ROOT, "docs", "benchmarks", "results-tta.json")
ROW_START_SECONDS = 6.0


def log(msg):
    print("e2e: %s" % msg, file=sys.stderr, flush=True)


def die(msg):
    print("e2e: %s" % msg, file=sys.stderr, flush=True)
    sys.exit(2)


def rate_bits(rate):
    """Bits per second of a tc rate; None for `unlimited` (the loopback without a qdisc)."""
    if rate == "unlimited":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate)
    if not m:
        die("--rates: NUMBER[k|m|g|t]bit, e.g. 1gbit, or unlimited (got %r)" % rate)
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


class Namespace(object):
    """A network namespace of our own; its loopback limited to one rate at a time."""

    def __init__(self):
        self.name = "lightwire-e2e-%d" % os.getpid()
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self.run(["ip", "link", "set", "lo", "up"], check=True)

    def cmd(self, argv):
        return ["ip", "netns", "exec", self.name] + list(argv)

    def run(self, argv, **kw):
        return subprocess.run(self.cmd(argv), **kw)

    def limit(self, rate):
        if rate == "unlimited":
            self.run(["tc", "qdisc", "del", "dev", "lo", "root"], stderr=subprocess.DEVNULL)
            log("namespace %s: lo unlimited" % self.name)
            return
        # As bench/netns_exchange.sh (bench/README.md "Shaping"): burst = 2 ms of the rate, at
        # least 256 KiB (a whole 64 KiB GSO packet and the qdisc watchdog's delay on a loaded VM);
        # latency 100 ms holds what the flows have in flight, so TCP sees no drops.
        burst = max(int(rate_bits(rate) / 8 * 0.002), 262144)
        self.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, "burst",
                  str(burst), "latency", "100ms"], check=True)
        log("namespace %s: lo limited to %s (burst %d bytes, latency 100 ms)" % (
            self.name, rate, burst))

    def close(self):
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True,
                              text=True).stdout.split()
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", self.name], stderr=subprocess.DEVNULL)


class Sidecars(object):
    """W `lightwire serve` processes in the namespace, one per rank, peers on its loopback."""

    def __init__(self, ns, binary, world, args, work):
        self.procs, self.sockets, self.logs = [], [], []
        peers = ",".join("127.0.0.1:%d" % (47100 + r) for r in range(world))
        # $LIGHTWIRE_BIN names the executable for this script; to the sidecar every LIGHTWIRE_
        # variable is a configuration key (docs/configuration.md), so it is not passed on.
        env = {k: v for k, v in os.environ.items() if k != "LIGHTWIRE_BIN"}
        env["LIGHTWIRE_PEER__SECRET"] = "e2e-%d" % os.getpid()
        for r in range(world):
            sock = os.path.join(work, "sidecar%d.sock" % r)
            logf = os.path.join(work, "sidecar%d.log" % r)
            cmd = [binary, "serve", "--job-id", "e2e", "--rank", str(r), "--world-size", str(world),
                   "--peers", peers, "--peer-listen", "127.0.0.1:%d" % (47100 + r), "--socket",
                   sock, "--control-tcp", "", "--admin-listen", "", "--state-dir", "",
                   "--threads", "1", "--log-level", "warn",
                   # codec auto's whole decision log, for the row (auto_decisions)
                   "--decision-log", "20000"] + list(args)
            self.procs.append(subprocess.Popen(ns.cmd(cmd), stdout=subprocess.DEVNULL,
                                               stderr=open(logf, "wb"), env=env))
            self.sockets.append(sock)
            self.logs.append(logf)
        import lightwire
        deadline = time.monotonic() + 60
        for r, sock in enumerate(self.sockets):
            while True:
                if self.procs[r].poll() is not None:
                    raise RuntimeError("sidecar %d exited: %s" % (r, self.tail(r)))
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
                    raise RuntimeError("sidecar %d not ready in 60 s: %s" % (r, self.tail(r)))
                time.sleep(0.1)

    def cpu_seconds(self):
        """The CPU time (user and system) the sidecars used so far, together."""
        total = 0.0
        for p in self.procs:
            try:
                with open("/proc/%d/stat" % p.pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited: its time is lost, the figure low
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def auto_decisions(self):
        """codec auto's entries of rank 0's decision log (every rank holds the same)."""
        import lightwire
        c = lightwire.Client(socket_path=self.sockets[0], timeout=(1.0, 10.0))
        try:
            log_ = c.status().get("policies", {}).get("log", [])
        except lightwire.LightwireError:
            return []
        finally:
            c.close()
        return [d for d in log_ if d.get("kind") in ("auto", "direct", "critical", "full_sync")]

    def tail(self, r, lines=5):
        try:
            with open(self.logs[r], "rb") as f:
                return " | ".join(f.read().decode("utf-8", "replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


TTA_STEP_CAP_FACTOR = tta.STEP_CAP_FACTOR  # rows may train this many times the baseline's steps


def tta_stop_spec(base, extra_steps):
    """The stop rule's part of a worker spec (bench/e2e/tta.py) for the rows of one (task, rate,
    seed) against its finished baseline row: the target (its final loss), the extra steps, the
    caps (its training time, and TTA_STEP_CAP_FACTOR times its steps)."""
    return {"target": base["final_loss"], "extra_steps": extra_steps,
            "cap_seconds": tta.training_seconds(base),
            "steps": TTA_STEP_CAP_FACTOR * base["eval"][-1]["step"]}


def run_config(ns, binary, python, profile, task, rate, config, work, seed=0, stop=None,
               on_progress=None):
    """One configuration: returns its row of the results. stop: the stop rule's spec fields
    (tta_stop_spec), None for a fixed number of steps. on_progress(step): called as the worker
    reports its evaluation steps."""
    name, label, kind, hook, sidecar_args = config
    args = list(sidecar_args or [])
    momentum = float(args[args.index("--momentum") + 1]) if "--momentum" in args else 0.0
    if "--auto-ladder" in args:  # a rung with momentum correction: dgc:DENSITY:MOMENTUM
        for rung in args[args.index("--auto-ladder") + 1].split(","):
            parts = rung.split("@")[0].split(":")
            if parts[0] == "dgc" and len(parts) == 3:
                momentum = max(momentum, float(parts[2]))
    # The sidecar's momentum needs lightwire.torch.SGD; otherwise a lightwire row takes the helper
    # of the task's optimizer (SGD: lightwire.torch.SGD, AdamW: lightwire.torch.AdamW), as users
    # would: the helpers declare their momentum, which codec auto's momentum rung needs.
    optimizer = "lightwire_sgd" if momentum > 0 else "helper" if kind == "lightwire" else "task"
    row = {"task": task, "rate": rate, "rate_bits_per_second": rate_bits(rate), "config": name,
           "label": label, "kind": kind, "baseline": name == "ddp", "status": "ok", "error": None,
           "steps": profile["steps"][task], "seed": seed}
    d = tempfile.mkdtemp(prefix="%s-%s-%d-" % (task, name, seed), dir=work)
    spec = {"task": task, "size": profile["size"], "seed": seed, "world_size": profile["world_size"],
            "steps": profile["steps"][task], "eval_every": profile["eval_every"][task], "kind": kind,
            "hook": hook, "powersgd_rank": 1, "sockets": [], "store_dir": d, "config": name,
            "optimizer": optimizer, "powersgd_start": POWERSGD_START,
            "bucket_cap_mb": profile.get("bucket_cap_mb")}
    if stop is not None:
        spec.update(stop)
    sidecars = None
    t0 = time.monotonic()
    try:
        if kind == "lightwire":
            sidecars = Sidecars(ns, binary, profile["world_size"], sidecar_args, d)
            spec["sockets"] = sidecars.sockets
            sidecar_cpu0 = sidecars.cpu_seconds()
        spec_path, out_path = os.path.join(d, "spec.json"), os.path.join(d, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        err_path = os.path.join(d, "worker.err")
        # One BLAS thread per trainer (as torch.set_num_threads(1), which Debian's torch does not
        # pass on to OpenBLAS): W trainers share the cores.
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
                   OPENBLAS_NUM_THREADS="1")
        with open(err_path, "wb") as err:
            p = subprocess.Popen(ns.cmd([python, os.path.join(HERE, "worker.py"), spec_path,
                                         out_path]), stdout=subprocess.DEVNULL, stderr=err,
                                 env=env, start_new_session=True)
            follower = Follower(err_path, on_progress)
            follower.start()
            try:
                rc = p.wait(profile["timeout"])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGUSR1)  # the ranks print where they hang
                time.sleep(2)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = None
            finally:
                follower.stop()
        with open(err_path, "rb") as f:
            stderr = f.read().decode("utf-8", "replace")
        if rc is None:
            row["status"], row["error"] = "timeout", "no result in %d s; last output: %s" % (
                profile["timeout"], last_lines(stderr))
        elif rc != 0 or not os.path.exists(out_path):
            row["status"], row["error"] = "failed", "exit status %s: %s" % (rc, last_lines(stderr))
        else:
            with open(out_path) as f:
                row.update(json.load(f))
            row["steps"] = row.get("steps_run", row["steps"])
            if sidecars is not None:
                # The sidecars' CPU time from ready to the end of training (their start is not
                # in it; the trainers' evaluations, when the sidecars idle, are), per step.
                row["sidecar_cpu_seconds_per_step"] = (
                    (sidecars.cpu_seconds() - sidecar_cpu0) / max(1, row["steps"]))
            summarize(row)
            if row.get("fallbacks"):
                row["notes"] = "%d bucket(s) fell back to gloo's allreduce" % row["fallbacks"]
    except Exception as e:  # a sidecar that did not start: the row says so
        row["status"], row["error"] = "failed", str(e)
    finally:
        if sidecars is not None and row["status"] == "ok":
            row["decisions"] = sidecars.auto_decisions()
        if sidecars is not None:
            if row["status"] != "ok":
                row["error"] = (row["error"] or "") + " | sidecar 0: " + sidecars.tail(0)
            sidecars.close()
    log("%s %s %s%s: %s in %.0f s%s%s" % (
        task, rate, name, " seed %d" % seed if profile.get("tta") else "", row["status"],
        time.monotonic() - t0, (", %.3f s/step, final loss %.4f" % (
            row["median_step_seconds"], row["final_loss"])) if row["status"] == "ok" else
        ": " + str(row["error"]), (", stopped after step %d (%s)" % (
            row["stop"]["step"], row["stop"]["reason"])) if row.get("stop") else ""))
    return row


class Follower(threading.Thread):
    """Prints the worker's progress lines ("e2e worker: ...") as they are written."""

    def __init__(self, path, on_progress=None):
        super().__init__(daemon=True)
        self.path, self.done = path, threading.Event()
        self.on_progress = on_progress

    def run(self):
        with open(self.path, "rb") as f:
            pending = b""
            while True:
                chunk = f.read()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode("utf-8", "replace")
                    if text.startswith("e2e worker:"):
                        print("  " + text, file=sys.stderr, flush=True)
                        m = re.search(r" step (\d+)/", text)
                        if m and self.on_progress is not None:
                            self.on_progress(int(m.group(1)))
                if not chunk:
                    if self.done.is_set():
                        return
                    time.sleep(0.5)

    def stop(self):
        self.done.set()
        self.join()


def last_lines(text, n=6):
    """The error of a failed run: the lines that name an error (the first three), then the last
    n lines of its output."""
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    if not lines:
        return "(no output)"
    errors = [l for l in lines[:-n] if re.search(r"Error|Exception|what\(\)|terminate called", l)]
    return " | ".join(errors[:3] + (["..."] if errors else []) + lines[-n:])


# The final loss and accuracy: the mean of the last evaluations, not the last one alone (one
# evaluation moves by several per cent from one step to the next with SGD's noise).
FINAL_EVALS = 3


def summarize(row):
    """The final figures of a finished row, from its evaluations."""
    last = row["eval"][-FINAL_EVALS:]
    row["final_loss"] = sum(e["loss"] for e in last) / len(last)
    acc = [e["accuracy"] for e in last if e.get("accuracy") is not None]
    row["final_accuracy"] = sum(acc) / len(acc) if acc else None
    row["final_evals"] = len(last)


def add_time_to_baseline(rows):
    """time_to_baseline_loss of every row of one (task, rate) group."""
    base = next((r for r in rows if r["baseline"] and r["status"] == "ok"), None)
    for r in rows:
        r["time_to_baseline_loss"] = None
        if base is None or r["status"] != "ok":
            continue
        for e in r["eval"]:
            if e["loss"] <= base["final_loss"]:
                r["time_to_baseline_loss"] = e["seconds"]
                break


def add_tta_figures(rows):
    """The time-to-accuracy figures (tta.row_figures) of every finished row of one (task, rate,
    seed) group, against its baseline; rows without a finished baseline get none."""
    base = next((r for r in rows if r["baseline"] and r["status"] == "ok"), None)
    for r in rows:
        r["tta"] = tta.row_figures(r, base) if base is not None and r["status"] == "ok" else None


def seeds_for(profile, config_name, seeds, task=None):
    """The seeds one configuration trains (on `task`): all of `seeds` or the first only, as the
    profile's task_config_seeds of that task says, else its config_seeds (their "*" entry for a
    configuration they do not name; every seed without config_seeds)."""
    rules = profile.get("config_seeds")
    if rules is None:
        return list(seeds)
    task_rules = profile.get("task_config_seeds", {}).get(task, {})
    which = task_rules.get(config_name, rules.get(config_name, rules.get("*", "first")))
    if which not in ("all", "first"):
        raise ValueError("config_seeds[%r]: 'all' or 'first', not %r" % (config_name, which))
    return list(seeds) if which == "all" else list(seeds[:1])


def plan_runs(profile, configs, seeds):
    """The rows of an invocation in run order: [(task, rate, seed, config)]. Fixed-step profiles:
    per task and rate every configuration (at the one seed). tta: per task, rate and seed the
    baseline first (the others of that seed need its target), then every configuration that
    trains that seed."""
    plan = []
    for task in profile["tasks"]:
        for rate in profile["rates"]:
            if not profile.get("tta"):
                plan += [(task, rate, seeds[0], c) for c in configs]
                continue
            for seed in seeds:
                plan += [(task, rate, seed, c) for c in configs
                         if seed in seeds_for(profile, c[0], seeds, task)]
    return plan


def measured_row_seconds(results):
    """{(task, rate, config): (training seconds, steps)} of the finished rows of an earlier tta
    results file, the mean over their seeds: what a row of that configuration took last time (its
    timed steps; estimate_seconds adds its start and evaluations)."""
    rows = {}
    for r in (results or {}).get("runs", []):
        if r.get("status") != "ok" or not r.get("step_seconds"):
            continue
        rows.setdefault((r["task"], r["rate"], r["config"]), []).append(
            (sum(r["step_seconds"]), len(r["step_seconds"])))
    return {k: (sum(t for t, _ in v) / len(v), round(sum(n for _, n in v) / len(v)))
            for k, v in rows.items()}


def estimate_seconds(profile, plan, step_seconds=None, measured=None):
    """How long a tta invocation takes at most, from the profile's steps and the per-step figures:
    {"at_most": every row up to its cap (the baseline: its horizon at its step time; any other row:
    the baseline's time or TTA_STEP_CAP_FACTOR times its steps at its own step time, whichever is
    shorter; a row
    without a figure: the baseline's time), "worst": every row the baseline's time (the time cap
    alone), "baseline": the baselines alone, "rows", "notes": what the figures leave out,
    "expected": each row as long as it took in `measured` (measured_row_seconds of an earlier run;
    at most its cap) and the others at most, "measured_rows": how many rows had a measurement};
    each row plus its start and its evaluations (ROW_START_SECONDS, EVAL_SECONDS)."""
    table = STEP_SECONDS if step_seconds is None else step_seconds

    def overhead(task, steps):
        return ROW_START_SECONDS + EVAL_SECONDS.get(task, 1.0) * math.ceil(
            steps / profile["eval_every"][task])
    at_most = worst = baselines = expected = 0.0
    measured_rows = 0
    notes = []
    for task, rate, seed, config in plan:
        figures = table.get((task, rate))
        if figures is None:
            figures = table.get((task, "1gbit"), {})
            note = "no step figures for %s at %s: the 1 Gbit/s ones used" % (task, rate)
            if note not in notes:
                notes.append(note)
        n = profile["steps"][task]
        base_s = figures.get("ddp")
        if base_s is None:
            raise ValueError("no baseline step figure for %s" % task)
        t_base = n * base_s
        own = figures.get(config[0])
        if config[0] == "ddp":
            row, row_steps = t_base, n
            baselines += t_base + overhead(task, n)
        elif own is None:
            row, row_steps = t_base, n
        else:
            row = min(t_base, TTA_STEP_CAP_FACTOR * n * own)
            row_steps = min(TTA_STEP_CAP_FACTOR * n, int(t_base / own))
        at_most += row + overhead(task, row_steps)
        worst += t_base + overhead(task, n)  # the baseline's row, once per row
        last = (measured or {}).get((task, rate, config[0]))
        if last is not None:
            measured_rows += 1
            expected += min(last[0], row) + overhead(task, min(last[1], row_steps))
        else:
            expected += row + overhead(task, row_steps)
    return {"at_most": at_most, "worst": worst, "baseline": baselines, "rows": len(plan),
            "notes": notes, "expected": expected, "measured_rows": measured_rows}


def machine_info(binary, python):
    info = {"cpus": os.cpu_count(), "kernel": platform.release(), "lightwire_bin": binary}
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            info["cpu_model"] = m.group(1).strip() if m else "unknown"
        with open("/proc/meminfo") as f:
            kb = int(re.search(r"MemTotal:\s*(\d+)", f.read()).group(1))
            info["memory_gib"] = round(kb / 2**20, 1)
        with open("/etc/os-release") as f:
            m = re.search(r'PRETTY_NAME="([^"]*)"', f.read())
            info["os"] = m.group(1) if m else "unknown"
    except OSError:
        pass
    out = subprocess.run([python, "-c", "import sys, torch; print(sys.version.split()[0], "
                          "torch.__version__)"], capture_output=True, text=True).stdout.split()
    if len(out) == 2:
        info["python"], info["torch"] = out
    return info


def executables(need_lightwire):
    """($LIGHTWIRE_BIN or build-release's lightwire, $PYTHON or /usr/bin/python3); dies when the
    executable is needed and missing."""
    binary = os.environ.get("LIGHTWIRE_BIN", os.path.join(ROOT, "build-release", "proxy",
                                                          "lightwire"))
    if need_lightwire and not os.access(binary, os.X_OK):
        die("no lightwire executable at %s (bash scripts/build.sh release, or set LIGHTWIRE_BIN)"
            % binary)
    return binary, os.environ.get("PYTHON", "/usr/bin/python3")


def git_commit():
    try:
        c = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return c + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def rereport(path, out_dir):
    """--rereport: the derived figures (final loss and accuracy, time to the baseline's loss; for
    tta results the time-to-accuracy figures and their seed summary) recomputed from the
    evaluations a results file holds, the file and the report rewritten."""
    with open(path) as f:
        results = json.load(f)
    by_seed = bool(results.get("tta"))
    groups = {}
    for row in results["runs"]:
        if row["status"] == "ok":
            summarize(row)
        key = (row["task"], row["rate"]) + ((row.get("seed", 0),) if by_seed else ())
        groups.setdefault(key, []).append(row)
    for rows in groups.values():
        add_time_to_baseline(rows)
        if by_seed:
            add_tta_figures(rows)
    if by_seed:
        results["tta"]["summary"] = tta.seed_summary(results["runs"])
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    import report
    for written in report.write_report(results, out_dir, os.path.basename(path)):
        log("wrote %s" % written)
    return 0


def parse_seeds(text):
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        die("--seeds: comma-separated integers, e.g. 0,1,2 (got %r)" % text)
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        die("--seeds: distinct integers >= 0 (got %r)" % text)
    return seeds


def skipped_row(task, rate, seed, config, steps, why):
    name, label, kind = config[:3]
    return {"task": task, "rate": rate, "rate_bits_per_second": rate_bits(rate), "config": name,
            "label": label, "kind": kind, "baseline": False, "status": "skipped", "error": why,
            "steps": steps, "seed": seed}


def log_estimate(profile, plan, last_results=LAST_TTA_RESULTS):
    """Prints the tta invocation's time estimate (estimate_seconds) before anything runs, with what
    the rows took in the results at `last_results` (when there); returns it for the results."""
    measured = None
    try:
        with open(last_results) as f:
            measured = measured_row_seconds(json.load(f))
    except (OSError, ValueError):
        pass
    est = estimate_seconds(profile, plan, measured=measured)
    budget = profile.get("budget")
    log("estimate: at most %.0f min for %d row(s) (each row to its cap: the baseline its horizon, "
        "the others the baseline's time or steps at their own step time, docs/BENCHMARKS.md's "
        "figures; starts and evaluations included; the baselines alone %.0f min); %.0f min if "
        "every row ran for the baseline's time" % (est["at_most"] / 60, est["rows"],
                                                     est["baseline"] / 60, est["worst"] / 60))
    if profile["size"] != "full":
        est["notes"].append("the step figures are the full-size models': far above the %s size's"
                            % profile["size"])
    if est["measured_rows"]:
        log("estimate: about %.0f min expected: %d of the %d row(s) as long as they took in %s, "
            "the others at most" % (est["expected"] / 60, est["measured_rows"], est["rows"],
                                    os.path.relpath(last_results, ROOT)))
    for note in est["notes"]:
        log("estimate: " + note)
    if budget is not None and est["at_most"] > budget:
        log("estimate: over the profile's budget of %.0f min: fewer --configs or --seeds "
            "(bench/README.md \"Time to accuracy\")" % (budget / 60))
    est["budget"] = budget
    return est


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="MLP at 1 Gbit/s, every configuration")
    g.add_argument("--smoke", action="store_true", help="tiny models, 2 ranks, 3 steps")
    p.add_argument("--tta", action="store_true",
                   help="time to accuracy: the baseline's final loss is every other row's target "
                        "(with --smoke: at smoke size)")
    p.add_argument("--seeds", help="comma-separated seeds (default 0; --tta: 0,1,2, which the "
                   "baseline and the compressed codecs take, the other rows the first)")
    p.add_argument("--tasks", help="comma-separated: mlp, lm")
    p.add_argument("--rates", help="comma-separated tc rates, e.g. 1gbit,10gbit, or unlimited")
    p.add_argument("--configs", help="comma-separated configuration names (--list)")
    p.add_argument("--steps", type=int, help="training steps of every run (--tta: the baseline's)")
    p.add_argument("--world-size", type=int)
    p.add_argument("--timeout", type=int, help="seconds a run may take (default: the profile's)")
    p.add_argument("--out-dir", help="where BENCHMARKS.md and benchmarks/ go (default docs; "
                   "--smoke: a new temporary directory)")
    p.add_argument("--results", help="results JSON (default OUT_DIR/benchmarks/results-PROFILE.json)")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument("--rereport", metavar="RESULTS",
                   help="recompute the final figures of a results file and rewrite it and the "
                        "report (no training)")
    args = p.parse_args()
    if args.rereport:
        return rereport(args.rereport, args.out_dir or os.path.join(ROOT, "docs"))
    if args.list:
        for c in ALL_CONFIGS:
            print("%-24s %-40s %s" % (c[0], c[1], " ".join(c[4] or []) or (c[3] or "")))
        return 0
    if args.tta and args.quick:
        die("--tta and --quick: one profile (--tta --smoke for the tta profile at smoke size)")
    if args.tta:
        name = "tta-smoke" if args.smoke else "tta"
    else:
        name = "quick" if args.quick else "smoke" if args.smoke else "full"
    profile = dict(PROFILES[name])
    profile["steps"] = dict(profile["steps"])
    if args.tasks:
        profile["tasks"] = args.tasks.split(",")
    if args.rates:
        profile["rates"] = args.rates.split(",")
    profile["eval_every"] = dict(profile["eval_every"])
    for t in ("mlp", "lm"):
        profile["eval_every"].setdefault(t, 10)
        profile["steps"].setdefault(t, 100)
    if args.steps:
        profile["steps"] = {t: args.steps for t in ("mlp", "lm")}
        if not profile.get("tta"):  # tta keeps its cadence: every row of a task evaluates alike
            profile["eval_every"] = {t: max(1, min(e, args.steps // 10)) for t, e in
                                     profile["eval_every"].items()}
    if args.world_size:
        profile["world_size"] = args.world_size
    if args.timeout:
        profile["timeout"] = args.timeout
    for t in profile["tasks"]:
        if t not in ("mlp", "lm"):
            die("--tasks: mlp, lm (got %r)" % t)
    for r in profile["rates"]:
        rate_bits(r)
    seeds = parse_seeds(args.seeds) if args.seeds else list(profile.get("seeds", [0]))
    if len(seeds) > 1 and not profile.get("tta"):
        die("--seeds: the %s profile trains one seed (several: --tta)" % name)
    by_name = {c[0]: c for c in ALL_CONFIGS}
    order = profile.get("configs") or [c[0] for c in CONFIGS]
    if args.configs:
        wanted = args.configs.split(",")
        unknown = [c for c in wanted if c not in by_name]
        if unknown:
            die("--configs: unknown %s (--list)" % ", ".join(unknown))
        order = [n for n in order if n in wanted] + [n for n in by_name
                                                     if n in wanted and n not in order]
    configs = [by_name[n] for n in order]
    if profile.get("tta") and (not configs or configs[0][0] != "ddp"):
        die("--tta: the ddp baseline must be one of the configurations (it sets the target)")
    if os.geteuid() != 0:
        die("needs root (ip netns, tc)")
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C: the finally blocks stop the trainers and
    # remove the namespace instead of leaving them behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            die("needs %s (iproute2: scripts/install-deps.sh)" % tool)
    binary, python = executables(any(c[2] == "lightwire" for c in configs))
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0:
        die("%s cannot import torch (set PYTHON)" % python)
    if args.out_dir is None:
        args.out_dir = tempfile.mkdtemp(prefix="lightwire-e2e-smoke-") if args.smoke else \
            os.path.join(ROOT, "docs")
    results_path = args.results or os.path.join(args.out_dir, "benchmarks",
                                                "results-%s.json" % name)
    command = " ".join(shlex.quote(a) for a in ["bench/e2e/e2e.py"] + sys.argv[1:])
    started = time.monotonic()
    results = {"version": 1, "profile": name, "command": command,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "commit": git_commit(), "machine": machine_info(binary, python),
               "world_size": profile["world_size"], "runs": []}
    plan = plan_runs(profile, configs, seeds)
    total = len(plan)
    log("profile %s: %d run(s): tasks %s, rates %s, %d configuration(s), world size %d; load "
        "average %s" % (name, total, ",".join(profile["tasks"]), ",".join(profile["rates"]),
                         len(configs), profile["world_size"], open("/proc/loadavg").read().split()[0]))
    if profile.get("tta"):
        results["tta"] = {
            "horizon": {t: profile["steps"][t] for t in profile["tasks"]},
            "eval_every": {t: profile["eval_every"][t] for t in profile["tasks"]},
            "extra_evals": profile["extra_evals"], "window": tta.WINDOW, "seeds": seeds,
            "config_seeds": {t: {c[0]: seeds_for(profile, c[0], seeds, t) for c in configs}
                             for t in profile["tasks"]},
            "estimate": log_estimate(profile, plan), "summary": None}
    ns = Namespace()
    work = tempfile.mkdtemp(prefix="lightwire-e2e-")
    done = 0
    limited = None
    try:
        # One group per (task, rate), and per seed in the tta profile: its rows are compared
        # with its baseline.
        for (task, rate, seed), items in itertools.groupby(plan, key=lambda x: x[:3]):
            if rate != limited:
                ns.limit(rate)
                limited = rate
            rows = []
            for _, _, _, config in items:
                done += 1
                log("[%d/%d] %s at %s%s: %s" % (done, total, task, rate, ", seed %d" % seed
                                                if profile.get("tta") else "", config[1]))
                stop = None
                if profile.get("tta") and config[0] != "ddp":
                    base = rows[0] if rows and rows[0]["baseline"] else None
                    if base is None or base["status"] != "ok":
                        why = "no target: the ddp baseline of seed %d did not finish" % seed
                        log("%s: skipped (%s)" % (config[0], why))
                        rows.append(skipped_row(task, rate, seed, config,
                                                profile["steps"][task], why))
                        continue
                    stop = tta_stop_spec(base, profile["extra_evals"] * profile["eval_every"][task])
                rows.append(run_config(ns, binary, python, profile, task, rate, config, work,
                                       seed=seed, stop=stop))
            add_time_to_baseline(rows)
            if profile.get("tta"):
                add_tta_figures(rows)
            results["runs"].extend(rows)
    finally:
        ns.close()
        shutil.rmtree(work, ignore_errors=True)
    if profile.get("tta"):
        results["tta"]["summary"] = tta.seed_summary(results["runs"])
    results["elapsed_seconds"] = round(time.monotonic() - started, 1)
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    log("results: %s" % results_path)
    import report
    for path in report.write_report(results, args.out_dir, os.path.basename(results_path)):
        log("wrote %s" % path)
    failed = [r for r in results["runs"] if r["status"] != "ok"]
    log("%d run(s), %d not ok, %.0f s" % (len(results["runs"]), len(failed),
                                          results["elapsed_seconds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
