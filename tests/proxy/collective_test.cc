// The ring collectives (proxy/peer/collective.h) over real TcpTransports on loopback: results
// against a plain computation of docs/exchange.md, bitwise identical on every rank; the
// result-checksum guard.

#include <doctest.h>

#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "kernels/codec.h"
#include "kernels/registry.h"
#include "proxy/peer/collective.h"
#include "tests/proxy/peer_mesh.h"

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

/// Runs one exchange round of `codec` on every rank (threads) and returns each rank's decoded
/// result with weight 1/W.
std::vector<std::vector<float>> exchangeAll(Mesh& mesh, const kernels::Codec& codec, size_t n,
                                            size_t chunk) {
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
      // Every chunk is announced final exactly once, with the payloads run() then returns.
      std::vector<std::vector<std::span<const uint8_t>>> announced(chunking.count());
      std::vector<int> calls(chunking.count(), 0);
      round.on_chunk = [&](size_t c, std::span<const std::span<const uint8_t>> list) {
        ++calls.at(c);
        announced.at(c).assign(list.begin(), list.end());
        return Status::ok();
      };
      auto got = ring.run(round);
      REQUIRE_MESSAGE(got.isOk(), got.status().message());
      for (size_t c = 0; c < got->size(); ++c) {
        REQUIRE(calls[c] == 1);
        REQUIRE(announced[c].size() == (*got)[c].size());
        for (size_t k = 0; k < announced[c].size(); ++k) {
          REQUIRE(announced[c][k].data() == (*got)[c][k].data());
          REQUIRE(announced[c][k].size() == (*got)[c][k].size());
        }
      }
      auto none = kernels::createCodec({.name = "none"});
      const kernels::Codec& decoder = round.dense ? **none : codec;
      std::vector<float> out(n, 0.0f);
      for (size_t c = 0; c < got->size(); ++c) {
        for (auto p : (*got)[c]) {
          REQUIRE(decoder
                      .decodeChunk(p, 1.0f / static_cast<float>(w), out.data() + chunking.begin(c),
                                   chunking.size(c))
                      .isOk());
        }
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
    const auto results = exchangeAll(mesh, **codec, n, chunk);
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

}  // namespace
}  // namespace lightwire::proxy::peer
