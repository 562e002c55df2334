#include "kernels/payload.h"

#include "kernels/parallel.h"
#include "kernels/simd/kernels.h"

#include <bit>
#include <cstdio>
#include <cstring>
#include <string>

namespace lightwire::kernels {

static_assert(std::endian::native == std::endian::little, "payloads are little-endian");

void writeHeader(uint8_t* out, const PayloadHeader& h) {
  out[0] = kMagic0;
  out[1] = kMagic1;
  out[2] = kPayloadVersion;
  out[3] = static_cast<uint8_t>(h.codec);
  out[4] = static_cast<uint8_t>(h.dtype);
  out[5] = h.flags;
  out[6] = h.round;
  out[7] = 0;
  storeU64(out + 8, h.elements);
}

Result<PayloadHeader> readHeader(std::span<const uint8_t> p, CodecId expected,
                                 uint64_t out_elements, uint8_t allowed_flags, uint8_t max_round) {
  if (p.size() < kHeaderBytes) {
    return dataLoss("payload truncated: " + std::to_string(p.size()) +
                    " bytes, the header alone needs " + std::to_string(kHeaderBytes));
  }
  if (p[0] != kMagic0 || p[1] != kMagic1) return dataLoss("payload has a wrong magic");
  if (p[2] != kPayloadVersion) {
    return dataLoss("payload version " + std::to_string(p[2]) + " is not supported (expected " +
                    std::to_string(kPayloadVersion) + ")");
  }
  PayloadHeader h;
  h.codec = static_cast<CodecId>(p[3]);
  if (h.codec != expected && h.codec != CodecId::kNone) {
    return dataLoss("payload codec id " + std::to_string(p[3]) + " does not match decoder " +
                    codecIdName(expected));
  }
  if (p[4] > static_cast<uint8_t>(DType::kBF16)) {
    return dataLoss("payload dtype " + std::to_string(p[4]) + " is unknown");
  }
  h.dtype = static_cast<DType>(p[4]);
  h.flags = p[5];
  const uint8_t allowed = h.codec == CodecId::kNone ? 0 : allowed_flags;
  if ((h.flags & ~allowed) != 0) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", unsigned(h.flags & ~allowed));
    return dataLoss(std::string("payload has unknown flag bits ") + hex);
  }
  h.round = p[6];
  if (h.round > (h.codec == CodecId::kNone ? 0 : max_round)) {
    return dataLoss("payload round " + std::to_string(h.round) + " does not exist for " +
                    codecIdName(h.codec));
  }
  if (p[7] != 0) return dataLoss("payload reserved header byte is not zero");
  h.elements = loadU64(p.data() + 8);
  if (h.elements != out_elements) {
    return dataLoss("payload holds " + std::to_string(h.elements) +
                    " elements but the output range has " + std::to_string(out_elements));
  }
  return h;
}

Status decodeDenseF32(std::span<const uint8_t> p, const PayloadHeader& h, float weight, float* out,
                      bool into) {
  const uint64_t need = kHeaderBytes + 4 * h.elements;
  if (h.elements > (p.size() / 4) || p.size() != need) {
    return dataLoss("none payload of " + std::to_string(h.elements) + " elements must be " +
                    std::to_string(need) + " bytes, got " + std::to_string(p.size()));
  }
  const uint8_t* v = p.data() + kHeaderBytes;
  if (into) {  // into zeros: +0 + w·v, the bits of the accumulating loop over zeros
    simd::scaleFloats(v, h.elements, weight, out);
  } else {
    simd::accumulateFloats(v, h.elements, weight, out);
  }
  return Status::ok();
}

Result<size_t> addDenseValues(std::span<const uint8_t> a, const float* b, uint64_t n,
                              std::span<uint8_t> out) {
  auto h = readHeader(a, CodecId::kNone, n, 0);
  if (!h) return h.status();
  if (a.size() != kHeaderBytes + 4 * n) {
    return dataLoss("none payload of " + std::to_string(n) + " elements must be " +
                    std::to_string(kHeaderBytes + 4 * n) + " bytes, got " +
                    std::to_string(a.size()));
  }
  if (out.size() < a.size()) return outOfRange("payload buffer too small");
  writeHeader(out.data(), *h);
  simd::addFloats(a.data() + kHeaderBytes, reinterpret_cast<const uint8_t*>(b), n,
                  out.data() + kHeaderBytes);
  return a.size();
}

size_t writeDensePayload(ConstTensor x, uint8_t* out, CpuStream* stream) {
  const size_t n = x.elements;
  writeHeader(out, {CodecId::kNone, x.dtype, 0, 0, n});
  uint8_t* body = out + kHeaderBytes;
  parallelFor(stream, n, size_t{1} << 16, [&](size_t lo, size_t hi) {
    visitDType(x.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      if constexpr (D == DType::kF32) {  // little-endian fp32 is already the wire layout
        std::memcpy(body + 4 * lo, static_cast<const float*>(x.data) + lo, 4 * (hi - lo));
      } else {
        for (size_t i = lo; i < hi; ++i) storeF32(body + 4 * i, loadWidened<D>(x.data, i));
      }
    });
  });
  return kHeaderBytes + 4 * n;
}

bool paddingIsZero(std::span<const uint8_t> bytes, uint64_t used_bits) {
  const uint64_t full = used_bits / 8;
  if (full < bytes.size() && (used_bits % 8) != 0) {
    if ((bytes[full] >> (used_bits % 8)) != 0) return false;
  }
  for (uint64_t i = (used_bits + 7) / 8; i < bytes.size(); ++i) {
    if (bytes[i] != 0) return false;
  }
  return true;
}

std::string codecIdName(CodecId id) {
  static const char* const kNames[] = {"none",     "fp16",      "bf16",   "topk",
                                       "randomk",  "threshold", "dgc",    "qsgd",
                                       "terngrad", "signsgd",   "onebit", "powersgd"};
  const auto i = static_cast<size_t>(id);
  return i < std::size(kNames) ? kNames[i] : "codec#" + std::to_string(i);
}

}  // namespace lightwire::kernels
