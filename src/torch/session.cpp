#include "tidal/torch/session.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iostream>
#include <map>

#include "tidal/common/enum_names.hpp"
#include "tidal/common/env.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/memory_defaults.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/measure.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/schedule.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/tracer.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::torch_layer {

namespace {

constexpr EnumName<OffloadMode> kModeNames[] = {
    {OffloadMode::kNone, "none"},
    {OffloadMode::kActivations, "activations"},
    {OffloadMode::kPlan, "plan"},
};
constexpr EnumName<SessionState> kStateNames[] = {
    {SessionState::kOff, "off"},
    {SessionState::kWarmup, "warmup"},
    {SessionState::kProfiling, "profiling"},
    {SessionState::kExecuting, "executing"},
};

}  // namespace

const char* to_string(OffloadMode m) { return enum_name(kModeNames, m); }
const char* to_string(SessionState s) { return enum_name(kStateNames, s); }

OffloadMode offload_mode_from_string(const std::string& s) {
  return enum_value(kModeNames, s, "offload mode");
}

namespace {

// The I/O counters that ActivationStats and ExecutorStats share, into the session's view.
template <typename Stats>
void take_io_stats(SessionStats& s, const Stats& x) {
  s.bytes_written = x.bytes_written;
  s.bytes_read = x.bytes_read;
  s.misses = x.misses;
  s.write_failures = x.write_failures;
  s.store_full_writes = x.store_full;
  s.write_error = x.write_error;
  s.stall_seconds = x.stall_seconds;
}

std::string bytes_text(std::uint64_t b) { return format_bytes(static_cast<double>(b)); }

// Bytes of the trace's tensors that exist when the step starts (made before its first op).
std::uint64_t bytes_at_start(const trace::Trace& t) {
  std::uint64_t sum = 0;
  for (const auto& x : t.tensors) {
    if (x.producer == trace::kNoOp && x.persistent) sum += x.bytes;
  }
  return sum;
}

constexpr int kMaxTightenings = 4;  // consecutive, per step shape
constexpr std::size_t kMaxPendingShapes = 16;

// The process's one plan-mode session: its tracer and executor follow every op of the loop's
// thread, so a second one is refused when it is made, not mid-run.
std::atomic<const void*> g_plan_session{nullptr};

}  // namespace

struct Session::Impl {
  ~Impl() { leave_plan_slot(); }
  void take_plan_slot() {
    const void* none = nullptr;
    TIDAL_EXPECT_AS(InvalidArgument, g_plan_session.compare_exchange_strong(none, this),
                    "another tidal Session in plan mode is open in this process, and there can "
                    "be one at a time (its tracer and executor follow every op of the process): "
                    "close() that one first, or run both loops under one session");
  }
  void leave_plan_slot() {
    const void* self = this;
    g_plan_session.compare_exchange_strong(self, nullptr);
  }

  // Options that only plan mode uses are refused in the others rather than ignored.
  void refuse_plan_options() const {
    if (opt.mode == OffloadMode::kPlan) return;
    const auto refuse = [&](bool given, const char* what) {
      TIDAL_EXPECT_AS(InvalidArgument, !given, what, " is an option of plan mode, and mode ",
                      to_string(opt.mode),
                      " does nothing with it: leave it unset, or use mode plan");
    };
    refuse(opt.strict_meter == true, "the strict meter (strict_meter)");
    refuse(opt.strict_budget, "strict_budget");
    refuse(opt.wall_by_retry, "wall_by_retry");
    refuse(opt.memory_budget > 0, "a memory budget in bytes (memory_budget)");
    TIDAL_EXPECT_AS(InvalidArgument,
                    opt.mode != OffloadMode::kNone || opt.host_memory == kHostMemoryAuto ||
                        opt.host_memory == 0,
                    "host_memory is a tier of plan and activation modes, and mode none does "
                    "nothing with it: leave it unset, or use one of them");
    refuse(opt.between_steps != BetweenSteps::kResident, "between_steps");
  }

  // Options left to the machine (SessionOptions: memory_budget and budget_fraction both 0,
  // strict_meter unset, host_memory kHostMemoryAuto), chosen from what it has. On a CUDA device
  // in plan mode: the budget is what tensors can hold there, the wall stands from step 0, and
  // host memory is a tier; elsewhere the CPU's documented defaults. stats().defaults says what
  // was chosen, with the figures.
  void choose_defaults() {
    const bool gpu = opt.mode == OffloadMode::kPlan && opt.device.is_cuda();
    std::string chosen;
    const auto say = [&](const std::string& what) {
      chosen += (chosen.empty() ? "" : "; ") + what;
    };
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

  SessionOptions opt;
  SessionState state = SessionState::kOff;
  std::shared_ptr<io::TensorStore> store;
  std::shared_ptr<io::HostPool> host;  // plan mode with host_memory
  std::unique_ptr<MemoryMeter> meter;
  std::unique_ptr<ActivationOffloader> offloader;
  std::unique_ptr<Tracer> tracer;
  std::unique_ptr<PlanExecutor> executor;
  std::shared_ptr<plan::Timeline> timeline;  // SessionOptions::timeline_steps
  struct Registered {
    torch::Tensor tensor;
    std::string name;
    trace::TensorClass cls;
  };
  std::vector<Registered> persistent;
  std::optional<trace::Trace> trace;  // shape 0's
  std::optional<plan::Plan> plan;
  int steps_in_state = 0;
  bool in_step = false;
  bool closed = false;  // close(): nothing more runs
  SessionStats stats;

  // One step shape: its ops, its profile, the capacity its plan was made for and the plan.
  struct Shape {
    trace::Trace trace;
    plan::Plan plan;
    double peak_live = 0;   // the trace's peak of live bytes, everything kept
    double capacity = 0;    // planner units (trace bytes)
    int tightenings = 0;    // consecutive
    bool at_floor = false;  // no plan can go lower
    // The plan replayed by the simulator (for the timeline), once asked; empty: not yet.
    std::vector<std::uint64_t> planned_memory;
    std::array<std::uint64_t, plan::kNumChannels> planned_bytes{};
  };
  std::vector<Shape> shapes;  // index = the executor's shape index
  std::map<std::vector<std::string>, std::vector<trace::Trace>> pending;  // seen, not planned
  // cpu-here: the store's measured figures (none after a failed measurement: the preset's), and
  // as text for the plan summary.
  bool store_measured = false;
  std::string measured_ssd;  // empty: not measured, or the measurement failed
  // cpu-here on the CPU: the compute each byte moved takes (Hardware::compute_seconds_per_byte).
  std::array<double, plan::kNumChannels> io_compute{};
  std::uint64_t profiled_current = 0;  // max meter bytes at the start of the profiled steps
  bool budget_known = false;
  bool all_within = true;
  // Activation mode, at step scale: a step after the warm-up runs without offloading as the
  // reference; the first offloaded step that does not peak lower than it stops offloading.
  std::uint64_t reference_peak = 0;
  int steps_not_lower = 0;
  bool offloading = false;  // the offloader runs in this step
  bool offloading_off = false;

  std::uint64_t peak_now() const { return opt.peak_bytes ? opt.peak_bytes() : 0; }
  std::uint64_t current_now() const { return opt.current_bytes ? opt.current_bytes() : 0; }
  void reset_peak() const {
    if (opt.reset_peak) opt.reset_peak();
  }

  // The wall stands from step 0 (strict meter, a budget in bytes, on the CPU): the warm-up and
  // profiled steps run under an executor without a plan, which writes out the storages ops read
  // least recently whenever an allocation would cross the budget.
  // On a GPU the same, with the wall raised the way the device raises it (apply_cap).
  bool walled_from_start() const {
    return opt.mode == OffloadMode::kPlan && opt.strict_meter == true && opt.memory_budget > 0 &&
           (opt.device.is_cpu() || opt.device.is_cuda());
  }

  void start_profiling() {
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

  plan::Hardware hardware() {
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

  // The store's bandwidth, once; on the CPU also what its I/O and the host tier's copies take
  // from compute there (the device is the CPU the I/O runs on).
  void measure_store() {
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

  // Plans `shape` for `capacity` (trace bytes). When no plan fits, the smallest capacity that
  // plans (bisection), and the reason, unless the budget is strict. At every capacity tried,
  // tensors under the smallest size moved may be what keeps it out of reach (a small model's
  // tensors are mostly under 1 MiB): then smaller ones are made movable, a quarter of the size
  // at a time down to 4 KiB, and the executor moves them too.
  plan::Plan plan_for(const Shape& shape, double& capacity, bool& at_floor) {
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

  // Plans of one trace at capacities the session tries, with the smallest size moved lowered
  // where the session's own does not plan.
  struct PlanAttempt {
    PlanAttempt(Impl& session, const trace::Trace& trace)
        : t(trace), hw(session.hardware()), least(session.opt.executor.min_bytes) {
      po.clean_copies = false;  // the plan executor writes every offload (no copy kept on a tier)
      po.more_memory_hint = "a larger memory budget (" + session.opt.budget_option + "; now " +
                            bytes_text(session.stats.memory_budget) + " for the whole process)";
      if (session.opt.between_steps == BetweenSteps::kResident) {
        // Every tensor a step uses is resident at its start and end: parameters, gradients and
        // optimizer state together may already be over the budget there.
        po.more_memory_hint += ", or " + session.opt.between_steps_option +
                               " (then the model's state need not all be in memory between "
                               "steps)";
      }
      own_min_bytes = least;
    }
    // A plan at `cap` with tensors of `least` bytes and more movable, trying the session's
    // min_bytes first and then smaller ones; nullopt when none plans (first_refusal says why
    // the first attempt of all failed).
    std::optional<plan::Plan> at(double cap) {
      hw.device_memory = static_cast<std::uint64_t>(std::max(cap, 1.0));
      for (least = own_min_bytes;; least = std::max<std::uint64_t>(4096, least / 4)) {
        po.min_bytes = least;
        try {
          return plan::make_plan(t, hw, po);
        } catch (const InvalidArgument& e) {
          if (!first_refusal) {
            first_refusal = std::current_exception();
            first_reason = e.what();
          }
        }
        if (least <= 4096) return std::nullopt;
      }
    }
    const trace::Trace& t;
    plan::Hardware hw;
    plan::PlannerOptions po;
    std::uint64_t own_min_bytes = 0;
    std::uint64_t least = 0;
    std::exception_ptr first_refusal;
    std::string first_reason;  // its message
  };

  // Tensors from `least` bytes on are moved, where the session's min_bytes did not plan.
  void adopt_min_bytes(std::uint64_t least) {
    if (least >= opt.executor.min_bytes) return;
    const std::string why = "no plan meets the budget with tensors under " +
                            bytes_text(opt.executor.min_bytes) +
                            " kept in memory (the smallest size moved): tensors of " +
                            bytes_text(least) + " and more are moved";
    add_notice(why);
    opt.executor.min_bytes = least;
    if (executor) executor->set_min_bytes(least);
  }

  // Something the user should know, said once, after what stats().notice says already.
  void add_notice(const std::string& why) {
    stats.notice = stats.notice.empty() ? why : stats.notice + "; " + why;
  }

  void summarise(const Shape& s) {
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

  // The planner counts the trace's tensors; the meter counts every allocation (memory no op
  // touches, allocator padding, tensors made and dropped inside an op). The difference is
  // subtracted from the budget: what the planner may use is what the meter leaves it.
  double capacity_for(const Shape& s) const {
    const auto unseen = std::max(0.0, static_cast<double>(stats.profiled_peak) - s.peak_live);
    return std::max(0.0, static_cast<double>(stats.memory_budget) - unseen);
  }

  // The executor's hard budget: the user's, or, when a shape's plan cannot meet it, the least
  // memory that plan reaches (the executor would otherwise write out and read back the same
  // tensors over and over for a budget no plan can keep).
  std::uint64_t executor_budget(const Shape& added) const {
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

  // kAuto: -1 until the first plan, then 0 (resident) or 1 (offloaded).
  int boundary = -1;
  bool boundary_offloaded() const {
    return opt.between_steps == BetweenSteps::kOffloaded ||
           (opt.between_steps == BetweenSteps::kAuto && boundary == 1);
  }

  // A trace recorded with the step-end op, made into one without it (the boundary offloaded).
  static void strip_step_end(trace::Trace& t) {
    if (t.ops.empty() || t.ops.back().name != kStepEndOp) return;
    t.ops.pop_back();
    const auto last = static_cast<trace::OpIndex>(t.ops.size()) - 1;
    for (auto& x : t.tensors) {
      if (x.freed_after != trace::kNoOp && x.freed_after > last) x.freed_after = last;
    }
  }

  // kAuto, at the first plan: the step boundary stays resident when a plan meets the budget so
  // (nothing changes for code between steps); otherwise the tensors may stay out across it.
  void choose_boundary(const trace::Trace& t) {
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

  // A new step shape: plan it and hand it to the executor (made on the first).
  void add_shape(trace::Trace t) {
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

  // Runs `planning`; when it refuses the loop (InvalidArgument: a torch.compile'd region, a
  // plan that cannot be made), the session stops tracing and brings every tensor back before
  // the error leaves end_step, so that a session kept alive by the caller (or by the
  // exception's traceback in Python) does not hold the process's one tracer.
  template <typename Planning>
  void plan_or_stop(Planning&& planning) {
    try {
      planning();
    } catch (const InvalidArgument&) {
      lift_cap();
      executor.reset();
      tracer.reset();
      state = SessionState::kOff;
      leave_plan_slot();
      throw;
    }
  }

  // The strict meter (SessionOptions::strict_meter): the budget becomes the CPU allocator's cap
  // once a plan runs, with the executor freeing memory before a refusal.
  // The wall is the executor's budget: the memory budget, or, when no plan meets it and the
  // session runs at the least peak a plan reaches (not strict_budget; budget_reason says so),
  // that peak.
  // On a GPU the caching allocator refuses past the wall (set_device_memory_wall) and frees
  // nothing first: the residency guard has the executor write tensors out and runs the refused
  // op again (PlanExecutor::retry_out_of_memory). SessionOptions::wall_by_retry raises the CPU's
  // wall that way too.
  bool cap_on = false;
  bool cap_by_retry = false;
  bool cap_unavailable_said = false;
  std::uint64_t wall = 0;
  std::uint64_t cap_previous = 0;
  std::uint64_t reclaimer_token = 0;
  void set_wall(std::uint64_t bytes) {
    wall = bytes;
    executor->set_budget(bytes);
    if (!cap_on) return;
    if (cap_by_retry) {
      (void)set_device_memory_wall(opt.device, bytes);
    } else {
      set_cpu_memory_cap(bytes);
    }
  }
  void apply_cap() {
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
  // The plan's view of a step of shape `index`, for the timeline: the simulator's replay of the
  // plan on its trace (memory per op, in the meter's bytes: plus what no step touches).
  plan::TimelineStep planned_view(int index) {
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

  // The I/O threads' time so far (store and host pool), for the timeline's per-step figure.
  std::pair<double, double> io_seconds() const {
    if (!store) return {-1, -1};
    const io::StoreStats st = store->stats();
    return {st.busy_seconds, st.checksum_seconds};
  }
  std::pair<double, double> io_at_step_start{-1, -1};

  // The channel rates the plans assumed (for the report's sentence); kept when the session
  // closes its store.
  plan::ChannelRates rates_at_close;
  plan::ChannelRates assumed_rates() {
    if (budget_known && store) return hardware().channels();
    return rates_at_close;
  }

  // The timeline file (SessionOptions::timeline_path) is optional output: a failure to write it
  // is a warning that names the path, and the session's results stay.
  void write_timeline_file() {
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

  // The executor's destructor brings every moved tensor back; the tracer's removes its
  // callbacks. What ~Session and close() both do.
  void stop_offloading() {
    if (tracer) tracer->set_listener(nullptr);
    lift_cap();
    executor.reset();
    tracer.reset();
  }

  void lift_cap() {
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

  // torch.compile's generated kernels read and write tensors without going through ATen's
  // dispatcher: the tracer sees a compiled region as one op and the residency guard cannot see
  // inside it, so a plan could release a tensor that such a kernel then reads. Refused before
  // any plan runs (profiling steps offload nothing).
  static void refuse_compiled_code(const trace::Trace& t) {
    for (const auto& op : t.ops) {
      TIDAL_EXPECT_AS(InvalidArgument, !is_compiled_region(op.name),
                      "plan mode cannot run a torch.compile'd model or function: its generated "
                      "kernels touch tensors that the plan executor cannot see (op ",
                      op.index, " is '", op.name,
                      "'). Use activation offloading (mode activations, which "
                      "works with torch.compile), or run the model without torch.compile");
    }
  }

  void make_first_plan() {
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

  // After an executed step: a step of an unknown shape is kept until its shape is seen again,
  // then planned; a known shape over the budget is planned again for less.
  void after_executed_step(const ExecutorStats& e, std::uint64_t peak) {
    if (e.diverged || e.shape < 0) {
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
        tighten(e.shape, static_cast<double>(std::min<std::uint64_t>(
                             e.eviction_overshoot, without - stats.memory_budget)));
      }
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

  // Plans step shape `index` again for `over` bytes less capacity, and a little more.
  void tighten(int index, double over) {
    Shape& s = shapes[static_cast<std::size_t>(index)];
    double cap = std::max(0.0, s.capacity - over - 0.01 * static_cast<double>(stats.memory_budget));
    bool floor = false;
    plan::Plan p = plan_for(s, cap, floor);
    s.capacity = cap;
    s.at_floor = floor;
    s.plan = std::move(p);
    ++s.tightenings;
    ++stats.tightenings;
    ++stats.replans;
    // The new plan is judged on its own steps.
    all_within = true;
    stats.steps_measured = 0;
    stats.executed_peak = 0;
    s.planned_memory.clear();
    executor->replace_plan(index, s.trace, s.plan);
    set_wall(executor_budget(s));
    if (index == 0) plan = s.plan;
    summarise(s);
  }
};

Session::Session(SessionOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(options);
  Impl& m = *impl_;
  m.stats.mode = m.opt.mode;
  m.refuse_plan_options();
  if (m.opt.mode == OffloadMode::kPlan) m.take_plan_slot();
  m.choose_defaults();
  if (!m.opt.peak_bytes) {
    m.meter = std::make_unique<MemoryMeter>(m.opt.device);
    MemoryMeter* meter = m.meter.get();
    m.opt.peak_bytes = [meter] { return meter->peak_bytes(); };
    m.opt.current_bytes = [meter] { return meter->current_bytes(); };
    m.opt.reset_peak = [meter] { meter->reset_peak(); };
  }
  if (m.opt.mode == OffloadMode::kNone) {
    m.state = SessionState::kOff;
    return;
  }
  if (m.opt.timeline_path.empty()) {
    if (auto path = read_env().timeline) m.opt.timeline_path = *path;  // TIDAL_TIMELINE
  }
  if (m.opt.timeline_steps > 0 || !m.opt.timeline_chosen_steps.empty()) {
    plan::Timeline::Options to;
    to.last_steps = m.opt.timeline_steps;
    to.steps = m.opt.timeline_chosen_steps;
    m.timeline = std::make_shared<plan::Timeline>(to);
    m.opt.executor.timeline = m.timeline;  // every executor the session makes records into it
  }
  TIDAL_EXPECT_AS(InvalidArgument, m.opt.profile_steps >= 1,
                  "plan mode needs at least one profiled step (profile_steps >= 1)");
  TIDAL_EXPECT_AS(InvalidArgument, m.opt.warmup_steps >= 0, "warmup_steps must be 0 or more");
  TIDAL_EXPECT_AS(
      InvalidArgument,
      m.opt.memory_budget > 0 || (m.opt.budget_fraction > 0 && m.opt.budget_fraction <= 1),
      "the memory budget fraction must be in (0, 1]");
  m.store = std::make_shared<io::TensorStore>(m.opt.store);
  if (m.opt.host_memory > 0) {
    m.host = std::make_shared<io::HostPool>(m.opt.host_memory);
  }
  if (m.opt.mode == OffloadMode::kActivations) {
    m.opt.activations.host = m.host;  // saved tensors to host memory first
    m.offloader = std::make_unique<ActivationOffloader>(m.store, m.opt.activations);
    m.offloader->set_timeline(m.timeline, m.opt.current_bytes);
    m.state = SessionState::kExecuting;
  } else {
    m.state = SessionState::kWarmup;
    if (m.walled_from_start()) {
      ExecutorOptions eo = m.opt.executor;
      eo.budget = m.opt.memory_budget;
      eo.current_bytes = m.opt.current_bytes;
      eo.host = m.host;
      m.executor = std::make_unique<PlanExecutor>(m.store, eo);
      m.wall = m.opt.memory_budget;
      m.stats.memory_budget = m.opt.memory_budget;
    }
  }
}

Session::~Session() {
  impl_->stop_offloading();
  if (!impl_->closed) impl_->write_timeline_file();
}

void Session::close() {
  Impl& m = *impl_;
  if (m.closed) return;
  TIDAL_EXPECT(!m.in_step, "close() inside step ", step_, ": end the step first");
  m.rates_at_close = m.assumed_rates();
  m.stop_offloading();
  m.write_timeline_file();
  m.offloader.reset();
  m.persistent.clear();
  m.host.reset();
  m.store.reset();  // its files and disk reservation, once nothing else holds it
  m.leave_plan_slot();
  m.closed = true;
  m.state = SessionState::kOff;
}

void Session::register_persistent(const std::vector<torch::Tensor>& tensors, trace::TensorClass cls,
                                  const std::string& name_prefix) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    register_persistent(tensors[i], name_prefix + std::to_string(i), cls);
  }
}

void Session::register_persistent(const torch::Tensor& tensor, const std::string& name,
                                  trace::TensorClass cls) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  impl_->persistent.push_back({tensor, name, cls});
  if (impl_->offloader) impl_->offloader->keep_storages_of({tensor});
  if (impl_->tracer) impl_->tracer->register_persistent(tensor, name, cls);
}

void Session::begin_step(std::int64_t step, const std::vector<torch::Tensor>& inputs) {
  Impl& m = *impl_;
  TIDAL_EXPECT(!m.closed, "begin_step(", step, ") on a closed session (make a new one)");
  TIDAL_EXPECT(!m.in_step, "begin_step(", step, ") while step ", step_,
               " is still open: call end_step() first");
  m.in_step = true;
  step_ = step;
  next_step_ = step + 1;
  // Without a plan yet, the model's state is what the executor may write out first.
  if (m.executor && m.executor->planless()) {
    std::vector<c10::StorageImpl*> state;
    for (const auto& r : m.persistent) {
      if (r.tensor.defined() && r.tensor.has_storage()) {
        state.push_back(r.tensor.storage().unsafeGetStorageImpl());
      }
      const auto& g = r.tensor.grad();
      if (g.defined() && g.has_storage()) state.push_back(g.storage().unsafeGetStorageImpl());
    }
    m.executor->note_inputs(state, /*recent=*/false);
  }
  if (m.timeline) {
    m.timeline->begin_step(step, to_string(m.state), m.stats.memory_budget, m.wall);
    m.io_at_step_start = m.io_seconds();
  }
  // A step starts within the budget (the first one after profiling holds everything).
  if (m.executor) m.executor->fit_budget();
  m.apply_cap();
  // Memory used between steps (evaluation, logging) is not charged to the step.
  m.reset_peak();
  if (m.state == SessionState::kWarmup && m.steps_in_state >= m.opt.warmup_steps) {
    m.start_profiling();
  }
  if (m.state == SessionState::kProfiling) {
    m.profiled_current = std::max(m.profiled_current, m.current_now());
  }
  // The warm-up steps and one more run without offloading; the last of them is the reference
  // (after the warm-up, lazily made state such as Adam's exists, as in every later step).
  if (m.timeline) {
    m.timeline->label_step(to_string(m.state), m.stats.memory_budget, m.wall);
    m.timeline->memory(m.current_now());
  }
  m.offloading = m.offloader && m.reference_peak > 0 && !m.offloading_off;
  if (m.offloading) m.offloader->begin_step(step, inputs);
  if (m.tracer) m.tracer->begin_step(step, inputs);
  if (m.executor) m.executor->begin_step(step, inputs);
}

void Session::begin_phase(trace::Phase phase) {
  Impl& m = *impl_;
  // Activation mode has no op tracer: its phases are the timeline's ops.
  if (m.timeline && m.offloader && m.in_step)
    m.timeline->op_start(-1, trace::to_string(phase), m.current_now());
  if (m.offloading) m.offloader->begin_phase(phase);
  if (m.tracer) m.tracer->begin_phase(phase);
}

void Session::begin_layer(std::int64_t layer) {
  if (impl_->tracer) impl_->tracer->begin_layer(layer);
}

void Session::end_step(std::int64_t step) {
  Impl& m = *impl_;
  if (!m.in_step) return;
  m.in_step = false;
  SessionStats& s = m.stats;
  s.bytes_written = s.bytes_read = s.misses = s.write_failures = s.store_full_writes = 0;
  s.bytes_to_host = s.bytes_from_host = 0;
  s.write_error.clear();
  s.stall_seconds = 0;
  // The step's tensors come back here (BetweenSteps::kResident): a read that fails throws, after
  // the session is left consistent for the next step.
  std::exception_ptr error;
  try {
    if (m.tracer) m.tracer->end_step(step);
  } catch (const Error&) {
    error = std::current_exception();
  }
  if (m.executor) m.executor->end_step(step);
  if (m.offloading) m.offloader->end_step(step);
  // While profiling, the tracer resets the meter's peak at every op (workspaces): it has the
  // step's peak.
  const std::uint64_t peak =
      m.tracer ? std::max(m.peak_now(), m.tracer->step_peak()) : m.peak_now();
  s.step_peak = peak;
  ++m.steps_in_state;
  if (m.offloading) {
    take_io_stats(s, m.offloader->last_step());
    s.bytes_to_host = m.offloader->last_step().bytes_to_host;
    if (s.notice.empty()) s.notice = m.offloader->notice();
    // One step that does not peak at least 1% lower than the reference is enough: offloading
    // that pays lowers the peak clearly, and "never above no offloading" must not wait for a
    // pattern. (A few KiB lower is the allocator's noise, not worth the writes.)
    if (peak + m.reference_peak / 100 >= m.reference_peak) ++m.steps_not_lower;
    if (m.steps_not_lower >= 1 && m.opt.activations.adaptive) {
      m.offloading_off = true;
      if (s.notice.empty()) {
        s.notice = "activation offloading did not lower this loop's peak (" + bytes_text(peak) +
                   " with it, " + bytes_text(m.reference_peak) +
                   " without, in the first step; less than 1% lower does not pay for the I/O): "
                   "its peak lies elsewhere (the optimizer step, data held in memory), or its "
                   "tensors are too small or its steps too short for the I/O to free memory in "
                   "time; saved tensors stay in memory";
      }
    }
  } else if (m.offloader && m.reference_peak == 0 && m.steps_in_state > m.opt.warmup_steps) {
    m.reference_peak = std::max<std::uint64_t>(peak, 1);
  }
  if (m.executor && m.executor->planless()) {
    // The wall stood from step 0: what the executor without a plan moved to keep it.
    const ExecutorStats e = m.executor->last_step();
    take_io_stats(s, e);
    s.write_stall_seconds = e.write_stall_seconds;
  }
  if (m.state == SessionState::kProfiling) {
    s.profiled_peak = std::max(s.profiled_peak, peak);
    if (!error && m.steps_in_state >= m.opt.profile_steps)
      m.plan_or_stop([&] { m.make_first_plan(); });
  } else if (m.state == SessionState::kExecuting && m.executor) {
    const ExecutorStats e = m.executor->last_step();
    take_io_stats(s, e);
    s.write_stall_seconds = e.write_stall_seconds;
    s.bytes_to_host = e.bytes_to_host;
    s.bytes_from_host = e.bytes_from_host;
    s.bytes_staged = e.bytes_staged;
    s.host_stall_seconds = e.host_stall_seconds;
    s.shape = e.shape;
    if (e.shape >= 0 && static_cast<std::size_t>(e.shape) < m.shapes.size()) {
      const plan::PlanSummary& ps = m.shapes[static_cast<std::size_t>(e.shape)].plan.summary;
      s.planned_bytes_to_ssd = ps.bytes_to_ssd;
      s.planned_bytes_to_host = ps.bytes_to_host;
      s.planned_step_seconds = ps.compute_seconds + ps.planned_stall_seconds;
    }
    if (!error) m.plan_or_stop([&] { m.after_executed_step(e, peak); });
    s.within_budget = s.steps_measured > 0 && m.all_within && s.steps_over_budget == 0;
    // A reason is for a budget not met: one left from a planning attempt that the executed
    // steps overcame would contradict within_budget.
    if (s.within_budget) s.budget_reason.clear();
  }
  if (m.timeline) {
    plan::TimelineStep facts = m.state == SessionState::kExecuting && m.executor
                                   ? m.planned_view(s.shape)
                                   : plan::TimelineStep{};
    facts.peak = peak;
    facts.misses = s.misses;
    const auto io = m.io_seconds();
    const auto& was = m.io_at_step_start;
    facts.io_busy_seconds = io.first >= 0 && was.first >= 0 ? io.first - was.first : -1;
    facts.checksum_seconds = io.second >= 0 && was.second >= 0 ? io.second - was.second : -1;
    m.timeline->end_step(facts);
  }
  if (error) std::rethrow_exception(error);
}

void Session::abort_step() {
  Impl& m = *impl_;
  if (!m.in_step) return;
  m.in_step = false;
  SessionStats& s = m.stats;
  ++s.steps_aborted;
  if (m.tracer) m.tracer->abort_step();
  std::exception_ptr error;
  if (m.executor) {
    m.executor->abort_step();
    if (!m.boundary_offloaded()) {
      try {
        m.executor->restore_all();
      } catch (const Error&) {
        error = std::current_exception();
      }
    }
  }
  if (m.offloading) m.offloader->end_step(step_);
  s.step_peak = m.tracer ? std::max(m.peak_now(), m.tracer->step_peak()) : m.peak_now();
  if (m.timeline) {
    m.timeline->label_step("aborted", s.memory_budget, m.wall);
    plan::TimelineStep facts;
    facts.peak = s.step_peak;
    m.timeline->end_step(facts);
  }
  if (error) std::rethrow_exception(error);
}

void Session::make_resident() {
  // Everything back, past the strict meter's wall if it must be (a model's whole state may be
  // larger than the budget): code that reads raw bytes (torch.save, safetensors) needs every
  // tensor at once. The wall comes back at the next begin_step, which first fits the budget.
  impl_->lift_cap();
  if (impl_->executor) impl_->executor->restore_all();
}

void Session::hold(const torch::Tensor& tensor) {
  if (impl_->executor && tensor.defined() && tensor.has_storage()) {
    impl_->executor->hold(tensor.storage().unsafeGetStorageImpl());
  }
}

void Session::release(const torch::Tensor& tensor) {
  if (impl_->executor && tensor.defined() && tensor.has_storage()) {
    impl_->executor->release(tensor.storage().unsafeGetStorageImpl());
  }
}

SessionStats Session::stats() const {
  SessionStats s = impl_->stats;
  s.state = impl_->state;
  if (s.mode == OffloadMode::kPlan && s.budget_reason.empty()) {
    if (!impl_->budget_known) {
      s.budget_reason = "no plan yet (warm-up and profiling steps run without one)";
    } else if (s.steps_measured == 0) {
      s.budget_reason = "no step has run a plan to its end yet";
    }
  }
  return s;
}

const SessionOptions& Session::options() const { return impl_->opt; }

plan::Preflight Session::preflight(std::uint64_t state_bytes) {
  Impl& m = *impl_;
  TIDAL_EXPECT_AS(InvalidArgument, m.opt.mode == OffloadMode::kPlan && m.store,
                  "preflight() is for an open plan-mode session");
  return plan::preflight(state_bytes, m.hardware(), m.opt.memory_budget);
}

plan::TimeReport Session::time_report() const {
  if (!impl_->timeline) return {};
  plan::TimeReport r = impl_->timeline->report(impl_->assumed_rates());
  r.replans = impl_->stats.replans;
  return r;
}

std::shared_ptr<const plan::Timeline> Session::timeline() const { return impl_->timeline; }

void Session::write_timeline(const std::string& path) const {
  TIDAL_EXPECT_AS(InvalidArgument, impl_->timeline != nullptr,
                  "no timeline is kept: set SessionOptions::timeline_steps (the CLI's "
                  "--timeline-steps, Python's timeline_steps) above 0, in plan or activation mode");
  impl_->timeline->write(path);
}

const std::optional<trace::Trace>& Session::trace() const { return impl_->trace; }
const std::optional<plan::Plan>& Session::plan() const { return impl_->plan; }
std::shared_ptr<io::TensorStore> Session::store() const { return impl_->store; }

}  // namespace tidal::torch_layer
