#pragma once
// The clipping of include/fsdp/clip_grad.h, with a step between the model's norm and the
// scaling: a pipeline's stages (src/pipeline) add up their norms there.

#include <fsdp/fully_sharded_module.h>

#include <ATen/ATen.h>

#include <functional>

namespace fsdp::detail {

/// clip_grad_norm_ over `model`, with `across(local, inf)` called on the norm reduced over
/// the model's shard group (a one-element double: the sum of squares, or with `inf` the
/// maximum) before the total and the scaling are taken from it; empty: nothing more.
double clip_grad_norm_across(ShardedModel& model, double max_norm, double norm_type,
                             const std::function<void(at::Tensor& local, bool inf)>& across);

}  // namespace fsdp::detail
