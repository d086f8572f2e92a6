// AtomicFile: a file appears whole or not at all, a failed or abandoned write leaves the old one,
// and temporary files of killed writers are cleared by the next writer of the path.
#include "tidal/common/atomic_file.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"

namespace tidal {
namespace {

using testing::TestDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The names in dir other than `except`.
std::vector<std::string> others(const std::string& dir, const std::string& except) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename() != except) names.push_back(e.path().filename().string());
  }
  return names;
}

void write_whole(const std::string& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text.data(), text.size());
  f.commit();
}

TEST(AtomicFile, CommitReplacesTheFileWhole) {
  TestDir t;
  const std::string path = t.path() + "/ck.bin";
  write_whole(path, "old contents");
  std::string text(1 << 20, '\0');
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>(i * 131 % 251);
  {
    AtomicFile f(path);
    f.write(text.data(), 1025);
    f.write(text.data() + 1025, text.size() - 1025);
    // Until commit, readers see the old file, whole.
    EXPECT_EQ(read_file(path), "old contents");
    f.commit();
    EXPECT_EQ(read_file(path), text);
    EXPECT_THROW(f.commit(), Error);  // once
  }
  EXPECT_EQ(read_file(path), text);
  EXPECT_TRUE(others(t.path(), "ck.bin").empty()) << others(t.path(), "ck.bin").front();
}

TEST(AtomicFile, AnAbandonedWriteLeavesTheOldFile) {
  TestDir t;
  const std::string path = t.path() + "/ck.bin";
  write_whole(path, "old contents");
  {
    AtomicFile f(path);
    const std::string part(513, 'x');
    f.write(part.data(), part.size());
  }  // no commit: an exception unwound past it
  EXPECT_EQ(read_file(path), "old contents");
  EXPECT_TRUE(others(t.path(), "ck.bin").empty());
  // A path that did not exist stays absent.
  { AtomicFile f(t.path() + "/new.bin"); }
  EXPECT_FALSE(std::filesystem::exists(t.path() + "/new.bin"));
  EXPECT_THROW(AtomicFile(t.path() + "/no/such/dir/x.bin"), IoError);
}

// Writes `n` bytes to path through AtomicFile and expects IoError with errno `err` (ENOSPC on a
// full filesystem), the previous file intact and no temporary file left.
void expect_failed_write_keeps_old(const std::string& dir, std::size_t n, int err) {
  const std::string path = dir + "/ck.bin";
  write_whole(path, "previous checkpoint");
  const std::string big(n, 'y');
  try {
    AtomicFile f(path);
    f.write(big.data(), big.size());
    f.commit();
    ADD_FAILURE() << "a write of " << n << " bytes did not fail";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), err) << e.what();
    EXPECT_NE(std::string(e.what()).find("ck.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("untouched"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file(path), "previous checkpoint");
  EXPECT_TRUE(others(dir, "ck.bin").empty()) << others(dir, "ck.bin").front();
}

TEST(AtomicFile, AFullFilesystemRaisesIoErrorAndKeepsTheOldFile) {
  TestDir t;
  const std::string dir = t.sub("small");
  // A 256 KiB tmpfs: needs CAP_SYS_ADMIN (root outside a restricted container).
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=256k") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs to fill (" << std::strerror(errno)
                 << "; needs root); AtomicFile.AFileSizeLimitRaisesIoError covers the same path";
  }
  expect_failed_write_keeps_old(dir, 1 << 20, ENOSPC);
  ::umount2(dir.c_str(), MNT_DETACH);
}

// The same failure without root: a file size limit fails the write with EFBIG.
TEST(AtomicFile, AFileSizeLimitRaisesIoErrorAndKeepsTheOldFile) {
  TestDir t;
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* const old_handler = ::signal(SIGXFSZ, SIG_IGN);  // else the signal ends the process
  struct rlimit lim = old;
  lim.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  expect_failed_write_keeps_old(t.path(), 1 << 20, EFBIG);
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
}

// A writer killed mid-write leaves <path>.tmp.<pid>; the next AtomicFile of the path removes it
// once that pid is gone, and leaves the files of live processes and other names alone.
TEST(AtomicFile, ANewWriterRemovesTemporaryFilesOfDeadWriters) {
  TestDir t;
  const std::string path = t.path() + "/ck.bin";
  write_whole(path, "previous checkpoint");
  std::vector<std::string> dead;
  for (int i = 0; i < 3; ++i) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      AtomicFile f(path);
      f.write("half", 4);
      ::_exit(0);  // no destructor: as SIGKILL leaves it
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);  // reaped: the pid no longer exists
    dead.push_back(path + ".tmp." + std::to_string(child));
    ASSERT_TRUE(std::filesystem::exists(dead.back()));
  }
  // A writer alive now (pid 1 always is) and names that only look alike are not touched.
  const std::vector<std::string> kept{path + ".tmp.1", path + ".tmp.x12", t.path() + "/other.tmp.7",
                                      path + ".tmp."};
  for (const auto& k : kept) std::ofstream(k) << "keep";
  {
    AtomicFile f(path);
    for (const auto& d : dead) EXPECT_FALSE(std::filesystem::exists(d)) << d;
    for (const auto& k : kept) EXPECT_TRUE(std::filesystem::exists(k)) << k;
  }
  EXPECT_EQ(read_file(path), "previous checkpoint");
}

}  // namespace
}  // namespace tidal
