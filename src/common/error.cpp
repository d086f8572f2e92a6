#include "tidal/common/error.hpp"

#include <cstring>

namespace tidal::detail {

std::string with_location(const std::string& msg, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  return concat(msg, " (at ", base != nullptr ? base + 1 : file, ":", line, ")");
}

void fail_syscall(const char* file, int line, const char* call, int errnum) {
  throw IoError(with_location(concat(call, " failed: ", std::strerror(errnum)), file, line),
                errnum);
}

}  // namespace tidal::detail
