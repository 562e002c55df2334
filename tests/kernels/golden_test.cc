// Golden payloads (docs/determinism.md): every codec must reproduce, byte for byte, the payloads
// that the independent reference tests/reference/lwref.py computes from the spec, and decode them
// bit for bit like the reference. The files live in tests/kernels/golden/ (layout: see
// tests/reference/make_golden.py); regenerate with
//   ${PYTHON:-/usr/bin/python3} tests/reference/make_golden.py
// and verify that the committed files are current with `make_golden.py --check`.
#include <doctest.h>

#include <bit>
#include <boost/json.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/select.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/golden_manifest.h"
#include "tests/kernels/test_util.h"

namespace test_golden {

namespace json = boost::json;
using namespace lightwire::kernels;

static_assert(std::endian::native == std::endian::little, "golden files are little-endian");

namespace {

const std::string& kGoldenDir = golden::dir();
using golden::readFile;

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

using golden::configFrom;
using golden::toDouble;
using golden::toOptDouble;

// Reads a file of concatenated payloads and cuts it by the manifest's sizes.
bool splitPayloads(const std::string& rel, const json::array& sizes,
                   std::vector<std::vector<uint8_t>>& out) {
  std::vector<uint8_t> all;
  if (!readFile(rel, all)) return false;
  out.clear();
  size_t off = 0;
  for (const auto& ps : sizes) {
    const size_t len = static_cast<size_t>(ps.to_number<uint64_t>());
    if (off + len > all.size()) return false;
    out.emplace_back(all.begin() + off, all.begin() + off + len);
    off += len;
  }
  return off == all.size();
}

// Runs one manifest case on a CpuStream of `threads`; returns a description of every mismatch
// (empty: the case matches the golden files).
// A multi-round (PowerSGD) case: `world` ranks, each with its own state; per step every rank
// analyzes its input, every round is encoded by every rank (with the previous round's reduced
// payload) and summed with addPayloads in rank order ((p0 + p1) + p2 ...); then every rank
// decodes the reduced payloads (decodeRounds), finishes its step (finishStep) and commits its
// state (commitState), as tests/kernels/multirank.h does. Checks every sent payload, every reduced
// payload and the decoded result (of every rank) against the golden files.
std::vector<std::string> runMultiRoundCase(const json::object& c, unsigned threads) {
  std::vector<std::string> errors;
  auto fail = [&](const std::string& m) { errors.push_back(m); };
  const CodecConfig config = configFrom(c.at("config").as_object());
  const std::string tensor(c.at("tensor_name").as_string());
  const auto dtype = parseDType(std::string(c.at("dtype").as_string()));
  if (!dtype) return {"unknown dtype"};
  const size_t n = static_cast<size_t>(c.at("elements").to_number<uint64_t>());
  const size_t world = static_cast<size_t>(c.at("world").to_number<uint64_t>());
  std::vector<uint64_t> shape;
  if (const json::value* sh = c.if_contains("shape"); sh != nullptr && !sh->is_null()) {
    for (const auto& d : sh->as_array()) shape.push_back(d.to_number<uint64_t>());
  }
  auto made = createCodec(config);
  if (!made.isOk()) return {"createCodec failed: " + made.status().message()};
  const Codec& codec = **made;
  const Chunking chunking = chunkingFor(codec, n, 0);
  if (chunking.count() != 1) return {"multi-round codec is not single-chunk"};
  const int rounds = codec.traits().rounds;

  CpuStream stream(threads);
  std::vector<CodecState> states;
  std::vector<std::vector<std::byte>> ws(world);
  for (size_t r = 0; r < world; ++r) {
    states.emplace_back(codec.stateFloats(n));
    ws[r].resize(codec.workspaceBytes(chunking));
  }
  for (const json::value& sv : c.at("steps").as_array()) {
    const json::object& s = sv.as_object();
    const uint64_t step_no = s.at("step").to_number<uint64_t>();
    const std::string where = "step " + std::to_string(step_no) + ": ";
    const float weight = static_cast<float>(toDouble(s.at("weight")));
    const auto& in_files = s.at("inputs").as_array();
    const auto& sent_files = s.at("sent").as_array();
    const auto& red_files = s.at("reduced").as_array();
    if (in_files.size() != world || sent_files.size() != static_cast<size_t>(rounds) ||
        red_files.size() != static_cast<size_t>(rounds)) {
      return {where + "manifest does not match world/rounds"};
    }
    std::vector<std::vector<uint8_t>> raw(world);
    std::vector<ConstTensor> inputs;
    for (size_t r = 0; r < world; ++r) {
      if (!readFile(std::string(in_files[r].as_string()), raw[r]) ||
          raw[r].size() != n * dtypeSize(*dtype)) {
        return {where + "cannot read input of rank " + std::to_string(r)};
      }
      raw[r].resize(raw[r].size() + 4);  // never empty; vector storage is suitably aligned
      inputs.push_back(ConstTensor{raw[r].data(), n, *dtype});
    }
    std::vector<uint64_t> step_shape = shape;
    if (const json::value* sh = s.if_contains("shape")) {
      step_shape.clear();
      if (!sh->is_null()) {
        for (const auto& d : sh->as_array()) step_shape.push_back(d.to_number<uint64_t>());
      }
    }
    // PowerSGD's state is sized by the step's matrix view: a change of view keeps the error and
    // draws the warm start afresh (as the engine does).
    for (auto& st : states) {
      if (st.floats() != codec.stateFloats(n, step_shape)) {
        st.resize(codec.stateFloats(n, step_shape), n);
      }
    }
    auto ctxOf = [&](size_t r) {
      StepContext ctx;
      ctx.seed = static_cast<uint32_t>(c.at("seed").to_number<uint64_t>());
      ctx.name_key = tensorNameKey(tensor);
      ctx.step = step_no;
      ctx.rank = static_cast<uint32_t>(r);
      ctx.stream = &stream;
      ctx.shape = step_shape;
      return ctx;
    };
    for (size_t r = 0; r < world; ++r) {
      const lightwire::Status st = codec.analyze(ctxOf(r), chunking, inputs[r], states[r], ws[r]);
      if (!st.isOk()) return {where + "analyze failed: " + st.message()};
    }
    std::vector<std::vector<uint8_t>> reduced;
    std::vector<std::vector<uint8_t>> own_sent(world);  // each rank's round-0 payload
    for (int round = 0; round < rounds; ++round) {
      const std::string rw = where + "round " + std::to_string(round) + ": ";
      std::vector<uint8_t> golden_reduced;
      if (!readFile(std::string(red_files[round].as_string()), golden_reduced)) {
        return {rw + "cannot read reduced payload"};
      }
      const std::span<const uint8_t> previous =
          round == 0 ? std::span<const uint8_t>{} : std::span<const uint8_t>(reduced.back());
      std::vector<uint8_t> sum;
      for (size_t r = 0; r < world; ++r) {
        std::vector<uint8_t> sent(codec.maxPayloadBytes(n));
        auto size = codec.encodeChunk(ctxOf(r), chunking, 0, round, previous, inputs[r], states[r],
                                      ws[r], sent);
        if (!size.isOk()) return {rw + "encodeChunk failed: " + size.status().message()};
        sent.resize(*size);
        if (round == 0) own_sent[r] = sent;
        std::vector<uint8_t> golden_sent;
        if (!readFile(std::string(sent_files[round].as_array()[r].as_string()), golden_sent)) {
          return {rw + "cannot read sent payload"};
        }
        if (sent != golden_sent) {
          size_t first = 0;
          while (first < sent.size() && first < golden_sent.size() &&
                 sent[first] == golden_sent[first]) {
            ++first;
          }
          fail(rw + "rank " + std::to_string(r) + ": payload differs at byte " +
               std::to_string(first) + " (size " + std::to_string(sent.size()) + ", golden " +
               std::to_string(golden_sent.size()) + ")");
        }
        if (r == 0) {
          sum = sent;
        } else {
          std::vector<uint8_t> next(std::max(sum.size(), sent.size()));
          auto added = codec.addPayloads(sum, sent, next);
          if (!added.isOk()) return {rw + "addPayloads failed: " + added.status().message()};
          next.resize(*added);
          sum = std::move(next);
        }
      }
      if (sum != golden_reduced) fail(rw + "reduced payload differs from the golden one");
      // Continue with the golden reduced payload, so one mismatch does not hide the next.
      reduced.push_back(std::move(golden_reduced));
    }
    std::vector<uint8_t> dec_raw;
    if (!readFile(std::string(s.at("decoded").as_string()), dec_raw) || dec_raw.size() != 4 * n) {
      return {where + "cannot read decoded file"};
    }
    std::vector<std::span<const uint8_t>> views(reduced.begin(), reduced.end());
    for (size_t r = 0; r < world; ++r) {
      std::vector<float> out(n, 0.0f);
      const lightwire::Status st = codec.decodeRounds(views, weight, out.data(), n);
      if (!st.isOk()) {
        fail(where + "decodeRounds failed: " + st.message());
      } else {
        size_t bad = 0, first = n;
        for (size_t i = 0; i < n; ++i) {
          uint32_t want;
          std::memcpy(&want, dec_raw.data() + 4 * i, 4);
          if (std::bit_cast<uint32_t>(out[i]) != want && bad++ == 0) first = i;
        }
        if (bad) {
          uint32_t want;
          std::memcpy(&want, dec_raw.data() + 4 * first, 4);
          fail(where + "rank " + std::to_string(r) + ": decoded output differs at " +
               std::to_string(bad) + " element(s), first " + std::to_string(first) + ": got " +
               hex32(std::bit_cast<uint32_t>(out[first])) + ", golden " + hex32(want));
        }
      }
      const lightwire::Status fin =
          codec.finishStep(ctxOf(r), chunking, views, weight, inputs[r], states[r], ws[r]);
      if (!fin.isOk()) return {where + "finishStep failed: " + fin.message()};
    }
    if (!errors.empty()) return errors;  // later steps depend on this one's state
    for (size_t r = 0; r < world; ++r) {
      const std::vector<std::span<const uint8_t>> sent{own_sent[r]};
      const lightwire::Status st =
          codec.commitState(ctxOf(r), chunking, inputs[r], sent, {}, states[r], ws[r]);
      if (!st.isOk()) return {where + "commitState failed: " + st.message()};
    }
  }
  return errors;
}

// A global-selection case (the sparse allreduce's owner frames, docs/determinism.md "4.6b Global
// selection"): `global_world` ranks, each with its own state; per step every rank encodes its
// input with the effect of sending deferred, each chunk's selection is the owner's rule
// (reduceSelectChunk) over the ranks' payloads in rank order, the selections are decoded with the
// step's weight, and every rank commits its state with its own payloads and the selections.
// Checks every rank's payloads, every selection and the decoded result against the golden files.
std::vector<std::string> runGlobalCase(const json::object& c, unsigned threads) {
  std::vector<std::string> errors;
  auto fail = [&](const std::string& m) { errors.push_back(m); };
  const CodecConfig config = configFrom(c.at("config").as_object());
  const std::string tensor(c.at("tensor_name").as_string());
  const size_t n = static_cast<size_t>(c.at("elements").to_number<uint64_t>());
  const size_t world = static_cast<size_t>(c.at("global_world").to_number<uint64_t>());
  const size_t requested = static_cast<size_t>(c.at("chunk_elements").to_number<uint64_t>());
  auto made = createCodec(config);
  if (!made.isOk()) return {"createCodec failed: " + made.status().message()};
  const Codec& codec = **made;
  if (!codec.selectsGlobally()) return {"codec does not select globally"};
  const Chunking chunking = Chunking::make(n, requested, codec.chunkAlignment());
  CpuStream stream(threads);
  std::vector<CodecState> states;
  for (size_t r = 0; r < world; ++r) states.emplace_back(codec.stateFloats(n));
  std::vector<float> sums;
  std::vector<uint64_t> scratch;
  for (const json::value& sv : c.at("steps").as_array()) {
    const json::object& s = sv.as_object();
    const uint64_t step_no = s.at("step").to_number<uint64_t>();
    const std::string where = "step " + std::to_string(step_no) + ": ";
    const float weight = static_cast<float>(toDouble(s.at("weight")));
    const auto& in_files = s.at("inputs").as_array();
    const auto& sent_files = s.at("sent").as_array();
    const auto& sent_sizes = s.at("sent_sizes").as_array();
    if (in_files.size() != world || sent_files.size() != world || sent_sizes.size() != world) {
      return {where + "manifest does not match global_world"};
    }
    std::vector<StepContext> ctx(world);
    std::vector<std::vector<std::vector<uint8_t>>> golden_sent(world);
    std::vector<std::vector<uint8_t>> raw(world);  // each rank's input, kept until its commit
    std::vector<lightwire::kernels::testing::OpenStep> open(world);
    for (size_t r = 0; r < world; ++r) {
      ctx[r].seed = static_cast<uint32_t>(c.at("seed").to_number<uint64_t>());
      ctx[r].name_key = tensorNameKey(tensor);
      ctx[r].step = step_no;
      ctx[r].rank = static_cast<uint32_t>(r);
      ctx[r].stream = &stream;
      ctx[r].defer_sent = true;
      if (!readFile(std::string(in_files[r].as_string()), raw[r]) || raw[r].size() != 4 * n) {
        return {where + "cannot read input of rank " + std::to_string(r)};
      }
      raw[r].resize(raw[r].size() + 4);  // never empty
      auto opened = lightwire::kernels::testing::openStep(codec, ctx[r], chunking,
                                                          ConstTensor{raw[r].data(), n}, states[r]);
      if (!opened.isOk()) return {where + "encoding failed: " + opened.status().message()};
      open[r] = std::move(opened).value();
      const auto& p = open[r].payloads;
      if (!splitPayloads(std::string(sent_files[r].as_string()), sent_sizes[r].as_array(),
                         golden_sent[r]) ||
          golden_sent[r].size() != chunking.count()) {
        return {where + "cannot read the payloads of rank " + std::to_string(r)};
      }
      for (size_t ch = 0; ch < chunking.count(); ++ch) {
        if (p[ch] != golden_sent[r][ch]) {
          fail(where + "rank " + std::to_string(r) + ": payload of chunk " + std::to_string(ch) +
               " differs (size " + std::to_string(p[ch].size()) + ", golden " +
               std::to_string(golden_sent[r][ch].size()) + ")");
        }
      }
    }
    std::vector<std::vector<uint8_t>> golden_sel;
    if (!splitPayloads(std::string(s.at("selected").as_string()), s.at("selected_sizes").as_array(),
                       golden_sel) ||
        golden_sel.size() != chunking.count()) {
      return {where + "cannot read the selections"};
    }
    // Every rank's entries of the layer, as its contribution frames carry them.
    std::vector<uint64_t> entries(world);
    for (size_t r = 0; r < world; ++r) {
      const std::vector<std::span<const uint8_t>> own(golden_sent[r].begin(), golden_sent[r].end());
      auto counted = sparseLayerEntries(own, codec.traits().id, chunking);
      if (!counted.isOk())
        return {where + "counting entries failed: " + counted.status().message()};
      entries[r] = *counted;
    }
    const LayerCounts layer{codec.selectionCount(n, std::nullopt), entries};
    std::vector<float> out(n, 0.0f);
    for (size_t ch = 0; ch < chunking.count(); ++ch) {
      const size_t begin = chunking.begin(ch), len = chunking.size(ch);
      // The golden payloads (one mismatch above does not hide one here).
      std::vector<std::span<const uint8_t>> contributions;
      for (size_t r = 0; r < world; ++r) contributions.emplace_back(golden_sent[r][ch]);
      std::vector<uint8_t> sel(sparseMaxPayloadBytes(len, DType::kF32));
      auto size = reduceSelectChunk(codec, contributions, len, layer, sums, scratch, sel);
      if (!size.isOk()) return {where + "reduceSelectChunk failed: " + size.status().message()};
      sel.resize(*size);
      if (sel != golden_sel[ch])
        fail(where + "selection of chunk " + std::to_string(ch) + " differs");
      if (const auto st = codec.decodeChunk(golden_sel[ch], weight, out.data() + begin, len);
          !st.isOk()) {
        return {where + "decoding a selection failed: " + st.message()};
      }
      for (size_t r = 0; r < world; ++r) {
        const auto st = codec.checkSelection(chunking, ch, golden_sent[r][ch], golden_sel[ch]);
        if (!st.isOk()) return {where + "checkSelection failed: " + st.message()};
      }
    }
    std::vector<uint8_t> dec_raw;
    if (!readFile(std::string(s.at("decoded").as_string()), dec_raw) || dec_raw.size() != 4 * n) {
      return {where + "cannot read decoded file"};
    }
    if (std::memcmp(dec_raw.data(), out.data(), 4 * n) != 0) fail(where + "decoded result differs");
    if (!errors.empty()) return errors;  // later steps depend on this one's state
    const std::vector<std::span<const uint8_t>> selected(golden_sel.begin(), golden_sel.end());
    for (size_t r = 0; r < world; ++r) {
      const std::vector<std::span<const uint8_t>> sent(golden_sent[r].begin(),
                                                       golden_sent[r].end());
      const auto st = codec.commitState(ctx[r], chunking, ConstTensor{raw[r].data(), n}, sent,
                                        selected, states[r], open[r].workspace);
      if (!st.isOk()) return {where + "commitState failed: " + st.message()};
    }
  }
  return errors;
}

std::vector<std::string> runCase(const json::object& c, unsigned threads) {
  if (c.if_contains("world") != nullptr) return runMultiRoundCase(c, threads);
  if (c.if_contains("global_world") != nullptr) return runGlobalCase(c, threads);
  std::vector<std::string> errors;
  auto fail = [&](const std::string& m) { errors.push_back(m); };

  const std::string name(c.at("name").as_string());
  const CodecConfig config = configFrom(c.at("config").as_object());
  const std::string tensor(c.at("tensor_name").as_string());
  const auto dtype = parseDType(std::string(c.at("dtype").as_string()));
  if (!dtype) return {"unknown dtype"};
  const size_t n = static_cast<size_t>(c.at("elements").to_number<uint64_t>());
  const size_t requested = static_cast<size_t>(c.at("chunk_elements").to_number<uint64_t>());

  auto made = createCodec(config);
  if (!made.isOk()) return {"createCodec failed: " + made.status().message()};
  const Codec& codec = **made;

  const Chunking chunking = Chunking::make(n, requested, codec.chunkAlignment());
  const auto& sizes = c.at("chunk_sizes").as_array();
  if (chunking.count() != sizes.size()) {
    return {"chunk count " + std::to_string(chunking.count()) + ", golden " +
            std::to_string(sizes.size()) + " (alignment " + std::to_string(codec.chunkAlignment()) +
            ")"};
  }
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (chunking.size(k) != sizes[k].to_number<uint64_t>()) {
      return {"chunk " + std::to_string(k) + " has " + std::to_string(chunking.size(k)) +
              " elements, golden " + std::to_string(sizes[k].to_number<uint64_t>())};
    }
  }

  CpuStream stream(threads);
  CodecState state(codec.stateFloats(n));
  CodecState other_state(codec.stateFloats(n));  // the second rank of "add" steps
  for (const json::value& sv : c.at("steps").as_array()) {
    const json::object& s = sv.as_object();
    const uint64_t step_no = s.at("step").to_number<uint64_t>();
    const std::string where = "step " + std::to_string(step_no) + ": ";

    // Input, raw little-endian, copied into storage aligned for its type.
    std::vector<uint8_t> raw;
    if (!readFile(std::string(s.at("input").as_string()), raw)) {
      fail(where + "cannot read input file");
      return errors;
    }
    if (raw.size() != n * dtypeSize(*dtype)) {
      fail(where + "input file has " + std::to_string(raw.size()) + " bytes");
      return errors;
    }
    std::vector<float> in32;
    std::vector<uint16_t> in16;
    const void* data = nullptr;
    if (*dtype == DType::kF32) {
      in32.resize(n);
      if (n) std::memcpy(in32.data(), raw.data(), raw.size());
      data = in32.data();
    } else {
      in16.resize(n);
      if (n) std::memcpy(in16.data(), raw.data(), raw.size());
      data = in16.data();
    }
    const ConstTensor input{data, n, *dtype};

    StepContext ctx;
    ctx.seed = static_cast<uint32_t>(c.at("seed").to_number<uint64_t>());
    ctx.name_key = tensorNameKey(tensor);
    ctx.step = step_no;
    ctx.rank = static_cast<uint32_t>(c.at("rank").to_number<uint64_t>());
    ctx.density = toOptDouble(s.if_contains("density"));
    ctx.stream = &stream;

    // --- payloads ---
    std::vector<uint8_t> golden;
    if (!readFile(std::string(s.at("payload").as_string()), golden)) {
      fail(where + "cannot read payload file");
      return errors;
    }
    const auto& psizes = s.at("payload_sizes").as_array();
    std::vector<std::vector<uint8_t>> golden_payloads;
    size_t off = 0;
    for (const auto& ps : psizes) {
      const size_t len = static_cast<size_t>(ps.to_number<uint64_t>());
      if (off + len > golden.size()) {
        fail(where + "payload file shorter than its sizes");
        return errors;
      }
      golden_payloads.emplace_back(golden.begin() + off, golden.begin() + off + len);
      off += len;
    }

    auto encoded = stepTensor(codec, ctx, chunking, input, state);  // committed
    if (!encoded.isOk()) {
      fail(where + "stepTensor failed: " + encoded.status().message());
      return errors;  // the state is no longer comparable
    }
    const auto& payloads = *encoded;
    if (payloads.size() != golden_payloads.size()) {
      fail(where + std::to_string(payloads.size()) + " payloads, golden " +
           std::to_string(golden_payloads.size()));
    } else {
      for (size_t k = 0; k < payloads.size(); ++k) {
        const auto& got = payloads[k];
        const auto& want = golden_payloads[k];
        if (got == want) continue;
        size_t first = 0;
        while (first < got.size() && first < want.size() && got[first] == want[first]) ++first;
        std::ostringstream m;
        m << where << "chunk " << k << ": payload differs at byte " << first << " (size "
          << got.size() << ", golden " << want.size() << ")";
        if (first < got.size() && first < want.size()) {
          m << ": got 0x" << std::hex << int(got[first]) << ", golden 0x" << int(want[first])
            << std::dec;
        }
        fail(m.str());
      }
    }

    // --- decoding (of the golden payloads: checks the decoder on its own) ---
    std::vector<uint8_t> dec_raw;
    if (!readFile(std::string(s.at("decoded").as_string()), dec_raw)) {
      fail(where + "cannot read decoded file");
      return errors;
    }
    std::vector<uint32_t> want_bits(n, 0u);
    const std::string format(s.at("decoded_format").as_string());
    if (format == "dense") {
      if (dec_raw.size() != 4 * n) {
        fail(where + "dense decoded file has the wrong size");
        return errors;
      }
      if (n) std::memcpy(want_bits.data(), dec_raw.data(), dec_raw.size());
    } else {
      for (size_t p = 0; p + 8 <= dec_raw.size(); p += 8) {
        uint32_t idx, bits;
        std::memcpy(&idx, dec_raw.data() + p, 4);
        std::memcpy(&bits, dec_raw.data() + p + 4, 4);
        if (idx >= n) {
          fail(where + "sparse decoded index out of range");
          return errors;
        }
        want_bits[idx] = bits;
      }
    }
    const float weight = static_cast<float>(toDouble(s.at("weight")));
    std::vector<float> out(n, 0.0f);
    const lightwire::Status st = decodeTensor(codec, chunking, golden_payloads, weight, out.data());
    if (!st.isOk()) {
      fail(where + "decodeTensor(golden payloads) failed: " + st.message());
    } else {
      size_t bad = 0, first = n;
      for (size_t i = 0; i < n; ++i) {
        if (std::bit_cast<uint32_t>(out[i]) != want_bits[i]) {
          if (bad++ == 0) first = i;
        }
      }
      if (bad) {
        fail(where + "decoded output differs at " + std::to_string(bad) + " element(s), first " +
             std::to_string(first) + ": got " + hex32(std::bit_cast<uint32_t>(out[first])) +
             ", golden " + hex32(want_bits[first]));
      }
    }
    // --- summable codecs: a second rank's payloads and the compressed-domain sum ---
    if (const json::value* addv = s.if_contains("add")) {
      const json::object& add = addv->as_object();
      const std::string aw = where + "add: ";
      std::vector<uint8_t> oraw;
      if (!readFile(std::string(add.at("input").as_string()), oraw) ||
          oraw.size() != n * dtypeSize(*dtype)) {
        fail(aw + "cannot read the other input");
        return errors;
      }
      std::vector<float> o32;
      std::vector<uint16_t> o16;
      const void* odata = nullptr;
      if (*dtype == DType::kF32) {
        o32.resize(n);
        if (n) std::memcpy(o32.data(), oraw.data(), oraw.size());
        odata = o32.data();
      } else {
        o16.resize(n);
        if (n) std::memcpy(o16.data(), oraw.data(), oraw.size());
        odata = o16.data();
      }
      std::vector<std::vector<uint8_t>> other, sums;
      if (!splitPayloads(std::string(add.at("payload").as_string()),
                         add.at("payload_sizes").as_array(), other) ||
          !splitPayloads(std::string(add.at("sum").as_string()), add.at("sum_sizes").as_array(),
                         sums) ||
          other.size() != golden_payloads.size() || sums.size() != golden_payloads.size()) {
        fail(aw + "cannot read the other/sum payload files");
        return errors;
      }
      StepContext octx = ctx;
      octx.rank = static_cast<uint32_t>(add.at("rank").to_number<uint64_t>());
      auto oenc = stepTensor(codec, octx, chunking, ConstTensor{odata, n, *dtype}, other_state);
      if (!oenc.isOk()) {
        fail(aw + "stepTensor(other rank) failed: " + oenc.status().message());
        return errors;
      }
      if (*oenc != other) fail(aw + "the other rank's payloads differ from the golden ones");
      for (size_t k = 0; k < other.size(); ++k) {
        std::vector<uint8_t> sum(codec.maxPayloadBytes(chunking.size(k)));
        auto added = codec.addPayloads(golden_payloads[k], other[k], sum);
        if (!added.isOk()) {
          fail(aw + "chunk " + std::to_string(k) +
               ": addPayloads failed: " + added.status().message());
          continue;
        }
        sum.resize(*added);
        if (sum != sums[k]) {
          size_t first = 0;
          while (first < sum.size() && first < sums[k].size() && sum[first] == sums[k][first]) {
            ++first;
          }
          fail(aw + "chunk " + std::to_string(k) + ": sum differs at byte " +
               std::to_string(first) + " (size " + std::to_string(sum.size()) + ", golden " +
               std::to_string(sums[k].size()) + ")");
        }
      }
    }
  }
  return errors;
}

}  // namespace

TEST_CASE("golden payloads: codecs reproduce tests/kernels/golden byte for byte") {
  std::ifstream in(kGoldenDir + "manifest.json");
  REQUIRE_MESSAGE(in.good(), "missing " << kGoldenDir << "manifest.json");
  std::stringstream text;
  text << in.rdbuf();
  boost::system::error_code ec;
  const json::value manifest = json::parse(text.str(), ec);
  REQUIRE_MESSAGE(!ec, "manifest.json: " << ec.message());
  const auto& cases = manifest.at("cases").as_array();
  REQUIRE(!cases.empty());

  size_t passed = 0, total = 0;
  // Every SIMD target Highway can run here, forced in turn (kernels/simd/targets.h).
  for (const int64_t target : simd::availableTargets()) {
    const simd::ScopedTargetForTest force(target);
    const std::string target_name = simd::targetName(target);
    for (const unsigned threads : {1u, 2u}) {
      for (const json::value& cv : cases) {
        const json::object& c = cv.as_object();
        const std::string name(c.at("name").as_string());
        const auto errors = runCase(c, threads);
        ++total;
        if (errors.empty()) ++passed;
        for (const auto& e : errors) {
          CHECK_MESSAGE(false, "case " << name << " [" << target_name << ", " << threads
                                       << " thread(s)] " << e);
        }
      }
    }
  }
  MESSAGE("golden cases passed: " << passed << " of " << total
                                  << " (cases x thread counts x SIMD targets)");
}

}  // namespace test_golden
