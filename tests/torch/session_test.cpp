#include "tidal/torch/session.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/memory.hpp"
#include "torch/test_models.hpp"

namespace tidal::torch_layer {
namespace {

struct RunResult {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
  SessionStats stats;
  ExecutorStats executor;
  std::uint64_t held_before = 0;  // the meter's bytes before the trainer was made
};

// The optimizer schedule of a run: after-backward (default), in-backward, deferred, clipping.
struct Schedule {
  bool in_backward = false;
  bool deferred = false;
  double clip = 0;
  std::int64_t micro_batches = 1;
  plan::MicroBatchOrder order = plan::MicroBatchOrder::kSequential;
  bool host = false;  // the optimizer step on the host (AdamW::Options::on_host)
};

RunResult train(const std::string& model, OffloadMode mode, const std::string& dir, int steps,
                io::FaultPlan faults = {}, Schedule schedule = {}) {
  MemoryMeter meter(torch::kCPU);
  const std::uint64_t held_before = meter.current_bytes();
  models::TrainerOptions o = testing::tiny_options(model, 4, 32, 77);
  o.optimizer = optimizer_schedule(schedule.in_backward, schedule.deferred);
  o.clip_grad_norm = schedule.clip;
  o.micro_batches = schedule.micro_batches;
  o.micro_batch_order = schedule.order;
  o.adamw.on_host = schedule.host;
  models::Trainer trainer(o);
  SessionOptions so;
  so.mode = mode;
  so.store.dirs = {dir};
  so.store.capacity = 512 * kMiB;
  so.store.faults = faults;
  so.activations.min_bytes = 16 * 1024;
  // These tests check that what moves comes back bit for bit; at this size offloading does not
  // lower the peak, so the step-scale rule would stop it.
  so.activations.adaptive = false;
  so.executor.min_bytes = 16 * 1024;
  so.budget_fraction = 0.5;
  // Not the strict meter: these tiny models miss the 50% budget with the default resident step
  // boundary and run at the least peak a plan reaches, which the executor does not hold to the
  // byte (a composite op's inner allocations; tensors under min_bytes). What is tested here is
  // the losses; loops_test and test_strict_meter.py run plan mode under the wall.
  so.peak_bytes = [&meter] { return meter.peak_bytes(); };
  so.reset_peak = [&meter] { meter.reset_peak(); };
  so.model_name = model;
  RunResult r;
  r.held_before = held_before;
  {
    Session session(so);
    trainer.add_observer(&session);
    for (int i = 0; i < steps; ++i) {
      r.losses.push_back(trainer.step().loss);
      // Gradients exist after the first step; they stay only on the after-backward schedule.
      if (i == 0 && !schedule.in_backward && !schedule.deferred)
        trainer.register_persistent(session);
    }
    trainer.remove_observer(&session);
    r.stats = session.stats();
  }                           // the session brings back whatever it moved
  trainer.flush_optimizer();  // deferred: the last step's updates
  for (auto& p : trainer.model()->parameters()) r.params.push_back(p.detach().clone());
  return r;
}

void expect_same(const RunResult& a, const RunResult& b, const char* what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << what << " step " << i;
  }
  ASSERT_EQ(a.params.size(), b.params.size());
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << what << " parameter " << i;
  }
}

// The runs of one optimizer schedule in each offload mode.
struct ModeRuns {
  RunResult none;
  RunResult activations;
  RunResult plan;
};

// Trains `model` on `schedule` in each offload mode and expects each run bit-identical to
// `reference` (a run on the after-backward schedule), and the plan executing and moving bytes.
ModeRuns expect_same_in_every_mode(const RunResult& reference, const std::string& model,
                                   const Schedule& schedule, const std::string& name,
                                   const std::string& dir, int steps) {
  ModeRuns r;
  r.none = train(model, OffloadMode::kNone, dir, steps, {}, schedule);
  r.activations = train(model, OffloadMode::kActivations, dir, steps, {}, schedule);
  r.plan = train(model, OffloadMode::kPlan, dir, steps, {}, schedule);
  expect_same(reference, r.none, (name + " against after-backward").c_str());
  expect_same(reference, r.activations, (name + " with activation offloading").c_str());
  expect_same(reference, r.plan, (name + " with the plan").c_str());
  EXPECT_EQ(r.plan.stats.state, SessionState::kExecuting) << r.plan.stats.plan_summary;
  EXPECT_GT(r.plan.stats.bytes_written, 0u) << r.plan.stats.plan_summary;
  return r;
}

class SessionModes : public ::testing::TestWithParam<std::string> {};

TEST_P(SessionModes, AllModesGiveBitIdenticalLossesAndParameters) {
  testing::TestDir dir;
  const int steps = 20;
  const RunResult none = train(GetParam(), OffloadMode::kNone, dir.path(), steps);
  const RunResult act = train(GetParam(), OffloadMode::kActivations, dir.path(), steps);
  const RunResult plan = train(GetParam(), OffloadMode::kPlan, dir.path(), steps);
  expect_same(none, act, "activations");
  expect_same(none, plan, "plan");
  EXPECT_GT(act.stats.bytes_written, 0u) << "activation mode moved nothing";
  EXPECT_EQ(plan.stats.state, SessionState::kExecuting) << plan.stats.plan_summary;
  EXPECT_GT(plan.stats.bytes_written, 0u) << "the plan moved nothing: " << plan.stats.plan_summary;
  EXPECT_EQ(plan.stats.replans, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, SessionModes, ::testing::Values("gpt-tiny", "llama-tiny"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// The optimizer-in-backward schedule updates each parameter from a hook on its gradient
// accumulator during backward: the same updates as the step after backward, bit for bit, and
// the same again with every offload mode (the plan is made on the in-backward trace, where the
// AdamW ops sit inside the backward phase).
TEST(Session, OptimizerInBackwardIsBitIdenticalInEveryMode) {
  testing::TestDir dir;
  const int steps = 12;
  const RunResult after = train("gpt-tiny", OffloadMode::kNone, dir.path(), steps);
  Schedule in_backward;
  in_backward.in_backward = true;
  const ModeRuns runs =
      expect_same_in_every_mode(after, "gpt-tiny", in_backward, "in-backward", dir.path(), steps);
  const RunResult& none = runs.none;
  EXPECT_GT(runs.activations.stats.bytes_written, 0u);
  // The parameters really changed (the hooks ran): not the initial weights.
  models::TrainerOptions o;
  o.config = models::model_config("gpt-tiny");
  o.seed = 77;
  models::Trainer fresh(o);
  const auto init = fresh.model()->parameters();
  ASSERT_EQ(init.size(), none.params.size());
  for (std::size_t i = 0; i < init.size(); ++i) {
    EXPECT_FALSE(torch::equal(init[i].detach(), none.params[i])) << "parameter " << i;
  }
}

// The deferred schedule updates each parameter right before its first use in the next forward
// pass, with the gradients clipped by the global norm: bit-identical to clipping and stepping
// after backward, in every offload mode; and the clipping is really in force.
TEST(Session, OptimizerDeferredWithClippingIsBitIdenticalInEveryMode) {
  testing::TestDir dir;
  const int steps = 12;
  Schedule clip;
  clip.clip = 0.05;
  Schedule deferred = clip;
  deferred.deferred = true;
  const RunResult after = train("llama-tiny", OffloadMode::kNone, dir.path(), steps, {}, clip);
  expect_same_in_every_mode(after, "llama-tiny", deferred, "clipped deferred", dir.path(), steps);
  const RunResult unclipped = train("llama-tiny", OffloadMode::kNone, dir.path(), steps);
  EXPECT_NE(after.losses.back(), unclipped.losses.back()) << "the clipping changed nothing";
}

// Micro-batches (gradient accumulation) in both orders. Layer-major runs every micro-batch
// through a block before the next block, forward and backward, each (block, micro-batch) its own
// graph: on a model without tied weights (llama-tiny) it is the sequential order's arithmetic, bit
// for bit, and in every offload mode (the plan is made on the layer-major trace, where each
// block's ops for all micro-batches sit together). On GPT-2 (its head tied to the embedding) the
// two uses of that weight sum in another order: every mode is bit-identical to layer-major
// without offloading, and within rounding of the sequential order. Accumulated micro-batches are
// within rounding of the whole batch.
TEST(Session, LayerMajorMicroBatchesAreBitIdenticalInEveryMode) {
  testing::TestDir dir;
  const int steps = 10;
  Schedule sequential;
  sequential.micro_batches = 2;
  Schedule layer_major = sequential;
  layer_major.order = plan::MicroBatchOrder::kLayerMajor;

  const RunResult llama_seq =
      train("llama-tiny", OffloadMode::kNone, dir.path(), steps, {}, sequential);
  expect_same_in_every_mode(llama_seq, "llama-tiny", layer_major, "llama layer-major", dir.path(),
                            steps);
  const RunResult whole = train("llama-tiny", OffloadMode::kNone, dir.path(), steps);
  for (std::size_t i = 0; i < whole.losses.size(); ++i) {
    EXPECT_NEAR(whole.losses[i], llama_seq.losses[i], 1e-4) << "step " << i;
  }

  const RunResult gpt_lm =
      train("gpt-tiny", OffloadMode::kNone, dir.path(), steps, {}, layer_major);
  expect_same_in_every_mode(gpt_lm, "gpt-tiny", layer_major, "gpt layer-major", dir.path(), steps);
  const RunResult gpt_seq =
      train("gpt-tiny", OffloadMode::kNone, dir.path(), steps, {}, sequential);
  for (std::size_t i = 0; i < gpt_seq.losses.size(); ++i) {
    EXPECT_NEAR(gpt_seq.losses[i], gpt_lm.losses[i], 1e-4) << "step " << i;
  }
  // (Not the parameters: Adam divides by the root of the second moment, so a rounding
  // difference in a gradient near zero moves a weight by up to the learning rate.)
}

// The optimizer step on the host: the same AdamW on host copies, with the gradients taken to the
// host as backward completes them, is the device step's arithmetic on a CPU device: bit for bit,
// in every mode, with micro-batches in either order. Its state is host memory: never registered,
// never in the trace, never moved (the plan has less to move than the device step's).
TEST(Session, OptimizerStepOnTheHostIsBitIdenticalInEveryMode) {
  testing::TestDir dir;
  const int steps = 8;
  for (const auto order :
       {plan::MicroBatchOrder::kSequential, plan::MicroBatchOrder::kLayerMajor}) {
    Schedule device;
    device.micro_batches = 2;
    device.order = order;
    Schedule host = device;
    host.host = true;
    const RunResult reference =
        train("llama-tiny", OffloadMode::kNone, dir.path(), steps, {}, device);
    const ModeRuns runs =
        expect_same_in_every_mode(reference, "llama-tiny", host, "host step", dir.path(), steps);
    const RunResult device_plan =
        train("llama-tiny", OffloadMode::kPlan, dir.path(), steps, {}, device);
    EXPECT_LT(runs.plan.stats.profiled_peak - runs.plan.held_before,
              device_plan.stats.profiled_peak - device_plan.held_before)
        << "the host step's device memory holds no optimizer state";
  }
}

TEST(Session, MicroBatchesThatDoNotDivideTheBatchSaySo) {
  models::TrainerOptions o = testing::tiny_options("gpt-tiny", 4, 32, 77);
  o.micro_batches = 3;
  EXPECT_THROW(models::Trainer{o}, InvalidArgument);
  o.micro_batches = 2;
  o.optimizer = OptimizerSchedule::kInBackward;
  EXPECT_THROW(models::Trainer{o}, InvalidArgument);
}

TEST(Session, AFailingStoreNeverChangesALoss) {
  testing::TestDir dir;
  const RunResult none = train("gpt-tiny", OffloadMode::kNone, dir.path(), 8);
  io::FaultPlan faults;
  faults.fail_op = 5;
  faults.fail_every_after = true;
  faults.only_writes = true;
  const RunResult act = train("gpt-tiny", OffloadMode::kActivations, dir.path(), 8, faults);
  const RunResult plan = train("gpt-tiny", OffloadMode::kPlan, dir.path(), 8, faults);
  expect_same(none, act, "activations with a failing store");
  expect_same(none, plan, "plan with a failing store");
  // Each mode met the failing disk on its own (a sum over both would let one mode that never
  // wrote hide behind the other): the last step's writes failed, and the plan was running.
  EXPECT_GT(act.stats.write_failures, 0u) << "activation mode wrote nothing that could fail";
  EXPECT_FALSE(act.stats.write_error.empty());
  EXPECT_EQ(plan.stats.state, SessionState::kExecuting) << plan.stats.plan_summary;
  EXPECT_GT(plan.stats.write_failures, 0u) << "plan mode wrote nothing that could fail";
  EXPECT_FALSE(plan.stats.write_error.empty());
}

// Memory the trace never saw: from step `from` on, bytes() from the CPU allocator (no op, so the
// same step shape) held from the start of backward, where a step's activations are all alive,
// to the step's end. A step's own allocation that grew after profiling, as a user's buffer does.
class LateAllocation final : public StepObserver {
 public:
  LateAllocation(std::int64_t from, std::function<std::uint64_t()> bytes)
      : from_(from), bytes_(std::move(bytes)) {}
  void begin_step(std::int64_t step, const std::vector<torch::Tensor>&) override { step_ = step; }
  void begin_phase(trace::Phase phase) override {
    if (phase != trace::Phase::kBackward || step_ < from_) return;
    const std::uint64_t n = bytes_();
    held_ = c10::GetAllocator(c10::kCPU)->allocate(n);
    std::memset(held_.get(), 1, n);  // really used
  }
  void end_step(std::int64_t) override { held_.clear(); }

 private:
  std::int64_t from_;
  std::function<std::uint64_t()> bytes_;
  std::int64_t step_ = 0;
  c10::DataPtr held_;
};

// Plan mode on the tiny GPT in `dir`: a budget the first plan meets with room to plan for less
// (and above its floor), and the preset's SSD figures for this machine (no 64 MiB measurement of
// the store, seconds on a busy disk; the same plans on every run).
SessionOptions tiny_plan_options(OffloadMode mode, const std::string& dir) {
  SessionOptions so;
  so.mode = mode;
  so.store.dirs = {dir};
  so.store.capacity = 256 * kMiB;
  so.executor.min_bytes = 16 * 1024;
  so.budget_fraction = 0.8;
  so.hardware_overrides.ssd = plan::parse_ssd_spec("1x2.0/1.5GB/s");
  return so;
}

// `steps` steps of `trainer` observed by `session` and `extra`; `after(i)` after step i.
template <typename After>
std::vector<double> train_observed(models::Trainer& trainer, Session& session, StepObserver& extra,
                                   int steps, After after) {
  trainer.add_observer(&session);
  trainer.add_observer(&extra);
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    losses.push_back(trainer.step().loss);
    if (i == 0) trainer.register_persistent(session);
    after(i);
  }
  trainer.remove_observer(&extra);
  trainer.remove_observer(&session);
  return losses;
}

// A step over the hard budget (memory the plan did not know of) makes the session plan that
// step shape again for less memory; the tighter plan keeps the budget, and no loss changes.
TEST(Session, AStepOverTheBudgetIsPlannedAgainForLess) {
  testing::TestDir dir;
  const int steps = 12;
  const std::int64_t late_from = 5;  // two steps after the first plan (warm-up, 2 profiled)
  struct Run {
    std::vector<double> losses;
    std::vector<SessionStats> per_step;
    std::vector<std::uint64_t> planned_peak;  // after each step: the plan's, in trace bytes
  };
  const auto run = [&](OffloadMode mode) {
    MemoryMeter meter(torch::kCPU);
    models::Trainer trainer(testing::tiny_options("gpt-tiny", 4, 32, 77));
    SessionOptions so = tiny_plan_options(mode, dir.path());
    so.peak_bytes = [&meter] { return meter.peak_bytes(); };
    so.current_bytes = [&meter] { return meter.current_bytes(); };
    so.reset_peak = [&meter] { meter.reset_peak(); };
    Session session(so);
    // Sized at the first late step to cross the budget there by a twentieth of it (in mode
    // none, where there is no budget, by the same share of the peak), then the same each step:
    // the plan made before it cannot keep the budget, one made for that much less can.
    std::uint64_t late_bytes = 0;
    LateAllocation late(late_from, [&] {
      if (late_bytes == 0) {
        const std::uint64_t wall =
            mode == OffloadMode::kNone ? meter.peak_bytes() : session.stats().memory_budget;
        late_bytes = wall - std::min(wall, meter.current_bytes()) + wall / 20;
      }
      return late_bytes;
    });
    Run r;
    r.losses = train_observed(trainer, session, late, steps, [&](int) {
      r.per_step.push_back(session.stats());
      r.planned_peak.push_back(session.plan() ? session.plan()->summary.peak_after_bytes : 0);
    });
    return r;
  };
  const Run none = run(OffloadMode::kNone);
  const Run plan = run(OffloadMode::kPlan);
  EXPECT_EQ(none.losses, plan.losses);
  const SessionStats& before = plan.per_step[static_cast<std::size_t>(late_from - 1)];
  ASSERT_EQ(before.state, SessionState::kExecuting) << before.plan_summary;
  EXPECT_EQ(before.steps_over_budget, 0) << "over the budget before the late allocation";
  const SessionStats& first = plan.per_step[static_cast<std::size_t>(late_from)];
  EXPECT_GT(first.step_peak, first.memory_budget) << "the late allocation did not cross it";
  EXPECT_EQ(first.steps_over_budget, 1);
  EXPECT_GT(first.tightenings, before.tightenings) << first.budget_reason;
  EXPECT_EQ(first.replans - first.tightenings, before.replans - before.tightenings)
      << "the same step shape, planned again: not a new one";
  EXPECT_FALSE(first.within_budget);
  const auto k = static_cast<std::size_t>(late_from);
  EXPECT_LT(plan.planned_peak[k], plan.planned_peak[k - 1]) << "planned again, but not for less";
  // Every later step over the budget is planned again too, until no plan can go lower (the
  // session then says why). (Whether the last plan keeps the budget is not asserted: memory
  // taken between two ops is outside what the executor guards, and how much the plan holds
  // there depends on which writes have finished.)
  for (std::size_t i = k + 1; i < plan.per_step.size(); ++i) {
    const SessionStats& s = plan.per_step[i];
    const SessionStats& prev = plan.per_step[i - 1];
    if (s.steps_over_budget == prev.steps_over_budget) continue;
    EXPECT_TRUE(s.tightenings > prev.tightenings || !s.budget_reason.empty())
        << "step " << i << " went over the budget and was neither planned again nor explained";
  }
  const SessionStats& last = plan.per_step.back();
  EXPECT_EQ(last.shapes, 1);
}

// Sleeps before backward's first op in the steps before `until`: the profiled steps run slower
// than the executed ones, as a process's first steps do on a CPU.
class SlowFirstSteps final : public StepObserver {
 public:
  SlowFirstSteps(std::int64_t until, double seconds) : until_(until), seconds_(seconds) {}
  void begin_step(std::int64_t step, const std::vector<torch::Tensor>&) override { step_ = step; }
  void begin_phase(trace::Phase phase) override {
    if (phase != trace::Phase::kBackward || step_ >= until_) return;
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds_));
  }

 private:
  std::int64_t until_;
  double seconds_;
  std::int64_t step_ = 0;
};

// Op times that executed steps contradict are replaced by theirs, and the step shape planned
// again on them, under the wall, with no loss changed: the plan's compute time drops by what
// only the profiled steps spent.
TEST(Session, PlansAgainOnOpTimesFromExecutedSteps) {
  testing::TestDir dir;
  const int steps = 14;
  const std::int64_t first_executed = 3;  // after the warm-up and 2 profiled steps
  const double slow = 0.2;
  struct Run {
    std::vector<double> losses;
    std::vector<SessionStats> per_step;
    std::vector<double> planned_compute;  // after each step: the plan's, 0 before it
  };
  const auto run = [&](OffloadMode mode) {
    models::Trainer trainer(testing::tiny_options("gpt-tiny", 4, 32, 77));
    SessionOptions so = tiny_plan_options(mode, dir.path());  // above its floor: it is retimed
    if (mode == OffloadMode::kPlan) so.strict_meter = true;
    Session session(so);
    SlowFirstSteps slower(first_executed, slow);
    Run r;
    r.losses = train_observed(trainer, session, slower, steps, [&](int) {
      r.per_step.push_back(session.stats());
      r.planned_compute.push_back(session.plan() ? session.plan()->summary.compute_seconds : 0);
    });
    return r;
  };
  const Run none = run(OffloadMode::kNone);
  const Run plan = run(OffloadMode::kPlan);
  EXPECT_EQ(none.losses, plan.losses);
  const auto first = static_cast<std::size_t>(first_executed - 1);
  ASSERT_EQ(plan.per_step[first].state, SessionState::kExecuting) << plan.per_step[first].notice;
  EXPECT_EQ(plan.per_step[first].retimings, 0);
  EXPECT_GE(plan.planned_compute[first], slow) << "the profiled steps' sleep is not in the plan";
  const SessionStats& last = plan.per_step.back();
  EXPECT_GE(last.retimings, 1) << last.plan_summary;
  EXPECT_LT(plan.planned_compute.back(), plan.planned_compute[first] - slow / 2)
      << "planned again on executed steps' op times, but they still hold the profiled sleep";
  EXPECT_EQ(last.steps_over_budget, 0) << last.budget_reason;
  EXPECT_EQ(last.shapes, 1);
}

TEST(Session, BadModeNameSaysWhatToUse) {
  try {
    offload_mode_from_string("ssd");
    FAIL();
  } catch (const tidal::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("none, activations, plan"), std::string::npos);
  }
}

}  // namespace
}  // namespace tidal::torch_layer
