#pragma once
// The rules the estimator's files share (estimate.cpp, pipeline.cpp).

#include <fsdp/strategy.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fsdp::estimate_rules {

// Messages name the command-line flag too: fsdp-estimate passes them on as they are.
[[noreturn]] inline void bad(const std::string& msg) { throw std::invalid_argument(msg); }

inline int64_t round_up(int64_t n, int64_t g) { return (n + g - 1) / g * g; }

// Bytes per element of the gathered parameters and reduced gradients.
inline int64_t precision_bytes(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return 4;
    case Precision::kBf16:
    case Precision::kFp16:
      return 2;
  }
  bad("precision " + std::to_string(static_cast<int>(precision)) +
      " is not a Precision; use one of its enumerators");
}

}  // namespace fsdp::estimate_rules
