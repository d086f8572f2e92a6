#include "tidal/common/text.hpp"

namespace tidal {

std::vector<std::string> split_list(std::string_view text, char separator) {
  std::vector<std::string> out;
  while (!text.empty()) {
    const auto end = text.find(separator);
    const auto item = text.substr(0, end);
    if (!item.empty()) out.emplace_back(item);
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  return out;
}

}  // namespace tidal
