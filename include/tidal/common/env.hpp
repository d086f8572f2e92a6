// Every TIDAL_* environment variable tidal reads, read in this one place.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace tidal {

/// The tunables a user can set from the environment. An unset variable is std::nullopt and the
/// option's own default applies. Explicit options given in code or on the command line win over
/// the environment only where the documentation of that option says so (the I/O backend choice
/// follows kvikio: the variable overrides AUTO, not an explicit choice).
struct Env {
  std::optional<std::string> io_backend;     ///< TIDAL_IO_BACKEND: auto|io_uring|posix|cufile
  std::optional<std::string> gds;            ///< TIDAL_GDS: off|on|auto (cuFile compat mode)
  std::optional<std::string> dirs;           ///< TIDAL_DIRS: comma-separated store directories
  std::optional<std::uint64_t> stripe_unit;  ///< TIDAL_STRIPE_UNIT: e.g. 1MiB
  std::optional<int> queue_depth;            ///< TIDAL_QUEUE_DEPTH: requests in flight per file
  std::optional<bool> checksum;              ///< TIDAL_CHECKSUM: 0|1
  std::optional<bool> memory_store;  ///< TIDAL_MEMORY_STORE: 0|1, a store on tmpfs/ramfs allowed
  /// TIDAL_HUGE_PAGES: 0|1 (default 1), host tensors of 2 MiB or more on transparent huge pages
  std::optional<bool> huge_pages;
  /// TIDAL_TIMELINE: a file each Session writes its timeline to when it ends, where the program
  /// names none (a Chrome trace; an SVG for a name ending in .svg).
  std::optional<std::string> timeline;
};

/// Reads the variables now. Throws tidal::InvalidArgument naming the variable on a bad value.
Env read_env();

/// The variables as read at first call (thread-safe, cached for the process). The store does not
/// use it: io::TensorStore calls read_env() each time one opens, so a variable set before that
/// (setenv in a program or a test) applies to it.
const Env& env();

}  // namespace tidal
