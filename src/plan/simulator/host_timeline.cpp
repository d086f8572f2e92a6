// The host CPU's timeline in the simulator (host_timeline.hpp).
#include "plan/simulator/host_timeline.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "tidal/common/error.hpp"

namespace tidal::plan::detail::sim {

using trace::OpIndex;
using trace::TensorId;

HostTimeline::HostTimeline(const std::vector<HostTask>& tasks, std::int32_t num_ops,
                           std::int32_t num_tensors)
    : active_(!tasks.empty()),
      after_(static_cast<std::size_t>(num_ops)),
      refresh_run_(static_cast<std::size_t>(num_tensors), -1) {
  for (const HostTask& task : tasks) {
    TIDAL_EXPECT_AS(InvalidArgument, task.after >= 0 && task.after < num_ops, "host task '",
                    task.name, "' follows op ", task.after, ", which the trace does not have");
    for (const auto* ids : {&task.inputs, &task.refreshes}) {
      for (TensorId id : *ids) {
        TIDAL_EXPECT_AS(InvalidArgument, id >= 0 && id < num_tensors, "host task '", task.name,
                        "' names tensor ", id, ", which the trace does not have");
      }
    }
    after_[static_cast<std::size_t>(task.after)].push_back(&task);
  }
}

void HostTimeline::mark_refreshes(OpIndex k) {
  std::size_t run = runs_.size();
  for (const HostTask* task : after_[static_cast<std::size_t>(k)]) {
    for (TensorId id : task->refreshes) {
      refresh_run_[static_cast<std::size_t>(id)] = static_cast<int>(run);
    }
    ++run;
  }
}

void HostTimeline::queue(OpIndex k, double t, const std::function<int(TensorId)>& drain,
                         bool counting) {
  for (const HostTask* task : after_[static_cast<std::size_t>(k)]) {
    Run r;
    r.task = task;
    r.queued = t;
    for (TensorId id : task->inputs) {
      const int j = drain(id);
      if (j >= 0) r.jobs.push_back(j);
    }
    if (counting) seconds_ += task->seconds;
    runs_.push_back(std::move(r));
  }
}

void HostTimeline::resolve(const std::function<JobView(int)>& job) {
  while (next_ < runs_.size()) {
    Run& r = runs_[next_];
    double ready = std::max(free_, r.queued);
    for (int j : r.jobs) {
      const JobView v = job(j);
      if (!v.done) return;
      ready = std::max(ready, v.end);
    }
    r.end = ready + r.task->seconds;
    free_ = r.end;
    ++next_;
  }
}

double HostTimeline::force(int index, const std::function<JobView(int)>& job,
                           const std::function<void(int)>& finish) {
  const auto i = static_cast<std::size_t>(index);
  while (runs_[i].end < 0) {
    for (int j : runs_[next_].jobs) {
      if (!job(j).done) finish(j);
    }
    resolve(job);
  }
  return runs_[i].end;
}

bool HostTimeline::pending(TensorId id, double now) {
  int& r = refresh_run_[static_cast<std::size_t>(id)];
  if (r < 0) return false;
  if (static_cast<std::size_t>(r) >= runs_.size()) return true;  // queued when its op ends
  const double end = runs_[static_cast<std::size_t>(r)].end;
  if (end >= 0 && end <= now) {
    r = -1;
    return false;
  }
  return true;
}

int HostTimeline::run_of(TensorId id) const { return refresh_run_[static_cast<std::size_t>(id)]; }

const std::string& HostTimeline::task_name(int run) const {
  return runs_[static_cast<std::size_t>(run)].task->name;
}

void HostTimeline::forget(TensorId id) { refresh_run_[static_cast<std::size_t>(id)] = -1; }

bool HostTimeline::take_deferred(TensorId id) {
  const auto d = std::find_if(deferred_.begin(), deferred_.end(),
                              [id](const DeferredRead& x) { return x.tensor == id; });
  if (d == deferred_.end()) return false;
  deferred_.erase(d);
  return true;
}

std::optional<std::pair<DeferredRead, double>> HostTimeline::next_ready(double t) {
  std::size_t best = deferred_.size();
  double best_end = t;
  for (std::size_t i = 0; i < deferred_.size(); ++i) {
    const int r = refresh_run_[static_cast<std::size_t>(deferred_[i].tensor)];
    if (r >= 0 && static_cast<std::size_t>(r) >= runs_.size()) continue;  // not queued yet
    const double end = r < 0 ? 0.0 : runs_[static_cast<std::size_t>(r)].end;
    if (r >= 0 && end < 0) continue;  // its task has not started
    if (end <= best_end) {
      best = i;
      best_end = end;
    }
  }
  if (best == deferred_.size()) return std::nullopt;
  const DeferredRead d = deferred_[best];
  deferred_.erase(deferred_.begin() + static_cast<std::ptrdiff_t>(best));
  refresh_run_[static_cast<std::size_t>(d.tensor)] = -1;
  return std::make_pair(d, best_end);
}

}  // namespace tidal::plan::detail::sim
