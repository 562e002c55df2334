#pragma once
// The `ps` topology (docs/exchange.md "The `ps` topology") as the step engine's Exchange: every
// sidecar pushes its chunk payloads to the parameter-server sidecar (rank PsOptions::server_rank,
// itself also a worker with trainers of its own), which combines them and broadcasts one payload
// per chunk back to everyone, so every rank decodes the same bytes.
//
//   - summable codecs and every round of multi-round codecs (sync only): the server sums the
//     payloads in the compressed domain, left fold in rank order ((p0 + p1) + p2) + ...;
//   - other codecs (and every codec under bounded staleness): the server decodes the payloads into
//     a dense fp32 sum (rank order), then re-compresses the sum with a server-side codec of its
//     own (the tensor's settings with momentum 0 and clipping off, its own error-feedback state,
//     the Philox stream `world_size`), so the downlink is compressed too and what the server's
//     re-compression drops stays in its residual. The server's state is committed in stepDone()
//     for a step that was not aborted.
//
// Every broadcast payload starts with a small header: u32 LE contributor count, then a bitmap of
// the ranks whose contribution to this step it holds (ceil(W/8) bytes, bit r % 8 of byte r / 8).
//
// bounded staleness: the server closes step t without the sidecars that have not pushed it yet
// when each of them is within the bound (its latest contribution the server holds is of step
// >= t - S) and straggler_wait has passed since the last arrival; a late push is folded into the
// next aggregate the server builds; the divisor is the number of contributions in the sum.
//
// Policy statistics records (ExchangeRound::stats_out, round 0): a worker sends its record to the
// server right before its push (frame phase 7); the server takes the records of the step's
// contributors (its own included) and sends them to every rank as one frame (phase 8,
// encodePsStats) right before its broadcast, so every rank fills the same stats_in. A late
// contribution's record (bounded staleness) is dropped: only the step's own contributors' records
// travel. Records are expected iff this rank has one: every rank of a job sends one, or none.
//
// Every wait has the exchange deadline; a failure fails the step here and is sent to every peer as
// an abort (Transport::abortStep).

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/codec.h"
#include "proxy/exchange/exchange.h"
#include "proxy/peer/transport.h"

namespace lightwire::proxy::peer {

/// Settings of the `ps` topology (config keys peer.ps_rank, peer.synchrony, peer.staleness,
/// peer.straggler_wait_s). Plain value.
struct PsOptions {
  uint32_t server_rank = 0;
  bool bounded_staleness = false;  // false = sync
  uint32_t staleness = 2;          // bound S (bounded staleness)
  std::chrono::milliseconds straggler_wait{20};
  uint32_t seed = 0;  // job seed (Philox key word 0), as EngineOptions::seed
};

/// The broadcast header of the `ps` topology (docs/exchange.md): u32 LE contributor count, then
/// ceil(W/8) bytes of bitmap of the ranks whose contribution to this very step the sum holds.
struct PsHeader {
  uint32_t count = 0;
  std::vector<bool> ranks;  // size W
};
size_t psHeaderBytes(uint32_t world_size);
void appendPsHeader(const PsHeader& h, std::vector<uint8_t>& out);
/// Parses the header at the start of `payload`; errors when it is short or names ranks >= W.
Result<PsHeader> parsePsHeader(std::span<const uint8_t> payload, uint32_t world_size);

/// The server's broadcast of a step's policy statistics records (docs/exchange.md): u32 LE count,
/// then per record u32 LE rank, u32 LE length, `length` bytes; ranks ascending. `by_rank` (index =
/// rank): the records, an empty entry = none (not a contributor).
std::vector<uint8_t> encodePsStats(const std::vector<std::vector<uint8_t>>& by_rank);
/// Parses it strictly (every length against what remains, ranks < W, ascending, each once, each
/// record non-empty and at most kMaxStatsBytes, nothing after the last); returns W entries.
Result<std::vector<std::vector<uint8_t>>> parsePsStats(std::span<const uint8_t> payload,
                                                       uint32_t world_size);

/// The `ps` topology over a Transport. Used by one engine thread at a time (the engine runs one
/// step at a time); the spans run() returns stay valid until stepDone() of that step.
class PsExchange final : public Exchange {
 public:
  PsExchange(Transport& transport, std::chrono::milliseconds timeout, PsOptions options);
  ~PsExchange() override;
  PsExchange(const PsExchange&) = delete;
  PsExchange& operator=(const PsExchange&) = delete;

  unsigned worldSize() const override { return transport_.worldSize(); }
  Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& round) override;
  /// Through the server: every rank sends its 8-byte checksum to the server, which answers every
  /// rank with all W checksums (8 W bytes, rank order); each rank names those that differ.
  Result<std::vector<uint32_t>> compareResults(const std::string& tensor, uint64_t step,
                                               uint64_t checksum) override;
  void abort(const std::string& tensor, uint64_t step, const std::string& reason) override;
  void stepDone(const std::string& tensor, uint64_t step) override;

  bool isServer() const { return transport_.rank() == options_.server_rank; }

 private:
  using Spans = std::vector<std::vector<std::span<const uint8_t>>>;
  struct ServerTensor;
  struct Pending;

  Result<Spans> worker(ExchangeRound& r, uint64_t tensor);
  Result<Spans> server(ExchangeRound& r, uint64_t tensor);
  /// Bounded staleness: waits for the step's pushes and late ones; fills `ontime` (per rank, the
  /// chunk payloads; empty = missing).
  Status gatherBounded(ExchangeRound& r, uint64_t tensor, ServerTensor& st,
                       std::chrono::steady_clock::time_point deadline,
                       std::vector<std::vector<std::vector<uint8_t>>>& ontime,
                       std::vector<bool>& present);
  using OnTime = std::vector<std::vector<std::vector<uint8_t>>>;  // [rank][chunk] payload
  Status gatherSync(const ExchangeRound& r, uint64_t tensor,
                    std::chrono::steady_clock::time_point deadline, OnTime& ontime,
                    std::vector<bool>& present);
  Status receiveRecords(const ExchangeRound& r, uint64_t tensor, const std::vector<bool>& present,
                        std::chrono::steady_clock::time_point deadline,
                        std::vector<std::vector<uint8_t>>& records);
  /// Rank k's payload of chunk c (this rank's own, or what it pushed).
  std::span<const uint8_t> payloadOf(const ExchangeRound& r, const OnTime& ontime, uint32_t k,
                                     size_t c) const;
  Status sumCompressed(const ExchangeRound& r, const OnTime& ontime,
                       std::vector<std::span<const uint8_t>>& combined);
  Status sumDense(const ExchangeRound& r, ServerTensor& st, const OnTime& ontime,
                  const std::vector<bool>& present, Pending& pending,
                  std::vector<std::span<const uint8_t>>& combined);
  /// The server's codec for the tensor of `r` (created or refreshed), or an error.
  Status prepareServerCodec(const ExchangeRound& r, ServerTensor& st);
  /// Sends `stats` (a statistics broadcast, empty = none) and then every chunk of `combined` (with
  /// `header`) to every other rank; fills `out` with this rank's view of the combined payloads.
  Status broadcast(const ExchangeRound& r, uint64_t tensor, const PsHeader& header,
                   const std::vector<std::span<const uint8_t>>& combined,
                   std::span<const uint8_t> stats, std::chrono::steady_clock::time_point deadline,
                   Spans& out);
  Status fail(uint64_t tensor, uint64_t step, Status s);

  Transport& transport_;
  std::chrono::milliseconds timeout_;
  PsOptions options_;
  // Payload bytes received or computed for the step in progress (spans returned point here).
  std::vector<std::vector<uint8_t>> held_;
  // Server only: per tensor name.
  std::map<std::string, std::unique_ptr<ServerTensor>> tensors_;
  // Server only: what stepDone() commits for the step whose exchange completed.
  std::unique_ptr<Pending> pending_;
  // (tensor, step) aborted here since its run: its server state is not committed.
  std::optional<std::pair<uint64_t, uint64_t>> aborted_;
};

}  // namespace lightwire::proxy::peer
