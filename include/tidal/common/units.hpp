// Sizes, bandwidths and durations as people write them: "64MiB", "2GB", "6.5GB/s", "1.5ms".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tidal {

inline constexpr std::uint64_t kKiB = 1024;
inline constexpr std::uint64_t kMiB = 1024 * kKiB;
inline constexpr std::uint64_t kGiB = 1024 * kMiB;
/// A transparent huge page on x86-64: memory advised onto them (madvise MADV_HUGEPAGE) is
/// aligned to and sized in these.
inline constexpr std::uint64_t kHugePage = 2 * kMiB;

/// Parse a byte count: a number with an optional unit B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB
/// (KB = 1000, KiB = 1024; a bare K/M/G/T is binary). Case-insensitive, spaces allowed,
/// fractions allowed ("1.5GiB"). At most 1 EiB (2^60). Throws tidal::InvalidArgument with a hint
/// on bad input and on a larger size.
std::uint64_t parse_bytes(std::string_view text);

/// Parse a bandwidth in bytes per second: "<size>/s", e.g. "6.5GB/s", "800MiB/s". A bare size
/// is accepted as per second. Throws tidal::InvalidArgument on bad input.
double parse_bandwidth(std::string_view text);

/// Parse a rate: a number with an optional SI prefix (k, M, G, T, P; any case) and an optional
/// "FLOP/s", "FLOPS" or "/s" suffix: "60T", "60TFLOPS", "2e9". Throws tidal::InvalidArgument on
/// bad input.
double parse_rate(std::string_view text);

/// Parse a duration in seconds: a number with an optional unit ns, us, ms, s, min, h.
double parse_seconds(std::string_view text);

/// Parse a percentage, "50%" or " 12.5 % ", as a fraction (0.5, 0.125): a number and a '%',
/// nothing else. Throws tidal::InvalidArgument on other text ("50xyz%", "50", "%"); the range
/// is the caller's to check.
double parse_percentage(std::string_view text);

/// "1.50 GiB", "512 B": binary units, three significant digits.
std::string format_bytes(double bytes);

/// "6.50 GB/s": decimal units, as drive makers and fio's GB/s quote them.
std::string format_bandwidth(double bytes_per_second);

/// "1.23 ms", "4.56 s".
std::string format_seconds(double seconds);

/// Round n up to a multiple of align (a power of two).
constexpr std::uint64_t align_up(std::uint64_t n, std::uint64_t align) {
  return (n + align - 1) & ~(align - 1);
}

}  // namespace tidal
