// A traced step from its start to its end: the iteration it leaves, checked against the first, its
// tensors carried into the next one, and the folding of iterations into one trace. And Tracer's
// public face, which forwards to its Impl.
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

void Tracer::Impl::begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) {
  step_peak_.store(0);
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = trace::Trace{};
  current_.model = options_.model;
  current_.batch = options_.batch;
  current_.seq = options_.seq;
  current_.meta["tracer"] = "tidal RecordFunction tracer";
  current_.meta["torch_version"] = TORCH_VERSION;
  current_.meta["step"] = std::to_string(step);
  extra_.clear();
  ids_.clear();
  live_.clear();
  nested_outputs_.clear();
  forward_seq_layer_.clear();
  extern_count_ = 0;
  carried_by_slot_.clear();
  carry_index_.clear();
  for (std::size_t i = 0; i < carry_.size(); ++i) {
    if (!carry_[i].storage.expired()) carry_index_[carry_[i].storage._unsafe_get_target()] = i;
  }
  for (const auto& p : persistent_) {
    auto strong = p.storage.lock();
    if (!strong || host_tier_storage(*strong)) continue;  // host memory is not the device's
    c10::Storage storage(std::move(strong));
    add_tensor(storage, storage.device(), p.name, p.cls, true, trace::kNoOp, -1);
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!traced(inputs[i], options_.device)) continue;
    if (ids_.count(inputs[i].storage().unsafeGetStorageImpl()) != 0) continue;
    add_tensor(inputs[i].storage(), inputs[i].device(), "input:" + std::to_string(i),
               TensorClass::kInput, false, trace::kNoOp, -1);
  }
  if (!inputs.empty()) current_.device = inputs.front().device().str();
  phase_.store(static_cast<int>(Phase::kOther));
  phase_told_ = false;
  layer_.store(-1);
  busy_.store(false);
  iteration_start_ = std::chrono::steady_clock::now();
  io_wait_at_start_ = options_.io_wait_seconds ? options_.io_wait_seconds() : 0;
  recording_.store(started_, std::memory_order_release);
}

void Tracer::Impl::begin_phase(Phase phase) {
  phase_told_ = true;
  phase_.store(static_cast<int>(phase));
}

void Tracer::Impl::begin_layer(std::int64_t layer) { layer_.store(layer); }

void Tracer::Impl::end_step(std::int64_t /*step*/) {
  if (!recording_.exchange(false)) return;
  fold_peak();
  std::unique_lock<std::mutex> lock(mutex_);
  collect_frees();
  std::vector<TensorRef> alive;
  OpIndex end_op = trace::kNoOp;
  if (options_.step_end_op) {
    // Every traced tensor still alive is the caller's once the step ends: one op uses them all.
    trace::Op op;
    op.index = end_op = static_cast<OpIndex>(current_.ops.size());
    op.name = kStepEndOp;
    op.phase = Phase::kOther;
    op.start_s = op.end_s = now();
    // Registered storages and the per-iteration ones are disjoint: each id comes once.
    const auto use = [&](TensorId id, c10::StorageImpl* impl) {
      op.inputs.push_back(id);
      alive.push_back({id, impl});
    };
    for (const auto& p : persistent_) {
      auto strong = p.storage.lock();
      if (!strong) continue;
      auto it = ids_.find(strong.get());
      if (it != ids_.end()) use(it->second, strong.get());
    }
    for (const auto& l : live_) {
      auto strong = l.storage.lock();
      if (strong) use(l.id, strong.get());
    }
    current_.ops.push_back(std::move(op));
  }
  finish_iteration();
  lock.unlock();
  // Outside the lock: the listener waits for reads, and may throw the store's error.
  if (listener_ != nullptr && end_op != trace::kNoOp) listener_->step_end(end_op, alive);
}

void Tracer::Impl::abort_step() {
  if (!recording_.exchange(false)) return;
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = trace::Trace{};
  extra_.clear();
  ids_.clear();
  live_.clear();
  // What the broken step made and left alive is not what a whole step leaves: nothing is
  // carried into the next one.
  carry_.clear();
}

// Carried tensors: those that died here before their producer made them anew are tensors with a
// gap (persistent, freed after their last old use, made anew by their producer); the others are
// what they would have been without the carry (inputs of unknown origin). Then the carry for
// the next iteration: what this one's ops made and left alive.
void Tracer::Impl::join_carried() {
  for (auto& t : current_.tensors) {
    auto& x = extra_[static_cast<std::size_t>(t.id)];
    if (!x.carried) continue;
    if (x.reproduced && !x.remade.expired() && t.freed_after != trace::kNoOp &&
        t.freed_after < t.producer) {
      t.cls =
          x.producer_phase == Phase::kBackward ? TensorClass::kGradient : TensorClass::kTemporary;
      continue;
    }
    if (x.reproduced) {  // its new storage died too: that op's output goes untracked
      auto& outs = current_.ops[static_cast<std::size_t>(t.producer)].outputs;
      outs.erase(std::remove(outs.begin(), outs.end(), t.id), outs.end());
    }
    t.persistent = false;
    t.producer = trace::kNoOp;
    t.output_slot = -1;
    t.freed_after = trace::kNoOp;
    t.cls = TensorClass::kInput;
    t.name = "extern:" + std::to_string(extern_count_++);
    x.external = true;
  }
  std::vector<Carried> next;
  for (const auto& l : live_) {
    const auto& t = current_.tensors[static_cast<std::size_t>(l.id)];
    const auto& x = extra_[static_cast<std::size_t>(l.id)];
    if (t.producer != trace::kNoOp && !x.external && !x.carried && !l.storage.expired()) {
      next.push_back(Carried{l.storage, t.producer, t.output_slot});
    }
  }
  for (const auto& t : current_.tensors) {
    const auto& x = extra_[static_cast<std::size_t>(t.id)];
    if (x.carried && x.reproduced && t.has_gap()) {
      next.push_back(Carried{x.remade, t.producer, t.output_slot});
    }
  }
  carry_ = std::move(next);
}

void Tracer::Impl::finish_iteration() {
  join_carried();
  std::vector<bool> alive(current_.tensors.size(), false);
  for (const auto& l : live_) alive[static_cast<std::size_t>(l.id)] = true;
  std::unordered_map<OpIndex, int> made_before;
  for (auto& t : current_.tensors) {
    const auto& x = extra_[static_cast<std::size_t>(t.id)];
    if (t.persistent) continue;
    if (x.external && alive[static_cast<std::size_t>(t.id)]) {
      t.persistent = true;  // made before the iteration and kept: e.g. an unregistered buffer
    } else if (x.external && x.first_use != trace::kNoOp) {
      // Made during the iteration by code that is not a dispatched op (a scalar wrapped into a
      // tensor inside a backward formula, say) and dead before the end: it belongs to the op
      // that first used it. Slots from 100 up keep these names apart from real outputs.
      auto& op = current_.ops[static_cast<std::size_t>(x.first_use)];
      const int j = made_before[x.first_use]++;
      t.producer = x.first_use;
      t.output_slot = 100 + j;
      t.name = "op" + std::to_string(x.first_use) + ":" + std::to_string(t.output_slot);
      push_unique(op.outputs, t.id);
      t.cls = op.phase == Phase::kForward && x.read_in_backward ? TensorClass::kActivation
                                                                : TensorClass::kTemporary;
    } else if (t.producer != trace::kNoOp) {
      t.cls = x.producer_phase == Phase::kForward && x.read_in_backward ? TensorClass::kActivation
                                                                        : TensorClass::kTemporary;
    }
  }
  current_.meta["iterations_recorded_before"] = std::to_string(iterations_.size());
  trace::validate(current_);
  if (measuring_workspace()) {
    // Each op's workspace: what the meter saw at its peak during the op beyond the trace's live
    // tensors there (temporaries, memory no op of the step touches, allocator padding), so that
    // live bytes + workspace at every op are what the meter measured.
    std::vector<std::uint64_t> peaks(current_.ops.size());
    for (std::size_t k = 0; k < peaks.size(); ++k) {
      peaks[k] = current_.ops[k].workspace_bytes;
      current_.ops[k].workspace_bytes = 0;
    }
    const auto live = trace::analyze_lifetimes(current_).live_bytes;
    for (std::size_t k = 0; k < peaks.size(); ++k) {
      current_.ops[k].workspace_bytes = peaks[k] > live[k] ? peaks[k] - live[k] : 0;
    }
    current_.meta["workspace_bytes"] = "meter peak per op beyond the live tensors";
  }

  std::vector<std::string> names = trace::op_names(current_);
  if (iterations_.empty()) {
    reference_names_ = std::move(names);
  } else if (divergence_.empty() && names != reference_names_) {
    std::size_t k = 0;
    while (k < names.size() && k < reference_names_.size() && names[k] == reference_names_[k]) ++k;
    const auto at = [](const std::vector<std::string>& v, std::size_t i) {
      return i < v.size() ? "'" + v[i] + "'" : std::string("the end of the iteration");
    };
    divergence_ = "profiled iteration " + std::to_string(iterations_.size()) +
                  " diverges from iteration 0 at op " + std::to_string(k) + ": " + at(names, k) +
                  " instead of " + at(reference_names_, k) + " (" + std::to_string(names.size()) +
                  " ops vs " + std::to_string(reference_names_.size()) + ")";
  }
  // While a plan runs, iterations are not kept: the last one is moved, not copied, each step.
  if (keep_iterations_ || iterations_.empty()) iterations_.push_back(current_);
  last_ = std::move(current_);
  has_last_ = true;
  current_ = trace::Trace{};
}

ProfileResult Tracer::Impl::result() const {
  TIDAL_EXPECT(!iterations_.empty(),
               "the tracer recorded no iteration; run at least one step "
               "between start() and the call to result()");
  ProfileResult r = fold_iterations(iterations_);
  if (!divergence_.empty()) {
    r.consistent = false;
    r.divergence = divergence_;
    r.trace.meta["consistent"] = "false";
  }
  return r;
}

ProfileResult fold_iterations(const std::vector<trace::Trace>& iterations) {
  TIDAL_EXPECT(!iterations.empty(), "no iteration to fold into a profile");
  ProfileResult r;
  r.iterations = static_cast<std::int64_t>(iterations.size());
  for (std::size_t i = 1; i < iterations.size() && r.consistent; ++i) {
    const auto& a = iterations[i].ops;
    const auto& b = iterations[0].ops;
    if (a.size() != b.size()) {
      r.consistent = false;
    } else {
      for (std::size_t k = 0; k < a.size(); ++k) {
        if (a[k].name != b[k].name) {
          r.consistent = false;
          r.divergence = "iteration " + std::to_string(i) + " differs from iteration 0 at op " +
                         std::to_string(k) + ": '" + a[k].name + "' instead of '" + b[k].name + "'";
          break;
        }
      }
    }
    if (!r.consistent && r.divergence.empty()) {
      r.divergence = "iteration " + std::to_string(i) + " has " + std::to_string(a.size()) +
                     " ops, iteration 0 has " + std::to_string(b.size());
    }
  }
  r.trace = iterations.back();
  r.trace.meta["iterations"] = std::to_string(r.iterations);
  r.trace.meta["consistent"] = r.consistent ? "true" : "false";
  if (r.consistent && iterations.size() > 1) {
    // Per op, the median duration and the median host time before the next op (what the
    // simulator and the planner count, Trace::op_seconds): one slow iteration moves neither.
    auto& ops = r.trace.ops;
    std::vector<double> durations(iterations.size());
    std::vector<double> gaps(iterations.size());
    double now = ops.empty() ? 0.0 : ops.front().start_s;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      for (std::size_t i = 0; i < iterations.size(); ++i) {
        const trace::Trace& it = iterations[i];
        durations[i] = std::max(0.0, it.ops[k].duration());
        gaps[i] = it.op_seconds(k) - durations[i];
        ops[k].workspace_bytes = std::max(ops[k].workspace_bytes, it.ops[k].workspace_bytes);
      }
      ops[k].start_s = now;
      ops[k].end_s = now + median(durations);
      now = ops[k].end_s + median(gaps);
    }
    r.trace.meta["op_durations"] = "median over iterations";
  }
  return r;
}

Tracer::Tracer(Options options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Tracer::~Tracer() = default;

void Tracer::register_persistent(const torch::Tensor& tensor, const std::string& name,
                                 trace::TensorClass cls) {
  impl_->register_persistent(tensor, name, cls);
}
void Tracer::start() { impl_->start(); }
void Tracer::stop() { impl_->stop(); }
bool Tracer::started() const { return impl_->started(); }
void Tracer::begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) {
  impl_->begin_step(step, inputs);
}
void Tracer::begin_phase(trace::Phase phase) { impl_->begin_phase(phase); }
void Tracer::begin_layer(std::int64_t layer) { impl_->begin_layer(layer); }
void Tracer::end_step(std::int64_t step) { impl_->end_step(step); }
void Tracer::abort_step() { impl_->abort_step(); }
void Tracer::set_listener(OpListener* listener) { impl_->set_listener(listener); }
void Tracer::set_io_wait_clock(std::function<double()> clock) {
  impl_->set_io_wait_clock(std::move(clock));
}
void Tracer::set_keep_iterations(bool keep) { impl_->set_keep_iterations(keep); }
void Tracer::set_step_end_op(bool on) { impl_->set_step_end_op(on); }
BoundTensors Tracer::alive_tensors() { return impl_->alive_tensors(); }
std::uint64_t Tracer::step_peak() const { return impl_->step_peak(); }
const std::vector<trace::Trace>& Tracer::iterations() const { return impl_->iterations(); }
const trace::Trace* Tracer::last_iteration() const { return impl_->last_iteration(); }
ProfileResult Tracer::result() const { return impl_->result(); }

}  // namespace tidal::torch_layer
