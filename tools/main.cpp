// tidal: lifetime-aware tensor offloading to NVMe SSDs. See README.md.
//
// Built twice: `tidal-torch` (TIDAL_WITH_TORCH) has every command; `tidal` has the torch-free
// ones and, where tidal-torch was built beside it (TIDAL_TORCH_CLI), hands train and profile to
// it, so that plan, simulate and bench-io start without loading libtorch.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>

#include "commands.hpp"
#include "tidal/common/error.hpp"

#ifdef TIDAL_WITH_TORCH
#include <c10/util/Exception.h>
#endif

namespace {

#ifdef TIDAL_TORCH_CLI
// The directory this program was started from (/proc/self/exe), with a trailing slash.
std::string own_directory() {
  std::string path(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) return {};
  path.resize(static_cast<std::size_t>(n));
  return path.substr(0, path.rfind('/') + 1);
}

// Runs the command in tidal-torch when it needs libtorch; returns only when it does not (or
// with the exit status of a failed hand-over).
int hand_over_torch_commands(int argc, char** argv) {
  if (argc < 2) return -1;
  const std::string command = argv[1];
  if (command != "train" && command != "profile") return -1;
  const std::string target = own_directory() + TIDAL_TORCH_CLI;
  execv(target.c_str(), argv);
  std::cerr << "tidal: error: `tidal " << command << "` runs in " << target
            << ", which could not be started (" << std::strerror(errno)
            << "); build or install tidal-torch beside tidal (it is built with libtorch)\n";
  return 1;
}

// The torch commands in `tidal --help`; never run here (see hand_over_torch_commands).
void add_torch_command_names(CLI::App& app) {
  app.add_subcommand("train", "Train a model with tensors offloaded (runs in tidal-torch)")
      ->allow_extras();
  app.add_subcommand("profile", "Trace training iterations (runs in tidal-torch)")->allow_extras();
}
#endif

}  // namespace

int main(int argc, char** argv) {
#ifdef TIDAL_TORCH_CLI
  if (const int status = hand_over_torch_commands(argc, argv); status >= 0) return status;
#endif
  CLI::App app{"tidal: train models larger than device memory by offloading tensors to SSDs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "tidal 0.1.0");
  tidal::cli::add_bench_io_command(app);
  tidal::cli::add_plan_command(app);
  tidal::cli::add_simulate_command(app);
  tidal::cli::add_estimate_command(app);
#ifdef TIDAL_WITH_TORCH
  tidal::cli::add_train_command(app);
  tidal::cli::add_profile_command(app);
#elif defined(TIDAL_TORCH_CLI)
  add_torch_command_names(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the reason; its status codes (101-127 by kind) become the usual 2 for a
    // usage error (--help and --version stay 0).
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const tidal::Error& e) {
    std::cerr << "tidal: error: " << e.what() << "\n";
    return 1;
#ifdef TIDAL_WITH_TORCH
  } catch (const c10::OutOfMemoryError& e) {
    // A budget too small for the step (the strict meter's wall, or the GPU's): the message says
    // what to change; torch's stack trace would bury it.
    std::cerr << "tidal: error: out of memory: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "tidal: unexpected error: " << e.what_without_backtrace() << "\n";
    return 2;
#endif
  } catch (const std::exception& e) {
    std::cerr << "tidal: unexpected error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
