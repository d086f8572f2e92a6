// The time report's closing sentence: the one thing that limits the run, and what would help.
#include <algorithm>
#include <cstdio>
#include <string>

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

}  // namespace

// The sentence: what limits this run and what would help.
std::string limit_sentence(const TimeReport& r, const std::array<double, kNumChannels>& busy,
                           const ChannelRates& rates) {
  if (r.steps == 0) return "not measured: no executed step was kept";
  const double step = r.step_seconds;
  const double stall = r.stall_seconds();
  std::string s;
  std::uint64_t moved = 0;
  for (auto b : r.bytes) moved += b;
  if (moved == 0 && stall == 0) {
    return "no I/O: nothing was offloaded in these steps (the run's notice may say why); the step "
           "is compute and the loop's own code";
  }
  if (step <= 0 || stall < 0.05 * step) {
    s = "compute: the I/O is hidden (stalls are " + pct(step > 0 ? stall / step : 0) +
        " of the step)";
    if (r.between_ops_seconds > 0.3 * step) {
      s += "; code outside ops (the loop, data, Python) takes " + pct(r.between_ops_seconds / step);
    }
    if (r.planned_seconds > 0 && step > 1.5 * r.planned_seconds) {
      s += "; the step took " + secs(step) + " where the plan predicted " +
           secs(r.planned_seconds) + " (the profiled op times do not hold under offloading)";
    }
    return s;
  }
  // The largest stall decides.
  int worst = -1;  // channel index for reads, kNumChannels for the write stall
  double most = r.write_stall_seconds;
  worst = static_cast<int>(kNumChannels);
  for (std::size_t c = 0; c < kNumChannels; ++c) {
    if (r.read_stall_seconds[c] > most) {
      most = r.read_stall_seconds[c];
      worst = static_cast<int>(c);
    }
  }
  const double compute = std::max(r.compute_seconds + r.between_ops_seconds, 1e-9);
  const auto delivered = [&](Channel c) {
    const double b = busy[index_of(c)];
    return b > 0 ? static_cast<double>(r.bytes[index_of(c)]) / b : 0.0;
  };
  const auto assumed = [&](Channel c) {
    if (rates[c] <= 0) return std::string();
    std::string a = ", the plan assumed " + gbps(rates[c]);
    const double got = delivered(c);
    if (got > 0 && got < 0.5 * rates[c]) {
      a += ": the " + std::string(tier_of(c) == Tier::kSsd ? "disk" : "host link") +
           " delivers far less than when the session measured it (another process using it, or "
           "throttling)";
    }
    return a;
  };
  if (worst < static_cast<int>(kNumChannels)) {
    const auto c = static_cast<Channel>(worst);
    const auto bytes = static_cast<double>(r.bytes[index_of(c)]);
    const double need = bytes / compute;
    if (delivered(c) > 1.2 * need) {
      // Bandwidth enough: the reads started too late.
      s = std::string(c == Channel::kSsdRead ? "SSD reads" : "host memory reads") +
          " started too late: ops waited " + secs(most) + " a step (" + pct(most / step) +
          ") for them, yet the " + (c == Channel::kSsdRead ? "store" : "host pool") +
          " delivered " + gbps(delivered(c)) + ", more than the " + gbps(need) +
          " the plan needs. Prefetches wait for room under the budget, or the plan issues them "
          "late: a larger budget lets them start earlier";
      if (r.misses > 0) {
        char b[96];
        std::snprintf(b, sizeof b, " (%.1f misses a step: reads started only when needed)",
                      r.misses);
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
    s = std::string(c == Channel::kSsdRead ? "SSD reads" : "host memory reads") + ": ops waited " +
        secs(most) + " a step (" + pct(most / step) + ") for reads; the plan needs " + gbps(need) +
        " to hide " + format_bytes(bytes) + " a step behind " + secs(compute) +
        " of compute, the " + (c == Channel::kSsdRead ? "store" : "host pool") + " delivered " +
        (delivered(c) > 0 ? gbps(delivered(c)) : std::string("(not measured)")) + assumed(c);
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
  } else {
    const auto bytes = static_cast<double>(r.bytes[index_of(Channel::kSsdWrite)] +
                                           r.bytes[index_of(Channel::kHostWrite)]);
    s = "writes under the budget: ops waited " + secs(most) + " a step (" + pct(most / step) +
        ") for writes to free memory";
    if (r.evictions > 0) {
      char b[64];
      std::snprintf(b, sizeof b, " (%.1f evictions a step)", r.evictions);
      s += b;
    }
    s += "; the plan needs " + gbps(bytes / compute) + " of writes, the store delivered " +
         (delivered(Channel::kSsdWrite) > 0 ? gbps(delivered(Channel::kSsdWrite))
                                            : std::string("(not measured)")) +
         assumed(Channel::kSsdWrite);
    if (r.evictions > 0 && delivered(Channel::kSsdWrite) > 1.2 * bytes / compute) {
      s += "; the bandwidth is there: the waits are evictions, writes outside the plan made at "
           "once, so the plan does not keep the budget by itself here. A larger budget would help";
    } else {
      s += ". A larger budget, more SSDs or host memory for offloaded tensors (--host-mem, "
           "host_memory=) would help";
    }
  }
  return s;
}

}  // namespace tidal::plan::detail
