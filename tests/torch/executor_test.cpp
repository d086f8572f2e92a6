// A wrong plan costs time, never correctness: random plans (offloads and prefetches of random
// tensors at random ops, deadlines ignored) must leave training bit-identical.
#include "tidal/torch/executor.hpp"

#include <gtest/gtest.h>

#include <random>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/tracer.hpp"

namespace tidal::torch_layer {
namespace {

models::TrainerOptions options() {
  models::TrainerOptions o;
  o.config = models::model_config("gpt-tiny");
  o.batch = 4;
  o.seq = 32;
  o.seed = 99;
  return o;
}

std::vector<double> plain_losses(int steps) {
  models::Trainer t(options());
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) losses.push_back(t.step().loss);
  return losses;
}

void register_all(Tracer& tracer, models::Trainer& t) {
  auto named = t.persistent_tensors();
  for (auto& [n, x] : named.parameters)
    tracer.register_persistent(x, n, trace::TensorClass::kParameter);
  for (auto& [n, x] : named.gradients)
    tracer.register_persistent(x, n, trace::TensorClass::kGradient);
  for (auto& [n, x] : named.optimizer_state) {
    tracer.register_persistent(x, n, trace::TensorClass::kOptimizerState);
  }
}

plan::Plan random_plan(const trace::Trace& tr, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  plan::Plan p;
  p.num_ops = static_cast<std::int32_t>(tr.ops.size());
  p.num_tensors = static_cast<std::int32_t>(tr.tensors.size());
  for (int i = 0; i < 400; ++i) {
    plan::PlanAction a;
    a.tensor = static_cast<trace::TensorId>(rng() % tr.tensors.size());
    a.kind = rng() % 2 == 0 ? plan::ActionKind::kOffload : plan::ActionKind::kPrefetch;
    a.trigger = static_cast<trace::OpIndex>(rng() % tr.ops.size());
    a.deadline = static_cast<trace::OpIndex>(rng() % tr.ops.size());
    a.bytes = tr.tensors[static_cast<std::size_t>(a.tensor)].bytes;
    p.actions.push_back(a);
  }
  return p;
}

TEST(PlanExecutor, RandomPlansNeverChangeALoss) {
  const int steps = 6;
  const auto want = plain_losses(steps);
  testing::TestDir dir;
  io::StoreOptions so;
  so.dirs = {dir.path()};
  so.capacity = 256 * kMiB;
  auto store = std::make_shared<io::TensorStore>(so);
  for (std::uint64_t seed : {1, 2, 3}) {
    models::Trainer trainer(options());
    Tracer tracer(Tracer::Options{"gpt-tiny", 4, 32});
    std::vector<double> losses;
    losses.push_back(trainer.step().loss);  // gradients exist from here on
    register_all(tracer, trainer);
    tracer.start();
    trainer.add_observer(&tracer);
    losses.push_back(trainer.step().loss);  // profiled
    const trace::Trace tr = tracer.result().trace;
    ExecutorOptions eo;
    eo.min_bytes = 0;  // move everything the random plan names, however small
    PlanExecutor ex(store, tr, random_plan(tr, seed), eo);
    tracer.set_keep_iterations(false);
    tracer.set_listener(&ex);
    trainer.add_observer(&ex);
    ExecutorStats total;
    for (int i = 2; i < steps; ++i) {
      losses.push_back(trainer.step().loss);
      const auto s = ex.last_step();
      total.offloads += s.offloads;
      total.released += s.released;
      total.misses += s.misses;
    }
    trainer.remove_observer(&ex);
    trainer.remove_observer(&tracer);
    tracer.set_listener(nullptr);
    EXPECT_EQ(losses, want) << "seed " << seed;
    EXPECT_GT(total.offloads, 0u) << "seed " << seed;
    EXPECT_GT(total.released, 0u) << "the plan freed no memory, seed " << seed;
    EXPECT_GT(total.misses, 0u) << "a random plan must miss sometimes, seed " << seed;
  }
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
