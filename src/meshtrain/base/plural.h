// "1 thread", "2 threads": a count with its noun, for user-facing messages.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace mt {

// n and the noun, with "s" appended unless n is 1 (or -1).
inline std::string plural(int64_t n, std::string_view noun) {
  return fmt::format("{} {}{}", n, noun, n == 1 || n == -1 ? "" : "s");
}

}  // namespace mt
