// Tests of the optimizer step on the host: the simulator's host tasks, the trace rewrite, and
// the plan and bound of the class on analytic traces.
#include "tidal/plan/host_step.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/policies.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan {
namespace {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

// Four ops of 0.1 s. W: a 100-byte parameter used by ops 0 and 2; G: its 100-byte gradient,
// made by op 2. The host link moves 100 bytes/s each way, the SSDs nothing.
trace::Trace weight_and_gradient() {
  trace::Trace t;
  t.model = "hand";
  for (int k = 0; k < 4; ++k) {
    trace::Op op;
    op.index = k;
    op.name = "op" + std::to_string(k);
    op.phase = k < 2 ? Phase::kForward : Phase::kBackward;
    op.start_s = 0.1 * k;
    op.end_s = 0.1 * (k + 1);
    t.ops.push_back(op);
  }
  trace::Tensor w;
  w.id = 0;
  w.name = "W";
  w.bytes = 100;
  w.cls = TensorClass::kParameter;
  w.persistent = true;
  trace::Tensor g;
  g.id = 1;
  g.name = "W.grad";
  g.bytes = 100;
  g.cls = TensorClass::kGradient;
  g.producer = 2;
  g.output_slot = 0;
  t.tensors = {w, g};
  t.ops[0].inputs = {0};
  t.ops[2].inputs = {0};
  t.ops[2].outputs = {1};
  trace::validate(t);
  return t;
}

Hardware link_of(double bytes_per_second) {
  Hardware hw;
  hw.name = "test";
  hw.device_memory = 1000;
  hw.host_link_bw = bytes_per_second;
  hw.host_memory = 1000;
  hw.gpu_flops = 1e12;
  hw.gpu_mem_bw = 1e11;
  hw.memory_margin = 0;
  return hw;
}

PlanAction action(TensorId id, ActionKind kind, OpIndex trigger, OpIndex deadline) {
  PlanAction a;
  a.tensor = id;
  a.kind = kind;
  a.trigger = trigger;
  a.deadline = deadline;
  a.target = Target::kHost;
  a.bytes = 100;
  a.wraps = deadline <= trigger;
  return a;
}

// G leaves for host memory after op 2, W leaves after it too and is read back before op 0.
Plan host_step_by_hand(const trace::Trace& t) {
  Plan p;
  p.model = t.model;
  p.hardware = "test";
  p.num_ops = 4;
  p.num_tensors = 2;
  p.actions = {action(1, ActionKind::kOffload, 2, 0), action(0, ActionKind::kOffload, 2, 3),
               action(0, ActionKind::kPrefetch, 2, 0)};
  validate_plan(p, t);
  return p;
}

TEST(HostTasks, AReadOfARefreshedTensorWaitsForItsTaskWhichWaitsForItsInput) {
  const trace::Trace t = weight_and_gradient();
  const Plan p = host_step_by_hand(t);
  const Hardware hw = link_of(100);
  for (double task_seconds : {0.0, 0.7, 2.0}) {
    SimOptions o;
    o.host_tasks = {{"adamw.W", 2, task_seconds, {1}, {0}}};
    const SimResult r = simulate(t, &p, hw, o);
    // Op 2 ends; G takes 1 s to reach host memory, then the task runs, then W takes 1 s to come
    // back; op 0 of the next iteration waits for it (op 3 runs meanwhile).
    EXPECT_NEAR(r.iteration_seconds, 0.3 + 1.0 + task_seconds + 1.0, 1e-9) << task_seconds;
    EXPECT_NEAR(r.host_task_seconds, task_seconds, 1e-12);
    EXPECT_EQ(r.refresh_waits, 1);
    EXPECT_EQ(r.misses, 0);
  }
  // Without the task, W stays clean on the host and comes back as soon as it can: its read
  // starts when op 2 ends, overlapping op 3.
  const SimResult free = simulate(t, &p, hw);
  EXPECT_NEAR(free.iteration_seconds, 0.3 + 1.0, 1e-9);
  EXPECT_EQ(free.refresh_waits, 0);
}

TEST(HostTasks, TheHostRunsItsTasksOneAtATimeInOrder) {
  const trace::Trace t = weight_and_gradient();
  const Plan p = host_step_by_hand(t);
  SimOptions o;
  // A long task queued after op 0 delays the Adam task behind it.
  o.host_tasks = {{"other", 0, 3.0, {}, {}}, {"adamw.W", 2, 0.5, {1}, {0}}};
  const SimResult r = simulate(t, &p, link_of(100), o);
  // "other" runs from 0.1 (end of op 0) to 3.1 in the first iteration; in steady state it
  // starts with each iteration's op 0 and the Adam task follows it: op 0 starts at s, "other"
  // ends at s + 3.1 > G's arrival, Adam ends at s + 3.6, W back at s + 4.6.
  EXPECT_NEAR(r.iteration_seconds, 4.6, 1e-9);
  EXPECT_NEAR(r.host_task_seconds, 3.5, 1e-12);
}

TEST(HostTasks, ATaskWhoseInputThePlanKeepsIsRefused) {
  const trace::Trace t = weight_and_gradient();
  Plan p = host_step_by_hand(t);
  p.actions.erase(p.actions.begin());  // G no longer goes to host memory
  SimOptions o;
  o.host_tasks = {{"adamw.W", 2, 0.1, {1}, {0}}};
  EXPECT_THROW(simulate(t, &p, link_of(100), o), InvalidArgument);
  o.host_tasks = {{"bad", 7, 0.1, {}, {}}};
  EXPECT_THROW(simulate(t, &p, link_of(100), o), InvalidArgument);
}

TEST(HostTasks, ATensorKeptStaleInDeviceMemoryIsRefused) {
  const trace::Trace t = weight_and_gradient();
  Plan p = host_step_by_hand(t);
  p.actions.pop_back();  // W's way out and back over the iteration's end
  p.actions.pop_back();
  SimOptions o;
  o.host_tasks = {{"adamw.W", 2, 0.1, {1}, {0}}};
  EXPECT_THROW(simulate(t, &p, link_of(100), o), InvalidArgument);
}

TransformerConfig small_model(const char* name) {
  TransformerConfig cfg = model_preset(name);
  cfg.layers = 2;
  return cfg;
}

TEST(HostStepModel, SixteenBitWeightsAndGradientsOnTheDeviceTheRestOnTheHost) {
  const Hardware hw = hardware_preset("h100-4ssd");
  for (const char* name : {"gpt2-small", "llama3.2-1b"}) {
    AnalyticTraceOptions o;
    o.precision = Precision::kBf16Mixed;
    o.micro_batches = 3;
    const TransformerConfig cfg = small_model(name);
    const trace::Trace tr = transformer_trace(cfg, 6, 64, hw, o);
    for (GradientAccumulation a : {GradientAccumulation::kHost, GradientAccumulation::kDevice}) {
      const HostStepModel m = host_step_model(tr, hw, a);
      const bool on_host = a == GradientAccumulation::kHost;
      std::uint64_t weights = 0;
      std::uint64_t grads = 0;
      for (const auto& x : m.device.tensors) {
        EXPECT_NE(x.cls, TensorClass::kOptimizerState) << x.name;
        if (x.cls == TensorClass::kParameter) weights += x.bytes;
        if (x.cls == TensorClass::kGradient) grads += x.bytes;
      }
      for (const auto& op : m.device.ops) EXPECT_NE(op.phase, Phase::kOptimizer) << op.name;
      const auto params = static_cast<std::uint64_t>(cfg.parameters());
      EXPECT_EQ(static_cast<std::uint64_t>(m.parameters), params);
      EXPECT_EQ(weights, 2 * params);
      // A gradient per micro-batch, 16-bit, where the host accumulates; one fp32 one where the
      // device does.
      EXPECT_EQ(grads, on_host ? 3 * 2 * params : 4 * params) << name;
      EXPECT_EQ(m.host_state_bytes, 16 * params);
      const double expected =
          static_cast<double>(params) *
          ((on_host ? 3.0 / hw.cpu_accumulate_rate : 0.0) + 1.0 / hw.cpu_adam_rate);
      EXPECT_NEAR(m.host_seconds, expected, 1e-9 * expected);
      EXPECT_EQ(m.refreshed.size(), m.refresh_task.size());
      for (std::size_t i = 0; i < m.refreshed.size(); ++i) {
        EXPECT_EQ(m.tasks[m.refresh_task[i]].refreshes.front(), m.refreshed[i]);
      }
      // Each task follows the last use of the gradient it reads.
      std::vector<OpIndex> last(m.device.tensors.size(), -1);
      for (const auto& op : m.device.ops) {
        for (const auto* ids : {&op.inputs, &op.outputs}) {
          for (TensorId id : *ids) last[static_cast<std::size_t>(id)] = op.index;
        }
      }
      for (const HostTask& task : m.tasks) {
        EXPECT_EQ(task.after, last[static_cast<std::size_t>(task.inputs.front())]) << task.name;
      }
    }
  }
}

TEST(HostStepModel, RefusesATraceWithoutAnOptimizerStepOrRates) {
  const Hardware hw = hardware_preset("h100-4ssd");
  trace::Trace t = transformer_trace(small_model("gpt2-small"), 2, 32, hw);
  Hardware no_rate = hw;
  no_rate.cpu_adam_rate = 0;
  EXPECT_THROW(host_step_model(t, no_rate), InvalidArgument);
  t.ops.erase(std::remove_if(t.ops.begin(), t.ops.end(),
                             [](const trace::Op& op) { return op.phase == Phase::kOptimizer; }),
              t.ops.end());
  EXPECT_THROW(host_step_model(t, hw), InvalidArgument);
}

// On random small shapes, budgets and host links: the plan is valid for the device trace, and
// no simulated plan of the class beats the class's bound; auto is never slower than either.
TEST(HostStepPolicy, NoPlanBeatsTheBoundAndAutoKeepsTheFaster) {
  std::mt19937_64 rng(49);
  int checked = 0;
  for (int i = 0; i < 12; ++i) {
    Hardware hw = hardware_preset("h100-4ssd");
    hw.ssd_count = 1;  // the host-rich machine: one SSD, the link mostly for host memory
    hw.ssd_write_bw = 2e9;
    hw.ssd_read_bw = 1.7e9;
    AnalyticTraceOptions o;
    o.precision = i % 3 == 0 ? Precision::kFp32 : Precision::kBf16Mixed;
    o.micro_batches = 1 + static_cast<int>(rng() % 3);
    const TransformerConfig cfg = small_model(i % 2 == 0 ? "gpt2-small" : "llama3.2-1b");
    const trace::Trace tr = transformer_trace(cfg, 2 * o.micro_batches, 128, hw, o);
    const PolicyResult keep = run_policy(Policy::kKeepAll, tr, hw);
    const double share = 0.3 + 0.5 * static_cast<double>(rng() % 100) / 100.0;
    hw.device_memory = static_cast<std::uint64_t>(share * static_cast<double>(keep.sim.peak_bytes));
    hw.host_link_bw = (5 + static_cast<double>(rng() % 50)) * 1e9;
    hw.cpu_adam_rate = (0.2 + static_cast<double>(rng() % 20) / 10.0) * 1e9;
    PolicyOptions po;
    po.optimizer_step = OptimizerPlacement::kHost;
    PolicyResult host;
    try {
      host = run_policy(Policy::kTidal, tr, hw, po);
    } catch (const InvalidArgument&) {
      continue;  // no plan fits this budget
    }
    ASSERT_TRUE(host.plan && host.plan_trace && host.bound);
    EXPECT_EQ(host.optimizer_step, OptimizerPlacement::kHost);
    validate_plan(*host.plan, *host.plan_trace);
    if (host.bound->no_fit_op < 0) {
      EXPECT_GE(host.sim.iteration_seconds, host.bound->iteration_seconds * (1 - 1e-9)) << i;
      ++checked;
    }
    po.optimizer_step = OptimizerPlacement::kDevice;
    const PolicyResult device = run_policy(Policy::kTidal, tr, hw, po);
    po.optimizer_step = OptimizerPlacement::kAuto;
    const PolicyResult best = run_policy(Policy::kTidal, tr, hw, po);
    if (best.fits) {
      double fastest = INFINITY;
      const PolicyResult* const results[] = {&host, &device};
      for (const PolicyResult* r : results) {
        if (r->fits) fastest = std::min(fastest, r->sim.iteration_seconds);
      }
      EXPECT_LE(best.sim.iteration_seconds, fastest * (1 + 1e-9)) << i;
    }
  }
  EXPECT_GE(checked, 6);
}

}  // namespace
}  // namespace tidal::plan
