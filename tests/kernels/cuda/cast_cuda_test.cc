// The CUDA cast kernels (kernels/cuda/cast.h) against kernels/dtype.h: bit-exact narrowing over
// edge values, a structured sweep and random bit patterns; widening with weighted accumulation
// over every fp16 / bf16 pattern; ragged sizes, unaligned pointers, a multi-wave grid, a
// non-default stream, and the API's argument checks. Needs a GPU (main.cc skips otherwise).

#include <cuda_runtime_api.h>
#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/cast.h"
#include "kernels/dtype.h"
#include "tests/kernels/cuda/cast_inputs.h"

namespace lightwire::kernels {
namespace test_cast_cuda {

#define LW_CUDA_REQUIRE(call)                                         \
  do {                                                                \
    const cudaError_t lw_e_ = (call);                                 \
    INFO(#call);                                                      \
    REQUIRE_MESSAGE(lw_e_ == cudaSuccess, cudaGetErrorString(lw_e_)); \
  } while (0)

/// Device memory of `count` T, freed on scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    LW_CUDA_REQUIRE(
        cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<size_t>(count, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  void upload(const std::vector<T>& host) {
    LW_CUDA_REQUIRE(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    LW_CUDA_REQUIRE(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t count_;
};

std::vector<float> asFloats(const std::vector<uint32_t>& patterns) {
  std::vector<float> v(patterns.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = bitsFloat(patterns[i]);
  return v;
}

using NarrowFn = cudaError_t (*)(const float*, uint16_t*, size_t, cudaStream_t);
using AccumulateFn = cudaError_t (*)(const uint16_t*, float, float*, size_t, cudaStream_t);

/// Runs `narrow` on the device over `input` and compares with `reference` element by element.
void checkNarrow(NarrowFn narrow, uint16_t (*reference)(float), const std::vector<float>& input) {
  DeviceBuffer<float> d_in(input.size());
  DeviceBuffer<uint16_t> d_out(input.size());
  d_in.upload(input);
  LW_CUDA_REQUIRE(narrow(d_in.get(), d_out.get(), input.size(), nullptr));
  LW_CUDA_REQUIRE(cudaStreamSynchronize(nullptr));
  const std::vector<uint16_t> got = d_out.download();
  size_t bad = 0;
  for (size_t i = 0; i < input.size(); ++i) {
    const uint16_t want = reference(input[i]);
    if (got[i] != want && bad++ < 5) {
      FAIL_CHECK("input " << testing::hex(floatBits(input[i])) << ": got " << testing::hex(got[i])
                          << ", want " << testing::hex(want));
    }
  }
  CHECK(bad == 0);
}

/// fp32 results compare bit for bit, except NaN against NaN: NaN payloads produced by arithmetic
/// (w * NaN, Inf - Inf) are not specified and differ between x86 and CUDA.
bool sameResult(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  return floatBits(got) == floatBits(want);
}

void checkAccumulate(AccumulateFn accumulate, float (*widen)(uint16_t), float weight) {
  CAPTURE(weight);
  std::vector<uint16_t> input(0x10000);
  for (uint32_t h = 0; h < 0x10000u; ++h) input[h] = static_cast<uint16_t>(h);
  std::vector<float> out(input.size());
  std::mt19937 rng(7);
  std::normal_distribution<float> gauss(0.0f, 3.0f);
  for (float& o : out) o = gauss(rng);

  DeviceBuffer<uint16_t> d_in(input.size());
  DeviceBuffer<float> d_out(out.size());
  d_in.upload(input);
  d_out.upload(out);
  LW_CUDA_REQUIRE(accumulate(d_in.get(), weight, d_out.get(), input.size(), nullptr));
  LW_CUDA_REQUIRE(cudaStreamSynchronize(nullptr));
  const std::vector<float> got = d_out.download();
  size_t bad = 0;
  for (size_t i = 0; i < input.size(); ++i) {
    const float product = weight * widen(input[i]);  // -ffp-contract=off: two roundings
    const float want = out[i] + product;
    if (!sameResult(got[i], want) && bad++ < 5) {
      FAIL_CHECK("pattern " << testing::hex(input[i]) << " onto " << out[i] << ": got " << got[i]
                            << " (" << testing::hex(floatBits(got[i])) << "), want " << want << " ("
                            << testing::hex(floatBits(want)) << ")");
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("cuda castFloatToHalf is bit-exact with floatToHalf") {
  checkNarrow(cuda::castFloatToHalf, floatToHalf, asFloats(testing::castTestPatterns(1 << 22)));
}

TEST_CASE("cuda castFloatToBf16 is bit-exact with floatToBf16") {
  checkNarrow(cuda::castFloatToBf16, floatToBf16, asFloats(testing::castTestPatterns(1 << 22)));
}

TEST_CASE("cuda accumulateHalf: out += w * halfToFloat(h) for every fp16 pattern") {
  for (float w : {1.0f, -0.5f, 3.0f, 1e-3f, 0.0f, 65504.0f}) {
    checkAccumulate(cuda::accumulateHalf, halfToFloat, w);
  }
}

TEST_CASE("cuda accumulateBf16: out += w * bf16ToFloat(b) for every bf16 pattern") {
  for (float w : {1.0f, -0.5f, 3.0f, 1e-3f, 0.0f, 1e30f}) {
    checkAccumulate(cuda::accumulateBf16, bf16ToFloat, w);
  }
}

TEST_CASE("cuda casts: ragged sizes, unaligned pointers, a multi-wave grid, own stream") {
  cudaStream_t stream = nullptr;
  LW_CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // 20M elements is more than the largest grid (65535 blocks of 256 threads): the grid-stride
  // loop must cover the rest.
  for (size_t n :
       {size_t{1}, size_t{3}, size_t{255}, size_t{257}, size_t{1000003}, size_t{20000000}}) {
    CAPTURE(n);
    std::vector<float> input(n + 1);
    std::mt19937 rng(static_cast<uint32_t>(n));
    for (float& x : input) x = bitsFloat(static_cast<uint32_t>(rng()));
    // Offsets by one element: 4-byte (fp32) and 2-byte (fp16) aligned only. One sentinel each side.
    DeviceBuffer<float> d_in(n + 1);
    DeviceBuffer<uint16_t> d_out(n + 2);
    d_in.upload(input);
    LW_CUDA_REQUIRE(cudaMemset(d_out.get(), 0xAB, (n + 2) * sizeof(uint16_t)));
    for (int which = 0; which < 2; ++which) {
      const auto narrow = which == 0 ? cuda::castFloatToHalf : cuda::castFloatToBf16;
      const auto reference = which == 0 ? floatToHalf : floatToBf16;
      LW_CUDA_REQUIRE(narrow(d_in.get() + 1, d_out.get() + 1, n, stream));
      LW_CUDA_REQUIRE(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> got = d_out.download();
      REQUIRE(got[0] == 0xABABu);
      REQUIRE(got[n + 1] == 0xABABu);
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) bad += got[i + 1] != reference(input[i + 1]);
      CHECK(bad == 0);

      // Widen back onto a zeroed output with weight 1 (unaligned too): exact for non-NaN values.
      DeviceBuffer<float> d_acc(n + 2);
      LW_CUDA_REQUIRE(cudaMemset(d_acc.get(), 0, (n + 2) * sizeof(float)));
      const auto accumulate = which == 0 ? cuda::accumulateHalf : cuda::accumulateBf16;
      LW_CUDA_REQUIRE(accumulate(d_out.get() + 1, 1.0f, d_acc.get() + 1, n, stream));
      LW_CUDA_REQUIRE(cudaStreamSynchronize(stream));
      const std::vector<float> acc = d_acc.download();
      REQUIRE(floatBits(acc[0]) == 0u);
      REQUIRE(floatBits(acc[n + 1]) == 0u);
      const auto widen = which == 0 ? halfToFloat : bf16ToFloat;
      bad = 0;
      for (size_t i = 0; i < n; ++i) bad += !sameResult(acc[i + 1], 0.0f + widen(got[i + 1]));
      CHECK(bad == 0);
    }
  }
  LW_CUDA_REQUIRE(cudaStreamDestroy(stream));
}

TEST_CASE("cuda casts: argument checks, no launch for n = 0") {
  CHECK(cuda::castFloatToHalf(nullptr, nullptr, 0, nullptr) == cudaSuccess);
  CHECK(cuda::castFloatToBf16(nullptr, nullptr, 0, nullptr) == cudaSuccess);
  CHECK(cuda::accumulateHalf(nullptr, 1.0f, nullptr, 0, nullptr) == cudaSuccess);
  CHECK(cuda::accumulateBf16(nullptr, 1.0f, nullptr, 0, nullptr) == cudaSuccess);
  CHECK(cuda::castFloatToHalf(nullptr, nullptr, 16, nullptr) == cudaErrorInvalidValue);
  CHECK(cuda::accumulateBf16(nullptr, 1.0f, nullptr, 16, nullptr) == cudaErrorInvalidValue);
  // An argument error is returned, not left behind for the next call.
  CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace test_cast_cuda
}  // namespace lightwire::kernels
