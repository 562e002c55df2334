// policies/stats: the statistics record every rank sends with a step, and their aggregate.
#include "policies/stats.h"

#include <doctest/doctest.h>

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
  s.resumed_from = 10;
  s.requests.push_back({Request::Kind::kSettings, 3, 0, R"({"default":{"codec":"topk"}})"});
  s.requests.push_back({Request::Kind::kCheckpoint, 4, 40, ""});
  return s;
}

TEST_SUITE("stats") {
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
    CHECK(*back->resumed_from == 10);
    CHECK(back->requests == s.requests);
    StepStats empty;
    auto e = decodeStats(encodeStats(empty));
    REQUIRE(e);
    CHECK(!e->cos_dot);
    CHECK(!e->loss);
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
      bytes[4] = 4;
      CHECK(decodeStats(bytes).status().message().find("version 4") != std::string::npos);
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
    SUBCASE("version 2 records (no declared momentum) are read") {
      StepStats s = sampleStats();
      s.tail_s = 0.5;
      bytes = encodeStats(s);
      // A version 2 record is a version 3 record without the 8 bytes of the declared momentum.
      const size_t at = 4 + 2 + 2 + 8 * 11 + 48;
      bytes.erase(bytes.begin() + at, bytes.begin() + at + 8);
      bytes[4] = 2;
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
      // A version 1 record is a version 3 record without the 48 bytes of link and timing and the
      // 8 of the declared momentum.
      const size_t at = 4 + 2 + 2 + 8 * 11;
      bytes.erase(bytes.begin() + at, bytes.begin() + at + 56);
      bytes[4] = 1;
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

  TEST_CASE("the mean loss is absent when the reported losses overflow") {
    GlobalStats g;
    g.loss_ranks = 2;
    g.loss_sum = 1.7e308;
    CHECK(*g.loss() == 0.85e308);
    g.loss_sum = HUGE_VAL;  // two finite losses of 1.7e308
    CHECK(!g.loss());
  }
}

}  // namespace
}  // namespace lightwire::policies
