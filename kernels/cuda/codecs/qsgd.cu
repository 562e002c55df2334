// CUDA `qsgd` (docs/determinism.md §4.5, docs/wire-format.md), byte-identical to
// kernels/codecs/qsgd.cc.
//
// Encoding one chunk of n elements in buckets of d, b bits per code, s = 2^(b-1) - 1 levels:
//   1. canonicalSegmentSums (kernels/cuda/reduce.h): per bucket the canonical fp64 sum of squares
//      (§2, indices relative to the bucket), one read of the chunk.
//   2. qsgdNormsKernel, per bucket: norm = (float)sqrt(sum) (__dsqrt_rn, __double2float_rn, as
//      std::sqrt and the cast), F = (float)s / norm (__fdiv_rn; FLT_MAX where +Inf) once per bucket
//      as qsgdFactor, and a device flag when a norm is not finite (the chunk is escaped).
//   3. qsgdEncodeKernel, one tile of 2048 elements per block iteration, an octet of eight
//      elements per thread (b whole bytes of codes), the second read of the chunk (mostly from
//      L2): the block computes the Philox groups its tile needs into shared memory (one call per
//      group, i.e. per eight elements), each thread quantises its octet with the fp32 arithmetic
//      of simd::qsgdQuantize and stages its b code bytes, and the block writes the tile's codes
//      with aligned 32-bit stores. The thread holding a bucket's first element writes its norm;
//      thread 0 writes the 24-byte header and the size. When the flag is set the same kernel
//      writes the `none` layout instead (§4.5 step 2, writeDensePayload's bytes).
// No atomics on the payload: every byte has one writer.
//
// Decoding (accumulate) is one pass, an octet per thread: the b code bytes of the octet, scale =
// norm / (float)s (__fdiv_rn) per bucket, v = (float)level · scale, negated for sign 1, and
// out = out + (w · v), as simd::qsgdDequantize. b and d are read from the payload on the device.

#include <cfloat>
#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include "kernels/codecs/qsgd_layout.h"
#include "kernels/cuda/codec.h"
#include "kernels/cuda/codecs/dense_payload.cuh"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/reduce.h"
#include "kernels/payload.h"
#include "kernels/philox.h"

namespace lightwire::kernels::cuda {
namespace {

using codecs::kOctet;
using codecs::kTileElements;
using codecs::Prefix;

/// Bucket k's norm and quantisation factor F (0 when the norm is 0 or not finite).
struct NormFactor {
  float norm;
  float factor;
};

__global__ void __launch_bounds__(kBlockThreads)
    qsgdNormsKernel(const double* __restrict__ sums, size_t buckets, float s_f,
                    NormFactor* __restrict__ nf, unsigned* __restrict__ non_finite) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t k = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < buckets;
       k += stride) {
    const float norm = __double2float_rn(__dsqrt_rn(sums[k]));
    float factor = 0.0f;
    if ((__float_as_uint(norm) & 0x7F800000u) == 0x7F800000u) {  // NaN or ±Inf
      atomicOr(non_finite, 1u);
    } else if (norm != 0.0f) {
      factor = __fdiv_rn(s_f, norm);
      factor = factor > FLT_MAX ? FLT_MAX : factor;
    }
    nf[k] = NormFactor{norm, factor};
  }
}

/// One element's code (simd::qsgdQuantize's quantizeOne), all fp32, no FMA: R = |x| · F,
/// fl = floor(R), p = R − fl, U = h · 2^-16, level = min(fl + (U < p), s).
__device__ __forceinline__ uint32_t quantizeOne(float x, uint32_t h, float factor, float s_f,
                                                unsigned sign_shift) {
  const float r = __fmul_rn(fabsf(x), factor);
  const float fl = floorf(r);
  const float p = __fsub_rn(r, fl);                            // exact
  const float u = __fmul_rn(static_cast<float>(h), 0x1p-16f);  // exact
  float level = __fadd_rn(fl, u < p ? 1.0f : 0.0f);            // exact (fl <= 2^8)
  level = level < s_f ? level : s_f;
  const uint32_t sign = x < 0.0f ? 1u : 0u;
  return (sign << sign_shift) | static_cast<uint32_t>(level);
}

/// Everything qsgdEncodeKernel needs (by value).
struct QsgdEncodeParams {
  const void* x;  // the chunk's first element (whole-tensor index `begin`)
  size_t begin, n, d;
  unsigned bits;
  float s_f;
  DevicePhilox rng;
  const NormFactor* nf;
  const unsigned* non_finite;
  uint8_t* out;
  uint64_t* d_size;
  uint64_t buckets, code_bytes, total;
  Prefix header, dense_header;
  bool x_vec;         // x is 16-byte aligned
  bool out_vec;       // out is 16-byte aligned
  bool out_aligned4;  // out is 4-byte aligned
};

template <DType D>
__global__ void __launch_bounds__(kBlockThreads) qsgdEncodeKernel(const QsgdEncodeParams p) {
  // Philox words of the tile: groups g0 .. g0 + 256 (element i uses half i & 1 of stream word
  // i >> 1, i.e. word (i >> 1) & 3 of group i >> 3).
  __shared__ uint32_t words[4 * (kBlockThreads + 1)];
  __shared__ uint32_t stage[kBlockThreads * 8 / 4];  // up to 8 code bytes per thread
  const bool escape = *p.non_finite != 0;            // uniform over the grid
  const unsigned t = threadIdx.x;
  if (blockIdx.x == 0 && t == 0) {
    codecs::writePrefix(p.out, escape ? p.dense_header : p.header);
    *p.d_size = escape ? kHeaderBytes + 4 * uint64_t{p.n} : p.total;
  }
  const void* const x = p.x;
  uint8_t* const norms = p.out + kQsgdHeaderBytes;
  uint8_t* const codes = norms + 4 * p.buckets;
  const unsigned sign_shift = p.bits - 1;
  const size_t tiles = (p.n + kTileElements - 1) / kTileElements;
  for (size_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const size_t t0 = tile * kTileElements;
    const size_t j0 = t0 + size_t{kOctet} * t;
    const unsigned count =
        j0 < p.n ? static_cast<unsigned>(p.n - j0 < kOctet ? p.n - j0 : kOctet) : 0u;
    float v[kOctet];
    if (count > 0) codecs::loadOctet<D>(x, j0, count, p.x_vec, v);
    if (escape) {  // the `none` layout: the widened values
      if (count > 0) codecs::storeDenseOctet(p.out + kHeaderBytes, j0, count, p.out_vec, v);
      continue;
    }
    const uint64_t i_first = uint64_t{p.begin} + t0;
    const uint64_t g0 = i_first >> 3;
    {
      const uint4 w = p.rng.group(g0 + t);
      words[4 * t] = w.x, words[4 * t + 1] = w.y, words[4 * t + 2] = w.z, words[4 * t + 3] = w.w;
      if (t == 0 && (i_first & 7) != 0) {  // the tile ends inside group g0 + 256
        const uint4 u = p.rng.group(g0 + kBlockThreads);
        uint32_t* last = words + 4 * kBlockThreads;
        last[0] = u.x, last[1] = u.y, last[2] = u.z, last[3] = u.w;
      }
    }
    __syncthreads();
    uint64_t acc = 0;
    if (count > 0) {
      size_t k = j0 / p.d;
      size_t r = j0 - k * p.d;  // position in bucket k
      NormFactor nf = p.nf[k];
      if (r == 0) codecs::storeU32Bytes(norms + 4 * k, __float_as_uint(nf.norm));
#pragma unroll
      for (unsigned e = 0; e < kOctet; ++e) {
        if (e < count) {
          uint32_t code = 0;  // norm 0: every x is ±0, level 0 and sign 0, no word used
          if (nf.norm != 0.0f) {
            const uint64_t i = i_first + kOctet * t + e;  // whole-tensor index
            const uint32_t word = words[(i >> 1) - 4 * g0];
            const uint32_t h = (i & 1) != 0 ? word >> 16 : word & 0xFFFFu;
            code = quantizeOne(v[e], h, nf.factor, p.s_f, sign_shift);
          }
          acc |= uint64_t{code} << (e * p.bits);
          if (++r == p.d && e + 1 < count) {  // the next element starts bucket k + 1
            ++k;
            r = 0;
            nf = p.nf[k];
            codecs::storeU32Bytes(norms + 4 * k, __float_as_uint(nf.norm));
          }
        }
      }
    }
    // Tile bytes [t0·b/8, ...): 256·b of them, fewer in the last tile (t0·b is a multiple of 8).
    const uint64_t byte0 = uint64_t{t0} * p.bits / 8;
    const uint64_t left = p.code_bytes - byte0;
    const size_t tile_bytes = static_cast<size_t>(
        left < uint64_t{kBlockThreads} * p.bits ? left : uint64_t{kBlockThreads} * p.bits);
    codecs::writeTileCodes(stage, p.bits, acc, codes + byte0, tile_bytes, p.out_aligned4);
    __syncthreads();  // `words` and `stage` are rewritten by the next tile
  }
}

/// out[j] = out[j] + (w · value_j) for a trusted payload (qsgd or `none` layout) of n elements.
__global__ void __launch_bounds__(kBlockThreads)
    qsgdAccumulateKernel(const uint8_t* __restrict__ payload, float weight, float* __restrict__ out,
                         size_t n, bool payload_vec, bool out_vec) {
  if (payload[3] == static_cast<uint8_t>(CodecId::kNone)) {
    codecs::accumulateDenseBody(payload + kHeaderBytes, weight, out, n, payload_vec, out_vec);
    return;
  }
  const unsigned b = payload[16];
  const uint64_t d = codecs::loadU32Bytes(payload + 20);
  const uint32_t s = (1u << (b - 1)) - 1;
  const float s_f = static_cast<float>(s);
  const uint32_t mask = (1u << b) - 1;
  const uint64_t buckets = n / d + (n % d != 0 ? 1 : 0);
  const uint8_t* const norms = payload + kQsgdHeaderBytes;
  const uint8_t* const codes = norms + 4 * buckets;
  const uint64_t code_bytes = (uint64_t{n} * b + 7) / 8;
  const size_t octets = (n + kOctet - 1) / kOctet;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t o = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < octets;
       o += stride) {
    const size_t j0 = o * kOctet;
    const unsigned count = static_cast<unsigned>(n - j0 < kOctet ? n - j0 : kOctet);
    uint64_t bits = 0;  // the octet's b code bytes (those inside the stream)
    for (unsigned q = 0; q < b; ++q) {
      const uint64_t at = uint64_t{o} * b + q;
      if (at < code_bytes) bits |= uint64_t{codes[at]} << (8 * q);
    }
    float acc[kOctet];
    codecs::loadOutOctet(out + j0, count, out_vec, acc);
    uint64_t k = j0 / d;
    uint64_t r = j0 - k * d;
    float scale = __fdiv_rn(__uint_as_float(codecs::loadU32Bytes(norms + 4 * k)), s_f);
#pragma unroll
    for (unsigned e = 0; e < kOctet; ++e) {
      if (e < count) {
        const uint32_t code = static_cast<uint32_t>(bits >> (e * b)) & mask;
        const float v = __fmul_rn(static_cast<float>(static_cast<int32_t>(code & s)), scale);
        const float value = (code >> (b - 1)) != 0 ? -v : v;
        acc[e] = __fadd_rn(acc[e], __fmul_rn(weight, value));
        if (++r == d && e + 1 < count) {
          ++k;
          r = 0;
          scale = __fdiv_rn(__uint_as_float(codecs::loadU32Bytes(norms + 4 * k)), s_f);
        }
      }
    }
    codecs::storeOutOctet(out + j0, count, out_vec, acc);
  }
}

/// QSGD on the GPU with fixed bits and bucket size. Stateless; immutable and thread-safe.
class QsgdCudaCodec final : public CudaCodec {
 public:
  explicit QsgdCudaCodec(std::unique_ptr<Codec> host)
      : host_(std::move(host)),
        bits_(static_cast<unsigned>(host_->config().bits)),
        levels_((1u << (bits_ - 1)) - 1),
        bucket_(host_->config().bucket_size) {}

  const Codec& host() const override { return *host_; }

  /// Per chunk (the largest): the escape flag, norms and factors, the bucket sums, and the scratch
  /// canonicalSegmentSums needs for buckets above 4096 elements.
  size_t workspaceBytes(const Chunking& c) const override {
    const size_t m = c.elements < c.chunk_elements ? c.elements : c.chunk_elements;
    const size_t buckets = (m + bucket_ - 1) / bucket_;
    return codecs::DeviceCarver::bytesFor({sizeof(unsigned), buckets * sizeof(NormFactor),
                                           buckets * sizeof(double),
                                           canonicalSegmentScratch(m, bucket_) * sizeof(double)});
  }

  Status accumulate(const uint8_t* d_payload, float weight, float* d_out, size_t out_elements,
                    DeviceBytes, cudaStream_t stream) const override {
    if (out_elements == 0) return Status::ok();
    if (d_payload == nullptr || d_out == nullptr) {
      return invalidArgument("qsgd (cuda): payload or output is null");
    }
    const size_t octets = (out_elements + kOctet - 1) / kOctet;
    qsgdAccumulateKernel<<<blocksFor(octets), kBlockThreads, 0, stream>>>(
        d_payload, weight, d_out, out_elements, codecs::isAligned(d_payload, 16),
        codecs::isAligned(d_out, 16));
    return cudaStatus(cudaGetLastError(), "qsgd (cuda) decode");
  }

  /// Every check of QsgdCodec::decodeChunk, in its order, without decoding: O(buckets) reads of
  /// the norms and O(payload) of the padding, no O(out_elements) output.
  Status validate(std::span<const uint8_t> payload, size_t out_elements) const override {
    auto q = parseQsgdPayload(payload, out_elements);
    if (!q) return q.status();
    if (q->header.codec == CodecId::kNone) return codecs::checkDenseLength(payload, q->header);
    return Status::ok();
  }

 protected:
  Status doAnalyze(const StepContext&, const Chunking&, DeviceTensor, DeviceState&, DeviceBytes,
                   cudaStream_t) const override {
    return Status::ok();
  }

  Status doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk, int,
                       std::span<const uint8_t>, DeviceTensor input, DeviceState&,
                       DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                       cudaStream_t stream) const override {
    const size_t begin = chunking.begin(chunk), n = chunking.size(chunk);
    const auto layout = qsgdLayout(n, bucket_, bits_);
    if (!layout) return outOfRange("qsgd chunk of " + std::to_string(n) + " elements is too large");
    const auto buckets = static_cast<size_t>(layout->buckets);

    codecs::DeviceCarver carve(workspace);
    auto* non_finite = carve.take<unsigned>(1);
    auto* nf = carve.take<NormFactor>(buckets);
    auto* sums = carve.take<double>(buckets);
    const size_t seg_scratch = canonicalSegmentScratch(n, bucket_);
    double* seg = seg_scratch > 0 ? carve.take<double>(seg_scratch) : nullptr;

    LW_RETURN_IF_ERROR(
        cudaStatus(cudaMemsetAsync(non_finite, 0, sizeof(unsigned), stream), "qsgd (cuda) encode"));
    const size_t width = dtypeSize(input.dtype);
    const void* chunk_x = static_cast<const char*>(input.data) + begin * width;
    if (n > 0) {
      LW_RETURN_IF_ERROR(cudaStatus(canonicalSegmentSums(chunk_x, input.dtype, n, bucket_,
                                                         ReduceTerm::kSquare, sums, seg, stream),
                                    "qsgd (cuda) bucket norms"));
      qsgdNormsKernel<<<blocksFor(buckets), kBlockThreads, 0, stream>>>(
          sums, buckets, static_cast<float>(levels_), nf, non_finite);
      LW_RETURN_IF_ERROR(cudaStatus(cudaGetLastError(), "qsgd (cuda) bucket norms"));
    }

    QsgdEncodeParams p{};
    p.x = chunk_x;
    p.begin = begin;
    p.n = n;
    p.d = bucket_;
    p.bits = bits_;
    p.s_f = static_cast<float>(levels_);
    p.rng = DevicePhilox{ctx.seed, ctx.name_key, static_cast<uint32_t>(ctx.step), ctx.rank,
                         static_cast<uint32_t>(RandomPurpose::kQsgdRounding)};
    p.nf = nf;
    p.non_finite = non_finite;
    p.out = d_out;
    p.d_size = d_size;
    p.buckets = layout->buckets;
    p.code_bytes = layout->code_bytes;
    p.total = layout->total;
    p.header = codecs::headerPrefix({CodecId::kQsgd, input.dtype, 0, 0, n});
    p.header.bytes[16] = static_cast<uint8_t>(bits_);
    p.header.bytes[17] = p.header.bytes[18] = p.header.bytes[19] = 0;
    storeU32(p.header.bytes + 20, bucket_);
    p.header.size = static_cast<uint32_t>(kQsgdHeaderBytes);
    p.dense_header = codecs::densePrefix(input.dtype, n);
    p.x_vec = codecs::isAligned(chunk_x, 16);
    p.out_vec = codecs::isAligned(d_out, 16);
    p.out_aligned4 = codecs::isAligned(d_out, 4);
    const unsigned grid = codecs::gridFor((n + kTileElements - 1) / kTileElements);
    visitDeviceDType(input.dtype, [&](auto d) {
      qsgdEncodeKernel<decltype(d)::value><<<grid, kBlockThreads, 0, stream>>>(p);
    });
    return cudaStatus(cudaGetLastError(), "qsgd (cuda) encode");
  }

 private:
  std::unique_ptr<Codec> host_;
  unsigned bits_;
  uint32_t levels_;  // s = 2^(b-1) - 1
  uint32_t bucket_;
};

LW_REGISTER_CUDA_CODEC(qsgd, CodecId::kQsgd,
                       [](std::unique_ptr<Codec> host) -> Result<std::unique_ptr<CudaCodec>> {
                         return std::unique_ptr<CudaCodec>(new QsgdCudaCodec(std::move(host)));
                       });

}  // namespace
}  // namespace lightwire::kernels::cuda
