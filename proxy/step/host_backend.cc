#include "proxy/step/host_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "kernels/reduce.h"
#include "kernels/registry.h"
#include "kernels/simd/kernels.h"

#include <spdlog/spdlog.h>

#include <xxh_x86dispatch.h>
#include <xxhash.h>

namespace lightwire::proxy {
namespace {

using kernels::DType;

constexpr size_t kGrain = size_t{1} << 16;

/// out[i] (+)= value i of the trainer's tensor, for i in [lo, hi).
void widenRange(DType dtype, const std::byte* data, size_t lo, size_t hi, float* out, bool add) {
  const kernels::ConstTensor t{data, hi, dtype};
  if (!add) {
    kernels::widenToFloat(t.slice(lo, hi - lo), out + lo);
    return;
  }
  float scratch[4096];
  for (size_t b = lo; b < hi; b += 4096) {
    const size_t len = std::min<size_t>(4096, hi - b);
    kernels::widenToFloat(t.slice(b, len), scratch);
    for (size_t i = 0; i < len; ++i) out[b + i] = out[b + i] + scratch[i];
  }
}

/// The trainer's tensor bytes [lo, hi) = result values, in its dtype.
void narrowRange(DType dtype, const float* result, size_t lo, size_t hi, std::byte* data) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(data + 4 * lo, result + lo, 4 * (hi - lo));
      return;
    case DType::kF16:
      kernels::simd::floatsToHalves(result + lo, hi - lo,
                                    reinterpret_cast<uint8_t*>(data) + 2 * lo);
      return;
    case DType::kBF16:
      kernels::simd::floatsToBf16s(result + lo, hi - lo, reinterpret_cast<uint8_t*>(data) + 2 * lo);
      return;
  }
}

/// The statistics record of one input (policies): norm² with the SIMD canonical reduction (in
/// parallel, block order fixed), then — only when they matter — the non-finite count (the norm is
/// not finite) and the count of values below min_magnitude (the adaptive schedule reads it).
policies::StepStats localStats(kernels::CpuStream* stream, const float* input, size_t n,
                               double min_magnitude, bool count_small,
                               std::vector<double>& block_sums) {
  policies::StepStats st;
  st.elements = n;
  // A statistic, not a payload: float lanes per 4096-value block (vectorised; NaN and Inf
  // propagate), blocks added in order in fp64. Half the cost of the canonical fp64 reduction.
  constexpr size_t kBlock = kernels::kStatsBlock;
  block_sums.assign((n + kBlock - 1) / kBlock, 0.0);
  kernels::parallelFor(stream, block_sums.size(), 16, [&](size_t lo, size_t hi) {
    for (size_t k = lo; k < hi; ++k) {
      block_sums[k] =
          kernels::statsSquareBlockSum(input + k * kBlock, std::min(kBlock, n - k * kBlock));
    }
  });
  for (const double b : block_sums) st.grad_norm2 += b;
  if (!std::isfinite(st.grad_norm2) || count_small) {
    std::mutex mu;
    const float tiny = static_cast<float>(min_magnitude);
    kernels::parallelFor(stream, n, size_t{1} << 16, [&](size_t lo, size_t hi) {
      uint64_t bad = 0, small = 0;
      for (size_t i = lo; i < hi; ++i) {
        const float v = input[i];
        bad += std::isfinite(v) ? 0 : 1;
        small += std::fabs(v) < tiny ? 1 : 0;
      }
      std::lock_guard lock(mu);
      st.nonfinite += bad;
      st.small += small;
    });
    if (!count_small) st.small = 0;
    if (st.nonfinite > 0) {
      st.grad_norm2 = 0;  // the count says it; the norm is meaningless
    } else if (!std::isfinite(st.grad_norm2)) {
      // Finite values whose float squares overflowed: the exact fp64 sum.
      st.grad_norm2 = kernels::canonicalSum(input, n, kernels::ReduceTerm::kSquare);
    }
  }
  return st;
}

}  // namespace

Status StepBackend::decodeChunks(const kernels::Chunking& chunking,
                                 std::span<const std::vector<std::span<const uint8_t>>> lists,
                                 std::span<const char> done, bool dense, float weight) {
  for (size_t c = 0; c < lists.size(); ++c) {
    if (done[c]) continue;
    if (Status st = decodeChunk(chunking, c, lists[c], dense, weight); !st.isOk()) {
      return dataLoss("chunk " + std::to_string(c) + ": " + st.message());
    }
  }
  return Status::ok();
}

HostBackend::HostBackend(kernels::CpuStream& stream, const kernels::Codec& codec,
                         kernels::CodecState& state, HostBuffers& buffers, StepPool& pool,
                         std::vector<Contribution*> parts, size_t n, DType dtype)
    : stream_(stream),
      codec_(codec),
      state_(state),
      buf_(buffers),
      pool_(pool),
      parts_(std::move(parts)),
      n_(n),
      dtype_(dtype) {}

// The work area lent to the state is the pooled result buffer: it goes back with the backend.
HostBackend::~HostBackend() { state_.detachWork(); }

const kernels::Codec& HostBackend::stepCodec() const {
  return dense_ ? kernels::noneCodec() : codec_;
}
kernels::CodecState& HostBackend::stepState() { return dense_ ? no_state_ : state_; }

Status HostBackend::ingest() {
  if (inputIsTrainers(parts_.size(), dtype_)) {
    input_ = reinterpret_cast<const float*>(parts_[0]->data);
  } else {
    float* sum = sum_buf_.get(pool_, n_);
    kernels::parallelFor(&stream_, n_, kGrain, [&](size_t lo, size_t hi) {
      for (size_t k = 0; k < parts_.size(); ++k) {
        widenRange(dtype_, parts_[k]->data, lo, hi, sum, k > 0);
      }
    });
    input_ = sum;
  }
  // Delayed sync's accumulation exists only for tensors that accumulate (made on their first
  // accumulation); a tensor whose size changed drops what it held.
  if (!buf_.accum.empty() && buf_.accum.size() != n_) buf_.accum.clear();
  return Status::ok();
}

std::vector<float>& HostBackend::accumulation() {
  if (buf_.accum.size() != n_) buf_.accum.assign(n_, 0.0f);
  return buf_.accum;
}

Status HostBackend::accumulate() {
  float* acc = accumulation().data();
  const float* in = input_;
  kernels::parallelFor(&stream_, n_, kGrain, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) acc[i] = acc[i] + in[i];
  });
  for (auto* part : parts_) std::memset(part->data, 0, n_ * kernels::dtypeSize(dtype_));
  return Status::ok();
}

Status HostBackend::addAccumulation() {
  const float* acc = accumulation().data();
  const float* in = input_;
  // The sum may be the input itself (several trainers): then the accumulation adds in place.
  float* sum = sum_buf_.get(pool_, n_);
  kernels::parallelFor(&stream_, n_, kGrain, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) sum[i] = in[i] + acc[i];
  });
  input_ = sum;
  accumulated_ = true;
  return Status::ok();
}

Status HostBackend::flush(const kernels::StepContext& ctx, const kernels::Chunking& chunking) {
  float* flushed = flushed_buf_.get(pool_, n_);
  if (auto s = codec_.flush(ctx, chunking, input(), state_, flushed); !s.isOk()) {
    return internalError("flushing the codec state: " + s.message());
  }
  input_ = flushed;
  flushed_ = true;
  return Status::ok();
}

Result<policies::StepStats> HostBackend::stats(double min_magnitude, bool count_small) {
  return localStats(&stream_, input_, n_, min_magnitude, count_small, buf_.blocks);
}

Result<double> HostBackend::residualNorm2() {
  return state_.floats() > 0 ? codec_.residualNorm2(state_, n_) : 0.0;
}

Status HostBackend::analyze(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                            bool dense) {
  dense_ = dense;
  ctx_ = ctx;
  chunking_ = chunking;
  const kernels::Codec& sc = stepCodec();
  buf_.workspace.resize(sc.workspaceBytes(chunking));
  // The codec's work area is the result buffer: a chunk's range is free once it is encoded
  // (Codec::encodeChunk), and its result is decoded there after that.
  if (const size_t w = sc.workFloats(n_); w > 0) {
    const size_t floats = std::max(n_, w);
    stepState().attachWork({result_buf_.get(pool_, floats), floats});
  }
  if (auto s = sc.analyze(ctx, chunking, input(), stepState(), buf_.workspace); !s.isOk()) {
    return internalError("compressing: " + s.message());
  }
  return Status::ok();
}

Result<std::span<const uint8_t>> HostBackend::encodeChunk(const kernels::StepContext& ctx,
                                                          const kernels::Chunking& chunking,
                                                          size_t chunk, int round,
                                                          std::span<const uint8_t> previous,
                                                          kernels::PayloadBuffer& out) {
  const kernels::Codec& sc = stepCodec();
  const size_t max = sc.maxPayloadBytes(chunking.size(chunk));
  if (out.size() < max) out.resize(max);
  auto size = sc.encodeChunk(ctx, chunking, chunk, round, previous, input(), stepState(),
                             buf_.workspace, std::span<uint8_t>(out.data(), max));
  if (!size) return internalError("compressing: " + size.status().message());
  return std::span<const uint8_t>(out.data(), *size);
}

Status HostBackend::checkSelection(const kernels::Chunking& chunking, size_t chunk,
                                   std::span<const uint8_t> sent,
                                   std::span<const uint8_t> selected) {
  if (auto st = stepCodec().checkSelection(chunking, chunk, sent, selected); !st.isOk()) {
    return dataLoss("the global selection of chunk " + std::to_string(chunk) + ": " + st.message());
  }
  return Status::ok();
}

Result<const float*> HostBackend::chunkInput(const kernels::Chunking& chunking, size_t chunk,
                                             std::vector<float>& /*scratch*/) {
  return input_ + chunking.begin(chunk);
}

Status HostBackend::prepareResult(bool in_place) {
  in_place_ = in_place && !stateReadsInput();
  if (in_place_) {
    result_ = reinterpret_cast<float*>(parts_[0]->data);
  } else {
    result_ = result_buf_.get(pool_, std::max<size_t>(n_, 1));
  }
  return Status::ok();
}

void HostBackend::scan(size_t lo, size_t hi) {
  if (kernels::simd::anyNonfinite(result_ + lo, hi - lo)) {
    nonfinite_.store(true, std::memory_order_relaxed);
  }
}

Status HostBackend::decodeChunk(const kernels::Chunking& chunking, size_t chunk,
                                std::span<const std::span<const uint8_t>> payloads, bool dense,
                                float weight) {
  const kernels::Codec& decoder = dense ? kernels::noneCodec() : stepCodec();
  const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
  if (payloads.empty()) std::fill_n(result_ + begin, len, 0.0f);
  // The first payload is decoded into the range (no pass to zero it), the others added to it.
  for (size_t k = 0; k < payloads.size(); ++k) {
    LW_RETURN_IF_ERROR(k == 0 ? decoder.decodeChunkInto(payloads[k], weight, result_ + begin, len)
                              : decoder.decodeChunk(payloads[k], weight, result_ + begin, len));
  }
  scan(begin, begin + len);
  return Status::ok();
}

Status HostBackend::decodeChunks(const kernels::Chunking& chunking,
                                 std::span<const std::vector<std::span<const uint8_t>>> lists,
                                 std::span<const char> done, bool dense, float weight) {
  // Chunks in parallel: each owns its range of the result.
  std::vector<std::string> errors(lists.size());
  kernels::parallelFor(&stream_, lists.size(), 1, [&](size_t lo, size_t hi) {
    for (size_t c = lo; c < hi; ++c) {
      if (done[c]) continue;
      if (Status st = decodeChunk(chunking, c, lists[c], dense, weight); !st.isOk()) {
        errors[c] = "chunk " + std::to_string(c) + ": " + st.message();
      }
    }
  });
  for (const auto& e : errors) {
    if (!e.empty()) return dataLoss(e);
  }
  return Status::ok();
}

Status HostBackend::decodeRounds(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                                 std::span<const std::span<const uint8_t>> rounds, float weight) {
  const kernels::Codec& sc = stepCodec();
  std::fill_n(result_, n_, 0.0f);
  if (auto s = sc.decodeRounds(rounds, weight, result_, n_); !s.isOk()) {
    return internalError("decompressing: " + s.message());
  }
  if (auto s = sc.finishStep(ctx, chunking, rounds, weight, input(), stepState(), buf_.workspace);
      !s.isOk()) {
    return internalError("finishing the step: " + s.message());
  }
  kernels::parallelFor(&stream_, n_, kGrain, [&](size_t lo, size_t hi) { scan(lo, hi); });
  return Status::ok();
}

Result<uint64_t> HostBackend::resultChecksum() {
  return XXH3_64bits_dispatch(result_, n_ * sizeof(float));
}

void HostBackend::copyResult() {
  for (auto* part : parts_) {
    kernels::parallelFor(&stream_, n_, kGrain, [&](size_t lo, size_t hi) {
      narrowRange(dtype_, result_, lo, hi, part->data);
    });
  }
}

Status HostBackend::writeBack() {
  if (in_place_) return Status::ok();
  // The input is a trainer's own memory and the commit reads it: the copy comes after the commit
  // (docs/determinism.md "4.6c Atomic steps (one copy of the state)").
  const auto* in = reinterpret_cast<const std::byte*>(input_);
  const bool input_is_trainers = std::any_of(parts_.begin(), parts_.end(),
                                             [&](const Contribution* p) { return p->data == in; });
  if (stateReadsInput() && input_is_trainers) {
    write_back_pending_ = true;
    return Status::ok();
  }
  copyResult();
  return Status::ok();
}

void HostBackend::commit(const Commit& c) {
  if (c.state && flushed_) {
    codec_.commitFlush(state_, n_);
  } else if (c.state && stateReadsInput()) {
    // The result goes to the trainer's buffer that holds the input in the commit's own pass.
    kernels::WriteBack wb;
    if (write_back_pending_ && inputIsTrainers(parts_.size(), dtype_)) {
      wb = {result_, reinterpret_cast<float*>(parts_[0]->data)};
    }
    if (auto st = codec_.commitState(ctx_, chunking_, input(), c.sent, c.selected, state_,
                                     buf_.workspace, wb);
        !st.isOk()) {
      // The payloads are this codec's own, made for this step: a codec bug. The state may be
      // partly updated: it starts over rather than carry a mix.
      spdlog::error("committing the codec state failed, the state is reset: {}", st.message());
      state_.reset();
    } else if (wb) {
      write_back_pending_ = false;
    }
  }
  stepState().detachWork();
  if (write_back_pending_) copyResult();
  write_back_pending_ = false;
  if (accumulated_) std::fill(buf_.accum.begin(), buf_.accum.end(), 0.0f);
}

}  // namespace lightwire::proxy
