// The vocabulary the planner, the simulator and the plan executor share: the tiers a tensor's
// bytes can be in, and the transfer channels that move them between device memory and a lower
// tier. Torch-free.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tidal::plan {

/// Where a tensor's bytes are. A plan moves tensors from device memory to a lower tier (SSD or
/// host memory) in their idle periods and back before their next use.
enum class Tier : std::uint8_t {
  kSsd = 0,     ///< the SSD tensor store
  kHost = 1,    ///< host memory (pinned on a GPU machine)
  kDevice = 2,  ///< device memory (the GPU's; host memory itself on a CPU-only machine)
};

/// The lower tier a plan action moves a tensor to and from: Tier::kSsd or Tier::kHost.
using Target = Tier;

enum class Direction : std::uint8_t {
  kWrite,  ///< device memory to the lower tier (an offload)
  kRead,   ///< the lower tier to device memory (a prefetch, or a miss)
};

/// A transfer channel: one lower tier, one direction. Each moves one transfer at a time at its
/// rate (ChannelRates), most urgent first; the four run at once.
enum class Channel : std::uint8_t { kSsdWrite = 0, kSsdRead = 1, kHostWrite = 2, kHostRead = 3 };
inline constexpr std::size_t kNumChannels = 4;
inline constexpr std::array<Channel, kNumChannels> kChannels = {
    Channel::kSsdWrite, Channel::kSsdRead, Channel::kHostWrite, Channel::kHostRead};

/// The channel that moves bytes to (kWrite) or from (kRead) a lower tier (kSsd or kHost).
constexpr Channel channel_of(Tier tier, Direction dir) {
  const int base = tier == Tier::kHost ? 2 : 0;
  return static_cast<Channel>(base + (dir == Direction::kRead ? 1 : 0));
}
constexpr Tier tier_of(Channel c) {
  return c == Channel::kHostWrite || c == Channel::kHostRead ? Tier::kHost : Tier::kSsd;
}
constexpr Direction direction_of(Channel c) {
  return c == Channel::kSsdWrite || c == Channel::kHostWrite ? Direction::kWrite : Direction::kRead;
}
constexpr bool is_write(Channel c) { return direction_of(c) == Direction::kWrite; }
constexpr std::size_t index_of(Channel c) { return static_cast<std::size_t>(c); }

/// "ssd", "host", "device".
const char* to_string(Tier t);
/// "ssd-write", "ssd-read", "host-write", "host-read".
const char* to_string(Channel c);

/// Transfer rates of the four channels, bytes/s, indexed by Channel.
///
/// The GPU's host link (PCIe) carries every transfer. The SSD channels get what the SSD array
/// can do (capped by the link); the host-memory channels get the rest of the link
/// (Hardware::channels()). This static split keeps the planner's bandwidth buckets and the
/// simulator's queues in agreement.
struct ChannelRates {
  std::array<double, kNumChannels> bytes_per_second{};

  double& operator[](Channel c) { return bytes_per_second[index_of(c)]; }
  double operator[](Channel c) const { return bytes_per_second[index_of(c)]; }
  /// Both channels of a lower tier move bytes: the tier can take an offload and give it back.
  [[nodiscard]] bool usable(Tier tier) const {
    return tier != Tier::kDevice && (*this)[channel_of(tier, Direction::kWrite)] > 0 &&
           (*this)[channel_of(tier, Direction::kRead)] > 0;
  }
};

}  // namespace tidal::plan
