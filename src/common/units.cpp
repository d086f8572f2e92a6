#include "tidal/common/units.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

#include "tidal/common/error.hpp"

namespace tidal {
namespace {

std::string lower_trimmed(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (std::isspace(static_cast<unsigned char>(c)) == 0) {
      out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    }
  }
  return out;
}

// Splits "6.5gb" into 6.5 and "gb"; throws when no number leads.
double split_number(const std::string& s, std::string* unit, std::string_view original,
                    const char* what) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TIDAL_EXPECT_AS(InvalidArgument, used > 0 && std::isfinite(value) && value >= 0, "'", original,
                  "' is not a valid ", what);
  *unit = s.substr(used);
  return value;
}

double byte_multiplier(const std::string& unit, std::string_view original) {
  struct Unit {
    const char* name;
    double factor;
  };
  static const Unit kUnits[] = {{"", 1},
                                {"b", 1},
                                {"k", 1024.0},
                                {"kib", 1024.0},
                                {"kb", 1e3},
                                {"m", 1048576.0},
                                {"mib", 1048576.0},
                                {"mb", 1e6},
                                {"g", 1073741824.0},
                                {"gib", 1073741824.0},
                                {"gb", 1e9},
                                {"t", 1099511627776.0},
                                {"tib", 1099511627776.0},
                                {"tb", 1e12}};
  for (const auto& u : kUnits) {
    if (unit == u.name) return u.factor;
  }
  TIDAL_EXPECT_AS(InvalidArgument, false, "'", original, "': unknown size unit '", unit,
                  "'; use B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)");
  return 0;
}

}  // namespace

std::uint64_t parse_bytes(std::string_view text) {
  std::string unit;
  const double value = split_number(lower_trimmed(text), &unit, text, "size (try 64MiB or 2GB)");
  const double bytes = value * byte_multiplier(unit, text);
  // 1 EiB: more than any memory or disk array, and far enough below 2^63 that sums and signed
  // differences of sizes downstream cannot overflow (llround of 1e19 wrapped to 2^63).
  constexpr double kMaxBytes = 1152921504606846976.0;  // 2^60
  TIDAL_EXPECT_AS(InvalidArgument, bytes <= kMaxBytes, "'", text,
                  "' is too large: a size is at most 1 EiB (1048576TiB)");
  return static_cast<std::uint64_t>(std::llround(bytes));
}

double parse_bandwidth(std::string_view text) {
  std::string s = lower_trimmed(text);
  if (s.size() > 2 && s.compare(s.size() - 2, 2, "/s") == 0) s.resize(s.size() - 2);
  if (s.size() > 2 && s.compare(s.size() - 2, 2, "ps") == 0) s.resize(s.size() - 2);
  std::string unit;
  const double value = split_number(s, &unit, text, "bandwidth (try 6.5GB/s)");
  return value * byte_multiplier(unit, text);
}

double parse_rate(std::string_view text) {
  std::string unit;
  const double value =
      split_number(lower_trimmed(text), &unit, text, "rate (examples: 60T, 60TFLOPS, 2e9)");
  for (std::string_view suffix : {"flop/s", "flops", "/s"}) {
    if (unit.size() >= suffix.size() &&
        unit.compare(unit.size() - suffix.size(), suffix.size(), suffix) == 0) {
      unit.erase(unit.size() - suffix.size());
      break;
    }
  }
  const std::string_view prefixes = "kmgtp";
  if (unit.empty()) return value;
  const auto at = prefixes.find(unit);
  TIDAL_EXPECT_AS(InvalidArgument, unit.size() == 1 && at != std::string_view::npos, "'", text,
                  "' has an unknown unit; use k, M, G, T or P (e.g. 60T)");
  constexpr double kScale[] = {1e3, 1e6, 1e9, 1e12, 1e15};
  return value * kScale[at];
}

double parse_seconds(std::string_view text) {
  std::string unit;
  const double value = split_number(lower_trimmed(text), &unit, text, "duration (try 1.5ms)");
  if (unit.empty() || unit == "s" || unit == "sec") return value;
  if (unit == "ms") return value * 1e-3;
  if (unit == "us") return value * 1e-6;
  if (unit == "ns") return value * 1e-9;
  if (unit == "min" || unit == "m") return value * 60;
  if (unit == "h") return value * 3600;
  TIDAL_FAIL("'", text, "': unknown time unit '", unit, "'; use ns, us, ms, s, min or h");
}

double parse_percentage(std::string_view text) {
  std::string s = lower_trimmed(text);
  TIDAL_EXPECT_AS(InvalidArgument, !s.empty() && s.back() == '%', "'", text,
                  "' is not a percentage (try 50%)");
  s.pop_back();
  std::string rest;
  const double value = split_number(s, &rest, text, "percentage (try 50%)");
  TIDAL_EXPECT_AS(InvalidArgument, rest.empty(), "'", text, "' is not a percentage: '", rest,
                  "' after the number (try 50%)");
  return value / 100;
}

std::string format_bytes(double bytes) {
  static const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int i = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && i < 5) {
    v /= 1024.0;
    ++i;
  }
  char buf[48];
  if (i == 0) {
    std::snprintf(buf, sizeof buf, "%.0f B", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f %s", std::fabs(v) < 10 ? 2 : (std::fabs(v) < 100 ? 1 : 0),
                  v, kNames[i]);
  }
  return buf;
}

std::string format_bandwidth(double bytes_per_second) {
  char buf[48];
  if (bytes_per_second >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2f GB/s", bytes_per_second / 1e9);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MB/s", bytes_per_second / 1e6);
  }
  return buf;
}

std::string format_seconds(double seconds) {
  char buf[48];
  const double a = std::fabs(seconds);
  if (a >= 1.0 || a == 0.0) {
    std::snprintf(buf, sizeof buf, "%.3f s", seconds);
  } else if (a >= 1e-3) {
    std::snprintf(buf, sizeof buf, "%.2f ms", seconds * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f us", seconds * 1e6);
  }
  return buf;
}

}  // namespace tidal
