// The ring collectives (proxy/peer/collective.h) over real TcpTransports on loopback: results
// against a plain computation of docs/exchange.md, bitwise identical on every rank; the
// result-checksum guard; the policy statistics records carried by round 0 of every path; and, with
// UCX, the ring over UcxTransports, bit for bit equal to the tcp one.

#include <doctest.h>

#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "kernels/codec.h"
#include "kernels/registry.h"
#include "proxy/peer/collective.h"
#include "proxy/step/engine.h"
#include "tests/proxy/peer_mesh.h"
#include "tests/text.h"

namespace lightwire::proxy::peer {
namespace {

using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)

std::vector<float> tensorOf(uint32_t rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<float>((rank + 1) * 0.37) + static_cast<float>(i % 97) * 0.013f -
           static_cast<float>(rank) * 0.5f;
  }
  return v;
}

/// Runs one exchange round of `codec` on every rank of `mesh` (threads, any link) and returns
/// each rank's decoded result with weight 1/W.
template <typename M>
std::vector<std::vector<float>> exchangeAll(M& mesh, const kernels::Codec& codec, size_t n,
                                            size_t chunk, bool raw = false) {
  const uint32_t w = static_cast<uint32_t>(mesh.transports.size());
  const kernels::Chunking chunking = kernels::chunkingFor(codec, n, chunk);
  std::vector<std::future<std::vector<float>>> futures;
  for (uint32_t r = 0; r < w; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      RingExchange ring(*mesh.transports[r], std::chrono::milliseconds(5000));
      const auto x = tensorOf(r, n);
      kernels::CodecState state(codec.stateFloats(n));
      kernels::StepContext ctx;
      ctx.rank = r;
      ctx.step = 1;
      auto payloads =
          kernels::encodeTensor(codec, ctx, chunking, kernels::ConstTensor{x.data(), n}, state);
      REQUIRE(payloads.isOk());
      std::vector<std::span<const uint8_t>> mine(payloads->begin(), payloads->end());
      const std::string name = "t";
      ExchangeRound round{name, 1, 0, codec, chunking, mine};
      if (raw) round.raw = [&](size_t c) { return x.data() + chunking.begin(c); };
      // Every chunk is announced final exactly once and decoded then: its list is valid during
      // the call only (the allreduce gives its buffers back to the transport afterwards).
      auto none = kernels::createCodec({.name = "none"});
      std::vector<float> out(n, 0.0f);
      std::vector<int> calls(chunking.count(), 0);
      round.on_chunk = [&](size_t c, std::span<const std::span<const uint8_t>> list) {
        ++calls.at(c);
        const kernels::Codec& decoder = round.dense ? **none : codec;
        for (auto p : list) {
          const Status st = decoder.decodeChunk(p, 1.0f / static_cast<float>(w),
                                                out.data() + chunking.begin(c), chunking.size(c));
          if (!st.isOk()) return st;
        }
        return Status::ok();
      };
      auto got = ring.run(round);
      REQUIRE_MESSAGE(got.isOk(), got.status().message());
      if (raw) {  // the values were added, or sent at their chains' starts: never a payload
        REQUIRE(round.raw_used.size() == chunking.count());
        for (size_t c = 0; c < chunking.count(); ++c) CHECK(round.raw_used[c]);
      }
      REQUIRE(got->size() == chunking.count());
      for (size_t c = 0; c < got->size(); ++c) {
        REQUIRE(calls[c] == 1);
        // An allreduce's sums went back to the transport once decoded: nothing is returned.
        if (codec.traits().summable || round.dense) CHECK((*got)[c].empty());
      }
      ring.stepDone(name, 1);
      return out;
    }));
  }
  std::vector<std::vector<float>> results;
  for (auto& f : futures) results.push_back(f.get());
  return results;
}

TEST_CASE("ring allreduce of codec none: chunk sums in ring order, identical on every rank") {
  for (uint32_t w : {2u, 3u, 5u}) {
    CAPTURE(w);
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    auto codec = kernels::createCodec({.name = "none"});
    REQUIRE(codec.isOk());
    const size_t n = 10000, chunk = 1024;
    // The same bytes when the ranks add their values instead of their payloads
    // (ExchangeRound::raw).
    const auto results = exchangeAll(mesh, **codec, n, chunk);
    CHECK(exchangeAll(mesh, **codec, n, chunk, /*raw=*/true) == results);
    // docs/exchange.md: chunk c owned by o = c mod W, summed ((x[o+1] + x[o+2]) + ...) + x[o].
    std::vector<std::vector<float>> x;
    for (uint32_t r = 0; r < w; ++r) x.push_back(tensorOf(r, n));
    const float weight = 1.0f / static_cast<float>(w);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t o = static_cast<uint32_t>((i / chunk) % w);
      float sum = x[(o + 1) % w][i];
      for (uint32_t k = 2; k <= w; ++k) sum = sum + x[(o + k) % w][i];
      const float want = 0.0f + weight * sum;
      for (uint32_t r = 0; r < w; ++r) {
        uint32_t a, b;
        std::memcpy(&a, &results[r][i], 4);
        std::memcpy(&b, &want, 4);
        REQUIRE(a == b);
      }
    }
  }
}

TEST_CASE("ring allgather of topk: every rank decodes every rank's payload in rank order") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  auto codec = kernels::createCodec({.name = "topk", .density = 0.1, .error_feedback = false});
  REQUIRE(codec.isOk());
  const size_t n = 5000, chunk = 2048;
  const auto results = exchangeAll(mesh, **codec, n, chunk);
  // The plain computation: each rank's own payloads decoded in rank order.
  const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, chunk);
  std::vector<float> want(n, 0.0f);
  for (uint32_t r = 0; r < 3; ++r) {
    const auto x = tensorOf(r, n);
    kernels::CodecState state((*codec)->stateFloats(n));
    kernels::StepContext ctx;
    ctx.rank = r;
    ctx.step = 1;
    auto p =
        kernels::encodeTensor(**codec, ctx, chunking, kernels::ConstTensor{x.data(), n}, state);
    REQUIRE(p.isOk());
    for (size_t c = 0; c < p->size(); ++c) {
      REQUIRE(
          (*codec)
              ->decodeChunk((*p)[c], 1.0f / 3.0f, want.data() + chunking.begin(c), chunking.size(c))
              .isOk());
    }
  }
  for (uint32_t r = 0; r < 3; ++r) {
    CHECK(std::memcmp(results[r].data(), want.data(), n * sizeof(float)) == 0);
  }
}

TEST_CASE("ring: a sparse codec dense enough switches to a dense allreduce of decoded chunks") {
  // topk at density 0.6: 4 ranks x 0.6 n pairs of 8 bytes > 2 x 4n bytes dense.
  const uint32_t w = 4;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  auto codec = kernels::createCodec({.name = "topk", .density = 0.6, .error_feedback = false});
  REQUIRE(codec.isOk());
  const size_t n = 6000, chunk = 1000;
  const auto results = exchangeAll(mesh, **codec, n, chunk);
  // Each rank's own payloads decoded, then summed in the ring order of chunk c's owner c mod W.
  const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, chunk);
  std::vector<std::vector<float>> decoded;
  for (uint32_t r = 0; r < w; ++r) {
    const auto x = tensorOf(r, n);
    kernels::CodecState state;
    kernels::StepContext ctx;
    ctx.rank = r;
    ctx.step = 1;
    auto p =
        kernels::encodeTensor(**codec, ctx, chunking, kernels::ConstTensor{x.data(), n}, state);
    REQUIRE(p.isOk());
    std::vector<float> d(n, 0.0f);
    for (size_t c = 0; c < p->size(); ++c) {
      REQUIRE((*codec)
                  ->decodeChunk((*p)[c], 1.0f, d.data() + chunking.begin(c), chunking.size(c))
                  .isOk());
    }
    decoded.push_back(std::move(d));
  }
  const float weight = 1.0f / static_cast<float>(w);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t o = static_cast<uint32_t>((i / chunk) % w);
    float sum = decoded[(o + 1) % w][i];
    for (uint32_t k = 2; k <= w; ++k) sum = sum + decoded[(o + k) % w][i];
    const float want = 0.0f + weight * sum;
    for (uint32_t r = 0; r < w; ++r) {
      REQUIRE(std::memcmp(&results[r][i], &want, 4) == 0);
    }
  }
  // Wire bytes: about 2 (W-1)/W dense chunks per rank, not W-1 payloads of 0.6 n pairs.
  for (uint32_t r = 0; r < w; ++r) {
    const double sent =
        metricValue(*mesh.metrics[r], "lightwire_wire_bytes_total{direction=\"sent\"}");
    CHECK(sent < 1.2 * 2.0 * (w - 1) / w * 4.0 * n + 4096);
  }
}

/// One tensor of a bucket for the runAll tests: its codec and size.
struct BucketTensor {
  std::string name;
  kernels::CodecConfig config;
  size_t n;
};

/// Every tensor of `tensors` exchanged at `step` on every rank of `mesh` — together in one runAll
/// (`together`), or one run() each — with its policy statistics record; returns [rank][tensor]
/// the decoded result (weight 1/W) followed by the records received, as floats of their bytes.
std::vector<std::vector<std::vector<float>>> exchangeBucket(
    Mesh& mesh, const std::vector<BucketTensor>& tensors, uint64_t step, bool together) {
  const uint32_t w = static_cast<uint32_t>(mesh.transports.size());
  std::vector<std::future<std::vector<std::vector<float>>>> futures;
  for (uint32_t r = 0; r < w; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      RingExchange ring(*mesh.transports[r], std::chrono::milliseconds(5000));
      std::vector<std::unique_ptr<kernels::Codec>> codecs;
      std::vector<kernels::Chunking> chunkings;
      std::vector<std::vector<std::vector<uint8_t>>> payloads;
      std::vector<std::vector<std::span<const uint8_t>>> mine;
      std::vector<std::vector<uint8_t>> records;
      std::deque<ExchangeRound> rounds;
      for (size_t t = 0; t < tensors.size(); ++t) {
        auto codec = kernels::createCodec(tensors[t].config);
        REQUIRE(codec.isOk());
        codecs.push_back(std::move(*codec));
        chunkings.push_back(kernels::chunkingFor(*codecs.back(), tensors[t].n, 700));
      }
      for (size_t t = 0; t < tensors.size(); ++t) {
        const size_t n = tensors[t].n;
        auto x = tensorOf(r + static_cast<uint32_t>(t), n);
        kernels::CodecState state(codecs[t]->stateFloats(n));
        kernels::StepContext ctx;
        ctx.rank = r;
        ctx.step = step;
        auto p = kernels::encodeTensor(*codecs[t], ctx, chunkings[t],
                                       kernels::ConstTensor{x.data(), n}, state);
        REQUIRE(p.isOk());
        payloads.push_back(std::move(*p));
        records.push_back(statsOf(r, step + t));
      }
      for (size_t t = 0; t < tensors.size(); ++t) {
        mine.emplace_back(payloads[t].begin(), payloads[t].end());
      }
      for (size_t t = 0; t < tensors.size(); ++t) {
        ExchangeRound& round = rounds.emplace_back(
            ExchangeRound{tensors[t].name, step, 0, *codecs[t], chunkings[t], mine[t]});
        round.stats_out = records[t];
        round.stats_fold = &testing::keepAllFold;
      }
      std::vector<std::vector<std::vector<std::span<const uint8_t>>>> got;
      if (together) {
        std::vector<ExchangeRound*> all;
        for (auto& round : rounds) all.push_back(&round);
        auto res = ring.runAll(all, nullptr);
        REQUIRE_MESSAGE(res.isOk(), res.status().message());
        got = std::move(*res);
      } else {
        for (auto& round : rounds) {
          auto res = ring.run(round);
          REQUIRE_MESSAGE(res.isOk(), res.status().message());
          got.push_back(std::move(*res));
        }
      }
      REQUIRE(got.size() == tensors.size());
      std::vector<std::vector<float>> out;
      auto none = kernels::createCodec({.name = "none"});
      for (size_t t = 0; t < tensors.size(); ++t) {
        const kernels::Codec& decoder = rounds[t].dense ? **none : *codecs[t];
        std::vector<float> v(tensors[t].n, 0.0f);
        for (size_t c = 0; c < got[t].size(); ++c) {
          for (auto payload : got[t][c]) {
            REQUIRE(decoder
                        .decodeChunk(payload, 1.0f / static_cast<float>(w),
                                     v.data() + chunkings[t].begin(c), chunkings[t].size(c))
                        .isOk());
          }
        }
        // The records every rank got for this tensor (folded along the ring), appended as bytes.
        REQUIRE(rounds[t].stats_folded);
        REQUIRE(rounds[t].stats_in.size() == 1);
        const auto kept = testing::keptRecords(rounds[t].stats_in[0], w);
        for (uint32_t k = 0; k < w; ++k) {
          REQUIRE(kept[k] == statsOf(k, step + t));
          v.push_back(static_cast<float>(kept[k].size()));
        }
        v.push_back(rounds[t].dense ? 1.0f : 0.0f);
        out.push_back(std::move(v));
      }
      for (const auto& t : tensors) ring.stepDone(t.name, step);
      return out;
    }));
  }
  std::vector<std::vector<std::vector<float>>> results;
  for (auto& f : futures) results.push_back(f.get());
  return results;
}

TEST_CASE("ring runAll: a bucket's tensors in one pass equal each exchanged alone, on every rank") {
  // Codec none (allreduce), topk 1 % (allgather), topk 60 % (switched to a dense allreduce) and
  // fp16, of different sizes (one chunk and several), in one pass at W = 3.
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const std::vector<BucketTensor> tensors = {
      {"fc1.weight", {.name = "topk", .density = 0.01, .error_feedback = false}, 5000},
      {"fc1.bias", {.name = "none"}, 64},
      {"fc2.weight", {.name = "none"}, 3000},
      {"fc2.bias", {.name = "topk", .density = 0.6, .error_feedback = false}, 2100},
      {"out.weight", {.name = "fp16"}, 1500}};
  const auto together = exchangeBucket(mesh, tensors, 7, true);
  const auto alone = exchangeBucket(mesh, tensors, 7, false);
  for (uint32_t r = 0; r < w; ++r) {
    CAPTURE(r);
    for (size_t t = 0; t < tensors.size(); ++t) {
      CAPTURE(tensors[t].name);
      REQUIRE(together[r][t].size() == alone[r][t].size());
      CHECK(std::memcmp(together[r][t].data(), alone[r][t].data(),
                        together[r][t].size() * sizeof(float)) == 0);
      CHECK(std::memcmp(together[r][t].data(), together[0][t].data(),
                        together[r][t].size() * sizeof(float)) == 0);
    }
    CHECK(together[r][3].back() == 1.0f);  // the dense switch happened inside the pass
    CHECK(together[r][0].back() == 0.0f);
  }
}

TEST_CASE("ring runAll: an abort of one tensor fails the whole pass on every rank, at once") {
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  auto none = kernels::createCodec({.name = "none"});
  auto topk = kernels::createCodec({.name = "topk", .density = 0.01, .error_feedback = false});
  REQUIRE(none.isOk());
  REQUIRE(topk.isOk());
  const size_t n = 4000;
  const std::string a = "a.weight", b = "b.weight";
  std::vector<std::future<Status>> futures;
  const auto t0 = Clock::now();
  for (uint32_t r = 0; r < w; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r]() -> Status {
      RingExchange ring(*mesh.transports[r], std::chrono::milliseconds(8000));
      if (r == 2) {  // this rank's second layer failed before its exchange: it aborts the bucket
        ring.abort(a, 3, "layer 'b.weight': out of memory");
        ring.abort(b, 3, "layer 'b.weight': out of memory");
        return Status::ok();
      }
      const kernels::Chunking ca = kernels::chunkingFor(**none, n, 1000);
      const kernels::Chunking cb = kernels::chunkingFor(**topk, n, 1000);
      const auto x = tensorOf(r, n);
      kernels::CodecState sa, sb((*topk)->stateFloats(n));
      kernels::StepContext ctx;
      ctx.rank = r;
      ctx.step = 3;
      auto pa = kernels::encodeTensor(**none, ctx, ca, kernels::ConstTensor{x.data(), n}, sa);
      auto pb = kernels::encodeTensor(**topk, ctx, cb, kernels::ConstTensor{x.data(), n}, sb);
      REQUIRE(pa.isOk());
      REQUIRE(pb.isOk());
      std::vector<std::span<const uint8_t>> ma(pa->begin(), pa->end()), mb(pb->begin(), pb->end());
      ExchangeRound ra{a, 3, 0, **none, ca, ma}, rb{b, 3, 0, **topk, cb, mb};
      ExchangeRound* all[] = {&ra, &rb};
      auto got = ring.runAll(all, nullptr);
      ring.stepDone(a, 3);
      ring.stepDone(b, 3);
      return got ? Status::ok() : got.status();
    }));
  }
  for (uint32_t r = 0; r < w; ++r) {
    const Status st = futures[r].get();
    if (r == 2) continue;
    CAPTURE(r);
    REQUIRE_FALSE(st.isOk());
    CHECK(lightwire::testing::contains(st.message(), "out of memory"));
  }
  CHECK(Clock::now() - t0 < std::chrono::milliseconds(6000));  // the abort, not the deadline
}

/// One tensor of codec none as the only layer of bucket "bucket.x" at `step`, on every rank of
/// `mesh`, rank r with tag(r); each rank's status. A rank for which `instead` returns true runs
/// no exchange (it did what a broken peer does through its transport; its status is ok).
std::vector<Status> bucketOnEveryRank(
    Mesh& mesh, uint64_t step, const std::function<BucketTag(uint32_t)>& tag,
    const std::function<bool(uint32_t, Transport&)>& instead = {}) {
  auto none = kernels::createCodec({.name = "none"});
  REQUIRE(none.isOk());
  const size_t n = 3000;
  const std::string a = "fc.weight";
  std::vector<std::future<Status>> futures;
  for (uint32_t r = 0; r < mesh.transports.size(); ++r) {
    futures.push_back(std::async(std::launch::async, [&, r]() -> Status {
      if (instead && instead(r, *mesh.transports[r])) return Status::ok();
      RingExchange ring(*mesh.transports[r], std::chrono::milliseconds(8000));
      const kernels::Chunking chunking = kernels::chunkingFor(**none, n, 1000);
      const auto x = tensorOf(r, n);
      kernels::CodecState state;
      kernels::StepContext ctx;
      auto p =
          kernels::encodeTensor(**none, ctx, chunking, kernels::ConstTensor{x.data(), n}, state);
      REQUIRE(p.isOk());
      std::vector<std::span<const uint8_t>> mine(p->begin(), p->end());
      ExchangeRound round{a, step, 0, **none, chunking, mine};
      ExchangeRound* all[] = {&round};
      const BucketTag t = tag(r);
      auto got = ring.runAll(all, &t);
      ring.stepDone(a, step);
      ring.stepDone(t.name, step);
      return got ? Status::ok() : got.status();
    }));
  }
  std::vector<Status> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

TEST_CASE("ring runAll: a rank with another layout of the bucket fails it on every rank, at once") {
  // Rank 2's trainer sent the bucket with another layout (its hash differs); the others agree.
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const auto t0 = Clock::now();
  const auto failed = bucketOnEveryRank(mesh, 4, [](uint32_t r) {
    return BucketTag{"bucket.x", r == 2 ? 0xbadbadbadbadbad0ull : 0x8c1d0b6f2e4a9375ull,
                     r == 2 ? 2u : 1u};
  });
  for (uint32_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    const Status& st = failed[r];
    REQUIRE_FALSE(st.isOk());
    CHECK(lightwire::testing::contains(st.message(), "bucket 'bucket.x' step 4"));
    CHECK(lightwire::testing::contains(st.message(), "must send a bucket with the same layout"));
    // Both layouts are named: by the rank's own comparison, or by that of a rank whose abort
    // came first (which of the two a rank reports depends on arrival order).
    CHECK(lightwire::testing::contains(st.message(), "badbadbadbadbad0 (2 layers)"));
    CHECK(lightwire::testing::contains(st.message(), "8c1d0b6f2e4a9375 (1 layers)"));
  }
  CHECK(Clock::now() - t0 < std::chrono::milliseconds(6000));  // at once, not at the deadline
  // The same bucket with one layout everywhere runs.
  for (const Status& st : bucketOnEveryRank(mesh, 5, [](uint32_t) {
         return BucketTag{"bucket.x", 0x8c1d0b6f2e4a9375ull, 1};
       })) {
    CHECK_MESSAGE(st.isOk(), st.message());
  }
}

TEST_CASE("ring runAll: a bucket header of the wrong size fails the bucket on every rank") {
  // Rank 2 speaks the protocol wrongly: its header of bucket.x has 5 bytes, not 12, and it runs
  // nothing else. The others fail the bucket naming it, before their deadline.
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const auto t0 = Clock::now();
  const auto failed = bucketOnEveryRank(
      mesh, 6,
      [](uint32_t) {
        return BucketTag{"bucket.x", 0x8c1d0b6f2e4a9375ull, 1};
      },
      [](uint32_t r, Transport& t) {
        if (r != 2) return false;
        FrameKey k;
        k.tensor = tensorKey("bucket.x");
        k.step = 6;
        k.phase = 4;  // docs/peer-protocol.md: a bucket's header
        k.origin = 2;
        const std::vector<uint8_t> header(5, 0x11);
        for (uint32_t dst = 0; dst < 2; ++dst) {
          REQUIRE(
              t.send(dst, FrameType::kData, k, 0, header, Clock::now() + std::chrono::seconds(2))
                  .isOk());
        }
        return true;
      });
  for (uint32_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    REQUIRE_FALSE(failed[r].isOk());
    CHECK_MESSAGE(lightwire::testing::contains(failed[r].message(),
                                               "rank 2's header of bucket 'bucket.x' has 5 bytes, "
                                               "not 20"),
                  failed[r].message());
  }
  CHECK(Clock::now() - t0 < std::chrono::milliseconds(6000));  // the abort, not the deadline
}

TEST_CASE("result checksums: the ranks whose result differs are named on every rank") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const uint64_t sums[3] = {0x1111, 0x1111, 0x2222};
  std::vector<std::future<Result<std::vector<uint32_t>>>> futures;
  for (uint32_t r = 0; r < 3; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      RingExchange ring(*mesh.transports[r], std::chrono::milliseconds(5000));
      return ring.compareResults("t", 100, sums[r]);
    }));
  }
  std::vector<std::vector<uint32_t>> differ;
  for (auto& f : futures) {
    auto d = f.get();
    REQUIRE_MESSAGE(d.isOk(), d.status().message());
    differ.push_back(*d);
  }
  CHECK(differ[0] == std::vector<uint32_t>{2});
  CHECK(differ[1] == std::vector<uint32_t>{2});
  CHECK(differ[2] == std::vector<uint32_t>{0, 1});
  // All equal: nobody differs.
  std::vector<std::future<Result<std::vector<uint32_t>>>> again;
  for (uint32_t r = 0; r < 3; ++r) {
    again.push_back(std::async(std::launch::async, [&, r] {
      RingExchange ring(*mesh.transports[r], std::chrono::milliseconds(5000));
      return ring.compareResults("t", 200, 0x3333);
    }));
  }
  for (auto& f : again) {
    auto d = f.get();
    REQUIRE(d.isOk());
    CHECK(d->empty());
  }
}

TEST_CASE("result checksums: a silent peer fails the comparison within the deadline") {
  Mesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  RingExchange ring(*mesh.transports[0], std::chrono::milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  auto d = ring.compareResults("t", 7, 1);  // rank 1 never answers
  CHECK_FALSE(d.isOk());
  CHECK(d.status().message().find("1") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

// --- policy statistics records -------------------------------------------------------------------

using Bytes = std::vector<uint8_t>;

using testing::statsOf;

/// One step of one rank through every round of its codec.
struct StatsRun {
  bool ok = false;
  std::string error;
  bool dense = false;
  std::vector<size_t> per_chunk;             // round 0: payloads returned per chunk
  std::vector<std::vector<Bytes>> stats_in;  // per round
  std::vector<Bytes> reduced;                // per round: what run() returned, chunk 0
};

/// Runs step `step` of tensor "s" with `cfg` on every rank (threads), every round; rank r gives
/// `stats[r]` as its record in round 0 (none when `stats` is empty). `before(r, transport)` runs
/// on rank r's thread before its exchange.
std::vector<StatsRun> runWithStats(
    Mesh& mesh, const kernels::CodecConfig& cfg, size_t n, size_t chunk, uint64_t step,
    const std::vector<Bytes>& stats, std::function<void(uint32_t, Transport&)> before = {},
    std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const uint32_t w = static_cast<uint32_t>(mesh.transports.size());
  std::vector<std::future<StatsRun>> futures;
  for (uint32_t r = 0; r < w; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      StatsRun run;
      auto made = kernels::createCodec(cfg);
      REQUIRE(made.isOk());
      const kernels::Codec& codec = **made;
      const kernels::Chunking chunking = kernels::chunkingFor(codec, n, chunk);
      kernels::CodecState state(codec.stateFloats(n));
      std::vector<std::byte> ws(codec.workspaceBytes(chunking));
      const auto x = tensorOf(r, n);
      const kernels::ConstTensor input{x.data(), n, kernels::DType::kF32};
      kernels::StepContext ctx;
      ctx.rank = r;
      ctx.step = step;
      REQUIRE(codec.analyze(ctx, chunking, input, state, ws).isOk());
      if (before) before(r, *mesh.transports[r]);
      RingExchange ring(*mesh.transports[r], timeout);
      const std::string name = "s";
      Bytes previous;
      run.ok = true;
      for (int round = 0; round < codec.traits().rounds; ++round) {
        std::vector<Bytes> bufs;
        for (size_t c = 0; c < chunking.count(); ++c) {
          Bytes buf(codec.maxPayloadBytes(chunking.size(c)));
          auto size = codec.encodeChunk(ctx, chunking, c, round, previous, input, state, ws, buf);
          REQUIRE(size.isOk());
          buf.resize(*size);
          bufs.push_back(std::move(buf));
        }
        std::vector<std::span<const uint8_t>> mine(bufs.begin(), bufs.end());
        ExchangeRound er{name, step, round, codec, chunking, mine};
        if (round == 0 && !stats.empty()) er.stats_out = stats[r];
        er.stats_fold = &testing::keepAllFold;
        er.stats_in.push_back({1, 2, 3});  // stale: run() clears it
        auto got = ring.run(er);
        if (!got) {
          run.ok = false;
          run.error = got.status().message();
          CHECK(er.stats_in.empty());
          break;
        }
        if (round == 0) {
          run.dense = er.dense;
          for (const auto& list : *got) run.per_chunk.push_back(list.size());
        }
        // Folded along the ring (one entry) when there were records: every rank's, by rank.
        CHECK(er.stats_folded == !er.stats_in.empty());
        run.stats_in.push_back(er.stats_in.empty() ? std::vector<Bytes>{}
                                                   : testing::keptRecords(er.stats_in.at(0), w));
        run.reduced.emplace_back((*got)[0][0].begin(), (*got)[0][0].end());
        previous = run.reduced.back();
      }
      if (!run.ok) ring.abort(name, step, run.error);
      ring.stepDone(name, step);
      return run;
    }));
  }
  std::vector<StatsRun> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

TEST_CASE("ring statistics records: every rank gets every rank's record, on every path") {
  struct Path {
    const char* what;
    kernels::CodecConfig cfg;
    uint32_t w;
    size_t n, chunk;
  };
  const std::vector<Path> paths = {
      {"summable allreduce", {.name = "fp16"}, 2, 5000, 1024},
      {"summable allreduce", {.name = "none"}, 3, 5000, 1024},
      {"sparse allgather",
       {.name = "topk", .density = 0.1, .error_feedback = false},
       3,
       5000,
       2048},
      {"dense switch", {.name = "topk", .density = 0.6, .error_feedback = false}, 4, 6000, 1000},
      {"multi-round", {.name = "powersgd", .approx_rank = 1}, 3, 4096, 1 << 20},
  };
  for (const auto& path : paths) {
    CAPTURE(path.what);
    CAPTURE(path.cfg.name);
    CAPTURE(path.w);
    Mesh mesh(path.w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    for (const bool with_stats : {true, false}) {
      CAPTURE(with_stats);
      const uint64_t step = with_stats ? 3 : 4;
      std::vector<Bytes> stats;
      if (with_stats) {
        for (uint32_t r = 0; r < path.w; ++r) stats.push_back(statsOf(r, step));
      }
      const auto runs = runWithStats(mesh, path.cfg, path.n, path.chunk, step, stats);
      const int rounds = path.cfg.name == "powersgd" ? 2 : 1;
      for (uint32_t r = 0; r < path.w; ++r) {
        CAPTURE(r);
        const StatsRun& run = runs[r];
        REQUIRE_MESSAGE(run.ok, run.error);
        REQUIRE(run.stats_in.size() == static_cast<size_t>(rounds));
        // The path taken.
        CHECK(run.dense == (std::string(path.what) == "dense switch"));
        for (size_t k : run.per_chunk) {
          CHECK(k == (std::string(path.what) == "sparse allgather" ? path.w : 1u));
        }
        // Round 0: every rank's record, index = rank; later rounds carry none.
        CHECK(run.stats_in[0] == stats);
        for (int round = 1; round < rounds; ++round) CHECK(run.stats_in[round].empty());
        // The data exchange is untouched: the same bytes everywhere.
        CHECK(run.reduced == runs[0].reduced);
      }
    }
  }
}

TEST_CASE("ring statistics: 2(W-1) frames per pass in all, at most two sent per rank") {
  // The same step with and without records on every path: the difference in DATA frames is the
  // statistics' way round the ring (docs/exchange.md "Policy statistics records").
  const std::vector<std::pair<kernels::CodecConfig, size_t>> paths = {
      {{.name = "none"}, 1024},
      {{.name = "topk", .density = 0.1, .error_feedback = false}, 2048},
      {{.name = "powersgd", .approx_rank = 1}, 1 << 20}};
  for (const uint32_t w : {2u, 3u, 5u, 8u}) {  // 5, 8: the fold both ways round
    CAPTURE(w);
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    uint64_t step = 20;
    for (const auto& path : paths) {
      const kernels::CodecConfig& cfg = path.first;
      const size_t chunk = path.second;
      CAPTURE(cfg.name);
      std::vector<std::vector<double>> sent(2, std::vector<double>(w));  // [with stats][rank]
      for (const bool with_stats : {false, true}) {
        std::vector<Bytes> stats;
        for (uint32_t r = 0; with_stats && r < w; ++r) stats.push_back(statsOf(r, step));
        std::vector<double> before(w);
        for (uint32_t r = 0; r < w; ++r) {
          before[r] = metricValue(*mesh.metrics[r], "lightwire_peer_data_frames_sent_total");
        }
        const auto runs = runWithStats(mesh, cfg, 4096, chunk, ++step, stats);
        for (uint32_t r = 0; r < w; ++r) {
          REQUIRE_MESSAGE(runs[r].ok, runs[r].error);
          if (with_stats) CHECK(runs[r].stats_in.at(0) == stats);  // every rank's, by rank
          sent[with_stats][r] =
              metricValue(*mesh.metrics[r], "lightwire_peer_data_frames_sent_total") - before[r];
        }
      }
      double extra = 0;
      for (uint32_t r = 0; r < w; ++r) {
        CAPTURE(r);
        const double mine = sent[1][r] - sent[0][r];
        CHECK(mine >= 1.0);
        CHECK(mine <= 2.0);
        extra += mine;
      }
      CHECK(extra == 2.0 * (w - 1));
    }
  }
}

TEST_CASE("ring: a rank whose deadline passes follows the waits to the silent rank") {
  // Rank 2 of 4 never starts the step. Rank 3 waits on it; rank 0 on rank 3; rank 1 on rank 0.
  // At half the deadline each tells the others on whom it waits, so every error names rank 2.
  const uint32_t w = 4;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  for (const bool with_stats : {true, false}) {
    CAPTURE(with_stats);
    const uint64_t step = with_stats ? 30 : 31;
    std::vector<std::future<std::string>> errors;
    for (uint32_t r : {0u, 1u, 3u}) {
      errors.push_back(std::async(std::launch::async, [&, r] {
        auto made = kernels::createCodec({.name = "none"});
        REQUIRE(made.isOk());
        const kernels::Chunking chunking = kernels::chunkingFor(**made, 4000, 1000);
        std::vector<Bytes> bufs;
        const auto x = tensorOf(r, 4000);
        kernels::CodecState state;
        kernels::StepContext ctx;
        auto p = kernels::encodeTensor(**made, ctx, chunking, kernels::ConstTensor{x.data(), 4000},
                                       state);
        REQUIRE(p.isOk());
        std::vector<std::span<const uint8_t>> mine(p->begin(), p->end());
        RingExchange ring(*mesh.transports[r], std::chrono::milliseconds(1200));
        ExchangeRound er{"s", step, 0, **made, chunking, mine};
        const Bytes record = statsOf(r, step);
        if (with_stats) {
          er.stats_out = record;
          er.stats_fold = &testing::keepAllFold;
        }
        auto got = ring.run(er);
        std::string error = got ? std::string() : got.status().message();
        if (!got) ring.abort("s", step, error);
        ring.stepDone("s", step);
        return error;
      }));
    }
    for (auto& f : errors) {
      const std::string e = f.get();
      CAPTURE(e);
      CHECK(e.find("rank 2") != std::string::npos);
    }
  }
}

/// Rank `bad` sends rank `to` a statistics frame (phase 3; chunk 0: its records, to rank 0; chunk
/// 1: the fold of every rank's) of `bytes` bytes for step `step` through the transport itself (as
/// a hostile or broken peer would), then runs the step without a record.
std::function<void(uint32_t, Transport&)> injectStats(uint32_t bad, uint32_t to, uint32_t chunk,
                                                      uint64_t step, size_t bytes) {
  return [=](uint32_t r, Transport& t) {
    if (r != bad) return;
    FrameKey k;
    k.tensor = tensorKey("s");
    k.step = step;
    k.phase = 3;  // docs/exchange.md: statistics
    k.chunk = chunk;
    k.origin = bad;
    const Bytes body(bytes, 0xAB);
    REQUIRE(
        t.send(to, FrameType::kData, k, 0, body, Clock::now() + std::chrono::seconds(2)).isOk());
  };
}

TEST_CASE("ring statistics: a malformed statistics frame fails the step, naming its sender") {
  uint64_t step = 10;
  struct Case {
    const char* codec;
    size_t bytes;
  };
  // Rank `bad` sends rank `to` a bad frame (records to rank 0, or the fold of all) through its
  // transport and runs the step without a record of its own (so it expects none); every other
  // rank fails with `message` (its own check, or the abort of the rank that made it).
  auto check = [&](uint32_t w, uint32_t bad, uint32_t to, uint32_t chunk,
                   const std::string& message) {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    for (const Case& c : {Case{"none", kMaxStatsBytes + 1}, Case{"none", 0}, Case{"topk", 9}}) {
      const char* codec = c.codec;
      const size_t bytes = c.bytes;
      CAPTURE(codec);
      CAPTURE(bytes);
      ++step;
      const kernels::CodecConfig cfg{.name = codec, .density = 0.1, .error_feedback = false};
      std::vector<Bytes> stats;
      for (uint32_t r = 0; r < w; ++r) stats.push_back(r == bad ? Bytes{} : statsOf(r, step));
      const auto runs =
          runWithStats(mesh, cfg, 3000, 1024, step, stats, injectStats(bad, to, chunk, step, bytes),
                       std::chrono::milliseconds(3000));
      for (uint32_t r = 0; r < w; ++r) {
        if (r == bad) continue;
        CAPTURE(r);
        CHECK_FALSE(runs[r].ok);
        CHECK_MESSAGE(runs[r].error.find(message) != std::string::npos, runs[r].error);
      }
    }
  };
  SUBCASE("records to rank 0") { check(3, 2, 0, 0, "the statistics record of rank 2: "); }
  // W = 4: rank 0 sends the fold to ranks 1 and 3, rank 1 passes it on to rank 2.
  SUBCASE("the fold of every rank's") {
    check(4, 1, 2, 1, "the statistics of every rank from rank 1: ");
  }
}

TEST_CASE("ring statistics records: an oversized record of our own fails the step on every rank") {
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  std::vector<Bytes> stats = {statsOf(0, 1), statsOf(1, 1), Bytes(kMaxStatsBytes + 1, 7)};
  const auto t0 = Clock::now();
  const auto runs = runWithStats(mesh, {.name = "none"}, 3000, 1024, 1, stats, {},
                                 std::chrono::milliseconds(3000));
  for (uint32_t r = 0; r < w; ++r) {
    CAPTURE(r);
    CHECK_FALSE(runs[r].ok);
    CHECK_MESSAGE(runs[r].error.find("statistics record has 65537 bytes, more than 65536") !=
                      std::string::npos,
                  runs[r].error);
  }
  CHECK(Clock::now() - t0 < std::chrono::milliseconds(2500));  // the abort, not the deadline
}

TEST_CASE("ring statistics records: a rank that sends none fails the others at the deadline") {
  // The engine gives every rank a record or none; a job that breaks this rule loses the step.
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const std::vector<Bytes> stats = {statsOf(0, 2), statsOf(1, 2), {}};
  const auto runs = runWithStats(mesh, {.name = "none"}, 3000, 1024, 2, stats, {},
                                 std::chrono::milliseconds(400));
  for (uint32_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK_FALSE(runs[r].ok);
    // Rank 0 waits for rank 2's records, rank 1 for the fold of all from rank 0 (or takes rank
    // 0's abort).
    const bool named =
        runs[r].error.find("waiting for rank 2's statistics record") != std::string::npos;
    CHECK_MESSAGE((named || (r == 1 && runs[r].error.find(
                                           "waiting for the statistics of every rank from rank "
                                           "0") != std::string::npos)),
                  runs[r].error);
  }
}

#ifdef LIGHTWIRE_HAVE_UCX
// --- the ring over the ucx link ------------------------------------------------------------------

/// The ring over ucx and over tcp: every rank's result is bitwise the same, on both transports.
void ringMatchesTcp(const kernels::CodecConfig& config, size_t n, size_t chunk) {
  auto codec = kernels::createCodec(config);
  REQUIRE(codec.isOk());
  UcxMesh ucx(3);
  ucx.startAll();
  REQUIRE(ucx.allConnected());
  const auto over_ucx = exchangeAll(ucx, **codec, n, chunk);

  Mesh tcp(3);
  tcp.startAll();
  REQUIRE(tcp.allConnected());
  const auto over_tcp = exchangeAll(tcp, **codec, n, chunk);

  for (uint32_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    REQUIRE(over_ucx[r].size() == n);
    CHECK(std::memcmp(over_ucx[r].data(), over_ucx[0].data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(over_ucx[r].data(), over_tcp[r].data(), n * sizeof(float)) == 0);
  }
}

TEST_CASE("ucx ring: allreduce of codec none at W=3 is identical on every rank and equals tcp") {
  ringMatchesTcp({.name = "none"}, 100000, 8192);
}

TEST_CASE("ucx ring: allgather of topk at W=3 is identical on every rank and equals tcp") {
  ringMatchesTcp({.name = "topk", .density = 0.1, .error_feedback = false}, 50000, 4096);
}
#endif

}  // namespace
}  // namespace lightwire::proxy::peer
