#pragma once
// The parts of a sharded checkpoint's rank file besides its flat parameters (layout in
// layout.h): each part's writer and reader side by side, so that a change to one is made
// to both. The rank file's writer (snapshot.cpp) and the load (sharded_load.cpp) call
// them in the file's order.

#include "../format/layout.h"

#include <fsdp/checkpoint.h>

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::ckpt {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// /optimizer/group_<g>: each optimizer param group's hyperparameters (lr, betas, ...).
void write_optimizer_groups(hid_t file,
                            const std::vector<std::map<std::string, ckpt::AttrValue>>& groups,
                            const std::string& path);
/// Sets them on `opt`, whose param groups must be as many; `what` names the checkpoint.
void read_optimizer_groups(hid_t file, const std::string& path, torch::optim::Optimizer& opt,
                           const std::string& what);

/// /state (step; groups scheduler, extra, loss_scaler) and /model_attrs.
void write_training_state(hid_t file, const ckpt::TrainingState& state, const std::string& path);
ckpt::TrainingState read_training_state(hid_t file, const std::string& path);

/// /rng/cpu, /rng/cuda_<i>: this process's default generators, as copies.
NamedTensors capture_rng();
void write_rng(hid_t file, const NamedTensors& rng, const std::string& path);
/// Sets this process's generators from the file (CUDA ones the file holds and this
/// machine has).
void restore_rng(hid_t file, const std::string& path);

/// /buffers/<fqn>: module buffers, each stored losslessly (rank 0's file).
void write_buffers(hid_t file, const NamedTensors& buffers, const std::string& path);
/// Loads each buffer of `module` the file holds; the names the file lacks go to
/// `missing` and those the module lacks to `unexpected`. A file without /buffers loads
/// and reports nothing.
void read_buffers(hid_t file, const std::string& path, const torch::nn::Module& module,
                  std::vector<std::string>& missing, std::vector<std::string>& unexpected);

}  // namespace fsdp::ckpt
