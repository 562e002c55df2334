// The sparse allreduce (docs/exchange.md "Sparse allreduce") over real TcpTransports on loopback:
// each chunk's owner sums every rank's selection in rank order and keeps the largest sums, its
// share of k by the entries the ranks sent for it (threshold: the sums whose mean reaches τ); the
// results against a plain computation of that rule, bitwise identical on every rank; the state
// settled by the global selection (error feedback and dgc); conservation over many steps; a
// silent rank failing the step on every rank within the deadline.

#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/registry.h"
#include "kernels/select.h"
#include "proxy/peer/collective.h"
#include "tests/kernels/test_util.h"
#include "tests/proxy/peer_mesh.h"

namespace lightwire::proxy::peer {
namespace {

using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)
using SparseInputs = std::function<std::vector<float>(uint32_t rank, uint64_t step)>;

/// What one rank ends a step with.
struct SparseRankStep {
  bool ok = false;
  std::string error;
  std::vector<std::vector<uint8_t>> sent;      // its payload of every chunk
  std::vector<std::vector<uint8_t>> selected;  // every chunk's global selection
  std::vector<float> sums;                     // the selections decoded with weight 1
  std::vector<float> state;                    // its codec state after the step (committed)
};

/// Runs `steps` steps of `codec` through the sparse allreduce on every rank of `mesh` (ranks in
/// `silent` take no part), each rank's state carried from step to step (committed after each
/// successful one). Returns [step][rank].
std::vector<std::vector<SparseRankStep>> runSparse(
    Mesh& mesh, const kernels::Codec& codec, size_t n, size_t chunk, const SparseInputs& inputs,
    uint64_t steps = 1, std::vector<uint32_t> silent = {},
    std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  const uint32_t w = static_cast<uint32_t>(mesh.transports.size());
  const kernels::Chunking chunking = kernels::chunkingFor(codec, n, chunk);
  std::vector<std::future<std::vector<SparseRankStep>>> futures;
  for (uint32_t r = 0; r < w; ++r) {
    if (std::find(silent.begin(), silent.end(), r) != silent.end()) continue;
    futures.push_back(std::async(std::launch::async, [&, r] {
      RingExchange ring(*mesh.transports[r], timeout);
      kernels::CodecState state(codec.stateFloats(n));
      std::vector<SparseRankStep> out;
      for (uint64_t step = 1; step <= steps; ++step) {
        SparseRankStep s;
        const auto x = inputs(r, step);
        kernels::StepContext ctx;
        ctx.rank = r;
        ctx.step = step;
        ctx.defer_sent = true;
        const kernels::ConstTensor input{x.data(), n};
        auto open = kernels::testing::openStep(codec, ctx, chunking, input, state);
        REQUIRE_MESSAGE(open.isOk(), open.status().message());
        s.sent = open->payloads;
        const std::vector<std::span<const uint8_t>> mine = kernels::testing::spans(s.sent);
        const std::string name = "t";
        ExchangeRound round{name, step, 0, codec, chunking, mine};
        round.select_globally = true;
        std::vector<int> calls(chunking.count(), 0);
        round.on_chunk = [&](size_t c, std::span<const std::span<const uint8_t>> list) {
          ++calls.at(c);
          return list.size() == 1 ? Status::ok() : internalError("not one selection");
        };
        auto got = ring.run(round);
        if (!got) {
          s.error = got.status().message();
          s.state.assign(state.currentSpan().begin(), state.currentSpan().end());
          ring.stepDone(name, step);
          out.push_back(std::move(s));
          break;
        }
        // As the step pipeline: each selection decoded (validated) and checked against what was
        // sent; the first error fails the step, which commits nothing. A step that succeeded
        // commits the state with what was sent and the selections.
        s.sums.assign(n, 0.0f);
        REQUIRE(got->size() == chunking.count());
        Status st = Status::ok();
        for (size_t c = 0; c < got->size() && st.isOk(); ++c) {
          REQUIRE(calls[c] == 1);
          REQUIRE((*got)[c].size() == 1);
          const auto sel = (*got)[c][0];
          s.selected.emplace_back(sel.begin(), sel.end());
          st = codec.decodeChunk(sel, 1.0f, s.sums.data() + chunking.begin(c), chunking.size(c));
          if (st.isOk()) st = codec.checkSelection(chunking, c, mine[c], sel);
        }
        ring.stepDone(name, step);
        s.ok = st.isOk();
        s.error = st.message();
        if (s.ok) {
          const Status committed = kernels::testing::commitStep(
              codec, ctx, chunking, input, *open, state, kernels::testing::spans(s.selected));
          REQUIRE_MESSAGE(committed.isOk(), committed.message());
        }
        s.state.assign(state.currentSpan().begin(), state.currentSpan().end());
        out.push_back(std::move(s));
      }
      return out;
    }));
  }
  std::vector<std::vector<SparseRankStep>> by_rank;
  for (auto& f : futures) by_rank.push_back(f.get());
  std::vector<std::vector<SparseRankStep>> by_step;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    for (size_t s = 0; s < by_rank[r].size(); ++s) {
      if (by_step.size() <= s) by_step.resize(s + 1);
      by_step[s].push_back(std::move(by_rank[r][s]));
    }
  }
  return by_step;
}

bool identicalBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// The rule of docs/exchange.md "Sparse allreduce", computed plainly: chunk c's sums of every
/// rank's payload in rank order (weight 1), of which the k_c = ⌊D_c · min(k, ⌊D / W⌋) / D⌋ entries
/// with the largest magnitude keys (ties: lower index; ±0 never) are kept — D_c the entries the
/// ranks sent for the chunk, D for the whole layer; threshold: every sum whose mean reaches τ,
/// |Σ| >= fl32(W·τ) (Codec::globalMinKey).
std::vector<float> sparseReference(const kernels::Codec& codec, const kernels::Chunking& chunking,
                                   const std::vector<SparseRankStep>& ranks) {
  const size_t n = chunking.elements;
  const uint32_t w = static_cast<uint32_t>(ranks.size());
  const uint32_t min_key = codec.globalMinKey(w);
  const uint32_t floor = std::max(min_key, uint32_t{1});
  auto entriesOf = [&](const std::vector<uint8_t>& payload, size_t len) {
    std::vector<uint32_t> idx;
    std::vector<float> val;
    REQUIRE(kernels::readSparseEntries(payload, codec.traits().id, len, idx, val).isOk());
    return idx.size();
  };
  size_t layer_entries = 0;
  for (const SparseRankStep& r : ranks) {
    for (size_t c = 0; c < chunking.count(); ++c)
      layer_entries += entriesOf(r.sent[c], chunking.size(c));
  }
  const size_t cap = std::min(codec.selectionCount(n, std::nullopt), layer_entries / w);
  std::vector<float> out(n, 0.0f);
  for (size_t c = 0; c < chunking.count(); ++c) {
    const size_t begin = chunking.begin(c), len = chunking.size(c);
    std::vector<float> sum(len, 0.0f);
    size_t entries = 0;
    for (const SparseRankStep& r : ranks) {
      REQUIRE(codec.decodeChunk(r.sent[c], 1.0f, sum.data(), len).isOk());
      entries += entriesOf(r.sent[c], len);
    }
    std::vector<size_t> order;
    for (size_t i = 0; i < len; ++i) {
      if (kernels::magnitudeKey(sum[i]) >= floor) order.push_back(i);
    }
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const uint32_t ka = kernels::magnitudeKey(sum[a]), kb = kernels::magnitudeKey(sum[b]);
      return ka != kb ? ka > kb : a < b;
    });
    const size_t k_c = min_key != 0 ? len : layer_entries == 0 ? 0 : entries * cap / layer_entries;
    for (size_t j = 0; j < std::min(k_c, order.size()); ++j) {
      out[begin + order[j]] = sum[order[j]];
    }
  }
  return out;
}

std::vector<float> sparseInput(uint32_t rank, uint64_t step, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = std::sin(0.001f * static_cast<float>(i * (rank + 2)) + static_cast<float>(step)) *
           (1.0f + static_cast<float>((i * 7919 + rank * 104729 + step * 31) % 1000) * 0.002f);
  }
  return v;
}

/// The selection codecs of the sparse allreduce with error feedback (dgc without momentum
/// correction): topk and dgc at `density`, threshold at τ = 1 (about a third of sparseInput's
/// values locally; the global floor W·τ keeps fewer).
std::vector<kernels::CodecConfig> selectionConfigs(double density, double momentum = 0.0) {
  return {{.name = "topk", .density = density},
          {.name = "dgc", .density = density, .momentum = momentum},
          {.name = "threshold", .threshold = 1.0}};
}

/// fn(mesh, w, codec) for every world size of `worlds` (a fresh mesh each) and every selection
/// codec (selectionConfigs) at `density`.
template <typename Fn>
void overMeshesAndCodecs(std::initializer_list<uint32_t> worlds, double density, Fn fn) {
  for (uint32_t w : worlds) {
    CAPTURE(w);
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    for (const auto& config : selectionConfigs(density)) {
      CAPTURE(config.name);
      auto codec = kernels::createCodec(config);
      REQUIRE(codec.isOk());
      fn(mesh, w, **codec);
    }
  }
}

TEST_CASE("sparse allreduce: the global selection of the summed contributions, on every rank") {
  overMeshesAndCodecs(
      {2u, 3u, 5u, 8u}, 0.02, [](Mesh& mesh, uint32_t w, const kernels::Codec& codec) {
        const size_t n = 12000, chunk = 1000;
        const auto steps = runSparse(mesh, codec, n, chunk,
                                     [&](uint32_t r, uint64_t s) { return sparseInput(r, s, n); });
        REQUIRE(steps.size() == 1);
        const auto& ranks = steps[0];
        REQUIRE(ranks.size() == w);
        const kernels::Chunking chunking = kernels::chunkingFor(codec, n, chunk);
        const auto want = sparseReference(codec, chunking, ranks);
        const size_t k = codec.selectionCount(n, std::nullopt);
        size_t nnz = 0;
        for (float v : want) nnz += v != 0.0f;
        CHECK(nnz <= k);
        CHECK(nnz > 0);
        for (uint32_t r = 0; r < w; ++r) {
          CAPTURE(r);
          REQUIRE(ranks[r].ok);
          CHECK(identicalBits(ranks[r].sums, want));
          CHECK(ranks[r].selected == ranks[0].selected);
        }
      });
}

TEST_CASE("sparse allreduce: what a rank sent and the selection dropped stays in its state") {
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const size_t n = 6000, chunk = 2000;
  for (double momentum : {0.0, 0.9}) {
    CAPTURE(momentum);
    // Error feedback (topk, threshold) and dgc's velocity (with and without momentum
    // correction): the first step's accumulation is the input, so an element keeps it unless
    // this rank sent it and the selection kept it; dgc's momentum is cleared exactly there.
    for (const auto& config : selectionConfigs(0.01, momentum)) {
      if (momentum > 0 && config.name != "dgc") continue;
      CAPTURE(config.name);
      auto codec = kernels::createCodec(config);
      REQUIRE(codec.isOk());
      const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, chunk);
      const auto steps = runSparse(mesh, **codec, n, chunk,
                                   [&](uint32_t r, uint64_t s) { return sparseInput(r, s, n); });
      const auto& ranks = steps[0];
      size_t dropped = 0;
      for (uint32_t r = 0; r < w; ++r) {
        CAPTURE(r);
        REQUIRE(ranks[r].ok);
        const auto x = sparseInput(r, 1, n);
        std::vector<char> sent(n, 0), kept(n, 0);
        for (size_t c = 0; c < chunking.count(); ++c) {
          std::vector<uint32_t> idx;
          std::vector<float> val;
          REQUIRE(kernels::readSparseEntries(ranks[r].sent[c], (*codec)->traits().id,
                                             chunking.size(c), idx, val)
                      .isOk());
          for (uint32_t i : idx) sent[chunking.begin(c) + i] = 1;
          REQUIRE(kernels::readSparseEntries(ranks[r].selected[c], (*codec)->traits().id,
                                             chunking.size(c), idx, val)
                      .isOk());
          for (uint32_t i : idx) kept[chunking.begin(c) + i] = 1;
        }
        const float* v = ranks[r].state.data() + (momentum > 0 ? n : 0);  // dgc: u then v
        for (size_t i = 0; i < n; ++i) {
          const bool gone = sent[i] && kept[i];
          dropped += sent[i] && !kept[i];
          REQUIRE(v[i] == (gone ? 0.0f : x[i]));
          if (momentum > 0) REQUIRE(ranks[r].state[i] == (gone ? 0.0f : x[i]));
        }
      }
      CHECK(dropped > 0);  // the ranks' selections differ: some of what was sent was dropped
    }
  }
}

TEST_CASE("sparse allreduce: a selection that keeps everything sent settles as the encode would") {
  // Every rank's large values lie at the same 50 places of every chunk (k = 200 of 4000: exactly
  // the ranks' selections), so each chunk's share — the ranks' mean count, 50 — keeps all that
  // every rank sent: each state equals an encode without deferral.
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const size_t n = 4000, chunk = 1000;
  auto inputs = [&](uint32_t r, uint64_t s) {
    std::vector<float> v = sparseInput(r, s, n);
    for (size_t i = 0; i < n; ++i) v[i] *= i % 20 == 3 ? 1e6f : 1e-3f;
    return v;
  };
  for (double momentum : {0.0, 0.9}) {
    CAPTURE(momentum);
    auto codec = kernels::createCodec({.name = "dgc", .density = 0.05, .momentum = momentum});
    REQUIRE(codec.isOk());
    const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, chunk);
    const auto steps = runSparse(mesh, **codec, n, chunk, inputs, 3);
    REQUIRE(steps.size() == 3);
    for (uint32_t r = 0; r < w; ++r) {
      CAPTURE(r);
      kernels::CodecState plain((*codec)->stateFloats(n));
      for (uint64_t s = 1; s <= 3; ++s) {
        CAPTURE(s);
        const auto x = inputs(r, s);
        kernels::StepContext ctx;
        ctx.rank = r;
        ctx.step = s;
        auto p =
            kernels::stepTensor(**codec, ctx, chunking, kernels::ConstTensor{x.data(), n}, plain);
        REQUIRE(p.isOk());
        const auto& ranks = steps[s - 1];
        REQUIRE(ranks.size() == w);
        CHECK(*p == ranks[r].sent);
        const std::vector<float> want(plain.currentSpan().begin(), plain.currentSpan().end());
        CHECK(identicalBits(ranks[r].state, want));
      }
    }
  }
}

TEST_CASE("sparse allreduce: ties, empty chunks, one owner's region, non-finite sums") {
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  auto codec = kernels::createCodec({.name = "topk", .density = 0.01, .error_feedback = false});
  REQUIRE(codec.isOk());
  const size_t n = 3000, chunk = 1000;
  const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, chunk);
  SUBCASE("ties break by the lower index") {
    // Every rank has the same magnitude everywhere in chunk 1: its 10 lowest indices win.
    const auto steps = runSparse(mesh, **codec, n, chunk, [&](uint32_t r, uint64_t) {
      std::vector<float> v(n, 0.0f);
      for (size_t i = 1000; i < 2000; ++i) v[i] = (i + r) % 2 ? 1.0f : -1.0f;
      return v;
    });
    const auto want = sparseReference(**codec, chunking, steps[0]);
    for (const auto& r : steps[0]) CHECK(identicalBits(r.sums, want));
  }
  SUBCASE("every selected index in one owner's region; the other chunks are empty") {
    const auto steps = runSparse(mesh, **codec, n, chunk, [&](uint32_t r, uint64_t) {
      std::vector<float> v(n, 0.0f);
      for (size_t i = 2000; i < 3000; ++i) v[i] = static_cast<float>(i % 37 + r);
      return v;
    });
    const auto want = sparseReference(**codec, chunking, steps[0]);
    for (const auto& r : steps[0]) {
      CHECK(identicalBits(r.sums, want));
      for (size_t i = 0; i < 2000; ++i) REQUIRE(r.sums[i] == 0.0f);
      size_t nnz = 0;
      for (size_t i = 2000; i < 3000; ++i) nnz += r.sums[i] != 0.0f;
      // Every rank sent all of its k = 30 there: the ranks' mean count, 30 (a share by the
      // region's length would have kept 10).
      CHECK(nnz == 30);
    }
  }
  SUBCASE("a non-finite sum is selected: every rank's result carries it") {
    const auto steps = runSparse(mesh, **codec, n, chunk, [&](uint32_t r, uint64_t) {
      std::vector<float> v = sparseInput(r, 1, n);
      if (r == 2) v[1500] = std::numeric_limits<float>::infinity();
      return v;
    });
    for (const auto& r : steps[0]) {
      REQUIRE(r.ok);
      CHECK(std::isinf(r.sums[1500]));
    }
  }
}

TEST_CASE("sparse allreduce: conservation of error feedback over many steps") {
  // Over S steps: the sum of the results' sums plus every rank's final residual is the sum of
  // every rank's inputs (fp32 rounding aside: relative 1e-5 of the total magnitude).
  overMeshesAndCodecs({2u, 5u}, 0.03, [](Mesh& mesh, uint32_t w, const kernels::Codec& codec) {
    const size_t n = 5000, chunk = 1000;
    const uint64_t s_count = 20;
    const auto steps = runSparse(
        mesh, codec, n, chunk, [&](uint32_t r, uint64_t s) { return sparseInput(r, s, n); },
        s_count);
    REQUIRE(steps.size() == s_count);
    std::vector<double> inputs(n, 0.0), outputs(n, 0.0);
    double scale = 0.0;
    for (uint64_t s = 1; s <= s_count; ++s) {
      for (uint32_t r = 0; r < w; ++r) {
        const auto x = sparseInput(r, s, n);
        for (size_t i = 0; i < n; ++i) {
          inputs[i] += x[i];
          scale += std::fabs(x[i]);
        }
      }
      for (size_t i = 0; i < n; ++i) outputs[i] += steps[s - 1][0].sums[i];
    }
    for (uint32_t r = 0; r < w; ++r) {
      for (size_t i = 0; i < n; ++i) outputs[i] += steps[s_count - 1][r].state[i];
    }
    double err = 0.0;
    for (size_t i = 0; i < n; ++i) err += std::fabs(inputs[i] - outputs[i]);
    CHECK(err <= 1e-5 * scale);
  });
}

TEST_CASE("sparse allreduce: a silent rank fails the step on every other rank, state unchanged") {
  const uint32_t w = 3;
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  auto codec = kernels::createCodec({.name = "dgc", .density = 0.05, .momentum = 0.9});
  REQUIRE(codec.isOk());
  const size_t n = 3000, chunk = 1000;
  const auto t0 = std::chrono::steady_clock::now();
  const auto steps = runSparse(
      mesh, **codec, n, chunk, [&](uint32_t r, uint64_t s) { return sparseInput(r, s, n); }, 1, {2},
      std::chrono::milliseconds(400));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  REQUIRE(steps.size() == 1);
  REQUIRE(steps[0].size() == 2);
  for (const auto& r : steps[0]) {
    CHECK_FALSE(r.ok);
    CHECK_MESSAGE(r.error.find("2") != std::string::npos, r.error);
    for (float v : r.state) REQUIRE(v == 0.0f);  // nothing committed
  }
}

}  // namespace
}  // namespace lightwire::proxy::peer

namespace lightwire::proxy::peer {
namespace {

/// Sends `payload` from `t` (rank `origin` of a test mesh) to `dst` as frame (tensor "t", step 1,
/// round 0, `phase`, `chunk`, origin).
void sendAs(Transport& t, uint32_t origin, uint32_t dst, uint8_t phase, uint32_t chunk,
            const std::vector<uint8_t>& payload, uint8_t codec_id) {
  FrameKey k;
  k.tensor = tensorKey("t");
  k.step = 1;
  k.phase = phase;
  k.chunk = chunk;
  k.origin = origin;
  REQUIRE(t.send(dst, FrameType::kData, k, codec_id, payload,
                 std::chrono::steady_clock::now() + std::chrono::seconds(2))
              .isOk());
}

void sendAsRank2(Transport& t, uint32_t dst, uint8_t phase, uint32_t chunk,
                 const std::vector<uint8_t>& payload, uint8_t codec_id) {
  sendAs(t, 2, dst, phase, chunk, payload, codec_id);
}

/// A contribution frame's body to a layer of one chunk (docs/exchange.md "Sparse allreduce"): the
/// sender's entries of the layer (u64, little-endian), then its payload of the chunk.
std::vector<uint8_t> contribution(uint64_t entries, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> body(8 + payload.size());
  kernels::storeU64(body.data(), entries);
  std::copy(payload.begin(), payload.end(), body.begin() + 8);
  return body;
}

/// A count frame's body (a layer of several chunks): the sender's entries of the layer.
std::vector<uint8_t> countOf(uint64_t entries) {
  std::vector<uint8_t> body(8);
  kernels::storeU64(body.data(), entries);
  return body;
}

TEST_CASE("balanceOwners: largest weight first, each to the least loaded rank") {
  // Loads after each: u0 (10) → r0 11; u4 (8) → r1 9; u1, u2, u3 (1 each) → r2 2, 4, 6; u5 (0) →
  // r2 7.
  const std::vector<uint64_t> w = {10, 1, 1, 1, 8, 0};
  CHECK(balanceOwners(w, 3) == std::vector<uint32_t>{0, 2, 2, 2, 1, 2});
  CHECK(balanceOwners(w, 1) == std::vector<uint32_t>(6, 0));
  CHECK(balanceOwners({}, 4).empty());
  // Empty regions spread too (each counts 1): round robin.
  CHECK(balanceOwners(std::vector<uint64_t>(5, 0), 2) == std::vector<uint32_t>{0, 1, 0, 1, 0});
}

/// One rank's step of a bucket of layers through RingExchange::runAll.
struct BucketRankStep {
  bool ok = false;
  std::string error;
  std::vector<SparseRankStep> layers;  // per layer: sent, selected, sums
  std::vector<uint32_t> owners;        // the pass's owner of every region
  bool balanced = false;
};

/// `steps` steps of a bucket of one-chunk-or-more layers (`names`, sizes[l] elements each) of
/// `codec` through the sparse allreduce, as the step pipeline runs them. The ranks in `fresh` start
/// a new RingExchange before step `fresh_step` (a restarted sidecar: no memory of the earlier
/// passes). Returns [step][rank].
std::vector<std::vector<BucketRankStep>> runSparseBucket(Mesh& mesh, const kernels::Codec& codec,
                                                         const std::vector<std::string>& names,
                                                         const std::vector<size_t>& sizes,
                                                         size_t chunk, uint64_t steps,
                                                         std::vector<uint32_t> fresh = {},
                                                         uint64_t fresh_step = 0) {
  const uint32_t w = static_cast<uint32_t>(mesh.transports.size());
  std::vector<kernels::Chunking> chunkings;
  for (size_t n : sizes) chunkings.push_back(kernels::chunkingFor(codec, n, chunk));
  std::vector<std::future<std::vector<BucketRankStep>>> futures;
  for (uint32_t r = 0; r < w; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      auto ring = std::make_unique<RingExchange>(*mesh.transports[r], std::chrono::seconds(5));
      std::vector<kernels::CodecState> states;
      for (size_t l = 0; l < names.size(); ++l) states.emplace_back(codec.stateFloats(sizes[l]));
      const BucketTag tag{"bucket.0", 0x51d3c0ffee000001ull, static_cast<uint32_t>(names.size())};
      std::vector<BucketRankStep> out;
      for (uint64_t step = 1; step <= steps; ++step) {
        if (step == fresh_step && std::find(fresh.begin(), fresh.end(), r) != fresh.end()) {
          ring = std::make_unique<RingExchange>(*mesh.transports[r], std::chrono::seconds(5));
        }
        BucketRankStep s;
        s.layers.resize(names.size());
        std::vector<std::vector<std::span<const uint8_t>>> mine(names.size());
        std::deque<ExchangeRound> rounds;
        std::vector<ExchangeRound*> all;
        kernels::StepContext ctx;
        ctx.rank = r;
        ctx.step = step;
        ctx.defer_sent = true;
        std::vector<std::vector<float>> inputs(names.size());  // kept until the commit
        std::vector<kernels::testing::OpenStep> open(names.size());
        for (size_t l = 0; l < names.size(); ++l) {
          const size_t n = sizes[l];
          const kernels::Chunking& chunking = chunkings[l];
          inputs[l] = sparseInput(r + static_cast<uint32_t>(l) * 7, step, n);
          auto opened = kernels::testing::openStep(
              codec, ctx, chunking, kernels::ConstTensor{inputs[l].data(), n}, states[l]);
          REQUIRE(opened.isOk());
          open[l] = std::move(*opened);
          s.layers[l].sent = open[l].payloads;
          mine[l].assign(s.layers[l].sent.begin(), s.layers[l].sent.end());
          ExchangeRound& round =
              rounds.emplace_back(ExchangeRound{names[l], step, 0, codec, chunking, mine[l]});
          round.select_globally = true;
          all.push_back(&round);
        }
        auto got = ring->runAll(all, &tag);
        s.owners = ring->sparseOwners();
        s.balanced = ring->sparseOwnersBalanced();
        s.ok = got.isOk();
        if (!got) s.error = got.status().message();
        for (size_t l = 0; l < names.size() && s.ok; ++l) {
          const kernels::Chunking& chunking = chunkings[l];
          auto& layer = s.layers[l];
          layer.sums.assign(sizes[l], 0.0f);
          for (size_t c = 0; c < chunking.count(); ++c) {
            REQUIRE((*got)[l][c].size() == 1);
            const auto sel = (*got)[l][c][0];
            layer.selected.emplace_back(sel.begin(), sel.end());
            REQUIRE(
                codec
                    .decodeChunk(sel, 1.0f, layer.sums.data() + chunking.begin(c), chunking.size(c))
                    .isOk());
            REQUIRE(codec.checkSelection(chunking, c, mine[l][c], sel).isOk());
          }
          REQUIRE(kernels::testing::commitStep(
                      codec, ctx, chunking, kernels::ConstTensor{inputs[l].data(), sizes[l]},
                      open[l], states[l], kernels::testing::spans(layer.selected))
                      .isOk());
        }
        for (const auto& name : names) ring->stepDone(name, step);
        out.push_back(std::move(s));
      }
      return out;
    }));
  }
  std::vector<std::vector<BucketRankStep>> by_step(steps);
  for (auto& f : futures) {
    auto ranks = f.get();
    for (uint64_t s = 0; s < steps; ++s) by_step[s].push_back(std::move(ranks[s]));
  }
  return by_step;
}

TEST_CASE(
    "sparse allreduce: a bucket's regions balanced over the owners by its previous selections, "
    "the same results") {
  const uint32_t w = 3;
  const size_t chunk = 1000;
  // Six layers whose keys are ≡ 0 mod 3: by rank (c + h) mod W every layer's first region falls
  // to rank 0.
  std::vector<std::string> names;
  for (int i = 0; names.size() < 6; ++i) {
    const std::string name = "layers." + std::to_string(i) + ".weight";
    if (tensorKey(name) % w == 0) names.push_back(name);
  }
  // Layers of one region each; or some of three, whose chunks go out as they are compressed,
  // after the layers of one region before them (docs/exchange.md "Which rank owns a region").
  std::vector<size_t> sizes(names.size(), 1000);
  SUBCASE("layers of one region") {}
  SUBCASE("layers of one and of three regions") { sizes[1] = sizes[4] = 3000; }
  CAPTURE(sizes[1]);
  auto codec = kernels::createCodec({.name = "topk", .density = 0.05});
  REQUIRE(codec.isOk());
  std::vector<kernels::Chunking> chunkings;
  std::vector<uint32_t> rule;  // rank (c + h) mod W of every region
  for (size_t l = 0; l < names.size(); ++l) {
    chunkings.push_back(kernels::chunkingFor(**codec, sizes[l], chunk));
    REQUIRE(chunkings[l].count() == sizes[l] / chunk);
    for (size_t c = 0; c < chunkings[l].count(); ++c) rule.push_back(c % w);
  }
  Mesh mesh(w);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  // Rank 1 restarts (a fresh exchange, no weights) before step 4.
  const auto steps = runSparseBucket(mesh, **codec, names, sizes, chunk, 5, {1}, 4);
  for (size_t s = 0; s < steps.size(); ++s) {
    CAPTURE(s + 1);
    const auto& ranks = steps[s];
    for (const auto& r : ranks) REQUIRE_MESSAGE(r.ok, r.error);
    // The pass's owners: the same on every rank; balanced from step 2 on, except the step the
    // restarted rank had no weights for (every rank then takes rank (c + h) mod W).
    const bool expect_balanced = s + 1 >= 2 && s + 1 != 4;
    for (const auto& r : ranks) {
      CHECK(r.balanced == expect_balanced);
      CHECK(r.owners == ranks[0].owners);
    }
    if (!expect_balanced) {
      CHECK(ranks[0].owners == rule);
    } else {
      // Balanced by the previous step's selections: each region's entries, largest first.
      std::vector<uint64_t> weights;
      for (size_t l = 0; l < names.size(); ++l) {
        const auto& layer = steps[s - 1][0].layers[l];
        for (size_t c = 0; c < chunkings[l].count(); ++c) {
          auto count = kernels::sparseEntryCount(layer.selected[c], (*codec)->traits().id,
                                                 chunkings[l].size(c));
          REQUIRE(count.isOk());
          weights.push_back(*count);
        }
      }
      CHECK(ranks[0].owners == balanceOwners(weights, w));
      if (rule.size() == names.size()) {
        std::vector<uint64_t> load(w, 0);
        for (uint32_t o : ranks[0].owners) ++load[o];
        CHECK(load == std::vector<uint64_t>(w, 2));
      }
      std::vector<uint64_t> moved(w, 0);
      for (size_t u = 0; u < weights.size(); ++u) moved[ranks[0].owners[u]] += weights[u];
      const uint64_t total = std::accumulate(weights.begin(), weights.end(), uint64_t{0});
      // Within one region's entries of the mean.
      CHECK(*std::max_element(moved.begin(), moved.end()) <=
            total / w + *std::max_element(weights.begin(), weights.end()));
    }
    // Whoever owns a region, the result is the rule's, bitwise, on every rank.
    for (size_t l = 0; l < names.size(); ++l) {
      CAPTURE(names[l]);
      std::vector<SparseRankStep> layer;
      for (const auto& r : ranks) layer.push_back(r.layers[l]);
      const auto want = sparseReference(**codec, chunkings[l], layer);
      for (const auto& r : ranks) CHECK(identicalBits(r.layers[l].sums, want));
    }
  }
}

TEST_CASE(
    "sparse allreduce: a peer's malformed contribution or selection fails the step on every "
    "rank, naming it, nothing committed") {
  // Rank 2 speaks the protocol wrongly and runs nothing else; ranks 0 and 1 fail step 1 before
  // their deadline (the abort of the rank that found it) and keep their state.
  const uint32_t w = 3;
  const size_t n = 3000, chunk = 1000;
  // Chunk c of tensor "t" belongs to rank (c + its key) mod 3 (docs/exchange.md): the chunk of
  // each rank.
  const uint32_t shift = static_cast<uint32_t>(tensorKey("t") % w);
  auto chunkOf = [&](uint32_t rank) { return (rank + w - shift) % w; };
  auto codec = kernels::createCodec({.name = "topk", .density = 0.05});
  REQUIRE(codec.isOk());
  const uint8_t id = static_cast<uint8_t>((*codec)->traits().id);
  const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, chunk);
  // Step 1 of a layer of `layer` elements on every rank but `silent` (which runs none): all fail
  // before their deadline, with `message`, and keep their state.
  auto failsWithout = [&](Mesh& mesh, uint32_t silent, size_t layer, const std::string& message) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto steps = runSparse(
        mesh, **codec, layer, chunk,
        [&](uint32_t r, uint64_t s) { return sparseInput(r, s, layer); }, 1, {silent},
        std::chrono::milliseconds(4000));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(3500));
    REQUIRE(steps.at(0).size() == w - 1);
    for (const auto& r : steps.at(0)) {
      CHECK_FALSE(r.ok);
      CHECK_MESSAGE(r.error.find(message) != std::string::npos, r.error);
      for (float v : r.state) REQUIRE(v == 0.0f);
    }
  };
  auto failsOnRanks01 = [&](Mesh& mesh, const std::string& message) {
    failsWithout(mesh, 2, n, message);
  };
  // Rank 2's real payloads of step 1 (what it would send).
  const auto x = sparseInput(2, 1, n);
  kernels::CodecState state((*codec)->stateFloats(n));
  kernels::StepContext ctx;
  ctx.rank = 2;
  ctx.step = 1;
  ctx.defer_sent = true;
  auto p = kernels::encodeTensor(**codec, ctx, chunking, kernels::ConstTensor{x.data(), n}, state);
  REQUIRE(p.isOk());
  const std::vector<uint8_t>& real0 = (*p)[chunkOf(0)];
  const uint64_t k = (*codec)->selectionCount(n, std::nullopt);  // topk: its entries of the layer
  // The layer has three chunks: rank 2 sends each chunk's payload, and its count of the layer's
  // entries in a frame of its own (phase 7) to each owner.
  SUBCASE("a contribution that does not decode") {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    sendAsRank2(*mesh.transports[2], 0, 7, 0, countOf(k), 0);
    sendAsRank2(*mesh.transports[2], 0, 5, chunkOf(0), std::vector<uint8_t>(40, 0x5A), id);
    failsOnRanks01(mesh, "chunk " + std::to_string(chunkOf(0)) + " of 't': payload of rank 2");
  }
  SUBCASE("a count frame of another size") {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    sendAsRank2(*mesh.transports[2], 0, 7, 0, std::vector<uint8_t>(5, 0), 0);
    sendAsRank2(*mesh.transports[2], 0, 5, chunkOf(0), real0, id);
    failsOnRanks01(mesh, "rank 2's count of entries of 't' is 5 bytes, not 8");
  }
  SUBCASE("a count declaring more entries than the layer has elements") {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    sendAsRank2(*mesh.transports[2], 0, 7, 0, countOf(~uint64_t{0}), 0);
    sendAsRank2(*mesh.transports[2], 0, 5, chunkOf(0), real0, id);
    failsOnRanks01(mesh, "declares 18446744073709551615 entries for a layer of 3000 elements");
  }
  SUBCASE("a contribution holding more entries than its rank declared for the layer") {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    sendAsRank2(*mesh.transports[2], 0, 7, 0, countOf(1), 0);
    sendAsRank2(*mesh.transports[2], 0, 5, chunkOf(0), real0, id);
    failsOnRanks01(mesh, "payload of rank 2 holds");
  }
  // A layer of one chunk: the count in the contribution's first 8 bytes. Its chunk belongs to
  // rank `shift`; another rank speaks wrongly.
  const uint32_t bad = (shift + 1) % w;
  const std::string named = "rank " + std::to_string(bad) + "'s contribution to chunk 0 of 't' ";
  SUBCASE("a layer of one chunk: a contribution shorter than its count of entries") {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    sendAs(*mesh.transports[bad], bad, shift, 5, 0, std::vector<uint8_t>(5, 0), id);
    failsWithout(mesh, bad, chunk, named + "is 5 bytes, shorter than its 8-byte count");
  }
  SUBCASE("a layer of one chunk: a contribution declaring more entries than it has elements") {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    sendAs(*mesh.transports[bad], bad, shift, 5, 0, contribution(chunk + 1, real0), id);
    failsWithout(mesh, bad, chunk, named + "declares 1001 entries for a layer of 1000 elements");
  }
  SUBCASE("a selection that does not decode (of another chunk size)") {
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    // Rank 2's real contributions (and counts) to owners 0 and 1; as the owner of its chunk, a
    // selection of 1008 elements (the chunk has 1000), one entry beyond the chunk.
    for (uint32_t dst = 0; dst < 2; ++dst)
      sendAsRank2(*mesh.transports[2], dst, 7, 0, countOf(k), 0);
    sendAsRank2(*mesh.transports[2], 0, 5, chunkOf(0), real0, id);
    sendAsRank2(*mesh.transports[2], 1, 5, chunkOf(1), (*p)[chunkOf(1)], id);
    std::vector<float> bad(chunk + 8, 0.0f);
    bad[chunk + 3] = 1.0f;
    std::vector<uint8_t> sel(kernels::sparseMaxPayloadBytes(chunk + 8, kernels::DType::kF32));
    std::vector<uint64_t> scratch;
    auto size = kernels::writeGlobalSelection((*codec)->traits().id, bad, 1, 0, scratch, sel);
    REQUIRE(size.isOk());
    sel.resize(*size);
    // The header says chunk + 8 elements: the decoder of a 1000-element chunk refuses it.
    for (uint32_t dst = 0; dst < 2; ++dst) {
      sendAsRank2(*mesh.transports[2], dst, 6, chunkOf(2), sel, id);
    }
    failsOnRanks01(mesh, "holds 1008 elements");
  }
}

}  // namespace
}  // namespace lightwire::proxy::peer
