#pragma once
// DeepSpeed's ds_config.json, taken as it is: read into this library's options, each key
// applied or accepted with the reason it has no effect here (docs/guide/deepspeed.md).
//
//   fsdp::deepspeed::ProgramValues program;  // what "auto" means: the program's own values
//   program.world_size = pg.size();
//   auto ds = fsdp::deepspeed::load_config("ds_config.json", program);
//   std::cout << ds.describe();            // the options, and one line per key
//   fsdp::ShardingOptions so = ds.sharding;  // strategy, offload, precision, prefetch bound

#include <fsdp/loss_scaler.h>
#include <fsdp/options.h>
#include <fsdp/warmup_schedule.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
/// DeepSpeed's configuration file, read into this library's options.
namespace deepspeed {

/// The program's values, which fill a config's "auto" entries (as Hugging Face's Trainer
/// fills them from its TrainingArguments), and the world size of the batch rule.
struct ProgramValues {
  int world_size = 1;                       ///< ranks of the job (train_batch_size's rule)
  int64_t micro_batch_per_rank = 0;         ///< sequences per rank per micro-batch; 0: unknown
  int64_t gradient_accumulation_steps = 1;  ///< micro-batches per optimizer step
  double lr = 1e-3;                         ///< the optimizer's (peak) learning rate
  double beta1 = 0.9, beta2 = 0.999;        ///< Adam's betas
  double eps = 1e-8;                        ///< Adam's eps
  double weight_decay = 0;                  ///< decoupled weight decay
  double gradient_clipping = 1.0;           ///< the global norm's bound (0: off)
  Precision precision = Precision::kFp32;   ///< fills fp16/bf16 "enabled"
  int64_t warmup_steps = 0;                 ///< the schedule's warm-up steps
  int64_t total_steps = 0;                  ///< optimizer steps the schedule spans
  /// The model width: "auto" bucket sizes as the Trainer sets them (reduce_bucket_size =
  /// h*h, stage3_prefetch_bucket_size = 0.9*h*h, stage3_param_persistence_threshold = 10*h);
  /// 0: DeepSpeed's defaults.
  int64_t hidden_size = 0;
  /// Pipeline stages (pipeline.stages "auto"); the batch rule's world is world_size / stages.
  int pipeline_stages = 1;
};

/// What a config's `optimizer` section asked for (DeepSpeed's Adam and AdamW).
struct Optimizer {
  bool present = false;     ///< the config had an optimizer section
  std::string type;         ///< as written: Adam or AdamW (any case)
  double lr = 1e-3;         ///< params.lr (DeepSpeed's FusedAdam default)
  double beta1 = 0.9;       ///< params.betas[0]
  double beta2 = 0.999;     ///< params.betas[1]
  double eps = 1e-8;        ///< params.eps
  double weight_decay = 0;  ///< params.weight_decay
  /// False for Adam with adam_w_mode false: L2 weight decay added to the gradient, not
  /// AdamW's decoupled decay (fsdp::FusedAdamW does the latter only).
  bool decoupled_weight_decay = true;
};

/// One key of the config and what became of it.
struct Note {
  std::string key;      ///< its path, e.g. zero_optimization.offload_param.device
  std::string value;    ///< as read (an "auto" shows what it was filled with)
  bool applied = true;  ///< false: accepted with no effect here
  std::string effect;   ///< applied: to what; otherwise why it has no effect
};

/// A config read into options. Keys the config leaves out take DeepSpeed's defaults.
struct Config {
  /// strategy (zero_optimization.stage: 0 kNoShard, 1 kZero1, 2 kZero2, 3 kFullShard),
  /// offload_optimizer/offload_param, mixed_precision (fp16/bf16) and
  /// max_gathered_units (the stage-3 prefetch bounds). Device, wrap policy and process
  /// group are the program's to set.
  ShardingOptions sharding;
  Precision precision = Precision::kFp32;  ///< fp16.enabled, bf16.enabled
  LossScalerOptions loss_scaler;           ///< fp16's loss_scale, initial_scale_power, ...
  Optimizer optimizer;
  bool has_scheduler = false;  ///< the config had a scheduler section
  WarmupSchedule scheduler;
  int world_size = 1;                       ///< ProgramValues::world_size
  int64_t train_batch_size = 0;             ///< global, in samples
  int64_t micro_batch_per_rank = 0;         ///< train_micro_batch_size_per_gpu
  int64_t gradient_accumulation_steps = 0;  ///< micro-batches per step
  double gradient_clipping = 1.0;           ///< DeepSpeed's default is 1.0 (0: off)
  int64_t steps_per_print = 0;              ///< 0: not given
  /// The pipeline section (fsdp::pipeline): stages (PipelineOptions::stages), and how the
  /// layers split (PipelineOptions::partition); gradient_accumulation_steps is then the
  /// pipeline's micro-batch count, as in DeepSpeed's pipe engine.
  int pipeline_stages = 1;
  std::string pipeline_partition = "parameters";
  bool wall_clock_breakdown = false;
  std::vector<Note> notes;  ///< one per key of the config, section by section

  /// The options it became and one line per note, for a program to print at start.
  std::string describe() const;
  /// Whether the config had this key (its path, e.g. "optimizer.params.lr").
  bool has(const std::string& key) const;
};

/// Reads a config from its JSON text. "auto" values are filled from `program`. An
/// unknown key or a value of the wrong type throws, naming the key's path, the value and
/// the keys supported there (the closest first). Trailing commas and comments (// /* */ #,
/// as DeepSpeed's hjson reader accepts) are accepted; other syntax errors name the line
/// and column. Duplicate keys throw, as in DeepSpeed.
Config parse_config(const std::string& json_text, const ProgramValues& program = {});
/// The same from a file.
Config load_config(const std::string& path, const ProgramValues& program = {});

}  // namespace deepspeed

// The names before they moved into fsdp::deepspeed (issue 54: concepts in nested
// namespaces, as torch::optim). They stay one release, deprecated.
using DeepSpeedProgramValues [[deprecated("renamed fsdp::deepspeed::ProgramValues")]] =
    deepspeed::ProgramValues;
using DeepSpeedOptimizer [[deprecated("renamed fsdp::deepspeed::Optimizer")]] =
    deepspeed::Optimizer;
using DeepSpeedNote [[deprecated("renamed fsdp::deepspeed::Note")]] = deepspeed::Note;
using DeepSpeedConfig [[deprecated("renamed fsdp::deepspeed::Config")]] = deepspeed::Config;
[[deprecated("renamed fsdp::deepspeed::parse_config")]] inline deepspeed::Config
parse_deepspeed_config(const std::string& json_text, const deepspeed::ProgramValues& program = {}) {
  return deepspeed::parse_config(json_text, program);
}
[[deprecated("renamed fsdp::deepspeed::load_config")]] inline deepspeed::Config
load_deepspeed_config(const std::string& path, const deepspeed::ProgramValues& program = {}) {
  return deepspeed::load_config(path, program);
}

}  // namespace fsdp
