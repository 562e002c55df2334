// CUDA fp32 <-> fp16/bf16 conversions (kernels/cuda/cast.h). One element per thread per iteration
// of a grid-stride loop: the loads and stores of a warp are contiguous, so the kernels run at
// memory bandwidth; the conversions are the integer bit logic of kernels/half_bits.h, shared with
// the host build that tests it.
//
// Compiled with --fmad=false (kernels/cuda/meson.build); the accumulation also spells out its two
// roundings with __fmul_rn / __fadd_rn, which are never contracted into an FMA.

#include "kernels/cuda/cast.h"

#include "kernels/half_bits.h"

namespace lightwire::kernels::cuda {
namespace {

constexpr unsigned kBlockThreads = 256;
// Enough blocks to fill any current GPU many times over; larger inputs loop (grid-stride).
constexpr size_t kMaxBlocks = 65535;

unsigned blocksFor(size_t n) {
  const size_t blocks = (n + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

struct ToHalf {
  __device__ uint16_t operator()(float v) const {
    return bits::floatBitsToHalf(__float_as_uint(v));
  }
};
struct ToBf16 {
  __device__ uint16_t operator()(float v) const {
    return bits::floatBitsToBf16(__float_as_uint(v));
  }
};
struct FromHalf {
  __device__ float operator()(uint16_t h) const {
    return __uint_as_float(bits::halfToFloatBits(h));
  }
};
struct FromBf16 {
  __device__ float operator()(uint16_t b) const {
    return __uint_as_float(bits::bf16ToFloatBits(b));
  }
};

template <typename Op>
__global__ void __launch_bounds__(kBlockThreads)
    narrowKernel(const float* __restrict__ in, uint16_t* __restrict__ out, size_t n) {
  const Op op;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = op(in[i]);
  }
}

template <typename Op>
__global__ void __launch_bounds__(kBlockThreads)
    accumulateKernel(const uint16_t* __restrict__ in, float weight, float* __restrict__ out,
                     size_t n) {
  const Op op;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __fadd_rn(out[i], __fmul_rn(weight, op(in[i])));
  }
}

template <typename Op>
cudaError_t launchNarrow(const float* d_in, uint16_t* d_out, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (d_in == nullptr || d_out == nullptr) return cudaErrorInvalidValue;
  narrowKernel<Op><<<blocksFor(n), kBlockThreads, 0, stream>>>(d_in, d_out, n);
  return cudaGetLastError();
}

template <typename Op>
cudaError_t launchAccumulate(const uint16_t* d_in, float weight, float* d_out, size_t n,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (d_in == nullptr || d_out == nullptr) return cudaErrorInvalidValue;
  accumulateKernel<Op><<<blocksFor(n), kBlockThreads, 0, stream>>>(d_in, weight, d_out, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t castFloatToHalf(const float* d_in, uint16_t* d_out, size_t n, cudaStream_t stream) {
  return launchNarrow<ToHalf>(d_in, d_out, n, stream);
}

cudaError_t castFloatToBf16(const float* d_in, uint16_t* d_out, size_t n, cudaStream_t stream) {
  return launchNarrow<ToBf16>(d_in, d_out, n, stream);
}

cudaError_t accumulateHalf(const uint16_t* d_in, float weight, float* d_out, size_t n,
                           cudaStream_t stream) {
  return launchAccumulate<FromHalf>(d_in, weight, d_out, n, stream);
}

cudaError_t accumulateBf16(const uint16_t* d_in, float weight, float* d_out, size_t n,
                           cudaStream_t stream) {
  return launchAccumulate<FromBf16>(d_in, weight, d_out, n, stream);
}

}  // namespace lightwire::kernels::cuda
