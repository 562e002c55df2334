#pragma once
// `codec: auto` (docs/policies.md "codec: auto"): each layer's codec chosen at run time, from a
// ladder of rungs ordered from least to most lossy, by a time model of the exchange — the link as
// the exchange measures it (LinkEstimator), the trainer's compute the hook reports — and the
// accuracy signals of the policies (critical phases move a layer towards less compression).
// Every input is in the global statistics of a step, so every rank decides alike; the decisions
// are policy state (checkpointed, told to rejoining peers, in the decision log).

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/codec.h"
#include "kernels/status.h"

namespace lightwire::policies {

/// One rung of the ladder. Plain value.
struct Rung {
  std::string text;            // as configured: "direct", "none", "fp16", "qsgd:8", "dgc:0.01"
  std::string label;           // for people: "direct", "qsgd 8 bits", "dgc 1 %"
  bool direct = false;         // the trainer's own process group; through the sidecar: `none`
  kernels::CodecConfig codec;  // the codec the sidecar sends the layer with
  std::shared_ptr<const kernels::Codec> impl;  // made from `codec` once, for the time model
  // The sidecar's CPU time per element for this codec (encode + decode, nanoseconds), part of
  // the time model: a heavily compressing codec that costs more CPU than it saves on the wire
  // is not chosen.
  double cost_ns = 0;
  // How many steps the rung needs to reach the loss a lossless exchange reaches in one (1 for
  // lossless rungs): the time model minimises step time × this — time to accuracy, not step
  // time. Defaults from the time-to-accuracy benchmarks (docs/policies.md "codec: auto"); a rung
  // may give its own (`dgc:0.01@2`).
  double steps_factor = 1;
};

/// The default ladder (docs/policies.md "codec: auto").
inline constexpr std::string_view kDefaultLadder =
    "direct,none,fp16,qsgd:8,qsgd:4,dgc:0.01:0.9,dgc:0.01";

/// Parses a ladder: comma-separated rungs from least to most lossy, each `direct` (first only),
/// `none`, `fp16`, `bf16`, `qsgd:BITS`, `topk:DENSITY`, `dgc:DENSITY` (error feedback, no
/// momentum: the optimizer keeps momentum), `dgc:DENSITY:MOMENTUM` (DGC's momentum correction:
/// the sidecar owns the layer's momentum while the rung is in force), `dgc:DENSITY:MOMENTUM:bc`
/// (the same with dgc's bias correction), `randomk:DENSITY` or
/// `powersgd:RANK`, optionally followed by `@FACTOR` (its steps factor, >= 1). At most 16 rungs,
/// none twice. Errors name the rung.
Result<std::vector<Rung>> parseLadder(std::string_view text);

/// The ladder as one text: its rungs' texts joined by commas ("" for none).
std::string ladderText(const std::vector<Rung>& ladder);

/// The `compression.auto` section (docs/configuration.md). Plain value.
struct AutoConfig {
  std::string ladder_text = std::string(kDefaultLadder);
  std::vector<Rung> ladder;      // parsed from ladder_text (filled by validate())
  uint64_t period = 10;          // re-evaluated at steps that are multiples of this
  uint32_t hysteresis = 2;       // a move to more compression: this many evaluations in a row
  double tolerance = 0.05;       // the least lossy rung within (1 + tolerance) of the fastest
  double link_change = 0.3;      // relative change of bandwidth or latency that re-decides at once
                                 // (seen at two updates of the layer in a row)
  double momentum_margin = 0.5;  // a move onto or off a rung with momentum correction: its score
                                 // must beat the best rung of the other side by (1 + this)
  uint64_t critical_steps = 0;   // early training: no move to more compression (0 = off: the
                                 // DGC warm-up of selection rungs covers early training)
  double critical_change = 0.5;  // |norm / baseline - 1| above this starts a critical phase
  uint64_t critical_hold = 20;   // ... that lasts this many steps
  uint64_t probe_every = 16;     // a direct window's length in steps (then 3 through the sidecar;
                                 // in a chain 2, and each window twice the one before)
};

/// Checks ranges and parses the ladder into `c.ladder`; errors name the key.
Status validate(AutoConfig& c);

/// The link as this sidecar's exchange measured it. Plain value.
struct Link {
  double bytes_per_s = 0;  // > 0
  double latency_s = 0;    // >= 0, per exchange round
};

/// Fits time = latency + bytes / bandwidth to the last exchanges (least squares over a window),
/// `bytes` being modelBytes() of the step's codec: the bandwidth is in the model's bytes, so that
/// predictions for other codecs are consistent with it. Not thread-safe (the engine's thread).
class LinkEstimator {
 public:
  static constexpr size_t kWindow = 16;     // the newest points
  static constexpr size_t kKeepNewest = 4;  // ... of which these are never left out as waits
  void add(double bytes, double seconds);
  std::optional<Link> estimate() const;

 private:
  std::deque<std::pair<double, double>> points_;
};

/// The bytes one rank moves for one step of a layer of `n` elements (shape: its dimensions) sent
/// with `codec` among `world` ranks: a ring allreduce for codecs whose payloads add (2(W − 1)/W of
/// a payload), an allgather otherwise ((W − 1) payloads), per round. `density`: a selection
/// codec's density for this step (the DGC warm-up sends more than the codec's own; nullopt: its
/// own).
double modelBytes(const kernels::Codec& codec, uint64_t n, const std::vector<uint64_t>& shape,
                  uint32_t world, std::optional<double> density = std::nullopt);

/// What the time model knows of one step of one layer (from the global statistics). Plain value.
struct AutoInputs {
  uint64_t elements = 0;
  std::vector<uint64_t> shape;
  uint32_t world = 1;
  std::optional<Link> link;
  double compute_s = 0;  // the layer's share of the trainer's compute per iteration
  double overlap_s = 0;  // ... of it, the share its exchange can hide behind
  // The layer's share of what the trainers' own process group added to an iteration beyond its
  // compute, as measured in direct windows (nullopt: none measured yet; then the direct rung is
  // modelled as `none` without the sidecar's CPU cost).
  std::optional<double> direct_s;
  // What the sidecar path costs beyond the modelled exchange (the trainer's copy and request, the
  // sidecar's ingest and write-back, the agreement): the measured tail of recent steps through
  // the sidecars less the model's exposed exchange of the rung in force. Added to every rung but
  // `direct`.
  double sidecar_overhead_s = 0;
  // The modelled exchange of the rung the overhead was measured with (0: none): a rung's overhead
  // is taken in proportion to its own modelled exchange, at most the whole — what the model does
  // not see of an exchange grows with it (a link's queueing, the copies of its bytes).
  double overhead_ref_s = 0;
  // Per rung: the layer's share of what an iteration took beyond its compute while the rung was
  // in force, as the hook measured it (< 0: not measured). A measured rung is judged by it, not
  // by the model: the model only ranks the rungs never tried.
  std::vector<double> measured_s;
  // Per rung: the layer's share of the compute of the iterations it carried (< 0: none): a
  // measured rung's step is this (or compute_s where none) plus its measured tail.
  std::vector<double> compute_by_s;
  const Rung* ladder_base = nullptr;  // the ladder measured_s and compute_by_s are indexed by
};

/// The model's time of one step of a layer with rung `r`: its share of the compute plus the part
/// of its exchange that does not hide behind its overlap. Needs inputs.link.
double modelStepSeconds(const Rung& r, const AutoInputs& in);
/// The exchange alone: rounds × latency + bytes / bandwidth + CPU cost.
double modelExchangeSeconds(const Rung& r, const AutoInputs& in);
/// ... of `bytes` (what the step moved: a full-sync's dense bytes, a warm-up's density) over
/// `link`, for a layer of `elements`.
double modelExchangeSeconds(const Rung& r, const Link& link, double bytes, uint64_t elements);

/// The model's time to accuracy of rung `r`: modelStepSeconds × its steps factor.
double modelScore(const Rung& r, const AutoInputs& in);
/// The index of the least lossy rung whose score is within (1 + tolerance) of the best usable
/// rung's (`usable[i]`: rung i may carry this layer). Needs inputs.link.
size_t chooseRung(const std::vector<Rung>& ladder, const std::vector<char>& usable,
                  const AutoInputs& in, double tolerance);

/// Whether a parameter server under bounded staleness can close a step with rung `r`'s codec (by
/// its traits: one round, payloads that may be summed over whoever arrived and re-compressed;
/// docs/exchange.md "bounded-staleness"). `direct` does not go through the server: true.
bool rungStalenessSafe(const Rung& r);

/// Whether rung `r` may carry a layer of this shape (powersgd needs a matrix), the trainers having
/// declared `momentum` (a rung with momentum correction M needs M declared by every trainer: their
/// optimizers then leave the layer's momentum to the sidecar).
bool rungUsable(const Rung& r, uint64_t n, const std::vector<uint64_t>& shape,
                std::optional<double> momentum = std::nullopt);

}  // namespace lightwire::policies
