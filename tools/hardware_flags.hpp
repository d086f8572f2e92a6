// The hardware flags of `tidal plan`, `tidal simulate` (and --ssd of `tidal train`): text on the
// command line, parsed here into the typed plan::HardwareOverrides, with the flag named in
// every error.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/hardware.hpp"

namespace tidal::cli {

struct HardwareFlags {
  std::optional<std::string> gpu_mem;         ///< "80GiB"
  std::optional<std::string> ssd;             ///< "4x6.5/6.7GB/s"
  std::optional<std::string> host_mem;        ///< "256GiB", "0"
  std::optional<std::string> host_link;       ///< "55GB/s"
  std::optional<std::string> gpu_link;        ///< "300GB/s"
  std::optional<std::string> gpu_flops;       ///< "60T"
  std::optional<std::string> gpu_flops_bf16;  ///< "835T"
  std::optional<std::string> gpu_mem_bw;      ///< "3.9TB/s"
  std::optional<std::string> cpu_adam;        ///< "2G"
  std::optional<std::string> ssd_tbw;         ///< "1200TB"
  std::optional<double> margin;               ///< 0.01
};

/// parse(text), with the flag and its text in front of the message of an error.
template <class Parse>
auto parse_flag(const char* flag, const std::string& text, Parse parse) -> decltype(parse(text)) {
  try {
    return parse(text);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string(flag) + " '" + text + "': " + e.what());
  }
}

inline std::optional<plan::SsdSpec> parse_ssd_flag(const std::optional<std::string>& text) {
  if (!text) return std::nullopt;
  return parse_flag("--ssd", *text, [](const std::string& t) { return plan::parse_ssd_spec(t); });
}

/// The overrides the flags give. Throws tidal::InvalidArgument naming the flag on bad text.
inline plan::HardwareOverrides parse_hardware_flags(const HardwareFlags& f) {
  const auto bytes = [](const char* flag, const std::optional<std::string>& t) {
    std::optional<std::uint64_t> v;
    if (t) v = parse_flag(flag, *t, [](const std::string& s) { return parse_bytes(s); });
    return v;
  };
  const auto bandwidth = [](const char* flag, const std::optional<std::string>& t) {
    std::optional<double> v;
    if (t) v = parse_flag(flag, *t, [](const std::string& s) { return parse_bandwidth(s); });
    return v;
  };
  const auto rate = [](const char* flag, const std::optional<std::string>& t) {
    std::optional<double> v;
    if (t) v = parse_flag(flag, *t, [](const std::string& s) { return parse_rate(s); });
    return v;
  };
  plan::HardwareOverrides o;
  o.device_memory = bytes("--gpu-mem", f.gpu_mem);
  o.ssd = parse_ssd_flag(f.ssd);
  o.host_memory = bytes("--host-mem", f.host_mem);
  o.host_link_bw = bandwidth("--host-link", f.host_link);
  o.gpu_link_bw = bandwidth("--gpu-link", f.gpu_link);
  o.gpu_flops = rate("--gpu-flops", f.gpu_flops);
  o.gpu_flops_bf16 = rate("--gpu-flops-bf16", f.gpu_flops_bf16);
  o.gpu_mem_bw = bandwidth("--gpu-mem-bw", f.gpu_mem_bw);
  o.cpu_adam_rate = rate("--cpu-adam", f.cpu_adam);
  if (const auto tbw = bytes("--tbw", f.ssd_tbw)) o.ssd_tbw = static_cast<double>(*tbw);
  if (f.margin) {
    TIDAL_EXPECT_AS(InvalidArgument, *f.margin >= 0 && *f.margin < 0.5,
                    "--margin must be in [0, 0.5), got ", *f.margin);
    o.memory_margin = f.margin;
  }
  return o;
}

inline void add_hardware_flags(CLI::App* cmd, HardwareFlags& f) {
  cmd->add_option("--gpu-mem", f.gpu_mem, "device memory, e.g. 80GiB");
  cmd->add_option("--ssd", f.ssd, "SSD array, e.g. 4x6.5/6.7GB/s (count x write/read)");
  cmd->add_option("--host-mem", f.host_mem, "host memory for offloaded tensors, e.g. 256GiB");
  cmd->add_option("--host-link", f.host_link, "device-host link per direction, e.g. 55GB/s");
  cmd->add_option("--gpu-link", f.gpu_link,
                  "GPU-GPU link per direction, for --data-parallel/--tensor-parallel, e.g. "
                  "300GB/s");
  cmd->add_option("--gpu-flops", f.gpu_flops, "peak matmul FLOP/s, e.g. 60T");
  cmd->add_option("--gpu-flops-bf16", f.gpu_flops_bf16,
                  "peak dense bf16 matmul FLOP/s, e.g. 835T (with --precision bf16-mixed|bf16)");
  cmd->add_option("--gpu-mem-bw", f.gpu_mem_bw, "device memory bandwidth, e.g. 3.9TB/s");
  cmd->add_option("--cpu-adam", f.cpu_adam, "CPU Adam parameters/s, e.g. 2G");
  cmd->add_option("--tbw", f.ssd_tbw, "SSD endurance per drive, e.g. 1200TB");
  cmd->add_option("--margin", f.margin, "share of device memory kept free (0.01)");
}

}  // namespace tidal::cli
