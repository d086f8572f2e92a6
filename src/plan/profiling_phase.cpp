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

// The steps before a plan: device memory used as a cache of the SSDs. An op's tensors come in
// from the SSDs where they are not resident; room is made first by writing out the tensors read
// least recently, never the op's own. The model starts on the SSDs (it was made outside the
// budget). Results that make the phase not fit go to the ProfilingPhase given.
class DemandPaging {
 public:
  DemandPaging(const trace::Trace& trace, const Hardware& hw, ProfilingPhase& r)
      : trace_(trace),
        r_(r),
        capacity_(static_cast<double>(hw.device_memory) * (1.0 - hw.memory_margin)),
        write_bw_(hw.ssd_write_total()),
        read_bw_(hw.ssd_read_total()),
        n_(trace.tensors.size()),
        ends_(trace.ops.size()),
        where_(n_, Where::kGone),
        last_read_(n_, 0),
        needed_(n_, 0) {
    const trace::LifetimeAnalysis la = trace::analyze_lifetimes(trace);
    const std::size_t n_ops = trace.ops.size();
    // Tensors whose memory goes back after op k (persistent ones only across a gap).
    for (std::size_t id = 0; id < n_; ++id) {
      const trace::TensorLifetime& l = la.tensors[id];
      const trace::Tensor& t = trace.tensors[id];
      if (l.live_end == trace::kNoOp || l.live_begin == trace::kNoOp) continue;
      if (t.persistent && !t.has_gap()) continue;
      if (static_cast<std::size_t>(l.live_end) < n_ops)
        ends_[static_cast<std::size_t>(l.live_end)].push_back(static_cast<trace::TensorId>(id));
    }
    // The model made outside the budget: its state starts on the SSD.
    for (std::size_t id = 0; id < n_; ++id) {
      if (trace.tensors[id].persistent) where_[id] = Where::kOnSsd;
    }
  }

  // One step: its time, and the bytes it read and wrote.
  double run_step(std::uint64_t& read, std::uint64_t& written) {
    double seconds = 0;
    read = written = 0;
    for (std::size_t k = 0; k < trace_.ops.size(); ++k) {
      const trace::Op& op = trace_.ops[k];
      std::vector<trace::TensorId> use(op.inputs);
      use.insert(use.end(), op.outputs.begin(), op.outputs.end());
      std::sort(use.begin(), use.end());
      use.erase(std::unique(use.begin(), use.end()), use.end());
      auto more = static_cast<double>(op.workspace_bytes);
      for (trace::TensorId id : use) {
        needed_[static_cast<std::size_t>(id)] = 1;
        if (where_[static_cast<std::size_t>(id)] != Where::kResident) {
          more += static_cast<double>(trace_.tensors[static_cast<std::size_t>(id)].bytes);
        }
      }
      make_room(more, written, seconds);
      if (resident_ + more > capacity_ && r_.fits) {
        r_.fits = false;
        char line[256];
        std::snprintf(line, sizeof line,
                      "op %zu '%s' needs %s of its own tensors and workspace, more than the %s "
                      "of device memory",
                      k, op.name.c_str(), format_bytes(resident_ + more).c_str(),
                      format_bytes(capacity_).c_str());
        r_.note = line;
      }
      bring_in(use, read, seconds);
      seconds += trace_.op_seconds(k);
      free_after(k);
    }
    return seconds;
  }

 private:
  // Room first: the tensors read least recently, never this op's, written out at once.
  void make_room(double more, std::uint64_t& written, double& seconds) {
    while (resident_ + more > capacity_) {
      std::size_t victim = n_;
      for (const auto& [when, id] : lru_) {
        if (needed_[id] == 0) {
          victim = id;
          break;
        }
      }
      if (victim == n_) break;
      lru_.erase({last_read_[victim], victim});
      const auto b = trace_.tensors[victim].bytes;
      written += b;
      seconds += static_cast<double>(b) / write_bw_;
      where_[victim] = Where::kOnSsd;
      resident_ -= static_cast<double>(b);
    }
  }

  // The op's tensors resident, read from the SSDs where they were there, most recently read.
  void bring_in(const std::vector<trace::TensorId>& use, std::uint64_t& read, double& seconds) {
    for (trace::TensorId id : use) {
      const auto i = static_cast<std::size_t>(id);
      const auto b = trace_.tensors[i].bytes;
      if (where_[i] == Where::kOnSsd) {
        read += b;
        seconds += static_cast<double>(b) / read_bw_;
      }
      if (where_[i] != Where::kResident) resident_ += static_cast<double>(b);
      if (where_[i] == Where::kResident) lru_.erase({last_read_[i], i});
      where_[i] = Where::kResident;
      last_read_[i] = ++tick_;
      lru_.insert({last_read_[i], i});
      needed_[i] = 0;
    }
  }

  // The tensors whose memory goes back after op k are gone.
  void free_after(std::size_t k) {
    for (trace::TensorId id : ends_[k]) {
      const auto i = static_cast<std::size_t>(id);
      if (where_[i] == Where::kResident) {
        resident_ -= static_cast<double>(trace_.tensors[i].bytes);
        lru_.erase({last_read_[i], i});
      }
      where_[i] = Where::kGone;
    }
  }

  const trace::Trace& trace_;
  ProfilingPhase& r_;
  double capacity_;
  double write_bw_;
  double read_bw_;
  std::size_t n_;
  std::vector<std::vector<trace::TensorId>> ends_;
  std::vector<Where> where_;
  std::vector<std::uint64_t> last_read_;
  std::vector<char> needed_;
  std::set<std::pair<std::uint64_t, std::size_t>> lru_;  // resident tensors by last read
  std::uint64_t tick_ = 0;
  double resident_ = 0;
};

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
  DemandPaging paging(trace, hw, r);
  std::uint64_t read = 0;
  std::uint64_t written = 0;
  r.first_step_seconds = paging.run_step(read, written);
  r.step_seconds = steps > 1 ? paging.run_step(read, written) : r.first_step_seconds;
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
