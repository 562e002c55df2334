// Entry point of kernels_cuda_tests and proxy_cuda_tests. Without a usable CUDA device (no
// driver, or no GPU) the tests cannot run: the executable says so and exits with 77, which meson
// and scripts/test.sh count as SKIPPED — never as passed. LW_REQUIRE_CUDA=1 turns that into a
// failure (exit 1), for scripts/device-check.sh on machines that are supposed to have a GPU.

#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime_api.h>
#include <doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device (cudaGetDeviceCount: %s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    std::fflush(stdout);
    const char* require = std::getenv("LW_REQUIRE_CUDA");
    if (require != nullptr && std::strcmp(require, "1") == 0) return 1;
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("CUDA device 0: %s (sm_%d%d), %d device(s)\n", prop.name, prop.major, prop.minor,
                count);
  }
  doctest::Context context(argc, argv);
  return context.run();
}
