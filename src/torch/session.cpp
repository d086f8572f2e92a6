#include "tidal/torch/session.hpp"

#include <algorithm>
#include <cstdio>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/measure.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/torch/tracer.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::torch_layer {

const char* to_string(OffloadMode m) {
  switch (m) {
    case OffloadMode::kNone:
      return "none";
    case OffloadMode::kActivations:
      return "activations";
    case OffloadMode::kPlan:
      return "plan";
  }
  return "?";
}

OffloadMode offload_mode_from_string(const std::string& s) {
  if (s == "none") return OffloadMode::kNone;
  if (s == "activations") return OffloadMode::kActivations;
  if (s == "plan") return OffloadMode::kPlan;
  TIDAL_EXPECT_AS(InvalidArgument, false, "unknown offload mode '", s,
                  "': use none, activations or plan");
  return OffloadMode::kNone;
}

namespace {

// The I/O counters that ActivationStats and ExecutorStats share, into the session's view.
template <typename Stats>
void take_io_stats(SessionStats& s, const Stats& x) {
  s.bytes_written = x.bytes_written;
  s.bytes_read = x.bytes_read;
  s.misses = x.misses;
  s.write_failures = x.write_failures;
  s.stall_seconds = x.stall_seconds;
}

}  // namespace

struct Session::Impl {
  enum class State { kOff, kWarmup, kProfiling, kExecuting };

  SessionOptions opt;
  State state = State::kOff;
  std::shared_ptr<io::TensorStore> store;
  std::unique_ptr<ActivationOffloader> offloader;
  std::unique_ptr<Tracer> tracer;
  std::unique_ptr<PlanExecutor> executor;
  struct Registered {
    torch::Tensor tensor;
    std::string name;
    trace::TensorClass cls;
  };
  std::vector<Registered> persistent;
  std::optional<trace::Trace> trace;
  std::optional<plan::Plan> plan;
  int steps_in_state = 0;
  SessionStats stats;
  io::StoreStats store_before;

  void start_profiling() {
    executor.reset();  // brings every moved tensor back
    tracer.reset();
    tracer = std::make_unique<Tracer>(Tracer::Options{opt.model_name, opt.batch, opt.seq});
    for (const auto& r : persistent) tracer->register_persistent(r.tensor, r.name, r.cls);
    tracer->start();
    state = State::kProfiling;
    steps_in_state = 0;
    if (opt.reset_peak) opt.reset_peak();
  }

  void make_plan_and_execute() {
    ProfileResult profile = tracer->result();
    TIDAL_EXPECT(profile.consistent, "the profiled steps ran different op sequences (",
                 profile.divergence, "); plan mode needs the same ops every step");
    const auto lifetimes = trace::analyze_lifetimes(profile.trace);
    const std::uint64_t measured = opt.peak_bytes ? opt.peak_bytes() : 0;
    stats.profiled_peak = measured;
    std::uint64_t budget = opt.memory_budget;
    if (budget == 0) {
      TIDAL_EXPECT_AS(InvalidArgument, measured > 0,
                      "plan mode needs a memory budget in bytes, or a memory meter to take a "
                      "share of the measured peak");
      budget = static_cast<std::uint64_t>(opt.budget_fraction * static_cast<double>(measured));
    }
    stats.memory_budget = budget;
    // The planner counts the trace's tensors; the meter counts every allocation (padding,
    // allocator slack, tensors nested inside ops). Scale the budget into trace units.
    const double peak_live = static_cast<double>(lifetimes.summary.peak_live_bytes);
    unit_scale = measured > 0 && peak_live > 0
                     ? std::min(1.0, peak_live / static_cast<double>(measured))
                     : 1.0;
    tighten = 1.0;
    trace = std::move(profile.trace);
    replan();
  }

  // Plans the kept trace for budget x unit_scale x tighten and starts executing it.
  void replan() {
    executor.reset();  // brings back whatever the previous plan moved
    plan::Hardware hw = plan::hardware_preset(opt.hardware);
    plan::HardwareOverrides overrides = opt.hardware_overrides;
    if (!overrides.ssd && opt.hardware == "cpu-here") {
      // cpu-here describes this machine: measure the store the plan will use, once.
      if (measured_ssd.empty()) {
        try {
          measured_ssd = io::ssd_spec(io::measure_bandwidth(*store, 64ull << 20),
                                      store->options().dirs.size());
        } catch (const IoError&) {
          measured_ssd = "preset";  // a failing store: plan with the preset's figures
        }
      }
      if (measured_ssd != "preset") overrides.ssd = measured_ssd;
    }
    overrides.gpu_mem = std::to_string(static_cast<std::uint64_t>(
        static_cast<double>(stats.memory_budget) * unit_scale * tighten));
    plan::apply_overrides(hw, overrides);
    plan::PlannerOptions po;
    po.min_bytes = opt.executor.min_bytes;
    po.more_memory_hint =
        "a larger memory budget (tidal train --mem-budget; SessionOptions::memory_budget or "
        "budget_fraction; now " +
        format_bytes(static_cast<double>(stats.memory_budget)) + " of a profiled peak of " +
        format_bytes(static_cast<double>(stats.profiled_peak)) + ")";
    plan::Plan p = plan::make_plan(*trace, hw, po);
    char line[256];
    std::snprintf(line, sizeof line,
                  "plan: %zu actions, %s to SSD per step, planned peak %s of %s (trace units), "
                  "planned stall %.3f s, planned in %.2f s, SSD %s",
                  p.actions.size(),
                  format_bytes(static_cast<double>(p.summary.bytes_to_ssd)).c_str(),
                  format_bytes(static_cast<double>(p.summary.peak_after_bytes)).c_str(),
                  format_bytes(static_cast<double>(hw.device_memory)).c_str(),
                  p.summary.planned_stall_seconds, p.summary.planning_seconds,
                  overrides.ssd ? overrides.ssd->c_str() : "preset");
    stats.plan_summary = line;
    plan = std::move(p);
    executor = std::make_unique<PlanExecutor>(store, *trace, *plan, opt.executor);
    tracer->set_keep_iterations(false);
    tracer->set_listener(executor.get());
    state = State::kExecuting;
    steps_in_state = 0;
    stats.executed_peak = 0;
  }

  // After an executed step: the meter's peak for it against the budget. Over it, the plan is
  // made again for a smaller capacity (what the trace cannot see, the meter can).
  void check_budget() {
    if (!opt.peak_bytes) return;
    const std::uint64_t peak = opt.peak_bytes();
    if (opt.reset_peak) opt.reset_peak();
    // The first step of a plan starts with everything resident (the previous plan's moves were
    // undone), so only the steps after it show the plan's steady state.
    if (steps_in_state < 2) return;
    stats.executed_peak = std::max(stats.executed_peak, peak);
    if (peak <= stats.memory_budget || stats.tightenings >= kMaxTightenings) return;
    const double before = tighten;
    tighten *= 0.97 * static_cast<double>(stats.memory_budget) / static_cast<double>(peak);
    ++stats.tightenings;
    try {
      replan();
    } catch (const InvalidArgument&) {
      // Even the tensors that cannot move do not fit the smaller capacity: keep the last plan.
      tighten = before;
      stats.tightenings = kMaxTightenings;
      replan();
    }
  }

  static constexpr int kMaxTightenings = 4;
  std::string measured_ssd;  // cpu-here: the store's measured figures, as an --ssd spec
  double unit_scale = 1.0;
  double tighten = 1.0;
};

Session::Session(SessionOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(options);
  Impl& m = *impl_;
  m.stats.mode = m.opt.mode;
  if (m.opt.mode == OffloadMode::kNone) {
    m.stats.state = "off";
    return;
  }
  m.store = std::make_shared<io::TensorStore>(m.opt.store);
  if (m.opt.mode == OffloadMode::kActivations) {
    m.offloader = std::make_unique<ActivationOffloader>(m.store, m.opt.activations);
    m.state = Impl::State::kExecuting;
  } else {
    TIDAL_EXPECT_AS(InvalidArgument, m.opt.profile_steps >= 1 && m.opt.warmup_steps >= 0,
                    "plan mode needs at least one profiled step");
    TIDAL_EXPECT_AS(InvalidArgument, m.opt.budget_fraction > 0 && m.opt.budget_fraction <= 1,
                    "the memory budget fraction must be in (0, 1]");
    m.state = Impl::State::kWarmup;
  }
}

Session::~Session() {
  // The executor's destructor brings tensors back; the tracer's removes its callbacks.
  if (impl_->tracer) impl_->tracer->set_listener(nullptr);
  impl_->executor.reset();
  impl_->tracer.reset();
}

void Session::register_persistent(const std::vector<torch::Tensor>& tensors, trace::TensorClass cls,
                                  const std::string& name_prefix) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    register_persistent(tensors[i], name_prefix + std::to_string(i), cls);
  }
}

void Session::register_persistent(const torch::Tensor& tensor, const std::string& name,
                                  trace::TensorClass cls) {
  if (!tensor.defined()) return;
  impl_->persistent.push_back({tensor, name, cls});
  if (impl_->offloader) impl_->offloader->keep_storages_of({tensor});
  if (impl_->tracer) impl_->tracer->register_persistent(tensor, name, cls);
}

void Session::begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) {
  Impl& m = *impl_;
  step_ = step;
  if (m.store) m.store_before = m.store->stats();
  if (m.state == Impl::State::kWarmup && m.steps_in_state >= m.opt.warmup_steps) {
    m.start_profiling();
  }
  if (m.offloader) m.offloader->begin_step(step, inputs);
  if (m.tracer) m.tracer->begin_step(step, inputs);
  if (m.executor) m.executor->begin_step(step, inputs);
}

void Session::begin_phase(trace::Phase phase) {
  Impl& m = *impl_;
  if (m.offloader) m.offloader->begin_phase(phase);
  if (m.tracer) m.tracer->begin_phase(phase);
}

void Session::begin_layer(std::int64_t layer) {
  if (impl_->tracer) impl_->tracer->begin_layer(layer);
}

void Session::end_step(std::int64_t step) {
  Impl& m = *impl_;
  if (m.tracer) m.tracer->end_step(step);
  if (m.executor) m.executor->end_step(step);
  if (m.offloader) m.offloader->end_step(step);
  ++m.steps_in_state;
  SessionStats& s = m.stats;
  s.bytes_written = s.bytes_read = s.misses = s.write_failures = 0;
  s.stall_seconds = 0;
  if (m.offloader) take_io_stats(s, m.offloader->last_step());
  if (m.executor) {
    const ExecutorStats e = m.executor->last_step();
    take_io_stats(s, e);
    if (e.diverged) {
      // The ops changed: what was planned no longer names the right tensors. Re-profile.
      ++s.replans;
      m.start_profiling();
      return;
    }
  }
  if (m.state == Impl::State::kProfiling && m.steps_in_state >= m.opt.profile_steps) {
    m.make_plan_and_execute();
  } else if (m.state == Impl::State::kExecuting && m.executor) {
    m.check_budget();
  }
}

SessionStats Session::stats() const {
  SessionStats s = impl_->stats;
  switch (impl_->state) {
    case Impl::State::kOff:
      s.state = "off";
      break;
    case Impl::State::kWarmup:
      s.state = "warmup";
      break;
    case Impl::State::kProfiling:
      s.state = "profiling";
      break;
    case Impl::State::kExecuting:
      s.state = "executing";
      break;
  }
  return s;
}

const std::optional<trace::Trace>& Session::trace() const { return impl_->trace; }
const std::optional<plan::Plan>& Session::plan() const { return impl_->plan; }
std::shared_ptr<io::TensorStore> Session::store() const { return impl_->store; }

}  // namespace tidal::torch_layer
