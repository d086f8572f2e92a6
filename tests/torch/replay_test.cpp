// One schedule, two engines: a profiled trace's plan replayed by the simulator (the reference)
// and run by the plan executor on a store that adds latency to every request, so that the
// plan's timing is wrong. Where each moved tensor is as each op starts, and the bytes moved,
// must agree; the executor must never cross its budget, and stall instead.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "io/test_dir.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/plan/schedule.hpp"
#include "tidal/plan/simulator.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/tracer.hpp"
#include "tidal/trace/lifetime.hpp"
#include "torch/executor/executor.hpp"
#include "torch/test_models.hpp"

namespace tidal::torch_layer {
namespace {

constexpr std::uint64_t kMinBytes = 16 * kKiB;

models::TrainerOptions trainer_options() { return testing::tiny_options("gpt-tiny", 4, 64, 7); }

struct Profile {
  trace::Trace trace;
  std::uint64_t meter_peak = 0;  // the meter's peak over the profiled step (all allocations)
};

// One plain step (gradients and optimizer state exist from then on), then one profiled.
Profile profile(models::Trainer& trainer, Tracer& tracer, MemoryMeter& meter) {
  trainer.step();
  trainer.register_persistent(tracer);
  tracer.start();
  trainer.add_observer(&tracer);
  meter.reset_peak();
  trainer.step();
  Profile p;
  p.meter_peak = std::max(meter.peak_bytes(), tracer.step_peak());  // it resets the peak per op
  p.trace = tracer.result().trace;
  return p;
}

struct Executed {
  std::vector<std::vector<plan::Residency>> residency;  // by op of the recorded step
  ExecutorStats recorded;                               // the recorded step's stats
  // Tensors that may have been written out by the safety net before the recorded step began:
  // the step before's evictions, and what fit_budget() wrote between the two steps (counted as
  // the store's finished writes around it, an upper bound: begin_step() clears the executor's
  // counters, so its own count of those evictions is not reported).
  std::uint64_t evicted_before = 0;
  double stall_seconds = 0;      // over every executed step
  std::uint64_t worst_peak = 0;  // the meter, over every executed step
};

// Trains the rest of the run under `plan`, with the executor's hard budget in meter bytes;
// records the residency of step `record` (0-based among executed steps).
Executed execute(const std::shared_ptr<io::TensorStore>& store, models::Trainer& trainer,
                 Tracer& tracer, const trace::Trace& tr, const plan::Plan& plan,
                 std::uint64_t budget, int steps, int record) {
  MemoryMeter meter;
  Executed out;
  int step = 0;
  ExecutorOptions eo;
  eo.min_bytes = kMinBytes;
  eo.budget = budget;
  eo.current_bytes = [meter] { return meter.current_bytes(); };
  eo.on_op_start = [&](trace::OpIndex k, const std::vector<plan::Residency>& where) {
    if (step != record) return;
    if (out.residency.size() <= static_cast<std::size_t>(k)) out.residency.resize(k + 1);
    out.residency[static_cast<std::size_t>(k)] = where;
  };
  PlanExecutor ex(store, tr, plan, eo);
  ex.bind_alive(tracer.alive_tensors());
  tracer.set_keep_iterations(false);
  tracer.set_listener(&ex);
  trainer.add_observer(&ex);
  const auto finished_writes = [&] {
    const io::StoreStats st = store->stats();
    return st.writes + st.failed_requests;
  };
  for (step = 0; step < steps; ++step) {
    const std::uint64_t writes_before = finished_writes();
    ex.fit_budget();
    if (step == record) out.evicted_before += finished_writes() - writes_before;
    meter.reset_peak();
    trainer.step();
    out.worst_peak = std::max(out.worst_peak, meter.peak_bytes());
    const ExecutorStats s = ex.last_step();
    out.stall_seconds += s.stall_seconds + s.write_stall_seconds;
    if (step == record) out.recorded = s;
    if (step == record - 1) out.evicted_before += s.evictions;
  }
  trainer.remove_observer(&ex);
  trainer.remove_observer(&tracer);
  tracer.set_listener(nullptr);
  return out;
}

struct Replay {
  plan::Plan plan;
  plan::SimResult sim;
  Executed run;
  std::uint64_t budget = 0;
  std::set<trace::TensorId> moved;                   // tensors the schedule migrates
  std::vector<std::vector<trace::OpIndex>> uses_of;  // by tensor: the ops that use it
};

Replay replay(unsigned delay_us) {
  models::Trainer trainer(trainer_options());
  MemoryMeter meter;
  // As a session does: the tracer reads the meter around every op, so that the trace has each
  // op's workspace (temporaries of composite ops), which the executor's budget counts.
  Tracer::Options to{"gpt-tiny", 4, 64};
  to.current_bytes = [&meter] { return meter.current_bytes(); };
  to.peak_bytes = [&meter] { return meter.peak_bytes(); };
  to.reset_peak = [&meter] { meter.reset_peak(); };
  Tracer tracer(to);
  const Profile prof = profile(trainer, tracer, meter);
  const trace::Trace& tr = prof.trace;
  std::uint64_t trace_peak = 0;
  for (std::uint64_t v : trace::analyze_lifetimes(tr).live_bytes)
    trace_peak = std::max(trace_peak, v);

  Replay r;
  plan::Hardware hw = plan::hardware_preset("cpu-here");
  hw.device_memory = trace_peak * 6 / 10;
  hw.memory_margin = 0;
  plan::PlannerOptions po;
  po.min_bytes = kMinBytes;
  r.plan = plan::make_plan(tr, hw, po);
  plan::SimOptions so;
  so.skip_clean_writes = false;  // the executor writes a tensor again each time it is offloaded
  so.record_residency = true;
  r.sim = plan::simulate(tr, &r.plan, hw, so);
  const plan::Schedule sched = plan::compile_schedule(tr, &r.plan);
  for (const auto& m : sched.migrations) r.moved.insert(m.tensor);
  r.uses_of = sched.uses_of;

  // The executor's budget is in the meter's bytes, which also count what the trace does not see
  // at every op (allocator padding of each live tensor): the plan's peak plus the difference
  // at the profiled peak, plus 3% for the padding elsewhere, so that the plan alone keeps it
  // (no evictions) and the test is about the two engines, not about the safety net.
  r.budget = r.plan.summary.peak_after_bytes +
             (prof.meter_peak - std::min(prof.meter_peak, trace_peak)) + prof.meter_peak * 3 / 100;
  testing::TestDir dir;
  io::StoreOptions sto;
  sto.dirs = {dir.path()};
  sto.capacity = 256 * kMiB;
  sto.faults.delay_us = delay_us;
  auto store = std::make_shared<io::TensorStore>(sto);
  r.run = execute(store, trainer, tracer, tr, r.plan, r.budget, 4, 2);

  return r;
}

TEST(Replay, SimulatorAndExecutorAgreeOnResidencyAndBytesOnASlowStore) {
  const Replay fast = replay(0);
  const Replay slow = replay(3000);  // 3 ms on every request: far slower than the plan assumed
  for (const Replay* r : {&fast, &slow}) {
    const char* which = r == &fast ? "fast store" : "slow store";
    ASSERT_FALSE(r->plan.actions.empty()) << which << ": the plan moves nothing";
    ASSERT_EQ(r->run.residency.size(), r->sim.residency.size()) << which;
    const ExecutorStats& e = r->run.recorded;
    // The executor's safety net (evictions: writing a tensor out at once when waiting for
    // writes cannot keep the budget) is the one thing the simulator does not do. It is rare
    // here (the budget has 3% of headroom) but a slow or loaded machine can need it. What it
    // changes is exact: an evicted tensor is away in the executor where the simulator has it in
    // memory, from its eviction until the next op that reads it (the residency guard reads it
    // back there: a miss) or the end of the step, and nothing else. So every difference is
    // such a run, and there are no more runs than tensors the safety net wrote out.
    std::size_t compared = 0;
    std::size_t differ = 0;
    std::size_t runs = 0;
    const auto n_ops = r->sim.residency.size();
    for (trace::TensorId id : r->moved) {
      const auto i = static_cast<std::size_t>(id);
      const auto& uses = r->uses_of[i];
      const auto present = [&](std::size_t k) {
        return r->sim.residency[k][i] != plan::Residency::kAbsent &&
               r->run.residency[k][i] != plan::Residency::kAbsent;
      };
      const auto differs = [&](std::size_t k) {
        return present(k) && plan::on_device_side(r->sim.residency[k][i]) !=
                                 plan::on_device_side(r->run.residency[k][i]);
      };
      for (std::size_t k = 0; k < n_ops; ++k) {
        if (!present(k)) continue;
        ++compared;
        if (!differs(k)) continue;
        ++differ;
        const plan::Residency sim = r->sim.residency[k][i];
        const plan::Residency exe = r->run.residency[k][i];
        EXPECT_TRUE(plan::on_device_side(sim) && !plan::on_device_side(exe))
            << which << ": before op " << k << " tensor " << id << " is " << plan::to_string(exe)
            << " in the executor, " << plan::to_string(sim) << " in the simulator";
        if (k > 0 && differs(k - 1)) continue;
        ++runs;
        // It starts where the executor wrote out a tensor that both engines had in memory (an
        // eviction), not where the simulator starts a read that the executor did not.
        if (k > 0 && present(k - 1)) {
          EXPECT_TRUE(plan::on_device_side(r->run.residency[k - 1][i]))
              << which << ": tensor " << id << " left the executor's memory before op " << k
              << " where the simulator's went on";
        }
        // The run's end: the last op before the two engines agree again (or the tensor dies, or
        // the step ends). Where they agree again, its last op read the tensor back.
        std::size_t end = k;
        while (end + 1 < n_ops && differs(end + 1)) ++end;
        if (end + 1 < n_ops && present(end + 1)) {
          EXPECT_TRUE(
              std::binary_search(uses.begin(), uses.end(), static_cast<trace::OpIndex>(end)))
              << which << ": tensor " << id << " was away in the executor alone from op " << k
              << " to op " << end << ", which does not use it";
        }
      }
    }
    EXPECT_GT(compared, 100u) << which;
    EXPECT_LE(runs, e.evictions + r->run.evicted_before)
        << which << ": " << differ << " of " << compared << " (op, tensor) pairs differ in " << runs
        << " runs; evictions: " << e.evictions << " in the step, " << r->run.evicted_before
        << " before it";
    // Transfers started in the step, as both engines count them.
    const auto& b = e.issued_bytes;
    using plan::Channel;
    using plan::index_of;
    const std::uint64_t written =
        b[index_of(Channel::kSsdWrite)] + b[index_of(Channel::kHostWrite)];
    const std::uint64_t read = b[index_of(Channel::kSsdRead)] + b[index_of(Channel::kHostRead)];
    const std::uint64_t sim_written = r->sim.ssd_bytes_written + r->sim.host_bytes_written;
    const std::uint64_t sim_read = r->sim.ssd_bytes_read + r->sim.host_bytes_read;
    EXPECT_EQ(written - e.evicted_bytes, sim_written)
        << which << " (forwarded " << e.forwarded << ", cancelled " << e.cancelled << ", unbound "
        << e.unbound << ", offloads " << e.offloads << ", evicted " << e.evicted_bytes << ")";
    EXPECT_GE(read, sim_read) << which;
    EXPECT_LE(read, sim_read + e.evicted_bytes)
        << which << " (misses " << e.misses << ", prefetches " << e.prefetches << ")";
    EXPECT_LE(r->run.worst_peak, r->budget) << which;
  }
  // 3 ms on each of some 80 requests a step: the slow store must cost time (not memory). Both
  // stalls are over four steps; a loaded machine stalls the plain store too, so the margin is
  // a fraction of what the added latency alone costs.
  EXPECT_GT(slow.run.stall_seconds, fast.run.stall_seconds + 0.05)
      << "the slow store must cost time, not memory";
}

}  // namespace
}  // namespace tidal::torch_layer
