#include "kernels/codecs/powersgd_layout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace lightwire::kernels::powersgd {
namespace {

Status checkSingleChunk(const Chunking& chunking) {
  if (chunking.count() > 1) {
    return invalidArgument("powersgd: the whole matrix is one payload, got " +
                           std::to_string(chunking.count()) +
                           " chunks (use kernels::chunkingFor(), which gives one chunk)");
  }
  return Status::ok();
}

}  // namespace

uint64_t isqrtCeil(uint64_t n) {
  uint64_t c = static_cast<uint64_t>(std::ceil(std::sqrt(static_cast<double>(n))));
  while (static_cast<unsigned __int128>(c) * c < n) ++c;
  while (c > 0 && static_cast<unsigned __int128>(c - 1) * (c - 1) >= n) --c;
  return c;
}

std::string describe(const View& v) {
  return std::to_string(v.rows) + " x " + std::to_string(v.cols) + " rank " +
         std::to_string(v.rank);
}

uint64_t rankFor(int approx_rank, uint64_t rows, uint64_t cols) {
  return std::min<uint64_t>({uint64_t(approx_rank), rows, cols});
}

size_t capFactor(size_t n, int approx_rank) {
  if (n == 0) return 0;
  const size_t by_rank = n > SIZE_MAX / kMaxRank ? SIZE_MAX : n * size_t(approx_rank);
  return std::min<size_t>(n + isqrtCeil(n), by_rank);
}

size_t stateFloats(size_t n, std::span<const uint64_t> shape, int approx_rank) {
  if (n == 0) return 0;
  auto v = viewFor(shape, n, approx_rank);
  if (!v) v = viewFor({}, n, approx_rank);
  // A view of n elements has cols·rank <= n·rank and cols <= n; no view fails above 2^32 cols
  // where n fits the API's limits, but the bound keeps the size defined if one did.
  return n + kMetaFloats + (v ? static_cast<size_t>(v->cols * v->rank) : capFactor(n, approx_rank));
}

bool stateHolds(size_t floats, size_t n, int approx_rank) {
  if (n == 0) return floats == 0;
  if (floats < n + kMetaFloats) return false;
  const uint64_t q = floats - n - kMetaFloats;  // Q's floats: cols · rank
  if (floats == stateFloats(n, {}, approx_rank)) return true;
  for (uint64_t r = 1; r <= uint64_t(approx_rank) && r <= q; ++r) {
    if (q % r != 0 || n % (q / r) != 0) continue;
    if (rankFor(approx_rank, n / (q / r), q / r) == r) return true;
  }
  return false;
}

Result<View> viewFor(std::span<const uint64_t> shape, size_t n, int approx_rank) {
  View v;
  if (shape.size() >= 2) {
    // Stops early once past n (no overflow), but a zero dimension anywhere makes it 0.
    unsigned __int128 product = 1;
    for (uint64_t d : shape) {
      if (d == 0) {
        product = 0;
        break;
      }
      if (product <= n) product *= d;
    }
    if (product != n) {
      return invalidArgument(
          "powersgd: the tensor shape holds " +
          (product > n ? std::string("more") : std::to_string(uint64_t(product))) +
          " elements, the tensor has " + std::to_string(n));
    }
    if (n == 0) return View{};
    v.rows = shape[0];
    v.cols = n / v.rows;
  } else {
    if (n == 0) return View{};
    v.cols = isqrtCeil(n);
    v.rows = (n + v.cols - 1) / v.cols;
  }
  if (v.rows > UINT32_MAX || v.cols > UINT32_MAX) {
    return invalidArgument("powersgd: the matrix view " + describe(v) +
                           " has a dimension above 2^32 - 1");
  }
  v.rank = rankFor(approx_rank, v.rows, v.cols);
  return v;
}

Result<View> stepView(const StepContext& ctx, const Chunking& chunking, int approx_rank) {
  LW_RETURN_IF_ERROR(checkSingleChunk(chunking));
  return viewFor(ctx.shape, chunking.elements, approx_rank);
}

void writeMeta(float* meta, const View& v, float valid) {
  meta[0] = valid;
  meta[1] = static_cast<float>(v.rows >> 16);
  meta[2] = static_cast<float>(v.rows & 0xFFFF);
  meta[3] = static_cast<float>(v.cols >> 16);
  meta[4] = static_cast<float>(v.cols & 0xFFFF);
  meta[5] = static_cast<float>(v.rank);
  meta[6] = meta[7] = 0.0f;
}

void writeFactorHeaders(uint8_t* out, DType dtype, int round, size_t n, const View& v) {
  writeHeader(out, {CodecId::kPowersgd, dtype, 0, static_cast<uint8_t>(round), n});
  storeU32(out + 16, static_cast<uint32_t>(v.rows));
  storeU32(out + 20, static_cast<uint32_t>(v.cols));
  storeU32(out + 24, static_cast<uint32_t>(v.rank));
  storeU32(out + 28, 0);
}

Result<Factors> parseFactors(std::span<const uint8_t> payload, uint64_t n, int round,
                             const std::string& what, int approx_rank) {
  auto h = readHeader(payload, CodecId::kPowersgd, n, 0, 1);
  if (!h) return Status{h.status().code(), what + ": " + h.status().message()};
  if (h->codec != CodecId::kPowersgd) {
    return dataLoss(what + " carries codec id " + std::to_string(int(h->codec)) +
                    ", powersgd factors have no dense escape");
  }
  if (round >= 0 && h->round != round) {
    return dataLoss(what + " is for round " + std::to_string(h->round) + ", expected round " +
                    std::to_string(round));
  }
  if (payload.size() < kFactorOffset) {
    return dataLoss(what + " truncated: " + std::to_string(payload.size()) +
                    " bytes, the headers need " + std::to_string(kFactorOffset));
  }
  const uint8_t* p = payload.data();
  Factors f;
  f.header = *h;
  f.view = View{loadU32(p + 16), loadU32(p + 20), loadU32(p + 24)};
  if (loadU32(p + 28) != 0) return dataLoss(what + ": reserved body field is not zero");
  const View& v = f.view;
  if (n == 0) {
    if (v != View{}) return dataLoss(what + ": an empty tensor needs a 0 x 0 rank 0 view");
  } else {
    const unsigned __int128 area = static_cast<unsigned __int128>(v.rows) * v.cols;
    const unsigned __int128 short_area =
        static_cast<unsigned __int128>(v.rows == 0 ? 0 : v.rows - 1) * v.cols;
    if (v.rows == 0 || v.cols == 0 || area < n || short_area >= n) {
      return dataLoss(what + ": a " + describe(v) + " view cannot hold " + std::to_string(n) +
                      " elements (needs rows·cols >= n > (rows−1)·cols)");
    }
    const uint64_t rank = rankFor(approx_rank, v.rows, v.cols);
    if (v.rank != rank) {
      return dataLoss(what + ": rank " + std::to_string(v.rank) + ", this codec uses rank " +
                      std::to_string(rank) + " for a " + std::to_string(v.rows) + " x " +
                      std::to_string(v.cols) + " view");
    }
  }
  f.count = static_cast<size_t>((h->round == 0 ? v.rows : v.cols) * v.rank);
  const uint64_t need = kFactorOffset + 4 * uint64_t(f.count);
  if (payload.size() != need) {
    return dataLoss(what + " of " + std::to_string(payload.size()) + " bytes, a round-" +
                    std::to_string(h->round) + " " + describe(v) + " payload has " +
                    std::to_string(need));
  }
  f.values = p + kFactorOffset;
  return f;
}

Result<std::pair<Factors, Factors>> parseRounds(std::span<const std::span<const uint8_t>> rounds,
                                                size_t n, int approx_rank) {
  if (rounds.size() != 2) {
    return invalidArgument("powersgd has 2 rounds, got " + std::to_string(rounds.size()) +
                           " reduced payloads");
  }
  auto p = parseFactors(rounds[0], n, 0, "powersgd: reduced round-0 payload", approx_rank);
  if (!p) return p.status();
  auto q = parseFactors(rounds[1], n, 1, "powersgd: reduced round-1 payload", approx_rank);
  if (!q) return q.status();
  if (p->view != q->view) {
    return dataLoss("powersgd: the reduced payloads have different views (" + describe(p->view) +
                    " and " + describe(q->view) + ")");
  }
  return std::pair<Factors, Factors>{*p, *q};
}

Result<std::pair<Factors, Factors>> parseFinishStep(
    const StepContext& ctx, const Chunking& chunking,
    std::span<const std::span<const uint8_t>> rounds, const FinishArgs& args, int approx_rank) {
  LW_RETURN_IF_ERROR(checkSingleChunk(chunking));
  const size_t n = chunking.elements;
  if (args.input_elements != n) {
    return invalidArgument("powersgd: input has " + std::to_string(args.input_elements) +
                           " elements, the chunking " + std::to_string(n));
  }
  if (args.state_floats != args.state_needed) {
    return invalidArgument("powersgd: codec state holds " + std::to_string(args.state_floats) +
                           " floats, the codec needs " + std::to_string(args.state_needed));
  }
  if (args.workspace_bytes < args.workspace_needed ||
      (args.workspace_null && args.workspace_needed > 0)) {
    return invalidArgument("powersgd: workspace of " + std::to_string(args.workspace_bytes) +
                           " bytes, the codec needs " + std::to_string(args.workspace_needed));
  }
  auto view = viewFor(ctx.shape, n, approx_rank);
  if (!view) return view.status();
  auto f = parseRounds(rounds, n, approx_rank);
  if (!f) return f.status();
  if (f->first.view != *view) {
    return dataLoss("powersgd: the reduced payloads are for a " + describe(f->first.view) +
                    " view, this rank uses " + describe(*view));
  }
  return f;
}

}  // namespace lightwire::kernels::powersgd
