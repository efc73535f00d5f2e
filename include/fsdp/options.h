#pragma once
// Options for fully_shard, as plain structs with their defaults.

#include <fsdp/process_group.h>
#include <fsdp/strategy.h>
#include <fsdp/wrap_policy.h>

#include <torch/torch.h>

#include <optional>
#include <string>

namespace fsdp {

/// Mixed precision over fp32 master weights. The shards, and the optimizer, stay fp32
/// unless master_dtype says otherwise (pure bf16).
struct MixedPrecision {
  /// dtype of the gathered parameters: compute and all-gather.
  torch::Dtype param_dtype = torch::kFloat32;
  /// dtype in which gradients are reduced across ranks; gradients land in the shards'
  /// dtype (master_dtype).
  torch::Dtype reduce_dtype = torch::kFloat32;
  /// dtype of the shards the optimizer steps (the master weights) and of their gradients.
  /// kBFloat16 is pure bf16 (FSDP users with little memory): no fp32 copy of anything, 2
  /// bytes per parameter for the shard and 2 for its gradient, and bf16 optimizer state
  /// from torch's optimizers (fsdp::FusedAdamW adds stochastic rounding or a Kahan
  /// compensation buffer: FusedAdamW::set_bf16_rounding). param_dtype must then be
  /// kBFloat16 too. Checkpoints store the values in fp32 as always, so they load into
  /// either kind of run.
  torch::Dtype master_dtype = torch::kFloat32;
  /// If set, floating-point buffers (not sharded; every rank keeps them) are cast to
  /// this dtype when sharding.
  std::optional<torch::Dtype> buffer_dtype = std::nullopt;
  /// Cast floating-point forward inputs of each unit to param_dtype.
  bool cast_forward_inputs = true;
  /// If set, the root's floating-point output is cast to this dtype (e.g. fp32 logits).
  std::optional<torch::Dtype> output_dtype = std::nullopt;
  /// Wrap points this picks (e.g. module_type_policy<torch::nn::LayerNorm>()) become
  /// their own units kept in fp32: their inputs are cast to fp32 and their floating
  /// outputs back to param_dtype. Empty: none.
  wrap::WrapPolicy keep_fp32_policy = nullptr;
};

/// One of DeepSpeed's offload sections (`offload_optimizer`, `offload_param`); OffloadDevice
/// is in fsdp/strategy.h.
struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  /// kNvme: an existing, writable directory; each rank makes its own files in it.
  std::string nvme_path;
  /// On CUDA: page-locked host buffers, so copies run asynchronously.
  bool pin_memory = true;
  /// kNvme: host memory for chunks in flight (read ahead and write behind), bytes.
  int64_t buffer_bytes = int64_t{64} << 20;
};

/// ZeRO++'s quantized communication (DeepSpeed's zero_quantized_weights and
/// zero_quantized_gradients; its hpZ, zero_hpz_partition_size, is
/// ShardingOptions::reshard_after_forward_group_size). Values travel as int8 or int4 with
/// one symmetric scale per block of elements, and are dequantized on arrival; every
/// element comes back within half its block's scale. docs/design.md, "Quantized
/// communication".
struct QuantizedCommunication {
  /// qwZ: the training all-gathers from the shards carry the parameters quantized, and
  /// every rank computes with the dequantized values (its own shard's too). Gathers from
  /// the hpZ group's slices travel unquantized: they hold those values already. Exports
  /// and checkpoints never quantize.
  bool weights = false;
  /// qgZ: gradients are reduced through an all-to-all of quantized chunks, summed in fp32
  /// in rank order: deterministic for a world size. With reshard_after_forward_group_size
  /// = k (hpZ) it is hierarchical: inside each group of k ranks first, then across groups,
  /// so 1/k as much crosses nodes. Under kHybridShard (or kNoShard) the all-reduce across
  /// replicas is quantized too.
  bool gradients = false;
  int weight_bits = 8;    ///< 8 or 4
  int gradient_bits = 8;  ///< 8 or 4
  /// Elements per scale; blocks never cross a rank's part.
  int64_t block_size = 2048;
  /// kFloat32, or kBFloat16 (rounded up, so the error bound holds).
  torch::Dtype scale_dtype = torch::kFloat32;
};

// Its own (implicit) constructors and assignments copy the deprecated cpu_offload
// without a warning; a program that names the field gets one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
/// Everything fully_shard needs to know.
struct ShardingOptions {
  /// Which wrap points become units; the root is always a unit.
  wrap::WrapPolicy auto_wrap_policy = wrap::always_wrap_policy();
  /// See ShardingStrategy.
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  /// Group size for kHybridShard (ranks that share one full copy); 0 = whole world.
  int hybrid_group_size = 0;
  /// FSDP2's reshard_after_forward=int (ZeRO++ hpZ). 0: as `strategy` says. k > 1: after
  /// a training forward each non-root unit reshards to groups of k consecutive ranks
  /// (e.g. the ranks of one node) instead of freeing everything: every rank keeps a 1/k
  /// slice of the unit's full parameters in param_dtype (MemoryStats::post_forward_params),
  /// and backward all-gathers from its k-rank group (CommStats::reshard_group_all_gather_bytes)
  /// instead of the whole shard group. k must divide the shard group size and be smaller
  /// than it; for kFullShard and kHybridShard only.
  int reshard_after_forward_group_size = 0;
  /// ZeRO++'s qwZ and qgZ; nothing is quantized by default.
  QuantizedCommunication quantized_communication;
  /// The ranks to shard over; defaults to a single process.
  ProcessGroup process_group = ProcessGroup();
  /// Device on which gathered parameters live and compute runs.
  torch::Device device = torch::kCPU;
  /// Compute and communication dtypes.
  MixedPrecision mixed_precision = {};
  /// Gather the next unit while the current one computes (forward and backward).
  bool prefetch = true;
  /// Prefetching stops while this many non-root units are gathered (the computing one
  /// included). The root stays gathered from forward through backward; see
  /// Note [Prefetch bound] in src/engine/runtime.cpp.
  int max_gathered_units = 2;
  /// DeepSpeed's stage3_max_live_parameters: prefetching also stops before the non-root
  /// units gathered (the computing one included, persistent ones not) would hold more
  /// than this many parameter elements. 0: no such bound. The unit about to compute is
  /// gathered regardless.
  int64_t max_live_numel = 0;
  /// DeepSpeed's stage3_prefetch_bucket_size: at most this many parameter elements in
  /// gathers issued ahead (prefetches not yet waited for); the first prefetch always
  /// goes. 0: no such bound.
  int64_t prefetch_bucket_numel = 0;
  /// DeepSpeed's stage3_param_persistence_threshold: a unit holding fewer parameter
  /// elements than this keeps its full parameters between uses, as under kZero2 (Note
  /// [Persistent parameters]): gathered once, again only after a step changed it, and
  /// not counted by the prefetch bounds. 0: none.
  int64_t persistence_threshold_numel = 0;
  /// Wrap points whose forward runs under activation checkpointing (Tensor -> Tensor
  /// forwards): e.g. always_wrap_policy(), every_kth_policy(2), module_type_policy<...>().
  /// Empty: none. A unit's gather for backward happens before its recompute.
  wrap::WrapPolicy checkpoint_policy = nullptr;
  /// Activation offload: the inputs that checkpoint_policy's regions save for backward
  /// live in host memory (pinned on CUDA) instead of on `device`, and come back when
  /// their backward starts (ActivationCheckpointOptions::offload_inputs). Needs checkpoint_policy.
  bool offload_activations = false;
  /// Broadcast rank 0's initial weights while sharding, so every rank starts equal.
  bool sync_module_states = true;
  /// Deprecated (goes in the next release): the same as offload_optimizer.device =
  /// offload_param.device = OffloadDevice::kCpu, which is what the engine reads.
  [[deprecated(
      "ShardingOptions::cpu_offload is deprecated: set offload_optimizer.device and "
      "offload_param.device to fsdp::OffloadDevice::kCpu")]] bool cpu_offload = false;
  /// DeepSpeed's offload_optimizer: the fp32 master shards, their gradients and the
  /// optimizer state (and so its step) on the host (kCpu) or in files (kNvme); a
  /// param_dtype copy of each shard stays on `device` for the all-gathers, refreshed after
  /// each step. Step them with fsdp::FusedAdamW. With offload_param on the host too this
  /// is ZeRO-Offload (the host memory pinned on CUDA); on a CPU device the same path runs
  /// with host copies, so its bookkeeping (MemoryStats::offload_buffers) is exercised.
  OffloadConfig offload_optimizer;
  /// DeepSpeed's offload_param: the param_dtype shards also live off the device and are
  /// copied to it before each all-gather. Needs offload_optimizer (the fp32 master shard
  /// is the parameter here); kNvme needs a strategy that frees parameters (kFullShard,
  /// kHybridShard). kCpu under the others: no device copy of the shard between gathers.
  OffloadConfig offload_param;
  /// Before sharding, refuse (with the figures) when the host RAM the shards, gradients
  /// and Adam state will need on this node exceeds what the OS reports available
  /// (MemAvailable), instead of being killed by the OOM killer later. Applies when the
  /// shards live in host memory (offload_optimizer, or a CPU device).
  bool check_host_memory = true;
  /// A directory: each rank writes a Chrome-trace/Perfetto JSON of this model's units
  /// there (trace_rank<R>.json: every unit's all-gather, forward, backward, recompute and
  /// reduce-scatter by FQN, the optimizer step, checkpoint I/O and waits, on a compute and
  /// a communication track; `fsdp-trace merge DIR` joins the ranks). Empty: the FSDP_TRACE
  /// environment variable's directory, if set; otherwise nothing is traced. The same spans
  /// are LibTorch profiler ranges, so a Kineto trace shows them too.
  std::string trace;
};
#pragma GCC diagnostic pop

}  // namespace fsdp
