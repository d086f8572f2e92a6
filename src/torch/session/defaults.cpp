// What a session runs with: its defaults (budget, wall, host memory), the one plan-mode session
// of the process, the options refused outside plan mode, and the hardware the planner is told of.
#include "torch/session/session_impl.hpp"

namespace tidal::torch_layer {

void Session::Impl::take_plan_slot() {
  const void* none = nullptr;
  TIDAL_EXPECT_AS(InvalidArgument, g_plan_session.compare_exchange_strong(none, this),
                  "another tidal Session in plan mode is open in this process, and there can "
                  "be one at a time (its tracer and executor follow every op of the process): "
                  "close() that one first, or run both loops under one session");
}

void Session::Impl::leave_plan_slot() {
  const void* self = this;
  g_plan_session.compare_exchange_strong(self, nullptr);
}

void Session::Impl::refuse_plan_options() const {
  if (opt.mode == OffloadMode::kPlan) return;
  const auto refuse = [&](bool given, const char* what) {
    TIDAL_EXPECT_AS(InvalidArgument, !given, what, " is an option of plan mode, and mode ",
                    to_string(opt.mode), " does nothing with it: leave it unset, or use mode plan");
  };
  refuse(opt.strict_meter == true, "the strict meter (strict_meter)");
  refuse(opt.strict_budget, "strict_budget");
  refuse(opt.wall_by_retry, "wall_by_retry");
  refuse(opt.memory_budget > 0, "a memory budget in bytes (memory_budget)");
  TIDAL_EXPECT_AS(
      InvalidArgument,
      opt.mode != OffloadMode::kNone || opt.host_memory == kHostMemoryAuto || opt.host_memory == 0,
      "host_memory is a tier of plan and activation modes, and mode none does "
      "nothing with it: leave it unset, or use one of them");
  refuse(opt.between_steps != BetweenSteps::kResident, "between_steps");
}

void Session::Impl::choose_defaults() {
  const bool gpu = opt.mode == OffloadMode::kPlan && opt.device.is_cuda();
  std::string chosen;
  const auto say = [&](const std::string& what) { chosen += (chosen.empty() ? "" : "; ") + what; };
  if (opt.memory_budget == 0 && opt.budget_fraction == 0) {
    if (gpu) {
      const BudgetChoice b = default_device_budget(measure_device_memory(opt.device));
      opt.memory_budget = b.bytes;
      say(b.why);
    } else {
      opt.budget_fraction = kCpuBudgetFraction;
      if (opt.mode == OffloadMode::kPlan) say("budget 50% of the profiled peak (the CPU's)");
    }
  }
  if (!opt.strict_meter.has_value()) {
    opt.strict_meter = gpu && opt.memory_budget > 0;
    if (*opt.strict_meter) say("the wall stands from step 0");
  }
  if (opt.host_memory == kHostMemoryAuto) {
    opt.host_memory = 0;
    if (opt.mode != OffloadMode::kNone && opt.device.is_cuda()) {
      const HostTierChoice h = default_host_tier(read_host_memory());
      opt.host_memory = h.bytes;
      say(h.why);
    }
  }
  stats.defaults = chosen;
}

bool Session::Impl::walled_from_start() const {
  return opt.mode == OffloadMode::kPlan && opt.strict_meter == true && opt.memory_budget > 0 &&
         (opt.device.is_cpu() || opt.device.is_cuda());
}

plan::Hardware Session::Impl::hardware() {
  plan::Hardware hw = plan::hardware_preset(opt.hardware);
  plan::HardwareOverrides overrides = opt.hardware_overrides;
  if (!overrides.ssd && opt.hardware == "cpu-here") {
    // cpu-here describes this machine: measure the store the plan will use, once.
    if (!store_measured) measure_store();
    if (!measured_ssd.empty()) overrides.ssd = plan::parse_ssd_spec(measured_ssd);
  }
  // The capacity is set per planning call; this only satisfies the preset's check.
  overrides.device_memory = std::max<std::uint64_t>(stats.memory_budget, 1);
  plan::apply_overrides(hw, overrides);
  hw.host_memory = opt.host_memory;
  // The store refuses what it cannot place (the write fails and the tensor stays, over the
  // budget): the plan keeps what it sends to the SSDs within the store, less an eighth for
  // the 4 KiB padding of each stripe run and for fragmentation.
  if (store) hw.ssd_capacity = store->stats().capacity / 8 * 7;
  hw.memory_margin = 0;  // the session measures every step: no blind margin
  hw.compute_seconds_per_byte = io_compute;
  return hw;
}

void Session::Impl::measure_store() {
  const bool on_cpu = opt.device.is_cpu();
  io::MeasureOptions mo;
  mo.bytes = 64ull << 20;
  mo.compute_cost = on_cpu;
  store_measured = true;
  try {
    const io::MeasuredBandwidth m = io::measure_bandwidth(*store, mo);
    measured_ssd = io::ssd_spec(m, store->options().dirs.size());
    io_compute[plan::index_of(plan::Channel::kSsdWrite)] = m.write_compute_seconds_per_byte;
    io_compute[plan::index_of(plan::Channel::kSsdRead)] = m.read_compute_seconds_per_byte;
  } catch (const IoError& e) {
    measured_ssd.clear();  // a failing or too small store: plan with the preset's figures
    const std::string why = "SSD figures not measured (" + std::string(e.what()) +
                            "): the plan uses the " + opt.hardware + " preset's";
    add_notice(why);
  }
  if (on_cpu && opt.host_memory > 0) {
    const double copy = io::measure_copy_compute_cost();
    io_compute[plan::index_of(plan::Channel::kHostWrite)] = copy;
    io_compute[plan::index_of(plan::Channel::kHostRead)] = copy;
  }
}

void Session::Impl::refuse_compiled_code(const trace::Trace& t) {
  for (const auto& op : t.ops) {
    TIDAL_EXPECT_AS(InvalidArgument, !is_compiled_region(op.name),
                    "plan mode cannot run a torch.compile'd model or function: its generated "
                    "kernels touch tensors that the plan executor cannot see (op ",
                    op.index, " is '", op.name,
                    "'). Use activation offloading (mode activations, which "
                    "works with torch.compile), or run the model without torch.compile");
  }
}

}  // namespace tidal::torch_layer
