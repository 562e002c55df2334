// The frames of the `ps` topology (docs/exchange.md "The `ps` topology"): the broadcast header
// and the statistics broadcast, written and parsed (the parser checks everything: a peer's bytes).

#include <spdlog/spdlog.h>

#include <string>

#include "proxy/peer/ps_exchange.h"
#include "proxy/peer/ps_util.h"

namespace lightwire::proxy::peer {
namespace {

uint32_t readU32(std::span<const uint8_t> p, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{p[at + i]} << (8 * i);
  return v;
}

void appendU32(uint32_t v, std::vector<uint8_t>& out) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

}  // namespace

// --- the broadcast header ------------------------------------------------------------------------

size_t psHeaderBytes(uint32_t world_size) { return 4 + (size_t{world_size} + 7) / 8; }

void appendPsHeader(const PsHeader& h, std::vector<uint8_t>& out) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(h.count >> (8 * i)));
  const size_t first = out.size();
  out.resize(first + (h.ranks.size() + 7) / 8, 0);
  for (size_t r = 0; r < h.ranks.size(); ++r) {
    if (h.ranks[r]) out[first + r / 8] |= static_cast<uint8_t>(1u << (r % 8));
  }
}

Result<PsHeader> parsePsHeader(std::span<const uint8_t> payload, uint32_t world_size) {
  const size_t bytes = psHeaderBytes(world_size);
  if (payload.size() < bytes) {
    return dataLoss("broadcast of " + std::to_string(payload.size()) +
                    " bytes is shorter than its header (" + std::to_string(bytes) + " bytes)");
  }
  PsHeader h;
  for (int i = 0; i < 4; ++i) h.count |= uint32_t{payload[i]} << (8 * i);
  h.ranks.assign(world_size, false);
  for (size_t b = 4; b < bytes; ++b) {
    for (unsigned bit = 0; bit < 8; ++bit) {
      if ((payload[b] >> bit & 1u) == 0) continue;
      const size_t r = (b - 4) * 8 + bit;
      if (r >= world_size) {
        return dataLoss("broadcast header names rank " + std::to_string(r) + " of a world of " +
                        std::to_string(world_size));
      }
      h.ranks[r] = true;
    }
  }
  if (h.count == 0) return dataLoss("broadcast header counts no contribution");
  return h;
}

// --- the statistics broadcast -------------------------------------------------------------------

std::vector<uint8_t> encodePsStats(const std::vector<std::vector<uint8_t>>& by_rank) {
  std::vector<uint8_t> out;
  uint32_t count = 0;
  size_t bytes = 4;
  for (const auto& rec : by_rank) {
    if (rec.empty()) continue;
    ++count;
    bytes += 8 + rec.size();
  }
  out.reserve(bytes);
  appendU32(count, out);
  for (size_t k = 0; k < by_rank.size(); ++k) {
    if (by_rank[k].empty()) continue;
    appendU32(static_cast<uint32_t>(k), out);
    appendU32(static_cast<uint32_t>(by_rank[k].size()), out);
    out.insert(out.end(), by_rank[k].begin(), by_rank[k].end());
  }
  return out;
}

Result<std::vector<std::vector<uint8_t>>> parsePsStats(std::span<const uint8_t> payload,
                                                       uint32_t world_size) {
  const std::string what = "statistics broadcast of " + std::to_string(payload.size()) + " bytes";
  if (payload.size() < 4) return dataLoss(what + " is shorter than its count (4 bytes)");
  const uint32_t count = readU32(payload, 0);
  if (count > world_size) {
    return dataLoss(what + " counts " + std::to_string(count) + " records in a world of " +
                    std::to_string(world_size));
  }
  std::vector<std::vector<uint8_t>> out(world_size);
  size_t at = 4;
  std::optional<uint32_t> previous;
  for (uint32_t i = 0; i < count; ++i) {
    if (payload.size() - at < 8) {
      return dataLoss(what + ": record " + std::to_string(i) + " of " + std::to_string(count) +
                      " is cut short (" + std::to_string(payload.size() - at) +
                      " bytes left, its rank and length take 8)");
    }
    const uint32_t rank = readU32(payload, at), length = readU32(payload, at + 4);
    at += 8;
    if (rank >= world_size) {
      return dataLoss(what + " holds a record of rank " + std::to_string(rank) + " of a world of " +
                      std::to_string(world_size));
    }
    if (previous && rank <= *previous) {
      return dataLoss(what + ": the record of rank " + std::to_string(rank) +
                      " follows that of rank " + std::to_string(*previous) +
                      " (ranks must be ascending, each once)");
    }
    if (auto s = checkStatsSize(rank, length); !s.isOk()) return withContext(what, s);
    if (length > payload.size() - at) {
      return dataLoss(what + ": the record of rank " + std::to_string(rank) + " claims " +
                      std::to_string(length) + " bytes, " + std::to_string(payload.size() - at) +
                      " remain");
    }
    out[rank].assign(payload.begin() + static_cast<std::ptrdiff_t>(at),
                     payload.begin() + static_cast<std::ptrdiff_t>(at + length));
    at += length;
    previous = rank;
  }
  if (at != payload.size()) {
    return dataLoss(what + " has " + std::to_string(payload.size() - at) +
                    " bytes after its last record");
  }
  return out;
}

}  // namespace lightwire::proxy::peer
