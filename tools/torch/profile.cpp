#include "commands.hpp"
#include "tidal/common/error.hpp"

namespace tidal::cli {

// Placeholder until the trainer issue lands: the subcommand exists and says so.
void add_profile_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("profile", "(not built yet) see issue 3");
  cmd->callback([] { TIDAL_FAIL("'tidal profile' is not implemented in this build yet"); });
}

}  // namespace tidal::cli
