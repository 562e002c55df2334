#pragma once
// A directory from mkdtemp for one test, removed with its files at the end.

#include <doctest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace lightwire::testing {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/lightwire-test-XXXXXX";
    const char* d = mkdtemp(tmpl);
    REQUIRE(d != nullptr);
    path_ = d;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  /// Writes `text` to file `name` in the directory; returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    const std::string p = path_ + "/" + name;
    std::ofstream(p) << text;
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace lightwire::testing
