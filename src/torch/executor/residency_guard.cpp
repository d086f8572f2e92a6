#include "torch/executor/residency_guard.hpp"

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

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/torch/memory.hpp"
#include "torch/device_sync.hpp"
#include "torch/executor/executor.hpp"
#include "torch/ivalue_tensors.hpp"

namespace tidal::torch_layer {
namespace {

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

constexpr int kMaxOomRetries = 16;

// Marks an op's storages in use for the life of the object.
class InUse {
 public:
  explicit InUse(c10::ArrayRef<c10::StorageImpl*> storages) : storages_(storages) {
    if (storages_.empty()) return;
    std::lock_guard<std::mutex> lock(g_guard.in_use_mu);
    for (auto* s : storages_) ++g_guard.in_use[s];
  }
  ~InUse() {
    if (storages_.empty()) return;
    std::lock_guard<std::mutex> lock(g_guard.in_use_mu);
    for (auto* s : storages_) {
      auto it = g_guard.in_use.find(s);
      if (it != g_guard.in_use.end() && --it->second <= 0) g_guard.in_use.erase(it);
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
      g_guard.oom_retries.fetch_add(1, std::memory_order_relaxed);
      stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
      stack->insert(stack->end(), args.begin(), args.end());
    }
  }
}

// The residency guard (see executor.hpp): runs before every op of a guarded thread, at any
// depth, and may throw, which a RecordFunction callback may not.
void residency_guard(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  const bool track = g_guard.track_inputs.load(std::memory_order_acquire);
  c10::SmallVector<c10::StorageImpl*, 8> storages;
  PlanExecutor* ex = nullptr;
  bool reads = false;
  if (track || g_guard.unsettled.load(std::memory_order_acquire) > 0) {
    ex = g_guard.executor.load(std::memory_order_acquire);
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
  const bool note = track && g_guard.note_lru.load(std::memory_order_acquire);
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kGuardKey);
  if (ex != nullptr && track && g_guard.retry_oom.load(std::memory_order_acquire)) {
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

ResidencyGuardState g_guard;

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&residency_guard>());
}

void set_residency_guard(bool on) { c10::impl::tls_set_dispatch_key_included(kGuardKey, on); }

}  // namespace tidal::torch_layer
