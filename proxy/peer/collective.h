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
//     order and sends the largest sums, its share of k by the entries the ranks sent for it, to
//     every rank (sparsePost/Reduce); in a bucket, the owners balanced by the sizes of the
//     bucket's previous selections when every rank proposed the same (planOwners);
//   - other codecs (sparse, quantised): a ring allgather; every rank decodes all W payloads of a
//     chunk in rank order (again the same arithmetic everywhere) — unless gathering would move
//     more bytes than a dense ring allreduce (W × nominal payload > 2 × dense chunk): then every
//     rank decodes its own payloads and the decoded fp32 chunks are ring-allreduced instead.
//
// Policy statistics records (ExchangeRound::stats_out, round 0) go from every rank to rank 0,
// which folds them in rank order (ExchangeRound::stats_fold) and sends the fold of all both ways
// round the ring to where the ways meet — 2(W-1) frames per pass in all, at most two sent per
// rank, 1 + ⌈(W-1)/2⌉ hops, every rank ending with the same bytes (stats_in, stats_folded). They
// move whenever the data exchange waits, and what is left after it. Records are expected from
// every rank iff this rank has one: every rank of a job sends one, or none (the engine
// guarantees it).
//
// Every wait has the exchange deadline; a failure (a peer down or silent, a malformed frame, a
// payload that does not add up) fails the step here and is sent to every peer as an abort, so
// they fail it at once instead of at their deadline.

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
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
  /// The owner of every region of the last pass's sparse allreduce (its globally selected
  /// rounds' chunks, in pass order), and whether they were the balanced owners every rank
  /// proposed (docs/exchange.md "Which rank owns a region") rather than rank (c + h) mod W.
  const std::vector<uint32_t>& sparseOwners() const {
    return balanced_ ? balanced_owners_ : fallback_owners_;
  }
  bool sparseOwnersBalanced() const { return balanced_; }

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
  /// with select_globally): each rank's payload of chunk c goes to the chunk's owner (ownerOf,
  /// phase 5), which sums every rank's in rank order, selects the
  /// largest sums (kernels::reduceSelectChunk) and sends that selection to every other rank
  /// (phase 6).
  /// sparsePost() posts this rank's contributions, each with the rank's entries of the whole
  /// layer, and returns those counts per item; sparseReduce() reduces and selects the owned
  /// chunks (the owner's rule needs every rank's count) and receives the others' selections:
  /// out[item][chunk] = {the selection}.
  /// With balanced owners proposed (planOwners), every layer is compressed before the first
  /// contribution goes out, and the bucket's headers are checked in between (checkBucket): the
  /// owners are known once every rank's proposal is.
  Result<std::vector<uint64_t>> sparsePost(std::span<const Item> items, const BucketTag* bucket,
                                           uint64_t step);
  Result<std::vector<Spans>> sparseReduce(std::span<const Item> items,
                                          std::span<const uint64_t> own_entries);
  /// The owners of the pass's regions (`select`: its globally selected rounds): rank (c + h)
  /// mod W; and, in a bucket whose previous pass on this rank left the sizes of its global
  /// selections (same rounds, same chunks, same W), those sizes balanced over the ranks
  /// (balanceOwners), proposed in the bucket's header as their hash (proposal_).
  void planOwners(std::span<const Item> select, const BucketTag* bucket, uint64_t step);
  /// After a pass that succeeded here: the entries of each region's global selection, the
  /// weights of the bucket's next pass.
  void rememberSelections(std::span<const Item> select, const std::vector<Spans>& selected,
                          const BucketTag& bucket, uint64_t step);
  /// XXH3-64 of the regions of a pass's select rounds: W, and each round's key and chunk count.
  uint64_t regionsSignature(std::span<const Item> select) const;
  /// The owner of chunk `chunk` of select item `item` in the pass in progress.
  uint32_t ownerOf(size_t item, size_t chunk) const {
    return sparseOwners()[unit_base_[item] + chunk];
  }
  /// The bucket's header (its layout hash, layer count and owners proposed) to every other rank,
  /// and every other rank's received and compared with this one's: a layout that differs fails
  /// the pass; the proposed owners are taken when every rank proposed the same (balanced_).
  Status postBucket(const BucketTag& bucket, uint64_t step);
  Status checkBucket(const BucketTag& bucket, uint64_t step);
  Status fail(uint64_t tensor, uint64_t step, Status s);
  /// Policy statistics (round 0, ExchangeRound::stats_out non-empty; docs/exchange.md "Policy
  /// statistics"): every other rank posts its records of the pass (every tensor's with one) to
  /// rank 0 at once (frame phase 3, chunk 0); rank 0 folds them in rank order
  /// (ExchangeRound::stats_fold) as they arrive and sends the fold of all both ways round the
  /// ring (chunk 1): ranks 1 .. ⌈(W-1)/2⌉ pass it on to their successor, ranks W-1 .. ⌈(W-1)/2⌉+1
  /// to their predecessor, until the two ways meet.
  /// statsBegin() sets the pass up (posts the records; rank 0 folds its own); statsAdvance() goes
  /// as far as what has arrived allows (block: to the end, or the deadline); statsFold() folds
  /// rank `rank`'s records in (rank 0), sending the fold of all after the last; statsAwaited()
  /// is the frame the statistics wait for now, if any.
  Status statsBegin(std::span<const Item> items, uint64_t step);
  Status statsAdvance(bool block);
  Status statsFold(uint32_t rank, std::span<const std::span<const uint8_t>> records);
  std::optional<Wake> statsAwaited() const;
  FrameKey chainKey(uint32_t chunk, uint32_t origin) const;
  /// Every wait of a pass for a frame from `src`: first the statistics moved on as far as they
  /// can (take() only), then the frame waited for until the deadline — woken whenever the
  /// statistics' next frame arrives, to pass it on at once. A wait still blocked at
  /// half the deadline tells every peer on whom it waits (frame phase 9, once per peer waited
  /// on), so that nameSilent() can follow the waits to the rank that holds the ring up.
  Result<Frame> take(uint32_t src, const FrameKey& key);
  /// The wait itself: the frame, or nullopt when `wake` (optional) arrived first.
  Result<std::optional<Frame>> waitFor(uint32_t src, const FrameKey& key, const Wake* wake);
  /// A pass failed at its deadline: `failed`, plus the ranks the waits lead to ("rank 0 waits for
  /// rank 2, which has not answered").
  Status nameSilent(Status failed);

  /// Sparse and quantised codecs: whether a dense ring allreduce of the decoded chunks moves
  /// fewer bytes than gathering every rank's payloads (then denseAllreduce() runs instead).
  bool denseIsSmaller(const ExchangeRound& r) const;
  /// The dense round that replaces `r` then: this rank's payloads decoded to fp32 and encoded as
  /// codec `none` (r.dense set); kept until the step ends.
  Result<ExchangeRound*> denseRound(ExchangeRound& r);
  /// Keeps a received payload until the step ends; returns a view of it.
  std::span<const uint8_t> keep(std::vector<uint8_t> received);
  /// A buffer of `bytes` for a partial sum, kept until the step ends (from the transport's pool,
  /// given back to it then).
  std::vector<uint8_t>& sumBuffer(size_t bytes);

  Transport& transport_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_;  // of the exchange in progress
  // Payload bytes received or computed for the step in progress (spans returned point here);
  // given back to the transport when the step ends.
  std::vector<std::vector<uint8_t>> held_;
  std::deque<std::vector<uint8_t>> sums_;  // deque: references stay valid as it grows
  // denseRound(): our decoded chunks, as codec `none` payloads, their spans, the round (deques:
  // references stay valid as they grow).
  std::deque<std::vector<float>> dense_inputs_;
  std::deque<std::vector<std::vector<uint8_t>>> dense_payloads_;
  std::deque<std::vector<std::span<const uint8_t>>> dense_spans_;
  std::deque<ExchangeRound> dense_rounds_;
  std::vector<float> select_sums_;        // sparseReduce(): one owned chunk's sums
  std::vector<uint64_t> select_scratch_;  // ... and its candidates
  // The statistics' way round the ring in the pass in progress.
  struct Chain {
    enum class Wait { kNothing, kRecords, kFinal };
    std::vector<ExchangeRound*> rounds;         // the pass's rounds with a record, in pass order
    FrameKey key;                               // phase 3 of the first one's tensor and step
    Wait wait = Wait::kNothing;                 // rank 0: the next rank's records; others: the fold
    uint32_t next = 0;                          // rank 0: the rank whose records it folds next
    std::vector<std::vector<uint8_t>> partial;  // rank 0: the fold of ranks 0 .. next-1, per round
    std::vector<uint8_t> out;                   // what this rank posted (lent until the flush)
    std::vector<std::vector<uint8_t>> final;    // every rank's fold, per round
  } chain_;
  std::chrono::steady_clock::time_point halfway_;   // of the exchange in progress
  std::optional<uint32_t> waiting_on_;              // the rank the last wait was for
  FrameKey pass_key_;                               // the pass's first tensor and step
  std::vector<char> told_waiting_;                  // per rank: the peers were told we wait on it
  std::deque<std::vector<uint8_t>> waiting_notes_;  // posted (lent until the flush)
  uint32_t notes_sent_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> buckets_;  // (bucket key, step) of the step's headers
  uint8_t header_[20] = {};                             // this rank's bucket header (posted)
  bool bucket_checked_ = false;                         // the pass's headers were compared
  // The sparse allreduce's owners (planOwners): per unit (a select round's chunk, pass order).
  struct Balance {
    uint64_t signature = 0;         // the units measured: the rounds' keys and chunks, and W
    uint64_t step = 0;              // of the pass measured
    std::vector<uint64_t> weights;  // per unit: the entries of its global selection
  };
  std::unordered_map<uint64_t, Balance> balance_;  // by bucket key (at most kMaxBalanced)
  std::vector<size_t> unit_base_;                  // per select round: its first unit
  std::vector<uint32_t> fallback_owners_, balanced_owners_;
  uint64_t proposal_ = 0;  // XXH3-64 of balanced_owners_, in this rank's header (0: none)
  bool balanced_ = false;  // the pass's owners are balanced_owners_ (every rank proposed them)
};

/// The owners of `weights.size()` regions among `world` ranks, balanced by weight (longest
/// processing time first): the regions by weight, largest first (ties: the earlier one), each to
/// the rank with the least load so far (ties: the lower rank), a region adding its weight + 1
/// (so that empty regions spread too). docs/exchange.md "Which rank owns a region".
std::vector<uint32_t> balanceOwners(std::span<const uint64_t> weights, uint32_t world);

/// XXH3-64 of a tensor name: the `tensor` field of frames.
uint64_t tensorKey(const std::string& name);

/// The body of a `ring` statistics frame (phase 3; docs/peer-protocol.md): one fold per tensor of
/// the pass with a record, in pass order — u32 count | per fold: u32 length | bytes.
std::vector<uint8_t> packStatsEntries(const std::vector<std::vector<uint8_t>>& folds);
/// The folds of such a body, which must hold `expected` of them (views into `bytes`).
Result<std::vector<std::span<const uint8_t>>> unpackStatsEntries(std::span<const uint8_t> bytes,
                                                                 size_t expected);

}  // namespace lightwire::proxy::peer
