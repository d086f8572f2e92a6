// A file that appears whole or not at all: written under a temporary name next to its final
// path, flushed to the disk (fsync), renamed over the final path, and the directory flushed, so
// that a crash (kill -9, power loss) at any point leaves either the old file or the new one.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace tidal {

/// Writes `path` atomically. Usage: AtomicFile f(path); f.write(...)...; f.commit();
/// Destroying it without commit() removes the temporary file and leaves `path` as it was.
/// Move-only; not thread-safe. Errors throw tidal::IoError naming the path.
class AtomicFile {
 public:
  /// Creates `<path>.tmp.<pid>.<random>` in path's directory, 0600, with O_CREAT|O_EXCL
  /// (mkostemp): a name another user cannot guess, never a file or symlink already there, so a
  /// link planted in a shared directory is neither followed nor truncated. `mode` is what the
  /// file has once committed (set on the descriptor with fchmod before the rename, never through
  /// the path; the umask does not apply). First removes the temporary files of earlier writers
  /// of this path that were killed mid-write (SIGKILL leaves its temporary file): regular files
  /// of this user, named `<path>.tmp.<pid>.<random>` (or `<path>.tmp.<pid>`, the name before the
  /// random part), whose pid no longer exists (kill(pid, 0) fails with ESRCH); files of live
  /// processes are left alone. This assumes every writer of the directory runs on this host (a
  /// pid names a process here only): on a directory shared over the network, a file of a writer
  /// on another host whose pid is free here would be removed while it writes. Throws
  /// tidal::IoError when the directory does not exist or is not writable.
  explicit AtomicFile(std::string path, mode_t mode = 0600);
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&&) = delete;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  /// Appends n bytes (all of them: short writes are retried; ENOSPC and EIO throw).
  void write(const void* data, std::size_t n);

  /// fchmod to the constructor's mode, fsync, rename over the final path (a symlink there is
  /// replaced, not written through), fsync of the directory. After it the file is durable.
  void commit();

  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string temp_;
  mode_t mode_;
  int fd_ = -1;
};

}  // namespace tidal
