#include "tidal/plan/profiling_phase.hpp"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {
namespace {

enum class Where : std::uint8_t { kGone, kResident, kOnSsd };

}  // namespace

ProfilingPhase simulate_profiling_phase(const trace::Trace& trace, const Hardware& hw, int steps,
                                        double planned_step_seconds, double planning_seconds) {
  TIDAL_EXPECT_AS(InvalidArgument, steps >= 1, "the steps before a plan must be 1 or more");
  TIDAL_EXPECT_AS(InvalidArgument, hw.device_memory > 0 && hw.ssd_count > 0,
                  "simulating the steps before a plan needs device memory and SSDs");
  ProfilingPhase r;
  r.steps = steps;
  r.fits = true;
  r.compute_seconds = trace.compute_seconds();
  const trace::LifetimeAnalysis la = trace::analyze_lifetimes(trace);
  const double capacity = static_cast<double>(hw.device_memory) * (1.0 - hw.memory_margin);
  const double write_bw = hw.ssd_write_total();
  const double read_bw = hw.ssd_read_total();
  const std::size_t n = trace.tensors.size();
  const std::size_t n_ops = trace.ops.size();

  // Tensors whose memory goes back after op k (persistent ones only across a gap).
  std::vector<std::vector<trace::TensorId>> ends(n_ops);
  for (std::size_t id = 0; id < n; ++id) {
    const trace::TensorLifetime& l = la.tensors[id];
    const trace::Tensor& t = trace.tensors[id];
    if (l.live_end == trace::kNoOp || l.live_begin == trace::kNoOp) continue;
    if (t.persistent && !t.has_gap()) continue;
    if (static_cast<std::size_t>(l.live_end) < n_ops)
      ends[static_cast<std::size_t>(l.live_end)].push_back(static_cast<trace::TensorId>(id));
  }

  // The model made outside the budget: its state starts on the SSD.
  std::vector<Where> where(n, Where::kGone);
  for (std::size_t id = 0; id < n; ++id) {
    if (trace.tensors[id].persistent) where[id] = Where::kOnSsd;
  }
  std::vector<std::uint64_t> last_read(n, 0);
  std::vector<char> needed(n, 0);
  std::set<std::pair<std::uint64_t, std::size_t>> lru;  // resident tensors by last read
  std::uint64_t tick = 0;
  double resident = 0;

  const auto run_step = [&](std::uint64_t& read, std::uint64_t& written) {
    double seconds = 0;
    read = written = 0;
    for (std::size_t k = 0; k < n_ops; ++k) {
      const trace::Op& op = trace.ops[k];
      std::vector<trace::TensorId> use(op.inputs);
      use.insert(use.end(), op.outputs.begin(), op.outputs.end());
      std::sort(use.begin(), use.end());
      use.erase(std::unique(use.begin(), use.end()), use.end());
      auto more = static_cast<double>(op.workspace_bytes);
      for (trace::TensorId id : use) {
        needed[static_cast<std::size_t>(id)] = 1;
        if (where[static_cast<std::size_t>(id)] != Where::kResident) {
          more += static_cast<double>(trace.tensors[static_cast<std::size_t>(id)].bytes);
        }
      }
      // Room first: the tensors read least recently, never this op's, written out at once.
      while (resident + more > capacity) {
        std::size_t victim = n;
        for (const auto& [when, id] : lru) {
          if (needed[id] == 0) {
            victim = id;
            break;
          }
        }
        if (victim == n) break;
        lru.erase({last_read[victim], victim});
        const auto b = trace.tensors[victim].bytes;
        written += b;
        seconds += static_cast<double>(b) / write_bw;
        where[victim] = Where::kOnSsd;
        resident -= static_cast<double>(b);
      }
      if (resident + more > capacity && r.fits) {
        r.fits = false;
        char line[256];
        std::snprintf(line, sizeof line,
                      "op %zu '%s' needs %s of its own tensors and workspace, more than the %s "
                      "of device memory",
                      k, op.name.c_str(), format_bytes(resident + more).c_str(),
                      format_bytes(capacity).c_str());
        r.note = line;
      }
      for (trace::TensorId id : use) {
        const auto i = static_cast<std::size_t>(id);
        const auto b = trace.tensors[i].bytes;
        if (where[i] == Where::kOnSsd) {
          read += b;
          seconds += static_cast<double>(b) / read_bw;
        }
        if (where[i] != Where::kResident) resident += static_cast<double>(b);
        if (where[i] == Where::kResident) lru.erase({last_read[i], i});
        where[i] = Where::kResident;
        last_read[i] = ++tick;
        lru.insert({last_read[i], i});
        needed[i] = 0;
      }
      seconds += trace.op_seconds(k);
      for (trace::TensorId id : ends[k]) {
        const auto i = static_cast<std::size_t>(id);
        if (where[i] == Where::kResident) {
          resident -= static_cast<double>(trace.tensors[i].bytes);
          lru.erase({last_read[i], i});
        }
        where[i] = Where::kGone;
      }
    }
    return seconds;
  };

  std::uint64_t read = 0;
  std::uint64_t written = 0;
  r.first_step_seconds = run_step(read, written);
  r.step_seconds = steps > 1 ? run_step(read, written) : r.first_step_seconds;
  r.bytes_read = read;
  r.bytes_written = written;
  r.total_seconds = r.first_step_seconds + (steps - 1) * r.step_seconds;
  if (planned_step_seconds > 0) {
    r.planned_step_seconds = planned_step_seconds;
    r.planning_seconds = planning_seconds;
    r.extra_seconds = r.total_seconds + planning_seconds - steps * planned_step_seconds;
    const double gain = r.step_seconds - planned_step_seconds;
    r.payback_steps = gain > 0 ? std::max(0.0, r.extra_seconds) / gain : -1;
  }
  return r;
}

}  // namespace tidal::plan
