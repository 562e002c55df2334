#include "proxy/peer/frame.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <cstring>
#include <string>
#include <vector>

#include <spdlog/fmt/fmt.h>

namespace lightwire::proxy::peer {
namespace {

// Header offsets (docs/peer-protocol.md).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffType = 6;
constexpr size_t kOffCodec = 7;
constexpr size_t kOffJob = 8;
constexpr size_t kOffTensor = 16;
constexpr size_t kOffStep = 24;
constexpr size_t kOffRound = 32;
constexpr size_t kOffPhase = 33;
constexpr size_t kOffReserved = 34;
constexpr size_t kOffChunk = 36;
constexpr size_t kOffOrigin = 40;
constexpr size_t kOffSrc = 44;
constexpr size_t kOffLength = 48;
constexpr size_t kOffChecksum = 56;
static_assert(kOffChecksum + 8 == kHeaderBytes);

template <typename T>
void put(uint8_t* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(uint64_t{v} >> (8 * i));
}
template <typename T>
T get(const uint8_t* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t{p[i]} << (8 * i);
  return static_cast<T>(v);
}

std::optional<size_t> fixedLength(FrameType type) {
  switch (type) {
    case FrameType::kHello:
      return kHelloBytes;
    case FrameType::kChallenge:
      return kChallengeBytes;
    case FrameType::kAuth:
      return kAuthBytes;
    case FrameType::kPing:
    case FrameType::kPong:
      return kPingBytes;
    default:
      return std::nullopt;
  }
}

Status bad(std::string_view peer, std::string what) {
  return dataLoss(fmt::format("malformed frame from {}: {}", peer, what));
}

}  // namespace

uint64_t jobHash(std::string_view job_id) { return XXH3_64bits(job_id.data(), job_id.size()); }

uint64_t payloadChecksum(std::span<const uint8_t> payload) {
  // The dispatching variant picks AVX2/AVX-512 at run time (the plain one is built for SSE2):
  // the same hash, 1.5-2.5x faster on large payloads.
  return XXH3_64bits_dispatch(payload.data(), payload.size());
}

FrameHeader makeHeader(FrameType type, const FrameKey& key, uint8_t codec, uint64_t job_hash,
                       uint32_t src, std::span<const uint8_t> payload) {
  FrameHeader h;
  h.type = type;
  h.codec = codec;
  h.job_hash = job_hash;
  h.key = key;
  h.src = src;
  h.length = payload.size();
  h.checksum = payloadChecksum(payload);
  return h;
}

std::array<uint8_t, kHeaderBytes> encodeHeader(const FrameHeader& h) {
  std::array<uint8_t, kHeaderBytes> b{};
  uint8_t* p = b.data();
  std::memcpy(p + kOffMagic, kMagic.data(), kMagic.size());
  put<uint16_t>(p + kOffVersion, h.version);
  p[kOffType] = static_cast<uint8_t>(h.type);
  p[kOffCodec] = h.codec;
  put<uint64_t>(p + kOffJob, h.job_hash);
  put<uint64_t>(p + kOffTensor, h.key.tensor);
  put<uint64_t>(p + kOffStep, h.key.step);
  p[kOffRound] = h.key.round;
  p[kOffPhase] = h.key.phase;
  put<uint16_t>(p + kOffReserved, 0);
  put<uint32_t>(p + kOffChunk, h.key.chunk);
  put<uint32_t>(p + kOffOrigin, h.key.origin);
  put<uint32_t>(p + kOffSrc, h.src);
  put<uint64_t>(p + kOffLength, h.length);
  put<uint64_t>(p + kOffChecksum, h.checksum);
  return b;
}

Result<FrameHeader> decodeHeader(std::span<const uint8_t> bytes, const HeaderChecks& checks,
                                 std::string_view peer) {
  if (bytes.size() != kHeaderBytes) {
    return bad(peer, fmt::format("header of {} bytes, expected {}", bytes.size(), kHeaderBytes));
  }
  const uint8_t* p = bytes.data();
  if (std::memcmp(p + kOffMagic, kMagic.data(), kMagic.size()) != 0) {
    return bad(peer, fmt::format("bad magic {:02x}{:02x}{:02x}{:02x} (expected \"LWP1\")", p[0],
                                 p[1], p[2], p[3]));
  }
  FrameHeader h;
  h.version = get<uint16_t>(p + kOffVersion);
  if (h.version != kProtocolVersion) {
    return bad(peer, fmt::format("protocol version {}, expected {}", h.version, kProtocolVersion));
  }
  const uint8_t type = p[kOffType];
  if (type < static_cast<uint8_t>(FrameType::kHello) ||
      type > static_cast<uint8_t>(FrameType::kState)) {
    return bad(peer, fmt::format("unknown frame type {}", type));
  }
  h.type = static_cast<FrameType>(type);
  if (const uint16_t reserved = get<uint16_t>(p + kOffReserved); reserved != 0) {
    return bad(peer, fmt::format("reserved field is {}, expected 0", reserved));
  }
  h.codec = p[kOffCodec];
  h.job_hash = get<uint64_t>(p + kOffJob);
  if (h.job_hash != checks.job_hash) {
    return bad(peer, fmt::format("job hash {:016x}, expected {:016x} (another job?)", h.job_hash,
                                 checks.job_hash));
  }
  h.key.tensor = get<uint64_t>(p + kOffTensor);
  h.key.step = get<uint64_t>(p + kOffStep);
  h.key.round = p[kOffRound];
  h.key.phase = p[kOffPhase];
  h.key.chunk = get<uint32_t>(p + kOffChunk);
  h.key.origin = get<uint32_t>(p + kOffOrigin);
  h.src = get<uint32_t>(p + kOffSrc);
  if (h.src >= checks.world_size) {
    return bad(
        peer, fmt::format("source rank {} out of range (world size {})", h.src, checks.world_size));
  }
  if (h.src == checks.own_rank) {
    return bad(peer, fmt::format("source rank {} is our own rank", h.src));
  }
  if (checks.expected_src && h.src != *checks.expected_src) {
    return bad(peer, fmt::format("source rank {}, but the connection is with rank {}", h.src,
                                 *checks.expected_src));
  }
  h.length = get<uint64_t>(p + kOffLength);
  if (h.length > checks.max_payload_bytes) {
    return bad(peer, fmt::format("{} frame of {} payload bytes exceeds the limit of {}",
                                 frameTypeName(h.type), h.length, checks.max_payload_bytes));
  }
  if (auto fixed = fixedLength(h.type); fixed && h.length != *fixed) {
    return bad(peer, fmt::format("{} frame of {} payload bytes, expected {}", frameTypeName(h.type),
                                 h.length, *fixed));
  }
  const uint64_t address_limit = h.type == FrameType::kRegister ? kMaxAddressBytes
                                 : h.type == FrameType::kPeers
                                     ? uint64_t{checks.world_size} * (kMaxAddressBytes + 1)
                                 : h.type == FrameType::kState ? kMaxStateBytes
                                                               : UINT64_MAX;
  if (h.length > address_limit) {
    return bad(peer, fmt::format("{} frame of {} payload bytes exceeds {}", frameTypeName(h.type),
                                 h.length, address_limit));
  }
  h.checksum = get<uint64_t>(p + kOffChecksum);
  return h;
}

Status verifyPayload(const FrameHeader& header, std::span<const uint8_t> payload,
                     std::string_view peer) {
  if (payload.size() != header.length) {
    return bad(peer,
               fmt::format("payload of {} bytes, header says {}", payload.size(), header.length));
  }
  if (const uint64_t sum = payloadChecksum(payload); sum != header.checksum) {
    return bad(peer, fmt::format("payload checksum mismatch ({:016x}, header says {:016x}) in {} "
                                 "frame ({})",
                                 sum, header.checksum, frameTypeName(header.type),
                                 describeKey(header.key)));
  }
  return Status::ok();
}

const char* frameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kHello:
      return "HELLO";
    case FrameType::kChallenge:
      return "CHALLENGE";
    case FrameType::kAuth:
      return "AUTH";
    case FrameType::kData:
      return "DATA";
    case FrameType::kAbort:
      return "ABORT";
    case FrameType::kPing:
      return "PING";
    case FrameType::kPong:
      return "PONG";
    case FrameType::kRegister:
      return "REGISTER";
    case FrameType::kPeers:
      return "PEERS";
    case FrameType::kState:
      return "STATE";
  }
  return "UNKNOWN";
}

std::string describeKey(const FrameKey& k) {
  return fmt::format("tensor {:016x}, step {}, round {}, phase {}, chunk {}, origin {}", k.tensor,
                     k.step, k.round, k.phase, k.chunk, k.origin);
}

size_t FrameKeyHash::operator()(const FrameKey& k) const noexcept {
  uint64_t words[4] = {k.tensor, k.step,
                       (uint64_t{k.round} << 40) | (uint64_t{k.phase} << 32) | k.chunk, k.origin};
  return static_cast<size_t>(XXH3_64bits(words, sizeof(words)));
}

std::array<uint8_t, kHelloBytes> encodeHello(const Hello& hello) {
  std::array<uint8_t, kHelloBytes> b{};
  put<uint32_t>(b.data(), hello.world_size);
  put<uint32_t>(b.data() + 4, hello.dst);
  std::memcpy(b.data() + 8, hello.nonce.data(), kNonceBytes);
  return b;
}

Hello decodeHello(std::span<const uint8_t> bytes) {
  Hello h;
  if (bytes.size() != kHelloBytes) return h;
  h.world_size = get<uint32_t>(bytes.data());
  h.dst = get<uint32_t>(bytes.data() + 4);
  std::memcpy(h.nonce.data(), bytes.data() + 8, kNonceBytes);
  return h;
}

Result<Nonce> randomNonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    return internalError("RAND_bytes failed to produce a handshake nonce");
  }
  return n;
}

Mac handshakeMac(MacRole role, std::string_view secret, std::string_view job_id,
                 const Nonce& client_nonce, const Nonce& server_nonce, uint32_t client_rank,
                 uint32_t server_rank, uint32_t world_size) {
  std::string_view label =
      role == MacRole::kServer ? "lightwire-v1|server|" : "lightwire-v1|client|";
  std::vector<uint8_t> msg;
  msg.reserve(label.size() + job_id.size() + 2 * kNonceBytes + 12);
  msg.insert(msg.end(), label.begin(), label.end());
  msg.insert(msg.end(), job_id.begin(), job_id.end());
  msg.insert(msg.end(), client_nonce.begin(), client_nonce.end());
  msg.insert(msg.end(), server_nonce.begin(), server_nonce.end());
  for (uint32_t v : {client_rank, server_rank, world_size}) {
    uint8_t b[4];
    put<uint32_t>(b, v);
    msg.insert(msg.end(), b, b + 4);
  }
  Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg.data(), msg.size(),
       mac.data(), &len);
  return mac;
}

bool macEqual(const Mac& expected, std::span<const uint8_t> got) {
  return got.size() == expected.size() &&
         CRYPTO_memcmp(expected.data(), got.data(), expected.size()) == 0;
}

}  // namespace lightwire::proxy::peer
