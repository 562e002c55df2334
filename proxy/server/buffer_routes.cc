// The buffer routes of the control API (docs/api.md "POST /v1/buffers, DELETE /v1/buffers/{id}"):
// shared-memory and CUDA IPC regions registered by trainers, their limits and their release
// (also of trainers that exited).

#include "proxy/server/control_api.h"

#include <spdlog/spdlog.h>

#include "ipc/cuda_ipc.h"
#include "proxy/server/api_util.h"

namespace lightwire::proxy {

using namespace api;  // NOLINT(google-build-using-namespace): the routes' shared helpers

Response ControlApi::bufferLimit(ipc::BufferTable::AddError why, const std::string& error) {
  metrics_
      .limitHits(why == ipc::BufferTable::AddError::kOwnerLimit ? "buffers_per_client" : "buffers")
      .Increment();
  return errorResponse(status::too_many_requests, "limit_reached", error);
}

Response ControlApi::registerBuffer(RouteCall& call) {
  const RequestInfo& info = call.info;
  json::object o;
  if (std::string e = parseObject(call.req.body(), &o); !e.empty()) return badRequest(e);
  std::string kind = "shm";
  if (std::string e = jsonString(o, "kind", false, &kind); !e.empty()) return badRequest(e);
  ipc::BufferOwner owner = ipc::BufferOwner::of(info.pid);
  owner.uid = info.uid;
  if (kind == "cuda_ipc") return registerCudaBuffer(o, owner);
  if (kind != "shm") {
    return badRequest("unknown buffer kind " + quote(kind) + " (known: 'shm', 'cuda_ipc')");
  }
  for (const auto& kv : o) {
    if (kv.key() != "kind" && kv.key() != "name" && kv.key() != "size") {
      return badRequest("unknown field " + quote(kv.key()) + " for kind 'shm'");
    }
  }
  std::string name;
  uint64_t size = 0;
  for (std::string e : {jsonString(o, "name", true, &name), jsonU64(o, "size", true, &size)}) {
    if (!e.empty()) return badRequest(e);
  }
  ipc::BufferTable::AddError why{};
  std::string error;
  const std::string id = buffers_.add(name, size, owner, &why, &error);
  if (id.empty()) {
    if (why == ipc::BufferTable::AddError::kForbidden) {
      return errorResponse(status::forbidden, "forbidden", error);
    }
    if (why != ipc::BufferTable::AddError::kInvalid) return bufferLimit(why, error);
    return badRequest(error);
  }
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  spdlog::debug("registered buffer {} ({} bytes of {})", id, size, name);
  return jsonResponse(status::created, json::object{{"id", id}, {"kind", "shm"}, {"size", size}});
}

Response ControlApi::registerCudaBuffer(const json::object& o, const ipc::BufferOwner& owner) {
  for (const auto& kv : o) {
    const std::string_view k = kv.key();
    if (k != "kind" && k != "name" && k != "size" && k != "handle" && k != "device" &&
        k != "offset" && k != "event") {
      return badRequest("unknown field " + quote(kv.key()) + " for kind 'cuda_ipc'");
    }
  }
  ipc::CudaIpcSpec spec;
  std::string handle, event;
  bool has_event = false;
  for (std::string e :
       {jsonString(o, "handle", true, &handle), jsonString(o, "device", true, &spec.pci_bus_id),
        jsonU64(o, "size", true, &spec.size), jsonU64(o, "offset", false, &spec.offset),
        jsonString(o, "name", false, &spec.name)}) {
    if (!e.empty()) return badRequest(e);
  }
  if (o.if_contains("event") != nullptr && !o.at("event").is_null()) {
    if (std::string e = jsonString(o, "event", true, &event); !e.empty()) return badRequest(e);
    has_event = true;
  }
  if (!ipc::parseHandleHex(handle, &spec.memory)) {
    return badRequest(
        "field 'handle' must be the 64-byte CUDA IPC memory handle as 128 hex digits");
  }
  if (has_event) {
    ipc::CudaIpcHandle ev;
    if (!ipc::parseHandleHex(event, &ev)) {
      return badRequest(
          "field 'event' must be the 64-byte CUDA IPC event handle as 128 hex digits");
    }
    spec.event = ev;
  }
  if (spec.size == 0) return badRequest("field 'size' must be > 0");
  if (spec.pci_bus_id.empty() || spec.pci_bus_id.size() > 64) {
    return badRequest("field 'device' must be the GPU's PCI bus id, e.g. \"0000:3b:00.0\"");
  }
  if (spec.name.size() > 256) return badRequest("field 'name' is longer than 256 bytes");
  std::shared_ptr<ipc::CudaDriver> driver;
  {
    std::lock_guard lock(mu_);
    if (!cuda_) {
      return errorResponse(status::conflict, "failed_precondition",
                           "this sidecar cannot open CUDA IPC handles: " + cuda_why_not_ +
                               "; send host memory (kind 'shm') or an HTTP body instead");
    }
    driver = cuda_;
  }
  std::string error;
  ipc::BufferTable::AddError why{};
  if (!buffers_.hasRoom(owner, &why, &error)) return bufferLimit(why, error);
  // This version stages device buffers through host memory of their size: bounded like a body.
  if (spec.size > config_.limits.max_body_bytes) {
    metrics_.limitHits("body_bytes").Increment();
    return errorResponse(status::payload_too_large, "too_large",
                         "a CUDA IPC buffer of " + std::to_string(spec.size) +
                             " bytes exceeds limits.max_body_bytes (" +
                             std::to_string(config_.limits.max_body_bytes) +
                             "): register smaller ranges (one per gradient bucket)");
  }
  auto region = ipc::CudaIpcRegion::open(driver, spec, &error);
  if (!region) return badRequest(error);
  const std::string label = region->name();
  const int ordinal = region->deviceOrdinal();
  const std::string id = buffers_.insert(std::move(region), owner, &why, &error);
  if (id.empty()) return bufferLimit(why, error);
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  spdlog::debug("registered CUDA IPC buffer {} ({} bytes on GPU {} = {})", id, spec.size, ordinal,
                spec.pci_bus_id);
  return jsonResponse(status::created, json::object{{"id", id},
                                                    {"kind", "cuda_ipc"},
                                                    {"size", spec.size},
                                                    {"device", spec.pci_bus_id},
                                                    {"name", label}});
}

Response ControlApi::releaseBuffer(RouteCall& call) {
  const std::string id = call.target.path.substr(std::string_view("/v1/buffers/").size());
  if (!buffers_.remove(id)) {
    return errorResponse(status::not_found, "not_found", "unknown buffer " + quote(id));
  }
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  metrics_.buffersReleased("client").Increment();
  return jsonResponse(status::ok, json::object{});
}

size_t ControlApi::releaseExitedOwners() {
  const auto released = buffers_.releaseExited();
  if (released.empty()) return 0;
  for (const auto& b : released) {
    spdlog::warn("released buffer {} ({}, {} bytes of {}): process {} that registered it exited",
                 b.id, b.kind, b.size, b.name, b.pid);
  }
  metrics_.buffersReleased("owner_exited").Increment(static_cast<double>(released.size()));
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  return released.size();
}

}  // namespace lightwire::proxy
