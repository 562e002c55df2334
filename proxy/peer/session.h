#pragma once
// The peer-session protocol of docs/peer-protocol.md written once, for every transport: the HMAC
// handshake (HELLO / CHALLENGE / AUTH), what a received frame does (mailboxes, aborts, pings,
// job state), liveness, the job state told on connect, send deadlines, abort / discard /
// beginStep, and which peers are up. A transport (proxy/peer/tcp_transport.h,
// proxy/peer/ucx_transport.h) sets up its connections, moves the bytes of each as a Link, and
// drives the PeerSession from its own thread (the link thread: Asio's io_context thread for tcp,
// the progress thread for ucx); the session hands work to that thread through the transport's
// `post` function and never blocks it.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/mailbox.h"
#include "proxy/peer/sockaddr.h"
#include "proxy/peer/transport.h"

namespace lightwire::metrics {
class Metrics;
}

namespace lightwire::proxy::peer {

inline constexpr uint32_t kNoPeer = UINT32_MAX;

struct Link;

/// One frame handed to a Link, and the outcome the sender waits for. Its outcome fields are
/// guarded by the session's mutex (PeerSession::mutex()).
struct SendOp {
  std::array<uint8_t, kHeaderBytes> header{};
  std::vector<uint8_t> owned;        // internal frames own their payload ...
  std::span<const uint8_t> payload;  // ... send() lends it until done
  std::shared_ptr<Link> link;
  std::function<void(bool)> on_sent;  // link thread, once handed over (ok?), before completion
  uint32_t dst = kNoPeer;
  bool data = false;  // a DATA frame (lightwire_peer_data_frames_sent_total)
  bool done = false;
  bool give_back = false;  // postOwned(): `owned` goes back to the pool once written
  bool timed_out = false;  // its deadline passed (dropped from a queue, or its link closed)
  std::string error;       // empty: sent
};

/// One connection to a peer (bytes in, bytes out), before and after its handshake, as the
/// session sees it. Its fields and methods belong to the link thread unless said otherwise.
struct Link : std::enable_shared_from_this<Link> {
  virtual ~Link() = default;
  /// Any thread: hands `op` to the link thread, which queues it; the link completes it with
  /// PeerSession::complete() once written or failed.
  virtual void post(std::shared_ptr<SendOp> op) = 0;
  /// Queues a frame that owns its payload (ping, pong, abort, state); nobody waits for it.
  virtual void sendOwned(FrameType type, const FrameKey& key, std::vector<uint8_t> payload) = 0;
  /// `op`'s deadline passed: drop it, or close the link when it cannot be withdrawn, so that it
  /// completes (a lent payload is never referenced afterwards).
  virtual void abandon(const std::shared_ptr<SendOp>& op) = 0;
  /// Closes the link; a peer's link marks the peer down (PeerSession::linkClosed).
  virtual void close(const std::string& reason) = 0;

  uint32_t peer = kNoPeer;  // set once authenticated
  std::string name;         // "rank N" or the remote address, for messages
  std::string address;
  std::chrono::steady_clock::time_point last_rx = std::chrono::steady_clock::now();
};

/// The connecting side's handshake: HELLO out, CHALLENGE verified, AUTH out. Plain value.
struct ClientHandshake {
  uint32_t server = kNoPeer;
  Nonce client_nonce{};
};

/// The accepting side's handshake: HELLO checked, CHALLENGE out, AUTH verified. Plain value.
struct ServerHandshake {
  uint32_t client = kNoPeer;  // the rank HELLO claimed (CHALLENGE sent)
  Nonce client_nonce{};
  Nonce server_nonce{};
};

/// Settings of a PeerSession (the transports' options of the same names). Plain value.
struct SessionOptions {
  std::chrono::milliseconds ping_interval{1000};
  std::chrono::milliseconds peer_timeout{10000};
  uint64_t max_frame_bytes = kDefaultMaxFrameBytes;
  uint64_t max_kept_bytes_per_peer = uint64_t{4} << 30;
  uint64_t max_kept_frames_per_peer = 65536;
};

/// The protocol state of one transport's job: membership, mailboxes, the authenticated link of
/// every peer. Thread-safe as Transport is: the Transport-facing methods may be called from any
/// thread after start(); those documented "link thread" only from the transport's thread.
class PeerSession {
 public:
  using Clock = std::chrono::steady_clock;
  using Post = std::function<void(std::function<void()>)>;

  PeerSession(const SessionOptions& options, metrics::Metrics& metrics);
  PeerSession(const PeerSession&) = delete;
  PeerSession& operator=(const PeerSession&) = delete;

  /// How work reaches the link thread. Set once, before start().
  void setPost(Post post) { post_ = std::move(post); }
  /// The message refusing a HELLO from `client`, which does not connect to us (rank order).
  void setWrongDirection(std::function<std::string(const std::string&, uint32_t)> f) {
    wrong_direction_ = std::move(f);
  }
  /// What a REGISTER or PEERS frame does (the rendezvous); without it, it closes the link.
  void setRendezvous(std::function<void(const std::shared_ptr<Link>&, const FrameHeader&,
                                        const std::vector<uint8_t>&)>
                         f) {
    rendezvous_ = std::move(f);
  }

  // --- start -------------------------------------------------------------------------------------

  /// Transport::start()'s checks of `m`; `rendezvous` checks (and may fill in) a membership with
  /// a rendezvous address, in place of the checks of `peers`.
  static Status checkMembership(Membership& m,
                                const std::function<Status(Membership&)>& rendezvous);
  /// Takes the (checked) membership: every peer down. Before the link thread starts.
  void begin(Membership m);
  bool started() const { return started_; }
  /// Whether start() was called before (and now it has been).
  bool markStarted() { return started_.exchange(true); }
  const Membership& membership() const { return membership_; }
  uint64_t jobHash() const { return job_hash_; }
  bool rendezvousMode() const { return !membership_.rendezvous.empty(); }
  /// Whether rank a opens the connection between a and b: the lower rank, except that with a
  /// rendezvous every rank connects to rank 0 (it cannot know their addresses before).
  bool initiates(uint32_t a, uint32_t b) const;
  HeaderChecks checks(std::optional<uint32_t> src, uint64_t max) const {
    return HeaderChecks{job_hash_, membership_.world_size, membership_.rank, src, max};
  }
  /// The header of a frame of ours.
  std::array<uint8_t, kHeaderBytes> header(FrameType type, const FrameKey& key, uint8_t codec,
                                           std::span<const uint8_t> payload) const;
  /// An internal frame (ping, pong, abort, state, handshake) that owns its payload.
  std::shared_ptr<SendOp> ownedOp(FrameType type, const FrameKey& key,
                                  std::vector<uint8_t> payload) const;
  PeerMailboxes& mail() { return mail_; }
  std::mutex& mutex() const { return mail_.mutex(); }
  metrics::Metrics& metrics() { return metrics_; }
  const SessionOptions& options() const { return options_; }
  /// The transport shuts down: losses are no longer logged, refusals not counted. Any thread.
  void setStopping() { stopping_ = true; }
  bool stopping() const { return stopping_; }

  // --- handshake (docs/peer-protocol.md "Handshake") ---------------------------------------------

  /// Client: the HELLO to `server`, with a fresh nonce kept in `hs`.
  Result<std::array<uint8_t, kHelloBytes>> hello(ClientHandshake& hs, uint32_t server) const;
  /// Client: verifies the server's CHALLENGE; the AUTH to send back.
  Result<Mac> answerChallenge(const ClientHandshake& hs, std::span<const uint8_t> challenge) const;
  /// Server: checks the HELLO (header source `client`) from `name`; the CHALLENGE to answer.
  Result<std::array<uint8_t, kChallengeBytes>> answerHello(ServerHandshake& hs,
                                                           const std::string& name, uint32_t client,
                                                           std::span<const uint8_t> hello) const;
  /// Server: verifies the client's AUTH.
  Status checkAuth(const ServerHandshake& hs, const std::string& name,
                   std::span<const uint8_t> auth) const;
  /// Link thread: makes `link` the connection of rank `peer` (refused when that rank is already
  /// connected) and logs it with `detail` ("address, ...").
  Status install(const std::shared_ptr<Link>& link, uint32_t peer, const std::string& detail);
  /// Link thread: tells the link just installed our job state (setJobState), if any.
  void greet(const std::shared_ptr<Link>& link);
  /// Link thread: `link` closed because of `reason`; if it was its peer's connection, the peer is
  /// down and receives waiting for it fail.
  void linkClosed(const std::shared_ptr<Link>& link, const std::string& reason);
  /// Counts and logs a connection refused (not a peer of this job), unless stopping.
  void noteRefused(const std::string& address, const Status& why);
  /// A connection beyond the cap of handshakes at once was closed: counted; whether to warn now
  /// (at most every 10 s).
  bool noteHandshakeCap();

  // --- receiving (link thread) -------------------------------------------------------------------

  /// A handshake frame where a session frame belongs: the error, else ok.
  static Status checkNotHandshake(FrameType type, const std::string& name);
  /// A frame of the other type than the handshake step expects.
  static Status unexpectedFrame(const std::string& name, FrameType got, FrameType want);
  /// A whole, verified frame from the authenticated `link`.
  void dispatch(const std::shared_ptr<Link>& link, const FrameHeader& h,
                std::vector<uint8_t> payload);
  /// Liveness at `now`: closes `link` when it has been silent for peer_timeout, else pings it.
  /// Returns whether it is still open.
  bool keepAlive(const std::shared_ptr<Link>& link, Clock::time_point now);

  // --- sending -----------------------------------------------------------------------------------

  /// Any thread: an op's outcome; wakes its waiters.
  void complete(const std::shared_ptr<SendOp>& op, std::string error);
  /// Marks `op` timed out and completes it (dropped before it was written).
  void completeTimedOut(const std::shared_ptr<SendOp>& op);

  // --- Transport ---------------------------------------------------------------------------------

  Status send(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
              std::span<const uint8_t> payload, Clock::time_point deadline);
  /// `owned`: the frame takes the buffer `payload` lies in (postOwned).
  Status post(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
              std::span<const uint8_t> payload, std::vector<uint8_t>* owned = nullptr);
  Status postOwned(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                   std::vector<uint8_t> payload);
  void reclaim();
  Status flush(Clock::time_point deadline);
  Result<Frame> receive(uint32_t src, const FrameKey& key, Clock::time_point deadline);
  Result<std::optional<Frame>> receiveOrWake(uint32_t src, const FrameKey& key, const Wake& wake,
                                             Clock::time_point deadline);
  /// Sends an ABORT of (tensor, step) to every connected peer; returns once the frames are handed
  /// to the links (at most kAbortQueued). Not from the link thread (it would wait kAbortQueued).
  void abortStep(uint64_t tensor, uint64_t step, const std::string& reason);
  static constexpr std::chrono::milliseconds kAbortQueued{250};
  void broadcastState();
  void setJobState(std::function<std::vector<uint8_t>()> provide,
                   std::function<void(uint32_t, std::span<const uint8_t>)> take);
  bool allConnected() const { return mail_.allUp() && started_; }
  /// Sets every peer's lightwire_peer_up to 0 (at start and at destruction).
  void markAllDown();
  /// The authenticated links up now (guarded by mutex()).
  std::vector<std::shared_ptr<Link>> upLinks() const;
  /// mutex() held: the link of rank `r`, if up.
  const std::shared_ptr<Link>& linkLocked(uint32_t r) const { return links_[r]; }

 private:
  Result<std::shared_ptr<SendOp>> queueFrame(uint32_t dst, FrameType type, const FrameKey& key,
                                             uint8_t codec, std::span<const uint8_t> payload,
                                             std::vector<uint8_t>* owned = nullptr);
  Status awaitFrames(std::vector<std::shared_ptr<SendOp>>& ops, Clock::time_point deadline);
  void onPong(uint32_t src, const std::vector<uint8_t>& payload);

  const SessionOptions options_;
  metrics::Metrics& metrics_;
  Membership membership_;
  uint64_t job_hash_ = 0;
  std::atomic<bool> started_{false};
  std::atomic<bool> stopping_{false};
  Post post_;
  std::function<std::string(const std::string&, uint32_t)> wrong_direction_;
  std::function<void(const std::shared_ptr<Link>&, const FrameHeader&, const std::vector<uint8_t>&)>
      rendezvous_;
  Clock::time_point last_handshake_warning_{};  // link thread

  // Per peer: received frames, aborts, up or down (docs/peer-protocol.md "After the handshake").
  // Its mutex also guards `links_` and the outcome of every SendOp, and its cv wakes their waiters.
  PeerMailboxes mail_;
  std::vector<std::shared_ptr<Link>> links_;  // index = rank: the authenticated link, if up

  // Set before start() (setJobState), used on the link thread.
  std::function<std::vector<uint8_t>()> provide_state_;
  std::function<void(uint32_t, std::span<const uint8_t>)> take_state_;

  std::mutex posted_mu_;
  std::vector<std::shared_ptr<SendOp>> posted_;  // post()ed, not yet flushed
};

/// A Transport whose protocol is a PeerSession: the methods every transport has in common, done
/// by the session. Thread-safe as Transport.
class SessionTransport : public Transport {
 public:
  uint32_t rank() const override;
  uint32_t worldSize() const override;
  Status send(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
              std::span<const uint8_t> payload,
              std::chrono::steady_clock::time_point deadline) override;
  Status post(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
              std::span<const uint8_t> payload,
              std::chrono::steady_clock::time_point deadline) override;
  Status flush(std::chrono::steady_clock::time_point deadline) override;
  void recycle(std::vector<uint8_t> buffer) override;
  Status postOwned(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                   std::vector<uint8_t> payload,
                   std::chrono::steady_clock::time_point deadline) override;
  void reclaim() override;
  std::vector<uint8_t> takeBuffer(size_t n) override;
  uint64_t pooledBytes() override;
  Result<Frame> receive(uint32_t src, const FrameKey& key,
                        std::chrono::steady_clock::time_point deadline) override;
  Result<std::optional<Frame>> receiveOrWake(
      uint32_t src, const FrameKey& key, const Wake& wake,
      std::chrono::steady_clock::time_point deadline) override;
  void abortStep(uint64_t tensor, uint64_t step, const std::string& reason) override;
  void discard(uint64_t tensor, uint64_t step) override;
  void beginStep(uint64_t tensor, uint64_t step) override;
  void broadcastState() override;
  void setJobState(std::function<std::vector<uint8_t>()> provide,
                   std::function<void(uint32_t, std::span<const uint8_t>)> take) override;
  bool allConnected() const override;
  std::vector<bool> peersUp() const override;

 protected:
  explicit SessionTransport(PeerSession& session) : session_(session) {}
  PeerSession& session_;
};

}  // namespace lightwire::proxy::peer
