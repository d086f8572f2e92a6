// Errors at tidal's API: one exception family, thrown through macros that add file and line.
//
// Hot I/O loops return -errno and never throw; the boundary (a TensorStore call, a CLI command)
// turns a failure into a tidal::Error whose message says what went wrong and what to do.
#pragma once

#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace tidal {

/// Base of every exception tidal throws. what() is a sentence for a person, followed by
/// "(at file:line)" for the developer.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A system call or an I/O request failed. errnum() is the positive errno (EIO, ENOSPC, ...).
class IoError : public Error {
 public:
  IoError(const std::string& what, int errnum) : Error(what), errnum_(errnum) {}
  [[nodiscard]] int errnum() const noexcept { return errnum_; }

 private:
  int errnum_;
};

/// The input given by a user (a flag, a file, an option) is wrong.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

std::string with_location(const std::string& msg, const char* file, int line);

template <typename E, typename... Args>
[[noreturn]] void fail(const char* file, int line, Args&&... args) {
  throw E(with_location(concat(std::forward<Args>(args)...), file, line));
}

template <typename... Args>
[[noreturn]] void fail_io(const char* file, int line, int errnum, Args&&... args) {
  throw IoError(with_location(concat(std::forward<Args>(args)...), file, line), errnum);
}

[[noreturn]] void fail_syscall(const char* file, int line, const char* call, int errnum);

}  // namespace detail
}  // namespace tidal

/// Throw tidal::Error with the concatenated message unless cond holds. The message is built only
/// on failure.
#define TIDAL_EXPECT(cond, ...)                                                          \
  do {                                                                                   \
    if (!(cond)) ::tidal::detail::fail<::tidal::Error>(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/// Like TIDAL_EXPECT with a chosen exception type (e.g. tidal::InvalidArgument).
#define TIDAL_EXPECT_AS(Type, cond, ...)                                       \
  do {                                                                         \
    if (!(cond)) ::tidal::detail::fail<Type>(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/// Throw tidal::Error unconditionally.
#define TIDAL_FAIL(...) ::tidal::detail::fail<::tidal::Error>(__FILE__, __LINE__, __VA_ARGS__)

/// Throw an exception of the chosen type (e.g. tidal::InvalidArgument) unconditionally.
#define TIDAL_FAIL_AS(Type, ...) ::tidal::detail::fail<Type>(__FILE__, __LINE__, __VA_ARGS__)

/// Throw tidal::IoError carrying errnum (a positive errno value).
#define TIDAL_FAIL_IO(errnum, ...) \
  ::tidal::detail::fail_io(__FILE__, __LINE__, (errnum), __VA_ARGS__)

/// Evaluate a system call; when it returns a negative value, throw tidal::IoError with errno's
/// text. Evaluates to the call's result.
#define TIDAL_SYSCALL(call)                                                             \
  ([&]() {                                                                              \
    auto tidal_rc_ = (call);                                                            \
    if (tidal_rc_ < 0) ::tidal::detail::fail_syscall(__FILE__, __LINE__, #call, errno); \
    return tidal_rc_;                                                                   \
  }())
