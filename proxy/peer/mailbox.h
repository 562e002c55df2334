#pragma once
// The transport-independent half of a peer transport (proxy/peer/transport.h): per peer rank,
// the received frames not yet asked for (the mailbox), the aborts received, the budget of what is
// kept, and whether the peer is up; and receive() waiting on all of that. The PeerSession of each
// transport (proxy/peer/session.h) owns one and feeds it from the transport's thread.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/status.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/transport.h"

namespace lightwire::proxy::peer {

/// The mailboxes and connection state of every peer rank of one transport. Thread-safe.
///
/// mutex() guards the per-peer state and may guard the owning transport's own state too (its
/// per-peer connections, its send completions): methods named `...Locked` expect it held, the
/// others take it. notify() / cv() wake receive() and whatever else waits on mutex().
class PeerMailboxes {
 public:
  using Clock = std::chrono::steady_clock;

  /// Received frames not yet asked for, per peer: beyond either bound reserve() refuses.
  PeerMailboxes(uint64_t max_kept_bytes_per_peer, uint64_t max_kept_frames_per_peer);
  PeerMailboxes(const PeerMailboxes&) = delete;
  PeerMailboxes& operator=(const PeerMailboxes&) = delete;

  /// Sizes the state for `world_size` ranks, this one being `self`; every peer down. At start().
  void reset(uint32_t world_size, uint32_t self);
  /// Ranks (0 before reset()).
  uint32_t size() const;

  std::mutex& mutex() const { return mu_; }
  std::condition_variable& cv() { return cv_; }

  // --- connection state --------------------------------------------------------------------------

  /// Whether `rank` is up. mutex() held.
  bool upLocked(uint32_t rank) const { return peers_[rank].up; }
  /// `rank` is up (its error cleared); wakes waiters. mutex() held.
  void markUpLocked(uint32_t rank);
  /// `rank` is down because of `reason`: receives waiting for it fail; wakes waiters. mutex() held.
  void markDownLocked(uint32_t rank, std::string reason);

  /// Whether every peer is up (readyz), and per peer (index = rank, our own rank reads true).
  bool allUp() const;
  std::vector<bool> peersUp() const;

  /// Checks a send of a `type` frame of `bytes` to `dst` (frames of at most `max_frame_bytes`)
  /// before anything is queued: Transport::send()'s argument errors.
  Status checkSend(uint32_t dst, FrameType type, size_t bytes, uint64_t max_frame_bytes) const;
  /// The error of a send to `dst`, which has no connection (naming why it went down). mutex() held.
  Status notConnectedLocked(uint32_t dst) const;

  // --- kept frames -------------------------------------------------------------------------------

  /// Reserves room in `src`'s mailbox for a frame of `bytes` about to arrive; false (and `why`)
  /// when over a bound. Every reservation is given back by release() or by the frame it became
  /// (deliver(), deliverAbort()) being consumed or discarded.
  bool reserve(uint32_t src, uint64_t bytes, std::string& why);
  /// Gives back a reservation whose frame never arrived.
  void release(uint32_t src, uint64_t bytes);

  /// Keeps a DATA frame (reserved) until asked for; wakes waiters.
  void deliver(Frame frame);
  /// Keeps an ABORT of (tensor, step) from `src` (reserved: reason's bytes); a second one for the
  /// same step replaces the first. Logs it; wakes waiters.
  void deliverAbort(uint32_t src, uint64_t tensor, uint64_t step, std::string reason);

  /// Transport::receive() once started: the frame `key` from `src`, or an abort of its step from
  /// any rank, or the loss of `src`, or the deadline.
  Result<Frame> receive(uint32_t src, const FrameKey& key, Clock::time_point deadline);
  /// receive(), which also returns — nullopt, the frame left kept — as soon as the frame
  /// `wake->key` from `wake->src` is kept (Transport::receiveOrWake).
  Result<std::optional<Frame>> receiveOrWake(uint32_t src, const FrameKey& key, const Wake* wake,
                                             Clock::time_point deadline);
  /// Drops kept frames and aborts of (tensor, steps <= step). An abort of such a step that
  /// arrives later is stale (the step is over here) and dropped, until beginStep() of that step.
  void discard(uint64_t tensor, uint64_t step);
  /// (tensor, step) starts here (again, after a resume): aborts of it are kept from now on.
  void beginStep(uint64_t tensor, uint64_t step);

  // --- payload buffers ---------------------------------------------------------------------------

  /// A buffer of `n` bytes for a payload: a recycled one (kernels::bestReuse: only growth beyond
  /// its last size is zero-filled; the largest, grown, when none is large enough), else a new
  /// one.
  std::vector<uint8_t> takeBuffer(size_t n);
  /// Keeps a consumed payload's buffer for takeBuffer() (within the pool's bounds).
  void recycle(std::vector<uint8_t> buffer);
  /// Bytes (capacity) of the buffers the pool holds idle now.
  uint64_t pooledBytes();

 private:
  /// What is kept per peer rank. Guarded by mu_.
  struct Slot {
    bool up = false;
    uint64_t generation = 0;  // incremented on every loss
    std::string last_error;
    std::unordered_map<FrameKey, std::deque<Frame>, FrameKeyHash> mailbox;
    std::map<std::pair<uint64_t, uint64_t>, std::string> aborts;  // (tensor, step) -> reason
    uint64_t kept_bytes = 0;  // payload bytes of mailbox + aborts + frames being received
    uint64_t kept_frames = 0;
  };

  void releaseLocked(Slot& slot, uint64_t bytes);

  // Per tensor: the last step discarded here (its late aborts are stale). Under mu_; one entry
  // per tensor this side has run.
  std::unordered_map<uint64_t, uint64_t> done_upto_;
  const uint64_t max_kept_bytes_;
  const uint64_t max_kept_frames_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> peers_;
  uint32_t world_size_ = 1;  // as the default Membership, until reset()
  uint32_t self_ = 0;

  // Buffers of consumed payloads (recycle()), reused for incoming frames. Guarded by pool_mu_.
  std::mutex pool_mu_;
  std::vector<std::vector<uint8_t>> pool_;
  uint64_t pool_bytes_ = 0;
};

}  // namespace lightwire::proxy::peer
