#pragma once
// The vocabulary of exported weights, shared by the live exports (checkpoint/export), the
// offline tools (checkpoint/offline) and the layout (layout.h): their element type, the
// progress callback, and another framework's names and transposes for safetensors.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::ckpt {

/// The element type of exported weights.
enum class ExportDtype { kF32, kBF16, kF16 };

/// Called after each parameter with (done, total, its FQN).
using Progress = std::function<void(size_t, size_t, const std::string&)>;

/// Another framework's layout for safetensors (SafetensorsOptions::name_for, ::transpose):
/// the name each tensor is written under ("" leaves it out), and which 2-D ones are
/// written transposed. Unset: clean FQNs, as they are.
struct Layout {
  std::function<std::string(const std::string&)> name_for;
  std::function<bool(const std::string&)> transpose;
  /// How a transpose of a tensor that is not 2-D is reported: "<what> '<fqn>', which has
  /// N dimensions; only 2-D tensors transpose".
  std::string what = "consolidate_checkpoint: the layout transposes";

  /// The name `fqn` is written under ("" leaves it out).
  std::string name(const std::string& fqn) const;
  /// Whether `fqn` is written transposed; throws if it is picked and `shape` is not 2-D.
  bool transposed(const std::string& fqn, const std::vector<int64_t>& shape) const;
  /// `shape` as written.
  std::vector<int64_t> file_shape(const std::string& fqn, std::vector<int64_t> shape) const;
};

}  // namespace fsdp::ckpt
