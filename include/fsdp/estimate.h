#pragma once
// Per-rank memory estimate, term by term, device and host (fsdp-estimate). It follows
// the engine's real layout (src/engine/flat_param.cpp, src/engine/runtime.cpp): one flat parameter
// per unit padded to a multiple of the shard-group size, fp32 master shards and gradient shards,
// Adam's two fp32 moments, gathered units in param_dtype bounded by Note [Prefetch bound], and
// cpu_offload moving the model state to the host. Plain C++; no LibTorch needed, so the tool starts
// at once.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

/// What the estimate needs to know about a run.
struct EstimateInput {
  /// Trainable parameters per unit, root unit first (the engine's flat parameters, in
  /// unit order). A unit with none (e.g. an empty root) is 0.
  std::vector<int64_t> unit_params;
  int world_size = 1;             ///< ranks in the job
  std::string strategy = "full";  ///< full | grad_op | none | hybrid (ShardingStrategy)
  int hybrid_group_size = 0;      ///< hybrid: ranks per shard group (0: the world)
  /// fp32 | bf16 | fp16: MixedPrecision::param_dtype and reduce_dtype (as train_gpt sets
  /// them); the shards and the optimizer stay fp32 either way.
  std::string precision = "fp32";
  bool cpu_offload = false;               ///< ShardingOptions::cpu_offload
  bool activation_checkpointing = false;  ///< every block checkpointed
  int max_gathered_units = 2;             ///< ShardingOptions::max_gathered_units
  /// Activations: a GPT's shape (docs/design.md, "Contracts") and the per-rank micro-batch in
  /// sequences. n_layer == 0 or micro_batch == 0: no activation estimate (e.g. --params).
  int64_t n_layer = 0, n_head = 0, d_model = 0, block_size = 0, vocab_size = 256, micro_batch = 0;
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
  /// comm_buffers, offload_buffers (cpu_offload only), activations.
  std::vector<MemoryTerm> terms;
  int shard_group_size = 1;         ///< ranks each flat parameter is split over
  int64_t total_params = 0;         ///< sum of unit_params (unpadded)
  int64_t largest_unit_params = 0;  ///< largest unit, root included (unpadded)
  int64_t device_total() const;
  int64_t host_total() const;
  /// Parameters, gradients, optimizer state and gathered units (DeepSpeed's "model
  /// states"): what a run needs before activations and transient buffers.
  int64_t model_states_device() const;
  int64_t model_states_host() const;
  /// The term with this key (throws std::invalid_argument if none).
  const MemoryTerm& term(const std::string& key) const;
};

/// Trainable parameters per unit of the GPT (docs/design.md, "Contracts") wrapped per block
/// (wrap=block): the root unit (wte, wpe, ln_f, lm_head) first, then one per block.
std::vector<int64_t> gpt_unit_params(int64_t n_layer, int64_t d_model, int64_t block_size,
                                     int64_t vocab_size = 256);

/// Validates `in` (throws std::invalid_argument naming the value and the fix) and
/// estimates the per-rank memory.
MemoryEstimate estimate_memory(const EstimateInput& in);

}  // namespace fsdp
