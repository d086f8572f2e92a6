// plan::Timeline on random steps driven by a clock the test moves: what it keeps, how it sums a
// step into where the time went, the sentence on what limits the run, and the Chrome trace and
// SVG it writes.
#include "tidal/plan/timeline.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace tidal::plan {
namespace {

using json = nlohmann::json;

// A clock the test moves by hand.
struct FakeClock {
  double t = 100.0;
  std::function<double()> fn() {
    return [this] { return t; };
  }
  // Options for a timeline that reads this clock.
  Timeline::Options options() {
    Timeline::Options o;
    o.clock = fn();
    return o;
  }
};

// What a random step did, as the test made it happen (the figures the report must find).
struct Truth {
  double step = 0;
  double in_ops = 0;
  std::array<double, kNumChannels> read_stall{};
  double write_stall = 0;
  double stalled_between_ops = 0;  // of the stalls, those outside every op
  std::array<std::uint64_t, kNumChannels> bytes{};
  int misses = 0;
};

// Runs one step of `ops` random ops on `tl`: gaps between ops, stalls inside and between them
// (times on the timeline's clock, which starts at 0 where the test's starts at 100), transfers
// that start inside ops and end some ops later (or after the step).
Truth random_step(Timeline& tl, FakeClock& clock, std::mt19937_64& rng, std::int64_t step, int ops,
                  StepState state = StepState::kExecuting) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  Truth truth;
  const double start = clock.t;
  tl.begin_step(step, state, 1000, 1200);
  struct Open {
    std::size_t handle;
    int ends_after;  // op index
  };
  std::vector<Open> open;
  for (int k = 0; k < ops; ++k) {
    clock.t += 0.001 * u(rng);  // outside ops
    if (u(rng) < 0.15) {
      // A stall between ops: an op the tracer does not record (on a GPU, an op on a CPU tensor)
      // waited for the budget. It is time outside ops, not compute.
      const double d = 0.002 * u(rng);
      tl.stall(StallKind::kBudget, Channel::kSsdWrite, "", tl.now(), tl.now() + d);
      clock.t += d;
      truth.write_stall += d;
      truth.stalled_between_ops += d;
      clock.t += 0.0001;
    }
    const double op_start = clock.t;
    tl.op_start(k, "op" + std::to_string(k), static_cast<std::uint64_t>(900 * u(rng)));
    if (u(rng) < 0.4) {  // a stall inside the op
      const double d = 0.002 * u(rng);
      const StallKind kind = u(rng) < 0.5 ? StallKind::kRead : StallKind::kBudget;
      const Channel ch = u(rng) < 0.7 ? Channel::kSsdRead : Channel::kHostRead;
      clock.t += 0.0001;
      tl.stall(kind, ch, "t" + std::to_string(k), tl.now(), tl.now() + d);
      clock.t += d;
      if (kind == StallKind::kRead) {
        truth.read_stall[index_of(ch)] += d;
      } else {
        truth.write_stall += d;
      }
    }
    if (u(rng) < 0.5) {  // a transfer
      const auto ch = static_cast<Channel>(static_cast<int>(4 * u(rng)) % 4);
      const TransferKind kind = u(rng) < 0.2 ? TransferKind::kMiss : TransferKind::kPlanned;
      const std::uint64_t bytes = 1 + static_cast<std::uint64_t>(1e6 * u(rng));
      const auto due = static_cast<trace::OpIndex>(k + 1 + static_cast<int>(3 * u(rng)));
      open.push_back(
          {tl.transfer_start(ch, kind, "t" + std::to_string(k), bytes, due < ops ? due : -1),
           k + static_cast<int>(4 * u(rng))});
      truth.bytes[index_of(ch)] += bytes;
      if (kind == TransferKind::kMiss) ++truth.misses;
    }
    clock.t += 0.003 * u(rng);
    for (auto it = open.begin(); it != open.end();) {
      if (it->ends_after <= k) {
        tl.transfer_end(it->handle, false);
        it = open.erase(it);
      } else {
        ++it;
      }
    }
    truth.in_ops += clock.t - op_start;
    tl.op_end(static_cast<std::uint64_t>(900 * u(rng)));
  }
  clock.t += 0.001 * u(rng);
  TimelineStep facts;
  facts.peak = 950;
  facts.misses = static_cast<std::uint64_t>(truth.misses);
  facts.planned_memory.assign(static_cast<std::size_t>(ops), 500);
  facts.planned_seconds = 0.01;
  tl.end_step(facts);
  truth.step = clock.t - start;
  // Transfers still open end in the next step (or never: still running when written).
  for (const auto& o : open) {
    if (u(rng) < 0.5) tl.transfer_end(o.handle, false);
  }
  return truth;
}

TEST(Timeline, ReportSumsTheStepsItKeeps) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 20; ++trial) {
    FakeClock clock;
    Timeline::Options o;
    o.clock = clock.fn();
    o.last_steps = 3;
    Timeline tl(o);
    std::vector<Truth> truths;
    const int steps = 2 + trial % 5;
    for (int s = 0; s < steps; ++s) {
      truths.push_back(random_step(tl, clock, rng, s, 5 + static_cast<int>(rng() % 40)));
    }
    const auto kept = tl.steps();
    ASSERT_EQ(kept.size(), std::min<std::size_t>(3, truths.size()));
    EXPECT_EQ(kept.back().step, steps - 1);
    // The report covers the kept steps: the last three.
    Truth sum;
    const std::size_t first = truths.size() - kept.size();
    for (std::size_t i = first; i < truths.size(); ++i) {
      sum.step += truths[i].step;
      sum.in_ops += truths[i].in_ops;
      sum.write_stall += truths[i].write_stall;
      sum.stalled_between_ops += truths[i].stalled_between_ops;
      for (std::size_t c = 0; c < kNumChannels; ++c) {
        sum.read_stall[c] += truths[i].read_stall[c];
        sum.bytes[c] += truths[i].bytes[c];
      }
      sum.misses += truths[i].misses;
    }
    const auto n = static_cast<double>(kept.size());
    const TimeReport r = tl.report();
    ASSERT_EQ(r.steps, static_cast<int>(kept.size()));
    EXPECT_NEAR(r.step_seconds, sum.step / n, 1e-9);
    EXPECT_NEAR(r.write_stall_seconds, sum.write_stall / n, 1e-9);
    double stalls = sum.write_stall;
    for (std::size_t c = 0; c < kNumChannels; ++c) {
      EXPECT_NEAR(r.read_stall_seconds[c], sum.read_stall[c] / n, 1e-9) << c;
      EXPECT_EQ(r.bytes[c], static_cast<std::uint64_t>(static_cast<double>(sum.bytes[c]) / n));
      stalls += sum.read_stall[c];
    }
    EXPECT_NEAR(r.compute_seconds, (sum.in_ops - (stalls - sum.stalled_between_ops)) / n, 1e-9);
    EXPECT_NEAR(r.between_ops_seconds, (sum.step - sum.in_ops - sum.stalled_between_ops) / n, 1e-9);
    EXPECT_NEAR(r.accounted(), 1.0, 1e-9);
    EXPECT_NEAR(r.misses, sum.misses / n, 1e-9);
    EXPECT_FALSE(r.limit.empty());
  }
}

TEST(Timeline, KeepsChosenStepsOnly) {
  FakeClock clock;
  std::mt19937_64 rng(7);
  Timeline::Options o;
  o.clock = clock.fn();
  o.steps = {1, 4};
  Timeline tl(o);
  for (int s = 0; s < 6; ++s) random_step(tl, clock, rng, s, 8);
  const auto kept = tl.steps();
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept[0].step, 1);
  EXPECT_EQ(kept[1].step, 4);
}

TEST(Timeline, OnlyExecutingStepsAreReportedWhenThereAreAny) {
  FakeClock clock;
  std::mt19937_64 rng(9);
  Timeline::Options o;
  o.clock = clock.fn();
  o.last_steps = 5;
  Timeline tl(o);
  random_step(tl, clock, rng, 0, 10, StepState::kWarmup);
  random_step(tl, clock, rng, 1, 10, StepState::kProfiling);
  const Truth t = random_step(tl, clock, rng, 2, 10, StepState::kExecuting);
  const TimeReport r = tl.report();
  EXPECT_EQ(r.steps, 1);
  EXPECT_NEAR(r.step_seconds, t.step, 1e-9);
  // Without any: every kept step.
  FakeClock c2;
  o.clock = c2.fn();
  Timeline none(o);
  random_step(none, c2, rng, 0, 10, StepState::kWarmup);
  EXPECT_EQ(none.report().steps, 1);
  EXPECT_EQ(Timeline(o).report().steps, 0);
  EXPECT_NE(Timeline(o).report().limit.find("not measured"), std::string::npos);
}

TEST(Timeline, TransferEndingInALaterStepEndsInItsOwn) {
  FakeClock clock;
  Timeline tl(clock.options());
  tl.begin_step(0, StepState::kExecuting, 0, 0);
  const std::size_t h = tl.transfer_start(Channel::kSsdWrite, TransferKind::kPlanned, "w", 10, -1);
  clock.t += 1;
  tl.end_step({});
  tl.begin_step(1, StepState::kExecuting, 0, 0);
  clock.t += 2;
  tl.transfer_end(h, false);
  // The handle is reused for the next transfer.
  EXPECT_EQ(tl.transfer_start(Channel::kSsdRead, TransferKind::kMiss, "r", 5, -1), h);
  clock.t += 1;
  tl.end_step({});
  const auto kept = tl.steps();
  ASSERT_EQ(kept.size(), 2u);
  ASSERT_EQ(kept[0].transfers.size(), 1u);
  EXPECT_DOUBLE_EQ(kept[0].transfers[0].end - kept[0].transfers[0].start, 3.0);
  ASSERT_EQ(kept[1].transfers.size(), 1u);
  EXPECT_EQ(kept[1].transfers[0].kind, TransferKind::kMiss);
  EXPECT_LT(kept[1].transfers[0].end, 0);  // not finished
  // Between steps: flagged.
  tl.transfer_start(Channel::kSsdRead, TransferKind::kMiss, "between", 5, -1);
  EXPECT_TRUE(tl.steps().back().transfers.back().between_steps);
}

// The report of a step whose only stall is of one kind, on one channel.
TimeReport one_sided(FakeClock& clock, StallKind kind, Channel channel, double stall,
                     std::uint64_t bytes) {
  Timeline::Options o;
  o.clock = clock.fn();
  Timeline tl(o);
  tl.begin_step(0, StepState::kExecuting, 100, 100);
  tl.op_start(0, "op", 0);
  const std::size_t h = tl.transfer_start(channel, TransferKind::kPlanned, "x", bytes, -1);
  clock.t += 0.01;
  if (stall > 0) tl.stall(kind, channel, "x", tl.now(), tl.now() + stall);
  clock.t += stall;
  tl.transfer_end(h, false);
  clock.t += 0.01;
  tl.op_end(0);
  tl.end_step({});
  return tl.report();
}

TEST(Timeline, TheSentenceNamesWhatLimits) {
  {
    FakeClock c;
    const auto r = one_sided(c, StallKind::kRead, Channel::kSsdRead, 0.5, 1 << 30);
    EXPECT_EQ(r.limit.rfind("SSD reads", 0), 0u) << r.limit;
    EXPECT_NE(r.limit.find("More SSDs"), std::string::npos) << r.limit;
    // The bandwidth it delivered: 1 GiB over the 0.51 s the read ran.
    EXPECT_NE(r.limit.find("delivered 2.1"), std::string::npos) << r.limit;
  }
  {
    FakeClock c;
    const auto r = one_sided(c, StallKind::kBudget, Channel::kSsdWrite, 0.5, 1 << 30);
    EXPECT_EQ(r.limit.rfind("writes under the budget", 0), 0u) << r.limit;
  }
  {
    FakeClock c;
    const auto r = one_sided(c, StallKind::kRead, Channel::kHostRead, 0.3, 1 << 20);
    EXPECT_EQ(r.limit.rfind("host memory reads", 0), 0u) << r.limit;
  }
  {
    FakeClock c;
    const auto r = one_sided(c, StallKind::kRead, Channel::kSsdRead, 0.0001, 1 << 20);
    EXPECT_EQ(r.limit.rfind("compute", 0), 0u) << r.limit;
  }
  {
    FakeClock c;
    const auto r = one_sided(c, StallKind::kRead, Channel::kSsdRead, 0.0, 0);
    EXPECT_EQ(r.limit.rfind("no I/O", 0), 0u) << r.limit;
  }
}

TEST(Timeline, ReadsThatHadTheBandwidthButStartedLateAreSaidSo) {
  FakeClock clock;
  Timeline tl(clock.options());
  tl.begin_step(0, StepState::kExecuting, 100, 100);
  tl.op_start(0, "op", 0);
  clock.t += 0.1;  // compute
  // The read starts only when the op needs it, and takes 10 ms: 1 MiB at 0.1 GB/s, where the
  // plan needs 1 MiB in 0.1 s of compute (0.01 GB/s).
  const std::size_t h = tl.transfer_start(Channel::kSsdRead, TransferKind::kMiss, "x", 1 << 20, -1);
  tl.stall(StallKind::kRead, Channel::kSsdRead, "x", tl.now(), tl.now() + 0.01);
  clock.t += 0.01;
  tl.transfer_end(h, false);
  tl.op_end(0);
  tl.end_step({});
  const TimeReport r = tl.report();
  EXPECT_EQ(r.limit.rfind("SSD reads started too late", 0), 0u) << r.limit;
  EXPECT_NE(r.limit.find("1.0 misses"), std::string::npos) << r.limit;
}

TEST(Timeline, ChromeTraceHasTheLanesAndKeepsEveryTransferInItsStep) {
  std::mt19937_64 rng(3);
  FakeClock clock;
  Timeline::Options o;
  o.clock = clock.fn();
  o.last_steps = 2;
  Timeline tl(o);
  for (int s = 0; s < 4; ++s) random_step(tl, clock, rng, s, 30);
  const json doc = json::parse(tl.chrome_json());
  std::set<std::string> lanes;
  std::map<std::int64_t, std::pair<double, double>> window;  // step -> [ts, ts + dur]
  std::map<std::int64_t, std::uint64_t> peak;
  std::map<std::int64_t, std::uint64_t> misses;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") lanes.insert(e["args"]["name"]);
    if (e.value("cat", "") == "step") {
      const double ts = e["ts"];
      window[e["args"]["step"]] = {ts, ts + e["dur"].get<double>()};
      peak[e["args"]["step"]] = e["args"]["peak_bytes"];
      misses[e["args"]["step"]] = e["args"]["misses"];
    }
  }
  EXPECT_TRUE(lanes.count("steps") && lanes.count("ops (stalls nested)")) << doc.dump();
  EXPECT_TRUE(lanes.count("I/O SSD read") && lanes.count("I/O SSD write"));
  ASSERT_EQ(window.size(), 2u);
  int transfers = 0;
  int memory = 0;
  int deadlines = 0;
  std::map<std::int64_t, std::uint64_t> miss_events;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("cat", "") == "transfer") {
      ++transfers;
      const auto [lo, hi] = window.at(e["args"]["step"]);
      const double ts = e["ts"];
      EXPECT_GE(ts, lo - 1e-6);
      EXPECT_LE(ts + e["dur"].get<double>(), hi + 1e-6);
      if (e["args"]["kind"] == "miss") ++miss_events[e["args"]["step"]];
      if (e["args"].contains("due_ts_us")) ++deadlines;
    }
    if (e["ph"] == "C" && e["name"] == "memory") {
      ++memory;
      EXPECT_LE(e["args"]["in_use"].get<std::uint64_t>(), 950u);  // the steps' peak
    }
  }
  EXPECT_GT(transfers, 0);
  EXPECT_GT(memory, 0);
  EXPECT_GT(deadlines, 0);
  for (const auto& [step, n] : misses) EXPECT_EQ(miss_events[step], n) << "step " << step;
  EXPECT_EQ(doc["otherData"]["format"], "tidal timeline");
}

TEST(Timeline, SvgDrawsTheLastStepAndWritesAtomically) {
  std::mt19937_64 rng(5);
  FakeClock clock;
  Timeline tl(clock.options());
  EXPECT_NE(tl.svg().find("no finished step"), std::string::npos);
  random_step(tl, clock, rng, 0, 20);
  const std::string svg = tl.svg();
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("budget"), std::string::npos);
  EXPECT_NE(svg.find("wall"), std::string::npos);  // 1200 against a budget of 1000
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  EXPECT_NE(svg.find("limit: "), std::string::npos);
  const auto dir = std::filesystem::temp_directory_path() / ("tl-" + std::to_string(rng()));
  std::filesystem::create_directories(dir);
  tl.write((dir / "a.svg").string());
  tl.write((dir / "a.json").string());
  std::ifstream in(dir / "a.json");
  EXPECT_NO_THROW((void)json::parse(in));
  std::ifstream svg_in(dir / "a.svg");
  std::stringstream text;
  text << svg_in.rdbuf();
  EXPECT_EQ(text.str(), svg);
  std::filesystem::remove_all(dir);
}

// The file is for sharing (0644), set on the descriptor: a symlink another user planted at the
// temporary name a writer used to take (<path>.tmp.<pid>) is not followed, and the file it
// points to keeps its bytes and its 0600 mode.
TEST(Timeline, WritesA0644FileAndFollowsNoPlantedLink) {
  std::mt19937_64 rng(9);
  FakeClock clock;
  Timeline tl(clock.options());
  random_step(tl, clock, rng, 0, 5);
  const auto dir = std::filesystem::temp_directory_path() / ("tl-" + std::to_string(rng()));
  std::filesystem::create_directories(dir);
  const std::string victim = (dir / "victim").string();
  std::ofstream(victim) << "private";
  ASSERT_EQ(::chmod(victim.c_str(), 0600), 0);
  const std::string path = (dir / "run.json").string();
  std::filesystem::create_symlink(victim, path + ".tmp." + std::to_string(::getpid()));
  tl.write(path);
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  ASSERT_EQ(::stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  std::ifstream in(victim);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "private");
  std::filesystem::remove_all(dir);
}

TEST(Timeline, FormatReportSaysWhatWasNotMeasured) {
  FakeClock clock;
  const TimeReport r = one_sided(clock, StallKind::kRead, Channel::kSsdRead, 0.2, 1 << 20);
  const std::string text = format_report(r);
  EXPECT_NE(text.find("read stall, SSD"), std::string::npos) << text;
  EXPECT_NE(text.find("not measured"), std::string::npos) << text;  // no store figures given
  EXPECT_NE(text.find("limit: "), std::string::npos);
}

}  // namespace
}  // namespace tidal::plan
