// A count forced through the environment, read at every call (the tests flip it).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <optional>

namespace capsroute {

// A count forced through the environment variable `name` (an integer >= 1), or nullopt if unset.
inline std::optional<int64_t> forced_count(const char* name) {
  const char* forced = std::getenv(name);
  if (forced == nullptr) return std::nullopt;
  char* end = nullptr;
  const long long n = std::strtoll(forced, &end, 10);
  TORCH_CHECK(end != forced && *end == '\0' && n >= 1, "capsroute: ", name,
              " must be an integer >= 1, got '", forced, "'");
  return n;
}

}  // namespace capsroute
