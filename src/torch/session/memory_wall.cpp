// The memory wall (the strict meter's cap, or the device's), the planned view the timeline draws
// against, and the notices a session gives.
#include "torch/session/session_impl.hpp"

namespace tidal::torch_layer {

void Session::Impl::set_wall(std::uint64_t bytes) {
  wall = bytes;
  executor->set_budget(bytes);
  if (!cap_on) return;
  if (cap_by_retry) {
    (void)set_device_memory_wall(opt.device, bytes);
  } else {
    set_cpu_memory_cap(bytes);
  }
}

void Session::Impl::apply_cap() {
  if (opt.strict_meter != true || cap_on || !executor || wall == 0) return;
  if (opt.device.is_cpu() && !opt.wall_by_retry) {
    cap_previous = cpu_memory_cap();
    PlanExecutor* ex = executor.get();
    reclaimer_token = set_cpu_memory_reclaimer([ex](std::uint64_t b) { return ex->reclaim(b); });
    PlanExecutor::track_inputs(true);
    set_cpu_memory_cap(wall);
    cap_on = true;
    return;
  }
  cap_previous = opt.device.is_cpu() ? cpu_memory_cap() : 0;
  if (!set_device_memory_wall(opt.device, wall)) {
    if (!cap_unavailable_said) {
      cap_unavailable_said = true;
      stats.notice = "the strict meter has no wall on " + opt.device.str() +
                     " (this torch cannot cap that device's allocator): the plan keeps the "
                     "budget, and nothing refuses an allocation past it";
    }
    return;
  }
  PlanExecutor::track_inputs(true);
  PlanExecutor::retry_out_of_memory(true);
  cap_on = true;
  cap_by_retry = true;
}

void Session::Impl::lift_cap() {
  if (!cap_on) return;
  PlanExecutor::track_inputs(false);
  if (cap_by_retry) {
    PlanExecutor::retry_out_of_memory(false);
    (void)set_device_memory_wall(opt.device, cap_previous);
  } else {
    set_cpu_memory_cap(cap_previous);
    clear_cpu_memory_reclaimer(reclaimer_token);
  }
  cap_on = false;
  cap_by_retry = false;
}

void Session::Impl::stop_offloading() {
  if (tracer) tracer->set_listener(nullptr);
  lift_cap();
  executor.reset();
  tracer.reset();
}

plan::TimelineStep Session::Impl::planned_view(int index) {
  plan::TimelineStep v;
  if (index < 0 || static_cast<std::size_t>(index) >= shapes.size()) return v;
  Shape& s = shapes[static_cast<std::size_t>(index)];
  if (s.planned_memory.empty()) {
    plan::Hardware hw = hardware();
    hw.device_memory = static_cast<std::uint64_t>(std::max(s.capacity, 1.0));
    const plan::SimResult r = plan::simulate(s.trace, &s.plan, hw);
    s.planned_memory = r.memory_per_op;
    for (auto& b : s.planned_memory) b += stats.untouched_bytes;
    s.planned_bytes = plan::compile_schedule(s.trace, &s.plan, /*strict=*/false).planned_bytes;
  }
  v.planned_memory = s.planned_memory;
  v.planned_seconds = s.plan.summary.compute_seconds + s.plan.summary.planned_stall_seconds;
  v.planned_stall_seconds = s.plan.summary.planned_stall_seconds;
  v.planned_bytes = s.planned_bytes;
  return v;
}

std::pair<double, double> Session::Impl::io_seconds() const {
  if (!store) return {-1, -1};
  const io::StoreStats st = store->stats();
  return {st.busy_seconds, st.checksum_seconds};
}

plan::ChannelRates Session::Impl::assumed_rates() {
  if (budget_known && store) return hardware().channels();
  return rates_at_close;
}

void Session::Impl::write_timeline_file() {
  if (!timeline || opt.timeline_path.empty()) return;
  try {
    timeline->write(opt.timeline_path);
  } catch (const std::exception& e) {
    const std::string why =
        "the timeline was not written to '" + opt.timeline_path + "': " + e.what();
    std::cerr << "tidal: warning: " << why << "\n";
    add_notice(why);
  }
}

void Session::Impl::add_notice(const std::string& why) {
  stats.notice = stats.notice.empty() ? why : stats.notice + "; " + why;
}

}  // namespace tidal::torch_layer
