#pragma once
// Reading and writing the per-parameter state of torch::optim's Adam, AdamW and SGD,
// which LibTorch keys by TensorImpl (its address).

#include <fsdp/checkpoint.h>

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::ckpt {

/// "adam", "adamw" or "sgd"; throws naming the type otherwise.
std::string optimizer_kind(torch::optim::Optimizer& opt);

/// One parameter's state: step count and named tensors laid out like the parameter.
struct ParamState {
  int64_t step = 0;
  std::vector<std::pair<std::string, at::Tensor>> tensors;  ///< e.g. exp_avg, exp_avg_sq
};

/// State of `param` (empty when the optimizer has not stepped it yet).
ParamState get_param_state(torch::optim::Optimizer& opt, const at::Tensor& param);
/// Replaces the state of `param` (creating it) with the tensors of `st`, taken as they are.
void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, ParamState&& st);
/// The optimizer's param group and position holding `param`, or {-1, -1}.
std::pair<int, int> find_param(torch::optim::Optimizer& opt, const at::Tensor& param);

/// The optimizer's parameters that are views of `shard` (fsdp::ShardParamGroups's
/// segments, or any leaf sharing its storage), each with its first element in the shard.
std::vector<std::pair<at::Tensor, int64_t>> shard_views(torch::optim::Optimizer& opt,
                                                        const at::Tensor& shard);
/// The param group holding `shard`, or else its first view; -1 when it holds neither.
int shard_group(torch::optim::Optimizer& opt, const at::Tensor& shard);
/// The error of `what` (save, load) when the optimizer holds no group for the shard of
/// `unit` (`group` < 0) that has elements (`length`).
void check_optimizer_holds(int group, int64_t length, const char* what, const std::string& unit);
/// The state of `shard` as the optimizer holds it, without copying: per state name, the
/// tensors that cover parts of the shard, each with its first element (one at 0 when the
/// optimizer holds the shard itself; elements none covers are zero; the step is the
/// largest of the views'). A rank whose views are all padding gets the names, no parts.
struct ShardStateParts {
  int64_t step = 0;
  std::vector<std::pair<std::string, std::vector<std::pair<int64_t, at::Tensor>>>> states;
};
ShardStateParts get_shard_state_parts(torch::optim::Optimizer& opt, const at::Tensor& shard);
/// The state of `shard` laid out like it: get_shard_state_parts put together.
ParamState get_shard_state(torch::optim::Optimizer& opt, const at::Tensor& shard);
/// Sets the state of `shard` (shard-sized tensors): the shard's own when the optimizer
/// holds it, else each view gets its range (views of `st`'s tensors) and the step.
void set_shard_state(torch::optim::Optimizer& opt, const at::Tensor& shard, ParamState&& st);

/// Hyperparameters of group `g` by name (lr, betas, eps, weight_decay, amsgrad, ...).
std::map<std::string, ckpt::AttrValue> group_hparams(torch::optim::Optimizer& opt, size_t g);
/// Sets the hyperparameters that `hp` names on group `g`.
void set_group_hparams(torch::optim::Optimizer& opt, size_t g,
                       const std::map<std::string, ckpt::AttrValue>& hp);

}  // namespace fsdp::ckpt
