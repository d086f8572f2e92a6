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
  std::optional<std::string> cpu_accumulate;  ///< "6G"
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

/// parse(*text) when the flag was given, with the flag named in an error.
template <class Parse>
auto parse_given(const char* flag, const std::optional<std::string>& text, Parse parse)
    -> std::optional<decltype(parse(*text))> {
  if (!text) return std::nullopt;
  return parse_flag(flag, *text, parse);
}

inline std::optional<plan::SsdSpec> parse_ssd_flag(const std::optional<std::string>& text) {
  return parse_given("--ssd", text, plan::parse_ssd_spec);
}

/// The overrides the flags give. Throws tidal::InvalidArgument naming the flag on bad text
/// (apply_overrides checks the values).
inline plan::HardwareOverrides parse_hardware_flags(const HardwareFlags& f) {
  plan::HardwareOverrides o;
  o.device_memory = parse_given("--gpu-mem", f.gpu_mem, parse_bytes);
  TIDAL_EXPECT_AS(InvalidArgument, !o.device_memory || *o.device_memory > 0, "--gpu-mem ",
                  *f.gpu_mem,
                  " is not a valid size of device memory: give one above 0 (e.g. "
                  "--gpu-mem 8GiB)");
  o.ssd = parse_ssd_flag(f.ssd);
  o.host_memory = parse_given("--host-mem", f.host_mem, parse_bytes);
  o.host_link_bw = parse_given("--host-link", f.host_link, parse_bandwidth);
  o.gpu_link_bw = parse_given("--gpu-link", f.gpu_link, parse_bandwidth);
  o.gpu_flops = parse_given("--gpu-flops", f.gpu_flops, parse_rate);
  o.gpu_flops_bf16 = parse_given("--gpu-flops-bf16", f.gpu_flops_bf16, parse_rate);
  o.gpu_mem_bw = parse_given("--gpu-mem-bw", f.gpu_mem_bw, parse_bandwidth);
  o.cpu_adam_rate = parse_given("--cpu-adam", f.cpu_adam, parse_rate);
  o.cpu_accumulate_rate = parse_given("--cpu-accumulate", f.cpu_accumulate, parse_rate);
  if (const auto tbw = parse_given("--tbw", f.ssd_tbw, parse_bytes)) {
    o.ssd_tbw = static_cast<double>(*tbw);
  }
  o.memory_margin = f.margin;
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
  cmd->add_option("--cpu-accumulate", f.cpu_accumulate,
                  "elements/s the host CPU adds a 16-bit gradient into an fp32 one (the "
                  "optimizer step on the host), e.g. 6G");
  cmd->add_option("--tbw", f.ssd_tbw, "SSD endurance per drive, e.g. 1200TB");
  cmd->add_option("--margin", f.margin, "share of device memory kept free (0.01)");
}

}  // namespace tidal::cli
