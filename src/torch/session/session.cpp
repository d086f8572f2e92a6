#include "tidal/torch/session.hpp"

#include "torch/session/session_impl.hpp"

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

// The timeline's word for a step the session runs in state `s`.
plan::StepState step_state(SessionState s) {
  switch (s) {
    case SessionState::kOff:
      return plan::StepState::kOff;
    case SessionState::kWarmup:
      return plan::StepState::kWarmup;
    case SessionState::kProfiling:
      return plan::StepState::kProfiling;
    case SessionState::kExecuting:
      return plan::StepState::kExecuting;
  }
  return plan::StepState::kOff;
}

}  // namespace

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
    m.timeline->begin_step(step, step_state(m.state), m.stats.memory_budget, m.wall);
    m.io_at_step_start = m.io_seconds();
  }
  if (m.bind_by_name_next_step) {
    m.bind_by_name_next_step = false;
    m.bind_persistent_by_name();
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
    m.timeline->label_step(step_state(m.state), m.stats.memory_budget, m.wall);
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

std::uint64_t Session::Impl::end_step_observers(std::int64_t step, std::exception_ptr& error) {
  SessionStats& s = stats;
  s.bytes_written = s.bytes_read = s.misses = s.write_failures = s.store_full_writes = 0;
  s.bytes_to_host = s.bytes_from_host = 0;
  s.write_error.clear();
  s.stall_seconds = 0;
  // The step's tensors come back here (BetweenSteps::kResident): a read that fails throws, after
  // the session is left consistent for the next step.
  try {
    if (tracer) tracer->end_step(step);
  } catch (const Error&) {
    error = std::current_exception();
  }
  if (executor) executor->end_step(step);
  if (offloading) offloader->end_step(step);
  // While profiling, the tracer resets the meter's peak at every op (workspaces): it has the
  // step's peak.
  const std::uint64_t peak = tracer ? std::max(peak_now(), tracer->step_peak()) : peak_now();
  s.step_peak = peak;
  return peak;
}

// Activation mode: the step's I/O, and the rule that stops offloading that does not lower the
// peak; before offloading starts, the reference peak.
void Session::Impl::after_activation_step(std::uint64_t peak) {
  SessionStats& s = stats;
  if (offloading) {
    take_io_stats(s, offloader->last_step());
    s.bytes_to_host = offloader->last_step().bytes_to_host;
    if (s.notice.empty()) s.notice = offloader->notice();
    // One step that does not peak at least 1% lower than the reference is enough: offloading
    // that pays lowers the peak clearly, and "never above no offloading" must not wait for a
    // pattern. (A few KiB lower is the allocator's noise, not worth the writes.)
    if (peak + reference_peak / 100 >= reference_peak) ++steps_not_lower;
    if (steps_not_lower >= 1 && opt.activations.adaptive) {
      offloading_off = true;
      if (s.notice.empty()) {
        s.notice = "activation offloading did not lower this loop's peak (" + bytes_text(peak) +
                   " with it, " + bytes_text(reference_peak) +
                   " without, in the first step; less than 1% lower does not pay for the I/O): "
                   "its peak lies elsewhere (the optimizer step, data held in memory), or its "
                   "tensors are too small or its steps too short for the I/O to free memory in "
                   "time; saved tensors stay in memory";
      }
    }
  } else if (offloader && reference_peak == 0 && steps_in_state > opt.warmup_steps) {
    reference_peak = std::max<std::uint64_t>(peak, 1);
  }
}

// Plan mode: what the executor moved, the first plan after the profiled steps, and each executed
// step's figures against its plan.
void Session::Impl::after_plan_step(std::uint64_t peak, bool failed) {
  SessionStats& s = stats;
  if (executor && executor->planless()) {
    // The wall stood from step 0: what the executor without a plan moved to keep it.
    const ExecutorStats e = executor->last_step();
    take_io_stats(s, e);
    s.write_stall_seconds = e.write_stall_seconds;
  }
  if (state == SessionState::kProfiling) {
    s.profiled_peak = std::max(s.profiled_peak, peak);
    if (!failed && steps_in_state >= opt.profile_steps) plan_or_stop([&] { make_first_plan(); });
  } else if (state == SessionState::kExecuting && executor) {
    const ExecutorStats e = executor->last_step();
    take_io_stats(s, e);
    s.write_stall_seconds = e.write_stall_seconds;
    s.bytes_to_host = e.bytes_to_host;
    s.bytes_from_host = e.bytes_from_host;
    s.bytes_staged = e.bytes_staged;
    s.host_stall_seconds = e.host_stall_seconds;
    s.shape = e.shape;
    if (e.shape >= 0 && static_cast<std::size_t>(e.shape) < shapes.size()) {
      const plan::PlanSummary& ps = shapes[static_cast<std::size_t>(e.shape)].plan.summary;
      s.planned_bytes_to_ssd = ps.bytes_to_ssd;
      s.planned_bytes_to_host = ps.bytes_to_host;
      s.planned_step_seconds = ps.compute_seconds + ps.planned_stall_seconds;
    }
    if (!failed) plan_or_stop([&] { after_executed_step(e, peak); });
    s.within_budget = s.steps_measured > 0 && all_within && s.steps_over_budget == 0;
    // A reason is for a budget not met: one left from a planning attempt that the executed
    // steps overcame would contradict within_budget.
    if (s.within_budget) s.budget_reason.clear();
  }
  // Plans made ahead: the later steps' plan once step 0 has run.
  if (ahead_steady && state == SessionState::kExecuting && !failed) {
    plan_or_stop([&] { take_steady_shape(); });
  }
}

// The step's facts for the timeline: the plan's view of it, and what was measured.
void Session::Impl::end_timeline_step(std::uint64_t peak) {
  if (!timeline) return;
  const SessionStats& s = stats;
  plan::TimelineStep facts =
      state == SessionState::kExecuting && executor ? planned_view(s.shape) : plan::TimelineStep{};
  facts.peak = peak;
  facts.misses = s.misses;
  const auto io = io_seconds();
  const auto& was = io_at_step_start;
  facts.io_busy_seconds = io.first >= 0 && was.first >= 0 ? io.first - was.first : -1;
  facts.checksum_seconds = io.second >= 0 && was.second >= 0 ? io.second - was.second : -1;
  timeline->end_step(facts);
}

void Session::end_step(std::int64_t step) {
  Impl& m = *impl_;
  if (!m.in_step) return;
  m.in_step = false;
  std::exception_ptr error;
  const std::uint64_t peak = m.end_step_observers(step, error);
  ++m.steps_in_state;
  m.after_activation_step(peak);
  m.after_plan_step(peak, error != nullptr);
  m.end_timeline_step(peak);
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
    m.timeline->label_step(plan::StepState::kAborted, s.memory_budget, m.wall);
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
  s.out_of_memory_retries = PlanExecutor::out_of_memory_retries() - impl_->retries_at_start;
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
