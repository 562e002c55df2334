// Target `frame`: one frame as a sidecar receives it from a peer (docs/peer-protocol.md):
// decodeHeader() against the connection's checks, the payload of the header's length,
// verifyPayload() (and, so that the fuzzer gets past the XXH3 checksum, the same payload again
// with its checksum put right), then the body as the receiver takes it: HELLO (decodeHello,
// the server's checks), CHALLENGE and AUTH (the HMAC proofs, constant-time comparison), PING/PONG,
// DATA (a codec payload of a ring phase or, after its header, of the parameter server's broadcast;
// a statistics record; the server's statistics broadcast), ABORT, STATE (the job state).
//
// Input: u8 world size (2 + x % 15), u8 own rank (% W), u8 flags (bit 0: after the handshake, the
// connection's rank follows as u8), [u8 peer rank], then the 64-byte header and the payload.
#include <cstring>
#include <string>

#include "policies/stats.h"
#include "proxy/peer/collective.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/ps_exchange.h"
#include "proxy/step/engine.h"
#include "proxy/step/job_state.h"
#include "tests/fuzz/peer_bodies.h"
#include "tests/fuzz/targets.h"

namespace lightwire::fuzz::frame {
namespace {

using namespace proxy::peer;

constexpr std::string_view kSecret = "fuzz-secret";
// Phases of the collectives (docs/exchange.md).
constexpr uint8_t kRingReduce = 0, kRingGather = 1, kRingStats = 3;
constexpr uint8_t kPsPush = 3, kPsBroadcast = 4, kPsStats = 7, kPsStatsAll = 8;
constexpr uint8_t kAfterHandshake = 1;

Nonce nonceOf(uint8_t fill) {
  Nonce n;
  n.fill(fill);
  return n;
}

/// The client's nonce of the handshake in progress (a server compares what it sent).
const Nonce kClientNonce = nonceOf(0x11);

void body(const FrameHeader& h, Span payload, uint32_t world, uint32_t own) {
  switch (h.type) {
    case FrameType::kHello: {
      // The server's side (proxy/peer/tcp_transport.cc): world size, target rank, who connects.
      const Hello hello = decodeHello(payload);
      check(std::memcmp(encodeHello(hello).data(), payload.data(), kHelloBytes) == 0,
            "HELLO does not read back");
      if (hello.world_size != world || hello.dst != own || h.src > own) return;
      (void)handshakeMac(MacRole::kServer, kSecret, kJob, hello.nonce, nonceOf(0x22), h.src, own,
                         world);
      return;
    }
    case FrameType::kChallenge: {  // the client checks the server's proof
      Nonce server{};
      std::memcpy(server.data(), payload.data(), kNonceBytes);
      const Mac expected =
          handshakeMac(MacRole::kServer, kSecret, kJob, kClientNonce, server, own, h.src, world);
      (void)macEqual(expected, payload.subspan(kNonceBytes));
      return;
    }
    case FrameType::kAuth: {  // the server checks the client's proof
      const Mac expected = handshakeMac(MacRole::kClient, kSecret, kJob, kClientNonce,
                                        nonceOf(0x22), h.src, own, world);
      (void)macEqual(expected, payload);
      return;
    }
    case FrameType::kData:
      if (h.codec == 0 && h.key.phase == kRingStats) {
        statsFolds(payload);
      } else if (h.codec == 0 && h.key.phase == kPsStats) {
        statsRecord(payload);
      } else if (h.key.phase == kPsStatsAll) {
        auto records = parsePsStats(payload, world);
        if (records) {
          auto policy = fuzzPolicy();
          stepRecords(*records, h.key.step, *policy);
        }
      } else if (h.key.phase == kPsBroadcast) {
        if (parsePsHeader(payload, world)) {
          codecPayload(h.codec, payload.subspan(psHeaderBytes(world)));
        }
      } else if (h.key.phase == kRingReduce || h.key.phase == kRingGather ||
                 h.key.phase == kPsPush) {
        codecPayload(h.codec, payload);
      }
      return;
    case FrameType::kAbort:
      (void)describeKey(h.key);
      return;
    case FrameType::kState: {
      auto policy = fuzzPolicy();
      jobState(payload, *policy);
      return;
    }
    default:  // PING/PONG (an echoed clock), REGISTER/PEERS (parsed inside the transport)
      return;
  }
}

}  // namespace

int run(const uint8_t* data, size_t size) {
  Reader in(data, size);
  HeaderChecks checks;
  checks.job_hash = jobHash(kJob);
  checks.world_size = 2 + in.u8() % 15;
  checks.own_rank = in.u8() % checks.world_size;
  if (in.u8() & kAfterHandshake) checks.expected_src = in.u8() % checks.world_size;
  const Span header = in.take(kHeaderBytes);
  auto h = decodeHeader(header, checks, "rank ?");
  if (!h) {
    check(!h.status().message().empty(), "header refused without a message");
    return 0;
  }
  check(std::memcmp(encodeHeader(*h).data(), header.data(), kHeaderBytes) == 0,
        "a valid header does not read back");
  // The receiver reads exactly `length` payload bytes (more would be the next frame).
  const Span rest = in.rest();
  if (rest.size() < h->length) return 0;
  const Span payload = rest.first(h->length);
  if (!verifyPayload(*h, payload, "rank ?").isOk()) {
    h->checksum = payloadChecksum(payload);
    check(verifyPayload(*h, payload, "rank ?").isOk(), "a put-right checksum is refused");
  }
  body(*h, payload, checks.world_size, checks.own_rank);
  return 0;
}

namespace {

/// A seed: the checks prefix, then the frame.
std::vector<uint8_t> frameSeed(uint32_t world, uint32_t own, std::optional<uint32_t> peer,
                               FrameType type, const FrameKey& key, uint8_t codec, uint32_t src,
                               Span payload) {
  Writer w;
  w.u8(static_cast<uint8_t>(world - 2)).u8(static_cast<uint8_t>(own));
  w.u8(peer ? kAfterHandshake : 0);
  if (peer) w.u8(static_cast<uint8_t>(*peer));
  const FrameHeader h = makeHeader(type, key, codec, jobHash(kJob), src, payload);
  w.bytes(encodeHeader(h)).bytes(payload);
  return w.take();
}

}  // namespace

void seeds(Seeds& out) {
  const uint32_t world = 3;
  // The handshake between rank 0 (client) and rank 1 (server).
  const Hello hello{.world_size = world, .dst = 1, .nonce = kClientNonce};
  out.emplace_back(
      "hello", frameSeed(world, 1, std::nullopt, FrameType::kHello, {}, 0, 0, encodeHello(hello)));
  const Nonce server = nonceOf(0x22);
  std::vector<uint8_t> challenge(server.begin(), server.end());
  const Mac smac = handshakeMac(MacRole::kServer, kSecret, kJob, kClientNonce, server, 0, 1, world);
  challenge.insert(challenge.end(), smac.begin(), smac.end());
  out.emplace_back("challenge",
                   frameSeed(world, 0, std::nullopt, FrameType::kChallenge, {}, 0, 1, challenge));
  const Mac cmac = handshakeMac(MacRole::kClient, kSecret, kJob, kClientNonce, server, 0, 1, world);
  out.emplace_back("auth", frameSeed(world, 1, std::nullopt, FrameType::kAuth, {}, 0, 0, cmac));
  const std::vector<uint8_t> clock = {1, 2, 3, 4, 5, 6, 7, 8};
  out.emplace_back("ping", frameSeed(world, 1, 0, FrameType::kPing, {}, 0, 0, clock));
  out.emplace_back("pong", frameSeed(world, 0, 1, FrameType::kPong, {}, 0, 1, clock));

  // DATA: a topk payload of the ring (reduce phase), and the parameter server's broadcast of it.
  const kernels::Codec& codec = codecAt(codecIndex("topk"));
  kernels::CodecState state(codec.stateFloats(37));
  const std::vector<uint8_t> topk =
      encodePattern(codec, kernels::Chunking::make(37, 0, 1), 1, {}, state)[0];
  const FrameKey key{.tensor = 0x1234, .step = 7, .phase = kRingReduce, .chunk = 0, .origin = 2};
  out.emplace_back("data_ring_topk", frameSeed(world, 1, 0, FrameType::kData, key, 3, 0, topk));
  std::vector<uint8_t> broadcast;
  proxy::peer::appendPsHeader({.count = world, .ranks = {true, true, true}}, broadcast);
  broadcast.insert(broadcast.end(), topk.begin(), topk.end());
  FrameKey bkey = key;
  bkey.phase = kPsBroadcast;
  out.emplace_back("data_ps_broadcast",
                   frameSeed(world, 1, 0, FrameType::kData, bkey, 3, 0, broadcast));

  // Statistics: one record (ring), and the server's broadcast of every rank's.
  policies::StepStats st{.grad_norm2 = 4.0, .elements = 1000, .residual_norm2 = 0.5};
  st.cos_dot = 0.9;
  st.cos_c2 = 1.0;
  st.cos_g2 = 1.0;
  st.loss = 2.5;
  st.loss_step = 6;
  st.requests.push_back({.kind = policies::Request::Kind::kCheckpoint, .id = 1, .step = 6});
  const std::vector<uint8_t> record = policies::encodeStats(st);
  FrameKey skey = key;
  skey.phase = kRingStats;
  auto fold0 = policies::foldStats({}, record, 0);
  auto fold1 = policies::foldStats(*fold0, record, 1);
  out.emplace_back("data_stats", frameSeed(world, 1, 0, FrameType::kData, skey, 0, 0,
                                           proxy::peer::packStatsEntries({*fold0, *fold1})));
  skey.phase = kPsStats;
  out.emplace_back("data_ps_record", frameSeed(world, 1, 0, FrameType::kData, skey, 0, 0, record));
  skey.phase = kPsStatsAll;
  out.emplace_back("data_ps_stats",
                   frameSeed(world, 1, 0, FrameType::kData, skey, 0, 0,
                             proxy::peer::encodePsStats({record, record, record})));
  const std::string reason = "tensor 'w' step 7 failed on rank 0: deadline exceeded";
  out.emplace_back("abort", frameSeed(world, 1, 0, FrameType::kAbort, key, 0, 0, bytesOf(reason)));
  const auto policy = fuzzPolicy();
  out.emplace_back("state", frameSeed(world, 1, 0, FrameType::kState, {}, 0, 0,
                                      proxy::encodeJobState({{"w", 7}, {"b", 6}}, policy.get())));
  out.emplace_back(
      "register", frameSeed(world, 0, 2, FrameType::kRegister, {}, 0, 2, bytesOf("10.0.0.3:4781")));
  out.emplace_back("peers", frameSeed(world, 2, 0, FrameType::kPeers, {}, 0, 0,
                                      bytesOf("10.0.0.1:4781\n10.0.0.2:4781\n10.0.0.3:4781\n")));
}

}  // namespace lightwire::fuzz::frame
