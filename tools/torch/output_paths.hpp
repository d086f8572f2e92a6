// The directories and files `tidal train` writes, checked before the run.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#include "tidal/common/error.hpp"

namespace tidal::cli {

// Makes `dir` (and its parents) a directory, or says which option names a path that cannot be.
inline void make_directory(const std::string& dir, const char* what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TIDAL_EXPECT_AS(InvalidArgument, !ec && std::filesystem::is_directory(dir), what, " '", dir,
                  "' cannot be made a directory: ",
                  ec ? ec.message() : std::string("a file of that name is in the way"),
                  " (give a directory you can write to)");
}

// Why `path` cannot be written at the end of the run, or "" when it can: its directory exists,
// is a directory and is writable, and the path is not a directory. Creates nothing: a probe
// file would be made at the target of a dangling symlink, and left there.
inline std::string why_not_writable(const std::string& path) {
  const std::filesystem::path p(path);
  if (p.filename().empty() || p.filename() == "." || p.filename() == "..") {
    return "it names a directory, not a file";
  }
  const std::string dir = p.parent_path().empty() ? std::string(".") : p.parent_path().string();
  std::error_code ec;
  const auto d = std::filesystem::status(dir, ec);
  if (!std::filesystem::exists(d)) return "its directory '" + dir + "' does not exist";
  if (!std::filesystem::is_directory(d)) return "'" + dir + "' is not a directory";
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return "its directory '" + dir + "' is not writable (" + std::strerror(errno) + ")";
  }
  if (std::filesystem::is_directory(std::filesystem::status(path, ec))) {
    return "it is a directory";
  }
  return "";
}

}  // namespace tidal::cli
