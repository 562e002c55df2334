// ipc/cuda_ipc: the parts of CUDA IPC registration that need no GPU (handle and bus-id parsing,
// refusals without a driver or for a GPU the sidecar cannot see). Opening a real handle from
// another process is checked on a GPU machine (tests/python/test_cuda_ipc.py, run by
// scripts/device-check.sh).
#include "ipc/cuda_ipc.h"

#include <doctest.h>

namespace lightwire::ipc {
namespace {

TEST_CASE("cuda ipc: handles are 128 hex digits, either case") {
  CudaIpcHandle h;
  std::string hex;
  for (int i = 0; i < 64; ++i) {
    static const char* digits = "0123456789ABCDEF";
    hex += digits[(i * 7) % 16];
    hex += digits[(i * 3 + 1) % 16];
  }
  REQUIRE(parseHandleHex(hex, &h));
  CHECK(h.bytes[0] == 0x01);
  CHECK(h.bytes[1] == 0x74);
  std::string lower = hex;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  CHECK(handleHex(h) == lower);
  CudaIpcHandle untouched;
  untouched.bytes[0] = 0x5A;
  for (const std::string& bad :
       {std::string(), hex.substr(1), hex + "0", hex.substr(0, 127) + "g", std::string(128, ' ')}) {
    CudaIpcHandle out = untouched;
    CHECK_FALSE(parseHandleHex(bad, &out));
    CHECK(out.bytes[0] == 0x5A);  // a refused string changes nothing
  }
}

TEST_CASE("cuda ipc: PCI bus ids compare whatever their spelling") {
  CHECK(normalizePciBusId("0000:3B:00.0") == "0000:3b:00.0");
  CHECK(normalizePciBusId("00000000:3B:00.0") == "0000:3b:00.0");  // nvidia-smi's 8-digit domain
  CHECK(normalizePciBusId("0001:c1:1f.7") == "0001:c1:1f.7");
  // Not a bus id: compared as written (lowercased), so it matches no GPU.
  CHECK(normalizePciBusId("GPU-0") == "gpu-0");
  CHECK(normalizePciBusId("0000:3b:00") == "0000:3b:00");
  CHECK(normalizePciBusId("0000:3b:00.0x") == "0000:3b:00.0x");
  CHECK(normalizePciBusId("") == "");
}

TEST_CASE("cuda ipc: no driver, no region") {
  CudaIpcSpec spec;
  spec.pci_bus_id = "0000:3b:00.0";
  spec.size = 64;
  std::string error;
  CHECK(CudaIpcRegion::open(nullptr, spec, &error) == nullptr);
  CHECK(error == "no CUDA driver");
}

TEST_CASE("cuda ipc: a GPU this sidecar cannot see is refused, naming the ones it sees") {
  std::string error;
  auto driver = CudaDriver::load(&error);
  if (!driver) {
    MESSAGE("no CUDA driver here (" << error << "): only the driverless refusal is checked");
    return;
  }
  CudaIpcSpec spec;
  spec.pci_bus_id = "ffff:ff:1f.7";
  spec.size = 64;
  CHECK(CudaIpcRegion::open(driver, spec, &error) == nullptr);
  CHECK(error.find("is not visible to this sidecar") != std::string::npos);
  // A zeroed handle on a visible GPU is not a live allocation of another process.
  if (!driver->devices().empty()) {
    spec.pci_bus_id = driver->devices()[0].pci_bus_id;
    CHECK(CudaIpcRegion::open(driver, spec, &error) == nullptr);
    CHECK(error.find("cannot open the CUDA IPC memory handle") != std::string::npos);
  }
}

}  // namespace
}  // namespace lightwire::ipc
