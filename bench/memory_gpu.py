#!/usr/bin/env python3
"""Device memory of a sidecar per codec on the GPU path (docs/cuda.md "Memory"), for sizing.

The GPU counterpart of bench/memory.py, for a machine with an NVIDIA GPU and PyTorch with CUDA
(scripts/device-check.sh runs it). This process is the trainer: it allocates one 2-D fp32 tensor
of --elements values on the GPU, registers it with one `lightwire serve` through CUDA IPC and hands
it over --steps times; the sidecar compresses on the device and writes the result back in place.
Rows, flags and state formulas are bench/memory.py's (warm-up and the PowerSGD start step off;
every reply's codec, mode and device checked; lightwire_state_bytes against the formula).

Measured per row: the device's free memory (torch.cuda.mem_get_info, the whole GPU) after a first
step of a 4096-element tensor (the sidecar's CUDA context, stream and small buffers exist) and
after the steps, the trainer allocating nothing in between: the difference is what the steps made
the sidecar keep on the device (its state, the pooled work area, the tensor's step buffers), as a
multiple of the tensor. Also the sidecar's lightwire_state_bytes and lightwire_pool_bytes. The
`model` row: --model-tensors tensors of one buffer, each with its own state and buffers.

    $PYTHON bench/memory_gpu.py LIGHTWIRE_BIN [--elements 25000000] [--steps 4]
                                [--rows none,...] [--json FILE]

Exit status 77 when there is no usable GPU (nothing measured), 1 when a row fails.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "clients", "python"))

import memory  # noqa: E402  (bench/memory.py: rows, formulas, shapes, process helpers)

SKIP = 77


def run_row(binary, row, n, steps, tensors):
    import torch
    import lightwire
    flags, target = memory.ROWS[row]
    d = tempfile.mkdtemp(prefix="lw-memgpu-")
    sock = os.path.join(d, "s.sock")
    log = open(os.path.join(d, "serve.log"), "wb")
    proc = subprocess.Popen([binary, "serve", "--socket", sock, "--control-tcp", "",
                             "--admin-listen", "", "--state-dir", "", "--warmup-steps", "0",
                             "--powersgd-start-step", "0"] + flags,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    c = None
    try:
        memory.wait_for_socket(proc, sock, row)
        c = lightwire.Client(socket_path=sock, timeout=(2.0, 600.0))
        c.wait_ready(timeout=60)
        per = n // tensors
        shape = memory.shape_of(per)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.empty(n, device="cuda")
        tiny = torch.zeros(4096, device="cuda")
        ev = torch.cuda.Event(interprocess=True)
        bid, tid = c.register_cuda(x, event=ev), c.register_cuda(tiny)
        # The sidecar's CUDA context, stream and small buffers: the idle figure comes after them.
        warm = c.emit_gradient_shm(tid, name="warm", step=0, shape=[4096])
        if not str(warm.get("device", "")).startswith("cuda:"):
            raise RuntimeError("%s: the warm-up step ran on %s, not a GPU" % (row, warm.get("device")))
        torch.cuda.synchronize()
        free_idle = torch.cuda.mem_get_info()[0]
        state_idle = memory.gauge(c.metrics(), "lightwire_state_bytes")  # the warm-up tensor's
        want = memory.EXPECT_CODEC.get(row, row)
        times = []
        for step in range(steps):
            x.normal_(generator=gen)  # in place: the trainer allocates nothing
            ev.record()
            t0 = time.monotonic()
            for t in range(tensors):
                name = "w" if tensors == 1 else "layer%03d.weight" % t
                rep = c.emit_gradient_shm(bid, name=name, step=step, shape=shape,
                                          offset=t * per * 4)
                if (rep.get("codec") != want or rep.get("mode") != "compressed"
                        or not str(rep.get("device", "")).startswith("cuda:")):
                    raise RuntimeError("%s: step %d ran %s (%s) on %s, not %s compressed on a GPU"
                                       % (row, step, rep.get("codec"), rep.get("mode"),
                                          rep.get("device"), want))
            times.append(time.monotonic() - t0)
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info()[0]
        text = c.metrics()
        state = memory.gauge(text, "lightwire_state_bytes") - state_idle
        pool = memory.gauge(text, "lightwire_pool_bytes")
        expect = tensors * memory.state_bytes(row, per, shape)
        if int(state) != expect:
            raise RuntimeError("%s: %d state bytes, the formula says %d (one copy)"
                               % (row, int(state), expect))
        c.release_buffer(bid)
        c.release_buffer(tid)
        kept = free_idle - free_after
        return {"row": row, "flags": " ".join(flags), "elements": n, "tensors": tensors,
                "shape": shape, "steps": steps, "device_kept_mb": kept / 1e6,
                "state_mb": state / 1e6, "pool_mb": pool / 1e6, "ratio": kept / (4.0 * n),
                "host_target": target, "step_s": min(times)}
    finally:
        if c is not None:
            c.close()
        memory.stop([proc])
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binary", help="the lightwire binary")
    ap.add_argument("--elements", type=int, default=25_000_000, help="fp32 elements (default 25M)")
    ap.add_argument("--steps", type=int, default=4, help="steps per row (default 4)")
    ap.add_argument("--rows", default=",".join(memory.ROWS),
                    help="rows to run (default all: %s)" % ",".join(memory.ROWS))
    ap.add_argument("--model-tensors", type=int, default=100,
                    help="tensors of the `model` row (default 100)")
    ap.add_argument("--json", help="also write the rows to this file (JSON list)")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in memory.ROWS]
    if unknown:
        ap.error("--rows: unknown %s (known: %s)" % (", ".join(unknown), ", ".join(memory.ROWS)))
    if args.elements < args.model_tensors or args.steps < 1:
        ap.error("--elements must be >= --model-tensors; --steps >= 1")
    try:
        import torch
        ok = torch.cuda.is_available()
        why = torch.cuda.get_device_name(0) if ok else "torch.cuda.is_available() is False"
    except Exception as e:  # noqa: BLE001 - no torch, no driver: nothing to measure
        ok, why = False, "cannot use torch: %s" % e
    if not ok:
        print("SKIP: no usable GPU (%s)" % why)
        return SKIP
    print("GPU: %s; tensor of %d fp32 elements (%.0f MB), one sidecar, one trainer, %d steps"
          % (why, args.elements, args.elements * 4 / 1e6, args.steps), flush=True)
    print("%-13s %10s %9s %9s %11s %12s %7s" % ("row", "kept MB", "state MB", "pool MB",
                                               "kept/tensor", "host target", "step s"), flush=True)
    out, failed = [], 0
    for row in rows:
        tensors = args.model_tensors if row == "model" else 1
        try:
            r = run_row(args.binary, row, args.elements, args.steps, tensors)
        except Exception as e:  # noqa: BLE001 - reported, the next row runs
            print("%-13s FAILED: %s" % (row, e), flush=True)
            out.append({"row": row, "error": str(e)})
            failed += 1
            continue
        out.append(r)
        print("%-13s %10.0f %9.0f %9.0f %10.2fx %11.1fx %7.3f" % (
            row, r["device_kept_mb"], r["state_mb"], r["pool_mb"], r["ratio"], r["host_target"],
            r["step_s"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
