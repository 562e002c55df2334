#include "kernels/reduce.h"

#include <algorithm>
#include <cmath>

#include "kernels/parallel.h"
#include "kernels/simd/kernels.h"

namespace lightwire::kernels {

double canonicalBlockSum(const float* x, size_t n, ReduceTerm term) {
  // Vectorised per Highway target (kernels/simd/kernels.cc); the lanes hold the eight canonical
  // accumulators, so the result is the scalar definition's on every target.
  switch (term) {
    case ReduceTerm::kSquare:
      return simd::blockSumSquares(x, n);
    case ReduceTerm::kAbs:
      return simd::blockSumAbs(x, n);
    case ReduceTerm::kValue:
      break;
  }
  return simd::blockSumValues(x, n);
}

double canonicalSum(const float* x, size_t n, ReduceTerm term, CpuStream* stream,
                    std::span<double> block_sums) {
  const size_t blocks = (n + kReduceBlock - 1) / kReduceBlock;
  double total = 0.0;
  if (stream == nullptr || stream->threads() <= 1 || blocks < 2 || block_sums.size() < blocks) {
    for (size_t b = 0; b < blocks; ++b) {
      const size_t begin = b * kReduceBlock;
      const size_t len = std::min(kReduceBlock, n - begin);
      total = total + canonicalBlockSum(x + begin, len, term);
    }
    return total;
  }
  stream->parallelFor(blocks, 16, [&](size_t lo, size_t hi) {
    for (size_t b = lo; b < hi; ++b) {
      const size_t begin = b * kReduceBlock;
      block_sums[b] = canonicalBlockSum(x + begin, std::min(kReduceBlock, n - begin), term);
    }
  });
  for (size_t b = 0; b < blocks; ++b) total = total + block_sums[b];
  return total;
}

double canonicalNorm(const float* x, size_t n, CpuStream* stream, std::span<double> block_sums) {
  return std::sqrt(canonicalSum(x, n, ReduceTerm::kSquare, stream, block_sums));
}

double statsSquareBlockSum(const float* x, size_t len) {
  constexpr size_t kLanes = 16;
  float lane[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) lane[j] += x[i + j] * x[i + j];  // vectorises
  }
  double sum = 0;
  for (; i < len; ++i) sum += static_cast<double>(x[i]) * x[i];
  for (size_t j = 0; j < kLanes; ++j) sum += lane[j];
  return sum;
}

}  // namespace lightwire::kernels
