// The timeline as an SVG: memory over the last finished step against the budget, measured and
// planned, with the stalls and the I/O lanes under it and the limit sentence.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "plan/timeline/timeline_impl.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/timeline.hpp"

namespace tidal::plan {

using detail::end_in;

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

}  // namespace tidal::plan
