#include "kernels/reduce.h"

#include <cmath>

#include "kernels/parallel.h"

namespace lightwire::kernels {

namespace {
// One loop per term (no switch inside) so the compiler can keep the eight lanes in registers.
template <ReduceTerm kTerm>
double blockSum(const float* x, size_t n) {
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    double t;
    if constexpr (kTerm == ReduceTerm::kSquare) {
      t = v * v;
    } else if constexpr (kTerm == ReduceTerm::kAbs) {
      t = std::fabs(v);
    } else {
      t = v;
    }
    a[i & 7] = a[i & 7] + t;
  }
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
}  // namespace

double canonicalBlockSum(const float* x, size_t n, ReduceTerm term) {
  switch (term) {
    case ReduceTerm::kSquare:
      return blockSum<ReduceTerm::kSquare>(x, n);
    case ReduceTerm::kAbs:
      return blockSum<ReduceTerm::kAbs>(x, n);
    case ReduceTerm::kValue:
      break;
  }
  return blockSum<ReduceTerm::kValue>(x, n);
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

}  // namespace lightwire::kernels
