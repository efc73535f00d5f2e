#pragma once
// The model view: what the engine lends about a sharded model to the folders above it
// and users never see (docs/design.md, "Public surface"), in narrow views, one per
// client: checkpoint_view.h (checkpoint/), optim_view.h (src/optim), train_view.h
// (src/train) and pipeline_view.h (src/pipeline). This header holds what several share:
// the flat parameters and this rank's pieces of them, and the barrier before the shards
// change. Implemented by src/engine/model_view.cpp; nothing here names an engine type.

#include <fsdp/fully_sharded_module.h>

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace fsdp {

/// One flat parameter of a unit (a unit has one for trainable, one for frozen params).
struct FlatParamInfo {
  std::string unit_fqn;                        ///< the owning unit ("" for the root)
  torch::Dtype param_dtype = torch::kFloat32;  ///< dtype of its gathered parameters
  bool requires_grad = true;                   ///< trainable (true) or frozen (false)
  int64_t numel = 0;                           ///< elements before padding
  int64_t padded_numel = 0;  ///< numel rounded up to a multiple of the shard group size
  int64_t shard_numel = 0;   ///< padded_numel / shard group size: elements each rank keeps
};

/// This rank's piece of one flat parameter, as checkpoint code sees it. The unpadded
/// flat parameter is split into `shard_group_size` equal chunks (the last ones padded);
/// ranks of other shard groups (HYBRID_SHARD, NO_SHARD) hold replicas of the same chunks.
struct LocalShard {
  FlatParamInfo info;
  int shard_group_size = 1;  ///< ranks the flat parameter is split over
  int shard_rank = 0;        ///< this rank's chunk index
  bool writer = true;        ///< first replica of its chunk: the one that saves it
  int64_t begin = 0;         ///< first element of the unpadded flat parameter held here
  int64_t length = 0;        ///< real (unpadded) elements held here; 0 when only padding
  torch::Tensor shard;       ///< the fp32 shard (shard_numel elements); the optimizer's parameter
  std::vector<ParamInfo> params;  ///< original parameters inside, aliases included
};

namespace detail {

/// Every flat parameter, in unit order (root first, then units in module order).
std::vector<FlatParamInfo> flat_params(const ShardedModel& model);
/// Every flat parameter's piece on this rank, in flat_params() order.
std::vector<LocalShard> local_shards(const ShardedModel& model);
/// Runs `model`'s barrier for as long as the model lives (then nothing): what
/// FusedAdamW::step, import_consolidated and a FullParamsScope's writeback call before
/// they change the shards.
std::function<void()> shard_change_barrier_of(const ShardedModel& model);

}  // namespace detail
}  // namespace fsdp
