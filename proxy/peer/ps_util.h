#pragma once
// Checks the `ps` topology's exchange and its frames share (ps_exchange.cc, ps_frames.cc).

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/status.h"
#include "proxy/exchange/exchange.h"

namespace lightwire::proxy::peer {

/// Checks the size of rank `rank`'s statistics record (non-empty, at most kMaxStatsBytes).
inline Status checkStatsSize(uint32_t rank, size_t bytes) {
  if (bytes == 0) {
    return dataLoss("the statistics record of rank " + std::to_string(rank) + " is empty");
  }
  if (bytes > kMaxStatsBytes) {
    return dataLoss("the statistics record of rank " + std::to_string(rank) + " has " +
                    std::to_string(bytes) + " bytes, more than " + std::to_string(kMaxStatsBytes));
  }
  return Status::ok();
}

inline Status withContext(const std::string& context, const Status& s) {
  return Status(s.code(), context + ": " + s.message());
}

}  // namespace lightwire::proxy::peer
