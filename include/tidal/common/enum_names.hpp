// One table of names per enum gives both directions: to_string and from_string.
//
//   constexpr EnumName<Tier> kTierNames[] = {{Tier::kSsd, "ssd"}, {Tier::kHost, "host"}};
//   const char* to_string(Tier t) { return enum_name(kTierNames, t); }
//   Tier tier_from_string(const std::string& s) { return enum_value(kTierNames, s, "tier"); }
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "tidal/common/error.hpp"

namespace tidal {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

/// The name of `value` in `table`; "?" for a value the table lacks.
template <class E, std::size_t N>
const char* enum_name(const EnumName<E> (&table)[N], E value) {
  for (const auto& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return "?";
}

/// The names of `table`, ", "-separated, in its order.
template <class E, std::size_t N>
std::string enum_names(const EnumName<E> (&table)[N]) {
  std::string names;
  for (const auto& entry : table) names += (names.empty() ? "" : ", ") + std::string(entry.name);
  return names;
}

/// The value named `name` in `table`. Throws tidal::InvalidArgument "unknown <what> '<name>';
/// choose one of: <names>" otherwise.
template <class E, std::size_t N>
E enum_value(const EnumName<E> (&table)[N], std::string_view name, const char* what) {
  for (const auto& entry : table) {
    if (name == entry.name) return entry.value;
  }
  TIDAL_FAIL_AS(InvalidArgument, "unknown ", what, " '", name,
                "'; choose one of: ", enum_names(table));
}

}  // namespace tidal

/// Defines `const char* to_string(E)` over a name table given as the remaining arguments,
/// e.g. TIDAL_ENUM_TO_STRING(Tier, {Tier::kSsd, "ssd"}, {Tier::kHost, "host"}); the table is
/// kNames_<E> in an unnamed namespace. Use at namespace scope, in the enum's namespace.
#define TIDAL_ENUM_TO_STRING(E, ...)                           \
  namespace {                                                  \
  constexpr ::tidal::EnumName<E> kNames_##E[] = {__VA_ARGS__}; \
  }                                                            \
  const char* to_string(E value) { return ::tidal::enum_name(kNames_##E, value); }

/// TIDAL_ENUM_TO_STRING and its inverse `E from_string(const std::string&)`, which throws
/// tidal::InvalidArgument naming `what` and listing the names.
#define TIDAL_ENUM_NAMES(E, from_string, what, ...) \
  TIDAL_ENUM_TO_STRING(E, __VA_ARGS__)              \
  E from_string(const std::string& name) { return ::tidal::enum_value(kNames_##E, name, what); }
