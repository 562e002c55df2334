// `dgc`, Deep Gradient Compression (docs/determinism.md §4.4): local clipping, momentum
// correction, accumulation, a sampled threshold whose count is accepted within [0.8k, 1.3k] (exact
// top-k otherwise), and momentum factor masking. Keeps its own state (u then v), so it is never
// wrapped in error feedback.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
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

class DgcCodec final : public Codec {
 public:
  DgcCodec(const CodecConfig& c, double density) : config_(c), density_(density) {}

  const CodecTraits& traits() const override {
    static const CodecTraits t{.id = CodecId::kDgc,
                               .name = "dgc",
                               .summable = false,
                               .sparse = true,
                               .own_memory = true,
                               .default_error_feedback = false};
    return t;
  }
  const CodecConfig& config() const override { return config_; }
  size_t stateFloats(size_t n) const override { return 2 * n; }
  size_t workspaceBytes(const Chunking& c) const override {
    const size_t n = c.elements;
    return SelectWorkspace::bytes(n) +
           WorkspaceCarver::bytesFor({blocks(n) * sizeof(double), samples(n) * sizeof(uint32_t)});
  }
  size_t maxPayloadBytes(size_t n) const override {
    return sparseMaxPayloadBytes(n, config_.sparse_values);
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
    if (n == 0) {
      *ws.plan = SelectionPlan{};
      return Status::ok();
    }

    const float* u = state.current();
    const float* v = u + n;
    float* un = state.next();
    float* vn = un + n;

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

    // 2–3. Momentum correction and accumulation, in the spec's operation order (no FMA).
    const float m = static_cast<float>(config_.momentum);
    const bool use_momentum = config_.momentum > 0.0;
    visitDType(x.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      forEach(ctx.stream, n, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          const float xi = loadWidened<D>(x.data, i);
          const float g = clip ? xi * factor : xi;
          if (use_momentum) {
            const float mu = m * u[i];
            const float ui = mu + g;
            un[i] = ui;
            vn[i] = v[i] + ui;
          } else {
            un[i] = 0.0f;
            vn[i] = v[i] + g;
          }
        }
      });
    });

    // 4. Selection on key(v').
    const size_t k = selectionSize(n, density);
    const ConstTensor acc{vn, n, DType::kF32};
    if (n <= kExactMaxElements || !sampledSelection(ctx, vn, n, k, sample_keys, ws.plan)) {
      selectExact(acc, k, ctx.stream, ws, ws.plan);
    }
    return Status::ok();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int /*round*/, std::span<const uint8_t>, ConstTensor input,
                               CodecState& state, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    const size_t n = chunking.elements;
    WorkspaceCarver carver(workspace);
    const SelectWorkspace ws = SelectWorkspace::carve(carver, n);
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    float* un = state.next();
    float* vn = n == 0 ? nullptr : un + n;
    const std::span<uint32_t> indices = ws.slots.subspan(begin, len);
    auto written =
        writeSparsePayload(CodecId::kDgc, input.dtype, config_.sparse_values, *ws.plan,
                           ConstTensor{vn, n, DType::kF32}, begin, len, indices, ctx.stream, out);
    if (!written) return written.status();

    // 6. Momentum factor masking of what was sent (the value as decoded).
    const bool f16 = config_.sparse_values == DType::kF16;
    for (size_t j = 0; j < written->nnz; ++j) {
      const size_t i = begin + indices[j];
      const float value = f16 ? halfToFloat(floatToHalfSaturating(vn[i])) : vn[i];
      vn[i] = vn[i] - value;
      un[i] = 0.0f;
    }
    return written->bytes;
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    return decodeSparsePayload(payload, CodecId::kDgc, weight, out, out_elements);
  }

 private:
  static size_t blocks(size_t n) { return (n + kReduceBlock - 1) / kReduceBlock; }

  /// M = max(1024, ceil(f · n)); 0 where the exact path is always taken.
  size_t samples(size_t n) const {
    if (n <= kExactMaxElements) return 0;
    const double m = std::ceil(config_.sample_fraction * static_cast<double>(n));
    return std::max(kMinSamples, static_cast<size_t>(m));
  }

  static void forEach(CpuStream* stream, size_t n, const std::function<void(size_t, size_t)>& fn) {
    if (stream != nullptr) {
      stream->parallelFor(n, size_t{1} << 16, fn);
    } else {
      fn(0, n);
    }
  }

  /// The sampled threshold of §4.4. Writes the plan and returns true when a count was accepted;
  /// false means: fall back to exact selection.
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
    // s_r (1-based, descending). nth_element on the partly ordered array gives the same value.
    auto sampleAt = [&](uint64_t r) {
      std::nth_element(keys.begin(), keys.begin() + (r - 1), keys.end(), std::greater<uint32_t>());
      return keys[r - 1];
    };
    const uint64_t lo = (U128{8} * k + 9) / 10;
    const uint64_t hi = (U128{13} * k) / 10;
    auto clampRank = [&](U128 r) -> uint64_t {
      return static_cast<uint64_t>(std::clamp<U128>(r, 1, m));
    };
    uint64_t r = clampRank((U128{k} * m + n - 1) / n);
    uint32_t threshold = sampleAt(r);
    uint64_t c = countKeysAtLeast(vn, n, threshold, ctx.stream);
    for (int refinement = 0;; ++refinement) {
      if (lo <= c && c <= hi) {
        *plan = SelectionPlan{threshold, n, false};
        return true;
      }
      if (refinement == kMaxRefinements) return false;
      uint64_t next = clampRank((U128{2} * r * k + c) / (U128{2} * c));
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
      threshold = sampleAt(r);
      c = countKeysAtLeast(vn, n, threshold, ctx.stream);
    }
  }

  CodecConfig config_;
  double density_;
};

Result<std::unique_ptr<Codec>> makeDgc(const CodecConfig& c) {
  auto density = configuredDensity(c, "dgc", kDgcDefaultDensity);
  if (!density) return density.status();
  LW_RETURN_IF_ERROR(checkSparseValues(c, "dgc"));
  if (!(c.momentum >= 0.0 && c.momentum < 1.0)) {
    return invalidArgument("dgc: momentum must be in [0, 1), got " + formatNumber(c.momentum));
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

LW_REGISTER_CODEC(dgc, "dgc", makeDgc);

}  // namespace
}  // namespace lightwire::kernels
