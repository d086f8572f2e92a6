// The flags of `tidal train`, as given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model_options.hpp"

namespace tidal::cli {

struct TrainArgs {
  ModelArgs model;
  bool json = false;
  std::vector<std::string> timeline;  // files: Chrome trace, or SVG for a name ending in .svg
  std::int64_t timeline_steps = 2;    // signed: -1 is refused, not read as 2^64 - 1
  bool recompute = false;
  std::string offload = "none";
  std::string mem_budget;  // empty: the device's default (SessionOptions::memory_budget)
  std::string dirs;
  bool dirs_given = false;  // --dir on the command line (an empty one is an error, not a default)
  std::string capacity = "0";
  std::string min_offload = "1MiB";
  int warmup_steps = 1;
  int profile_steps = 2;
  int retime_steps = 4;
  std::string ssd;  // planner's SSD figures, e.g. "1x2.0/1.5GB/s"
  std::string save_trace;
  std::string save_plan;
  std::string between_steps;  // empty: auto (given outside plan mode: refused)
  bool strict_budget = false;
  bool strict_meter = false;
  std::string host_mem;    // empty: the machine's default (SessionOptions::host_memory)
  std::string checkpoint;  // directory checkpoints are written to
  int checkpoint_every = 0;
  std::string resume;    // directory to resume from
  int kill_at_step = 0;  // testing: SIGKILL in the middle of this step (1-based)
};

}  // namespace tidal::cli
