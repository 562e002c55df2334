// The seed corpora of the fuzz targets (tests/fuzz/README.md), without libFuzzer:
//   fuzz_corpus make DIR        writes every target's seeds to DIR/<target>/<name> (what is
//                               committed under tests/fuzz/corpus/; files of a target not made
//                               any more are removed)
//   fuzz_corpus replay DIR...   runs every file of DIR/<target>/ (or of DIR when it is one
//                               target's directory: its name says which) through its target
//   fuzz_corpus dict DIR        writes DIR/config_yaml.dict from the configuration key table
//                               (every YAML key, environment variable and flag)
//   fuzz_corpus list            the target names
// Exit status 0 when everything ran (a broken invariant aborts), 2 on a usage error.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include "proxy/config/config.h"
#include "tests/fuzz/targets.h"

namespace fs = std::filesystem;
using namespace lightwire::fuzz;

namespace {

struct Target {
  std::function<int(const uint8_t*, size_t)> run;
  std::function<void(Seeds&)> seeds;
};

const std::map<std::string, Target>& targets() {
#define LW_FUZZ_ENTRY(name) {#name, Target{name::run, name::seeds}},
  static const std::map<std::string, Target> t = {LW_FUZZ_TARGETS(LW_FUZZ_ENTRY)};
#undef LW_FUZZ_ENTRY
  return t;
}

int make(const fs::path& dir) {
  size_t total = 0, files = 0;
  for (const auto& [name, target] : targets()) {
    Seeds seeds;
    target.seeds(seeds);
    const fs::path sub = dir / name;
    fs::create_directories(sub);
    std::set<std::string> made;
    for (const auto& [file, bytes] : seeds) {
      if (!made.insert(file).second) fail(name + ": two seeds named " + file);
      std::ofstream out(sub / file, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(bytes.data()),
                static_cast<std::streamsize>(bytes.size()));
      if (!out) fail("cannot write " + (sub / file).string());
      total += bytes.size();
    }
    for (const auto& entry : fs::directory_iterator(sub)) {
      if (!made.count(entry.path().filename().string())) fs::remove(entry.path());
    }
    files += made.size();
    std::printf("%-12s %3zu seeds\n", name.c_str(), made.size());
  }
  std::printf("%zu files, %zu bytes in %s\n", files, total, dir.c_str());
  return 0;
}

int dict(const fs::path& dir) {
  std::set<std::string> words;
  for (const auto& k : lightwire::proxy::serveConfigKeys()) {
    size_t at = 0;
    for (size_t dot; (dot = k.path.find('.', at)) != std::string::npos; at = dot + 1) {
      words.insert(k.path.substr(at, dot - at) + ":");
    }
    words.insert(k.path.substr(at) + ": ");
    if (!k.default_text.empty()) words.insert(k.default_text);
    words.insert("#@env " + k.env + "=");
    words.insert("#@flag " + k.path + "=");
  }
  // compression.rules and the codec parameters are file/JSON only (not in the key table).
  for (const char* w : {"rules:", "- pattern: ", "min_elements: ", "max_elements: ", "codec: ",
                        "sync_every: ", "group: ", "approx_rank: ", "threshold: ", "bits: ",
                        "bucket_size: ", "error_feedback: ", "values: ", "ratio: ", "density: "}) {
    words.insert(w);
  }
  std::ofstream out(dir / "config_yaml.dict", std::ios::trunc);
  out << "# libFuzzer dictionary of the `config_yaml` target, written by `fuzz_corpus dict` from\n"
         "# proxy/config/config.h serveConfigKeys(): YAML keys, environment variables, flags, "
         "defaults.\n";
  for (const auto& w : words) {
    out << '"';
    for (unsigned char c : w) {
      if (c == '"' || c == '\\' || c < 0x20 || c > 0x7E) {
        char hex[5];
        std::snprintf(hex, sizeof hex, "\\x%02x", c);
        out << hex;
      } else {
        out << c;
      }
    }
    out << "\"\n";
  }
  if (!out) fail("cannot write " + (dir / "config_yaml.dict").string());
  std::printf("%zu words in %s\n", words.size(), (dir / "config_yaml.dict").c_str());
  return 0;
}

size_t replayFile(const Target& target, const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in),
                                   std::istreambuf_iterator<char>()};
  target.run(bytes.data(), bytes.size());
  return 1;
}

int replay(const fs::path& dir) {
  const std::string leaf = dir.filename().string();
  if (auto it = targets().find(leaf); it != targets().end()) {
    size_t n = 0;
    for (const auto& entry : fs::directory_iterator(dir)) n += replayFile(it->second, entry.path());
    std::printf("%-12s %3zu inputs\n", leaf.c_str(), n);
    return 0;
  }
  for (const auto& [name, target] : targets()) {
    const fs::path sub = dir / name;
    if (!fs::is_directory(sub)) continue;
    size_t n = 0;
    for (const auto& entry : fs::directory_iterator(sub)) n += replayFile(target, entry.path());
    std::printf("%-12s %3zu inputs\n", name.c_str(), n);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  quiet();
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "make" && argc == 3) return make(argv[2]);
  if (cmd == "replay" && argc >= 3) {
    for (int i = 2; i < argc; ++i) replay(argv[i]);
    return 0;
  }
  if (cmd == "dict" && argc == 3) return dict(argv[2]);
  if (cmd == "list" && argc == 2) {
    for (const auto& [name, target] : targets()) std::printf("%s\n", name.c_str());
    return 0;
  }
  std::fprintf(stderr, "usage: %s make DIR | replay DIR... | dict DIR | list\n", argv[0]);
  return 2;
}
