// Activation offloading the SSDTrain/TBA way: autograd's saved tensors go to the SSD store
// during forward and come back, prefetched, during backward. No change to the model.
//
// It hooks every tensor autograd saves through a custom autograd Engine whose
// get_default_saved_variable_hooks() hands out tidal's hooks (installed once per process with
// torch::autograd::set_default_engine_stub, before the first backward). While no offloader is
// active the engine behaves exactly as the stock one.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tidal/io/host_pool.hpp"
#include "tidal/io/store.hpp"
#include "tidal/plan/timeline.hpp"
#include "tidal/torch/step.hpp"

namespace tidal::torch_layer {

struct ActivationOptions {
  /// Saved tensors smaller than this stay in memory (TBA skips tensors under 8 Mi elements; on
  /// CPU-sized models a smaller default keeps the benefit).
  std::uint64_t min_bytes = 1 << 20;
  /// Bytes of offloaded activations read back ahead of their use during backward, at the
  /// start. Every read-ahead costs memory, so the lookahead adapts after each step: it doubles
  /// when backward waited for reads over 1% of the step (a miss that cost less does not widen
  /// it: reading further ahead would not cure it and would hold more in memory) and shrinks by
  /// a quarter otherwise, within [min_lookahead_bytes, max_lookahead_bytes].
  std::uint64_t lookahead_bytes = 32ull << 20;
  std::uint64_t min_lookahead_bytes = 4ull << 20;
  std::uint64_t max_lookahead_bytes = 1ull << 30;
  /// Stop offloading the last tensors of forward when the measured write bandwidth cannot hide
  /// their I/O (TBA's adaptive keep), recalibrated after every step. The rule is the SSDs':
  /// a tensor host memory has room for goes there and is never kept by it.
  bool adaptive = true;
  /// The host tier (Session::host_memory; null: SSD only): saved tensors go to host memory
  /// first, at the link's speed, and to the SSD store where it is full. Shared, not copied.
  std::shared_ptr<io::HostPool> host;
};

/// Per-step counters (the step that ended last).
struct ActivationStats {
  std::uint64_t packed = 0;          ///< saved tensors seen by the pack hook
  std::uint64_t offloaded = 0;       ///< distinct storages written to the store
  std::uint64_t kept_small = 0;      ///< under min_bytes
  std::uint64_t kept_parameter = 0;  ///< leaves that require grad (weights)
  std::uint64_t kept_adaptive = 0;   ///< kept by the adaptive rule
  std::uint64_t deduplicated = 0;    ///< saved tensors that shared an already offloaded storage
  std::uint64_t forwarded = 0;       ///< unpacked from memory (write still in flight or kept)
  std::uint64_t prefetched = 0;      ///< reads started ahead of use
  std::uint64_t misses = 0;          ///< reads started only when backward needed the tensor
  std::uint64_t write_failures = 0;  ///< writes that failed: the tensor stayed in memory
  std::uint64_t store_full = 0;      ///< of write_failures: no space (store or disk full, ENOSPC)
  std::string write_error;           ///< the store's message for the last failed write, or empty
  /// Writes dropped before they started because autograd released the tensor first (its
  /// backward ran while the write waited in the queue): its memory went back at once.
  std::uint64_t cancelled_writes = 0;
  std::uint64_t bytes_written = 0;  ///< to either tier
  std::uint64_t bytes_to_host = 0;  ///< of bytes_written, to the host tier
  std::uint64_t bytes_read = 0;
  double stall_seconds = 0;           ///< time unpack waited for reads
  double forward_seconds = 0;         ///< first pack to first unpack
  std::int64_t passes = 1;            ///< forward passes that saved tensors (a GAN: several)
  std::int64_t keep_from = -1;        ///< adaptive: index of the first kept tensor, -1 none
  std::uint64_t lookahead_bytes = 0;  ///< read-ahead used in this step's backward
};

/// Offloads saved activations of the steps between begin_step() and end_step() to `store`.
/// One offloader may be active at a time per process. begin_step/end_step come from the thread
/// that runs the training step; the hooks run on that thread (forward) and on autograd's
/// threads (backward); all internal state is locked. Gradients are bit-identical to training
/// without it: a tensor whose write fails stays in memory, and a corrupt read is an error.
class ActivationOffloader final : public StepObserver {
 public:
  ActivationOffloader(std::shared_ptr<io::TensorStore> store, ActivationOptions options = {});
  ~ActivationOffloader() override;
  ActivationOffloader(const ActivationOffloader&) = delete;
  ActivationOffloader& operator=(const ActivationOffloader&) = delete;

  void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) override;
  void begin_phase(trace::Phase phase) override;
  /// Waits for the step's I/O, frees its store space, recalibrates the adaptive rule.
  void end_step(std::int64_t step) override;

  /// Convenience for loops without a StepObserver-aware trainer.
  void begin_step() { begin_step(0, {}); }
  void end_step() { end_step(0); }

  [[nodiscard]] ActivationStats last_step() const;

  /// Empty, or one sentence saying that offloading stopped paying (the adaptive rules keep
  /// every saved tensor in memory) and why.
  [[nodiscard]] std::string notice() const;

  /// Tensors that live across steps anyway (parameters, optimizer state): saved tensors that
  /// share their storage stay in memory. Needed because autograd hands leaves to the pack hook
  /// detached, so a weight cannot be told from an activation by its autograd metadata.
  void keep_storages_of(const std::vector<torch::Tensor>& tensors);
  /// Records each write and read of a saved tensor (on the SSD channels, kind "activation", or
  /// "miss" for a read backward waited for without a prefetch), the waits, and the forward and
  /// backward phases as ops, into `timeline` (null: none); with `current_bytes`, memory in use at
  /// each saved tensor and each unpack. The owner opens and closes its steps.
  void set_timeline(std::shared_ptr<plan::Timeline> timeline,
                    std::function<std::uint64_t()> current_bytes = {});

  struct Impl;  ///< opaque; shared with the hooks of saved tensors that outlive a step

 private:
  std::shared_ptr<Impl> impl_;
};

/// Installs tidal's autograd engine (idempotent, thread-safe). Called by ActivationOffloader's
/// constructor; must happen before the process's first backward to take effect.
void install_autograd_engine();

}  // namespace tidal::torch_layer
