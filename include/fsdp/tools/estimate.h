#pragma once
// Per-rank memory estimate, term by term, device and host (fsdp-estimate). It follows
// the engine's real layout (src/engine/flat_param.cpp, src/engine/runtime.cpp): one flat parameter
// per unit padded to a multiple of the shard-group size, fp32 master shards and gradient shards,
// Adam's two fp32 moments, gathered units in param_dtype bounded by Note [Prefetch bound],
// ZeRO-1/2's persistent full parameters (and ZeRO-1's full gradients), and offload_optimizer /
// offload_param moving model state to the host or to NVMe files. Per rank, and per node.
// Plain C++; no LibTorch needed, so the tool starts at once.

#include <fsdp/strategy.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

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

// Its own (implicit) constructors and assignments copy the deprecated cpu_offload
// without a warning; a program that names the field gets one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
/// What the estimate needs to know about a run.
struct EstimateInput {
  /// Trainable parameters per unit, root unit first (the engine's flat parameters, in
  /// unit order). A unit with none (e.g. an empty root) is 0.
  std::vector<int64_t> unit_params;
  int world_size = 1;                                        ///< ranks in the job
  ShardingStrategy strategy = ShardingStrategy::kFullShard;  ///< ShardingOptions::strategy
  int hybrid_group_size = 0;               ///< kHybridShard: ranks per shard group (0: the world)
  Precision precision = Precision::kFp32;  ///< gathered parameters and reduced gradients
  /// Deprecated (goes in the next release), as ShardingOptions::cpu_offload: the same as
  /// offload_optimizer = offload_param = kCpu.
  [[deprecated(
      "EstimateInput::cpu_offload is deprecated: set offload_optimizer and offload_param to "
      "fsdp::OffloadDevice::kCpu")]] bool cpu_offload = false;
  /// ShardingOptions::offload_optimizer.device: the fp32 master shards, their gradients and
  /// AdamW's state on the host (kCpu), or the AdamW state in files and the rest on the host
  /// (kNvme); a param_dtype copy of each shard stays on the device unless offload_param.
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  /// ShardingOptions::offload_param.device: no param_dtype shard on the device; the fp32
  /// master shard (host memory for kCpu, files for kNvme) is cast and copied to the device
  /// before each gather. Needs offload_optimizer, and kFullShard or kHybridShard.
  OffloadDevice offload_param = OffloadDevice::kNone;
  /// OffloadConfig::buffer_bytes: host memory for chunks in flight, per NVMe offload.
  int64_t nvme_buffer_bytes = int64_t{64} << 20;
  /// Ranks (GPUs) per node, for the per-node figures; 0: every rank on one node.
  int gpus_per_node = 0;
  bool activation_checkpointing = false;  ///< every block checkpointed
  /// ShardingOptions::offload_activations: the checkpointed blocks' inputs in host memory
  /// (needs activation_checkpointing).
  bool offload_activations = false;
  /// MixedPrecision::master_dtype = kBFloat16 (pure bf16; needs Precision::kBf16): shards,
  /// gradient shards and AdamW's state in bf16, 8 bytes per sharded element instead of 16.
  bool pure_bf16 = false;
  int max_gathered_units = 2;  ///< ShardingOptions::max_gathered_units
  /// ShardingOptions::reshard_after_forward_group_size (hpZ): 0, or k dividing the shard
  /// group (1 < k < group) under kFullShard or kHybridShard.
  int reshard_after_forward_group_size = 0;
  /// ShardingOptions::quantized_communication (ZeRO++ qwZ and qgZ): whether the gathers
  /// and the reductions travel quantized, their bits (8 or 4) and the elements per scale.
  bool quantized_weights = false;
  bool quantized_gradients = false;
  int weight_bits = 8;
  int gradient_bits = 8;
  int64_t quantization_block = 2048;
  /// The model's shape and micro-batch, for activations (none by default, e.g. for a
  /// bare parameter count).
  TransformerShape activations;
};
#pragma GCC diagnostic pop

/// One term of the estimate, per rank.
struct MemoryTerm {
  std::string key;    ///< stable name: parameters, gradients, optimizer_state, ... (JSON, tests)
  std::string label;  ///< for people, e.g. "gathered units (bf16)"
  /// How the figure relates to the engine: "exact" (equals its counters), "bound" (its
  /// counter's peak never exceeds it), or "rough" (a formula; the engine counts nothing).
  std::string basis;
  int64_t device_bytes = 0;  ///< on the compute device
  int64_t host_bytes = 0;    ///< in host RAM (offloaded model state, staging)
  int64_t nvme_bytes = 0;    ///< in files under OffloadConfig::nvme_path
};

struct MemoryEstimate {
  /// In this order: parameters, gradients, optimizer_state, device_param_shards
  /// (offload_optimizer without offload_param only), gathered_units, full_gradients (kZero1
  /// only), post_forward_slices (reshard_after_forward_group_size only), comm_buffers,
  /// quantization_buffers (quantized_weights or quantized_gradients only),
  /// offload_buffers (any offload), nvme_buffers (NVMe offload only), activations.
  std::vector<MemoryTerm> terms;
  int shard_group_size = 1;         ///< ranks each flat parameter is split over
  int gpus_per_node = 1;            ///< ranks per node (EstimateInput::gpus_per_node, resolved)
  int nodes = 1;                    ///< world_size / gpus_per_node
  int64_t total_params = 0;         ///< sum of unit_params (unpadded)
  int64_t largest_unit_params = 0;  ///< largest unit, root included (unpadded)
  /// The peak while the model is built, before any gradient or optimizer state exists
  /// (not part of the totals). "construction_eager": the model built in full, then
  /// fully_shard: every parameter in fp32 on the host of every rank. "construction_sharded":
  /// fsdp::make_sharded: the fp32 shards (where the parameters term lives), plus the root
  /// unit's own parameters (built first, sharded last) and the largest other unit (the one
  /// being built) on the host (Note [Flatten in place]).
  std::vector<MemoryTerm> construction;
  /// Sums of the terms, per rank. Per node: times gpus_per_node (every rank alike).
  int64_t device_total() const;
  int64_t host_total() const;
  int64_t nvme_total() const;
  /// Parameters, gradients, optimizer state, the device parameter shards, gathered units and
  /// ZeRO-1's full gradients (DeepSpeed's "model states"): what a run holds between steps,
  /// and ZeRO-1's gradients at the end of backward, before activations and transient
  /// buffers. Per rank.
  int64_t model_states_device() const;
  int64_t model_states_host() const;
  int64_t model_states_nvme() const;
  /// The term with this key (throws std::invalid_argument if none).
  const MemoryTerm& term(const std::string& key) const;
};

/// Validates `in` (throws std::invalid_argument naming the value and the fix) and
/// estimates the per-rank memory.
MemoryEstimate estimate_memory(const EstimateInput& in);

/// One row of DeepSpeed's table (estimate_zero3_model_states_mem_needs_all_cold, or
/// ..._zero2_...), with DeepSpeed's own figures (its formula, additional_buffer_factor
/// included) beside this engine's for the same options.
struct DeepSpeedRow {
  OffloadDevice offload_param = OffloadDevice::kNone;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  /// DeepSpeed's zero.Init (the model built sharded): here fsdp::make_sharded; otherwise
  /// the model built in full on every rank, then fully_shard. Always false for stage 2.
  bool zero_init = false;
  int64_t deepspeed_cpu_bytes = 0;  ///< DeepSpeed's "per CPU": host bytes per node
  int64_t deepspeed_gpu_bytes = 0;  ///< DeepSpeed's "per GPU"
  /// This engine: the host peak per node over construction and training (model states,
  /// gpus_per_node ranks), the device model states per rank, NVMe bytes per node.
  int64_t host_per_node = 0;
  int64_t device_per_gpu = 0;
  int64_t nvme_per_node = 0;
  /// The two parts of host_per_node: model states in training, and construction's peak
  /// (construction_sharded with zero_init, construction_eager without), per node.
  int64_t host_states_per_node = 0;
  int64_t host_construction_per_node = 0;
};

/// DeepSpeed's table for `in` (its stage from in.strategy: kFullShard is stage 3, with rows
/// offload_param x offload_optimizer x zero_init; kZero2 and kZero1 get stage 2's rows,
/// offload_optimizer cpu and none; DeepSpeed has no estimator for stage 1). DeepSpeed's
/// inputs: total_params (the sum of the units), largest_layer_params (the largest unit),
/// num_gpus_per_node and num_nodes. Throws std::invalid_argument for other strategies.
/// `stage` is set to 3 or 2.
std::vector<DeepSpeedRow> deepspeed_table(const EstimateInput& in, int* stage = nullptr,
                                          double additional_buffer_factor = 1.5);

/// Pipeline stages (fsdp::pipeline, train_gpt --pipeline-stages) for estimate_pipeline.
struct PipelineShape {
  int stages = 1;           ///< PipelineOptions::stages; the world size is a multiple
  int micro_batches = 0;    ///< PipelineOptions::micro_batches; 0: 2 x stages (train_gpt's)
  bool gpipe = false;       ///< GPipe: every micro-batch's activations at once; else 1F1B
  bool reduce_once = true;  ///< PipelineOptions::reduce_once
  std::string partition = "parameters";  ///< PipelineOptions::partition
};

/// The layer boundaries a partition asks for (PipelineOptions::partition: "parameters",
/// "uniform", or the first layer of each stage after the first, "3,6,9"): stages + 1
/// values from 0 to the number of layers, each stage at least one layer. `layer_params`:
/// each layer's parameter count. Errors (std::invalid_argument) name the value, as
/// `stages_name` and `partition_name` call them, and the fix.
std::vector<int64_t> pipeline_partition(
    const std::vector<int64_t>& layer_params, int stages, const std::string& partition,
    const std::string& stages_name = "PipelineOptions::stages=",
    const std::string& partition_name = "PipelineOptions::partition=");

/// One stage's estimate: its ranks' memory.
struct StageEstimate {
  int stage = 0;                            ///< its index, 0 first
  int64_t first_layer = 0, last_layer = 0;  ///< the layers [first, last) it holds
  int micro_batches_in_flight = 1;  ///< most micro-batches whose activations it holds at once
  MemoryEstimate memory;            ///< per rank of the stage
};

/// Per-stage memory of a pipelined run. `in.unit_params` are the pipeline's layers in
/// order (each one unit, behind shard_sequential's wrap points; the stage's root holds
/// none); `in.world_size` is the job's, and each stage shards over world / stages ranks.
/// `in.activations` describes one micro-batch of one data-parallel replica, its n_layer
/// blocks being layers 1 .. n_layer between the embeddings (layer 0) and the head (the
/// last layer), as the GPT's pipeline layers are: a stage's activation term counts its
/// own blocks (the logits on the last stage only), times the micro-batches in flight
/// (1F1B: stages - stage, at most micro_batches; GPipe: micro_batches). With reduce_once
/// and more than one micro-batch, a stage holds all its units' full parameters
/// (param_dtype) and unsharded gradients (reduce dtype) from its first backward to its
/// last: the terms stage_full_parameters and stage_full_gradients. Throws
/// std::invalid_argument naming the value and the fix.
std::vector<StageEstimate> estimate_pipeline(const EstimateInput& in, const PipelineShape& p);

}  // namespace fsdp
