#!/usr/bin/env python3
"""Compares two builds of lightwire on the codec and exchange benchmarks.

    $PYTHON bench/compare_builds.py --a NEW/lightwire --b OLD/lightwire [--rounds 3]
                                    [--elements 4000000] [--no-callgrind] [--json FILE]

For a change that must not change speed (a refactor): every figure of `bench codec --all` and
`bench exchange` for build A and build B, run in turn (A B A B ...) so that drift of the machine
falls on both alike, reported as medians over the rounds with the ratio A/B and the spread of B's
own rounds (how far the same binary moves between rounds: the noise floor a ratio must be read
against). With valgrind installed (scripts/install-deps.sh installs it), each codec also runs
once under callgrind for both builds: instruction counts do not move with the machine's load, so
they tell a real change of work from noise. Nothing is judged: it prints figures.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

CODEC_FLAGS = {
    "density": "--density",
    "threshold": "--threshold",
    "bits": "--bits",
    "momentum": "--momentum",
    "approx_rank": "--approx-rank",
    "bucket_size": "--bucket-size",
}


def run_json(cmd):
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def codec_args(row):
    args = ["--codec", row["codec"]]
    for key, value in row["params"].items():
        if key in CODEC_FLAGS:
            args += [CODEC_FLAGS[key], str(value)]
    return args


def instructions(binaries, args):
    """Instructions executed by one whole `bench codec` process of each binary under callgrind
    (run side by side: the counts do not depend on the load)."""
    procs = [subprocess.Popen(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                               b, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for b in binaries]
    counts = []
    for b, proc in zip(binaries, procs):
        err = proc.communicate()[1]
        found = [line for line in err.splitlines() if "I   refs:" in line]
        if not found:
            raise RuntimeError(f"callgrind gave no count for {b} {' '.join(args)}:\n{err[-800:]}")
        counts.append(int(found[-1].split()[-1].replace(",", "")))
    return counts


def spread(values):
    lo, hi = min(values), max(values)
    return (hi - lo) / statistics.median(values) if statistics.median(values) else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="the lightwire binary under test")
    p.add_argument("--b", required=True, help="the baseline lightwire binary")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (medians over them)")
    p.add_argument("--elements", type=int, default=4_000_000, help="bench codec --elements")
    p.add_argument("--runs", type=int, default=15, help="bench codec --runs (per figure)")
    p.add_argument("--threads", type=int, default=1,
                   help="bench codec --threads (1: least noise from the scheduler)")
    p.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts")
    p.add_argument("--json", help="write every figure to this file")
    o = p.parse_args()
    for b in (o.a, o.b):
        if not os.access(b, os.X_OK):
            sys.exit(f"compare_builds: {b} is not an executable")

    codec_cmd = ["bench", "codec", "--all", "--elements", str(o.elements), "--threads",
                 str(o.threads), "--runs", str(o.runs), "--json"]
    exchange_cmd = ["bench", "exchange", "--world-size", "4", "--codec", "dgc", "--density",
                    "0.01", "--elements", "1000000", "--steps", "10", "--json"]
    rounds = {"a": [], "b": []}
    for i in range(o.rounds):
        for side in ("a", "b"):
            binary = getattr(o, side)
            print(f"round {i + 1}/{o.rounds}: {side} = {binary}", file=sys.stderr, flush=True)
            rounds[side].append({"codec": {r["label"]: r for r in run_json([binary, *codec_cmd])},
                                 "exchange": run_json([binary, *exchange_cmd])[0]})

    figures = {"codec": {}, "exchange": {}, "instructions": {}}
    labels = list(rounds["b"][0]["codec"])
    print(f"\nbench codec --all --elements {o.elements} --threads {o.threads} --runs {o.runs}: "
          f"medians of {o.rounds} rounds, seconds (A/B; B's own spread)")
    print(f"{'codec':32s} {'compress A':>10s} {'B':>8s} {'A/B':>6s} {'B±':>5s}   "
          f"{'decompress A':>12s} {'B':>8s} {'A/B':>6s} {'B±':>5s}  wire equal")
    for label in labels:
        row = {}
        cells = []
        for key in ("compress_seconds", "decompress_seconds"):
            a = [r["codec"][label][key] for r in rounds["a"]]
            b = [r["codec"][label][key] for r in rounds["b"]]
            ma, mb = statistics.median(a), statistics.median(b)
            row[key] = {"a": ma, "b": mb, "ratio": ma / mb, "b_spread": spread(b)}
            cells.append(f"{ma * 1e3:9.2f}m {mb * 1e3:7.2f}m {ma / mb:6.3f} {spread(b):5.2f}")
        wire = rounds["a"][0]["codec"][label]["wire_bytes"] == rounds["b"][0]["codec"][label][
            "wire_bytes"]
        row["wire_equal"] = wire
        figures["codec"][label] = row
        print(f"{label:32s} {cells[0]}   {cells[1]}  {'yes' if wire else 'NO'}")

    print(f"\nbench exchange (4 sidecars, dgc 1 %, 1 M elements, ring over tcp loopback): "
          f"medians of {o.rounds} rounds")
    for key in ("seconds_per_step", "algbw_gbps", "wire_bytes_per_rank", "raw_vs_wire_per_rank"):
        a = [r["exchange"][key] for r in rounds["a"]]
        b = [r["exchange"][key] for r in rounds["b"]]
        ma, mb = statistics.median(a), statistics.median(b)
        figures["exchange"][key] = {"a": ma, "b": mb, "ratio": ma / mb, "b_spread": spread(b)}
        print(f"  {key:22s} A {ma:.6g}  B {mb:.6g}  A/B {ma / mb:.3f}  (B's spread {spread(b):.2f})")

    if o.no_callgrind or shutil.which("valgrind") is None:
        print("\n(no instruction counts: " +
              ("--no-callgrind" if o.no_callgrind else "valgrind is not installed") + ")")
    else:
        print("\ninstructions of one whole `bench codec` process per codec (callgrind, 1 M "
              "elements, 5 runs; set-up included, the same in both)")
        for label in labels:
            args = ["bench", "codec", *codec_args(rounds["b"][0]["codec"][label]), "--elements",
                    "1000000", "--threads", "1", "--runs", "5", "--json"]
            ia, ib = instructions([o.a, o.b], args)
            figures["instructions"][label] = {"a": ia, "b": ib, "ratio": ia / ib}
            print(f"  {label:32s} A {ia:>13,}  B {ib:>13,}  A/B {ia / ib:.4f}", flush=True)

    if o.json:
        with open(o.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
