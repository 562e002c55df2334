"""CUDA IPC end to end, on a machine with an NVIDIA GPU and PyTorch with CUDA (docs/cuda.md).

This process is the trainer; `lightwire serve` is a separate process that opens this process's
CUDA memory through the IPC handles PyTorch exports, and writes each result back in place.

    python3 tests/python/cuda_ipc_check.py LIGHTWIRE_BIN [OUT_JSON]

Runs without pytest (the GPU machine may not have it); tests/python/test_cuda_ipc.py runs the
same checks under pytest and skips them where there is no GPU. Exit status 0 only when every
check passed; 77 when there is no usable GPU (skipped, not passed).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))

SKIP = 77


class Serve(object):
    """A `lightwire serve` child on a Unix socket in a temporary directory."""

    def __init__(self, binary, codec="none", local_trainers=1, extra=()):
        self.dir = tempfile.mkdtemp(prefix="lw-cuda-ipc-")
        self.socket = os.path.join(self.dir, "lw.sock")
        self.log = open(os.path.join(self.dir, "serve.log"), "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--socket", self.socket, "--control-tcp", "", "--admin-listen", "",
             "--local-trainers", str(local_trainers), "--codec", codec, "--state-dir", "",
             "--log-level", "info"] + list(extra),
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        import lightwire
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("lightwire serve exited %d: %s" % (self.proc.returncode, self.output()))
            if os.path.exists(self.socket):
                c = lightwire.Client(socket_path=self.socket, timeout=(1.0, 5.0))
                ok = c.healthz()
                c.close()
                if ok:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("lightwire serve not healthy in 30 s: " + self.output())
            time.sleep(0.05)

    def client(self, trainer=None):
        import lightwire
        return lightwire.Client(socket_path=self.socket, timeout=(2.0, 60.0), trainer=trainer)

    def output(self):
        self.log.flush()
        with open(os.path.join(self.dir, "serve.log"), "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def check_none_in_place(binary):
    """codec none, one trainer: the result written in place equals the input, bit for bit; the
    reply reports the step; neighbours of the registered range are untouched."""
    import torch
    from lightwire import LightwireError
    s = Serve(binary, codec="none")
    try:
        c = s.client()
        status = c.status()
        assert status["cuda"]["available"], "sidecar sees no CUDA driver: %s" % status["cuda"]
        big = torch.randn(3 * 1000003, device="cuda")
        x = big[1000003:2000006]  # a view at a storage offset
        want = x.clone()
        before, after = big[:1000003].clone(), big[2000006:].clone()
        ev = torch.cuda.Event(interprocess=True)
        bid = c.register_cuda(x, event=ev)
        for step in range(3):
            x.copy_(want * (step + 1))
            ev.record()
            reply = c.emit_gradient_shm(bid, name="w", step=step, shape=[x.numel()])
            assert reply["codec"] == "none", reply
            assert reply["device"].startswith("cuda:"), "the step ran on %s" % reply["device"]
            torch.cuda.synchronize()
            assert torch.equal(x, want * (step + 1)), "step %d: result differs from the input" % step
        assert torch.equal(big[:1000003], before) and torch.equal(big[2000006:], after), \
            "bytes outside the registered range changed"
        listed = [b for b in c.status()["buffers"] if b["id"] == bid]
        assert listed and listed[0]["kind"] == "cuda_ipc", listed
        c.release_buffer(bid)
        try:
            c.emit_gradient_shm(bid, name="w", step=3, shape=[x.numel()])
            raise AssertionError("a released buffer was accepted")
        except LightwireError as e:
            assert e.status == 404, e
        c.close()
        return "3 steps of 1000003 fp32 in place, neighbours untouched, released buffer refused"
    finally:
        s.close()


def check_fp16_and_two_trainers(binary):
    """Two local trainers (threads with trainer 0 and 1, each its own registered tensor), codec
    fp16: each gets the same mean, equal to the CPU codec's arithmetic on the host copies."""
    import torch
    s = Serve(binary, codec="fp16", local_trainers=2)
    try:
        n = 1 << 20
        a = torch.randn(n, device="cuda")
        b = torch.randn(n, device="cuda")
        ha, hb = a.cpu(), b.cpu()
        clients = [s.client(trainer=0), s.client(trainer=1)]
        ids = [clients[0].register_cuda(a), clients[1].register_cuda(b)]
        torch.cuda.synchronize()
        errors = []

        replies = [None, None]

        def emit(k):
            try:
                replies[k] = clients[k].emit_gradient_shm(ids[k], name="g", step=0, shape=[n])
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=emit, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert all(r["device"].startswith("cuda:") for r in replies), replies
        torch.cuda.synchronize()
        # World 1: the sum in trainer order, sent as fp16, decoded with weight 1/2.
        want = ((ha + hb).half().float() * 0.5)
        assert torch.equal(a.cpu(), b.cpu()), "the two trainers got different results"
        diff = (a.cpu() - want).abs().max().item()
        assert diff == 0.0, "max |result - reference| = %g" % diff
        for k in (0, 1):
            clients[k].release_buffer(ids[k])
            clients[k].close()
        return "2 trainers x %d fp32 through fp16: identical, bit-exact against the reference" % n
    finally:
        s.close()


def check_refusals(binary):
    """Registrations the sidecar must refuse with a clear 400: a GPU it cannot see, a range past
    the allocation, a handle that is not one."""
    import torch
    from lightwire import LightwireError
    from lightwire.client import cuda_ipc_spec
    s = Serve(binary)
    try:
        c = s.client()
        x = torch.zeros(1024, device="cuda")
        doc = cuda_ipc_spec(x)
        cases = {
            "unknown GPU": dict(doc, device="ffff:ff:1f.7"),
            "range past the allocation": dict(doc, offset=doc["offset"] + (1 << 40)),
            "not a live handle": dict(doc, handle="00" * 64),
        }
        seen = []
        for what, bad in cases.items():
            try:
                c._json("POST", "/v1/buffers", bad)
                raise AssertionError("%s was accepted" % what)
            except LightwireError as e:
                assert e.status == 400, (what, e)
                seen.append("%s: %s" % (what, e.message[:80]))
        assert c.status()["buffers"] == [], "a refused registration left a buffer"
        c.close()
        return "; ".join(seen)
    finally:
        s.close()


def check_ddp_hook_cuda_bucket(binary):
    """lightwire.torch.ddp_comm_hook on a CUDA bucket (world 1) goes through CUDA IPC: the future
    resolves to a CUDA tensor equal to the bucket (the mean of one trainer)."""
    import torch
    import lightwire.torch as lwt
    s = Serve(binary)
    try:
        state = lwt.LightwireHookState(client=s.client(), on_error="raise")

        class Bucket(object):
            def __init__(self, t):
                self.t = t

            def buffer(self):
                return self.t

            def index(self):
                return 0

        g = torch.randn(300007, device="cuda")
        for step in range(2):
            out = lwt.ddp_comm_hook(state, Bucket(g * (step + 1))).wait()
            assert out.is_cuda, out.device
            assert torch.equal(out, g * (step + 1)), "hook result differs at step %d" % step
        assert state.cuda_ipc and state.sidecar_steps == 2, (state.cuda_ipc, state.sidecar_steps)
        state.close()
        return "2 CUDA buckets through CUDA IPC"
    finally:
        s.close()


def run_steps(binary, codec_args, gpu, dtype, steps=4):
    """Two local trainers, `steps` steps of two tensors (1M + 4097 elements of `dtype`) through a
    sidecar with --gpu `gpu`: the results of every step (host copies) and the replies."""
    import torch
    s = Serve(binary, local_trainers=2, extra=list(codec_args) + ["--gpu", gpu,
                                                                  "--chunk-elements", "262144"])
    try:
        gen = torch.Generator(device="cpu").manual_seed(7)
        shapes = {"w": 1 << 20, "b": 4097}
        clients = [s.client(trainer=0), s.client(trainer=1)]
        tensors = {(k, name): torch.zeros(n, dtype=dtype, device="cuda")
                   for k in (0, 1) for name, n in shapes.items()}
        ids = {key: clients[key[0]].register_cuda(t) for key, t in tensors.items()}
        results, replies = [], []
        for step in range(steps):
            for key, t in tensors.items():
                t.copy_(torch.randn(t.numel(), generator=gen).to(dtype))
            torch.cuda.synchronize()
            for name, n in shapes.items():
                errors, got = [], [None, None]

                def emit(k):
                    try:
                        got[k] = clients[k].emit_gradient_shm(ids[(k, name)], name=name,
                                                              step=step, shape=[n],
                                                              dtype=str(dtype).split(".")[1])
                    except Exception as e:  # reported below
                        errors.append(e)

                threads = [threading.Thread(target=emit, args=(k,)) for k in (0, 1)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
                assert not errors, (errors, s.output())
                replies.extend(got)
                results.append(tensors[(0, name)].cpu().clone())
                assert torch.equal(tensors[(0, name)].cpu(), tensors[(1, name)].cpu()), \
                    "the two trainers got different results"
        for k in (0, 1):
            clients[k].close()
        return results, replies
    finally:
        s.close()


def check_gpu_path_matches_host(binary):
    """The GPU path (compression on the device) against the same sidecar staging through the
    host (--gpu false): bit-identical results step after step (codec state included), for
    stateful and stateless codecs and fp32/fp16 gradients; the replies say where each step ran."""
    import torch
    cases = [(["--codec", "dgc", "--density", "0.01", "--momentum", "0.9"], torch.float32),
             (["--codec", "topk", "--density", "0.05", "--error-feedback", "true"], torch.float16),
             (["--codec", "qsgd", "--bits", "4"], torch.float32),
             (["--codec", "powersgd"], torch.float32),
             (["--codec", "onebit"], torch.bfloat16)]
    for args, dtype in cases:
        on_gpu, gpu_replies = run_steps(binary, args, "true", dtype)
        on_host, host_replies = run_steps(binary, args, "false", dtype)
        assert all(r["device"].startswith("cuda:") for r in gpu_replies), gpu_replies[:2]
        assert all(r["device"] == "cpu" for r in host_replies), host_replies[:2]
        for i, (a, b) in enumerate(zip(on_gpu, on_host)):
            bits = torch.int16 if a.element_size() == 2 else torch.int32  # bit for bit
            assert torch.equal(a.view(bits), b.view(bits)), \
                "%s %s: result %d differs between the GPU path and the host path" % (args, dtype, i)
        wire = [r["wire_bytes"] for r in gpu_replies], [r["wire_bytes"] for r in host_replies]
        assert wire[0] == wire[1], ("wire bytes differ", args)
    return "dgc, topk+EF (fp16), qsgd, powersgd, onebit (bf16): 4 steps x 2 tensors bit-identical"


CHECKS = [check_none_in_place, check_fp16_and_two_trainers, check_refusals,
          check_ddp_hook_cuda_bucket, check_gpu_path_matches_host]


def gpu_available():
    try:
        import torch
    except Exception as e:
        return False, "cannot import torch: %s" % e
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, torch.cuda.get_device_name(0)


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    binary, out = argv[1], (argv[2] if len(argv) > 2 else None)
    ok, why = gpu_available()
    results = []
    if not ok:
        print("SKIP: no usable GPU (%s)" % why)
        code = SKIP
    else:
        print("GPU: %s" % why)
        for check in CHECKS:
            t0 = time.monotonic()
            try:
                detail = check(binary)
                results.append({"check": check.__name__, "ok": True, "detail": detail})
                print("PASS  %s (%.1f s): %s" % (check.__name__, time.monotonic() - t0, detail))
            except Exception as e:
                results.append({"check": check.__name__, "ok": False, "detail": repr(e)})
                print("FAIL  %s (%.1f s): %r" % (check.__name__, time.monotonic() - t0, e))
        code = 0 if all(r["ok"] for r in results) else 1
    if out:
        with open(out, "w") as f:
            json.dump({"gpu": why, "skipped": not ok, "results": results}, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
