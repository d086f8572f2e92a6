// The tracer's RecordFunction callbacks: each op's inputs, outputs, frees and workspace, as it
// runs.
#include <torch/version.h>

#include <algorithm>
#include <cstring>

#include "tidal/common/error.hpp"
#include "tidal/common/stats.hpp"
#include "tidal/trace/lifetime.hpp"
#include "torch/device_sync.hpp"
#include "torch/ivalue_tensors.hpp"
#include "torch/tracer/tracer_impl.hpp"

namespace tidal::torch_layer {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

struct Tracer::Impl::OpContext : at::ObserverContext {
  OpIndex index = 0;
  std::uint64_t bytes_before = 0;  // the meter's bytes when the op started (workspace)
};

namespace {

std::atomic<Tracer::Impl*> g_tracer{nullptr};
std::atomic<std::uint64_t> g_next_thread_id{1};

// Per thread: how deep in nested ATen calls we are, and the autograd nodes being run (their
// sequence numbers), innermost last.
thread_local int tl_depth = 0;
thread_local std::vector<std::int64_t> tl_node_seq;
thread_local const std::uint64_t tl_thread_id = g_next_thread_id.fetch_add(1);

bool transparent(const at::RecordFunction& fn);

std::unique_ptr<at::ObserverContext> function_start(const at::RecordFunction& fn) {
  if (transparent(fn)) return nullptr;
  Tracer::Impl* t = g_tracer.load(std::memory_order_acquire);
  if (t == nullptr) {
    ++tl_depth;
    return nullptr;
  }
  return t->on_op_start(fn);
}

void function_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (transparent(fn)) return;
  Tracer::Impl* t = g_tracer.load(std::memory_order_acquire);
  if (t == nullptr) {
    --tl_depth;
    return;
  }
  t->on_op_end(fn, ctx);
}

std::unique_ptr<at::ObserverContext> node_start(const at::RecordFunction& fn) {
  tl_node_seq.push_back(fn.seqNr());
  return nullptr;
}

void node_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {
  if (!tl_node_seq.empty()) tl_node_seq.pop_back();
}

using detail::for_each_tensor;

// The autograd engine wraps each node it runs in a FUNCTION-scope record named
// "autograd::engine::evaluate_function: <Node>". It is not an op: the ops inside it are.
bool transparent(const at::RecordFunction& fn) {
  static constexpr char kPrefix[] = "autograd::engine::evaluate_function";
  return std::strncmp(fn.name(), kPrefix, sizeof(kPrefix) - 1) == 0;
}

// Factories such as aten::ones_like read only the shape of their input, not its bytes (autograd
// seeds backward with ones_like(loss)): their inputs are not uses.
bool reads_inputs(const char* name) {
  const std::size_t n = std::strlen(name);
  return !(n >= 5 && std::strcmp(name + n - 5, "_like") == 0);
}

// In-place ops (aten::add_) and out= overloads write into a tensor they were given.
bool writes_in_place(const at::RecordFunction& fn, const char* name) {
  const std::size_t n = std::strlen(name);
  if (n >= 2 && name[n - 1] == '_' && name[n - 2] != '_') return true;
  const auto op = fn.operator_name();
  return op.has_value() && (op->overload_name == "out" || op->overload_name.rfind("out_", 0) == 0);
}

}  // namespace

Tracer::Impl::Impl(Options options) : options_(std::move(options)) {}

Tracer::Impl::~Impl() { stop(); }

void Tracer::Impl::register_persistent(const torch::Tensor& tensor, const std::string& name,
                                       TensorClass cls) {
  TIDAL_EXPECT(usable(tensor), "register_persistent: '", name, "' is not a tensor with storage");
  const auto* impl = tensor.storage().unsafeGetStorageImpl();
  if (persistent_index_.count(impl) != 0) return;
  persistent_index_.emplace(impl, persistent_.size());
  persistent_.push_back(Persistent{tensor.storage().getWeakStorageImpl(), name, cls});
}

void Tracer::Impl::start() {
  if (started_) return;
  Tracer::Impl* expected = nullptr;
  TIDAL_EXPECT(g_tracer.compare_exchange_strong(expected, this),
               "another tidal Tracer is already recording in this process; stop it first");
  owner_thread_ = tl_thread_id;
  function_handle_ =
      at::addThreadLocalCallback(at::RecordFunctionCallback(&function_start, &function_end)
                                     .needsInputs(true)
                                     .needsOutputs(true)
                                     .scopes({at::RecordScope::FUNCTION}));
  backward_handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&node_start, &node_end)
                                                    .scopes({at::RecordScope::BACKWARD_FUNCTION}));
  started_ = true;
}

void Tracer::Impl::stop() {
  if (!started_) return;
  recording_.store(false);
  at::removeCallback(function_handle_);
  at::removeCallback(backward_handle_);
  g_tracer.store(nullptr, std::memory_order_release);
  started_ = false;
}

double Tracer::Impl::now() const {
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - iteration_start_).count();
  if (!options_.io_wait_seconds) return wall;
  return wall - (options_.io_wait_seconds() - io_wait_at_start_);
}

TensorId Tracer::Impl::add_tensor(const c10::Storage& storage, const c10::Device& device,
                                  std::string name, TensorClass cls, bool persistent,
                                  OpIndex producer, std::int32_t slot) {
  trace::Tensor t;
  t.id = static_cast<TensorId>(current_.tensors.size());
  t.name = std::move(name);
  t.bytes = storage.nbytes();
  t.device = device.str();
  t.cls = cls;
  t.persistent = persistent;
  t.producer = producer;
  t.output_slot = slot;
  current_.tensors.push_back(std::move(t));
  extra_.emplace_back();
  const auto* impl = storage.unsafeGetStorageImpl();
  ids_.emplace(impl, current_.tensors.back().id);
  if (!persistent) live_.push_back(Live{storage.getWeakStorageImpl(), current_.tensors.back().id});
  return current_.tensors.back().id;
}

TensorId Tracer::Impl::lookup_or_add_input(const at::Tensor& t) {
  const auto* impl = t.storage().unsafeGetStorageImpl();
  auto it = ids_.find(impl);
  if (it != ids_.end()) return it->second;
  if (auto c = carry_index_.find(impl); c != carry_index_.end()) {
    const Carried& from = carry_[c->second];
    auto strong = from.storage.lock();
    if (strong && strong.get() == impl && carried_by_slot_.count({from.producer, from.slot}) == 0) {
      // Made by op `producer` of the last iteration: the same tensor as what that op makes in
      // this one, alive across the boundary. A tensor with a gap if it dies before the op makes
      // it anew (join_carried() decides at the end).
      const auto id =
          add_tensor(t.storage(), t.device(),
                     "op" + std::to_string(from.producer) + ":" + std::to_string(from.slot),
                     TensorClass::kTemporary, true, from.producer, from.slot);
      auto& x = extra_[static_cast<std::size_t>(id)];
      x.carried = true;
      x.first_use = static_cast<OpIndex>(current_.ops.size());
      live_.push_back(Live{t.storage().getWeakStorageImpl(), id});
      carried_by_slot_[{from.producer, from.slot}] = id;
      return id;
    }
  }
  // Not registered and not made by a recorded op: created before the iteration or outside the
  // observed ops. Kept as an input; it becomes persistent if it outlives the iteration.
  const auto id = add_tensor(t.storage(), t.device(), "extern:" + std::to_string(extern_count_++),
                             TensorClass::kInput, false, trace::kNoOp, -1);
  extra_[static_cast<std::size_t>(id)].external = true;
  extra_[static_cast<std::size_t>(id)].first_use = static_cast<OpIndex>(current_.ops.size());
  return id;
}

void Tracer::Impl::collect_frees() {
  const auto last = static_cast<OpIndex>(current_.ops.size()) - 1;
  std::size_t kept = 0;
  for (auto& l : live_) {
    if (l.storage.expired()) {
      current_.tensors[static_cast<std::size_t>(l.id)].freed_after = last;
      ids_.erase(l.storage._unsafe_get_target());
    } else {
      live_[kept++] = std::move(l);
    }
  }
  live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(kept), live_.end());
}

std::unique_ptr<at::ObserverContext> Tracer::Impl::on_op_start(const at::RecordFunction& fn) {
  const int depth = tl_depth++;
  if (!recording_.load(std::memory_order_acquire) || depth > 0) return nullptr;
  // Threads that inherited the loop thread's callbacks (c10d's gloo workers copy its thread-local
  // state) but run no op of the step: their ops would enter the trace at whatever point they
  // happen to run. Autograd's workers do run the step's ops, inside backward nodes.
  if (tl_thread_id != owner_thread_ && tl_node_seq.empty()) return nullptr;
  bool expected = false;
  // Another thread's op is running: this is work it spawned (intra-op parallelism), not a new op.
  if (!busy_.compare_exchange_strong(expected, true)) return nullptr;
  busy_thread_.store(tl_thread_id);

  std::vector<TensorRef> refs;
  std::unique_lock<std::mutex> lock(mutex_);
  collect_frees();
  trace::Op op;
  op.index = static_cast<OpIndex>(current_.ops.size());
  op.name = fn.name();
  const bool in_node = !tl_node_seq.empty();
  if (in_node) {
    op.phase = Phase::kBackward;
  } else if (phase_told_) {
    op.phase = static_cast<Phase>(phase_.load());
  } else {
    // A loop that says nothing of phases: ops that build a graph are forward, the rest (the
    // optimizer runs under NoGradGuard) are "other".
    op.phase = at::GradMode::is_enabled() ? Phase::kForward : Phase::kOther;
  }
  if (in_node) {
    // The autograd node was created by the forward op whose starting sequence number is the
    // largest one not above the node's.
    const auto seq = tl_node_seq.back();
    auto it = forward_seq_layer_.upper_bound(seq);
    if (seq >= 0 && it != forward_seq_layer_.begin()) op.layer = std::prev(it)->second;
  } else if (op.phase == Phase::kForward) {
    op.layer = static_cast<std::int32_t>(layer_.load());
    if (fn.seqNr() >= 0) forward_seq_layer_[fn.seqNr()] = op.layer;
  }
  const auto& inputs = reads_inputs(fn.name()) ? fn.inputs() : c10::ArrayRef<const c10::IValue>();
  for (const auto& v : inputs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!traced(t, options_.device)) return;
      const auto id = lookup_or_add_input(t);
      push_unique(op.inputs, id);
      if (listener_ != nullptr) refs.push_back({id, t.storage().unsafeGetStorageImpl()});
      if (op.phase == Phase::kBackward)
        extra_[static_cast<std::size_t>(id)].read_in_backward = true;
    });
  }
  auto ctx = std::make_unique<OpContext>();
  ctx->index = op.index;
  const std::string name = listener_ != nullptr ? op.name : std::string();
  current_.ops.push_back(std::move(op));
  lock.unlock();
  // Outside the lock: the listener may wait for a read before the op can run.
  if (listener_ != nullptr) listener_->before_op(ctx->index, name, refs);
  if (measuring_workspace()) {
    fold_peak();
    options_.reset_peak();
    ctx->bytes_before = options_.current_bytes();
  }
  if (keep_iterations_) detail::sync_current_stream(options_.device);  // device time (see Options)
  current_.ops[static_cast<std::size_t>(ctx->index)].start_s = now();
  return ctx;
}

void Tracer::Impl::on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  --tl_depth;
  if (ctx == nullptr) {
    note_nested_outputs(fn);
    return;
  }
  if (keep_iterations_) detail::sync_current_stream(options_.device);
  const double end = now();
  const std::uint64_t op_peak = op_peak_bytes(*static_cast<OpContext*>(ctx));
  std::unique_lock<std::mutex> lock(mutex_);
  const auto index = static_cast<OpContext*>(ctx)->index;
  auto& op = current_.ops[static_cast<std::size_t>(index)];
  op.end_s = end;
  op.workspace_bytes = op_peak;
  const std::int32_t slot = record_outputs(fn, index);
  std::vector<TensorRef> refs = adopt_nested_outputs(index, slot);
  if (listener_ != nullptr) {
    append_output_refs(fn, refs);
    lock.unlock();
    listener_->after_op(index, refs);
  }
  busy_.store(false);
}

// A nested op of the recorded one: remember storages it creates, in case they outlive the
// recorded op (saved for backward) and so belong to it.
void Tracer::Impl::note_nested_outputs(const at::RecordFunction& fn) {
  if (!busy_.load() || busy_thread_.load() != tl_thread_id) return;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& v : fn.outputs()) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (traced(t, options_.device) && ids_.count(t.storage().unsafeGetStorageImpl()) == 0) {
        nested_outputs_.push_back(t.storage().getWeakStorageImpl());
      }
    });
  }
}

// The meter's peak during the op, made into a workspace in finish_iteration (0 when the
// workspace is not measured).
std::uint64_t Tracer::Impl::op_peak_bytes(const OpContext& ctx) {
  if (!measuring_workspace()) return 0;
  const std::uint64_t op_peak = std::max(options_.peak_bytes(), ctx.bytes_before);
  fold_peak();
  return op_peak;
}

// With mutex_ held: storage becomes output `slot` of op `index`.
void Tracer::Impl::add_output(OpIndex index, std::int32_t slot, const c10::Storage& storage,
                              const c10::Device& device) {
  auto& op = current_.ops[static_cast<std::size_t>(index)];
  // A carried tensor whose last-iteration storage has died is made anew here: same tensor.
  if (auto c = carried_by_slot_.find({index, slot}); c != carried_by_slot_.end()) {
    const auto id = c->second;
    auto& x = extra_[static_cast<std::size_t>(id)];
    if (!x.reproduced &&
        current_.tensors[static_cast<std::size_t>(id)].freed_after != trace::kNoOp) {
      x.reproduced = true;
      x.remade = storage.getWeakStorageImpl();
      x.producer_phase = op.phase;
      ids_.emplace(storage.unsafeGetStorageImpl(), id);
      op.outputs.push_back(id);
      return;
    }
  }
  const auto id =
      add_tensor(storage, device, "op" + std::to_string(index) + ":" + std::to_string(slot),
                 TensorClass::kTemporary, false, index, slot);
  extra_[static_cast<std::size_t>(id)].producer_phase = op.phase;
  op.outputs.push_back(id);
}

// With mutex_ held: the tensors op `index` returned are new outputs, tensors it wrote in place,
// or views of tensors it was given (inputs). Returns the number of output slots seen.
std::int32_t Tracer::Impl::record_outputs(const at::RecordFunction& fn, OpIndex index) {
  auto& op = current_.ops[static_cast<std::size_t>(index)];
  const bool in_place = writes_in_place(fn, op.name.c_str());
  std::int32_t slot = 0;
  for (const auto& v : fn.outputs()) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (traced(t, options_.device)) {
        auto it = ids_.find(t.storage().unsafeGetStorageImpl());
        if (it == ids_.end()) {
          add_output(index, slot, t.storage(), t.device());
        } else if (in_place) {
          push_unique(op.outputs, it->second);
        } else {
          push_unique(op.inputs, it->second);  // a view or alias of a tensor it was given
        }
      }
      ++slot;
    });
  }
  return slot;
}

// With mutex_ held: tensors op `index`'s nested ops made that outlive it (matmul's reshaped
// copies saved for backward) are its outputs too, from `slot` on, for the trace and for the
// listener, which may have to move them. Returns the listener's references to them.
std::vector<TensorRef> Tracer::Impl::adopt_nested_outputs(OpIndex index, std::int32_t slot) {
  std::vector<TensorRef> refs;
  for (auto& weak : nested_outputs_) {
    if (weak.expired() || ids_.count(weak._unsafe_get_target()) != 0) continue;
    auto strong = weak.lock();
    if (!strong) continue;
    c10::Storage storage(std::move(strong));
    add_output(index, slot, storage, storage.device());
    if (listener_ != nullptr) {
      auto it = ids_.find(storage.unsafeGetStorageImpl());
      if (it != ids_.end()) refs.push_back({it->second, storage.unsafeGetStorageImpl()});
    }
    ++slot;
  }
  nested_outputs_.clear();
  return refs;
}

// With mutex_ held: appends the listener's references to the tensors the op returned.
void Tracer::Impl::append_output_refs(const at::RecordFunction& fn, std::vector<TensorRef>& refs) {
  for (const auto& v : fn.outputs()) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!traced(t, options_.device)) return;
      auto it = ids_.find(t.storage().unsafeGetStorageImpl());
      if (it != ids_.end()) refs.push_back({it->second, t.storage().unsafeGetStorageImpl()});
    });
  }
}

bool Tracer::Impl::measuring_workspace() const {
  return keep_iterations_ && options_.current_bytes && options_.peak_bytes && options_.reset_peak;
}

void Tracer::Impl::fold_peak() {
  if (!options_.peak_bytes) return;
  const std::uint64_t p = options_.peak_bytes();
  std::uint64_t seen = step_peak_.load();
  while (p > seen && !step_peak_.compare_exchange_weak(seen, p)) {
  }
}

BoundTensors Tracer::Impl::alive_tensors() {
  std::lock_guard<std::mutex> lock(mutex_);
  // During a step, tensors freed so far leave the trace's live set; after it (the iteration is
  // folded and current_ is empty) the ones the caller has let go since are only skipped.
  if (!current_.tensors.empty()) collect_frees();
  BoundTensors out;
  out.reserve(live_.size());
  for (const auto& l : live_) {
    if (!l.storage.expired()) out.emplace_back(l.id, l.storage);
  }
  // Registered persistent tensors (weights, gradients, optimizer state) are not among the
  // tensors watched for frees: add them with the ids this iteration gave them.
  for (const auto& p : persistent_) {
    auto strong = p.storage.lock();
    if (!strong) continue;
    auto it = ids_.find(strong.get());
    if (it != ids_.end()) out.emplace_back(it->second, p.storage);
  }
  return out;
}

std::uint64_t Tracer::Impl::step_peak() const {
  const std::uint64_t now = options_.peak_bytes ? options_.peak_bytes() : 0;
  return std::max(now, step_peak_.load());
}

}  // namespace tidal::torch_layer
