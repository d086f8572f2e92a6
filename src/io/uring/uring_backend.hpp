// Internal: the io_uring backend's seams for tests. The backend reaches the kernel through two
// calls, submit and wait; tests replace them to return the errors a kernel may return (EBADF,
// EBUSY, EFAULT, ...), which no real disk produces on demand. Nothing here is public API.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "tidal/io/backend.hpp"

struct io_uring;
struct io_uring_cqe;
struct __kernel_timespec;

namespace tidal::io::detail {

/// The kernel calls of the io_uring backend, liburing's by default.
struct UringCalls {
  /// io_uring_queue_init: 0 or -errno.
  int (*queue_init)(unsigned entries, io_uring* ring, unsigned flags) = nullptr;
  /// io_uring_submit: the number of entries the kernel took, or -errno.
  int (*submit)(io_uring* ring) = nullptr;
  /// io_uring_wait_cqe_timeout (ts == nullptr: wait without a timeout): 0 or -errno.
  int (*wait)(io_uring* ring, io_uring_cqe** cqe, __kernel_timespec* ts) = nullptr;
};

/// liburing's calls (for hooks that pass some calls through).
UringCalls uring_default_calls();

/// The io_uring backend using `calls` (entries left nullptr take liburing's).
std::unique_ptr<Backend> make_uring_backend_with(
    std::vector<int> fds, unsigned entries,
    const std::vector<std::pair<void*, std::size_t>>& buffers, UringCalls calls);

/// The calls that make_uring_backend() (and so every TensorStore opened afterwards) uses.
/// Tests only: not synchronised with stores being opened on other threads. Returns the
/// previous calls.
UringCalls set_uring_calls_for_testing(UringCalls calls);

}  // namespace tidal::io::detail
