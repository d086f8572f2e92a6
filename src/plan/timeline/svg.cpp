// The timeline as an SVG: memory over the last finished step against the budget, measured and
// planned, with the stalls and the I/O lanes under it and the limit sentence.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "plan/timeline/timeline_impl.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/timeline.hpp"

namespace tidal::plan {

using detail::end_in;

namespace {

// The picture, in pixels: its width, and the plot's margins left (for the axis' labels) and right;
// the plot's width; the memory plot's top and height, an I/O lane's height, and the lanes (the
// stalls' and four channels').
constexpr int kW = 1100;
constexpr int kLeft = 90;
constexpr int kRight = 20;
constexpr double kPlotW = kW - kLeft - kRight;
constexpr int kTop = 50;
constexpr int kMemH = 260;
constexpr int kLaneH = 22;
constexpr int kLanes = 5;
constexpr int kLane0 = kTop + kMemH + 30;                         // the first lane's top
constexpr int kAxisY = kTop + kMemH + 40 + kLanes * kLaneH + 18;  // the time axis' labels

// The last kept step that finished; null when none did.
const TimelineStep* last_finished(const std::vector<TimelineStep>& all) {
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->end >= 0) return &*it;
  }
  return nullptr;
}

// The sentence, wrapped at word boundaries (lines of at most 150 characters), with the
// characters that SVG text cannot hold as they are blanked.
std::vector<std::string> wrap_limit(std::string limit) {
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
  return lines;
}

// Draws one finished step into o: memory against the budget, the lanes, the legend.
class StepPicture {
 public:
  StepPicture(const TimelineStep& s, std::ostringstream& o)
      : s_(s), o_(o), t0_(s.start), dur_(std::max(s.end - s.start, 1e-9)) {
    std::uint64_t top = std::max({s.peak, s.budget, s.wall});
    for (const auto& m : s.memory) top = std::max(top, m.second);
    for (auto b : s.planned_memory) top = std::max(top, b);
    ymax_ = std::max(1.0, static_cast<double>(top) * 1.08);
  }

  // The title, the axes and their ticks.
  void axes() {
    char b[256];
    o_ << R"(<text x=")" << kLeft << R"(" y="20" font-size="15">step )" << s_.step << " ("
       << to_string(s_.state) << "): memory against the budget, and the I/O under it</text>\n";
    o_ << "<line x1=\"" << kLeft << "\" y1=\"" << kTop + kMemH << "\" x2=\"" << kW - kRight
       << "\" y2=\"" << kTop + kMemH << "\" stroke=\"#444\"/>\n"
       << "<line x1=\"" << kLeft << "\" y1=\"" << kTop << "\" x2=\"" << kLeft << "\" y2=\""
       << kTop + kMemH << "\" stroke=\"#444\"/>\n";
    for (int i = 0; i <= 4; ++i) {
      const double v = ymax_ * i / 4;
      std::snprintf(b, sizeof b,
                    "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n"
                    "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#eee\"/>\n",
                    kLeft - 6, y(v) + 4, format_bytes(v).c_str(), kLeft, y(v), kW - kRight, y(v));
      o_ << b;
    }
    for (int i = 0; i <= 5; ++i) {
      const double t = dur_ * i / 5;
      std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"%s\">%.3g s</text>\n",
                    x(t0_ + t), kAxisY, i == 5 ? "end" : "middle", t);
      o_ << b;
    }
  }

  // Budget, planned and measured memory.
  void memory() {
    // The budget's label at the left, the wall's at the right: they may lie close together.
    if (s_.budget > 0) {
      level(s_.budget, "#c00", false, "budget " + format_bytes(static_cast<double>(s_.budget)));
    }
    if (s_.wall > 0 && s_.wall != s_.budget) {
      level(s_.wall, "#a0a", true,
            "wall " + format_bytes(static_cast<double>(s_.wall)) +
                " (no plan meets the budget: the least a plan reaches)");
    }
    std::vector<std::pair<double, std::uint64_t>> planned;
    for (const auto& op : s_.ops) {
      if (op.index >= 0 && static_cast<std::size_t>(op.index) < s_.planned_memory.size()) {
        planned.emplace_back(op.start, s_.planned_memory[static_cast<std::size_t>(op.index)]);
      }
    }
    step_line(planned, "#999", "stroke-dasharray=\"3,3\"");
    step_line(s_.memory, "#1f5fbf", "");
  }

  // The lanes: the stalls', then each channel's transfers.
  void lanes() {
    char b[256];
    const char* lane_names[] = {"stalls", "SSD write", "SSD read", "host write", "host read"};
    for (int i = 0; i < kLanes; ++i) {
      const int ly = kLane0 + i * kLaneH;
      std::snprintf(b, sizeof b,
                    "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s</text>\n"
                    "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"#f6f6f6\"/>\n",
                    kLeft - 6, ly + 15, lane_names[i], kLeft, ly + 2, kPlotW, kLaneH - 4);
      o_ << b;
    }
    for (const auto& st : s_.stalls) {
      std::snprintf(
          b, sizeof b,
          "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"><title>stall "
          "(%s) %.4f s</title></rect>\n",
          x(st.start), kLane0 + 2, std::max(1.0, x(st.end) - x(st.start)), kLaneH - 4,
          st.kind == StallKind::kRead ? "#d62728" : "#ff7f0e", to_string(st.kind),
          st.end - st.start);
      o_ << b;
    }
    for (const auto& t : s_.transfers) transfer(t);
  }

  // The legend and the sentence's lines.
  void legend(const std::vector<std::string>& lines) {
    const int ly = kAxisY + 22;
    o_ << "<text x=\"" << kLeft << "\" y=\"" << ly
       << "\"><tspan fill=\"#1f5fbf\">measured memory</tspan>  <tspan fill=\"#999\">planned "
          "memory</tspan>  <tspan fill=\"#c00\">budget</tspan>  <tspan "
          "fill=\"#2ca02c\">write</tspan>"
          "  <tspan fill=\"#1f77b4\">read</tspan>  <tspan fill=\"#d62728\">miss / read "
          "stall</tspan>"
          "  <tspan fill=\"#ff7f0e\">eviction / write stall</tspan></text>\n";
    for (std::size_t i = 0; i < lines.size(); ++i) {
      o_ << "<text x=\"" << kLeft << "\" y=\"" << ly + 18 + 16 * static_cast<int>(i)
         << R"(" font-size="12">)" << (i == 0 ? "limit: " : "") << lines[i] << "</text>\n";
    }
  }

 private:
  [[nodiscard]] double x(double t) const {
    return kLeft + kPlotW * std::clamp((t - t0_) / dur_, 0.0, 1.0);
  }
  [[nodiscard]] double y(double bytes) const { return kTop + kMemH * (1.0 - bytes / ymax_); }

  // A dashed level across the plot, labelled at the left or the right.
  void level(std::uint64_t bytes, const char* colour, bool right, const std::string& label) {
    char b[256];
    const double yy = y(static_cast<double>(bytes));
    std::snprintf(b, sizeof b,
                  "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\" "
                  "stroke-dasharray=\"6,4\"/>\n<text x=\"%d\" y=\"%.1f\" fill=\"%s\" "
                  "text-anchor=\"%s\">",
                  kLeft, yy, kW - kRight, yy, colour, right ? kW - kRight - 4 : kLeft + 4, yy - 4,
                  colour, right ? "end" : "start");
    o_ << b << label << "</text>\n";
  }

  // A step line through (time, bytes) points, to the step's end.
  void step_line(const std::vector<std::pair<double, std::uint64_t>>& pts, const char* colour,
                 const char* extra) {
    if (pts.empty()) return;
    char b[256];
    o_ << R"(<polyline fill="none" stroke=")" << colour << R"(" stroke-width="1.5" )" << extra
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
      o_ << b;
    }
    std::snprintf(b, sizeof b, "%.1f,%.1f", x(s_.end), last_y);
    o_ << b << "\"/>\n";
  }

  // A transfer on its channel's lane, coloured by why it ran.
  void transfer(const TimelineTransfer& t) {
    char b[256];
    const int lane = 1 + static_cast<int>(index_of(t.channel));
    const char* colour = t.kind == TransferKind::kMiss       ? "#d62728"
                         : t.kind == TransferKind::kEviction ? "#ff7f0e"
                         : is_write(t.channel)               ? "#2ca02c"
                                                             : "#1f77b4";
    std::snprintf(b, sizeof b,
                  "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\" "
                  "fill-opacity=\"0.45\"><title>%s %s</title></rect>\n",
                  x(t.start), kLane0 + lane * kLaneH + 2,
                  std::max(1.0, x(end_in(t, s_)) - x(t.start)), kLaneH - 4, colour,
                  to_string(t.kind), format_bytes(static_cast<double>(t.bytes)).c_str());
    o_ << b;
  }

  const TimelineStep& s_;
  std::ostringstream& o_;
  double t0_;
  double dur_;
  double ymax_ = 1;
};

}  // namespace

std::string Timeline::svg() const {
  const std::vector<TimelineStep> all = steps();
  const TimelineStep* s = last_finished(all);
  std::ostringstream o;
  const std::vector<std::string> lines = wrap_limit(report().limit);
  const int h = kTop + kMemH + 40 + kLanes * kLaneH + 58 + 16 * static_cast<int>(lines.size());
  o << R"(<svg xmlns="http://www.w3.org/2000/svg" width=")" << kW << R"(" height=")" << h
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  if (s == nullptr) {
    o << "<text x=\"20\" y=\"40\">no finished step was kept</text>\n</svg>\n";
    return o.str();
  }
  StepPicture picture(*s, o);
  picture.axes();
  picture.memory();
  picture.lanes();
  picture.legend(lines);
  o << "</svg>\n";
  return o.str();
}

}  // namespace tidal::plan
