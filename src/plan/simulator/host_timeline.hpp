// The host CPU's timeline in the simulator (private to plan/): the host tasks of a plan whose
// optimizer step runs on the host (SimOptions::host_tasks), one at a time in the order they are
// queued, and the reads they hold back. The simulator's channels stay the simulator's: this
// class asks for what it needs of them through the calls it is given.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tidal/plan/simulator.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail::sim {

/// A transfer as the host timeline sees it: done or not, and when it ended.
struct JobView {
  bool done = false;
  double end = 0;
};

/// A prefetch held back until the host task that rewrites its tensor is done.
struct DeferredRead {
  trace::TensorId tensor = 0;
  double key = 0;
};

class HostTimeline {
 public:
  /// Throws tidal::InvalidArgument when a task names an op or tensor the trace does not have.
  HostTimeline(const std::vector<HostTask>& tasks, std::int32_t num_ops, std::int32_t num_tensors);

  /// Whether there are tasks at all (without, the simulator skips this timeline).
  [[nodiscard]] bool active() const { return active_; }

  /// The tensors the tasks after op k rewrite are stale from op k's end on: before the
  /// migrations issued then, so that a read of one among them waits for its task.
  void mark_refreshes(trace::OpIndex k);
  /// Queues the tasks after op k (ended at t). `drain` gives a tensor's offload to host memory
  /// (its job, or -2 where no write was needed) and throws where there is none.
  void queue(trace::OpIndex k, double t, const std::function<int(trace::TensorId)>& drain,
             bool counting);
  /// Gives an end time to the queued tasks, in order, while their inputs' offloads are done.
  void resolve(const std::function<JobView(int)>& job);
  /// The end of run `index`, finishing its inputs' offloads (`finish`) as needed.
  double force(int index, const std::function<JobView(int)>& job,
               const std::function<void(int)>& finish);
  /// Whether a task still rewrites tensor `id` at time `now` (forgets one that is done).
  bool pending(trace::TensorId id, double now);
  /// The run rewriting `id` (-1: none) and its task's name.
  [[nodiscard]] int run_of(trace::TensorId id) const;
  [[nodiscard]] const std::string& task_name(int run) const;
  void forget(trace::TensorId id);

  void defer(trace::TensorId id, double key) { deferred_.push_back({id, key}); }
  /// Removes the held-back read of `id`; whether there was one.
  bool take_deferred(trace::TensorId id);
  /// The held-back read whose task ends first, at or before t, with that end; removed.
  std::optional<std::pair<DeferredRead, double>> next_ready(double t);

  void start_counting() {
    seconds_ = 0;
    waits_ = 0;
  }
  void count_wait() { ++waits_; }
  [[nodiscard]] double seconds() const { return seconds_; }
  [[nodiscard]] std::int64_t waits() const { return waits_; }

 private:
  struct Run {
    const HostTask* task = nullptr;
    double queued = 0;      // when its op ended
    std::vector<int> jobs;  // the offloads of its inputs
    double end = -1;        // when it ends; -1 until known
  };
  bool active_ = false;
  std::vector<std::vector<const HostTask*>> after_;  // by op
  std::vector<Run> runs_;                            // in the order queued
  std::size_t next_ = 0;                             // the first without an end yet
  double free_ = 0;                                  // when the host's last task ends
  std::vector<int> refresh_run_;                     // by tensor: the run rewriting it
  std::vector<DeferredRead> deferred_;
  double seconds_ = 0;
  std::int64_t waits_ = 0;
};

}  // namespace tidal::plan::detail::sim
