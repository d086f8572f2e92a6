#include "tidal/plan/hardware.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal::plan {

double Hardware::ssd_write_total() const {
  return std::min(ssd_count * ssd_write_bw, host_link_bw);
}

double Hardware::ssd_read_total() const { return std::min(ssd_count * ssd_read_bw, host_link_bw); }

ChannelRates Hardware::channels() const {
  ChannelRates r;
  r[Channel::kSsdWrite] = ssd_write_total();
  r[Channel::kSsdRead] = ssd_read_total();
  // Host memory as a destination only gets the link bandwidth the SSDs leave, and only when a
  // host-memory budget exists.
  if (host_memory > 0) {
    r[Channel::kHostWrite] = std::max(0.0, host_link_bw - r[Channel::kSsdWrite]);
    r[Channel::kHostRead] = std::max(0.0, host_link_bw - r[Channel::kSsdRead]);
  }
  return r;
}

std::string Hardware::describe() const {
  std::ostringstream out;
  out << format_bytes(static_cast<double>(device_memory)) << " device, " << ssd_count << "x SSD "
      << format_bandwidth(ssd_write_bw) << " write / " << format_bandwidth(ssd_read_bw)
      << " read, host link " << format_bandwidth(host_link_bw) << ", host memory "
      << format_bytes(static_cast<double>(host_memory));
  if (gpu_link_bw > 0) out << ", GPU link " << format_bandwidth(gpu_link_bw);
  return out.str();
}

std::vector<std::string> hardware_preset_names() { return {"h100-4ssd", "a100-2ssd", "cpu-here"}; }

Hardware hardware_preset(const std::string& name) {
  Hardware hw;
  hw.name = name;
  if (name == "h100-4ssd") {
    hw.device_memory = 94'000'000'000ull;
    hw.ssd_count = 4;
    hw.ssd_write_bw = 6.5e9;
    hw.ssd_read_bw = 6.7e9;
    hw.host_link_bw = 55e9;               // PCIe Gen5 x16: 64 GB/s raw, about 55 GB/s achieved
    hw.host_memory = 768'000'000'000ull;  // half of the 1.5 TB host of two GPUs
    hw.gpu_link_bw = 300e9;               // NVLink bridge of an H100 NVL pair: 600 GB/s both ways
    hw.gpu_flops = 60e12;                 // fp32 without TF32 (PyTorch's default for matmul)
    hw.gpu_flops_bf16 = 835e12;           // H100 NVL dense bf16 (1,671 with sparsity)
    hw.gpu_mem_bw = 3.9e12;
    hw.cpu_adam_rate = 2e9;
    hw.cpu_accumulate_rate = 6e9;
    hw.ssd_tbw = 1200e12;
  } else if (name == "a100-2ssd") {
    hw.device_memory = 80ull * kGiB;
    hw.ssd_count = 2;
    hw.ssd_write_bw = 3.0e9;
    hw.ssd_read_bw = 3.5e9;
    hw.host_link_bw = 25e9;
    hw.host_memory = 256ull * kGiB;
    hw.gpu_link_bw = 300e9;  // NVLink bridge of an A100 PCIe pair: 600 GB/s both ways
    hw.gpu_flops = 19.5e12;
    hw.gpu_flops_bf16 = 312e12;
    hw.gpu_mem_bw = 2.0e12;
    hw.cpu_adam_rate = 1e9;
    hw.cpu_accumulate_rate = 3e9;
    hw.ssd_tbw = 600e12;
  } else if (name == "cpu-here") {
    hw.device_memory = 0;  // must be given
    hw.ssd_count = 1;
    hw.ssd_write_bw = 2.0e9;
    hw.ssd_read_bw = 1.5e9;
    hw.host_link_bw = 10e9;  // memcpy within host memory
    hw.host_memory = 0;
    hw.gpu_flops = 50e9;
    hw.gpu_mem_bw = 10e9;
    hw.matmul_efficiency = 0.5;
    hw.op_overhead_s = 20e-6;
    hw.cpu_adam_rate = 0.2e9;
    hw.cpu_accumulate_rate = 0.6e9;
    hw.ssd_tbw = 600e12;
  } else {
    std::string names;
    for (const auto& n : hardware_preset_names()) names += (names.empty() ? "" : ", ") + n;
    TIDAL_EXPECT_AS(InvalidArgument, false, "unknown hardware preset '", name,
                    "'; choose one of: ", names);
  }
  return hw;
}

SsdSpec parse_ssd_spec(const std::string& text) {
  constexpr const char* kForm = "write <count>x<write>/<read>GB/s, e.g. 4x6.5/6.7GB/s";
  SsdSpec spec;
  const auto x = text.find_first_of("xX");
  TIDAL_EXPECT_AS(InvalidArgument, x != std::string::npos && x > 0, "'", text,
                  "' is not an SSD array; ", kForm);
  try {
    spec.count = std::stoi(text.substr(0, x));
  } catch (const std::exception&) {
    spec.count = 0;
  }
  TIDAL_EXPECT_AS(InvalidArgument, spec.count > 0 && spec.count <= 1024, "'", text,
                  "': the SSD count before 'x' must be a number from 1 to 1024; ", kForm);
  const std::string rest = text.substr(x + 1);
  // "6.5/6.7GB/s": the first '/' followed by a digit separates write from read.
  std::size_t slash = std::string::npos;
  for (std::size_t i = 0; i + 1 < rest.size(); ++i) {
    if (rest[i] == '/' &&
        (std::isdigit(static_cast<unsigned char>(rest[i + 1])) != 0 || rest[i + 1] == '.')) {
      slash = i;
      break;
    }
  }
  // Each figure parsed on its own, so that a message names the one that is wrong.
  const auto figure = [&](const std::string& part, const char* which) {
    try {
      return parse_bandwidth(part);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::concat("'", text, "': the ", which, " bandwidth '", part,
                                           "' is not a bandwidth (", e.what(), "); ", kForm));
    }
  };
  if (slash == std::string::npos) {
    spec.write_bw = spec.read_bw = figure(rest, "write and read");
  } else {
    const std::string first = rest.substr(0, slash);
    const std::string second = rest.substr(slash + 1);
    spec.read_bw = figure(second, "read");
    // The unit of the second figure applies to a first one without a unit ("6.5/6.7GB/s").
    const bool first_has_unit = first.find_first_not_of("0123456789.eE+- ") != std::string::npos;
    std::size_t unit_at = second.find_first_not_of("0123456789.eE+- ");
    if (unit_at == std::string::npos) unit_at = second.size();
    spec.write_bw = figure(first_has_unit ? first : first + second.substr(unit_at), "write");
  }
  // 1 MB/s to 1 TB/s per drive: outside that, a typo (a unit, an exponent), not an SSD.
  const auto check = [&](double bw, const char* which) {
    TIDAL_EXPECT_AS(InvalidArgument, bw >= 1e6 && bw <= 1e12, "'", text, "': the ", which,
                    " bandwidth of each SSD is ", format_bandwidth(bw),
                    "; it must be from 1MB/s to 1TB/s (tidal bench-io measures it); ", kForm);
  };
  if (slash == std::string::npos) {
    check(spec.write_bw, "write and read");
  } else {
    check(spec.write_bw, "write");
    check(spec.read_bw, "read");
  }
  return spec;
}

namespace {

template <class T>
void set_if(T& field, const std::optional<T>& value, bool& any) {
  if (!value) return;
  field = *value;
  any = true;
}

void set_rate_if(double& field, const std::optional<double>& value, const char* what, bool& any) {
  if (!value) return;
  TIDAL_EXPECT_AS(InvalidArgument, *value > 0, "the ", what, " must be positive, got ", *value);
  field = *value;
  any = true;
}

}  // namespace

void apply_overrides(Hardware& hw, const HardwareOverrides& o) {
  bool any = false;
  // 0 is a size given, not one left out: said as such, not as an unknown memory.
  TIDAL_EXPECT_AS(InvalidArgument, !o.device_memory || *o.device_memory > 0,
                  "a device memory of 0 bytes is not a valid size; give one above 0 (e.g. 8 GiB)");
  set_if(hw.device_memory, o.device_memory, any);
  if (o.ssd) {
    TIDAL_EXPECT_AS(InvalidArgument, o.ssd->count > 0 && o.ssd->write_bw > 0 && o.ssd->read_bw > 0,
                    "the SSD array needs at least one SSD and positive bandwidths");
    hw.ssd_count = o.ssd->count;
    hw.ssd_write_bw = o.ssd->write_bw;
    hw.ssd_read_bw = o.ssd->read_bw;
    any = true;
  }
  set_if(hw.host_memory, o.host_memory, any);
  set_rate_if(hw.host_link_bw, o.host_link_bw, "host link bandwidth", any);
  set_rate_if(hw.gpu_link_bw, o.gpu_link_bw, "GPU link bandwidth", any);
  set_rate_if(hw.gpu_flops, o.gpu_flops, "matmul rate", any);
  set_rate_if(hw.gpu_flops_bf16, o.gpu_flops_bf16, "bf16 matmul rate", any);
  set_rate_if(hw.gpu_mem_bw, o.gpu_mem_bw, "device memory bandwidth", any);
  set_rate_if(hw.cpu_adam_rate, o.cpu_adam_rate, "CPU Adam rate", any);
  set_rate_if(hw.cpu_accumulate_rate, o.cpu_accumulate_rate, "CPU gradient accumulation rate", any);
  set_rate_if(hw.ssd_tbw, o.ssd_tbw, "SSD endurance", any);
  if (o.memory_margin) {
    TIDAL_EXPECT_AS(InvalidArgument, *o.memory_margin >= 0 && *o.memory_margin < 0.5,
                    "the memory margin must be in [0, 0.5), got ", *o.memory_margin);
    hw.memory_margin = *o.memory_margin;
    any = true;
  }
  if (any && hw.name.find('+') == std::string::npos) hw.name += "+overrides";
  TIDAL_EXPECT_AS(InvalidArgument, hw.device_memory > 0, "the device memory of hardware '", hw.name,
                  "' is unknown; give it (e.g. 8 GiB)");
}

}  // namespace tidal::plan
