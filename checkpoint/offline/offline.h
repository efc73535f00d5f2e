#pragma once
// What the offline tools (src/tools: fsdp-consolidate, fsdp-inspect) call in checkpoint/,
// without LibTorch: fsdp_ckpt_core implements it (offline.cpp, inspect.cpp). The public
// consolidate_checkpoint and inspect_checkpoint (<fsdp/checkpoint.h>) call the same.

#include "../format/weights.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::ckpt {

/// Offline consolidation into one HDF5 file (fsdp-consolidate): no process group, one
/// parameter at a time.
void consolidate_offline(const std::string& sharded, const std::string& out_file, ExportDtype dtype,
                         bool with_optimizer, const Progress& progress);
/// Offline consolidation into safetensors (fsdp-consolidate --format safetensors): the
/// directory `out_dir` gets what export_safetensors writes from the live model with the
/// same layout, byte for byte, reading one parameter at a time.
void consolidate_offline_safetensors(const std::string& sharded, const std::string& out_dir,
                                     ExportDtype dtype, uint64_t max_shard_size,
                                     const Progress& progress, const Layout& layout = {});

/// Describes and verifies a sharded checkpoint directory or a consolidated file.
std::string inspect(const std::string& path, bool verify);

}  // namespace fsdp::ckpt
