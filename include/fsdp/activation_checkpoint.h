#pragma once
// Activation checkpointing for LibTorch (pytorch/pytorch#52744): trade recompute for
// activation memory. (Saving training state to disk is <fsdp/checkpoint.h>.)

#include <fsdp/stats.h>

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace fsdp {

/// How a checkpointed region keeps the inputs it saves for backward.
struct ActivationCheckpointOptions {
  /// Activation offload (FSDP1's offload_wrapper, DeepSpeed's cpu_checkpointing): the
  /// saved inputs are copied to host memory (pinned, asynchronously, when they are on a
  /// GPU) and the device copies are dropped; backward copies them back when the region's
  /// backward starts, and starts copying the inputs of the region whose backward comes
  /// next (the one checkpointed just before it in forward) right after. On a CPU device
  /// the host copy is an explicit copy that backward uses as it is.
  bool offload_inputs = false;
  /// If set, counts the host bytes of offloaded inputs, from forward until the graph that
  /// holds them is freed (ShardedModel's MemoryStats::offloaded_activations).
  stats::MemoryCounter* host_counter = nullptr;
};

/// A region to checkpoint: tensors in, tensors out. Non-tensor arguments are captured
/// by the callable.
using ActivationCheckpointFn =
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs fn(inputs) without keeping its intermediate activations (only the inputs are
/// saved). Backward recomputes fn with gradients enabled, under the RNG state that the
/// forward saw (CPU, and CUDA for CUDA inputs), so dropout draws the same masks, then
/// back-propagates through the recomputed graph. Gradients reach fn's parameters as
/// usual. Inputs or outputs that do not require grad, several of each, and nested
/// checkpoints are supported; a second backward with retain_graph recomputes again.
/// Double backward (create_graph=true) through a region is rejected with an error.
std::vector<torch::Tensor> activation_checkpoint(const ActivationCheckpointFn& fn,
                                                 const std::vector<torch::Tensor>& inputs);

/// As above, with the saved inputs kept as `options` says.
std::vector<torch::Tensor> activation_checkpoint(const ActivationCheckpointFn& fn,
                                                 const std::vector<torch::Tensor>& inputs,
                                                 const ActivationCheckpointOptions& options);

/// One tensor in, one out.
torch::Tensor activation_checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                    const torch::Tensor& input,
                                    const ActivationCheckpointOptions& options = {});

/// How many times backward has recomputed a checkpointed region in this process, on any
/// thread (ShardingOptions::checkpoint_policy wraps each wrap point it picks in one).
int64_t activation_recomputes();

// The names before 0.x (CHANGELOG.md): "checkpoint" meant two things, recomputation here
// and saving to disk in <fsdp/checkpoint.h>. They stay one release, deprecated.
using CheckpointOptions [[deprecated("renamed fsdp::ActivationCheckpointOptions")]] =
    ActivationCheckpointOptions;
using CheckpointFn [[deprecated("renamed fsdp::ActivationCheckpointFn")]] = ActivationCheckpointFn;
[[deprecated("renamed fsdp::activation_checkpoint")]] inline std::vector<torch::Tensor> checkpoint(
    const ActivationCheckpointFn& fn, const std::vector<torch::Tensor>& inputs) {
  return activation_checkpoint(fn, inputs);
}
[[deprecated("renamed fsdp::activation_checkpoint")]] inline std::vector<torch::Tensor> checkpoint(
    const ActivationCheckpointFn& fn, const std::vector<torch::Tensor>& inputs,
    const ActivationCheckpointOptions& options) {
  return activation_checkpoint(fn, inputs, options);
}
[[deprecated("renamed fsdp::activation_checkpoint")]] inline torch::Tensor checkpoint(
    const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& input,
    const ActivationCheckpointOptions& options = {}) {
  return activation_checkpoint(fn, input, options);
}

}  // namespace fsdp
