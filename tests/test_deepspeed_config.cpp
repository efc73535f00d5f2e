// DeepSpeed configs taken as they are (fsdp::deepspeed::parse_config): every key's mapping,
// DeepSpeed's batch rule, "auto", the refusals with their messages, relaxed JSON, the
// warm-up schedules against DeepSpeed's own numbers, and train_gpt --deepspeed-config at
// world 2 against the same run given as plain flags.
#include "support/multirank.h"

#include <fsdp/deepspeed_config.h>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

using namespace fsdp::testing;
// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_deepspeed_config_cases {

using fsdp::OffloadDevice;
using fsdp::ShardingStrategy;
using fsdp::deepspeed::Config;

namespace {

/// The message deepspeed::parse_config throws for `text` ("" if it does not throw).
std::string error_of(const std::string& text, const fsdp::deepspeed::ProgramValues& p = {}) {
  try {
    fsdp::deepspeed::parse_config(text, p);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

#define EXPECT_ERROR(text, message)                        \
  do {                                                     \
    const std::string got_ = error_of(text);               \
    EXPECT_NE(got_.find(message), std::string::npos)       \
        << "expected: " << (message) << "\ngot: " << got_; \
  } while (0)

const fsdp::deepspeed::Note& note(const Config& c, const std::string& key) {
  for (const auto& n : c.notes)
    if (n.key == key) return n;
  throw std::runtime_error("no note for " + key);
}

std::string source(const std::string& rel) { return std::string(FSDP_SOURCE_DIR) + "/" + rel; }

// ---- every key's mapping ----------------------------------------------------------------

TEST(DeepSpeedConfig, TheExampleZero3OffloadConfigMapsEveryKeyAndNotesEachOne) {
  fsdp::deepspeed::ProgramValues p;
  p.world_size = 2;
  p.gradient_accumulation_steps = 2;
  p.micro_batch_per_rank = 3;
  p.hidden_size = 32;
  const auto c =
      fsdp::deepspeed::load_config(source("examples/gpt/ds_config_zero3_offload.json"), p);
  EXPECT_EQ(c.train_batch_size, 12);
  EXPECT_EQ(c.micro_batch_per_rank, 3);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.precision, fsdp::Precision::kFp16);
  EXPECT_EQ(c.sharding.mixed_precision.param_dtype, torch::kHalf);
  EXPECT_EQ(c.sharding.mixed_precision.reduce_dtype, torch::kHalf);
  EXPECT_EQ(c.loss_scaler.loss_scale, 0);
  EXPECT_EQ(c.loss_scaler.initial_scale_power, 12);
  EXPECT_EQ(c.loss_scaler.loss_scale_window, 100);
  EXPECT_EQ(c.loss_scaler.hysteresis, 2);
  EXPECT_EQ(c.loss_scaler.min_loss_scale, 1);
  EXPECT_TRUE(c.optimizer.present);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_EQ(c.optimizer.lr, 3e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_TRUE(c.optimizer.decoupled_weight_decay);
  EXPECT_TRUE(c.has_scheduler);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 3e-3);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 3);
  EXPECT_EQ(c.scheduler.warmup_type, fsdp::WarmupSchedule::Type::kLinear);
  EXPECT_EQ(c.scheduler.total_num_steps, 8);
  EXPECT_EQ(c.sharding.strategy, ShardingStrategy::kFullShard);
  EXPECT_EQ(c.sharding.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.sharding.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c.sharding.offload_optimizer.pin_memory);
  // "auto" prefetch bucket = 0.9 * 32 * 32 = 921 elements; max_live_parameters 1e9; the
  // count of units unbounded, as DeepSpeed counts elements only; "auto" persistence
  // threshold = 10 * 32.
  EXPECT_EQ(c.sharding.prefetch_bucket_numel, 921);
  EXPECT_EQ(c.sharding.max_live_numel, 1000000000);
  EXPECT_EQ(c.sharding.max_gathered_units, INT_MAX);
  EXPECT_EQ(c.sharding.persistence_threshold_numel, 320);
  EXPECT_EQ(c.steps_per_print, 2);
  EXPECT_FALSE(c.wall_clock_breakdown);
  // One note per key of the file (the nested sections' keys, not the sections).
  ASSERT_EQ(c.notes.size(), 35u) << c.describe();
  EXPECT_EQ(c.notes.front().key, "train_batch_size");
  EXPECT_EQ(note(c, "gradient_accumulation_steps").value, "2");
  EXPECT_EQ(note(c, "zero_optimization.stage").effect, "ShardingOptions::strategy = kFullShard");
  EXPECT_EQ(note(c, "zero_optimization.offload_param.device").effect,
            "ShardingOptions::offload_param.device = cpu");
  EXPECT_EQ(note(c, "zero_optimization.stage3_prefetch_bucket_size").value, "\"auto\" -> 921");
  EXPECT_TRUE(note(c, "zero_optimization.stage3_prefetch_bucket_size").applied);
  EXPECT_EQ(note(c, "zero_optimization.reduce_bucket_size").value, "\"auto\" -> 1024");
  EXPECT_FALSE(note(c, "zero_optimization.reduce_bucket_size").applied);
  EXPECT_FALSE(note(c, "zero_optimization.overlap_comm").applied);
  EXPECT_FALSE(note(c, "zero_optimization.sub_group_size").applied);
  EXPECT_FALSE(note(c, "wall_clock_breakdown").applied);
  EXPECT_NE(c.describe().find("DeepSpeed config: strategy kFullShard, offload_optimizer cpu, "
                              "offload_param cpu, precision fp16 (loss scale dynamic from 2^12, "
                              "window 100, hysteresis 2, min 1), prefetch max_live_numel "
                              "1000000000, prefetch_bucket_numel 921, "
                              "persistence_threshold_numel 320"),
            std::string::npos)
      << c.describe();
}

// The pipeline section: stages and partition map to fsdp::PipelineOptions, and the batch
// rule counts the data-parallel ranks (world / stages), as DeepSpeed's pipe engine does.
TEST(DeepSpeedConfig, ThePipelineSectionSetsStagesAndPartitionAndTheBatchRuleCountsReplicas) {
  fsdp::deepspeed::ProgramValues p;
  p.world_size = 4;
  const auto c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 16, "gradient_accumulation_steps": 4,
          "pipeline": {"stages": 2, "partition": "uniform", "pipe_partitioned": true,
                       "grad_partitioned": true, "seed_layers": false,
                       "activation_checkpoint_interval": 0}})",
      p);
  EXPECT_EQ(c.pipeline_stages, 2);
  EXPECT_EQ(c.pipeline_partition, "uniform");
  EXPECT_EQ(c.micro_batch_per_rank, 2);  // 16 = 2 x 4 micro-batches x 2 replicas
  EXPECT_TRUE(note(c, "pipeline.stages").applied);
  EXPECT_FALSE(note(c, "pipeline.pipe_partitioned").applied);
  EXPECT_NE(c.describe().find("x data-parallel 2 (2 pipeline stages, partition uniform)"),
            std::string::npos)
      << c.describe();
  p.pipeline_stages = 4;  // "auto": the program's
  const auto a = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 16, "pipeline": {"stages": "auto", "partition": "best"}})", p);
  EXPECT_EQ(a.pipeline_stages, 4);
  EXPECT_EQ(a.pipeline_partition, "parameters");
  EXPECT_EQ(a.micro_batch_per_rank, 16);  // one replica, one micro-batch
  fsdp::deepspeed::ProgramValues four;
  four.world_size = 4;
  EXPECT_NE(error_of(R"({"train_batch_size": 16, "pipeline": {"stages": 3}})", four)
                .find("ds_config: pipeline.stages 3 does not divide the world size 4"),
            std::string::npos);
  EXPECT_ERROR(R"({"train_batch_size": 8, "pipeline": {"partition": "type:Block"}})",
               "ds_config: pipeline.partition \"type:Block\" is not available here; write "
               "\"parameters\"");
  EXPECT_ERROR(R"({"train_batch_size": 8, "pipeline": {"activation_checkpoint_interval": 2}})",
               "train_gpt --activation-checkpointing every:2");
  EXPECT_ERROR(R"({"train_batch_size": 8, "pipeline": {"micro_batches": 2}})",
               "Supported keys in pipeline");
}

TEST(DeepSpeedConfig, StagesZeroToThreeBecomeNoShardZero1Zero2AndFullShard) {
  const ShardingStrategy want[] = {ShardingStrategy::kNoShard, ShardingStrategy::kZero1,
                                   ShardingStrategy::kZero2, ShardingStrategy::kFullShard};
  for (int stage = 0; stage < 4; ++stage) {
    const auto c =
        fsdp::deepspeed::parse_config(R"({"train_batch_size": 8, "zero_optimization": {"stage": )" +
                                      std::to_string(stage) + "}}");
    EXPECT_EQ(c.sharding.strategy, want[stage]) << stage;
  }
  // No zero_optimization: DeepSpeed's stage 0. The old format: true is stage 1.
  EXPECT_EQ(fsdp::deepspeed::parse_config(R"({"train_batch_size": 8})").sharding.strategy,
            ShardingStrategy::kNoShard);
  EXPECT_EQ(fsdp::deepspeed::parse_config(R"({"train_batch_size": 8, "zero_optimization": true})")
                .sharding.strategy,
            ShardingStrategy::kZero1);
  EXPECT_ERROR(R"({"train_batch_size": 8, "zero_optimization": {"stage": 4}})",
               "ds_config: zero_optimization.stage 4 is unknown; use 0, 1, 2 or 3");
}

TEST(DeepSpeedConfig, OffloadSectionsAndTheLegacyCpuOffloadMapAsDeepSpeedReadsThem) {
  auto c = fsdp::deepspeed::parse_config(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": false,
                            "buffer_count": 4, "pipeline_read": false, "ratio": 1.0},
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5,
                        "buffer_size": 1e8, "max_in_cpu": 1e9}}})");
  EXPECT_EQ(c.sharding.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.sharding.offload_optimizer.nvme_path, "/local_nvme");
  EXPECT_FALSE(c.sharding.offload_optimizer.pin_memory);
  EXPECT_EQ(c.sharding.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.sharding.offload_param.buffer_bytes, int64_t{5} * 100000000 * 2);
  EXPECT_TRUE(note(c, "zero_optimization.offload_param.buffer_size").applied);
  EXPECT_FALSE(note(c, "zero_optimization.offload_optimizer.buffer_count").applied);
  // cpu_offload (deprecated) is DeepSpeed's offload_optimizer to the CPU, not both.
  c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": true}})");
  EXPECT_EQ(c.sharding.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.sharding.offload_param.device, OffloadDevice::kNone);
  c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload_param": true}})");
  EXPECT_EQ(c.sharding.offload_param.device, OffloadDevice::kCpu);
  EXPECT_ERROR(
      R"({"train_batch_size": 8, "zero_optimization": {"offload_param": {"device": "gpu"}}})",
      "ds_config: zero_optimization.offload_param.device \"gpu\" is unknown; use cpu, "
      "nvme or none");
  EXPECT_ERROR(
      R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"ratio": 0.5}}})",
      "zero_optimization.offload_optimizer.ratio 0.5 is not available here (partial offload)");
}

TEST(DeepSpeedConfig, Fp16AndBf16SectionsSetThePrecisionAndTheLossScaler) {
  auto c = fsdp::deepspeed::parse_config(R"({"train_batch_size": 8, "bf16": {"enabled": true}})");
  EXPECT_EQ(c.precision, fsdp::Precision::kBf16);
  EXPECT_EQ(c.sharding.mixed_precision.param_dtype, torch::kBFloat16);
  EXPECT_EQ(*c.sharding.mixed_precision.output_dtype, torch::kFloat32);
  c = fsdp::deepspeed::parse_config(R"({"train_batch_size": 8, "bfloat16": {"enabled": true}})");
  EXPECT_EQ(c.precision, fsdp::Precision::kBf16);
  c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 128}})");
  EXPECT_EQ(c.precision, fsdp::Precision::kFp16);
  EXPECT_EQ(c.loss_scaler.loss_scale, 128);
  // Keys of a section that is off are accepted with no effect, and say so.
  c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "fp16": {"enabled": false, "hysteresis": 4}})");
  EXPECT_EQ(c.precision, fsdp::Precision::kFp32);
  EXPECT_FALSE(note(c, "fp16.hysteresis").applied);
  EXPECT_NE(note(c, "fp16.hysteresis").effect.find("fp16 is not enabled"), std::string::npos);
  EXPECT_ERROR(R"({"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}})",
               "ds_config: bfloat16 and fp16 modes cannot be simultaneously enabled");
  EXPECT_ERROR(R"({"train_batch_size": 8, "fp16": {"consecutive_hysteresis": true}})",
               "ds_config: fp16.consecutive_hysteresis: true is not available here");
}

TEST(DeepSpeedConfig, AdamIsAdamWUnlessAdamWModeIsFalseAsInDeepSpeed) {
  auto c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "optimizer": {"type": "adam", "params": {"lr": 1e-4}}})");
  EXPECT_TRUE(c.optimizer.decoupled_weight_decay);
  EXPECT_EQ(c.optimizer.lr, 1e-4);
  EXPECT_EQ(c.optimizer.beta2, 0.999);  // FusedAdam's default
  c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})");
  EXPECT_FALSE(c.optimizer.decoupled_weight_decay);
  // AdamW stays AdamW whatever adam_w_mode says (engine.py: name == adamw or adam_w_mode).
  c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})");
  EXPECT_TRUE(c.optimizer.decoupled_weight_decay);
  EXPECT_ERROR(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb"}})",
               "ds_config: optimizer.type \"Lamb\" is not available here; use Adam or AdamW");
  EXPECT_ERROR(
      R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1}}})",
      "'max_grad_norm' is not supported as an optimizer parameter, please switch to using "
      "the deepspeed parameter 'gradient_clipping'");
}

// ---- DeepSpeed's batch rule -------------------------------------------------------------

TEST(DeepSpeedConfig, TheBatchRuleFillsTheMissingSizeAndRefusesAnInconsistentTriple) {
  fsdp::deepspeed::ProgramValues p;
  p.world_size = 4;
  auto c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2})", p);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  c = fsdp::deepspeed::parse_config(R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})",
                                    p);
  EXPECT_EQ(c.micro_batch_per_rank, 4);
  c = fsdp::deepspeed::parse_config(
      R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})", p);
  EXPECT_EQ(c.train_batch_size, 24);
  c = fsdp::deepspeed::parse_config(R"({"train_micro_batch_size_per_gpu": 3})", p);
  EXPECT_EQ(c.train_batch_size, 12);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(error_of(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                         "gradient_accumulation_steps": 2})",
                     p),
            "ds_config: Check batch related parameters. train_batch_size is not equal to "
            "micro_batch_per_gpu * gradient_acc_step * world_size 32 != 2 * 2 * 4");
  // DeepSpeed's integer division leaves 30 / 4 = 7 per rank: the rule then fails.
  EXPECT_NE(error_of(R"({"train_batch_size": 30})", p).find("30 != 7 * 1 * 4"), std::string::npos);
  EXPECT_EQ(error_of(R"({"gradient_accumulation_steps": 2})", p),
            "ds_config: Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
            "provided (or the program's batch size: deepspeed::ProgramValues::"
            "micro_batch_per_rank, train_gpt's --batch-size divisible by the data-parallel "
            "ranks x --grad-accum)");
  EXPECT_NE(error_of(R"({"train_batch_size": 2})", p)
                .find("Micro batch size per gpu: 0 has to be greater than 0"),
            std::string::npos);
}

// ---- "auto" -----------------------------------------------------------------------------

TEST(DeepSpeedConfig, AutoValuesAreFilledFromTheProgramAsTheTrainerDoes) {
  fsdp::deepspeed::ProgramValues p;
  p.world_size = 2;
  p.micro_batch_per_rank = 4;
  p.gradient_accumulation_steps = 3;
  p.lr = 5e-4;
  p.beta1 = 0.8;
  p.beta2 = 0.9;
  p.eps = 1e-6;
  p.weight_decay = 0.1;
  p.gradient_clipping = 0.5;
  p.precision = fsdp::Precision::kBf16;
  p.warmup_steps = 7;
  p.total_steps = 70;
  p.hidden_size = 64;
  const auto c = fsdp::deepspeed::parse_config(R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"}})",
                                               p);
  EXPECT_EQ(c.train_batch_size, 24);
  EXPECT_EQ(c.micro_batch_per_rank, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 3);
  EXPECT_EQ(c.gradient_clipping, 0.5);
  EXPECT_EQ(c.precision, fsdp::Precision::kBf16);
  EXPECT_EQ(c.optimizer.lr, 5e-4);
  EXPECT_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.optimizer.beta2, 0.9);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 5e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 7);
  EXPECT_EQ(c.scheduler.total_num_steps, 70);
  EXPECT_EQ(note(c, "zero_optimization.reduce_bucket_size").value, "\"auto\" -> 4096");
  EXPECT_EQ(note(c, "zero_optimization.stage3_param_persistence_threshold").value,
            "\"auto\" -> 640");
  EXPECT_EQ(note(c, "optimizer.params.betas").value, "\"auto\" -> [0.8, 0.9]");
  // An "auto" the program cannot fill is refused, naming the key.
  EXPECT_EQ(error_of(R"({"train_micro_batch_size_per_gpu": "auto"})"),
            "ds_config: train_micro_batch_size_per_gpu: \"auto\" needs the program's value, "
            "which it did not give; write a number");
}

// ---- refusals ---------------------------------------------------------------------------

TEST(DeepSpeedConfig, AnUnknownKeyIsRefusedNamingItsPathTheClosestKeyAndTheSupportedOnes) {
  const std::string e = error_of(
      R"({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_paramters": 1e9}})");
  EXPECT_EQ(e.rfind("ds_config: zero_optimization.stage3_max_live_paramters is not a key this "
                    "library knows; did you mean stage3_max_live_parameters? Supported keys in "
                    "zero_optimization: stage3_max_live_parameters, ",
                    0),
            0u)
      << e;
  EXPECT_NE(e.find("offload_optimizer"), std::string::npos) << e;
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "optimiser": {}})")
                .find("ds_config: optimiser is not a key this library knows; did you mean "
                      "optimizer? Supported keys at the top level: optimizer, "),
            std::string::npos);
  // A key under a scheduler that does not have it: WarmupLR has no total_num_steps.
  EXPECT_NE(
      error_of(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR",
                        "params": {"total_num_steps": 10}}})")
          .find("ds_config: scheduler.params.total_num_steps is not a key this library knows. "
                "Supported keys in scheduler.params: "),
      std::string::npos);
}

// Configs as users write them (issue 41): Lightning-style without batch keys takes the
// program's batch, with a note; "true" and "false" as strings are read for what they say,
// with a note, where DeepSpeed reads any non-empty string as true.
TEST(DeepSpeedConfig, ConfigsWithoutBatchKeysTakeTheProgramsBatch) {
  fsdp::deepspeed::ProgramValues p;
  p.world_size = 4;
  p.micro_batch_per_rank = 3;
  p.gradient_accumulation_steps = 2;
  auto c = fsdp::deepspeed::parse_config(R"({"zero_optimization": {"stage": 2}})", p);
  EXPECT_EQ(c.micro_batch_per_rank, 3);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.train_batch_size, 24);
  EXPECT_NE(c.describe().find("train_batch_size, train_micro_batch_size_per_gpu = (absent): "
                              "applied: from the program's batch: micro 3 x accumulation 2 x "
                              "world 4 = 24, as Lightning's DeepSpeed strategy fills them"),
            std::string::npos)
      << c.describe();
  // gradient_accumulation_steps alone is the config's.
  c = fsdp::deepspeed::parse_config(R"({"gradient_accumulation_steps": 4})", p);
  EXPECT_EQ(c.train_batch_size, 3 * 4 * 4);
}

// Note [Every problem at once]: an unknown key at the top level and one in a section, a
// value of the wrong type and missing batch keys, in one error, each with its path and fix.
TEST(DeepSpeedConfig, EveryProblemIsReportedInOneError) {
  const std::string e = error_of(R"({"gradient_accumulation_step": 2,
      "fp16": {"enabled": "yes"},
      "zero_optimization": {"stage": 3, "stage3_max_live_paramters": 1e9}})");
  EXPECT_EQ(e.rfind("ds_config: 4 problems:\n  - ", 0), 0u) << e;
  for (const char* part :
       {"ds_config: gradient_accumulation_step is not a key this library knows; did you mean "
        "gradient_accumulation_steps?",
        "ds_config: fp16.enabled: \"yes\" is a string; expected true or false",
        "ds_config: zero_optimization.stage3_max_live_paramters is not a key this library knows; "
        "did you mean stage3_max_live_parameters?",
        "ds_config: Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
        "provided"}) {
    EXPECT_NE(e.find(part), std::string::npos) << part << "\n in: " << e;
  }
}

TEST(DeepSpeedConfig, TrueAndFalseStringsAreReadForWhatTheySay) {
  auto c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "bf16": {"enabled": "true"}, "fp16": {"enabled": "false"}})");
  EXPECT_EQ(c.precision, fsdp::Precision::kBf16);
  EXPECT_NE(c.describe().find("fp16.enabled = \"false\": applied: the string read as false "
                              "(DeepSpeed reads any non-empty string as true, \"false\" too"),
            std::string::npos)
      << c.describe();
  EXPECT_EQ(error_of(R"({"train_batch_size": 8, "fp16": {"enabled": "True"}})"),
            "ds_config: fp16.enabled: \"True\" is a string; expected true or false or \"auto\"");
}

TEST(DeepSpeedConfig, AValueOfTheWrongTypeIsRefusedNamingTheKeyTheValueAndWhatItMustBe) {
  EXPECT_EQ(error_of(R"({"train_batch_size": 8, "zero_optimization": {"stage": "three"}})"),
            "ds_config: zero_optimization.stage: \"three\" is a string; expected an integer");
  EXPECT_EQ(error_of(R"({"train_batch_size": 8, "fp16": {"enabled": "yes"}})"),
            "ds_config: fp16.enabled: \"yes\" is a string; expected true or false or \"auto\"");
  EXPECT_EQ(error_of(R"({"train_batch_size": 8.5})"),
            "ds_config: train_batch_size: 8.5 is a number; expected an integer");
  EXPECT_EQ(error_of(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
                         "params": {"betas": 0.9}}})"),
            "ds_config: optimizer.params.betas: 0.9 is a number; expected [beta1, beta2] (two "
            "numbers) or \"auto\"");
  EXPECT_EQ(error_of(R"({"train_batch_size": 8, "zero_optimization": []})"),
            "ds_config: zero_optimization: [] is an array; expected an object");
  EXPECT_EQ(error_of(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR",
                         "params": {"warmup_num_steps": 0}}})"),
            "ds_config: scheduler.params.warmup_num_steps must be a positive integer, got 0");
}

TEST(DeepSpeedConfig, TrailingCommasAndCommentsAreAcceptedAsDeepSpeedsHjsonReaderDoes) {
  const auto c = fsdp::deepspeed::parse_config(R"({
    // pasted from a blog post
    "train_batch_size": 8,   # hjson comment
    "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95,],},},
    /* a "string" in a comment, */ "steps_per_print": 5,
  })");
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.steps_per_print, 5);
  // Inside strings, commas and comment markers stay.
  EXPECT_EQ(fsdp::deepspeed::parse_config(
                R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer":
                    {"device": "nvme", "nvme_path": "/a,}//b#c"}}})")
                .sharding.offload_optimizer.nvme_path,
            "/a,}//b#c");
}

TEST(DeepSpeedConfig, ASyntaxErrorNamesTheLineAndColumnAndADuplicateKeyIsRefused) {
  const std::string e = error_of("{\n  \"train_batch_size\": 8\n  \"steps_per_print\": 1\n}");
  EXPECT_NE(e.find("ds_config: not valid JSON: "), std::string::npos) << e;
  EXPECT_NE(e.find("line 3, column 19"), std::string::npos) << e;  // after the token
  EXPECT_EQ(error_of("{\"train_batch_size\": 8 /* never closed"),
            "ds_config: the comment opened at line 1, column 24 is never closed with */");
  EXPECT_NE(error_of(R"({"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}})")
                .find("ds_config: duplicate key fp16.enabled"),
            std::string::npos);
}

// ---- the schedules ----------------------------------------------------------------------

fsdp::WarmupSchedule schedule(double lo, double hi, int64_t warm, bool log, int64_t total) {
  fsdp::WarmupSchedule w;
  w.warmup_min_lr = lo;
  w.warmup_max_lr = hi;
  w.warmup_num_steps = warm;
  w.warmup_type = log ? fsdp::WarmupSchedule::Type::kLog : fsdp::WarmupSchedule::Type::kLinear;
  w.total_num_steps = total;
  return w;
}

// The rates of optimizer steps 0, 1, ... as DeepSpeed 0.19.8's engine sets them, printed by
// tests/interop/deepspeed_lr.py (deepspeed.runtime.lr_schedules in the project's .venv).
TEST(WarmupSchedule, WarmupLrAndWarmupDecayLrGiveDeepSpeedsRates) {
  struct Case {
    fsdp::WarmupSchedule w;
    std::vector<double> rates;
  };
  const std::vector<Case> cases = {
      {schedule(1e-4, 3e-3, 5, true, 0),
       {0.0001, 0.0001, 0.00134896201841284, 0.0020795579640093577, 0.00259792403682568, 0.003,
        0.003, 0.003}},
      {schedule(1e-4, 3e-3, 5, false, 0),
       {0.0001, 0.0001, 0.0006800000000000002, 0.0012600000000000003, 0.00184,
        0.0024200000000000003, 0.003, 0.003}},
      {schedule(0.0, 1e-3, 1, true, 0), {0.0, 0.0, 0.001, 0.001}},
      {schedule(0.0, 3e-3, 4, true, 10),
       {0.0, 0.0, 0.0015, 0.0023774437510817345, 0.003, 0.003, 0.0025, 0.002, 0.0015, 0.001, 0.0005,
        0.0}},
      {schedule(1e-5, 2e-3, 3, false, 10),
       {1e-05, 1e-05, 0.0006733333333333333, 0.0013366666666666666, 0.002, 0.0017157142857142857,
        0.0014314285714285716, 0.0011471428571428572, 0.0008628571428571429, 0.0005785714285714286,
        0.0002942857142857143, 1e-05}},
  };
  for (const auto& c : cases) {
    for (size_t k = 0; k < c.rates.size(); ++k)
      EXPECT_DOUBLE_EQ(c.w.lr(static_cast<int64_t>(k) - 1), c.rates[k]) << "step " << k;
  }
}

// The same against DeepSpeed itself, run now (skipped where deepspeed does not import).
TEST(WarmupSchedule, RatesEqualDeepSpeedsLrSchedulesRunInPython) {
  auto r = run_command({FSDP_PYTHON, source("tests/interop/deepspeed_lr.py")});
  if (r.exit_code == 77) GTEST_SKIP() << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream lines(r.output);
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("RATES ", 0) != 0) continue;
    std::istringstream in(line.substr(6));
    std::string name, kind;
    double lo, hi;
    int64_t warm, total;
    in >> name >> lo >> hi >> warm >> kind >> total;
    const auto w = schedule(lo, hi, warm, kind == "log", total);
    double rate;
    int64_t k = 0;
    while (in >> rate) {
      EXPECT_NEAR(w.lr(k - 1), rate, 1e-18 + 1e-15 * rate) << name << " step " << k;
      ++k;
    }
    EXPECT_GE(k, 4) << line;
    ++cases;
  }
  EXPECT_EQ(cases, 6) << r.output;
}

TEST(DeepSpeedConfig, Stage3ElementBoundsAreTheEnginesAndTheOtherTakesDeepSpeedsDefault) {
  auto c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
          "stage3_max_live_parameters": 3000000, "stage3_param_persistence_threshold": 1000}})");
  EXPECT_EQ(c.sharding.max_live_numel, 3000000);
  EXPECT_EQ(c.sharding.prefetch_bucket_numel, 50000000);  // DeepSpeed's default
  EXPECT_EQ(c.sharding.max_gathered_units, INT_MAX);
  EXPECT_EQ(c.sharding.persistence_threshold_numel, 1000);
  // Below stage 3 they are noted as stage-3 only and change nothing.
  c = fsdp::deepspeed::parse_config(
      R"({"train_batch_size": 8, "zero_optimization": {"stage": 2,
          "stage3_max_live_parameters": 3000000}})");
  EXPECT_EQ(c.sharding.max_live_numel, 0);
  EXPECT_EQ(c.sharding.max_gathered_units, 2);
  EXPECT_FALSE(note(c, "zero_optimization.stage3_max_live_parameters").applied);
}

// ---- train_gpt --deepspeed-config ----------------------------------------------------------

#ifdef FSDP_TEST_HAVE_EXAMPLES
std::string bin(const std::string& name) { return bin_dir() + "/" + name; }

std::vector<double> losses_in(const std::string& log) {
  std::ifstream f(log);
  std::vector<double> out;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

std::vector<std::string> gpt_run(const std::string& log, std::vector<std::string> extra) {
  std::vector<std::string> cmd = {bin("fsdp-run"),
                                  "--nproc",
                                  "2",
                                  "--",
                                  bin("train_gpt"),
                                  "--device",
                                  "cpu",
                                  "--n-layer",
                                  "2",
                                  "--d-model",
                                  "32",
                                  "--n-head",
                                  "2",
                                  "--block-size",
                                  "16",
                                  "--seed",
                                  "7",
                                  "--log-jsonl",
                                  log};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

// The issue's case: stage 3, both offloads to the CPU, fp16 and WarmupDecayLR at world 2.
// Its losses equal those of the same run given as flags, and rank 0 prints what it became.
TEST(TrainGpt, DeepSpeedZero3OffloadFp16ConfigTrainsLikeTheSameFlagsAtWorldTwo) {
  const std::string a = "/tmp/fsdp_ds_config_a.jsonl", b = "/tmp/fsdp_ds_config_b.jsonl";
  auto ra = run_command(
      gpt_run(a, {"--deepspeed-config", source("examples/gpt/ds_config_zero3_offload.json")}));
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  auto rb = run_command(gpt_run(b, {"--sharding",
                                    "zero3",
                                    "--offload-optimizer",
                                    "cpu",
                                    "--offload-param",
                                    "cpu",
                                    "--precision",
                                    "fp16",
                                    "--loss-scale-power",
                                    "12",
                                    "--loss-scale-window",
                                    "100",
                                    "--batch-size",
                                    "12",
                                    "--grad-accum",
                                    "2",
                                    "--clip-grad",
                                    "1",
                                    "--lr",
                                    "3e-3",
                                    "--adam-betas",
                                    "0.9,0.95",
                                    "--adam-eps",
                                    "1e-8",
                                    "--weight-decay",
                                    "0.01",
                                    "--lr-schedule",
                                    "warmup_decay",
                                    "--warmup-min-lr",
                                    "0",
                                    "--warmup-steps",
                                    "3",
                                    "--warmup-type",
                                    "linear",
                                    "--steps",
                                    "8",
                                    "--max-gathered-units",
                                    "1"}));
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  const auto la = losses_in(a), lb = losses_in(b);
  ASSERT_EQ(la.size(), 8u) << ra.output;
  for (double l : la) EXPECT_TRUE(std::isfinite(l)) << ra.output;
  EXPECT_EQ(la, lb);
  for (const char* line :
       {"DeepSpeed config: strategy kFullShard, offload_optimizer cpu, offload_param cpu, "
        "precision "
        "fp16 (loss scale dynamic from 2^12, window 100, hysteresis 2, min 1), prefetch "
        "max_live_numel 1000000000, prefetch_bucket_numel ",
        "batch 12 = micro 3 x accumulation 2 x world 2, gradient_clipping 1",
        "optimizer AdamW: lr 0.003, betas (0.9, 0.95), eps 1e-08, weight_decay 0.01",
        "scheduler WarmupDecayLR: 0 -> 0.003 over 3 steps (linear), then linearly to 0 at step 8",
        "zero_optimization.offload_param.device = \"cpu\": applied: "
        "ShardingOptions::offload_param.device = cpu",
        "wall_clock_breakdown = false: no effect here: "}) {
    EXPECT_NE(ra.output.find(line), std::string::npos) << line << "\n" << ra.output;
  }
  std::remove(a.c_str());
  std::remove(b.c_str());
}

TEST(TrainGpt, DeepSpeedConfigErrorsExitTwoNamingTheKeyOrTheConflictingFlag) {
  const std::string cfg = "/tmp/fsdp_ds_config_bad.json";
  auto run = [&](const std::string& text, std::vector<std::string> extra) {
    std::ofstream(cfg) << text;
    std::vector<std::string> args = {"--deepspeed-config", cfg, "--steps", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<std::string> cmd = {bin("train_gpt"), "--device", "cpu"};
    cmd.insert(cmd.end(), args.begin(), args.end());
    return run_command(cmd);
  };
  auto r =
      run(R"({"train_batch_size": 16, "zero_optimization": {"stage3_max_live_paramters": 1}})", {});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train_gpt: error: --deepspeed-config " + cfg +
                          ": ds_config: zero_optimization.stage3_max_live_paramters is not a key "
                          "this library knows; did you mean stage3_max_live_parameters?"),
            std::string::npos)
      << r.output;
  r = run(R"({"train_batch_size": 16, "zero_optimization": {"stage": "3"}})", {});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(
      r.output.find("ds_config: zero_optimization.stage: \"3\" is a string; expected an integer"),
      std::string::npos)
      << r.output;
  r = run(R"({"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})",
          {"--lr", "3e-4"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train_gpt: error: --lr 0.0003 was given, but --deepspeed-config " + cfg +
                          " sets it to 0.0001 (optimizer.params.lr); leave the flag out, or write "
                          "\"auto\" in the config to take the flag's value"),
            std::string::npos)
      << r.output;
  // NVMe is mapped, and a path that does not exist reaches the engine's check, whose
  // message reaches the user.
  r = run(R"({"train_batch_size": 16, "zero_optimization": {"stage": 3,
              "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent/nvme"}}})",
          {});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("ShardingOptions::offload_optimizer.nvme_path='/nonexistent/nvme' cannot "
                          "be used: No such file or directory"),
            std::string::npos)
      << r.output;
  std::remove(cfg.c_str());
}
#endif

// The names before fsdp::deepspeed stay one release, deprecated (CHANGELOG.md): a program
// that wrote them still compiles, with a warning naming the new one, and gets the same.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(DeepSpeedConfig, TheNamesBeforeTheNamespaceStillReadTheSameConfig) {
  const std::string json =
      R"({"train_batch_size": 12, "gradient_accumulation_steps": 3, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.002}}})";
  fsdp::DeepSpeedProgramValues old_program;
  old_program.world_size = 2;
  const fsdp::DeepSpeedConfig old_names = fsdp::parse_deepspeed_config(json, old_program);
  const fsdp::DeepSpeedOptimizer& old_optimizer = old_names.optimizer;
  const std::vector<fsdp::DeepSpeedNote>& old_notes = old_names.notes;

  fsdp::deepspeed::ProgramValues program;
  program.world_size = 2;
  const Config now = fsdp::deepspeed::parse_config(json, program);
  EXPECT_EQ(old_names.describe(), now.describe());
  EXPECT_EQ(old_names.sharding.strategy, ShardingStrategy::kZero2);
  EXPECT_EQ(old_names.micro_batch_per_rank, 2);
  EXPECT_DOUBLE_EQ(old_optimizer.lr, 0.002);
  EXPECT_EQ(old_notes.size(), now.notes.size());

  const std::string path = ::testing::TempDir() + "/fsdp_ds_old_names.json";
  std::ofstream(path) << json;
  EXPECT_EQ(fsdp::load_deepspeed_config(path, old_program).describe(), now.describe());
  std::remove(path.c_str());
}
#pragma GCC diagnostic pop

}  // namespace

}  // namespace test_deepspeed_config_cases
