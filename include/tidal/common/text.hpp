// Text helpers for options given as lists.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tidal {

/// Splits "a,b,,c" at `separator` into {"a", "b", "c"}: empty items (doubled or trailing
/// separators) are dropped, and no other character is treated specially.
std::vector<std::string> split_list(std::string_view text, char separator = ',');

}  // namespace tidal
