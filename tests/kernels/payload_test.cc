// Header layout and the bit-packing shared by every codec (docs/wire-format.md).
#include <doctest.h>

#include <random>
#include <vector>

#include "kernels/payload.h"

using namespace lightwire::kernels;

TEST_CASE("payload: header bytes are little-endian as documented") {
  uint8_t h[16];
  writeHeader(h, {CodecId::kQsgd, DType::kBF16, 0x01, 2, 0x0102030405060708ull});
  const uint8_t want[16] = {0x4C, 0x57, 1, 7, 2, 1, 2, 0, 8, 7, 6, 5, 4, 3, 2, 1};
  CHECK(std::equal(h, h + 16, want));
  auto r =
      readHeader(std::span<const uint8_t>(h, 16), CodecId::kQsgd, 0x0102030405060708ull, 0x01, 2);
  REQUIRE(r.isOk());
  CHECK(r->codec == CodecId::kQsgd);
  CHECK(r->dtype == DType::kBF16);
  CHECK(r->round == 2);
}

TEST_CASE("payload: header validation names the problem") {
  uint8_t h[16];
  writeHeader(h, {CodecId::kTopk, DType::kF32, 0, 0, 10});
  auto check_bad = [&](std::vector<uint8_t> bytes, const char* what) {
    auto r = readHeader(bytes, CodecId::kTopk, 10, 0x01);
    CHECK_MESSAGE(!r.isOk(), what);
    if (!r.isOk()) CHECK(!r.status().message().empty());
  };
  std::vector<uint8_t> ok(h, h + 16);
  for (size_t len = 0; len < 16; ++len) check_bad({ok.begin(), ok.begin() + len}, "truncated");
  auto m = ok;
  m[0] = 0;
  check_bad(m, "magic");
  m = ok;
  m[2] = 2;
  check_bad(m, "version");
  m = ok;
  m[3] = 6;
  check_bad(m, "other codec id");
  m = ok;
  m[4] = 3;
  check_bad(m, "dtype");
  m = ok;
  m[5] = 0x02;
  check_bad(m, "unknown flag");
  m = ok;
  m[7] = 1;
  check_bad(m, "reserved");
  m = ok;
  m[6] = 1;
  check_bad(m, "round of a single-round codec");
  m = ok;
  m[8] = 11;
  check_bad(m, "count mismatch");
  // The none layout is accepted by every decoder (dense escape), without flags.
  m = ok;
  m[3] = 0;
  CHECK(readHeader(m, CodecId::kTopk, 10, 0x01).isOk());
  m[5] = 1;
  CHECK(!readHeader(m, CodecId::kTopk, 10, 0x01).isOk());
}

TEST_CASE("payload: bit-packing round trips LSB-first for every width") {
  std::mt19937_64 gen(7);
  for (unsigned w = 1; w <= 32; ++w) {
    const size_t count = 77;
    std::vector<uint32_t> values(count);
    for (auto& v : values)
      v = static_cast<uint32_t>(gen()) & (w == 32 ? 0xFFFFFFFFu : ((1u << w) - 1));
    std::vector<uint8_t> buf(packedBytes(count, w) + 4, 0);
    BitWriter bw(buf.data());
    for (auto v : values) bw.put(v, w);
    bw.flush();
    CHECK(paddingIsZero(buf, count * w));
    BitReader br(buf.data());
    for (auto v : values) CHECK(br.get(w) == v);
  }
  // Stream bit t is bit t%8 of byte t/8: values 1 (w=1), 2 (w=2), 5 (w=3) -> 1 | 2<<1 | 5<<3.
  uint8_t b[2] = {0, 0};
  BitWriter bw(b);
  bw.put(1, 1);
  bw.put(2, 2);
  bw.put(5, 3);
  bw.flush();
  CHECK(b[0] == (1 | (2 << 1) | (5 << 3)));
  CHECK(!paddingIsZero(std::span<const uint8_t>(b, 1), 5));
  CHECK(paddingIsZero(std::span<const uint8_t>(b, 1), 6));
}
