// tidal: lifetime-aware tensor offloading to NVMe SSDs. See README.md.
#include <exception>
#include <iostream>

#include "commands.hpp"
#include "tidal/common/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"tidal: train models larger than device memory by offloading tensors to SSDs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "tidal 0.1.0");
  tidal::cli::add_bench_io_command(app);
  tidal::cli::add_plan_command(app);
  tidal::cli::add_simulate_command(app);
#ifdef TIDAL_WITH_TORCH
  tidal::cli::add_train_command(app);
  tidal::cli::add_profile_command(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const tidal::Error& e) {
    std::cerr << "tidal: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "tidal: unexpected error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
