// Target `payload`: every codec's payload decoder on the path the step engine
// (proxy/step/host_backend.cc) and the exchanges (proxy/peer/collective.cc, ps_exchange.cc) apply
// to payloads from peers:
//   - single-round codecs: each chunk's list of payloads (one per contributing sidecar) decoded
//     into the chunk's range of the result, zeroed first, with weight 1 / contributors, stopping at
//     the first that does not decode; or as plain fp32 sums (codec `none`) when the exchange
//     switched to a dense allreduce;
//   - summable codecs: the payloads added in the compressed domain, ((p0 + p1) + p2) ..., into a
//     buffer of maxPayloadBytes(chunk) as the ring and the parameter server do, then the sum
//     decoded;
//   - the parameter server's other path: the chunks decoded into a dense sum that is re-compressed
//     with the server's codec (momentum and clipping off), whose payloads must decode again;
//   - the sparse allreduce (selection codecs, mode bit 4): each chunk's list as every rank's
//     contribution to its owner, summed and selected (kernels::reduceSelectChunk), and the list's
//     last payload as an owner's selection that this sidecar settles its state with, its first
//     as this sidecar's own payload: every chunk's pair checked (Codec::checkSelection), then,
//     when all pass, the step committed with them (Codec::commitState);
//   - PowerSGD (two rounds): the reduced round-0 payload is the `previous` of this sidecar's
//     round-1 encode, then decodeRounds() and finishStep() take both reduced rounds.
// Properties checked besides ASan/UBSan: a decoder that fails leaves its output untouched
// (docs/wire-format.md), a sum fits its buffer, what our own encoders produce decodes, an owner's
// selection decodes and holds at most its share of k, a selection refused by checkSelection
// changes no state, and the commit of selections it accepted does not fail.
//
// Input: u8 codec (fuzz_util.h codecConfigs()), u8 mode (bit 0 add the payloads, bit 1 server
// re-compression, bit 2 dense sums, bit 3 a shape follows, bit 4 the sparse allreduce), u32
// elements (at most 2^18), u32 requested chunk size, [u32 rows, u32 cols], u64 step, then up to 16
// pieces (u32 length, bytes): payload i belongs to chunk i % chunks (PowerSGD: to round i % 2).
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/select.h"
#include "tests/fuzz/targets.h"

namespace lightwire::fuzz::payload {
namespace {

using kernels::Chunking;
using kernels::Codec;
using kernels::CodecState;
using kernels::ConstTensor;
using kernels::DType;
using kernels::StepContext;

constexpr uint32_t kMaxElements = uint32_t{1} << 18;
constexpr size_t kMaxChunks = 64;
constexpr size_t kMaxPayloads = 16;

constexpr uint8_t kAdd = 1, kRecompress = 2, kDense = 4, kShape = 8, kGlobal = 16;

using Span = std::span<const uint8_t>;

/// The parameter server's codec for configuration i: the tensor's settings with momentum 0 and
/// clipping off (proxy/peer/ps_exchange.h).
const Codec& serverCodecAt(size_t i) {
  static const std::vector<std::unique_ptr<Codec>> codecs = [] {
    std::vector<std::unique_ptr<Codec>> v;
    for (auto c : codecConfigs()) {
      c.momentum = 0.0;
      c.clip_norm = 0.0;
      auto codec = kernels::createCodec(c);
      if (!codec) fail("server codec " + c.name + ": " + codec.status().message());
      v.push_back(std::move(codec).value());
    }
    return v;
  }();
  return *codecs.at(i);
}

struct Parsed {
  size_t config = 0;
  uint8_t mode = 0;
  size_t n = 0;
  size_t chunk = 0;
  std::vector<uint64_t> shape;
  uint64_t step = 0;
  std::vector<Span> payloads;
};

Parsed parse(const uint8_t* data, size_t size) {
  Reader in(data, size);
  Parsed p;
  p.config = in.u8() % codecConfigs().size();
  p.mode = in.u8();
  p.n = in.u32() % (kMaxElements + 1);
  p.chunk = in.u32();
  if (p.mode & kShape) {
    const uint64_t rows = in.u32(), cols = in.u32();
    if (rows * cols == p.n) p.shape = {rows, cols};  // the API refuses other shapes
  }
  p.step = in.u64();
  while (!in.empty() && p.payloads.size() < kMaxPayloads) p.payloads.push_back(in.piece());
  return p;
}

/// Writes the seed layout parse() reads.
std::vector<uint8_t> encode(size_t config, uint8_t mode, uint32_t n, uint32_t chunk,
                            const std::vector<uint64_t>& shape, uint64_t step,
                            const std::vector<std::vector<uint8_t>>& payloads) {
  Writer w;
  w.u8(static_cast<uint8_t>(config)).u8(mode).u32(n).u32(chunk);
  if (mode & kShape) w.u32(static_cast<uint32_t>(shape[0])).u32(static_cast<uint32_t>(shape[1]));
  w.u64(step);
  for (const auto& p : payloads) w.piece(p);
  return w.take();
}

StepContext contextFor(const Parsed& p, uint32_t rank) {
  StepContext ctx;
  ctx.seed = 7;
  ctx.name_key = kernels::tensorNameKey("fuzz.tensor");
  ctx.step = p.step;
  ctx.rank = rank;
  ctx.shape = p.shape;
  return ctx;
}

/// decodeChunk into `out`, checking that a refusal leaves it untouched.
Status decodeChecked(const Codec& codec, Span payload, float weight, std::vector<float>& out) {
  const std::vector<float> before = out;
  Status s = codec.decodeChunk(payload, weight, out.data(), out.size());
  if (!s.isOk()) {
    check(!s.message().empty(), std::string(codec.traits().name) + ": an error without a message");
    check(before.empty() || std::memcmp(before.data(), out.data(), 4 * out.size()) == 0,
          std::string(codec.traits().name) + " refused a payload (" + s.message() +
              ") but wrote its output");
  }
  return s;
}

/// ((p0 + p1) + p2) + ... as the ring and the parameter server add summable payloads; the sums
/// are kept in `held`. nullopt when a pair does not add up (the exchange fails the step).
std::optional<Span> addAll(const Codec& codec, const std::vector<Span>& list, size_t chunk_elements,
                           std::vector<std::vector<uint8_t>>& held) {
  Span acc = list[0];
  for (size_t k = 1; k < list.size(); ++k) {
    std::vector<uint8_t> sum(codec.maxPayloadBytes(chunk_elements));
    auto size = codec.addPayloads(acc, list[k], sum);
    if (!size) return std::nullopt;
    check(*size <= sum.size(), "addPayloads returned a size past its buffer");
    sum.resize(*size);
    held.push_back(std::move(sum));
    acc = held.back();
  }
  return acc;
}

/// The sparse allreduce of chunk c (docs/determinism.md "4.6b Global selection"): `list` as every
/// rank's contribution to the chunk's owner (its last payload is then an owner's selection that
/// this sidecar, whose own payload is the first, settles its state with: settle()).
void globalSelect(const Parsed& p, const Codec& codec, const Chunking& chunking, size_t c,
                  const std::vector<Span>& list) {
  const size_t len = chunking.size(c);
  // The share: the chunk's part of k by the entries sent (threshold: every sum of its floor).
  // Each rank declares its payload's entries as its whole layer's, plus the step's number: a
  // layer whose other chunks held that many more.
  const uint32_t min_key = codec.globalMinKey(static_cast<uint32_t>(list.size()));
  const size_t k = codec.selectionCount(p.n, std::nullopt);
  std::vector<uint64_t> entries;
  uint64_t chunk_entries = 0, layer_entries = 0;
  for (Span q : list) {
    auto count = kernels::sparseEntryCount(q, codec.traits().id, len);
    chunk_entries += count ? *count : 0;
    entries.push_back((count ? *count : 0) + p.step % 7);
    layer_entries += entries.back();
  }
  size_t k_c = len;
  if (min_key == 0) {
    const uint64_t cap = std::min<uint64_t>(k, layer_entries / list.size());
    k_c = layer_entries == 0 ? 0 : static_cast<size_t>(chunk_entries * cap / layer_entries);
  }
  std::vector<float> sums;
  std::vector<uint64_t> scratch;
  std::vector<uint8_t> sel(kernels::sparseMaxPayloadBytes(len, DType::kF32));
  const kernels::LayerCounts layer{k, entries};
  if (auto size = kernels::reduceSelectChunk(codec, list, len, layer, sums, scratch, sel)) {
    check(*size <= sel.size(), "a selection past its buffer");
    sel.resize(*size);
    std::vector<uint32_t> idx;
    std::vector<float> val;
    check(kernels::readSparseEntries(sel, codec.traits().id, len, idx, val).isOk(),
          "an owner's selection does not decode");
    check(idx.size() <= k_c, "a selection holds more than its share");
    if (min_key == 0) check(idx.size() <= k, "a selection holds more than k");
    for (float v : val) {
      check(kernels::magnitudeKey(v) >= min_key, "a selection holds an entry below its floor");
    }
  }
}

/// What this sidecar sent of one chunk and the owner's selection of it.
using Settled = std::pair<Span, Span>;

/// This sidecar settles a step of the sparse allreduce, as the step engine does, into a state
/// that holds something (pattern()): every chunk's pair (nullopt: a chunk that had no payloads,
/// for which it sent nothing and nothing was selected) is checked first (checkSelection, which
/// changes nothing); a step with a pair refused commits nothing, else the step on pattern(n)
/// is committed with the pairs (commitState), which must not fail.
void settle(const Parsed& p, const Codec& codec, const Chunking& chunking,
            const std::vector<std::optional<Settled>>& settled) {
  CodecState state(codec.stateFloats(p.n, p.shape));
  if (state.floats() == 0) return;
  const std::vector<float> fill = pattern(state.floats(), static_cast<uint32_t>(p.step));
  check(state.restore(fill).isOk(), "restoring a state of the codec's size failed");
  const std::string name = codec.traits().name;
  // An empty payload of the codec (an empty selection) for every chunk that had none.
  std::vector<std::vector<uint8_t>> empty(chunking.count());
  std::vector<Span> sent, selected;
  for (size_t c = 0; c < chunking.count(); ++c) {
    if (settled[c]) {
      sent.push_back(settled[c]->first);
      selected.push_back(settled[c]->second);
      const Status s = codec.checkSelection(chunking, c, sent.back(), selected.back());
      if (!s.isOk()) {
        check(std::memcmp(state.current(), fill.data(), 4 * fill.size()) == 0,
              name + " refused a selection (" + s.message() + ") but changed the state");
        return;  // the step fails: nothing is committed
      }
      continue;
    }
    const std::vector<float> zeros(chunking.size(c), 0.0f);
    std::vector<uint64_t> scratch;
    empty[c].resize(kernels::sparseMaxPayloadBytes(chunking.size(c), DType::kF32));
    auto size = kernels::writeGlobalSelection(codec.traits().id, zeros, 0, 0, scratch, empty[c]);
    check(size.isOk(), "writing an empty selection failed");
    empty[c].resize(*size);
    sent.push_back(empty[c]);
    selected.push_back(empty[c]);
  }
  StepContext ctx = contextFor(p, 0);
  ctx.defer_sent = true;
  const std::vector<float> x = pattern(p.n, static_cast<uint32_t>(p.step) + 1);
  const ConstTensor input{x.data(), p.n, DType::kF32};
  std::vector<std::byte> ws(codec.workspaceBytes(chunking));
  const Status a = codec.analyze(ctx, chunking, input, state, ws);
  check(a.isOk(), name + ": analyze of a valid tensor failed: " + a.message());
  const Status s = codec.commitState(ctx, chunking, input, sent, selected, state, ws);
  check(s.isOk(), name + ": committing selections checkSelection accepted failed: " + s.message());
}

/// The server re-compresses the dense sum; its own payloads must decode.
void recompress(const Parsed& p, const Chunking& chunking, const std::vector<float>& sum) {
  const Codec& server = serverCodecAt(p.config);
  const Chunking sc = kernels::chunkingFor(server, p.n, chunking.chunk_elements);
  CodecState state(server.stateFloats(p.n, p.shape));
  auto payloads = kernels::encodeTensor(server, contextFor(p, 0), sc,
                                        ConstTensor{sum.data(), p.n, DType::kF32}, state);
  check(payloads.isOk(), "re-compressing a decoded sum failed: " +
                             (payloads ? std::string() : payloads.status().message()));
  std::vector<float> back(p.n);
  const Status s = kernels::decodeTensor(server, sc, *payloads, 1.0f, back.data());
  check(s.isOk(), "a payload of our own encoder does not decode: " + s.message());
}

void singleRound(const Parsed& p, const Codec& codec) {
  Chunking chunking = kernels::chunkingFor(codec, p.n, p.chunk);
  if (chunking.count() > kMaxChunks) {
    chunking = kernels::chunkingFor(codec, p.n, (p.n + kMaxChunks - 1) / kMaxChunks);
  }
  const size_t chunks = chunking.count();
  const Codec& decoder = (p.mode & kDense) ? kernels::noneCodec() : codec;
  std::vector<float> sum(p.n, 0.0f);  // the parameter server's dense sum (weight 1)
  bool all_decoded = true;
  const bool global = (p.mode & kGlobal) && !(p.mode & kDense) && codec.selectsGlobally();
  std::vector<std::optional<Settled>> settled(chunks);  // the sparse allreduce's, per chunk
  for (size_t c = 0; c < chunks; ++c) {
    std::vector<Span> list;
    for (size_t i = c; i < p.payloads.size(); i += chunks) list.push_back(p.payloads[i]);
    if (list.empty()) continue;
    const size_t len = chunking.size(c), begin = chunking.begin(c);
    // The step engine: zeroed range, then every contribution with weight 1 / contributors. An
    // exactly sized buffer per chunk, so ASan sees a write into the next chunk.
    std::vector<float> out(len, 0.0f);
    const float weight = 1.0f / static_cast<float>(list.size());
    for (Span payload : list) {
      if (!decodeChecked(decoder, payload, weight, out).isOk()) break;
    }
    // The parameter server's dense path: weight 1 into the sum.
    std::vector<float> dense(len, 0.0f);
    for (Span payload : list) {
      if (!decodeChecked(decoder, payload, 1.0f, dense).isOk()) {
        all_decoded = false;
        break;
      }
    }
    std::copy(dense.begin(), dense.end(), sum.begin() + static_cast<std::ptrdiff_t>(begin));
    if (global) {
      globalSelect(p, codec, chunking, c, list);
      settled[c] = Settled{list.front(), list.back()};
    }
    if (p.mode & kAdd) {
      std::vector<std::vector<uint8_t>> held;
      if (auto total = addAll(codec, list, len, held)) {
        std::vector<float> result(len, 0.0f);
        (void)decodeChecked(codec, *total, 1.0f, result);
      }
    }
  }
  if (global) settle(p, codec, chunking, settled);
  if ((p.mode & kRecompress) && all_decoded && !(p.mode & kDense)) recompress(p, chunking, sum);
}

/// PowerSGD: round r's payloads are the pieces i with i % 2 == r, summed as the exchange does.
void twoRounds(const Parsed& p, const Codec& codec) {
  const Chunking chunking = kernels::chunkingFor(codec, p.n, 0);
  const StepContext ctx = contextFor(p, 0);
  const std::vector<float> x = pattern(p.n, static_cast<uint32_t>(p.step));
  const ConstTensor input{x.data(), p.n, DType::kF32};
  CodecState state(codec.stateFloats(p.n, ctx.shape));
  std::vector<std::byte> ws(codec.workspaceBytes(chunking));
  const Status analyzed = codec.analyze(ctx, chunking, input, state, ws);
  check(analyzed.isOk(), "powersgd analyze of a valid tensor failed: " + analyzed.message());
  std::vector<uint8_t> own(codec.maxPayloadBytes(p.n));
  auto size = codec.encodeChunk(ctx, chunking, 0, 0, {}, input, state, ws, own);
  check(size.isOk(), "powersgd round 0 of a valid tensor failed");

  std::vector<std::vector<uint8_t>> held;
  std::vector<Span> reduced;
  for (size_t round = 0; round < 2; ++round) {
    std::vector<Span> list;
    for (size_t i = round; i < p.payloads.size(); i += 2) list.push_back(p.payloads[i]);
    if (list.empty()) return;
    auto total = addAll(codec, list, p.n, held);
    if (!total) return;
    reduced.push_back(*total);
    if (round == 0) {
      // This sidecar's round 1 starts from the reduced round 0 it received.
      if (!codec.encodeChunk(ctx, chunking, 0, 1, reduced[0], input, state, ws, own)) return;
    }
  }
  std::vector<float> out(p.n, 0.0f);
  const std::vector<float> before = out;
  const Status s = codec.decodeRounds(reduced, 0.5f, out.data(), p.n);
  if (!s.isOk()) {
    check(before == out, "powersgd refused its rounds (" + s.message() + ") but wrote its output");
    return;
  }
  if (codec.finishStep(ctx, chunking, reduced, 0.5f, input, state, ws).isOk()) {
    // `sent`: one payload of our own (multi-round codecs do not read it).
    const std::vector<Span> sent{own};
    const Status c = codec.commitState(ctx, chunking, input, sent, {}, state, ws);
    check(c.isOk(),
          "powersgd: commitState after a finishStep that succeeded failed: " + c.message());
    (void)codec.residualNorm2(state, p.n);
  }
}

/// PowerSGD seeds: round 0 of two ranks, their sum, then each rank's round 1 from that sum, in
/// the input's order (rank 0 round 0, rank 0 round 1, rank 1 round 0, rank 1 round 1).
std::vector<std::vector<uint8_t>> twoRankRounds(const Codec& codec, const Parsed& p) {
  const Chunking chunking = kernels::chunkingFor(codec, p.n, 0);
  std::vector<std::vector<uint8_t>> p0(2), p1(2);
  std::vector<std::vector<float>> xs;
  std::vector<CodecState> states;
  std::vector<std::vector<std::byte>> wss;
  for (uint32_t r = 0; r < 2; ++r) {
    xs.push_back(pattern(p.n, 3 + r));
    states.emplace_back(codec.stateFloats(p.n, p.shape));
    wss.emplace_back(codec.workspaceBytes(chunking));
    const ConstTensor input{xs[r].data(), p.n, DType::kF32};
    if (!codec.analyze(contextFor(p, r), chunking, input, states[r], wss[r]).isOk()) {
      fail("seed analyze");
    }
    p0[r].resize(codec.maxPayloadBytes(p.n));
    auto s =
        codec.encodeChunk(contextFor(p, r), chunking, 0, 0, {}, input, states[r], wss[r], p0[r]);
    if (!s) fail("seed encode round 0");
    p0[r].resize(*s);
  }
  std::vector<uint8_t> sum(codec.maxPayloadBytes(p.n));
  auto s = codec.addPayloads(p0[0], p0[1], sum);
  if (!s) fail("seed add");
  sum.resize(*s);
  for (uint32_t r = 0; r < 2; ++r) {
    const ConstTensor input{xs[r].data(), p.n, DType::kF32};
    p1[r].resize(codec.maxPayloadBytes(p.n));
    auto e =
        codec.encodeChunk(contextFor(p, r), chunking, 0, 1, sum, input, states[r], wss[r], p1[r]);
    if (!e) fail("seed encode round 1");
    p1[r].resize(*e);
  }
  return {p0[0], p1[0], p0[1], p1[1]};
}

}  // namespace

int run(const uint8_t* data, size_t size) {
  const Parsed p = parse(data, size);
  const Codec& codec = codecAt(p.config);
  if (codec.traits().rounds > 1) {
    twoRounds(p, codec);
  } else {
    singleRound(p, codec);
  }
  return 0;
}

void seeds(Seeds& out) {
  const auto& configs = codecConfigs();
  for (size_t i = 0; i < configs.size(); ++i) {
    const Codec& codec = codecAt(i);
    const std::string name = std::to_string(i) + "_" + configs[i].name;
    for (uint32_t n : {1u, 37u, 3000u}) {
      // Two sidecars' payloads of one step, chunks of 1024 elements (PowerSGD: one chunk).
      const uint32_t chunk = n > 1024 ? 1024 : 0;
      const Chunking chunking = kernels::chunkingFor(codec, n, chunk);
      std::vector<uint64_t> shape;
      if (n == 3000) shape = {60, 50};
      Parsed p{.config = i, .n = n, .chunk = chunk, .shape = shape, .step = 3};
      std::vector<std::vector<uint8_t>> payloads;
      if (codec.traits().rounds > 1) {
        payloads = twoRankRounds(codec, p);
        out.emplace_back(name + "_n" + std::to_string(n),
                         encode(i, shape.empty() ? 0 : kShape, n, chunk, shape, 3, payloads));
        continue;
      }
      for (uint32_t r = 0; r < 2; ++r) {
        CodecState state(codec.stateFloats(n));
        for (auto& payload : encodePattern(codec, chunking, 3 + r, contextFor(p, r), state)) {
          payloads.push_back(std::move(payload));
        }
      }
      const uint8_t mode = codec.traits().summable ? kAdd : kRecompress;
      out.emplace_back(name + "_n" + std::to_string(n), encode(i, mode, n, chunk, {}, 3, payloads));
      if (codec.selectsGlobally()) {  // the same payloads through the sparse allreduce
        out.emplace_back(name + "_global_n" + std::to_string(n),
                         encode(i, kGlobal, n, chunk, {}, 3, payloads));
      }
    }
  }
  // Found by fuzzing: an empty PowerSGD tensor whose zero dimension comes second was refused.
  const size_t psgd = codecIndex("powersgd");
  const Parsed empty{.config = psgd, .shape = {5, 0}, .step = 3};
  out.emplace_back("powersgd_shape_5x0",
                   encode(psgd, kShape, 0, 0, empty.shape, 3, twoRankRounds(codecAt(psgd), empty)));
  // A dense allreduce's sums: plain fp32 chunks in the `none` layout, decoded as such.
  CodecState none_state;
  const auto dense =
      encodePattern(kernels::noneCodec(), Chunking::make(500, 0, 1), 9, {}, none_state);
  out.emplace_back("dense_topk", encode(codecIndex("topk"), kDense, 500, 0, {}, 1, dense));
  // A chunk with NaN and Inf: the quantising codecs send it in the `none` layout.
  std::vector<float> bad = pattern(256, 4);
  bad[3] = NAN;
  bad[200] = -INFINITY;
  for (const char* codec : {"qsgd", "terngrad", "signsgd", "onebit"}) {
    const size_t i = codecIndex(codec);
    CodecState state(codecAt(i).stateFloats(256));
    auto enc = kernels::encodeTensor(codecAt(i), {}, kernels::chunkingFor(codecAt(i), 256, 0),
                                     ConstTensor{bad.data(), 256, DType::kF32}, state);
    if (!enc) fail("seed nonfinite");
    out.emplace_back("nonfinite_" + configs[i].name, encode(i, kRecompress, 256, 0, {}, 1, *enc));
  }
}

}  // namespace lightwire::fuzz::payload
