// `randomk` (docs/determinism.md §4.7, docs/wire-format.md "randomk"): every element is selected
// independently with probability t / 2^32 from the SHARED Philox stream (stream 0xFFFFFFFF,
// purpose 3), so all ranks select the same elements of a (tensor, step), the indices never
// travel, and payloads add value by value (summable). The values are scaled by 2^32 / t, which
// makes the estimate unbiased. The payload carries what recomputing the selection needs (seed,
// name key, step, the chunk's whole-tensor start, t), because decodeChunk has no StepContext.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/codecs/randomk.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/select.h"

#include "kernels/simd/philox_simd-inl.h"

// The selection bits of a block of consecutive Philox groups, compiled for every target Highway
// knows and chosen at run time. Integer arithmetic only: the bits are the same on every target
// (checked against philoxBlock() in tests/kernels/randomk_test.cc, on every target).
HWY_BEFORE_NAMESPACE();
namespace lightwire::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

inline constexpr size_t kRandomkBlockGroups = 64;  // a multiple of every target's u32 lane count

/// Selection bits of the block's 4·kRandomkBlockGroups elements (element 4·g0 first): bit q of
/// bits[q / 64] is set iff word q < t (t < 2^32).
void RandomkMaskBlock(uint32_t step, uint32_t k0, uint32_t k1, uint32_t g0, uint32_t t,
                      uint64_t* HWY_RESTRICT bits) {
  HWY_ALIGN uint32_t words[4 * kRandomkBlockGroups];
  const uint32_t ctr[3] = {step, kSharedStream,
                           static_cast<uint32_t>(RandomPurpose::kRandomkIndices)};
  const uint32_t key[2] = {k0, k1};
  simd::HWY_NAMESPACE::philoxGroupsImpl(ctr, key, g0, kRandomkBlockGroups, words);
  const hn::ScalableTag<uint32_t> d;
  const hn::RebindToSigned<decltype(d)> di;
  const size_t N = hn::Lanes(d);
  // r < t (unsigned) <=> (t ^ 2^31) > (r ^ 2^31) (signed): signed compares exist on every target.
  const auto flip = hn::Set(d, 0x80000000u);
  const auto vt = hn::BitCast(di, hn::Xor(hn::Set(d, t), flip));
  uint8_t bytes[4 * kRandomkBlockGroups / 8 + 8] = {};
  for (size_t i = 0; i < 4 * kRandomkBlockGroups; i += N) {
    const auto r = hn::BitCast(di, hn::Xor(hn::Load(d, words + i), flip));
    const auto m = hn::Gt(vt, r);
    if (N >= 8) {
      hn::StoreMaskBits(di, m, bytes + i / 8);
    } else {
      uint8_t b[8] = {};
      hn::StoreMaskBits(di, m, b);
      bytes[i / 8] = static_cast<uint8_t>(bytes[i / 8] | (b[0] << (i % 8)));
    }
  }
  for (size_t w = 0; w < kRandomkBlockGroups / 16; ++w) {
    uint64_t v = 0;
    for (size_t k = 0; k < 8; ++k) v |= uint64_t{bytes[8 * w + k]} << (8 * k);
    bits[w] = v;
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace lightwire::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace lightwire::kernels {

HWY_EXPORT(RandomkMaskBlock);

namespace {

/// The best target's RandomkMaskBlock, chosen at run time.
void randomkMaskBlock(uint32_t step, uint32_t k0, uint32_t k1, uint32_t g0, uint32_t t,
                      uint64_t* bits) {
  HWY_DYNAMIC_DISPATCH(RandomkMaskBlock)(step, k0, k1, g0, t, bits);
}

constexpr size_t kRandomkHeaderBytes = 56;
constexpr uint8_t kFlagF16Values = 0x01;
constexpr uint64_t kFullWord = uint64_t{1} << 32;  // t = 2^32: every element is selected

/// What decides the selection of a chunk (the fields of the payload body, §4.7).
struct RandomkSelection {
  uint32_t seed = 0;
  uint32_t name_key = 0;
  uint32_t step = 0;
  uint64_t start = 0;  // whole-tensor index of the chunk's first element
  uint64_t t = 0;      // element selected iff its word < t; 0..2^32
};

/// The selection word for k of n elements (§4.7 step 2): 0 if n = 0, else
/// max(1, floor((k·2^32 + floor(n/2)) / n)), exactly.
uint64_t selectionWord(uint64_t n, uint64_t k) {
  if (n == 0) return 0;
  const unsigned __int128 num = (static_cast<unsigned __int128>(k) << 32) + (n / 2);
  const uint64_t t = static_cast<uint64_t>(num / n);
  return t == 0 ? 1 : t;
}

/// s = (float)(2^32 / (double)t), the unbiasing scale (t > 0).
float selectionScale(uint64_t t) {
  return static_cast<float>(4294967296.0 / static_cast<double>(t));
}

constexpr size_t kBlockGroups = HWY_NAMESPACE::kRandomkBlockGroups;
constexpr size_t kBlockElements = 4 * kBlockGroups;

/// Bits of a 64-bit word that cover block positions [lo, hi), the word covering [64w, 64w + 64).
inline uint64_t rangeBits(uint64_t lo, uint64_t hi, uint64_t w) {
  const uint64_t a = std::max(lo, 64 * w), b = std::min(hi, 64 * w + 64);
  if (a >= b) return 0;
  const uint64_t width = b - a;
  const uint64_t ones = width == 64 ? ~uint64_t{0} : ((uint64_t{1} << width) - 1);
  return ones << (a - 64 * w);
}

constexpr size_t kBlockWords = kBlockElements / 64;

/// Calls block(j0, bits) for the blocks covering chunk-local [lo, hi) in order (0 < t < 2^32):
/// bit q of bits[q / 64] is set iff chunk-local element j0 + q is selected and lies in [lo, hi).
/// j0 is computed modulo 2^64 (the first block may start before the chunk).
template <typename Block>
inline void forEachBlock(const RandomkSelection& s, uint64_t lo, uint64_t hi, Block&& block) {
  const uint32_t t = static_cast<uint32_t>(s.t);
  uint64_t bits[kBlockWords];
  // Whole-tensor indices [a, b), in blocks of kBlockGroups groups starting at i's group.
  const uint64_t a = s.start + lo, b = s.start + hi;
  uint64_t i = a;
  while (i < b) {
    const uint64_t g0 = i / 4;
    randomkMaskBlock(s.step, s.seed, s.name_key, static_cast<uint32_t>(g0), t, bits);
    const uint64_t first = g0 * 4;  // element of block position 0
    // b - first, not first + kBlockElements: no overflow when the chunk ends near 2^64.
    const uint64_t end = b - first > kBlockElements ? first + kBlockElements : b;
    for (uint64_t w = 0; w < kBlockWords; ++w) bits[w] &= rangeBits(i - first, end - first, w);
    block(first - s.start, bits);
    i = end;
  }
}

/// Number of blocks forEachBlock visits for chunk-local [0, n) (n > 0).
inline uint64_t blockCount(const RandomkSelection& s, uint64_t n) {
  const uint64_t first = (s.start / 4) * 4;
  return ((s.start - first) + n + (kBlockElements - 1)) / kBlockElements;  // start - first < 4
}

/// Calls take(j) for the selected chunk-local elements of a block, in increasing order.
template <typename Take>
inline void takeBits(uint64_t j0, const uint64_t* bits, Take&& take) {
  for (uint64_t w = 0; w < kBlockWords; ++w) {
    uint64_t m = bits[w];
    while (m != 0) {
      take(j0 + 64 * w + static_cast<uint64_t>(std::countr_zero(m)));
      m &= m - 1;
    }
  }
}

/// Calls take(j) for every selected chunk-local j in [lo, hi), in increasing order.
template <typename Take>
inline void forEachSelected(const RandomkSelection& s, uint64_t lo, uint64_t hi, Take&& take) {
  if (lo >= hi || s.t == 0) return;
  if (s.t >= kFullWord) {
    for (uint64_t j = lo; j < hi; ++j) take(j);
    return;
  }
  forEachBlock(s, lo, hi, [&](uint64_t j0, const uint64_t* bits) { takeBits(j0, bits, take); });
}

/// The fields of a randomk payload after its header.
struct RandomkBody {
  RandomkSelection sel;
  uint64_t nnz = 0;
  size_t value_bytes = 4;
};

/// Validates the body fields and the exact length of a randomk payload (header already read).
Result<RandomkBody> readBody(std::span<const uint8_t> payload, const PayloadHeader& h) {
  if (payload.size() < kRandomkHeaderBytes) {
    return dataLoss("randomk payload truncated: " + std::to_string(payload.size()) +
                    " bytes, its fixed fields need " + std::to_string(kRandomkHeaderBytes));
  }
  const uint8_t* p = payload.data();
  RandomkBody body;
  body.sel.seed = loadU32(p + 16);
  body.sel.name_key = loadU32(p + 20);
  body.sel.step = loadU32(p + 24);
  if (loadU32(p + 28) != 0) return dataLoss("randomk payload has a non-zero reserved field");
  body.sel.start = loadU64(p + 32);
  body.sel.t = loadU64(p + 40);
  body.nnz = loadU64(p + 48);
  body.value_bytes = (h.flags & kFlagF16Values) ? 2 : 4;
  const uint64_t n = h.elements;
  if (body.sel.t > kFullWord) {
    return dataLoss("randomk payload selection word " + std::to_string(body.sel.t) +
                    " exceeds 2^32");
  }
  if (body.sel.start > std::numeric_limits<uint64_t>::max() - n) {
    return dataLoss("randomk payload start " + std::to_string(body.sel.start) + " plus " +
                    std::to_string(n) + " elements overflows");
  }
  if (body.nnz > n) {
    return dataLoss("randomk payload claims nnz " + std::to_string(body.nnz) + " > " +
                    std::to_string(n) + " elements");
  }
  // nnz <= n = the caller's output size, so nnz · 4 cannot overflow.
  const uint64_t need = kRandomkHeaderBytes + body.value_bytes * body.nnz;
  if (payload.size() != need) {
    return dataLoss("randomk payload with nnz " + std::to_string(body.nnz) + " must be " +
                    std::to_string(need) + " bytes, got " + std::to_string(payload.size()));
  }
  return body;
}

constexpr CodecTraits kRandomkTraits{.id = CodecId::kRandomk,
                                     .name = "randomk",
                                     .summable = true,
                                     .sparse = false,
                                     .own_memory = false,
                                     .default_error_feedback = false,
                                     .uses_density = true,
                                     .staleness_safe = false};

class RandomkCodec final : public Codec {
 public:
  RandomkCodec(const CodecConfig& c, double density) : config_(c), density_(density) {}

  const CodecTraits& traits() const override { return kRandomkTraits; }
  const CodecConfig& config() const override { return config_; }
  size_t workspaceBytes(const Chunking&) const override {
    return WorkspaceCarver::bytesFor({sizeof(uint64_t)});
  }
  size_t maxPayloadBytes(size_t n) const override {
    return kRandomkHeaderBytes + dtypeSize(config_.sparse_values) * n;
  }

  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, ConstTensor, CodecState&,
                   std::span<std::byte> workspace) const override {
    double density = density_;
    if (ctx.density) {
      LW_RETURN_IF_ERROR(checkDensity(*ctx.density, "randomk: step density"));
      density = *ctx.density;
    }
    const size_t n = chunking.elements;
    WorkspaceCarver carver(workspace);
    carver.take<uint64_t>(1)[0] = selectionWord(n, selectionSize(n, density));
    return Status::ok();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int /*round*/, std::span<const uint8_t>, ConstTensor input,
                               CodecState&, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    WorkspaceCarver carver(workspace);
    const uint64_t t = carver.take<uint64_t>(1)[0];
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    const RandomkSelection sel{ctx.seed, ctx.name_key, static_cast<uint32_t>(ctx.step), begin, t};
    const bool f16 = config_.sparse_values == DType::kF16;
    const size_t vb = f16 ? 2 : 4;
    const float scale = t == 0 ? 1.0f : selectionScale(t);
    uint8_t* vals = out.data() + kRandomkHeaderBytes;

    // Each task writes its selected values from its own first slot on (count <= position), then
    // the runs are compacted in task order: the bytes never depend on the thread count.
    const TaskSplit split = TaskSplit::of(len);
    std::array<size_t, TaskSplit::kMaxTasks> counts{};
    visitDType(input.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      const void* data = input.data;
      runTasks(ctx.stream, split, [&](size_t task) {
        const size_t lo = split.begin(task), hi = split.end(task);
        uint8_t* dst = vals + vb * lo;
        size_t c = 0;
        if (f16) {
          forEachSelected(sel, lo, hi, [&](uint64_t j) {
            const float v = loadWidened<D>(data, begin + j) * scale;
            storeU16(dst + 2 * c, floatToHalfSaturating(v));
            ++c;
          });
        } else {
          forEachSelected(sel, lo, hi, [&](uint64_t j) {
            const float v = loadWidened<D>(data, begin + j) * scale;
            storeF32(dst + 4 * c, v);
            ++c;
          });
        }
        counts[task] = c;
      });
    });
    size_t nnz = 0;
    for (size_t task = 0; task < split.tasks; ++task) {
      const size_t from = split.begin(task);
      if (nnz != from && counts[task] > 0) {
        std::memmove(vals + vb * nnz, vals + vb * from, vb * counts[task]);
      }
      nnz += counts[task];
    }

    uint8_t* p = out.data();
    writeHeader(p, {CodecId::kRandomk, input.dtype, f16 ? kFlagF16Values : uint8_t{0}, 0, len});
    storeU32(p + 16, sel.seed);
    storeU32(p + 20, sel.name_key);
    storeU32(p + 24, sel.step);
    storeU32(p + 28, 0);
    storeU64(p + 32, sel.start);
    storeU64(p + 40, sel.t);
    storeU64(p + 48, nnz);
    return kRandomkHeaderBytes + vb * nnz;
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    auto header = readHeader(payload, CodecId::kRandomk, out_elements, kFlagF16Values);
    if (!header) return header.status();
    if (header->codec == CodecId::kNone) return decodeDenseF32(payload, *header, weight, out);
    auto body = readBody(payload, *header);
    if (!body) return body.status();
    const uint64_t n = header->elements;
    const RandomkSelection& sel = body->sel;
    // Pass 1 computes the selection bits of the chunk once, keeps them in a per-thread buffer
    // (grown once, then reused: no allocation in the steady state) and checks their count; only
    // then does pass 2 add the values.
    const bool partial = n > 0 && sel.t != 0 && sel.t < kFullWord;
    thread_local std::vector<uint64_t> cache;
    uint64_t count = 0;
    if (partial) {
      cache.resize(std::max<size_t>(cache.size(), blockCount(sel, n) * kBlockWords));
      uint64_t* dst = cache.data();
      forEachBlock(sel, 0, n, [&](uint64_t, const uint64_t* bits) {
        for (uint64_t w = 0; w < kBlockWords; ++w) {
          count += static_cast<uint64_t>(std::popcount(bits[w]));
          dst[w] = bits[w];
        }
        dst += kBlockWords;
      });
    } else {
      count = sel.t == 0 ? 0 : n;
    }
    if (count != body->nnz) {
      return dataLoss("randomk payload carries " + std::to_string(body->nnz) +
                      " values but its selection fields select " + std::to_string(count));
    }
    const uint8_t* vals = payload.data() + kRandomkHeaderBytes;
    const bool f16 = body->value_bytes == 2;
    size_t c = 0;
    auto add = [&](uint64_t j) {
      const float v = f16 ? halfToFloat(loadU16(vals + 2 * c)) : loadF32(vals + 4 * c);
      out[j] = out[j] + weight * v;
      ++c;
    };
    if (partial) {
      const uint64_t blocks = blockCount(sel, n);
      uint64_t j0 = (sel.start / 4) * 4 - sel.start;  // modulo 2^64, as in forEachBlock
      for (uint64_t k = 0; k < blocks; ++k, j0 += kBlockElements) {
        takeBits(j0, cache.data() + k * kBlockWords, add);
      }
    } else if (sel.t != 0) {
      for (uint64_t j = 0; j < n; ++j) add(j);
    }
    return Status::ok();
  }

  Result<size_t> addPayloads(std::span<const uint8_t> a, std::span<const uint8_t> b,
                             std::span<uint8_t> out) const override {
    if (a.size() < kHeaderBytes || b.size() < kHeaderBytes) {
      return dataLoss("randomk payload to add is shorter than its header");
    }
    const uint64_t n = loadU64(a.data() + 8), n_b = loadU64(b.data() + 8);
    if (n != n_b) {
      return dataLoss("randomk payloads to add hold " + std::to_string(n) + " and " +
                      std::to_string(n_b) + " elements");
    }
    auto ha = readHeader(a, CodecId::kRandomk, n, kFlagF16Values);
    if (!ha) return ha.status();
    auto hb = readHeader(b, CodecId::kRandomk, n, kFlagF16Values);
    if (!hb) return hb.status();
    if (ha->codec != CodecId::kRandomk || hb->codec != CodecId::kRandomk) {
      return dataLoss("randomk payloads to add must both be in the randomk layout");
    }
    if (ha->dtype != hb->dtype || ha->flags != hb->flags) {
      return dataLoss("randomk payloads to add differ in source dtype or value type");
    }
    auto ba = readBody(a, *ha);
    if (!ba) return ba.status();
    auto bb = readBody(b, *hb);
    if (!bb) return bb.status();
    const RandomkSelection &sa = ba->sel, &sb = bb->sel;
    if (sa.seed != sb.seed || sa.name_key != sb.name_key || sa.step != sb.step ||
        sa.start != sb.start || sa.t != sb.t || ba->nnz != bb->nnz) {
      return dataLoss(
          "randomk payloads to add select different elements (seed, name key, step, "
          "start, selection word or nnz differ)");
    }
    if (out.size() < a.size()) {
      return outOfRange("payload buffer of " + std::to_string(out.size()) + " bytes, needs " +
                        std::to_string(a.size()));
    }
    // Value j is read before it is written and the layouts are equal, so `out` may be `a` or `b`.
    const uint8_t* va = a.data() + kRandomkHeaderBytes;
    const uint8_t* vb = b.data() + kRandomkHeaderBytes;
    uint8_t* vo = out.data() + kRandomkHeaderBytes;
    const uint64_t nnz = ba->nnz;
    if (ba->value_bytes == 2) {
      for (uint64_t j = 0; j < nnz; ++j) {
        const float sum = halfToFloat(loadU16(va + 2 * j)) + halfToFloat(loadU16(vb + 2 * j));
        storeU16(vo + 2 * j, floatToHalfSaturating(sum));
      }
    } else {
      for (uint64_t j = 0; j < nnz; ++j) {
        storeF32(vo + 4 * j, loadF32(va + 4 * j) + loadF32(vb + 4 * j));
      }
    }
    if (out.data() != a.data()) std::memmove(out.data(), a.data(), kRandomkHeaderBytes);
    return a.size();
  }

 private:
  CodecConfig config_;
  double density_;
};

LW_REGISTER_CODEC(randomk, kRandomkTraits,
                  [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
                    auto density = configuredDensity(c, "randomk");
                    if (!density) return density.status();
                    LW_RETURN_IF_ERROR(checkSparseValues(c, "randomk"));
                    return std::unique_ptr<Codec>(new RandomkCodec(c, *density));
                  });

}  // namespace
}  // namespace lightwire::kernels
#endif  // HWY_ONCE
