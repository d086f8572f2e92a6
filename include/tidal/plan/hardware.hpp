// The hardware a plan is made for and simulated on: device memory, SSDs, host link, host memory,
// and the roofline figures that turn an analytic op into seconds. Torch-free.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tidal/plan/tiers.hpp"

namespace tidal::plan {

/// A machine, or one GPU's share of it. Plain data; copyable; no synchronisation.
struct Hardware {
  std::string name;                 ///< preset name, or "custom"
  std::uint64_t device_memory = 0;  ///< device (GPU) memory capacity, bytes
  int ssd_count = 0;                ///< SSDs striped as one array (RAID-0 in software)
  double ssd_write_bw = 0;          ///< per SSD, bytes/s
  double ssd_read_bw = 0;           ///< per SSD, bytes/s
  double host_link_bw = 0;          ///< device <-> host, per direction, bytes/s
  /// GPU <-> GPU link, per direction, bytes/s (0: one GPU only): what collectives run on.
  double gpu_link_bw = 0;
  std::uint64_t host_memory = 0;  ///< host memory offloaded tensors may use, bytes (0: none)
  /// Bytes the SSD store can hold at once, over all SSDs (0: no limit, the SSDs' size is
  /// assumed large enough). The planner keeps the tensors it has on the SSDs at any op within it.
  std::uint64_t ssd_capacity = 0;
  double gpu_flops = 0;            ///< peak fp32 matmul FLOP/s (as PyTorch runs fp32 matmuls)
  double gpu_flops_bf16 = 0;       ///< peak dense bf16 matmul FLOP/s (0: same as gpu_flops)
  double gpu_mem_bw = 0;           ///< device memory bandwidth, bytes/s
  double matmul_efficiency = 0.8;  ///< fraction of gpu_flops a large matmul reaches
  double op_overhead_s = 5e-6;     ///< launch and framework overhead per op
  double cpu_adam_rate = 0;        ///< parameters/s of the host CPU Adam (ZeRO, host step)
  /// Elements/s the host CPU adds a 16-bit gradient from the device into an fp32 one (the host
  /// step's gradient accumulation, host_step.hpp).
  double cpu_accumulate_rate = 0;
  double ssd_tbw = 0;           ///< endurance per SSD, bytes written (TBW)
  double memory_margin = 0.01;  ///< share of device memory the planner leaves free (G10)
  /// Compute time each byte started on a channel takes from the device (seconds per byte, by
  /// index_of(channel)): the host CPU's own work for the transfer when the device computes on
  /// that CPU (cpu-here, measured by the session: submission, checksums, copies, a virtual
  /// machine's exits); 0 where compute runs elsewhere (a GPU). The simulator adds it to the op
  /// that starts the transfer.
  std::array<double, kNumChannels> compute_seconds_per_byte{};

  /// Aggregate SSD write/read bandwidth of the array, capped by the host link.
  [[nodiscard]] double ssd_write_total() const;
  [[nodiscard]] double ssd_read_total() const;
  /// The channel split tidal's planner and the simulator use (see ChannelRates in tiers.hpp).
  [[nodiscard]] ChannelRates channels() const;
  /// One line: "94.0 GB device, 4x SSD 6.50/6.70 GB/s, host link 55.0 GB/s, host 768 GB".
  [[nodiscard]] std::string describe() const;
};

/// Names of the presets: h100-4ssd, a100-2ssd, cpu-here.
std::vector<std::string> hardware_preset_names();

/// A preset by name. Throws tidal::InvalidArgument listing the known names otherwise.
///
/// - h100-4ssd: one H100 NVL (94 GB, fp32 60 TFLOP/s without TF32, bf16 835 TFLOP/s dense, 3.9
/// TB/s), 4 SSDs of 6.5 GB/s
///   write and 6.7 GB/s read (Samsung 990 PRO, 1200 TB written each), PCIe Gen5 x16 link, half
///   of a 1.5 TB host: the per-GPU setup of the TERAIO paper.
/// - a100-2ssd: one A100 80 GB (fp32 19.5 TFLOP/s, bf16 312 TFLOP/s, 2.0 TB/s), 2 SSDs of 3.0/3.5
/// GB/s (Gen4),
///   PCIe Gen4 x16, 256 GB host.
/// - cpu-here: the 2-core build machine: the memory budget must be given (--gpu-mem); one SSD
///   at the fio figures of this machine (2.0 GB/s write, 1.5 GB/s read) unless measured figures
///   are given with --ssd (tidal bench-io prints them).
Hardware hardware_preset(const std::string& name);

/// Parses an SSD array: "<count>x<write>/<read><unit>/s" or "<count>x<bw><unit>/s" (same both
/// ways); the unit on the last figure applies to both. Returns {count, write, read}.
struct SsdSpec {
  int count = 0;
  double write_bw = 0;
  double read_bw = 0;
};
SsdSpec parse_ssd_spec(const std::string& text);

/// Field overrides: unset fields keep the preset's value. Numbers in the units of Hardware; the
/// command line parses its text into them (parse_ssd_spec here; parse_rate, parse_bytes in
/// common/units.hpp).
struct HardwareOverrides {
  std::optional<std::uint64_t> device_memory;  ///< bytes
  std::optional<SsdSpec> ssd;                  ///< count and per-SSD bandwidths
  std::optional<std::uint64_t> host_memory;    ///< bytes; 0: no host tier
  std::optional<double> host_link_bw;          ///< bytes/s per direction
  std::optional<double> gpu_link_bw;           ///< bytes/s per direction
  std::optional<double> gpu_flops;             ///< FLOP/s
  std::optional<double> gpu_flops_bf16;        ///< FLOP/s
  std::optional<double> gpu_mem_bw;            ///< bytes/s
  std::optional<double> cpu_adam_rate;         ///< parameters/s
  std::optional<double> cpu_accumulate_rate;   ///< elements/s
  std::optional<double> ssd_tbw;               ///< bytes written per SSD over its life
  std::optional<double> memory_margin;         ///< in [0, 0.5)
};

/// Applies the set fields. Throws tidal::InvalidArgument on a margin outside [0, 0.5), a
/// non-positive rate, or when the result has no device memory (cpu-here has none until given).
void apply_overrides(Hardware& hw, const HardwareOverrides& o);

}  // namespace tidal::plan
