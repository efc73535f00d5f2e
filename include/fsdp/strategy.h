#pragma once
// The sharding strategies. Plain C++, no LibTorch, so the estimator (fsdp-estimate)
// takes the same enum as ShardingOptions.

namespace fsdp {

/// How parameters, gradients and optimizer state are split over ranks.
enum class ShardingStrategy {
  kFullShard,    ///< ZeRO-3: parameters gathered for forward, freed, gathered again for backward
  kShardGradOp,  ///< ZeRO-2: parameters stay gathered from forward through backward
  kNoShard,      ///< data parallel: parameters replicated, gradients all-reduced
  kHybridShard,  ///< FULL_SHARD inside groups of `hybrid_group_size`, replicated across groups
};

}  // namespace fsdp
