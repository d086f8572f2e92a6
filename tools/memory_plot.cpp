#include "memory_plot.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace tidal::cli {

std::string svg_plot(const std::vector<plan::PolicyResult>& results, std::uint64_t capacity,
                     const std::string& title) {
  const double w = 960;
  const double h = 480;
  const double left = 70;
  const double right = 170;
  const double top = 40;
  const double bottom = 50;
  double ymax = static_cast<double>(capacity);
  for (const auto& r : results) ymax = std::max(ymax, static_cast<double>(r.sim.peak_bytes));
  ymax *= 1.05;
  const double gb = 1e9;
  auto X = [&](double f) { return left + f * (w - left - right); };
  auto Y = [&](double b) { return top + (1 - b / ymax) * (h - top - bottom); };
  static const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                  "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << h
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << left << "\" y=\"24\" font-size=\"15\">" << title << "</text>\n";
  for (int i = 0; i <= 5; ++i) {
    const double b = ymax * i / 5;
    s << "<line x1=\"" << left << "\" x2=\"" << X(1) << "\" y1=\"" << Y(b) << "\" y2=\"" << Y(b)
      << "\" stroke=\"#ddd\"/>\n<text x=\"" << left - 6 << "\" y=\"" << Y(b) + 4
      << "\" text-anchor=\"end\">" << std::lround(b / gb) << "</text>\n";
  }
  s << "<text x=\"14\" y=\"" << (top + h - bottom) / 2 << "\" transform=\"rotate(-90 14 "
    << (top + h - bottom) / 2 << ")\" text-anchor=\"middle\">device memory (GB)</text>\n"
    << "<text x=\"" << X(0.5) << "\" y=\"" << h - 12
    << "\" text-anchor=\"middle\">position in the iteration (op index / ops)</text>\n";
  s << "<line x1=\"" << left << "\" x2=\"" << X(1) << "\" y1=\"" << Y(static_cast<double>(capacity))
    << "\" y2=\"" << Y(static_cast<double>(capacity))
    << "\" stroke=\"black\" stroke-dasharray=\"6 4\"/>\n<text x=\"" << X(1) + 6 << "\" y=\""
    << Y(static_cast<double>(capacity)) + 4 << "\">capacity</text>\n";
  int idx = 0;
  for (const auto& r : results) {
    const auto& m = r.sim.memory_per_op;
    if (m.empty()) continue;
    const char* color = kColors[idx % 8];
    // At most 1500 points: the maximum of each bucket, so peaks stay visible.
    const std::size_t points = std::min<std::size_t>(m.size(), 1500);
    s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
    for (std::size_t p = 0; p < points; ++p) {
      const std::size_t lo = p * m.size() / points;
      const std::size_t hi = std::max(lo + 1, (p + 1) * m.size() / points);
      std::uint64_t v = 0;
      for (std::size_t k = lo; k < hi; ++k) v = std::max(v, m[k]);
      s << X(static_cast<double>(lo) / static_cast<double>(m.size())) << ","
        << Y(static_cast<double>(v)) << " ";
    }
    s << "\"/>\n<text x=\"" << X(1) + 6 << "\" y=\"" << top + 16 * (idx + 2) << "\" fill=\""
      << color << "\">" << plan::to_string(r.policy) << "</text>\n";
    ++idx;
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace tidal::cli
