// Ordinary libtorch training loops (not tidal's trainer) under a Session with the smallest
// change a user makes: a Session, begin_step()/end_step() around each step, nothing registered.
// Each case is one thing such loops do: threads that run ops during a step, torch::save between
// steps, several backward passes per step, steps that are not all alike, a budget no plan can
// meet, and a store that fails under a running step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/torch/session.hpp"

namespace tidal::torch_layer {
namespace {

SessionOptions options_for(OffloadMode mode, const std::string& dir) {
  SessionOptions so;
  so.mode = mode;
  so.store.dirs = {dir};
  so.store.capacity = 256 * kMiB;
  so.activations.min_bytes = 16 * 1024;
  so.executor.min_bytes = 16 * 1024;
  so.budget_fraction = 0.5;
  // A step over the budget fails here as it would on a GPU (the wall is plan mode's).
  if (mode == OffloadMode::kPlan) so.strict_meter = true;
  return so;
}

// A regression MLP with Adam, written as a user would; `extra` adds work to some steps.
struct Mlp {
  torch::nn::Sequential net{torch::nn::Linear(64, 256), torch::nn::ReLU(),
                            torch::nn::Linear(256, 256), torch::nn::ReLU(),
                            torch::nn::Linear(256, 1)};
  std::unique_ptr<torch::optim::Adam> opt;
  Mlp() { opt = std::make_unique<torch::optim::Adam>(net->parameters(), 1e-3); }
  double step(const torch::Tensor& x, const torch::Tensor& y) {
    opt->zero_grad();
    auto loss = torch::mse_loss(net->forward(x), y);
    loss.backward();
    opt->step();
    return loss.item<double>();
  }
};

struct Data {
  std::vector<torch::Tensor> x, y;
  explicit Data(int n) {
    torch::manual_seed(3);
    for (int i = 0; i < n; ++i) {
      x.push_back(torch::randn({128, 64}));
      y.push_back(x.back().sum(1, true).sin());
    }
  }
};

struct LoopRun {
  std::vector<double> losses;
  SessionStats stats;
  std::vector<SessionStats> per_step;
  std::uint64_t peak = 0;  // highest step peak
};

// Trains the MLP for `steps` steps; `between(i, mlp)` runs after step i's end_step.
template <typename Between>
LoopRun train_mlp(SessionOptions so, int steps, Between between) {
  LoopRun r;
  Session session(so);  // first: its meter sees the model's tensors
  torch::manual_seed(11);
  Mlp mlp;
  Data data(steps);
  for (int i = 0; i < steps; ++i) {
    session.begin_step();
    r.losses.push_back(
        mlp.step(data.x[static_cast<std::size_t>(i)], data.y[static_cast<std::size_t>(i)]));
    session.end_step();
    r.peak = std::max(r.peak, session.stats().step_peak);
    r.per_step.push_back(session.stats());
    between(i, mlp);
  }
  r.stats = session.stats();
  return r;
}

LoopRun train_mlp(SessionOptions so, int steps) {
  return train_mlp(std::move(so), steps, [](int, Mlp&) {});
}

// Ops on other threads during every step (a data loader's workers) never enter the trace: plan
// mode plans once, executes to the end and changes no loss.
TEST(Loops, OpsOfOtherThreadsNeverEnterTheTrace) {
  testing::TestDir dir;
  std::atomic<bool> stop{false};
  std::atomic<long> background_ops{0};
  std::thread worker([&] {
    while (!stop) {
      auto t = torch::ones({64, 64});  // not the shared generator: the losses must not move
      (t * 2 + 1).sum();
      ++background_ops;
    }
  });
  const LoopRun none = train_mlp(options_for(OffloadMode::kNone, dir.path()), 12);
  const LoopRun plan = train_mlp(options_for(OffloadMode::kPlan, dir.path()), 12);
  stop = true;
  worker.join();
  EXPECT_GT(background_ops.load(), 100) << "the other thread hardly ran";
  EXPECT_EQ(none.losses, plan.losses);
  EXPECT_EQ(plan.stats.state, SessionState::kExecuting) << plan.stats.plan_summary;
  EXPECT_EQ(plan.stats.shapes, 1) << "other threads' ops made the steps look different";
  EXPECT_GT(plan.stats.steps_measured, 0);
}

// torch::save and torch::load of the model and of Adam between steps in plan mode: the files
// hold the real values (a fresh model loaded from them computes the same loss), and training
// goes on with the same losses as without offloading.
TEST(Loops, SaveAndLoadBetweenStepsInPlanMode) {
  testing::TestDir dir;
  const auto model_file = dir.path() + "/model.pt";
  const auto optim_file = dir.path() + "/optim.pt";
  std::vector<double> reloaded_losses;
  auto checkpoint = [&](int i, Mlp& mlp) {
    if (i % 4 != 3) return;
    torch::save(mlp.net, model_file);
    torch::save(*mlp.opt, optim_file);
    torch::load(mlp.net, model_file);
    torch::load(*mlp.opt, optim_file);
    // Every parameter is readable by raw pointer between steps.
    for (const auto& p : mlp.net->parameters()) ASSERT_NE(p.data_ptr(), nullptr);
    torch::NoGradGuard no_grad;
    torch::nn::Sequential fresh{torch::nn::Linear(64, 256), torch::nn::ReLU(),
                                torch::nn::Linear(256, 256), torch::nn::ReLU(),
                                torch::nn::Linear(256, 1)};
    torch::load(fresh, model_file);
    torch::manual_seed(5);
    auto x = torch::randn({16, 64});
    reloaded_losses.push_back(torch::equal(fresh->forward(x), mlp.net->forward(x)) ? 1.0 : 0.0);
  };
  const LoopRun none = train_mlp(options_for(OffloadMode::kNone, dir.path()), 16, checkpoint);
  SessionOptions so = options_for(OffloadMode::kPlan, dir.path());
  so.strict_meter = false;  // between steps it loads a second copy of the model: over any wall
  const LoopRun plan = train_mlp(so, 16, checkpoint);
  EXPECT_EQ(none.losses, plan.losses);
  EXPECT_EQ(plan.stats.state, SessionState::kExecuting) << plan.stats.plan_summary;
  EXPECT_GT(plan.stats.bytes_written, 0u) << plan.stats.plan_summary;
  ASSERT_EQ(reloaded_losses.size(), 8u);
  for (double same : reloaded_losses) EXPECT_EQ(same, 1.0) << "a saved model differs";
}

// Steps that log every third step (extra ops inside the step) form two shapes: each is planned
// once, none is profiled again, and losses do not change.
TEST(Loops, EachStepShapeIsPlannedOnce) {
  testing::TestDir dir;
  auto run = [&](OffloadMode mode) {
    LoopRun r;
    Session session(options_for(mode, dir.path()));
    torch::manual_seed(11);
    Mlp mlp;
    Data data(30);
    for (int i = 0; i < 30; ++i) {
      session.begin_step();
      r.losses.push_back(
          mlp.step(data.x[static_cast<std::size_t>(i)], data.y[static_cast<std::size_t>(i)]));
      if (i % 3 == 0) {
        torch::NoGradGuard no_grad;
        double norm = 0;
        for (const auto& p : mlp.net->parameters()) norm += p.norm().item<double>();
        r.losses.push_back(norm);
      }
      session.end_step();
    }
    r.stats = session.stats();
    return r;
  };
  const LoopRun none = run(OffloadMode::kNone);
  const LoopRun plan = run(OffloadMode::kPlan);
  EXPECT_EQ(none.losses, plan.losses);
  EXPECT_EQ(plan.stats.shapes, 2) << plan.stats.plan_summary;
  // Tightenings (a plan made again for less memory after a step went over) are not new shapes.
  EXPECT_EQ(plan.stats.replans - plan.stats.tightenings, 1) << "only the second shape's plan";
  EXPECT_GE(plan.stats.steps_measured, 20)
      << "tightenings " << plan.stats.tightenings << ", retimings " << plan.stats.retimings;
}

// A GAN-like step: two forward/backward passes with two optimizers. Activation mode offloads
// the saved tensors of both passes and never holds more memory than no offloading.
TEST(Loops, ActivationModeOffloadsEveryBackwardOfAStep) {
  testing::TestDir dir;
  std::uint64_t bytes = 0;
  auto run = [&](OffloadMode mode, bool adaptive) {
    LoopRun r;
    SessionOptions so = options_for(mode, dir.path());
    so.activations.adaptive = adaptive;
    Session session(so);
    torch::manual_seed(7);
    torch::nn::Sequential g{torch::nn::Linear(32, 512), torch::nn::ReLU(),
                            torch::nn::Linear(512, 64)};
    torch::nn::Sequential d{torch::nn::Linear(64, 512), torch::nn::ReLU(),
                            torch::nn::Linear(512, 1)};
    torch::optim::Adam og(g->parameters(), 1e-3);
    torch::optim::Adam od(d->parameters(), 1e-3);
    for (int i = 0; i < 10; ++i) {
      auto real = torch::randn({256, 64});
      auto z = torch::randn({256, 32});
      session.begin_step();
      od.zero_grad();
      auto fake = g->forward(z);
      auto loss_d =
          torch::binary_cross_entropy_with_logits(d->forward(real), torch::ones({256, 1})) +
          torch::binary_cross_entropy_with_logits(d->forward(fake.detach()),
                                                  torch::zeros({256, 1}));
      loss_d.backward();
      od.step();
      og.zero_grad();
      auto loss_g =
          torch::binary_cross_entropy_with_logits(d->forward(fake), torch::ones({256, 1}));
      loss_g.backward();
      og.step();
      r.losses.push_back(loss_d.item<double>());
      r.losses.push_back(loss_g.item<double>());
      session.end_step();
      bytes += session.stats().bytes_written;
      // From the fifth step on: after the warm-up, the reference step and the two trial steps.
      if (i >= 4) r.peak = std::max(r.peak, session.stats().step_peak);
    }
    r.stats = session.stats();
    return r;
  };
  const LoopRun none = run(OffloadMode::kNone, true);
  bytes = 0;
  const LoopRun forced = run(OffloadMode::kActivations, false);
  EXPECT_EQ(none.losses, forced.losses);
  EXPECT_GT(bytes, 0u);
  EXPECT_EQ(forced.stats.bytes_written > 0, true) << "the last step's two passes moved nothing";
  const LoopRun adaptive = run(OffloadMode::kActivations, true);
  EXPECT_EQ(none.losses, adaptive.losses);
  EXPECT_LE(adaptive.peak, none.peak) << "activation offloading raised the peak for good";
}

// A budget no plan can meet never stops training; it says why. With strict_budget it stops at
// the first planned step with that reason.
TEST(Loops, ABudgetThatCannotBeMetIsReportedNotThrown) {
  testing::TestDir dir;
  SessionOptions so = options_for(OffloadMode::kPlan, dir.path());
  so.memory_budget = 64 * 1024;  // far below what one layer's tensors need
  // Under the strict meter such a budget is a wall from step 0, as a GPU's memory is: the
  // first step stops with out of memory. Without it the session runs and reports.
  EXPECT_THROW(train_mlp(so, 10), c10::OutOfMemoryError);
  so.strict_meter = false;
  // Between steps on the SSD: the plan may then take even the optimizer state out across the
  // boundary, so the smallest peak it reaches is below no offloading's.
  so.between_steps = BetweenSteps::kOffloaded;
  const LoopRun none = train_mlp(options_for(OffloadMode::kNone, dir.path()), 10);
  const LoopRun plan = train_mlp(so, 10);
  EXPECT_EQ(none.losses, plan.losses);
  EXPECT_FALSE(plan.stats.within_budget);
  EXPECT_NE(plan.stats.budget_reason.find("cannot fit"), std::string::npos)
      << plan.stats.budget_reason;
  // The warm-up and profiling steps run without offloading; the executed ones are measured.
  EXPECT_LT(plan.stats.executed_peak, none.peak)
      << "the smallest reachable peak should still be below none's: " << plan.stats.plan_summary
      << "; " << plan.stats.budget_reason;

  so.strict_budget = true;
  EXPECT_THROW(train_mlp(so, 10), InvalidArgument);

  // With the step's tensors resident between steps, the reason suggests the other choice; with
  // them offloaded it does not.
  EXPECT_EQ(plan.stats.budget_reason.find("between_steps"), std::string::npos)
      << plan.stats.budget_reason;
  so.strict_budget = false;
  so.between_steps = BetweenSteps::kResident;
  const LoopRun resident = train_mlp(so, 10);
  EXPECT_NE(resident.stats.budget_reason.find("BetweenSteps::kOffloaded"), std::string::npos)
      << resident.stats.budget_reason;
}

// A corrupt read or a failing disk under a running plan: the step stops with the store's
// message, as a tidal::IoError from the op that needed the tensor or from end_step().
// The fault matrix: {EIO, ENOSPC, short transfer, corrupt stripe, added latency} x {write, read}
// x {activations, plan}, each on the store under a running loop. A fault on a write leaves the
// tensor in memory: the losses are those of a run without tidal, and the step's stats count the
// failed writes. A fault on a read stops the step with tidal::IoError carrying the store's
// message (the data is gone; training on garbage would be worse). Latency only costs time.
// (A stripe corrupted on its way to the disk or at rest is the read case: the checksum is taken
// from memory before the write and checked after the read.)
enum class Fault : std::uint8_t { kEio, kEnospc, kShort, kCorrupt, kLatency };
const char* fault_name(Fault f) {
  switch (f) {
    case Fault::kEio:
      return "eio";
    case Fault::kEnospc:
      return "enospc";
    case Fault::kShort:
      return "short";
    case Fault::kCorrupt:
      return "corrupt";
    case Fault::kLatency:
      return "latency";
  }
  return "?";
}

struct FaultCase {
  Fault fault;
  bool on_write;
  OffloadMode mode;
};

io::FaultPlan fault_plan(const FaultCase& c) {
  io::FaultPlan p;
  p.only_writes = c.on_write;
  p.only_reads = !c.on_write;
  switch (c.fault) {
    case Fault::kEio:
    case Fault::kEnospc:
      p.fail_op = 2;
      p.fail_every_after = true;  // a dying (or full) disk: the second op on and every one after
      p.fail_errno = c.fault == Fault::kEio ? EIO : ENOSPC;
      break;
    case Fault::kShort:
      p.short_op = 2;
      break;
    case Fault::kCorrupt:
      p.corrupt_read = 3;
      break;
    case Fault::kLatency:
      p.delay_us = 3000;
      break;
  }
  return p;
}

class FaultMatrix : public ::testing::TestWithParam<FaultCase> {};

TEST_P(FaultMatrix, WritesKeepTheTensorReadsStopTheStepLatencyOnlyCostsTime) {
  const FaultCase c = GetParam();
  testing::TestDir dir;
  static const LoopRun none = train_mlp(options_for(OffloadMode::kNone, dir.path()), 12);
  SessionOptions so = options_for(c.mode, dir.path());
  so.store.faults = fault_plan(c);
  so.hardware_overrides.ssd =
      plan::parse_ssd_spec("1x2/1.5GB/s");  // no measurement: the faults hit training's I/O
  so.activations.adaptive = false;  // keep offloading even where it does not pay: reads happen
  // A store that fails every write cannot take memory off the device: under a wall this loop
  // would stop with out of memory, as on a GPU (saying why). What is tested here is that the
  // failed writes keep the tensors and the losses.
  if (c.on_write && c.fault != Fault::kLatency) so.strict_meter = false;
  const bool expect_error = !c.on_write && c.fault != Fault::kLatency;
  if (expect_error) {
    const char* says = c.fault == Fault::kEio      ? "Input/output error"
                       : c.fault == Fault::kEnospc ? "No space left on device"
                       : c.fault == Fault::kShort  ? "short read"
                                                   : "checksum mismatch";
    try {
      train_mlp(so, 12);
      ADD_FAILURE() << "no error reached the caller";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    return;
  }
  const LoopRun run = train_mlp(so, 12);
  EXPECT_EQ(run.losses, none.losses);
  std::uint64_t failed = 0, full = 0, written = 0, read = 0;
  std::string why;
  double stall = 0;
  for (const auto& s : run.per_step) {
    failed += s.write_failures;
    full += s.store_full_writes;
    if (!s.write_error.empty()) why = s.write_error;
    written += s.bytes_written;
    read += s.bytes_read;
    stall += s.stall_seconds + s.write_stall_seconds;
  }
  if (c.fault == Fault::kLatency) {
    EXPECT_EQ(failed, 0u);
    EXPECT_GT(read, 0u) << "nothing came back from the store: the latency was never seen";
    EXPECT_GT(stall, 0.0) << "3 ms per op and not one wait";
  } else {
    EXPECT_GT(failed, 0u) << "the failed writes were not counted";
    // Each degraded write is counted with its reason; only ENOSPC counts as "store full".
    EXPECT_EQ(full > 0, c.fault == Fault::kEnospc) << full << " of " << failed;
    const char* says = c.fault == Fault::kEio      ? "Input/output error"
                       : c.fault == Fault::kEnospc ? "No space left on device"
                                                   : "short write";
    EXPECT_NE(why.find(says), std::string::npos) << why;
  }
}

// A store too small for what a step offloads: the writes it cannot place are refused up front
// (the store is full), counted as such with the store's message, and training goes on unchanged.
TEST(Loops, AFullStoreIsReportedAndChangesNoLoss) {
  testing::TestDir dir;
  const LoopRun none = train_mlp(options_for(OffloadMode::kNone, dir.path()), 8);
  SessionOptions so = options_for(OffloadMode::kActivations, dir.path());
  so.store.capacity = 64 * 1024;  // room for one of the MLP's 128 KiB activations: none
  so.activations.adaptive = false;
  const LoopRun run = train_mlp(so, 8);
  EXPECT_EQ(run.losses, none.losses);
  std::uint64_t full = 0;
  std::string why;
  for (const auto& s : run.per_step) {
    full += s.store_full_writes;
    if (!s.write_error.empty()) why = s.write_error;
  }
  EXPECT_GT(full, 0u);
  EXPECT_NE(why.find("the store is full"), std::string::npos) << why;
}

std::vector<FaultCase> fault_cases() {
  std::vector<FaultCase> out;
  for (auto mode : {OffloadMode::kActivations, OffloadMode::kPlan}) {
    for (bool on_write : {true, false}) {
      for (auto f :
           {Fault::kEio, Fault::kEnospc, Fault::kShort, Fault::kCorrupt, Fault::kLatency}) {
        if (on_write && f == Fault::kCorrupt) continue;  // the read case (see above)
        out.push_back({f, on_write, mode});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Loops, FaultMatrix, ::testing::ValuesIn(fault_cases()),
                         [](const ::testing::TestParamInfo<FaultCase>& info) {
                           return std::string(to_string(info.param.mode)) + "_" +
                                  (info.param.on_write ? "write_" : "read_") +
                                  fault_name(info.param.fault);
                         });

// The budget is a promise from the first executed step on: on a disk too slow for the plan's
// timing (every store op held 4 ms), no executed step's peak crosses it; the steps wait
// instead (stall), and the losses do not change.
TEST(Loops, PlanModeNeverCrossesTheBudgetOnASlowDiskItStallsInstead) {
  testing::TestDir dir;
  const LoopRun none = train_mlp(options_for(OffloadMode::kNone, dir.path()), 12);
  SessionOptions quiet_opt = options_for(OffloadMode::kPlan, dir.path());
  quiet_opt.between_steps = BetweenSteps::kOffloaded;  // a budget a plan can meet
  quiet_opt.budget_fraction = 0.7;  // torch 2.x's Adam needs 1.78 MiB around one op: 0.6 is 1.65
  SessionOptions slow_opt = quiet_opt;
  slow_opt.store.faults.delay_us = 4000;
  const LoopRun quiet = train_mlp(quiet_opt, 12);
  const LoopRun slow = train_mlp(slow_opt, 12);
  EXPECT_EQ(none.losses, quiet.losses);
  EXPECT_EQ(none.losses, slow.losses);
  double stall[2] = {0, 0};
  int executed[2] = {0, 0};
  const LoopRun* runs[2] = {&quiet, &slow};
  for (int r = 0; r < 2; ++r) {
    for (std::size_t i = 0; i < runs[r]->per_step.size(); ++i) {
      const SessionStats& s = runs[r]->per_step[i];
      if (s.state != SessionState::kExecuting || s.steps_measured == 0) continue;
      ++executed[r];
      EXPECT_LE(s.step_peak, s.memory_budget)
          << (r == 0 ? "quiet" : "slow") << " disk, step " << i << ": " << s.plan_summary;
      stall[r] += s.stall_seconds + s.write_stall_seconds;
    }
    EXPECT_GE(executed[r], 6) << (r == 0 ? "quiet" : "slow");
    EXPECT_EQ(runs[r]->stats.steps_over_budget, 0);
    EXPECT_TRUE(runs[r]->stats.within_budget) << runs[r]->stats.budget_reason;
  }
  EXPECT_GT(stall[1], stall[0]) << "a disk 4 ms per op slower must cost waiting";
}

}  // namespace
}  // namespace tidal::torch_layer
