// Backend names, the fault-injection wrapper, and the cuFile backend for device memory.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>

#include "io/op_pool.hpp"
#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"
#include "tidal/io/backend.hpp"
#ifdef TIDAL_WITH_CUDA
#include "io/cuda/device.hpp"
#endif

namespace tidal::io {

TIDAL_ENUM_TO_STRING(BackendKind, {BackendKind::kAuto, "auto"}, {BackendKind::kIoUring, "io_uring"},
                     {BackendKind::kPosix, "posix"})

BackendKind backend_kind_from_string(const std::string& name) {
  if (name == "uring") return BackendKind::kIoUring;
  return enum_value(kNames_BackendKind, name, "I/O backend (cuFile is chosen with TIDAL_GDS=on)");
}

#ifndef TIDAL_WITH_IO_URING
std::unique_ptr<Backend> make_uring_backend(std::vector<int> /*fds*/, unsigned /*entries*/,
                                            const std::vector<std::pair<void*, std::size_t>>&) {
  TIDAL_FAIL_IO(ENOSYS,
                "this build of tidal has no io_uring backend (liburing-dev was missing at "
                "build time); use the posix backend");
}
bool uring_compiled() { return false; }
#endif

namespace {

class FaultBackend final : public Backend {
 public:
  FaultBackend(std::unique_ptr<Backend> inner, FaultPlan plan)
      : inner_(std::move(inner)), plan_(plan) {}

  [[nodiscard]] const char* name() const override { return inner_->name(); }

  void submit(IoOp* op) override {
    if ((plan_.only_writes && !op->write) || (plan_.only_reads && op->write)) {
      inner_->submit(op);
      return;
    }
    const std::uint64_t k = ++ops_;
    const bool fail =
        plan_.fail_op != 0 && (k == plan_.fail_op || (plan_.fail_every_after && k > plan_.fail_op));
    if (fail) {
      op->on_complete(op, -plan_.fail_errno);
      return;
    }
    const bool make_short = plan_.short_op != 0 && k == plan_.short_op;
    bool corrupt = false;
    if (!op->write) {
      ++reads_;
      corrupt = plan_.corrupt_read != 0 && reads_ == plan_.corrupt_read;
    }
    if (make_short || corrupt || plan_.delay_us != 0) {
      // Interpose on the completion: remember the real callback in a side record.
      auto rec = std::make_unique<Interposed>();
      rec->real_complete = op->on_complete;
      rec->real_context = op->context;
      rec->short_by = make_short ? 512 : 0;
      rec->corrupt = corrupt;
      rec->corrupt_byte = plan_.corrupt_byte;
      rec->corrupt_xor = plan_.corrupt_xor;
      rec->delay_us = plan_.delay_us;
      op->context = rec.release();
      op->on_complete = &FaultBackend::complete;
    }
    inner_->submit(op);
  }

  void flush() override { inner_->flush(); }
  [[nodiscard]] std::string broken_reason() const override { return inner_->broken_reason(); }

 private:
  struct Interposed {
    void (*real_complete)(IoOp*, long) = nullptr;
    void* real_context = nullptr;
    long short_by = 0;
    bool corrupt = false;
    std::uint64_t corrupt_byte = 0;
    unsigned char corrupt_xor = 0;
    unsigned delay_us = 0;
  };

  static void complete(IoOp* op, long result) {
    std::unique_ptr<Interposed> rec(static_cast<Interposed*>(op->context));
    if (rec->delay_us != 0) std::this_thread::sleep_for(std::chrono::microseconds(rec->delay_us));
    op->context = rec->real_context;
    op->on_complete = rec->real_complete;
    if (result > 0 && rec->short_by > 0) result = std::max(0L, result - rec->short_by);
    if (result > 0 && rec->corrupt) {
      const auto n = static_cast<std::uint64_t>(result);
      const std::uint64_t at = rec->corrupt_byte < n ? rec->corrupt_byte : n / 2;
      static_cast<unsigned char*>(op->buffer)[at] ^= rec->corrupt_xor;
    }
    op->on_complete(op, result);
  }

  std::unique_ptr<Backend> inner_;
  FaultPlan plan_;
  std::uint64_t ops_ = 0;  // submit() runs on the dispatcher thread only
  std::uint64_t reads_ = 0;
};

#ifdef TIDAL_WITH_CUDA
class CuFileBackend final : public Backend {
 public:
  CuFileBackend(const std::vector<int>& fds, int threads) {
    driver_ = detail::cuda::CuFile::instance();
    TIDAL_EXPECT(driver_ != nullptr,
                 "cuFile is not available: ", detail::cuda::CuFile::unavailable_reason());
    for (int fd : fds) {
      void* h = driver_->register_file(fd);
      if (h == nullptr) {
        for (void* done : handles_) driver_->deregister_file(done);
        TIDAL_FAIL("cuFileHandleRegister failed: ", detail::cuda::last_error(),
                   " (set TIDAL_GDS=off to use the staging path)");
      }
      handles_.push_back(h);
    }
    pool_ = std::make_unique<detail::OpPool>(threads, [this](IoOp& op) {
      void* h = handles_[static_cast<std::size_t>(op.file)];
      const auto off = static_cast<off_t>(op.offset);
      return static_cast<long>(op.write ? driver_->write(h, op.buffer, op.length, off)
                                        : driver_->read(h, op.buffer, op.length, off));
    });
  }

  ~CuFileBackend() override {
    pool_.reset();  // threads first, then the handles they use
    for (void* h : handles_) driver_->deregister_file(h);
  }

  [[nodiscard]] const char* name() const override { return "cufile"; }
  void submit(IoOp* op) override { pool_->submit(op); }

 private:
  detail::cuda::CuFile* driver_ = nullptr;
  std::vector<void*> handles_;
  std::unique_ptr<detail::OpPool> pool_;
};
#endif

}  // namespace

std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner, FaultPlan plan) {
  return std::make_unique<FaultBackend>(std::move(inner), plan);
}

std::unique_ptr<Backend> make_cufile_backend(const std::vector<int>& fds, int threads) {
#ifdef TIDAL_WITH_CUDA
  return std::make_unique<CuFileBackend>(fds, threads);
#else
  (void)fds;
  (void)threads;
  TIDAL_FAIL("this build of tidal has no CUDA support (nvcc was missing at build time)");
#endif
}

}  // namespace tidal::io
