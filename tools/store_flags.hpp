// The store-directory flags of the torch-free commands (bench-io --dir, plan/simulate
// --measure-dir): comma-separated text parsed here, with the flag named in every error. The
// store checks the directories themselves (that they exist, are not in memory, are distinct).
#pragma once

#include <string>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"

namespace tidal::cli {

/// The directories of `text` ("/mnt/nvme0,/mnt/nvme1"). Throws tidal::InvalidArgument naming
/// `flag` when the text is empty or a name between commas is (an empty --dir would otherwise fall
/// back to TIDAL_DIRS or a default without a word).
inline std::vector<std::string> parse_dir_flag(const char* flag, const std::string& text) {
  const std::vector<std::string> dirs = split_list(text);
  std::size_t commas = 0;
  for (char c : text) commas += c == ',' ? 1 : 0;
  TIDAL_EXPECT_AS(InvalidArgument, !dirs.empty() && dirs.size() == commas + 1, flag, " '", text,
                  "' ", dirs.empty() ? "names no directory" : "has an empty name between commas",
                  "; give one directory per SSD, comma-separated (e.g. ", flag,
                  " /mnt/nvme0/tidal,/mnt/nvme1/tidal)");
  return dirs;
}

}  // namespace tidal::cli
