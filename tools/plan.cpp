#include "commands.hpp"
#include "tidal/common/error.hpp"

namespace tidal::cli {

// Placeholder until the planner issue lands: the subcommand exists and says so.
void add_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "(not built yet) see issue 4");
  cmd->callback([] { TIDAL_FAIL("'tidal plan' is not implemented in this build yet"); });
}

}  // namespace tidal::cli
