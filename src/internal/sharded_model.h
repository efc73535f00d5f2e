#pragma once
// What the engine and checkpoint/ share about a sharded model and a process group, and
// users never see (docs/design.md, "Public surface"): the engine objects behind the
// public handles, and the flat-parameter view that checkpoints are written from.

#include <fsdp/fully_sharded_module.h>
#include <fsdp/process_group.h>

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {
class Backend;
class Runtime;
class Unit;
}  // namespace detail

// The opaque types the public headers declare. Each engine object derives from one, so
// a public handle holds it without the public headers naming the engine.
class UnitCore {};
class ModelCore {};
class BackendCore {};

/// The engine's way into the public handles' private members.
struct EngineAccess {
  static detail::Unit* unit(const WrapPointImpl& wp);
  static void set_unit(WrapPointImpl& wp, std::shared_ptr<detail::Unit> unit);
  static void set_runtime(WrapPointImpl& wp, std::shared_ptr<detail::Runtime> runtime);
  static void set_casts(WrapPointImpl& wp, std::optional<torch::Dtype> inputs, std::optional<torch::Dtype> outputs);
  static void set_checkpointed(WrapPointImpl& wp, const std::string& fqn);
  /// The model's runtime; throws when the handle is empty.
  static detail::Runtime& runtime(const ShardedModel& model);
  static WrapPointImpl& root(const ShardedModel& model) { return model.root(); }
  static std::shared_ptr<detail::Backend> backend(const ProcessGroup& pg);
  static ProcessGroup make_group(std::shared_ptr<detail::Backend> backend);
};

/// One flat parameter of a unit (a unit has one for trainable, one for frozen params).
struct FlatParamInfo {
  std::string unit_fqn;       ///< the owning unit ("" for the root)
  torch::Dtype param_dtype = torch::kFloat32;  ///< dtype of its gathered parameters
  bool requires_grad = true;  ///< trainable (true) or frozen (false)
  int64_t numel = 0;          ///< elements before padding
  int64_t padded_numel = 0;   ///< numel rounded up to a multiple of the shard group size
  int64_t shard_numel = 0;    ///< padded_numel / shard group size: elements each rank keeps
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
/// Collective over the shard group (all its ranks call it): the full fp32 value
/// (unpadded numel elements) of flat parameter `index`, built from `shard_like`, this
/// rank's shard of it or of any state laid out like it (e.g. Adam's exp_avg). Counted
/// in MemoryStats::checkpoint_buffers while the returned tensor lives.
torch::Tensor gather_flat(const ShardedModel& model, size_t index, const torch::Tensor& shard_like);
/// Lets `optimizer` write each updated trainable shard, in param_dtype, in its update
/// pass (FusedAdamW::set_copy_out); the next gathers send that copy instead of
/// casting the shard, as long as the shard has not changed since. Only for 16-bit
/// param_dtype with shards on the CPU (CPU training or cpu_offload). Returns how many
/// flat parameters were attached.
int attach_copy_out(const ShardedModel& model, FusedAdamW& optimizer);
/// Gathers that used an optimizer's copy (attach_copy_out) instead of a cast.
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
/// Turns the tree under `root` into units; `root` becomes the root unit.
void shard_module_tree(const std::shared_ptr<WrapPointImpl>& root, const ShardingOptions& options);
/// Rebuilds `seq` with every entry behind a wrap point, keeping entry names.
torch::nn::Sequential wrap_sequential_entries(const torch::nn::Sequential& seq);

}  // namespace detail
}  // namespace fsdp
