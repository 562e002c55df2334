#include "tests/fuzz/fuzz_util.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <vector>

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>
#include <boost/json/stream_parser.hpp>

#include <spdlog/spdlog.h>

#include "kernels/registry.h"
#include "proxy/config/config.h"
#include "proxy/server/control_api.h"

namespace lightwire::fuzz {

void quiet() {
  if (std::getenv("LW_FUZZ_LOG") == nullptr) spdlog::set_level(spdlog::level::off);
}

ScratchDir::ScratchDir() {
  std::string base = "/dev/shm";
  if (::access(base.c_str(), W_OK) != 0) {
    const char* tmp = std::getenv("TMPDIR");
    base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  std::string tmpl = base + "/lightwire-fuzz-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) fail("cannot create a scratch directory in " + base);
  path_ = tmpl;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

ScratchDir& ScratchDir::get() {
  static ScratchDir dir;
  return dir;
}

void ScratchDir::clear() const {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(path_, ec)) {
    std::error_code ignored;
    std::filesystem::remove_all(entry.path(), ignored);
  }
}

std::string ScratchDir::write(const std::string& name, std::span<const uint8_t> bytes) const {
  const std::string p = path_ + "/" + name;
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) fail("cannot write " + p);
  return p;
}

const std::vector<kernels::CodecConfig>& codecConfigs() {
  using kernels::DType;
  static const std::vector<kernels::CodecConfig> configs = {
      {.name = "none"},
      {.name = "none", .error_feedback = true},
      {.name = "fp16"},
      {.name = "fp16", .error_feedback = true},
      {.name = "bf16"},
      {.name = "topk", .density = 0.01},
      {.name = "topk", .ratio = 300.0, .sparse_values = DType::kF16},
      {.name = "topk", .density = 0.05, .error_feedback = false},
      {.name = "dgc", .density = 0.01},
      {.name = "dgc", .density = 0.001, .momentum = 0.9, .clip_norm = 50.0},
      {.name = "dgc", .density = 0.02, .sparse_values = DType::kF16},
      {.name = "qsgd", .bits = 8},
      {.name = "qsgd", .bits = 4, .bucket_size = 100},
      {.name = "qsgd", .bits = 2, .bucket_size = 64, .error_feedback = true},
      {.name = "randomk", .density = 0.05},
      {.name = "randomk", .ratio = 50.0, .sparse_values = DType::kF16},
      {.name = "threshold", .threshold = 1.5},
      {.name = "threshold",
       .sparse_values = DType::kF16,
       .threshold = 1.0,
       .error_feedback = false},
      {.name = "terngrad"},
      {.name = "terngrad", .bucket_size = 100, .error_feedback = true},
      {.name = "signsgd"},
      {.name = "signsgd", .bucket_size = 64, .error_feedback = false},
      {.name = "onebit"},
      {.name = "onebit", .bucket_size = 1000},
      {.name = "powersgd", .approx_rank = 1},
      {.name = "powersgd", .approx_rank = 2},
      {.name = "powersgd", .approx_rank = 4},
  };
  return configs;
}

const kernels::Codec& codecAt(size_t i) {
  static const std::vector<std::unique_ptr<kernels::Codec>> codecs = [] {
    std::vector<std::unique_ptr<kernels::Codec>> v;
    for (const auto& c : codecConfigs()) {
      auto codec = kernels::createCodec(c);
      if (!codec) fail("codec " + c.name + ": " + codec.status().message());
      v.push_back(std::move(codec).value());
    }
    return v;
  }();
  return *codecs.at(i);
}

size_t codecIndex(std::string_view name) {
  const auto& configs = codecConfigs();
  for (size_t i = 0; i < configs.size(); ++i) {
    if (configs[i].name == name) return i;
  }
  fail("no configuration of codec " + std::string(name));
}

std::vector<std::vector<uint8_t>> encodePattern(const kernels::Codec& codec,
                                                const kernels::Chunking& chunking, uint32_t seed,
                                                const kernels::StepContext& ctx,
                                                kernels::CodecState& state) {
  const std::vector<float> x = pattern(chunking.elements, seed);
  auto payloads = kernels::encodeTensor(
      codec, ctx, chunking, kernels::ConstTensor{x.data(), x.size(), kernels::DType::kF32}, state);
  if (!payloads)
    fail(std::string("seed step of ") + codec.traits().name + ": " + payloads.status().message());
  return std::move(payloads).value();
}

Status runStep(const kernels::Codec& codec, size_t n, uint32_t seed, kernels::CodecState& state,
               bool flush) {
  using kernels::ConstTensor;
  const kernels::Chunking chunking = kernels::chunkingFor(codec, n, 256);
  kernels::StepContext ctx;
  ctx.seed = 7;
  ctx.name_key = 0x5EED;
  ctx.step = seed;
  const std::vector<float> x = pattern(n, seed);
  const ConstTensor input{x.data(), n, kernels::DType::kF32};
  std::vector<float> out(n, 0.0f);
  const std::string name = codec.traits().name;
  if (flush) {
    LW_RETURN_IF_ERROR(codec.flush(ctx, chunking, input, state, out.data()));
    codec.commitFlush(state, n);
    return Status::ok();
  }
  std::vector<std::byte> ws(codec.workspaceBytes(chunking));
  LW_RETURN_IF_ERROR(codec.analyze(ctx, chunking, input, state, ws));
  std::vector<std::vector<uint8_t>> payloads;
  std::span<const uint8_t> previous;
  for (int round = 0; round < codec.traits().rounds; ++round) {
    for (size_t c = 0; c < chunking.count(); ++c) {
      std::vector<uint8_t> p(codec.maxPayloadBytes(chunking.size(c)));
      auto size = codec.encodeChunk(ctx, chunking, c, round, previous, input, state, ws, p);
      check(size.isOk(), name + " did not encode a chunk after analyze() accepted the state: " +
                             (size ? std::string() : size.status().message()));
      p.resize(*size);
      payloads.push_back(std::move(p));
      if (codec.traits().rounds == 1) {
        const Status d = codec.decodeChunk(payloads.back(), 1.0f, out.data() + chunking.begin(c),
                                           chunking.size(c));
        check(d.isOk(), name + ": a payload of our own does not decode: " + d.message());
      }
    }
    previous = payloads.back();
  }
  if (codec.traits().rounds > 1) {
    const std::vector<std::span<const uint8_t>> rounds(payloads.begin(), payloads.end());
    const Status d = codec.decodeRounds(rounds, 1.0f, out.data(), n);
    check(d.isOk(), name + ": payloads of our own do not decode: " + d.message());
    const Status f = codec.finishStep(ctx, chunking, rounds, 1.0f, input, state, ws);
    check(f.isOk(), name + ": finishStep of our own payloads failed: " + f.message());
  }
  // Committed with round 0's payloads, one per chunk (multi-round codecs do not read them).
  const std::vector<std::span<const uint8_t>> sent(
      payloads.begin(), payloads.begin() + static_cast<std::ptrdiff_t>(chunking.count()));
  const Status committed = codec.commitState(ctx, chunking, input, sent, {}, state, ws);
  check(committed.isOk(), name + ": committing our own payloads failed: " + committed.message());
  (void)codec.residualNorm2(state, n);
  return Status::ok();
}

std::vector<float> pattern(size_t n, uint32_t seed) {
  std::vector<float> x(n);
  uint32_t h = seed * 2654435761u + 0x9E3779B9u;
  for (size_t i = 0; i < n; ++i) {
    h ^= h << 13;
    h ^= h >> 17;
    h ^= h << 5;
    // Mostly small values of both signs, some larger ones, an exact zero every 97th element.
    const float unit = static_cast<float>(static_cast<int32_t>(h & 0xFFFF) - 32768) / 32768.0f;
    x[i] = i % 97 == 0 ? 0.0f : unit * ((h >> 16) % 17 == 0 ? 8.0f : 1.0f);
  }
  return x;
}

std::string jsonError(std::string_view text) {
  boost::json::stream_parser p;
  boost::system::error_code ec;
  const size_t used = p.write_some(text.data(), text.size(), ec);
  if (!ec) p.finish(ec);
  if (!ec) return "";
  const size_t from = used > 60 ? used - 60 : 0;
  return ec.message() + " at byte " + std::to_string(used) + ": ..." +
         std::string(text.substr(from, 120)) + "...";
}

namespace {

/// Equal JSON values: numbers by value (an integer may come back as int64 or uint64), doubles
/// within 4 units in the last place, since Boost.JSON 1.81 parses numbers faster than exactly
/// (1.8446744073709542E20, which it writes, reads back as ...545E20).
bool sameJson(const boost::json::value& a, const boost::json::value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_uint64() && b.is_uint64()) return a.get_uint64() == b.get_uint64();
    if (a.is_int64() && b.is_int64()) return a.get_int64() == b.get_int64();
    if (!a.is_double() && !b.is_double()) {  // int64 and uint64
      const int64_t i = a.is_int64() ? a.get_int64() : b.get_int64();
      const uint64_t u = a.is_uint64() ? a.get_uint64() : b.get_uint64();
      return i >= 0 && static_cast<uint64_t>(i) == u;
    }
    const double x = a.to_number<double>(), y = b.to_number<double>();
    if (x == y) return true;
    int64_t ix, iy;
    std::memcpy(&ix, &x, 8);
    std::memcpy(&iy, &y, 8);
    return (ix < 0) == (iy < 0) && std::llabs(ix - iy) <= 4;
  }
  if (a.kind() != b.kind()) return false;
  if (a.is_array()) {
    const auto &x = a.get_array(), &y = b.get_array();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!sameJson(x[i], y[i])) return false;
    }
    return true;
  }
  if (a.is_object()) {
    const auto &x = a.get_object(), &y = b.get_object();
    if (x.size() != y.size()) return false;
    for (const auto& kv : x) {
      const auto* other = y.if_contains(kv.key());
      if (other == nullptr || !sameJson(kv.value(), *other)) return false;
    }
    return true;
  }
  return a == b;
}

}  // namespace

void checkCompression(const proxy::CompressionConfig& c) {
  const std::string text = boost::json::serialize(proxy::toJson(c));
  const std::string bad = jsonError(text);
  check(bad.empty(), "the compression section's JSON does not parse: " + bad);
  const boost::json::value v = boost::json::parse(text);
  auto back = proxy::compressionFromJson(v);
  check(back.isOk(), "the compression section's JSON is refused (" +
                         (back ? std::string() : back.status().message()) +
                         "): " + text.substr(0, 400));
  const boost::json::object again = proxy::toJson(*back);
  check(sameJson(again, v), "the compression section changes through JSON: " + text.substr(0, 300) +
                                " became " + boost::json::serialize(again).substr(0, 300));
  // The engine's chooser: the first matching rule, else the default.
  auto chooser = proxy::chooserFor(std::make_shared<const proxy::CompressionConfig>(*back));
  std::vector<kernels::CodecConfig> chosen = {c.default_codec};
  for (const auto& r : c.rules) chosen.push_back(r.codec);
  chosen.push_back(chooser(proxy::TensorFacts{"fuzz.tensor", 4096}).codec);
  for (const auto& codec : chosen) {
    auto built = kernels::createCodec(codec);
    check(built.isOk(), "an accepted codec setting does not build (" +
                            (built ? std::string() : built.status().message()) +
                            "): " + codec.name);
  }
}

}  // namespace lightwire::fuzz
