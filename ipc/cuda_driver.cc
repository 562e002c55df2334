#include "ipc/cuda_driver.h"

#include <dlfcn.h>

namespace lightwire::ipc {
namespace {

/// Resolves `name` into `fn`; false (and `missing` set) when the library lacks it.
template <typename F>
bool resolve(void* lib, const char* name, F& fn, std::string& missing) {
  void* p = dlsym(lib, name);
  if (!p) {
    if (!missing.empty()) missing += ", ";
    missing += name;
    return false;
  }
  fn = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

std::shared_ptr<CudaDriver> CudaDriver::load(std::string* error, const std::string& library) {
  auto fail = [&](std::string why) -> std::shared_ptr<CudaDriver> {
    if (error) *error = std::move(why);
    return nullptr;
  };
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    return fail("no CUDA driver (" + std::string(why ? why : library.c_str()) + ")");
  }
  std::shared_ptr<CudaDriver> d(new CudaDriver());
  d->library_ = lib;
  std::string missing;
  resolve(lib, "cuInit", d->cuInit, missing);
  resolve(lib, "cuDriverGetVersion", d->cuDriverGetVersion, missing);
  resolve(lib, "cuDeviceGetCount", d->cuDeviceGetCount, missing);
  resolve(lib, "cuDeviceGet", d->cuDeviceGet, missing);
  resolve(lib, "cuDeviceGetName", d->cuDeviceGetName, missing);
  resolve(lib, "cuDeviceGetPCIBusId", d->cuDeviceGetPCIBusId, missing);
  resolve(lib, "cuDevicePrimaryCtxRetain", d->cuDevicePrimaryCtxRetain, missing);
  resolve(lib, "cuDevicePrimaryCtxRelease_v2", d->cuDevicePrimaryCtxRelease, missing);
  resolve(lib, "cuCtxSetCurrent", d->cuCtxSetCurrent, missing);
  resolve(lib, "cuIpcOpenMemHandle_v2", d->cuIpcOpenMemHandle, missing);
  resolve(lib, "cuIpcCloseMemHandle", d->cuIpcCloseMemHandle, missing);
  resolve(lib, "cuIpcOpenEventHandle", d->cuIpcOpenEventHandle, missing);
  resolve(lib, "cuMemGetAddressRange_v2", d->cuMemGetAddressRange, missing);
  resolve(lib, "cuStreamCreate", d->cuStreamCreate, missing);
  resolve(lib, "cuStreamDestroy_v2", d->cuStreamDestroy, missing);
  resolve(lib, "cuStreamWaitEvent", d->cuStreamWaitEvent, missing);
  resolve(lib, "cuStreamSynchronize", d->cuStreamSynchronize, missing);
  resolve(lib, "cuEventCreate", d->cuEventCreate, missing);
  resolve(lib, "cuEventDestroy_v2", d->cuEventDestroy, missing);
  resolve(lib, "cuEventRecord", d->cuEventRecord, missing);
  resolve(lib, "cuMemcpyDtoHAsync_v2", d->cuMemcpyDtoHAsync, missing);
  resolve(lib, "cuMemcpyHtoDAsync_v2", d->cuMemcpyHtoDAsync, missing);
  resolve(lib, "cuGetErrorName", d->cuGetErrorName, missing);
  resolve(lib, "cuGetErrorString", d->cuGetErrorString, missing);
  if (!missing.empty()) {
    return fail(library + " lacks entry points this sidecar needs (" + missing +
                "): the driver is too old");
  }
  if (const CUresult r = d->cuInit(0); r != kSuccess) {
    return fail("cuInit failed: " + d->errorText(r));
  }
  if (const CUresult r = d->cuDriverGetVersion(&d->version_); r != kSuccess) {
    return fail("cuDriverGetVersion failed: " + d->errorText(r));
  }
  int count = 0;
  if (const CUresult r = d->cuDeviceGetCount(&count); r != kSuccess) {
    return fail("cuDeviceGetCount failed: " + d->errorText(r));
  }
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    char name[256] = {};
    char bus[32] = {};
    if (d->cuDeviceGet(&dev, i) != kSuccess ||
        d->cuDeviceGetName(name, sizeof name - 1, dev) != kSuccess ||
        d->cuDeviceGetPCIBusId(bus, sizeof bus - 1, dev) != kSuccess) {
      return fail("cannot query GPU " + std::to_string(i));
    }
    d->devices_.push_back({i, name, bus});
  }
  return d;
}

CudaDriver::~CudaDriver() {
  if (library_) dlclose(library_);
}

std::string CudaDriver::errorText(CUresult r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName) cuGetErrorName(r, &name);
  if (cuGetErrorString) cuGetErrorString(r, &text);
  std::string out = name ? name : "CUresult " + std::to_string(r);
  if (text) out += std::string(": ") + text;
  return out;
}

}  // namespace lightwire::ipc
