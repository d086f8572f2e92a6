// POSIX thread pool backend: the fallback that works everywhere, pread/pwrite on pool threads.
#include <unistd.h>

#include <cerrno>
#include <memory>

#include "io/op_pool.hpp"
#include "tidal/io/backend.hpp"

namespace tidal::io {
namespace {

long transfer(int fd, const IoOp& op) {
  std::uint64_t done = 0;
  auto* p = static_cast<char*>(op.buffer);
  while (done < op.length) {
    const auto off = static_cast<off_t>(op.offset + done);
    const ssize_t n = op.write ? ::pwrite(fd, p + done, op.length - done, off)
                               : ::pread(fd, p + done, op.length - done, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;  // end of file: reported as a short transfer
    done += static_cast<std::uint64_t>(n);
  }
  return static_cast<long>(done);
}

class PosixBackend final : public Backend {
 public:
  PosixBackend(std::vector<int> fds, int threads)
      : fds_(std::move(fds)), pool_(threads, [this](IoOp& op) {
          return transfer(fds_[static_cast<std::size_t>(op.file)], op);
        }) {}

  [[nodiscard]] const char* name() const override { return "posix"; }
  void submit(IoOp* op) override { pool_.submit(op); }

 private:
  std::vector<int> fds_;
  detail::OpPool pool_;  // last: its threads stop before the members they use go away
};

}  // namespace

std::unique_ptr<Backend> make_posix_backend(std::vector<int> fds, int threads) {
  return std::make_unique<PosixBackend>(std::move(fds), threads);
}

}  // namespace tidal::io
