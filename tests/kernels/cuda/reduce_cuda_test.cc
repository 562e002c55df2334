// The canonical fp64 reduction on the GPU (kernels/cuda/reduce.h) against kernels/reduce.h, bit for
// bit: every term, fp32 / fp16 / bf16 inputs, lengths around the 4096-element block and the
// 8-accumulator stride, whole arrays and segments (QSGD buckets) shorter and longer than a block.
// Needs a GPU (main.cc skips otherwise).

#include <doctest.h>

#include <cstring>

#include "kernels/cuda/reduce.h"
#include "kernels/reduce.h"
#include "tests/kernels/cuda/codec_compare.h"

namespace lightwire::kernels::cuda {
namespace test_reduce_cuda {

using testing::DeviceMem;

/// The CPU's canonical sum of the terms of x (widened from `dtype` exactly).
double cpuSum(const std::vector<float>& x, DType dtype, ReduceTerm term) {
  std::vector<float> widened(x.size());
  const std::vector<uint8_t> bytes = testing::asDType(x, dtype);
  for (size_t i = 0; i < x.size(); ++i) {
    widened[i] = ConstTensor{bytes.data(), x.size(), dtype}.at(i);
  }
  return kernels::canonicalSum(widened.data(), widened.size(), term);
}

bool sameDouble(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST_CASE("cuda canonicalSum equals the CPU's bit for bit") {
  const ReduceTerm terms[] = {ReduceTerm::kSquare, ReduceTerm::kAbs, ReduceTerm::kValue};
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{4095},
                   size_t{4096}, size_t{4097}, size_t{100003}, size_t{1} << 20}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      const std::vector<float> x = testing::heavyTailedInput(n, n + 3);
      const std::vector<uint8_t> bytes = testing::asDType(x, dtype);
      DeviceMem d_x(bytes.size());
      d_x.upload(bytes.data(), bytes.size());
      DeviceMem sums((canonicalBlocks(n) + 1) * sizeof(double));
      DeviceMem total(sizeof(double));
      for (ReduceTerm term : terms) {
        CAPTURE(n);
        CAPTURE(static_cast<int>(dtype));
        CAPTURE(static_cast<int>(term));
        LW_CUDA_CHECK_OK(
            canonicalSum(d_x.as(), dtype, n, term, sums.as<double>(), total.as<double>(), nullptr));
        LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
        const double got = total.download<double>(1)[0];
        CHECK(sameDouble(got, cpuSum(x, dtype, term)));
      }
    }
  }
}

TEST_CASE("cuda canonicalSegmentSums: every segment as its own array") {
  for (size_t segment :
       {size_t{1}, size_t{7}, size_t{512}, size_t{4096}, size_t{5000}, size_t{12289}}) {
    for (size_t n : {size_t{1}, segment, 3 * segment + 5, size_t{40000}}) {
      CAPTURE(segment);
      CAPTURE(n);
      const std::vector<float> x = testing::normalInput(n, segment * 13 + n);
      DeviceMem d_x(n * sizeof(float));
      d_x.upload(x.data(), n * sizeof(float));
      const size_t segments = (n + segment - 1) / segment;
      DeviceMem sums(segments * sizeof(double));
      DeviceMem scratch(canonicalSegmentScratch(n, segment) * sizeof(double));
      LW_CUDA_CHECK_OK(canonicalSegmentSums(d_x.as(), DType::kF32, n, segment, ReduceTerm::kSquare,
                                            sums.as<double>(), scratch.as<double>(), nullptr));
      LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
      const std::vector<double> got = sums.download<double>(segments);
      size_t bad = 0;
      for (size_t s = 0; s < segments; ++s) {
        const size_t begin = s * segment;
        const size_t len = std::min(segment, n - begin);
        const double want = kernels::canonicalSum(x.data() + begin, len, ReduceTerm::kSquare);
        if (!sameDouble(got[s], want) && bad++ < 3) {
          FAIL_CHECK("segment " << s << ": got " << got[s] << ", want " << want);
        }
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("cuda canonicalSum rejects null pointers") {
  DeviceMem total(sizeof(double));
  CHECK(canonicalSum(nullptr, DType::kF32, 10, ReduceTerm::kSquare, total.as<double>(),
                     total.as<double>(), nullptr) == cudaErrorInvalidValue);
  // n = 0 needs no input and sums to +0.0.
  LW_CUDA_CHECK_OK(canonicalSum(nullptr, DType::kF32, 0, ReduceTerm::kSquare, nullptr,
                                total.as<double>(), nullptr));
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  const double zero = total.download<double>(1)[0];
  CHECK(sameDouble(zero, 0.0));
}

}  // namespace test_reduce_cuda
}  // namespace lightwire::kernels::cuda
