#pragma once
// What the offline tools (src/tools: fsdp-consolidate, fsdp-inspect) call in checkpoint/,
// without LibTorch: fsdp_ckpt_core implements it (offline.cpp, inspect.cpp). The public
// consolidate_checkpoint and inspect_checkpoint (<fsdp/checkpoint.h>) call the same.

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

/// Offline consolidation into one HDF5 file (fsdp-consolidate): no process group, one
/// parameter at a time.
void consolidate_offline(const std::string& sharded, const std::string& out_file, ExportDtype dtype,
                         bool with_optimizer, const Progress& progress);
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

/// Offline consolidation into safetensors (fsdp-consolidate --format safetensors): the
/// directory `out_dir` gets what export_safetensors writes from the live model with the
/// same layout, byte for byte, reading one parameter at a time.
void consolidate_offline_safetensors(const std::string& sharded, const std::string& out_dir,
                                     ExportDtype dtype, uint64_t max_shard_size,
                                     const Progress& progress, const Layout& layout = {});

/// Describes and verifies a sharded checkpoint directory or a consolidated file.
std::string inspect(const std::string& path, bool verify);

}  // namespace fsdp::ckpt
