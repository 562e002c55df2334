// main() of the tests that link spdlog (proxy_tests, exchange_tests).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest.h>
#include <spdlog/spdlog.h>

int main(int argc, char** argv) {
  // spdlog's registry is a function-local static of the (uninstrumented) shared library: create it
  // before any test starts threads, or ThreadSanitizer cannot see the guard that publishes it.
  spdlog::default_logger_raw();
  doctest::Context context(argc, argv);
  return context.run();
}
