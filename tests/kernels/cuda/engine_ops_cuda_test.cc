// The element-wise kernels of a step on the GPU (kernels/cuda/engine_ops.h) against their host
// definitions, bit for bit: the local trainers' sum in trainer order (one launch and several), the
// policies' squared-norm statistic (kernels::statsSquareBlockSum), the value counts, the narrowing
// into a trainer's dtype. Needs a GPU (main.cc skips otherwise).

#include <cuda_runtime_api.h>
#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cuda/engine_ops.h"
#include "kernels/cuda/reduce.h"
#include "kernels/dtype.h"
#include "kernels/reduce.h"

namespace lightwire::kernels::cuda {
namespace test_engine_ops_cuda {

#define LW_OPS_REQUIRE(call)                                          \
  do {                                                                \
    const cudaError_t lw_e_ = (call);                                 \
    INFO(#call);                                                      \
    REQUIRE_MESSAGE(lw_e_ == cudaSuccess, cudaGetErrorString(lw_e_)); \
  } while (0)

/// Device copy of a host vector (freed on scope exit).
template <typename T>
struct OnDevice {
  explicit OnDevice(const std::vector<T>& host) : n(host.size()) {
    LW_OPS_REQUIRE(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)));
    if (n > 0) {
      LW_OPS_REQUIRE(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
  }
  ~OnDevice() { cudaFree(ptr); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  std::vector<T> get() const {
    LW_OPS_REQUIRE(cudaDeviceSynchronize());
    std::vector<T> host(n);
    if (n > 0) {
      LW_OPS_REQUIRE(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    }
    return host;
  }
  T* ptr = nullptr;
  size_t n;
};

std::vector<float> randomFloats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

/// The host's bytes of `v` in `dtype`.
std::vector<uint8_t> asDType(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out(v.size() * dtypeSize(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = dtype == DType::kF16 ? floatToHalf(v[i]) : floatToBf16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

bool sameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("sumWidened: the trainers' sum in trainer order, as the CPU engine adds them") {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (unsigned count : {1u, 2u, 3u, 8u, 9u, 17u}) {
      for (size_t n : {size_t{1}, size_t{1000}, size_t{65537}}) {
        CAPTURE(static_cast<int>(dtype));
        CAPTURE(count);
        CAPTURE(n);
        std::vector<std::vector<uint8_t>> inputs;
        std::vector<float> want(n);
        for (unsigned k = 0; k < count; ++k) {
          inputs.push_back(asDType(randomFloats(n, 100 + k), dtype));
          std::vector<float> widened(n);
          widenToFloat(ConstTensor{inputs.back().data(), n, dtype}, widened.data());
          for (size_t i = 0; i < n; ++i) want[i] = k == 0 ? widened[i] : want[i] + widened[i];
        }
        std::vector<std::unique_ptr<OnDevice<uint8_t>>> on_device;
        std::vector<const void*> pointers;
        for (const auto& in : inputs) {
          on_device.push_back(std::make_unique<OnDevice<uint8_t>>(in));
          pointers.push_back(on_device.back()->ptr);
        }
        OnDevice<float> out(std::vector<float>(n, -1.0f));
        LW_OPS_REQUIRE(sumWidened(pointers.data(), count, dtype, n, out.ptr, nullptr));
        CHECK(sameBits(out.get(), want));
      }
    }
  }
  CHECK(sumWidened(nullptr, 0, DType::kF32, 10, nullptr, nullptr) == cudaErrorInvalidValue);
  CHECK(sumWidened(nullptr, 0, DType::kF32, 0, nullptr, nullptr) == cudaSuccess);
}

TEST_CASE("statsSquareBlockSums: the policies' norm statistic of the CPU, bit for bit") {
  for (size_t n : {size_t{1}, size_t{15}, size_t{16}, size_t{4095}, size_t{4096}, size_t{4097},
                   size_t{100003}}) {
    CAPTURE(n);
    std::vector<float> x = randomFloats(n, static_cast<uint32_t>(n));
    if (n > 20) x[17] = 1e30f;  // float squares overflow: the lanes go to +Inf, as on the CPU
    const size_t blocks = (n + kStatsBlock - 1) / kStatsBlock;
    double want = 0;
    std::vector<double> want_blocks(blocks);
    for (size_t b = 0; b < blocks; ++b) {
      want_blocks[b] = statsSquareBlockSum(x.data() + b * kStatsBlock,
                                           std::min(kStatsBlock, n - b * kStatsBlock));
      want += want_blocks[b];
    }
    OnDevice<float> dx(x);
    OnDevice<double> sums(std::vector<double>(blocks + 1, -1.0));
    LW_OPS_REQUIRE(statsSquareBlockSums(dx.ptr, n, sums.ptr, nullptr));
    LW_OPS_REQUIRE(sumBlockSums(sums.ptr, blocks, sums.ptr + blocks, nullptr));
    const auto got = sums.get();
    CHECK(std::memcmp(got.data(), want_blocks.data(), blocks * sizeof(double)) == 0);
    CHECK(std::memcmp(&got[blocks], &want, sizeof want) == 0);
  }
}

TEST_CASE("countValues, addFloats and narrowFloats") {
  std::vector<float> x = randomFloats(70001, 5);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[70000] = -std::numeric_limits<float>::infinity();
  x[9] = 1e-9f;
  x[10] = -0.0f;
  uint64_t bad = 0, small = 0;
  for (float v : x) {
    bad += std::isfinite(v) ? 0 : 1;
    small += std::isfinite(v) && std::fabs(v) < 0.01f ? 1 : 0;
  }
  OnDevice<float> dx(x);
  OnDevice<unsigned long long> counts(std::vector<unsigned long long>{0, 0});
  LW_OPS_REQUIRE(countValues(dx.ptr, x.size(), 0.01f, counts.ptr, nullptr));
  const auto c = counts.get();
  CHECK(c[0] == bad);
  CHECK(c[1] == small);

  const std::vector<float> y = randomFloats(x.size(), 6);
  OnDevice<float> dy(y), sum(std::vector<float>(x.size()));
  LW_OPS_REQUIRE(addFloats(dx.ptr, dy.ptr, sum.ptr, x.size(), nullptr));
  std::vector<float> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = x[i] + y[i];
  CHECK(sameBits(sum.get(), want));

  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    OnDevice<uint8_t> out(std::vector<uint8_t>(x.size() * dtypeSize(dtype), 0xAB));
    LW_OPS_REQUIRE(narrowFloats(dy.ptr, y.size(), dtype, out.ptr, nullptr));
    CHECK(out.get() == asDType(y, dtype));
  }
}

}  // namespace test_engine_ops_cuda
}  // namespace lightwire::kernels::cuda
