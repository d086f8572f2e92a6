#include "tidal/torch/training_checkpoint.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <mutex>

#include "tidal/common/atomic_file.hpp"
#include "tidal/common/error.hpp"
#include "tidal/torch/session.hpp"

namespace tidal::torch_layer {

void write_checkpoint(torch::serialize::OutputArchive& archive, const std::string& path,
                      Session* session) {
  if (session != nullptr) session->make_resident();
  AtomicFile file(path);
  archive.save_to([&file](const void* data, std::size_t n) {
    file.write(data, n);
    return n;
  });
  file.commit();
}

void read_checkpoint(torch::serialize::InputArchive& archive, const std::string& path) {
  TIDAL_EXPECT_AS(InvalidArgument, std::filesystem::is_regular_file(path), "checkpoint '", path,
                  "' does not exist (resume from a directory a run wrote checkpoints to)");
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    TIDAL_FAIL_AS(
        InvalidArgument, "checkpoint '", path,
        "' cannot be read (truncated, or not a checkpoint): ", e.what_without_backtrace());
  }
}

torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace tidal::torch_layer
