#pragma once
// Device memory a trainer shares through CUDA IPC (docs/cuda.md, POST /v1/buffers with kind
// "cuda_ipc"): the trainer exports an IPC memory handle once (PyTorch: storage._share_cuda_()),
// plus optionally an IPC event it records after producing each gradient; the sidecar opens the
// handle with cuIpcOpenMemHandle on the GPU it belongs to (matched by PCI bus id, since device
// ordinals differ between processes with different CUDA_VISIBLE_DEVICES), checks the registered
// range against the allocation (cuMemGetAddressRange), and keeps the mapping until the buffer is
// released.
//
// Data paths: the step engine works on the range in place on the GPU (devicePointer(), after
// waitOn(): docs/cuda.md "Steps on the GPU") when every trainer of a step hands device memory and
// the codec runs there; otherwise each step copies the range to a host staging buffer on the
// region's own stream (fetch, after waiting on the trainer's event) and the result back (store)
// before the step replies.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ipc/cuda_driver.h"
#include "ipc/shm_region.h"

namespace lightwire::ipc {

/// "0000:3b:00.0" for any spelling of a PCI bus id (8- or 4-digit domain, either case); a string
/// that is not one is returned lowercased.
std::string normalizePciBusId(const std::string& id);

/// Parses 128 hexadecimal digits (either case) into a handle; false otherwise.
bool parseHandleHex(const std::string& hex, CudaIpcHandle* out);
/// The handle as 128 lowercase hexadecimal digits.
std::string handleHex(const CudaIpcHandle& h);

/// What a trainer registers.
struct CudaIpcSpec {
  CudaIpcHandle memory;                // the allocation's IPC handle
  std::string pci_bus_id;              // its GPU, e.g. "0000:3b:00.0" (case-insensitive)
  uint64_t offset = 0;                 // the registered range inside the allocation
  uint64_t size = 0;                   // bytes, > 0
  std::optional<CudaIpcHandle> event;  // recorded by the trainer after each gradient
  std::string name;                    // a label for listings (default "cuda:<bus id>")
};

class CudaIpcRegion final : public Region {
 public:
  /// Opens `spec` with `driver`. null and a message for the client in `error` when the GPU is not
  /// visible here, the handle cannot be opened (closed, stale, from this very process, or not a
  /// handle), the range lies outside the allocation, or the event cannot be opened.
  static std::unique_ptr<CudaIpcRegion> open(std::shared_ptr<CudaDriver> driver,
                                             const CudaIpcSpec& spec, std::string* error);
  ~CudaIpcRegion() override;
  CudaIpcRegion(const CudaIpcRegion&) = delete;
  CudaIpcRegion& operator=(const CudaIpcRegion&) = delete;

  std::byte* data() const override { return staging_.get(); }
  uint64_t size() const override { return spec_.size; }
  const std::string& name() const override { return spec_.name; }
  const char* kind() const override { return "cuda_ipc"; }
  bool stillBacked() const override { return true; }  // the mapping holds the allocation alive
  bool fetch(uint64_t offset, uint64_t bytes, std::string* error) override;
  bool store(uint64_t offset, uint64_t bytes, std::string* error) override;

  /// Makes `stream` (a stream of this region's GPU, as the CUDA runtime's cudaStream_t) wait on
  /// the device for the trainer's IPC event; nothing when the trainer registered none. The GPU
  /// path of the step engine calls it before it reads the region in place.
  bool waitOn(void* stream, std::string* error) override;
  std::optional<DeviceView> deviceAt(uint64_t offset) const override {
    return DeviceView{ordinal_, devicePointer() + offset};
  }

  int deviceOrdinal() const { return ordinal_; }
  const std::string& pciBusId() const { return spec_.pci_bus_id; }
  uint64_t allocationBytes() const { return allocation_bytes_; }
  /// The registered range's device address in this process.
  uint64_t devicePointer() const { return base_ + spec_.offset; }

 private:
  CudaIpcRegion() = default;
  bool check(CudaDriver::CUresult r, const char* what, std::string* error) const;

  std::shared_ptr<CudaDriver> driver_;
  CudaIpcSpec spec_;
  int ordinal_ = -1;
  CudaDriver::CUdevice device_ = 0;
  CudaDriver::CUcontext context_ = nullptr;
  CudaDriver::CUdeviceptr base_ = 0;
  uint64_t allocation_bytes_ = 0;
  CudaDriver::CUevent event_ = nullptr;
  CudaDriver::CUstream stream_ = nullptr;
  std::unique_ptr<std::byte[]> staging_;
  std::mutex mu_;  // one copy at a time on the region's stream
};

}  // namespace lightwire::ipc
