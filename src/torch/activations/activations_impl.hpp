// ActivationOffloader's state (private to its files): the records of saved tensors, the write
// queue, and the engine's process-wide state.
#pragma once

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/torch/activations.hpp"
#include "torch/device_sync.hpp"
#include "torch/timeline_glue.hpp"

namespace tidal::torch_layer {
using timeline_glue::Clock;
using timeline_glue::since;

// One storage whose bytes a saved tensor needs: shared by every saved view of that storage
// (deduplication), written once, read back once.
struct Record {
  // kQueued: on a GPU, waiting for the kernels that produce it (an event on the stream that
  // queued them) before its write is handed to the store; its memory is held as when kept.
  enum class State { kKept, kQueued, kWriting, kOffloaded, kReading, kRestored };
  State state = State::kKept;
  std::shared_ptr<c10::Event> ready;  // kQueued: complete once the bytes are final
  c10::Storage storage;               // holds the memory while kept, writing, or restored
  c10::weak_intrusive_ptr<c10::StorageImpl> identity{c10::intrusive_ptr<c10::StorageImpl>()};
  std::uint64_t nbytes = 0;
  c10::Device device{c10::kCPU};
  io::Ticket ticket;
  io::Tier* tier = nullptr;  // where its bytes went: the host pool or the SSD store
  std::uint32_t version = 0;
  std::size_t index = 0;  // position in pack order
  int users = 0;          // saved variables referring to it
  int alive = 0;          // of those, the ones autograd has not released yet
  int unpacked = 0;
  double packed_at = 0;                      // seconds from the first pack of the step
  std::shared_ptr<c10::Event> packed_event;  // on a GPU: when the device reached the pack
  std::size_t recorded = kNotRecorded;       // the timeline's handle of its transfer in flight
  static constexpr std::size_t kNotRecorded = timeline_glue::kNotRecorded;
};

struct ActivationOffloader::Impl : std::enable_shared_from_this<Impl> {
  std::shared_ptr<io::TensorStore> store;
  ActivationOptions opt;

  std::mutex mu;
  // On a GPU: hands queued writes to the store as soon as their kernels have run. Without it a
  // write would start only at the next pack (training thread), whose launches run far ahead of
  // the GPU: most writes of a forward pass would still be queued when backward begins, and
  // backward cancels those. Started with the first queued write; ~Impl stops it.
  std::thread submitter;
  std::condition_variable queued_cv;  // a write was queued, or stopping
  bool stopping = false;
  std::vector<std::shared_ptr<Record>> order;  // this step, pack order
  std::unordered_map<const c10::StorageImpl*, std::shared_ptr<Record>> by_storage;
  // Storages of parameters and other persistent tensors, with a weak reference each so that a
  // freed parameter's address cannot be mistaken for a new tensor's.
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> persistent;
  std::deque<std::shared_ptr<Record>> writing;  // write in flight
  std::atomic<bool> in_backward{false};
  bool first_pack = true;
  Clock::time_point step_start;
  double busy_at_start = 0;          // store busy seconds at begin_step
  std::uint64_t moved_at_start = 0;  // store bytes written + read at begin_step
  double bandwidth = 0;              // measured store bandwidth (bytes/s), smoothed over steps
  double forward_seconds = 0;
  // On a GPU the host queues forward far ahead of the device, so its clock says when work was
  // queued (10 ms for a forward the device ran in 80 ms, on an H200). Timed events on the
  // device's stream at each pack (the first one's is start_event) and at backward give the
  // device's times;
  // device_times_locked puts them in place of the host's before the adaptive rule reads them.
  std::shared_ptr<c10::Event> start_event;
  std::shared_ptr<c10::Event> backward_event;
  std::int64_t prefetch_cursor = -1;  // next record (downwards) to prefetch
  std::uint64_t prefetch_in_flight = 0;
  std::int64_t keep_from = -1;        // adaptive decision for this step
  std::int64_t first_cancelled = -1;  // this step: lowest index whose write was dropped unstarted
  std::uint64_t lookahead = 0;        // read-ahead bytes for this step's backward
  std::int64_t limit_from = -1;       // step-scale rule: tensors from this index on stay (-1: none)
  int slow_steps = 0;  // consecutive steps that waited over 10% of their time for reads
  std::string notice;  // said once, when offloading stopped paying
  ActivationStats stats;
  ActivationStats last;
  std::shared_ptr<plan::Timeline> timeline;  // set_timeline
  std::function<std::uint64_t()> current_bytes;
  void sample_memory() {
    if (timeline && current_bytes) timeline->memory(current_bytes());
  }

  void record_start(Record& r, plan::Channel channel, plan::TransferKind kind) {
    r.recorded = timeline_glue::transfer_start(
        timeline.get(), channel, kind, [&] { return label(r); }, r.nbytes, -1);
  }
  void record_end(Record& r, bool failed) {
    timeline_glue::transfer_end(timeline.get(), r.recorded, failed);
  }
  void record_stall(plan::StallKind kind, plan::Channel channel, const Record& r,
                    Clock::time_point t0) {
    timeline_glue::stall_since(
        timeline.get(), kind, channel, [&] { return label(r); }, t0);
  }
  static std::string label(const Record& r) { return "saved tensor " + std::to_string(r.index); }

  bool host_has_room(std::uint64_t bytes) const {
    return opt.host && opt.host->free_bytes() >= bytes;
  }
  bool on_host(const Record& r) const { return opt.host && r.tier == opt.host.get(); }
  // The timeline's channel of a transfer of `r`'s bytes.
  plan::Channel channel(const Record& r, plan::Direction d) const {
    return plan::channel_of(on_host(r) ? plan::Tier::kHost : plan::Tier::kSsd, d);
  }

  std::shared_ptr<Record> pack(const at::Tensor& t, at::Tensor* kept);
  // pack's steps: the step's first pack and a new forward pass noted; the counter of a tensor
  // that stays in memory (a parameter or a view of one, or one under min_bytes), else nullptr;
  // the record of the same bytes saved before, shared, else nullptr.
  void note_pack_locked();
  std::uint64_t* kept_counter(const at::Tensor& t);
  std::shared_ptr<Record> shared_record_locked(const at::Tensor& t);
  void poll_writes_locked(bool block);
  void submit_write_locked(Record& r);
  void submit_ready_locked(bool block);
  std::shared_ptr<c10::Event> first_queued_locked() const;
  void submit_loop();
  ~Impl();
  void finish_write_locked(Record& r);
  void prefetch_locked(std::size_t below);
  void start_read_locked(Record& r, io::Priority p);
  void note_backward();
  void begin_backward_locked();
  // unpack's steps, under the lock (released while waiting for a read).
  void reuse_live_bytes_locked(Record& r, std::unique_lock<std::mutex>& lock);
  void await_bytes_locked(Record& r, std::unique_lock<std::mutex>& lock);
  at::Tensor unpack(Record& r, const c10::TensorOptions& options, std::int64_t offset,
                    const std::vector<std::int64_t>& sizes,
                    const std::vector<std::int64_t>& strides, at::ScalarType dtype);
  void calibrate_locked();
  void device_times_locked();
  void note_cancelled_locked(const Record& r);
  void release(Record& r);
};

// The engine's process-wide state: autograd calls the engine and the hooks without a pointer of
// ours, so what they need lives in this one object (defined in autograd_engine.cpp). Safe to use
// from any thread: autograd's worker threads read it too.
struct ActivationEngineState {
  /// The offloader whose step is running, if any: read by the engine on every saved tensor.
  std::atomic<ActivationOffloader::Impl*> active{nullptr};
  /// Backward passes running in tidal's engine. A tensor saved while one runs belongs to a graph
  /// built inside backward (recomputation, double backward) and is used at once: it stays.
  std::atomic<int> backward_running{0};
  /// Keeps the active Impl alive while a hook is being created.
  std::mutex active_mu;
  std::shared_ptr<ActivationOffloader::Impl> active_owner;
  /// The engine torch had before tidal's was installed.
  torch::autograd::Engine* previous_engine = nullptr;
};
extern ActivationEngineState g_engine;

}  // namespace tidal::torch_layer
