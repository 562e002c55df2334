#pragma once
// The exchange seam (docs/architecture.md "Seams"): what the step pipeline asks of the other
// sidecars for one round of one step, declared apart from the pipeline so that the collectives
// (proxy/peer) depend on this header only. What travels and in which order: docs/exchange.md.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/status.h"

namespace lightwire::proxy {

/// Largest statistics record a sidecar sends or accepts with a step (ExchangeRound::stats_out).
inline constexpr size_t kMaxStatsBytes = size_t{64} << 10;

/// One exchange round of one step of one tensor, as this sidecar sees it.
struct ExchangeRound {
  const std::string& tensor;
  uint64_t step;
  int round;
  const kernels::Codec& codec;
  const kernels::Chunking& chunking;
  std::span<const std::span<const uint8_t>> payloads;  // this sidecar's payload of every chunk
  // Exchanges that say encodesLazily(): instead of `payloads` (then empty), compresses chunk c on
  // first call and returns its payload (stable until the step ends), so compressing chunk i+1
  // overlaps sending chunk i. Use payload(c), which covers both.
  std::function<Result<std::span<const uint8_t>>(size_t)> encode;
  // The step's density of selection codecs when a schedule overrides the configured one (the same
  // on every sidecar: a function of the step).
  std::optional<double> density;
  // Optional (set by the pipeline for single-round codecs): the exchange may call it as soon as
  // chunk c's payloads to decode are final, so decoding overlaps the rest of the exchange. The
  // list is valid during the call only: the exchange may then reuse its buffers, and run() may
  // return an empty list for c. An error fails the exchange. Chunks it was not called for are
  // decoded after run(). Exchanges that set `contributors` below worldSize() must not call it.
  std::function<Status(size_t, std::span<const std::span<const uint8_t>>)> on_chunk;
  // Optional (set by the pipeline for host steps of codec `none` without state): chunk c's fp32
  // values, whose `none` payload is a 16-byte header and exactly those bytes. A ring position
  // that only adds its own payload to a partial sum adds these instead (the same additions in the
  // same order: the same bytes), the first position of a chain sends them behind the header, and
  // neither asks for the payload, so the codec never makes it. Valid
  // until the chunk's result is decoded (the pipeline may decode into the same memory).
  std::function<const float*(size_t)> raw;
  // Set by the exchange: the chunks whose payload it never asked for, because it used `raw`.
  std::vector<char> raw_used;
  // Set by the exchange: how many sidecars' contributions the returned payloads hold (0 = all of
  // worldSize(); fewer under bounded staleness, where the result is their mean).
  uint32_t contributors = 0;
  // Set by the pipeline (docs/exchange.md "Sparse allreduce"): the codec selects globally
  // (Codec::selectsGlobally) and this sidecar encoded with StepContext::defer_sent, so the
  // exchange must return, for every chunk, exactly one payload: the chunk's global selection of
  // every sidecar's summed contributions (the owner's rule, kernels::reduceSelectChunk), which
  // the pipeline settles its state with. Only for exchanges that say selectsGlobally().
  bool select_globally = false;
  // Set by the exchange: the returned payloads are plain fp32 arrays (codec `none`), not the
  // codec's payloads (a sparse allgather switched to a dense allreduce because it was smaller).
  bool dense = false;
  // Policy statistics (docs/policies.md): this sidecar's statistics record of the step (opaque
  // bytes, at most kMaxStatsBytes; given in round 0 only, empty = none). The exchange delivers
  // every sidecar's record, or their fold, to every sidecar within the step's own exchange and
  // fills `stats_in`: either every record, index = rank (an entry stays empty for a rank whose
  // record is not part of the step: not a contributor under bounded staleness), or — with
  // `stats_folded` set — one entry, every rank's record folded in rank order by `stats_fold`.
  // Every rank gets the same bytes.
  std::span<const uint8_t> stats_out;
  // Folds `rank`'s record into the fold of the records of the ranks before it (empty: none yet);
  // given with stats_out (policies::foldStats). An exchange that folds calls it with every rank's
  // record in rank order, each rank folding its own (docs/exchange.md "Policy statistics").
  using StatsFold = Result<std::vector<uint8_t>> (*)(std::span<const uint8_t> partial,
                                                     std::span<const uint8_t> record,
                                                     uint32_t rank);
  StatsFold stats_fold = nullptr;
  std::vector<std::vector<uint8_t>> stats_in;
  bool stats_folded = false;

  Result<std::span<const uint8_t>> payload(size_t chunk) const {
    if (encode) return encode(chunk);
    return payloads[chunk];
  }
};

/// The bucket whose layers one Exchange::runAll exchanges (round 0): its name and the hash of its
/// layout, which every sidecar checks against every other's before the data (docs/exchange.md
/// "A bucket's layers in one exchange").
struct BucketTag {
  std::string name;
  uint64_t layout_hash = 0;
  uint32_t layers = 0;
};

/// The seam to the other sidecars. For each chunk it returns the payloads to decode: the reduced
/// (summed) payload for summable and multi-round codecs, or every sidecar's payload otherwise.
/// The spans stay valid until the step ends (one step runs at a time).
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual unsigned worldSize() const = 0;
  virtual Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& round) = 0;
  /// The rounds of several tensors of one step together — a bucket's layers, each its own tensor
  /// with its own codec (docs/exchange.md "A bucket's layers in one exchange") — each as run()
  /// returns it, in the order given. It fails as a whole: one error, and the caller fails every
  /// tensor of it. `bucket` (round 0 of a bucket; else null): the layout every sidecar must have
  /// sent the rounds' tensors with. This default runs them one after the other (one round trip
  /// each) and checks no layout; an exchange may run them in one pass.
  virtual Result<std::vector<std::vector<std::vector<std::span<const uint8_t>>>>> runAll(
      std::span<ExchangeRound* const> rounds, const BucketTag* /*bucket*/) {
    std::vector<std::vector<std::vector<std::span<const uint8_t>>>> out;
    out.reserve(rounds.size());
    for (ExchangeRound* r : rounds) {
      auto got = run(*r);
      if (!got) return got.status();
      out.push_back(std::move(*got));
    }
    return out;
  }
  /// Whether run() can return a global selection (ExchangeRound::select_globally).
  virtual bool selectsGlobally() const { return false; }
  /// Whether run() takes this sidecar's payloads chunk by chunk through ExchangeRound::encode
  /// (compression overlapping the exchange) rather than all compressed beforehand.
  virtual bool encodesLazily() const { return false; }
  /// Silent-divergence guard (docs/exchange.md "Silent-divergence guard"): compares this
  /// sidecar's checksum of a step's result with every other sidecar's. Returns the ranks whose
  /// checksum differs from this one's (empty: all agree), or an error when the comparison itself
  /// failed (a peer down or silent).
  virtual Result<std::vector<uint32_t>> compareResults(const std::string& /*tensor*/,
                                                       uint64_t /*step*/, uint64_t /*checksum*/) {
    return std::vector<uint32_t>{};
  }
  /// The step (tensor, step) failed here (before, during or after its exchange): tell the other
  /// sidecars, so they fail it at once rather than at their deadline.
  virtual void abort(const std::string& /*tensor*/, uint64_t /*step*/,
                     const std::string& /*reason*/) {}
  /// The step (tensor, step) is over here, successfully or not: what was kept for it can go.
  virtual void stepDone(const std::string& /*tensor*/, uint64_t /*step*/) {}
};

/// World size 1: this sidecar's payloads are the reduced ones. Stateless.
class LocalExchange final : public Exchange {
 public:
  unsigned worldSize() const override { return 1; }
  // One sidecar: its own selection is the global one.
  bool selectsGlobally() const override { return true; }
  Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& round) override {
    std::vector<std::vector<std::span<const uint8_t>>> out(round.payloads.size());
    for (size_t c = 0; c < round.payloads.size(); ++c) out[c].push_back(round.payloads[c]);
    round.stats_in.clear();
    round.stats_folded = false;
    if (!round.stats_out.empty()) {
      round.stats_in.emplace_back(round.stats_out.begin(), round.stats_out.end());
    }
    return out;
  }
};

}  // namespace lightwire::proxy
