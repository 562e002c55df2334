"""The soak's synthetic model: its tensors, the sidecar configuration that gives each its codec,
the trainers' inputs and the check of every result.

Shared by soak.py (which writes the configuration) and trainer.py (which sends the inputs and
checks the replies), so both always agree.

Inputs are chosen so that the expected mean is known without the other trainers' data and, for
the exactly-summable codecs (``none``, ``fp16``), computable bit for bit: every trainer of the
job sends ``a * base + b`` where ``base`` is one fixed array of small integers per tensor (the
same in every process) and ``a`` in 1..3, ``b`` in -1..1 depend only on (global trainer, step,
tensor). Every partial sum is then a small integer, exact in float32 and float16 whatever the
order in which the sidecars add them, so the mean is ``float32(A * base + B) * float32(1/N)``
(A, B the sums of a and b over the N = sidecars x local trainers contributions), which is what
the sidecar computes (sum, then the weight 1/N).
"""

import numpy as np

# (name, elements, dtype, codec rule or None for the default codec `none`, exact check)
# Sizes 4 KiB .. 4 MiB; names are matched by the rules' patterns below.
TENSORS = (
    ("enc.embedding.weight", 1 << 20, "float32", {"codec": "dgc", "density": 0.01, "momentum": 0.9}),
    ("enc.layer0.weight", 1 << 18, "float32", {"codec": "topk", "density": 0.01}),
    ("enc.layer1.weight", 1 << 16, "float32", {"codec": "qsgd", "bits": 8}),
    ("enc.layer1.bias", 1 << 10, "float32", None),
    ("dec.proj.weight", 1 << 19, "float16", {"codec": "fp16"}),
    ("dec.proj.bias", 1 << 11, "float16", None),
    ("dec.out.weight", 1 << 18, "float32", {"codec": "fp16"}),
    ("dec.head.weight", 1 << 17, "float32", None),
)

EXACT_CODECS = ("none", "fp16")  # integer partial sums stay exact through these codecs
CHUNK_ELEMENTS = 1 << 18         # several chunks for the larger tensors (ring owners differ)


def codec_of(spec):
    rule = spec[3]
    return rule["codec"] if rule else "none"


def config_yaml():
    """The sidecars' YAML configuration: default codec `none`, one rule per compressed tensor
    (fnmatch pattern = its exact name)."""
    lines = ["compression:", "  chunk_elements: %d" % CHUNK_ELEMENTS, "  default:", "    codec: none",
             "  rules:"]
    for name, _, _, rule in TENSORS:
        if not rule:
            continue
        lines.append('    - pattern: "%s"' % name)
        for k, v in rule.items():
            lines.append("      %s: %s" % (k, v))
    return "\n".join(lines) + "\n"


def nbytes(spec):
    return spec[1] * np.dtype(spec[2]).itemsize


def bases():
    """{name: float32 array of integers in -4..4}, the same in every process."""
    out = {}
    for i, (name, n, _, _) in enumerate(TENSORS):
        rng = np.random.default_rng([20261130, i])
        out[name] = rng.integers(-4, 5, size=n).astype(np.float32)
    return out


def coefficients(g, step, idx):
    """(a, b) of global trainer `g` at `step` for tensor number `idx`: a in 1..3, b in -1..1."""
    h = (g * 7919 + step * 104729 + idx * 31337) & 0x7FFFFFFF
    h = (h * 2654435761) & 0xFFFFFFFF
    return 1 + (h >> 7) % 3, (h >> 13) % 3 - 1


def input_into(out, base, a, b):
    """out[:] = a * base + b, in out's dtype (float32 or float16 view)."""
    np.multiply(base, np.float32(a), out=out, casting="unsafe")
    out += out.dtype.type(b)


class CheckFailed(Exception):
    """A reply with a wrong result."""


def check(spec, idx, step, total, got, base):
    """Checks the result `got` (array of the tensor's dtype) of `step` of tensor `idx`, sent by
    `total` trainers in all. Raises CheckFailed. Returns "exact" or "finite" (the check done)."""
    name, n, dtype = spec[0], spec[1], spec[2]
    if got.dtype != np.dtype(dtype) or got.size != n:
        raise CheckFailed("%s step %d: got %s[%d], want %s[%d]" % (name, step, got.dtype, got.size, dtype, n))
    if codec_of(spec) not in EXACT_CODECS:
        if not np.isfinite(got).all():
            raise CheckFailed("%s step %d: %d non-finite values in the result"
                              % (name, step, int((~np.isfinite(got)).sum())))
        return "finite"
    A = B = 0
    for g in range(total):
        a, b = coefficients(g, step, idx)
        A += a
        B += b
    want = ((base * np.float32(A) + np.float32(B)) * np.float32(1.0 / total)).astype(dtype)
    if not np.array_equal(got, want):
        bad = np.nonzero(got != want)[0]
        i = int(bad[0])
        raise CheckFailed("%s step %d: %d of %d elements differ from the exact mean; first at %d: got %r, want %r"
                          % (name, step, len(bad), n, i, float(got[i]), float(want[i])))
    return "exact"
