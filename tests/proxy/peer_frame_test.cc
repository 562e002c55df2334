// The peer wire format: header round trips, hostile headers, payload checksums, the handshake MACs.

#include <doctest.h>

#include <cstring>
#include <vector>

#include "proxy/peer/frame.h"

namespace lightwire::proxy::peer {
namespace {

HeaderChecks checksFor(uint32_t own, uint32_t world) {
  HeaderChecks c;
  c.job_hash = jobHash("job-a");
  c.own_rank = own;
  c.world_size = world;
  return c;
}

std::array<uint8_t, kHeaderBytes> sampleHeader(std::span<const uint8_t> payload) {
  FrameKey key{0x1122334455667788ull, 42, 3, 1, 7, 2};
  return encodeHeader(makeHeader(FrameType::kData, key, 9, jobHash("job-a"), 2, payload));
}

template <typename T>
void poke(std::array<uint8_t, kHeaderBytes>& b, size_t off, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) b[off + i] = static_cast<uint8_t>(uint64_t{v} >> (8 * i));
}

}  // namespace

TEST_CASE("peer frame: header round trip, byte layout") {
  std::vector<uint8_t> payload = {1, 2, 3, 4, 5};
  auto b = sampleHeader(payload);
  CHECK(std::memcmp(b.data(), "LWP1", 4) == 0);
  CHECK(b[4] == 4);
  CHECK(b[5] == 0);  // version u16 LE
  CHECK(b[6] == static_cast<uint8_t>(FrameType::kData));
  CHECK(b[7] == 9);
  CHECK(b[16] == 0x88);  // tensor LE
  CHECK(b[24] == 42);
  CHECK(b[32] == 3);
  CHECK(b[33] == 1);
  CHECK(b[34] == 0);
  CHECK(b[35] == 0);
  CHECK(b[36] == 7);
  CHECK(b[40] == 2);
  CHECK(b[44] == 2);
  CHECK(b[48] == 5);

  auto h = decodeHeader(b, checksFor(0, 4), "rank 2");
  REQUIRE(h.isOk());
  CHECK(h->type == FrameType::kData);
  CHECK(h->codec == 9);
  CHECK(h->key == FrameKey{0x1122334455667788ull, 42, 3, 1, 7, 2});
  CHECK(h->src == 2);
  CHECK(h->length == 5);
  CHECK(verifyPayload(*h, payload, "rank 2").isOk());
  CHECK(encodeHeader(*h) == b);
}

TEST_CASE("peer frame: every corrupted header field is refused, naming the peer") {
  std::vector<uint8_t> payload(100, 7);
  const auto good = sampleHeader(payload);
  auto expectBad = [&](std::array<uint8_t, kHeaderBytes> b, const char* what,
                       HeaderChecks c = checksFor(0, 4)) {
    auto h = decodeHeader(b, c, "rank 2");
    CHECK_MESSAGE(!h.isOk(), what);
    if (!h.isOk()) {
      CHECK(h.status().code() == StatusCode::kDataLoss);
      CHECK_MESSAGE(h.status().message().find("rank 2") != std::string::npos, what);
      CHECK_MESSAGE(h.status().message().find(what) != std::string::npos, h.status().message());
    }
  };
  for (size_t i = 0; i < 4; ++i) {
    auto b = good;
    b[i] ^= 0x20;
    expectBad(b, "magic");
  }
  {
    auto b = good;
    poke<uint16_t>(b, 4, 1);  // a sidecar of the first version (no bucket headers)
    expectBad(b, "protocol version 1, expected 4");
  }
  {
    auto b = good;
    poke<uint16_t>(b, 4, 2);  // 12-byte bucket headers (no owners proposed)
    expectBad(b, "protocol version 2, expected 4");
  }
  {
    auto b = good;
    poke<uint16_t>(b, 4, 3);  // every contribution with its layer's count (no count frames)
    expectBad(b, "protocol version 3, expected 4");
  }
  for (uint8_t t : {0, 11, 255}) {
    auto b = good;
    b[6] = t;
    expectBad(b, "unknown frame type");
  }
  {
    auto b = good;
    poke<uint16_t>(b, 34, 1);
    expectBad(b, "reserved");
  }
  {
    auto b = good;
    b[8] ^= 1;
    expectBad(b, "job hash");
  }
  {
    auto b = good;
    poke<uint32_t>(b, 44, 4);
    expectBad(b, "out of range");
    poke<uint32_t>(b, 44, UINT32_MAX);
    expectBad(b, "out of range");
    poke<uint32_t>(b, 44, 0);
    expectBad(b, "our own rank");
  }
  {
    auto c = checksFor(0, 4);
    c.expected_src = 3;
    expectBad(good, "connection is with rank 3", c);
  }
  {
    auto b = good;
    poke<uint64_t>(b, 48, UINT64_MAX);
    expectBad(b, "exceeds the limit");
    poke<uint64_t>(b, 48, kDefaultMaxFrameBytes + 1);
    expectBad(b, "exceeds the limit");
    auto c = checksFor(0, 4);
    c.max_payload_bytes = 99;
    expectBad(good, "exceeds the limit", c);
    c.max_payload_bytes = 100;
    CHECK(decodeHeader(good, c, "rank 2").isOk());
  }
  // Handshake and ping frames have fixed sizes.
  for (auto [type, size] : {std::pair{FrameType::kHello, kHelloBytes},
                            {FrameType::kChallenge, kChallengeBytes},
                            {FrameType::kAuth, kAuthBytes},
                            {FrameType::kPing, kPingBytes},
                            {FrameType::kPong, kPingBytes}}) {
    auto b = good;
    b[6] = static_cast<uint8_t>(type);
    poke<uint64_t>(b, 48, size);
    CHECK(decodeHeader(b, checksFor(0, 4), "rank 2").isOk());
    poke<uint64_t>(b, 48, size + 1);
    expectBad(b, "expected");
    poke<uint64_t>(b, 48, uint64_t{1} << 40);
    expectBad(b, "exceeds the limit");
  }
  // Rendezvous frames carry addresses (bounded by kMaxAddressBytes, per rank for PEERS); STATE
  // frames the job state (kMaxStateBytes).
  for (auto [type, limit] : {std::pair{FrameType::kRegister, kMaxAddressBytes},
                             {FrameType::kPeers, 4 * (kMaxAddressBytes + 1)},
                             {FrameType::kState, kMaxStateBytes}}) {
    auto b = good;
    b[6] = static_cast<uint8_t>(type);
    poke<uint64_t>(b, 48, limit);
    CHECK(decodeHeader(b, checksFor(0, 4), "rank 2").isOk());
    poke<uint64_t>(b, 48, limit + 1);
    expectBad(b, "exceeds");
  }
  // Truncated headers (and one byte too many).
  for (size_t n = 0; n < kHeaderBytes; ++n) {
    auto h = decodeHeader(std::span(good.data(), n), checksFor(0, 4), "rank 2");
    CHECK(!h.isOk());
  }
  std::vector<uint8_t> longer(good.begin(), good.end());
  longer.push_back(0);
  CHECK(!decodeHeader(longer, checksFor(0, 4), "rank 2").isOk());
}

TEST_CASE("peer frame: random garbage never decodes into an oversized frame") {
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  auto c = checksFor(1, 3);
  c.max_payload_bytes = 1 << 20;
  for (int i = 0; i < 20000; ++i) {
    auto b = sampleHeader({});
    // Flip a few random bytes of a valid header.
    for (int k = 0; k < 1 + i % 4; ++k) b[next() % kHeaderBytes] = static_cast<uint8_t>(next());
    auto h = decodeHeader(b, c, "rank 2");
    if (h.isOk()) {
      CHECK(h->length <= c.max_payload_bytes);
      CHECK(h->src < 3);
      CHECK(h->src != 1);
    }
  }
}

TEST_CASE("peer frame: payload checksum") {
  std::vector<uint8_t> payload(1000);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 31);
  auto b = sampleHeader(payload);
  auto h = decodeHeader(b, checksFor(0, 4), "rank 2");
  REQUIRE(h.isOk());
  CHECK(verifyPayload(*h, payload, "rank 2").isOk());
  payload[500] ^= 1;
  Status st = verifyPayload(*h, payload, "rank 2");
  CHECK(!st.isOk());
  CHECK(st.message().find("rank 2") != std::string::npos);
  CHECK(st.message().find("checksum") != std::string::npos);
  payload.pop_back();
  CHECK(!verifyPayload(*h, payload, "rank 2").isOk());
  // The empty payload has a checksum too.
  auto e = decodeHeader(sampleHeader({}), checksFor(0, 4), "rank 2");
  REQUIRE(e.isOk());
  CHECK(verifyPayload(*e, {}, "rank 2").isOk());
}

TEST_CASE("peer frame: hello and handshake MACs") {
  auto n1 = randomNonce();
  auto n2 = randomNonce();
  REQUIRE(n1.isOk());
  REQUIRE(n2.isOk());
  CHECK(*n1 != *n2);
  Hello hello{5, 3, *n1};
  auto enc = encodeHello(hello);
  Hello back = decodeHello(enc);
  CHECK(back.world_size == 5);
  CHECK(back.dst == 3);
  CHECK(back.nonce == *n1);

  const Mac base = handshakeMac(MacRole::kServer, "secret", "job", *n1, *n2, 1, 3, 5);
  CHECK(macEqual(base, base));
  CHECK(base == handshakeMac(MacRole::kServer, "secret", "job", *n1, *n2, 1, 3, 5));
  // Every input matters.
  CHECK(base != handshakeMac(MacRole::kClient, "secret", "job", *n1, *n2, 1, 3, 5));
  CHECK(base != handshakeMac(MacRole::kServer, "secreT", "job", *n1, *n2, 1, 3, 5));
  CHECK(base != handshakeMac(MacRole::kServer, "secret", "job2", *n1, *n2, 1, 3, 5));
  CHECK(base != handshakeMac(MacRole::kServer, "secret", "job", *n2, *n1, 1, 3, 5));
  CHECK(base != handshakeMac(MacRole::kServer, "secret", "job", *n1, *n2, 2, 3, 5));
  CHECK(base != handshakeMac(MacRole::kServer, "secret", "job", *n1, *n2, 1, 4, 5));
  CHECK(base != handshakeMac(MacRole::kServer, "secret", "job", *n1, *n2, 1, 3, 6));
  Mac other = base;
  other[31] ^= 1;
  CHECK(!macEqual(base, other));
  CHECK(!macEqual(base, std::span(base.data(), 31)));
}

}  // namespace lightwire::proxy::peer
