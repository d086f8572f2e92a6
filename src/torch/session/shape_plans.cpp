// The plans of the session's step shapes: profiling, planning at the capacity the budget leaves,
// the boundary between steps, tightening a plan that went over, and new shapes as they appear.
#include "torch/session/session_impl.hpp"

namespace tidal::torch_layer {

void Session::Impl::start_profiling() {
  const bool keep = executor && executor->planless();
  if (!keep) {
    lift_cap();
    executor.reset();  // brings every moved tensor back
  }
  tracer.reset();
  Tracer::Options to;
  to.model = opt.model_name;
  to.batch = opt.batch;
  to.seq = opt.seq;
  // kAuto profiles with the step-end op: the first plan decides whether to keep it.
  to.step_end_op = opt.between_steps != BetweenSteps::kOffloaded && boundary != 1;
  to.current_bytes = opt.current_bytes;
  to.peak_bytes = opt.peak_bytes;
  to.reset_peak = opt.reset_peak;
  to.device = opt.device;
  if (keep) {
    PlanExecutor* ex = executor.get();
    to.io_wait_seconds = [ex] { return ex->io_wait_seconds(); };
  }
  tracer = std::make_unique<Tracer>(to);
  for (const auto& r : persistent) tracer->register_persistent(r.tensor, r.name, r.cls);
  tracer->start();
  state = SessionState::kProfiling;
  steps_in_state = 0;
}

plan::Plan Session::Impl::plan_for(const Shape& shape, double& capacity, bool& at_floor) {
  PlanAttempt attempt(*this, shape.trace);
  at_floor = false;
  if (std::optional<plan::Plan> p = attempt.at(capacity)) {
    adopt_min_bytes(attempt.least);
    at_floor = !p->summary.fits;
    return *p;
  }
  if (opt.strict_budget) std::rethrow_exception(attempt.first_refusal);
  stats.budget_reason = attempt.first_reason;
  // The active tensors alone exceed the capacity somewhere: find the least capacity that plans.
  at_floor = true;
  double lo = capacity;
  double hi = shape.peak_live + 1;  // everything kept: always plans
  std::optional<plan::Plan> best;
  std::uint64_t best_least = opt.executor.min_bytes;
  for (int i = 0; i < 12 && hi - lo > 4096; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (std::optional<plan::Plan> p = attempt.at(mid)) {
      best = std::move(p);
      best_least = attempt.least;
      hi = mid;
    } else {
      lo = mid;
    }
  }
  capacity = hi;
  if (!best) {
    best = attempt.at(hi);
    best_least = attempt.least;
    TIDAL_EXPECT(best.has_value(), "no plan keeps every tensor in memory (", hi,
                 " bytes of device memory)");
  }
  adopt_min_bytes(best_least);
  return *best;
}

void Session::Impl::adopt_min_bytes(std::uint64_t least) {
  if (least >= opt.executor.min_bytes) return;
  const std::string why = "no plan meets the budget with tensors under " +
                          bytes_text(opt.executor.min_bytes) +
                          " kept in memory (the smallest size moved): tensors of " +
                          bytes_text(least) + " and more are moved";
  add_notice(why);
  opt.executor.min_bytes = least;
  if (executor) executor->set_min_bytes(least);
}

void Session::Impl::summarise(const Shape& s) {
  const auto& p = s.plan;
  char line[512];
  std::snprintf(
      line, sizeof line,
      "plan %zu: %zu actions, %s to SSD and %s to host per step, planned peak %s "
      "of %s (trace units), planned stall %.3f s, planned in %.2f s, SSD %s, I/O compute "
      "%.2f/%.2f/%.2f ns/B",
      shapes.size() - 1, p.actions.size(), bytes_text(p.summary.bytes_to_ssd).c_str(),
      bytes_text(p.summary.bytes_to_host).c_str(), bytes_text(p.summary.peak_after_bytes).c_str(),
      bytes_text(static_cast<std::uint64_t>(s.capacity)).c_str(), p.summary.planned_stall_seconds,
      p.summary.planning_seconds, measured_ssd.empty() ? "preset" : measured_ssd.c_str(),
      io_compute[plan::index_of(plan::Channel::kSsdWrite)] * 1e9,
      io_compute[plan::index_of(plan::Channel::kSsdRead)] * 1e9,
      io_compute[plan::index_of(plan::Channel::kHostWrite)] * 1e9);
  stats.plan_summary = line;
}

double Session::Impl::capacity_for(const Shape& s) const {
  const auto unseen = std::max(0.0, static_cast<double>(stats.profiled_peak) - s.peak_live);
  return std::max(0.0, static_cast<double>(stats.memory_budget) - unseen);
}

std::uint64_t Session::Impl::executor_budget(const Shape& added) const {
  double reachable = static_cast<double>(stats.memory_budget);
  const auto floor_of = [&](const Shape& s) {
    if (!s.at_floor) return;
    const double unseen = static_cast<double>(stats.memory_budget) - capacity_for(s);
    reachable = std::max(reachable, s.capacity + unseen);
  };
  for (const auto& s : shapes) floor_of(s);
  floor_of(added);
  return static_cast<std::uint64_t>(reachable);
}

bool Session::Impl::boundary_offloaded() const {
  return opt.between_steps == BetweenSteps::kOffloaded ||
         (opt.between_steps == BetweenSteps::kAuto && boundary == 1);
}

void Session::Impl::strip_step_end(trace::Trace& t) {
  if (t.ops.empty() || t.ops.back().name != kStepEndOp) return;
  t.ops.pop_back();
  const auto last = static_cast<trace::OpIndex>(t.ops.size()) - 1;
  for (auto& x : t.tensors) {
    if (x.freed_after != trace::kNoOp && x.freed_after > last) x.freed_after = last;
  }
}

void Session::Impl::choose_boundary(const trace::Trace& t) {
  Shape probe;
  probe.trace = t;
  probe.peak_live =
      static_cast<double>(trace::analyze_lifetimes(probe.trace).summary.peak_live_bytes);
  probe.capacity = capacity_for(probe);
  bool floor = true;
  try {
    (void)plan_for(probe, probe.capacity, floor);
  } catch (const InvalidArgument&) {
    floor = true;  // strict_budget: no plan meets it with the boundary resident
  }
  boundary = floor ? 1 : 0;
  if (boundary == 1) {
    stats.budget_reason.clear();  // the resident attempt's: the offloaded plan says its own
    tracer->set_step_end_op(false);
    stats.notice =
        "the model's tensors stay on the SSD between steps where the budget needs it (no plan "
        "meets it with all of them in memory at each step's end): ATen ops bring them back "
        "by themselves, and code that reads raw bytes between steps (torch::save, data_ptr) "
        "calls make_resident() first (Python's state_dict() of the session's model and "
        "optimizer does it); the between-steps option chooses explicitly";
  }
}

void Session::Impl::add_shape(trace::Trace t) {
  refuse_compiled_code(t);
  if (opt.between_steps == BetweenSteps::kAuto && boundary < 0) choose_boundary(t);
  if (boundary_offloaded()) strip_step_end(t);
  stats.between_steps = boundary_offloaded() ? "offloaded" : "resident";
  Shape s;
  s.trace = std::move(t);
  s.peak_live = static_cast<double>(trace::analyze_lifetimes(s.trace).summary.peak_live_bytes);
  s.capacity = capacity_for(s);
  s.plan = plan_for(s, s.capacity, s.at_floor);
  const bool first = !executor || executor->planless();
  if (executor && !first) {
    executor->add_shape(s.trace, s.plan);
    ++stats.replans;
    set_wall(executor_budget(s));
  } else {
    if (executor) {  // it ran the steps before this plan under the wall: it takes the plan
      executor->add_shape(s.trace, s.plan);
      set_wall(executor_budget(s));
    } else {
      ExecutorOptions eo = opt.executor;
      eo.budget = executor_budget(s);  // hard: the executor waits rather than go over
      wall = eo.budget;
      eo.current_bytes = opt.current_bytes;
      eo.host = host;
      executor = std::make_unique<PlanExecutor>(store, s.trace, s.plan, eo);
      // Executed steps' op times without the executor's waits (retiming.cpp).
      PlanExecutor* ex = executor.get();
      tracer->set_io_wait_clock([ex] { return ex->io_wait_seconds(); });
    }
    executor->bind_alive(tracer->alive_tensors());
    tracer->set_keep_iterations(false);
    tracer->set_listener(executor.get());
    trace = s.trace;
    plan = s.plan;
  }
  shapes.push_back(std::move(s));
  summarise(shapes.back());
  stats.shapes = static_cast<int>(shapes.size());
}

void Session::Impl::make_first_plan() {
  // Group the profiled steps by their ops: the shape seen most (the latest on a tie) is
  // planned now, the others wait until they are seen again.
  std::map<std::vector<std::string>, std::vector<trace::Trace>> by_shape;
  for (const auto& it : tracer->iterations()) by_shape[trace::op_names(it)].push_back(it);
  auto best = by_shape.end();
  for (auto it = by_shape.begin(); it != by_shape.end(); ++it) {
    if (best == by_shape.end() || it->second.size() >= best->second.size()) best = it;
  }
  const std::uint64_t measured = stats.profiled_peak;
  const trace::Trace& last = best->second.back();
  const std::uint64_t traced_at_start = bytes_at_start(last);
  stats.untouched_bytes =
      profiled_current > traced_at_start ? profiled_current - traced_at_start : 0;
  std::uint64_t budget = opt.memory_budget;
  if (budget == 0) {
    TIDAL_EXPECT_AS(InvalidArgument, measured > 0,
                    "plan mode needs a memory budget in bytes, or a memory meter to take a "
                    "share of the measured peak");
    const std::uint64_t used =
        measured > stats.untouched_bytes ? measured - stats.untouched_bytes : 0;
    budget = stats.untouched_bytes +
             static_cast<std::uint64_t>(opt.budget_fraction * static_cast<double>(used));
  }
  stats.memory_budget = budget;
  budget_known = true;
  trace::Trace folded = fold_iterations(best->second).trace;
  for (auto& [names, traces] : by_shape) {
    if (names != best->first) pending[names] = std::move(traces);
  }
  add_shape(std::move(folded));
  state = SessionState::kExecuting;
  steps_in_state = 0;
}

void Session::Impl::after_executed_step(const ExecutorStats& e, std::uint64_t peak) {
  if (e.diverged || e.shape < 0) {
    if (stats.planned_ahead && !ahead_left_said && e.diverged) {
      ahead_left_said = true;
      add_notice("a step left the plan made ahead (" + e.divergence +
                 "): its ops are profiled and planned as a new step shape (plan_ahead's step "
                 "must run the same ops as the loop's, without .item() or printing of values)");
    }
    const trace::Trace* t = tracer->last_iteration();
    if (t == nullptr) return;
    auto names = trace::op_names(*t);
    auto it = pending.find(names);
    if (it == pending.end()) {
      if (pending.size() >= kMaxPendingShapes) pending.erase(pending.begin());
      pending[names].push_back(*t);
      return;
    }
    it->second.push_back(*t);
    trace::Trace folded = fold_iterations(it->second).trace;
    pending.erase(it);
    add_shape(std::move(folded));
    return;
  }
  // A known shape ran to its end: its peak counts against the budget.
  ++stats.steps_measured;
  stats.executed_peak = std::max(stats.executed_peak, peak);
  Shape& s = shapes[static_cast<std::size_t>(e.shape)];
  if (peak <= stats.memory_budget) {
    // Within the budget. If only thanks to evictions (the executor's last resort, paid in
    // write stalls and misses), the plan is made again for that much less memory, so that
    // it keeps the budget by itself.
    // The executor evicts before an op when the meter and what the trace says the op makes
    // would cross the budget; what an op makes can be less than the trace's figure (a
    // foreach op's outputs, say). When the step's peak with every evicted byte added back
    // is still within the budget, the evictions were not needed and the plan stands:
    // tightening for them would lower the capacity step after step until nothing plans.
    const std::uint64_t without = peak + e.evicted_bytes;
    if (e.evictions == 0 || without <= stats.memory_budget) {
      s.tightenings = 0;
    } else if (!s.at_floor && s.tightenings < kMaxTightenings) {
      tighten(e.shape, static_cast<double>(std::min<std::uint64_t>(e.eviction_overshoot,
                                                                   without - stats.memory_budget)));
      return;
    }
    note_executed_times(e.shape);
    return;
  }
  all_within = false;
  ++stats.steps_over_budget;
  if (s.at_floor || s.tightenings >= kMaxTightenings) {
    if (stats.budget_reason.empty()) {
      stats.budget_reason = "step shape " + std::to_string(e.shape) + " peaked at " +
                            bytes_text(peak) + " over the budget of " +
                            bytes_text(stats.memory_budget) +
                            " and its plan cannot be made tighter";
    }
    return;
  }
  // What the meter saw over the budget is taken off the planner's capacity, and a little more.
  tighten(e.shape, static_cast<double>(peak - stats.memory_budget));
}

void Session::Impl::tighten(int index, double over) {
  Shape& s = shapes[static_cast<std::size_t>(index)];
  ++s.tightenings;
  ++stats.tightenings;
  ++stats.replans;
  replan(index, std::max(0.0, s.capacity - over - 0.01 * static_cast<double>(stats.memory_budget)));
  // The new plan is judged on its own steps.
  all_within = true;
  stats.steps_measured = 0;
  stats.executed_peak = 0;
}

void Session::Impl::replan(int index, double capacity) {
  bool floor = false;
  plan::Plan p = plan_for(shapes[static_cast<std::size_t>(index)], capacity, floor);
  install_plan(index, std::move(p), capacity, floor);
}

void Session::Impl::install_plan(int index, plan::Plan p, double capacity, bool at_floor) {
  Shape& s = shapes[static_cast<std::size_t>(index)];
  s.capacity = capacity;
  s.at_floor = at_floor;
  s.plan = std::move(p);
  s.planned_memory.clear();
  s.executed_times.clear();
  executor->replace_plan(index, s.trace, s.plan);
  set_wall(executor_budget(s));
  if (index == 0) {
    plan = s.plan;
    trace = s.trace;
  }
  summarise(s);
}

}  // namespace tidal::torch_layer
