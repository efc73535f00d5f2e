#pragma once
// Per-rank memory estimate, term by term, device and host (fsdp-estimate). It follows
// the engine's real layout (src/engine/flat_param.cpp, src/engine/runtime.cpp): one flat parameter
// per unit padded to a multiple of the shard-group size, fp32 master shards and gradient shards,
// Adam's two fp32 moments, gathered units in param_dtype bounded by Note [Prefetch bound], and
// cpu_offload moving the model state to the host. Plain C++; no LibTorch needed, so the tool starts
// at once.

#include <fsdp/strategy.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

/// The dtype of gathered parameters and reduced gradients (MixedPrecision::param_dtype
/// and reduce_dtype); the shards and the optimizer stay fp32 either way.
enum class Precision {
  kFp32,  ///< 4 bytes per gathered element
  kBf16,  ///< 2 bytes
  kFp16,  ///< 2 bytes
};

/// "fp32", "bf16" or "fp16".
const char* to_string(Precision p);

/// A decoder-only transformer of GPT-2-style blocks (attention, then a 4x MLP), for the
/// rough activation term. n_layer == 0 or micro_batch == 0: no activation estimate.
struct TransformerShape {
  int64_t n_layer = 0;      ///< blocks
  int64_t n_head = 0;       ///< attention heads
  int64_t d_model = 0;      ///< width
  int64_t block_size = 0;   ///< sequence length, in tokens
  int64_t vocab_size = 0;   ///< the logits' width
  int64_t micro_batch = 0;  ///< sequences per rank per micro-batch
};

/// What the estimate needs to know about a run.
struct EstimateInput {
  /// Trainable parameters per unit, root unit first (the engine's flat parameters, in
  /// unit order). A unit with none (e.g. an empty root) is 0.
  std::vector<int64_t> unit_params;
  int world_size = 1;                                        ///< ranks in the job
  ShardingStrategy strategy = ShardingStrategy::kFullShard;  ///< ShardingOptions::strategy
  int hybrid_group_size = 0;               ///< kHybridShard: ranks per shard group (0: the world)
  Precision precision = Precision::kFp32;  ///< gathered parameters and reduced gradients
  bool cpu_offload = false;                ///< ShardingOptions::cpu_offload
  bool activation_checkpointing = false;   ///< every block checkpointed
  int max_gathered_units = 2;              ///< ShardingOptions::max_gathered_units
  /// ShardingOptions::reshard_after_forward_group_size (hpZ): 0, or k dividing the shard
  /// group (1 < k < group) under kFullShard or kHybridShard.
  int reshard_after_forward_group_size = 0;
  /// The model's shape and micro-batch, for activations (none by default, e.g. for a
  /// bare parameter count).
  TransformerShape activations;
};

/// One term of the estimate, per rank.
struct MemoryTerm {
  std::string key;    ///< stable name: parameters, gradients, optimizer_state, ... (JSON, tests)
  std::string label;  ///< for people, e.g. "gathered units (bf16)"
  /// How the figure relates to the engine: "exact" (equals its counters), "bound" (its
  /// counter's peak never exceeds it), or "rough" (a formula; the engine counts nothing).
  std::string basis;
  int64_t device_bytes = 0;  ///< on the compute device
  int64_t host_bytes = 0;    ///< in host RAM (model state under cpu_offload)
};

struct MemoryEstimate {
  /// In this order: parameters, gradients, optimizer_state, gathered_units,
  /// post_forward_slices (reshard_after_forward_group_size only), comm_buffers,
  /// offload_buffers (cpu_offload only), activations.
  std::vector<MemoryTerm> terms;
  int shard_group_size = 1;         ///< ranks each flat parameter is split over
  int64_t total_params = 0;         ///< sum of unit_params (unpadded)
  int64_t largest_unit_params = 0;  ///< largest unit, root included (unpadded)
  /// The peak while the model is built, before any gradient or optimizer state exists
  /// (not part of the totals). "construction_eager": the model built in full, then
  /// fully_shard: every parameter in fp32 on the host of every rank. "construction_sharded":
  /// fsdp::make_sharded: the fp32 shards (where the parameters term lives), plus the root
  /// unit's own parameters (built first, sharded last) and the largest other unit (the one
  /// being built) on the host (Note [Flatten in place]).
  std::vector<MemoryTerm> construction;
  int64_t device_total() const;
  int64_t host_total() const;
  /// Parameters, gradients, optimizer state and gathered units (DeepSpeed's "model
  /// states"): what a run needs before activations and transient buffers.
  int64_t model_states_device() const;
  int64_t model_states_host() const;
  /// The term with this key (throws std::invalid_argument if none).
  const MemoryTerm& term(const std::string& key) const;
};

/// Validates `in` (throws std::invalid_argument naming the value and the fix) and
/// estimates the per-rank memory.
MemoryEstimate estimate_memory(const EstimateInput& in);

}  // namespace fsdp
