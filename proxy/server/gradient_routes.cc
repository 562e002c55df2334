// The gradient route of the control API (docs/api.md "POST /v1/emit_gradient"): a tensor as a
// raw body (form 1) or as a region of a registered buffer (form 2), submitted to the step engine;
// the reply when its step ends.

#include "proxy/server/control_api.h"

#include <boost/json/serialize.hpp>

#include "ipc/cuda_ipc.h"
#include "proxy/server/api_util.h"

namespace lightwire::proxy {

using namespace api;  // NOLINT(google-build-using-namespace): the routes' shared helpers

Response ControlApi::emitRaw(Request& req, const RequestTarget& t, Reply& reply, bool& replied) {
  for (const auto& [k, v] : t.query) {
    if (k != "name" && k != "step" && k != "dtype" && k != "shape" && k != "trainer") {
      return badRequest("unknown query parameter " + quoted(k) +
                        " (known: name, step, dtype, shape, trainer)");
    }
  }
  TensorSpec spec;
  auto q = [&](const char* k) -> const std::string* {
    auto it = t.query.find(k);
    return it == t.query.end() ? nullptr : &it->second;
  };
  if (!q("name")) return badRequest("missing query parameter 'name'");
  spec.name = *q("name");
  if (std::string e = checkName(spec.name); !e.empty()) return badRequest(e);
  if (!q("step")) return badRequest("missing query parameter 'step'");
  if (!parseU64(*q("step"), &spec.step)) {
    return badRequest("query parameter 'step' must be an unsigned integer, got " +
                      quoted(*q("step")));
  }
  if (const std::string* d = q("dtype")) {
    auto dt = kernels::parseDType(*d);
    if (!dt) {
      return badRequest("unknown dtype " + quoted(*d) + " (float32, float16 or bfloat16)");
    }
    spec.dtype = *dt;
  }
  if (const std::string* tr = q("trainer")) {
    uint64_t v = 0;
    if (!parseU64(*tr, &v) || v > 1u << 20) {
      return badRequest("query parameter 'trainer' must be a small unsigned integer, got " +
                        quoted(*tr));
    }
    spec.trainer = static_cast<unsigned>(v);
  } else if (config_.local_trainers > 1) {
    return badRequest("missing query parameter 'trainer': this sidecar serves " +
                      std::to_string(config_.local_trainers) + " local trainers");
  }
  const size_t width = kernels::dtypeSize(spec.dtype);
  const uint64_t body_bytes = req.body().size();
  if (const std::string* sh = q("shape"); sh && !sh->empty()) {
    std::string_view rest = *sh;
    while (true) {
      const size_t comma = rest.find(',');
      uint64_t d = 0;
      if (!parseU64(rest.substr(0, comma), &d)) {
        return badRequest(
            "query parameter 'shape' must be unsigned integers separated by "
            "commas, got " +
            quoted(*sh));
      }
      spec.shape.push_back(d);
      if (spec.shape.size() > kMaxDims) break;
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
    if (std::string e = elementsOf(spec.shape, &spec.elements); !e.empty()) return badRequest(e);
    if (spec.elements > body_bytes / width || spec.elements * width != body_bytes) {
      return badRequest("shape " + quoted(*sh) + " of " + apiDTypeName(spec.dtype) + " needs " +
                        (spec.elements > body_bytes / width
                             ? std::string("more")
                             : std::to_string(spec.elements * width)) +
                        " bytes, the body has " + std::to_string(body_bytes));
    }
  } else {
    if (body_bytes % width != 0) {
      return badRequest("body of " + std::to_string(body_bytes) +
                        " bytes is not a whole number of " + apiDTypeName(spec.dtype) + " values");
    }
    spec.elements = body_bytes / width;
  }
  if (spec.elements == 0) return badRequest("empty tensor: the body holds no values");

  auto body = std::make_shared<std::string>(std::move(req.body()));
  Contribution c;
  c.spec = spec;
  c.data = reinterpret_cast<std::byte*>(body->data());
  c.keep_alive = body;
  replied = true;
  const std::string name = spec.name;
  const uint64_t step = spec.step;
  engine_.submit(std::move(c), [reply, body, name, step](StepOutcome o) {
    if (!o.ok()) return reply(fromOutcome(o));
    Response r{status::ok, 11};
    r.set(http::field::content_type, "application/octet-stream");
    r.set("X-Lightwire-Codec", o.figures.codec);
    r.set("X-Lightwire-Raw-Bytes", std::to_string(o.figures.raw_bytes));
    r.set("X-Lightwire-Wire-Bytes", std::to_string(o.figures.wire_bytes));
    r.set("X-Lightwire-Nonfinite", o.figures.nonfinite ? "1" : "0");
    r.set("X-Lightwire-Mode", o.figures.mode);
    r.set("X-Lightwire-Settings", std::to_string(o.figures.settings));
    r.body() = std::move(*body);
    reply(std::move(r));
  });
  return {};
}

Response ControlApi::emitShm(Request& req, Reply& reply, bool& replied) {
  json::object o;
  if (std::string e = parseObject(req.body(), &o); !e.empty()) return badRequest(e);
  for (const auto& kv : o) {
    const std::string_view k = kv.key();
    if (k != "name" && k != "step" && k != "trainer" && k != "buffer" && k != "offset" &&
        k != "dtype" && k != "shape" && k != "elements") {
      return badRequest("unknown field " + quoted(k));
    }
  }
  TensorSpec spec;
  std::string buffer, dtype = "float32";
  uint64_t offset = 0, trainer = 0, elements = 0;
  bool has_trainer = false, has_elements = false;
  for (std::string e :
       {jsonString(o, "name", true, &spec.name), jsonU64(o, "step", true, &spec.step),
        jsonU64(o, "trainer", false, &trainer, &has_trainer),
        jsonString(o, "buffer", true, &buffer), jsonU64(o, "offset", false, &offset),
        jsonString(o, "dtype", false, &dtype),
        jsonU64(o, "elements", false, &elements, &has_elements)}) {
    if (!e.empty()) return badRequest(e);
  }
  if (std::string e = checkName(spec.name); !e.empty()) return badRequest(e);
  auto dt = kernels::parseDType(dtype);
  if (!dt) return badRequest("unknown dtype " + quoted(dtype) + " (float32, float16 or bfloat16)");
  spec.dtype = *dt;
  if (has_trainer) {
    if (trainer > 1u << 20) return badRequest("field 'trainer' is out of range");
    spec.trainer = static_cast<unsigned>(trainer);
  } else if (config_.local_trainers > 1) {
    return badRequest("missing field 'trainer': this sidecar serves " +
                      std::to_string(config_.local_trainers) + " local trainers");
  }
  if (const json::value* sh = o.if_contains("shape")) {
    if (!sh->is_array()) return badRequest("field 'shape' must be an array of integers");
    for (const auto& d : sh->get_array()) {
      if (d.is_uint64()) {
        spec.shape.push_back(d.get_uint64());
      } else if (d.is_int64() && d.get_int64() >= 0) {
        spec.shape.push_back(static_cast<uint64_t>(d.get_int64()));
      } else {
        return badRequest("field 'shape' must be an array of non-negative integers");
      }
      if (spec.shape.size() > kMaxDims) break;
    }
    if (std::string e = elementsOf(spec.shape, &spec.elements); !e.empty()) return badRequest(e);
    if (has_elements && elements != spec.elements) {
      return badRequest("fields 'shape' and 'elements' disagree");
    }
  } else if (has_elements) {
    spec.elements = elements;
  } else {
    return badRequest("missing field 'shape' (or 'elements')");
  }
  if (spec.elements == 0) return badRequest("empty tensor: 0 elements");
  auto region = buffers_.find(buffer);
  if (!region) {
    return errorResponse(status::not_found, "not_found", "unknown buffer " + quoted(buffer));
  }
  const uint64_t width = kernels::dtypeSize(spec.dtype);
  if (offset % width != 0) {
    return badRequest("offset " + std::to_string(offset) + " is not a multiple of " +
                      std::to_string(width) + " (the size of " + apiDTypeName(spec.dtype) + ")");
  }
  if (spec.elements > region->size() / width || offset > region->size() ||
      spec.elements * width > region->size() - offset) {
    return badRequest("region [" + std::to_string(offset) + ", +" + std::to_string(spec.elements) +
                      " " + apiDTypeName(spec.dtype) + ") lies outside buffer " + buffer + " (" +
                      std::to_string(region->size()) + " bytes)");
  }
  if (!region->stillBacked()) {
    return badRequest("buffer " + buffer + " no longer holds its registered size");
  }
  Contribution c;
  c.spec = spec;
  c.data = region->data() + offset;
  c.still_valid = [region] { return region->stillBacked(); };
  if (std::string_view(region->kind()) != "shm") {
    const uint64_t bytes = spec.elements * width;
    c.fetch = [region, offset, bytes](std::string* why) {
      return region->fetch(offset, bytes, why);
    };
    c.store = [region, offset, bytes](std::string* why) {
      return region->store(offset, bytes, why);
    };
  }
  if (auto cuda = std::dynamic_pointer_cast<ipc::CudaIpcRegion>(region)) {
    // The engine's GPU path reads and writes the trainer's memory in place.
    Contribution::Device d;
    d.ordinal = cuda->deviceOrdinal();
    d.ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(cuda->devicePointer() + offset));
    d.wait = [cuda](void* stream, std::string* why) { return cuda->waitOn(stream, why); };
    c.device = std::move(d);
  }
  c.keep_alive = region;
  replied = true;
  const std::string name = spec.name;
  const uint64_t step = spec.step;
  engine_.submit(std::move(c), [reply, name, step](StepOutcome out) {
    if (!out.ok()) return reply(fromOutcome(out));
    reply(jsonResponse(status::ok, figuresJson(name, step, out.figures)));
  });
  return {};
}

}  // namespace lightwire::proxy
