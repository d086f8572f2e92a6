// The simulator's view of transfers and tensors (private to plan/simulator.cpp and its parts).
#pragma once

#include <array>
#include <cstdint>

#include "tidal/plan/tiers.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail::sim {

using trace::TensorId;

enum class State : std::uint8_t { kAbsent, kResident, kWriting, kOffloaded, kReading };

struct Job {
  double remaining = 0;  // bytes
  double key = 0;        // deadline as a global op number; earliest first
  std::int64_t seq = 0;
  TensorId tensor = 0;
  Channel channel = Channel::kSsdWrite;
  std::uint64_t bytes = 0;
  std::uint64_t version = 0;
  bool done = false;
  double end = 0;  // when it completed (once done)
};

struct TensorState {
  State state = State::kAbsent;
  std::uint64_t version = 0;
  // The version of the tensor each lower tier holds a copy of (SSD, host; -1: none). Each tier
  // keeps its copy until the tensor changes, whatever the other tier does.
  std::array<std::int64_t, 2> copy_version{-1, -1};
  bool dead = false;  // freed by the program while a transfer was in flight
  bool on_host = false;
  bool on_ssd = false;
  bool staging = false;  // host memory taken for a stage in flight
  int job = -1;          // the transfer in flight
  int stage_job = -1;    // the stage in flight
  // This instance's last offload: its job, kCleanOffload when the tier's copy was current (no
  // write), -1 when none was issued. A host task reading the tensor waits for it.
  int drain_job = -1;
};

constexpr int kCleanOffload = -2;

}  // namespace tidal::plan::detail::sim
