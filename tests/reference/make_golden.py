#!/usr/bin/env python3
"""Generates the golden payload files of tests/kernels/golden/ with the reference lwref.py.

    ${PYTHON:-/usr/bin/python3} tests/reference/make_golden.py           # (re)write the files
    ${PYTHON:-/usr/bin/python3} tests/reference/make_golden.py --check   # compare, exit 1 on diff

Layout of tests/kernels/golden/:
  manifest.json                 every case: codec config, tensor, chunking, steps
  <case>/s<j>.in                step j's input, raw little-endian (fp32: 4 bytes, fp16/bf16: the
                                2-byte bit pattern); a step may name another step's input file
  <case>/s<j>.payload           the step's payloads, chunk after chunk (sizes in the manifest)
  <case>/s<j>.decoded           decoded result (weight applied, into a zeroed fp32 output):
                                "dense": n x fp32; "sparse": (u32 index, u32 fp32 bits) pairs, in
                                index order, for every element whose bits are not 0x00000000 (all
                                others are +0.0); whichever is smaller

Summable codecs may carry, per step, "add": a second rank's input (<case>/s<j>.other.in, encoded
with its own state and rank), its payloads (s<j>.other.payload) and the compressed-domain sums of
the two (s<j>.sum.payload, addPayloads(this, other) chunk by chunk).

Multi-round cases (PowerSGD; the case has "world" and "shape") hold per step one input per rank
(s<j>.r<rank>.in), every rank's payload of every round (s<j>.r<rank>.round<q>.payload), the
reduced payload of every round (s<j>.round<q>.reduced: the rank payloads added in rank order,
((p0 + p1) + p2) ...) and the decoded result (s<j>.decoded, dense, the same on every rank); every
rank finishes its step from the reduced payloads before the next step (tests/kernels/multirank.h).

Global-selection cases (the sparse allreduce, docs/determinism.md "4.6b Global selection"; the
case has "global_world") hold per step one input per rank (s<j>.r<rank>.in), every rank's
payloads encoded with the effect of sending deferred (s<j>.r<rank>.payload, chunk after chunk),
each chunk's global selection (s<j>.selected, chunk after chunk: the owner's sums of the ranks'
payloads in rank order, its share of k by key) and the selections decoded with the step's weight
(s<j>.decoded, dense); every rank then settles its state with its own payloads and the
selections before the next step.

Doubles of the codec config and the fp32 weights are written as decimal strings (Python repr,
shortest round-trip) so that a correctly rounded strtod reproduces them exactly.

Inputs are made here from fixed numpy default_rng seeds; the C++ test never needs the generator.
"""

import argparse
import filecmp
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lwref  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.normpath(os.path.join(HERE, "..", "kernels", "golden"))

F32 = np.float32


# ------------------------------------------------------------------------------------------------
# Input helpers
# ------------------------------------------------------------------------------------------------
def f32_bits(*bits):
    return lwref.f32_from_bits(np.array(bits, dtype=np.uint32)).copy()


def f32_vals(*vals):
    return np.array(vals, dtype=np.float32)


def gaussian(seed, n, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * scale).astype(np.float32)


def to_f16_bits(a):
    return lwref.f32_to_f16_array(np.asarray(a, dtype=np.float32))


def to_bf16_bits(a):
    return lwref.f32_to_bf16_array(np.asarray(a, dtype=np.float32))


def fp32_edges():
    """fp32 values at the edges of the fp16 and bf16 conversions."""
    b = [
        0x00000000, 0x80000000,              # +-0
        0x00000001, 0x80000001,              # fp32 min subnormal
        0x007FFFFF, 0x00400000,              # fp32 max subnormal, a mid subnormal
        0x00008000, 0x00018000, 0x00028000,  # bf16 ties inside fp32 subnormals (even/odd)
        0x00800000,                          # fp32 min normal
        0x33800000, 0xB3800000,              # fp16 min subnormal 2^-24
        0x33000000,                          # 2^-25: tie between 0 and 2^-24 -> 0
        0x33000001,                          # just above that tie -> 2^-24
        0x33C00000,                          # 1.5 * 2^-24: tie -> 2 * 2^-24 (even)
        0x34200000,                          # 2.5 * 2^-24: tie -> 2 * 2^-24 (even)
        0x387FC000,                          # fp16 max subnormal 1023 * 2^-24
        0x387FE000,                          # 1023.5 * 2^-24: tie -> 2^-14 (min normal)
        0x38800000,                          # 2^-14
        0x3F800000, 0xBF800000,              # +-1
        0x3F801000,                          # 1 + 2^-11: fp16 tie -> 1
        0x3F803000,                          # 1 + 3 * 2^-11: fp16 tie -> 1 + 2^-9
        0x3F801001,                          # just above the fp16 tie
        0x3F808000,                          # 1 + 2^-8: bf16 tie -> 1
        0x3F818000,                          # 1 + 3 * 2^-8: bf16 tie -> up
        0x3F817FFF,                          # just below a bf16 tie
        0x477FE000, 0xC77FE000,              # +-65504 (fp16 max)
        0x477FEFFF,                          # 65519.996 -> 65504
        0x477FF000, 0xC77FF000,              # +-65520 -> +-Inf
        0x47800000,                          # 65536
        0x501502F9,                          # 1e10
        0x7F7F7FFF,                          # below the top bf16 tie -> 0x7F7F
        0x7F7F8000,                          # bf16 tie at the top -> Inf
        0x7F7FFFFF, 0xFF7FFFFF,              # +-fp32 max
        0x7F800000, 0xFF800000,              # +-Inf
        0x7FC00000,                          # default quiet NaN
        0x7FC12345,                          # quiet NaN with payload
        0xFFD55555,                          # negative NaN with payload
        0x7F800001,                          # signalling NaN, payload only in low bits
        0x7FA00000,                          # signalling NaN, payload in top bits
        0x7F802000,                          # signalling NaN, payload bit 13
        0x40490FDB, 0xC02DF854, 0x3DCCCCCD,  # pi, -e, 0.1
    ]
    return f32_bits(*b)


def fp16_edges():
    return np.array([
        0x0000, 0x8000, 0x0001, 0x8001, 0x0200, 0x03FF, 0x0400, 0x8400, 0x3C00, 0x3C01, 0xBC03,
        0x3555, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
        0x7C01,                      # signalling NaN
        0x7D23,                      # signalling NaN with payload
        0x7E00, 0x7E55, 0xFE01, 0xFFFF,  # quiet NaNs
        0x4248, 0xC000, 0x1400, 0x0155,
    ], dtype=np.uint16)


def bf16_edges():
    return np.array([
        0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x3F81,
        0x3380,                      # 2^-24 -> fp16 0x0001
        0x3300,                      # 2^-25 -> fp16 tie -> 0
        0x3340,                      # 1.5 * 2^-25 -> fp16 2^-24
        0x33C0,                      # 1.5 * 2^-24: fp16 tie -> 2 * 2^-24
        0x3880, 0x477F, 0x4780, 0xC780, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
        0x7F81,                      # signalling NaN
        0x7FC1, 0xFFC0, 0xFFFF,      # quiet NaNs
        0x4049, 0x3DCD,
    ], dtype=np.uint16)


def mixed_f32(seed, n):
    """Random values over many binades, including fp16-subnormal and overflow ranges."""
    rng = np.random.default_rng(seed)
    mant = rng.uniform(1.0, 2.0, n)
    exps = rng.integers(-30, 18, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (sign * mant * np.exp2(exps)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Case definitions
# ------------------------------------------------------------------------------------------------
def cfg(name, **kw):
    c = {
        "name": name, "density": None, "ratio": None, "bits": 8, "bucket_size": 512,
        "momentum": 0.0, "clip_norm": 0.0, "sample_fraction": 0.01, "sparse_values": "fp32",
        "error_feedback": None, "threshold": None, "approx_rank": 1, "bias_correction": False,
    }
    for k, v in kw.items():
        assert k in c, k
        c[k] = v
    return c


class Step:
    def __init__(self, data, step, weight=1.0, density=None, input_of=None, input_case=None,
                 other=None):
        self.other = other          # summable codecs: another rank's input, added to this one
        self.data = data            # float32 array (fp32) or uint16 bit array (fp16/bf16)
        self.step = step
        self.weight = F32(weight)
        self.density = density
        self.input_of = input_of    # reuse the input file of this earlier step index
        self.input_case = input_case  # ... of that earlier case (default: this case)


def case(name, config, dtype, steps, tensor="layer.0.weight", seed=0, rank=0, chunk=0, note="",
         other_rank=None):
    n = len(steps[0].data)
    for s in steps:
        assert len(s.data) == n
        assert s.data.dtype == (np.float32 if dtype == "fp32" else np.uint16)
    if other_rank is not None:
        assert all(s.other is not None and len(s.other) == n for s in steps)
    return dict(name=name, config=config, dtype=dtype, steps=steps, tensor=tensor, seed=seed,
                rank=rank, chunk=chunk, n=n, note=note, other_rank=other_rank)


def tied_pm(seed, n, mags):
    rng = np.random.default_rng(seed)
    v = rng.choice(np.array(mags, dtype=np.float32), n)
    return np.where(rng.random(n) < 0.5, -v, v).astype(np.float32)


def cases(log):
    C = []
    # --- none ---------------------------------------------------------------------------------
    C.append(case("none_f32_edges", cfg("none"), "fp32", [Step(fp32_edges(), 0, 0.5)]))
    C.append(case("none_f16_edges", cfg("none"), "fp16", [Step(fp16_edges(), 3, 1.0)]))
    C.append(case("none_f32_2049_chunked", cfg("none"), "fp32",
                  [Step(gaussian(11, 2049), 0, 0.3)],
                  chunk=1000))
    C.append(case("none_f32_n0", cfg("none"), "fp32", [Step(f32_vals(), 0, 1.0)]))
    C.append(case("none_ef", cfg("none", error_feedback=True), "fp32",
                  [Step(gaussian(13, 50), 0), Step(gaussian(14, 50), 1, 0.5)], chunk=20))
    # --- fp16 ---------------------------------------------------------------------------------
    C.append(case("fp16_f32_edges", cfg("fp16"), "fp32", [Step(fp32_edges(), 0, 1.0)]))
    C.append(case("fp16_f16_edges", cfg("fp16"), "fp16", [Step(fp16_edges(), 0, 0.5)]))
    C.append(case("fp16_bf16_edges", cfg("fp16"), "bf16", [Step(bf16_edges(), 0, 1.0)]))
    C.append(case("fp16_f32_n0", cfg("fp16"), "fp32", [Step(f32_vals(), 0, 1.0)]))
    C.append(case("fp16_f32_n1", cfg("fp16"), "fp32", [Step(f32_vals(-1.0009765625), 0, 1.0)]))
    C.append(case("fp16_f32_n7", cfg("fp16"), "fp32", [Step(mixed_f32(21, 7), 0, 0.3)]))
    C.append(case("fp16_f32_4097", cfg("fp16"), "fp32",
                  [Step(mixed_f32(22, 4097), 0, 0.25)],
                  chunk=1024))
    C.append(case("fp16_f16_4097", cfg("fp16"), "fp16", [Step(to_f16_bits(gaussian(24, 4097)), 0)],
                  chunk=2048))
    C.append(case("fp16_ef_f32", cfg("fp16", error_feedback=True), "fp32",
                  [Step(mixed_f32(25, 999), 0, 1.0), Step(mixed_f32(26, 999), 1, 0.5),
                   Step(mixed_f32(27, 999), 2, 1.0)], chunk=400))
    C.append(case("fp16_ef_f16_edges", cfg("fp16", error_feedback=True), "fp16",
                  [Step(fp16_edges(), 0, 1.0)],
                  note="with error feedback the codec compresses a = x + e (fp32), so -0 and "
                       "signalling NaNs are not sent as is"))
    C.append(case("fp16_add_f32", cfg("fp16"), "fp32",
                  [Step(mixed_f32(28, 300), 0, 1.0, other=mixed_f32(29, 300))], chunk=128,
                  other_rank=1, note="add: fp32 sums of the widened halves, converted again "
                                     "(ties, subnormals, overflow to Inf)"))
    # --- bf16 ---------------------------------------------------------------------------------
    C.append(case("bf16_f32_edges", cfg("bf16"), "fp32", [Step(fp32_edges(), 0, 1.5)]))
    C.append(case("bf16_f16_edges", cfg("bf16"), "fp16", [Step(fp16_edges(), 0, 1.0)]))
    C.append(case("bf16_bf16_edges", cfg("bf16"), "bf16", [Step(bf16_edges(), 0, 0.5)]))
    C.append(case("bf16_f32_n0", cfg("bf16"), "fp32", [Step(f32_vals(), 0, 1.0)]))
    C.append(case("bf16_f32_n1", cfg("bf16"), "fp32", [Step(f32_bits(0x3F818000), 0, 1.0)]))
    C.append(case("bf16_f32_n7", cfg("bf16"), "fp32", [Step(mixed_f32(31, 7), 0, 1.0)]))
    C.append(case("bf16_f32_4097", cfg("bf16"), "fp32", [Step(mixed_f32(32, 4097), 0, 0.3)],
                  chunk=1000))
    C.append(case("bf16_bf16_4097", cfg("bf16"), "bf16",
                  [Step(to_bf16_bits(gaussian(33, 4097)), 0, 1.0)], chunk=4096))
    C.append(case("bf16_ef_f32", cfg("bf16", error_feedback=True), "fp32",
                  [Step(gaussian(34, 1000), 0), Step(gaussian(35, 1000), 1),
                   Step(gaussian(36, 1000), 2, 0.25)]))
    C.append(case("bf16_add_f16", cfg("bf16"), "fp16",
                  [Step(to_f16_bits(gaussian(37, 301)), 0, 1.0, other=to_f16_bits(gaussian(38, 301)))],
                  chunk=100, other_rank=1))
    # --- topk ---------------------------------------------------------------------------------
    C.append(case("topk_density_f32", cfg("topk", density=0.01), "fp32",
                  [Step(gaussian(41, 5000), 0, 1.0), Step(gaussian(42, 5000), 1, 0.5),
                   Step(gaussian(43, 5000), 2, 0.25)], tensor="encoder.attn.q_proj"))
    C.append(case("topk_ratio_f16values", cfg("topk", ratio=20.0, sparse_values="fp16"), "fp32",
                  [Step(gaussian(44, 3001, 1e-3), 0, 1.0), Step(gaussian(45, 3001, 1e-3), 1, 1.0),
                   Step(gaussian(46, 3001, 1e-3), 2, 0.3)], chunk=1000))
    C.append(case("topk_f16_input", cfg("topk", density=0.05), "fp16",
                  [Step(to_f16_bits(gaussian(47, 2000)), 0), Step(to_f16_bits(gaussian(48, 2000)), 1),
                   Step(to_f16_bits(gaussian(49, 2000)), 2, 0.5)], chunk=700))
    C.append(case("topk_bf16_input_f16values",
                  cfg("topk", density=0.02, sparse_values="fp16"), "bf16",
                  [Step(to_bf16_bits(gaussian(50, 1500, 100.0)), 7),
                   Step(to_bf16_bits(gaussian(51, 1500, 100.0)), 8)], chunk=512))
    const = np.full(100, 0.75, dtype=np.float32)
    C.append(case("topk_constant", cfg("topk", density=0.1), "fp32",
                  [Step(const, 0), Step(const, 1, input_of=0), Step(const, 2, input_of=0)],
                  chunk=16))
    C.append(case("topk_ties_signs", cfg("topk", density=0.3), "fp32",
                  [Step(tied_pm(52, 1000, [1.0, 2.0, 3.0]), 0),
                   Step(tied_pm(53, 1000, [1.0, 2.0, 3.0]), 1, 0.5),
                   Step(tied_pm(54, 1000, [0.5, 1.0]), 2)], chunk=64,
                  note="many equal magnitudes of both signs; the tie cut falls inside a chunk"))
    ties_f16 = tied_pm(55, 777, [0.1, 0.2])
    C.append(case("topk_ties_f16values", cfg("topk", ratio=3.0, sparse_values="fp16"), "fp32",
                  [Step(ties_f16, 0), Step(tied_pm(56, 777, [0.1, 0.2]), 1),
                   Step(tied_pm(57, 777, [0.3]), 2)], chunk=100))
    finite = gaussian(58, 300)
    nan_inf = gaussian(59, 300)
    nan_inf[[3, 77, 150]] = f32_bits(0x7FC12345, 0xFFC00001, 0x7FC00000)
    nan_inf[[10, 299]] = f32_vals(np.inf, -np.inf)
    nan_inf[[11, 12]] = f32_bits(0x80000000, 0x00000001)
    C.append(case("topk_nan_inf", cfg("topk", density=0.05), "fp32",
                  [Step(finite, 0), Step(nan_inf, 1, 0.5)], chunk=128,
                  note="NaN/Inf only in the last step, so no NaN residual feeds a later payload"))
    C.append(case("topk_density1", cfg("topk", density=1.0), "fp32",
                  [Step(gaussian(63, 37), 0), Step(gaussian(64, 37), 1)], chunk=10,
                  note="k = n: every gap is 0, so w = 0 and there are no gap bytes"))
    ov0 = gaussian(65, 600)
    ov0[200:400] = F32(0.0)                      # chunk 1 (200..399) selects nothing
    ov0[[50, 450]] = f32_vals(1.0e5, -70000.0)   # |v| >= 65520: the fp16 value is +-Inf
    ov0[451] = F32(65519.0)                      # rounds to 65504
    C.append(case("topk_f16values_empty_chunk_overflow",
                  cfg("topk", density=0.01, sparse_values="fp16"), "fp32",
                  [Step(ov0, 0), Step(gaussian(66, 600), 1, 0.5)], chunk=200,
                  note="fp16 values: a chunk without selected elements still has flag bit 0 set; "
                       "values beyond fp16 range go out as Inf, the residual becomes -+Inf"))
    C.append(case("topk_n0", cfg("topk", density=0.5), "fp32", [Step(f32_vals(), 0)]))
    C.append(case("topk_n1", cfg("topk", density=0.01), "fp32",
                  [Step(f32_vals(-2.5), 0), Step(f32_vals(1.0), 1)]))
    C.append(case("topk_multichunk_large", cfg("topk", density=0.002), "fp32",
                  [Step(gaussian(60, 5000), 0), Step(gaussian(61, 5000), 1),
                   Step(gaussian(62, 5000), 2)], chunk=1300, seed=7, rank=1))
    # --- dgc ----------------------------------------------------------------------------------
    C.append(case("dgc_exact_m0", cfg("dgc", density=0.01), "fp32",
                  [Step(gaussian(70, 10000), 0), Step(gaussian(71, 10000), 1, 0.5),
                   Step(gaussian(70, 10000), 2, input_of=0)], chunk=4096, tensor="fc1.weight"))
    small = gaussian(85, 1000)
    small_inf = gaussian(86, 1000)
    small_inf[[5, 900]] = f32_vals(np.inf, -np.inf)
    small_nan = gaussian(87, 1000)
    small_nan[7] = f32_bits(0x7FC0BEEF)[0]
    C.append(case("dgc_exact_clip_nonfinite", cfg("dgc", density=0.02, momentum=0.5, clip_norm=10.0),
                  "fp32", [Step(small, 0), Step(small_inf, 1, 0.5), Step(small_nan, 2)], chunk=300,
                  note="step 1: Inf makes the clipping norm Inf, so f = 0: finite values become "
                       "+-0, Inf becomes NaN (0 * Inf). Step 2: a NaN makes the norm NaN, so no "
                       "clipping. NaNs are selected first"))
    dov = gaussian(89, 500)
    dov[[10, 20]] = f32_vals(8.0e4, -1.0e6)
    C.append(case("dgc_exact_f16values_overflow",
                  cfg("dgc", density=0.01, momentum=0.5, sparse_values="fp16"), "fp32",
                  [Step(dov, 0), Step(gaussian(90, 500), 1)], chunk=128,
                  note="v' beyond fp16 range: the value sent is Inf and masking leaves v' - Inf"))
    C.append(case("dgc_exact_m09_clip_f16values",
                  cfg("dgc", density=0.02, momentum=0.9, clip_norm=50.0, sparse_values="fp16"),
                  "fp16",
                  [Step(to_f16_bits(gaussian(73, 32768)), 0, 1.0, density=0.05),
                   Step(to_f16_bits(gaussian(73, 32768)), 1, 0.5, input_of=0),
                   Step(to_f16_bits(gaussian(73, 32768)), 2, 1.0, density=0.01, input_of=0)],
                  chunk=10000, seed=3))
    C.append(case("dgc_sample_40000_m0", cfg("dgc", density=0.01), "fp16",
                  [Step(to_f16_bits(gaussian(76, 40000)), 0),
                   Step(to_f16_bits(gaussian(76, 40000)), 1, 0.5, input_of=0),
                   Step(to_f16_bits(gaussian(76, 40000)), 2, input_of=0)],
                  chunk=16384, tensor="decoder.layers.3.mlp.w2", seed=11, rank=2))
    C.append(case("dgc_sample_40000_m09_override",
                  cfg("dgc", ratio=50.0, momentum=0.9, sample_fraction=0.001), "fp16",
                  [Step(to_f16_bits(gaussian(79, 40000)), 4294967301, 1.0, density=0.05),
                   Step(to_f16_bits(gaussian(79, 40000)), 4294967302, 1.0, input_of=0),
                   Step(to_f16_bits(gaussian(79, 40000)), 4294967303, 0.3, density=0.004,
                        input_of=0)],
                  tensor="emb/wé", seed=0xDEADBEEF, rank=3, chunk=0))
    C.append(case("dgc_sample_100000_m09_clip_f16values",
                  cfg("dgc", density=0.01, momentum=0.9, clip_norm=100.0, sparse_values="fp16"),
                  "fp16",
                  [Step(to_f16_bits(gaussian(82, 100000)), 0),
                   Step(to_f16_bits(gaussian(82, 100000)), 1, 0.5, input_of=0),
                   Step(to_f16_bits(gaussian(82, 100000)), 2, input_of=0)],
                  chunk=25000, tensor="lm_head.weight", seed=5, rank=1))
    nf = to_f16_bits(gaussian(86, 110000))
    nf[[10, 50000, 109999]] = np.array([0x7E01, 0xFC00, 0x7C00], dtype=np.uint16)  # NaN, -Inf, Inf
    C.append(case("dgc_sample_110000_M1045_nonfinite",
                  cfg("dgc", density=0.005, momentum=0.9, sample_fraction=0.0095), "fp16",
                  [Step(nf, 0), Step(nf, 1, 0.5, input_of=0)], chunk=30000, rank=5,
                  tensor="transformer.wte", seed=77,
                  note="M = ceil(0.0095 * 110000) = 1045 > 1024; NaN/Inf selected first"))
    rng = np.random.default_rng(87)
    sp = np.zeros(40000, dtype=np.float32)
    sp[rng.choice(40000, 300, replace=False)] = gaussian(88, 300)
    C.append(case("dgc_sample_40000_sparse_grad", cfg("dgc", density=0.01), "bf16",
                  [Step(to_bf16_bits(sp), 0), Step(to_bf16_bits(sp), 1, input_of=0)],
                  chunk=8192, tensor="embedding.weight", seed=4, rank=1,
                  note="300 non-zeros, k = 400: most sampled keys are 0"))
    cst = to_bf16_bits(np.full(40000, -0.5, dtype=np.float32))
    C.append(case("dgc_constant_40000", cfg("dgc", density=0.01, momentum=0.9), "bf16",
                  [Step(cst, 0), Step(cst, 1, input_of=0), Step(cst, 2, input_of=0)],
                  chunk=12000, seed=1, rank=0))
    # dgc's bias correction (momentum 0.9): c' = 0.9 c + 1 and v' = v + u' / (c' * 0.1); the
    # same inputs again, so elements sent at one step are sent again with a restarted c.
    bc = [gaussian(91 + (j % 2), 3000) for j in range(4)]
    C.append(case("dgc_exact_m09_biascorr",
                  cfg("dgc", density=0.02, momentum=0.9, bias_correction=True), "fp32",
                  [Step(bc[j], j) for j in range(4)], chunk=1000, tensor="fc2.weight", seed=9))
    C.append(case("dgc_sample_40000_m09_biascorr_clip_f16values",
                  cfg("dgc", density=0.01, momentum=0.9, clip_norm=100.0, sparse_values="fp16",
                      bias_correction=True), "fp16",
                  [Step(to_f16_bits(gaussian(93, 40000)), 0),
                   Step(to_f16_bits(gaussian(93, 40000)), 1, 0.5, input_of=0),
                   Step(to_f16_bits(gaussian(93, 40000)), 2, input_of=0)],
                  chunk=16384, tensor="blocks.0.attn.qkv.weight", seed=6, rank=2))
    # --- qsgd ---------------------------------------------------------------------------------
    C.append(case("qsgd_b8_d512_ef", cfg("qsgd", bits=8, bucket_size=512, error_feedback=True),
                  "fp32", [Step(qsgd_input(90, 3500, zero_bucket=(1024, 512)), 0),
                           Step(qsgd_input(91, 3500, zero_bucket=(1024, 512)), 1, 0.5),
                           Step(qsgd_input(92, 3500), 2)],
                  chunk=1500, rank=0, seed=9))
    C.append(case("qsgd_b4_d100_rank3_nonfinite", cfg("qsgd", bits=4, bucket_size=100), "fp32",
                  [Step(qsgd_nonfinite(93, 1234), 0), Step(qsgd_nonfinite(94, 1234), 1, 0.25)],
                  chunk=250, rank=3, seed=42, tensor="blocks.7.ffn.bias",
                  note="chunks of 300: chunk 0 Inf, chunk 1 NaN, chunk 2 fp32-overflowing norm, "
                       "chunk 3 an all-zero bucket"))
    C.append(case("qsgd_b2_d100_f16_ef", cfg("qsgd", bits=2, bucket_size=100, error_feedback=True),
                  "fp16",
                  [Step(to_f16_bits(gaussian(95, 1050)), 0), Step(to_f16_bits(gaussian(96, 1050)), 1),
                   Step(to_f16_bits(qsgd_last_nan(97, 1050)), 2, 0.5)],
                  chunk=300, rank=3, seed=2))
    C.append(case("qsgd_b8_d100_single_chunk", cfg("qsgd", bits=8, bucket_size=100), "fp32",
                  [Step(qsgd_input(98, 1001, zero_bucket=(500, 100)), 12345, 0.3)],
                  rank=0, seed=0))
    C.append(case("qsgd_b4_d512_bf16", cfg("qsgd", bits=4, bucket_size=512), "bf16",
                  [Step(to_bf16_bits(gaussian(99, 3000, 0.01)), 0),
                   Step(to_bf16_bits(gaussian(100, 3000, 0.01)), 1)],
                  chunk=1024, rank=3, seed=1))
    C.append(case("qsgd_b3_d7", cfg("qsgd", bits=3, bucket_size=7), "fp32",
                  [Step(gaussian(101, 50), 0)], chunk=20, rank=0))
    # --- reduction order probes (see qsgd_order_probe / dgc_clip_probe) -------------------------
    qx, _ = qsgd_order_probe(4099, 4, 60, 8198, log)
    C.append(case("qsgd_b8_d4099_reduction_order", cfg("qsgd", bits=8, bucket_size=4099), "fp32",
                  [Step(qx, 0)], chunk=8198, rank=0, seed=0, tensor="probe",
                  note="bucket norms next to fp32 rounding flips: only the canonical order of "
                       "determinism §2 (blocks of 4096 and 8 accumulators relative to the "
                       "bucket) reproduces them"))
    dx, clip_a, clip_b, _ = dgc_clip_probe(12300, 3000, log)
    C.append(case("dgc_clip_reduction_order_a", cfg("dgc", density=0.01, clip_norm=clip_a), "fp32",
                  [Step(dx, 0)], chunk=3000, tensor="probe",
                  note="clip_norm / N lies just above an fp32 rounding boundary"))
    C.append(case("dgc_clip_reduction_order_b", cfg("dgc", density=0.01, clip_norm=clip_b), "fp32",
                  [Step(dx, 0, input_of=0, input_case="dgc_clip_reduction_order_a")], chunk=3000,
                  tensor="probe", note="clip_norm / N lies just below an fp32 rounding boundary"))
    C.extend(cases_later_codecs(log))
    C.extend(global_cases())
    return C


def global_cases():
    """The sparse allreduce's owner frames (determinism §4.6b), W = 2, 3, 4; topk, dgc (exact
    and sampled selections), threshold."""
    def ranks(seed, w, n, scale=1.0):
        return [gaussian(seed + 17 * r, n, scale * (1 + r)) for r in range(w)]
    C = []
    # topk with error feedback, 3 ranks, 3 chunks, 3 steps: the residual of what the selection
    # dropped reaches the next steps' payloads.
    C.append(gs_case("global_topk_ef_w3", cfg("topk", density=0.02), 1000,
                     [GSStep(ranks(900 + j, 3, 3000), j) for j in range(3)]))
    # dgc with momentum correction and fp16 values, 4 ranks: one rank sends nothing in step 1,
    # every large value of step 2 lies in one owner's region, and step 3 has ties of magnitude
    # across ranks and within chunks.
    n = 4096
    quiet = ranks(920, 4, n)
    quiet[2] = np.zeros(n, dtype=np.float32)
    region = ranks(930, 4, n, 1e-3)
    for r in range(4):
        region[r][1024:2048] = gaussian(940 + r, 1024, 10.0)
    ties = [np.where(np.arange(n) % 3 == r % 3, F32(2.0), F32(-2.0)).astype(np.float32)
            for r in range(4)]
    C.append(gs_case("global_dgc_m09_f16_w4", cfg("dgc", density=0.05, momentum=0.9,
                                                  sparse_values="fp16"), 1024,
                     [GSStep(quiet, 1), GSStep(region, 2), GSStep(ties, 3)]))
    # dgc without momentum, 2 ranks, a non-finite value: it is selected (largest key) and reaches
    # the result.
    nf = ranks(950, 2, 2500)
    nf[1][1234] = F32(np.inf)
    C.append(gs_case("global_dgc_m0_nonfinite_w2", cfg("dgc", density=0.01), 800,
                     [GSStep(ranks(960, 2, 2500), 0), GSStep(nf, 1)]))
    # dgc's sampled selection (over 32 Ki elements), 3 ranks, 4 chunks: in step 0 the ranks send
    # 330, 426 and 394 entries for k = 330, so the shares are cut to add up to k (their mean
    # count would give 383); in step 1, residuals carried, 309, 295 and 389.
    C.append(gs_case("global_dgc_sampled_cap_w3", cfg("dgc", density=0.01), 8250,
                     [GSStep(ranks(981, 3, 33000), 0), GSStep(ranks(980, 3, 33000), 1)]))
    # dgc with bias correction, 3 ranks: what the global selection drops keeps its c' (and u'),
    # what it keeps restarts them at 0.
    C.append(gs_case("global_dgc_m09_biascorr_w3", cfg("dgc", density=0.05, momentum=0.9,
                                                       bias_correction=True), 1000,
                     [GSStep(ranks(990 + j, 3, 3000), j) for j in range(3)]))
    # threshold with error feedback, 3 ranks: the owner keeps the sums whose mean reaches tau
    # (|sum| >= fl32(3 tau)), however many; what a rank sent and that drops stays in its
    # residual, which grows until the next steps send it.
    C.append(gs_case("global_threshold_ef_w3", cfg("threshold", threshold=2.0), 1000,
                     [GSStep(ranks(970 + j, 3, 3000), j) for j in range(3)]))
    return C


class GSStep:
    """One step of a global-selection case: one fp32 input per rank."""

    def __init__(self, inputs, step):
        self.inputs = inputs
        self.step = step


def gs_case(name, config, chunk, steps, tensor="layer.0.weight", seed=0, note=""):
    world = len(steps[0].inputs)
    n = len(steps[0].inputs[0])
    return dict(name=name, config=config, dtype="fp32", steps=steps, tensor=tensor, seed=seed,
                n=n, note=note, world=world, chunk=chunk, global_selection=True)


def put_file(outdir, written, name, data):
    """Writes one golden file (its path relative to outdir) and remembers its bytes."""
    with open(os.path.join(outdir, name), "wb") as fh:
        fh.write(data)
    written[name] = data


def _opt_repr(v):
    return None if v is None else repr(float(v))


def config_json(config):
    """A case's codec configuration as the manifest holds it (doubles as decimal strings)."""
    cj = {
        "name": config["name"],
        "density": _opt_repr(config["density"]),
        "ratio": _opt_repr(config["ratio"]),
        "bits": config["bits"],
        "bucket_size": config["bucket_size"],
        "momentum": repr(float(config["momentum"])),
        "clip_norm": repr(float(config["clip_norm"])),
        "sample_fraction": repr(float(config["sample_fraction"])),
        "sparse_values": config["sparse_values"],
        "error_feedback": config["error_feedback"],
        "threshold": _opt_repr(config["threshold"]),
        "approx_rank": config["approx_rank"],
    }
    if config["bias_correction"]:
        cj["bias_correction"] = True
    return cj


def with_note(cj, c):
    if c["note"]:
        cj["note"] = c["note"]
    return cj


def run_gs_case(c, outdir, log, written):
    """W ranks: each encodes with the effect of sending deferred; each chunk's owner sums the
    ranks' payloads in rank order and keeps its share of k by the entries the ranks sent for it,
    or (threshold) the sums of at least its floor (lwref.global_selection); the
    selections are decoded with weight 1/W; every rank settles its state."""
    config, n, world = c["config"], c["n"], c["world"]
    chunking = lwref.chunk_ranges(n, c["chunk"], lwref.codec_alignment(config))
    cid = lwref.CODEC_ID[config["name"]]
    codecs = [lwref.Codec(config, n) for _ in range(world)]
    weight = F32(1.0) / F32(world)
    os.makedirs(os.path.join(outdir, c["name"]), exist_ok=True)

    def put(nm, data):
        put_file(outdir, written, nm, data)

    steps_json = []
    for j, st in enumerate(c["steps"]):
        in_names, sent_names, sent_sizes, sent = [], [], [], []
        for rk, x in enumerate(st.inputs):
            nm = "%s/s%d.r%d.in" % (c["name"], j, rk)
            put(nm, raw_bytes(x, "fp32"))
            in_names.append(nm)
            payloads, info = codecs[rk].step(x, "fp32", chunking, c["seed"], c["tensor"],
                                             st.step, rk, None, defer_sent=True)
            nm = "%s/s%d.r%d.payload" % (c["name"], j, rk)
            put(nm, b"".join(payloads))
            sent_names.append(nm)
            sent_sizes.append([len(p) for p in payloads])
            sent.append(payloads)
        # threshold keeps no count (every entry of at least its floor).
        k = n if config["name"] == "threshold" else lwref.selection_size(
            n, lwref.effective_density(config, None))
        floor = lwref.global_min_key(config, world)
        entries = [lwref.layer_entries(sent[rk], cid, chunking) for rk in range(world)]
        selected = [lwref.global_selection(cid, [sent[rk][ci] for rk in range(world)], m, floor,
                                           k, entries)
                    for ci, (b, m) in enumerate(chunking)]
        sel_name = "%s/s%d.selected" % (c["name"], j)
        put(sel_name, b"".join(selected))
        out = np.zeros(n, dtype=np.float32)
        for (b, m), p in zip(chunking, selected):
            lwref.decode_payload(p, cid, weight, out, b, m)
        dec_name = "%s/s%d.decoded" % (c["name"], j)
        put(dec_name, out.astype("<f4").tobytes())
        for rk in range(world):
            codecs[rk].settle(sent[rk], selected, chunking)
        nnz = sum(lwref.sparse_entries(p, cid, m)[0].size for p, (_, m) in zip(selected, chunking))
        steps_json.append({
            "step": st.step, "weight": repr(float(weight)), "density": None, "inputs": in_names,
            "sent": sent_names, "sent_sizes": sent_sizes, "selected": sel_name,
            "selected_sizes": [len(p) for p in selected], "decoded": dec_name,
            "decoded_format": "dense", "info": {"k": k, "selected": int(nnz)}})
        log("    step %d: k %d, selected %d, entries sent %s, payloads %s bytes per rank" % (
            st.step, k, nnz, entries, [sum(sz) for sz in sent_sizes]))
    return with_note({
        "name": c["name"], "config": config_json(config),
        "tensor_name": c["tensor"], "seed": c["seed"], "rank": 0, "dtype": "fp32",
        "elements": n, "chunk_elements": c["chunk"], "chunk_sizes": [m for _, m in chunking],
        "global_world": world, "steps": steps_json,
    }, c)


def with_nonfinite(x, at):
    """x with qNaN (payload), +Inf, -Inf at the three indices of `at`."""
    y = x.copy()
    y[at[0]] = f32_bits(0x7FC12345)[0]
    y[at[1]] = F32(np.inf)
    y[at[2]] = F32(-np.inf)
    return y


def bucket_edges(seed, n):
    """Gaussian values with an all-zero bucket (+-0), an all-positive and an all-negative run,
    exact ties of the maximum magnitude and some subnormals."""
    x = gaussian(seed, n)
    x[14:21] = F32(0.0)
    x[16] = F32(-0.0)
    x[21:28] = np.abs(x[21:28])
    x[28:35] = -np.abs(x[28:35])
    x[35:42] = f32_vals(2.0, -2.0, 2.0, 0.5, -0.25, 1e-40, -1e-45)
    return x


def cases_later_codecs(log):
    """randomk, threshold, terngrad, signsgd, onebit and powersgd (two ranks, two rounds)."""
    C = []
    # --- randomk ------------------------------------------------------------------------------
    C.append(case("randomk_density_f32", cfg("randomk", density=0.05), "fp32",
                  [Step(gaussian(200, 3001), 0, 1.0), Step(gaussian(201, 3001), 1, 0.5),
                   Step(gaussian(202, 3001), 4294967301, 0.25, density=0.2)],
                  chunk=1000, tensor="encoder.attn.k_proj", seed=5, rank=0,
                  note="step 4294967301: the payload's step field is its low 32 bits (5)"))
    rk = gaussian(203, 1999, 3000.0)
    C.append(case("randomk_ratio_f16values_f16", cfg("randomk", ratio=20.0, sparse_values="fp16"),
                  "fp16", [Step(to_f16_bits(rk), 3), Step(to_f16_bits(gaussian(204, 1999)), 4, 0.3)],
                  chunk=700, seed=1, rank=3,
                  note="values x * s beyond 65504 are sent as +-65504 (saturating)"))
    C.append(case("randomk_bf16_ef", cfg("randomk", density=0.1, error_feedback=True), "bf16",
                  [Step(to_bf16_bits(gaussian(205, 777)), 0),
                   Step(to_bf16_bits(gaussian(206, 777)), 1),
                   Step(to_bf16_bits(gaussian(207, 777)), 2, 0.5)], chunk=100, rank=3))
    C.append(case("randomk_density1", cfg("randomk", density=1.0), "fp32",
                  [Step(gaussian(209, 37), 0)], chunk=10,
                  note="k = n: t = 2^32, every element selected, s = 1"))
    big = gaussian(210, 1000)
    big[[5, 6, 7, 8]] = f32_vals(3.0e38, -3.0e38, 1.0e30, -1.0)
    C.append(case("randomk_overflow_nonfinite", cfg("randomk", density=0.5), "fp32",
                  [Step(with_nonfinite(big, [100, 200, 300]), 0, 1.0),
                   Step(with_nonfinite(big, [0, 1, 2]), 1, 1.0)],
                  chunk=256, seed=9,
                  note="x * s overflows to Inf for +-3e38; NaN and Inf propagate (qNaN payload "
                       "kept by x86)"))
    C.append(case("randomk_n0", cfg("randomk", density=0.5), "fp32", [Step(f32_vals(), 0)]))
    C.append(case("randomk_n1", cfg("randomk", density=0.01), "fp32",
                  [Step(f32_vals(-2.5), 0), Step(f32_vals(1.0), 1)],
                  note="n = 1: k = 1, t = 2^32 (always selected)"))
    C.append(case("randomk_sparse_t", cfg("randomk", density=0.001), "fp32",
                  [Step(gaussian(211, 5003), 7)], chunk=1024, seed=3, tensor="emb/wé"))
    C.append(case("randomk_add_f32", cfg("randomk", density=0.1), "fp32",
                  [Step(gaussian(212, 1500), 0, 1.0, other=gaussian(213, 1500)),
                   Step(gaussian(214, 1500), 1, 0.5, other=gaussian(215, 1500))],
                  chunk=600, rank=0, other_rank=3,
                  note="add: rank 3's payloads (same indices) added to rank 0's"))
    ov = gaussian(216, 900, 3000.0)
    C.append(case("randomk_add_f16values", cfg("randomk", ratio=8.0, sparse_values="fp16"),
                  "fp32", [Step(ov, 2, 1.0, other=gaussian(217, 900, 3000.0))],
                  chunk=0, rank=1, other_rank=2,
                  note="fp16 value sums saturate at +-65504"))
    # --- threshold ----------------------------------------------------------------------------
    tx = gaussian(220, 2000)
    tx[[3, 4, 5]] = f32_vals(1.5, -1.5, np.nextafter(F32(1.5), F32(0.0)))
    C.append(case("threshold_ef_f32", cfg("threshold", threshold=1.5), "fp32",
                  [Step(tx, 0), Step(gaussian(221, 2000), 1, 0.5), Step(gaussian(222, 2000), 2)],
                  chunk=500, note="error feedback on by default; |x| = tau is selected"))
    tt = gaussian(223, 1001, 0.1)
    tt[[0, 1, 2, 3]] = f32_vals(0.1, -0.1, np.nextafter(F32(0.1), F32(0.0)), 1.0e5)
    tt[4] = F32(-70000.0)
    C.append(case("threshold_f16values_noef", cfg("threshold", threshold=0.1, sparse_values="fp16",
                                                  error_feedback=False), "fp32",
                  [Step(tt, 0, 1.0)], chunk=333,
                  note="tau = (float)0.1; values beyond fp16 range saturate to +-65504"))
    C.append(case("threshold_f16values_ef", cfg("threshold", threshold=0.1, sparse_values="fp16"),
                  "fp32", [Step(tt, 0, 1.0, input_of=0, input_case="threshold_f16values_noef"),
                           Step(gaussian(224, 1001, 0.1), 1, 0.5)], chunk=333,
                  note="the saturation excess stays in the residual"))
    tn = fp32_edges()
    C.append(case("threshold_edges_tiny", cfg("threshold", threshold=1e-45, error_feedback=False),
                  "fp32", [Step(tn, 0, 0.5)], chunk=16,
                  note="tau = the smallest subnormal: everything but +-0 is selected, NaN/Inf too"))
    C.append(case("threshold_f16_input", cfg("threshold", threshold=2.0), "fp16",
                  [Step(to_f16_bits(gaussian(225, 1500)), 0), Step(to_f16_bits(gaussian(226, 1500)), 1)],
                  chunk=512))
    C.append(case("threshold_bf16_nonfinite_last", cfg("threshold", threshold=0.75), "bf16",
                  [Step(to_bf16_bits(gaussian(227, 300)), 0),
                   Step(to_bf16_bits(with_nonfinite(gaussian(228, 300), [10, 150, 299])), 1)],
                  chunk=128, note="NaN/Inf only in the last step"))
    C.append(case("threshold_none_selected", cfg("threshold", threshold=1e30), "fp32",
                  [Step(gaussian(229, 50), 0)], chunk=20))
    C.append(case("threshold_n0", cfg("threshold", threshold=1.0), "fp32", [Step(f32_vals(), 0)]))
    C.append(case("threshold_n1", cfg("threshold", threshold=1.0), "fp32",
                  [Step(f32_vals(-2.5), 0), Step(f32_vals(0.5), 1)]))
    # --- terngrad -----------------------------------------------------------------------------
    C.append(case("terngrad_d512_rank0", cfg("terngrad"), "fp32",
                  [Step(gaussian(230, 3000), 0), Step(gaussian(231, 3000), 1, 0.5)],
                  chunk=1024, rank=0, seed=1, tensor="blocks.0.attn.qkv"))
    C.append(case("terngrad_d100_rank3_nonfinite", cfg("terngrad", bucket_size=100), "fp32",
                  [Step(bucket_edges(232, 1234), 4, 0.25), Step(qsgd_nonfinite(233, 1234), 5)],
                  chunk=250, rank=3, seed=42,
                  note="chunks of 300: step 5 chunk 0 Inf, chunk 1 NaN (none layout), chunk 2 "
                       "+-3e38 (finite: scaler 3e38), chunk 3 an all-zero bucket"))
    C.append(case("terngrad_d7_f16_rank3", cfg("terngrad", bucket_size=7), "fp16",
                  [Step(to_f16_bits(bucket_edges(234, 50)), 0)], chunk=20, rank=3))
    C.append(case("terngrad_bf16_ef", cfg("terngrad", bucket_size=64, error_feedback=True), "bf16",
                  [Step(to_bf16_bits(gaussian(235, 333)), 0), Step(to_bf16_bits(gaussian(236, 333)), 1),
                   Step(to_bf16_bits(gaussian(237, 333)), 2)], chunk=128, rank=1))
    C.append(case("terngrad_n0", cfg("terngrad"), "fp32", [Step(f32_vals(), 0)]))
    C.append(case("terngrad_n1", cfg("terngrad"), "fp32",
                  [Step(f32_vals(-2.5), 0), Step(f32_vals(0.0), 1)]))
    # --- signsgd ------------------------------------------------------------------------------
    C.append(case("signsgd_d512_ef", cfg("signsgd"), "fp32",
                  [Step(gaussian(240, 2100), 0), Step(gaussian(241, 2100), 1, 0.5),
                   Step(gaussian(242, 2100), 2)], chunk=1024,
                  note="error feedback on by default"))
    C.append(case("signsgd_d100_noef_edges", cfg("signsgd", bucket_size=100, error_feedback=False),
                  "fp32", [Step(bucket_edges(243, 1234), 0, 0.3), Step(qsgd_nonfinite(244, 1234), 1)],
                  chunk=250, note="step 1: chunks with NaN/Inf go out in the none layout"))
    C.append(case("signsgd_d7_f16", cfg("signsgd", bucket_size=7), "fp16",
                  [Step(to_f16_bits(bucket_edges(245, 50)), 0), Step(to_f16_bits(gaussian(246, 50)), 1)],
                  chunk=20))
    C.append(case("signsgd_d5000_bf16", cfg("signsgd", bucket_size=5000, error_feedback=False),
                  "bf16", [Step(to_bf16_bits(gaussian(247, 5003)), 0)], chunk=0,
                  note="a bucket longer than one 4096-element block of the canonical sum"))
    C.append(case("signsgd_n0", cfg("signsgd"), "fp32", [Step(f32_vals(), 0)]))
    C.append(case("signsgd_n1", cfg("signsgd"), "fp32",
                  [Step(f32_vals(-2.5), 0), Step(f32_vals(1.0), 1)]))
    # --- onebit -------------------------------------------------------------------------------
    C.append(case("onebit_d512_ef", cfg("onebit"), "fp32",
                  [Step(gaussian(250, 2100), 0), Step(gaussian(251, 2100), 1, 0.5),
                   Step(gaussian(252, 2100), 2)], chunk=1024,
                  note="error feedback on by default"))
    C.append(case("onebit_d7_noef_edges", cfg("onebit", bucket_size=7, error_feedback=False),
                  "fp32", [Step(bucket_edges(253, 71), 0, 0.3)], chunk=14,
                  note="buckets all zero, all positive (neg = +0), all negative (pos = +0)"))
    C.append(case("onebit_d100_noef_nonfinite", cfg("onebit", bucket_size=100,
                                                     error_feedback=False), "fp32",
                  [Step(qsgd_nonfinite(254, 1234), 0)], chunk=250))
    C.append(case("onebit_f16_ef", cfg("onebit", bucket_size=64), "fp16",
                  [Step(to_f16_bits(gaussian(255, 500)), 0), Step(to_f16_bits(gaussian(256, 500)), 1)],
                  chunk=128))
    C.append(case("onebit_d5000_bf16", cfg("onebit", bucket_size=5000, error_feedback=False),
                  "bf16", [Step(to_bf16_bits(gaussian(257, 5003)), 0)], chunk=0))
    C.append(case("onebit_n0", cfg("onebit"), "fp32", [Step(f32_vals(), 0)]))
    sx = mean_order_probe("signsgd", 4099, 4, 60, log)
    C.append(case("signsgd_d4099_reduction_order", cfg("signsgd", bucket_size=4099,
                                                       error_feedback=False), "fp32",
                  [Step(sx, 0)], chunk=8198, tensor="probe",
                  note="bucket scales next to fp32 rounding flips: only the canonical order of "
                       "determinism §2 reproduces them"))
    ox = mean_order_probe("onebit", 4099, 4, 60, log)
    C.append(case("onebit_d4099_reduction_order", cfg("onebit", bucket_size=4099,
                                                      error_feedback=False), "fp32",
                  [Step(ox, 0)], chunk=8198, tensor="probe",
                  note="pos (even buckets) and neg (odd buckets) next to fp32 rounding flips"))
    # --- powersgd (two ranks, two rounds) -------------------------------------------------------
    def lowrank(seed, rows, cols, rank, noise=0.0):
        rng = np.random.default_rng(seed)
        m = rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))
        m = m + noise * rng.standard_normal((rows, cols))
        return m.astype(np.float32).ravel()

    g0, g1 = lowrank(300, 24, 16, 2, 0.1), lowrank(301, 24, 16, 2, 0.1)
    C.append(mr_case("powersgd_w2_r2_shape", cfg("powersgd", approx_rank=2), "fp32",
                     [MRStep([g0, g1], 0, 0.5),
                      MRStep([lowrank(302, 24, 16, 3), lowrank(303, 24, 16, 3)], 1, 0.5),
                      MRStep([g0, g1], 2, 0.5)], shape=[24, 16], tensor="fc.weight", seed=3,
                     note="step 2 repeats step 0's inputs on the warm-started Q"))
    C.append(mr_case("powersgd_w2_r4_flat_f16", cfg("powersgd", approx_rank=4), "fp16",
                     [MRStep([to_f16_bits(gaussian(304, 1001)), to_f16_bits(gaussian(305, 1001))],
                             7, 0.5),
                      MRStep([to_f16_bits(gaussian(306, 1001)), to_f16_bits(gaussian(307, 1001))],
                             8, 0.5)], shape=None, tensor="flat.bias",
                     note="no shape: cols = ceil(sqrt(1001)) = 32, rows = 32, 23 padding zeros"))
    C.append(mr_case("powersgd_w2_tall_bf16_rank_clamp", cfg("powersgd", approx_rank=4), "bf16",
                     [MRStep([to_bf16_bits(gaussian(308, 8200)), to_bf16_bits(gaussian(309, 8200))],
                             0, 0.5)], shape=[4100, 2], seed=1,
                     note="r = min(4, 4100, 2) = 2; the dots over 4100 rows cross a 4096 block"))
    z = np.zeros(60, dtype=np.float32)
    C.append(mr_case("powersgd_w2_zero_redraw_3d", cfg("powersgd", approx_rank=3), "fp32",
                     [MRStep([z, z], 0, 0.5),
                      MRStep([lowrank(310, 4, 15, 1), lowrank(311, 4, 15, 1)], 1, 0.5),
                      MRStep([lowrank(312, 4, 15, 1), z], 2, 0.5)], shape=[4, 3, 5],
                     note="step 0 all zero: T = 0, so Q' columns are zero and step 1 redraws "
                          "them; rank-1 inputs at r = 3"))
    C.append(mr_case("powersgd_w2_rank1_weight1", cfg("powersgd"), "fp32",
                     [MRStep([gaussian(313, 77), gaussian(314, 77)], 0, 1.0),
                      MRStep([gaussian(315, 77), gaussian(316, 77)], 1, 1.0)], shape=[7, 11],
                     tensor="emb/wé", seed=0xDEADBEEF))
    C.append(mr_case("powersgd_w2_n1", cfg("powersgd", approx_rank=2), "fp32",
                     [MRStep([f32_vals(-2.5), f32_vals(1.0)], 0, 0.5),
                      MRStep([f32_vals(3.0), f32_vals(0.0)], 1, 0.5)]))
    C.append(mr_case("powersgd_w2_n0", cfg("powersgd", approx_rank=2), "fp32",
                     [MRStep([f32_vals(), f32_vals()], 0, 0.5)]))
    C.append(mr_case("powersgd_w3_rank1", cfg("powersgd", approx_rank=1), "fp32",
                     [MRStep([gaussian(317, 50), gaussian(318, 50), gaussian(319, 50)], 5,
                             F32(1.0) / F32(3.0))]))
    row2 = np.zeros(30, dtype=np.float32)
    row2[12:18] = f32_vals(1.0, -2.0, 0.5, 3.0, -1.0, 0.25)
    C.append(mr_case("powersgd_w2_partial_redraw", cfg("powersgd", approx_rank=3), "fp32",
                     [MRStep([row2, _f32_scaled(row2, 2.0)], 0, 0.5),
                      MRStep([gaussian(324, 30), gaussian(325, 30)], 1, 0.5),
                      MRStep([gaussian(326, 30), gaussian(327, 30)], 2, 0.5)], shape=[5, 6],
                     note="step 0: one non-zero row, so P-hat columns 1 and 2 are exactly zero, "
                          "T and Q' too; step 1 keeps column 0 warm and redraws columns 1, 2"))
    C.append(mr_case("powersgd_w2_view_change", cfg("powersgd", approx_rank=1024), "fp32",
                     [MRStep([gaussian(328, 96), gaussian(329, 96)], 0, 0.5, shape=[8, 12]),
                      MRStep([gaussian(330, 96), gaussian(331, 96)], 1, 0.5, shape=None),
                      MRStep([gaussian(332, 96), gaussian(333, 96)], 2, 0.5, shape=[96]),
                      MRStep([gaussian(334, 96), gaussian(335, 96)], 3, 0.5, shape=[8, 12])],
                     note="views 8x12 (r = 8), then flat 10x10 (r = 10, 4 padding), then a 1-d "
                          "shape (flat again: warm), then 8x12 again: a view change draws a "
                          "fresh Q; approx_rank 1024 is clamped to min(rows, cols)"))
    ginf = gaussian(320, 48)
    ginf[[5]] = F32(np.inf)
    C.append(mr_case("powersgd_w2_inf_last", cfg("powersgd", approx_rank=2), "fp32",
                     [MRStep([gaussian(321, 48), gaussian(322, 48)], 0, 0.5),
                      MRStep([ginf, gaussian(323, 48)], 1, 0.5)], shape=[6, 8],
                     note="+Inf in the last step: Inf and NaN (Inf - Inf, default NaN) reach "
                          "the factors and the result"))
    C.append(case("onebit_n1", cfg("onebit"), "fp32",
                  [Step(f32_vals(-2.5), 0), Step(f32_vals(1.0), 1)]))
    return C


def qsgd_input(seed, n, zero_bucket=None):
    x = gaussian(seed, n)
    x[::97] *= F32(8.0)
    if zero_bucket:
        b, m = zero_bucket
        x[b:b + m] = F32(0.0)
        x[b + 5] = F32(-0.0)
    return x


def qsgd_nonfinite(seed, n):
    x = gaussian(seed, n)
    x[17] = F32(np.inf)                          # chunk 0 (elements 0..299): Inf -> none layout
    x[333] = f32_bits(0x7FC01234)[0]             # chunk 1 (300..599): NaN -> none layout
    x[600] = F32(3.0e38)                         # chunk 2 (600..899): finite values whose
    x[601] = F32(-3.0e38)                        #   bucket norm overflows fp32 -> none layout
    x[900:1000] = F32(0.0)                       # chunk 3 (900..1199): an all-zero bucket
    x[1200] = F32(-0.0)                          # chunk 4 (1200..1233): tail bucket of 34
    return x


def qsgd_last_nan(seed, n):
    x = gaussian(seed, n)
    x[650] = F32(np.nan)                         # chunk 2 (600..899) goes out in none layout
    x[1000:1050] = F32(0.0)                      # tail bucket all zero
    return x

# ------------------------------------------------------------------------------------------------
# Reduction-order probes (determinism §2)
#
# The canonical fp64 sum normally disappears in the fp32 rounding of a norm. These inputs make it
# visible: one element 2^30 (square 2^60, whose fp64 ulp is 256), thousands of small elements
# (squares < 200, lost or kept depending on which accumulator they meet first), and two tuning
# elements b, c chosen so that the canonical sum lies right next to the point where the fp32 norm
# (QSGD) or the fp32 clipping factor (DGC) flips. Then summing in another plausible order (plain
# loop, pairwise, other block size, other accumulator count, indices relative to the tensor
# instead of the bucket, ...) changes the payload. The alternatives below are simulated only to
# choose the inputs and to report what each probe distinguishes.
# ------------------------------------------------------------------------------------------------
def _seq(a):
    t = 0.0
    for v in a:
        t = t + v
    return t


def _tree8(a):
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


def _halving(a):  # SIMD-style horizontal reduction: add the upper half onto the lower half
    while len(a) > 1:
        h = len(a) // 2
        a = [a[i] + a[i + h] for i in range(h)]
    return a[0]


def _pairs(a):
    while len(a) > 1:
        b = [a[i] + a[i + 1] for i in range(0, len(a) - 1, 2)]
        if len(a) % 2:
            b.append(a[-1])
        a = b
    return a[0]


def _blocked(t, block=4096, nacc=8, combine=_tree8, acc_off=0, block_off=0, blocks=_seq):
    sums = []
    i = 0
    while i < len(t):
        end = min(len(t), ((i + block_off) // block + 1) * block - block_off)
        acc = [0.0] * nacc
        for k in range(i, end):
            acc[(k + acc_off) % nacc] = acc[(k + acc_off) % nacc] + t[k]
        sums.append(combine(acc))
        i = end
    return blocks(sums) if sums else 0.0


def alternative_sums(offset, chunk=None):
    """Plausible wrong orders. offset: index of the array's first element in the tensor."""
    alts = {
        "plain loop": _seq,
        "numpy pairwise": lambda t: float(np.sum(np.array(t, dtype=np.float64))),
        "no 4096 blocks": lambda t: _blocked(t, block=1 << 40),
        "blocks of 1024": lambda t: _blocked(t, block=1024),
        "blocks of 8192": lambda t: _blocked(t, block=8192),
        "accumulators combined in a row": lambda t: _blocked(t, combine=_seq),
        "accumulators combined by halving": lambda t: _blocked(t, combine=_halving),
        "4 accumulators": lambda t: _blocked(t, nacc=4, combine=_pairs),
        "16 accumulators": lambda t: _blocked(t, nacc=16, combine=_pairs),
        "block sums combined pairwise": lambda t: _blocked(t, blocks=_pairs),
    }
    if offset % 8:
        alts["accumulator index relative to the tensor"] = lambda t: _blocked(t, acc_off=offset)
    if offset % 4096:
        alts["blocks and index relative to the tensor"] = lambda t: _blocked(
            t, acc_off=offset, block_off=offset)
    if chunk:
        def per_chunk(t):
            total = 0.0
            for b in range(0, len(t), chunk):
                total = total + lwref.canonical_sum(t[b:b + chunk])
            return total
        alts["per-chunk sums added"] = per_chunk
    return alts


def _fbits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bitsf(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _squares(y):
    return [float(v) * float(v) for v in y.tolist()]


def _probe_layout(seed, L, big_late):
    rng = np.random.default_rng(seed)
    x = rng.uniform(3.0, 14.0, L).astype(np.float32)
    x[rng.random(L) < 0.5] *= F32(-1.0)
    pos = rng.choice(L, 3, replace=False)
    if big_late:  # the 2^30 element in the last block
        pos[0] = (L - 1) // 4096 * 4096 + rng.integers(0, L - (L - 1) // 4096 * 4096)
    return x, [int(p) for p in pos]


def _probe_fill(x, pos, b, c):
    y = x.copy()
    y[pos[0]] = F32(2.0 ** 30)
    y[pos[1]] = F32(b)
    y[pos[2]] = F32(c)
    return y


def _probe_flip(x, pos, value_of):
    """b, and the two neighbouring fp32 values of c around which value_of(canonical sum) flips;
    None when the flip is not inside the searched range."""
    smalls = float(np.sum(x.astype(np.float64) ** 2))
    b = float(F32(math.sqrt(2.0 ** 37 + 2.0 ** 12 - smalls - 200.0 ** 2)))

    def val(cb):
        return value_of(lwref.canonical_sum(_squares(_probe_fill(x, pos, b, _bitsf(cb)))))

    lo, hi = _fbits(50.0), _fbits(400.0)
    v_lo = val(lo)
    if val(hi) == v_lo:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if val(mid) == v_lo:
            lo = mid
        else:
            hi = mid
    return b, _bitsf(lo), _bitsf(hi)


def qsgd_order_probe(d, buckets, tail, chunk, log):
    """Input of `buckets` probe buckets of d elements and a gaussian tail; each probe bucket's
    fp32 norm sits next to a flip (alternately just below and just above it)."""
    def norm32(S):
        return float(lwref.to_f32(math.sqrt(S)))

    for trial in range(50):
        parts, covered = [], {}
        for k in range(buckets):
            x, pos = _probe_layout(1000 * trial + k, d, big_late=(k % 3 == 1))
            flip = _probe_flip(x, pos, norm32)
            if flip is None:
                break
            b, c_below, c_above = flip
            y = _probe_fill(x, pos, b, c_below if k % 2 == 0 else c_above)
            t = _squares(y)
            want = norm32(lwref.canonical_sum(t))
            chunk_off = (k * d) % chunk
            for name, fn in alternative_sums(k * d, None).items():
                if norm32(fn(t)) != want:
                    covered.setdefault(name, []).append(k)
            if chunk_off % 8:
                name = "accumulator index relative to the chunk"
                if norm32(_blocked(t, acc_off=chunk_off)) != want:
                    covered.setdefault(name, []).append(k)
            parts.append(y)
        if len(parts) < buckets:
            continue
        must = set(alternative_sums(d, None)) - {"block sums combined pairwise"}  # 2 blocks only
        if must <= set(covered):
            x = np.concatenate(parts + [gaussian(5000 + trial, tail)])
            for name in sorted(covered):
                log("    qsgd order probe: '%s' differs in bucket(s) %s" % (name, covered[name]))
            return x, covered
    raise SystemExit("qsgd order probe: no layout distinguishes every alternative")


def mean_order_probe(kind, d, buckets, tail, log):
    """signsgd / onebit scales: fp32(S / count) of a canonical fp64 sum over a bucket. One
    element 2^36 (fp64 ulp 2^-16) makes the small elements' low bits order dependent; element c
    is tuned so that the fp32 scale sits next to a flip (alternately below and above it).
    kind "signsgd": terms |x|; kind "onebit": the positive part (even buckets) or, with the
    bucket negated, the negative part (odd buckets)."""
    def terms_of(y, negate):
        if kind == "signsgd":
            return [abs(float(v)) for v in y.tolist()], len(y)
        if negate:
            t = [float(v) if v < 0 else 0.0 for v in y.tolist()]
            return t, sum(1 for v in y.tolist() if v < 0)
        t = [0.0 if v < 0 else float(v) for v in y.tolist()]
        return t, sum(1 for v in y.tolist() if not v < 0)

    def scale(t, cnt, fn=lwref.canonical_sum):
        return float(lwref.to_f32(fn(t) / float(cnt)))

    for trial in range(50):
        parts, covered = [], {}
        for k in range(buckets):
            x, pos = _probe_layout(3000 + 1000 * trial + k, d, big_late=(k % 3 == 1))
            negate = kind == "onebit" and k % 2 == 1
            if kind == "onebit":
                x = np.abs(x)
                x[np.random.default_rng(k).random(d) < 0.3] *= F32(-1.0)  # the other part
                if negate:
                    x = -x

            def fill(cb):
                y = x.copy()
                sg = F32(-1.0) if negate else F32(1.0)
                y[pos[0]] = sg * F32(2.0 ** 36)
                y[pos[1]] = sg * F32(100.0)
                y[pos[2]] = sg * F32(_bitsf(cb))
                return y

            def val(cb):
                t, cnt = terms_of(fill(cb), negate)
                return scale(t, cnt)

            lo, hi = _fbits(50.0), _fbits(20000.0)
            v_lo = val(lo)
            if val(hi) == v_lo:
                break
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if val(mid) == v_lo:
                    lo = mid
                else:
                    hi = mid
            y = fill(lo if k % 2 == 0 else hi)
            t, cnt = terms_of(y, negate)
            want = scale(t, cnt)
            for name, fn in alternative_sums(k * d, None).items():
                if scale(t, cnt, fn) != want:
                    covered.setdefault(name, []).append(k)
            parts.append(y)
        if len(parts) < buckets:
            continue
        must = {"plain loop", "no 4096 blocks", "accumulators combined in a row"}
        if must <= set(covered):
            for name in sorted(covered):
                log("    %s order probe: '%s' differs in bucket(s) %s" % (kind, name,
                                                                         covered[name]))
            return np.concatenate(parts + [gaussian(6000 + trial, tail)])
    raise SystemExit("%s order probe: no layout distinguishes the gross alternatives" % kind)


def dgc_clip_probe(n, chunk, log):
    """One input and two clip norms: with the first the canonical norm gives a clipping factor
    just above an fp32 rounding boundary, with the second just below, so an order that gives a
    larger (first) or smaller (second) norm changes f and every value sent."""
    for trial in range(50):
        x, pos = _probe_layout(7000 + trial, n, big_late=True)
        y = _probe_fill(x, pos, float(F32(370000.0)), 200.0)
        t = _squares(y)
        N = math.sqrt(lwref.canonical_sum(t))
        alts = {name: math.sqrt(fn(t)) for name, fn in alternative_sums(0, chunk).items()}
        # m: an fp32 midpoint near 0.7 whose tie rounds down (A) / up (B)
        lo32 = F32(0.7)
        up = np.nextafter(lo32, F32(1.0))
        if _fbits(float(lo32)) & 1:
            lo32, up = up, np.nextafter(up, F32(1.0))
        m_down = (float(lo32) + float(up)) / 2.0          # tie -> lo32 (even)
        m_up = (float(up) + float(np.nextafter(up, F32(1.0)))) / 2.0  # tie -> up2 (even)

        def clip_for(m, above):
            """The smallest clip with clip / N > m (above), or the largest with clip / N < m."""
            clip = m * N
            while clip / N > m:
                clip = math.nextafter(clip, 0.0)
            while clip / N <= m:
                clip = math.nextafter(clip, math.inf)
            if not above:
                while clip / N >= m:
                    clip = math.nextafter(clip, 0.0)
            return clip

        clip_a = clip_for(m_down, True)    # f rounds up; a larger norm makes it round down
        clip_b = clip_for(m_up, False)     # f rounds down; a smaller norm makes it round up
        f_of = lambda clip, NN: float(lwref.to_f32(clip / NN))  # noqa: E731
        covered = {}
        for name, Na in alts.items():
            for tag, clip in (("A", clip_a), ("B", clip_b)):
                if f_of(clip, Na) != f_of(clip, N):
                    covered.setdefault(name, []).append(tag)
        if {"plain loop", "no 4096 blocks", "per-chunk sums added"} <= set(covered):
            for name in sorted(alts):
                log("    dgc clip probe: '%s' %s" % (
                    name, "differs with clip %s" % "/".join(covered[name]) if name in covered
                    else "not distinguished (its norm rounds the same)"))
            return y, clip_a, clip_b, covered
    raise SystemExit("dgc clip probe: no input distinguishes the gross alternatives")


# ------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------
def raw_bytes(data, dtype):
    if dtype == "fp32":
        return data.astype("<f4").tobytes()
    return data.astype("<u2").tobytes()


def run_case(c, outdir, log, written):
    config = c["config"]
    n = c["n"]
    codec = lwref.Codec(config, n)
    other_codec = lwref.Codec(config, n) if c["other_rank"] is not None else None
    chunking = lwref.chunk_ranges(n, c["chunk"], lwref.codec_alignment(config))
    cdir = os.path.join(outdir, c["name"])
    os.makedirs(cdir, exist_ok=True)
    steps_json = []
    for j, st in enumerate(c["steps"]):
        data = raw_bytes(st.data, c["dtype"])
        if st.input_of is None:
            in_name = "%s/s%d.in" % (c["name"], j)
            put_file(outdir, written, in_name, data)
        else:
            in_name = "%s/s%d.in" % (st.input_case or c["name"], st.input_of)
            assert written[in_name] == data, in_name  # an earlier file with the same bytes
        payloads, info = codec.step(st.data, c["dtype"], chunking, c["seed"], c["tensor"],
                                    st.step, c["rank"], st.density)
        out = np.zeros(n, dtype=np.float32)
        codec.decode(payloads, chunking, st.weight, out)
        pay_name = "%s/s%d.payload" % (c["name"], j)
        put_file(outdir, written, pay_name, b"".join(payloads))
        dec_name = "%s/s%d.decoded" % (c["name"], j)
        bits = out.view(np.uint32)
        sparse = 8 * int(np.count_nonzero(bits)) < 4 * n  # whichever file is smaller
        if sparse:
            nz = np.nonzero(bits != 0)[0]
            decoded = b"".join(struct.pack("<II", int(i), int(bits[i])) for i in nz)
        else:
            decoded = out.astype("<f4").tobytes()
        put_file(outdir, written, dec_name, decoded)
        sj = {
            "step": st.step,
            "weight": repr(float(st.weight)),
            "density": None if st.density is None else repr(float(st.density)),
            "input": in_name,
            "payload": pay_name,
            "payload_sizes": [len(p) for p in payloads],
            "decoded": dec_name,
            "decoded_format": "sparse" if sparse else "dense",
            "info": info,
        }
        if other_codec is not None:
            oin = "%s/s%d.other.in" % (c["name"], j)
            put_file(outdir, written, oin, raw_bytes(st.other, c["dtype"]))
            opay, _ = other_codec.step(st.other, c["dtype"], chunking, c["seed"], c["tensor"],
                                       st.step, c["other_rank"], st.density)
            sums = [lwref.add_payloads(config["name"], pa, pb) for pa, pb in zip(payloads, opay)]
            opn = "%s/s%d.other.payload" % (c["name"], j)
            spn = "%s/s%d.sum.payload" % (c["name"], j)
            put_file(outdir, written, opn, b"".join(opay))
            put_file(outdir, written, spn, b"".join(sums))
            sj["add"] = {"rank": c["other_rank"], "input": oin, "payload": opn,
                         "payload_sizes": [len(p) for p in opay], "sum": spn,
                         "sum_sizes": [len(p) for p in sums]}
        steps_json.append(sj)
        desc = " ".join("%s=%s" % (k, v) for k, v in info.items() if k != "dgc_lo_hi")
        log("    step %d: %d chunk(s), %d payload bytes %s" % (
            st.step, len(payloads), sum(len(p) for p in payloads), desc))
    return with_note({
        "name": c["name"], "config": config_json(config),
        "tensor_name": c["tensor"], "seed": c["seed"], "rank": c["rank"], "dtype": c["dtype"],
        "elements": n, "chunk_elements": c["chunk"], "chunk_sizes": [m for _, m in chunking],
        "steps": steps_json,
    }, c)


class MRStep:
    """One step of a multi-round (PowerSGD) case: one input per rank."""

    def __init__(self, inputs, step, weight, shape="case"):
        self.shape = shape          # the trainer's shape at this step ("case": the case's)
        self.inputs = inputs
        self.step = step
        self.weight = F32(weight)


def _f32_scaled(x, f):
    return (x * F32(f)).astype(np.float32)


def mr_case(name, config, dtype, steps, shape=None, tensor="layer.0.weight", seed=0, note=""):
    world = len(steps[0].inputs)
    n = len(steps[0].inputs[0])
    for st in steps:
        assert len(st.inputs) == world
        for x in st.inputs:
            assert len(x) == n and x.dtype == (np.float32 if dtype == "fp32" else np.uint16)
    return dict(name=name, config=config, dtype=dtype, steps=steps, tensor=tensor, seed=seed,
                n=n, note=note, world=world, shape=shape, multiround=True)


def run_mr_case(c, outdir, log, written):
    """W ranks, every round's payloads summed in rank order ((p0 + p1) + ...), every rank decodes
    the reduced payloads and finishes its step (tests/kernels/multirank.h does the same)."""
    config = c["config"]
    n = c["n"]
    world = c["world"]
    ranks = [lwref.PowerSGD(config["approx_rank"], n) for _ in range(world)]
    cdir = os.path.join(outdir, c["name"])
    os.makedirs(cdir, exist_ok=True)
    steps_json = []
    for j, st in enumerate(c["steps"]):
        in_names = []
        for rk, x in enumerate(st.inputs):
            nm = "%s/s%d.r%d.in" % (c["name"], j, rk)
            put_file(outdir, written, nm, raw_bytes(x, c["dtype"]))
            in_names.append(nm)
        shape = c["shape"] if st.shape == "case" else st.shape
        sent0 = [ranks[rk].begin(st.inputs[rk], c["dtype"], c["seed"], c["tensor"], st.step,
                                 shape) for rk in range(world)]
        red0 = sent0[0]
        for p in sent0[1:]:
            red0 = lwref.powersgd_add(red0, p)
        sent1 = [ranks[rk].round1(red0) for rk in range(world)]
        red1 = sent1[0]
        for p in sent1[1:]:
            red1 = lwref.powersgd_add(red1, p)
        info = {"rows": ranks[0].rows, "cols": ranks[0].cols, "r": ranks[0].r,
                "redrawn_columns": ranks[0].redrawn}
        out = np.zeros(n, dtype=np.float32)
        lwref.powersgd_decode(red0, red1, n, config["approx_rank"], st.weight, out)
        for rk in range(world):
            ranks[rk].finish(red0, red1, st.weight)
        sent_names = []
        for q, sent in enumerate((sent0, sent1)):
            names = []
            for rk, p in enumerate(sent):
                nm = "%s/s%d.r%d.round%d.payload" % (c["name"], j, rk, q)
                put_file(outdir, written, nm, p)
                names.append(nm)
            sent_names.append(names)
        red_names = []
        for q, red in enumerate((red0, red1)):
            nm = "%s/s%d.round%d.reduced" % (c["name"], j, q)
            put_file(outdir, written, nm, red)
            red_names.append(nm)
        dec_name = "%s/s%d.decoded" % (c["name"], j)
        put_file(outdir, written, dec_name, out.astype("<f4").tobytes())
        steps_json.append({
            "step": st.step, "weight": repr(float(st.weight)), "density": None,
            "shape": shape, "inputs": in_names, "sent": sent_names, "reduced": red_names,
            "decoded": dec_name, "decoded_format": "dense", "info": info})
        log("    step %d: view %dx%d r=%d, redrawn %s, %d + %d bytes per rank" % (
            st.step, info["rows"], info["cols"], info["r"], info["redrawn_columns"], len(sent0[0]),
            len(sent1[0])))
    return with_note({
        "name": c["name"], "config": config_json(config),
        "tensor_name": c["tensor"], "seed": c["seed"], "rank": 0, "dtype": c["dtype"],
        "elements": n, "chunk_elements": 0, "chunk_sizes": [n], "world": world,
        "shape": c["shape"], "steps": steps_json,
    }, c)


def check_coverage(manifest):
    """The dgc cases must exercise every selection path of §4.4."""
    paths = set()
    for cj in manifest["cases"]:
        for s in cj["steps"]:
            p = s["info"].get("dgc_path")
            if p:
                paths.add(p.split("(")[0] if p.startswith("refined") else p)
    want = {"exact(n<=32768)", "initial", "refined", "exact(fallback)"}
    if not want <= paths:
        raise SystemExit("dgc path coverage incomplete: have %s, want %s" % (sorted(paths),
                                                                             sorted(want)))


def generate(outdir, log):
    manifest = {
        "format": 1,
        "generator": "tests/reference/make_golden.py (reference: tests/reference/lwref.py)",
        "doc": "See make_golden.py for the file layout. Doubles and weights are decimal strings "
               "(shortest round-trip). chunk_elements is the requested chunk size (0 = one "
               "chunk); chunk_sizes are the resulting chunk lengths.",
        "cases": [],
    }
    written = {}
    for c in cases(log):
        t0 = time.time()
        log("case %s (%s, n=%d, %s, %d step(s))" % (c["name"], c["config"]["name"], c["n"],
                                                   c["dtype"], len(c["steps"])))
        if c.get("multiround"):
            manifest["cases"].append(run_mr_case(c, outdir, log, written))
        elif c.get("global_selection"):
            manifest["cases"].append(run_gs_case(c, outdir, log, written))
        else:
            manifest["cases"].append(run_case(c, outdir, log, written))
        log("    %.2fs" % (time.time() - t0))
    check_coverage(manifest)
    with open(os.path.join(outdir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.write("\n")
    return manifest


def list_files(root):
    out = set()
    for dp, _, fns in os.walk(root):
        for fn in fns:
            out.add(os.path.relpath(os.path.join(dp, fn), root))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and compare with the committed files")
    ap.add_argument("--out", default=GOLDEN, help="output directory (default: %(default)s)")
    args = ap.parse_args()

    def log(msg):
        print(msg, flush=True)

    if not args.check:
        if os.path.isdir(args.out):
            shutil.rmtree(args.out)
        os.makedirs(args.out)
        generate(args.out, log)
        total = sum(os.path.getsize(os.path.join(args.out, f)) for f in list_files(args.out))
        log("wrote %s (%d bytes)" % (args.out, total))
        return 0

    tmp = tempfile.mkdtemp(prefix="lw-golden-")
    try:
        generate(tmp, log)
        have, want = list_files(args.out), list_files(tmp)
        bad = []
        for f in sorted(want - have):
            bad.append("missing in %s: %s" % (args.out, f))
        for f in sorted(have - want):
            bad.append("not generated any more: %s" % f)
        for f in sorted(have & want):
            if not filecmp.cmp(os.path.join(args.out, f), os.path.join(tmp, f), shallow=False):
                case_name = f.split("/")[0] if "/" in f else "(manifest)"
                bad.append("differs: %s (case %s)" % (f, case_name))
        if bad:
            for b in bad:
                print("CHECK FAILED: " + b, file=sys.stderr)
            return 1
        log("check ok: %d files identical" % len(want))
        return 0
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    sys.exit(main())
