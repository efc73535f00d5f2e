#pragma once
// Gradient clipping by the global norm over all shards.

#include <fsdp/fully_sharded_module.h>

namespace fsdp {

/// Scales every gradient shard so that the norm of the whole model's gradient is at
/// most `max_norm`, and returns that norm before clipping. Every rank returns the same
/// value, equal to torch::nn::utils::clip_grad_norm_ on the unsharded model. Supports
/// norm_type 2 (L2) and infinity (std::numeric_limits<double>::infinity()). Collective:
/// every rank calls it, after backward and before the optimizer step.
double clip_grad_norm_(ShardedModel& model, double max_norm, double norm_type = 2.0);

}  // namespace fsdp
