#pragma once
// The model view for src/pipeline (model_view.h): stages built layer by layer under
// sharded construction, and their parameters renamed to the whole model's names.

#include "model_view.h"

#include <utility>

namespace fsdp {

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

/// Renames every original parameter (and alias) of `model` to `name(its clean FQN)`, for
/// checkpoints, state dicts and exports (a pipeline stage's layers under the whole
/// model's names, PipelineOptions::parameter_names). Names must stay distinct: an error
/// names the two that collide.
void rename_parameters(ShardedModel& model,
                       const std::function<std::string(const std::string&)>& name);

}  // namespace detail
}  // namespace fsdp
