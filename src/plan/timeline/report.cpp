// Where the time went: the kept steps summed into a TimeReport, as text and as JSON.
#include <algorithm>
#include <array>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "plan/timeline/timeline_impl.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/timeline.hpp"

namespace tidal::plan {

using json = nlohmann::json;
using detail::end_in;
using detail::limit_sentence;

namespace {

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

// The kept steps the report covers: the finished ones in state "executing", else every finished
// one.
std::vector<const TimelineStep*> measured_steps(const std::vector<TimelineStep>& all) {
  std::vector<const TimelineStep*> use;
  for (const auto& s : all) {
    if (s.end >= 0 && s.state == StepState::kExecuting) use.push_back(&s);
  }
  if (use.empty()) {
    for (const auto& s : all) {
      if (s.end >= 0) use.push_back(&s);
    }
  }
  return use;
}

// Adds the step's compute, time between ops and stalls (by channel for reads) to r's sums.
void add_times(TimeReport& r, const TimelineStep& s) {
  double in_ops = 0;
  std::vector<std::pair<double, double>> op_spans;  // by start (ops do not overlap)
  for (const auto& op : s.ops) {
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
  for (const auto& st : s.stalls) {
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
  r.between_ops_seconds += std::max(0.0, (s.end - s.start) - in_ops - stalled_between);
}

// Adds the step's transfers to r's sums (bytes, misses, evictions, planned bytes by channel) and
// to `busy`, the seconds each channel had a transfer in flight.
void add_transfers(TimeReport& r, std::array<double, kNumChannels>& busy, const TimelineStep& s) {
  std::array<std::vector<std::pair<double, double>>, kNumChannels> spans;
  for (const auto& t : s.transfers) {
    if (t.between_steps) continue;  // not the step's: code between steps read it back
    r.bytes[index_of(t.channel)] += t.failed ? 0 : t.bytes;
    if (t.kind == TransferKind::kMiss) r.misses += 1;
    if (t.kind == TransferKind::kEviction) r.evictions += 1;
    spans[index_of(t.channel)].emplace_back(t.start, end_in(t, s));
  }
  for (std::size_t c = 0; c < kNumChannels; ++c) {
    busy[c] += covered(spans[c], s.start, s.end >= 0 ? s.end : s.start);
    r.planned_bytes[c] += s.planned_bytes[c];
  }
}

// Turns r's sums over n steps (and busy's) into means per step; the store's figures are left to
// the caller.
void average(TimeReport& r, std::array<double, kNumChannels>& busy, double n) {
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
}

}  // namespace

double TimeReport::stall_seconds() const {
  double s = write_stall_seconds;
  for (double r : read_stall_seconds) s += r;
  return s;
}

double TimeReport::accounted() const {
  if (step_seconds <= 0) return 0;
  return (compute_seconds + between_ops_seconds + stall_seconds()) / step_seconds;
}

TimeReport Timeline::report(const ChannelRates& rates) const {
  std::vector<TimelineStep> all = steps();
  const std::vector<const TimelineStep*> use = measured_steps(all);
  TimeReport r;
  std::array<double, kNumChannels> busy{};
  double io_busy = 0;
  double checksum = 0;
  bool io_known = !use.empty();
  for (const TimelineStep* s : use) {
    ++r.steps;
    r.step_seconds += s->end - s->start;
    add_times(r, *s);
    add_transfers(r, busy, *s);
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
  average(r, busy, n);
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

}  // namespace tidal::plan
