#include "commands.hpp"
#include "tidal/common/error.hpp"

namespace tidal::cli {

void add_bench_io_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench-io", "(being built) I/O benchmark");
  cmd->callback([] { TIDAL_FAIL("'tidal bench-io' is not implemented in this build yet"); });
}

}  // namespace tidal::cli
