// `dgc`, Deep Gradient Compression (docs/determinism.md §4.4): local clipping, momentum
// correction (optionally bias-corrected after masking), accumulation, a sampled threshold whose
// count is accepted within [0.8k, 1.3k] (exact top-k otherwise), and momentum factor masking. Keeps
// its own state (u then v with momentum, then c with bias correction; v alone without momentum),
// so it is never wrapped in error feedback. A step computes v' into the work area
// (u' is not stored); commitState() recomputes u' and v' in place and masks what was sent
// (docs/determinism.md "4.6c Atomic steps (one copy of the state)").

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/reduce.h"
#include "kernels/registry.h"
#include "kernels/select.h"

namespace lightwire::kernels {
namespace {

using U128 = unsigned __int128;

constexpr size_t kExactMaxElements = 32768;
constexpr size_t kMinSamples = 1024;
constexpr int kMaxRefinements = 3;

constexpr CodecTraits kDgcTraits{.id = CodecId::kDgc,
                                 .name = "dgc",
                                 .summable = false,
                                 .sparse = true,
                                 .own_memory = true,
                                 .default_error_feedback = false,
                                 .uses_density = true,
                                 .uses_min_magnitude = true};

class DgcCodec final : public Codec {
 public:
  DgcCodec(const CodecConfig& c, double density)
      : config_(c), density_(density), min_key_(minMagnitudeKey(c.min_magnitude)) {}

  const CodecTraits& traits() const override { return kDgcTraits; }
  const CodecConfig& config() const override { return config_; }
  /// u then v with momentum, then c with bias correction; v alone without momentum (u' would be
  /// zero everywhere: not stored, not written, which saves a quarter of the fused pass's memory
  /// traffic).
  using Codec::stateFloats;
  size_t stateFloats(size_t n, std::span<const uint64_t>) const override {
    return hasMomentum() ? (config_.bias_correction ? 3 * n : 2 * n) : n;
  }
  size_t workspaceBytes(const Chunking& c) const override {
    const size_t n = c.elements;
    return SelectWorkspace::bytes(n) +
           WorkspaceCarver::bytesFor({blocks(n) * sizeof(double), samples(n) * sizeof(uint32_t),
                                      samples(n) * sizeof(uint32_t), sizeof(Memo)});
  }
  size_t maxPayloadBytes(size_t n) const override {
    return sparseMaxPayloadBytes(n, config_.sparse_values);
  }
  std::optional<size_t> nominalPayloadBytes(size_t n,
                                            std::optional<double> density) const override {
    // k = density * n pairs; an index costs at most 4 bytes (gap coding usually needs less).
    const double d = density.value_or(density_);
    const size_t k = std::min(n, static_cast<size_t>(std::ceil(d * static_cast<double>(n))));
    return std::min(maxPayloadBytes(n), 64 + k * (4 + dtypeSize(config_.sparse_values)));
  }

  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                   CodecState& state, std::span<std::byte> workspace) const override {
    const size_t n = chunking.elements;
    double density = density_;
    if (ctx.density) {
      LW_RETURN_IF_ERROR(checkDensity(*ctx.density, "dgc: step density"));
      density = *ctx.density;
    }
    WorkspaceCarver carver(workspace);
    const SelectWorkspace ws = SelectWorkspace::carve(carver, n);
    const std::span<double> block_sums = carver.take<double>(blocks(n));
    const std::span<uint32_t> sample_keys = carver.take<uint32_t>(samples(n));
    const std::span<uint32_t> sample_scratch = carver.take<uint32_t>(samples(n));
    Memo* memo = carver.take<Memo>(1).data();
    *memo = Memo{};
    if (n == 0) {
      *ws.plan = SelectionPlan{};
      return Status::ok();
    }

    float* vn = state.work(n);  // v'; u' is not kept (commitState() recomputes it)

    // 1. Clipping: the canonical fp64 norm of x over the whole tensor.
    ConstTensor x = input;
    bool clip = false;
    float factor = 1.0f;
    if (config_.clip_norm > 0.0) {
      if (input.dtype != DType::kF32) {  // widen into v' (overwritten element-wise below)
        forEach(ctx.stream, n,
                [&](size_t lo, size_t hi) { widenToFloat(input.slice(lo, hi - lo), vn + lo); });
        x = ConstTensor{vn, n, DType::kF32};
      }
      const double norm =
          canonicalNorm(static_cast<const float*>(x.data), n, ctx.stream, block_sums);
      if (norm > config_.clip_norm) {
        clip = true;
        factor = static_cast<float>(config_.clip_norm / norm);
      }
    }
    *memo = Memo{clip, factor};

    // 2–3. Momentum correction and accumulation, in the spec's operation order (no FMA), fused
    // with the selection's first count: the sample is drawn first (v'_i of a sampled i is
    // computed from x_i, u_i, v_i alone), so the one pass that writes u' and v' also counts and
    // lists the elements at or above the first sampled threshold. When that count is accepted
    // (nearly always), the list is the selection and encoding reads only it.
    DgcPass pass = passOver(state.current(), n);
    pass.vn = vn;
    pass.clip = clip;
    pass.factor = factor;
    const size_t k = selectionSize(n, density);
    const ConstTensor acc{vn, n, DType::kF32};
    const bool sampled = n > kExactMaxElements;
    const bool listable = sampled && n <= size_t{0xFFFFFFFFu};
    uint64_t r = 0;
    if (listable) {
      r = initialRank(n, k, sample_keys.size());
      sampleKeys(ctx, x, pass, n, sample_keys, sample_scratch);
      pass.threshold = sampleAt(sample_keys, r);
    }
    const TaskSplit split = TaskSplit::of(n);
    std::array<uint64_t, TaskSplit::kMaxTasks> counts{};
    uint32_t* slots = ws.slots.data();
    visitDType(x.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      runTasks(ctx.stream, split, [&](size_t t) {
        const size_t lo = split.begin(t), hi = split.end(t);
        if constexpr (D == DType::kF32) {
          DgcPass p = pass;
          p.x = static_cast<const float*>(x.data);
          counts[t] = dgcFusedPassF32(p, lo, hi, slots + lo);
        } else {
          counts[t] = fusedPassScalar<D>(pass, x.data, lo, hi, slots + lo);
        }
      });
    });
    // min_magnitude (§4.2): whichever path selected S, elements below the floor stay in v'.
    auto done = [&] {
      applyMinKey(acc, min_key_, ws.slots, ws.plan);
      return Status::ok();
    };
    if (!listable) {
      if (!sampled || !sampledSelection(ctx, vn, n, k, sample_keys, ws.plan)) {
        selectExact(acc, k, ctx.stream, ws, ws.plan);
      }
      return done();
    }

    // 4. Selection on key(v'): the first count is the fused pass's.
    uint64_t c = 0;
    for (size_t t = 0; t < split.tasks; ++t) c += counts[t];
    const uint64_t lo = (U128{8} * k + 9) / 10;
    const uint64_t hi = (U128{13} * k) / 10;
    if (lo <= c && c <= hi) {
      uint64_t listed = 0;
      for (size_t t = 0; t < split.tasks; ++t) {
        if (listed != split.begin(t) && counts[t] > 0) {
          std::memmove(slots + listed, slots + split.begin(t), counts[t] * sizeof(uint32_t));
        }
        listed += counts[t];
      }
      *ws.plan = SelectionPlan{pass.threshold, n, false, true, listed};
      return done();
    }
    if (!refine(ctx, vn, n, k, sample_keys, r, pass.threshold, c, ws.plan)) {
      selectExact(acc, k, ctx.stream, ws, ws.plan);
    }
    return done();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int /*round*/, std::span<const uint8_t>, ConstTensor input,
                               CodecState& state, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    const size_t n = chunking.elements;
    WorkspaceCarver carver(workspace);
    const SelectWorkspace ws = SelectWorkspace::carve(carver, n);
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    const ConstTensor acc{state.work(n), n, DType::kF32};
    const bool listed = ws.plan->has_list;
    const std::span<uint32_t> indices =
        listed ? ws.slots.first(ws.plan->listed) : ws.slots.subspan(begin, len);
    auto written =
        listed ? writeSparsePayloadFromList(CodecId::kDgc, input.dtype, config_.sparse_values,
                                            indices, acc, begin, len, ctx.stream, out)
               : writeSparsePayload(CodecId::kDgc, input.dtype, config_.sparse_values, *ws.plan,
                                    acc, begin, len, indices, ctx.stream, out);
    if (!written) return written.status();
    return written->bytes;
  }

  /// Steps 2–3 in place (u = u', v = v', c = c', the same arithmetic as the fused pass, with the
  /// clipping analyze() decided), then step 6, momentum factor masking of what was sent (the value
  /// as decoded): v −= value, u = 0, c = 0 — under a global selection only where the selection
  /// kept it.
  Status doCommitState(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                       std::span<const std::span<const uint8_t>> sent,
                       std::span<const std::span<const uint8_t>> selected, CodecState& state,
                       std::span<std::byte> workspace, WriteBack write_back) const override {
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    WorkspaceCarver carver(workspace);
    SelectWorkspace::carve(carver, n);
    carver.take<double>(blocks(n));
    carver.take<uint32_t>(samples(n));
    carver.take<uint32_t>(samples(n));
    const Memo memo = carver.take<Memo>(1)[0];
    const bool momentum = hasMomentum();
    float* u = momentum ? state.mutableCurrent() : nullptr;
    float* v = momentum ? u + n : state.mutableCurrent();
    float* cb = momentum && config_.bias_correction ? v + n : nullptr;
    DgcPass pass = passOver(state.current(), n);
    pass.clip = memo.clip;
    pass.factor = memo.factor;
    pass.un = u;
    pass.vn = v;
    visitDType(input.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      forEach(ctx.stream, n, [&](size_t lo, size_t hi) {
        if constexpr (D == DType::kF32) {
          DgcPass p = pass;
          p.x = static_cast<const float*>(input.data);
          dgcStatePassF32(p, cb, lo, hi);  // reads u_i, c_i, v_i, x_i before they change
        } else {
          for (size_t i = lo; i < hi; ++i) {
            dgcStoreNext(pass, cb, i, loadWidened<D>(input.data, i));  // reads before it writes
          }
        }
        if (write_back) {  // x[lo, hi) read above
          std::memmove(write_back.to + lo, write_back.from + lo, (hi - lo) * sizeof(float));
        }
      });
    });
    std::vector<std::string> errors(sent.size());
    forEachChunk(ctx.stream, sent.size(), [&](size_t c) {
      const size_t begin = chunking.begin(c), len = chunking.size(c);
      auto mask = [&](size_t i, float value) {
        v[begin + i] = v[begin + i] - value;
        if (u != nullptr) u[begin + i] = 0.0f;
        if (cb != nullptr) cb[begin + i] = 0.0f;
      };
      Status st;
      if (selected.empty()) {
        // Every entry sent: its value is v'_i as sent (fp16-rounded with fp16 values). The
        // entries' vectors are the thread's, reused from commit to commit.
        thread_local std::vector<uint32_t> indices;
        thread_local std::vector<float> values;
        st = readSparseEntries(sent[c], CodecId::kDgc, len, indices, values);
        for (size_t j = 0; st.isOk() && j < indices.size(); ++j) mask(indices[j], values[j]);
      } else {
        st = forEachSettled(CodecId::kDgc, sent[c], selected[c], len, mask);
      }
      if (!st.isOk()) errors[c] = "chunk " + std::to_string(c) + ": " + st.message();
    });
    for (const auto& err : errors) {
      if (!err.empty()) return internalError("dgc could not settle its payload: " + err);
    }
    return Status::ok();
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    return decodeSparsePayload(payload, CodecId::kDgc, weight, out, out_elements);
  }

  bool selectsGlobally() const override { return true; }
  size_t selectionCount(size_t n, std::optional<double> density) const override {
    return selectionSize(n, density.value_or(density_));
  }

  Status checkSelection(const Chunking& chunking, size_t chunk, std::span<const uint8_t> sent,
                        std::span<const uint8_t> selected) const override {
    return forEachSettled(CodecId::kDgc, sent, selected, chunking.size(chunk),
                          [](size_t, float) {});
  }

  /// Steps 1–3 of doAnalyze (clipping, momentum correction, accumulation), bit for bit, then
  /// everything accumulated is sent: out = v'. commitFlush() zeroes u, v (and c).
  Status doFlush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                 CodecState& state, float* out) const override {
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    DgcPass pass = passOver(state.current(), n);
    ConstTensor x = input;
    if (config_.clip_norm > 0.0) {
      if (input.dtype != DType::kF32) {  // widen into out (overwritten element-wise below)
        forEach(ctx.stream, n,
                [&](size_t lo, size_t hi) { widenToFloat(input.slice(lo, hi - lo), out + lo); });
        x = ConstTensor{out, n, DType::kF32};
      }
      // The canonical norm does not depend on the stream (block sums go sequential here).
      const double norm = canonicalNorm(static_cast<const float*>(x.data), n, nullptr);
      if (norm > config_.clip_norm) {
        pass.clip = true;
        pass.factor = static_cast<float>(config_.clip_norm / norm);
      }
    }
    visitDType(x.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      forEach(ctx.stream, n, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) out[i] = accumulatedAt<D>(pass, x.data, i);
      });
    });
    return Status::ok();
  }
  void commitFlush(CodecState& state, size_t) const override { state.reset(); }

  /// Σ v_i² of the committed accumulated velocity (not the momentum u).
  double residualNorm2(const CodecState& state, size_t n) const override {
    if (n == 0 || state.floats() != stateFloats(n)) return 0.0;
    const float* v = hasMomentum() ? state.current() + n : state.current();
    return canonicalSum(v, n, ReduceTerm::kSquare);
  }

 private:
  /// What commitState() needs of analyze(): whether it clipped, and by what factor.
  struct Memo {
    bool clip = false;
    float factor = 1.0f;
  };

  bool hasMomentum() const { return config_.momentum > 0.0; }

  /// The fused pass's parameters over the committed state `current` (u, v, c as laid out).
  DgcPass passOver(const float* current, size_t n) const {
    DgcPass p;
    p.momentum = hasMomentum();
    p.m = static_cast<float>(config_.momentum);
    p.u = p.momentum ? current : nullptr;
    p.v = p.momentum ? current + n : current;
    p.bias = p.momentum && config_.bias_correction;
    p.c = p.bias ? current + 2 * n : nullptr;
    p.w = static_cast<float>(1.0 - config_.momentum);
    return p;
  }

  /// fn(c) for every chunk c < chunks, in parallel.
  static void forEachChunk(CpuStream* stream, size_t chunks,
                           const std::function<void(size_t)>& fn) {
    parallelFor(stream, chunks, 1, [&](size_t lo, size_t hi) {
      for (size_t c = lo; c < hi; ++c) fn(c);
    });
  }
  static size_t blocks(size_t n) { return (n + kReduceBlock - 1) / kReduceBlock; }

  /// M = max(1024, ceil(f · n)); 0 where the exact path is always taken.
  size_t samples(size_t n) const {
    if (n <= kExactMaxElements) return 0;
    const double m = std::ceil(config_.sample_fraction * static_cast<double>(n));
    return std::max(kMinSamples, static_cast<size_t>(m));
  }

  static void forEach(CpuStream* stream, size_t n, const std::function<void(size_t, size_t)>& fn) {
    parallelFor(stream, n, size_t{1} << 16, fn);
  }

  /// v'_i of element i (steps 1–3), exactly as the fused pass computes it.
  template <DType D>
  static float accumulatedAt(const DgcPass& p, const void* x, size_t i) {
    const float xi = loadWidened<D>(x, i);
    return dgcNext(p, i, p.clip ? xi * p.factor : xi).v;
  }

  /// The fused pass over [lo, hi) for fp16/bf16 input (dgcFusedPassF32 takes fp32).
  template <DType D>
  static uint64_t fusedPassScalar(const DgcPass& p, const void* x, size_t lo, size_t hi,
                                  uint32_t* list) {
    uint64_t c = 0;
    for (size_t i = lo; i < hi; ++i) {
      const float xi = loadWidened<D>(x, i);
      const DgcNext next = dgcNext(p, i, p.clip ? xi * p.factor : xi);
      if (p.momentum && p.un != nullptr) p.un[i] = next.u;
      const float vi = next.v;
      p.vn[i] = vi;
      list[c] = static_cast<uint32_t>(i);
      c += magnitudeKey(vi) >= p.threshold;
    }
    return c;
  }

  /// The sample keys key(v'_index(j)) of §4.4, computed from x, u and v (before v' exists), as a
  /// multiset (only their order statistics matter): each thread's indices are bucketed by
  /// address (a counting sort on index >> shift) before the gather, so the random reads walk
  /// memory upwards (far fewer TLB misses) and are prefetched ahead.
  static void sampleKeys(const StepContext& ctx, ConstTensor x, const DgcPass& p, size_t n,
                         std::span<uint32_t> keys, std::span<uint32_t> scratch) {
    const size_t m = keys.size();
    const PhiloxStream philox(ctx.seed, ctx.name_key, ctx.step, ctx.rank,
                              RandomPurpose::kDgcSampling);
    constexpr unsigned kBucketBits = 12;
    unsigned shift = 0;
    while ((uint64_t{n - 1} >> shift) >= (uint64_t{1} << kBucketBits)) ++shift;
    visitDType(x.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      forEach(ctx.stream, m, [&](size_t lo, size_t end) {
        uint32_t* idx = scratch.data();
        philox.words(lo, end - lo, keys.data() + lo);  // word j mod 4 of group j / 4
        std::array<uint32_t, size_t{1} << kBucketBits> start{};
        for (size_t j = lo; j < end; ++j) {
          keys[j] = static_cast<uint32_t>((uint64_t{keys[j]} * n) >> 32);
          ++start[keys[j] >> shift];
        }
        uint32_t offset = static_cast<uint32_t>(lo);
        for (auto& s : start) {
          offset += s;
          s = offset - s;
        }
        for (size_t j = lo; j < end; ++j) idx[start[keys[j] >> shift]++] = keys[j];
        constexpr size_t kAhead = 32;
        for (size_t j = lo; j < end; ++j) {
          if (j + kAhead < end) {
            const size_t ahead = idx[j + kAhead];
            __builtin_prefetch(static_cast<const char*>(x.data) + ahead * dtypeSize(D));
            __builtin_prefetch(p.v + ahead);
            if (p.momentum) __builtin_prefetch(p.u + ahead);
            if (p.bias) __builtin_prefetch(p.c + ahead);
          }
          keys[j] = magnitudeKey(accumulatedAt<D>(p, x.data, idx[j]));
        }
      });
    });
  }

  /// s_r (1-based, descending). nth_element on the partly ordered array gives the same value.
  static uint32_t sampleAt(std::span<uint32_t> keys, uint64_t r) {
    std::nth_element(keys.begin(), keys.begin() + (r - 1), keys.end(), std::greater<uint32_t>());
    return keys[r - 1];
  }

  static uint64_t clampRank(U128 r, size_t m) {
    return static_cast<uint64_t>(std::clamp<U128>(r, 1, m));
  }
  static uint64_t initialRank(size_t n, size_t k, size_t m) {
    return clampRank((U128{k} * m + n - 1) / n, m);
  }

  /// The sampled threshold of §4.4 over v' (already written). Writes the plan and returns true
  /// when a count was accepted; false means: fall back to exact selection.
  bool sampledSelection(const StepContext& ctx, const float* vn, size_t n, size_t k,
                        std::span<uint32_t> keys, SelectionPlan* plan) const {
    const size_t m = keys.size();
    const PhiloxStream philox(ctx.seed, ctx.name_key, ctx.step, ctx.rank,
                              RandomPurpose::kDgcSampling);
    forEach(ctx.stream, (m + 3) / 4, [&](size_t lo, size_t hi) {
      for (size_t g = lo; g < hi; ++g) {
        const std::array<uint32_t, 4> r = philox.group(g);
        for (size_t q = 0; q < 4 && 4 * g + q < m; ++q) {
          const size_t index = static_cast<size_t>((U128{r[q]} * n) >> 32);
          keys[4 * g + q] = magnitudeKey(vn[index]);
        }
      }
    });
    const uint64_t r = initialRank(n, k, m);
    const uint32_t threshold = sampleAt(keys, r);
    const uint64_t c = countKeysAtLeast(vn, n, threshold, ctx.stream);
    return refine(ctx, vn, n, k, keys, r, threshold, c, plan);
  }

  /// Acceptance and refinement of §4.4 from rank r, threshold s_r and its count c.
  static bool refine(const StepContext& ctx, const float* vn, size_t n, size_t k,
                     std::span<uint32_t> keys, uint64_t r, uint32_t threshold, uint64_t c,
                     SelectionPlan* plan) {
    const size_t m = keys.size();
    const uint64_t lo = (U128{8} * k + 9) / 10;
    const uint64_t hi = (U128{13} * k) / 10;
    for (int refinement = 0;; ++refinement) {
      if (lo <= c && c <= hi) {
        *plan = SelectionPlan{threshold, n, false};
        return true;
      }
      if (refinement == kMaxRefinements) return false;
      uint64_t next = clampRank((U128{2} * r * k + c) / (U128{2} * c), m);
      if (next == r) {
        if (c > hi) {
          if (r == 1) return false;
          next = r - 1;
        } else {
          if (r == m) return false;
          next = r + 1;
        }
      }
      r = next;
      threshold = sampleAt(keys, r);
      c = countKeysAtLeast(vn, n, threshold, ctx.stream);
    }
  }

  CodecConfig config_;
  double density_;
  uint32_t min_key_;  // min_magnitude as a key floor (0 = off)
};

Result<std::unique_ptr<Codec>> makeDgc(const CodecConfig& c) {
  auto density = configuredDensity(c, "dgc", kDgcDefaultDensity);
  if (!density) return density.status();
  LW_RETURN_IF_ERROR(checkSparseValues(c, "dgc"));
  if (!(c.momentum >= 0.0 && c.momentum < 1.0)) {
    return invalidArgument("dgc: momentum must be in [0, 1), got " + formatNumber(c.momentum));
  }
  if (c.bias_correction && !(c.momentum > 0.0)) {
    return invalidArgument(
        "dgc: bias_correction corrects the momentum's restart after masking and needs momentum > "
        "0, got momentum " +
        formatNumber(c.momentum));
  }
  if (!(c.clip_norm >= 0.0)) {
    return invalidArgument("dgc: clip_norm must be >= 0 (0 = off), got " +
                           formatNumber(c.clip_norm));
  }
  if (!(c.sample_fraction >= 0.001 && c.sample_fraction <= 0.01)) {
    return invalidArgument("dgc: sample_fraction must be in [0.001, 0.01], got " +
                           formatNumber(c.sample_fraction));
  }
  return std::unique_ptr<Codec>(new DgcCodec(c, *density));
}

LW_REGISTER_CODEC(dgc, kDgcTraits, makeDgc);

}  // namespace
}  // namespace lightwire::kernels
