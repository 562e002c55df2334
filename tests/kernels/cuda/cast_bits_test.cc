// The integer conversion logic the CUDA kernels run (kernels/cuda/cast_bits.h), compiled for the
// host and compared with kernels/dtype.h, the reference every backend must match. Runs on any
// machine; cast_cuda_test.cc checks the same on a GPU.

#include <doctest.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/cast_bits.h"
#include "kernels/dtype.h"
#include "tests/kernels/cuda/cast_inputs.h"

namespace lightwire::kernels {
namespace {

namespace bits = cuda::bits;

TEST_CASE("cuda cast bits: fp32 -> fp16 / bf16 equal floatToHalf / floatToBf16") {
  const std::vector<uint32_t> patterns = testing::castTestPatterns(1 << 20);
  size_t half_bad = 0, bf16_bad = 0;
  for (uint32_t u : patterns) {
    const float f = bitsFloat(u);
    if (bits::floatBitsToHalf(u) != floatToHalf(f) && half_bad++ < 5) {
      FAIL_CHECK("fp16 of " << testing::hex(u) << ": got " << testing::hex(bits::floatBitsToHalf(u))
                            << ", want " << testing::hex(floatToHalf(f)));
    }
    if (bits::floatBitsToBf16(u) != floatToBf16(f) && bf16_bad++ < 5) {
      FAIL_CHECK("bf16 of " << testing::hex(u) << ": got " << testing::hex(bits::floatBitsToBf16(u))
                            << ", want " << testing::hex(floatToBf16(f)));
    }
  }
  CHECK(half_bad == 0);
  CHECK(bf16_bad == 0);
}

TEST_CASE("cuda cast bits: every fp32 around the fp16 subnormal range") {
  // Exponents 102..113 hold everything from below 2^-25 to the first normal binade of fp16: the
  // rounding with variable shift. Exhaustive over the mantissa, both signs.
  size_t bad = 0;
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t u = (101u << 23); u < (114u << 23); ++u) {
      const uint32_t p = sign | u;
      if (bits::floatBitsToHalf(p) != floatToHalf(bitsFloat(p)) && bad++ < 5) {
        FAIL_CHECK("fp16 of " << testing::hex(p) << ": got "
                              << testing::hex(bits::floatBitsToHalf(p)) << ", want "
                              << testing::hex(floatToHalf(bitsFloat(p))));
      }
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("cuda cast bits: widening is exact for every fp16 and bf16 pattern") {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const auto x = static_cast<uint16_t>(h);
    REQUIRE(bits::halfToFloatBits(x) == floatBits(halfToFloat(x)));
    REQUIRE(bits::bf16ToFloatBits(x) == floatBits(bf16ToFloat(x)));
  }
}

TEST_CASE("cuda cast bits: fp16 and bf16 round trips") {
  // Every non-NaN half / bf16 value survives widening then narrowing bit for bit.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const auto x = static_cast<uint16_t>(h);
    if ((x & 0x7C00u) != 0x7C00u || (x & 0x3FFu) == 0) {
      REQUIRE(bits::floatBitsToHalf(bits::halfToFloatBits(x)) == x);
    }
    if ((x & 0x7F80u) != 0x7F80u || (x & 0x7Fu) == 0) {
      REQUIRE(bits::floatBitsToBf16(bits::bf16ToFloatBits(x)) == x);
    }
  }
}

}  // namespace
}  // namespace lightwire::kernels
