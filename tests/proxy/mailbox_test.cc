// PeerMailboxes (proxy/peer/mailbox.h): aborts against kept frames, stale aborts after a step is
// over here, and their accounting; waits that a second frame may end; the receive pool, and
// every frame's buffer going back to it from PeerSession::dispatch.
#include <doctest.h>

#include <chrono>
#include <thread>

#include "metrics/metrics.h"
#include "proxy/peer/mailbox.h"
#include "proxy/peer/session.h"

namespace lightwire::proxy::peer {
namespace {

using Clock = std::chrono::steady_clock;

FrameKey keyOf(uint64_t tensor, uint64_t step) {
  FrameKey k;
  k.tensor = tensor;
  k.step = step;
  return k;
}

/// Rank 0 of 2, rank 1 up.
struct Mail {
  Mail() : m(1 << 20, 64) {
    m.reset(2, 0);
    std::lock_guard lock(m.mutex());
    m.markUpLocked(1);
  }
  void frame(uint64_t tensor, uint64_t step) {
    std::string why;
    REQUIRE(m.reserve(1, 4, why));
    Frame f;
    f.key = keyOf(tensor, step);
    f.src = 1;
    f.payload = {1, 2, 3, 4};
    m.deliver(std::move(f));
  }
  void abort(uint64_t tensor, uint64_t step) {
    std::string why;
    REQUIRE(m.reserve(1, 6, why));
    m.deliverAbort(1, tensor, step, "failed");
  }
  Result<Frame> receive(uint64_t tensor, uint64_t step) {
    return m.receive(1, keyOf(tensor, step), Clock::now() + std::chrono::milliseconds(20));
  }
  PeerMailboxes m;
};

TEST_CASE("mailbox: an abort wins over a frame the aborting rank sent before giving up") {
  Mail mail;
  mail.frame(7, 3);
  mail.abort(7, 3);
  auto got = mail.receive(7, 3);
  REQUIRE_FALSE(got);
  CHECK(got.status().message().find("aborted step 3") != std::string::npos);
  CHECK(got.status().code() == StatusCode::kAborted);
  // Other steps are not affected.
  mail.frame(7, 4);
  CHECK(mail.receive(7, 4));
}

TEST_CASE("mailbox: a wait that may be woken returns its frame, or nothing when the other came") {
  Mail mail;
  const Wake wake{1, keyOf(9, 3)};
  // The frame waited for wins when both are there; the wake frame stays kept.
  mail.frame(7, 3);
  mail.frame(9, 3);
  auto got = mail.m.receiveOrWake(1, keyOf(7, 3), &wake, Clock::now());
  REQUIRE(got);
  REQUIRE(got->has_value());
  CHECK((*got)->key.tensor == 7);
  // Only the wake frame: nothing, at once, and it is still there to be received.
  const auto t0 = Clock::now();
  auto woken = mail.m.receiveOrWake(1, keyOf(7, 4), &wake, t0 + std::chrono::seconds(5));
  REQUIRE(woken);
  CHECK_FALSE(woken->has_value());
  CHECK(Clock::now() - t0 < std::chrono::seconds(4));
  CHECK(mail.receive(9, 3));
  // Neither: the deadline, as receive(); a frame arriving later ends the wait.
  CHECK_FALSE(
      mail.m.receiveOrWake(1, keyOf(7, 4), &wake, Clock::now() + std::chrono::milliseconds(20)));
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    mail.frame(9, 3);
  });
  auto late = mail.m.receiveOrWake(1, keyOf(7, 4), &wake, Clock::now() + std::chrono::seconds(5));
  later.join();
  REQUIRE(late);
  CHECK_FALSE(late->has_value());
  // An abort of the step still wins.
  mail.abort(7, 4);
  auto aborted = mail.m.receiveOrWake(1, keyOf(7, 4), &wake, Clock::now());
  REQUIRE_FALSE(aborted);
  CHECK(aborted.status().code() == StatusCode::kAborted);
}

TEST_CASE("mailbox: a late abort of a step over here is dropped until the step starts again") {
  Mail mail;
  mail.m.discard(7, 11);  // step 11 failed (or ended) here
  mail.abort(7, 11);      // the peer's abort of that attempt arrives late: stale
  mail.frame(7, 11);
  CHECK(mail.receive(7, 11));  // not failed by the stale abort
  mail.m.discard(7, 11);
  mail.abort(7, 12);  // a later step's abort counts
  CHECK_FALSE(mail.receive(7, 12));
  mail.m.beginStep(7, 11);  // step 11 again (a resume): its aborts count again
  mail.abort(7, 11);
  CHECK_FALSE(mail.receive(7, 11));
  // Other tensors are not affected by tensor 7's steps.
  mail.abort(8, 5);
  CHECK_FALSE(mail.receive(8, 5));
}

TEST_CASE("mailbox: a dropped stale abort gives its reservation back") {
  PeerMailboxes m(64, 2);  // room for two kept items
  m.reset(2, 0);
  {
    std::lock_guard lock(m.mutex());
    m.markUpLocked(1);
  }
  m.discard(7, 100);
  std::string why;
  for (int i = 0; i < 10; ++i) {
    REQUIRE_MESSAGE(m.reserve(1, 6, why), why);  // would run out if the stale ones were kept
    m.deliverAbort(1, 7, 50 + static_cast<uint64_t>(i), "late");
  }
}

}  // namespace
}  // namespace lightwire::proxy::peer

namespace lightwire::proxy::peer {
namespace {

TEST_CASE("mailbox buffers: a frame takes the pooled buffer that needs no zero-fill") {
  PeerMailboxes m(1 << 20, 64);
  // Two pooled buffers of the same capacity, one last used for a small frame, one for a large.
  std::vector<uint8_t> small(4000, 7), large(4000, 9);
  small.resize(10);
  const uint8_t* large_data = large.data();
  const uint8_t* small_data = small.data();
  m.recycle(std::move(small));
  m.recycle(std::move(large));
  // A large frame gets the buffer that already holds that many bytes (nothing zero-filled: its
  // old bytes are still there), a small one then the other.
  auto a = m.takeBuffer(3000);
  CHECK(a.data() == large_data);
  CHECK(a.size() == 3000);
  CHECK(a[2999] == 9);
  auto b = m.takeBuffer(8);
  CHECK(b.data() == small_data);
  CHECK(b.size() == 8);
  // None large enough: the largest kept one is reallocated (zeroed, its old bytes not copied)
  // rather than a buffer added beside it, so the pool holds no more buffers than were in use.
  b.assign(8, 5);
  m.recycle(std::move(b));
  auto c = m.takeBuffer(5000);
  CHECK(c.size() == 5000);
  CHECK(c[0] == 0);
  CHECK(c[4999] == 0);
  auto fresh = m.takeBuffer(16);  // the pool is empty now
  CHECK(fresh.size() == 16);
  // Only a buffer that must grow within its capacity: it is taken, the growth zeroed.
  std::vector<uint8_t> roomy(4000, 3);
  roomy.resize(10);
  const uint8_t* roomy_data = roomy.data();
  m.recycle(std::move(roomy));
  auto d = m.takeBuffer(100);
  CHECK(d.data() == roomy_data);
  CHECK(d[9] == 3);
  CHECK(d[99] == 0);
}

}  // namespace
}  // namespace lightwire::proxy::peer

namespace lightwire::proxy::peer {
namespace {

/// A link that keeps what the session queues on it.
struct RecordingLink : Link {
  void post(std::shared_ptr<SendOp>) override {}
  void sendOwned(FrameType type, const FrameKey&, std::vector<uint8_t> payload) override {
    sent.emplace_back(type, std::move(payload));
  }
  void abandon(const std::shared_ptr<SendOp>&) override {}
  void close(const std::string&) override {}
  std::vector<std::pair<FrameType, std::vector<uint8_t>>> sent;
};

TEST_CASE("session: every frame's buffer that is not data goes back to the receive pool") {
  metrics::Metrics metrics;
  PeerSession session(SessionOptions{}, metrics);
  session.mail().reset(2, 0);
  auto link = std::make_shared<RecordingLink>();
  link->peer = 1;
  // A small frame may be read into a large pooled buffer (the smallest kept one that holds it):
  // whatever the frame, that buffer must come back, or the next large frame needs a new one.
  auto lent = [&](size_t size) {
    std::vector<uint8_t> b = session.mail().takeBuffer(size_t{1} << 20);
    b.resize(size);
    for (size_t i = 0; i < size; ++i) b[i] = static_cast<uint8_t>(i + 1);
    return b;
  };
  FrameHeader h{};
  h.src = 1;
  h.type = FrameType::kPing;
  h.length = kPingBytes;
  session.dispatch(link, h, lent(kPingBytes));
  CHECK(session.mail().pooledBytes() >= (size_t{1} << 20));
  // The pong echoes the ping's bytes, in a buffer of their own size.
  REQUIRE(link->sent.size() == 1);
  CHECK(link->sent[0].first == FrameType::kPong);
  CHECK(link->sent[0].second == std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(link->sent[0].second.capacity() < 1024);
  for (FrameType type : {FrameType::kPong, FrameType::kAbort}) {
    const uint64_t before = session.mail().pooledBytes();
    h.type = type;
    session.dispatch(link, h, lent(kPingBytes));
    CHECK(session.mail().pooledBytes() == before);  // taken from the pool and given back
  }
  // A data frame's buffer stays with the frame (its consumer gives it back).
  const uint64_t before = session.mail().pooledBytes();
  h.type = FrameType::kData;
  session.dispatch(link, h, lent(16));
  CHECK(session.mail().pooledBytes() < before);
}

}  // namespace
}  // namespace lightwire::proxy::peer
