// Op times from executed steps. The profile samples a process's first steps, which on a CPU run
// slower or faster than the steps after them (memory first touched, thread pools started,
// another process's load come and gone); a plan on those times misjudges what I/O hides behind.
// Executed steps of a known shape record the same ops with the executor's waits left out
// (Tracer::set_io_wait_clock); their medians replace the profile's where the two differ.
#include "torch/session/session_impl.hpp"

namespace tidal::torch_layer {

namespace {

double median_of(std::vector<double>& v) {
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

// An executed step's op times, (duration, host time after it) per op of the shape; nullopt when
// the step had other ops than the shape's (a step-end op is the only extra allowed). The names
// need no check: the executor followed them op by op, and a step that left them diverged.
std::optional<std::vector<double>> op_times(const trace::Trace& executed,
                                            const trace::Trace& shape) {
  const auto& ops = shape.ops;
  if (executed.ops.size() != ops.size() &&
      !(executed.ops.size() == ops.size() + 1 && executed.ops.back().name == kStepEndOp)) {
    return std::nullopt;
  }
  std::vector<double> times(2 * ops.size());
  for (std::size_t k = 0; k < ops.size(); ++k) {
    const double d = std::max(0.0, executed.ops[k].duration());
    times[2 * k] = d;
    times[2 * k + 1] = k + 1 < ops.size() ? std::max(0.0, executed.op_seconds(k) - d) : 0.0;
  }
  return times;
}

}  // namespace

void Session::Impl::note_executed_times(int index) {
  // On a GPU the executed steps' op times are launch times (nothing waits for the stream there).
  if (!opt.device.is_cpu() || !tracer || opt.retime_steps <= 0) return;
  Shape& s = shapes[static_cast<std::size_t>(index)];
  // A plan at its floor is the least memory any plan reaches, with the executor's wall raised to
  // it: planned again, it may land above the floor and lower the wall under what it needs.
  if (s.at_floor) return;
  const trace::Trace* t = tracer->last_iteration();
  if (t == nullptr) return;
  std::optional<std::vector<double>> times = op_times(*t, s.trace);
  if (!times) return;
  s.executed_times.push_back(std::move(*times));
  // A longer window after each change of plan: a machine whose speed keeps moving is followed,
  // more and more slowly, rather than planned for every few steps.
  const int shift = std::min(s.retimings, kMaxRetimeWindowShift);
  if (s.executed_times.size() < static_cast<std::size_t>(opt.retime_steps) << shift) return;
  // Per op, the median over the steps: one slow step moves none.
  std::vector<double> med(s.executed_times.front().size());
  std::vector<double> column(s.executed_times.size());
  for (std::size_t i = 0; i < med.size(); ++i) {
    for (std::size_t r = 0; r < column.size(); ++r) column[r] = s.executed_times[r][i];
    med[i] = median_of(column);
  }
  s.executed_times.clear();
  double executed = 0;
  for (double x : med) executed += x;
  if (executed <= 0) return;
  // On this CPU the plan's transfers took compute from the ops that ran beside them
  // (io_compute: Hardware::compute_seconds_per_byte), which the planner adds by itself: taken
  // out again, spread over the ops, so that it is not counted twice.
  const auto bytes = plan::compile_schedule(s.trace, &s.plan, /*strict=*/false).planned_bytes;
  double io = 0;
  for (std::size_t c = 0; c < bytes.size(); ++c)
    io += static_cast<double>(bytes[c]) * io_compute[c];
  const double scale = std::max(0.5, (executed - io) / executed);
  const double planned = s.trace.compute_seconds();
  if (std::abs(executed * scale - planned) <= kRetimeTolerance * planned) return;
  trace::Trace before = s.trace;  // kept where the new times do not plan as well
  double now = s.trace.ops.empty() ? 0.0 : s.trace.ops.front().start_s;
  for (std::size_t k = 0; k < s.trace.ops.size(); ++k) {
    auto& op = s.trace.ops[k];
    op.start_s = now;
    op.end_s = now + med[2 * k] * scale;
    now = op.end_s + med[2 * k + 1] * scale;
  }
  s.trace.meta["op_durations"] = "median over executed steps";
  // The same capacity and smallest size moved, and a plan that fits there, or none.
  PlanAttempt attempt(*this, s.trace);
  std::optional<plan::Plan> p = attempt.at(s.capacity);
  if (!p || !p->summary.fits || attempt.least < opt.executor.min_bytes) {
    s.trace = std::move(before);
    return;
  }
  ++s.retimings;
  ++stats.retimings;
  install_plan(index, std::move(*p), s.capacity, false);
}

}  // namespace tidal::torch_layer
