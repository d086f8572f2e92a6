// What `tidal train` measured and how it reports it: the results on stderr, the JSON line, the
// files asked for.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tidal/models/trainer.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"
#include "train_args.hpp"

namespace tidal::cli {

// The I/O of a run's offloaded steps, summed from the session's per-step stats.
struct IoTotals {
  std::uint64_t bytes_written = 0, bytes_read = 0, bytes_to_host = 0, bytes_from_host = 0;
  std::uint64_t bytes_staged = 0;
  std::uint64_t planned_to_ssd = 0, planned_to_host = 0, misses = 0, failures = 0, full = 0;
  std::string write_error;  // the last failed write's message
  double stall = 0, host_stall = 0, write_stall = 0;
  void add(const torch_layer::SessionStats& s) {
    bytes_written += s.bytes_written;
    bytes_read += s.bytes_read;
    bytes_to_host += s.bytes_to_host;
    bytes_from_host += s.bytes_from_host;
    bytes_staged += s.bytes_staged;
    planned_to_ssd += s.planned_bytes_to_ssd;
    planned_to_host += s.planned_bytes_to_host;
    misses += s.misses;
    failures += s.write_failures;
    full += s.store_full_writes;
    if (!s.write_error.empty()) write_error = s.write_error;
    stall += s.stall_seconds;
    host_stall += s.host_stall_seconds;
    write_stall += s.write_stall_seconds;
  }
};

// What the steps of a run measured.
struct StepRecord {
  std::vector<double> losses;
  std::vector<double> seconds;
  std::vector<double> offload_seconds;  // steps that ran with offloading on
  std::vector<std::uint64_t> step_peaks;
  IoTotals io;  // over the steps that ran with offloading on
  int checkpoints_written = 0;
};

// What the JSON line says besides the store and the time report.
struct RunContext {
  const TrainArgs& args;
  const models::TrainerOptions& options;
  const torch_layer::SessionOptions& so;
  std::int64_t first_step;
};

/// After the steps: the results on stderr, the JSON line on stdout (--json), then the files
/// asked for (a file that cannot be written is a warning).
void report_run(const RunContext& run, torch_layer::Session& session,
                const torch_layer::MemoryMeter& meter, const StepRecord& rec);

}  // namespace tidal::cli
