#pragma once
// The model view for src/train (model_view.h): the gradient shards clipping and loss
// scaling read, and the gathers and slots of full parameters.

#include "model_view.h"

namespace fsdp {

namespace detail {

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
/// The original parameters of flat parameter `index`, in slot order.
std::vector<FlatSlot> flat_slots(const ShardedModel& model, size_t index);

}  // namespace detail
}  // namespace fsdp
