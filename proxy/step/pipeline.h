#pragma once
// The step pipeline (docs/architecture.md "The step pipeline"): one step of one tensor, top to
// bottom, as a handful of stages — plan (settings, policies, codec and state), begin (the host or
// the GPU backend), ingest (local sum, delayed sync), prepare (schedules, full-sync flush),
// statistics, exchange (compress and exchange, round by round), decode, guard (result
// checksums), policies, write-back, commit. Every data operation goes through the
// StepBackend (backend.h), so the stages read the same for the host and the GPU.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "policies/policy.h"
#include "proxy/step/backend.h"
#include "proxy/step/engine.h"

namespace lightwire::proxy {

/// Sums of a sampled chunk for the cosine similarity of a compressed gradient (policies).
struct CosineTerms {
  double dot = 0, c2 = 0, g2 = 0;
};
/// Decodes `payload` (one chunk) and returns its sums against `original` (nullopt: not finite or
/// not decodable). `scratch` is reused.
std::optional<CosineTerms> cosineTerms(const kernels::Codec& codec,
                                       std::span<const uint8_t> payload, const float* original,
                                       size_t len, std::vector<float>& scratch);

/// Elements per chunk of a tensor of `n` elements (docs/exchange.md "One step"): the configured
/// `chunk_elements`, except that an elementwise codec (`none`, `fp16`, `bf16`: a chunk's result
/// does not depend on where the chunks end) of more than kRingSplitMinElements elements gets at
/// least `world` chunks — at most ⌈n / world⌉ elements each, never fewer than
/// kRingSplitMinElements — so that every rank owns a chunk of the ring and no layer is one serial
/// chain of 2(W − 1) hops. A sparse allreduce (`global_select`) is split the same way, so that
/// every rank owns a region of the index space (the chunks' boundaries are part of its result:
/// each chunk keeps its share of k).
constexpr size_t kRingSplitMinElements = size_t{1} << 16;
size_t ringChunkElements(const kernels::Codec& codec, size_t n, size_t chunk_elements,
                         uint32_t world, bool global_select = false);

/// peer.sparse auto (docs/exchange.md "Sparse allreduce"): whether the sparse allreduce of a
/// selection codec's layer of `n` elements among `world` sidecars moves fewer bytes per rank than
/// the allgather (or the dense allreduce it switches to), by the codec's nominal payload size at
/// the step's `density` — from the configuration only, so every rank decides alike (threshold,
/// whose size is not known ahead: from 3 sidecars on).
bool sparseAllreduceIsSmaller(const kernels::Codec& codec, size_t n, uint32_t world,
                              std::optional<double> density);

/// One step of one tensor through its stages. Lives for one step on the thread that runs it (the
/// engine's, or a submitting one for small steps); the tensor is the engine thread's meanwhile.
class StepPipeline {
 public:
  StepPipeline(StepEngine& engine, StepEngine::Tensor& tensor, uint64_t step,
               StepEngine::Pending& pending);
  ~StepPipeline();
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;

  /// Runs every stage; the outcome carries the figures (also of a failed step, as far as it got).
  StepOutcome run();

  /// One step of every layer of a bucket (docs/architecture.md "A bucket's layers: one step"):
  /// each layer's stages up to its exchange, then every layer's exchange round r together in one
  /// Exchange::runAll (round by round while any layer has rounds left), then the stages after it,
  /// and only when every layer got that far, their write-backs and commits. A layer that fails
  /// fails the bucket: every layer's outcome is that failure (the message names the layer), no
  /// layer commits. A layer whose step is a local accumulation step (delayed sync) has no
  /// exchange and ends on its own. Outcomes in the order of `pipelines`.
  static std::vector<StepOutcome> runBucket(std::vector<std::unique_ptr<StepPipeline>>& pipelines);

 private:
  /// Why a stage stops the step; nullopt: the next stage runs.
  struct Stop {
    StepError error;
    std::string message;
  };
  using Stage = std::optional<Stop>;

  Stage checkBuffers();
  Stage plan();
  Stage makeCodec();
  Stage makeState();
  Stage begin();
  Stage ingest();
  Stage prepare();
  Stage statistics();
  // The stages before the exchange (nullopt: it runs), then the exchange: beginExchange() (the
  // whole-tensor analysis), each round opened (its ExchangeRound, round_) and closed with what
  // the exchange returned, endExchange(); the stages after it, then writeBack() and commit().
  Stage beforeExchange();
  Stage beginExchange();
  Stage openRound(int round);
  Stage closeRound(int round, Result<std::vector<std::vector<std::span<const uint8_t>>>> got);
  void endExchange();
  Stage afterExchange();
  Stage exchangeRound(int round);
  Result<std::span<const uint8_t>> encode(int round, size_t chunk);
  Stage settle();
  void noteSparseChoice();
  Stage decode();
  Stage guard();
  Stage policies();
  Stage accumulate();
  Stage writeBack();
  void commit();
  void record();
  /// The bytes this step moved in the time model of codec: auto (policies/auto.h modelBytes).
  double modelBytes() const;
  /// Feeds the engine's link estimate with a step's bytes and exchange time (engine thread).
  static void measureLink(StepEngine& engine, double bytes, double exchange_us);
  StepOutcome skipped();
  StepOutcome stopped(Stop stop);
  /// A backend operation's failure as a Stop (its error kind: the backend's).
  Stop backendFailed(const Status& st) const { return {backend_->failure(), st.message()}; }

  StepEngine& engine_;
  StepEngine::Tensor& t_;
  const uint64_t step_;
  StepEngine::Pending& p_;
  const size_t n_;
  const unsigned trainers_;
  policies::PolicyEngine* const policy_;
  std::chrono::steady_clock::time_point t0_;
  StepOutcome out_;

  TensorSettings settings_;
  policies::StepPlan plan_;
  std::optional<policies::AutoStep> auto_;  // codec: auto: the rung of this step
  std::optional<int> gpu_ordinal_;  // where the GPU backend runs the step (nullopt: the host)
  std::unique_ptr<StepBackend> backend_;
  // makeCodec() -> makeState(): the committed state, on the host, of a tensor whose shape
  // changed its size (PowerSGD's warm start), to be made again with its error kept.
  kernels::CodecState carried_;
  kernels::StepContext ctx_;
  kernels::Chunking chunking_;
  bool dense_step_ = false;            // bypass and full sync: codec `none`
  bool select_globally_ = false;       // a sparse allreduce: encoded with defer_sent, settled after
  std::optional<bool> sparse_choice_;  // peer.sparse auto: this step's choice (when it had one)
  const kernels::Codec* step_codec_ = nullptr;  // the codec this step encodes with
  std::vector<uint8_t> record_;                 // this sidecar's statistics record
  std::vector<std::vector<uint8_t>> stats_in_;
  bool stats_folded_ = false;       // stats_in_ is one fold of every rank's record (ExchangeRound)
  std::optional<CosineTerms> cos_;  // of this step, measured on one chunk while it is encoded
  // The exchange rounds.
  int rounds_ = 1;
  std::optional<ExchangeRound> round_;                          // the open round
  std::chrono::steady_clock::time_point round_started_;         // when it went to the exchange
  std::vector<std::vector<std::span<const uint8_t>>> reduced_;  // per chunk: payloads to decode
  std::vector<std::span<const uint8_t>> round_payloads_;        // multi-round: reduced per round
  std::vector<std::span<const uint8_t>> mine_;                  // this round's own payloads
  std::vector<std::span<const uint8_t>> selected_;  // a global selection's, per chunk (commit)
  std::vector<char> encoded_;                       // ... encoded yet
  std::vector<char> decoded_;  // decoded during the exchange (ExchangeRound::on_chunk)
  double round_compress_us_ = 0.0, early_decode_us_ = 0.0;
  double exchange_us_ = 0.0, compress_us_ = 0.0;
  uint32_t contributors_ = 0;
  bool dense_result_ = false;
  bool nonfinite_ = false;
  // A delayed-sync accumulation step in a bucket: it accumulates only once every other layer of
  // the bucket wrote back (runBucket), so that a failed bucket leaves its accumulation as it was.
  bool defer_accumulation_ = false;
};

}  // namespace lightwire::proxy
