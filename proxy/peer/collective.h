#pragma once
// The collectives of the `ring` topology (docs/exchange.md "One step") as the step engine's
// Exchange: given this sidecar's payload of every chunk, return for every chunk what to decode.
//
//   - summable codecs and multi-round rounds: a ring allreduce at chunk granularity. Chunk c is
//     owned by rank c mod W; its partial sum travels the ring from rank owner+1 to the owner,
//     each rank adding its own payload (addPayloads, in that fixed order), and the owner's final
//     sum travels on around the ring to everyone (reduce-scatter, then allgather). Every rank
//     decodes the same bytes, so results are bitwise identical.
//   - selection codecs asked for a global selection (ExchangeRound::select_globally): a sparse
//     allreduce — each rank's payload of chunk c to the chunk's owner, which sums them in rank
//     order and sends the chunk's share of the global top-k to every rank (sparsePost/Reduce);
//   - other codecs (sparse, quantised): a ring allgather; every rank decodes all W payloads of a
//     chunk in rank order (again the same arithmetic everywhere) — unless gathering would move
//     more bytes than a dense ring allreduce (W × nominal payload > 2 × dense chunk): then every
//     rank decodes its own payloads and the decoded fp32 chunks are ring-allreduced instead.
//
// Policy statistics records (ExchangeRound::stats_out, round 0): every rank posts its record to
// every other rank (the transports are a full mesh) before its first data frame, frame phase 3
// (chunk 0, origin = the sender), and receives every other rank's once its data exchange is done,
// so every rank holds the same stats_in. Records are expected from every rank iff this rank has
// one: every rank of a job sends one, or none (the engine guarantees it).
//
// Every wait has the exchange deadline; a failure (a peer down or silent, a malformed frame, a
// payload that does not add up) fails the step here and is sent to every peer as an abort, so
// they fail it at once instead of at their deadline.

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "proxy/exchange/exchange.h"
#include "proxy/peer/transport.h"

namespace lightwire::proxy::peer {

/// The `ring` topology over a Transport. Used by one engine thread at a time (the engine runs one
/// step at a time); the spans it returns stay valid until the next run().
class RingExchange final : public Exchange {
 public:
  RingExchange(Transport& transport, std::chrono::milliseconds timeout);

  unsigned worldSize() const override { return transport_.worldSize(); }
  Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& round) override;
  /// One pass for every round given (a bucket's layers): every record and every gather's own
  /// payloads posted first, then one ring allreduce over the chunks of every summable (or
  /// multi-round, or dense-switched) tensor, position by position across the tensors, then the
  /// gathers' hops, tensor after tensor at each hop; one flush. With `bucket`, every rank's
  /// layout hash of it is received and compared before any data is taken (a mismatch fails the
  /// pass on every rank, naming the ranks). run() is this for one round, without a bucket.
  Result<std::vector<std::vector<std::vector<std::span<const uint8_t>>>>> runAll(
      std::span<ExchangeRound* const> rounds, const BucketTag* bucket) override;
  bool encodesLazily() const override { return true; }
  bool selectsGlobally() const override { return true; }
  Result<std::vector<uint32_t>> compareResults(const std::string& tensor, uint64_t step,
                                               uint64_t checksum) override;
  void abort(const std::string& tensor, uint64_t step, const std::string& reason) override;
  void stepDone(const std::string& tensor, uint64_t step) override;

 private:
  using Spans = std::vector<std::vector<std::span<const uint8_t>>>;
  /// One tensor's round in a pass, and its frames' tensor key.
  struct Item {
    ExchangeRound* r = nullptr;
    uint64_t tensor = 0;
  };
  /// The ring allreduce of every item's chunks (one schedule over all of them): each item's sums.
  Result<std::vector<Spans>> allreduce(std::span<const Item> items);
  /// The ring allgather of every item's payloads: this rank's own posted (gatherPost), then the
  /// others' received hop by hop (gatherReceive); by_origin[item][chunk][rank].
  Status gatherPost(std::span<const Item> items, std::vector<Spans>& by_origin);
  Status gatherReceive(std::span<const Item> items, std::vector<Spans>& by_origin);
  /// The sparse allreduce (docs/exchange.md "Sparse allreduce") of every item's chunks (rounds
  /// with select_globally): each rank's payload of chunk c goes to the chunk's owner (rank
  /// (c + the tensor's key) mod W, phase 5), which sums every rank's in rank order, selects the
  /// chunk's share of the global top-k and sends that selection to every other rank (phase 6).
  /// sparsePost() posts this rank's contributions; sparseReduce() reduces and selects the owned
  /// chunks and receives the others' selections: out[item][chunk] = {the selection}.
  Status sparsePost(std::span<const Item> items);
  Result<std::vector<Spans>> sparseReduce(std::span<const Item> items);
  /// The bucket's header (its layout hash and layer count) to every other rank, and every other
  /// rank's received and compared with this one's.
  Status postBucket(const BucketTag& bucket, uint64_t step);
  Status checkBucket(const BucketTag& bucket, uint64_t step);
  Status fail(uint64_t tensor, uint64_t step, Status s);
  /// Policy statistics (round 0, ExchangeRound::stats_out non-empty): posts this rank's record
  /// to every other rank (before any data frame), and receives every other rank's once the data
  /// is in (checked: non-empty, at most kMaxStatsBytes), filling r.stats_in.
  Status postStats(const ExchangeRound& r, uint64_t tensor);
  Status receiveStats(ExchangeRound& r, uint64_t tensor);

  /// Sparse and quantised codecs: whether a dense ring allreduce of the decoded chunks moves
  /// fewer bytes than gathering every rank's payloads (then denseAllreduce() runs instead).
  bool denseIsSmaller(const ExchangeRound& r) const;
  /// The dense round that replaces `r` then: this rank's payloads decoded to fp32 and encoded as
  /// codec `none` (r.dense set); kept until the step ends.
  Result<ExchangeRound*> denseRound(ExchangeRound& r);
  /// Keeps a received payload until the step ends; returns a view of it.
  std::span<const uint8_t> keep(std::vector<uint8_t> received);
  /// A buffer of `bytes` for a partial sum, kept until the step ends (reused across steps).
  std::vector<uint8_t>& sumBuffer(size_t bytes);

  Transport& transport_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_;  // of the exchange in progress
  // Payload bytes received or computed for the step in progress (spans returned point here);
  // given back (to the transport, or spare_sums_) when the step ends.
  std::vector<std::vector<uint8_t>> held_;
  std::deque<std::vector<uint8_t>> sums_;  // deque: references stay valid as it grows
  std::vector<std::vector<uint8_t>> spare_sums_;
  // denseRound(): our decoded chunks, as codec `none` payloads, their spans, the round (deques:
  // references stay valid as they grow).
  std::deque<std::vector<float>> dense_inputs_;
  std::deque<std::vector<std::vector<uint8_t>>> dense_payloads_;
  std::deque<std::vector<std::span<const uint8_t>>> dense_spans_;
  std::deque<ExchangeRound> dense_rounds_;
  std::vector<float> select_sums_;                      // sparseReduce(): one owned chunk's sums
  std::vector<uint64_t> select_scratch_;                // ... and its candidates
  std::vector<std::pair<uint64_t, uint64_t>> buckets_;  // (bucket key, step) of the step's headers
  uint8_t header_[12] = {};                             // this rank's bucket header (posted)
};

/// XXH3-64 of a tensor name: the `tensor` field of frames.
uint64_t tensorKey(const std::string& name);

}  // namespace lightwire::proxy::peer
