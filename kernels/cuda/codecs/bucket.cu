// CUDA `terngrad`, `signsgd` and `onebit` (docs/determinism.md §4.9–4.11, docs/wire-format.md),
// byte-identical to kernels/codecs/bucket.cc.
//
// Encoding one chunk of n elements in buckets of d:
//   1. bucketReduceKernel: per bucket, per canonical block of 4096 elements (§2), eight threads;
//      thread j of the eight accumulates elements j, j+8, ... of the block in increasing order and
//      three shuffles combine the eight as ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)), exactly as the
//      CPU's block sums: terngrad the largest magnitude bits (an exact u32 maximum), signsgd the
//      fp64 sum of |x|, onebit the fp64 sums of P_i = (x < 0 ? +0 : x) and N_i = (x < 0 ? x : +0)
//      and the count of x < 0. One read of the chunk. When a bucket is one canonical block (d or n
//      <= 4096), the same threads finalise the bucket's scales; otherwise
//   1b. bucketFinalizeKernel adds each bucket's block results in block order (t = +0.0 + s_0 +
//      s_1 + ...) and finalises: terngrad s = max; signsgd (float)(S / (double)c); onebit
//      pos = (float)(ΣP / cp), neg = (float)(ΣN / cn) (0 when the count is 0). A scale that is
//      not finite sets the chunk's escape flag.
//   2. bucketEncodeKernel: tiles of 2048 elements, an octet per thread (one byte of 1-bit codes,
//      two of 2-bit codes), the second read of the chunk (mostly from L2). terngrad's block
//      computes the Philox groups of its tile into shared memory (one call per four elements) and
//      codes in fp64 as the scalar definition: p = |x| / s (__ddiv_rn), u = w · 2^-32, code =
//      u < p ? (x < 0 ? 2 : 1) : 0, code 0 when s = 0; signsgd and onebit code x < 0. The block
//      stages its codes in shared memory and writes them with aligned 32-bit stores; the thread
//      holding a bucket's first element writes its scale(s); thread 0 the header and the size.
//      When the escape flag is set, the same kernel writes the `none` layout instead.
// No atomics on the payload: every byte has one writer.
//
// Decoding (accumulate) is one pass, an octet per thread: value = +0 / s / −s (terngrad),
// scale / −scale (signsgd), pos / neg (onebit), out = out + (w · value) (__fmul_rn, __fadd_rn).

#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include "kernels/codecs/bucket.h"
#include "kernels/cuda/codec.h"
#include "kernels/cuda/codecs/dense_payload.cuh"
#include "kernels/cuda/device.cuh"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "kernels/reduce.h"

namespace lightwire::kernels::cuda {
namespace {

using codecs::kOctet;
using codecs::kTileElements;
using codecs::Prefix;

using Kind = BucketCodecKind;

/// Code width and fp32 scales per bucket of a kind (host and device constants).
template <Kind K>
inline constexpr unsigned kCodeBits = bucketKindInfo(K).bits;
template <Kind K>
inline constexpr unsigned kScalesPerBucket = bucketKindInfo(K).scales;

template <Kind K>
constexpr CodecId codecIdOf() {
  return bucketKindInfo(K).id;
}
template <Kind K>
constexpr const char* nameOf() {
  return bucketKindInfo(K).name;
}

/// kernels/codecs/bucket.h's bucketLayout for kind K.
template <Kind K>
std::optional<BucketLayout> bucketLayout(uint64_t n, uint64_t d) {
  return kernels::bucketLayout(n, d, bucketKindInfo(K));
}

/// The result of one canonical block: terngrad c = max magnitude bits; signsgd a = Σ|x|;
/// onebit a = ΣP, b = ΣN, c = count of x < 0.
struct Partial {
  double a;
  double b;
  uint32_t c;
};

/// One of the eight canonical accumulators of a block (and, after combine(), the block's result).
template <Kind K>
struct Acc {
  double a = 0.0;
  double b = 0.0;
  uint32_t c = 0;

  __device__ __forceinline__ void add(float x) {
    if constexpr (K == Kind::kTerngrad) {
      const uint32_t u = __float_as_uint(x) & 0x7FFFFFFFu;  // NaN and Inf above every finite
      c = u > c ? u : c;
    } else if constexpr (K == Kind::kSignsgd) {
      a = __dadd_rn(a, fabs(static_cast<double>(x)));
    } else {
      const double d = static_cast<double>(x);
      const bool negative = d < 0.0;
      a = __dadd_rn(a, negative ? 0.0 : d);
      b = __dadd_rn(b, negative ? d : 0.0);
      c += negative ? 1u : 0u;
    }
  }

  /// Accumulator = accumulator ⊕ that of the lane `delta` above (within groups of eight lanes).
  /// Called with delta 1, 2, 4 by all 32 lanes: lane 0 of each eight ends with
  /// ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)) (fp64 addition is commutative, so which lane holds which
  /// operand changes no bit); max and integer sums are exact in any order.
  __device__ __forceinline__ void combine(unsigned delta) {
    if constexpr (K == Kind::kTerngrad) {
      const uint32_t o = __shfl_down_sync(0xFFFFFFFFu, c, delta, 8);
      c = o > c ? o : c;
    } else if constexpr (K == Kind::kSignsgd) {
      a = __dadd_rn(a, __shfl_down_sync(0xFFFFFFFFu, a, delta, 8));
    } else {
      a = __dadd_rn(a, __shfl_down_sync(0xFFFFFFFFu, a, delta, 8));
      b = __dadd_rn(b, __shfl_down_sync(0xFFFFFFFFu, b, delta, 8));
      c += __shfl_down_sync(0xFFFFFFFFu, c, delta, 8);
    }
  }
};

/// Bucket k's scale(s) from its `count` block results in block order (len elements), as
/// BucketCodec::bucketScales; sets *non_finite when one is not finite.
template <Kind K>
__device__ void finalizeBucket(size_t k, uint64_t len, const Partial* blocks, size_t count,
                               float* scales, unsigned* non_finite) {
  bool bad;
  if constexpr (K == Kind::kTerngrad) {
    uint32_t m = 0;
    for (size_t b = 0; b < count; ++b) m = blocks[b].c > m ? blocks[b].c : m;
    scales[k] = __uint_as_float(m);
    bad = m >= 0x7F800000u;
  } else if constexpr (K == Kind::kSignsgd) {
    double sum = 0.0;
    for (size_t b = 0; b < count; ++b) sum = __dadd_rn(sum, blocks[b].a);
    const float scale = __double2float_rn(__ddiv_rn(sum, static_cast<double>(len)));
    scales[k] = scale;
    bad = (__float_as_uint(scale) & 0x7F800000u) == 0x7F800000u;
  } else {
    double pos = 0.0, neg = 0.0;
    uint64_t negatives = 0;
    for (size_t b = 0; b < count; ++b) {
      pos = __dadd_rn(pos, blocks[b].a);
      neg = __dadd_rn(neg, blocks[b].b);
      negatives += blocks[b].c;
    }
    const uint64_t positives = len - negatives;
    const float ps =
        positives > 0 ? __double2float_rn(__ddiv_rn(pos, static_cast<double>(positives))) : 0.0f;
    const float ns =
        negatives > 0 ? __double2float_rn(__ddiv_rn(neg, static_cast<double>(negatives))) : 0.0f;
    scales[2 * k] = ps;
    scales[2 * k + 1] = ns;
    bad = (__float_as_uint(ps) & 0x7F800000u) == 0x7F800000u ||
          (__float_as_uint(ns) & 0x7F800000u) == 0x7F800000u;
  }
  if (bad) atomicOr(non_finite, 1u);
}

/// What bucketReduceKernel needs (by value).
struct ReduceParams {
  const void* x;      // the chunk's first element
  size_t n, d;        // chunk elements, bucket size
  size_t bps;         // canonical blocks per bucket: ceil(min(d, n) / 4096)
  size_t total_cb;    // buckets · bps
  Partial* partials;  // bps > 1: the block results, bucket k's at k · bps
  float* scales;
  unsigned* non_finite;
};

template <Kind K, DType D>
__global__ void __launch_bounds__(kBlockThreads) bucketReduceKernel(const ReduceParams p) {
  const size_t groups_per_grid = static_cast<size_t>(gridDim.x) * (blockDim.x / 8);
  const unsigned j = threadIdx.x & 7;
  // `base` is the warp's first canonical block: uniform across the warp, so all 32 lanes run the
  // same iterations and reach every shuffle; lanes past the end add nothing.
  for (size_t base = (static_cast<size_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u)) / 8;
       base < p.total_cb; base += groups_per_grid) {
    const size_t cb = base + (threadIdx.x & 31) / 8;
    const bool live = cb < p.total_cb;
    Acc<K> acc;
    size_t bucket = 0, len = 0;
    if (live) {
      bucket = cb / p.bps;
      const size_t block = cb % p.bps;
      const size_t seg_begin = bucket * p.d;
      const size_t seg_end = p.n - seg_begin > p.d ? seg_begin + p.d : p.n;
      len = seg_end - seg_begin;
      // A short last bucket leaves its blocks past its end unused (begin >= seg_end: empty).
      const size_t begin = seg_begin + block * kReduceBlock;
      const size_t end = begin >= seg_end                 ? begin
                         : seg_end - begin > kReduceBlock ? begin + kReduceBlock
                                                          : seg_end;
      for (size_t i = begin + j; i < end; i += 8) acc.add(loadWidenedDevice<D>(p.x, i));
    }
    acc.combine(1);
    acc.combine(2);
    acc.combine(4);
    if (live && j == 0) {
      const Partial part{acc.a, acc.b, acc.c};
      if (p.bps == 1) {
        finalizeBucket<K>(bucket, len, &part, 1, p.scales, p.non_finite);
      } else {
        p.partials[cb] = part;
      }
    }
  }
}

/// Buckets of more than one canonical block: their block results, in block order.
template <Kind K>
__global__ void __launch_bounds__(kBlockThreads)
    bucketFinalizeKernel(const Partial* __restrict__ partials, size_t n, size_t d, size_t bps,
                         size_t buckets, float* __restrict__ scales,
                         unsigned* __restrict__ non_finite) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t k = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < buckets;
       k += stride) {
    const size_t len = n - k * d > d ? d : n - k * d;
    const size_t blocks = (len + kReduceBlock - 1) / kReduceBlock;
    finalizeBucket<K>(k, len, partials + k * bps, blocks, scales, non_finite);
  }
}

/// What bucketEncodeKernel needs (by value).
struct BucketEncodeParams {
  const void* x;  // the chunk's first element (whole-tensor index `begin`)
  size_t begin, n, d;
  DevicePhilox rng;  // terngrad
  const float* scales;
  const unsigned* non_finite;
  uint8_t* out;
  uint64_t* d_size;
  uint64_t scale_bytes, code_bytes, total;
  Prefix header, dense_header;
  bool x_vec;         // x is 16-byte aligned
  bool out_vec;       // out is 16-byte aligned
  bool out_aligned4;  // out is 4-byte aligned
};

template <Kind K, DType D>
__global__ void __launch_bounds__(kBlockThreads) bucketEncodeKernel(const BucketEncodeParams p) {
  constexpr bool kTernary = K == Kind::kTerngrad;
  constexpr unsigned kBits = kCodeBits<K>;
  constexpr unsigned kScales = kScalesPerBucket<K>;
  // terngrad: the Philox words of the tile, groups g0 .. g0 + 512 (element i uses word i & 3 of
  // group i >> 2).
  __shared__ uint32_t words[kTernary ? 4 * (2 * kBlockThreads + 1) : 1];
  __shared__ uint32_t stage[kBlockThreads * kBits / 4];
  const bool escape = *p.non_finite != 0;  // uniform over the grid
  const unsigned t = threadIdx.x;
  if (blockIdx.x == 0 && t == 0) {
    codecs::writePrefix(p.out, escape ? p.dense_header : p.header);
    *p.d_size = escape ? kHeaderBytes + 4 * uint64_t{p.n} : p.total;
  }
  uint8_t* const scales_out = p.out + kBucketHeaderBytes;
  uint8_t* const codes = scales_out + p.scale_bytes;
  const auto store_scales = [&](size_t k) {
#pragma unroll
    for (unsigned q = 0; q < kScales; ++q) {
      codecs::storeU32Bytes(scales_out + 4 * (kScales * k + q),
                            __float_as_uint(p.scales[kScales * k + q]));
    }
  };
  const size_t tiles = (p.n + kTileElements - 1) / kTileElements;
  for (size_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const size_t t0 = tile * kTileElements;
    const size_t j0 = t0 + size_t{kOctet} * t;
    const unsigned count =
        j0 < p.n ? static_cast<unsigned>(p.n - j0 < kOctet ? p.n - j0 : kOctet) : 0u;
    float v[kOctet];
    if (count > 0) codecs::loadOctet<D>(p.x, j0, count, p.x_vec, v);
    if (escape) {  // the `none` layout: the widened values
      if (count > 0) codecs::storeDenseOctet(p.out + kHeaderBytes, j0, count, p.out_vec, v);
      continue;
    }
    const uint64_t i_first = uint64_t{p.begin} + t0;
    [[maybe_unused]] const uint64_t g0 = i_first >> 2;
    if constexpr (kTernary) {
      const uint4 a = p.rng.group(g0 + t);
      const uint4 b = p.rng.group(g0 + kBlockThreads + t);
      uint32_t* wa = words + 4 * t;
      uint32_t* wb = words + 4 * (kBlockThreads + t);
      wa[0] = a.x, wa[1] = a.y, wa[2] = a.z, wa[3] = a.w;
      wb[0] = b.x, wb[1] = b.y, wb[2] = b.z, wb[3] = b.w;
      if (t == 0 && (i_first & 3) != 0) {  // the tile ends inside group g0 + 512
        const uint4 c = p.rng.group(g0 + 2 * kBlockThreads);
        uint32_t* wc = words + 4 * (2 * kBlockThreads);
        wc[0] = c.x, wc[1] = c.y, wc[2] = c.z, wc[3] = c.w;
      }
      __syncthreads();
    }
    uint32_t acc = 0;
    if (count > 0) {
      size_t k = j0 / p.d;
      size_t r = j0 - k * p.d;  // position in bucket k
      [[maybe_unused]] float s = kTernary ? p.scales[k] : 0.0f;
      if (r == 0) store_scales(k);
#pragma unroll
      for (unsigned e = 0; e < kOctet; ++e) {
        if (e < count) {
          uint32_t code;
          if constexpr (kTernary) {
            code = 0;  // s = 0: every x of the bucket is ±0, code 0, no word used
            if (s != 0.0f) {
              const uint64_t i = i_first + kOctet * t + e;  // whole-tensor index
              const uint32_t w = words[i - 4 * g0];
              const double prob =
                  __ddiv_rn(fabs(static_cast<double>(v[e])), static_cast<double>(s));
              const double u = __dmul_rn(static_cast<double>(w), 0x1p-32);  // exact
              code = u < prob ? (v[e] < 0.0f ? 2u : 1u) : 0u;
            }
          } else {
            code = v[e] < 0.0f ? 1u : 0u;  // ±0 give 0
          }
          acc |= code << (e * kBits);
          if (++r == p.d && e + 1 < count) {  // the next element starts bucket k + 1
            ++k;
            r = 0;
            if constexpr (kTernary) s = p.scales[k];
            store_scales(k);
          }
        }
      }
    }
    // Tile bytes [t0·bits/8, ...): 256·bits of them, fewer in the last tile.
    const uint64_t byte0 = uint64_t{t0} * kBits / 8;
    const uint64_t left = p.code_bytes - byte0;
    const size_t tile_bytes = static_cast<size_t>(
        left < uint64_t{kBlockThreads} * kBits ? left : uint64_t{kBlockThreads} * kBits);
    codecs::writeTileCodes(stage, kBits, acc, codes + byte0, tile_bytes, p.out_aligned4);
    __syncthreads();  // `words` and `stage` are rewritten by the next tile
  }
}

/// out[j] = out[j] + (w · value_j) for a trusted payload (the kind's or the `none` layout).
template <Kind K>
__global__ void __launch_bounds__(kBlockThreads)
    bucketAccumulateKernel(const uint8_t* __restrict__ payload, float weight,
                           float* __restrict__ out, size_t n, bool payload_vec, bool out_vec) {
  if (payload[3] == static_cast<uint8_t>(CodecId::kNone)) {
    codecs::accumulateDenseBody(payload + kHeaderBytes, weight, out, n, payload_vec, out_vec);
    return;
  }
  constexpr unsigned kBits = kCodeBits<K>;
  constexpr unsigned kScales = kScalesPerBucket<K>;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  const uint64_t d = codecs::loadU32Bytes(payload + kHeaderBytes);
  const uint64_t buckets = n / d + (n % d != 0 ? 1 : 0);
  const uint8_t* const scales = payload + kBucketHeaderBytes;
  const uint8_t* const codes = scales + 4 * kScales * buckets;
  const uint64_t code_bytes = (uint64_t{n} * kBits + 7) / 8;
  const auto scale_at = [&](uint64_t k, unsigned q) {
    return __uint_as_float(codecs::loadU32Bytes(scales + 4 * (kScales * k + q)));
  };
  const size_t octets = (n + kOctet - 1) / kOctet;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t o = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < octets;
       o += stride) {
    const size_t j0 = o * kOctet;
    const unsigned count = static_cast<unsigned>(n - j0 < kOctet ? n - j0 : kOctet);
    uint32_t bits = 0;  // the octet's code byte(s) (those inside the stream)
#pragma unroll
    for (unsigned q = 0; q < kBits; ++q) {
      const uint64_t at = uint64_t{o} * kBits + q;
      if (at < code_bytes) bits |= uint32_t{codes[at]} << (8 * q);
    }
    float acc[kOctet];
    codecs::loadOutOctet(out + j0, count, out_vec, acc);
    uint64_t k = j0 / d;
    uint64_t r = j0 - k * d;
    float a = scale_at(k, 0);
    [[maybe_unused]] float b = kScales == 2 ? scale_at(k, kScales - 1) : 0.0f;
#pragma unroll
    for (unsigned e = 0; e < kOctet; ++e) {
      if (e < count) {
        const uint32_t code = (bits >> (e * kBits)) & kMask;
        float value;
        if constexpr (K == Kind::kTerngrad) {
          value = code == 0 ? 0.0f : (code == 1 ? a : -a);
        } else if constexpr (K == Kind::kSignsgd) {
          value = code != 0 ? -a : a;
        } else {
          value = code != 0 ? b : a;
        }
        acc[e] = __fadd_rn(acc[e], __fmul_rn(weight, value));
        if (++r == d && e + 1 < count) {
          ++k;
          r = 0;
          a = scale_at(k, 0);
          if constexpr (kScales == 2) b = scale_at(k, 1);
        }
      }
    }
    codecs::storeOutOctet(out + j0, count, out_vec, acc);
  }
}

/// terngrad, signsgd or onebit on the GPU with a fixed bucket size. Stateless (error feedback is
/// the decorator's); immutable and thread-safe.
template <Kind K>
class BucketCudaCodec final : public CudaCodec {
 public:
  explicit BucketCudaCodec(std::unique_ptr<Codec> host)
      : host_(std::move(host)), bucket_(host_->config().bucket_size) {}

  const Codec& host() const override { return *host_; }

  /// Per chunk (the largest): the escape flag, the scales, and the block results of buckets of
  /// more than one canonical block.
  size_t workspaceBytes(const Chunking& c) const override {
    const size_t m = c.elements < c.chunk_elements ? c.elements : c.chunk_elements;
    const size_t buckets = (m + bucket_ - 1) / bucket_;
    const size_t bps = blocksPerBucket(m);
    return codecs::DeviceCarver::bytesFor({sizeof(unsigned),
                                           kScalesPerBucket<K> * buckets * sizeof(float),
                                           bps > 1 ? buckets * bps * sizeof(Partial) : 0});
  }

  Status accumulate(const uint8_t* d_payload, float weight, float* d_out, size_t out_elements,
                    DeviceBytes, cudaStream_t stream) const override {
    if (out_elements == 0) return Status::ok();
    if (d_payload == nullptr || d_out == nullptr) {
      return invalidArgument(std::string(nameOf<K>()) + " (cuda): payload or output is null");
    }
    const size_t octets = (out_elements + kOctet - 1) / kOctet;
    bucketAccumulateKernel<K><<<blocksFor(octets), kBlockThreads, 0, stream>>>(
        d_payload, weight, d_out, out_elements, codecs::isAligned(d_payload, 16),
        codecs::isAligned(d_out, 16));
    return cudaStatus(cudaGetLastError(), std::string(nameOf<K>()) + " (cuda) decode");
  }

  /// Every check of BucketCodec::decodeChunk, in its order, without decoding: O(buckets) reads of
  /// the scales and O(payload) of the codes (padding, terngrad's code 3), no O(out_elements)
  /// output.
  Status validate(std::span<const uint8_t> payload, size_t out_elements) const override {
    auto parsed = parseBucketPayload(K, payload, out_elements);
    if (!parsed) return parsed.status();
    if (parsed->header.codec == CodecId::kNone) {
      return codecs::checkDenseLength(payload, parsed->header);
    }
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
    const std::string name = nameOf<K>();
    const size_t begin = chunking.begin(chunk), n = chunking.size(chunk);
    const auto layout = bucketLayout<K>(n, bucket_);
    if (!layout) {
      return outOfRange(name + " chunk of " + std::to_string(n) + " elements is too large");
    }
    const auto buckets = static_cast<size_t>(layout->buckets);
    const size_t bps = blocksPerBucket(n);

    codecs::DeviceCarver carve(workspace);
    auto* non_finite = carve.take<unsigned>(1);
    auto* scales = carve.take<float>(kScalesPerBucket<K> * buckets);
    Partial* partials = bps > 1 ? carve.take<Partial>(buckets * bps) : nullptr;

    LW_RETURN_IF_ERROR(cudaStatus(cudaMemsetAsync(non_finite, 0, sizeof(unsigned), stream),
                                  name + " (cuda) encode"));
    const void* chunk_x = static_cast<const char*>(input.data) + begin * dtypeSize(input.dtype);
    if (n > 0) {
      const ReduceParams r{chunk_x, n, bucket_, bps, buckets * bps, partials, scales, non_finite};
      // 32 canonical blocks (eight threads each) per CUDA block.
      const unsigned grid = codecs::gridFor((r.total_cb + 31) / 32);
      visitDeviceDType(input.dtype, [&](auto d) {
        bucketReduceKernel<K, decltype(d)::value><<<grid, kBlockThreads, 0, stream>>>(r);
      });
      LW_RETURN_IF_ERROR(cudaStatus(cudaGetLastError(), name + " (cuda) bucket scales"));
      if (bps > 1) {
        bucketFinalizeKernel<K><<<blocksFor(buckets), kBlockThreads, 0, stream>>>(
            partials, n, bucket_, bps, buckets, scales, non_finite);
        LW_RETURN_IF_ERROR(cudaStatus(cudaGetLastError(), name + " (cuda) bucket scales"));
      }
    }

    BucketEncodeParams p{};
    p.x = chunk_x;
    p.begin = begin;
    p.n = n;
    p.d = bucket_;
    p.rng = DevicePhilox{ctx.seed, ctx.name_key, static_cast<uint32_t>(ctx.step), ctx.rank,
                         static_cast<uint32_t>(RandomPurpose::kTerngradRounding)};
    p.scales = scales;
    p.non_finite = non_finite;
    p.out = d_out;
    p.d_size = d_size;
    p.scale_bytes = layout->scale_bytes;
    p.code_bytes = layout->code_bytes;
    p.total = layout->total;
    p.header = codecs::headerPrefix({codecIdOf<K>(), input.dtype, 0, 0, n});
    storeU32(p.header.bytes + kHeaderBytes, bucket_);
    p.header.size = static_cast<uint32_t>(kBucketHeaderBytes);
    p.dense_header = codecs::densePrefix(input.dtype, n);
    p.x_vec = codecs::isAligned(chunk_x, 16);
    p.out_vec = codecs::isAligned(d_out, 16);
    p.out_aligned4 = codecs::isAligned(d_out, 4);
    const unsigned grid = codecs::gridFor((n + kTileElements - 1) / kTileElements);
    visitDeviceDType(input.dtype, [&](auto d) {
      bucketEncodeKernel<K, decltype(d)::value><<<grid, kBlockThreads, 0, stream>>>(p);
    });
    return cudaStatus(cudaGetLastError(), name + " (cuda) encode");
  }

 private:
  /// Canonical blocks of the longest bucket of a chunk of n elements (at least 1).
  size_t blocksPerBucket(size_t n) const {
    const size_t longest = n < bucket_ ? n : bucket_;
    const size_t blocks = (longest + kReduceBlock - 1) / kReduceBlock;
    return blocks == 0 ? 1 : blocks;
  }

  std::unique_ptr<Codec> host_;
  uint32_t bucket_;
};

template <Kind K>
Result<std::unique_ptr<CudaCodec>> makeBucket(std::unique_ptr<Codec> host) {
  return std::unique_ptr<CudaCodec>(new BucketCudaCodec<K>(std::move(host)));
}

LW_REGISTER_CUDA_CODEC(terngrad, CodecId::kTerngrad, makeBucket<Kind::kTerngrad>);
LW_REGISTER_CUDA_CODEC(signsgd, CodecId::kSignsgd, makeBucket<Kind::kSignsgd>);
LW_REGISTER_CUDA_CODEC(onebit, CodecId::kOnebit, makeBucket<Kind::kOnebit>);

}  // namespace
}  // namespace lightwire::kernels::cuda
