#pragma once
// Device-side helpers shared by the CUDA codecs (kernels/cuda/codecs/*.cu). Only for .cu files.
//
//   - loads of fp32 / fp16 / bf16 elements widened to fp32, exactly as kernels/dtype.h;
//   - Philox4x32-10 (Random123 compiles for the device) with the key and counter layout of
//     docs/determinism.md §3;
//   - the canonical fp64 reduction of docs/determinism.md §2 (kernels/cuda/reduce.h);
//   - launch-size helpers and error propagation.
// Compiled with --fmad=false; arithmetic that feeds a payload should still spell out its roundings
// (__fmul_rn, __fadd_rn, __dmul_rn, __dadd_rn) where a contraction would otherwise be possible.

#include <Random123/philox.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/half_bits.h"

namespace lightwire::kernels::cuda {

inline constexpr unsigned kBlockThreads = 256;
inline constexpr size_t kMaxBlocks = 65535;

/// Blocks of kBlockThreads for a grid-stride loop over n items.
inline unsigned blocksFor(size_t n, unsigned threads = kBlockThreads) {
  const size_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

#define LW_CUDA_TRY(expr)                             \
  do {                                                \
    const cudaError_t lw_cuda_e_ = (expr);            \
    if (lw_cuda_e_ != cudaSuccess) return lw_cuda_e_; \
  } while (0)

/// Element i of a device tensor of dtype D, widened to fp32 (exact).
template <DType D>
__device__ __forceinline__ float loadWidenedDevice(const void* data, size_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (D == DType::kF16) {
    return __uint_as_float(bits::halfToFloatBits(static_cast<const uint16_t*>(data)[i]));
  } else {
    return __uint_as_float(bits::bf16ToFloatBits(static_cast<const uint16_t*>(data)[i]));
  }
}

/// Runs fn(std::integral_constant<DType, D>{}) for the runtime dtype (host side, for launches).
template <typename Fn>
decltype(auto) visitDeviceDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF16:
      return fn(std::integral_constant<DType, DType::kF16>{});
    case DType::kBF16:
      return fn(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF32:
    default:
      return fn(std::integral_constant<DType, DType::kF32>{});
  }
}

/// Philox4x32-10 words of group `group` for (seed, name_key) and (step, stream, purpose):
/// docs/determinism.md §3, identical to kernels/philox.h's PhiloxStream::group().
struct DevicePhilox {
  uint32_t k0, k1;      // seed, name key
  uint32_t c0, c1, c2;  // step (low 32 bits), stream, purpose
  __device__ __forceinline__ uint4 group(uint64_t g) const {
    r123::Philox4x32_R<10> rng;
    r123::Philox4x32_R<10>::ctr_type c = {{c0, c1, c2, static_cast<uint32_t>(g)}};
    r123::Philox4x32_R<10>::key_type k = {{k0, k1}};
    const auto r = rng(c, k);
    return make_uint4(r[0], r[1], r[2], r[3]);
  }
  /// The word serving item i.
  __device__ __forceinline__ uint32_t word(uint64_t i) const {
    const uint4 w = group(i >> 2);
    switch (i & 3) {
      case 0:
        return w.x;
      case 1:
        return w.y;
      case 2:
        return w.z;
      default:
        return w.w;
    }
  }
};

/// u32 word -> uniform double in [0, 1), exact (kernels/philox.h unitDouble).
__device__ __forceinline__ double unitDoubleDevice(uint32_t r) {
  return static_cast<double>(r) * 0x1p-32;
}

}  // namespace lightwire::kernels::cuda
