// Header layout and the bit-packing shared by every codec (docs/wire-format.md).
#include <doctest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/payload.h"

namespace test_payload {

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

TEST_CASE("payload: a dense payload plus values is its sum; a malformed payload is refused") {
  // A `none` payload of 5 elements, as a peer's partial sum arrives.
  const float a_vals[5] = {1.0f, -2.5f, 3.0f, -0.0f, 1e30f};
  const float b_vals[5] = {0.5f, 2.5f, -1.0f, -0.0f, 1e30f};
  std::vector<uint8_t> a(16 + 20);
  writeHeader(a.data(), {CodecId::kNone, DType::kF32, 0, 0, 5});
  std::memcpy(a.data() + 16, a_vals, 20);
  std::vector<uint8_t> out(a.size(), 0xAB);
  auto size = addDenseValues(a, b_vals, 5, out);
  REQUIRE(size.isOk());
  CHECK(*size == a.size());
  CHECK(std::equal(a.begin(), a.begin() + 16, out.begin()));  // a's header
  for (size_t i = 0; i < 5; ++i) {
    float got;
    std::memcpy(&got, out.data() + 16 + 4 * i, 4);
    const float want = a_vals[i] + b_vals[i];
    CHECK(std::memcmp(&got, &want, 4) == 0);
  }
  // What a hostile or confused peer could send, and a short output: refused, `out` untouched.
  auto refused = [&](std::vector<uint8_t> bad, size_t n, size_t out_size, const char* what) {
    std::vector<uint8_t> o(out_size, 0xCD);
    auto r = addDenseValues(bad, b_vals, n, o);
    CHECK_MESSAGE(!r.isOk(), what);
    CHECK_MESSAGE(std::all_of(o.begin(), o.end(), [](uint8_t v) { return v == 0xCD; }), what);
  };
  refused(std::vector<uint8_t>(a.begin(), a.begin() + 10), 5, out.size(), "truncated header");
  refused(std::vector<uint8_t>(a.begin(), a.end() - 1), 5, out.size(), "truncated body");
  auto longer = a;
  longer.push_back(0);
  refused(longer, 5, out.size() + 1, "trailing byte");
  refused(a, 4, out.size(), "another element count");
  auto topk = a;
  topk[3] = static_cast<uint8_t>(CodecId::kTopk);
  refused(topk, 5, out.size(), "another codec");
  refused(a, 5, out.size() - 1, "output too small");
}

}  // namespace test_payload
