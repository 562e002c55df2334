// policies/stats: the statistics record every rank sends with a step, and their aggregate.
#include "policies/stats.h"

#include <doctest/doctest.h>

#include <bit>
#include <cmath>

namespace lightwire::policies {
namespace {

StepStats sampleStats() {
  StepStats s;
  s.grad_norm2 = 12.5;
  s.nonfinite = 1;
  s.elements = 1000;
  s.small = 7;
  s.residual_norm2 = 0.25;
  s.cos_dot = 3;
  s.cos_c2 = 4;
  s.cos_g2 = 9;
  s.loss = 2.5;
  s.loss_step = 41;
  s.reward = -7.25;
  s.reward_step = 40;
  s.resumed_from = 10;
  s.requests.push_back({Request::Kind::kSettings, 3, 0, R"({"default":{"codec":"topk"}})"});
  s.requests.push_back({Request::Kind::kCheckpoint, 4, 40, ""});
  return s;
}

/// Every field of two aggregates, doubles compared by their bits.
void checkSame(const GlobalStats& a, const GlobalStats& b) {
  auto bits = [](std::optional<double> v) {
    return v ? std::optional<uint64_t>(std::bit_cast<uint64_t>(*v)) : std::nullopt;
  };
  CHECK(a.ranks == b.ranks);
  CHECK(bits(a.grad_norm2) == bits(b.grad_norm2));
  CHECK(a.nonfinite == b.nonfinite);
  CHECK(a.elements == b.elements);
  CHECK(a.small == b.small);
  CHECK(bits(a.residual_norm2) == bits(b.residual_norm2));
  CHECK(a.cos_ranks == b.cos_ranks);
  CHECK(bits(a.cos_dot) == bits(b.cos_dot));
  CHECK(bits(a.cos_c2) == bits(b.cos_c2));
  CHECK(bits(a.cos_g2) == bits(b.cos_g2));
  CHECK(a.loss_ranks == b.loss_ranks);
  CHECK(bits(a.loss_sum) == bits(b.loss_sum));
  CHECK(a.loss_step == b.loss_step);
  CHECK(a.reward_ranks == b.reward_ranks);
  CHECK(bits(a.reward_sum) == bits(b.reward_sum));
  CHECK(a.reward_step == b.reward_step);
  CHECK(a.resumed_from == b.resumed_from);
  CHECK(a.requests == b.requests);
  CHECK(bits(a.link_bytes_per_s) == bits(b.link_bytes_per_s));
  CHECK(bits(a.link_latency_s) == bits(b.link_latency_s));
  CHECK(bits(a.compute_s) == bits(b.compute_s));
  CHECK(bits(a.overlap_s) == bits(b.overlap_s));
  CHECK(bits(a.direct_s) == bits(b.direct_s));
  CHECK(bits(a.tail_s) == bits(b.tail_s));
  CHECK(bits(a.momentum) == bits(b.momentum));
}

/// Rank r's record of a w-rank job: every field set on some ranks, values whose sums round.
std::vector<uint8_t> variedRecord(uint32_t r, uint32_t w) {
  StepStats s;
  s.grad_norm2 = 0.1 * (r + 1) + 1e-17 * r;
  s.elements = 1000;
  s.nonfinite = r % 3 == 0 ? 1 : 0;
  s.small = r;
  s.residual_norm2 = 1.0 / (r + 3);
  if (r % 2 == 0) {
    s.cos_dot = 0.3 + r;
    s.cos_c2 = 0.7 * r + 0.1;
    s.cos_g2 = 1.1 * r + 0.2;
  }
  if (r % 4 != 1) {
    s.loss = 2.0 / 3.0 + r;
    s.loss_step = 40 + r % 2;
  }
  if (r % 3 != 1) {
    s.reward = -1.0 / 3.0 - r;  // rewards may be negative
    s.reward_step = 40 + r % 3;
  }
  if (r != w / 2) s.resumed_from = 17;
  if (r % 3 != 2) {
    s.link_bytes_per_s = 1e8 + r;
    s.link_latency_s = 1e-4 / (r + 1);
  }
  if (r % 5 != 4) {
    s.compute_s = 0.01 * ((r * 7) % 11 + 1);
    s.overlap_s = *s.compute_s / 2;
  }
  if (r % 2) s.direct_s = 0.001 * r;
  s.tail_s = 0.002 * r;
  s.momentum = 0.9;
  if (r == 1) s.requests.push_back({Request::Kind::kSettings, 3, 0, R"({"default":{}})"});
  if (r + 1 == w) s.requests.push_back({Request::Kind::kCheckpoint, 9, 40, ""});
  return encodeStats(s);
}

TEST_SUITE("stats") {
  TEST_CASE("folding the records in rank order, as bytes, gives exactly the aggregate") {
    for (uint32_t w : {1u, 2u, 3u, 7u, 16u, 64u}) {
      CAPTURE(w);
      std::vector<std::vector<uint8_t>> records;
      std::vector<uint8_t> partial;
      for (uint32_t r = 0; r < w; ++r) {
        records.push_back(variedRecord(r, w));
        auto f = foldStats(partial, records.back(), r);
        REQUIRE_MESSAGE(f, f.status().message());
        partial = std::move(*f);
      }
      auto folded = finishStats(partial);
      REQUIRE_MESSAGE(folded, folded.status().message());
      auto all = aggregate(records);
      REQUIRE(all);
      checkSame(*folded, *all);
      CHECK(folded->requests.size() == (w > 1 ? 2u : 1u));
      // What travels stays small: the sums, one resume run per change, 16 bytes of compute
      // figures per rank, the requests (here: about 100 bytes).
      CHECK(partial.size() <= 256 + 16 * w + 3 * 12 + 100);
    }
    // Ranks without a record (bounded staleness) are skipped alike.
    const std::vector<std::vector<uint8_t>> gappy = {variedRecord(0, 4), {}, variedRecord(2, 4)};
    auto p0 = foldStats({}, gappy[0], 0);
    REQUIRE(p0);
    auto p2 = foldStats(*p0, gappy[2], 2);
    REQUIRE(p2);
    checkSame(*finishStats(*p2), *aggregate(gappy));
  }

  TEST_CASE("a fold refuses ranks out of order, bad records and malformed partials") {
    auto p1 = foldStats({}, variedRecord(1, 4), 1);
    REQUIRE(p1);
    for (uint32_t r : {0u, 1u}) {
      auto again = foldStats(*p1, variedRecord(r, 4), r);
      REQUIRE_FALSE(again);
      CHECK(again.status().message().find("rank order") != std::string::npos);
    }
    auto bad_record = foldStats(*p1, std::vector<uint8_t>{1, 2, 3}, 2);
    REQUIRE_FALSE(bad_record);
    CHECK(bad_record.status().message().find("rank 2") != std::string::npos);
    // Every truncation of a partial, a trailing byte, and garbage.
    auto p2 = foldStats(*p1, variedRecord(2, 4), 2);
    REQUIRE(p2);
    for (size_t len = 0; len < p2->size(); ++len) {
      CAPTURE(len);
      CHECK_FALSE(finishStats(std::span<const uint8_t>(p2->data(), len)));
      if (len > 0) {  // empty: nothing folded yet
        CHECK_FALSE(foldStats(std::span<const uint8_t>(p2->data(), len), variedRecord(3, 4), 3));
      }
    }
    auto longer = *p2;
    longer.push_back(0);
    CHECK_FALSE(finishStats(longer));
    CHECK_FALSE(finishStats(std::vector<uint8_t>(200, 0xAB)));
    // Hostile counts: more records than ranks, more nonfinite values than elements.
    auto more = *p2;
    more[4] = 9;  // ranks: 9 records folded, the next rank 3
    CHECK_FALSE(finishStats(more));
    auto counts = *p2;
    const size_t nonfinite_at = 4 + 4 + 4 + 1 + 8;
    for (size_t i = 0; i < 8; ++i) counts[nonfinite_at + i] = 0xFF;
    CHECK_FALSE(finishStats(counts));
  }

  TEST_CASE("a record round-trips exactly") {
    const StepStats s = sampleStats();
    auto back = decodeStats(encodeStats(s));
    REQUIRE(back);
    CHECK(back->grad_norm2 == 12.5);
    CHECK(back->nonfinite == 1);
    CHECK(back->small == 7);
    CHECK(*back->cos_g2 == 9);
    CHECK(*back->loss == 2.5);
    CHECK(back->loss_step == 41);
    CHECK(*back->reward == -7.25);
    CHECK(back->reward_step == 40);
    CHECK(*back->resumed_from == 10);
    CHECK(back->requests == s.requests);
    StepStats empty;
    auto e = decodeStats(encodeStats(empty));
    REQUIRE(e);
    CHECK(!e->cos_dot);
    CHECK(!e->loss);
    CHECK(!e->reward);
    CHECK(!e->resumed_from);
  }

  TEST_CASE("every truncation and a trailing byte are refused") {
    const auto bytes = encodeStats(sampleStats());
    for (size_t n = 0; n < bytes.size(); ++n) {
      CHECK_FALSE(decodeStats(std::span(bytes.data(), n)));
    }
    auto longer = bytes;
    longer.push_back(0);
    auto r = decodeStats(longer);
    REQUIRE_FALSE(r);
    CHECK(r.status().message().find("trailing") != std::string::npos);
  }

  TEST_CASE("hostile fields are refused") {
    auto bytes = encodeStats(sampleStats());
    SUBCASE("magic") {
      bytes[0] = 'X';
      CHECK_FALSE(decodeStats(bytes));
    }
    SUBCASE("version") {
      bytes[4] = 5;
      CHECK(decodeStats(bytes).status().message().find("version 5") != std::string::npos);
      bytes[4] = 0;
      CHECK_FALSE(decodeStats(bytes));
    }
    SUBCASE("link and timing figures out of range") {
      StepStats s;
      s.elements = 1;
      s.link_bytes_per_s = 0.0;  // a bandwidth of 0
      s.link_latency_s = 0.0;
      CHECK_FALSE(decodeStats(encodeStats(s)));
      s.link_bytes_per_s = 1e9;
      s.compute_s = 1.0;
      s.overlap_s = 2.0;  // more overlap than compute
      CHECK_FALSE(decodeStats(encodeStats(s)));
      s.overlap_s = 0.5;
      s.tail_s = -1.0;
      CHECK_FALSE(decodeStats(encodeStats(s)));
      s.tail_s = 0.25;
      s.direct_s = 0.125;
      auto back = decodeStats(encodeStats(s));
      REQUIRE(back.isOk());
      CHECK(*back->link_bytes_per_s == 1e9);
      CHECK(*back->overlap_s == 0.5);
      CHECK(*back->tail_s == 0.25);
      CHECK(*back->direct_s == 0.125);
    }
    SUBCASE("declared momentum") {
      StepStats s;
      s.elements = 1;
      for (double bad : {0.0, 1.0, -0.5, 2.0}) {
        s.momentum = bad;
        CHECK_FALSE(decodeStats(encodeStats(s)));
      }
      s.momentum = 0.9;
      auto back = decodeStats(encodeStats(s));
      REQUIRE(back.isOk());
      CHECK(*back->momentum == 0.9);
    }
    SUBCASE("a reward that is not finite") {
      StepStats s;
      s.elements = 1;
      for (double bad : {INFINITY, -INFINITY, NAN}) {
        s.reward = bad;
        CHECK(decodeStats(encodeStats(s)).status().message().find("reward must be finite") !=
              std::string::npos);
      }
    }
    SUBCASE("version 3 records (no reward) are read") {
      StepStats s = sampleStats();
      s.reward.reset();
      s.momentum = 0.9;
      bytes = encodeStats(s);
      // A version 3 record is a version 4 record without the 16 bytes of the reward and its step.
      const size_t at = 4 + 2 + 2 + 8 * 11 + 48 + 8;
      bytes.erase(bytes.begin() + at, bytes.begin() + at + 16);
      bytes[4] = 3;
      auto v3 = decodeStats(bytes);
      REQUIRE_MESSAGE(v3.isOk(), v3.status().message());
      CHECK(*v3->momentum == 0.9);
      CHECK(*v3->loss == 2.5);
      CHECK_FALSE(v3->reward);
      CHECK(v3->requests == sampleStats().requests);
      bytes[6] |= 128;  // a reward flag in a version 3 record: unknown there
      CHECK_FALSE(decodeStats(bytes));
    }
    SUBCASE("version 2 records (no declared momentum) are read") {
      StepStats s = sampleStats();
      s.tail_s = 0.5;
      bytes = encodeStats(s);
      // A version 2 record is a version 4 record without the 8 bytes of the declared momentum and
      // the 16 of the reward.
      const size_t at = 4 + 2 + 2 + 8 * 11 + 48;
      bytes.erase(bytes.begin() + at, bytes.begin() + at + 24);
      bytes[4] = 2;
      bytes[6] &= 127;  // the reward's flag
      auto v2 = decodeStats(bytes);
      REQUIRE_MESSAGE(v2.isOk(), v2.status().message());
      CHECK(*v2->tail_s == 0.5);
      CHECK_FALSE(v2->momentum);
      CHECK(v2->requests == sampleStats().requests);
      bytes[6] |= 64;  // a momentum flag in a version 2 record: unknown there
      CHECK_FALSE(decodeStats(bytes));
    }
    SUBCASE("version 1 records (no link, no timing) are read") {
      bytes = encodeStats(sampleStats());
      // A version 1 record is a version 4 record without the 48 bytes of link and timing, the 8
      // of the declared momentum and the 16 of the reward.
      const size_t at = 4 + 2 + 2 + 8 * 11;
      bytes.erase(bytes.begin() + at, bytes.begin() + at + 72);
      bytes[4] = 1;
      bytes[6] &= 127;  // the reward's flag
      auto v1 = decodeStats(bytes);
      REQUIRE_MESSAGE(v1.isOk(), v1.status().message());
      CHECK_FALSE(v1->link_bytes_per_s);
      CHECK(v1->requests == sampleStats().requests);
    }
    SUBCASE("counts above the element count") {
      StepStats s;
      s.elements = 1;
      s.nonfinite = 2;
      CHECK_FALSE(decodeStats(encodeStats(s)));
    }
    SUBCASE("too many requests") {
      StepStats s;
      for (int i = 0; i < 17; ++i) s.requests.push_back({Request::Kind::kCheckpoint, 1, 1, ""});
      CHECK_FALSE(decodeStats(encodeStats(s)));
    }
    SUBCASE("a request body longer than allowed, a checkpoint with a body, an unknown kind") {
      StepStats s;
      s.requests.push_back({Request::Kind::kSettings, 1, 0, std::string(49 << 10, 'x')});
      CHECK_FALSE(decodeStats(encodeStats(s)));
      StepStats c;
      c.requests.push_back({Request::Kind::kCheckpoint, 1, 0, "x"});
      CHECK_FALSE(decodeStats(encodeStats(c)));
      StepStats k;
      k.requests.push_back({static_cast<Request::Kind>(9), 1, 0, ""});
      CHECK_FALSE(decodeStats(encodeStats(k)));
    }
    SUBCASE("settings that are not a JSON object (ranks keep them as JSON)") {
      for (const char* body : {"v1", "[1]", "{\"default\": {\"codec\": \"topk\xff\"}}", ""}) {
        StepStats s;
        s.requests.push_back({Request::Kind::kSettings, 1, 0, body});
        CHECK_FALSE(decodeStats(encodeStats(s)));
      }
    }
  }

  TEST_CASE("aggregate sums in rank order, skips ranks without records, names bad ones") {
    StepStats a, b;
    a.grad_norm2 = 1;
    a.elements = 10;
    a.cos_dot = 1;
    a.cos_c2 = 1;
    a.cos_g2 = 1;
    a.loss = 2;
    a.loss_step = 5;
    a.requests.push_back({Request::Kind::kCheckpoint, 7, 3, ""});
    b.grad_norm2 = 3;
    b.elements = 10;
    b.nonfinite = 2;
    b.loss = 4;
    b.loss_step = 6;
    auto g = aggregate({encodeStats(a), {}, encodeStats(b)});
    REQUIRE(g);
    CHECK(g->ranks == 2);
    CHECK(g->grad_norm2 == 4);
    CHECK(g->nonfinite == 2);
    CHECK(g->elements == 20);
    CHECK(g->cos_ranks == 1);
    CHECK(*g->cosine() == doctest::Approx(1.0));
    CHECK(*g->loss() == 3);
    CHECK(g->loss_step == 6);
    REQUIRE(g->requests.size() == 1);
    CHECK(g->requests[0].origin == 0);
    CHECK(!resumeMismatch(*g));
    auto bad = aggregate({encodeStats(a), {1, 2, 3}});
    REQUIRE_FALSE(bad);
    CHECK(bad.status().message().find("rank 1") != std::string::npos);
  }

  TEST_CASE("the declared momentum holds only when every record declares the same") {
    StepStats a, b, c;
    a.momentum = 0.9;
    b.momentum = 0.9;
    c.momentum = 0.95;
    auto both = aggregate({encodeStats(a), encodeStats(b)});
    REQUIRE(both);
    CHECK(*both->momentum == 0.9);
    auto differ = aggregate({encodeStats(a), encodeStats(c)});
    REQUIRE(differ);
    CHECK_FALSE(differ->momentum);
    auto one_silent = aggregate({encodeStats(StepStats{}), encodeStats(a)});
    REQUIRE(one_silent);
    CHECK_FALSE(one_silent->momentum);
    auto other_order = aggregate({encodeStats(a), encodeStats(StepStats{})});
    REQUIRE(other_order);
    CHECK_FALSE(other_order->momentum);
  }

  TEST_CASE("ranks that resumed from different steps are named") {
    StepStats a, b;
    a.resumed_from = 10;
    auto g = aggregate({encodeStats(a), encodeStats(b)});
    REQUIRE(g);
    auto m = resumeMismatch(*g);
    REQUIRE(m);
    CHECK(m->find("10, none") != std::string::npos);
    b.resumed_from = 10;
    CHECK(!resumeMismatch(*aggregate({encodeStats(a), encodeStats(b)})));
  }

  TEST_CASE("cosine is absent when not measured or degenerate") {
    GlobalStats g;
    CHECK(!g.cosine());
    g.cos_ranks = 1;
    g.cos_c2 = 0;
    g.cos_g2 = 1;
    CHECK(!g.cosine());
    g.cos_c2 = 4;
    g.cos_g2 = 1;
    g.cos_dot = -2;
    CHECK(*g.cosine() == doctest::Approx(-1.0));
    g.cos_dot = 1e247;  // not an honest record: clamped to what a cosine can be
    CHECK(*g.cosine() == 1.0);
  }

  TEST_CASE("the mean loss and reward are absent when the reported values overflow") {
    GlobalStats g;
    g.loss_ranks = 2;
    g.loss_sum = 1.7e308;
    CHECK(*g.loss() == 0.85e308);
    g.loss_sum = HUGE_VAL;  // two finite losses of 1.7e308
    CHECK(!g.loss());
    CHECK(!g.reward());
    g.reward_ranks = 2;
    g.reward_sum = -3;
    CHECK(*g.reward() == -1.5);
    g.reward_sum = -HUGE_VAL;
    CHECK(!g.reward());
  }

  TEST_CASE("the mean reward is over the ranks that reported one, its step the newest") {
    StepStats a, b, c;
    a.reward = 2;
    a.reward_step = 7;
    c.reward = -5;
    c.reward_step = 8;
    auto g = aggregate({encodeStats(a), encodeStats(b), encodeStats(c)});
    REQUIRE(g);
    CHECK(g->reward_ranks == 2);
    CHECK(*g->reward() == -1.5);
    CHECK(g->reward_step == 8);
    CHECK(!g->loss());
  }
}

}  // namespace
}  // namespace lightwire::policies
