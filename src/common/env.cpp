#include "tidal/common/env.hpp"

#include <cstdlib>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal {
namespace {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

}  // namespace

Env read_env() {
  Env e;
  e.io_backend = get("TIDAL_IO_BACKEND");
  e.gds = get("TIDAL_GDS");
  e.dirs = get("TIDAL_DIRS");
  if (auto v = get("TIDAL_STRIPE_UNIT")) {
    try {
      e.stripe_unit = parse_bytes(*v);
    } catch (const Error& err) {
      TIDAL_FAIL_AS(InvalidArgument, "TIDAL_STRIPE_UNIT='", *v, "': ", err.what());
    }
  }
  if (auto v = get("TIDAL_QUEUE_DEPTH")) {
    char* end = nullptr;
    const long depth = std::strtol(v->c_str(), &end, 10);
    TIDAL_EXPECT_AS(InvalidArgument, end != nullptr && *end == '\0' && depth > 0 && depth <= 4096,
                    "TIDAL_QUEUE_DEPTH='", *v, "' must be a whole number from 1 to 4096");
    e.queue_depth = static_cast<int>(depth);
  }
  if (auto v = get("TIDAL_CHECKSUM")) {
    TIDAL_EXPECT_AS(InvalidArgument, *v == "0" || *v == "1", "TIDAL_CHECKSUM='", *v,
                    "' must be 0 or 1");
    e.checksum = (*v == "1");
  }
  if (auto v = get("TIDAL_MEMORY_STORE")) {
    TIDAL_EXPECT_AS(InvalidArgument, *v == "0" || *v == "1", "TIDAL_MEMORY_STORE='", *v,
                    "' must be 0 or 1");
    e.memory_store = (*v == "1");
  }
  if (auto v = get("TIDAL_HUGE_PAGES")) {
    TIDAL_EXPECT_AS(InvalidArgument, *v == "0" || *v == "1", "TIDAL_HUGE_PAGES='", *v,
                    "' must be 0 or 1");
    e.huge_pages = (*v == "1");
  }
  if (auto v = get("TIDAL_TIMELINE")) {
    // Only blanks is a slip (a quoted empty value, a stray space), not a file to create.
    TIDAL_EXPECT_AS(InvalidArgument, v->find_first_not_of(" \t\n\r\f\v") != std::string::npos,
                    "TIDAL_TIMELINE='", *v,
                    "' names no file (only blanks): give the file to write the timeline to, or "
                    "unset it");
    e.timeline = *v;
  }
  return e;
}

const Env& env() {
  static const Env cached = read_env();
  return cached;
}

}  // namespace tidal
