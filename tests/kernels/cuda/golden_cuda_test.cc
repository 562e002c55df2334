// The golden payload files (tests/kernels/golden, written by the independent reference
// tests/reference/lwref.py) against the CUDA codecs: every case's payloads, encoded on the GPU,
// byte for byte, and the golden payloads decoded on the GPU bit for bit like the reference —
// single-round cases chunk by chunk, PowerSGD rank by rank and round by round. Cases whose input
// holds a NaN are left out of the byte comparison where arithmetic touches it (NaN payload bits
// may differ on CUDA, docs/determinism.md §1): decoded NaNs compare as NaN. Needs a GPU.

#include <doctest.h>

#include <bit>
#include <boost/json.hpp>
#include <cmath>
#include <fstream>
#include <sstream>

#include "tests/kernels/cuda/codec_compare.h"
#include "tests/kernels/golden_manifest.h"

namespace json = boost::json;

namespace lightwire::kernels::cuda {
namespace test_golden_cuda {

using testing::commitOnGpu;
using testing::DeviceMem;

using golden::configFrom;
using golden::readFile;
using golden::toDouble;
using golden::toOptDouble;

bool hasNaN(const std::vector<uint8_t>& raw, DType dtype) {
  const size_t w = dtypeSize(dtype);
  for (size_t i = 0; i + w <= raw.size(); i += w) {
    if (std::isnan(ConstTensor{raw.data() + i, 1, dtype}.at(0))) return true;
  }
  return false;
}

/// Bits equal, or both NaN.
bool sameValue(uint32_t got, uint32_t want) {
  return got == want ||
         (std::isnan(std::bit_cast<float>(got)) && std::isnan(std::bit_cast<float>(want)));
}

std::string firstDiff(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return "differs at byte " + std::to_string(i) + " (size " + std::to_string(got.size()) +
         ", golden " + std::to_string(want.size()) + ")";
}

/// Decoded fp32 bits of a step (dense file, or sparse (index, bits) pairs over zeros).
std::optional<std::vector<uint32_t>> decodedBits(const json::object& s, size_t n) {
  std::vector<uint8_t> raw;
  if (!readFile(std::string(s.at("decoded").as_string()), raw)) return std::nullopt;
  std::vector<uint32_t> bits(n, 0u);
  const json::value* fmt = s.if_contains("decoded_format");
  if (fmt == nullptr || fmt->as_string() == "dense") {
    if (raw.size() != 4 * n) return std::nullopt;
    if (n) std::memcpy(bits.data(), raw.data(), raw.size());
    return bits;
  }
  for (size_t p = 0; p + 8 <= raw.size(); p += 8) {
    uint32_t idx, b;
    std::memcpy(&idx, raw.data() + p, 4);
    std::memcpy(&b, raw.data() + p + 4, 4);
    if (idx >= n) return std::nullopt;
    bits[idx] = b;
  }
  return bits;
}

/// Compares a device fp32 result with golden bits; returns "" or a description.
std::string compareDecoded(const DeviceMem& out, const std::vector<uint32_t>& want, size_t n) {
  const std::vector<uint32_t> got = out.download<uint32_t>(n);
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    if (!sameValue(got[i], want[i]) && bad++ == 0) first = i;
  }
  if (bad == 0) return "";
  return "decoded output differs at " + std::to_string(bad) + " element(s), first " +
         std::to_string(first);
}

/// One single-round case; returns every mismatch.
std::vector<std::string> runCase(const json::object& c, size_t* nan_skipped) {
  std::vector<std::string> errors;
  const CodecConfig config = configFrom(c.at("config").as_object());
  const auto dtype = parseDType(std::string(c.at("dtype").as_string()));
  if (!dtype) return {"unknown dtype"};
  const size_t n = static_cast<size_t>(c.at("elements").to_number<uint64_t>());
  auto made = createCudaCodec(config);
  if (!made) return {"createCudaCodec failed: " + made.status().message()};
  const CudaCodec& codec = **made;
  const Chunking chunking =
      Chunking::make(n, static_cast<size_t>(c.at("chunk_elements").to_number<uint64_t>()),
                     codec.host().chunkAlignment());
  auto st = DeviceState::create(codec.stateFloats(n));
  if (!st) return {"state: " + st.status().message()};
  DeviceState state = std::move(*st);
  DeviceMem ws(codec.workspaceBytes(chunking));
  DeviceMem d_in(n * dtypeSize(*dtype) + 4);
  DeviceMem d_payload(codec.maxPayloadBytes(chunking.chunk_elements));
  DeviceMem d_size(sizeof(uint64_t));
  DeviceMem d_out(n * sizeof(float));
  for (const json::value& sv : c.at("steps").as_array()) {
    const json::object& s = sv.as_object();
    const uint64_t step_no = s.at("step").to_number<uint64_t>();
    const std::string where = "step " + std::to_string(step_no) + ": ";
    std::vector<uint8_t> raw, golden;
    if (!readFile(std::string(s.at("input").as_string()), raw) ||
        raw.size() != n * dtypeSize(*dtype) ||
        !readFile(std::string(s.at("payload").as_string()), golden)) {
      return {where + "cannot read the case's files"};
    }
    const bool nan_input = hasNaN(raw, *dtype);
    d_in.upload(raw.data(), raw.size());
    StepContext ctx;
    ctx.seed = static_cast<uint32_t>(c.at("seed").to_number<uint64_t>());
    ctx.name_key = tensorNameKey(std::string(c.at("tensor_name").as_string()));
    ctx.step = step_no;
    ctx.rank = static_cast<uint32_t>(c.at("rank").to_number<uint64_t>());
    ctx.density = toOptDouble(s.if_contains("density"));
    const DeviceTensor in{d_in.as(), n, *dtype};
    if (Status a = codec.analyze(ctx, chunking, in, state, ws.span(), nullptr); !a.isOk()) {
      return {where + "analyze: " + a.message()};
    }
    std::vector<std::vector<uint8_t>> golden_payloads;
    size_t off = 0;
    for (const auto& ps : s.at("payload_sizes").as_array()) {
      const size_t len = static_cast<size_t>(ps.to_number<uint64_t>());
      if (off + len > golden.size()) return {where + "payload file shorter than its sizes"};
      golden_payloads.emplace_back(golden.begin() + off, golden.begin() + off + len);
      off += len;
    }
    if (golden_payloads.size() != chunking.count()) return {where + "chunk count differs"};
    std::vector<std::vector<uint8_t>> sent;  // what the GPU sent, for its commit
    for (size_t k = 0; k < chunking.count(); ++k) {
      Status e = codec.encodeChunk(ctx, chunking, k, 0, {}, in, state, ws.span(),
                                   d_payload.as<uint8_t>(), d_size.as<uint64_t>(), nullptr);
      if (!e.isOk()) return {where + "encodeChunk: " + e.message()};
      if (cudaDeviceSynchronize() != cudaSuccess) return {where + "device error"};
      const uint64_t size = d_size.download<uint64_t>(1)[0];
      const std::vector<uint8_t>& got = sent.emplace_back(d_payload.download<uint8_t>(size));
      if (got != golden_payloads[k]) {
        if (nan_input) {
          ++*nan_skipped;
        } else {
          errors.push_back(where + "chunk " + std::to_string(k) + ": payload " +
                           firstDiff(got, golden_payloads[k]));
        }
      }
    }
    // Decoding the golden payloads on the GPU.
    const auto want = decodedBits(s, n);
    if (!want) return {where + "cannot read the decoded file"};
    const float weight = static_cast<float>(toDouble(s.at("weight")));
    LW_CUDA_CHECK_OK(cudaMemset(d_out.as(), 0, n * sizeof(float)));
    for (size_t k = 0; k < chunking.count(); ++k) {
      DeviceMem scratch(codec.decodeScratchBytes(golden_payloads[k].size(), chunking.size(k)));
      Status d =
          codec.decodeChunk(golden_payloads[k], weight, d_out.as<float>() + chunking.begin(k),
                            chunking.size(k), scratch.span(), nullptr);
      if (!d.isOk()) {
        errors.push_back(where + "decodeChunk(golden): " + d.message());
        break;
      }
      LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
    }
    if (std::string e = compareDecoded(d_out, *want, n); !e.empty()) errors.push_back(where + e);
    if (!errors.empty()) return errors;  // later steps depend on this one's state
    const std::vector<std::span<const uint8_t>> sent_views(sent.begin(), sent.end());
    LW_STATUS_OK(commitOnGpu(codec, ctx, chunking, in, sent_views, state, ws.span(), nullptr));
  }
  return errors;
}

/// A PowerSGD case: `world` ranks, each with its own state; round r of every rank is compared with
/// the golden sent payload, the next round starts from the golden reduced payload, and every rank
/// decodes the golden reduced payloads.
std::vector<std::string> runMultiRoundCase(const json::object& c) {
  std::vector<std::string> errors;
  const CodecConfig config = configFrom(c.at("config").as_object());
  const auto dtype = parseDType(std::string(c.at("dtype").as_string()));
  if (!dtype) return {"unknown dtype"};
  const size_t n = static_cast<size_t>(c.at("elements").to_number<uint64_t>());
  const size_t world = static_cast<size_t>(c.at("world").to_number<uint64_t>());
  std::vector<uint64_t> shape;
  if (const json::value* sh = c.if_contains("shape"); sh != nullptr && !sh->is_null()) {
    for (const auto& d : sh->as_array()) shape.push_back(d.to_number<uint64_t>());
  }
  auto made = createCudaCodec(config);
  if (!made) return {"createCudaCodec failed: " + made.status().message()};
  const CudaCodec& codec = **made;
  const Chunking chunking = chunkingFor(codec.host(), n, 0);
  const int rounds = codec.traits().rounds;
  std::vector<DeviceState> states;
  std::vector<std::unique_ptr<DeviceMem>> ws, inputs;
  for (size_t r = 0; r < world; ++r) {
    auto st = DeviceState::create(codec.stateFloats(n));
    if (!st) return {"state: " + st.status().message()};
    states.push_back(std::move(*st));
    ws.push_back(std::make_unique<DeviceMem>(codec.workspaceBytes(chunking)));
    inputs.push_back(std::make_unique<DeviceMem>(n * dtypeSize(*dtype) + 4));
  }
  DeviceMem d_payload(codec.maxPayloadBytes(std::max<size_t>(n, 1)));
  DeviceMem d_size(sizeof(uint64_t));
  DeviceMem d_out(n * sizeof(float));
  DeviceMem scratch(codec.accumulateScratchBytes(n));
  for (const json::value& sv : c.at("steps").as_array()) {
    const json::object& s = sv.as_object();
    const uint64_t step_no = s.at("step").to_number<uint64_t>();
    const std::string where = "step " + std::to_string(step_no) + ": ";
    const float weight = static_cast<float>(toDouble(s.at("weight")));
    const auto& in_files = s.at("inputs").as_array();
    const auto& sent_files = s.at("sent").as_array();
    const auto& red_files = s.at("reduced").as_array();
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
      const size_t floats = codec.stateFloats(n, step_shape);
      if (st.floats() == floats) continue;
      auto old = st.download(nullptr);
      if (!old) return {where + "state: " + old.status().message()};
      old->resize(floats, 0.0f);
      std::fill(old->begin() + static_cast<std::ptrdiff_t>(std::min(n, floats)), old->end(), 0.0f);
      auto made = DeviceState::create(floats);
      if (!made) return {where + "state: " + made.status().message()};
      if (const auto up = made->upload(*old, nullptr); !up.isOk()) {
        return {where + "state: " + up.message()};
      }
      st = std::move(*made);
    }
    bool nan_input = false;
    for (size_t r = 0; r < world; ++r) {
      std::vector<uint8_t> raw;
      if (!readFile(std::string(in_files[r].as_string()), raw) ||
          raw.size() != n * dtypeSize(*dtype)) {
        return {where + "cannot read input of rank " + std::to_string(r)};
      }
      nan_input = nan_input || hasNaN(raw, *dtype);
      inputs[r]->upload(raw.data(), raw.size());
    }
    auto ctxOf = [&](size_t r) {
      StepContext ctx;
      ctx.seed = static_cast<uint32_t>(c.at("seed").to_number<uint64_t>());
      ctx.name_key = tensorNameKey(std::string(c.at("tensor_name").as_string()));
      ctx.step = step_no;
      ctx.rank = static_cast<uint32_t>(r);
      ctx.shape = step_shape;
      return ctx;
    };
    auto inputOf = [&](size_t r) { return DeviceTensor{inputs[r]->as(), n, *dtype}; };
    for (size_t r = 0; r < world; ++r) {
      if (Status a =
              codec.analyze(ctxOf(r), chunking, inputOf(r), states[r], ws[r]->span(), nullptr);
          !a.isOk()) {
        return {where + "analyze: " + a.message()};
      }
    }
    std::vector<std::vector<uint8_t>> reduced;
    for (int round = 0; round < rounds; ++round) {
      std::vector<uint8_t> golden_reduced;
      if (!readFile(std::string(red_files[round].as_string()), golden_reduced)) {
        return {where + "cannot read a reduced payload"};
      }
      for (size_t r = 0; r < world; ++r) {
        std::vector<uint8_t> golden_sent;
        if (!readFile(std::string(sent_files[round].as_array()[r].as_string()), golden_sent)) {
          return {where + "cannot read a sent payload"};
        }
        std::span<const uint8_t> previous;
        if (round > 0) previous = reduced.back();
        Status e = codec.encodeChunk(ctxOf(r), chunking, 0, round, previous, inputOf(r), states[r],
                                     ws[r]->span(), d_payload.as<uint8_t>(), d_size.as<uint64_t>(),
                                     nullptr);
        if (!e.isOk()) return {where + "encodeChunk: " + e.message()};
        LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
        const std::vector<uint8_t> got =
            d_payload.download<uint8_t>(d_size.download<uint64_t>(1)[0]);
        if (got != golden_sent && !nan_input) {
          errors.push_back(where + "round " + std::to_string(round) + " rank " + std::to_string(r) +
                           ": payload " + firstDiff(got, golden_sent));
        }
      }
      reduced.push_back(std::move(golden_reduced));
    }
    const auto want = decodedBits(s, n);
    if (!want) return {where + "cannot read the decoded file"};
    std::vector<std::span<const uint8_t>> views(reduced.begin(), reduced.end());
    for (size_t r = 0; r < world; ++r) {
      LW_CUDA_CHECK_OK(cudaMemset(d_out.as(), 0, n * sizeof(float)));
      Status d = codec.decodeRounds(views, weight, d_out.as<float>(), n, scratch.span(), nullptr);
      if (!d.isOk()) return {where + "decodeRounds: " + d.message()};
      LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
      if (std::string e = compareDecoded(d_out, *want, n); !e.empty()) {
        errors.push_back(where + "rank " + std::to_string(r) + ": " + e);
      }
      Status f = codec.finishStep(ctxOf(r), chunking, views, weight, inputOf(r), states[r],
                                  ws[r]->span(), nullptr);
      if (!f.isOk()) return {where + "finishStep: " + f.message()};
    }
    if (!errors.empty()) return errors;
    for (size_t r = 0; r < world; ++r) {
      LW_STATUS_OK(commitOnGpu(codec, ctxOf(r), chunking, inputOf(r), {}, states[r], ws[r]->span(),
                               nullptr));
    }
  }
  return errors;
}

TEST_CASE("cuda golden payloads: the CUDA codecs reproduce tests/kernels/golden") {
  std::ifstream in(golden::dir() + "manifest.json");
  REQUIRE_MESSAGE(in.good(), "missing " << golden::dir() << "manifest.json");
  std::stringstream text;
  text << in.rdbuf();
  boost::system::error_code ec;
  const json::value manifest = json::parse(text.str(), ec);
  REQUIRE_MESSAGE(!ec, "manifest.json: " << ec.message());
  size_t passed = 0, total = 0, nan_skipped = 0;
  for (const json::value& cv : manifest.at("cases").as_array()) {
    const json::object& c = cv.as_object();
    const std::string name(c.at("name").as_string());
    const auto errors =
        c.if_contains("world") != nullptr ? runMultiRoundCase(c) : runCase(c, &nan_skipped);
    ++total;
    if (errors.empty()) ++passed;
    for (const auto& e : errors) CHECK_MESSAGE(false, "case " << name << ": " << e);
  }
  MESSAGE("golden cases passed on the GPU: " << passed << " of " << total << " (" << nan_skipped
                                             << " payloads of NaN inputs not compared)");
  CHECK(total > 0);
}

}  // namespace test_golden_cuda
}  // namespace lightwire::kernels::cuda
