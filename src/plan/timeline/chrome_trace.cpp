// The timeline as a Chrome trace (JSON object format): steps, ops with their stalls, and each
// channel's transfers on lanes, a lane per transfer in flight at once.
#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "plan/timeline/timeline_impl.hpp"
#include "tidal/common/enum_names.hpp"
#include "tidal/plan/timeline.hpp"

namespace tidal::plan {

using json = nlohmann::json;
using detail::end_in;

namespace {

// A channel's name in the lanes' titles.
constexpr EnumName<Channel> kChannelTitles[] = {{Channel::kSsdWrite, "SSD write"},
                                                {Channel::kSsdRead, "SSD read"},
                                                {Channel::kHostWrite, "host write"},
                                                {Channel::kHostRead, "host read"}};

constexpr int kPid = 1;
constexpr double kUs = 1e6;
constexpr int kStepsTid = 1;
constexpr int kOpsTid = 2;
constexpr int kLanesPerChannel = 16;

int lane_tid(Channel c, int lane) {
  return 10 + static_cast<int>(index_of(c)) * kLanesPerChannel + lane;
}

// The trace's events as the steps are added: the process and its threads (steps, ops, a thread
// per channel lane) named, each step's slices and counters.
class ChromeTrace {
 public:
  ChromeTrace() {
    events_.push_back(json{{"name", "process_name"},
                           {"ph", "M"},
                           {"pid", kPid},
                           {"args", {{"name", "tidal: measured steps"}}}});
    meta(kStepsTid, "steps");
    meta(kOpsTid, "ops (stalls nested)");
  }

  void add_step(const TimelineStep& s) {
    const double end = s.end >= 0 ? s.end : s.start;
    add_step_slice(s, end);
    const std::vector<double> op_start_by_index = add_ops(s, end);
    add_stalls(s);
    add_transfers(s, end, op_start_by_index);
    add_memory(s, op_start_by_index);
  }

  // The document: the events, the lanes' names, and `report_json` (time_report_json) beside.
  std::string finish(const std::string& report_json) {
    for (Channel c : kChannels) {
      for (int lane = 0; lane < lanes_used_[index_of(c)]; ++lane) {
        std::string name = std::string("I/O ") + enum_name(kChannelTitles, c);
        if (lane > 0) name += " #" + std::to_string(lane + 1);
        meta(lane_tid(c, lane), name);
      }
    }
    const json parts = json::parse(report_json);
    json doc{{"traceEvents", std::move(events_)}, {"displayTimeUnit", "ms"}};
    doc["otherData"] = json{{"format", "tidal timeline"}, {"where_the_time_went", parts}};
    return doc.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  }

 private:
  // A complete event: a slice of thread tid from `start` for `seconds`.
  void add_slice(const std::string& name, const char* cat, double start, double seconds, int tid,
                 json args) {
    events_.push_back(json{{"name", name},
                           {"cat", cat},
                           {"ph", "X"},
                           {"ts", start * kUs},
                           {"dur", seconds * kUs},
                           {"pid", kPid},
                           {"tid", tid},
                           {"args", std::move(args)}});
  }

  void meta(int tid, const std::string& name) {
    events_.push_back(json{{"name", "thread_name"},
                           {"ph", "M"},
                           {"pid", kPid},
                           {"tid", tid},
                           {"args", {{"name", name}}}});
    events_.push_back(json{{"name", "thread_sort_index"},
                           {"ph", "M"},
                           {"pid", kPid},
                           {"tid", tid},
                           {"args", {{"sort_index", tid}}}});
  }

  void add_step_slice(const TimelineStep& s, double end) {
    add_slice("step " + std::to_string(s.step) + " (" + to_string(s.state) + ")", "step", s.start,
              end - s.start, kStepsTid,
              {{"step", s.step},
               {"state", to_string(s.state)},
               {"peak_bytes", s.peak},
               {"misses", s.misses},
               {"budget_bytes", s.budget},
               {"wall_bytes", s.wall},
               {"planned_seconds", s.planned_seconds}});
  }

  // Returns each op index's start (-1: the op did not run), for deadlines and planned memory.
  std::vector<double> add_ops(const TimelineStep& s, double end) {
    std::vector<double> op_start_by_index;
    for (const auto& op : s.ops) {
      const double oe = op.end >= 0 ? op.end : end;
      add_slice(op.name, "op", op.start, oe - op.start, kOpsTid,
                {{"step", s.step}, {"index", op.index}});
      if (op.index >= 0) {
        const auto k = static_cast<std::size_t>(op.index);
        if (op_start_by_index.size() <= k) op_start_by_index.resize(k + 1, -1);
        op_start_by_index[k] = op.start;
      }
    }
    return op_start_by_index;
  }

  void add_stalls(const TimelineStep& s) {
    for (const auto& st : s.stalls) {
      std::string name = std::string("stall: ") + to_string(st.kind);
      if (!st.tensor.empty()) name += " " + st.tensor;
      add_slice(name, "stall", st.start, st.end - st.start, kOpsTid,
                {{"step", s.step},
                 {"kind", to_string(st.kind)},
                 {"channel", to_string(st.channel)},
                 {"op", st.op},
                 {"tensor", st.tensor}});
    }
  }

  // Transfers: on their channel's lanes, a lane per transfer in flight at once.
  void add_transfers(const TimelineStep& s, double end,
                     const std::vector<double>& op_start_by_index) {
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
      const double ts = std::min(t.start, end);
      const double te = std::max(ts, std::min(end_in(t, s), end));
      const int lane = take_lane(lane_free[index_of(t.channel)], ts, te);
      auto& used = lanes_used_[index_of(t.channel)];
      used = std::max(used, lane + 1);
      add_transfer(s, t, end, ts, te, lane_tid(t.channel, lane), op_start_by_index);
    }
  }

  // The first of a channel's lanes (`free_at`: when each is free) free at ts, a new one while
  // there are fewer than kLanesPerChannel, else the last; it is taken until te.
  static int take_lane(std::vector<double>& free_at, double ts, double te) {
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
    return static_cast<int>(lane);
  }

  // The transfer's slice [ts, te) on thread tid, and its deadline's mark when the op it was due
  // before ran.
  void add_transfer(const TimelineStep& s, const TimelineTransfer& t, double end, double ts,
                    double te, int tid, const std::vector<double>& op_start_by_index) {
    const double true_end = end_in(t, s);
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
    if (t.due_op >= 0) {
      args["due_op"] = t.due_op;
      const auto k = static_cast<std::size_t>(t.due_op);
      if (k < op_start_by_index.size() && op_start_by_index[k] >= 0) {
        const double due = op_start_by_index[k];
        args["due_ts_us"] = due * kUs;
        args["late_ms"] = std::max(0.0, true_end - due) * 1e3;
        events_.push_back(json{{"name", "due: " + t.tensor},
                               {"cat", "deadline"},
                               {"ph", "i"},
                               {"s", "t"},
                               {"ts", due * kUs},
                               {"pid", kPid},
                               {"tid", tid},
                               {"args", {{"step", s.step}, {"op", t.due_op}}}});
      }
    }
    add_slice(std::string(to_string(t.kind)) + " " + t.tensor, "transfer", ts, te - ts, tid,
              std::move(args));
  }

  // Counters: the memory in use (with the budget and wall), and the plan's at each op's start.
  void add_memory(const TimelineStep& s, const std::vector<double>& op_start_by_index) {
    for (const auto& [t, bytes] : s.memory) {
      events_.push_back(
          json{{"name", "memory"},
               {"ph", "C"},
               {"ts", t * kUs},
               {"pid", kPid},
               {"args", {{"in_use", bytes}, {"budget", s.budget}, {"wall", s.wall}}}});
    }
    if (!s.planned_memory.empty()) {
      for (std::size_t k = 0; k < s.planned_memory.size() && k < op_start_by_index.size(); ++k) {
        if (op_start_by_index[k] < 0) continue;
        events_.push_back(json{{"name", "planned memory"},
                               {"ph", "C"},
                               {"ts", op_start_by_index[k] * kUs},
                               {"pid", kPid},
                               {"args", {{"planned", s.planned_memory[k]}}}});
      }
    }
  }

  json events_ = json::array();
  std::array<int, kNumChannels> lanes_used_{};
};

}  // namespace

std::string Timeline::chrome_json() const {
  const std::vector<TimelineStep> all = steps();
  ChromeTrace trace;
  for (const auto& s : all) trace.add_step(s);
  return trace.finish(time_report_json(report()));
}

}  // namespace tidal::plan
