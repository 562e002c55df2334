#include "proxy/peer/mailbox.h"

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "kernels/reuse.h"

namespace lightwire::proxy::peer {
namespace {

// Recycled payload buffers kept for reuse (recycle()), at most this many and this many bytes.
constexpr size_t kPoolBuffers = 256;
constexpr uint64_t kPoolBytes = uint64_t{512} << 20;

}  // namespace

PeerMailboxes::PeerMailboxes(uint64_t max_kept_bytes_per_peer, uint64_t max_kept_frames_per_peer)
    : max_kept_bytes_(max_kept_bytes_per_peer), max_kept_frames_(max_kept_frames_per_peer) {}

void PeerMailboxes::reset(uint32_t world_size, uint32_t self) {
  std::lock_guard lock(mu_);
  peers_ = std::vector<Slot>(world_size);
  world_size_ = world_size;
  self_ = self;
}

uint32_t PeerMailboxes::size() const {
  std::lock_guard lock(mu_);
  return static_cast<uint32_t>(peers_.size());
}

void PeerMailboxes::markUpLocked(uint32_t rank) {
  Slot& slot = peers_[rank];
  slot.up = true;
  slot.last_error.clear();
  cv_.notify_all();
}

void PeerMailboxes::markDownLocked(uint32_t rank, std::string reason) {
  Slot& slot = peers_[rank];
  slot.up = false;
  ++slot.generation;
  slot.last_error = std::move(reason);
  cv_.notify_all();
}

bool PeerMailboxes::allUp() const {
  std::lock_guard lock(mu_);
  for (uint32_t r = 0; r < peers_.size(); ++r) {
    if (r != self_ && !peers_[r].up) return false;
  }
  return true;
}

std::vector<bool> PeerMailboxes::peersUp() const {
  std::lock_guard lock(mu_);
  std::vector<bool> up(peers_.size(), false);
  for (uint32_t r = 0; r < peers_.size(); ++r) up[r] = r == self_ || peers_[r].up;
  return up;
}

Status PeerMailboxes::checkSend(uint32_t dst, FrameType type, size_t bytes,
                                uint64_t max_frame_bytes) const {
  {
    std::lock_guard lock(mu_);
    if (dst >= world_size_ || dst == self_) {
      return invalidArgument(fmt::format("peer: cannot send to rank {} (we are rank {} of {})", dst,
                                         self_, world_size_));
    }
  }
  if (type != FrameType::kData && type != FrameType::kAbort) {
    return invalidArgument(
        fmt::format("peer: send() carries DATA and ABORT frames, not {}", frameTypeName(type)));
  }
  if (bytes > max_frame_bytes) {
    return outOfRange(fmt::format("peer: frame of {} bytes for rank {} exceeds the limit of {}",
                                  bytes, dst, max_frame_bytes));
  }
  return Status::ok();
}

Status PeerMailboxes::notConnectedLocked(uint32_t dst) const {
  const std::string& why = peers_[dst].last_error;
  return Status(StatusCode::kUnavailable, fmt::format("peer: rank {} is not connected{}{}", dst,
                                                      why.empty() ? "" : ": ", why));
}

bool PeerMailboxes::reserve(uint32_t src, uint64_t bytes, std::string& why) {
  std::lock_guard lock(mu_);
  Slot& slot = peers_[src];
  if (slot.kept_frames + 1 > max_kept_frames_ || slot.kept_bytes + bytes > max_kept_bytes_) {
    why = fmt::format(
        "rank {} sent more than we keep: {} frames / {} bytes kept, limits {} / {} bytes", src,
        slot.kept_frames, slot.kept_bytes, max_kept_frames_, max_kept_bytes_);
    return false;
  }
  slot.kept_frames += 1;
  slot.kept_bytes += bytes;
  return true;
}

void PeerMailboxes::releaseLocked(Slot& slot, uint64_t bytes) {
  slot.kept_frames -= 1;
  slot.kept_bytes -= bytes;
}

void PeerMailboxes::release(uint32_t src, uint64_t bytes) {
  std::lock_guard lock(mu_);
  releaseLocked(peers_[src], bytes);
}

void PeerMailboxes::deliver(Frame frame) {
  std::lock_guard lock(mu_);
  const FrameKey key = frame.key;
  peers_[frame.src].mailbox[key].push_back(std::move(frame));
  cv_.notify_all();
}

void PeerMailboxes::deliverAbort(uint32_t src, uint64_t tensor, uint64_t step, std::string reason) {
  spdlog::warn("peer: rank {} aborted tensor {:016x} step {}: {}", src, tensor, step, reason);
  std::lock_guard lock(mu_);
  Slot& slot = peers_[src];
  if (auto done = done_upto_.find(tensor); done != done_upto_.end() && step <= done->second) {
    // The step is over here (it failed or completed): a late abort of it must not fail a later
    // attempt of the same step (after a resume).
    releaseLocked(slot, reason.size());
    return;
  }
  auto [it, inserted] = slot.aborts.try_emplace({tensor, step});
  if (!inserted) releaseLocked(slot, it->second.size());
  it->second = std::move(reason);
  cv_.notify_all();
}

Result<Frame> PeerMailboxes::receive(uint32_t src, const FrameKey& key,
                                     Clock::time_point deadline) {
  auto got = receiveOrWake(src, key, nullptr, deadline);
  if (!got) return got.status();
  return std::move(**got);
}

Result<std::optional<Frame>> PeerMailboxes::receiveOrWake(uint32_t src, const FrameKey& key,
                                                          const Wake* wake,
                                                          Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  for (uint32_t r : {src, wake ? wake->src : src}) {
    if (r >= world_size_ || r == self_) {
      return invalidArgument(fmt::format("peer: cannot receive from rank {} (we are rank {} of {})",
                                         r, self_, world_size_));
    }
  }
  Slot& slot = peers_[src];
  const uint64_t generation = slot.generation;
  for (;;) {
    // An abort wins over frames already kept: the step failed on another rank, so it must fail
    // here too, even when that rank's frames arrived before it gave up.
    for (uint32_t r = 0; r < peers_.size(); ++r) {
      const auto& aborts = peers_[r].aborts;
      if (auto it = aborts.find({key.tensor, key.step}); it != aborts.end()) {
        return Status(StatusCode::kAborted,
                      fmt::format("peer: rank {} aborted step {} of tensor {:016x}: {}", r,
                                  key.step, key.tensor, it->second));
      }
    }
    if (auto it = slot.mailbox.find(key); it != slot.mailbox.end()) {
      Frame f = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) slot.mailbox.erase(it);
      releaseLocked(slot, f.payload.size());
      return std::optional<Frame>(std::move(f));
    }
    if (wake && peers_[wake->src].mailbox.count(wake->key) != 0) return std::optional<Frame>();
    if (!slot.up || slot.generation != generation) {
      return Status(
          StatusCode::kUnavailable,
          fmt::format("peer: connection to rank {} lost{}{}", src,
                      slot.last_error.empty() ? " (not connected)" : ": ", slot.last_error));
    }
    if (Clock::now() >= deadline) {
      return Status(
          StatusCode::kUnavailable,
          fmt::format("peer: deadline passed waiting for rank {} ({})", src, describeKey(key)));
    }
    cv_.wait_until(lock, deadline);
  }
}

void PeerMailboxes::beginStep(uint64_t tensor, uint64_t step) {
  std::lock_guard lock(mu_);
  auto it = done_upto_.find(tensor);
  if (it == done_upto_.end() || it->second < step) return;
  if (step == 0) {
    done_upto_.erase(it);
  } else {
    it->second = step - 1;
  }
}

void PeerMailboxes::discard(uint64_t tensor, uint64_t step) {
  std::lock_guard lock(mu_);
  auto& done = done_upto_[tensor];
  done = std::max(done, step);
  for (auto& slot : peers_) {
    std::erase_if(slot.mailbox, [&](auto& entry) {
      if (entry.first.tensor != tensor || entry.first.step > step) return false;
      for (auto& f : entry.second) releaseLocked(slot, f.payload.size());
      return true;
    });
    std::erase_if(slot.aborts, [&](auto& entry) {
      if (entry.first.first != tensor || entry.first.second > step) return false;
      releaseLocked(slot, entry.second.size());
      return true;
    });
  }
}

std::vector<uint8_t> PeerMailboxes::takeBuffer(size_t n) {
  std::vector<uint8_t> b;
  {
    std::lock_guard lock(pool_mu_);
    // A kept buffer even when none is large enough: the largest is grown (reallocated) rather
    // than a new one added, so the pool holds as many buffers as were ever in use at once, of
    // the largest sizes asked for — not one more for every size that did not fit.
    b = kernels::takeReused(pool_, n, /*capacity_only=*/false, pool_bytes_);
  }
  if (b.capacity() < n) b.clear();  // reallocated: its old bytes are not copied
  b.resize(n);
  return b;
}

uint64_t PeerMailboxes::pooledBytes() {
  std::lock_guard lock(pool_mu_);
  return pool_bytes_;
}

void PeerMailboxes::recycle(std::vector<uint8_t> buffer) {
  if (buffer.capacity() == 0) return;
  std::lock_guard lock(pool_mu_);
  if (pool_bytes_ + buffer.capacity() > kPoolBytes || pool_.size() >= kPoolBuffers) return;
  pool_bytes_ += buffer.capacity();
  pool_.push_back(std::move(buffer));
}

}  // namespace lightwire::proxy::peer
