#pragma once
// The statistics record one sidecar contributes to one step of one tensor, and their aggregate
// (docs/policies.md "Statistics: what every rank knows about a step"). The exchange carries every
// rank's record to every rank with the step (ExchangeRound::stats_out / stats_in), so every rank
// aggregates the same bytes in rank order and takes the same decisions. Records also carry the
// control requests that must reach every sidecar at an agreed step: compression settings proposed
// through PUT /v1/config and trainer-driven checkpoints (POST /v1/checkpoint).
//
// Layout (little-endian): "LWS1" | u16 version (4) | u16 flags (bit 0: cosine terms valid, bit 1:
// loss valid) | f64 grad_norm2 | u64 nonfinite | u64 elements | u64 small | f64 residual_norm2 |
// f64 cos_dot | f64 cos_c2 | f64 cos_g2 | f64 loss | u64 loss_step | u64 resumed_from (+1, 0 =
// none) | from version 2: f64 link bytes/s | f64 link latency s (flag bit 2: link valid) | f64
// compute s | f64 overlap s (flag bit 3: timing valid) | f64 direct s (flag bit 4) | f64 tail s
// (flag bit 5) | from version 3: f64 declared momentum (flag bit 6) | from version 4: f64 reward |
// u64 reward_step (flag bit 7: reward valid) | u32 request count | per request: u8 kind (1
// settings, 2 checkpoint) | u64 id | u64 step | u32 body length | body. Records of versions 1 to 3
// (without the parts of the later versions) are read too.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.h"

namespace lightwire::policies {

/// A control request travelling with the statistics (to every rank, at an agreed step).
struct Request {
  enum class Kind : uint8_t { kSettings = 1, kCheckpoint = 2 };
  Kind kind = Kind::kSettings;
  uint64_t id = 0;      // unique per origin sidecar (its own counter)
  uint64_t step = 0;    // checkpoint: the step whose state is saved; settings: unused (0)
  std::string body;     // settings: the compression section as JSON; checkpoint: empty
  uint32_t origin = 0;  // the rank whose record carried it (set when aggregated, not encoded)
  bool operator==(const Request&) const = default;
};

/// One rank's record of one step of one tensor. Plain value.
struct StepStats {
  double grad_norm2 = 0;      // squared L2 norm of the input (the sum of the local trainers)
  uint64_t nonfinite = 0;     // NaN/Inf values in the input
  uint64_t elements = 0;      // values in the input
  uint64_t small = 0;         // finite values with |g| < min_magnitude
  double residual_norm2 = 0;  // what the codec state holds back, before this step
  // Sampled cosine between this rank's compressed and original gradient, of its previous
  // compressed step of the tensor: sum c*g, sum c*c, sum g*g over the sampled chunk.
  std::optional<double> cos_dot, cos_c2, cos_g2;  // all set or none
  std::optional<double> loss;                     // the last loss the trainer reported...
  uint64_t loss_step = 0;                         // ... and its step
  std::optional<double> reward;                   // the last reward the trainer reported...
  uint64_t reward_step = 0;                       // ... and its step
  std::optional<uint64_t>
      resumed_from;  // the step this sidecar last resumed from (POST /v1/resume)
  // `codec: auto` (policies/auto.h): the link as this sidecar's exchange measured it, and the
  // trainers' compute per iteration that falls to this tensor (and the part of it its exchange
  // can hide behind), as the hook reported them.
  std::optional<double> link_bytes_per_s, link_latency_s;  // both set or none
  std::optional<double> compute_s, overlap_s;              // both set or none
  // What the trainers' own process group added beyond the compute, in direct windows, and what
  // the sidecars added in the other steps (the hook's measurements).
  std::optional<double> direct_s, tail_s;
  // The momentum the trainers' optimizer takes back from the sidecar (dgc's momentum correction,
  // a `dgc:D:M` rung of codec auto), when every local trainer declared the same one.
  std::optional<double> momentum;
  std::vector<Request> requests;
};

/// The aggregate of every rank's record of a step (sums in rank order). Plain value.
struct GlobalStats {
  uint32_t ranks = 0;  // records aggregated
  double grad_norm2 = 0;
  uint64_t nonfinite = 0, elements = 0, small = 0;
  double residual_norm2 = 0;
  uint32_t cos_ranks = 0;  // records with cosine terms
  double cos_dot = 0, cos_c2 = 0, cos_g2 = 0;
  uint32_t loss_ranks = 0;  // records with a loss
  double loss_sum = 0;
  uint64_t loss_step = 0;     // the largest step of the losses reported
  uint32_t reward_ranks = 0;  // records with a reward
  double reward_sum = 0;
  uint64_t reward_step = 0;                           // the largest step of the rewards reported
  std::vector<std::optional<uint64_t>> resumed_from;  // per aggregated record, rank order
  std::vector<Request> requests;                      // rank order, then the origin's order
  // `codec: auto`: the fastest link any rank measured (most bandwidth, least latency: the rank
  // that waited least for its peers; nullopt: none did), and the median of the compute (and of
  // the overlap) the ranks reported (nullopt: none did).
  std::optional<double> link_bytes_per_s, link_latency_s;
  std::optional<double> compute_s, overlap_s;
  std::optional<double> direct_s, tail_s;  // the most any rank reported
  // The trainers' declared momentum when every record declared the same (nullopt otherwise): a
  // rung with momentum correction is usable only then.
  std::optional<double> momentum;

  /// The global cosine similarity, when measured: sum dot / sqrt(sum c2 * sum g2).
  std::optional<double> cosine() const;
  /// The mean reported loss, when any rank reported one.
  std::optional<double> loss() const;
  /// The mean reported reward, when any rank reported one.
  std::optional<double> reward() const;
};

std::vector<uint8_t> encodeStats(const StepStats& s);
/// Parses a record strictly (every length against what remains; at most kMaxStatsBytes as the
/// exchange enforces; at most 16 requests, settings bodies at most 48 KiB).
Result<StepStats> decodeStats(std::span<const uint8_t> bytes);
/// The median of `v` (not empty; of an even count, the mean of the middle two).
double median(std::vector<double> v);

/// Decodes and sums the records (index = rank; empty entries are ranks without a record). Errors
/// name the rank whose record is malformed.
Result<GlobalStats> aggregate(const std::vector<std::vector<uint8_t>>& records);

/// The records of some ranks folded in rank order (docs/policies.md "Statistics: what every rank
/// knows about a step"): the sums so far, in the order aggregate() adds them, and the parts
/// that stay per rank — resume marks (as runs of equal values), compute and overlap figures
/// (their medians are taken at the end), requests with their origin. What the `ring` topology
/// passes round the ring instead of every record to every rank (docs/exchange.md).
struct PartialStats {
  GlobalStats g;                           // compute_s / overlap_s unset until finished
  uint32_t next_rank = 0;                  // records of ranks below this are folded (or absent)
  bool momentum_agreed = true;             // every record so far declared the same momentum
  std::vector<double> computes, overlaps;  // per record with timing, rank order
};

/// Folds `rank`'s record into `partial` (empty: nothing folded yet), both as bytes: the
/// encoded partial of the records so far and this one. Ranks must come in increasing order.
/// Errors: a malformed partial or record (the record's naming the rank), a rank out of order.
/// Folding every rank's record one after the other and finishing gives exactly aggregate().
Result<std::vector<uint8_t>> foldStats(std::span<const uint8_t> partial,
                                       std::span<const uint8_t> record, uint32_t rank);
/// The aggregate of a fold (strictly parsed; the medians taken).
Result<GlobalStats> finishStats(std::span<const uint8_t> partial);
/// When the records disagree about the step their sidecars resumed from (POST /v1/resume): what
/// to tell the trainers (the step fails on every rank alike).
std::optional<std::string> resumeMismatch(const GlobalStats& g);

}  // namespace lightwire::policies
