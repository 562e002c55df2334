"""The two training tasks of the end-to-end benchmark (bench/e2e/e2e.py, docs/BENCHMARKS.md).

Imported by the trainer processes (Debian's torch, CPU). Each task is deterministic: its data is
made here from fixed seeds (nothing is downloaded) and is the same in every process; batch(rank,
step) depends only on (task seed, rank, step); model() draws its initial weights from torch's
global RNG, which the caller seeds with torch.manual_seed(seed) beforehand. Nothing here touches
the global RNG except model().

  make_task("mlp")   MLP classifier 512-2048-2048-10 on synthetic data labelled by a fixed random
                     "teacher" network; batch 64 per rank; SGD with momentum.
  make_task("lm")    decoder-only byte-level transformer language model on the text of
                     /usr/share/common-licenses (last 10 % held out); batch 8 x 64 bytes per rank;
                     AdamW.

size="smoke" gives the same structure, tiny, for a seconds-long smoke test.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

CORPUS_DIR = "/usr/share/common-licenses"
CORPUS_MIN_BYTES = 100 * 1024

# Distinct sub-seeds so that the teacher, the evaluation sets and the per-(rank, step) batches
# never share a random stream.
_SALT_TEACHER = 1
_SALT_EVAL = 3
_SALT_BATCH = 4


def _generator(seed, *parts):
    """A CPU torch.Generator seeded deterministically from seed and a few small integers."""
    s = int(seed) & 0xFFFFFFFF
    for p in parts:
        # A fixed mixing (splitmix-like), identical in every process (unlike Python's hash()).
        s = (s * 0x9E3779B1 + int(p) + 0x7F4A7C15) & 0xFFFFFFFFFFFF
        s ^= s >> 17
    g = torch.Generator()
    g.manual_seed(s)
    return g


class Task:
    """Protocol shared by the tasks (see the module docstring)."""

    name = ""
    title = ""
    batch_size = 0
    has_accuracy = False

    def model(self) -> nn.Module:
        raise NotImplementedError

    def batch(self, rank: int, step: int):
        raise NotImplementedError

    def loss(self, model, inputs, targets) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model) -> dict:
        raise NotImplementedError

    def optimizer(self, params) -> torch.optim.Optimizer:
        raise NotImplementedError

    def parameters(self) -> int:
        raise NotImplementedError

    def __repr__(self):
        return "<Task %s: %s>" % (self.name, self.title)


def _unwrap(model):
    """The module inside a DistributedDataParallel (or similar) wrapper: evaluate() runs on it
    directly, so that it involves no collective and may run on one rank only."""
    return getattr(model, "module", model)


def _fmt_params(n):
    return "%.1fM" % (n / 1e6) if n >= 1e5 else "%.1fk" % (n / 1e3)


# --------------------------------------------------------------------------------------------------
# MLP classifier on teacher-labelled synthetic data


class MLPTask(Task):
    """x ~ N(0, I_d); label = argmax of a fixed random 2-layer ReLU "teacher" network (its output
    biases calibrated so that the classes come out about balanced), with a little label noise (a
    fraction of the labels replaced by uniform ones) so that the task is never solved outright.

    The training data are an endless stream: batch(rank, step) draws fresh inputs from a generator
    seeded by (seed, rank, step) and labels them with the teacher (a few MFLOP), so there is no
    pool to hold or memorise, and the training loss estimates the population loss. The evaluation
    set is a fixed, separately seeded sample of eval_size inputs."""

    name = "mlp"
    has_accuracy = True

    def __init__(self, size="full", seed=0):
        if size == "full":
            self.dims = (512, 2048, 2048, 10)
            self.batch_size = 64
            self.eval_size = 512
            self.teacher_hidden = 128
        elif size == "smoke":
            self.dims = (32, 64, 64, 10)
            self.batch_size = 4
            self.eval_size = 256
            self.teacher_hidden = 16
        else:
            raise ValueError("size must be 'full' or 'smoke', not %r" % (size,))
        self.size = size
        self.seed = int(seed)
        # 0.05: over 100 steps of 4 x 64 samples the loss plateaus ~20 steps, then falls steadily
        # (eval 2.30 -> 1.42) and is still falling at 100; 0.1 is slightly ahead at 100 steps but
        # noisier and no better by 200 (1.35 vs 1.33); 0.02 is too slow (1.72 at 100).
        self.lr = 0.05
        self.momentum = 0.9
        self.label_noise = 0.05
        self._teacher = None
        self._eval = None
        self.title = "MLP classifier %s (%s parameters), synthetic data" % (
            "-".join(str(x) for x in self.dims), _fmt_params(self.parameters()))

    def _make_teacher(self):
        if self._teacher is not None:
            return self._teacher
        d_in, n_cls, h = self.dims[0], self.dims[-1], self.teacher_hidden
        g = _generator(self.seed, _SALT_TEACHER)
        w1 = torch.randn(d_in, h, generator=g) / math.sqrt(d_in)
        b1 = torch.randn(h, generator=g) * 0.5
        w2 = torch.randn(h, n_cls, generator=g) / math.sqrt(h)
        # Calibrate the output biases on a separate sample so that the classes are about balanced.
        lc = torch.relu(torch.randn(4096, d_in, generator=g) @ w1 + b1) @ w2
        b2 = torch.zeros(n_cls)
        step = 0.5 * lc.std().item() * n_cls
        for _ in range(50):
            frac = torch.bincount((lc + b2).argmax(1), minlength=n_cls).float() / lc.shape[0]
            b2 -= step * (frac - 1.0 / n_cls)
        self._teacher = (w1, b1, w2, b2)
        return self._teacher

    def _sample(self, n, g):
        w1, b1, w2, b2 = self._make_teacher()
        n_cls = self.dims[-1]
        x = torch.randn(n, self.dims[0], generator=g)
        y = (torch.relu(x @ w1 + b1) @ w2 + b2).argmax(1)
        noisy = torch.rand(n, generator=g) < self.label_noise
        y = torch.where(noisy, torch.randint(0, n_cls, (n,), generator=g), y)
        return x, y

    def _eval_set(self):
        if self._eval is None:
            self._eval = self._sample(self.eval_size, _generator(self.seed, _SALT_EVAL))
        return self._eval

    def model(self):
        d = self.dims
        layers = []
        for i in range(len(d) - 1):
            layers.append(nn.Linear(d[i], d[i + 1]))
            if i < len(d) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def parameters(self):
        d = self.dims
        return sum(d[i] * d[i + 1] + d[i + 1] for i in range(len(d) - 1))

    def batch(self, rank, step):
        return self._sample(self.batch_size, _generator(self.seed, _SALT_BATCH, rank, step))

    def loss(self, model, inputs, targets):
        return F.cross_entropy(model(inputs), targets)

    def evaluate(self, model):
        xe, ye = self._eval_set()
        model = _unwrap(model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(xe)
                loss = F.cross_entropy(logits, ye).item()
                acc = (logits.argmax(1) == ye).float().mean().item()
        finally:
            model.train(was_training)
        return {"loss": loss, "accuracy": acc}

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)


# --------------------------------------------------------------------------------------------------
# Byte-level transformer language model


def read_corpus(directory=CORPUS_DIR, min_bytes=CORPUS_MIN_BYTES):
    """The regular files of directory (symbolic links skipped, so no text is counted twice), sorted
    by name and concatenated, as bytes."""
    if not os.path.isdir(directory):
        raise RuntimeError("lm task: text corpus directory %s is missing (install Debian's base-files "
                           "or point CORPUS_DIR elsewhere)" % directory)
    parts = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            parts.append(f.read())
    data = b"".join(parts)
    if len(data) < min_bytes:
        raise RuntimeError("lm task: text corpus %s holds only %d bytes of regular files; at least %d "
                           "are needed" % (directory, len(data), min_bytes))
    return data


class CausalLM(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-norm
    nn.TransformerEncoderLayer blocks with a causal mask, final LayerNorm, untied output head."""

    def __init__(self, vocab, d_model, n_layers, n_heads, d_ff, context):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=d_ff, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        # Additive float mask (-inf above the diagonal). Passing a src_mask also keeps the layers
        # off torch's inference "fast path" in eval mode, so train and eval compute the same thing.
        # A plain attribute, not a buffer: the model has no buffers, so DDP broadcasts none.
        self._mask = torch.triu(torch.full((context, context), float("-inf")), 1)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        if t > self.context:
            raise ValueError("sequence of %d exceeds the context of %d" % (t, self.context))
        x = self.tok(idx) + self.pos.weight[:t]
        if self._mask.device != idx.device:
            self._mask = self._mask.to(idx.device)
        mask = self._mask[:t, :t]
        for blk in self.blocks:
            x = blk(x, src_mask=mask)
        return self.head(self.norm(x))


class LMTask(Task):
    """Byte-level next-token prediction on read_corpus(): the first 90 % trains (batch(rank, step)
    = batch_size random windows of context + 1 bytes, from a generator seeded by (seed, rank,
    step)); the last 10 % is held out, and evaluate() scores eval_size fixed windows spread evenly
    over it (mean cross-entropy in nats per byte)."""

    name = "lm"
    has_accuracy = False

    def __init__(self, size="full", seed=0):
        if size == "full":
            self.cfg = dict(vocab=256, d_model=256, n_layers=4, n_heads=4, d_ff=1024, context=64)
            self.batch_size = 8
            self.eval_size = 64
        elif size == "smoke":
            self.cfg = dict(vocab=256, d_model=32, n_layers=1, n_heads=2, d_ff=64, context=16)
            self.batch_size = 4
            self.eval_size = 16
        else:
            raise ValueError("size must be 'full' or 'smoke', not %r" % (size,))
        self.size = size
        self.seed = int(seed)
        # 1e-3 without warm-up learned faster over 100 steps (4 x 8 sequences) than 2e-3 or 3e-3
        # with a 5-10 step linear warm-up.
        self.lr = 1e-3
        self.weight_decay = 0.01
        self._data = None
        c = self.cfg
        self.title = ("Transformer byte-level LM, %d layer%s, d_model %d, %d heads, context %d "
                      "(%s parameters), %s" % (
                          c["n_layers"], "" if c["n_layers"] == 1 else "s", c["d_model"],
                          c["n_heads"], c["context"], _fmt_params(self.parameters()), CORPUS_DIR))

    def _make_data(self):
        if self._data is not None:
            return self._data
        raw = read_corpus()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        n_train = int(len(data) * 0.9)
        train, ev = data[:n_train], data[n_train:]
        span = self.cfg["context"] + 1
        # Fixed evaluation windows spread evenly over the held-out 10 %.
        n = self.eval_size
        starts = torch.linspace(0, len(ev) - span, n).long()
        ev_windows = torch.stack([ev[s:s + span] for s in starts.tolist()])
        self._data = (train, ev_windows)
        return self._data

    def model(self):
        return CausalLM(**self.cfg)

    def parameters(self):
        c = self.cfg
        v, d, f, l, t = c["vocab"], c["d_model"], c["d_ff"], c["n_layers"], c["context"]
        per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        return v * d + t * d + l * per_layer + 2 * d + (d * v + v)

    def batch(self, rank, step):
        train, _ = self._make_data()
        span = self.cfg["context"] + 1
        g = _generator(self.seed, _SALT_BATCH, rank, step)
        starts = torch.randint(0, len(train) - span + 1, (self.batch_size,), generator=g)
        w = torch.stack([train[s:s + span] for s in starts.tolist()])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def loss(self, model, inputs, targets):
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, model):
        _, ev = self._make_data()
        model = _unwrap(model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                loss = self.loss(model, ev[:, :-1], ev[:, 1:]).item()
        finally:
            model.train(was_training)
        return {"loss": loss, "accuracy": None}

    def optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.95),
                                 weight_decay=self.weight_decay)


TASKS = {"mlp": MLPTask, "lm": LMTask}


def make_task(name: str, size: str = "full", seed: int = 0) -> Task:
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError("unknown task %r (known: %s)" % (name, ", ".join(sorted(TASKS)))) from None
    return cls(size=size, seed=seed)
