#pragma once
// Private helpers of the CUDA dense and quantising codecs (codecs/dense.cu, qsgd.cu, bucket.cu):
// payload prefixes written by a kernel, octet-wise loads and stores (eight consecutive elements per
// thread, 16-byte vector accesses where the host found the pointers aligned, byte accesses
// otherwise, so no pointer alignment is ever assumed), the `none` layout (the dense escape every
// decoder accepts), workspace carving and the host-side checks decodeDenseF32 makes.
//
// Everything here is exact data movement: no arithmetic that could round differently from the CPU
// except the documented accumulation out = out + (w · v) (__fmul_rn, then __fadd_rn).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>

#include "kernels/cuda/codec.h"
#include "kernels/cuda/device.cuh"
#include "kernels/payload.h"

namespace lightwire::kernels::cuda::codecs {

/// Elements one thread handles (whole bytes of codes for any code width up to 8 bits).
inline constexpr unsigned kOctet = 8;
/// Elements of one tile: one CUDA block of kBlockThreads threads, an octet each.
inline constexpr size_t kTileElements = size_t{kBlockThreads} * kOctet;

/// Grid for a loop over `items` tiles or octets (at least one block: thread 0 of block 0 writes
/// the payload prefix and size even for an empty chunk).
inline unsigned gridFor(size_t items) {
  return static_cast<unsigned>(items == 0 ? 1 : (items < kMaxBlocks ? items : kMaxBlocks));
}

/// Whether host-visible device address p is a multiple of `alignment`.
inline bool isAligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

/// Up to 32 bytes a kernel writes at the start of a payload, built on the host with writeHeader.
struct Prefix {
  uint8_t bytes[32];
  uint32_t size;
};

/// The 16-byte header of a payload.
inline Prefix headerPrefix(const PayloadHeader& h) {
  Prefix p{};
  writeHeader(p.bytes, h);
  p.size = static_cast<uint32_t>(kHeaderBytes);
  return p;
}

/// The header of the `none` layout of n elements handed in as `dtype` (writeDensePayload's).
inline Prefix densePrefix(DType dtype, uint64_t n) {
  return headerPrefix({CodecId::kNone, dtype, 0, 0, n});
}

__device__ __forceinline__ void writePrefix(uint8_t* out, const Prefix& p) {
#pragma unroll
  for (uint32_t q = 0; q < sizeof p.bytes; ++q) {
    if (q < p.size) out[q] = p.bytes[q];
  }
}

__device__ __forceinline__ uint32_t loadU32Bytes(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

__device__ __forceinline__ void storeU32Bytes(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
}

/// fp32 of 16-bit bits h of dtype D (exact, kernels/half_bits.h).
template <DType D>
__device__ __forceinline__ float widen16(uint32_t h) {
  if constexpr (D == DType::kF16) {
    return __uint_as_float(bits::halfToFloatBits(static_cast<uint16_t>(h)));
  } else {
    return __uint_as_float(bits::bf16ToFloatBits(static_cast<uint16_t>(h)));
  }
}

/// v[e] = element i0 + e of x (dtype D) widened to fp32, for e < count (<= 8); v[e] = 0 beyond.
/// vec: x + i0 is 16-byte aligned (the caller checked x + first index on the host; octets start
/// at multiples of 8 elements), so a full octet is one or two 16-byte loads.
template <DType D>
__device__ __forceinline__ void loadOctet(const void* x, size_t i0, unsigned count, bool vec,
                                          float (&v)[kOctet]) {
  if (vec && count == kOctet) {
    if constexpr (D == DType::kF32) {
      const auto* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + i0);
      const float4 a = p[0], b = p[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + i0);
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (unsigned m = 0; m < 4; ++m) {
        v[2 * m] = widen16<D>(w[m] & 0xFFFFu);
        v[2 * m + 1] = widen16<D>(w[m] >> 16);
      }
    }
    return;
  }
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) v[e] = e < count ? loadWidenedDevice<D>(x, i0 + e) : 0.0f;
}

/// v[e] = out[e] for e < count; vec: out is 16-byte aligned.
__device__ __forceinline__ void loadOutOctet(const float* out, unsigned count, bool vec,
                                             float (&v)[kOctet]) {
  if (vec && count == kOctet) {
    const auto* p = reinterpret_cast<const float4*>(out);
    const float4 a = p[0], b = p[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) v[e] = e < count ? out[e] : 0.0f;
}

/// out[e] = v[e] for e < count; vec: out is 16-byte aligned.
__device__ __forceinline__ void storeOutOctet(float* out, unsigned count, bool vec,
                                              const float (&v)[kOctet]) {
  if (vec && count == kOctet) {
    auto* p = reinterpret_cast<float4*>(out);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) {
    if (e < count) out[e] = v[e];
  }
}

/// w[e] = the e-th of `count` (<= 8) consecutive little-endian u32 at p; vec: p 16-byte aligned.
__device__ __forceinline__ void loadWordOctet(const uint8_t* p, unsigned count, bool vec,
                                              uint32_t (&w)[kOctet]) {
  if (vec && count == kOctet) {
    const auto* q = reinterpret_cast<const uint4*>(p);
    const uint4 a = q[0], b = q[1];
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    return;
  }
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) w[e] = e < count ? loadU32Bytes(p + 4 * e) : 0u;
}

/// The e-th of `count` consecutive little-endian u32 at p = w[e]; vec: p 16-byte aligned.
__device__ __forceinline__ void storeWordOctet(uint8_t* p, unsigned count, bool vec,
                                               const uint32_t (&w)[kOctet]) {
  if (vec && count == kOctet) {
    auto* q = reinterpret_cast<uint4*>(p);
    q[0] = make_uint4(w[0], w[1], w[2], w[3]);
    q[1] = make_uint4(w[4], w[5], w[6], w[7]);
    return;
  }
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) {
    if (e < count) storeU32Bytes(p + 4 * e, w[e]);
  }
}

/// h[e] = the e-th of `count` (<= 8) consecutive little-endian u16 at p; vec: p 16-byte aligned.
__device__ __forceinline__ void loadHalfOctet(const uint8_t* p, unsigned count, bool vec,
                                              uint32_t (&h)[kOctet]) {
  if (vec && count == kOctet) {
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (unsigned m = 0; m < 4; ++m) {
      h[2 * m] = w[m] & 0xFFFFu;
      h[2 * m + 1] = w[m] >> 16;
    }
    return;
  }
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) {
    h[e] = e < count ? (uint32_t{p[2 * e]} | (uint32_t{p[2 * e + 1]} << 8)) : 0u;
  }
}

/// The e-th of `count` consecutive little-endian u16 at p = h[e] (low 16 bits); vec: p 16-byte
/// aligned.
__device__ __forceinline__ void storeHalfOctet(uint8_t* p, unsigned count, bool vec,
                                               const uint32_t (&h)[kOctet]) {
  if (vec && count == kOctet) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4((h[0] & 0xFFFFu) | (h[1] << 16), (h[2] & 0xFFFFu) | (h[3] << 16),
                   (h[4] & 0xFFFFu) | (h[5] << 16), (h[6] & 0xFFFFu) | (h[7] << 16));
    return;
  }
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) {
    if (e < count) {
      p[2 * e] = static_cast<uint8_t>(h[e]);
      p[2 * e + 1] = static_cast<uint8_t>(h[e] >> 8);
    }
  }
}

/// Values j0 .. j0 + count of a `none` body (fp32 bits of v, little-endian) at body + 4·j0.
/// vec: body is 16-byte aligned (then so is body + 4·j0, j0 being a multiple of 8).
__device__ __forceinline__ void storeDenseOctet(uint8_t* body, size_t j0, unsigned count, bool vec,
                                                const float (&v)[kOctet]) {
  uint32_t w[kOctet];
#pragma unroll
  for (unsigned e = 0; e < kOctet; ++e) w[e] = __float_as_uint(v[e]);
  storeWordOctet(body + 4 * j0, count, vec, w);
}

/// out[i] = out[i] + (w · value_i) for the n fp32 values of a `none` body (decodeDenseF32), one
/// octet per thread, grid-stride. body_vec: body 16-byte aligned; out_vec: out 16-byte aligned.
__device__ __forceinline__ void accumulateDenseBody(const uint8_t* body, float weight, float* out,
                                                    size_t n, bool body_vec, bool out_vec) {
  const size_t octets = (n + kOctet - 1) / kOctet;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t o = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < octets;
       o += stride) {
    const size_t j0 = o * kOctet;
    const unsigned count = static_cast<unsigned>(n - j0 < kOctet ? n - j0 : kOctet);
    uint32_t bits[kOctet];
    float acc[kOctet];
    loadWordOctet(body + 4 * j0, count, body_vec, bits);
    loadOutOctet(out + j0, count, out_vec, acc);
#pragma unroll
    for (unsigned e = 0; e < kOctet; ++e) {
      acc[e] = __fadd_rn(acc[e], __fmul_rn(weight, __uint_as_float(bits[e])));
    }
    storeOutOctet(out + j0, count, out_vec, acc);
  }
}

/// Stages `bytes_per_thread` bytes of each thread's codes (acc, little-endian) in `stage` (shared
/// memory of kBlockThreads · bytes_per_thread bytes, u32-aligned) and writes the tile's bytes
/// [0, tile_bytes) to dst: aligned u32 stores when dst is 4-byte aligned, bytes otherwise. Every
/// thread of the block must call it (it synchronises the block once, between staging and writing);
/// the caller synchronises again before it writes `stage` for the next tile.
__device__ __forceinline__ void writeTileCodes(uint32_t* stage, unsigned bytes_per_thread,
                                               uint64_t acc, uint8_t* dst, size_t tile_bytes,
                                               bool dst_aligned4) {
  auto* stage_bytes = reinterpret_cast<uint8_t*>(stage);
  const unsigned t = threadIdx.x;
  for (unsigned q = 0; q < bytes_per_thread; ++q) {
    stage_bytes[t * bytes_per_thread + q] = static_cast<uint8_t>(acc >> (8 * q));
  }
  __syncthreads();
  if (dst_aligned4) {
    for (size_t w = t; 4 * w < tile_bytes; w += kBlockThreads) {
      if (4 * w + 4 <= tile_bytes) {
        reinterpret_cast<uint32_t*>(dst)[w] = stage[w];
      } else {
        for (size_t q = 4 * w; q < tile_bytes; ++q) dst[q] = stage_bytes[q];
      }
    }
  } else {
    for (size_t q = t; q < tile_bytes; q += kBlockThreads) dst[q] = stage_bytes[q];
  }
}

/// 256-byte aligned slices of a device workspace. The first slice starts at the first 256-byte
/// boundary at or after the workspace's start; bytesFor() reserves the 255 bytes that may cost.
class DeviceCarver {
 public:
  explicit DeviceCarver(DeviceBytes ws)
      : cur_((reinterpret_cast<uintptr_t>(ws.data) + 255) & ~uintptr_t{255}) {}
  static size_t round(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
  static size_t bytesFor(std::initializer_list<size_t> sizes) {
    size_t total = 255;
    for (size_t s : sizes) total += round(s);
    return total;
  }
  template <typename T>
  T* take(size_t count) {
    T* p = reinterpret_cast<T*>(cur_);
    cur_ += round(count * sizeof(T));
    return p;
  }

 private:
  uintptr_t cur_;
};

/// decodeDenseF32's acceptance of a `none`-layout payload whose header was read (readHeader).
inline Status checkDenseLength(std::span<const uint8_t> p, const PayloadHeader& h) {
  const uint64_t need = kHeaderBytes + 4 * h.elements;
  if (h.elements > (p.size() / 4) || p.size() != need) {
    return dataLoss("none payload of " + std::to_string(h.elements) + " elements must be " +
                    std::to_string(need) + " bytes, got " + std::to_string(p.size()));
  }
  return Status::ok();
}

}  // namespace lightwire::kernels::cuda::codecs
