// Philox4x32-10 against Random123's known-answer vectors (kat_vectors, philox4x32 10 rows), and
// the key/counter layout of docs/determinism.md §3.
#include <doctest.h>

#include <cstdlib>
#include <set>

#include "kernels/philox.h"

namespace test_philox {

using namespace lightwire::kernels;

TEST_CASE("philox: Random123 known-answer vectors for philox4x32-10") {
  struct Kat {
    std::array<uint32_t, 4> ctr;
    std::array<uint32_t, 2> key;
    std::array<uint32_t, 4> out;
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const auto& k : kats) CHECK(philoxBlock(k.ctr, k.key) == k.out);
}

TEST_CASE("philox: stream layout is (step, stream, purpose, group) under (seed, name key)") {
  const uint32_t name_key = tensorNameKey("layer1.weight");
  PhiloxStream s(7, name_key, 0x1'0000'0005ull, 3, RandomPurpose::kQsgdRounding);
  // Step keeps its low 32 bits; item i uses word i%4 of group i/4.
  const auto g2 = philoxBlock({5, 3, 1, 2}, {7, name_key});
  CHECK(s.group(2) == g2);
  for (uint32_t w = 0; w < 4; ++w) CHECK(s.word(8 + w) == g2[w]);
  // Different purpose, stream or name gives different words.
  PhiloxStream other_purpose(7, name_key, 5, 3, RandomPurpose::kDgcSampling);
  PhiloxStream other_rank(7, name_key, 5, 4, RandomPurpose::kQsgdRounding);
  PhiloxStream other_name(7, tensorNameKey("layer1.bias"), 5, 3, RandomPurpose::kQsgdRounding);
  CHECK(other_purpose.group(2) != g2);
  CHECK(other_rank.group(2) != g2);
  CHECK(other_name.group(2) != g2);
}

TEST_CASE("philox: tensor name key is the low half of XXH3-64") {
  // XXH3-64 of "abc" with seed 0 is 0x78af5f94892f3950 (xxhash test vectors / python xxhash).
  CHECK(tensorNameKey("abc") == 0x892f3950u);
  CHECK(tensorNameKey("") == static_cast<uint32_t>(0x2D06800538D394C2ull));
}

TEST_CASE("philox: unitDouble maps words into [0, 1) exactly") {
  CHECK(unitDouble(0) == 0.0);
  CHECK(unitDouble(0xFFFFFFFFu) < 1.0);
  CHECK(unitDouble(0x80000000u) == 0.5);
  // Words look uniform: 64k draws fill all 16 buckets roughly evenly.
  PhiloxStream s(1, 2, 3, 4, RandomPurpose::kDgcSampling);
  int buckets[16] = {};
  for (uint64_t i = 0; i < 65536; ++i) ++buckets[s.word(i) >> 28];
  for (int b : buckets) CHECK(std::abs(b - 4096) < 400);
}

}  // namespace test_philox
