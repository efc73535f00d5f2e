#pragma once
// Per-rank memory estimate, term by term, device and host (fsdp-estimate). It follows
// the engine's real layout: one flat parameter per unit padded to the shard-group
// size, fp32 master shards and gradient shards, Adam's two fp32 moments, gathered units
// in param_dtype bounded by Note [Prefetch bound], and offload moving model state to
// the host. No LibTorch needed.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

struct EstimateInput {
  /// Trainable parameters per unit, root unit first (the engine's flat parameters).
  std::vector<int64_t> unit_params;
  int world_size = 1;
  std::string strategy = "full";  ///< full | grad_op | none | hybrid
  int hybrid_group_size = 0;      ///< hybrid: ranks per shard group (0: the world)
  std::string precision = "fp32"; ///< fp32 | bf16 | fp16 (param_dtype of gathered units)
  bool cpu_offload = false;
  bool activation_checkpointing = false;
  int max_gathered_units = 2;     ///< ShardingOptions::max_gathered_units
  /// Activations: a GPT's shape and the per-rank micro-batch. Zero n_layer: no estimate.
  int64_t n_layer = 0, n_head = 0, d_model = 0, block_size = 0, vocab_size = 256, micro_batch = 0;
};

struct MemoryTerm {
  std::string name;
  int64_t device_bytes = 0;
  int64_t host_bytes = 0;
};

struct MemoryEstimate {
  std::vector<MemoryTerm> terms;  ///< parameters, gradients, optimizer state, gathered units, activations, ...
  int shard_group_size = 1;
  int64_t total_params = 0;
  int64_t device_total() const;
  int64_t host_total() const;
  /// The term called `name` (throws if none).
  const MemoryTerm& term(const std::string& name) const;
};

/// The units of the GPT in DESIGN section 6 wrapped per block: the root unit (wte, wpe,
/// ln_f, lm_head) first, then one unit per block.
std::vector<int64_t> gpt_unit_params(int64_t n_layer, int64_t d_model, int64_t block_size, int64_t vocab_size = 256);

/// Validates the input (throws std::invalid_argument naming the value and the fix)
/// and estimates.
MemoryEstimate estimate_memory(const EstimateInput& in);

}  // namespace fsdp
