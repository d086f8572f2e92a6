#include "tidal/torch/executor.hpp"

#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "device_sync.hpp"
#include "ivalue_tensors.hpp"
#include "tidal/common/error.hpp"

namespace tidal::torch_layer {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

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
// Storages not in memory right now, over all executors: the safety net's fast path is a load.
std::atomic<int> g_nonresident{0};

std::unique_ptr<at::ObserverContext> safety_net(const at::RecordFunction& fn) {
  if (g_nonresident.load(std::memory_order_acquire) == 0) return nullptr;
  PlanExecutor* ex = g_executor.load(std::memory_order_acquire);
  if (ex == nullptr || reads_no_data(fn.name())) return nullptr;
  for (const auto& v : fn.inputs()) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (t.defined() && t.has_storage()) ex->ensure_resident(t.storage().unsafeGetStorageImpl());
    });
  }
  return nullptr;
}

}  // namespace

struct PlanExecutor::Impl {
  enum class State { kResident, kWriting, kOffloaded, kReading };
  struct Slot {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
    State state = State::kResident;
    io::Ticket ticket;
    std::uint64_t nbytes = 0;
    c10::Device device{c10::kCPU};
    c10::DataPtr incoming;  // memory a read is filling
    bool cancel = false;    // touched while its write was in flight: keep it
  };

  std::shared_ptr<io::TensorStore> store;
  ExecutorOptions opt;
  std::vector<std::string> op_names;
  std::vector<std::vector<plan::PlanAction>> at_trigger;  // by op index
  std::recursive_mutex mu;  // the safety net can re-enter through ops run by the store? no; kept
                            // recursive so restore paths may call ensure_resident freely
  std::unordered_map<c10::StorageImpl*, Slot> slots;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> bound;  // by tensor id
  ExecutorStats stats;
  ExecutorStats last;
  bool diverged = false;
  std::uint64_t callback = 0;

  void bind(const std::vector<TensorRef>& refs) {
    for (const auto& r : refs) {
      if (r.id < 0 || static_cast<std::size_t>(r.id) >= bound.size() || r.storage == nullptr) {
        continue;
      }
      bound[static_cast<std::size_t>(r.id)] = c10::weak_intrusive_ptr<c10::StorageImpl>(
          c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(r.storage));
    }
  }

  // Slots whose storage died: their store space goes back.
  void poll() {
    for (auto it = slots.begin(); it != slots.end();) {
      Slot& s = it->second;
      c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
      if (!live) {
        if (s.ticket.valid()) {
          if (s.state == State::kOffloaded || s.state == State::kResident) {
            store->free(s.ticket);
          } else {
            try {
              store->wait(s.ticket);
            } catch (const IoError&) {
            }
            store->free(s.ticket);
          }
        }
        if (s.state == State::kOffloaded || s.state == State::kReading) g_nonresident--;
        it = slots.erase(it);
        continue;
      }
      if (s.state == State::kWriting && store->ready(s.ticket)) finish_write(*live, s);
      if (s.state == State::kReading && store->ready(s.ticket)) finish_read(*live, s);
      ++it;
    }
  }

  void finish_write(c10::StorageImpl& impl, Slot& s) {
    try {
      store->wait(s.ticket);
    } catch (const IoError&) {
      ++stats.write_failures;  // the tensor keeps its memory: nothing is lost
      store->free(s.ticket);
      s.ticket = io::Ticket{};
      s.state = State::kResident;
      return;
    }
    stats.bytes_written += s.nbytes;
    if (s.cancel) {
      ++stats.cancelled;
      store->free(s.ticket);
      s.ticket = io::Ticket{};
      s.state = State::kResident;
      return;
    }
    impl.set_data_ptr_noswap(c10::DataPtr(nullptr, s.device));  // frees the memory
    s.state = State::kOffloaded;
    ++stats.released;
    g_nonresident++;
  }

  void start_read(c10::StorageImpl& impl, Slot& s, io::Priority p) {
    c10::Allocator* alloc = impl.allocator();
    s.incoming = alloc->allocate(s.nbytes);
    store->read(s.ticket, s.incoming.get(), p);
    s.state = State::kReading;
    stats.bytes_read += s.nbytes;
  }

  void finish_read(c10::StorageImpl& impl, Slot& s) {
    const auto t0 = Clock::now();
    store->wait(s.ticket);  // a failed or corrupt read throws: the op must not see wrong bytes
    stats.stall_seconds += since(t0);
    impl.set_data_ptr_noswap(std::move(s.incoming));
    store->free(s.ticket);
    s.ticket = io::Ticket{};
    s.state = State::kResident;
    g_nonresident--;
  }

  void make_resident(c10::StorageImpl* storage) {
    auto it = slots.find(storage);
    if (it == slots.end()) return;
    Slot& s = it->second;
    switch (s.state) {
      case State::kResident:
        return;
      case State::kWriting:
        s.cancel = true;  // the op may change it: the memory stays, the write is dropped
        return;
      case State::kOffloaded:
        ++stats.misses;
        start_read(*storage, s, io::Priority::kUrgent);
        [[fallthrough]];
      case State::kReading:
        store->prioritize(s.ticket, io::Priority::kUrgent);
        finish_read(*storage, s);
        return;
    }
  }

  void run_action(const plan::PlanAction& a) {
    if (a.tensor < 0 || static_cast<std::size_t>(a.tensor) >= bound.size()) return;
    c10::intrusive_ptr<c10::StorageImpl> impl = bound[static_cast<std::size_t>(a.tensor)].lock();
    if (!impl) {
      ++stats.unbound;
      return;
    }
    if (a.kind == plan::ActionKind::kOffload) {
      if (impl->nbytes() < opt.min_bytes || impl->allocator() == nullptr ||
          impl->data() == nullptr) {
        return;
      }
      Slot& s = slots[impl.get()];
      if (s.state != State::kResident) return;
      s.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(impl);
      s.nbytes = impl->nbytes();
      s.device = impl->device();
      s.cancel = false;
      detail::sync_current_stream(s.device);  // the producing kernels must have finished
      s.ticket = store->write(impl->data(), s.nbytes, io::Priority::kOffload);
      s.state = State::kWriting;
      ++stats.offloads;
    } else {
      auto it = slots.find(impl.get());
      if (it == slots.end() || it->second.state != State::kOffloaded) return;
      start_read(*impl, it->second, io::Priority::kPrefetch);
      ++stats.prefetches;
    }
  }
};

PlanExecutor::PlanExecutor(std::shared_ptr<io::TensorStore> store, const trace::Trace& trace,
                           const plan::Plan& plan, ExecutorOptions options)
    : impl_(std::make_unique<Impl>()) {
  TIDAL_EXPECT(store != nullptr, "PlanExecutor needs a TensorStore");
  TIDAL_EXPECT_AS(InvalidArgument,
                  plan.num_ops == static_cast<std::int32_t>(trace.ops.size()) &&
                      plan.num_tensors == static_cast<std::int32_t>(trace.tensors.size()),
                  "the plan was made for a trace of ", plan.num_ops, " ops and ", plan.num_tensors,
                  " tensors, not this one (", trace.ops.size(), " ops, ", trace.tensors.size(),
                  " tensors); plan this trace again");
  impl_->store = std::move(store);
  impl_->opt = options;
  for (const auto& op : trace.ops) impl_->op_names.push_back(op.name);
  impl_->at_trigger.resize(trace.ops.size());
  for (const auto& a : plan.actions) {
    if (a.trigger >= 0 && static_cast<std::size_t>(a.trigger) < trace.ops.size()) {
      impl_->at_trigger[static_cast<std::size_t>(a.trigger)].push_back(a);
    }
  }
  impl_->bound.assign(trace.tensors.size(), c10::weak_intrusive_ptr<c10::StorageImpl>(
                                                c10::intrusive_ptr<c10::StorageImpl>()));
  PlanExecutor* expected = nullptr;
  TIDAL_EXPECT(g_executor.compare_exchange_strong(expected, this),
               "another PlanExecutor is active in this process");
  impl_->callback = at::addGlobalCallback(at::RecordFunctionCallback(&safety_net)
                                              .needsInputs(true)
                                              .scopes({at::RecordScope::FUNCTION}));
}

PlanExecutor::~PlanExecutor() {
  at::removeCallback(impl_->callback);
  try {
    restore_all();
  } catch (const std::exception&) {
    // A read that fails here leaves that tensor's storage empty; nothing more can be done.
  }
  g_executor.store(nullptr);
}

void PlanExecutor::restore_all() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  for (auto& [storage, s] : impl_->slots) {
    c10::intrusive_ptr<c10::StorageImpl> live = s.weak.lock();
    if (!live) continue;
    if (s.state == Impl::State::kWriting) {
      s.cancel = true;
      impl_->finish_write(*live, s);
    }
    impl_->make_resident(live.get());
  }
  impl_->poll();
}

void PlanExecutor::ensure_resident(c10::StorageImpl* storage) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->make_resident(storage);
}

void PlanExecutor::before_op(trace::OpIndex index, const std::string& name,
                             const std::vector<TensorRef>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (!m.diverged && (index < 0 || static_cast<std::size_t>(index) >= m.op_names.size() ||
                      m.op_names[static_cast<std::size_t>(index)] != name)) {
    m.diverged = true;
    m.stats.diverged = true;
    m.stats.divergence =
        ::tidal::detail::concat("op ", index, " is ", name, " but the profile has ",
                                index >= 0 && static_cast<std::size_t>(index) < m.op_names.size()
                                    ? m.op_names[static_cast<std::size_t>(index)]
                                    : std::string("no such op"));
  }
  if (!m.diverged) m.bind(inputs);
  for (const auto& r : inputs) m.make_resident(r.storage);
  m.poll();
}

void PlanExecutor::after_op(trace::OpIndex index, const std::vector<TensorRef>& outputs) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (m.diverged) return;  // on-demand only: the safety net still serves every op
  m.bind(outputs);
  if (index >= 0 && static_cast<std::size_t>(index) < m.at_trigger.size()) {
    for (const auto& a : m.at_trigger[static_cast<std::size_t>(index)]) m.run_action(a);
  }
}

void PlanExecutor::begin_step(std::int64_t /*step*/, const std::vector<torch::Tensor>& /*in*/) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->stats = ExecutorStats{};
  impl_->diverged = false;
}

void PlanExecutor::end_step(std::int64_t /*step*/) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  impl_->poll();
  impl_->last = impl_->stats;
}

ExecutorStats PlanExecutor::last_step() const {
  std::lock_guard<std::recursive_mutex> lock(impl_->mu);
  return impl_->last;
}

}  // namespace tidal::torch_layer
