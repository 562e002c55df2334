// ipc/cuda_driver: the CUDA driver API loaded at run time. On a machine without a driver the load
// fails cleanly (the sidecar runs CPU-only); with one, every GPU is listed.
#include "ipc/cuda_driver.h"

#include <doctest.h>

namespace lightwire::ipc {
namespace {

TEST_CASE("cuda driver: a missing library is a clear error, not a crash") {
  std::string error;
  auto d = CudaDriver::load(&error, "/nonexistent/libcuda.so.1");
  CHECK(d == nullptr);
  CHECK(error.find("no CUDA driver") != std::string::npos);
  CHECK(error.find("/nonexistent/libcuda.so.1") != std::string::npos);
}

TEST_CASE("cuda driver: a library without the entry points is refused, naming them") {
  std::string error;
  auto d = CudaDriver::load(&error, "libm.so.6");  // a real library that is not the driver
  CHECK(d == nullptr);
  CHECK(error.find("lacks entry points") != std::string::npos);
  CHECK(error.find("cuIpcOpenMemHandle_v2") != std::string::npos);
}

TEST_CASE("cuda driver: the machine's own driver, if any") {
  std::string error;
  auto d = CudaDriver::load(&error);
  if (!d) {
    MESSAGE("no CUDA driver here: " << error);
    CHECK(!error.empty());
    return;
  }
  CHECK(d->version() >= 11000);
  for (const auto& dev : d->devices()) {
    CHECK(!dev.name.empty());
    CHECK(dev.pci_bus_id.size() >= 12);  // "0000:3b:00.0"
  }
  CHECK(d->errorText(1).find("CUDA_ERROR_INVALID_VALUE") == 0);
}

}  // namespace
}  // namespace lightwire::ipc
