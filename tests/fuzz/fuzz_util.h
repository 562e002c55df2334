#pragma once
// Helpers shared by the libFuzzer targets of tests/fuzz/ (README.md there) and by their seed
// generator and corpus replayer (corpus_tool.cc): reading an input field by field and writing
// seeds in the same layout, the property check, scratch directories, the codec configurations the
// targets choose from, and deterministic tensors.
//
// Every target is a namespace lightwire::fuzz::<target> with
//   int run(const uint8_t* data, size_t size);   // one input (LLVMFuzzerTestOneInput's body)
//   void seeds(Seeds& out);                       // its seed corpus: real, valid inputs
// and is listed in targets.h. entry.cc turns one of them into a libFuzzer executable.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/codec.h"

namespace lightwire::proxy {
struct CompressionConfig;
}  // namespace lightwire::proxy

namespace lightwire::fuzz {

/// Seed files of one target: (file name, contents).
using Seeds = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

/// The job every target's frames, states and checkpoints belong to.
inline constexpr std::string_view kJob = "fuzz-job";

/// Reads an input from the front, little-endian. Past the end every field reads as zero and every
/// byte range as empty, so every input is a valid one.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : rest_(data, size) {}
  explicit Reader(std::span<const uint8_t> bytes) : rest_(bytes) {}

  template <typename T>
  T le() {
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T) && !rest_.empty(); ++i) {
      v |= uint64_t{rest_[0]} << (8 * i);
      rest_ = rest_.subspan(1);
    }
    return static_cast<T>(v);
  }
  uint8_t u8() { return le<uint8_t>(); }
  uint16_t u16() { return le<uint16_t>(); }
  uint32_t u32() { return le<uint32_t>(); }
  uint64_t u64() { return le<uint64_t>(); }

  /// The next `n` bytes (fewer at the end).
  std::span<const uint8_t> take(size_t n) {
    n = std::min(n, rest_.size());
    auto out = rest_.first(n);
    rest_ = rest_.subspan(n);
    return out;
  }
  /// A u32 length, then that many bytes (fewer at the end).
  std::span<const uint8_t> piece() { return take(u32()); }
  /// Everything left.
  std::span<const uint8_t> rest() { return take(rest_.size()); }
  bool empty() const { return rest_.empty(); }

 private:
  std::span<const uint8_t> rest_;
};

/// Writes a seed in the layout Reader reads.
class Writer {
 public:
  template <typename T>
  Writer& le(T v) {
    for (size_t i = 0; i < sizeof(T); ++i)
      out_.push_back(static_cast<uint8_t>(uint64_t{v} >> (8 * i)));
    return *this;
  }
  Writer& u8(uint8_t v) { return le(v); }
  Writer& u16(uint16_t v) { return le(v); }
  Writer& u32(uint32_t v) { return le(v); }
  Writer& u64(uint64_t v) { return le(v); }
  Writer& bytes(std::span<const uint8_t> b) {
    out_.insert(out_.end(), b.begin(), b.end());
    return *this;
  }
  Writer& bytes(std::string_view s) {
    return bytes({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
  }
  Writer& piece(std::span<const uint8_t> b) {
    return u32(static_cast<uint32_t>(b.size())).bytes(b);
  }
  Writer& piece(std::string_view s) { return u32(static_cast<uint32_t>(s.size())).bytes(s); }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

inline std::vector<uint8_t> bytesOf(std::string_view s) { return {s.begin(), s.end()}; }
inline std::string_view textOf(std::span<const uint8_t> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

/// Silences the library's logging (malformed inputs are logged at warn: millions of lines), unless
/// LW_FUZZ_LOG is set. Called once by every entry point.
void quiet();

/// A broken invariant that is not a crash (a decoder that failed but wrote its output, a state
/// that does not read back): printed, then abort(), so libFuzzer keeps the input as a crash.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what.c_str());
  std::abort();
}
inline void check(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

/// A private directory for targets that need files (config files, checkpoints, a sidecar's
/// state), created on first use under /dev/shm when there is one (checkpoints fsync; tmpfs makes
/// that free) or $TMPDIR, removed with its contents at exit. Not thread-safe.
class ScratchDir {
 public:
  static ScratchDir& get();
  ~ScratchDir();
  const std::string& path() const { return path_; }
  /// Removes everything inside (each input starts from an empty directory).
  void clear() const;
  /// Writes `bytes` to file `name` inside; returns its path.
  std::string write(const std::string& name, std::span<const uint8_t> bytes) const;

 private:
  ScratchDir();
  std::string path_;
};

/// The codec configurations a target picks from with one input byte: every codec with the
/// options that change its payload or state layout (fp16 sparse values, bucket sizes, qsgd bits,
/// error feedback, DGC momentum and clipping, PowerSGD ranks).
const std::vector<kernels::CodecConfig>& codecConfigs();
/// createCodec(codecConfigs()[i]) for every i, built once.
const kernels::Codec& codecAt(size_t i);

/// The index in codecConfigs() of the first configuration of codec `name`.
size_t codecIndex(std::string_view name);

/// One step of a single-round codec on pattern(n, seed) (n = chunking.elements): every chunk's
/// payload, `state` read and left as it was (not committed). Aborts on error (seeds are made of
/// valid steps).
std::vector<std::vector<uint8_t>> encodePattern(const kernels::Codec& codec,
                                                const kernels::Chunking& chunking, uint32_t seed,
                                                const kernels::StepContext& ctx,
                                                kernels::CodecState& state);

/// One whole step of `codec` on this sidecar alone (world size 1) from `state`, as the step
/// engine runs it: analyze, every chunk (or both PowerSGD rounds) encoded and its own payloads
/// decoded, finishStep, commit; with `flush`, a full synchronisation instead. The input is
/// pattern(n, seed). Errors of analyze() are returned (a restored state may be refused); a
/// payload of our own that does not decode aborts.
Status runStep(const kernels::Codec& codec, size_t n, uint32_t seed, kernels::CodecState& state,
               bool flush = false);

/// A deterministic tensor of n values of mixed sign and magnitude (a few exact zeros), from an
/// integer hash: no RNG state, the same on every run.
std::vector<float> pattern(size_t n, uint32_t seed);

/// Why `text` is not JSON Boost.JSON parses (the error and the text around where it stopped), or ""
/// when it is.
std::string jsonError(std::string_view text);

/// What every sidecar does with a compression section that was accepted (from the YAML file or
/// a PUT /v1/config body): its JSON (what PUT proposes to the peers) must read back through
/// compressionFromJson() as the same section, and every codec its chooser can pick (the default
/// and each rule's) must build. A broken property aborts.
void checkCompression(const proxy::CompressionConfig& c);

}  // namespace lightwire::fuzz
