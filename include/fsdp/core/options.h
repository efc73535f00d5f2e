#pragma once
// The options core (fsdp::core): the one place that names the sharding options and their values,
// checks them against each other and derives what follows from them (Note [Options
// core] in options.cpp). Plain C++, no LibTorch: the engine (fully_shard), the memory
// estimator, the DeepSpeed config reader, the trainers' flags and fsdp-estimate all call
// it, so a rule and its message are written once.
#include <fsdp/strategy.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::core {

/// Who the message is for: a program that set ShardingOptions' fields (kApi), or a user
/// who typed a command line (kFlags: train_gpt's, train_llama's and fsdp-estimate's
/// flags, which are the same names).
enum class Surface { kApi, kFlags };

/// Every option the rules below read.
enum class Option {
  kStrategy,
  kWorldSize,
  kHybridGroupSize,
  kHpzGroupSize,
  kOffloadOptimizer,
  kOffloadParam,
  kCpuOffload,
  kNvmeBufferBytes,
  kPrecision,
  kReduceDtype,
  kMasterDtype,
  kKeepFp32,
  kMaxGatheredUnits,
  kActivationCheckpointing,
  kOffloadActivations,
  kQuantizeWeightBits,
  kQuantizeGradientBits,
  kQuantizeBlock,
};

/// The option as `s` names it: "ShardingOptions::hybrid_group_size" or
/// "--hybrid-group-size".
std::string name(Option o, Surface s);

/// A strategy's name: the enumerator ("kFullShard") or the flag's value ("full").
const char* strategy_name(ShardingStrategy v, Surface s);
/// The strategy a --sharding value names (full, zero3, zero2, zero1, grad_op, none,
/// hybrid); std::invalid_argument naming `option` and the choices otherwise.
ShardingStrategy parse_strategy(const std::string& text, const std::string& option);
/// A precision's name: the dtype ("Float", "BFloat16", "Half") or the flag's value.
const char* precision_name(Precision v, Surface s);
/// The precision `text` names (fp32, bf16, fp16), for `o` as `s` names it, or for an
/// option of a reader's own (`option`: "--export-dtype").
Precision parse_precision(const std::string& text, Option o, Surface s);
Precision parse_precision(const std::string& text, const std::string& option, Surface s);
/// The offload device `text` names (none, cpu, nvme), for `o` as `s` names it.
OffloadDevice parse_offload(const std::string& text, Option o, Surface s);
/// The error for a dtype no rule takes (e.g. MixedPrecision::param_dtype = Double).
[[noreturn]] void unsupported_dtype(Option o, const std::string& dtype, Surface s);

/// The options the rules read, as plain values: each front end fills it from what it
/// holds (ShardingOptions, EstimateInput, the flags).
struct Options {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int world_size = 1;
  /// false where the world is not up yet (a trainer reading its flags): the rules that
  /// need its size wait for the engine, which checks them again with it.
  bool world_size_known = true;
  int hybrid_group_size = 0;  ///< 0: the world
  int hpz_group_size = 0;     ///< reshard_after_forward_group_size; 0: off
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  bool cpu_offload = false;                ///< the deprecated both-to-the-host switch
  int64_t nvme_buffer_bytes = int64_t{1};  ///< per NVMe offload; must be positive
  Precision param = Precision::kFp32;      ///< gathered parameters
  Precision reduce = Precision::kFp32;     ///< reduced gradients
  Precision master = Precision::kFp32;     ///< kBf16: pure bf16
  bool keep_fp32 = false;                  ///< a keep_fp32_policy is set
  int max_gathered_units = 2;
  bool activation_checkpointing = false;  ///< a checkpoint policy is set
  bool offload_activations = false;
  bool quantize_weights = false;
  bool quantize_gradients = false;
  int weight_bits = 8;
  int gradient_bits = 8;
  int64_t quantize_block = 2048;
};

/// Throws std::invalid_argument with the message of the first rule `o` breaks, naming
/// every option as `s` does; each message says the fix.
void validate(const Options& o, Surface s);
/// `o` with the deprecated cpu_offload resolved to what it means: both offloads on the
/// host (validate() has refused it beside an NVMe offload).
Options resolved(const Options& o);

/// Ranks each flat parameter is split over: the world (kFullShard, kShardGradOp, kZero2,
/// kZero1), the hybrid group (kHybridShard) or 1 (kNoShard).
int shard_group_size(const Options& o);
/// Whether units are freed after forward (kFullShard, kHybridShard): what hpZ and NVMe
/// parameters need.
bool reshards_after_forward(ShardingStrategy s);
/// Whether full parameters persist between steps (DeepSpeed's ZeRO-1 and ZeRO-2).
bool keeps_params(ShardingStrategy s);
/// Bytes per element of a precision.
int64_t precision_bytes(Precision p);

/// The rules of single values that several readers take, with the option named as the
/// reader wrote it (`option`: "--backend", "ProcessGroupOptions::backend",
/// "ds_config: pipeline.stages"); std::invalid_argument otherwise.
/// A backend: auto, gloo or nccl.
void check_backend(const std::string& text, const std::string& option, Surface s);
/// Pipeline stages: at least 1 and, where the world's size is known (not 0), dividing it.
void check_pipeline_stages(int stages, int world_size, const std::string& option, Surface s);
/// Micro-batches per step: at least 1 (kApi), or 0 for 2 x the stages (kFlags).
void check_micro_batches(int micro_batches, const std::string& option, Surface s);
/// A count that must be positive.
void check_positive(int64_t v, const std::string& option, Surface s);

/// The first layer of each pipeline stage, then the layer count (stages + 1 bounds):
/// "parameters" balances parameter counts, "uniform" layer counts, or the first layer of
/// stages 1.. as "B1,B2,...". Errors (std::invalid_argument) name the values as
/// `stages_name` and `partition_name` call them.
std::vector<int64_t> pipeline_partition(const std::vector<int64_t>& layer_params, int stages,
                                        const std::string& partition,
                                        const std::string& stages_name,
                                        const std::string& partition_name);

}  // namespace fsdp::core
