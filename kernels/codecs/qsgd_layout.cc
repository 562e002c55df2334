#include "kernels/codecs/qsgd_layout.h"

#include <cmath>
#include <string>

namespace lightwire::kernels {

std::optional<QsgdLayout> qsgdLayout(uint64_t n, uint64_t d, unsigned b) {
  if (d == 0 || n > (uint64_t{1} << 60)) return std::nullopt;  // then nothing below overflows
  QsgdLayout l;
  l.buckets = n / d + (n % d != 0 ? 1 : 0);
  l.code_bytes = packedBytes(n, b);
  l.total = kQsgdHeaderBytes + 4 * l.buckets + l.code_bytes;
  return l;
}

Result<QsgdPayload> parseQsgdPayload(std::span<const uint8_t> payload, uint64_t out_elements) {
  auto h = readHeader(payload, CodecId::kQsgd, out_elements, 0);
  if (!h) return h.status();
  QsgdPayload q;
  q.header = *h;
  if (h->codec == CodecId::kNone) return q;
  const uint8_t* p = payload.data();
  if (payload.size() < kQsgdHeaderBytes) {
    return dataLoss("qsgd payload truncated: " + std::to_string(payload.size()) +
                    " bytes, its headers alone need " + std::to_string(kQsgdHeaderBytes));
  }
  const unsigned b = p[16];
  if (b < 2 || b > 8) {
    return dataLoss("qsgd payload has b = " + std::to_string(b) + " bits, must be 2..8");
  }
  if (p[17] != 0 || p[18] != 0 || p[19] != 0) {
    return dataLoss("qsgd payload reserved bytes 17..19 are not zero");
  }
  const uint32_t d = loadU32(p + 20);
  if (d == 0) return dataLoss("qsgd payload has bucket size d = 0");
  const uint64_t n = h->elements;
  const auto layout = qsgdLayout(n, d, b);
  if (!layout) {
    return dataLoss("qsgd payload element count " + std::to_string(n) + " is too large");
  }
  if (payload.size() != layout->total) {
    return dataLoss("qsgd payload of " + std::to_string(n) + " elements (b = " + std::to_string(b) +
                    ", d = " + std::to_string(d) + ") must be " + std::to_string(layout->total) +
                    " bytes, got " + std::to_string(payload.size()));
  }
  const uint8_t* norms = p + kQsgdHeaderBytes;
  for (uint64_t k = 0; k < layout->buckets; ++k) {
    const float norm = loadF32(norms + 4 * k);
    if (std::isnan(norm) || std::isinf(norm) || norm < 0.0f) {
      return dataLoss("qsgd bucket " + std::to_string(k) + " has norm " + std::to_string(norm) +
                      " (must be finite and >= 0)");
    }
  }
  const uint8_t* codes = norms + 4 * layout->buckets;
  if (!paddingIsZero({codes, static_cast<size_t>(layout->code_bytes)}, n * b)) {
    return dataLoss("qsgd payload has non-zero unused bits after its last code");
  }
  q.bits = b;
  q.d = d;
  q.layout = *layout;
  q.norms = norms;
  q.codes = codes;
  return q;
}

}  // namespace lightwire::kernels
