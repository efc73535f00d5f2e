// The options core (include/fsdp/core/options.h, Note [Options core]): one table of
// names, one set of rules, each message naming the option as its reader wrote it.
#include <fsdp/core/options.h>

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace test_options_core_cases {
namespace {

using fsdp::OffloadDevice;
using fsdp::Precision;
using fsdp::ShardingStrategy;
using fsdp::core::Option;
using fsdp::core::Options;
using fsdp::core::Surface;

// The message validate() throws for `o`, or "" when it passes.
std::string error(const Options& o, Surface s) {
  try {
    fsdp::core::validate(o, s);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(OptionsCore, EveryStrategyParsesFromTheNameItPrints) {
  for (auto v :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
        ShardingStrategy::kHybridShard, ShardingStrategy::kZero2, ShardingStrategy::kZero1}) {
    const std::string flag = fsdp::core::strategy_name(v, Surface::kFlags);
    EXPECT_EQ(fsdp::core::parse_strategy(flag, "--sharding"), v) << flag;
    EXPECT_EQ(std::string(fsdp::core::strategy_name(v, Surface::kApi)).rfind('k', 0), 0u);
  }
  EXPECT_EQ(fsdp::core::parse_strategy("zero3", "--sharding"), ShardingStrategy::kFullShard);
  try {
    fsdp::core::parse_strategy("zero4", "--sharding");
    ADD_FAILURE() << "zero4 parsed";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "--sharding zero4 is unknown; use full, grad_op, none, hybrid, zero2 or zero1 (zero3 "
              "is full)");
  }
  for (auto p : {Precision::kFp32, Precision::kBf16, Precision::kFp16})
    EXPECT_EQ(fsdp::parse_precision(fsdp::to_string(p)), p);
  for (auto d : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme})
    EXPECT_EQ(fsdp::core::parse_offload(fsdp::to_string(d), Option::kOffloadParam, Surface::kFlags),
              d);
  EXPECT_THROW(fsdp::core::parse_offload("disk", Option::kOffloadParam, Surface::kFlags),
               std::invalid_argument);
}

TEST(OptionsCore, ARuleSaysTheSameInTheApisWordsAndTheFlags) {
  Options o;
  o.strategy = ShardingStrategy::kHybridShard;
  o.world_size = 4;
  o.hybrid_group_size = 3;
  EXPECT_EQ(error(o, Surface::kApi),
            "ShardingOptions::hybrid_group_size=3 must divide the world size 4 (e.g. the ranks per "
            "node), or be 0 for the whole world");
  EXPECT_EQ(error(o, Surface::kFlags),
            "--hybrid-group-size 3 must divide the world size 4 (e.g. the ranks per node), or be 0 "
            "for the whole world");
  o.hybrid_group_size = 2;
  EXPECT_EQ(error(o, Surface::kApi), "");

  Options pure;
  pure.master = Precision::kBf16;
  EXPECT_EQ(error(pure, Surface::kApi),
            "MixedPrecision::master_dtype=BFloat16 (pure bf16) needs "
            "MixedPrecision::param_dtype=BFloat16 "
            "too (got Float): the gathered parameters cannot be more precise than the shards");
  EXPECT_EQ(error(pure, Surface::kFlags),
            "--master-dtype bf16 (pure bf16) needs --precision bf16 too (got fp32): the gathered "
            "parameters cannot be more precise than the shards");
}

TEST(OptionsCore, OffloadRulesAndTheDeprecatedSwitch) {
  Options o;
  o.offload_param = OffloadDevice::kCpu;
  EXPECT_EQ(error(o, Surface::kFlags).rfind("--offload-param cpu needs --offload-optimizer too", 0),
            0u)
      << error(o, Surface::kFlags);
  o.offload_optimizer = OffloadDevice::kCpu;
  o.offload_param = OffloadDevice::kNvme;
  EXPECT_EQ(error(o, Surface::kFlags)
                .rfind("--offload-param nvme needs --offload-optimizer nvme too (got cpu)", 0),
            0u)
      << error(o, Surface::kFlags);
  o.offload_optimizer = OffloadDevice::kNvme;
  o.strategy = ShardingStrategy::kZero2;
  EXPECT_NE(error(o, Surface::kFlags).find("needs a strategy that frees parameters after use"),
            std::string::npos);
  o.strategy = ShardingStrategy::kFullShard;
  EXPECT_EQ(error(o, Surface::kFlags), "");
  o.nvme_buffer_bytes = 0;
  EXPECT_EQ(error(o, Surface::kFlags).rfind("--nvme-buffer-bytes 0 is invalid", 0), 0u);

  Options legacy;
  legacy.cpu_offload = true;
  legacy.offload_param = OffloadDevice::kNvme;
  legacy.offload_optimizer = OffloadDevice::kNvme;
  EXPECT_EQ(error(legacy, Surface::kApi)
                .rfind("ShardingOptions::cpu_offload (everything to host memory) "
                       "contradicts",
                       0),
            0u);
  legacy.offload_param = legacy.offload_optimizer = OffloadDevice::kNone;
  EXPECT_EQ(error(legacy, Surface::kApi), "");
  const Options both = fsdp::core::resolved(legacy);
  EXPECT_EQ(both.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_EQ(both.offload_param, OffloadDevice::kCpu);
  EXPECT_FALSE(both.cpu_offload);
}

// A trainer reads its flags before the world is up: the rules that need its size wait
// for the engine; the others hold already.
TEST(OptionsCore, RulesThatNeedTheWorldWaitForIt) {
  Options o;
  o.world_size_known = false;
  o.world_size = 0;
  o.strategy = ShardingStrategy::kHybridShard;
  o.hybrid_group_size = 3;
  o.hpz_group_size = 5;
  EXPECT_EQ(error(o, Surface::kFlags), "");
  o.strategy = ShardingStrategy::kShardGradOp;
  EXPECT_EQ(
      error(o, Surface::kFlags)
          .rfind("--hpz-group-size 5 needs a strategy that frees parameters after forward", 0),
      0u)
      << error(o, Surface::kFlags);
  o.world_size_known = true;
  o.strategy = ShardingStrategy::kFullShard;
  o.world_size = 8;
  EXPECT_EQ(
      error(o, Surface::kFlags),
      "--hpz-group-size 5 must divide the shard group size 8 and lie strictly between 1 and 8 "
      "(e.g. the number of ranks per node); 0 reshards to the whole shard group");
  o.hpz_group_size = 4;
  EXPECT_EQ(error(o, Surface::kFlags), "");
  EXPECT_EQ(fsdp::core::shard_group_size(o), 8);
}

TEST(OptionsCore, QuantizationIsCheckedOnlyWhenItIsOn) {
  Options o;
  o.weight_bits = 3;
  EXPECT_EQ(error(o, Surface::kApi), "");
  o.quantize_weights = true;
  EXPECT_EQ(error(o, Surface::kApi),
            "QuantizedCommunication::weight_bits=3 is unsupported; use 8 (int8) or 4 (int4)");
  o.weight_bits = 4;
  o.quantize_block = 0;
  EXPECT_EQ(error(o, Surface::kFlags),
            "--quantize-block 0 must be at least 1 element per scale (2048 is the default)");
}

TEST(OptionsCore, SingleValuesOfSeveralReaders) {
  auto msg = [](auto&& fn) {
    try {
      fn();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(msg([] { fsdp::core::check_backend("mpi", "--backend", Surface::kFlags); }),
            "--backend mpi is unknown; use auto (nccl on a GPU, gloo on the CPU), gloo or nccl");
  EXPECT_EQ(msg([] { fsdp::core::check_backend("nccl", "--backend", Surface::kFlags); }), "");
  EXPECT_EQ(msg([] {
              fsdp::core::check_pipeline_stages(3, 4, "PipelineOptions::stages", Surface::kApi);
            }),
            "PipelineOptions::stages=3 does not divide the world size 4: the world is stages x "
            "data-parallel ranks; use a divisor of 4");
  EXPECT_EQ(
      msg([] { fsdp::core::check_pipeline_stages(3, 0, "--pipeline-stages", Surface::kFlags); }),
      "");
  EXPECT_EQ(msg([] { fsdp::core::check_micro_batches(0, "--micro-batches", Surface::kFlags); }),
            "");
  EXPECT_EQ(msg([] {
              fsdp::core::check_micro_batches(0, "PipelineOptions::micro_batches", Surface::kApi);
            }),
            "PipelineOptions::micro_batches=0 must be at least 1");
  EXPECT_EQ(fsdp::core::pipeline_partition({10, 10, 10, 10}, 2, "uniform", "s=", "p="),
            (std::vector<int64_t>{0, 2, 4}));
}

}  // namespace
}  // namespace test_options_core_cases
