#pragma once
// The model view: what the engine lends about a sharded model to the folders above it
// (checkpoint/, src/optim, src/train) and users never see (docs/design.md, "Public
// surface"): the flat-parameter view checkpoints are written from, the optimizer's
// copy-out, and the few calls the training helpers make. Implemented by
// src/engine/model_view.cpp; nothing here names an engine type.

#include <fsdp/fully_sharded_module.h>
#include <fsdp/process_group.h>

#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

class ShardParamGroups;

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

/// shard_sequential over the layers [first, last) that `make(i)` builds one at a time
/// (name and module), under sharded construction (make_sharded's ConstructionScope):
/// each layer shards as soon as it is built, so a rank holds its shards and the one
/// layer being built (src/engine/wrap_point.cpp; fsdp::pipeline's layer factory).
Sharded<torch::nn::Sequential> shard_layers_as_built(
    int64_t first, int64_t last,
    const std::function<std::pair<std::string, torch::nn::AnyModule>(int64_t)>& make,
    const ShardingOptions& options);

/// The error for a layer factory that made no module for layer `i` (named `name`).
void check_layer_made(const torch::nn::AnyModule& module, int64_t i, const std::string& name);

/// Every flat parameter, in unit order (root first, then units in module order).
std::vector<FlatParamInfo> flat_params(const ShardedModel& model);
/// Renames every original parameter (and alias) of `model` to `name(its clean FQN)`, for
/// checkpoints, state dicts and exports (a pipeline stage's layers under the whole
/// model's names, PipelineOptions::parameter_names). Names must stay distinct: an error
/// names the two that collide.
void rename_parameters(ShardedModel& model,
                       const std::function<std::string(const std::string&)>& name);
/// Every flat parameter's piece on this rank, in flat_params() order.
std::vector<LocalShard> local_shards(const ShardedModel& model);
/// Collective over the shard group (all its ranks call it): the full fp32 value
/// (unpadded numel elements) of flat parameter `index`, built from `shard_like`, this
/// rank's shard of it or of any state laid out like it (e.g. Adam's exp_avg). Counted
/// in MemoryStats::checkpoint_buffers while the returned tensor lives.
torch::Tensor gather_flat(const ShardedModel& model, size_t index, const torch::Tensor& shard_like);
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
/// Adds `delta` bytes (negative: releases) to MemoryStats::checkpoint_staging.
void account_checkpoint_staging(const ShardedModel& model, int64_t delta);
/// The host buffers `model`'s last asynchronous save staged into, by what they held
/// ("flat_3/param", ...), kept for the next save to copy into (SaveOptions::keep_staging);
/// counted in MemoryStats::checkpoint_staging. The model owns them: they go with it.
std::map<std::string, torch::Tensor>& checkpoint_staging_pool(const ShardedModel& model);
/// Tests only: called by a save with (step, what): ("write", the rank file) before it is
/// written (by an asynchronous save in its thread), on rank 0 with ("publish", the
/// checkpoint directory), and by an asynchronous save with ("stage", the buffer's key)
/// before each staging copy. A throw there fails that
/// step as running out of memory or a disk error would. Empty: none.
void set_save_hook(std::function<void(const std::string&, const std::string&)> hook);

// The training helpers' calls (src/train).
/// The gradient shards the trainable flat parameters hold (those defined), in unit order.
std::vector<torch::Tensor> grad_shards(const ShardedModel& model);
/// Calls `fn` with each gradient shard of grad_shards(), in that order: in memory as it is;
/// in a parameter file (Note [NVMe parameters]) read into a host buffer by O_DIRECT, and
/// written back after `fn` when `write`. One shard in memory at a time.
void visit_grad_shards(const ShardedModel& model, bool write,
                       const std::function<void(torch::Tensor&)>& fn);
/// Collective over the shard group: sums `tensor` (or takes the maximum) in place.
void shard_group_all_reduce(const ShardedModel& model, const torch::Tensor& tensor, bool max);
/// Gathers every unit's full parameters in unit order; without `keep`, each is freed
/// again right after its gather (ranks that only take part: FullParamsOptions::rank0_only).
void gather_units(const ShardedModel& model, bool keep);
/// Frees every unit's full parameters in unit order, first copying them into the fp32
/// shards with `writeback` (units not gathered are skipped), then waits for the copies
/// to the host shards (the caller may write them next).
void release_units(const ShardedModel& model, bool writeback);
/// Collective over the shard group: flat parameter `index`'s full fp32 value
/// (padded_numel elements), not counted in any MemoryStats counter.
torch::Tensor full_flat_fp32(const ShardedModel& model, size_t index);
/// One original parameter inside a flat parameter, with every name it has (a tensor
/// tied within one unit has several).
struct FlatSlot {
  std::vector<std::string> names;  ///< its clean FQN, then its aliases
  int64_t offset = 0;              ///< first element in the flat parameter
  int64_t numel = 0;
  std::vector<int64_t> shape;
};
/// Calls `f(true)` when each backward of `model` starts (before any gradient shard is
/// written) and `f(false)` when it has ended, for as long as the model lives.
void add_backward_observer(const ShardedModel& model, std::function<void(bool starting)> f);
/// Sets what must run before `model`'s shards or an optimizer's state over them change:
/// an asynchronous save's background staging waits there (Note [Background staging]).
/// The model's runtime owns it and runs it at the end of every backward (last, once the
/// gradients are reduced). Empty: nothing.
void set_shard_change_barrier(const ShardedModel& model, std::function<void()> barrier);
/// Runs `model`'s barrier for as long as the model lives (then nothing): what
/// FusedAdamW::step, import_consolidated and a FullParamsScope's writeback call before
/// they change the shards.
std::function<void()> shard_change_barrier_of(const ShardedModel& model);
/// The same, for the model `groups` were made over (FusedAdamW over ShardParamGroups).
std::function<void()> shard_change_barrier_of(const ShardParamGroups& groups);
/// The original parameters of flat parameter `index`, in slot order.
std::vector<FlatSlot> flat_slots(const ShardedModel& model, size_t index);

}  // namespace detail
}  // namespace fsdp
