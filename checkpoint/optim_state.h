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

/// Hyperparameters of group `g` by name (lr, betas, eps, weight_decay, amsgrad, ...).
std::map<std::string, AttrValue> group_hparams(torch::optim::Optimizer& opt, size_t g);
/// Sets the hyperparameters that `hp` names on group `g`.
void set_group_hparams(torch::optim::Optimizer& opt, size_t g,
                       const std::map<std::string, AttrValue>& hp);

}  // namespace fsdp::ckpt
