#include "tidal/common/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include "tidal/common/error.hpp"

namespace tidal {
namespace {

std::string directory_of(const std::string& path) {
  auto dir = std::filesystem::path(path).parent_path();
  return dir.empty() ? std::string(".") : dir.string();
}

// mkostemp's random part: six letters or digits.
constexpr std::size_t kRandomChars = 6;

// The pid in a temporary file's name after `<name>.tmp.`: `<pid>.<random>`, or `<pid>` alone
// (the name before the random part); 0 when `rest` is neither.
long pid_of_temp(const std::string& rest) {
  const std::size_t dot = rest.find('.');
  const std::string digits = rest.substr(0, dot);
  if (digits.empty() || digits.size() > 10 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return 0;
  }
  if (dot != std::string::npos) {
    const std::string random = rest.substr(dot + 1);
    if (random.size() != kRandomChars) return 0;
    for (const char c : random) {
      if (std::isalnum(static_cast<unsigned char>(c)) == 0) return 0;
    }
  }
  return std::stol(digits);
}

// Removes the temporary files left by writers of this path that were killed before commit() or
// their destructor ran (SIGKILL, a crash): this user's regular files whose process no longer
// exists. A live pid's file (another writer, now) is left alone; so is one whose process we may
// not signal (EPERM: it exists), and anything that is not our own regular file (a link or a
// file another user put there). Pids are this host's: see the header.
void remove_stale_temps(const std::string& path) {
  const std::string prefix = std::filesystem::path(path).filename().string() + ".tmp.";
  const pid_t self = ::getpid();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(directory_of(path), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = pid_of_temp(name.substr(prefix.size()));
    if (pid <= 0 || pid == self) continue;
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != ::geteuid()) {
      continue;
    }
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      ::unlink(entry.path().c_str());  // a race with another cleaner is harmless
    }
  }
}

}  // namespace

AtomicFile::AtomicFile(std::string path, mode_t mode) : path_(std::move(path)), mode_(mode) {
  remove_stale_temps(path_);
  // O_EXCL under mkostemp: the name is new, so nothing planted there (a symlink to another
  // user's file) is followed or truncated, and the random part makes the name unguessable.
  std::string name =
      path_ + ".tmp." + std::to_string(::getpid()) + "." + std::string(kRandomChars, 'X');
  fd_ = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd_ < 0) {
    const int e = errno;
    TIDAL_FAIL_IO(e, "cannot create a temporary file next to '", path_,
                  "' to write it: ", std::strerror(e),
                  " (check that the directory exists and is writable)");
  }
  temp_ = std::move(name);
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : path_(std::move(other.path_)),
      temp_(std::move(other.temp_)),
      mode_(other.mode_),
      fd_(other.fd_) {
  other.fd_ = -1;
  other.temp_.clear();
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t n) {
  TIDAL_EXPECT(fd_ >= 0, "AtomicFile::write after commit() of '", path_, "'");
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int e = w < 0 ? errno : EIO;
      TIDAL_FAIL_IO(e, "writing '", path_, "' failed: ", std::strerror(e),
                    e == ENOSPC ? " (the disk is full: free space or write elsewhere)" : "",
                    "; the previous version of the file, if any, is untouched");
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void AtomicFile::commit() {
  TIDAL_EXPECT(fd_ >= 0, "AtomicFile::commit called twice for '", path_, "'");
  // On the descriptor: a chmod of the path after the rename would follow a link put there.
  if (::fchmod(fd_, mode_) != 0) {
    const int e = errno;
    TIDAL_FAIL_IO(e, "cannot set the mode of '", path_, "': ", std::strerror(e),
                  "; the previous version of the file, if any, is untouched");
  }
  if (::fsync(fd_) != 0) {
    const int e = errno;
    TIDAL_FAIL_IO(e, "flushing '", path_, "' to the disk failed: ", std::strerror(e),
                  "; the previous version of the file, if any, is untouched");
  }
  ::close(fd_);
  fd_ = -1;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    TIDAL_FAIL_IO(e, "cannot rename '", temp_, "' to '", path_, "': ", std::strerror(e));
  }
  temp_.clear();
  // The rename is durable once the directory's entry is on the disk.
  const int dir = ::open(directory_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

}  // namespace tidal
