#include "tidal/common/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
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

// Removes `<path>.tmp.<pid>` files left by writers of this path that were killed before
// commit() or their destructor ran (SIGKILL, a crash): those whose process no longer exists.
// A live pid's file (another writer, now) is left alone; so is one whose process we may not
// signal (EPERM: it exists). Pids are this host's: see the header.
void remove_stale_temps(const std::string& path) {
  const std::string prefix = std::filesystem::path(path).filename().string() + ".tmp.";
  const pid_t self = ::getpid();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(directory_of(path), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.size() > prefix.size() + 10 ||
        name.compare(0, prefix.size(), prefix) != 0) {
      continue;
    }
    const std::string digits = name.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::stol(digits);
    if (pid <= 0 || pid == self) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      ::unlink(entry.path().c_str());  // a race with another cleaner is harmless
    }
  }
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  remove_stale_temps(path_);
  temp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0) {
    const int e = errno;
    TIDAL_FAIL_IO(e, "cannot create '", temp_, "' to write '", path_, "': ", std::strerror(e),
                  " (check that the directory exists and is writable)");
  }
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : path_(std::move(other.path_)), temp_(std::move(other.temp_)), fd_(other.fd_) {
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
