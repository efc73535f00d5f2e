#pragma once
// What checkpoint files and their readers share, without LibTorch: the format version
// and the attribute value type. The offline tools (fsdp-consolidate, fsdp-inspect) are
// built on this and HDF5 alone, so they start fast and stay small in memory.

#include <cstdint>
#include <string>
#include <variant>

namespace fsdp {

/// Version of the file formats this build writes, and the newest it reads.
constexpr int64_t kCheckpointFormatVersion = 1;

/// A scalar attribute: model configuration values and the like.
using AttrValue = std::variant<int64_t, double, std::string>;

}  // namespace fsdp
