// The `ps` topology (proxy/peer/ps_exchange.h, docs/exchange.md) over real TcpTransports on
// loopback: every rank receives the same bytes, equal to a plain computation of the server's
// combination (rank-order compressed-domain sum, or decode -> dense sum -> re-encode with a server
// codec of its own); failures within the deadline naming the rank; result checksums through the
// server; bounded staleness (steps closed without a rank within the bound, its late contributions
// folded into the next aggregate, a rank beyond the bound waited for); the policy statistics
// records (those of the step's contributors, the same on every rank).

#include <doctest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <thread>
#include <vector>

#include "kernels/codec.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "proxy/peer/collective.h"
#include "proxy/peer/ps_exchange.h"
#include "proxy/step/engine.h"
#include "tests/proxy/peer_mesh.h"

namespace lightwire::proxy::peer {
namespace {

using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)
using Bytes = std::vector<uint8_t>;
using Chunks = std::vector<Bytes>;

constexpr uint32_t kSeed = 0x5eed;

std::vector<float> tensorOf(uint32_t rank, uint64_t step, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t h = static_cast<uint32_t>((i * 2654435761u) ^ (rank * 40503u + step * 977u));
    v[i] = static_cast<float>(static_cast<int>(h % 2001) - 1000) * 0.001f +
           static_cast<float>(rank) * 0.25f - static_cast<float>(step % 3) * 0.1f;
  }
  return v;
}

/// One step of one rank, as the step engine would run it.
struct StepRecord {
  bool ok = false;
  std::string error;
  std::vector<Chunks> sent, got;  // per round: the payload of every chunk
  uint32_t contributors = 0;
  std::vector<Bytes> stats_in;  // round 0's
  std::vector<float> result;
  std::chrono::milliseconds took{0};
};

struct RankPlan {
  kernels::CodecConfig cfg;
  std::string name;
  size_t n = 3000, chunk = 1024;
  std::vector<uint64_t> steps;
  std::function<void(uint64_t)> before;  // called before the step is compressed and pushed
  std::function<void(uint64_t, const StepRecord&)> after;
  std::function<Bytes(uint64_t)> stats;  // this rank's statistics record of a step (empty = none)
};

using testing::statsOf;

/// Runs `plans` in order on rank `rank` through `ps` (one engine thread): compress (the state
/// read), exchange every round, decode with weight 1/contributors, commit, stepDone.
std::vector<std::map<uint64_t, StepRecord>> runRank(PsExchange& ps, uint32_t rank,
                                                    const std::vector<RankPlan>& plans) {
  std::vector<std::map<uint64_t, StepRecord>> out(plans.size());
  for (size_t p = 0; p < plans.size(); ++p) {
    const RankPlan& plan = plans[p];
    auto made = kernels::createCodec(plan.cfg);
    REQUIRE(made.isOk());
    const kernels::Codec& codec = **made;
    const size_t n = plan.n;
    kernels::CodecState state(codec.stateFloats(n));
    const kernels::Chunking chunking = kernels::chunkingFor(codec, n, plan.chunk);
    std::vector<std::byte> ws(codec.workspaceBytes(chunking));
    for (uint64_t step : plan.steps) {
      if (plan.before) plan.before(step);
      const auto t0 = Clock::now();
      StepRecord rec;
      const auto x = tensorOf(rank, step, n);
      const kernels::ConstTensor input{x.data(), n, kernels::DType::kF32};
      kernels::StepContext ctx;
      ctx.seed = kSeed;
      ctx.name_key = kernels::tensorNameKey(plan.name);
      ctx.step = step;
      ctx.rank = rank;
      REQUIRE(codec.analyze(ctx, chunking, input, state, ws).isOk());
      const int rounds = codec.traits().rounds;
      std::vector<std::span<const uint8_t>> round_payloads;
      std::vector<std::vector<std::span<const uint8_t>>> reduced;
      std::vector<Chunks> bufs(static_cast<size_t>(rounds));
      const Bytes record = plan.stats ? plan.stats(step) : Bytes{};
      bool failed = false;
      for (int r = 0; r < rounds && !failed; ++r) {
        std::vector<std::span<const uint8_t>> mine;
        for (size_t c = 0; c < chunking.count(); ++c) {
          Bytes buf(codec.maxPayloadBytes(chunking.size(c)));
          std::span<const uint8_t> previous;
          if (r > 0) previous = round_payloads.back();
          auto size = codec.encodeChunk(ctx, chunking, c, r, previous, input, state, ws, buf);
          REQUIRE(size.isOk());
          buf.resize(*size);
          bufs[static_cast<size_t>(r)].push_back(std::move(buf));
        }
        for (const auto& b : bufs[static_cast<size_t>(r)]) mine.emplace_back(b);
        rec.sent.push_back(bufs[static_cast<size_t>(r)]);
        ExchangeRound er{plan.name, step, r, codec, chunking, mine};
        if (r == 0) er.stats_out = record;
        er.stats_in.push_back({1, 2, 3});  // stale: run() clears it
        auto got = ps.run(er);
        if (!got) {
          rec.error = got.status().message();
          CHECK(er.stats_in.empty());
          failed = true;
          break;
        }
        rec.contributors = er.contributors;
        if (r == 0) {
          rec.stats_in = er.stats_in;
        } else {
          CHECK(er.stats_in.empty());  // records travel in round 0 only
        }
        Chunks g;
        for (const auto& per_chunk : *got) {
          REQUIRE(per_chunk.size() == 1);
          g.emplace_back(per_chunk[0].begin(), per_chunk[0].end());
        }
        rec.got.push_back(std::move(g));
        if (rounds > 1) {
          round_payloads.push_back((*got)[0][0]);
        } else {
          reduced = std::move(*got);
        }
      }
      if (!failed) {
        const float weight = 1.0f / static_cast<float>(rec.contributors);
        rec.result.assign(n, 0.0f);
        if (rounds > 1) {
          REQUIRE(codec.decodeRounds(round_payloads, weight, rec.result.data(), n).isOk());
          REQUIRE(codec.finishStep(ctx, chunking, round_payloads, weight, input, state, ws).isOk());
        } else {
          for (size_t c = 0; c < chunking.count(); ++c) {
            REQUIRE(codec
                        .decodeChunk(reduced[c][0], weight, rec.result.data() + chunking.begin(c),
                                     chunking.size(c))
                        .isOk());
          }
        }
        // Committed from this rank's round-0 payloads (multi-round codecs do not read them).
        const std::vector<std::span<const uint8_t>> sent(bufs[0].begin(), bufs[0].end());
        REQUIRE(codec.commitState(ctx, chunking, input, sent, {}, state, ws).isOk());
        rec.ok = true;
      } else {
        ps.abort(plan.name, step, rec.error);
      }
      ps.stepDone(plan.name, step);
      rec.took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
      if (plan.after) plan.after(step, rec);
      out[p][step] = std::move(rec);
    }
  }
  return out;
}

/// Runs every rank's plans on its own thread; result[rank][plan][step].
std::vector<std::vector<std::map<uint64_t, StepRecord>>> runAll(
    Mesh& mesh, PsOptions options, std::chrono::milliseconds timeout,
    const std::vector<std::vector<RankPlan>>& plans,
    std::vector<std::chrono::milliseconds> timeouts = {}) {
  const uint32_t w = static_cast<uint32_t>(mesh.transports.size());
  std::vector<std::future<std::vector<std::map<uint64_t, StepRecord>>>> futures;
  for (uint32_t r = 0; r < w; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      PsExchange ps(*mesh.transports[r], timeouts.empty() ? timeout : timeouts[r], options);
      return runRank(ps, r, plans[r]);
    }));
  }
  std::vector<std::vector<std::map<uint64_t, StepRecord>>> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

/// The compressed-domain left fold ((p0 + p1) + p2) + ... of one chunk.
Bytes foldSum(const kernels::Codec& codec, size_t chunk_elements,
              const std::vector<const Bytes*>& parts) {
  Bytes acc = *parts[0];
  for (size_t k = 1; k < parts.size(); ++k) {
    Bytes sum(codec.maxPayloadBytes(chunk_elements));
    auto size = codec.addPayloads(acc, *parts[k], sum);
    REQUIRE(size.isOk());
    sum.resize(*size);
    acc = std::move(sum);
  }
  return acc;
}

/// The server's re-compression, as docs/exchange.md describes it: its own codec (momentum 0, no
/// clipping) and state, Philox stream W.
struct ServerRef {
  ServerRef(kernels::CodecConfig cfg, size_t n, size_t chunk, std::string name_, uint32_t w_)
      : name(std::move(name_)), w(w_) {
    cfg.momentum = 0.0;
    cfg.clip_norm = 0.0;
    auto made = kernels::createCodec(cfg);
    REQUIRE(made.isOk());
    codec = std::move(*made);
    state = kernels::CodecState(codec->stateFloats(n));
    chunking = kernels::chunkingFor(*codec, n, chunk);
  }
  /// contributions: each a payload per chunk, in the order they are summed.
  Chunks combine(const std::vector<const Chunks*>& contributions, uint64_t step) {
    const size_t n = chunking.elements;
    std::vector<float> sum(n, 0.0f);
    for (const Chunks* p : contributions) {
      for (size_t c = 0; c < chunking.count(); ++c) {
        REQUIRE(codec->decodeChunk((*p)[c], 1.0f, sum.data() + chunking.begin(c), chunking.size(c))
                    .isOk());
      }
    }
    kernels::StepContext ctx;
    ctx.seed = kSeed;
    ctx.name_key = kernels::tensorNameKey(name);
    ctx.step = step;
    ctx.rank = w;
    std::vector<std::byte> ws(codec->workspaceBytes(chunking));
    const kernels::ConstTensor input{sum.data(), n, kernels::DType::kF32};
    REQUIRE(codec->analyze(ctx, chunking, input, state, ws).isOk());
    Chunks out;
    for (size_t c = 0; c < chunking.count(); ++c) {
      Bytes buf(codec->maxPayloadBytes(chunking.size(c)));
      auto size = codec->encodeChunk(ctx, chunking, c, 0, {}, input, state, ws, buf);
      REQUIRE(size.isOk());
      buf.resize(*size);
      out.push_back(std::move(buf));
    }
    const std::vector<std::span<const uint8_t>> sent(out.begin(), out.end());
    REQUIRE(codec->commitState(ctx, chunking, input, sent, {}, state, ws).isOk());
    return out;
  }
  std::string name;
  uint32_t w;
  std::unique_ptr<kernels::Codec> codec;
  kernels::CodecState state;
  kernels::Chunking chunking;
};

bool sameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<kernels::CodecConfig> syncCodecs() {
  return {
      {.name = "none"},
      {.name = "fp16"},
      {.name = "topk", .density = 0.05},
      {.name = "dgc", .density = 0.05, .momentum = 0.9},
      {.name = "qsgd", .bits = 4},
      {.name = "powersgd", .approx_rank = 1},
  };
}

TEST_CASE("ps sync: every codec at W = 2, 3, 4: identical bytes on every rank, as the reference") {
  for (uint32_t w : {2u, 3u, 4u}) {
    CAPTURE(w);
    Mesh mesh(w);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    PsOptions o;
    o.server_rank = w == 2 ? 0 : (w == 3 ? 2 : 1);
    o.seed = kSeed;
    const std::vector<uint64_t> steps = {0, 1, 2};
    std::vector<std::vector<RankPlan>> plans(w);
    for (uint32_t r = 0; r < w; ++r) {
      for (const auto& cfg : syncCodecs()) {
        RankPlan p;
        p.cfg = cfg;
        p.name = "layer." + cfg.name;
        p.steps = steps;
        // Statistics records in steps 0 and 2 (every rank), none in step 1.
        p.stats = [r](uint64_t s) { return s == 1 ? Bytes{} : statsOf(r, s); };
        plans[r].push_back(p);
      }
    }
    const auto res = runAll(mesh, o, 5000ms, plans);
    const auto codecs = syncCodecs();
    for (size_t p = 0; p < codecs.size(); ++p) {
      const auto& cfg = codecs[p];
      CAPTURE(cfg.name);
      auto codec = kernels::createCodec(cfg);
      REQUIRE(codec.isOk());
      const auto& traits = (*codec)->traits();
      const kernels::Chunking chunking = kernels::chunkingFor(**codec, 3000, 1024);
      ServerRef server(cfg, 3000, 1024, "layer." + cfg.name, w);
      for (uint64_t s : steps) {
        CAPTURE(s);
        for (uint32_t r = 0; r < w; ++r) {
          const StepRecord& rec = res[r][p].at(s);
          REQUIRE_MESSAGE(rec.ok, rec.error);
          CHECK(rec.contributors == w);
          CHECK(rec.got == res[0][p].at(s).got);
          if (s == 1) {
            CHECK(rec.stats_in.empty());
          } else {  // every rank's record, index = rank, on every rank
            REQUIRE(rec.stats_in.size() == w);
            for (uint32_t k = 0; k < w; ++k) CHECK(rec.stats_in[k] == statsOf(k, s));
          }
          CHECK(sameBits(rec.result, res[0][p].at(s).result));
        }
        const StepRecord& rec0 = res[0][p].at(s);
        if (traits.summable || traits.rounds > 1) {
          for (int round = 0; round < traits.rounds; ++round) {
            const auto rr = static_cast<size_t>(round);
            for (size_t c = 0; c < rec0.got[rr].size(); ++c) {
              std::vector<const Bytes*> parts;
              for (uint32_t r = 0; r < w; ++r) parts.push_back(&res[r][p].at(s).sent[rr][c]);
              CHECK(rec0.got[rr][c] == foldSum(**codec, chunking.size(c), parts));
            }
          }
        } else {
          std::vector<const Chunks*> parts;
          for (uint32_t r = 0; r < w; ++r) parts.push_back(&res[r][p].at(s).sent[0]);
          CHECK(rec0.got[0] == server.combine(parts, s));
        }
        bool nonzero = false;
        for (float v : rec0.result) nonzero |= v != 0.0f;
        CHECK(nonzero);
      }
    }
  }
}

TEST_CASE("ps sync: a missing worker fails the step on every rank, naming it") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  PsOptions o;
  o.server_rank = 0;
  std::vector<std::vector<RankPlan>> plans(3);
  for (uint32_t r = 0; r < 2; ++r) {
    RankPlan p;
    p.cfg = {.name = "topk", .density = 0.1};
    p.name = "t";
    p.steps = {0};
    plans[r].push_back(p);
  }
  // The server waits 500 ms; the worker's own deadline is later, so it learns of the failure
  // from the server's abort.
  const auto res = runAll(mesh, o, 500ms, plans, {500ms, 4000ms, 500ms});
  const StepRecord& server = res[0][0].at(0);
  const StepRecord& worker = res[1][0].at(0);
  CHECK_FALSE(server.ok);
  CHECK_FALSE(worker.ok);
  CHECK(server.error.find("rank 2") != std::string::npos);
  CHECK(worker.error.find("rank 2") != std::string::npos);
  CHECK(server.took >= 450ms);
  CHECK(server.took < 3000ms);
  CHECK(worker.took < 3000ms);
}

TEST_CASE("ps sync: a missing server fails the workers at their deadline, naming it") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  PsOptions o;
  o.server_rank = 1;
  std::vector<std::vector<RankPlan>> plans(3);
  for (uint32_t r : {0u, 2u}) {
    RankPlan p;
    p.cfg = {.name = "none"};
    p.name = "t";
    p.steps = {0};
    plans[r].push_back(p);
  }
  const auto res = runAll(mesh, o, 400ms, plans);
  for (uint32_t r : {0u, 2u}) {
    const StepRecord& rec = res[r][0].at(0);
    CHECK_FALSE(rec.ok);
    CHECK(rec.error.find("parameter server (rank 1)") != std::string::npos);
    CHECK(rec.took < 3000ms);
  }
}

TEST_CASE("ps sync: payloads that do not add up or do not decode fail the step, naming the rank") {
  for (const char* name : {"fp16", "qsgd"}) {
    CAPTURE(name);
    Mesh mesh(2);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    PsOptions o;
    o.server_rank = 0;
    auto codec = kernels::createCodec({.name = name});
    REQUIRE(codec.isOk());
    const size_t n = 2048;
    const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, 1024);
    std::vector<std::future<std::string>> futures;
    for (uint32_t r = 0; r < 2; ++r) {
      futures.push_back(std::async(std::launch::async, [&, r]() -> std::string {
        PsExchange ps(*mesh.transports[r], 2000ms, o);
        const auto x = tensorOf(r, 0, n);
        kernels::CodecState state((*codec)->stateFloats(n));
        kernels::StepContext ctx;
        ctx.rank = r;
        auto payloads =
            kernels::encodeTensor(**codec, ctx, chunking, kernels::ConstTensor{x.data(), n}, state);
        REQUIRE(payloads.isOk());
        if (r == 1) (*payloads)[1].resize((*payloads)[1].size() - 3);  // truncated
        std::vector<std::span<const uint8_t>> mine(payloads->begin(), payloads->end());
        ExchangeRound round{"t", 0, 0, **codec, chunking, mine};
        auto got = ps.run(round);
        ps.stepDone("t", 0);
        return got.isOk() ? std::string() : got.status().message();
      }));
    }
    const std::string server = futures[0].get(), worker = futures[1].get();
    CHECK(server.find("chunk 1 from rank 1") != std::string::npos);
    CHECK(server.find(std::string(name) == "fp16" ? "does not add up" : "does not decode") !=
          std::string::npos);
    CHECK(worker.find("chunk 1 from rank 1") != std::string::npos);  // the server's abort
  }
}

TEST_CASE("ps result checksums: compared through the server, the differing ranks named") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const uint64_t sums[3] = {0x1111, 0x2222, 0x1111};
  PsOptions o;
  o.server_rank = 1;
  std::vector<std::future<Result<std::vector<uint32_t>>>> futures;
  for (uint32_t r = 0; r < 3; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      PsExchange ps(*mesh.transports[r], 3000ms, o);
      return ps.compareResults("t", 100, sums[r]);
    }));
  }
  std::vector<std::vector<uint32_t>> differ;
  for (auto& f : futures) {
    auto d = f.get();
    REQUIRE_MESSAGE(d.isOk(), d.status().message());
    differ.push_back(*d);
  }
  CHECK(differ[0] == std::vector<uint32_t>{1});
  CHECK(differ[1] == std::vector<uint32_t>{0, 2});
  CHECK(differ[2] == std::vector<uint32_t>{1});
  // A silent server: the comparison fails within the deadline, naming it.
  PsExchange ps(*mesh.transports[0], 300ms, o);
  auto d = ps.compareResults("t", 200, 1);
  CHECK_FALSE(d.isOk());
  CHECK(d.status().message().find("rank 1") != std::string::npos);
}

TEST_CASE("ps broadcast header: count and bitmap round trip, hostile headers refused") {
  PsHeader h;
  h.count = 7;
  h.ranks = {true, false, true, true, false, false, false, false, true, false};
  Bytes b;
  appendPsHeader(h, b);
  REQUIRE(b.size() == psHeaderBytes(10));
  CHECK(b == Bytes{7, 0, 0, 0, 0x0D, 0x01});
  auto back = parsePsHeader(b, 10);
  REQUIRE(back.isOk());
  CHECK(back->count == 7);
  CHECK(back->ranks == h.ranks);
  CHECK_FALSE(parsePsHeader(std::span<const uint8_t>(b).first(5), 10).isOk());  // short
  b[5] = 0x04;                                                                  // rank 10 of 10
  CHECK_FALSE(parsePsHeader(b, 10).isOk());
  Bytes zero{0, 0, 0, 0, 1};
  CHECK_FALSE(parsePsHeader(zero, 3).isOk());  // no contribution
}

// --- bounded staleness ---------------------------------------------------------------------------

TEST_CASE(
    "ps bounded staleness: steps close without a rank within the bound, its late "
    "contributions are folded into the next aggregate, a rank beyond it is waited for") {
  for (const char* name : {"none", "topk"}) {
    CAPTURE(name);
    Mesh mesh(3);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    PsOptions o;
    o.server_rank = 0;
    o.bounded_staleness = true;
    o.staleness = 2;
    o.straggler_wait = 200ms;
    o.seed = kSeed;
    const kernels::CodecConfig cfg{.name = name, .density = 0.1};
    const std::vector<uint64_t> steps = {0, 1, 2, 3, 4};
    std::atomic<int> done_step2{0};
    std::vector<std::vector<RankPlan>> plans(3);
    for (uint32_t r = 0; r < 3; ++r) {
      RankPlan p;
      p.cfg = cfg;
      p.name = "w";
      p.steps = steps;
      p.stats = [r](uint64_t s) { return statsOf(r, s); };
      if (r < 2) {
        p.after = [&](uint64_t s, const StepRecord&) {
          if (s == 2) ++done_step2;
        };
      } else {
        // Rank 2 falls behind at step 1: it pushes steps 1 and 2 only once ranks 0 and 1 have
        // finished step 2 (closed without it) and the server has been waiting for it at step 3
        // (beyond the bound: its latest contribution is of step 0 < 3 - 2) for 400 ms.
        p.before = [&](uint64_t s) {
          if (s != 1) return;
          REQUIRE(waitFor([&] { return done_step2.load() == 2; }));
          std::this_thread::sleep_for(400ms);
        };
      }
      plans[r].push_back(p);
    }
    const auto res = runAll(mesh, o, 5000ms, plans);
    // Contributions of each aggregate: late ones in (step, rank) order, then the step's own in
    // rank order.
    const std::map<uint64_t, std::vector<std::pair<uint32_t, uint64_t>>> composition = {
        {0, {{0, 0}, {1, 0}, {2, 0}}}, {1, {{0, 1}, {1, 1}}},
        {2, {{0, 2}, {1, 2}}},         {3, {{2, 1}, {2, 2}, {0, 3}, {1, 3}, {2, 3}}},
        {4, {{0, 4}, {1, 4}, {2, 4}}},
    };
    ServerRef server(cfg, 3000, 1024, "w", 3);
    for (uint64_t s : steps) {
      CAPTURE(s);
      std::vector<const Chunks*> parts;
      for (auto [rank, step] : composition.at(s)) parts.push_back(&res[rank][0].at(step).sent[0]);
      const Chunks want = server.combine(parts, s);
      for (uint32_t r = 0; r < 3; ++r) {
        CAPTURE(r);
        const StepRecord& rec = res[r][0].at(s);
        REQUIRE_MESSAGE(rec.ok, rec.error);
        CHECK(rec.contributors == composition.at(s).size());
        CHECK(rec.got[0] == want);
        CHECK(sameBits(rec.result, res[0][0].at(s).result));
        // The records of step s's own contributors (late ones dropped), the same on every rank:
        // rank 2's steps 1 and 2 hold none of its own.
        REQUIRE(rec.stats_in.size() == 3);
        for (uint32_t k = 0; k < 3; ++k) {
          CAPTURE(k);
          const bool ontime = std::find(composition.at(s).begin(), composition.at(s).end(),
                                        std::make_pair(k, s)) != composition.at(s).end();
          CHECK(rec.stats_in[k] == (ontime ? statsOf(k, s) : Bytes{}));
        }
      }
    }
    // Step 3 waited for rank 2 (beyond the bound) rather than closing without it.
    CHECK(res[1][0].at(3).took >= 300ms);
  }
}

TEST_CASE("ps bounded staleness: a step a rank never ran holds nothing up") {
  Mesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  PsOptions o;
  o.server_rank = 0;
  o.bounded_staleness = true;
  o.staleness = 2;
  o.straggler_wait = 100ms;
  o.seed = kSeed;
  const kernels::CodecConfig cfg{.name = "qsgd", .bits = 4};
  std::vector<std::vector<RankPlan>> plans(2);
  for (uint32_t r = 0; r < 2; ++r) {
    RankPlan p;
    p.cfg = cfg;
    p.name = "s";
    p.steps = r == 0 ? std::vector<uint64_t>{0, 1, 2, 3} : std::vector<uint64_t>{0, 2, 3};
    plans[r].push_back(p);
  }
  const auto res = runAll(mesh, o, 3000ms, plans);
  const std::map<uint64_t, std::vector<std::pair<uint32_t, uint64_t>>> composition = {
      {0, {{0, 0}, {1, 0}}},
      {1, {{0, 1}}},
      {2, {{0, 2}, {1, 2}}},  // rank 1 never pushes step 1: nothing of it is waited for
      {3, {{0, 3}, {1, 3}}},
  };
  ServerRef server(cfg, 3000, 1024, "s", 2);
  for (const auto& entry : composition) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const auto& s = entry.first;
    const auto& parts_of = entry.second;
    CAPTURE(s);
    std::vector<const Chunks*> parts;
    for (auto [rank, step] : parts_of) parts.push_back(&res[rank][0].at(step).sent[0]);
    const Chunks want = server.combine(parts, s);
    for (uint32_t r = 0; r < 2; ++r) {
      if (!res[r][0].contains(s)) continue;
      const StepRecord& rec = res[r][0].at(s);
      REQUIRE_MESSAGE(rec.ok, rec.error);
      CHECK(rec.contributors == parts_of.size());
      CHECK(rec.got[0] == want);
      CHECK(rec.stats_in.empty());  // no records given, none delivered
    }
  }
}

TEST_CASE("ps bounded staleness: a rank beyond the bound fails the step at the deadline") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  PsOptions o;
  o.server_rank = 0;
  o.bounded_staleness = true;
  o.staleness = 1;
  o.straggler_wait = 50ms;
  std::vector<std::vector<RankPlan>> plans(3);
  for (uint32_t r = 0; r < 3; ++r) {
    RankPlan p;
    p.cfg = {.name = "qsgd", .bits = 4};
    p.name = "b";
    p.steps = r == 2 ? std::vector<uint64_t>{0} : std::vector<uint64_t>{0, 1, 2};
    plans[r].push_back(p);
  }
  const auto res = runAll(mesh, o, 800ms, plans, {800ms, 4000ms, 800ms});
  for (uint32_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    REQUIRE(res[r][0].at(0).ok);
    CHECK(res[r][0].at(0).contributors == 3);
    REQUIRE_MESSAGE(res[r][0].at(1).ok, res[r][0].at(1).error);  // rank 2 within the bound
    CHECK(res[r][0].at(1).contributors == 2);
    CHECK(res[r][0].at(1).got == res[0][0].at(1).got);
    const StepRecord& beyond = res[r][0].at(2);
    CHECK_FALSE(beyond.ok);
    CHECK(beyond.error.find("rank(s) 2") != std::string::npos);
    CHECK(beyond.error.find("staleness bound") != std::string::npos);
    CHECK(beyond.took < 3000ms);
  }
  CHECK(res[0][0].at(2).took >= 750ms);
}

TEST_CASE("ps bounded staleness: multi-round codecs and randomk are refused") {
  Mesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  PsOptions o;
  o.bounded_staleness = true;
  for (const auto& cfg : std::vector<kernels::CodecConfig>{{.name = "powersgd"},
                                                           {.name = "randomk", .density = 0.1}}) {
    auto codec = kernels::createCodec(cfg);
    REQUIRE(codec.isOk());
    PsExchange ps(*mesh.transports[1], 500ms, o);
    const size_t n = 256;
    const auto x = tensorOf(1, 0, n);
    const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, 1024);
    kernels::CodecState state((*codec)->stateFloats(n));
    auto payloads =
        kernels::encodeTensor(**codec, {}, chunking, kernels::ConstTensor{x.data(), n}, state);
    REQUIRE(payloads.isOk());
    std::vector<std::span<const uint8_t>> mine(payloads->begin(), payloads->end());
    ExchangeRound round{"r", 0, 0, **codec, chunking, mine};
    auto got = ps.run(round);
    REQUIRE_FALSE(got.isOk());
    CHECK(got.status().message().find(cfg.name + " needs peer.synchrony sync") !=
          std::string::npos);
    ps.stepDone("r", 0);
  }
}

// --- policy statistics records -------------------------------------------------------------------

TEST_CASE("ps statistics broadcast: layout, round trip, hostile payloads refused") {
  const std::vector<Bytes> by_rank = {{0xA1, 0xA2}, {}, {0xC1}};
  const Bytes b = encodePsStats(by_rank);
  CHECK(b == Bytes{2, 0, 0, 0,                          // count
                   0, 0, 0, 0, 2, 0, 0, 0, 0xA1, 0xA2,  // rank 0, 2 bytes
                   2, 0, 0, 0, 1, 0, 0, 0, 0xC1});      // rank 2, 1 byte
  auto back = parsePsStats(b, 3);
  REQUIRE(back.isOk());
  CHECK(*back == by_rank);
  CHECK(encodePsStats({{}, {}}) == Bytes{0, 0, 0, 0});
  auto none = parsePsStats(Bytes{0, 0, 0, 0}, 2);
  REQUIRE(none.isOk());
  CHECK(*none == std::vector<Bytes>(2));
  // The largest record allowed, and one byte more.
  std::vector<Bytes> big = {Bytes(kMaxStatsBytes, 1)};
  CHECK(parsePsStats(encodePsStats(big), 1).isOk());
  big[0].push_back(2);
  auto too_big = parsePsStats(encodePsStats(big), 1);
  REQUIRE_FALSE(too_big.isOk());
  CHECK(too_big.status().message().find("record of rank 0 has 65537 bytes") != std::string::npos);

  auto refused = [](const Bytes& p, uint32_t w, const std::string& why) {
    CAPTURE(why);
    auto r = parsePsStats(p, w);
    REQUIRE_FALSE(r.isOk());
    CHECK_MESSAGE(r.status().message().find(why) != std::string::npos, r.status().message());
  };
  refused(Bytes{1, 0, 0}, 3, "shorter than its count");
  refused(Bytes{4, 0, 0, 0}, 3, "counts 4 records in a world of 3");
  refused(Bytes{1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0}, 3, "cut short");
  refused(Bytes{1, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 9}, 3, "record of rank 3 of a world of 3");
  refused(Bytes{2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 9, 0, 0, 0, 0, 1, 0, 0, 0, 9}, 3,
          "rank 0 follows that of rank 1");
  refused(Bytes{2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 9, 1, 0, 0, 0, 1, 0, 0, 0, 9}, 3,
          "rank 1 follows that of rank 1");
  refused(Bytes{1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 3, "record of rank 0 is empty");
  refused(Bytes{1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 9, 9}, 3, "claims 3 bytes, 2 remain");
  refused(Bytes{1, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 9}, 3, "more than 65536");
  refused(Bytes{1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 9, 7}, 3, "1 bytes after its last record");
  refused(Bytes{0, 0, 0, 0, 7}, 3, "1 bytes after its last record");
}

TEST_CASE("ps statistics records: an oversized record from a worker fails the step everywhere") {
  for (const bool bounded : {false, true}) {
    CAPTURE(bounded);
    Mesh mesh(3);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    PsOptions o;
    o.server_rank = 0;
    o.bounded_staleness = bounded;
    o.straggler_wait = 100ms;
    o.seed = kSeed;
    std::vector<std::vector<RankPlan>> plans(3);
    for (uint32_t r = 0; r < 3; ++r) {
      RankPlan p;
      p.cfg = {.name = "topk", .density = 0.1};
      p.name = "t";
      p.steps = {0};
      if (r < 2) {
        p.stats = [r](uint64_t s) { return statsOf(r, s); };
      } else {
        // Rank 2 sends the server a record one byte too large through its transport (as a
        // hostile or broken peer would) and runs the step without a record of its own.
        p.before = [&](uint64_t s) {
          FrameKey k;
          k.tensor = tensorKey("t");
          k.step = s;
          k.phase = 7;  // docs/exchange.md: a rank's statistics record, to the server
          k.origin = 2;
          const Bytes record(kMaxStatsBytes + 1, 0xEE);
          REQUIRE(mesh.transports[2]
                      ->send(0, FrameType::kData, k, 0, record, Clock::now() + 2s)
                      .isOk());
        };
      }
      plans[r].push_back(p);
    }
    const auto res = runAll(mesh, o, 3000ms, plans);
    for (uint32_t r = 0; r < 3; ++r) {
      CAPTURE(r);
      const StepRecord& rec = res[r][0].at(0);
      CHECK_FALSE(rec.ok);
      // The server's own check; the workers learn it from the server's abort.
      CHECK_MESSAGE(
          rec.error.find("statistics record of rank 2 has 65537 bytes, more than 65536") !=
              std::string::npos,
          rec.error);
      CHECK(rec.took < 2500ms);
    }
  }
}

TEST_CASE("ps statistics records: a bad statistics broadcast fails the worker, naming it") {
  struct Case {
    Bytes frame;
    std::string want;
  };
  const std::vector<Case> cases = {
      {encodePsStats({statsOf(0, 0), Bytes(kMaxStatsBytes + 1, 1)}),
       "statistics record of rank 1 has 65537 bytes"},
      {encodePsStats({statsOf(0, 0), {}}), "sent no statistics record of rank 1, a contributor"},
      {Bytes{1, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0, 9}, "record of rank 5 of a world of 2"},
  };
  uint64_t step = 0;
  for (const Case& c : cases) {
    CAPTURE(c.want);
    ++step;
    Mesh mesh(2);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    PsOptions o;
    o.server_rank = 0;
    auto codec = kernels::createCodec({.name = "none"});
    REQUIRE(codec.isOk());
    const size_t n = 256;
    const kernels::Chunking chunking = kernels::chunkingFor(**codec, n, 1024);
    // Rank 0 plays a server whose statistics broadcast is bad: a valid broadcast of rank 1's
    // payload, preceded by `c.frame`.
    auto fake = std::async(std::launch::async, [&] {
      Transport& t = *mesh.transports[0];
      const uint64_t tensor = tensorKey("t");
      FrameKey push{tensor, step, 0, 3, 0, 1};
      auto pushed = t.receive(1, push, Clock::now() + 3s);
      REQUIRE(pushed.isOk());
      FrameKey stats{tensor, step, 0, 8, 0, 0};
      REQUIRE(t.send(1, FrameType::kData, stats, 0, c.frame, Clock::now() + 2s).isOk());
      Bytes framed;
      appendPsHeader({2, {true, true}}, framed);
      framed.insert(framed.end(), pushed->payload.begin(), pushed->payload.end());
      FrameKey bcast{tensor, step, 0, 4, 0, 0};
      REQUIRE(t.send(1, FrameType::kData, bcast, pushed->codec, framed, Clock::now() + 2s).isOk());
    });
    PsExchange ps(*mesh.transports[1], 3000ms, o);
    const auto x = tensorOf(1, step, n);
    kernels::CodecState state((*codec)->stateFloats(n));
    auto payloads =
        kernels::encodeTensor(**codec, {}, chunking, kernels::ConstTensor{x.data(), n}, state);
    REQUIRE(payloads.isOk());
    std::vector<std::span<const uint8_t>> mine(payloads->begin(), payloads->end());
    const Bytes record = statsOf(1, step);
    ExchangeRound round{"t", step, 0, **codec, chunking, mine};
    round.stats_out = record;
    auto got = ps.run(round);
    fake.get();
    REQUIRE_FALSE(got.isOk());
    CHECK_MESSAGE(got.status().message().find(c.want) != std::string::npos, got.status().message());
    CHECK(got.status().message().find("parameter server (rank 0)") != std::string::npos);
    CHECK(round.stats_in.empty());
    ps.stepDone("t", step);
  }
}

}  // namespace
}  // namespace lightwire::proxy::peer
