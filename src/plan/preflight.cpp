#include "tidal/plan/preflight.hpp"

#include <algorithm>
#include <cstdio>

#include "tidal/common/units.hpp"
#include "tidal/plan/tiers.hpp"

namespace tidal::plan {
namespace {

std::string bytes(std::uint64_t b) { return format_bytes(static_cast<double>(b)); }

// Seconds to move `b` bytes at `rate` bytes/s; 0 bytes take none, a channel without a rate
// takes forever.
double seconds(std::uint64_t b, double rate) {
  if (b == 0) return 0;
  return rate > 0 ? static_cast<double>(b) / rate : 1e300;
}

}  // namespace

Preflight preflight(std::uint64_t state_bytes, const Hardware& hw, std::uint64_t device_budget) {
  Preflight p;
  p.state_bytes = state_bytes;
  p.device_bytes = device_budget;
  const std::uint64_t elsewhere = hw.host_memory + hw.ssd_capacity;
  const std::string held =
      "host memory " + bytes(hw.host_memory) + " and the SSD store " + bytes(hw.ssd_capacity);
  if (device_budget == 0) {
    p.fits = true;
    p.line = "pre-flight: the model's state is " + bytes(state_bytes) +
             "; the budget is a share of a peak the first steps measure, and " + held +
             " take what it leaves out";
    return p;
  }
  p.outside_bytes = state_bytes > device_budget ? state_bytes - device_budget : 0;
  p.fits = p.outside_bytes <= elsewhere;
  if (!p.fits) {
    p.line = "pre-flight: the model's state (" + bytes(state_bytes) +
             ": parameters, gradients and optimizer state; activations come on top) does not "
             "fit in the device budget " +
             bytes(device_budget) + ", " + held + " together (" + bytes(device_budget + elsewhere) +
             "): give more host memory, a larger store capacity or more SSDs, or train a "
             "smaller model or in lower precision";
    return p;
  }
  p.to_host = std::min(p.outside_bytes, hw.host_memory);
  p.to_ssd = p.outside_bytes - p.to_host;
  const ChannelRates r = hw.channels();
  p.transfer_seconds =
      seconds(p.to_host, r[Channel::kHostWrite]) + seconds(p.to_host, r[Channel::kHostRead]) +
      seconds(p.to_ssd, r[Channel::kSsdWrite]) + seconds(p.to_ssd, r[Channel::kSsdRead]);
  if (p.outside_bytes == 0) {
    p.line = "pre-flight: the model's state (" + bytes(state_bytes) +
             ") fits in the device budget " + bytes(device_budget) +
             "; activations come on top, and what does not fit moves to " + held;
    return p;
  }
  char when[64];
  std::snprintf(when, sizeof when, "%.3g s", p.transfer_seconds);
  p.line = "pre-flight: the model's state is " + bytes(state_bytes) + " against a budget of " +
           bytes(device_budget) + ": " + bytes(p.outside_bytes) + " lives outside the device (" +
           bytes(p.to_host) + " in host memory, " + bytes(p.to_ssd) +
           " on the SSDs), and moving it out and back takes at least " + when +
           " a step at the assumed rates; activations come on top";
  return p;
}

}  // namespace tidal::plan
