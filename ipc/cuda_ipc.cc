#include "ipc/cuda_ipc.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

namespace lightwire::ipc {
namespace {

constexpr unsigned kLazyEnablePeerAccess = 0x1;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr unsigned kStreamNonBlocking = 0x1;     // CU_STREAM_NON_BLOCKING

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

int hexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string normalizePciBusId(const std::string& id) {
  // domain:bus:device.function, each hexadecimal; nvidia-smi writes an 8-digit domain, the
  // driver 4 digits, either case.
  unsigned long parts[4] = {};
  size_t at = 0;
  for (int k = 0; k < 4; ++k) {
    const char sep = k < 2 ? ':' : (k == 2 ? '.' : '\0');
    size_t end = at;
    while (end < id.size() && hexDigit(id[end]) >= 0) ++end;
    if (end == at || end - at > 8) return lower(id);
    parts[k] = std::stoul(id.substr(at, end - at), nullptr, 16);
    if (k < 3) {
      if (end >= id.size() || id[end] != sep) return lower(id);
      at = end + 1;
    } else if (end != id.size()) {
      return lower(id);
    }
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%04lx:%02lx:%02lx.%lx", parts[0], parts[1], parts[2], parts[3]);
  return buf;
}

bool parseHandleHex(const std::string& hex, CudaIpcHandle* out) {
  if (hex.size() != 2 * sizeof out->bytes) return false;
  CudaIpcHandle h;
  for (size_t i = 0; i < sizeof h.bytes; ++i) {
    const int hi = hexDigit(hex[2 * i]), lo = hexDigit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    h.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  *out = h;
  return true;
}

std::string handleHex(const CudaIpcHandle& h) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : h.bytes) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

bool CudaIpcRegion::check(CudaDriver::CUresult r, const char* what, std::string* error) const {
  if (r == CudaDriver::kSuccess) return true;
  *error = std::string(what) + " failed on GPU " + spec_.pci_bus_id + ": " + driver_->errorText(r);
  return false;
}

std::unique_ptr<CudaIpcRegion> CudaIpcRegion::open(std::shared_ptr<CudaDriver> driver,
                                                   const CudaIpcSpec& spec, std::string* error) {
  if (!driver) {
    *error = "no CUDA driver";
    return nullptr;
  }
  if (spec.size == 0) {
    *error = "size must be > 0";
    return nullptr;
  }
  std::unique_ptr<CudaIpcRegion> r(new CudaIpcRegion());
  r->driver_ = driver;
  r->spec_ = spec;
  r->spec_.pci_bus_id = normalizePciBusId(spec.pci_bus_id);
  if (r->spec_.name.empty()) r->spec_.name = "cuda:" + r->spec_.pci_bus_id;
  std::string visible;
  for (const CudaDevice& d : driver->devices()) {
    if (normalizePciBusId(d.pci_bus_id) == r->spec_.pci_bus_id) r->ordinal_ = d.ordinal;
    visible += (visible.empty() ? "" : ", ") + normalizePciBusId(d.pci_bus_id);
  }
  if (r->ordinal_ < 0) {
    *error = "GPU " + r->spec_.pci_bus_id + " is not visible to this sidecar (it sees: " +
             (visible.empty() ? std::string("none") : visible) +
             "); run the sidecar with every GPU of the node visible";
    return nullptr;
  }
  if (!r->check(driver->cuDeviceGet(&r->device_, r->ordinal_), "cuDeviceGet", error) ||
      !r->check(driver->cuDevicePrimaryCtxRetain(&r->context_, r->device_),
                "cuDevicePrimaryCtxRetain", error)) {
    r->context_ = nullptr;
    return nullptr;
  }
  if (!r->check(driver->cuCtxSetCurrent(r->context_), "cuCtxSetCurrent", error)) return nullptr;
  CudaDriver::CUdeviceptr base = 0;
  if (const auto res = driver->cuIpcOpenMemHandle(&base, spec.memory, kLazyEnablePeerAccess);
      res != CudaDriver::kSuccess) {
    *error = "cannot open the CUDA IPC memory handle on GPU " + r->spec_.pci_bus_id + " (" +
             driver->errorText(res) +
             "): it is not a live handle of another process's allocation on that GPU (closed, "
             "stale after the trainer freed it, or exported by this process)";
    return nullptr;
  }
  r->base_ = base;
  CudaDriver::CUdeviceptr alloc_base = 0;
  size_t alloc_bytes = 0;
  if (!r->check(driver->cuMemGetAddressRange(&alloc_base, &alloc_bytes, base),
                "cuMemGetAddressRange", error)) {
    return nullptr;
  }
  r->allocation_bytes_ = alloc_bytes - (base - alloc_base);
  if (spec.offset > r->allocation_bytes_ || spec.size > r->allocation_bytes_ - spec.offset) {
    *error = "range [" + std::to_string(spec.offset) + ", +" + std::to_string(spec.size) +
             ") lies outside the shared allocation (" + std::to_string(r->allocation_bytes_) +
             " bytes)";
    return nullptr;
  }
  if (spec.event) {
    if (const auto res = driver->cuIpcOpenEventHandle(&r->event_, *spec.event);
        res != CudaDriver::kSuccess) {
      r->event_ = nullptr;
      *error = "cannot open the CUDA IPC event handle (" + driver->errorText(res) +
               "): create it with torch.cuda.Event(interprocess=True)";
      return nullptr;
    }
  }
  if (!r->check(driver->cuStreamCreate(&r->stream_, kStreamNonBlocking), "cuStreamCreate", error)) {
    r->stream_ = nullptr;
    return nullptr;
  }
  r->staging_.reset(new (std::nothrow) std::byte[spec.size]);
  if (!r->staging_) {
    *error = "cannot allocate " + std::to_string(spec.size) + " bytes of host staging";
    return nullptr;
  }
  return r;
}

CudaIpcRegion::~CudaIpcRegion() {
  if (!driver_ || !context_) return;
  driver_->cuCtxSetCurrent(context_);
  if (stream_) driver_->cuStreamDestroy(stream_);
  if (event_) driver_->cuEventDestroy(event_);
  if (base_) driver_->cuIpcCloseMemHandle(base_);
  driver_->cuDevicePrimaryCtxRelease(device_);
}

bool CudaIpcRegion::fetch(uint64_t offset, uint64_t bytes, std::string* error) {
  if (offset > spec_.size || bytes > spec_.size - offset) {
    *error = "range outside the registered buffer";
    return false;
  }
  std::lock_guard lock(mu_);
  if (!check(driver_->cuCtxSetCurrent(context_), "cuCtxSetCurrent", error)) return false;
  // The trainer recorded its event after the work that produced the gradient: our copy starts
  // after it on the device, without blocking this thread until then.
  if (event_ &&
      !check(driver_->cuStreamWaitEvent(stream_, event_, 0), "cuStreamWaitEvent", error)) {
    return false;
  }
  return check(driver_->cuMemcpyDtoHAsync(staging_.get() + offset, devicePointer() + offset, bytes,
                                          stream_),
               "cuMemcpyDtoHAsync", error) &&
         check(driver_->cuStreamSynchronize(stream_), "cuStreamSynchronize", error);
}

bool CudaIpcRegion::waitOn(void* stream, std::string* error) {
  if (event_ == nullptr) return true;
  std::lock_guard lock(mu_);
  if (!check(driver_->cuCtxSetCurrent(context_), "cuCtxSetCurrent", error)) return false;
  return check(driver_->cuStreamWaitEvent(static_cast<CudaDriver::CUstream>(stream), event_, 0),
               "cuStreamWaitEvent", error);
}

bool CudaIpcRegion::store(uint64_t offset, uint64_t bytes, std::string* error) {
  if (offset > spec_.size || bytes > spec_.size - offset) {
    *error = "range outside the registered buffer";
    return false;
  }
  std::lock_guard lock(mu_);
  if (!check(driver_->cuCtxSetCurrent(context_), "cuCtxSetCurrent", error)) return false;
  // Complete before the reply: the trainer reads the result as soon as it has the reply.
  return check(driver_->cuMemcpyHtoDAsync(devicePointer() + offset, staging_.get() + offset, bytes,
                                          stream_),
               "cuMemcpyHtoDAsync", error) &&
         check(driver_->cuStreamSynchronize(stream_), "cuStreamSynchronize", error);
}

}  // namespace lightwire::ipc
