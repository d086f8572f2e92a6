// Each subcommand of the `tidal` CLI lives in its own file and registers itself here.
#pragma once

#include <CLI/CLI.hpp>

namespace tidal::cli {

void add_bench_io_command(CLI::App& app);  // tools/bench_io.cpp
void add_plan_command(CLI::App& app);      // tools/plan.cpp
void add_simulate_command(CLI::App& app);  // tools/simulate.cpp
void add_estimate_command(CLI::App& app);  // tools/estimate.cpp
#ifdef TIDAL_WITH_TORCH
void add_train_command(CLI::App& app);    // tools/torch/train.cpp
void add_profile_command(CLI::App& app);  // tools/torch/profile.cpp
#endif

}  // namespace tidal::cli
