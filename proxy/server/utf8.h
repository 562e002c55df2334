#pragma once
// UTF-8 checks for text that ends up in JSON (replies, the effective configuration, settings that
// travel to the peers): Boost.JSON writes a string's bytes as they are, and its parser, like any
// other, refuses what is not UTF-8, so one stray byte would make a whole document unreadable.

#include <cstddef>
#include <string>
#include <string_view>

namespace lightwire::proxy {

/// Length (1-4) of the well-formed UTF-8 sequence at s[i], or 0 when none starts there (RFC 3629:
/// no overlong forms, no surrogates, nothing above U+10FFFF).
inline size_t utf8SequenceAt(std::string_view s, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size() || at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if ((at(i + k) & 0xC0) != 0x80) return 0;
  }
  return n;
}

inline bool isValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8SequenceAt(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

/// `s` with every byte that starts no well-formed UTF-8 sequence replaced by '?'.
inline std::string toValidUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8SequenceAt(s, i);
    if (n == 0) {
      out += '?';
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace lightwire::proxy
