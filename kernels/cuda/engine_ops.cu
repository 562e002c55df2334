// Element-wise device operations of a step on the GPU (kernels/cuda/engine_ops.h). Grid-stride
// loops, one element per thread per iteration: contiguous warp accesses, memory-bound.
// Compiled with --fmad=false; the additions are __fadd_rn, never contracted.

#include "kernels/cuda/engine_ops.h"

#include <algorithm>

#include "kernels/cuda/cast.h"
#include "kernels/cuda/device.cuh"

namespace lightwire::kernels::cuda {
namespace {

struct SumInputs {
  const void* p[kSumInputsPerLaunch];
};

template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    sumKernel(SumInputs in, unsigned count, bool add, float* __restrict__ out, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float acc = add ? out[i] : loadWidenedDevice<D>(in.p[0], i);
    for (unsigned k = add ? 0 : 1; k < count; ++k) {
      acc = __fadd_rn(acc, loadWidenedDevice<D>(in.p[k], i));
    }
    out[i] = acc;
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    addKernel(const float* a, const float* b, float* out, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __fadd_rn(a[i], b[i]);
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    countKernel(const float* __restrict__ x, size_t n, float tiny,
                unsigned long long* __restrict__ counts) {
  unsigned long long bad = 0, small = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = x[i];
    const bool finite = (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u;
    bad += finite ? 0 : 1;
    small += (finite && fabsf(v) < tiny) ? 1 : 0;
  }
  // Warp totals first: one atomic per warp and counter, not per thread.
  for (int o = 16; o > 0; o >>= 1) {
    bad += __shfl_down_sync(0xFFFFFFFFu, bad, o);
    small += __shfl_down_sync(0xFFFFFFFFu, small, o);
  }
  if ((threadIdx.x & 31u) == 0) {
    if (bad != 0) atomicAdd(&counts[0], bad);
    if (small != 0) atomicAdd(&counts[1], small);
  }
}

// One block of 16 threads per 4096-value block: thread j is lane j (its loads, 16 apart, are
// contiguous across the lanes), thread 0 then combines as the CPU does.
constexpr unsigned kStatsLanes = 16;
__global__ void __launch_bounds__(kStatsLanes)
    statsKernel(const float* __restrict__ x, size_t n, double* __restrict__ block_sums) {
  __shared__ float lanes[kStatsLanes];
  for (size_t b = blockIdx.x; b * kStatsBlock < n; b += gridDim.x) {
    const float* xb = x + b * kStatsBlock;
    const size_t len = n - b * kStatsBlock < kStatsBlock ? n - b * kStatsBlock : kStatsBlock;
    const size_t body = len / kStatsLanes * kStatsLanes;
    float lane = 0.0f;
    for (size_t i = threadIdx.x; i < body; i += kStatsLanes) {
      lane = __fadd_rn(lane, __fmul_rn(xb[i], xb[i]));
    }
    lanes[threadIdx.x] = lane;
    __syncthreads();
    if (threadIdx.x == 0) {
      double sum = 0.0;
      for (size_t i = body; i < len; ++i) {
        sum = __dadd_rn(sum, __dmul_rn(static_cast<double>(xb[i]), static_cast<double>(xb[i])));
      }
      for (unsigned j = 0; j < kStatsLanes; ++j) sum = __dadd_rn(sum, lanes[j]);
      block_sums[b] = sum;
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t statsSquareBlockSums(const float* d_x, size_t n, double* d_block_sums,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const size_t blocks = (n + kStatsBlock - 1) / kStatsBlock;
  statsKernel<<<static_cast<unsigned>(std::min(blocks, kMaxBlocks)), kStatsLanes, 0, stream>>>(
      d_x, n, d_block_sums);
  return cudaGetLastError();
}

cudaError_t sumWidened(const void* const* inputs, unsigned count, DType dtype, size_t n,
                       float* d_out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (count == 0 || inputs == nullptr || d_out == nullptr) return cudaErrorInvalidValue;
  for (unsigned first = 0; first < count; first += kSumInputsPerLaunch) {
    SumInputs in{};
    const unsigned k = std::min(kSumInputsPerLaunch, count - first);
    for (unsigned j = 0; j < k; ++j) in.p[j] = inputs[first + j];
    visitDeviceDType(dtype, [&](auto d) {
      sumKernel<decltype(d)::value>
          <<<blocksFor(n), kBlockThreads, 0, stream>>>(in, k, first > 0, d_out, n);
    });
    LW_CUDA_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

cudaError_t addFloats(const float* d_a, const float* d_b, float* d_out, size_t n,
                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  addKernel<<<blocksFor(n), kBlockThreads, 0, stream>>>(d_a, d_b, d_out, n);
  return cudaGetLastError();
}

cudaError_t countValues(const float* d_x, size_t n, float tiny, unsigned long long* d_counts,
                        cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  // Fewer blocks than elements: each thread counts many, keeping the atomics few.
  countKernel<<<std::min(blocksFor(n), 1024u), kBlockThreads, 0, stream>>>(d_x, n, tiny, d_counts);
  return cudaGetLastError();
}

cudaError_t narrowFloats(const float* d_x, size_t n, DType dtype, void* d_out,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kF16:
      return castFloatToHalf(d_x, static_cast<uint16_t*>(d_out), n, stream);
    case DType::kBF16:
      return castFloatToBf16(d_x, static_cast<uint16_t*>(d_out), n, stream);
    case DType::kF32:
    default:
      if (d_out == d_x) return cudaSuccess;
      return cudaMemcpyAsync(d_out, d_x, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
  }
}

}  // namespace lightwire::kernels::cuda
