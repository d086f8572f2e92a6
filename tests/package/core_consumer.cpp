// A program of another project over tidal's torch-free core: random bytes of an odd size through
// the SSD tensor store and back, compared byte for byte. Used by run.sh against the installed
// package (find_package, pkg-config) and through add_subdirectory.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "tidal/tidal.hpp"  // the umbrella header, without torch here

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s STORE_DIR\n", argv[0]);
    return 2;
  }
  tidal::io::StoreOptions opt;
  opt.dirs = {argv[1]};
  opt.capacity = 16u << 20;
  tidal::io::TensorStore store(opt);
  std::mt19937 rng(std::random_device{}());
  std::vector<unsigned char> src(1025 * 1024 + 513), dst(src.size());
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  const auto ticket = store.write(src.data(), src.size());
  store.wait(ticket);
  store.read(ticket, dst.data());
  store.wait(ticket);
  store.free(ticket);
  if (src != dst) {
    std::fprintf(stderr, "FAIL: the bytes read back differ from those written\n");
    return 1;
  }
  std::printf("ok: %zu bytes through the store\n", src.size());
  return 0;
}
