"""An agent-RL trainer through lightwire sidecars: GRPO-style policy gradients on a small byte-level
language-model policy, tasks handed out and rollouts collected by a store (docs/agent-rl.md).

The policy is a causal transformer over bytes. The task (`--task`), generated from fixed seeds:
`reverse` (the default) writes a string of letters backwards ("abcd=" -> "dcba."); `add` writes
the sum's digits ("47+38=" -> "085."); `compare` says which number is larger ("47?38=" -> ">.").
A completion earns the share of its characters that match the answer's (partial credit, so that
early groups are rarely all alike). A cached, deterministic supervised warm start comes first.
For `reverse` its corpus mixes two conventions, copying and reversing, so the policy can already
produce what the reward asks for but prefers the other -- RL's usual situation on a pretrained
model -- and RL makes it reverse. For `add` and `compare` the warm start gives partial
competence, and RL at these sizes barely moves it in a hundred steps (docs/agent-rl.md).

One optimizer step of each of the W trainer processes:
1. take its tasks of the step from the store (`--prompts` prompts: rollouts enqueued by the
   algorithm side for that step), sample `--group` completions per prompt with the current policy
   (KV cache), score them, record them in the store as spans and finish each rollout with its
   reward;
2. GRPO loss: group-relative advantages (reward minus the group's mean, over its standard
   deviation), the clipped ratio objective of PPO per completion token, optionally a KL term to
   the frozen warm start (`--kl`); backward over `--accum` micro-batches (the gradients add up);
3. the whole model's gradient, one tensor per layer (names and shapes: the layout), to this
   trainer's sidecar once per optimizer step (`emit_gradient`, HTTP body or shared memory:
   `--transport`), which returns the average over the job; AdamW steps with it;
4. the trainer's mean reward of the step to the sidecar (`report(step, reward=...)`), which feeds
   the rollback policy (docs/policies.md).
Rank 0 evaluates a fixed held-out prompt set greedily every `--eval-every` steps (the time it takes
is left out of the time axis). Whether the exchange is a ring, a parameter server or a parameter
server with bounded staleness is the sidecars' configuration; `--straggler` makes one random
trainer per step twice as slow (the same choice on every trainer).

Usage: sidecars running (one socket per trainer):

    PYTHONPATH=clients/python python3 clients/python/examples/agent_rl.py --sockets A,B \\
        --profile short

or let the example start W sidecars on loopback itself (`lightwire serve`, codec none):

    PYTHONPATH=clients/python python3 clients/python/examples/agent_rl.py --serve \\
        build-release/proxy/lightwire --trainers 2 --profile short

Profiles: `short` (0.1 M parameters, seconds on two cores: the test suite's) and `bench` (4.8 M
parameters: bench/agent_rl.py, 4 trainers on a 1 Gbit/s link, where the dense exchange dominates
a step).
Any profile field can be overridden by its flag. `--out FILE` writes the run's figures (JSON).
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightwire  # noqa: E402
from agent_store import StoreClient, StoreServer  # noqa: E402

PROFILES = {
    # model: d_model, n_layer, n_head; task: letters (reverse) or digits (add, compare) and the
    # warm corpus's copy_share (reverse); batch: prompts x group per trainer and step
    "short": dict(d_model=64, n_layer=2, n_head=4, letters=4, digits=2, copy_share=0.65,
                  prompts=4, group=4, steps=12, lr=1e-3, warm_steps=60, warm_batch=64,
                  warm_lr=3e-3, eval_every=4, eval_prompts=64),
    "bench": dict(d_model=256, n_layer=6, n_head=4, letters=4, digits=2, copy_share=0.65,
                  prompts=1, group=8, steps=100, lr=1e-4, warm_steps=300, warm_batch=64,
                  warm_lr=1e-3, eval_every=5, eval_prompts=128),
}
VOCAB = 256  # bytes
LETTERS = "abcdefghijklmnopqrstuvwxyz"
EVAL_WINDOW = 3  # evaluations in the running mean that is a run's final reward


# ------------------------------------------------------------------------------------ the task

def format_problem(x, cfg):
    """The (prompt, answer) of problem x: a string of letters (reverse) or a pair of numbers."""
    task, digits = cfg["task"], cfg["digits"]
    if task == "reverse":
        return x + "=", x[::-1] + "."
    a, b = x
    if task == "compare":
        return "%0*d?%0*d=" % (digits, a, digits, b), "<=>"[(a > b) - (a < b) + 1] + "."
    return "%0*d+%0*d=" % (digits, a, digits, b), "%0*d." % (digits + 1, a + b)


def draw(rng, cfg):
    """A random problem (before formatting)."""
    if cfg["task"] == "reverse":
        return "".join(rng.choice(LETTERS) for _ in range(cfg["letters"]))
    return rng.randrange(10 ** cfg["digits"]), rng.randrange(10 ** cfg["digits"])


def heldout(x):
    """Whether problem x belongs to the held-out set (never a training task): a tenth of them."""
    return zlib.crc32(repr(x).encode()) % 10 == 0


def problem(rng, cfg):
    """A training problem: (prompt, answer)."""
    while True:
        x = draw(rng, cfg)
        if not heldout(x):
            return format_problem(x, cfg)


def warm_example(rng, cfg):
    """One example of the warm start's corpus. For `reverse` it mixes two conventions, as text
    found in the wild does: the letters copied (a `copy_share` of the examples) or reversed (the
    rest). The policy learns both, prefers copying, and RL has to make it reverse -- the situation
    of RL on a pretrained model, which can already produce what the reward asks for, but not
    reliably. For `add` and `compare` the corpus holds the answers, and a short warm start gives
    partial competence."""
    prompt, answer = problem(rng, cfg)
    if cfg["task"] == "reverse" and rng.random() < cfg["copy_share"]:
        return prompt, prompt[:-1] + "."
    return prompt, answer


def eval_set(cfg):
    """The fixed held-out prompts (seed-independent: every run is judged on the same ones)."""
    rng = random.Random(20261206)
    out = []
    while len(out) < cfg["eval_prompts"]:
        x = draw(rng, cfg)
        if heldout(x):
            out.append(format_problem(x, cfg))
    return out


def answer_length(cfg):
    return len(eval_set(dict(cfg, eval_prompts=1))[0][1])


def context(cfg):
    """Prompt and answer: the positions the policy sees."""
    prompt, answer = eval_set(dict(cfg, eval_prompts=1))[0]
    return len(prompt) + len(answer)


def reward(completion, answer):
    """The share of the answer's characters (the final '.' included) the completion has at the
    same place: 0 to 1."""
    return sum(1 for x, y in zip(completion, answer) if x == y) / len(answer)


def encode(texts):
    return torch.tensor([list(t.encode("ascii")) for t in texts], dtype=torch.long)


def decode(rows):
    return ["".join(chr(c) if 32 <= c < 127 else "?" for c in row) for row in rows.tolist()]


# ----------------------------------------------------------------------------------- the policy

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x, cache=None):
        """x: (B, T, d). cache: (k, v) of the earlier positions, or None; returns (y, (k, v))."""
        B, T, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(B, T, h, d // h).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        if T > 1:  # causal: query i (at position past + i) sees keys up to past + i
            S = k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
            att = att.masked_fill(~mask, float("-inf"))
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, d)
        x = x + self.proj(y)
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x, (k, v)


class Policy(nn.Module):
    def __init__(self, d_model, n_layer, n_head, ctx):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(ctx, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, caches=None, start=0):
        """Logits (B, T, VOCAB) of the tokens idx at positions start.., and the new caches."""
        pos = torch.arange(start, start + idx.shape[1])
        x = self.tok(idx) + self.pos(pos)
        new = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, None if caches is None else caches[i])
            new.append(c)
        return self.ln_f(x) @ self.tok.weight.t(), new  # output head tied to the embedding


@torch.no_grad()
def generate(model, prompts, n_new, gen=None):
    """Completions of n_new bytes for the prompts (B, Tp): sampled with generator `gen`, greedy
    without one. KV cache: each new token runs through the model once."""
    logits, caches = model(prompts)
    out = []
    for t in range(n_new):
        last = logits[:, -1]
        if gen is None:
            tok = last.argmax(dim=-1, keepdim=True)
        else:
            tok = torch.multinomial(last.softmax(dim=-1), 1, generator=gen)
        out.append(tok)
        if t + 1 < n_new:
            logits, caches = model(tok, caches, start=prompts.shape[1] + t)
    return torch.cat(out, dim=1)


def evaluate(model, problems):
    """The mean reward of greedy completions of the held-out prompts."""
    prompts = encode([p for p, _ in problems])
    n_new = len(problems[0][1])
    done = decode(generate(model, prompts, n_new))
    return sum(reward(c, a) for c, (_, a) in zip(done, problems)) / len(problems)


def completion_logp(model, prompts, completions):
    """Per-token log-probabilities (B, n_new) of the completions after their prompts."""
    seq = torch.cat([prompts, completions], dim=1)
    logits, _ = model(seq[:, :-1])
    tail = logits[:, prompts.shape[1] - 1:]
    return tail.log_softmax(dim=-1).gather(2, completions.unsqueeze(2)).squeeze(2)


def model_facts(model, ctx):
    """Parameter count and training FLOPs per token (6 per weight of the matrix products, plus
    attention's 12 · layers · context · width; embeddings' lookups not counted, the tied output
    head counted)."""
    n = sum(p.numel() for p in model.parameters())
    d = model.ln_f.normalized_shape[0]
    matmul = sum(p.numel() for name, p in model.named_parameters()
                 if p.dim() == 2 and name != "pos.weight")
    return n, 6 * matmul + 12 * len(model.blocks) * ctx * d


# ------------------------------------------------------------------------------- the warm start

def warm_start(cfg, cache_dir, log=print):
    """The supervised warm start's weights: trained once (one thread, fixed seeds: the same bytes
    every time) and cached under cache_dir by everything that shapes them."""
    keys = ("d_model", "n_layer", "n_head", "task", "warm_steps", "warm_batch", "warm_lr") + (
        ("letters", "copy_share") if cfg["task"] == "reverse" else ("digits",))
    spec = {k: cfg[k] for k in keys}
    spec["seed"] = cfg["warm_seed"]
    spec["version"] = 2
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, "agent-rl-warm-%s.pt" % digest)
    model = make_policy(cfg)
    if os.path.exists(path):
        model.load_state_dict(torch.load(path))
        return model, path
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    model = make_policy(cfg)
    rng = random.Random(spec["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["warm_lr"], weight_decay=0.0)
    t0 = time.monotonic()
    for step in range(cfg["warm_steps"]):
        batch = [warm_example(rng, cfg) for _ in range(cfg["warm_batch"])]
        prompts, answers = encode([p for p, _ in batch]), encode([a for _, a in batch])
        loss = -completion_logp(model, prompts, answers).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log("warm start: step %d/%d, loss %.3f (%.0f s)" % (
                step + 1, cfg["warm_steps"], loss.item(), time.monotonic() - t0))
    torch.set_num_threads(threads)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + ".tmp%d" % os.getpid()
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model, path


def make_policy(cfg):
    return Policy(cfg["d_model"], cfg["n_layer"], cfg["n_head"], ctx=context(cfg))


# ------------------------------------------------------------------------------- the exchange

class Exchange(object):
    """The whole model's gradient to the sidecar, one tensor per layer: its layout (every
    parameter's name, element offset and shape) sent with the first step, then only its hash, and
    again when the sidecar does not hold it (it restarted: 404 unknown_layout) -- the client's
    `emit_layers` for the HTTP body, its `LayoutHashes` for shared memory."""

    def __init__(self, client, model, transport, name="policy"):
        self.client = client
        self.name = name
        self.params = [p for p in model.parameters()]
        self.layout, offset = [], 0
        for pname, p in model.named_parameters():
            self.layout.append({"name": "%s.%s" % (name, pname), "offset": offset,
                                "shape": list(p.shape)})
            offset += p.numel()
        self.elements = offset
        self.transport = transport
        self.seg = None
        if transport == "shm":
            self.seg = lightwire.ShmSegment(4 * self.elements)
            client.register_buffer(self.seg)
            self.view = np.frombuffer(self.seg.buf, dtype=np.float32, count=self.elements)
            self.hashes = lightwire.LayoutHashes()
        self.wire_bytes = self.raw_bytes = 0

    def flat_grad(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def average(self, step, flat):
        """The job's average of `flat` (a float32 tensor of the whole model) for `step`."""
        if self.transport == "shm":
            self.view[:] = flat.numpy()

            def emit(layout, layout_hash):
                reply = self.client.emit_gradient_shm(self.seg, name=self.name, step=step,
                                                      shape=[self.elements], layout=layout,
                                                      layout_hash=layout_hash)
                return reply, reply.get("layout_hash")
            figures = self.hashes.send(self.name, self.layout, emit)
            out = torch.from_numpy(self.view.copy())
        else:
            out = self.client.emit_layers(flat, name=self.name, step=step, layout=self.layout)
            figures = self.client.last_figures
        self.wire_bytes += int(figures.get("wire_bytes") or 0)
        self.raw_bytes += int(figures.get("raw_bytes") or 0)
        return out

    def close(self):
        if self.seg is not None:
            try:
                self.client.release_buffer(self.seg)
            except lightwire.LightwireError:
                pass
            self.seg.close()


def set_grads(params, flat):
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


# --------------------------------------------------------------------------------- the trainer

def straggler_of(seed, step, world):
    """The trainer that is slow at `step` (the same on every trainer)."""
    return random.Random(seed * 1000003 + step).randrange(world)


def train(rank, cfg, sockets, store_url, warm_path, out_dir):
    torch.set_num_threads(1)
    world = len(sockets)
    torch.manual_seed(cfg["seed"])
    model = make_policy(cfg)
    model.load_state_dict(torch.load(warm_path))
    ref = None
    if cfg["kl"] > 0:
        ref = make_policy(cfg)
        ref.load_state_dict(torch.load(warm_path))
        ref.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    client = lightwire.Client(socket_path=sockets[rank], timeout=(5.0, 300.0))
    client.wait_ready(timeout=120)
    store = StoreClient(store_url)
    exchange = Exchange(client, model, cfg["transport"])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    problems = eval_set(cfg)
    gen = torch.Generator().manual_seed(cfg["seed"] * 7919 + rank)
    n_new = answer_length(cfg)
    rows, evals = [], []
    zero_share = None
    away = 0.0  # seconds spent evaluating: not on the time axis
    t0 = time.monotonic()

    def run_eval(step):
        nonlocal away
        t = time.monotonic()
        model.eval()
        r = evaluate(model, problems)
        model.train()
        evals.append({"step": step, "t": t - t0 - away, "reward": r})
        away += time.monotonic() - t
        print("step %4d  held-out reward %.3f  (%.1f s)" % (step, r, evals[-1]["t"]), flush=True)

    if rank == 0:
        run_eval(0)
    for step in range(1, cfg["steps"] + 1):
        ts = time.monotonic()
        # 1. Rollouts: this step's tasks from the store, G samples each, rewards back to it.
        tasks = store.dequeue("trainer-%d" % rank, step, cfg["prompts"])
        if len(tasks) != cfg["prompts"]:
            raise RuntimeError("trainer %d: the store had %d tasks of step %d, not %d" % (
                rank, len(tasks), step, cfg["prompts"]))
        g = cfg["group"]
        prompts = encode([t["input"]["prompt"] for t in tasks]).repeat_interleave(g, dim=0)
        model.eval()
        completions = generate(model, prompts, n_new, gen)
        model.train()
        texts = decode(completions)
        rewards = torch.tensor([reward(c, tasks[i // g]["input"]["answer"])
                                for i, c in enumerate(texts)])
        for j, t in enumerate(tasks):
            group = rewards[j * g:(j + 1) * g]
            store.add_spans(t["rollout_id"], t["attempt_id"], [
                {"name": "completion", "attributes": {"text": texts[j * g + i],
                                                      "reward": float(group[i])}}
                for i in range(g)])
            store.finish(t["rollout_id"], t["attempt_id"], float(group.mean()))
        # 2. GRPO: group-relative advantages, the clipped objective, micro-batches.
        grouped = rewards.view(-1, g)
        adv = ((grouped - grouped.mean(dim=1, keepdim=True)) /
               (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)
        opt.zero_grad(set_to_none=False)
        n = prompts.shape[0]
        mb = max(1, n // cfg["accum"])
        for lo in range(0, n, mb):
            sl = slice(lo, min(n, lo + mb))
            logp = completion_logp(model, prompts[sl], completions[sl])
            old = logp.detach()  # sampled by this policy: the ratio starts at 1
            ratio = (logp - old).exp()
            a = adv[sl].unsqueeze(1)
            obj = torch.min(ratio * a, ratio.clamp(1 - cfg["clip"], 1 + cfg["clip"]) * a)
            loss = -obj.mean()
            if ref is not None:
                with torch.no_grad():
                    ref_logp = completion_logp(ref, prompts[sl], completions[sl])
                d = ref_logp - logp
                loss = loss + cfg["kl"] * (d.exp() - d - 1).mean()
            (loss * (sl.stop - sl.start) / n).backward()
        flat = exchange.flat_grad()
        if zero_share is None:
            zero_share = float((flat == 0).sum()) / flat.numel()
        if cfg["straggler"] and straggler_of(cfg["seed"], step, world) == rank:
            time.sleep(time.monotonic() - ts)  # twice as slow this step
        tc = time.monotonic()
        # 3. Once per optimizer step: the whole model's gradient, averaged over the job.
        avg = exchange.average(step, flat)
        te = time.monotonic()
        set_grads(exchange.params, avg)
        if cfg["grad_clip"] > 0:  # of the average: the same on every trainer
            torch.nn.utils.clip_grad_norm_(exchange.params, cfg["grad_clip"])
        opt.step()
        mean_reward = float(rewards.mean())
        # 4. The reward feeds the sidecars' rollback policy.
        try:
            client.report(step, reward=mean_reward)
        except lightwire.LightwireError:
            pass  # a sidecar away misses it; training goes on
        rows.append({"step": step, "t": time.monotonic() - t0 - away, "reward": mean_reward,
                     "compute_s": tc - ts, "exchange_s": te - tc})
        if rank == 0 and (step % cfg["eval_every"] == 0 or step == cfg["steps"]):
            run_eval(step)
    exchange.close()
    store.close()
    result = {"rank": rank, "rows": rows, "evals": evals, "zero_share": zero_share,
              "layout": exchange.layout,
              "wire_bytes": exchange.wire_bytes, "raw_bytes": exchange.raw_bytes}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(result, f)


def _entry(rank, cfg, sockets, store_url, warm_path, out_dir):
    try:
        train(rank, cfg, sockets, store_url, warm_path, out_dir)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


# -------------------------------------------------------------------------------- the launcher

def serve_sidecars(binary, world, work, codec_args):
    """W `lightwire serve` processes on loopback (one job), for trying the example alone."""
    import socket
    ports = []
    for _ in range(world):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()
    peers = ",".join("127.0.0.1:%d" % p for p in ports)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTWIRE_")}
    env["LIGHTWIRE_PEER__SECRET"] = os.urandom(8).hex()
    procs, sockets = [], []
    for r in range(world):
        sock = os.path.join(work, "sidecar%d.sock" % r)
        cmd = [binary, "serve", "--job-id", "agent-rl", "--rank", str(r), "--world-size",
               str(world), "--peers", peers, "--peer-listen", "127.0.0.1:%d" % ports[r],
               "--socket", sock, "--control-tcp", "", "--admin-listen", "", "--state-dir", "",
               "--log-level", "warn"] + list(codec_args)
        procs.append(subprocess.Popen(cmd, env=env))
        sockets.append(sock)
    return procs, sockets


def summarize(cfg, results, facts, wall):
    evals = results[0]["evals"]
    rewards = [e["reward"] for e in evals]
    final = sum(rewards[-EVAL_WINDOW:]) / len(rewards[-EVAL_WINDOW:])
    steps = cfg["steps"]
    wire = sum(r["wire_bytes"] for r in results) / len(results) / steps
    raw = sum(r["raw_bytes"] for r in results) / len(results) / steps
    last = max(r["rows"][-1]["t"] for r in results)
    return {"params": facts[0], "flops_per_token": facts[1],
            "zero_share": results[0]["zero_share"], "start_reward": rewards[0],
            "final_reward": final, "steps": steps, "train_seconds": last,
            "steps_per_second": steps / last if last > 0 else None,
            "wire_bytes_per_step": wire, "raw_bytes_per_step": raw, "wall_seconds": wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="short")
    ap.add_argument("--sockets", help="the sidecars' sockets, one per trainer (comma-separated)")
    ap.add_argument("--serve", metavar="LIGHTWIRE",
                    help="start --trainers sidecars on loopback with this executable")
    ap.add_argument("--serve-args", default="--codec none",
                    help="`lightwire serve` arguments of the sidecars --serve starts")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--transport", choices=["http", "shm"], default="http",
                    help="the gradient as the HTTP request's body, or in shared memory")
    ap.add_argument("--task", choices=["reverse", "add", "compare"], default="reverse",
                    help="reverse: the letters backwards (\"abcd=\" -> \"dcba.\"); add: the "
                         "sum's digits (\"47+38=\" -> \"085.\"); compare: which is larger "
                         "(\"47?38=\" -> \">.\")")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per optimizer step (one exchange per optimizer step)")
    ap.add_argument("--kl", type=float, default=0.0, help="KL coefficient to the warm start")
    ap.add_argument("--clip", type=float, default=0.2, help="the ratio's clip range")
    ap.add_argument("--grad-clip", type=float, default=1.0,
                    help="the averaged gradient's norm at most this (0: no clipping)")
    ap.add_argument("--straggler", action="store_true",
                    help="one random trainer per step twice as slow")
    ap.add_argument("--cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lightwire"),
        help="where the warm start is cached")
    ap.add_argument("--warm-seed", type=int, default=1234)
    ap.add_argument("--out", help="write the run's figures (JSON) here")
    ap.add_argument("--warm-only", action="store_true",
                    help="only make (or find) the cached warm start, and say where it is")
    for key, value in PROFILES["short"].items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None)
    args = ap.parse_args(argv)
    cfg = dict(PROFILES[args.profile])
    for key in PROFILES["short"]:
        v = getattr(args, key)
        if v is not None:
            cfg[key] = v
    cfg.update(task=args.task, seed=args.seed, accum=args.accum, kl=args.kl, clip=args.clip,
               grad_clip=args.grad_clip,
               straggler=args.straggler, transport=args.transport, warm_seed=args.warm_seed)
    if cfg["accum"] < 1 or cfg["accum"] > cfg["prompts"] * cfg["group"]:
        ap.error("--accum must be between 1 and prompts x group")
    if cfg["d_model"] % cfg["n_head"]:
        ap.error("--d-model must be a multiple of --n-head")
    if args.warm_only:
        model, warm_path = warm_start(cfg, args.cache_dir)
        print("warm start: %s (held-out reward %.3f)" % (
            warm_path, evaluate(model, eval_set(cfg))))
        return 0
    if bool(args.sockets) == bool(args.serve):
        ap.error("give the sidecars' --sockets, or --serve LIGHTWIRE to start them")
    work = tempfile.mkdtemp(prefix="agent-rl-")
    procs = []
    server = None
    try:
        if args.serve:
            procs, sockets = serve_sidecars(args.serve, args.trainers, work,
                                            args.serve_args.split())
        else:
            sockets = args.sockets.split(",")
        world = len(sockets)
        t_warm = time.monotonic()
        model, warm_path = warm_start(cfg, args.cache_dir)
        facts = model_facts(model, context(cfg))
        print("policy: %d parameters, %.2f MFLOP per token (training); warm start %s (%.0f s)" % (
            facts[0], facts[1] / 1e6, os.path.basename(warm_path), time.monotonic() - t_warm),
            flush=True)
        # The store, and the algorithm side's tasks: each trainer's prompts of every step.
        server = StoreServer()
        algo = StoreClient(server.url)
        rng = random.Random(cfg["seed"])
        tasks = []
        for step in range(1, cfg["steps"] + 1):
            for _ in range(world * cfg["prompts"]):
                p, a = problem(rng, cfg)
                tasks.append({"step": step, "input": {"prompt": p, "answer": a}})
        algo.enqueue(tasks)
        t0 = time.monotonic()
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=_entry, args=(r, cfg, sockets, server.url, warm_path, work))
                   for r in range(world)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        failed = [r for r, w in enumerate(workers) if w.exitcode != 0]
        if failed:
            raise SystemExit("trainers %s failed" % failed)
        wall = time.monotonic() - t0
        results = []
        for r in range(world):
            with open(os.path.join(work, "rank%d.json" % r)) as f:
                results.append(json.load(f))
        stats = algo.stats()
        summary = summarize(cfg, results, facts, wall)
        summary["store"] = stats
        print("store: %d rollouts, %s, %d spans, %d calls refused" % (
            stats["rollouts"], ", ".join("%d %s" % (n, s) for s, n in
                                         sorted(stats["by_status"].items())),
            stats["spans"], stats["rejected"]))
        print("held-out reward: %.3f at the start, %.3f at the end (mean of the last %d "
              "evaluations); %d steps in %.1f s (%.2f steps/s); %.0f bytes on the wire per "
              "trainer and step (%.0f raw)" % (
                  summary["start_reward"], summary["final_reward"], EVAL_WINDOW,
                  summary["steps"], summary["train_seconds"], summary["steps_per_second"],
                  summary["wire_bytes_per_step"], summary["raw_bytes_per_step"]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"config": cfg, "summary": summary, "layout": results[0]["layout"],
                           "ranks": results}, f)
        return 0
    finally:
        if server is not None:
            server.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
