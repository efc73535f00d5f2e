#pragma once
// The model view for src/optim (model_view.h): the copy-out targets FusedAdamW writes
// in its update pass, the backward observers ShardParamGroups keeps its views with, and
// the barrier over a ShardParamGroups' model.

#include "model_view.h"

#include <atomic>
#include <memory>

namespace fsdp {

class ShardParamGroups;

namespace detail {

/// A trainable shard an optimizer may write in param_dtype in its update pass
/// (FusedAdamW::set_copy_out): the shard, the copy the next gathers send instead of
/// casting the shard, and the cell where the writer records the shard's version right
/// after writing the copy (the gathers use the copy only while the versions agree).
struct CopyOutTarget {
  torch::Tensor shard;
  torch::Tensor copy;
  std::shared_ptr<std::atomic<int64_t>> version;
};
/// The model's copy-out targets: one per trainable flat parameter, only for 16-bit
/// param_dtype with shards on the CPU (CPU training or cpu_offload); none otherwise. The
/// optimizer registers them itself, so the engine knows no optimizer.
std::vector<CopyOutTarget> copy_out_targets(const ShardedModel& model);
/// Gathers that used an optimizer's copy (copy_out_targets) instead of a cast.
int64_t copy_out_gathers(const ShardedModel& model);
/// Calls `f(true)` when each backward of `model` starts (before any gradient shard is
/// written) and `f(false)` when it has ended, for as long as the model lives.
void add_backward_observer(const ShardedModel& model, std::function<void(bool starting)> f);
/// The same, for the model `groups` were made over (FusedAdamW over ShardParamGroups).
std::function<void()> shard_change_barrier_of(const ShardParamGroups& groups);

}  // namespace detail
}  // namespace fsdp
