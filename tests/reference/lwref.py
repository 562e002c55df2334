#!/usr/bin/env python3
"""lwref: a deliberately plain, independent reference of lightwire's codecs.

Written from docs/wire-format.md and docs/determinism.md alone (never from the C++ sources), so
that the golden payload files it produces check the C++ (and CUDA) codecs against the spec.

Conventions used throughout:
  * fp32 tensors are numpy float32 arrays; every fp32 operation is done on numpy float32 arrays or
    np.float32 scalars so that each operation rounds to fp32 exactly once (numpy uses the hardware
    IEEE operations, no FMA). Helper `_f32` asserts the dtype never silently widens.
  * fp64 reductions are sequential Python float loops in the canonical order of determinism §2.
  * bit patterns (fp32 as u32, fp16/bf16 as u16) are plain Python ints or numpy uint arrays; NaN
    values are never round-tripped through Python floats (that could change their bits).

Run with /usr/bin/python3 (needs numpy and Debian's python3-xxhash).
"""

import math
import struct

import numpy as np
import xxhash

MASK32 = 0xFFFFFFFF

# ------------------------------------------------------------------------------------------------
# Philox4x32-10 (Random123's philox4x32(ctr, key) with R = 10)
# ------------------------------------------------------------------------------------------------
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85


def philox4x32_10(ctr, key):
    """ctr: 4 u32, key: 2 u32 -> tuple of 4 u32 words."""
    c0, c1, c2, c3 = (int(c) & MASK32 for c in ctr)
    k0, k1 = (int(k) & MASK32 for k in key)
    for rnd in range(10):
        if rnd > 0:  # key bump between rounds (9 bumps for 10 rounds)
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        p0 = PHILOX_M0 * c0  # mulhilo32(M0, ctr[0])
        p1 = PHILOX_M1 * c2  # mulhilo32(M1, ctr[2])
        hi0, lo0 = p0 >> 32, p0 & MASK32
        hi1, lo1 = p1 >> 32, p1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0, c1, c2, c3)


PHILOX_KAT = [  # Random123 kat_vectors, philox4x32_10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def philox_self_check():
    for ctr, key, want in PHILOX_KAT:
        got = philox4x32_10(ctr, key)
        if got != want:
            raise AssertionError("Philox KAT failed: ctr=%s key=%s got=%s want=%s" % (
                [hex(c) for c in ctr], [hex(k) for k in key], [hex(g) for g in got],
                [hex(w) for w in want]))


PURPOSE_QSGD = 1
PURPOSE_DGC = 2
PURPOSE_RANDOMK = 3
PURPOSE_TERNGRAD = 4
PURPOSE_POWERSGD = 5
SHARED_STREAM = 0xFFFFFFFF


def tensor_name_key(name):
    """k1: low 32 bits of XXH3-64 (seed 0) of the UTF-8 name."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8")) & MASK32


class RandomWords:
    """Words of Philox(step, stream, purpose, group) for one tensor step; item i -> word i%4 of
    group i//4 (determinism §3)."""

    def __init__(self, seed, name, step, stream, purpose):
        self.key = (seed & MASK32, tensor_name_key(name))
        self.step = step & MASK32
        self.stream = stream & MASK32
        self.purpose = purpose
        self.cache = {}

    def word(self, i):
        g = i // 4
        words = self.cache.get(g)
        if words is None:
            words = philox4x32_10((self.step, self.stream, self.purpose, g & MASK32), self.key)
            self.cache[g] = words
        return words[i % 4]


def randomk_selection_word(n, k):
    """determinism §4.7 step 2: t = max(1, floor((k * 2^32 + floor(n/2)) / n)), 0 when n = 0."""
    if n == 0:
        return 0
    return max(1, (k * (1 << 32) + n // 2) // n)


def randomk_local_selection(seed, name_key, step, start, m, t):
    """Chunk-local indices j in [0, m) whose element start + j is selected (r < t), §4.7 step 3.
    Philox(step, 0xFFFFFFFF, purpose 3, low 32 bits of (start + j) // 4), key (seed, name_key)."""
    key = (seed & MASK32, name_key & MASK32)
    sel = []
    words = None
    g_cached = None
    for j in range(m):
        i = start + j
        g = i // 4
        if g != g_cached:
            words = philox4x32_10((step & MASK32, SHARED_STREAM, PURPOSE_RANDOMK, g & MASK32), key)
            g_cached = g
        if words[i % 4] < t:
            sel.append(j)
    return sel


# ------------------------------------------------------------------------------------------------
# fp32 helpers, fp16 / bf16 conversions by bit manipulation (determinism §4.1)
# ------------------------------------------------------------------------------------------------
F32 = np.float32


def _f32(a):
    assert isinstance(a, (np.ndarray, np.float32)) and a.dtype == np.float32, type(a)
    return a


def bits_of(a):
    """u32 bit patterns of a float32 array."""
    return _f32(a).view(np.uint32)


def f32_from_bits(u):
    return np.asarray(u, dtype=np.uint32).view(np.float32)


def key_of(a):
    """key(x): the u32 pattern with the sign bit cleared (as int64 array for safe comparisons)."""
    return (bits_of(a) & np.uint32(0x7FFFFFFF)).astype(np.int64)


def _float_of_finite_bits(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]  # exact


def f32_bits_to_f16(u):
    """fp32 bits -> binary16 bits: RNE, >= 65520 -> Inf, correctly rounded subnormals, NaN rule."""
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: sign | 0x7E00 | (mantissa23 >> 13)
        return sign | 0x7E00 | ((a & 0x7FFFFF) >> 13)
    if a == 0x7F800000:
        return sign | 0x7C00
    val = _float_of_finite_bits(a)  # |x| as an exact Python float
    if val >= 65520.0:
        return sign | 0x7C00
    if val == 0.0:
        return sign
    _, e = math.frexp(val)  # val = m * 2^e with 0.5 <= m < 1, so floor(log2 val) = e - 1
    exp = e - 1
    quantum_exp = -24 if exp < -14 else exp - 10  # spacing of binary16 values around val
    q = round(math.ldexp(val, -quantum_exp))  # exact scaling; round() is round-half-even
    if exp < -14:
        return sign | q  # subnormal (q == 1024 is the smallest normal, encoded the same way)
    return sign | (((exp + 15) << 10) + (q - 1024))  # q == 2048 carries into the exponent


def f32_bits_to_f16_saturating(u):
    """Sparse fp16 values (determinism §4.3): finite magnitudes above 65504 become +-65504."""
    a = u & 0x7FFFFFFF
    if a < 0x7F800000 and _float_of_finite_bits(a) > 65504.0:
        return ((u >> 16) & 0x8000) | 0x7BFF
    return f32_bits_to_f16(u)


def f16_to_f32_bits(h):
    """binary16 bits -> fp32 bits, exact (NaN payload kept, signalling bit untouched)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return sign | 0x7F800000 | (m << 13)
    if e == 0:
        if m == 0:
            return sign
        return sign | struct.unpack("<I", struct.pack("<f", m * 2.0 ** -24))[0]  # exact
    return sign | ((e - 15 + 127) << 23) | (m << 13)


def f32_bits_to_bf16(u):
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x0040
    return ((u + 0x7FFF + ((u >> 16) & 1)) & MASK32) >> 16


def bf16_to_f32_bits(h):
    return h << 16


def f32_to_f16_array(a):
    return np.array([f32_bits_to_f16(int(u)) for u in bits_of(a)], dtype=np.uint16)


def f16_to_f32_array(h):
    return f32_from_bits(np.array([f16_to_f32_bits(int(x)) for x in h], dtype=np.uint32))


def f32_to_bf16_array(a):
    return np.array([f32_bits_to_bf16(int(u)) for u in bits_of(a)], dtype=np.uint16)


def bf16_to_f32_array(h):
    return f32_from_bits(np.array([bf16_to_f32_bits(int(x)) for x in h], dtype=np.uint32))


DTYPE_CODE = {"fp32": 0, "fp16": 1, "bf16": 2}


def widen(raw, dtype):
    """Trainer input (float32 array, or uint16 bit array for fp16/bf16) -> fp32 (exact)."""
    if dtype == "fp32":
        return _f32(np.array(raw, dtype=np.float32))
    if dtype == "fp16":
        return f16_to_f32_array(raw)
    if dtype == "bf16":
        return bf16_to_f32_array(raw)
    raise ValueError(dtype)


# ------------------------------------------------------------------------------------------------
# Canonical fp64 reductions (determinism §2)
# ------------------------------------------------------------------------------------------------
def canonical_sum(terms):
    """terms: sequence of Python floats (each already computed in fp64)."""
    total = 0.0
    L = len(terms)
    for b0 in range(0, L, 4096):
        acc = [0.0] * 8
        for i in range(b0, min(b0 + 4096, L)):
            j = i % 8  # index relative to the start of the array
            acc[j] = acc[j] + terms[i]
        s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
        total = total + s
    return total


def norm_f64(x):
    """fp64 sqrt of the canonical sum of (double)x*(double)x over the fp32 array x."""
    terms = [float(v) * float(v) for v in _f32(x).tolist()]
    return math.sqrt(canonical_sum(terms))


def to_f32(d):
    """fp64 Python float -> fp32, round to nearest even (overflow -> Inf)."""
    with np.errstate(all="ignore"):
        return np.float32(d)


# ------------------------------------------------------------------------------------------------
# Payload layouts (wire-format.md)
# ------------------------------------------------------------------------------------------------
CODEC_ID = {"none": 0, "fp16": 1, "bf16": 2, "topk": 3, "randomk": 4, "threshold": 5, "dgc": 6,
            "qsgd": 7, "terngrad": 8, "signsgd": 9, "onebit": 10, "powersgd": 11}


def header(codec_id, dtype_code, flags, count):
    return bytes([0x4C, 0x57, 1, codec_id, dtype_code, flags, 0, 0]) + struct.pack("<Q", count)


def pack_bits(values, w, nbytes):
    """LSB-first bit stream: value j occupies bits [j*w, (j+1)*w); zero padding to nbytes."""
    out = bytearray(nbytes)
    t = 0
    for v in values:
        assert 0 <= v < (1 << w) or (w == 0 and v == 0)
        for bit in range(w):
            if (v >> bit) & 1:
                out[t // 8] |= 1 << (t % 8)
            t += 1
    return bytes(out)


def unpack_bits(data, count, w):
    vals = []
    t = 0
    for _ in range(count):
        v = 0
        for bit in range(w):
            if (data[t // 8] >> (t % 8)) & 1:
                v |= 1 << bit
            t += 1
        vals.append(v)
    return vals, t


def none_payload(a, dtype_code):
    return header(0, dtype_code, 0, len(a)) + _f32(a).astype("<f4").tobytes()


def sparse_payload(codec_id, dtype_code, n_chunk, local_idx, value_bits, fp16_values):
    """local_idx: strictly increasing chunk-local indices; value_bits: u32 (fp32) or u16 (fp16)."""
    nnz = len(local_idx)
    gaps = []
    prev = -1
    for i in local_idx:
        gaps.append(i - prev - 1)
        prev = i
    assert all(g >= 0 for g in gaps)
    w = max(gaps).bit_length() if nnz else 0
    G = (nnz * w + 7) // 8
    G = (G + 3) // 4 * 4
    body = struct.pack("<IB", nnz, w) + b"\0\0\0" + pack_bits(gaps, w, G)
    if fp16_values:
        body += b"".join(struct.pack("<H", v) for v in value_bits)
    else:
        body += b"".join(struct.pack("<I", v) for v in value_bits)
    flags = 1 if fp16_values else 0
    return header(codec_id, dtype_code, flags, n_chunk) + body


# ------------------------------------------------------------------------------------------------
# Decoding: out[i] = out[i] + (w * v), fp32, two roundings (determinism §1)
# ------------------------------------------------------------------------------------------------
def decode_payload(payload, expected_codec_id, weight, out, begin, n_chunk):
    """Adds weight * decoded into out[begin:begin+n_chunk] (float32 array, modified in place)."""
    w = F32(weight)
    p = payload
    assert len(p) >= 16 and p[0] == 0x4C and p[1] == 0x57 and p[2] == 1, "bad header"
    cid, dt, flags, rnd, res = p[3], p[4], p[5], p[6], p[7]
    assert cid in (expected_codec_id, 0) and rnd == 0 and res == 0 and dt in (0, 1, 2)
    count = struct.unpack_from("<Q", p, 8)[0]
    assert count == n_chunk
    body = p[16:]
    seg = out[begin:begin + n_chunk]
    with np.errstate(all="ignore"):
        if cid == 0:
            assert flags == 0 and len(body) == 4 * n_chunk
            vals = np.frombuffer(body, dtype="<f4").astype(np.float32)
            seg[:] = seg + (w * vals)
        elif cid in (1, 2):
            assert flags == 0 and len(body) == 2 * n_chunk
            h = np.frombuffer(body, dtype="<u2")
            vals = f16_to_f32_array(h) if cid == 1 else bf16_to_f32_array(h)
            seg[:] = seg + (w * vals)
        elif cid in (3, 5, 6):
            assert flags in (0, 1)
            fp16 = flags == 1
            nnz, wbits = struct.unpack_from("<IB", body, 0)
            assert body[5:8] == b"\0\0\0" and nnz <= n_chunk and wbits <= 32
            G = ((nnz * wbits + 7) // 8 + 3) // 4 * 4
            vsize = 2 if fp16 else 4
            assert len(body) == 8 + G + vsize * nnz, "sparse length"
            gaps, used = unpack_bits(body[8:8 + G], nnz, wbits)
            for t in range(used, 8 * G):
                assert not (body[8 + t // 8] >> (t % 8)) & 1, "padding bits"
            vb = body[8 + G:]
            idx = -1
            for j in range(nnz):
                idx = idx + gaps[j] + 1
                assert idx < n_chunk
                if fp16:
                    v = f32_from_bits(np.uint32(f16_to_f32_bits(struct.unpack_from("<H", vb, 2 * j)[0])))
                else:
                    v = f32_from_bits(np.uint32(struct.unpack_from("<I", vb, 4 * j)[0]))
                v = F32(v)
                seg[idx] = _f32(seg[idx] + _f32(w * v))
        elif cid == 7:
            assert flags == 0
            b = body[0]
            assert 2 <= b <= 8 and body[1:4] == b"\0\0\0"
            d = struct.unpack_from("<I", body, 4)[0]
            assert d >= 1
            B = (n_chunk + d - 1) // d
            C = (n_chunk * b + 7) // 8
            assert len(body) == 8 + 4 * B + C, "qsgd length"
            norms = np.frombuffer(body[8:8 + 4 * B], dtype="<f4").astype(np.float32)
            assert np.all(np.isfinite(norms)) and np.all(norms >= 0)
            codes, used = unpack_bits(body[8 + 4 * B:], n_chunk, b)
            for t in range(used, 8 * C):
                assert not (body[8 + 4 * B + t // 8] >> (t % 8)) & 1, "qsgd padding bits"
            s = (1 << (b - 1)) - 1
            vals = np.zeros(n_chunk, dtype=np.float32)
            for i in range(n_chunk):
                code = codes[i]
                level = code & ((1 << (b - 1)) - 1)
                sign = code >> (b - 1)
                scale = _f32(norms[i // d] / F32(s))
                value = _f32(F32(level) * scale)
                if sign:
                    value = -value
                vals[i] = value
            seg[:] = seg + (w * vals)
        elif cid == 4:  # randomk
            assert flags in (0, 1)
            fp16 = flags == 1
            seed, name_key, step, res2, start, t, nnz = struct.unpack_from("<IIIIQQQ", body, 0)
            assert res2 == 0 and t <= (1 << 32) and nnz <= n_chunk
            assert start + n_chunk <= (1 << 64) - 1
            vsize = 2 if fp16 else 4
            assert len(body) == 40 + vsize * nnz, "randomk length"
            sel = randomk_local_selection(seed, name_key, step, start, n_chunk, t)
            assert len(sel) == nnz, "randomk count"
            vb = body[40:]
            for jj, idx in enumerate(sel):
                if fp16:
                    v = f32_from_bits(np.uint32(f16_to_f32_bits(struct.unpack_from("<H", vb, 2 * jj)[0])))
                else:
                    v = f32_from_bits(np.uint32(struct.unpack_from("<I", vb, 4 * jj)[0]))
                v = F32(v)
                seg[idx] = _f32(seg[idx] + _f32(w * v))
        elif cid in (8, 9, 10):  # terngrad, signsgd, onebit: shared bucket layout
            assert flags == 0
            d = struct.unpack_from("<I", body, 0)[0]
            assert d >= 1
            B = (n_chunk + d - 1) // d
            per = 8 if cid == 10 else 4
            cb = 2 if cid == 8 else 1
            C = (n_chunk * cb + 7) // 8
            assert len(body) == 4 + per * B + C, "bucket layout length"
            sc = np.frombuffer(body[4:4 + per * B], dtype="<f4").astype(np.float32)
            assert np.all(np.isfinite(sc))
            if cid == 10:
                pos, neg = sc[0::2], sc[1::2]
                assert np.all(pos >= 0) and np.all(neg <= 0)
            else:
                assert np.all(sc >= 0)  # -0.0 compares equal to 0: accepted
            codes, used = unpack_bits(body[4 + per * B:], n_chunk, cb)
            for tt in range(used, 8 * C):
                assert not (body[4 + per * B + tt // 8] >> (tt % 8)) & 1, "padding bits"
            vals = np.zeros(n_chunk, dtype=np.float32)
            for i in range(n_chunk):
                code = codes[i]
                bk = i // d
                if cid == 8:
                    assert code != 3, "terngrad code 3"
                    vals[i] = F32(0.0) if code == 0 else (sc[bk] if code == 1 else -sc[bk])
                elif cid == 9:
                    vals[i] = sc[bk] if code == 0 else -sc[bk]
                else:
                    vals[i] = pos[bk] if code == 0 else neg[bk]
            seg[:] = seg + (w * vals)
        else:
            raise AssertionError("codec id %d" % cid)
    _f32(seg)


# ------------------------------------------------------------------------------------------------
# Chunking (determinism §5)
# ------------------------------------------------------------------------------------------------
def chunk_ranges(n, requested, alignment):
    """[(begin, size)]: chunks of `requested` rounded up to a multiple of alignment (0 = one)."""
    if requested == 0:
        return [(0, n)]
    ce = (requested + alignment - 1) // alignment * alignment
    if n == 0:
        return [(0, 0)]
    return [(b, min(ce, n - b)) for b in range(0, n, ce)]


# ------------------------------------------------------------------------------------------------
# Selection (determinism §4.2, §4.3, §4.4)
# ------------------------------------------------------------------------------------------------
def selection_size(n, density):
    if n == 0:
        return 0
    return min(n, max(1, math.floor(density * n + 0.5)))


def min_magnitude_key(m):
    """The key floor of min_magnitude m (§4.2): key of the smallest fp32 value >= m (m rounded up
    to fp32, +Inf beyond the fp32 range); 0 when m is not > 0 (off)."""
    if not (m is not None and m > 0):
        return 0
    with np.errstate(over="ignore"):
        f = np.float32(m)  # round to nearest
    if float(f) < m:
        f = np.nextafter(f, np.float32(np.inf), dtype=np.float32)
    return int(np.array([f], dtype=np.float32).view(np.uint32)[0]) & 0x7FFFFFFF


def apply_min_magnitude(sel, keys, cfg):
    """§4.2: drop from the selected indices `sel` every element whose key is below the floor of
    cfg["min_magnitude"] (absent or 0 = off); what is dropped stays in the residual."""
    mk = min_magnitude_key(cfg.get("min_magnitude") or 0.0)
    if mk == 0:
        return sel
    return sel[keys[sel] >= mk]


def topk_select(keys, k):
    """Sorted indices: the k largest keys, ties broken by lower index (§4.3, via T literally)."""
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    T = int(np.sort(keys)[::-1][k - 1])  # k-th largest key, counting duplicates
    above = np.nonzero(keys > T)[0]
    need = k - len(above)
    ties = np.nonzero(keys == T)[0][:need]
    sel = np.sort(np.concatenate([above, ties]))
    assert len(sel) == k
    return sel


def dgc_select(keys, k, n, f, seed, name, step, rank, info):
    """DGC selection (§4.4); records the path taken in info."""
    if n <= 32768:
        info["dgc_path"] = "exact(n<=32768)"
        return topk_select(keys, k)
    M = max(1024, math.ceil(f * n))
    rw = RandomWords(seed, name, step, rank, PURPOSE_DGC)
    sample_keys = []
    for j in range(M):
        r = rw.word(j)
        idx = (r * n) >> 32
        sample_keys.append(int(keys[idx]))
    s = sorted(sample_keys, reverse=True)  # s[r-1] is s_r
    lo = (8 * k + 9) // 10
    hi = (13 * k) // 10
    r = min(max((k * M + n - 1) // n, 1), M)
    T = s[r - 1]
    c = int(np.count_nonzero(keys >= T))
    trace = ["r=%d c=%d" % (r, c)]
    info["dgc_M"] = M
    info["dgc_lo_hi"] = [lo, hi]
    if lo <= c <= hi:
        info["dgc_path"] = "initial"
        info["dgc_trace"] = trace
        return np.nonzero(keys >= T)[0]
    for attempt in range(3):
        r2 = min(max((2 * r * k + c) // (2 * c), 1), M)
        if r2 == r:
            if c > hi:
                r2 = r - 1
            elif c < lo:
                r2 = r + 1
            if r2 < 1 or r2 > M:
                trace.append("stop(r'=%d)" % r2)
                break
        r = r2
        T = s[r - 1]
        c = int(np.count_nonzero(keys >= T))
        trace.append("r=%d c=%d" % (r, c))
        if lo <= c <= hi:
            info["dgc_path"] = "refined(%d)" % (attempt + 1)
            info["dgc_trace"] = trace
            return np.nonzero(keys >= T)[0]
    info["dgc_path"] = "exact(fallback)"
    info["dgc_trace"] = trace
    return topk_select(keys, k)


# ------------------------------------------------------------------------------------------------
# Codecs
# ------------------------------------------------------------------------------------------------
def default_error_feedback(name):
    # docs/codecs.md "Codecs" (error feedback by default): on for the biased codecs without memory
    # of their own
    return name in ("topk", "threshold", "signsgd", "onebit")


def codec_alignment(cfg):
    return cfg["bucket_size"] if cfg["name"] in ("qsgd", "terngrad", "signsgd", "onebit") else 1


def effective_density(cfg, step_density):
    """density d for §4.2: the per-step override (schedules, §4.4) if any, else density, else
    1/ratio (fp64)."""
    if step_density is not None:
        return step_density
    if cfg.get("density") is not None:
        return cfg["density"]
    return 1.0 / cfg["ratio"]  # fp64


class Codec:
    """One configured codec plus the persistent state of one tensor."""

    def __init__(self, cfg, n):
        self.cfg = cfg
        self.n = n
        name = cfg["name"]
        ef = cfg.get("error_feedback")
        if ef is None:
            ef = default_error_feedback(name)
        if name == "dgc":
            assert not ef, "dgc has its own memory"
        self.ef = ef
        self.e = np.zeros(n, dtype=np.float32)          # error-feedback residual
        self.u = np.zeros(n, dtype=np.float32)          # dgc momentum
        self.v = np.zeros(n, dtype=np.float32)          # dgc accumulated residual
        self.c = np.zeros(n, dtype=np.float32)          # dgc bias correction (1 - m^a) / (1 - m)

    # -- one step ---------------------------------------------------------------------------------
    def step(self, raw, dtype, chunking, seed, name, step, rank, step_density, defer_sent=False):
        """Returns (payloads per chunk, info). Commits the prepared state (the step succeeds).
        defer_sent (a global selection, determinism §4.6b): the effect of sending is left out and
        the state is committed by settle() instead."""
        cfg = self.cfg
        dcode = DTYPE_CODE[dtype]
        x = widen(raw, dtype)
        info = {}
        with np.errstate(all="ignore"):
            if cfg["name"] == "dgc":
                return self._dgc(x, dcode, chunking, seed, name, step, rank, step_density, info,
                                 defer_sent)
            if self.ef:
                a = _f32(x + self.e)
                # "exactly as if a were the input": a is fp32, so casts convert it (not as-is)
                raw_for_inner, dtype_for_inner = a, "fp32"
            else:
                a = x
                raw_for_inner, dtype_for_inner = raw, dtype
            payloads = self._inner(a, raw_for_inner, dtype_for_inner, dcode, chunking, seed, name,
                                   step, rank, step_density, info)
            if self.ef and defer_sent:
                self._deferred = ("ef", a)
            elif self.ef:
                decoded = np.zeros(self.n, dtype=np.float32)
                self.decode(payloads, chunking, F32(1.0), decoded)
                self.e = _f32(a + _f32(F32(-1.0) * decoded))
        return payloads, info

    def _inner(self, a, raw, rdtype, dcode, chunking, seed, name, step, rank, step_density, info):
        cfg = self.cfg
        cname = cfg["name"]
        out = []
        if cname == "none":
            for b, m in chunking:
                out.append(none_payload(a[b:b + m], dcode))
        elif cname in ("fp16", "bf16"):
            cid = CODEC_ID[cname]
            for b, m in chunking:
                if cname == rdtype:  # same format as the input: sent as is, bit for bit
                    h = np.asarray(raw[b:b + m], dtype=np.uint16)
                elif cname == "fp16":
                    h = f32_to_f16_array(a[b:b + m])
                else:
                    h = f32_to_bf16_array(a[b:b + m])
                out.append(header(cid, dcode, 0, m) + h.astype("<u2").tobytes())
        elif cname == "topk":
            k = selection_size(self.n, effective_density(cfg, step_density))
            keys = key_of(a)
            sel = apply_min_magnitude(topk_select(keys, k), keys, cfg)
            info["k"] = k
            info["nnz"] = int(len(sel))
            out = self._sparse_chunks(3, a, sel, dcode, chunking)
        elif cname == "qsgd":
            out = self._qsgd(a, dcode, chunking, seed, name, step, rank, info)
        elif cname == "randomk":
            out = self._randomk(a, dcode, chunking, seed, name, step, step_density, info)
        elif cname == "threshold":
            tau = to_f32(cfg["threshold"])
            assert np.isfinite(tau) and tau > 0
            ktau = int(bits_of(np.array([tau], dtype=np.float32))[0]) & 0x7FFFFFFF
            keys = key_of(a)
            sel = apply_min_magnitude(np.nonzero(keys >= ktau)[0], keys, cfg)
            info["nnz"] = int(len(sel))
            out = self._sparse_chunks(5, a, sel, dcode, chunking)
        elif cname in ("terngrad", "signsgd", "onebit"):
            out = self._bucketed(cname, a, dcode, chunking, seed, name, step, rank, info)
        else:
            raise ValueError(cname)
        return out

    def _randomk(self, a, dcode, chunking, seed, name, step, step_density, info):
        cfg = self.cfg
        n = self.n
        k = selection_size(n, effective_density(cfg, step_density))
        t = randomk_selection_word(n, k)
        fp16 = cfg["sparse_values"] == "fp16"
        s = to_f32(4294967296.0 / float(t)) if t else None
        name_key = tensor_name_key(name)
        out = []
        total = 0
        for b, m in chunking:
            sel = randomk_local_selection(seed, name_key, step, b, m, t)
            total += len(sel)
            vals = []
            for j in sel:
                v = _f32(a[b + j] * s)  # one fp32 multiplication
                u = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
                vals.append(f32_bits_to_f16_saturating(u) if fp16 else u)
            body = struct.pack("<IIIIQQQ", seed & MASK32, name_key, step & MASK32, 0, b, t,
                               len(sel))
            body += b"".join(struct.pack("<H" if fp16 else "<I", v) for v in vals)
            out.append(header(4, dcode, 1 if fp16 else 0, m) + body)
        info["k"] = k
        info["t"] = t
        info["nnz"] = total
        if s is not None:
            info["scale_bits"] = "0x%08x" % int(np.array([s], dtype=np.float32).view(np.uint32)[0])
        return out

    def _bucketed(self, cname, a, dcode, chunking, seed, name, step, rank, info):
        d = self.cfg["bucket_size"]
        rw = RandomWords(seed, name, step, rank, PURPOSE_TERNGRAD) if cname == "terngrad" else None
        out = []
        escaped = []
        for ci, (b, m) in enumerate(chunking):
            chunk = a[b:b + m]
            if not np.all(np.isfinite(chunk)):
                escaped.append(ci)
                out.append(none_payload(chunk, dcode))
                continue
            scales = []   # fp32 values (onebit: pos, neg pairs)
            codes = []
            for bb in range(0, m, d):
                bucket = chunk[bb:bb + d]
                c = len(bucket)
                if cname == "terngrad":
                    sc = F32(0.0)
                    for v in bucket.tolist():
                        if abs(v) > float(sc):
                            sc = F32(abs(v))
                    scales.append(sc)
                    for lj, v in enumerate(bucket.tolist()):
                        i = b + bb + lj  # whole-tensor index
                        if sc == 0:
                            codes.append(0)
                            continue
                        p = abs(v) / float(sc)
                        u = rw.word(i) * 2.0 ** -32
                        codes.append((2 if v < 0 else 1) if u < p else 0)
                elif cname == "signsgd":
                    S = canonical_sum([abs(float(v)) for v in bucket.tolist()])
                    scales.append(to_f32(S / float(c)))
                    codes.extend(1 if v < 0 else 0 for v in bucket.tolist())
                else:  # onebit
                    vl = bucket.tolist()
                    SP = canonical_sum([0.0 if v < 0 else float(v) for v in vl])
                    SN = canonical_sum([float(v) if v < 0 else 0.0 for v in vl])
                    cn = sum(1 for v in vl if v < 0)
                    cp = c - cn
                    pos = to_f32(SP / float(cp)) if cp > 0 else F32(0.0)
                    neg = to_f32(SN / float(cn)) if cn > 0 else F32(0.0)
                    scales.extend([pos, neg])
                    codes.extend(1 if v < 0 else 0 for v in vl)
            cb = 2 if cname == "terngrad" else 1
            C = (m * cb + 7) // 8
            body = struct.pack("<I", d)
            body += np.array(scales, dtype=np.float32).astype("<f4").tobytes()
            body += pack_bits(codes, cb, C)
            out.append(header(CODEC_ID[cname], dcode, 0, m) + body)
        info["escaped_chunks"] = escaped
        return out

    def _sparse_chunks(self, cid, vals, sel, dcode, chunking):
        fp16 = self.cfg["sparse_values"] == "fp16"
        out = []
        for b, m in chunking:
            idx = [int(i) for i in sel if b <= i < b + m]
            if fp16:
                vb = [f32_bits_to_f16_saturating(int(bits_of(vals[i:i + 1])[0])) for i in idx]
            else:
                vb = [int(bits_of(vals[i:i + 1])[0]) for i in idx]
            out.append(sparse_payload(cid, dcode, m, [i - b for i in idx], vb, fp16))
        return out

    def _qsgd(self, a, dcode, chunking, seed, name, step, rank, info):
        cfg = self.cfg
        bbits = cfg["bits"]
        d = cfg["bucket_size"]
        s = (1 << (bbits - 1)) - 1
        rw = RandomWords(seed, name, step, rank, PURPOSE_QSGD)
        out = []
        escaped = []
        for ci, (b, m) in enumerate(chunking):
            chunk = a[b:b + m]
            norms = []
            for bb in range(0, m, d):
                norms.append(to_f32(norm_f64(chunk[bb:bb + d])))
            if not all(np.isfinite(nv) for nv in norms):
                escaped.append(ci)
                out.append(none_payload(chunk, dcode))
                continue
            codes = []
            for li in range(m):
                i = b + li  # whole-tensor index
                xv = chunk[li]
                sign = 1 if xv < 0 else 0
                norm = norms[li // d]
                if norm == 0:
                    level = 0
                else:
                    # all fp32 (np.float32 scalars, one IEEE rounding per operation)
                    with np.errstate(over="ignore"):
                        F = _f32(F32(s) / norm)
                    if np.isinf(F):
                        F = F32(np.finfo(np.float32).max)
                    r = _f32(F32(abs(xv)) * F)
                    fl = _f32(np.floor(r))
                    p = _f32(r - fl)
                    # element i: half i % 2 (0 = low 16 bits) of stream word i // 2
                    hbits = (rw.word(i // 2) >> (16 * (i % 2))) & 0xFFFF
                    u = _f32(F32(hbits) * F32(2.0 ** -16))
                    level = int(fl) + (1 if u < p else 0)
                    level = min(level, s)
                codes.append((sign << (bbits - 1)) | level)
            C = (m * bbits + 7) // 8
            body = struct.pack("<B", bbits) + b"\0\0\0" + struct.pack("<I", d)
            body += b"".join(struct.pack("<I", int(bits_of(np.array([nv], dtype=np.float32))[0]))
                             for nv in norms)
            body += pack_bits(codes, bbits, C)
            out.append(header(7, dcode, 0, m) + body)
        info["escaped_chunks"] = escaped
        return out

    def _dgc(self, x, dcode, chunking, seed, name, step, rank, step_density, info,
             defer_sent=False):
        cfg = self.cfg
        n = self.n
        # 1. clipping
        g = x
        if cfg["clip_norm"] > 0:
            N = norm_f64(x)
            if N > cfg["clip_norm"]:
                f = to_f32(cfg["clip_norm"] / N)
                g = _f32(x * f)
                info["clipped"] = True
        # 2-3. momentum correction and accumulation
        m = cfg["momentum"]
        c2 = np.zeros(n, dtype=np.float32)
        if m > 0 and cfg.get("bias_correction"):
            # c' = (m c) + 1; v' = v + (u' / (c' (float)(1 - m))), each operation rounded to fp32
            u2 = _f32(_f32(F32(m) * self.u) + g)
            c2 = _f32(_f32(F32(m) * self.c) + F32(1.0))
            v2 = _f32(self.v + _f32(u2 / _f32(c2 * to_f32(1.0 - m))))
        elif m > 0:
            u2 = _f32(_f32(F32(m) * self.u) + g)
            v2 = _f32(self.v + u2)
        else:
            u2 = np.zeros(n, dtype=np.float32)
            v2 = _f32(self.v + g)
        # 4. selection
        k = selection_size(n, effective_density(cfg, step_density))
        keys = key_of(v2)
        sel = dgc_select(keys, k, n, cfg["sample_fraction"], seed, name, step, rank, info)
        info["k"] = k
        # spec: "the count always lies in [0.8k, 1.3k]" (before min_magnitude)
        assert (8 * k + 9) // 10 <= len(sel) <= (13 * k) // 10, info
        sel = apply_min_magnitude(sel, keys, cfg)
        info["nnz"] = int(len(sel))
        # 5. payload carries v'_i for i in S
        payloads = self._sparse_chunks(6, v2, sel, dcode, chunking)
        if defer_sent:
            self._deferred = ("dgc", u2, v2, c2)
            return payloads, info
        # 6. masking: v'_i = v'_i - value_i (as decoded), u'_i = 0
        v2 = v2.copy()
        u2 = u2.copy()
        c2 = c2.copy()
        if len(sel):
            if cfg["sparse_values"] == "fp16":
                sat = np.array([f32_bits_to_f16_saturating(int(u)) for u in bits_of(v2[sel])],
                               dtype=np.uint16)
                dec = f16_to_f32_array(sat)
            else:
                dec = v2[sel].copy()
            v2[sel] = _f32(v2[sel] - dec)
            u2[sel] = F32(0.0)
            c2[sel] = F32(0.0)
        # 7. commit
        self.u, self.v, self.c = u2, v2, c2
        return payloads, info

    # -- global selection (determinism §4.6b) ---------------------------------------------------
    def settle(self, own_payloads, selected, chunking):
        """After step(..., defer_sent=True): every entry of this rank's payload of a chunk that
        the chunk's global selection also holds gives up its value as sent (error feedback: e' =
        a + ((-1) * value); dgc: v' = v' - value, u' = 0); the rest stays. Commits."""
        cid = CODEC_ID[self.cfg["name"]]
        kind = self._deferred[0]
        if kind == "ef":
            e = self._deferred[1].copy()
        else:
            u2, v2, c2 = (a.copy() for a in self._deferred[1:])
        with np.errstate(all="ignore"):
            for (b, m), own, sel in zip(chunking, own_payloads, selected):
                oi, ov = sparse_entries(own, cid, m)
                si, _ = sparse_entries(sel, cid, m)
                keep = np.isin(oi, si)
                idx, vals = b + oi[keep], ov[keep]
                if kind == "ef":
                    e[idx] = _f32(e[idx] + _f32(F32(-1.0) * vals))
                else:
                    v2[idx] = _f32(v2[idx] - vals)
                    u2[idx] = F32(0.0)
                    c2[idx] = F32(0.0)
        if kind == "ef":
            self.e = e
        else:
            self.u, self.v, self.c = u2, v2, c2
        self._deferred = None

    # -- decoding ---------------------------------------------------------------------------------
    def decode(self, payloads, chunking, weight, out):
        cid = CODEC_ID[self.cfg["name"]]
        for (b, m), p in zip(chunking, payloads):
            decode_payload(p, cid, weight, out, b, m)


def sparse_entries(payload, expected_codec_id, n_chunk):
    """The (chunk-local indices, fp32 values as decoded) of a sparse payload, in index order; the
    `none` escape lists every element."""
    p = payload
    cid, flags = p[3], p[5]
    assert cid in (expected_codec_id, 0)
    if cid == 0:
        return np.arange(n_chunk, dtype=np.int64), np.frombuffer(p[16:], dtype="<f4").astype(
            np.float32)
    body = p[16:]
    nnz, w = struct.unpack_from("<IB", body, 0)
    G = ((nnz * w + 7) // 8 + 3) // 4 * 4
    gaps, _ = unpack_bits(body[8:8 + G], nnz, w)
    idx = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
    vb = body[8 + G:]
    if flags == 1:
        vals = f16_to_f32_array(np.frombuffer(vb, dtype="<u2")[:nnz])
    else:
        vals = np.frombuffer(vb, dtype="<f4")[:nnz].astype(np.float32)
    return idx, np.asarray(vals, dtype=np.float32)


def global_min_key(cfg, world):
    """The global selection's floor (determinism §4.6b): threshold, the key of fl32(W * tau) (the
    mean's magnitude at least tau; at least 1); topk and dgc, 0 (they keep a count)."""
    if cfg["name"] != "threshold":
        return 0
    with np.errstate(all="ignore"):
        t = np.array([F32(world) * to_f32(cfg["threshold"])], dtype=np.float32)
    return max(int(key_of(t)[0]), 1)


def layer_entries(payloads, codec_id, chunking):
    """The entries of one rank's payloads of a layer (one per chunk of `chunking`): what its
    contribution frames carry (determinism §4.6b)."""
    return sum(sparse_entries(p, codec_id, m)[0].size for p, (_, m) in zip(payloads, chunking))


def global_selection(codec_id, contributions, n_chunk, min_key=0, k=0, entries=()):
    """The owner's rule of the sparse allreduce (determinism §4.6b): the ranks' payloads of a
    chunk decoded with weight 1 in rank order into zeros (fp32); of the sums whose key is at least
    max(min_key, 1), the k_c of largest key (ties: the lower index) -- or every one when min_key
    is set (threshold). k_c = floor(D_c * K / D): D_c the entries of the ranks' payloads of the
    chunk, D the sum of `entries` (each rank's entries of the whole layer, layer_entries), K =
    min(k, floor(D / W)), k the codec's selection count for the layer. The result is a sparse
    payload of the codec with fp32 values (header dtype fp32)."""
    sums = np.zeros(n_chunk, dtype=np.float32)
    for p in contributions:
        decode_payload(p, codec_id, F32(1.0), sums, 0, n_chunk)
    if min_key:
        k_c = n_chunk
    else:
        assert len(entries) == len(contributions)
        d_c = sum(sparse_entries(p, codec_id, n_chunk)[0].size for p in contributions)
        d = sum(entries)
        cap = min(k, d // len(contributions))
        k_c = d_c * cap // d if d else 0
    keys = key_of(sums)
    cand = np.nonzero(keys >= max(min_key, 1))[0]
    chosen = np.sort(cand[np.lexsort((cand, -keys[cand]))][:k_c])
    return sparse_payload(codec_id, DTYPE_CODE["fp32"], n_chunk, [int(i) for i in chosen],
                          [int(u) for u in bits_of(sums[chosen])], False)


def add_payloads(codec_name, a, b):
    """Summable codecs: the payload of a + b in the compressed domain (determinism §4.7)."""
    if codec_name in ("fp16", "bf16"):  # §4.1: encode(decode(a) + decode(b)), fp32 sum
        assert a[:16] == b[:16] and len(a) == len(b)
        ha = np.frombuffer(a[16:], dtype="<u2")
        hb = np.frombuffer(b[16:], dtype="<u2")
        with np.errstate(all="ignore"):
            if codec_name == "fp16":
                sm = _f32(f16_to_f32_array(ha) + f16_to_f32_array(hb))
                h = f32_to_f16_array(sm)
            else:
                sm = _f32(bf16_to_f32_array(ha) + bf16_to_f32_array(hb))
                h = f32_to_bf16_array(sm)
        return a[:16] + h.astype("<u2").tobytes()
    if codec_name != "randomk":
        raise ValueError("add_payloads: %s" % codec_name)
    assert a[:16] == b[:16], "randomk add: headers differ"
    assert a[3] == 4
    fp16 = a[5] == 1
    assert a[16:56] == b[16:56], "randomk add: fields differ"
    nnz = struct.unpack_from("<Q", a, 48)[0]
    out = bytearray(a[:56])
    with np.errstate(all="ignore"):
        for j in range(nnz):
            if fp16:
                ua = f16_to_f32_bits(struct.unpack_from("<H", a, 56 + 2 * j)[0])
                ub = f16_to_f32_bits(struct.unpack_from("<H", b, 56 + 2 * j)[0])
            else:
                ua = struct.unpack_from("<I", a, 56 + 4 * j)[0]
                ub = struct.unpack_from("<I", b, 56 + 4 * j)[0]
            v = _f32(F32(f32_from_bits(np.uint32(ua))) + F32(f32_from_bits(np.uint32(ub))))
            u = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
            out += struct.pack("<H", f32_bits_to_f16_saturating(u)) if fp16 else struct.pack("<I", u)
    assert len(out) == len(a) == len(b)
    return bytes(out)


# ------------------------------------------------------------------------------------------------
# PowerSGD (determinism §4.12): two summable rounds, own memory, single chunk
# ------------------------------------------------------------------------------------------------
def powersgd_view(n, shape):
    if n == 0:
        return 0, 0
    if shape is not None and len(shape) >= 2:
        rows = shape[0]
        prod = 1
        for d in shape:
            prod *= d
        assert prod == n, "shape does not match n"
        return rows, n // rows
    cols = math.isqrt(n)
    if cols * cols < n:
        cols += 1
    return (n + cols - 1) // cols, cols


def canonical_dot(a, b):
    """Canonical fp64 sum (§2) of (double)a_t * (double)b_t; a, b: sequences of Python floats
    (fp32 values)."""
    return canonical_sum([x * y for x, y in zip(a, b)])


def orthonormalize(S, rows, r):
    """Modified Gram-Schmidt applied twice per column (§4.12 step 4). S: rows x r fp32 (numpy
    array); returns P-hat as a rows x r float32 array."""
    A = [[float(v) for v in S[:, j]] for j in range(r)]  # columns as Python floats (fp32 values)
    for j in range(r):
        col = A[j]
        for _ in range(2):
            for l in range(j):
                d = canonical_dot(A[l], col)
                col = [float(to_f32(col[i] - d * A[l][i])) for i in range(rows)]
        nu = math.sqrt(canonical_sum([v * v for v in col]))
        if nu != 0:
            col = [float(to_f32(v / nu)) for v in col]
        A[j] = col
    out = np.zeros((rows, r), dtype=np.float32)
    for j in range(r):
        out[:, j] = np.array(A[j], dtype=np.float32)
    return out


def powersgd_payload(dcode, n, rnd, rows, cols, r, F):
    body = struct.pack("<IIII", rows, cols, r, 0) + _f32(F).astype("<f4").tobytes()
    return bytes([0x4C, 0x57, 1, 11, dcode, 0, rnd, 0]) + struct.pack("<Q", n) + body


def powersgd_parse(p, n, rnd, r0):
    assert len(p) >= 32 and p[:3] == b"LW\x01" and p[3] == 11 and p[5] == 0 and p[6] == rnd
    assert p[7] == 0 and struct.unpack_from("<Q", p, 8)[0] == n
    rows, cols, r, res = struct.unpack_from("<IIII", p, 16)
    assert res == 0
    if n > 0:
        assert rows >= 1 and cols >= 1 and rows * cols >= n and (rows - 1) * cols < n
    assert r == min(r0, rows, cols)
    F = (rows if rnd == 0 else cols) * r
    assert len(p) == 32 + 4 * F
    vals = np.frombuffer(p[32:], dtype="<f4").astype(np.float32).reshape(-1, r) if r else \
        np.zeros((rows if rnd == 0 else cols, 0), dtype=np.float32)
    return rows, cols, r, vals


def powersgd_add(a, b):
    assert a[:32] == b[:32] and len(a) == len(b)
    va = np.frombuffer(a[32:], dtype="<f4").astype(np.float32)
    vb = np.frombuffer(b[32:], dtype="<f4").astype(np.float32)
    with np.errstate(all="ignore"):
        return a[:32] + _f32(va + vb).astype("<f4").tobytes()


class PowerSGD:
    """One rank's PowerSGD state for one tensor, and its step in the order of §4.12."""

    def __init__(self, r0, n):
        self.r0 = r0
        self.n = n
        self.e = np.zeros(n, dtype=np.float32)
        self.valid = False
        self.view = None  # (rows, cols, r) of the committed Q
        self.Q = None

    def begin(self, raw, dtype, seed, name, step, shape):
        """Steps 1-3: returns the round-0 payload; keeps M and Q for the rest of the step."""
        n = self.n
        x = widen(raw, dtype)
        self.dcode = DTYPE_CODE[dtype]
        rows, cols = powersgd_view(n, shape)
        r = min(self.r0, rows, cols)
        self.rows, self.cols, self.r = rows, cols, r
        with np.errstate(all="ignore"):
            M = _f32(x + self.e)
        self.M = M
        Mp = np.zeros(rows * cols, dtype=np.float32)
        Mp[:n] = M
        self.Mm = Mp.reshape(rows, cols) if n else np.zeros((0, 0), dtype=np.float32)
        if self.valid and self.view == (rows, cols, r):
            Q = self.Q.copy()
            fresh = [bool(np.all(Q[:, j] == 0)) for j in range(r)]
        else:
            Q = np.zeros((cols, r), dtype=np.float32)
            fresh = [True] * r
        rw = RandomWords(seed, name, step, SHARED_STREAM, PURPOSE_POWERSGD)
        for j in range(r):
            if fresh[j]:
                for k in range(cols):
                    u = rw.word(k * r + j) * 2.0 ** -32
                    Q[k, j] = to_f32(2.0 * u - 1.0)
        self.Qstep = Q
        self.redrawn = [j for j in range(r) if fresh[j]]
        Mrows = [[float(v) for v in self.Mm[i]] for i in range(rows)]
        Qcols = [[float(v) for v in Q[:, j]] for j in range(r)]
        P = np.zeros((rows, r), dtype=np.float32)
        for i in range(rows):
            for j in range(r):
                P[i, j] = to_f32(canonical_dot(Mrows[i], Qcols[j]))
        return powersgd_payload(self.dcode, n, 0, rows, cols, r, P)

    def round1(self, reduced0):
        rows, cols, r = self.rows, self.cols, self.r
        _, _, _, S = powersgd_parse(reduced0, self.n, 0, self.r0)
        Ph = orthonormalize(S, rows, r)
        Mcols = [[float(v) for v in self.Mm[:, k]] for k in range(cols)]
        Pcols = [[float(v) for v in Ph[:, j]] for j in range(r)]
        Ql = np.zeros((cols, r), dtype=np.float32)
        for k in range(cols):
            for j in range(r):
                Ql[k, j] = to_f32(canonical_dot(Mcols[k], Pcols[j]))
        return powersgd_payload(self.dcode, self.n, 1, rows, cols, r, Ql)

    def finish(self, reduced0, reduced1, weight):
        """Step 7: prepares and commits the next state (the step succeeded)."""
        v = powersgd_values(reduced0, reduced1, self.n, self.r0)
        w = F32(weight)
        _, _, _, T = powersgd_parse(reduced1, self.n, 1, self.r0)
        with np.errstate(all="ignore"):
            self.e = _f32(self.M - _f32(w * v))
            self.Q = _f32(w * T)
        self.valid = True
        self.view = (self.rows, self.cols, self.r)


def powersgd_values(reduced0, reduced1, n, r0):
    """Step 6: v for every real element (float32 array of n)."""
    rows, cols, r, S = powersgd_parse(reduced0, n, 0, r0)
    rows1, cols1, r1, T = powersgd_parse(reduced1, n, 1, r0)
    assert (rows, cols, r) == (rows1, cols1, r1)
    Ph = orthonormalize(S, rows, r)
    v = np.zeros(n, dtype=np.float32)
    Prow = [[float(x) for x in Ph[i]] for i in range(rows)]
    Trow = [[float(x) for x in T[k]] for k in range(cols)]
    for idx in range(n):
        i, k = divmod(idx, cols)
        v[idx] = to_f32(canonical_dot(Prow[i], Trow[k]))
    return v


def powersgd_decode(reduced0, reduced1, n, r0, weight, out):
    v = powersgd_values(reduced0, reduced1, n, r0)
    with np.errstate(all="ignore"):
        out[:] = _f32(out + _f32(F32(weight) * v))


philox_self_check()


# ------------------------------------------------------------------------------------------------
# Self-tests (python3 lwref.py): the reference checked against independent facts
# ------------------------------------------------------------------------------------------------
def _self_test():
    from fractions import Fraction

    philox_self_check()
    assert xxhash.xxh3_64_intdigest(b"") == 0x2D06800538D394C2  # XXH3-64 of the empty input
    rng = np.random.default_rng(1234)
    # fp16: against numpy's (correctly rounded, RNE) float16 cast for non-NaN values
    u = np.concatenate([rng.integers(0, 1 << 32, 200000, dtype=np.uint64).astype(np.uint32),
                        np.arange(0x33000000 - 64, 0x33000000 + 64, dtype=np.uint32),
                        np.arange(0x477FF000 - 64, 0x477FF000 + 64, dtype=np.uint32),
                        np.arange(0x387FE000 - 64, 0x387FE000 + 64, dtype=np.uint32)])
    u = u[(u & 0x7FFFFFFF) <= 0x7F800000]
    with np.errstate(all="ignore"):
        want = u.view(np.float32).astype(np.float16).view(np.uint16)
    got = np.array([f32_bits_to_f16(int(x)) for x in u], dtype=np.uint16)
    bad = np.nonzero(got != want)[0]
    assert len(bad) == 0, [(hex(int(u[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:5]]
    # fp16 widening: against numpy for every non-NaN half
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    h = h[(h & 0x7FFF) <= 0x7C00]
    w = np.array([f16_to_f32_bits(int(x)) for x in h], dtype=np.uint32)
    assert np.array_equal(w, h.view(np.float16).astype(np.float32).view(np.uint32))
    # bf16: the spec's u32 formula against exact rounding with Fractions (finite values)
    for x in list(rng.integers(0, 0x7F800000, 20000)) + [0x3F808000, 0x3F818000, 0x7F7F8000,
                                                         0x7F7FFFFF, 0x00008000, 0x00018000]:
        x = int(x)
        val = Fraction(_float_of_finite_bits(x))
        lo = x & 0xFFFF0000
        lo_v = Fraction(_float_of_finite_bits(lo))
        hi_v = Fraction(_float_of_finite_bits(lo + 0x10000)) if lo + 0x10000 < 0x7F800000 else \
            Fraction(2) ** 128  # the next "value" above bf16 max: rounds to Inf
        if val - lo_v < hi_v - val or (val - lo_v == hi_v - val and ((lo >> 16) & 1) == 0):
            exp = lo >> 16
        else:
            exp = (lo >> 16) + 1
        assert f32_bits_to_bf16(x) == exp, hex(x)
    # canonical sum vs exact sum (close) and vs a by-hand small example
    t = [float(v) for v in rng.standard_normal(10000)]
    assert abs(canonical_sum(t) - math.fsum(t)) < 1e-9
    assert canonical_sum([]) == 0.0 and canonical_sum([1e16, 1.0, -1e16]) == 0.0 and canonical_sum([1e16, -1e16, 1.0]) == 1.0
    assert canonical_sum([1e16] + [0.0] * 7 + [1.0]) == 1e16  # same accumulator: rounds away
    # selection size
    assert selection_size(0, 0.5) == 0 and selection_size(10, 0.01) == 1
    assert selection_size(1000, 0.0125) == 13 and selection_size(3001, 1.0 / 20.0) == 150
    # topk with error feedback: decoded + e' == x + e exactly (fp32 values)
    n = 1000
    c = Codec({"name": "topk", "density": 0.1, "sparse_values": "fp32", "error_feedback": None}, n)
    ch = chunk_ranges(n, 300, 1)
    for s in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        e0 = c.e.copy()
        p, _ = c.step(x, "fp32", ch, 0, "t", s, 0, None)
        dec = np.zeros(n, dtype=np.float32)
        c.decode(p, ch, F32(1.0), dec)
        assert np.count_nonzero(dec) == 100
        assert np.array_equal(_f32(dec + c.e), _f32(x + e0))
    # min_magnitude: the key floor is m rounded up to fp32; below it nothing is sent
    assert min_magnitude_key(0.0) == 0 and min_magnitude_key(None) == 0
    assert min_magnitude_key(1.0) == 0x3F800000
    assert min_magnitude_key(0.1) == 0x3DCCCCCD  # (float)0.1 is above 0.1 already
    assert min_magnitude_key(0.30000001192092896) == 0x3E99999A  # exactly (float)0.3: kept
    assert min_magnitude_key(float.fromhex("0x1.000001p0")) == 0x3F800001  # rounded up
    assert min_magnitude_key(1e-50) == 1 and min_magnitude_key(1e300) == 0x7F800000
    n = 1000
    x = (rng.standard_normal(n) * 1e-6).astype(np.float32)
    x[::10] = F32(3.0)
    for cfg in ({"name": "topk", "density": 0.5, "sparse_values": "fp32", "error_feedback": None,
                 "min_magnitude": 1e-3},
                {"name": "threshold", "threshold": 1e-30, "sparse_values": "fp32",
                 "error_feedback": None, "min_magnitude": 1e-3},
                {"name": "dgc", "density": 0.5, "momentum": 0.9, "clip_norm": 0.0,
                 "sample_fraction": 0.01, "sparse_values": "fp32", "error_feedback": None,
                 "min_magnitude": 1e-3}):
        c = Codec(cfg, n)
        p, info = c.step(x, "fp32", chunk_ranges(n, 300, 1), 0, "m", 0, 0, None)
        assert info["nnz"] == 100, (cfg["name"], info)
        kept = c.v if cfg["name"] == "dgc" else c.e
        small = np.ones(n, dtype=bool)
        small[::10] = False
        assert np.array_equal(kept[small], x[small]) and not np.any(kept[~small])
    # qsgd: levels within range, decoded mean close to the input (unbiased)
    n = 4096
    x = rng.standard_normal(n).astype(np.float32)
    acc = np.zeros(n, dtype=np.float64)
    reps = 40
    q = Codec({"name": "qsgd", "bits": 4, "bucket_size": 512, "error_feedback": None}, n)
    for s in range(reps):
        p, _ = q.step(x, "fp32", [(0, n)], 0, "q", s, 0, None)
        dec = np.zeros(n, dtype=np.float32)
        q.decode(p, [(0, n)], F32(1.0), dec)
        acc += dec
    assert abs(float(np.mean(acc / reps - x))) < 0.02
    # randomk: the selection word and the expected count (k on average)
    assert randomk_selection_word(1000, 10) == (10 * 2 ** 32 + 500) // 1000
    assert randomk_selection_word(1, 1) == 2 ** 32 and randomk_selection_word(0, 0) == 0
    n = 2000
    rk = Codec({"name": "randomk", "density": 0.05, "sparse_values": "fp32",
                "error_feedback": None}, n)
    x = rng.standard_normal(n).astype(np.float32)
    acc = np.zeros(n, dtype=np.float64)
    for s in range(200):
        p, info = rk.step(x, "fp32", chunk_ranges(n, 700, 1), 0, "r", s, s % 4, None)
        dec = np.zeros(n, dtype=np.float32)
        rk.decode(p, chunk_ranges(n, 700, 1), F32(1.0), dec)
        acc += dec
    assert abs(float(np.mean(acc / 200 - x))) < 0.05
    # terngrad: unbiased; onebit: each bucket's decoded sum equals its input sum (approximately)
    tg = Codec({"name": "terngrad", "bucket_size": 64, "error_feedback": None}, n)
    acc[:] = 0
    for s in range(100):
        p, _ = tg.step(x, "fp32", chunk_ranges(n, 640, 64), 0, "t", s, 1, None)
        dec = np.zeros(n, dtype=np.float32)
        tg.decode(p, chunk_ranges(n, 640, 64), F32(1.0), dec)
        acc += dec
    assert abs(float(np.mean(acc / 100 - x))) < 0.02
    ob = Codec({"name": "onebit", "bucket_size": 100, "error_feedback": False}, n)
    p, _ = ob.step(x, "fp32", chunk_ranges(n, 0, 100), 0, "o", 0, 0, None)
    dec = np.zeros(n, dtype=np.float32)
    ob.decode(p, chunk_ranges(n, 0, 100), F32(1.0), dec)
    for b in range(0, n, 100):
        assert abs(float(np.sum(dec[b:b + 100], dtype=np.float64)) -
                   float(np.sum(x[b:b + 100], dtype=np.float64))) < 1e-3
    # powersgd: exact (to fp32 rounding) on a rank-2 matrix held by two ranks, r = 2
    A = (rng.standard_normal((20, 2)) @ rng.standard_normal((2, 15))).astype(np.float32).ravel()
    B = _f32(A * F32(0.5))
    ranks = [PowerSGD(2, A.size), PowerSGD(2, A.size)]
    p0 = [c.begin(xx, "fp32", 0, "w", 0, (20, 15)) for c, xx in zip(ranks, (A, B))]
    s0 = powersgd_add(p0[0], p0[1])
    p1 = [c.round1(s0) for c in ranks]
    s1 = powersgd_add(p1[0], p1[1])
    out = np.zeros(A.size, dtype=np.float32)
    powersgd_decode(s0, s1, A.size, 2, 0.5, out)
    assert float(np.max(np.abs(out - _f32((A + B) * F32(0.5))))) < 1e-5
    print("lwref self-test ok")


if __name__ == "__main__":
    _self_test()
