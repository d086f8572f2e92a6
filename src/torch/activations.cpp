#include "tidal/torch/activations.hpp"

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

#include "device_sync.hpp"
#include "tidal/common/error.hpp"

namespace tidal::torch_layer {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

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
  static constexpr std::size_t kNotRecorded = static_cast<std::size_t>(-1);
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
    if (!timeline) return;
    r.recorded = timeline->transfer_start(channel, kind, "saved tensor " + std::to_string(r.index),
                                          r.nbytes, -1);
  }
  void record_end(Record& r, bool failed) {
    if (!timeline || r.recorded == Record::kNotRecorded) return;
    timeline->transfer_end(r.recorded, failed);
    r.recorded = Record::kNotRecorded;
  }
  void record_stall(plan::StallKind kind, plan::Channel channel, const Record& r,
                    Clock::time_point t0) {
    if (!timeline) return;
    const double end = timeline->now();
    timeline->stall(kind, channel, "saved tensor " + std::to_string(r.index), end - since(t0), end);
  }

  bool host_has_room(std::uint64_t bytes) const {
    return opt.host && opt.host->free_bytes() >= bytes;
  }
  bool on_host(const Record& r) const { return opt.host && r.tier == opt.host.get(); }
  // The timeline's channel of a transfer of `r`'s bytes.
  plan::Channel channel(const Record& r, plan::Direction d) const {
    return plan::channel_of(on_host(r) ? plan::Tier::kHost : plan::Tier::kSsd, d);
  }

  std::shared_ptr<Record> pack(const at::Tensor& t, at::Tensor* kept);
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
  at::Tensor unpack(Record& r, const c10::TensorOptions& options, std::int64_t offset,
                    const std::vector<std::int64_t>& sizes,
                    const std::vector<std::int64_t>& strides, at::ScalarType dtype);
  void calibrate_locked();
  void device_times_locked();
  void note_cancelled_locked(const Record& r);
  void release(Record& r);
};

namespace {

// The offloader whose step is running, if any: read by the engine on every saved tensor.
// An atomic (not thread_local) because autograd's worker threads must see it too.
std::atomic<ActivationOffloader::Impl*> g_active{nullptr};
// Backward passes running in tidal's engine. A tensor saved while one runs belongs to a graph
// built inside backward (recomputation, double backward) and is used at once: it stays.
std::atomic<int> g_backward_running{0};
std::mutex g_active_mu;  // keeps the active Impl alive while a hook is being created
std::shared_ptr<ActivationOffloader::Impl> g_active_owner;

class OffloadHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit OffloadHooks(std::shared_ptr<ActivationOffloader::Impl> impl) : impl_(std::move(impl)) {}

  void call_pack_hook(const at::Tensor& t) override {
    version_ = t._version();
    version_counter_ = t.unsafeGetTensorImpl()->version_counter();
    record_ = impl_->pack(t, &kept_);
    if (record_) {
      offset_ = t.storage_offset();
      sizes_ = t.sizes().vec();
      strides_ = t.strides().vec();
      dtype_ = t.scalar_type();
      options_ = t.options();
    }
  }

  at::Tensor call_unpack_hook() override {
    // With hooks installed autograd no longer checks saved tensors for in-place changes.
    TIDAL_EXPECT(version_counter_.current_version() == version_,
                 "one of the variables needed for gradient computation has been modified by an "
                 "inplace operation (saved at version ",
                 version_, ", now ", version_counter_.current_version(),
                 "); tidal's activation offloading keeps autograd's rule");
    if (!record_) {
      impl_->note_backward();
      return kept_;
    }
    return impl_->unpack(*record_, options_, offset_, sizes_, strides_, dtype_);
  }

  // Autograd releases a saved variable when its node has run (or its graph is dropped): where
  // no offloading would free the tensor, the record gives up its memory and its write.
  ~OffloadHooks() override {
    if (record_) impl_->release(*record_);
  }

 private:
  std::shared_ptr<ActivationOffloader::Impl> impl_;
  std::shared_ptr<Record> record_;
  at::Tensor kept_;
  c10::TensorOptions options_;  // the original device and dtype
  std::uint32_t version_ = 0;
  c10::VariableVersion version_counter_{c10::VariableVersion::DISABLED};
  std::int64_t offset_ = 0;
  std::vector<std::int64_t> sizes_;
  std::vector<std::int64_t> strides_;
  at::ScalarType dtype_ = at::kFloat;
};

// The default engine before tidal's was installed (PyTorch's own, or its Python engine).
torch::autograd::Engine* g_previous_engine = nullptr;

class TidalEngine final : public torch::autograd::Engine {
 public:
  TidalEngine() = default;
  ~TidalEngine() override {
    device_ready_queues_.clear();  // the replaced engine's: its threads are not ours to stop
    stop();
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    // Hooks of the engine tidal's replaced come first: in a Python process that is PyTorch's
    // Python engine, whose hooks are torch.autograd.graph.saved_tensors_hooks (save_on_cpu,
    // non-reentrant checkpointing), which the user set around this very code.
    if (g_previous_engine != nullptr) {
      if (auto hooks = g_previous_engine->get_default_saved_variable_hooks()) return hooks;
    }
    if (g_active.load(std::memory_order_acquire) == nullptr) return nullptr;
    if (!at::SavedTensorDefaultHooks::is_enabled()) return nullptr;
    std::shared_ptr<ActivationOffloader::Impl> impl;
    {
      std::lock_guard<std::mutex> lock(g_active_mu);
      impl = g_active_owner;
    }
    if (!impl || g_backward_running.load() > 0) return nullptr;  // saved inside backward: keep
    return std::make_unique<OffloadHooks>(std::move(impl));
  }

  // Python's anomaly mode (torch.autograd.detect_anomaly) records Python stacks through it.
  std::unique_ptr<torch::autograd::AnomalyMetadata> make_anomaly_metadata() override {
    return g_previous_engine != nullptr ? g_previous_engine->make_anomaly_metadata()
                                        : Engine::make_anomaly_metadata();
  }

  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs,
                                         bool keep_graph, bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    struct Running {
      Running() { ++g_backward_running; }
      ~Running() { --g_backward_running; }
    } running;
    share_device_threads();
    return Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }

 private:
  // PyTorch 2.x starts the autograd engine's device threads (one per GPU) once per process,
  // for whichever engine runs a backward first: an engine installed after a backward has none,
  // and its first CUDA backward fails an internal assert in Engine::ready_queue. So tidal's
  // engine works through the threads of the engine it replaced (started here if no backward
  // has run yet): their ready queues and the pool for reentrant backwards. Those threads run
  // the same Engine code; tidal's overrides act on the calling thread. (Where a torch keeps the
  // flag per engine, Engine::execute then starts this engine's own threads over these.)
  void share_device_threads() {
    std::call_once(shared_, [this] {
      if (g_previous_engine == nullptr) return;
      g_previous_engine->initialize_device_threads_pool();
      // Members of the replaced engine, reached through pointers to members formed here.
      constexpr auto queues = &TidalEngine::device_ready_queues_;
      constexpr auto pool = &TidalEngine::thread_pool_shared_;
      if (device_ready_queues_.empty()) device_ready_queues_ = g_previous_engine->*queues;
      if (!thread_pool_shared_) thread_pool_shared_ = g_previous_engine->*pool;
    });
  }

  std::once_flag shared_;
};

torch::autograd::Engine& tidal_engine() {
  static TidalEngine engine;
  return engine;
}

}  // namespace

void install_autograd_engine() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_previous_engine = &torch::autograd::Engine::get_default_engine();
    torch::autograd::set_default_engine_stub(&tidal_engine);
  });
}

std::shared_ptr<Record> ActivationOffloader::Impl::pack(const at::Tensor& t, at::Tensor* kept) {
  std::lock_guard<std::mutex> lock(mu);
  if (first_pack) {
    first_pack = false;
    step_start = Clock::now();
    // Without an op tracer, the phases are the timeline's ops (a loop that marks them itself
    // marks the same ones).
    if (timeline) timeline->op_start(-1, "forward", plan::Timeline::kNoSample);
  }
  ++stats.packed;
  sample_memory();
  if (in_backward.load() && g_backward_running.load() == 0) {
    // A forward pass after a backward in the same step (a GAN's second model, gradient
    // accumulation): its tensors are offloaded and prefetched like the first pass's.
    in_backward = false;
    prefetch_cursor = -1;
    prefetch_in_flight = 0;
    ++stats.passes;
  }
  poll_writes_locked(false);
  const auto keep = [&](std::uint64_t& counter) {
    ++counter;
    *kept = t.detach();  // never the tensor itself: that would close a cycle through grad_fn
    return std::shared_ptr<Record>();
  };
  // Weights, and the views of them that ops save (linear saves weight.t()), stay: they live
  // anyway, so writing them would free nothing. Leaves arrive detached, hence the storage map.
  if (t.is_leaf() && t.requires_grad()) return keep(stats.kept_parameter);
  if (t.is_view() && t._base().is_leaf() && t._base().requires_grad()) {
    return keep(stats.kept_parameter);  // weight.t() and other views of a leaf
  }
  if (t.has_storage()) {
    auto p = persistent.find(t.storage().unsafeGetStorageImpl());
    if (p != persistent.end() && p->second.lock().get() == p->first) {
      return keep(stats.kept_parameter);
    }
  }
  if (!t.has_storage() || t.storage().nbytes() < opt.min_bytes) return keep(stats.kept_small);

  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  auto it = by_storage.find(key);
  if (it != by_storage.end()) {
    Record& r = *it->second;
    // The same live storage at the same version holds the same bytes: share the record. (The
    // weak reference keeps the StorageImpl's address from being reused while we map it.) Not a
    // record autograd has released (alive == 0): it gave up its bytes (a cancelled write leaves
    // it kept with no storage), and sharing it would unpack an empty storage.
    if (r.alive > 0 && r.identity.lock().get() == key && r.version == t._version()) {
      ++r.users;
      ++r.alive;
      ++stats.deduplicated;
      return it->second;
    }
  }
  const std::size_t index = order.size();
  auto r = std::make_shared<Record>();
  r->nbytes = t.storage().nbytes();
  r->index = index;
  r->packed_at = since(step_start);
  // On a GPU: where the device is in the step (device_times_locked), and, for a write, when the
  // kernels that made the tensor have run (Record::ready). Null for CPU tensors.
  r->packed_event = detail::record_on_current_stream(t.device());
  if (!start_event) start_event = r->packed_event;
  if (keep_from >= 0 && static_cast<std::int64_t>(index) >= keep_from &&
      !host_has_room(r->nbytes)) {
    // Adaptive keep: needed first in backward, and their I/O to the SSDs could not be hidden
    // (host memory, when it has room, takes them at the link's speed). They stay in the pack
    // order (as kept records) so that the rule sees the whole timeline next step.
    order.push_back(r);
    return keep(stats.kept_adaptive);
  }
  r->storage = t.storage();
  r->identity = t.storage().getWeakStorageImpl();
  r->device = t.device();
  r->version = t._version();
  r->users = 1;
  r->alive = 1;
  // On a GPU the kernel that produced it may still be running: the bytes must be final before
  // the store's own streams copy them. An event on the producing stream says when; the training
  // thread goes on, and the write is handed to the store once the event has completed
  // (submit_ready_locked). CPU tensors are written at once.
  r->ready = r->packed_event;
  if (r->ready) {
    r->state = Record::State::kQueued;
    if (!submitter.joinable()) submitter = std::thread([this] { submit_loop(); });
    queued_cv.notify_one();
  } else {
    submit_write_locked(*r);
  }
  ++stats.offloaded;
  writing.push_back(r);
  by_storage[key] = r;
  order.push_back(r);
  return r;
}

void ActivationOffloader::Impl::submit_write_locked(Record& r) {
  r.ready.reset();
  try {
    // Host memory first (pinned on a GPU machine: the link's speed), the SSDs where it is short.
    r.tier = host_has_room(r.nbytes) ? static_cast<io::Tier*>(opt.host.get())
                                     : static_cast<io::Tier*>(store.get());
    r.ticket = r.tier->write(r.storage.data(), r.nbytes, io::Priority::kOffload);
    r.state = Record::State::kWriting;
    record_start(r, channel(r, plan::Direction::kWrite), plan::TransferKind::kActivation);
  } catch (const Error& e) {
    // Refused at once (a closed store, a size it cannot take): the tensor stays in memory.
    ++stats.write_failures;
    stats.write_error = e.what();
    r.state = Record::State::kKept;
  }
}

// Hands the store every queued write whose bytes are final (`block`: waits for them). Events
// of one stream complete in the order they were recorded: the first one not complete ends it.
void ActivationOffloader::Impl::submit_ready_locked(bool block) {
  for (auto& w : writing) {
    if (w->state != Record::State::kQueued) continue;
    if (block) {
      w->ready->synchronize();
    } else if (!w->ready->query()) {
      return;
    }
    submit_write_locked(*w);
  }
}

std::shared_ptr<c10::Event> ActivationOffloader::Impl::first_queued_locked() const {
  for (const auto& w : writing) {
    if (w->state == Record::State::kQueued) return w->ready;
  }
  return nullptr;
}

// The submitter thread: waits (unlocked) for the oldest queued write's event, then hands the
// store every write whose bytes are final. The event is shared, so a record cancelled meanwhile
// (backward, release) only makes the wait end early.
void ActivationOffloader::Impl::submit_loop() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    std::shared_ptr<c10::Event> ready;
    queued_cv.wait(lock, [&] { return stopping || (ready = first_queued_locked()) != nullptr; });
    if (stopping) return;
    lock.unlock();
    ready->synchronize();
    lock.lock();
    submit_ready_locked(false);
  }
}

ActivationOffloader::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  queued_cv.notify_all();
  if (submitter.joinable()) submitter.join();
}

// Retires finished writes in order: their memory goes back as soon as the bytes are safe.
void ActivationOffloader::Impl::poll_writes_locked(bool block) {
  submit_ready_locked(block);
  while (!writing.empty()) {
    Record& r = *writing.front();
    if (r.state == Record::State::kQueued) return;  // not final yet (block: submitted above)
    if (r.state == Record::State::kWriting) {
      if (!block && !r.tier->ready(r.ticket)) return;
      finish_write_locked(r);
    }
    writing.pop_front();
  }
}

void ActivationOffloader::Impl::finish_write_locked(Record& r) {
  if (r.state == Record::State::kQueued) {
    r.ready->synchronize();
    submit_write_locked(r);
  }
  try {
    r.tier->wait(r.ticket);
    record_end(r, false);
    r.state = Record::State::kOffloaded;
    stats.bytes_written += r.nbytes;
    if (on_host(r)) stats.bytes_to_host += r.nbytes;
    r.storage = c10::Storage();  // drop our reference: the memory is freed if nobody else holds it
    if (r.alive == 0) {          // released while it was being written: nobody will read it back
      r.tier->free(r.ticket);
      r.ticket = io::Ticket{};
    }
  } catch (const IoError& e) {
    // A full or failing store never changes a result: the tensor simply stays in memory.
    ++stats.write_failures;
    if (e.errnum() == ENOSPC) ++stats.store_full;
    stats.write_error = e.what();
    record_end(r, true);
    r.tier->free(r.ticket);
    r.ticket = io::Ticket{};
    r.state = Record::State::kKept;
  }
}

void ActivationOffloader::Impl::start_read_locked(Record& r, io::Priority p) {
  at::Tensor bytes;
  {
    detail::ReadAllocationScope scope(r.device);  // no queued kernel may use this memory
    bytes = at::empty({static_cast<std::int64_t>(r.nbytes)},
                      at::TensorOptions().dtype(at::kByte).device(r.device));
  }
  r.storage = bytes.storage();
  r.tier->read(r.ticket, r.storage.mutable_data(), p);
  record_start(
      r, channel(r, plan::Direction::kRead),
      p == io::Priority::kUrgent ? plan::TransferKind::kMiss : plan::TransferKind::kActivation);
  r.state = Record::State::kReading;
  stats.bytes_read += r.nbytes;
}

// Starts reads for the records that backward will need next (reverse pack order), up to the
// lookahead in bytes.
void ActivationOffloader::Impl::prefetch_locked(std::size_t below) {
  // Reads wait for the writes in flight: a read ahead of them would hold their memory longer
  // than no offloading would (the disk serves both), for a tensor that is in memory anyway.
  poll_writes_locked(false);
  if (!writing.empty()) return;
  if (prefetch_cursor < 0 || static_cast<std::size_t>(prefetch_cursor) >= below) {
    prefetch_cursor = static_cast<std::int64_t>(below) - 1;
  }
  while (prefetch_cursor >= 0 && prefetch_in_flight < lookahead) {
    auto& r = order[static_cast<std::size_t>(prefetch_cursor)];
    --prefetch_cursor;
    if (!r || r->state != Record::State::kOffloaded || r->alive == 0) continue;
    if (!r->identity.expired()) continue;  // still in memory elsewhere: unpack forwards it
    start_read_locked(*r, io::Priority::kPrefetch);
    prefetch_in_flight += r->nbytes;
    ++stats.prefetched;
  }
}

// Backward has begun: remember how long forward took and start reading back the last tensors.
// Writes still waiting in the store's queue are of the tensors forward saved last, which
// backward needs first: they are dropped (the tensors stay in memory, as without offloading),
// and the ones already running go ahead of every read, so that their memory comes back.
void ActivationOffloader::Impl::begin_backward_locked() {
  if (in_backward.exchange(true)) return;
  if (timeline) timeline->op_start(-1, "backward", plan::Timeline::kNoSample);
  forward_seconds = since(step_start);
  if (start_event) {
    backward_event = detail::record_on_current_stream(start_event->device());
  }
  for (auto& w : writing) {
    if (w->state == Record::State::kQueued) {  // never handed to the store: nothing to cancel
      w->ready.reset();
      w->state = Record::State::kKept;
      note_cancelled_locked(*w);
      continue;
    }
    if (w->state != Record::State::kWriting) continue;
    if (w->tier->cancel_write(w->ticket)) {
      record_end(*w, false);
      w->ticket = io::Ticket{};
      w->state = Record::State::kKept;
      note_cancelled_locked(*w);
    } else {
      w->tier->prioritize(w->ticket, io::Priority::kUrgent);
    }
  }
  prefetch_locked(order.size());
}

void ActivationOffloader::Impl::note_backward() {
  if (in_backward.load()) return;
  std::lock_guard<std::mutex> lock(mu);
  begin_backward_locked();
}

at::Tensor ActivationOffloader::Impl::unpack(Record& r, const c10::TensorOptions& options,
                                             std::int64_t offset,
                                             const std::vector<std::int64_t>& sizes,
                                             const std::vector<std::int64_t>& strides,
                                             at::ScalarType dtype) {
  std::unique_lock<std::mutex> lock(mu);
  begin_backward_locked();
  sample_memory();
  poll_writes_locked(false);
  if (r.state == Record::State::kRestored && !r.storage) {
    // Unpacked more often than it was saved (retain_graph): read it again.
    TIDAL_EXPECT(r.ticket.valid(),
                 "a saved activation was unpacked after its step ended; call "
                 "backward before end_step()");
    r.state = Record::State::kOffloaded;
  }
  if (r.state == Record::State::kOffloaded || r.state == Record::State::kReading) {
    // Someone else (the caller's variables, another graph) kept the storage alive: its bytes
    // are still in memory, unchanged (the version check above), so no read and no second copy.
    if (auto live = r.identity.lock()) {
      if (r.state == Record::State::kReading) {
        const io::Ticket t = r.ticket;
        lock.unlock();
        bool failed = false;
        try {
          r.tier->wait(t);
        } catch (const IoError&) {
          failed = true;
        }
        lock.lock();
        record_end(r, failed);
        prefetch_in_flight -= std::min(prefetch_in_flight, r.nbytes);
      }
      r.storage = c10::Storage(std::move(live));
      r.state = Record::State::kRestored;
      ++stats.forwarded;
    }
  }
  // end_step freed the step's bytes on the SSD: a graph kept past it cannot be run backward.
  TIDAL_EXPECT(r.state != Record::State::kOffloaded || r.ticket.valid(),
               "backward used a saved activation after its step ended (end_step, or the end of "
               "the offload_activations context, gave its bytes on the SSD back): call backward "
               "inside the step that ran the forward");
  switch (r.state) {
    case Record::State::kKept:
    case Record::State::kQueued:
    case Record::State::kWriting:
    case Record::State::kRestored:
      if (r.state != Record::State::kRestored) ++stats.forwarded;
      break;
    case Record::State::kOffloaded:
      ++stats.misses;
      start_read_locked(r, io::Priority::kUrgent);
      [[fallthrough]];
    case Record::State::kReading: {
      r.tier->prioritize(r.ticket, io::Priority::kUrgent);
      const io::Ticket t = r.ticket;
      const auto t0 = Clock::now();
      lock.unlock();
      try {
        r.tier->wait(t);  // a failed or corrupt read throws: never a wrong gradient
      } catch (const Error&) {
        lock.lock();
        record_end(r, true);
        throw;
      }
      lock.lock();
      stats.stall_seconds += since(t0);
      record_stall(plan::StallKind::kRead, plan::Channel::kSsdRead, r, t0);
      record_end(r, false);
      if (r.state == Record::State::kReading) {
        r.state = Record::State::kRestored;
        prefetch_in_flight -= std::min(prefetch_in_flight, r.nbytes);
      }
      break;
    }
  }
  TIDAL_EXPECT(r.storage, "a saved activation lost its bytes before backward used it (record ",
               r.index, " of this step); this is a tidal bug, please report it");
  // Taken before prefetch_locked: it retires finished writes, and when this record's own write
  // (still running: the tensor was forwarded from memory) finishes there, the record drops its
  // storage. Read after that, it was empty: PyTorch's "storage INTERNAL ASSERT" under load.
  c10::Storage storage = r.storage;
  detail::record_use_on_current_stream(storage.data_ptr(), r.device);
  prefetch_locked(r.index);
  if (++r.unpacked >= r.users && r.state == Record::State::kRestored) {
    r.storage = c10::Storage();  // autograd now holds what it needs
  }
  lock.unlock();
  return at::empty({0}, options.dtype(dtype)).set_(storage, offset, sizes, strides);
}

// TBA's adaptive rule on this step's timeline: walking saved tensors in pack order, the first n
// with (bytes before n + 2 x bytes of n) / (3 x forward time - 2 x time before n) > write
// bandwidth, and everything after it, stay in memory next step (backward ~ 2x forward).
// A second witness needs no bandwidth: a write dropped unstarted because backward released its
// tensor first did not hide behind forward, so that tensor and every later one stay in memory
// next step too. That one never keeps the first tensor, so that a write is always going and
// the bandwidth keeps being measured (on a loaded machine the store's thread may not start a
// single write in a short forward, and the rule would otherwise have nothing to go on).
void ActivationOffloader::Impl::calibrate_locked() {
  const io::StoreStats st = store->stats();
  const double busy = st.busy_seconds - busy_at_start;
  const auto moved = static_cast<double>(st.bytes_written + st.bytes_read - moved_at_start);
  // Only a step that kept the store busy says something about its bandwidth.
  if (busy > 1e-3 && moved > 0) {
    const double measured = moved / busy;
    bandwidth = bandwidth > 0 ? 0.5 * bandwidth + 0.5 * measured : measured;
  }
  if (!opt.adaptive) return;
  if (bandwidth > 0 && forward_seconds > 0) {  // otherwise the last decision stands
    keep_from = -1;
    double before = 0;
    for (std::size_t i = 0; i < order.size(); ++i) {
      if (!order[i] || on_host(*order[i])) continue;  // the rule is the SSDs': the host is fast
      const double bytes = static_cast<double>(order[i]->nbytes);
      const double window = 3 * forward_seconds - 2 * order[i]->packed_at;
      if (window <= 0 || (before + 2 * bytes) / window > bandwidth) {
        keep_from = static_cast<std::int64_t>(i);
        break;
      }
      before += bytes;
    }
  }
  if (first_cancelled >= 0) {
    const std::int64_t from = std::max<std::int64_t>(1, first_cancelled);
    if (keep_from < 0 || from < keep_from) keep_from = from;
  }
}

// On a GPU: forward's time and each pack's, from the device's events (see start_event). Waits
// for the device to reach backward's start, which the end of a step has queued long before. A
// pack on another stream, not yet reached, keeps its host time; so does everything when the
// events cannot be timed.
void ActivationOffloader::Impl::device_times_locked() {
  if (!start_event || !backward_event) return;
  try {
    backward_event->synchronize();
    forward_seconds = start_event->elapsedTime(*backward_event) / 1e3;
    for (auto& r : order) {
      if (!r || !r->packed_event || !r->packed_event->query()) continue;
      r->packed_at = start_event->elapsedTime(*r->packed_event) / 1e3;
    }
  } catch (const c10::Error&) {
    // Host times stand.
  }
  for (auto& r : order) {
    if (r) r->packed_event.reset();
  }
}

void ActivationOffloader::Impl::note_cancelled_locked(const Record& r) {
  ++stats.cancelled_writes;
  const auto i = static_cast<std::int64_t>(r.index);
  if (first_cancelled < 0 || i < first_cancelled) first_cancelled = i;
}

// The last saved variable of `r` is gone: a write not yet started is dropped (its memory goes
// back now, as it would without offloading), and bytes in the store are freed.
void ActivationOffloader::Impl::release(Record& r) {
  std::lock_guard<std::mutex> lock(mu);
  if (--r.alive > 0) return;
  switch (r.state) {
    case Record::State::kQueued:  // never handed to the store: its memory goes back now
      r.ready.reset();
      r.state = Record::State::kKept;
      r.storage = c10::Storage();
      note_cancelled_locked(r);
      return;
    case Record::State::kWriting:
      if (r.tier->cancel_write(r.ticket)) {
        record_end(r, false);
        r.ticket = io::Ticket{};
        r.state = Record::State::kKept;
        r.storage = c10::Storage();
        note_cancelled_locked(r);
        return;
      }
      {
        // Part of it runs. Without offloading the memory would go back now, so wait for the
        // write (ahead of every read) rather than hold it longer: a stall, never a higher peak.
        r.tier->prioritize(r.ticket, io::Priority::kUrgent);
        const auto t0 = Clock::now();
        finish_write_locked(r);  // frees the ticket (alive == 0), or keeps the bytes on failure
        stats.stall_seconds += since(t0);
        record_stall(plan::StallKind::kBudget, channel(r, plan::Direction::kWrite), r, t0);
        r.storage = c10::Storage();
      }
      return;
    case Record::State::kOffloaded:
      if (r.ticket.valid()) r.tier->free(r.ticket);
      r.ticket = io::Ticket{};
      return;
    case Record::State::kReading:
      return;  // the read fills r.storage: end_step lets it go
    case Record::State::kKept:
    case Record::State::kRestored:
      r.storage = c10::Storage();
      return;
  }
}

ActivationOffloader::ActivationOffloader(std::shared_ptr<io::TensorStore> store,
                                         ActivationOptions options)
    : impl_(std::make_shared<Impl>()) {
  TIDAL_EXPECT(store != nullptr, "ActivationOffloader needs a TensorStore");
  impl_->store = std::move(store);
  impl_->opt = options;
  install_autograd_engine();
}

ActivationOffloader::~ActivationOffloader() {
  if (g_active.load() == impl_.get()) end_step(0);
}

void ActivationOffloader::begin_step(std::int64_t /*step*/,
                                     const std::vector<torch::Tensor>& /*inputs*/) {
  {
    std::lock_guard<std::mutex> lock(g_active_mu);
    TIDAL_EXPECT(g_active_owner == nullptr || g_active_owner == impl_,
                 "another ActivationOffloader is active; end its step first");
    g_active_owner = impl_;
    g_active.store(impl_.get(), std::memory_order_release);
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats = ActivationStats{};
  impl_->stats.keep_from = impl_->keep_from;
  if (impl_->lookahead == 0) impl_->lookahead = impl_->opt.lookahead_bytes;
  impl_->stats.lookahead_bytes = impl_->lookahead;
  impl_->first_pack = true;
  impl_->step_start = Clock::now();
  impl_->in_backward = false;
  impl_->prefetch_cursor = -1;
  impl_->prefetch_in_flight = 0;
  impl_->forward_seconds = 0;
  impl_->start_event.reset();
  impl_->backward_event.reset();
  impl_->first_cancelled = -1;
  const io::StoreStats st = impl_->store->stats();
  impl_->busy_at_start = st.busy_seconds;
  impl_->moved_at_start = st.bytes_written + st.bytes_read;
}

void ActivationOffloader::begin_phase(trace::Phase phase) {
  if (phase == trace::Phase::kBackward) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->begin_backward_locked();
  }
}

void ActivationOffloader::end_step(std::int64_t /*step*/) {
  {
    std::lock_guard<std::mutex> lock(g_active_mu);
    if (g_active_owner == impl_) {
      g_active.store(nullptr, std::memory_order_release);
      g_active_owner.reset();
    }
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.poll_writes_locked(true);
  // Records of this step may still be referenced by a graph the caller kept; their tickets are
  // freed here, and such a graph's offloaded tensors can no longer be unpacked.
  for (auto& r : m.order) {
    if (!r || !r->ticket.valid()) continue;
    if (r->state == Record::State::kReading) {
      bool failed = false;
      try {
        r->tier->wait(r->ticket);
      } catch (const IoError&) {
        failed = true;
      }
      m.record_end(*r, failed);
    }
    r->tier->free(r->ticket);
    r->ticket = io::Ticket{};
  }
  m.device_times_locked();
  m.stats.forward_seconds = m.forward_seconds;
  m.calibrate_locked();
  // Read-ahead: as little as keeps backward from waiting.
  const double step_seconds = since(m.step_start);
  // At step scale: when reads still stall the step after the read-ahead had three steps to
  // adapt, offload half as many tensors (the first ones of forward, which backward needs last,
  // keep going). When none is left, say so once: offloading does not pay here.
  m.slow_steps = m.stats.stall_seconds > 0.1 * step_seconds ? m.slow_steps + 1 : 0;
  if (m.slow_steps >= 3 && m.opt.adaptive) {
    const std::int64_t n =
        m.limit_from >= 0 ? m.limit_from : static_cast<std::int64_t>(m.order.size());
    m.limit_from = n / 2;
    m.slow_steps = 0;
  }
  if (m.limit_from >= 0 && (m.keep_from < 0 || m.limit_from < m.keep_from)) {
    m.keep_from = m.limit_from;
  }
  if (m.opt.adaptive && m.keep_from == 0 && m.notice.empty() && !m.order.empty()) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "activation offloading does not pay here: the store (%.2f GB/s measured) "
                  "cannot hide this step's writes behind a %.1f ms forward pass, or reads kept "
                  "stalling backward; saved tensors stay in memory",
                  m.bandwidth / 1e9, 1e3 * m.forward_seconds);
    m.notice = line;
  }
  // Only a wait that cost time widens it: a miss of a few milliseconds each step (the first
  // record backward needs, written just before it) is not cured by reading further ahead, and
  // doubling the read-ahead for it every step would hold ever more of the step in memory.
  const bool waited = m.stats.stall_seconds > 0.01 * step_seconds;
  const double next = static_cast<double>(m.lookahead) * (waited ? 2.0 : 0.75);
  m.lookahead = std::clamp<std::uint64_t>(static_cast<std::uint64_t>(next),
                                          m.opt.min_lookahead_bytes, m.opt.max_lookahead_bytes);
  m.last = m.stats;
  m.order.clear();
  m.by_storage.clear();
  m.writing.clear();
}

void ActivationOffloader::keep_storages_of(const std::vector<torch::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& t : tensors) {
    if (t.defined() && t.has_storage()) {
      impl_->persistent.emplace(t.storage().unsafeGetStorageImpl(),
                                t.storage().getWeakStorageImpl());
    }
  }
}

void ActivationOffloader::set_timeline(std::shared_ptr<plan::Timeline> timeline,
                                       std::function<std::uint64_t()> current_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->timeline = std::move(timeline);
  impl_->current_bytes = std::move(current_bytes);
}

std::string ActivationOffloader::notice() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->notice;
}

ActivationStats ActivationOffloader::last_step() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last;
}

}  // namespace tidal::torch_layer
