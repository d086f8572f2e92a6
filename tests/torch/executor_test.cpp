// A wrong plan costs time, never correctness: random plans (offloads and prefetches of random
// tensors at random ops, deadlines ignored) must leave training bit-identical.
#include "torch/executor/executor.hpp"

#include <gtest/gtest.h>

#include <random>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/tracer.hpp"
#include "torch/test_models.hpp"

namespace tidal::torch_layer {
namespace {

models::TrainerOptions options() { return testing::tiny_options("gpt-tiny", 4, 32, 99); }

std::vector<double> plain_losses(int steps) {
  models::Trainer t(options());
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) losses.push_back(t.step().loss);
  return losses;
}

// 400 random actions; with `host`, each offload goes to host memory or the SSD at random.
plan::Plan random_plan(const trace::Trace& tr, std::uint64_t seed, bool host = false) {
  std::mt19937_64 rng(seed);
  plan::Plan p;
  p.num_ops = static_cast<std::int32_t>(tr.ops.size());
  p.num_tensors = static_cast<std::int32_t>(tr.tensors.size());
  for (int i = 0; i < 400; ++i) {
    plan::PlanAction a;
    a.tensor = static_cast<trace::TensorId>(rng() % tr.tensors.size());
    a.kind = rng() % 2 == 0 ? plan::ActionKind::kOffload : plan::ActionKind::kPrefetch;
    // With host memory, some are stages (SSD copy into the pool) instead of prefetches.
    if (host && a.kind == plan::ActionKind::kPrefetch && rng() % 3 == 0) {
      a.kind = plan::ActionKind::kStage;
    }
    a.trigger = static_cast<trace::OpIndex>(rng() % tr.ops.size());
    a.deadline = static_cast<trace::OpIndex>(rng() % tr.ops.size());
    a.bytes = tr.tensors[static_cast<std::size_t>(a.tensor)].bytes;
    if (host && (rng() % 2 == 0 || a.kind == plan::ActionKind::kStage)) {
      a.target = plan::Target::kHost;
    }
    p.actions.push_back(a);
  }
  return p;
}

struct RandomRun {
  std::vector<double> losses;
  ExecutorStats total;  // summed over the executed steps
};

// Trains gpt-tiny for `steps` steps: one plain, one profiled, the rest under a random plan.
RandomRun run_random_plan(const std::shared_ptr<io::TensorStore>& store, int steps,
                          std::uint64_t seed, const std::shared_ptr<io::HostPool>& host) {
  RandomRun r;
  models::Trainer trainer(options());
  Tracer tracer(Tracer::Options{"gpt-tiny", 4, 32});
  r.losses.push_back(trainer.step().loss);  // gradients exist from here on
  trainer.register_persistent(tracer);
  tracer.start();
  trainer.add_observer(&tracer);
  r.losses.push_back(trainer.step().loss);  // profiled
  const trace::Trace tr = tracer.result().trace;
  ExecutorOptions eo;
  eo.min_bytes = 0;  // move everything the random plan names, however small
  eo.host = host;
  PlanExecutor ex(store, tr, random_plan(tr, seed, host != nullptr), eo);
  tracer.set_keep_iterations(false);
  tracer.set_listener(&ex);
  trainer.add_observer(&ex);
  for (int i = 2; i < steps; ++i) {
    r.losses.push_back(trainer.step().loss);
    const auto s = ex.last_step();
    r.total.offloads += s.offloads;
    r.total.released += s.released;
    r.total.misses += s.misses;
    r.total.host_offloads += s.host_offloads;
    r.total.host_fallbacks += s.host_fallbacks;
    r.total.bytes_to_host += s.bytes_to_host;
    r.total.bytes_from_host += s.bytes_from_host;
    r.total.bytes_written += s.bytes_written;
    r.total.stages += s.stages;
    r.total.stage_skips += s.stage_skips;
    r.total.bytes_staged += s.bytes_staged;
  }
  trainer.remove_observer(&ex);
  trainer.remove_observer(&tracer);
  tracer.set_listener(nullptr);
  return r;
}

std::shared_ptr<io::TensorStore> open_store(const testing::TestDir& dir) {
  io::StoreOptions so;
  so.dirs = {dir.path()};
  so.capacity = 256 * kMiB;
  return std::make_shared<io::TensorStore>(so);
}

TEST(PlanExecutor, RandomPlansNeverChangeALoss) {
  const int steps = 6;
  const auto want = plain_losses(steps);
  testing::TestDir dir;
  auto store = open_store(dir);
  for (std::uint64_t seed : {1, 2, 3}) {
    const RandomRun r = run_random_plan(store, steps, seed, nullptr);
    EXPECT_EQ(r.losses, want) << "seed " << seed;
    EXPECT_GT(r.total.offloads, 0u) << "seed " << seed;
    EXPECT_GT(r.total.released, 0u) << "the plan freed no memory, seed " << seed;
    EXPECT_GT(r.total.misses, 0u) << "a random plan must miss sometimes, seed " << seed;
  }
}

// Host actions go to the host pool while it has room and to the SSD when it is full; neither
// changes a loss.
TEST(PlanExecutor, HostActionsUseThePoolAndFallBackToTheSsdWhenItIsFull) {
  const int steps = 6;
  const auto want = plain_losses(steps);
  testing::TestDir dir;
  auto store = open_store(dir);
  for (std::uint64_t seed : {4, 5}) {
    auto pool = std::make_shared<io::HostPool>(256 * kKiB);  // far less than the plan sends
    const RandomRun r = run_random_plan(store, steps, seed, pool);
    EXPECT_EQ(r.losses, want) << "seed " << seed;
    EXPECT_GT(r.total.host_offloads, 0u) << "seed " << seed;
    EXPECT_GT(r.total.bytes_to_host, 0u) << "seed " << seed;
    EXPECT_GT(r.total.host_fallbacks, 0u) << "a 256 KiB pool must fill up, seed " << seed;
    EXPECT_GT(r.total.bytes_written, 0u) << "the SSD took the rest, seed " << seed;
    EXPECT_LE(pool->stats().peak_used_bytes, 256 * kKiB);
  }
}

// Stages copy SSD-offloaded tensors into the host pool (where it has room), and the prefetches
// and misses that follow read the pool; none of it changes a loss.
TEST(PlanExecutor, StagesCopyIntoThePoolAndNeverChangeALoss) {
  const int steps = 6;
  const auto want = plain_losses(steps);
  testing::TestDir dir;
  auto store = open_store(dir);
  std::uint64_t stages = 0;
  std::uint64_t skips = 0;
  for (std::uint64_t seed : {6, 7, 8}) {
    auto pool = std::make_shared<io::HostPool>(4 * kMiB);
    const RandomRun r = run_random_plan(store, steps, seed, pool);
    EXPECT_EQ(r.losses, want) << "seed " << seed;
    EXPECT_EQ(r.total.bytes_staged > 0, r.total.stages > 0) << "seed " << seed;
    stages += r.total.stages;
    skips += r.total.stage_skips;
    EXPECT_LE(pool->stats().peak_used_bytes, 4 * kMiB);
    EXPECT_EQ(pool->stats().tickets, 0u) << "the pool keeps nothing after the run, seed " << seed;
  }
  EXPECT_GT(stages, 0u);
  RecordProperty("stage_skips", static_cast<int>(skips));
}

// The hard budget's safety net alone: under a plan that moves nothing, with a budget below what
// the step holds at its peak, every byte that leaves memory is an eviction (a tensor the
// running op does not read, written out at once, read back by the op that needs it). The meter
// never crosses the budget, and no loss changes.
TEST(PlanExecutor, EvictionsKeepAHardBudgetThePlanDoesNot) {
  const int steps = 4;
  const auto want = plain_losses(steps);
  testing::TestDir dir;
  auto store = open_store(dir);
  MemoryMeter meter;
  models::Trainer trainer(options());
  // As a session does: the tracer reads the meter around every op, so that the trace has each
  // op's workspace, which the executor's budget counts.
  Tracer::Options to{"gpt-tiny", 4, 32};
  to.current_bytes = [&meter] { return meter.current_bytes(); };
  to.peak_bytes = [&meter] { return meter.peak_bytes(); };
  to.reset_peak = [&meter] { meter.reset_peak(); };
  Tracer tracer(to);
  std::vector<double> losses;
  losses.push_back(trainer.step().loss);  // gradients and optimizer state exist from here on
  trainer.register_persistent(tracer);
  tracer.start();
  trainer.add_observer(&tracer);
  meter.reset_peak();
  losses.push_back(trainer.step().loss);  // profiled
  const std::uint64_t profiled_peak = std::max(meter.peak_bytes(), tracer.step_peak());
  const trace::Trace tr = tracer.result().trace;
  plan::Plan keep_all;  // no actions: the plan keeps every tensor in memory
  keep_all.num_ops = static_cast<std::int32_t>(tr.ops.size());
  keep_all.num_tensors = static_cast<std::int32_t>(tr.tensors.size());
  ExecutorOptions eo;
  eo.min_bytes = 16 * kKiB;
  eo.budget = profiled_peak * 85 / 100;
  eo.current_bytes = [&meter] { return meter.current_bytes(); };
  PlanExecutor ex(store, tr, keep_all, eo);
  ex.bind_alive(tracer.alive_tensors());
  tracer.set_keep_iterations(false);
  tracer.set_listener(&ex);
  trainer.add_observer(&ex);
  std::uint64_t worst_peak = 0;
  ExecutorStats total;
  for (int i = 2; i < steps; ++i) {
    ex.fit_budget();
    meter.reset_peak();
    losses.push_back(trainer.step().loss);
    worst_peak = std::max(worst_peak, meter.peak_bytes());
    const ExecutorStats s = ex.last_step();
    EXPECT_EQ(s.offloads, s.evictions) << "step " << i << ": the plan moves nothing";
    EXPECT_EQ(s.prefetches, 0u) << "step " << i;
    total.evictions += s.evictions;
    total.evicted_bytes += s.evicted_bytes;
    total.misses += s.misses;
    total.write_failures += s.write_failures;
  }
  trainer.remove_observer(&ex);
  trainer.remove_observer(&tracer);
  tracer.set_listener(nullptr);
  EXPECT_EQ(losses, want);
  EXPECT_GT(total.evictions, 0u);
  EXPECT_GT(total.evicted_bytes, 0u);
  EXPECT_GT(total.misses, 0u) << "evicted tensors come back when an op needs them";
  EXPECT_EQ(total.write_failures, 0u);
  EXPECT_LE(worst_peak, eo.budget)
      << "profiled peak " << profiled_peak << ", " << total.evicted_bytes << " bytes evicted";
}

TEST(PlanExecutor, RefusesAPlanForAnotherTrace) {
  testing::TestDir dir;
  io::StoreOptions so;
  so.dirs = {dir.path()};
  so.capacity = 16 * kMiB;
  auto store = std::make_shared<io::TensorStore>(so);
  trace::Trace tr;
  tr.ops.resize(3);
  plan::Plan p;
  p.num_ops = 5;
  EXPECT_THROW(PlanExecutor(store, tr, p), tidal::InvalidArgument);
}

}  // namespace
}  // namespace tidal::torch_layer
