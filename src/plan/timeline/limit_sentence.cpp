// The time report's closing sentence: the one thing that limits the run, and what would help.
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "plan/timeline/timeline_impl.hpp"
#include "tidal/common/units.hpp"

namespace tidal::plan::detail {

namespace {

std::string gbps(double bytes_per_second) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB/s", bytes_per_second / 1e9);
  return b;
}

std::string pct(double share) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f%%", 100.0 * share);
  return b;
}

std::string secs(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f s", s);
  return b;
}

// The report's channels as measured (bytes over the time each had a transfer in flight), against
// what the plan assumed of them.
struct ChannelFacts {
  const TimeReport& r;
  const std::array<double, kNumChannels>& busy;
  const ChannelRates& rates;

  // Bytes per second the channel delivered while busy; 0: not measured.
  [[nodiscard]] double delivered(Channel c) const {
    const double b = busy[index_of(c)];
    return b > 0 ? static_cast<double>(r.bytes[index_of(c)]) / b : 0.0;
  }
  // ", the plan assumed ...", and why when the channel delivered far less; empty when unknown.
  [[nodiscard]] std::string assumed(Channel c) const {
    if (rates[c] <= 0) return {};
    std::string a = ", the plan assumed " + gbps(rates[c]);
    const double got = delivered(c);
    if (got > 0 && got < 0.5 * rates[c]) {
      a += ": the " + std::string(tier_of(c) == Tier::kSsd ? "disk" : "host link") +
           " delivers far less than when the session measured it (another process using it, or "
           "throttling)";
    }
    return a;
  }
};

// Stalls under 5% of the step: the I/O is hidden, and the step is compute (or code outside ops,
// or op times the plan did not foresee).
std::string hidden_io_sentence(const TimeReport& r) {
  const double step = r.step_seconds;
  const double stall = r.stall_seconds();
  std::string s = "compute: the I/O is hidden (stalls are " + pct(step > 0 ? stall / step : 0) +
                  " of the step)";
  if (r.between_ops_seconds > 0.3 * step) {
    s += "; code outside ops (the loop, data, Python) takes " + pct(r.between_ops_seconds / step);
  }
  if (r.planned_seconds > 0 && step > 1.5 * r.planned_seconds) {
    s += "; the step took " + secs(step) + " where the plan predicted " + secs(r.planned_seconds) +
         " (the profiled op times do not hold under offloading)";
  }
  return s;
}

// The largest stall, in seconds, and whose: a read channel's index, or kNumChannels for the write
// stall (which wins ties).
std::pair<int, double> worst_stall(const TimeReport& r) {
  int worst = static_cast<int>(kNumChannels);
  double most = r.write_stall_seconds;
  for (std::size_t c = 0; c < kNumChannels; ++c) {
    if (r.read_stall_seconds[c] > most) {
      most = r.read_stall_seconds[c];
      worst = static_cast<int>(c);
    }
  }
  return {worst, most};
}

// Reads on channel c waited `most` a step though the channel delivered more than the `need`ed
// rate: they started too late.
std::string reads_started_late(const ChannelFacts& f, Channel c, double most, double need) {
  const TimeReport& r = f.r;
  std::string s = std::string(c == Channel::kSsdRead ? "SSD reads" : "host memory reads") +
                  " started too late: ops waited " + secs(most) + " a step (" +
                  pct(most / r.step_seconds) + ") for them, yet the " +
                  (c == Channel::kSsdRead ? "store" : "host pool") + " delivered " +
                  gbps(f.delivered(c)) + ", more than the " + gbps(need) +
                  " the plan needs. Prefetches wait for room under the budget, or the plan issues "
                  "them late: a larger budget lets them start earlier";
  if (r.misses > 0) {
    char b[96];
    std::snprintf(b, sizeof b, " (%.1f misses a step: reads started only when needed)", r.misses);
    s += b;
  }
  if (r.misses > 0 && r.evictions > 0) {
    char b[200];
    std::snprintf(b, sizeof b,
                  "; %.1f evictions a step (writes outside the plan, to stay under the "
                  "budget) are read back as misses: the plan does not keep the budget by "
                  "itself here",
                  r.evictions);
    s += b;
  }
  return s;
}

// Reads on channel c stalled the most (`most` seconds a step, beside `compute` seconds of
// compute): they started too late, or the channel is too slow for the plan.
std::string read_sentence(const ChannelFacts& f, Channel c, double most, double compute) {
  const TimeReport& r = f.r;
  const auto bytes = static_cast<double>(r.bytes[index_of(c)]);
  const double need = bytes / compute;
  // Bandwidth enough: the reads started too late.
  if (f.delivered(c) > 1.2 * need) return reads_started_late(f, c, most, need);
  std::string s =
      std::string(c == Channel::kSsdRead ? "SSD reads" : "host memory reads") + ": ops waited " +
      secs(most) + " a step (" + pct(most / r.step_seconds) + ") for reads; the plan needs " +
      gbps(need) + " to hide " + format_bytes(bytes) + " a step behind " + secs(compute) +
      " of compute, the " + (c == Channel::kSsdRead ? "store" : "host pool") + " delivered " +
      (f.delivered(c) > 0 ? gbps(f.delivered(c)) : std::string("(not measured)")) + f.assumed(c);
  if (r.misses > 0) {
    char b[96];
    std::snprintf(b, sizeof b, "; %.1f misses a step (reads started only when an op needed them)",
                  r.misses);
    s += b;
  }
  s += c == Channel::kSsdRead
           ? ". More SSDs (one directory per SSD), host memory for offloaded tensors "
             "(--host-mem, host_memory=), a larger budget or a smaller batch would help"
           : ". A larger budget or a smaller batch would help";
  return s;
}

// Waits for writes (budget and deadline stalls, evictions) were the largest stall: `most` seconds
// a step, beside `compute` seconds of compute.
std::string write_sentence(const ChannelFacts& f, double most, double compute) {
  const TimeReport& r = f.r;
  const auto bytes = static_cast<double>(r.bytes[index_of(Channel::kSsdWrite)] +
                                         r.bytes[index_of(Channel::kHostWrite)]);
  std::string s = "writes under the budget: ops waited " + secs(most) + " a step (" +
                  pct(most / r.step_seconds) + ") for writes to free memory";
  if (r.evictions > 0) {
    char b[64];
    std::snprintf(b, sizeof b, " (%.1f evictions a step)", r.evictions);
    s += b;
  }
  s += "; the plan needs " + gbps(bytes / compute) + " of writes, the store delivered " +
       (f.delivered(Channel::kSsdWrite) > 0 ? gbps(f.delivered(Channel::kSsdWrite))
                                            : std::string("(not measured)")) +
       f.assumed(Channel::kSsdWrite);
  if (r.evictions > 0 && f.delivered(Channel::kSsdWrite) > 1.2 * bytes / compute) {
    s += "; the bandwidth is there: the waits are evictions, writes outside the plan made at "
         "once, so the plan does not keep the budget by itself here. A larger budget would help";
  } else {
    s += ". A larger budget, more SSDs or host memory for offloaded tensors (--host-mem, "
         "host_memory=) would help";
  }
  return s;
}

}  // namespace

// The sentence: what limits this run and what would help.
std::string limit_sentence(const TimeReport& r, const std::array<double, kNumChannels>& busy,
                           const ChannelRates& rates) {
  if (r.steps == 0) return "not measured: no executed step was kept";
  const double step = r.step_seconds;
  const double stall = r.stall_seconds();
  std::uint64_t moved = 0;
  for (auto b : r.bytes) moved += b;
  if (moved == 0 && stall == 0) {
    return "no I/O: nothing was offloaded in these steps (the run's notice may say why); the step "
           "is compute and the loop's own code";
  }
  if (step <= 0 || stall < 0.05 * step) return hidden_io_sentence(r);
  // The largest stall decides.
  const auto [worst, most] = worst_stall(r);
  const double compute = std::max(r.compute_seconds + r.between_ops_seconds, 1e-9);
  const ChannelFacts facts{r, busy, rates};
  if (worst < static_cast<int>(kNumChannels)) {
    return read_sentence(facts, static_cast<Channel>(worst), most, compute);
  }
  return write_sentence(facts, most, compute);
}

}  // namespace tidal::plan::detail
