// `powersgd`, PowerSGD (Vogels et al. 2019; docs/determinism.md §4.12): a rank-r approximation
// M ≈ P̂·Qᵀ of a matrix view of x + e, exchanged in two summable rounds (P = M·Q, then
// Q = Mᵀ·P̂ with P̂ the orthonormalised sum of every rank's P), with its own error feedback and a
// warm-started Q. The whole matrix is one payload (single_chunk); the step is decoded with
// decodeRounds() and its next state prepared by finishStep().
//
// The three matrix products are Highway kernels compiled per target (foreach_target.h) and
// dispatched at run time. Each vector lane adds the same fp64 terms in the same order as the
// scalar definition (the canonical accumulator a_(t mod 8) of docs/determinism.md §2, or one
// independent sum per lane), with separate multiply and add, so every target gives the same bits.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/codecs/powersgd.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "kernels/simd/block_sum-inl.h"

HWY_BEFORE_NAMESPACE();
namespace lightwire::kernels::powersgd_simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using simd::HWY_NAMESPACE::BlockSumTag;
using simd::HWY_NAMESPACE::CanonicalBlockSum;
using simd::HWY_NAMESPACE::CombineAccumulators;
using simd::HWY_NAMESPACE::LoadPromoted;

constexpr size_t kBlock = 4096;   // canonical reduction block (docs/determinism.md §2)
constexpr size_t kTile = 64;      // columns per tile of Mᵀ·P̂
constexpr size_t kTileRanks = 4;  // factor columns per tile of Mᵀ·P̂

/// Canonical fp64 dot product Σ_t (double)a[t]·(double)b[t] over t < len (§2).
double Dot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, size_t len) {
  double total = 0.0;
  for (size_t base = 0; base < len; base += kBlock) {
    const float* pa = a + base;
    const float* pb = b + base;
    total = total + CanonicalBlockSum(
                        std::min(kBlock, len - base),
                        [pa, pb](BlockSumTag dd, size_t t) HWY_ATTR {
                          return hn::Mul(LoadPromoted(dd, pa + t), LoadPromoted(dd, pb + t));
                        },
                        [pa, pb](size_t t) HWY_ATTR {
                          return static_cast<double>(pa[t]) * static_cast<double>(pb[t]);
                        });
  }
  return total;
}

/// Round 1, one tile of columns k0..k0+width (width <= kTile) and factor columns j0..j0+jn
/// (jn <= kTileRanks): total[jj·kTile + c] = canonical Σ_i M(i, k0 + c)·P̂[i][j0 + jj] over
/// i < rows, where M(i, k) is m[i·cols + k] below n and +0.0 (padding) above. Each (c, jj) is its
/// own sum: lanes run over c, so every lane adds its terms in the scalar order.
void ColumnTile(const float* HWY_RESTRICT m, size_t n, size_t rows, size_t cols, size_t k0,
                size_t width, const float* HWY_RESTRICT phat, size_t r, size_t j0, size_t jn,
                double* HWY_RESTRICT total) {
  HWY_ALIGN double acc[8][kTileRanks][kTile];
  HWY_ALIGN double x[kTile];
  for (size_t jj = 0; jj < jn; ++jj) std::fill(total + jj * kTile, total + jj * kTile + width, 0.0);
  for (size_t b = 0; b < rows; b += kBlock) {
    const size_t e = std::min(rows, b + kBlock);
    for (auto& slot : acc) {
      for (size_t jj = 0; jj < jn; ++jj) std::fill(slot[jj], slot[jj] + width, 0.0);
    }
    for (size_t i = b; i < e; ++i) {
      const float* row = m + i * cols + k0;
      const size_t start = i * cols + k0;
      const size_t real = start >= n ? 0 : std::min(width, n - start);
      for (size_t c = 0; c < real; ++c) x[c] = static_cast<double>(row[c]);
      for (size_t c = real; c < width; ++c) x[c] = 0.0;
      for (size_t jj = 0; jj < jn; ++jj) {
        const double pij = phat[i * r + j0 + jj];
        double* a = acc[(i - b) & 7][jj];
        size_t c = 0;
#if HWY_TARGET != HWY_SCALAR
        const hn::ScalableTag<double> dd;
        const size_t lanes = hn::Lanes(dd);
        const auto p = hn::Set(dd, pij);
        for (; c + lanes <= width; c += lanes) {
          hn::Store(hn::Add(hn::Load(dd, a + c), hn::Mul(hn::Load(dd, x + c), p)), dd, a + c);
        }
#endif
        for (; c < width; ++c) a[c] = a[c] + x[c] * pij;
      }
    }
    for (size_t jj = 0; jj < jn; ++jj) {
      double* t = total + jj * kTile;
      for (size_t c = 0; c < width; ++c) {
        const double s = ((acc[0][jj][c] + acc[1][jj][c]) + (acc[2][jj][c] + acc[3][jj][c])) +
                         ((acc[4][jj][c] + acc[5][jj][c]) + (acc[6][jj][c] + acc[7][jj][c]));
        t[c] = t[c] + s;
      }
    }
  }
}

/// Decoding one row i: for k < real, v = (float) canonical Σ_j prow[j]·tt[j·cols + k] over j < r
/// (r <= kBlock), then dst[k] = dst[k] + (w·v), or dst[k] = dst[k] − (w·v) when `subtract`.
void RowApply(const float* HWY_RESTRICT prow, const float* HWY_RESTRICT tt, size_t cols,
              size_t real, size_t r, float w, bool subtract, float* HWY_RESTRICT dst) {
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const size_t lanes = hn::Lanes(dd);
  const auto wv = hn::Set(df, w);
  using V = decltype(hn::Zero(dd));
  for (; k + lanes <= real; k += lanes) {
    V a[8];
    for (auto& v : a) v = hn::Zero(dd);
    for (size_t j = 0; j < r; ++j) {
      const auto t = hn::PromoteTo(dd, hn::LoadU(df, tt + j * cols + k));
      a[j & 7] = hn::Add(a[j & 7], hn::Mul(hn::Set(dd, static_cast<double>(prow[j])), t));
    }
    const V sum = hn::Add(hn::Add(hn::Add(a[0], a[1]), hn::Add(a[2], a[3])),
                          hn::Add(hn::Add(a[4], a[5]), hn::Add(a[6], a[7])));
    const auto v = hn::DemoteTo(df, hn::Add(hn::Zero(dd), sum));
    const auto d = hn::LoadU(df, dst + k);
    const auto s = hn::Mul(wv, v);
    hn::StoreU(subtract ? hn::Sub(d, s) : hn::Add(d, s), df, dst + k);
  }
#endif
  for (; k < real; ++k) {
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t j = 0; j < r; ++j) {
      a[j & 7] = a[j & 7] + static_cast<double>(prow[j]) * static_cast<double>(tt[j * cols + k]);
    }
    const float v = static_cast<float>(0.0 + CombineAccumulators(a));
    const float s = w * v;
    dst[k] = subtract ? dst[k] - s : dst[k] + s;
  }
}

}  // namespace lightwire::kernels::powersgd_simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include "kernels/codecs/powersgd_layout.h"
#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/reduce.h"
#include "kernels/registry.h"
#include "kernels/select.h"

namespace lightwire::kernels {
namespace powersgd_simd {
HWY_EXPORT(Dot);
HWY_EXPORT(ColumnTile);
HWY_EXPORT(RowApply);
}  // namespace powersgd_simd

namespace {

using powersgd::describe;
using powersgd::Factors;
using powersgd::kFactorOffset;
using powersgd::kMaxRank;
using powersgd::kMetaFloats;
using powersgd::View;
using powersgd::writeMeta;

constexpr size_t kBlock = powersgd_simd::HWY_NAMESPACE::kBlock;
constexpr size_t kTile = powersgd_simd::HWY_NAMESPACE::kTile;
constexpr size_t kTileRanks = powersgd_simd::HWY_NAMESPACE::kTileRanks;
static_assert(kMaxRank <= int(kBlock), "RowApply sums r terms in one canonical block");

/// Canonical fp64 sum (§2) of term(0..len): blocks of 4096, eight strided accumulators.
template <typename Term>
inline double canonicalTerms(size_t len, const Term& term) {
  double total = 0.0;
  for (size_t b = 0; b < len; b += kBlock) {
    const size_t e = std::min(len, b + kBlock);
    double a[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    size_t k = b;
    for (; k + 8 <= e; k += 8) {
      for (size_t q = 0; q < 8; ++q) a[q] = a[q] + term(k + q);
    }
    for (; k < e; ++k) a[(k - b) & 7] = a[(k - b) & 7] + term(k);
    total = total + (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  }
  return total;
}

/// Canonical fp64 dot product of two contiguous fp32 arrays.
inline double dot(const float* a, const float* b, size_t len) {
  return HWY_DYNAMIC_DISPATCH(powersgd_simd::Dot)(a, b, len);
}

/// Orthonormalises the columns of the rows × r matrix `a` (row-major) in place: for each column
/// j in order, two passes of projections on columns 0..j−1, then normalisation; a column whose
/// norm is 0 stays as it is.
void orthonormalize(float* a, size_t rows, size_t r) {
  for (size_t j = 0; j < r; ++j) {
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t l = 0; l < j; ++l) {
        const double d = canonicalTerms(rows, [&](size_t i) {
          return static_cast<double>(a[i * r + l]) * static_cast<double>(a[i * r + j]);
        });
        for (size_t i = 0; i < rows; ++i) {
          const double t = d * static_cast<double>(a[i * r + l]);
          a[i * r + j] = static_cast<float>(static_cast<double>(a[i * r + j]) - t);
        }
      }
    }
    const double norm = std::sqrt(canonicalTerms(rows, [&](size_t i) {
      const double v = a[i * r + j];
      return v * v;
    }));
    if (norm == 0.0) continue;
    for (size_t i = 0; i < rows; ++i) {
      a[i * r + j] = static_cast<float>(static_cast<double>(a[i * r + j]) / norm);
    }
  }
}

constexpr CodecTraits kPowerSgdTraits{.id = CodecId::kPowersgd,
                                      .name = "powersgd",
                                      .summable = true,
                                      .sparse = false,
                                      .own_memory = true,
                                      .default_error_feedback = false,
                                      .rounds = 2,
                                      .single_chunk = true};

class PowerSgdCodec final : public Codec {
 public:
  explicit PowerSgdCodec(const CodecConfig& c) : config_(c) {}

  const CodecTraits& traits() const override { return kPowerSgdTraits; }
  const CodecConfig& config() const override { return config_; }

  /// e (n), the meta block, then the warm-start Q (cols · r values of the shape's matrix view;
  /// a shape that does not hold n elements fails the step, its state is sized as without one).
  using Codec::stateFloats;
  size_t stateFloats(size_t n, std::span<const uint64_t> shape) const override {
    return powersgd::stateFloats(n, shape, config_.approx_rank);
  }
  /// One factor (Qᵀ, then P̂), in finishStep() also the reduced Q transposed, and the state's
  /// next meta block and warm-start Q (what commitState() copies into the state), then the memo.
  size_t workspaceBytes(const Chunking& c) const override {
    const size_t f = capFactor(c.elements) * sizeof(float);
    return WorkspaceCarver::bytesFor(
        {f, f, (kMetaFloats + capFactor(c.elements)) * sizeof(float), sizeof(Memo)});
  }
  size_t maxPayloadBytes(size_t n) const override { return kFactorOffset + 4 * capFactor(n); }

  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                   CodecState& state, std::span<std::byte> workspace) const override {
    auto view = stepView(ctx, chunking);
    if (!view) return view.status();
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    const View v = *view;
    const size_t r = v.rank, cols = v.cols;
    const float* e = state.current();
    // M = x + e (fp32) in the work area (the encodes read it; commitState() recomputes it).
    addWidened(ctx.stream, input, e, state.work(n), n);
    // Q: the committed warm start when it is for this view, else the shared Philox draw; a column
    // that is entirely zero is drawn again.
    const float* meta = e + n;
    const float* q_current = meta + kMetaFloats;
    const Slices sl = slices(workspace, n);
    float* next_meta = sl.next;
    float* q = next_meta + kMetaFloats;
    const bool warm = meta[0] == 1.0f && metaView(meta) == v;
    writeMeta(next_meta, v, 0.0f);
    const PhiloxStream philox(ctx.seed, ctx.name_key, ctx.step, kSharedStream,
                              RandomPurpose::kPowersgdInit);
    for (size_t j = 0; j < r; ++j) {
      bool zero = true;
      if (warm) {
        for (size_t k = 0; k < cols; ++k) {
          q[k * r + j] = q_current[k * r + j];
          if (q[k * r + j] != 0.0f) zero = false;
        }
      }
      if (!zero) continue;
      for (size_t k = 0; k < cols; ++k) {
        const uint32_t word = philox.word(k * r + j);
        q[k * r + j] = static_cast<float>(2.0 * unitDouble(word) - 1.0);
      }
    }
    // Qᵀ into the workspace (round 0 reads it row by row).
    float* qt = sl.factor;
    for (size_t k = 0; k < cols; ++k) {
      for (size_t j = 0; j < r; ++j) qt[j * cols + k] = q[k * r + j];
    }
    return Status::ok();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t, int round,
                               std::span<const uint8_t> previous, ConstTensor input,
                               CodecState& state, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    auto view = stepView(ctx, chunking);
    if (!view) return view.status();
    const View v = *view;
    const size_t n = chunking.elements;
    const Slices sl = slices(workspace, n);
    if (n > 0 && metaView(sl.next) != v) {
      return failedPrecondition("powersgd: the matrix view differs from the one analyze() used");
    }
    const size_t r = v.rank, rows = v.rows, cols = v.cols;
    uint8_t* body = out.data() + kFactorOffset;
    const float* m = state.work(n);
    float* ws = sl.factor;
    if (round == 0) {
      // P[i][j] = canonical Σ_k M[i][k]·Q[k][j] over the padded row.
      parallelFor(ctx.stream, rows, 64, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          const float* row = m + i * cols;
          const size_t real = std::min<size_t>(cols, n - i * cols);
          for (size_t j = 0; j < r; ++j) {
            const float* qt = ws + j * cols;
            const double p =
                real == cols ? dot(row, qt, cols) : canonicalTerms(cols, [&](size_t k) {
                  const double mk = k < real ? static_cast<double>(row[k]) : 0.0;
                  return mk * static_cast<double>(qt[k]);
                });
            storeF32(body + 4 * (i * r + j), static_cast<float>(p));
          }
        }
      });
      powersgd::writeFactorHeaders(out.data(), input.dtype, 0, n, v);
      return kFactorOffset + 4 * rows * r;
    }
    // Round 1: P̂ = orthonormalise(reduced P), then Q[k][j] = canonical Σ_i M[i][k]·P̂[i][j].
    auto p = parseFactors(previous, n, 0, "powersgd: the reduced round-0 payload");
    if (!p) return p.status();
    if (p->view != v) {
      return dataLoss("powersgd: the reduced round-0 payload is for a " + describe(p->view) +
                      " view, this rank uses " + describe(v));
    }
    loadOrthonormal(*p, ws);
    parallelFor(ctx.stream, (cols + kTile - 1) / kTile, 1, [&](size_t lo, size_t hi) {
      double total[kTileRanks * kTile];
      for (size_t t = lo; t < hi; ++t) {
        const size_t k0 = t * kTile, width = std::min(kTile, cols - k0);
        for (size_t j0 = 0; j0 < r; j0 += kTileRanks) {
          const size_t jn = std::min(kTileRanks, r - j0);
          HWY_DYNAMIC_DISPATCH(powersgd_simd::ColumnTile)
          (m, n, rows, cols, k0, width, ws, r, j0, jn, total);
          for (size_t jj = 0; jj < jn; ++jj) {
            for (size_t c = 0; c < width; ++c) {
              storeF32(body + 4 * ((k0 + c) * r + j0 + jj),
                       static_cast<float>(total[jj * kTile + c]));
            }
          }
        }
      }
    });
    powersgd::writeFactorHeaders(out.data(), input.dtype, 1, n, v);
    return kFactorOffset + 4 * cols * r;
  }

  Status decodeChunk(std::span<const uint8_t>, float, float*, size_t) const override {
    return failedPrecondition(
        "powersgd has two rounds: decode a step with decodeRounds() and the reduced payloads of "
        "both rounds, not decodeChunk()");
  }

  Status decodeRounds(std::span<const std::span<const uint8_t>> rounds, float weight, float* out,
                      size_t out_elements) const override {
    auto f = parseRounds(rounds, out_elements);
    if (!f) return f.status();
    const auto& [p, q] = *f;
    if (out_elements == 0) return Status::ok();
    std::vector<float> phat(p.count), tt(q.count);
    loadOrthonormal(p, phat.data());
    loadTransposed(q, tt.data());
    product(nullptr, p.view, out_elements, phat.data(), tt.data(), weight, false, out);
    return Status::ok();
  }

  Status finishStep(const StepContext& ctx, const Chunking& chunking,
                    std::span<const std::span<const uint8_t>> rounds, float weight,
                    ConstTensor input, CodecState& state,
                    std::span<std::byte> workspace) const override {
    const size_t n = chunking.elements;
    const powersgd::FinishArgs args{.input_elements = input.elements,
                                    .state_floats = state.floats(),
                                    .state_needed = stateFloats(n, ctx.shape),
                                    .workspace_bytes = workspace.size(),
                                    .workspace_needed = workspaceBytes(chunking),
                                    .workspace_null = false};
    auto f = powersgd::parseFinishStep(ctx, chunking, rounds, args, config_.approx_rank);
    if (!f) return f.status();
    const auto& [p, q] = *f;
    if (n == 0) return Status::ok();
    const Slices sl = slices(workspace, n);
    float* meta = sl.next;
    if (metaView(meta) != p.view || meta[0] != 0.0f) {
      return failedPrecondition(
          "powersgd: finishStep() needs a matching analyze() first, and runs once per step");
    }
    // P̂ and Q_sumᵀ for commitState()'s e' = M − weight · (P̂·Q_sumᵀ); Q' = weight · Q_sum (the
    // warm start).
    loadOrthonormal(p, sl.factor);
    loadTransposed(q, sl.transposed);
    float* qn = meta + kMetaFloats;
    for (size_t i = 0; i < q.count; ++i) qn[i] = weight * loadF32(q.values + 4 * i);
    writeMeta(meta, p.view, 1.0f);
    *sl.memo = Memo{weight, q.count};
    return Status::ok();
  }

  /// e' = M − weight · (P̂·Q_sumᵀ) with M = x + e recomputed in place (finishStep()'s arithmetic
  /// of the double-buffered form, bit for bit), then the meta block and Q' of finishStep().
  Status doCommitState(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                       std::span<const std::span<const uint8_t>>,
                       std::span<const std::span<const uint8_t>>, CodecState& state,
                       std::span<std::byte> workspace, WriteBack write_back) const override {
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    const Slices sl = slices(workspace, n);
    if (sl.next[0] != 1.0f) {
      return failedPrecondition("powersgd: commitState() needs finishStep() first");
    }
    float* e = state.mutableCurrent();
    addWidened(ctx.stream, input, e, e, n, write_back);
    product(ctx.stream, metaView(sl.next), n, sl.factor, sl.transposed, sl.memo->weight, true, e);
    std::copy(sl.next, sl.next + kMetaFloats + sl.memo->q_floats, e + n);
    return Status::ok();
  }

  /// out = x + e (M of doAnalyze, bit for bit); commitFlush() zeroes the error and keeps the
  /// meta block and warm-start Q as they are.
  Status doFlush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                 CodecState& state, float* out) const override {
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    addWidened(ctx.stream, input, state.current(), out, n);
    return Status::ok();
  }
  void commitFlush(CodecState& state, size_t n) const override {
    if (n > 0 && state.floats() >= n) std::fill_n(state.mutableCurrent(), n, 0.0f);
  }

  /// Σ e_i² of the committed error (not the meta block or Q).
  double residualNorm2(const CodecState& state, size_t n) const override {
    if (!powersgd::stateHolds(state.floats(), n, config_.approx_rank)) return 0.0;
    return canonicalSum(state.current(), n, ReduceTerm::kSquare);
  }

  Result<size_t> addPayloads(std::span<const uint8_t> a, std::span<const uint8_t> b,
                             std::span<uint8_t> out) const override {
    if (a.size() < kHeaderBytes) return dataLoss("powersgd payload truncated (no header)");
    const uint64_t n = loadU64(a.data() + 8);
    auto fa = parseFactors(a, n, -1, "powersgd: payload a");
    if (!fa) return fa.status();
    auto fb = parseFactors(b, n, fa->header.round, "powersgd: payload b");
    if (!fb) return fb.status();
    if (fa->view != fb->view) {
      return dataLoss("powersgd: payloads to add have different views (" + describe(fa->view) +
                      " and " + describe(fb->view) + ")");
    }
    if (out.size() < a.size()) {
      return outOfRange("powersgd: payload buffer of " + std::to_string(out.size()) +
                        " bytes, the sum needs " + std::to_string(a.size()));
    }
    std::memmove(out.data(), a.data(), kFactorOffset);
    for (size_t i = 0; i < fa->count; ++i) {
      const size_t o = kFactorOffset + 4 * i;
      storeF32(out.data() + o, loadF32(a.data() + o) + loadF32(b.data() + o));
    }
    return a.size();
  }

 private:
  /// Room for one factor (rows·r or cols·r values) of any view of n elements.
  size_t capFactor(size_t n) const { return powersgd::capFactor(n, config_.approx_rank); }

  /// What commitState() needs of finishStep(): the step's weight and the floats of Q'.
  struct Memo {
    float weight = 0.0f;
    size_t q_floats = 0;
  };
  /// The workspace: one factor (Qᵀ, then P̂), the reduced Q transposed, the next meta block and
  /// Q', the memo.
  struct Slices {
    float *factor, *transposed, *next;
    Memo* memo;
  };
  Slices slices(std::span<std::byte> workspace, size_t n) const {
    WorkspaceCarver carver(workspace);
    Slices s;
    s.factor = carver.take<float>(capFactor(n)).data();
    s.transposed = carver.take<float>(capFactor(n)).data();
    s.next = carver.take<float>(kMetaFloats + capFactor(n)).data();
    s.memo = carver.take<Memo>(1).data();
    return s;
  }

  Result<View> stepView(const StepContext& ctx, const Chunking& chunking) const {
    return powersgd::stepView(ctx, chunking, config_.approx_rank);
  }

  static View metaView(const float* meta) {
    auto u = [](float f) { return f >= 0.0f && f < 65536.0f ? uint64_t(f) : uint64_t(1) << 40; };
    return View{(u(meta[1]) << 16) | u(meta[2]), (u(meta[3]) << 16) | u(meta[4]), u(meta[5])};
  }

  Result<Factors> parseFactors(std::span<const uint8_t> payload, uint64_t n, int round,
                               const std::string& what) const {
    return powersgd::parseFactors(payload, n, round, what, config_.approx_rank);
  }

  Result<std::pair<Factors, Factors>> parseRounds(std::span<const std::span<const uint8_t>> rounds,
                                                  size_t n) const {
    return powersgd::parseRounds(rounds, n, config_.approx_rank);
  }

  /// The round-1 factor (cols × r) as r × cols.
  static void loadTransposed(const Factors& q, float* tt) {
    const size_t r = q.view.rank, cols = q.view.cols;
    for (size_t k = 0; k < cols; ++k) {
      for (size_t j = 0; j < r; ++j) tt[j * cols + k] = loadF32(q.values + 4 * (k * r + j));
    }
  }

  static void loadOrthonormal(const Factors& p, float* phat) {
    for (size_t i = 0; i < p.count; ++i) phat[i] = loadF32(p.values + 4 * i);
    orthonormalize(phat, p.view.rows, p.view.rank);
  }

  /// For every real element idx = i·cols + k < n, v = (float) canonical Σ_j P̂[i][j]·T[k][j]
  /// (tt = Tᵀ), then dst[idx] = dst[idx] + (w·v), or − (w·v) when `subtract`. Parallel over rows.
  static void product(CpuStream* stream, const View& v, size_t n, const float* phat,
                      const float* tt, float w, bool subtract, float* dst) {
    const size_t r = v.rank, cols = v.cols;
    parallelFor(stream, v.rows, 64, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        const size_t real = std::min<size_t>(cols, n - i * cols);
        HWY_DYNAMIC_DISPATCH(powersgd_simd::RowApply)
        (phat + i * r, tt, cols, real, r, w, subtract, dst + i * cols);
      }
    });
  }

  CodecConfig config_;
};

Result<std::unique_ptr<Codec>> makePowerSgd(const CodecConfig& c) {
  if (c.approx_rank < 1 || c.approx_rank > kMaxRank) {
    return invalidArgument("powersgd: approx_rank must be in [1, " + std::to_string(kMaxRank) +
                           "], got " + std::to_string(c.approx_rank));
  }
  return std::unique_ptr<Codec>(new PowerSgdCodec(c));
}

LW_REGISTER_CODEC(powersgd, kPowerSgdTraits, makePowerSgd);

}  // namespace
}  // namespace lightwire::kernels

#endif  // HWY_ONCE
