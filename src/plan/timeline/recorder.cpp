// The timeline's recorder: steps, ops, transfers, stalls and memory as they happen, under one
// mutex; and the file it writes.
#include <algorithm>
#include <chrono>
#include <utility>

#include "tidal/common/atomic_file.hpp"
#include "tidal/common/enum_names.hpp"
#include "tidal/plan/timeline.hpp"

namespace tidal::plan {

namespace {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

TIDAL_ENUM_TO_STRING(TransferKind, {TransferKind::kPlanned, "planned"},
                     {TransferKind::kMiss, "miss"}, {TransferKind::kEviction, "eviction"},
                     {TransferKind::kActivation, "activation"})
TIDAL_ENUM_TO_STRING(StallKind, {StallKind::kRead, "read"}, {StallKind::kBudget, "budget"},
                     {StallKind::kDeadline, "deadline"})
TIDAL_ENUM_TO_STRING(StepState, {StepState::kOff, "off"}, {StepState::kWarmup, "warmup"},
                     {StepState::kProfiling, "profiling"}, {StepState::kExecuting, "executing"},
                     {StepState::kAborted, "aborted"})

Timeline::Timeline(Options options)
    : opt_(std::move(options)), t0_(opt_.clock ? opt_.clock() : steady_seconds()) {}

double Timeline::now() const { return (opt_.clock ? opt_.clock() : steady_seconds()) - t0_; }

TimelineStep* Timeline::current_locked() { return open_ ? &steps_.back() : nullptr; }

void Timeline::begin_step(std::int64_t step, StepState state, std::uint64_t budget,
                          std::uint64_t wall) {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_) steps_.back().end = now();  // a step that never ended: closed here
  TimelineStep s;
  s.step = step;
  s.state = state;
  s.start = now();
  s.budget = budget;
  s.wall = wall;
  steps_.push_back(std::move(s));
  open_ = true;
}

void Timeline::label_step(StepState state, std::uint64_t budget, std::uint64_t wall) {
  std::lock_guard<std::mutex> lock(mu_);
  if (TimelineStep* s = current_locked()) {
    s->state = state;
    s->budget = budget;
    s->wall = wall;
  }
}

void Timeline::end_step(const TimelineStep& facts) {
  std::lock_guard<std::mutex> lock(mu_);
  TimelineStep* s = current_locked();
  if (s == nullptr) return;
  s->end = now();
  for (auto& op : s->ops) {
    if (op.end < 0) op.end = s->end;
  }
  s->peak = facts.peak;
  s->misses = facts.misses;
  s->planned_memory = facts.planned_memory;
  s->planned_seconds = facts.planned_seconds;
  s->planned_stall_seconds = facts.planned_stall_seconds;
  s->planned_bytes = facts.planned_bytes;
  s->io_busy_seconds = facts.io_busy_seconds;
  s->checksum_seconds = facts.checksum_seconds;
  open_ = false;
  // Which steps stay: the chosen ones, or the last N.
  if (!opt_.steps.empty()) {
    if (std::find(opt_.steps.begin(), opt_.steps.end(), s->step) == opt_.steps.end()) {
      steps_.pop_back();
    }
  } else {
    while (steps_.size() > std::max<std::size_t>(opt_.last_steps, 1)) steps_.pop_front();
  }
}

void Timeline::op_start(trace::OpIndex index, const std::string& name, std::uint64_t memory_now) {
  std::lock_guard<std::mutex> lock(mu_);
  TimelineStep* s = current_locked();
  if (s == nullptr) return;
  const double t = now();
  if (!s->ops.empty() && s->ops.back().end < 0) {
    if (index < 0 && s->ops.back().index < 0 && s->ops.back().name == name) return;  // the same
    s->ops.back().end = t;  // ops do not nest
  }
  s->ops.push_back(TimelineOp{index, name, t, -1});
  if (memory_now != kNoSample) s->memory.emplace_back(t, memory_now);
}

void Timeline::op_end(std::uint64_t memory_now) {
  std::lock_guard<std::mutex> lock(mu_);
  TimelineStep* s = current_locked();
  if (s == nullptr || s->ops.empty() || s->ops.back().end >= 0) return;
  const double t = now();
  s->ops.back().end = t;
  if (memory_now != kNoSample) s->memory.emplace_back(t, memory_now);
}

std::size_t Timeline::transfer_start(Channel channel, TransferKind kind, std::string tensor,
                                     std::uint64_t bytes, trace::OpIndex due_op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (steps_.empty()) return static_cast<std::size_t>(-1);
  TimelineStep& s = steps_.back();  // between steps: the last step's
  TimelineTransfer t;
  t.channel = channel;
  t.kind = kind;
  t.tensor = std::move(tensor);
  t.bytes = bytes;
  t.start = now();
  t.due_op = due_op;
  t.between_steps = !open_;
  s.transfers.push_back(std::move(t));
  const std::pair<std::int64_t, std::size_t> where{s.step, s.transfers.size() - 1};
  if (!free_handles_.empty()) {
    const std::size_t h = free_handles_.back();
    free_handles_.pop_back();
    handles_[h] = where;
    return h;
  }
  handles_.push_back(where);
  return handles_.size() - 1;
}

void Timeline::transfer_end(std::size_t handle, bool failed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (handle >= handles_.size()) return;
  const auto [step, index] = handles_[handle];
  free_handles_.push_back(handle);
  // Newest first: a transfer ends in its step or soon after.
  for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
    if (it->step != step) continue;
    if (index < it->transfers.size()) {
      it->transfers[index].end = now();
      it->transfers[index].failed = failed;
    }
    return;
  }
}

void Timeline::stall(StallKind kind, Channel channel, std::string tensor, double start,
                     double end) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_) return;  // between steps (code reading tensors back): no step waited
  TimelineStep& s = steps_.back();
  TimelineStall st;
  st.kind = kind;
  st.channel = channel;
  st.tensor = std::move(tensor);
  st.start = start;
  st.end = end;
  // The op it delayed: the one running when it began.
  for (auto it = s.ops.rbegin(); it != s.ops.rend(); ++it) {
    if (it->start <= start) {
      if (it->end < 0 || it->end >= start) st.op = it->index;
      break;
    }
  }
  s.stalls.push_back(std::move(st));
}

void Timeline::memory(std::uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  TimelineStep* s = current_locked();
  if (s != nullptr) s->memory.emplace_back(now(), bytes);
}

std::vector<TimelineStep> Timeline::steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {steps_.begin(), steps_.end()};
}

void Timeline::write(const std::string& path) const {
  const bool svg_file = path.size() >= 4 && path.compare(path.size() - 4, 4, ".svg") == 0;
  const std::string text = svg_file ? svg() : chrome_json();
  // A picture or trace to share, not a secret: 0644 (AtomicFile sets it on the descriptor).
  AtomicFile f(path, 0644);
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace tidal::plan
