// Session's state (private to the session's files): the one object behind
// tidal::torch_layer::Session.
#pragma once

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
#include "tidal/torch/session.hpp"
#include "tidal/torch/tracer.hpp"
#include "tidal/trace/lifetime.hpp"
#include "torch/executor/executor.hpp"

namespace tidal::torch_layer {

// The I/O counters that ActivationStats and ExecutorStats share, into the session's view.
template <typename Stats>
inline void take_io_stats(SessionStats& s, const Stats& x) {
  s.bytes_written = x.bytes_written;
  s.bytes_read = x.bytes_read;
  s.misses = x.misses;
  s.write_failures = x.write_failures;
  s.store_full_writes = x.store_full;
  s.write_error = x.write_error;
  s.stall_seconds = x.stall_seconds;
}

inline std::string bytes_text(std::uint64_t b) { return format_bytes(static_cast<double>(b)); }

// Bytes of the trace's tensors that exist when the step starts (made before its first op).
inline std::uint64_t bytes_at_start(const trace::Trace& t) {
  std::uint64_t sum = 0;
  for (const auto& x : t.tensors) {
    if (x.producer == trace::kNoOp && x.persistent) sum += x.bytes;
  }
  return sum;
}

inline constexpr int kMaxTightenings = 4;  // consecutive, per step shape
// Op times from executed steps (retiming.cpp): medians over SessionOptions::retime_steps steps,
// adopted where they differ from the plan's by more than this share; after each adoption the
// next window is twice as long, up to this many times retime_steps.
inline constexpr double kRetimeTolerance = 0.10;
inline constexpr int kMaxRetimeWindowShift = 4;
inline constexpr std::size_t kMaxPendingShapes = 16;

// The process's one plan-mode session: its tracer and executor follow every op of the loop's
// thread, so a second one is refused when it is made, not mid-run.
inline std::atomic<const void*> g_plan_session{nullptr};

struct Session::Impl {
  ~Impl() { leave_plan_slot(); }
  void take_plan_slot();
  void leave_plan_slot();

  // Options that only plan mode uses are refused in the others rather than ignored.
  void refuse_plan_options() const;

  // Options left to the machine (SessionOptions: memory_budget and budget_fraction both 0,
  // strict_meter unset, host_memory kHostMemoryAuto), chosen from what it has. On a CUDA device
  // in plan mode: the budget is what tensors can hold there, the wall stands from step 0, and
  // host memory is a tier; elsewhere the CPU's documented defaults. stats().defaults says what
  // was chosen, with the figures.
  void choose_defaults();

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
  // PlanExecutor::out_of_memory_retries() (process-wide) when the session was made.
  std::uint64_t retries_at_start = PlanExecutor::out_of_memory_retries();

  // One step shape: its ops, its profile, the capacity its plan was made for and the plan.
  struct Shape {
    trace::Trace trace;
    plan::Plan plan;
    double peak_live = 0;   // the trace's peak of live bytes, everything kept
    double capacity = 0;    // planner units (trace bytes)
    int tightenings = 0;    // consecutive
    int retimings = 0;      // plans made on op times from executed steps
    bool at_floor = false;  // no plan can go lower
    // Executed steps' op times since the last check (retiming.cpp).
    std::vector<std::vector<double>> executed_times;
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
  bool walled_from_start() const;

  void start_profiling();

  plan::Hardware hardware();

  // The store's bandwidth, once; on the CPU also what its I/O and the host tier's copies take
  // from compute there (the device is the CPU the I/O runs on).
  void measure_store();

  // Plans `shape` for `capacity` (trace bytes). When no plan fits, the smallest capacity that
  // plans (bisection), and the reason, unless the budget is strict. At every capacity tried,
  // tensors under the smallest size moved may be what keeps it out of reach (a small model's
  // tensors are mostly under 1 MiB): then smaller ones are made movable, a quarter of the size
  // at a time down to 4 KiB, and the executor moves them too.
  plan::Plan plan_for(const Shape& shape, double& capacity, bool& at_floor);

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
  void adopt_min_bytes(std::uint64_t least);

  // Something the user should know, said once, after what stats().notice says already.
  void add_notice(const std::string& why);

  void summarise(const Shape& s);

  // The planner counts the trace's tensors; the meter counts every allocation (memory no op
  // touches, allocator padding, tensors made and dropped inside an op). The difference is
  // subtracted from the budget: what the planner may use is what the meter leaves it.
  double capacity_for(const Shape& s) const;

  // The executor's hard budget: the user's, or, when a shape's plan cannot meet it, the least
  // memory that plan reaches (the executor would otherwise write out and read back the same
  // tensors over and over for a budget no plan can keep).
  std::uint64_t executor_budget(const Shape& added) const;

  // kAuto: -1 until the first plan, then 0 (resident) or 1 (offloaded).
  int boundary = -1;
  bool boundary_offloaded() const;

  // A trace recorded with the step-end op, made into one without it (the boundary offloaded).
  static void strip_step_end(trace::Trace& t);

  // kAuto, at the first plan: the step boundary stays resident when a plan meets the budget so
  // (nothing changes for code between steps); otherwise the tensors may stay out across it.
  void choose_boundary(const trace::Trace& t);

  // A new step shape: plan it and hand it to the executor (made on the first).
  void add_shape(trace::Trace t);

  // Runs `planning`; when it refuses the loop (InvalidArgument: a torch.compile'd region, a
  // plan that cannot be made), the session stops tracing and brings every tensor back before
  // the error leaves end_step, so that a session kept alive by the caller (or by the
  // exception's traceback in Python) does not hold the process's one tracer.
  template <typename Planning>
  void plan_or_stop(Planning&& planning);

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
  void set_wall(std::uint64_t bytes);
  void apply_cap();
  // The plan's view of a step of shape `index`, for the timeline: the simulator's replay of the
  // plan on its trace (memory per op, in the meter's bytes: plus what no step touches).
  plan::TimelineStep planned_view(int index);

  // The I/O threads' time so far (store and host pool), for the timeline's per-step figure.
  std::pair<double, double> io_seconds() const;
  std::pair<double, double> io_at_step_start{-1, -1};

  // The channel rates the plans assumed (for the report's sentence); kept when the session
  // closes its store.
  plan::ChannelRates rates_at_close;
  plan::ChannelRates assumed_rates();

  // The timeline file (SessionOptions::timeline_path) is optional output: a failure to write it
  // is a warning that names the path, and the session's results stay.
  void write_timeline_file();

  // The executor's destructor brings every moved tensor back; the tracer's removes its
  // callbacks. What ~Session and close() both do.
  void stop_offloading();

  void lift_cap();

  // torch.compile's generated kernels read and write tensors without going through ATen's
  // dispatcher: the tracer sees a compiled region as one op and the residency guard cannot see
  // inside it, so a plan could release a tensor that such a kernel then reads. Refused before
  // any plan runs (profiling steps offload nothing).
  static void refuse_compiled_code(const trace::Trace& t);

  void make_first_plan();

  // After an executed step: a step of an unknown shape is kept until its shape is seen again,
  // then planned; a known shape over the budget is planned again for less.
  void after_executed_step(const ExecutorStats& e, std::uint64_t peak);

  // Executed step of shape `index`, within its plan: its op times are kept, and every
  // retime_steps steps (twice as many after each retiming, up to 16 times as many) their medians
  // replace the trace's where those are off by more than kRetimeTolerance, and the shape is
  // planned again (on a CPU device only).
  void note_executed_times(int index);
  // Plans step shape `index` again, for `capacity` (trace bytes), and hands the plan over. The
  // budget's record (steps measured, their peak) goes on: a plan for less memory (tighten)
  // starts it anew.
  void replan(int index, double capacity);
  // Hands plan `p` of step shape `index`, made for `capacity`, to the executor.
  void install_plan(int index, plan::Plan p, double capacity, bool at_floor);
  // Plans step shape `index` again for `over` bytes less capacity, and a little more.
  // end_step's stages, in order: the observers' ends and the step's peak (a failed read back
  // is kept in `error`), activation mode's rule, plan mode's planning, the timeline.
  std::uint64_t end_step_observers(std::int64_t step, std::exception_ptr& error);
  void after_activation_step(std::uint64_t peak);
  void after_plan_step(std::uint64_t peak, bool failed);
  void end_timeline_step(std::uint64_t peak);
  void tighten(int index, double over);

  // Session::plan_ahead (plan_ahead.cpp). The later steps' trace, until step 0 has run; and
  // whether the next step binds its persistent tensors to the plan's ids by name at its start
  // (step 0, and step 1, which registers the state step 0 made).
  std::optional<trace::Trace> ahead_steady;
  bool bind_by_name_next_step = false;
  bool ahead_left_said = false;  // a step left the plan made ahead: said once
  // Binds the registered tensors to shape 0's trace ids of the same names (before a step: the
  // plan may write them out before any op shows them).
  void bind_persistent_by_name();
  // After step 0 of a plan made ahead: shape 0 becomes the later steps' trace, planned anew.
  void take_steady_shape();
};

template <typename Planning>
void Session::Impl::plan_or_stop(Planning&& planning) {
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

}  // namespace tidal::torch_layer
