#pragma once
// The CUDA driver API, loaded at run time (docs/cuda.md "The CUDA driver, loaded at run time"):
// dlopen("libcuda.so.1") and only the entry points the sidecar needs, so one binary starts and
// works on machines with and without a GPU and its driver. The few driver types used are declared
// here as the driver ABI fixes them (handles are 64 opaque bytes, devices ints, pointers 64-bit),
// so ipc/ builds without the CUDA toolkit.
//
// Versioned entry points are resolved by their ABI names (cuIpcOpenMemHandle_v2, ...), the ones
// cuda.h maps the plain names to since CUDA 11.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lightwire::ipc {

/// CUipcMemHandle / CUipcEventHandle: what a trainer exports (cudaIpcGetMemHandle, PyTorch's
/// storage._share_cuda_()).
struct CudaIpcHandle {
  uint8_t bytes[64] = {};
};

/// One GPU as the driver sees it.
struct CudaDevice {
  int ordinal = 0;
  std::string name;
  std::string pci_bus_id;  // "0000:3b:00.0": how a handle's GPU is matched across processes
};

/// The loaded driver. Thread-safe (the driver API is).
class CudaDriver {
 public:
  using CUresult = int;
  static constexpr CUresult kSuccess = 0;  // CUDA_SUCCESS
  using CUdevice = int;
  using CUdeviceptr = unsigned long long;
  using CUcontext = struct CUctx_st*;
  using CUstream = struct CUstream_st*;
  using CUevent = struct CUevent_st*;

  /// Loads `library` and every entry point, then cuInit(0). nullptr and `error` (naming the
  /// library, or the entry point missing, or cuInit's error) when any of that fails: the sidecar
  /// then runs CPU-only.
  static std::shared_ptr<CudaDriver> load(std::string* error,
                                          const std::string& library = "libcuda.so.1");
  ~CudaDriver();
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  int version() const { return version_; }  // e.g. 12040 for 12.4
  const std::vector<CudaDevice>& devices() const { return devices_; }
  /// "CUDA_ERROR_INVALID_VALUE: invalid argument" for a CUresult.
  std::string errorText(CUresult r) const;

  // Entry points (the driver's own signatures).
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetPCIBusId)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CudaIpcHandle, unsigned) = nullptr;
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr) = nullptr;
  CUresult (*cuIpcOpenEventHandle)(CUevent*, CudaIpcHandle) = nullptr;
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;

 private:
  CudaDriver() = default;
  void* library_ = nullptr;
  int version_ = 0;
  std::vector<CudaDevice> devices_;
};

}  // namespace lightwire::ipc
