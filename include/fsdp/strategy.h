#pragma once
// The sharding strategies, offload devices and precisions. Plain C++, no LibTorch, so the
// estimator (fsdp-estimate) takes the same enums as ShardingOptions.

#include <string>

namespace fsdp {

/// How parameters, gradients and optimizer state are split over ranks. The README's
/// "Memory modes" table maps each to DeepSpeed's, FSDP's and FairScale's names.
enum class ShardingStrategy {
  kFullShard,    ///< ZeRO-3: parameters gathered for forward, freed, gathered again for backward
  kShardGradOp,  ///< FSDP's SHARD_GRAD_OP: gathered once per step, kept from forward through
                 ///< backward, then freed
  kNoShard,      ///< data parallel (DeepSpeed stage 0, DDP): replicated, gradients all-reduced
  kHybridShard,  ///< FULL_SHARD inside groups of `hybrid_group_size`, replicated across groups
  /// DeepSpeed's ZeRO-2: full parameters in param_dtype persist on every rank between
  /// steps (gathered again only after the optimizer changed the shards); gradients are
  /// reduce-scattered into fp32 shards in backward; fp32 masters and optimizer state sharded.
  kZero2,
  /// ZeRO-1 (DeepSpeed stage 1, FairScale's OSS): as kZero2, and every rank also keeps the
  /// full unsharded gradients (reduce_dtype) between steps; only the fp32 masters, their
  /// gradient shards and the optimizer state are sharded.
  kZero1,
};

/// Where DeepSpeed's offload_optimizer / offload_param put their state.
enum class OffloadDevice {
  kNone,  ///< on ShardingOptions::device
  kCpu,   ///< host memory (pinned on CUDA when OffloadConfig::pin_memory)
  kNvme,  ///< files under OffloadConfig::nvme_path, read and written asynchronously
};

/// "none", "cpu" or "nvme" (defined with the estimator, which every fsdp library links).
const char* to_string(OffloadDevice d);

/// The dtype of gathered parameters and reduced gradients (MixedPrecision::param_dtype
/// and reduce_dtype); the shards and the optimizer stay fp32 either way. The one name for
/// a precision in the public API: the estimator's and the DeepSpeed config's.
enum class Precision {
  kFp32,  ///< 4 bytes per gathered element
  kBf16,  ///< 2 bytes
  kFp16,  ///< 2 bytes
};

/// "fp32", "bf16" or "fp16".
const char* to_string(Precision p);
/// The precision named "fp32", "bf16" or "fp16"; std::invalid_argument naming `name` and
/// the three choices otherwise.
Precision parse_precision(const std::string& name);

}  // namespace fsdp
