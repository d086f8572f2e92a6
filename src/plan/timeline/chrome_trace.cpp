// The timeline as a Chrome trace (JSON object format): steps, ops with their stalls, and each
// channel's transfers on lanes, a lane per transfer in flight at once.
#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "plan/timeline/timeline_impl.hpp"
#include "tidal/plan/timeline.hpp"

namespace tidal::plan {

using json = nlohmann::json;
using detail::end_in;

namespace {

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

}  // namespace

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

}  // namespace tidal::plan
