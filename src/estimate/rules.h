#pragma once
// The rules the estimator's files share (estimate.cpp, pipeline.cpp).

#include <fsdp/strategy.h>

#include <fsdp/core/options.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fsdp::estimate_rules {

// Messages name the command-line flag too: fsdp-estimate passes them on as they are.
[[noreturn]] inline void bad(const std::string& msg) { throw std::invalid_argument(msg); }

inline int64_t round_up(int64_t n, int64_t g) { return (n + g - 1) / g * g; }

using core::precision_bytes;

}  // namespace fsdp::estimate_rules
