#include "tidal/torch/executor.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "device_sync.hpp"
#include "ivalue_tensors.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/torch/memory.hpp"

namespace tidal::torch_layer {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr c10::DispatchKey kGuardKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// Ops that only look at metadata or make views: their inputs need no bytes in memory.
bool reads_no_data(std::string_view name) {
  static const std::unordered_set<std::string_view> kViews = {
      "aten::view",           "aten::t",          "aten::transpose", "aten::permute",
      "aten::expand",         "aten::as_strided", "aten::detach",    "aten::alias",
      "aten::unsqueeze",      "aten::squeeze",    "aten::select",    "aten::slice",
      "aten::_reshape_alias", "aten::split",      "aten::chunk",     "aten::narrow",
      "aten::size",           "aten::stride",     "aten::numel",     "aten::dim",
      "aten::is_same_size",   "aten::unbind",     "aten::set_"};
  if (name.size() >= 5 && name.substr(name.size() - 5) == "_like") return true;
  return kViews.count(name) != 0;
}

using detail::for_each_tensor;

std::atomic<PlanExecutor*> g_executor{nullptr};
// Storages not plainly resident (being written, offloaded, being read), over all executors: the
// guard's fast path is one load.
std::atomic<int> g_unsettled{0};
// While an executor may be asked to reclaim memory (the strict meter) or runs without a plan,
// the guard records the storages of every op running now, at any depth and on any thread:
// those are never written out from under it.
std::atomic<bool> g_track_inputs{false};
// The wall as a GPU raises it (PlanExecutor::retry_out_of_memory): an op refused memory is run
// again after the executor has written tensors out. Ops retried, over the process.
std::atomic<bool> g_retry_oom{false};
constexpr const char* kNothingLeftToMove =
    "every tensor left in memory is read by the running op, held, or under min_bytes";
std::atomic<std::uint64_t> g_oom_retries{0};
constexpr int kMaxOomRetries = 16;
// While the executor has no plan: the guard also notes what each op reads and makes (LRU order).
std::atomic<bool> g_note_lru{false};
std::mutex g_in_use_mu;
std::unordered_map<const c10::StorageImpl*, int> g_in_use;

bool in_use_now(const c10::StorageImpl* p) {
  std::lock_guard<std::mutex> lock(g_in_use_mu);
  return g_in_use.count(p) != 0;
}

// Marks an op's storages in use for the life of the object.
class InUse {
 public:
  explicit InUse(c10::ArrayRef<c10::StorageImpl*> storages) : storages_(storages) {
    if (storages_.empty()) return;
    std::lock_guard<std::mutex> lock(g_in_use_mu);
    for (auto* s : storages_) ++g_in_use[s];
  }
  ~InUse() {
    if (storages_.empty()) return;
    std::lock_guard<std::mutex> lock(g_in_use_mu);
    for (auto* s : storages_) {
      auto it = g_in_use.find(s);
      if (it != g_in_use.end() && --it->second <= 0) g_in_use.erase(it);
    }
  }
  InUse(const InUse&) = delete;
  InUse& operator=(const InUse&) = delete;

 private:
  c10::ArrayRef<c10::StorageImpl*> storages_;
};

// Runs `op` (its inputs made resident first) with the wall of set_device_memory_wall: an
// allocation past it throws c10::OutOfMemoryError, as the GPU's caching allocator does. Then the
// executor writes out tensors the op does not read and the op runs again from its arguments,
// kept here. The guard runs at every depth, so the op caught is the innermost that allocates:
// an allocating op (at::empty) or a kernel that makes its outputs before it writes anything.
// Each further try frees twice as much (a fragmented cache needs more than the request).
void run_making_room(const c10::OperatorHandle& op, c10::DispatchKeySet below,
                     torch::jit::Stack* stack, PlanExecutor& ex,
                     c10::ArrayRef<c10::StorageImpl*> resident) {
  const std::size_t n = op.schema().arguments().size();
  const std::size_t base = stack->size() - n;
  const std::vector<c10::IValue> args(stack->begin() + static_cast<std::ptrdiff_t>(base),
                                      stack->end());
  for (int attempt = 0;; ++attempt) {
    try {
      if (!resident.empty()) ex.ensure_resident(resident);
      op.redispatchBoxed(below, stack);
      return;
    } catch (const c10::OutOfMemoryError& e) {
      const std::uint64_t refused = take_last_refused_bytes();
      const std::uint64_t freed =
          attempt < kMaxOomRetries ? ex.make_room_after_refusal(refused, attempt) : 0;
      if (freed == 0) {
        // An inner op's refusal already says why: the op that called it adds nothing.
        if (std::string(e.what_without_backtrace()).find(" (tidal: ") != std::string::npos) throw;
        // What the op itself holds and asks for, against the wall: the least budget it needs.
        std::uint64_t own = 0;
        for (const c10::StorageImpl* st : resident) own += st->nbytes();
        const std::string sizes =
            "the op needs its inputs' " + format_bytes(static_cast<double>(own)) +
            (refused > 0 ? " and asked for " + format_bytes(static_cast<double>(refused)) + " more"
                         : std::string(" and more, of a size not known")) +
            ", with " + format_bytes(static_cast<double>(ex.memory_in_use())) +
            " in use under a budget of " + format_bytes(static_cast<double>(ex.budget())) +
            "; give a budget above what one op needs at once (a smaller batch or sequence "
            "lowers it)";
        C10_THROW_ERROR(OutOfMemoryError,
                        std::string(e.what_without_backtrace()) + " (tidal: " + op.schema().name() +
                            " was refused memory under the wall and nothing more could be "
                            "written out after " +
                            std::to_string(attempt) + " tries: " + ex.last_reclaim_shortfall() +
                            "; " + sizes + ")");
      }
      g_oom_retries.fetch_add(1, std::memory_order_relaxed);
      stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
      stack->insert(stack->end(), args.begin(), args.end());
    }
  }
}

// The residency guard (see executor.hpp): runs before every op of a guarded thread, at any
// depth, and may throw, which a RecordFunction callback may not.
void residency_guard(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  const bool track = g_track_inputs.load(std::memory_order_acquire);
  c10::SmallVector<c10::StorageImpl*, 8> storages;
  PlanExecutor* ex = nullptr;
  bool reads = false;
  if (track || g_unsettled.load(std::memory_order_acquire) > 0) {
    ex = g_executor.load(std::memory_order_acquire);
    const auto& schema = op.schema();
    reads = !reads_no_data(schema.name());
    if (ex != nullptr && (track || reads)) {
      for (const auto& v : torch::jit::last(*stack, schema.arguments().size())) {
        for_each_tensor(v, [&](const at::Tensor& t) {
          if (t.defined() && t.has_storage())
            storages.push_back(t.storage().unsafeGetStorageImpl());
        });
      }
    }
  }
  // Not written out while the op runs, nor while its inputs are read back below (a read takes
  // memory, and the reclaimer must not make it by writing out an input read a moment before);
  // a view's source included: the view shares its bytes.
  const InUse in_use(track ? c10::ArrayRef<c10::StorageImpl*>(storages)
                           : c10::ArrayRef<c10::StorageImpl*>());
  const bool note = track && g_note_lru.load(std::memory_order_acquire);
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kGuardKey);
  if (ex != nullptr && track && g_retry_oom.load(std::memory_order_acquire)) {
    if (note && !storages.empty()) ex->note_inputs(storages);
    run_making_room(
        op, below, stack, *ex,
        reads ? c10::ArrayRef<c10::StorageImpl*>(storages) : c10::ArrayRef<c10::StorageImpl*>());
  } else {
    if (!storages.empty()) {
      if (note) ex->note_inputs(storages);
      if (reads) ex->ensure_resident(storages);
    }
    op.redispatchBoxed(below, stack);
  }
  if (note) {
    // What the op made may be written out too (a gradient no op has read yet, say).
    c10::SmallVector<c10::StorageImpl*, 4> made;
    for (const auto& v : torch::jit::last(*stack, op.schema().returns().size())) {
      for_each_tensor(v, [&](const at::Tensor& t) {
        if (t.defined() && t.has_storage()) made.push_back(t.storage().unsafeGetStorageImpl());
      });
    }
    if (!made.empty()) ex->note_inputs(made);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&residency_guard>());
}

void set_residency_guard(bool on) { c10::impl::tls_set_dispatch_key_included(kGuardKey, on); }

struct PlanExecutor::Impl {
  enum class State { kResident, kWriting, kOffloaded, kReading };
  std::string shortfall;  // why the last reclaim freed less than asked, or empty
  struct Slot {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
    State state = State::kResident;
    io::Ticket ticket;
    io::Tier* tier = nullptr;  // where its bytes are: the SSD store or the host pool
    std::uint64_t nbytes = 0;
    c10::Device device{c10::kCPU};
    c10::DataPtr incoming;     // memory a read is filling
    bool cancel = false;       // touched (or prefetched) while its write was in flight: keep it
    std::int64_t due = 0;      // a write: the op it must be done before, counted over all steps
    std::exception_ptr error;  // a read that failed; thrown to the next op that needs it
    std::int32_t tensor = -1;  // its id in the trace, when known (for the timeline)
    std::size_t recorded = kNotRecorded;  // the timeline's handle of its transfer in flight
    // A stage in flight: the host pool's ticket the store is reading the tensor into (the slot
    // stays offloaded on the store until it lands; plan::ActionKind::kStage).
    io::Ticket staged;
  };
  static constexpr std::size_t kNotRecorded = static_cast<std::size_t>(-1);
  // One step shape: the ops of a profiled step and its plan's schedule (the one the simulator
  // replays): migrations by issuing op, memory each op allocates, uses of each tensor.
  struct Shape {
    std::vector<std::string> op_names;
    std::vector<std::string> tensor_names;  // by id: the timeline's labels
    plan::Schedule sched;
  };
  // A prefetch held back by the budget, issued when memory allows or when an op needs it.
  struct HeldPrefetch {
    std::int64_t due;  // counted over all steps, as Slot::due
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  std::vector<HeldPrefetch> held;  // sorted by due: the most urgent first
  // Ops of the steps before this one: Migration::due is counted from its step's start, and a
  // write issued at one step's end is due in the next.
  std::int64_t step_base = 0;

  std::shared_ptr<io::TensorStore> store;
  ExecutorOptions opt;

  bool on_host(const Slot& s) const { return opt.host && s.tier == opt.host.get(); }
  std::vector<Shape> shapes;
  int current = 0;                        // shape of the step running
  int last_completed = 0;                 // shape the last step ended with
  std::size_t ops_run = 0;                // ops of this step so far
  std::vector<plan::Migration> deferred;  // migrations issued by the step-end op: next step
  std::int64_t deferred_base = 0;         // step_base of the step that issued them
  std::recursive_mutex mu;  // recursive: restore paths call make_resident under the lock
  std::unordered_map<c10::StorageImpl*, Slot> slots;
  std::unordered_map<const c10::StorageImpl*, int> holds;  // hold() counts
  bool is_held(const c10::StorageImpl* p) const { return holds.count(p) != 0; }
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> bound;  // by tensor id
  ExecutorStats stats;
  ExecutorStats last;
  bool diverged = false;
  std::thread::id guard_thread;
  // The inputs of the op running now (before_op to after_op): never reclaimed from under it.
  std::vector<const c10::StorageImpl*> running_inputs;
  // Without a plan (before the first one): storages ops have read, with when they were last
  // read (a count of notes), for writing out the least recently used first.
  struct Seen {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
    std::uint64_t last = 0;
  };
  std::unordered_map<const c10::StorageImpl*, Seen> seen;
  std::uint64_t notes = 0;
  double waited_before = 0;  // I/O waits of the steps before this one (stall + write stall)
  // Of all the waits, those of reclaims on threads other than the loop's (a logging thread's
  // allocation under the strict meter): they are no time the loop's ops waited.
  double waited_elsewhere = 0;
  double waits() const { return waited_before + stats.stall_seconds + stats.write_stall_seconds; }
  bool planless() const { return shapes.empty(); }

  // Any plan for this trace runs (a wrong one costs time, never correctness): compiled leniently.
  static Shape make_shape(const trace::Trace& trace, const plan::Plan& plan) {
    Shape s;
    s.sched = plan::compile_schedule(trace, &plan, /*strict=*/false);
    s.op_names = trace::op_names(trace);
    s.tensor_names.reserve(trace.tensors.size());
    for (const auto& t : trace.tensors) s.tensor_names.push_back(t.name);
    return s;
  }
  const Shape& shape() const { return shapes[static_cast<std::size_t>(current)]; }

  // ---- the timeline (ExecutorOptions::timeline), when one is set ----
  plan::Timeline* tl() const { return opt.timeline.get(); }
  // A tensor's label: its trace name where the slot knows its id, else its size.
  std::string label(const Slot& s) const {
    if (s.tensor >= 0 && !shapes.empty()) {
      const auto& names = shape().tensor_names;
      if (static_cast<std::size_t>(s.tensor) < names.size()) {
        return names[static_cast<std::size_t>(s.tensor)];
      }
    }
    return ::tidal::detail::concat("storage of ", format_bytes(static_cast<double>(s.nbytes)));
  }
  // The trace id bound to `p` now, or -1 (a scan: only with a timeline).
  std::int32_t id_of(const c10::StorageImpl* p) const {
    for (std::size_t id = 0; id < bound.size(); ++id) {
      if (bound[id].lock().get() == p) return static_cast<std::int32_t>(id);
    }
    return -1;
  }
  void record_start(Slot& s, plan::Direction dir, plan::TransferKind kind, std::int64_t due) {
    if (tl() == nullptr) return;
    const plan::Tier tier = on_host(s) ? plan::Tier::kHost : plan::Tier::kSsd;
    const bool this_step = due >= step_base;
    s.recorded = tl()->transfer_start(plan::channel_of(tier, dir), kind, label(s), s.nbytes,
                                      this_step ? due - step_base : -1);
  }
  void record_end(Slot& s, bool failed) {
    if (tl() == nullptr || s.recorded == kNotRecorded) return;
    tl()->transfer_end(s.recorded, failed);
    s.recorded = kNotRecorded;
  }
  void record_stall(plan::StallKind kind, plan::Channel channel, std::string tensor,
                    Clock::time_point t0) {
    if (tl() == nullptr) return;
    const double end = tl()->now();
    tl()->stall(kind, channel, std::move(tensor), end - since(t0), end);
  }

  // Where tensor `id` of the current shape is now (for ExecutorOptions::on_op_start).
  plan::Residency residency_of(std::size_t id) const {
    if (id >= bound.size()) return plan::Residency::kAbsent;
    auto live = bound[id].lock();
    if (!live) return plan::Residency::kAbsent;
    auto it = slots.find(live.get());
    if (it == slots.end()) return plan::Residency::kResident;
    switch (it->second.state) {
      case State::kResident:
        return plan::Residency::kResident;
      case State::kWriting:
        return it->second.cancel ? plan::Residency::kResident : plan::Residency::kLeaving;
      case State::kReading:
        return plan::Residency::kArriving;
      case State::kOffloaded:
        for (const auto& h : held) {
          if (h.storage.lock().get() == live.get()) return plan::Residency::kArriving;
        }
        return plan::Residency::kAway;
    }
    return plan::Residency::kResident;
  }

  void grow_bound(std::size_t n) {
    if (bound.size() < n) {
      bound.resize(
          n, c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>()));
    }
  }

  // True when shapes a and b run the same first n ops.
  static bool same_start(const Shape& a, const Shape& b, std::size_t n) {
    return a.op_names.size() >= n && b.op_names.size() >= n &&
           std::equal(a.op_names.begin(), a.op_names.begin() + static_cast<std::ptrdiff_t>(n),
                      b.op_names.begin());
  }

  // Op `index` named `name` is next: follow it in the current shape, or move to another known
  // shape with the same ops so far, or go on-demand for the rest of the step. Until the step
  // diverges, the ops it ran are the current shape's first ones: no copy of their names is kept.
  void advance(trace::OpIndex index, const std::string& name) {
    ++ops_run;
    if (diverged) return;
    const auto k = static_cast<std::size_t>(index);
    const Shape& cur = shapes[static_cast<std::size_t>(current)];
    if (index >= 0 && k < cur.op_names.size() && cur.op_names[k] == name) return;
    for (std::size_t j = 0; j < shapes.size() && index >= 0; ++j) {
      const Shape& s = shapes[j];
      if (static_cast<int>(j) != current && k < s.op_names.size() && s.op_names[k] == name &&
          same_start(s, cur, k)) {
        current = static_cast<int>(j);
        ++stats.shape_switches;
        grow_bound(static_cast<std::size_t>(s.sched.num_tensors));
        return;
      }
    }
    diverge(::tidal::detail::concat(
        "op ", index, " is ", name, " but the profile has ",
        index >= 0 && k < cur.op_names.size() ? cur.op_names[k] : std::string("no such op")));
  }

  // The step left every known shape: on demand from here, saying where and how.
  void diverge(std::string why) {
    diverged = true;
    stats.diverged = true;
    stats.divergence = std::move(why);
  }

  void bind(const std::vector<TensorRef>& refs) {
    for (const auto& r : refs) {
      if (r.id < 0 || static_cast<std::size_t>(r.id) >= bound.size() || r.storage == nullptr) {
        continue;
      }
      bound[static_cast<std::size_t>(r.id)] = c10::weak_intrusive_ptr<c10::StorageImpl>(
          c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(r.storage));
    }
  }

  void settle(Slot& s, State next) {
    const bool was = s.state != State::kResident;
    const bool now = next != State::kResident;
    s.state = next;
    if (was && !now) g_unsettled--;
    if (!was && now) g_unsettled++;
  }

  // Slots whose storage died give their store space back; finished I/O is retired. Never
  // throws: a failed read is kept in its slot for the op that needs the tensor.
  void poll() {
    for (auto it = slots.begin(); it != slots.end();) {
      Slot& s = it->second;
      c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
      if (!live) {
        release_io(s);  // waits; errors of discarded data drop
        record_end(s, false);
        settle(s, State::kResident);
        it = slots.erase(it);
        continue;
      }
      if (s.state == State::kWriting && s.tier->ready(s.ticket)) finish_write(*live, s);
      if (s.state == State::kOffloaded && s.staged.valid()) finish_stage(s, false);
      if (s.state == State::kReading && s.tier->ready(s.ticket)) {
        try {
          finish_read(*live, s, false);
        } catch (const Error&) {
          s.error = std::current_exception();
        }
      }
      ++it;
    }
  }

  // Gives back a slot's space in its tier, and a stage's in the host pool after its read.
  void release_io(Slot& s) {
    if (s.ticket.valid()) s.tier->free(s.ticket);  // waits for a request in flight
    s.ticket = io::Ticket{};
    if (s.staged.valid()) opt.host->free(s.staged);
    s.staged = io::Ticket{};
  }

  // A stage: the store reads an offloaded tensor into the host pool, so that its prefetch reads
  // the pool (the SSDs read early, the faster host link late). Skipped where the pool has no
  // room; the prefetch then reads the store.
  void start_stage(Slot& s, std::int64_t due) {
    if (!opt.host || s.state != State::kOffloaded || on_host(s) || s.staged.valid()) return;
    if (s.error || !s.ticket.valid()) return;
    const auto room = opt.host->reserve(s.nbytes);
    if (!room) {
      ++stats.stage_skips;
      return;
    }
    s.staged = room->first;
    s.tier->read(s.ticket, room->second, io::Priority::kPrefetch);
    record_start(s, plan::Direction::kRead, plan::TransferKind::kPlanned, due);
    issued(s, plan::Direction::kRead);
  }

  // Ends a stage whose read is done (or, with `wait`, waits for it): the tensor is in the host
  // pool and its store space goes back. A failed read keeps the store's copy, which the
  // prefetch then reads (and reports, if it fails again).
  void finish_stage(Slot& s, bool wait) {
    if (!s.staged.valid() || (!wait && !s.tier->ready(s.ticket))) return;
    try {
      s.tier->wait(s.ticket);
    } catch (const Error&) {
      ++stats.stage_failures;
      opt.host->free(s.staged);
      s.staged = io::Ticket{};
      record_end(s, true);
      return;
    }
    record_end(s, false);
    s.tier->free(s.ticket);
    s.ticket = s.staged;
    s.tier = opt.host.get();
    s.staged = io::Ticket{};
    ++stats.stages;
    stats.bytes_staged += s.nbytes;
    stats.bytes_read += s.nbytes;
  }

  void finish_write(c10::StorageImpl& impl, Slot& s) {
    try {
      s.tier->wait(s.ticket);
    } catch (const IoError& e) {
      ++stats.write_failures;  // the tensor keeps its memory: nothing is lost
      if (e.errnum() == ENOSPC) ++stats.store_full;
      stats.write_error = e.what();
      s.tier->free(s.ticket);
      s.ticket = io::Ticket{};
      settle(s, State::kResident);
      record_end(s, true);
      return;
    }
    record_end(s, false);
    (on_host(s) ? stats.bytes_to_host : stats.bytes_written) += s.nbytes;
    if (s.cancel) {
      ++stats.cancelled;
      s.tier->free(s.ticket);
      s.ticket = io::Ticket{};
      settle(s, State::kResident);
      return;
    }
    impl.set_data_ptr_noswap(c10::DataPtr(nullptr, s.device));  // frees the memory
    settle(s, State::kOffloaded);
    ++stats.released;
  }

  // `kind` and `due` (the op it is needed by, counted over all steps as Slot::due; -1: none)
  // label it in the timeline.
  void start_read(c10::StorageImpl& impl, Slot& s, io::Priority p, plan::TransferKind kind,
                  std::int64_t due) {
    finish_stage(s, true);  // a stage in flight lands first: the read then takes the pool's copy
    c10::Allocator* alloc = impl.allocator();
    {
      detail::ReadAllocationScope scope(s.device);  // no queued kernel may use this memory
      s.incoming = alloc->allocate(s.nbytes);
    }
    s.tier->read(s.ticket, s.incoming.get(), p);
    record_start(s, plan::Direction::kRead, kind, due);
    settle(s, State::kReading);
    (on_host(s) ? stats.bytes_from_host : stats.bytes_read) += s.nbytes;
    issued(s, plan::Direction::kRead);
  }

  // A planned read ahead of its op. Its memory may be refused where the wall is the device's
  // own (PlanExecutor::retry_out_of_memory: the CUDA allocator's fraction, or the CPU cap
  // refusing at once): this runs in a RecordFunction callback, which must not throw, and the
  // trigger's other actions (the writes that make room) must still run. Then the tensor stays
  // offloaded and false is returned; the caller holds it, and the guard reads it when an op
  // needs it.
  bool start_prefetch(c10::StorageImpl& impl, Slot& s, std::int64_t due) {
    try {
      start_read(impl, s, io::Priority::kPrefetch, plan::TransferKind::kPlanned, due);
    } catch (const c10::OutOfMemoryError&) {
      (void)take_last_refused_bytes();
      ++stats.refused_prefetches;
      return false;
    }
    ++stats.prefetches;
    return true;
  }

  // Counts a transfer as it starts, on its channel (the simulator counts them so too).
  void issued(const Slot& s, plan::Direction dir) {
    const plan::Tier tier = on_host(s) ? plan::Tier::kHost : plan::Tier::kSsd;
    stats.issued_bytes[plan::index_of(plan::channel_of(tier, dir))] += s.nbytes;
  }

  // Waits for the slot's read. On failure the memory it was filling goes back, the tensor stays
  // offloaded (a later access reads it again) and the store's error propagates. `needed`: an op
  // waits for it (a stall in the timeline), not a poll of a read that is done.
  void finish_read(c10::StorageImpl& impl, Slot& s, bool needed) {
    const auto t0 = Clock::now();
    const auto stalled = [&] {
      const double dt = since(t0);
      stats.stall_seconds += dt;
      if (on_host(s)) stats.host_stall_seconds += dt;
      if (needed) {
        record_stall(plan::StallKind::kRead,
                     on_host(s) ? plan::Channel::kHostRead : plan::Channel::kSsdRead, label(s), t0);
      }
    };
    try {
      s.tier->wait(s.ticket);
    } catch (const Error&) {
      stalled();
      record_end(s, true);
      s.incoming.clear();
      settle(s, State::kOffloaded);
      throw;
    }
    stalled();
    record_end(s, false);
    detail::record_use_on_current_stream(s.incoming, s.device);
    impl.set_data_ptr_noswap(std::move(s.incoming));
    s.tier->free(s.ticket);
    s.ticket = io::Ticket{};
    settle(s, State::kResident);
  }

  // Never leaves the storage without its bytes: either it is resident on return, or this throws.
  void make_resident(c10::StorageImpl* storage) {
    auto it = slots.find(storage);
    if (it == slots.end()) return;
    Slot& s = it->second;
    if (s.error) {
      std::exception_ptr e = std::move(s.error);
      s.error = nullptr;
      std::rethrow_exception(e);
    }
    switch (s.state) {
      case State::kResident:
        return;
      case State::kWriting:
        s.cancel = true;  // the op may change it: the memory stays, the write is dropped
        return;
      case State::kOffloaded:
        ++stats.misses;
        start_read(*storage, s, io::Priority::kUrgent, plan::TransferKind::kMiss, -1);
        [[fallthrough]];
      case State::kReading:
        s.tier->prioritize(s.ticket, io::Priority::kUrgent);
        finish_read(*storage, s, true);
        return;
    }
  }

  // Memory the running or next op will allocate (its outputs and workspace): a prefetch must
  // leave room for it, or the op would cross the budget with nothing left to wait for.
  std::uint64_t reserve = 0;

  std::uint64_t meter_bytes() const { return opt.current_bytes ? opt.current_bytes() : 0; }
  bool over(std::uint64_t more) const {
    return opt.budget != 0 && opt.current_bytes && meter_bytes() + more > opt.budget;
  }

  // Waits for writes in flight, oldest first, until `more` bytes fit under the budget or none is
  // left: their memory goes back as each completes. A write stall, counted as such.
  void wait_for_room(std::uint64_t more) {
    if (!over(more)) return;
    const auto t0 = Clock::now();
    bool waited = false;
    while (over(more)) {
      Slot* oldest = nullptr;
      for (auto& entry : slots) {
        Slot& s = entry.second;
        if (s.state == State::kWriting && !s.cancel &&
            (oldest == nullptr || s.ticket.id < oldest->ticket.id)) {
          oldest = &s;
        }
      }
      if (oldest == nullptr) break;
      c10::intrusive_ptr<c10::StorageImpl> live = oldest->weak.lock();
      if (!live) break;
      waited = true;
      finish_write(*live, *oldest);
    }
    if (waited) {
      ++stats.budget_waits;
      stats.write_stall_seconds += since(t0);
      record_stall(plan::StallKind::kBudget, plan::Channel::kSsdWrite, "", t0);
    }
  }

  // The last resort of the budget: no write in flight is left to wait for, and op `index`
  // would still take memory over it (the plan was made for other timings or other tensors).
  // Tensors of the trace that the op does not use are written out at once, the one used
  // again latest first, until it fits or none is left. A write stall; a later op that needs
  // one reads it back (a miss).
  // `in_use(storage)`: true for the storages op `index` reads (never written out for it).
  template <typename InUseFn>
  void evict_for(std::uint64_t more, trace::OpIndex index, InUseFn in_use) {
    if (!over(more) || (diverged && !planless())) return;
    stats.eviction_overshoot =
        std::max(stats.eviction_overshoot, meter_bytes() + more - opt.budget);
    evict_while([&] { return over(more); }, index, in_use);
  }

  // A storage that may be written out now: big enough, with bytes, resident, not read by an op
  // running now, not held.
  template <typename InUseFn>
  bool evictable(const c10::intrusive_ptr<c10::StorageImpl>& live, InUseFn in_use) const {
    return live && live->nbytes() >= opt.min_bytes && evictable_at_any_size(live, in_use);
  }
  template <typename InUseFn>
  bool evictable_at_any_size(const c10::intrusive_ptr<c10::StorageImpl>& live,
                             InUseFn in_use) const {
    if (!live || !movable_storage(*live)) return false;
    auto it = slots.find(live.get());
    if (it != slots.end() && (it->second.state != State::kResident || it->second.error)) {
      return false;
    }
    if (in_use(live.get()) || is_held(live.get())) return false;
    return !g_track_inputs.load(std::memory_order_acquire) || !in_use_now(live.get());
  }

  // The next victim: with a plan, the bound tensor used again latest (after op `index`);
  // without one, the storage ops read least recently.
  template <typename InUseFn>
  c10::intrusive_ptr<c10::StorageImpl> pick_victim(trace::OpIndex index, InUseFn in_use) {
    c10::intrusive_ptr<c10::StorageImpl> victim;
    if (planless()) {
      std::uint64_t oldest = std::numeric_limits<std::uint64_t>::max();
      for (auto it = seen.begin(); it != seen.end();) {
        auto live = it->second.weak.lock();
        if (!live) {
          it = seen.erase(it);
          continue;
        }
        if (it->second.last < oldest && evictable(live, in_use)) {
          oldest = it->second.last;
          victim = std::move(live);
        }
        ++it;
      }
      return victim;
    }
    const plan::Schedule& sched = shape().sched;
    const auto n_ops = static_cast<std::int64_t>(sched.num_ops);
    std::int64_t best = -1;
    for (std::size_t id = 0; id < bound.size() && id < sched.uses_of.size(); ++id) {
      auto live = bound[id].lock();
      if (!evictable(live, in_use)) continue;
      // Distance to the next use in this step, or past its end (used next step, or never).
      const auto& u = sched.uses_of[id];
      auto next = std::upper_bound(u.begin(), u.end(), index);
      const std::int64_t distance = next != u.end() ? *next - index : n_ops + 1;
      if (distance > best) {
        best = distance;
        victim = std::move(live);
      }
    }
    return victim;
  }

  // The bytes that could be written out now but for min_bytes (the tensors the plan knows, or
  // without a plan those ops read): what a smaller min_bytes would let go.
  template <typename InUseFn>
  std::uint64_t bytes_under_min_bytes(InUseFn in_use) const {
    std::uint64_t sum = 0;
    const auto add = [&](const c10::intrusive_ptr<c10::StorageImpl>& live) {
      if (live && live->nbytes() < opt.min_bytes && evictable_at_any_size(live, in_use)) {
        sum += live->nbytes();
      }
    };
    if (planless()) {
      for (const auto& [p, s] : seen) add(s.weak.lock());
    } else {
      for (const auto& b : bound) add(b.lock());
    }
    return sum;
  }

  // Writes out resident tensors that `in_use` does not name (pick_victim's order) while
  // `needed()`; returns the bytes freed.
  template <typename Needed, typename InUseFn>
  std::uint64_t evict_while(Needed needed, trace::OpIndex index, InUseFn in_use) {
    const auto t0 = Clock::now();
    bool evicted = false;
    std::uint64_t freed = 0;
    while (needed()) {
      c10::intrusive_ptr<c10::StorageImpl> victim = pick_victim(index, in_use);
      if (!victim) break;
      Slot& s = slots[victim.get()];
      s.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(victim);
      s.nbytes = victim->nbytes();
      s.device = victim->device();
      s.cancel = false;
      s.tier = store.get();
      s.due = 0;  // waited for at once
      if (tl() != nullptr) s.tensor = planless() ? -1 : id_of(victim.get());
      detail::sync_current_stream(s.device);
      s.ticket = store->write(victim->data(), s.nbytes, io::Priority::kUrgent);
      record_start(s, plan::Direction::kWrite, plan::TransferKind::kEviction, -1);
      issued(s, plan::Direction::kWrite);
      settle(s, State::kWriting);
      ++stats.offloads;
      ++stats.evictions;
      stats.evicted_bytes += s.nbytes;
      evicted = true;
      finish_write(*victim, s);  // waits; on failure it stays and the next candidate is tried
      if (s.state == State::kResident) {
        slots.erase(victim.get());
        break;  // a failing store: stop evicting for this op
      }
      freed += s.nbytes;
    }
    if (evicted) {
      ++stats.budget_waits;
      stats.write_stall_seconds += since(t0);
      record_stall(plan::StallKind::kBudget, plan::Channel::kSsdWrite, "evictions", t0);
    }
    return freed;
  }

  // Waits for every read in flight that no running op reads (`running`, or the guard's record):
  // they become resident, so evictable. Returns whether there was one.
  template <typename InUseFn>
  bool finish_reads_in_flight(InUseFn running) {
    bool any = false;
    for (auto& [storage, s] : slots) {
      if (s.state != State::kReading || running(storage)) continue;
      if (g_track_inputs.load(std::memory_order_acquire) && in_use_now(storage)) continue;
      c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
      if (!live) continue;
      try {
        s.tier->prioritize(s.ticket, io::Priority::kUrgent);
        finish_read(*live, s, false);
        any = true;
      } catch (const Error&) {
        s.error = std::current_exception();  // the op that needs it gets the error
      }
    }
    return any;
  }

  // Issues held prefetches, earliest deadline first, while they fit.
  void issue_held() {
    while (!held.empty()) {
      auto live = held.front().storage.lock();
      if (!live) {
        held.erase(held.begin());
        continue;
      }
      auto it = slots.find(live.get());
      if (it == slots.end() || it->second.state != State::kOffloaded) {
        held.erase(held.begin());
        continue;
      }
      if (over(it->second.nbytes + reserve)) return;
      if (!start_prefetch(*live, it->second, held.front().due)) return;  // stays held
      held.erase(held.begin());
    }
  }

  // Issues migration `m` of a step that started `base` ops into the run.
  void run_migration(const plan::Migration& m, std::int64_t base) {
    if (m.tensor < 0 || static_cast<std::size_t>(m.tensor) >= bound.size()) return;
    c10::intrusive_ptr<c10::StorageImpl> impl = bound[static_cast<std::size_t>(m.tensor)].lock();
    if (!impl) {
      ++stats.unbound;
      return;
    }
    if (m.kind == plan::ActionKind::kOffload) {
      if (impl->nbytes() < opt.min_bytes || !movable_storage(*impl)) return;
      if (is_held(impl.get())) return;
      Slot& s = slots[impl.get()];
      if (s.state != State::kResident || s.error) return;
      s.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(impl);
      s.nbytes = impl->nbytes();
      s.device = impl->device();
      s.cancel = false;
      s.due = base + m.due;
      s.tensor = m.tensor;
      detail::sync_current_stream(s.device);  // the producing kernels must have finished
      // Where the plan says: host memory while the pool has room, else the SSD store.
      s.tier = store.get();
      if (m.tier == plan::Tier::kHost) {
        if (opt.host && opt.host->free_bytes() >= s.nbytes) {
          s.tier = opt.host.get();
          ++stats.host_offloads;
        } else {
          ++stats.host_fallbacks;
        }
      }
      s.ticket = s.tier->write(impl->data(), s.nbytes, io::Priority::kOffload);
      record_start(s, plan::Direction::kWrite, plan::TransferKind::kPlanned, s.due);
      issued(s, plan::Direction::kWrite);
      settle(s, State::kWriting);
      ++stats.offloads;
      return;
    }
    auto it = slots.find(impl.get());
    if (it == slots.end()) return;
    Slot& s = it->second;
    if (m.kind == plan::ActionKind::kStage) {
      start_stage(s, base + m.due);
      return;
    }
    if (s.state == State::kWriting && !s.cancel) {
      // Forwarding: the tensor is wanted back before its write is done. It keeps its memory;
      // a write not yet started is dropped, one that runs is finished and forgotten.
      ++stats.forwarded;
      if (s.tier->cancel_write(s.ticket)) {
        s.ticket = io::Ticket{};
        settle(s, State::kResident);
        record_end(s, false);
      } else {
        s.cancel = true;
      }
      return;
    }
    if (s.state != State::kOffloaded) return;
    wait_for_room(s.nbytes + reserve);
    if (!over(s.nbytes + reserve) && start_prefetch(*impl, s, base + m.due)) return;
    // No room yet (by the meter, or the wall refused it): hold it, most urgent first, until
    // memory allows or an op needs it.
    HeldPrefetch h{base + m.due, c10::weak_intrusive_ptr<c10::StorageImpl>(impl)};
    auto pos = std::upper_bound(held.begin(), held.end(), h,
                                [](const auto& x, const auto& y) { return x.due < y.due; });
    held.insert(pos, std::move(h));
    ++stats.delayed_prefetches;
  }

  void run_trigger(trace::OpIndex index) {
    const plan::Schedule& sched = shape().sched;
    if (index < 0 || static_cast<std::size_t>(index) >= sched.issued_after.size()) return;
    for (std::int32_t i : sched.issued_after[static_cast<std::size_t>(index)]) {
      run_migration(sched.migrations[static_cast<std::size_t>(i)], step_base);
    }
  }

  // The plan's deadlines: before op `index`, the writes due by then are done (as the simulator
  // has them), so that the tensor is gone when the plan counts it gone, whatever the disk's
  // speed. Not the writes of the tensors this op uses (they stay: see before_op).
  void wait_for_deadlines(trace::OpIndex index, const std::vector<TensorRef>& inputs) {
    if (!opt.wait_for_deadlines) return;
    const std::int64_t now = step_base + index;
    const auto t0 = Clock::now();
    bool waited = false;
    for (auto& [storage, s] : slots) {
      if (s.state != State::kWriting || s.cancel || s.due > now) continue;
      if (std::any_of(inputs.begin(), inputs.end(),
                      [&](const TensorRef& r) { return r.storage == storage; })) {
        continue;
      }
      c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
      if (!live) continue;
      if (!s.tier->ready(s.ticket)) waited = true;
      finish_write(*live, s);
    }
    if (waited) {
      ++stats.deadline_waits;
      stats.write_stall_seconds += since(t0);
      record_stall(plan::StallKind::kDeadline, plan::Channel::kSsdWrite, "", t0);
    }
  }
};

namespace {

// tidal's own work at a step's start or end, as an op of the timeline (its stalls are inside).
class OpSpan {
 public:
  OpSpan(PlanExecutor::Impl& m, trace::OpIndex index, const char* name) : m_(m) {
    if (m_.tl() != nullptr) m_.tl()->op_start(index, name, m_.meter_bytes());
  }
  ~OpSpan() {
    if (m_.tl() != nullptr) m_.tl()->op_end(m_.meter_bytes());
  }
  OpSpan(const OpSpan&) = delete;
  OpSpan& operator=(const OpSpan&) = delete;

 private:
  PlanExecutor::Impl& m_;
};

}  // namespace

PlanExecutor::PlanExecutor(std::shared_ptr<io::TensorStore> store, const trace::Trace& trace,
                           const plan::Plan& plan, ExecutorOptions options)
    : PlanExecutor(std::move(store), std::move(options)) {
  add_shape(trace, plan);  // with a plan from the start: the guard tracks nothing
  g_track_inputs.store(false, std::memory_order_release);
}

PlanExecutor::PlanExecutor(std::shared_ptr<io::TensorStore> store, ExecutorOptions options)
    : impl_(std::make_unique<Impl>()) {
  TIDAL_EXPECT(store != nullptr, "PlanExecutor needs a TensorStore");
  impl_->store = std::move(store);
  impl_->opt = std::move(options);
  PlanExecutor* expected = nullptr;
  TIDAL_EXPECT(g_executor.compare_exchange_strong(expected, this),
               "another PlanExecutor is active in this process");
  // Without a plan: the guard tracks what runs, in LRU order (add_shape stops the order).
  g_track_inputs.store(true, std::memory_order_release);
  g_note_lru.store(true, std::memory_order_release);
}

bool PlanExecutor::planless() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->planless();
}

bool movable_storage(const c10::StorageImpl& storage) {
  const c10::Allocator* alloc = storage.allocator();
  return alloc != nullptr && storage.data() != nullptr &&
         storage.data_ptr().get_deleter() == alloc->raw_deleter();
}

void PlanExecutor::track_inputs(bool on) { g_track_inputs.store(on, std::memory_order_release); }

void PlanExecutor::retry_out_of_memory(bool on) {
  g_retry_oom.store(on, std::memory_order_release);
}

std::uint64_t PlanExecutor::out_of_memory_retries() {
  return g_oom_retries.load(std::memory_order_relaxed);
}

void PlanExecutor::note_inputs(c10::ArrayRef<c10::StorageImpl*> storages, bool recent) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (!m.planless()) return;
  for (c10::StorageImpl* p : storages) {
    if (p == nullptr || p->nbytes() < m.opt.min_bytes || !movable_storage(*p)) continue;
    auto& e = m.seen[p];
    const bool fresh = e.weak.expired();
    if (fresh) {
      e.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(
          c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(p));
      e.last = 0;
    }
    if (recent) e.last = ++m.notes;
  }
}

double PlanExecutor::io_wait_seconds() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->waits() - impl_->waited_elsewhere;
}

PlanExecutor::~PlanExecutor() {
  try {
    restore_all();
  } catch (const std::exception&) {
    // A tensor that cannot be read back keeps an empty storage; the error reached the caller
    // of the op that needed it, or of restore_all() or end_step(), before.
  }
  {
    std::lock_guard<std::recursive_mutex> lock(impl_->mu);
    for (auto& [storage, s] : impl_->slots) {
      impl_->release_io(s);
      impl_->settle(s, Impl::State::kResident);
    }
    impl_->slots.clear();
  }
  if (impl_->guard_thread == std::this_thread::get_id()) set_residency_guard(false);
  g_track_inputs.store(false, std::memory_order_release);
  g_note_lru.store(false, std::memory_order_release);
  g_executor.store(nullptr);
}

int PlanExecutor::add_shape(const trace::Trace& trace, const plan::Plan& plan) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->shapes.push_back(Impl::make_shape(trace, plan));
  impl_->grow_bound(trace.tensors.size());
  impl_->seen.clear();  // a plan picks victims from here on
  g_note_lru.store(false, std::memory_order_release);
  return static_cast<int>(impl_->shapes.size()) - 1;
}

void PlanExecutor::set_min_bytes(std::uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->opt.min_bytes = bytes;
}

void PlanExecutor::replace_plan(int index, const trace::Trace& trace, const plan::Plan& plan) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  TIDAL_EXPECT(index >= 0 && static_cast<std::size_t>(index) < impl_->shapes.size(),
               "replace_plan: no step shape ", index);
  impl_->shapes[static_cast<std::size_t>(index)] = Impl::make_shape(trace, plan);
  impl_->grow_bound(trace.tensors.size());
}

void PlanExecutor::hold(c10::StorageImpl* storage) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  ++impl_->holds[storage];
  auto it = impl_->slots.find(storage);
  if (it != impl_->slots.end() && it->second.state == Impl::State::kWriting) {
    it->second.cancel = true;
    impl_->finish_write(*storage, it->second);  // the bytes stay where they are: in memory
  }
  impl_->make_resident(storage);
}

void PlanExecutor::release(const c10::StorageImpl* storage) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  auto it = impl_->holds.find(storage);
  if (it != impl_->holds.end() && --it->second <= 0) impl_->holds.erase(it);
}

void PlanExecutor::restore_all() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  std::exception_ptr first;
  for (auto& [storage, s] : impl_->slots) {
    c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
    if (!live) continue;
    if (s.state == Impl::State::kWriting) {
      s.cancel = true;
      impl_->finish_write(*live, s);
    }
    try {
      impl_->make_resident(live.get());
    } catch (const Error&) {
      if (!first) first = std::current_exception();
    }
  }
  impl_->poll();
  if (first) std::rethrow_exception(first);
}

void PlanExecutor::bind_alive(const BoundTensors& tensors) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  for (const auto& [id, storage] : tensors) {
    if (id >= 0 && static_cast<std::size_t>(id) < impl_->bound.size()) {
      impl_->bound[static_cast<std::size_t>(id)] = storage;
    }
  }
}

std::uint64_t PlanExecutor::reclaim(std::uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const double waits_at_start = m.waits();
  const bool elsewhere =
      m.guard_thread != std::thread::id() && m.guard_thread != std::this_thread::get_id();
  const std::uint64_t target = m.meter_bytes() > bytes ? m.meter_bytes() - bytes : 0;
  const auto index = static_cast<trace::OpIndex>(m.ops_run) - 1;
  const auto running = [&](const c10::StorageImpl* p) {
    return std::find(m.running_inputs.begin(), m.running_inputs.end(), p) != m.running_inputs.end();
  };
  const auto needed = [&] { return m.meter_bytes() > target; };
  std::uint64_t freed = m.evict_while(needed, m.diverged ? -1 : index, running);
  if (needed() && m.finish_reads_in_flight(running)) {
    // Prefetches in flight hold memory no eviction could take while they read: finished, they
    // are resident, and may go again (the last resort; the plan wanted them soon).
    freed += m.evict_while(needed, m.diverged ? -1 : index, running);
  }
  m.stats.reclaimed_bytes += freed;
  if (m.meter_bytes() > target) {
    const std::uint64_t small = m.bytes_under_min_bytes(running);
    if (m.stats.write_failures > 0) {
      m.shortfall = "writes to the store failed (" + m.stats.write_error + ")";
    } else if (small > 0) {
      m.shortfall = ::tidal::detail::concat(
          format_bytes(static_cast<double>(small)),
          " of tensors left in memory are under min_bytes, the smallest size tidal moves (now ",
          format_bytes(static_cast<double>(m.opt.min_bytes)),
          "): a smaller min_bytes (the CLI's --min-offload) lets them go");
    } else {
      m.shortfall = kNothingLeftToMove;
    }
    note_reclaim_shortfall(m.shortfall);
  }
  if (elsewhere) m.waited_elsewhere += m.waits() - waits_at_start;
  return freed;
}

std::uint64_t PlanExecutor::make_room_after_refusal(std::uint64_t refused, int attempt) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.poll();
  const std::uint64_t want = std::max<std::uint64_t>(refused, std::uint64_t{1} << 20)
                             << std::min(attempt, 10);
  const std::uint64_t meter = m.meter_bytes();
  const std::uint64_t over = meter + want > m.opt.budget ? meter + want - m.opt.budget : 0;
  m.shortfall.clear();
  return reclaim(std::max(over, want));
}

std::uint64_t PlanExecutor::memory_in_use() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->meter_bytes();
}

std::uint64_t PlanExecutor::budget() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->opt.budget;
}

std::string PlanExecutor::last_reclaim_shortfall() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->shortfall.empty() ? kNothingLeftToMove : impl_->shortfall;
}

void PlanExecutor::set_budget(std::uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->opt.budget = bytes;
}

void PlanExecutor::fit_budget() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->poll();
  impl_->wait_for_room(0);
  impl_->evict_for(0, -1, [](const c10::StorageImpl*) { return false; });
}

void PlanExecutor::ensure_resident(c10::ArrayRef<c10::StorageImpl*> storages) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  // Reads the op needs at once (misses) take memory too: room is made for them first, never by
  // writing out another tensor this op uses.
  std::uint64_t missing = 0;
  for (c10::StorageImpl* s : storages) {
    auto it = m.slots.find(s);
    if (it != m.slots.end() && it->second.state == Impl::State::kOffloaded) {
      missing += it->second.nbytes;
    }
  }
  if (missing > 0) {
    m.wait_for_room(missing);
    m.evict_for(missing, static_cast<trace::OpIndex>(m.ops_run) - 1,
                [&](const c10::StorageImpl* p) {
                  return std::find(storages.begin(), storages.end(), p) != storages.end();
                });
  }
  for (c10::StorageImpl* s : storages) m.make_resident(s);
}

void PlanExecutor::before_op(trace::OpIndex index, const std::string& name,
                             const std::vector<TensorRef>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (m.tl() != nullptr) m.tl()->op_start(index, name, m.meter_bytes());
  if (is_compiled_region(name) && !m.diverged) {
    // A torch.compile'd region the profile did not have: its kernels bypass the residency
    // guard, so everything comes back now and the rest of the step runs on demand. (A failed
    // read cannot stop the op from here; the tensor stays offloaded and the guard reports it
    // at the next ATen op that reads it.)
    m.diverge(::tidal::detail::concat("op ", index, " is ", name, ", a torch.compile'd region"));
    try {
      restore_all();
    } catch (const Error&) {
    }
  }
  m.advance(index, name);
  m.running_inputs.clear();
  for (const auto& r : inputs) m.running_inputs.push_back(r.storage);
  if (!m.diverged) m.bind(inputs);
  if (m.opt.on_op_start && !m.diverged && index >= 0) {
    std::vector<plan::Residency> where(static_cast<std::size_t>(m.shape().sched.num_tensors));
    for (std::size_t id = 0; id < where.size(); ++id) where[id] = m.residency_of(id);
    m.opt.on_op_start(index, where);
  }
  // No reads here (this runs in a RecordFunction callback, where a failure could not stop the
  // op): the residency guard reads what the op needs. A write in flight is cancelled, though, so
  // that an op changing the tensor in place never loses its change.
  for (const auto& r : inputs) {
    auto it = m.slots.find(r.storage);
    if (it != m.slots.end() && it->second.state == Impl::State::kWriting) it->second.cancel = true;
  }
  m.poll();
  if (!m.diverged && index >= 0) {
    const auto& new_bytes = m.shape().sched.new_bytes;
    m.wait_for_deadlines(index, inputs);
    if (static_cast<std::size_t>(index) < new_bytes.size()) {
      const std::uint64_t more = new_bytes[static_cast<std::size_t>(index)];
      m.wait_for_room(more);
      m.evict_for(more, index, [&](const c10::StorageImpl* p) {
        return std::any_of(inputs.begin(), inputs.end(),
                           [&](const TensorRef& r) { return r.storage == p; });
      });
      m.reserve = more;
    }
  }
  m.issue_held();
}

void PlanExecutor::after_op(trace::OpIndex index, const std::vector<TensorRef>& outputs) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.running_inputs.clear();
  if (m.tl() != nullptr) m.tl()->op_end(m.meter_bytes());
  if (m.diverged) return;  // on-demand only: the guard still serves every op
  m.bind(outputs);
  const auto& new_bytes = m.shape().sched.new_bytes;
  const auto next = static_cast<std::size_t>(index) + 1;
  m.reserve = index >= 0 && next < new_bytes.size() ? new_bytes[next] : 0;
  try {
    m.run_trigger(index);
  } catch (const Error&) {
    // Starting an offload or a prefetch failed (no memory for a read, say): the tensors stay
    // where they are, and the guard fetches what an op needs.
  }
}

void PlanExecutor::step_end(trace::OpIndex index, const std::vector<TensorRef>& alive) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const OpSpan span(m, index, kStepEndOp);
  m.advance(index, kStepEndOp);
  if (!m.diverged) m.bind(alive);
  m.poll();
  std::exception_ptr first;
  for (const auto& r : alive) {
    try {
      m.make_resident(r.storage);
    } catch (const Error&) {
      if (!first) first = std::current_exception();
    }
  }
  m.deferred.clear();
  if (m.planless()) {
    if (first) std::rethrow_exception(first);
    return;
  }
  const plan::Schedule& sched = m.shape().sched;
  if (!m.diverged && index >= 0 && static_cast<std::size_t>(index) < sched.issued_after.size()) {
    for (std::int32_t i : sched.issued_after[static_cast<std::size_t>(index)]) {
      m.deferred.push_back(sched.migrations[static_cast<std::size_t>(i)]);
    }
    m.deferred_base = m.step_base;
  }
  if (first) std::rethrow_exception(first);
}

void PlanExecutor::begin_step(std::int64_t /*step*/, const std::vector<torch::Tensor>& /*in*/) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.waited_before += m.stats.stall_seconds + m.stats.write_stall_seconds;
  m.stats = ExecutorStats{};
  m.step_base += static_cast<std::int64_t>(m.ops_run);
  m.diverged = m.planless();  // without a plan every op is served on demand
  m.ops_run = 0;
  m.held.clear();
  m.current = m.last_completed;
  const OpSpan span(m, -1, "tidal::step_begin");
  set_residency_guard(true);
  m.guard_thread = std::this_thread::get_id();
  // What the plan moves after the last step's end (the step-end op's actions) starts now, so
  // that between steps everything stays the caller's.
  try {
    for (const auto& mig : m.deferred) m.run_migration(mig, m.deferred_base);
  } catch (const Error&) {
  }
  m.deferred.clear();
}

void PlanExecutor::end_step(std::int64_t /*step*/) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.holds.clear();  // a hold lasts at most to the end of its step
  m.poll();
  if (m.planless()) {
    m.last = m.stats;
    return;
  }
  const auto& shape = m.shapes[static_cast<std::size_t>(m.current)];
  if (!m.diverged && m.ops_run != shape.op_names.size()) {
    // The step stopped early: it is the prefix of a known shape, or a shape of its own.
    bool found = false;
    for (std::size_t j = 0; j < m.shapes.size() && !found; ++j) {
      if (m.shapes[j].op_names.size() == m.ops_run &&
          Impl::same_start(m.shapes[j], shape, m.ops_run)) {
        m.current = static_cast<int>(j);
        found = true;
      }
    }
    if (!found) {
      m.diverge(::tidal::detail::concat("the step ended after ", m.ops_run,
                                        " ops; the profile has ", shape.op_names.size()));
    }
  }
  if (!m.diverged) {
    m.stats.shape = m.current;
    m.stats.planned_bytes = m.shape().sched.planned_bytes;
    m.last_completed = m.current;
  }
  m.last = m.stats;
}

void PlanExecutor::abort_step() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.holds.clear();
  m.deferred.clear();
  m.poll();
  m.stats.shape = -1;
  m.last = m.stats;
}

ExecutorStats PlanExecutor::last_step() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->last;
}

}  // namespace tidal::torch_layer
