// Tracer's state (private to the tracer's files): the iteration being recorded, the tensors it
// has seen, and the RecordFunction callbacks that feed it.
#pragma once

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <unordered_map>

#include "tidal/torch/memory.hpp"
#include "tidal/torch/tracer.hpp"

namespace tidal::torch_layer {

inline bool usable(const at::Tensor& t) { return t.defined() && t.has_storage(); }

/// A tensor in the device's memory, which the trace is about: not another device's (a CPU
/// tensor of a GPU step) and not host memory on a CPU device (HostMemoryScope).
inline bool traced(const at::Tensor& t, const c10::Device& device) {
  return usable(t) && t.device().type() == device.type() &&
         !host_tier_storage(*t.storage().unsafeGetStorageImpl());
}

inline void push_unique(std::vector<trace::TensorId>& ids, trace::TensorId id) {
  if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
}

class Tracer::Impl {
 public:
  explicit Impl(Options options);
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  void register_persistent(const torch::Tensor& tensor, const std::string& name,
                           trace::TensorClass cls);

  void start();
  void stop();
  [[nodiscard]] bool started() const { return started_; }

  void begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs);
  void begin_phase(trace::Phase phase);
  void begin_layer(std::int64_t layer);
  void end_step(std::int64_t step);
  void abort_step();

  void set_listener(OpListener* listener) { listener_ = listener; }
  void set_io_wait_clock(std::function<double()> clock) {
    std::lock_guard<std::mutex> lock(mutex_);
    options_.io_wait_seconds = std::move(clock);
  }

  void set_keep_iterations(bool keep) { keep_iterations_ = keep; }
  void set_step_end_op(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    options_.step_end_op = on;
  }

  [[nodiscard]] BoundTensors alive_tensors();

  [[nodiscard]] std::uint64_t step_peak() const;

  [[nodiscard]] const std::vector<trace::Trace>& iterations() const { return iterations_; }

  [[nodiscard]] const trace::Trace* last_iteration() const { return has_last_ ? &last_ : nullptr; }

  [[nodiscard]] ProfileResult result() const;

  struct OpContext;
  std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn);
  void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx);

 private:
  struct Persistent {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    std::string name;
    trace::TensorClass cls;
  };
  struct PerTensor {  // bookkeeping beside trace::Tensor, same index
    trace::Phase producer_phase = trace::Phase::kOther;
    bool read_in_backward = false;
    bool external = false;  // first seen as an input, origin unknown
    trace::OpIndex first_use = trace::kNoOp;
    bool carried = false;     // made by an op of the last iteration and first seen here as input
    bool reproduced = false;  // carried, and made anew by the same op (and slot) here
    c10::weak_intrusive_ptr<c10::StorageImpl> remade{c10::intrusive_ptr<c10::StorageImpl>()};
  };
  struct Carried {  // a storage an op made in the last iteration that outlived it
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    trace::OpIndex producer;
    std::int32_t slot;
  };
  struct Live {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    trace::TensorId id;
  };

  double now() const;
  trace::TensorId add_tensor(const c10::Storage& storage, const c10::Device& device,
                             std::string name, trace::TensorClass cls, bool persistent,
                             trace::OpIndex producer, std::int32_t slot);
  trace::TensorId lookup_or_add_input(const at::Tensor& t);
  void collect_frees();
  // on_op_end's stages.
  void note_nested_outputs(const at::RecordFunction& fn);
  std::uint64_t op_peak_bytes(const OpContext& ctx);
  void add_output(trace::OpIndex index, std::int32_t slot, const c10::Storage& storage,
                  const c10::Device& device);
  std::int32_t record_outputs(const at::RecordFunction& fn, trace::OpIndex index);
  std::vector<TensorRef> adopt_nested_outputs(trace::OpIndex index, std::int32_t slot);
  void append_output_refs(const at::RecordFunction& fn, std::vector<TensorRef>& refs);
  void join_carried();
  void finish_iteration();

  Options options_;
  bool started_ = false;
  OpListener* listener_ = nullptr;
  bool keep_iterations_ = true;
  std::atomic<std::uint64_t> step_peak_{0};
  [[nodiscard]] bool measuring_workspace() const;
  void fold_peak();
  std::uint64_t function_handle_ = 0;
  std::uint64_t backward_handle_ = 0;

  std::vector<Persistent> persistent_;
  std::unordered_map<const c10::StorageImpl*, std::size_t> persistent_index_;

  // State of the iteration being recorded. Guarded by mutex_.
  std::mutex mutex_;
  std::atomic<bool> recording_{false};
  std::atomic<bool> busy_{false};  // a recorded op is running
  std::atomic<std::uint64_t> busy_thread_{0};
  std::uint64_t owner_thread_ = 0;  // the thread that called start()
  std::atomic<int> phase_{static_cast<int>(trace::Phase::kOther)};
  std::atomic<std::int64_t> layer_{-1};
  trace::Trace current_;
  std::vector<PerTensor> extra_;
  std::unordered_map<const c10::StorageImpl*, trace::TensorId> ids_;
  std::vector<Live> live_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> nested_outputs_;
  std::map<std::int64_t, std::int32_t> forward_seq_layer_;  // autograd seq at op start -> layer
  std::chrono::steady_clock::time_point iteration_start_;
  double io_wait_at_start_ = 0;  // Options::io_wait_seconds at iteration_start_
  std::int32_t extern_count_ = 0;
  // Tensors crossing the iteration boundary (a gradient made in backward that a deferred
  // optimizer step reads in the next forward): what the last iteration's ops made and left
  // alive, and this iteration's tensors for them by (producer, slot).
  std::vector<Carried> carry_;
  std::unordered_map<const c10::StorageImpl*, std::size_t> carry_index_;
  std::map<std::pair<trace::OpIndex, std::int32_t>, trace::TensorId> carried_by_slot_;

  std::vector<trace::Trace> iterations_;
  trace::Trace last_;
  bool has_last_ = false;
  bool phase_told_ = false;  // begin_phase was called in this iteration
  std::vector<std::string> reference_names_;
  std::string divergence_;
};

}  // namespace tidal::torch_layer
