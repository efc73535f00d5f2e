// Offline consolidation and inspection, as the library's calls (<fsdp/checkpoint.h>): what
// fsdp-consolidate and fsdp-inspect run (checkpoint/offline), reached from a program.
#include "export.h"

#include "../offline/offline.h"

#include <fsdp/checkpoint.h>

namespace fsdp {

void ckpt::consolidate_checkpoint(const std::string& sharded, const std::string& out_file,
                                  const ckpt::ConsolidateOptions& options) {
  if (options.format == ckpt::WeightsFormat::kSafetensors) {
    TORCH_CHECK(!options.with_optimizer,
                "consolidate_checkpoint: safetensors holds weights only; "
                "with_optimizer needs the HDF5 format");
    ckpt::consolidate_offline_safetensors(sharded, out_file, ckpt::export_dtype(options.dtype),
                                          options.max_shard_size, options.progress,
                                          {options.name_for, options.transpose});
    return;
  }
  ckpt::consolidate_offline(sharded, out_file, ckpt::export_dtype(options.dtype),
                            options.with_optimizer, options.progress);
}

std::string ckpt::inspect_checkpoint(const std::string& path, bool verify) {
  return ckpt::inspect(path, verify);
}

}  // namespace fsdp
