// Shared by the examples, so that each one's file is its training loop: the flags they all take,
// the Session options made from them, and the per-step figures and summary line that
// tests/examples/run_examples.sh reads. The Session itself stays visible in every example.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "tidal/torch/build_info.hpp"
#include "tidal/torch/session.hpp"

namespace tidal_example {

/// The flags every example takes.
struct Args {
  std::string mode = "none";           ///< --mode none|activations|plan
  std::string dir = "/var/tmp/tidal";  ///< --dir: the store
  int steps = 10;                      ///< --steps
  double mem_budget = 0.5;             ///< --mem-budget: plan mode's budget_fraction
};

/// A flag of one example's own: gets the flag and a function returning its next argument;
/// returns false for a flag it does not know.
using ExtraFlag = std::function<bool(const std::string&, const std::function<std::string()>&)>;

/// Parses argv into `args` (defaults as given); other flags go to `extra`. Throws
/// std::invalid_argument for an unknown flag or a missing value.
inline void parse_args(int argc, char** argv, Args& args, const ExtraFlag& extra = {}) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::function<std::string()> value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--mode") {
      args.mode = value();
    } else if (arg == "--dir") {
      args.dir = value();
    } else if (arg == "--steps") {
      args.steps = std::stoi(value());
    } else if (arg == "--mem-budget") {
      args.mem_budget = std::stod(value());
    } else if (!extra || !extra(arg, value)) {
      throw std::invalid_argument("unknown flag " + arg);
    }
  }
}

/// What a user sets: the mode, one store directory of 1 GiB, tensors from 64 KiB on.
inline tidal::torch_layer::SessionOptions session_options(const Args& args) {
  tidal::torch_layer::SessionOptions options;
  options.mode = tidal::torch_layer::offload_mode_from_string(args.mode);
  options.store.dirs = {args.dir};
  options.store.capacity = 1ull << 30;
  options.activations.min_bytes = 64 * 1024;
  options.executor.min_bytes = 64 * 1024;
  options.budget_fraction = args.mem_budget;
  // These loops read no raw bytes between steps: the planner may leave tensors out across the
  // step boundary where the budget needs it.
  // A budget on the CPU is a wall here, as a GPU's memory would be. Both are plan mode's options
  // (the other modes refuse them).
  if (options.mode == tidal::torch_layer::OffloadMode::kPlan) {
    options.between_steps = tidal::torch_layer::BetweenSteps::kAuto;
    options.strict_meter = true;
  }
  if (options.mode != tidal::torch_layer::OffloadMode::kNone) {
    std::filesystem::create_directories(args.dir);
  }
  return options;
}

/// Sums a run's per-step figures from the Session's stats and prints the summary line.
class Report {
 public:
  /// Steps before this one are left out of the steady peak and the step time: plan mode's
  /// warm-up and profiling steps (1 + 2), activation mode's warm-up, reference and trial steps.
  static constexpr int kSteadyFrom = 4;

  /// Right before session.begin_step().
  void start_step() { t0_ = std::chrono::steady_clock::now(); }

  /// Right after session.end_step(): its peak (the meter's, from begin_step to end_step), time
  /// and bytes moved; prints the step's losses bit-exact ("step 3 loss 0x1.2p-1"), the lines
  /// run_examples.sh compares across modes.
  void end_step(int step, const tidal::torch_layer::Session& session,
                std::initializer_list<std::pair<const char*, double>> losses) {
    std::printf("step %d", step);
    for (const auto& [name, value] : losses) std::printf(" %s %a", name, value);
    std::printf("\n");
    std::fflush(stdout);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    const auto s = session.stats();
    peak_ = std::max(peak_, s.step_peak);
    if (step >= kSteadyFrom) {
      seconds_ += dt;
      steady_peak_ = std::max(steady_peak_, s.step_peak);
      ++timed_;
    }
    written_ += s.bytes_written;
    read_ += s.bytes_read;
    misses_ += s.misses;
  }

  /// The line run_examples.sh reads. within_budget: plan mode's verdict over the steps its
  /// current plan ran (why, if not, in stats().budget_reason); other modes have no budget.
  void print_summary(const Args& args, const tidal::torch_layer::Session& session) const {
    const auto s = session.stats();
    const bool within = s.mode != tidal::torch_layer::OffloadMode::kPlan || s.within_budget;
    std::printf(
        "summary mode=%s peak_bytes=%llu budget=%llu within_budget=%d bytes_written=%llu "
        "bytes_read=%llu misses=%llu step_seconds=%.4f steady_peak_bytes=%llu blas=%s\n",
        args.mode.c_str(), static_cast<unsigned long long>(peak_),
        static_cast<unsigned long long>(s.memory_budget), within ? 1 : 0,
        static_cast<unsigned long long>(written_), static_cast<unsigned long long>(read_),
        static_cast<unsigned long long>(misses_), timed_ > 0 ? seconds_ / timed_ : 0.0,
        static_cast<unsigned long long>(steady_peak_), tidal::torch_layer::blas_library().c_str());
    if (!s.notice.empty()) std::printf("note: %s\n", s.notice.c_str());
    if (!within && !s.budget_reason.empty()) std::printf("budget: %s\n", s.budget_reason.c_str());
  }

 private:
  std::chrono::steady_clock::time_point t0_;
  std::uint64_t peak_ = 0;
  std::uint64_t steady_peak_ = 0;
  std::uint64_t written_ = 0;
  std::uint64_t read_ = 0;
  std::uint64_t misses_ = 0;
  double seconds_ = 0;
  int timed_ = 0;
};

/// An example's main: runs `run` and turns an exception into "error: ..." and exit status 1.
inline int main_with_errors(int argc, char** argv, int (*run)(int, char**)) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace tidal_example
