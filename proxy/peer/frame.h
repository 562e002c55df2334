#pragma once
// The peer wire format (docs/peer-protocol.md): a fixed 64-byte little-endian header, then the
// payload; and the pieces of the HMAC-SHA256 handshake that both sides (and tests) compute.
// Pure functions, no I/O; safe to call from any thread.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kernels/status.h"
#include "proxy/peer/transport.h"

namespace lightwire::proxy::peer {

inline constexpr size_t kHeaderBytes = 64;
inline constexpr std::array<uint8_t, 4> kMagic = {'L', 'W', 'P', '1'};
inline constexpr uint16_t kProtocolVersion = 4;
inline constexpr uint64_t kDefaultMaxFrameBytes = uint64_t{2} << 30;  // 2 GiB

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;  // HMAC-SHA256
// Payload sizes of the fixed-size frame types (anything else is refused at the header).
inline constexpr size_t kHelloBytes = 8 + kNonceBytes;  // world size, dst rank, nonce
inline constexpr size_t kChallengeBytes = kNonceBytes + kMacBytes;
inline constexpr size_t kAuthBytes = kMacBytes;
inline constexpr size_t kPingBytes = 8;  // sender's clock (ns), echoed
// Rendezvous frames: one "host:port" (REGISTER), or one per rank, newline-separated (PEERS).
inline constexpr size_t kMaxAddressBytes = 300;
// STATE frames (the job's step counters, JSON) are at most this long.
inline constexpr size_t kMaxStateBytes = size_t{16} << 20;

/// The decoded header of one frame. Plain value.
struct FrameHeader {
  uint16_t version = kProtocolVersion;
  FrameType type = FrameType::kData;
  uint8_t codec = 0;
  uint64_t job_hash = 0;
  FrameKey key;
  uint32_t src = 0;
  uint64_t length = 0;    // payload bytes
  uint64_t checksum = 0;  // XXH3-64 of the payload
};

/// What a received header must agree with. Plain value.
struct HeaderChecks {
  uint64_t job_hash = 0;
  uint32_t world_size = 1;
  uint32_t own_rank = 0;
  std::optional<uint32_t> expected_src;  // the authenticated peer of the connection, if known
  uint64_t max_payload_bytes = kDefaultMaxFrameBytes;
};

/// XXH3-64 of the job id (the `job` header field).
uint64_t jobHash(std::string_view job_id);
/// XXH3-64 of a payload (the `checksum` header field).
uint64_t payloadChecksum(std::span<const uint8_t> payload);

/// A header for `payload` (length and checksum filled in).
FrameHeader makeHeader(FrameType type, const FrameKey& key, uint8_t codec, uint64_t job_hash,
                       uint32_t src, std::span<const uint8_t> payload);
std::array<uint8_t, kHeaderBytes> encodeHeader(const FrameHeader& header);

/// Parses and validates a header received from `peer` (a name for messages: "rank 3", or the
/// remote address before the handshake). Checks size, magic, version, type, reserved, job,
/// source rank, and the payload length (against the limit and the fixed sizes of handshake and
/// ping frames) before anyone allocates for the payload.
Result<FrameHeader> decodeHeader(std::span<const uint8_t> bytes, const HeaderChecks& checks,
                                 std::string_view peer);

/// Verifies the payload against the header's length and checksum.
Status verifyPayload(const FrameHeader& header, std::span<const uint8_t> payload,
                     std::string_view peer);

const char* frameTypeName(FrameType type);
/// "tensor 0x..., step N, round R, phase P, chunk C, origin O" for messages.
std::string describeKey(const FrameKey& key);

/// Hash of a FrameKey for unordered containers.
struct FrameKeyHash {
  size_t operator()(const FrameKey& k) const noexcept;
};

// --- handshake -----------------------------------------------------------------------------------

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

/// The HELLO payload: the connecting side's view of the job. Its rank is the header's `src`.
struct Hello {
  uint32_t world_size = 0;
  uint32_t dst = 0;  // the rank it means to reach
  Nonce nonce{};
};
std::array<uint8_t, kHelloBytes> encodeHello(const Hello& hello);
/// `bytes` must be kHelloBytes long (the header check guarantees it).
Hello decodeHello(std::span<const uint8_t> bytes);

/// 32 bytes from OpenSSL's RAND_bytes.
Result<Nonce> randomNonce();

enum class MacRole { kServer, kClient };
/// HMAC-SHA256(secret, "lightwire-v1|server|" or "lightwire-v1|client|" + job_id + client_nonce
/// + server_nonce + u32le client_rank + u32le server_rank + u32le world_size).
Mac handshakeMac(MacRole role, std::string_view secret, std::string_view job_id,
                 const Nonce& client_nonce, const Nonce& server_nonce, uint32_t client_rank,
                 uint32_t server_rank, uint32_t world_size);
/// Constant-time comparison (CRYPTO_memcmp); false when the sizes differ.
bool macEqual(const Mac& expected, std::span<const uint8_t> got);

}  // namespace lightwire::proxy::peer
