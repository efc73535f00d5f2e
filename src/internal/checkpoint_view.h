#pragma once
// The model view for checkpoint/ (model_view.h): gathers of a flat parameter, the host
// buffers an asynchronous save stages into, the barrier it registers (Note [Background
// staging]) and the tests' hook into a save.

#include "model_view.h"

#include <map>

namespace fsdp {

namespace detail {

/// Collective over the shard group (all its ranks call it): the full fp32 value
/// (unpadded numel elements) of flat parameter `index`, built from `shard_like`, this
/// rank's shard of it or of any state laid out like it (e.g. Adam's exp_avg). Counted
/// in MemoryStats::checkpoint_buffers while the returned tensor lives.
torch::Tensor gather_flat(const ShardedModel& model, size_t index, const torch::Tensor& shard_like);
/// Adds `delta` bytes (negative: releases) to MemoryStats::checkpoint_staging.
void account_checkpoint_staging(const ShardedModel& model, int64_t delta);
/// The host buffers `model`'s last asynchronous save staged into, by what they held
/// ("flat_3/param", ...), kept for the next save to copy into (SaveOptions::keep_staging);
/// counted in MemoryStats::checkpoint_staging. The model owns them: they go with it.
std::map<std::string, torch::Tensor>& checkpoint_staging_pool(const ShardedModel& model);
/// Tests only: called by a save of `model` with (step, what): ("write", the rank file)
/// before it is written (by an asynchronous save in its thread), on rank 0 with
/// ("publish", the checkpoint directory), and by an asynchronous save with ("stage", the
/// buffer's key) before each staging copy. A throw there fails that step as running out
/// of memory or a disk error would. The model's runtime holds it, as it holds the shard
/// change barrier: no other model, and no other test in the process, sees it. Empty: none.
void set_save_hook(const ShardedModel& model,
                   std::function<void(const std::string&, const std::string&)> hook);
/// Calls `model`'s save hook, if it has one (the checkpoint code, before each step of a save).
void call_save_hook(const ShardedModel& model, const char* step, const std::string& what);

/// Sets what must run before `model`'s shards or an optimizer's state over them change:
/// an asynchronous save's background staging waits there (Note [Background staging]).
/// The model's runtime owns it and runs it at the end of every backward (last, once the
/// gradients are reduced). Empty: nothing.
void set_shard_change_barrier(const ShardedModel& model, std::function<void()> barrier);

}  // namespace detail
}  // namespace fsdp
