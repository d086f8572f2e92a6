// Plans before step 0 (Session::plan_ahead): from traces of the loop made without running it
// (Python's tidal.fake_trace, the user's step under FakeTensorMode), so that the first steps run
// a plan instead of on-demand eviction under the wall.
#include "torch/session/session_impl.hpp"

namespace tidal::torch_layer {

std::vector<trace::Trace> Session::recorded_iterations() const {
  if (!impl_->tracer || impl_->state != SessionState::kProfiling) return {};
  return impl_->tracer->iterations();
}

namespace {

std::uint64_t largest_operand(const trace::Trace& t) {
  std::uint64_t most = 0;
  for (const auto& op : t.ops) {
    if (op.name == kStepEndOp) continue;
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (const auto id : *ids) {
        most = std::max(most, t.tensors[static_cast<std::size_t>(id)].bytes);
      }
    }
  }
  return most;
}

}  // namespace

void Session::plan_ahead(trace::Trace first, trace::Trace steady) {
  Impl& m = *impl_;
  TIDAL_EXPECT_AS(InvalidArgument, m.opt.mode == OffloadMode::kPlan,
                  "plan_ahead is for plan mode (Session(mode=\"plan\"))");
  TIDAL_EXPECT_AS(InvalidArgument,
                  m.state == SessionState::kWarmup && m.steps_in_state == 0 && !m.in_step &&
                      !m.tracer && m.shapes.empty(),
                  "plan_ahead comes before the session's first step");
  trace::validate(first);
  trace::validate(steady);
  const auto peak_live = [](const trace::Trace& t) {
    return trace::analyze_lifetimes(t).summary.peak_live_bytes;
  };
  // What the meter holds that the traces do not (memory no op of the step touches) is charged
  // to every step, as after profiling. The traces have no workspaces (nothing ran, so nothing
  // measured the temporaries inside an op): the largest tensor an op reads or writes is set
  // aside for them, and executed steps over the budget tighten the plan as after profiling.
  const std::uint64_t traced = bytes_at_start(first);
  const std::uint64_t now = m.current_now();
  m.stats.untouched_bytes = now > traced ? now - traced : 0;
  const std::uint64_t peak = std::max(peak_live(first), peak_live(steady));
  m.stats.profiled_peak =
      m.stats.untouched_bytes + peak + std::max(largest_operand(first), largest_operand(steady));
  std::uint64_t budget = m.opt.memory_budget;
  if (budget == 0) {
    budget = m.stats.untouched_bytes +
             static_cast<std::uint64_t>(m.opt.budget_fraction * static_cast<double>(peak));
  }
  m.stats.memory_budget = budget;
  m.budget_known = true;
  m.start_profiling();  // the tracer, with the options profiling would give it
  // Step 0 runs its own trace's plan, and the steps after it the steady trace's
  // (take_steady_shape). What step 0 makes and keeps (Adam's state, made at the first optimizer
  // step) lives across steps like the state registered later: persistent, so that the plan may
  // write it out after its last use in step 0 (a per-step tensor alive at the step's end has no
  // idle time the planner can use). Before its producer it does not exist: the executor finds
  // nothing bound to its id there and skips it.
  for (auto& t : first.tensors) {
    if (!t.persistent && t.producer != trace::kNoOp && t.freed_after == trace::kNoOp) {
      t.persistent = true;
    }
  }
  m.plan_or_stop([&] {
    if (m.opt.between_steps == BetweenSteps::kAuto && m.boundary < 0) m.choose_boundary(steady);
    m.add_shape(std::move(first));
  });
  m.bind_by_name_next_step = true;
  m.state = SessionState::kExecuting;
  m.steps_in_state = 0;
  m.ahead_steady = std::move(steady);
  m.stats.planned_ahead = true;
}

void Session::Impl::bind_persistent_by_name() {
  if (!executor || shapes.empty()) return;
  std::map<std::string, const Registered*> by_name;
  for (const auto& r : persistent) by_name.emplace(r.name, &r);
  BoundTensors bound;
  for (const auto& t : shapes.front().trace.tensors) {
    if (!t.persistent || t.producer != trace::kNoOp) continue;
    auto it = by_name.find(t.name);
    if (it == by_name.end()) continue;
    const torch::Tensor& x = it->second->tensor;
    if (x.defined() && x.has_storage()) bound.emplace_back(t.id, x.storage().getWeakStorageImpl());
  }
  executor->bind_alive(bound);
}

void Session::Impl::take_steady_shape() {
  trace::Trace t = std::move(*ahead_steady);
  ahead_steady.reset();
  bind_by_name_next_step = true;
  if (boundary_offloaded()) strip_step_end(t);
  Shape& s = shapes.front();
  s.trace = std::move(t);
  s.peak_live = static_cast<double>(trace::analyze_lifetimes(s.trace).summary.peak_live_bytes);
  s.tightenings = 0;
  s.retimings = 0;
  replan(0, capacity_for(s));
}

}  // namespace tidal::torch_layer
