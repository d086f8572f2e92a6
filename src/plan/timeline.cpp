#include "tidal/plan/timeline.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "tidal/common/atomic_file.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal::plan {

using json = nlohmann::json;

namespace {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Seconds of [a, b) covered by the union of `spans` (each clipped to [a, b)).
double covered(std::vector<std::pair<double, double>> spans, double a, double b) {
  for (auto& s : spans) {
    s.first = std::max(s.first, a);
    s.second = std::min(s.second, b);
  }
  std::sort(spans.begin(), spans.end());
  double total = 0;
  double reach = a;
  for (const auto& [lo, hi] : spans) {
    if (hi <= lo) continue;
    const double from = std::max(lo, reach);
    if (hi > from) {
      total += hi - from;
      reach = hi;
    }
  }
  return total;
}

// A transfer's end for drawing and sums: its end, or the step's end while it was still running.
double end_in(const TimelineTransfer& t, const TimelineStep& s) {
  return t.end >= 0 ? t.end : (s.end >= 0 ? s.end : t.start);
}

const char* channel_title(Channel c) {
  switch (c) {
    case Channel::kSsdWrite:
      return "SSD write";
    case Channel::kSsdRead:
      return "SSD read";
    case Channel::kHostWrite:
      return "host write";
    case Channel::kHostRead:
      return "host read";
  }
  return "?";
}

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

}  // namespace

const char* to_string(TransferKind k) {
  switch (k) {
    case TransferKind::kPlanned:
      return "planned";
    case TransferKind::kMiss:
      return "miss";
    case TransferKind::kEviction:
      return "eviction";
    case TransferKind::kActivation:
      return "activation";
  }
  return "?";
}

const char* to_string(StallKind k) {
  switch (k) {
    case StallKind::kRead:
      return "read";
    case StallKind::kBudget:
      return "budget";
    case StallKind::kDeadline:
      return "deadline";
  }
  return "?";
}

double TimeReport::stall_seconds() const {
  double s = write_stall_seconds;
  for (double r : read_stall_seconds) s += r;
  return s;
}

double TimeReport::accounted() const {
  if (step_seconds <= 0) return 0;
  return (compute_seconds + between_ops_seconds + stall_seconds()) / step_seconds;
}

Timeline::Timeline(Options options)
    : opt_(std::move(options)), t0_(opt_.clock ? opt_.clock() : steady_seconds()) {}

double Timeline::now() const { return (opt_.clock ? opt_.clock() : steady_seconds()) - t0_; }

TimelineStep* Timeline::current_locked() { return open_ ? &steps_.back() : nullptr; }

void Timeline::begin_step(std::int64_t step, const std::string& state, std::uint64_t budget,
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

void Timeline::label_step(const std::string& state, std::uint64_t budget, std::uint64_t wall) {
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

TimeReport Timeline::report(const ChannelRates& rates) const {
  std::vector<TimelineStep> all = steps();
  std::vector<const TimelineStep*> use;
  for (const auto& s : all) {
    if (s.end >= 0 && s.state == "executing") use.push_back(&s);
  }
  if (use.empty()) {
    for (const auto& s : all) {
      if (s.end >= 0) use.push_back(&s);
    }
  }
  TimeReport r;
  std::array<double, kNumChannels> busy{};
  double io_busy = 0;
  double checksum = 0;
  bool io_known = !use.empty();
  for (const TimelineStep* s : use) {
    ++r.steps;
    r.step_seconds += s->end - s->start;
    double in_ops = 0;
    std::vector<std::pair<double, double>> op_spans;  // by start (ops do not overlap)
    for (const auto& op : s->ops) {
      in_ops += std::max(0.0, op.end - op.start);
      if (op.end >= op.start) op_spans.emplace_back(op.start, op.end);
    }
    std::sort(op_spans.begin(), op_spans.end());
    // Whether a stall lies inside a recorded op: the last op starting at or before it.
    const auto inside_an_op = [&](const TimelineStall& st) {
      auto it = std::upper_bound(op_spans.begin(), op_spans.end(),
                                 std::make_pair(st.start, std::numeric_limits<double>::max()));
      if (it == op_spans.begin()) return false;
      --it;
      return st.end <= it->second + 1e-9;
    };
    double stalled_in_ops = 0;
    double stalled_between = 0;
    for (const auto& st : s->stalls) {
      const double d = std::max(0.0, st.end - st.start);
      (inside_an_op(st) ? stalled_in_ops : stalled_between) += d;
      if (st.kind == StallKind::kRead) {
        r.read_stall_seconds[index_of(st.channel)] += d;
      } else {
        r.write_stall_seconds += d;
      }
    }
    // Stalls happen inside ops (the residency guard, before_op), in tidal's own step-start work
    // (recorded as an op), or between recorded ops, where an op the tracer leaves out waited
    // (on a GPU, one on a CPU tensor: Adam's step counts). What is left of the ops' time is
    // compute, and of the time between them the loop's own.
    r.compute_seconds += std::max(0.0, in_ops - stalled_in_ops);
    r.between_ops_seconds += std::max(0.0, (s->end - s->start) - in_ops - stalled_between);
    std::array<std::vector<std::pair<double, double>>, kNumChannels> spans;
    for (const auto& t : s->transfers) {
      if (t.between_steps) continue;  // not the step's: code between steps read it back
      r.bytes[index_of(t.channel)] += t.failed ? 0 : t.bytes;
      if (t.kind == TransferKind::kMiss) r.misses += 1;
      if (t.kind == TransferKind::kEviction) r.evictions += 1;
      spans[index_of(t.channel)].emplace_back(t.start, end_in(t, *s));
    }
    for (std::size_t c = 0; c < kNumChannels; ++c) {
      busy[c] += covered(spans[c], s->start, s->end >= 0 ? s->end : s->start);
      r.planned_bytes[c] += s->planned_bytes[c];
    }
    r.planned_seconds += s->planned_seconds;
    r.planned_stall_seconds += s->planned_stall_seconds;
    if (s->io_busy_seconds < 0) io_known = false;
    io_busy += std::max(0.0, s->io_busy_seconds);
    checksum += std::max(0.0, s->checksum_seconds);
  }
  if (r.steps == 0) {
    r.limit = limit_sentence(r, busy, rates);
    return r;
  }
  // Bytes over busy time before the averages (both are sums over the steps).
  const auto n = static_cast<double>(r.steps);
  r.step_seconds /= n;
  r.compute_seconds /= n;
  r.between_ops_seconds /= n;
  for (auto& x : r.read_stall_seconds) x /= n;
  r.write_stall_seconds /= n;
  for (std::size_t c = 0; c < kNumChannels; ++c) {
    r.bytes[c] = static_cast<std::uint64_t>(static_cast<double>(r.bytes[c]) / n);
    r.planned_bytes[c] = static_cast<std::uint64_t>(static_cast<double>(r.planned_bytes[c]) / n);
    busy[c] /= n;
  }
  r.misses /= n;
  r.evictions /= n;
  r.planned_seconds /= n;
  r.planned_stall_seconds /= n;
  r.io_busy_seconds = io_known ? io_busy / n : -1;
  r.checksum_seconds = io_known ? checksum / n : -1;
  r.limit = limit_sentence(r, busy, rates);
  return r;
}

std::string format_report(const TimeReport& r) {
  if (r.steps == 0) return "where the time went: not measured (no executed step was kept)\n";
  std::ostringstream o;
  char line[256];
  const double step = r.step_seconds;
  const auto row = [&](const char* what, double s, const std::string& extra = "") {
    std::snprintf(line, sizeof line, "  %-26s %9.4f s  %5.1f%%%s\n", what, s,
                  step > 0 ? 100.0 * s / step : 0.0, extra.c_str());
    o << line;
  };
  std::snprintf(line, sizeof line, "where the time went (a step, mean of %d): %.4f s", r.steps,
                step);
  o << line;
  if (r.planned_seconds > 0) {
    std::snprintf(line, sizeof line, " (plan: %.4f s)", r.planned_seconds);
    o << line;
  }
  o << "\n";
  std::string planned_compute;
  if (r.planned_seconds > 0) {
    std::snprintf(line, sizeof line, "  (plan, ops and the time between them: %.4f s)",
                  r.planned_seconds - r.planned_stall_seconds);
    planned_compute = line;
  }
  row("compute (inside ops)", r.compute_seconds, planned_compute);
  row("outside ops (loop, data)", r.between_ops_seconds);
  for (Channel c : kChannels) {
    if (is_write(c)) continue;
    if (r.read_stall_seconds[index_of(c)] > 0 || r.bytes[index_of(c)] > 0) {
      row(c == Channel::kSsdRead ? "read stall, SSD" : "read stall, host memory",
          r.read_stall_seconds[index_of(c)]);
    }
  }
  row("write stall (budget)", r.write_stall_seconds);
  std::string planned;
  if (r.planned_seconds > 0) {
    std::snprintf(line, sizeof line, "  (plan: %.4f s)", r.planned_stall_seconds);
    planned = line;
  }
  row("stalls in all", r.stall_seconds(), planned);
  std::snprintf(line, sizeof line, "  parts add up to %.1f%% of the step\n", 100.0 * r.accounted());
  o << line;
  for (Channel c : kChannels) {
    const std::size_t k = index_of(c);
    if (r.bytes[k] == 0 && r.planned_bytes[k] == 0) continue;
    o << "  " << to_string(c) << ": " << format_bytes(static_cast<double>(r.bytes[k]))
      << " a step (plan: " << format_bytes(static_cast<double>(r.planned_bytes[k])) << ")\n";
  }
  if (r.misses > 0 || r.evictions > 0 || r.replans > 0) {
    std::snprintf(line, sizeof line,
                  "  misses %.1f, evictions %.1f a step; %d re-plan(s) in the run\n", r.misses,
                  r.evictions, r.replans);
    o << line;
  }
  if (r.io_busy_seconds >= 0) {
    std::snprintf(line, sizeof line,
                  "  beside the step: the store had I/O in flight %.4f s, its checksums took "
                  "%.4f s of CPU (copies and submissions not measured apart)\n",
                  r.io_busy_seconds, std::max(0.0, r.checksum_seconds));
    o << line;
  } else {
    o << "  beside the step: the store's busy and checksum time not measured\n";
  }
  o << "limit: " << r.limit << "\n";
  return o.str();
}

std::string time_report_json(const TimeReport& r) {
  json j;
  j["steps"] = r.steps;
  j["limit"] = r.limit;
  if (r.steps > 0) {
    const auto measured = [](double v) { return v >= 0 ? json(v) : json(nullptr); };
    j["step_seconds"] = r.step_seconds;
    j["compute_seconds"] = r.compute_seconds;
    j["between_ops_seconds"] = r.between_ops_seconds;
    j["write_stall_seconds"] = r.write_stall_seconds;
    j["stall_seconds"] = r.stall_seconds();
    j["accounted"] = r.accounted();
    for (Channel c : kChannels) {
      const std::string name = to_string(c);
      if (!is_write(c)) j["read_stall_seconds"][name] = r.read_stall_seconds[index_of(c)];
      j["bytes"][name] = r.bytes[index_of(c)];
      j["planned_bytes"][name] = r.planned_bytes[index_of(c)];
    }
    j["misses"] = r.misses;
    j["evictions"] = r.evictions;
    j["replans"] = r.replans;
    j["planned_seconds"] = r.planned_seconds > 0 ? json(r.planned_seconds) : json(nullptr);
    j["planned_stall_seconds"] =
        r.planned_seconds > 0 ? json(r.planned_stall_seconds) : json(nullptr);
    j["store_busy_seconds"] = measured(r.io_busy_seconds);
    j["checksum_seconds"] = measured(r.checksum_seconds);
  }
  return j.dump();
}

std::string Timeline::chrome_json() const {
  const std::vector<TimelineStep> all = steps();
  constexpr int kPid = 1;
  constexpr double kUs = 1e6;
  constexpr int kStepsTid = 1;
  constexpr int kOpsTid = 2;
  constexpr int kLanesPerChannel = 16;
  const auto lane_tid = [](Channel c, int lane) {
    return 10 + static_cast<int>(index_of(c)) * kLanesPerChannel + lane;
  };
  json events = json::array();
  const auto meta = [&](int tid, const std::string& name) {
    events.push_back(json{{"name", "thread_name"},
                          {"ph", "M"},
                          {"pid", kPid},
                          {"tid", tid},
                          {"args", {{"name", name}}}});
    events.push_back(json{{"name", "thread_sort_index"},
                          {"ph", "M"},
                          {"pid", kPid},
                          {"tid", tid},
                          {"args", {{"sort_index", tid}}}});
  };
  events.push_back(json{{"name", "process_name"},
                        {"ph", "M"},
                        {"pid", kPid},
                        {"args", {{"name", "tidal: measured steps"}}}});
  meta(kStepsTid, "steps");
  meta(kOpsTid, "ops (stalls nested)");
  std::array<int, kNumChannels> lanes_used{};
  for (const auto& s : all) {
    const double end = s.end >= 0 ? s.end : s.start;
    events.push_back(json{{"name", "step " + std::to_string(s.step) + " (" + s.state + ")"},
                          {"cat", "step"},
                          {"ph", "X"},
                          {"ts", s.start * kUs},
                          {"dur", (end - s.start) * kUs},
                          {"pid", kPid},
                          {"tid", kStepsTid},
                          {"args",
                           {{"step", s.step},
                            {"state", s.state},
                            {"peak_bytes", s.peak},
                            {"misses", s.misses},
                            {"budget_bytes", s.budget},
                            {"wall_bytes", s.wall},
                            {"planned_seconds", s.planned_seconds}}}});
    std::vector<double> op_start_by_index;
    for (const auto& op : s.ops) {
      const double oe = op.end >= 0 ? op.end : end;
      events.push_back(json{{"name", op.name},
                            {"cat", "op"},
                            {"ph", "X"},
                            {"ts", op.start * kUs},
                            {"dur", (oe - op.start) * kUs},
                            {"pid", kPid},
                            {"tid", kOpsTid},
                            {"args", {{"step", s.step}, {"index", op.index}}}});
      if (op.index >= 0) {
        const auto k = static_cast<std::size_t>(op.index);
        if (op_start_by_index.size() <= k) op_start_by_index.resize(k + 1, -1);
        op_start_by_index[k] = op.start;
      }
    }
    for (const auto& st : s.stalls) {
      std::string name = std::string("stall: ") + to_string(st.kind);
      if (!st.tensor.empty()) name += " " + st.tensor;
      events.push_back(json{{"name", name},
                            {"cat", "stall"},
                            {"ph", "X"},
                            {"ts", st.start * kUs},
                            {"dur", (st.end - st.start) * kUs},
                            {"pid", kPid},
                            {"tid", kOpsTid},
                            {"args",
                             {{"step", s.step},
                              {"kind", to_string(st.kind)},
                              {"channel", to_string(st.channel)},
                              {"op", st.op},
                              {"tensor", st.tensor}}}});
    }
    // Transfers: on their channel's lanes, a lane per transfer in flight at once.
    std::array<std::vector<double>, kNumChannels> lane_free{};
    std::vector<std::size_t> order(s.transfers.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return s.transfers[a].start < s.transfers[b].start;
    });
    for (std::size_t i : order) {
      const TimelineTransfer& t = s.transfers[i];
      // Drawn within its step: one still running at the step's end is cut there (how much
      // longer it ran is in its args); one started between steps is drawn at the step's end.
      const double true_end = end_in(t, s);
      const double ts = std::min(t.start, end);
      const double te = std::max(ts, std::min(true_end, end));
      auto& free_at = lane_free[index_of(t.channel)];
      std::size_t lane = 0;
      while (lane < free_at.size() && free_at[lane] > ts) ++lane;
      if (lane == free_at.size()) {
        if (free_at.size() < kLanesPerChannel) {
          free_at.push_back(0);
        } else {
          lane = free_at.size() - 1;
        }
      }
      free_at[lane] = te;
      auto& used = lanes_used[index_of(t.channel)];
      used = std::max(used, static_cast<int>(lane) + 1);
      json args{{"step", s.step},
                {"tensor", t.tensor},
                {"bytes", t.bytes},
                {"kind", to_string(t.kind)},
                {"channel", to_string(t.channel)},
                {"finished", t.end >= 0},
                {"failed", t.failed},
                {"start_ts_us", t.start * kUs},
                {"end_ts_us", true_end * kUs}};
      if (t.between_steps) args["between_steps"] = true;
      if (true_end > end) args["ran_past_step_end_ms"] = (true_end - end) * 1e3;
      const int tid = lane_tid(t.channel, static_cast<int>(lane));
      if (t.due_op >= 0) {
        args["due_op"] = t.due_op;
        const auto k = static_cast<std::size_t>(t.due_op);
        if (k < op_start_by_index.size() && op_start_by_index[k] >= 0) {
          const double due = op_start_by_index[k];
          args["due_ts_us"] = due * kUs;
          args["late_ms"] = std::max(0.0, true_end - due) * 1e3;
          events.push_back(json{{"name", "due: " + t.tensor},
                                {"cat", "deadline"},
                                {"ph", "i"},
                                {"s", "t"},
                                {"ts", due * kUs},
                                {"pid", kPid},
                                {"tid", tid},
                                {"args", {{"step", s.step}, {"op", t.due_op}}}});
        }
      }
      events.push_back(json{{"name", std::string(to_string(t.kind)) + " " + t.tensor},
                            {"cat", "transfer"},
                            {"ph", "X"},
                            {"ts", ts * kUs},
                            {"dur", (te - ts) * kUs},
                            {"pid", kPid},
                            {"tid", tid},
                            {"args", std::move(args)}});
    }
    for (const auto& [t, bytes] : s.memory) {
      events.push_back(json{{"name", "memory"},
                            {"ph", "C"},
                            {"ts", t * kUs},
                            {"pid", kPid},
                            {"args", {{"in_use", bytes}, {"budget", s.budget}, {"wall", s.wall}}}});
    }
    if (!s.planned_memory.empty()) {
      for (std::size_t k = 0; k < s.planned_memory.size() && k < op_start_by_index.size(); ++k) {
        if (op_start_by_index[k] < 0) continue;
        events.push_back(json{{"name", "planned memory"},
                              {"ph", "C"},
                              {"ts", op_start_by_index[k] * kUs},
                              {"pid", kPid},
                              {"args", {{"planned", s.planned_memory[k]}}}});
      }
    }
  }
  for (Channel c : kChannels) {
    for (int lane = 0; lane < lanes_used[index_of(c)]; ++lane) {
      std::string name = std::string("I/O ") + channel_title(c);
      if (lane > 0) name += " #" + std::to_string(lane + 1);
      meta(lane_tid(c, lane), name);
    }
  }
  const json parts = json::parse(time_report_json(report()));
  json doc{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  doc["otherData"] = json{{"format", "tidal timeline"}, {"where_the_time_went", parts}};
  return doc.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string Timeline::svg() const {
  const std::vector<TimelineStep> all = steps();
  const TimelineStep* s = nullptr;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->end >= 0) {
      s = &*it;
      break;
    }
  }
  std::ostringstream o;
  constexpr int kW = 1100;
  constexpr int kLeft = 90;
  constexpr int kRight = 20;
  constexpr int kTop = 50;
  constexpr int kMemH = 260;
  constexpr int kLaneH = 22;
  const int lanes = 5;  // stalls + four channels
  // The sentence, wrapped at word boundaries.
  std::string limit = report().limit;
  for (char& c : limit) {
    if (c == '<' || c == '>' || c == '&') c = ' ';
  }
  std::vector<std::string> lines;
  while (!limit.empty()) {
    std::size_t cut = limit.size();
    if (cut > 150) {
      cut = limit.rfind(' ', 150);
      if (cut == std::string::npos || cut == 0) cut = 150;
    }
    lines.push_back(limit.substr(0, cut));
    limit.erase(0, std::min(limit.size(), cut + 1));
  }
  const int h = kTop + kMemH + 40 + lanes * kLaneH + 58 + 16 * static_cast<int>(lines.size());
  o << R"(<svg xmlns="http://www.w3.org/2000/svg" width=")" << kW << R"(" height=")" << h
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  if (s == nullptr) {
    o << "<text x=\"20\" y=\"40\">no finished step was kept</text>\n</svg>\n";
    return o.str();
  }
  const double t0 = s->start;
  const double dur = std::max(s->end - s->start, 1e-9);
  const double pw = kW - kLeft - kRight;
  const auto x = [&](double t) { return kLeft + pw * std::clamp((t - t0) / dur, 0.0, 1.0); };
  std::uint64_t top = std::max({s->peak, s->budget, s->wall});
  for (const auto& m : s->memory) top = std::max(top, m.second);
  for (auto b : s->planned_memory) top = std::max(top, b);
  const double ymax = std::max(1.0, static_cast<double>(top) * 1.08);
  const auto y = [&](double bytes) { return kTop + kMemH * (1.0 - bytes / ymax); };
  char b[256];
  o << R"(<text x=")" << kLeft << R"(" y="20" font-size="15">step )" << s->step << " (" << s->state
    << "): memory against the budget, and the I/O under it</text>\n";
  // Axes and ticks.
  o << "<line x1=\"" << kLeft << "\" y1=\"" << kTop + kMemH << "\" x2=\"" << kW - kRight
    << "\" y2=\"" << kTop + kMemH << "\" stroke=\"#444\"/>\n"
    << "<line x1=\"" << kLeft << "\" y1=\"" << kTop << "\" x2=\"" << kLeft << "\" y2=\""
    << kTop + kMemH << "\" stroke=\"#444\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = ymax * i / 4;
    std::snprintf(b, sizeof b,
                  "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n"
                  "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#eee\"/>\n",
                  kLeft - 6, y(v) + 4, format_bytes(v).c_str(), kLeft, y(v), kW - kRight, y(v));
    o << b;
  }
  const int axis_y = kTop + kMemH + 40 + lanes * kLaneH + 18;
  for (int i = 0; i <= 5; ++i) {
    const double t = dur * i / 5;
    std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"%s\">%.3g s</text>\n",
                  x(t0 + t), axis_y, i == 5 ? "end" : "middle", t);
    o << b;
  }
  // Budget, planned and measured memory.
  // The budget's label at the left, the wall's at the right: they may lie close together.
  const auto level = [&](std::uint64_t bytes, const char* colour, bool right,
                         const std::string& label) {
    const double yy = y(static_cast<double>(bytes));
    std::snprintf(b, sizeof b,
                  "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\" "
                  "stroke-dasharray=\"6,4\"/>\n<text x=\"%d\" y=\"%.1f\" fill=\"%s\" "
                  "text-anchor=\"%s\">",
                  kLeft, yy, kW - kRight, yy, colour, right ? kW - kRight - 4 : kLeft + 4, yy - 4,
                  colour, right ? "end" : "start");
    o << b << label << "</text>\n";
  };
  if (s->budget > 0) {
    level(s->budget, "#c00", false, "budget " + format_bytes(static_cast<double>(s->budget)));
  }
  if (s->wall > 0 && s->wall != s->budget) {
    level(s->wall, "#a0a", true,
          "wall " + format_bytes(static_cast<double>(s->wall)) +
              " (no plan meets the budget: the least a plan reaches)");
  }
  std::vector<std::pair<double, std::uint64_t>> planned;
  for (const auto& op : s->ops) {
    if (op.index >= 0 && static_cast<std::size_t>(op.index) < s->planned_memory.size()) {
      planned.emplace_back(op.start, s->planned_memory[static_cast<std::size_t>(op.index)]);
    }
  }
  const auto steps_path = [&](const std::vector<std::pair<double, std::uint64_t>>& pts,
                              const char* colour, const char* extra) {
    if (pts.empty()) return;
    o << R"(<polyline fill="none" stroke=")" << colour << R"(" stroke-width="1.5" )" << extra
      << " points=\"";
    // A step line, at most one vertical stroke per pixel column (from the value it came in
    // with, through the column's least and most, to the value it leaves with): thousands of
    // ops draw as they look, in a file of a few hundred kB at most.
    double last_y = y(static_cast<double>(pts.front().second));
    std::size_t i = 0;
    while (i < pts.size()) {
      const long column = std::lround(x(pts[i].first));
      double lo = last_y;
      double hi = last_y;
      const double enter = last_y;
      for (; i < pts.size() && std::lround(x(pts[i].first)) == column; ++i) {
        last_y = y(static_cast<double>(pts[i].second));
        lo = std::min(lo, last_y);
        hi = std::max(hi, last_y);
      }
      std::snprintf(b, sizeof b, "%ld,%.1f %ld,%.1f %ld,%.1f %ld,%.1f ", column, enter, column, lo,
                    column, hi, column, last_y);
      o << b;
    }
    std::snprintf(b, sizeof b, "%.1f,%.1f", x(s->end), last_y);
    o << b << "\"/>\n";
  };
  steps_path(planned, "#999", "stroke-dasharray=\"3,3\"");
  steps_path(s->memory, "#1f5fbf", "");
  // Lanes.
  const int lane0 = kTop + kMemH + 30;
  const char* lane_names[] = {"stalls", "SSD write", "SSD read", "host write", "host read"};
  for (int i = 0; i < lanes; ++i) {
    const int ly = lane0 + i * kLaneH;
    std::snprintf(b, sizeof b,
                  "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s</text>\n"
                  "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"#f6f6f6\"/>\n",
                  kLeft - 6, ly + 15, lane_names[i], kLeft, ly + 2, pw, kLaneH - 4);
    o << b;
  }
  for (const auto& st : s->stalls) {
    std::snprintf(b, sizeof b,
                  "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"><title>stall "
                  "(%s) %.4f s</title></rect>\n",
                  x(st.start), lane0 + 2, std::max(1.0, x(st.end) - x(st.start)), kLaneH - 4,
                  st.kind == StallKind::kRead ? "#d62728" : "#ff7f0e", to_string(st.kind),
                  st.end - st.start);
    o << b;
  }
  for (const auto& t : s->transfers) {
    const int lane = 1 + static_cast<int>(index_of(t.channel));
    const char* colour = t.kind == TransferKind::kMiss       ? "#d62728"
                         : t.kind == TransferKind::kEviction ? "#ff7f0e"
                         : is_write(t.channel)               ? "#2ca02c"
                                                             : "#1f77b4";
    std::snprintf(b, sizeof b,
                  "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\" "
                  "fill-opacity=\"0.45\"><title>%s %s</title></rect>\n",
                  x(t.start), lane0 + lane * kLaneH + 2,
                  std::max(1.0, x(end_in(t, *s)) - x(t.start)), kLaneH - 4, colour,
                  to_string(t.kind), format_bytes(static_cast<double>(t.bytes)).c_str());
    o << b;
  }
  // Legend and the sentence.
  const int ly = axis_y + 22;
  o << "<text x=\"" << kLeft << "\" y=\"" << ly
    << "\"><tspan fill=\"#1f5fbf\">measured memory</tspan>  <tspan fill=\"#999\">planned "
       "memory</tspan>  <tspan fill=\"#c00\">budget</tspan>  <tspan fill=\"#2ca02c\">write</tspan>"
       "  <tspan fill=\"#1f77b4\">read</tspan>  <tspan fill=\"#d62728\">miss / read stall</tspan>"
       "  <tspan fill=\"#ff7f0e\">eviction / write stall</tspan></text>\n";
  for (std::size_t i = 0; i < lines.size(); ++i) {
    o << "<text x=\"" << kLeft << "\" y=\"" << ly + 18 + 16 * static_cast<int>(i)
      << R"(" font-size="12">)" << (i == 0 ? "limit: " : "") << lines[i] << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
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
