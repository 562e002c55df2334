#pragma once
// The seam between the collectives and the wire (docs/peer-protocol.md "Connections"): a
// Transport connects this sidecar to every other sidecar of the job, authenticates them, and moves
// frames. Collectives (proxy/peer/collective.h) only send frames to a rank and wait for the frame
// with a given key from a rank, with a deadline. The session protocol is written once
// (proxy/peer/session.h) over the links of the `tcp` (Boost.Asio, proxy/peer/tcp_transport.h) and
// `ucx` (UCX ucp active messages, proxy/peer/ucx_transport.h) transports.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.h"

namespace lightwire::proxy::peer {

/// Frame types (docs/peer-protocol.md).
enum class FrameType : uint8_t {
  kHello = 1,      // handshake: version, job, rank, nonce
  kChallenge = 2,  // handshake: the other side's nonce and its HMAC proof
  kAuth = 3,       // handshake: the connecting side's HMAC proof
  kData = 4,       // a payload of one (tensor, step, round, chunk) from `src`
  kAbort = 5,      // the step (tensor, step) failed on `src`; payload: UTF-8 reason
  kPing = 6,       // liveness (round-trip time)
  kPong = 7,
  kRegister = 8,  // rendezvous: a rank's peer address ("host:port", or ":port"), to rank 0
  kPeers = 9,     // rendezvous: every rank's peer address, one per line, from rank 0
  kState = 10,    // the job state as the sender knows it (step counters), on every (re)connect
};

/// What identifies a data or abort frame within a job. Plain value.
struct FrameKey {
  uint64_t tensor = 0;  // XXH3-64 of the tensor name
  uint64_t step = 0;
  uint8_t round = 0;  // exchange round of multi-round codecs
  uint8_t phase = 0;  // collective phase (e.g. 0 reduce-scatter, 1 allgather)
  uint32_t chunk = 0;
  uint32_t origin = 0;  // the rank whose contribution this is (allgather), or the chunk owner
  bool operator==(const FrameKey&) const = default;
};

/// A received frame: its key, the sending rank, its payload.
struct Frame {
  FrameType type = FrameType::kData;
  FrameKey key;
  uint32_t src = 0;
  uint8_t codec = 0;
  std::vector<uint8_t> payload;
};

/// A frame whose arrival ends a wait early (Transport::receiveOrWake).
struct Wake {
  uint32_t src = 0;
  FrameKey key;
};

/// Membership of one job, as configured (docs/exchange.md "Membership").
struct Membership {
  std::string job_id;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::vector<std::string> peers;  // "host:port" of every rank, index = rank
  std::string secret;              // job secret (HMAC key); never logged
  // Rendezvous instead of `peers` (which is then empty): rank 0's peer address. Every other rank
  // connects to rank 0 there, tells it `advertise` (its own peer address; "" = this transport's
  // port on the address rank 0 sees the connection come from), and learns every rank's address.
  std::string rendezvous;
  std::string advertise;
};

/// Moves frames between the sidecars of a job. Thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;
  /// The port the transport listens on (bound at creation).
  virtual uint16_t port() const = 0;
  /// Validates the membership and starts connecting (returns at once; see allConnected()).
  /// Once only.
  virtual Status start(Membership membership) = 0;
  virtual uint32_t rank() const = 0;
  virtual uint32_t worldSize() const = 0;

  /// Sends a DATA (or ABORT) frame to `dst`; returns when the frame is handed to the OS (or
  /// fails: peer down, deadline passed). The payload is not retained. A frame already partly
  /// written when the deadline passes cannot be abandoned: the connection to `dst` is closed.
  virtual Status send(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                      std::span<const uint8_t> payload,
                      std::chrono::steady_clock::time_point deadline) = 0;

  /// Like send(), but returns once the frame is queued, so a collective can go on (receive,
  /// add) while its frames travel. `payload` is lent until flush() returns and must not change
  /// before. Errors of posted frames (peer down, deadline passed) are reported by flush(); a frame
  /// of a lost connection also fails the receives that wait for that peer.
  virtual Status post(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                      std::span<const uint8_t> payload,
                      std::chrono::steady_clock::time_point deadline) {
    return send(dst, type, key, codec, payload, deadline);
  }
  /// Waits until every frame post()ed so far is handed to the OS (or failed); returns the first
  /// error. At the deadline, frames still queued are dropped and a connection with a frame half
  /// written is closed (as send() does), so no lent payload is referenced after it returns.
  virtual Status flush(std::chrono::steady_clock::time_point /*deadline*/) { return Status::ok(); }

  /// Gives a received payload's buffer back for reuse by later frames (optional; saves the
  /// allocation, zero-fill and page faults of a fresh buffer per frame).
  virtual void recycle(std::vector<uint8_t> /*buffer*/) {}

  /// Like post(), but the frame owns `payload`: once the frame is written, the buffer goes back
  /// to the pool recycle() fills, at the next reclaim() or flush(), so a collective holds only
  /// the frames in flight, not a step's worth. The caller may still read the buffer (through a
  /// span taken before the move) until it calls reclaim() or flush(); on an error it is gone.
  virtual Status postOwned(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                           std::vector<uint8_t> payload,
                           std::chrono::steady_clock::time_point deadline) = 0;
  /// Buffers of postOwned() frames already written go back to the pool (see postOwned()).
  virtual void reclaim() = 0;
  /// A buffer of `n` bytes for a payload, a recycled one where one fits (its bytes unspecified).
  virtual std::vector<uint8_t> takeBuffer(size_t n) = 0;
  /// Bytes of received frames' buffers kept for reuse
  /// (lightwire_buffer_pool_bytes{pool="receive"}).
  virtual uint64_t pooledBytes() { return 0; }

  /// Waits for the frame with `key` from `src` (data), or for an abort of (key.tensor, key.step)
  /// from any rank; frames that arrive for other keys are kept until asked for (or until their
  /// step is discarded). Errors: deadline passed (naming `src`), the peer's connection lost (or
  /// not up when called, unless the frame was already kept), an abort received (its reason), a
  /// malformed frame (naming the peer).
  virtual Result<Frame> receive(uint32_t src, const FrameKey& key,
                                std::chrono::steady_clock::time_point deadline) = 0;
  /// receive(), which also returns as soon as the frame `wake.key` from `wake.src` has arrived:
  /// then nullopt, and that frame stays kept for a receive() of its own. For a collective with
  /// a second frame to pass on whenever it comes (docs/exchange.md "Policy statistics
  /// records"). This default never wakes.
  virtual Result<std::optional<Frame>> receiveOrWake(
      uint32_t src, const FrameKey& key, const Wake& /*wake*/,
      std::chrono::steady_clock::time_point deadline) {
    auto got = receive(src, key, deadline);
    if (!got) return got.status();
    return std::optional<Frame>(std::move(*got));
  }

  /// Tells every peer that (tensor, step) failed here, so they fail it at once rather than at
  /// their deadline. Best effort.
  virtual void abortStep(uint64_t tensor, uint64_t step, const std::string& reason) = 0;

  /// (tensor, step) starts on this side: aborts of it count again even if an earlier attempt of
  /// it was discarded (a step retried after a resume).
  virtual void beginStep(uint64_t /*tensor*/, uint64_t /*step*/) {}
  /// Drops kept frames of (tensor, steps <= step): the step is over on this side; a late abort
  /// of it is stale and ignored (until beginStep()).
  virtual void discard(uint64_t tensor, uint64_t step) = 0;

  /// The job state (docs/peer-protocol.md "After the handshake") this sidecar tells every peer
  /// once connected (`provide`), and what to do with a peer's (`take`, called on the transport's
  /// thread with the sender's rank). Set before start(); transports without it neither send nor
  /// take state.
  virtual void setJobState(std::function<std::vector<uint8_t>()> /*provide*/,
                           std::function<void(uint32_t, std::span<const uint8_t>)> /*take*/) {}

  /// Sends the job state (setJobState's `provide`) to every connected peer now, not only at
  /// connect: a change every sidecar must learn at once (a resume). Best effort.
  virtual void broadcastState() {}

  /// Whether every peer is connected and authenticated (readyz), and per peer (peer_up; index =
  /// rank, our own rank reads true).
  virtual bool allConnected() const = 0;
  /// Reads the TLS certificate, key and CA files again for the connections made from then on;
  /// the previous ones stay in use on an error. Transports without TLS say so.
  virtual Result<std::string> reloadTls() {
    return failedPrecondition("this peer transport has no TLS to reload");
  }
  /// This node's peer TLS certificate in force (after the last reload); none without TLS.
  struct TlsCertificate {
    std::string file;           // peer.tls.cert_file
    std::string subject;        // "/CN=node0"
    int64_t not_after = 0;      // end of validity, Unix time (0: unreadable)
    std::string not_after_utc;  // the same as "2027-03-01T12:00:00Z" ("" when unreadable)
  };
  virtual std::optional<TlsCertificate> tlsCertificate() const { return std::nullopt; }
  virtual std::vector<bool> peersUp() const = 0;
};

}  // namespace lightwire::proxy::peer
