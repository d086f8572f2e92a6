// Before a model's first step: can its state (parameters, gradients, optimizer state) live in
// the device's budget, host memory and the SSDs together, and at least how long does a step
// spend moving what does not fit on the device? Activations are not known before a step runs
// and come on top.
#pragma once

#include <cstdint>
#include <string>

#include "tidal/plan/hardware.hpp"

namespace tidal::plan {

struct Preflight {
  bool fits = true;
  std::uint64_t state_bytes = 0;
  std::uint64_t device_bytes = 0;   ///< the budget; 0: a share of a peak not measured yet
  std::uint64_t outside_bytes = 0;  ///< state that must leave the device (budget known)
  std::uint64_t to_host = 0;        ///< of it, what host memory takes (first: it is faster)
  std::uint64_t to_ssd = 0;         ///< and the rest, on the SSDs
  /// The least a step spends moving outside_bytes out and back at hw's rates, each tier's two
  /// directions one after the other; -1 when the budget is not known yet.
  double transfer_seconds = -1;
  std::string line;  ///< one sentence: the figures, and what to change when it does not fit
};

/// `hw` gives host memory (host_memory), the SSD store's room (ssd_capacity) and the rates;
/// `device_budget` the bytes of device memory the state may use (0: not known yet).
Preflight preflight(std::uint64_t state_bytes, const Hardware& hw, std::uint64_t device_budget);

}  // namespace tidal::plan
