#pragma once
// train_gpt's command line: its flags in the groups --help lists, parsed from argv after
// the values of a --config file, and checked. A flag that cannot work throws a UsageError
// naming the flag, its value and what to give instead.

#include <fsdp/fsdp.h>

#include "lm_config.h"
#include "program.h"

#include <cstdint>
#include <optional>
#include <set>
#include <string>

namespace lm {

/// How to train.
struct TrainingFlags {
  int64_t batch_size = 0;   ///< --batch-size: the global batch in sequences, split across ranks
  int64_t grad_accum = 0;   ///< --grad-accum: micro-batches per step
  int64_t steps = 0;        ///< --steps: optimizer steps the schedule spans
  double lr = 0;            ///< --lr: the peak learning rate
  double weight_decay = 0;  ///< --weight-decay: AdamW's
  /// --no-decay-recipe: "standard" (biases and 1-D parameters, i.e. norm weights, without
  /// weight decay: fsdp::no_decay_groups) or "none" (every parameter decays).
  std::string no_decay_recipe;
  int64_t warmup_steps = 0;     ///< --warmup-steps: the warm-up's steps
  std::string lr_schedule;      ///< --lr-schedule: constant|cosine|warmup|warmup_decay
  double warmup_min_lr = 0;     ///< --warmup-min-lr: warmup and warmup_decay start here
  std::string warmup_type;      ///< --warmup-type: log|linear (warmup, warmup_decay)
  double beta1 = 0, beta2 = 0;  ///< --adam-betas B1,B2
  double eps = 0;               ///< --adam-eps
  double clip_grad = 0;         ///< --clip-grad: the global gradient norm's bound (0: off)
  uint64_t seed = 0;            ///< --seed: weights and data
  std::string data;             ///< --data: a text file, byte-level ("": the synthetic task)
  std::string eval_text;        ///< --eval-text: a fixed batch's bytes, evaluated first and last
  double val_fraction = 0;      ///< --val-fraction: with --data, the last part held out
};

/// How the model is sharded, and in which precision.
struct ShardingFlags {
  std::string precision;  ///< --precision: fp32|bf16|fp16
  /// fp16: --loss-scale (0: dynamic), --loss-scale-power, --loss-scale-window,
  /// --loss-scale-hysteresis, --min-loss-scale (DeepSpeed's fp16 fields)
  fsdp::LossScalerOptions loss_scaler;
  std::string device;                ///< --device as given: cpu|cuda|cuda:N|auto
  std::string backend;               ///< --backend resolved for the device: gloo|nccl
  std::string wrap;                  ///< --wrap as given: block|size:N|none
  fsdp::ShardingOptions options;     ///< all the flags say (device included); the group comes later
  bool sharded_construction = true;  ///< --construction sharded (make_sharded) or eager
  /// --bf16-rounding, resolved (auto: stochastic where the shards step on the host, else
  /// nearest); used with --master-dtype bf16 only.
  fsdp::FusedAdamW::Bf16Rounding bf16_rounding = fsdp::FusedAdamW::Bf16Rounding::kNearest;
};

/// Where checkpoints go and where the weights come from.
struct CheckpointFlags {
  std::string save_dir;        ///< --save-dir ("": no checkpoints)
  int64_t save_every = 0;      ///< --save-every: steps between saves (0: only at the end)
  int64_t keep = 0;            ///< --keep: the newest K checkpoints stay (0: all)
  bool async_save = false;     ///< --async-save: write in the background
  int64_t stop_at = 0;         ///< --stop-at: stop after this step, as if preempted (0: never)
  bool resume = false;         ///< --resume: from the newest checkpoint in save_dir
  std::string init_from;       ///< --init-from: consolidated weights to start from
  std::string consolidate_to;  ///< --consolidate-to: one HDF5 file written at the end
  std::string export_hf;       ///< --export-hf: a Hugging Face model directory written at the end
  std::string export_dtype;    ///< --export-dtype: fp32|bf16|fp16 of --export-hf
};

/// What rank 0 writes as training goes.
struct OutputFlags {
  std::string log_jsonl;  ///< --log-jsonl: one JSON object per step ("": none)
  int64_t log_every = 0;  ///< --log-every, resolved: steps between progress lines
  std::string io_log;     ///< --io-log: one JSON object per checkpoint save, load, export
};

/// Pipeline stages (fsdp::pipeline): --pipeline-stages 1 trains without them.
struct PipelineFlags {
  int stages = 1;  ///< --pipeline-stages: stages over the ranks (divides the world)
  fsdp::PipelineSchedule schedule = fsdp::PipelineSchedule::k1F1B;  ///< --pipeline-schedule
  int micro_batches = 0;  ///< --micro-batches, resolved (0 given: 2 x stages)
  std::string partition;  ///< --partition: parameters|uniform|B1,B2,...
};

struct Flags {
  std::string deepspeed_config;  ///< --deepspeed-config: a DeepSpeed ds_config.json
  std::set<std::string> given;   ///< the flags given (command line and --config), by name
  Config model;                  ///< --n-layer, --n-head, ..., or --init-from's file
  TrainingFlags training;
  ShardingFlags sharding;
  CheckpointFlags checkpoint;
  OutputFlags output;
  PipelineFlags pipeline;
};

/// The program parse_flags was called for (its name prefixes every output line).
const std::string& program();
const Program& program_info();

/// Parses and checks the command line, all but what needs the world size or touches the
/// disk. std::nullopt after printing --help.
std::optional<Flags> parse_flags(const Program& program, int argc, char** argv);

/// fp16's loss-scale fields in range (the flags, or a DeepSpeed config's fp16 section).
void check_loss_scaler(const fsdp::LossScalerOptions& ls);
/// --offload-optimizer / --offload-param: none|cpu|nvme.
fsdp::OffloadDevice parse_offload_device(const std::string& flag, const std::string& value);

/// What pipeline stages do not do yet, refused by flag (nothing when --pipeline-stages is 1).
void check_pipeline_flags(const Flags& f);

/// The global batch must split evenly into `world` ranks' micro-batches (with pipeline
/// stages: into each data-parallel replica's --micro-batches).
void check_batch_for_world(const TrainingFlags& training, int world,
                           const PipelineFlags& pipeline = {});

/// The checkpoint flags, and the places they write to, checked before any training: the
/// save directory is created, and the consolidated file's directory must exist.
void check_checkpoint_flags(const CheckpointFlags& checkpoint, int64_t steps);

}  // namespace lm
