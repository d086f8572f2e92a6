// A fresh directory on a real disk for store tests (O_DIRECT needs one; tmpfs may refuse it).
// TIDAL_TEST_DIR chooses the parent; default /var/tmp. Removed with its contents at the end.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace tidal::testing {

class TestDir {
 public:
  TestDir() {
    const char* parent = std::getenv("TIDAL_TEST_DIR");
    std::random_device rd;
    path_ = std::filesystem::path(parent != nullptr ? parent : "/var/tmp") /
            ("tidal-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TestDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TestDir(const TestDir&) = delete;
  TestDir& operator=(const TestDir&) = delete;

  [[nodiscard]] std::string path() const { return path_.string(); }
  /// A subdirectory, created on first use.
  [[nodiscard]] std::string sub(const std::string& name) const {
    auto p = path_ / name;
    std::filesystem::create_directories(p);
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

/// n random bytes from a seeded generator.
inline std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<unsigned char>(rng());
  return v;
}

}  // namespace tidal::testing
