#pragma once
// Optimizer parameter groups by original parameter, over the flat shards
// (docs/design.md, "Parameter groups over flat shards").
//
// A unit's trainable parameters live in one flat fp32 shard per rank, so
// model.sharded_parameters() gives an optimizer one tensor per unit: one learning rate and
// one weight decay for all of a unit's parameters. ShardParamGroups splits each shard into
// segments, each a run of consecutive original parameters (or the parts of them this rank
// holds) that one rule puts in the same group. Each segment is a leaf tensor that is a view
// of its range of the shard, and after each backward its .grad() is a view of the same
// range of the gradient shard, so any torch::optim optimizer (AdamW, Adam, SGD) or
// fsdp::FusedAdamW steps the shard in place through them, with per-group options:
//
//   auto groups = fsdp::ShardParamGroups(model, fsdp::no_decay_groups(0.1));
//   torch::optim::AdamW opt(groups.param_groups(torch::optim::AdamWOptions(3e-4)));
//   // or: fsdp::FusedAdamW opt(groups, torch::optim::AdamWOptions(3e-4));
//
// Group g of the optimizer is group g of the spec on every rank and at every world size
// (empty where this rank holds none of its elements), so checkpoints save and restore the
// groups' hyperparameters by index, and the state (exp_avg, exp_avg_sq, step) of each
// segment lands in the shard's layout: it reshards like the state of a whole shard.

#include <fsdp/fully_sharded_module.h>

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

class ShardParamGroups;
namespace detail {
std::function<void()> shard_change_barrier_of(const ShardParamGroups& groups);
}  // namespace detail

/// One group's options. Unset fields take the optimizer's defaults (the options passed to
/// ShardParamGroups::param_groups).
struct GroupOptions {
  std::string name;                    ///< for messages and the group table ("decay", ...)
  std::optional<double> lr;            ///< learning rate
  std::optional<double> lr_scale;      ///< learning rate = the defaults' lr times this
  std::optional<double> weight_decay;  ///< weight decay
};

/// Which group an original parameter belongs to: an index into ParamGroupSpec::groups,
/// from its clean FQN and its original shape (ParamInfo::fqn, ParamInfo::shape).
using ParamGroupRule = std::function<size_t(const ParamInfo& param)>;

/// Groups and the rule that assigns each original parameter to one of them.
struct ParamGroupSpec {
  std::vector<GroupOptions> groups;
  ParamGroupRule rule;
};

/// The standard recipe: group 0 ("decay") takes `weight_decay`; group 1 ("no_decay") none:
/// biases (an FQN ending in "bias") and every parameter with fewer than 2 dimensions
/// (norm weights). With `embeddings_no_decay`, also parameters whose FQN contains
/// `embedding_substring` (e.g. "wte" or "embed").
ParamGroupSpec no_decay_groups(double weight_decay, bool embeddings_no_decay = false,
                               const std::string& embedding_substring = "embed");

/// One segment: elements [begin, begin + numel) of the trainable shard of flat parameter
/// `flat` (an index into the model's flat parameters), all in group `group`.
struct ShardSegment {
  size_t flat = 0;
  std::string unit_fqn;
  int64_t begin = 0;
  int64_t numel = 0;
  size_t group = 0;
  std::vector<std::string> fqns;  ///< the original parameters it covers (parts of them)
  torch::Tensor view;             ///< the leaf the optimizer steps: shard[begin, begin + numel)
};

/// Segments of every trainable shard of `model` on this rank, grouped by `spec`. Cheap to
/// copy (copies share the views). The model keeps the views' gradients up to date for as
/// long as it lives: when a backward ends, each view's .grad() becomes its range of the
/// gradient shard; when the next backward starts, a gradient shard whose views an
/// optimizer has set to none (zero_grad()) is dropped first, so the backward starts from
/// zero as with the shards themselves. (zero_grad(false) zeroes the shard in place.)
class ShardParamGroups {
 public:
  ShardParamGroups(const ShardedModel& model, ParamGroupSpec spec);

  /// torch::optim groups over the views: group g has spec group g's options over
  /// `defaults` (Options: torch::optim::AdamWOptions, AdamOptions or SGDOptions). Every
  /// group is present, also when empty on this rank.
  template <class Options>
  std::vector<torch::optim::OptimizerParamGroup> param_groups(const Options& defaults) const {
    std::vector<torch::optim::OptimizerParamGroup> out;
    for (size_t g = 0; g < num_groups(); ++g) {
      auto o = std::make_unique<Options>(defaults);
      const GroupOptions& go = group_options(g);
      if (go.lr) o->lr(*go.lr);
      if (go.lr_scale) o->lr(defaults.lr() * *go.lr_scale);
      if (go.weight_decay) o->weight_decay(*go.weight_decay);
      out.emplace_back(views(g), std::move(o));
    }
    return out;
  }

  size_t num_groups() const;
  const GroupOptions& group_options(size_t g) const;
  /// The leaves of group g on this rank, in unit order.
  std::vector<torch::Tensor> views(size_t g) const;
  /// Every segment on this rank, in unit order.
  const std::vector<ShardSegment>& segments() const;
  /// The group of the original parameter `fqn` (clean FQN); an error naming it otherwise.
  size_t group_of(const std::string& fqn) const;
  /// Elements of group g over the whole model (the original parameters' numel summed).
  int64_t group_numel(size_t g) const;
  /// Elements of group g in this rank's shards.
  int64_t local_group_numel(size_t g) const;
  /// One line per group: "group 0 'decay': 1234 elements, 5 parameters (lr 3e-4, weight_decay
  /// 0.1)".
  std::string describe(double default_lr, double default_weight_decay) const;
  /// The model's ShardingOptions::offload_optimizer: FusedAdamW over these groups keeps
  /// its state where it says (NVMe files included), as over the model itself.
  const OffloadConfig& offload_optimizer() const;
  /// The model's ShardingOptions::offload_param (with nvme, FusedAdamW streams the
  /// parameters through its buffer_bytes too).
  const OffloadConfig& offload_param() const;
  /// The model's ShardingOptions::process_group (FusedAdamW checks the free space of a
  /// disk its ranks share over it).
  const ProcessGroup& process_group() const;

 private:
  // The model's barrier before its shards change (Note [Background staging]), for
  // FusedAdamW over these groups.
  friend std::function<void()> detail::shard_change_barrier_of(const ShardParamGroups& groups);
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fsdp
