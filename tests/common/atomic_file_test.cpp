// AtomicFile: a file appears whole or not at all, a failed or abandoned write leaves the old one,
// and temporary files of killed writers are cleared by the next writer of the path.
#include "tidal/common/atomic_file.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
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

// The temporary files in dir whose name starts `<name>.tmp.<pid>.`.
std::vector<std::string> temps_of(const std::string& dir, const std::string& name, pid_t pid) {
  const std::string prefix = name + ".tmp." + std::to_string(pid) + ".";
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) found.push_back(e.path().string());
  }
  return found;
}

// A writer killed mid-write leaves <path>.tmp.<pid>.<random>; the next AtomicFile of the path
// removes it once that pid is gone, and leaves the files of live processes, other users' kinds
// of files (links) and other names alone. The name before the random part, <path>.tmp.<pid>,
// is cleared too.
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
    const auto left = temps_of(t.path(), "ck.bin", child);
    ASSERT_EQ(left.size(), 1u);
    dead.push_back(left.front());
    if (i == 0) {  // the older name of a dead writer
      dead.push_back(path + ".tmp." + std::to_string(child));
      std::ofstream(dead.back()) << "half";
    }
  }
  // A writer alive now (pid 1 always is), a link named like a dead writer's file, and names
  // that only look alike are not touched.
  const std::vector<std::string> kept{path + ".tmp.1",          path + ".tmp.1.aB3xZ9",
                                      path + ".tmp.x12",        t.path() + "/other.tmp.7",
                                      path + ".tmp.",           path + ".tmp.99999999.abc",
                                      path + ".tmp.12.abcdef.x"};
  for (const auto& k : kept) std::ofstream(k) << "keep";
  const std::string dead_link = path + ".tmp.2147483646.abcdef";  // no such pid
  std::filesystem::create_symlink(path, dead_link);
  {
    AtomicFile f(path);
    for (const auto& d : dead) EXPECT_FALSE(std::filesystem::exists(d)) << d;
    for (const auto& k : kept) EXPECT_TRUE(std::filesystem::exists(k)) << k;
    EXPECT_TRUE(std::filesystem::is_symlink(dead_link));
  }
  EXPECT_EQ(read_file(path), "previous checkpoint");
}

// Another user of a shared directory plants a symlink where the temporary file would be (the
// old name, <path>.tmp.<pid>, was easy to guess) or at the final path: the write follows
// neither. The victim keeps its bytes and its mode; the final path becomes our regular file
// with the mode asked for, and a dangling link's target is never created.
TEST(AtomicFile, APlantedSymlinkIsNeverFollowed) {
  TestDir t;
  const std::string victim = t.path() + "/victim";
  std::ofstream(victim) << "secret";
  ASSERT_EQ(::chmod(victim.c_str(), 0600), 0);
  const std::string path = t.path() + "/run.json";
  const std::string guessed = path + ".tmp." + std::to_string(::getpid());
  std::filesystem::create_symlink(victim, guessed);
  {
    AtomicFile f(path, 0644);
    f.write("timeline", 8);
    f.commit();
  }
  EXPECT_EQ(read_file(victim), "secret");
  struct stat st {};
  ASSERT_EQ(::stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  EXPECT_EQ(read_file(path), "timeline");
  EXPECT_TRUE(std::filesystem::is_symlink(guessed));  // not ours to remove, nor to write

  // A dangling link at the guessable name: its target is never created.
  const std::string missing = t.path() + "/created-through-link";
  const std::string other = t.path() + "/other.json";
  std::filesystem::create_symlink(missing, other + ".tmp." + std::to_string(::getpid()));
  write_whole(other, "x");
  EXPECT_FALSE(std::filesystem::exists(missing));

  // A link at the final path is replaced by the rename, not written through.
  const std::string linked = t.path() + "/linked.json";
  std::filesystem::create_symlink(victim, linked);
  write_whole(linked, "new");
  EXPECT_FALSE(std::filesystem::is_symlink(linked));
  EXPECT_EQ(read_file(linked), "new");
  EXPECT_EQ(read_file(victim), "secret");
  ASSERT_EQ(::lstat(linked.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);  // the default: private
}

// Two writers of one path at once (two threads, or two processes that reuse a pid across
// hosts) each have their own temporary file: neither truncates the other's, and the last
// commit wins whole.
TEST(AtomicFile, TwoWritersOfOnePathDoNotShareATemporaryFile) {
  TestDir t;
  const std::string path = t.path() + "/ck.bin";
  AtomicFile a(path);
  AtomicFile b(path);
  a.write("first writer", 12);
  b.write("second", 6);
  a.commit();
  EXPECT_EQ(read_file(path), "first writer");
  b.commit();
  EXPECT_EQ(read_file(path), "second");
  EXPECT_TRUE(others(t.path(), "ck.bin").empty()) << others(t.path(), "ck.bin").front();
}

}  // namespace
}  // namespace tidal
