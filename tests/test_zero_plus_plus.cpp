// ZeRO++ in training (Note [Quantized training]): qwZ, qgZ and hpZ train like unquantized
// bf16 communication within a stated tolerance, deterministically, and the same check
// fails when quantization is broken on purpose (Note [Quantization faults]); the options'
// refusals and DeepSpeed's three keys.
#include "../src/comm/quantize.h"
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/fsdp.h>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_zero_plus_plus_cases {

namespace {

struct Path {
  const char* name;
  int world;
  ShardingStrategy strategy;
  int hybrid = 0;
  int hpz = 0;
  bool qw = true, qg = true;
  int gradient_bits = 8;
};
void PrintTo(const Path& p, std::ostream* os) { *os << p.name; }

// The MLP with its weights made uneven on purpose: along each parameter, alternate runs of
// 64 elements are 4x the others, so neighbouring quantization blocks (64 elements) have
// scales that differ by up to 4x wherever they fall, and a block dequantized with its
// neighbour's scale is far off.
MlpNet uneven_mlp() {
  torch::manual_seed(11);
  MlpNet net;
  torch::NoGradGuard g;
  for (auto& p : net->parameters()) {
    auto flat = p.view({-1});
    auto idx = torch::arange(flat.numel());
    flat.mul_(1 + 3 * ((idx / 64) % 2).to(torch::kFloat));
  }
  return net;
}

constexpr int kSteps = 12;
// The stated tolerance: every step's loss within 3% of the unquantized run's. (The uneven
// weights make the small elements of a mixed block coarse: int8 weights alone move step
// 0's loss by 0.3%, and SGD at this rate turns that into 1-2% by step 12.)
constexpr double kTolerance = 0.03;

// The global loss of each of kSteps SGD steps of `net` sharded with `o`.
std::vector<double> losses(const ShardingOptions& o, const ProcessGroup& pg) {
  auto model = fully_shard(uneven_mlp(), o);
  torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(0.05));
  std::vector<double> out;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = mlp_batch(step, 16);
    auto loss = torch::mse_loss(model(my_rows(x, pg)).to(torch::kFloat), my_rows(y, pg));
    loss.backward();
    opt.step();
    opt.zero_grad();
    out.push_back(global_mean(loss, pg));
  }
  return out;
}

double worst_relative(const std::vector<double>& a, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - ref[i]) / ref[i]);
  return worst;
}

class QuantizedTraining : public ::testing::TestWithParam<Path> {};

}  // namespace

// Against the same run with bf16 communication unquantized: within kTolerance at every step;
// the same losses twice (deterministic); and with the scales off by one block, outside it.
// FSDP_TEST_BREAK_QUANTIZATION=1 breaks the quantized run itself, so the parity assertion
// fails as it would on a real bug.
TEST_P(QuantizedTraining, TracksUnquantizedBf16WithinTheTolerance) {
  const Path c = GetParam();
  run_ranks(c.world, [c](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.strategy = c.strategy;
    o.hybrid_group_size = c.hybrid;
    o.reshard_after_forward_group_size = c.hpz;
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
    const std::vector<double> ref = losses(o, pg);
    QuantizedCommunication& q = o.quantized_communication;
    q.weights = c.qw;
    q.gradients = c.qg;
    q.gradient_bits = c.gradient_bits;
    q.block_size = 64;
    const char* env = std::getenv("FSDP_TEST_BREAK_QUANTIZATION");
    if (env != nullptr && std::string(env) == "1")
      fsdp::detail::set_quantization_fault(fsdp::detail::QuantizationFault::kScalesOffByOneBlock);
    const std::vector<double> quant = losses(o, pg);
    const double err = worst_relative(quant, ref);
    if (std::getenv("FSDP_TEST_PRINT_LOSSES") != nullptr && pg.rank() == 0)
      for (int i = 0; i < kSteps; ++i)
        std::printf("[report] step %d %.6f %.6f\n", i, quant[i], ref[i]);
    EXPECT_LE(err, kTolerance) << "the worst step's loss is " << err * 100
                               << "% from the unquantized run's";
    EXPECT_EQ(losses(o, pg), quant) << "not deterministic";
    fsdp::detail::set_quantization_fault(fsdp::detail::QuantizationFault::kScalesOffByOneBlock);
    const double broken = worst_relative(losses(o, pg), ref);
    fsdp::detail::set_quantization_fault(fsdp::detail::QuantizationFault::kNone);
    EXPECT_GT(broken, kTolerance) << "the check would not catch scales off by one block";
    if (pg.rank() == 0) {
      std::printf(
          "[report] %-26s loss after %d steps: %.6f quantized, %.6f bf16; worst step "
          "%.4f%% (tolerance %.0f%%); scales off by one block: %.2f%%\n",
          c.name, kSteps, quant.back(), ref.back(), err * 100, kTolerance * 100, broken * 100);
      std::fflush(stdout);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Paths, QuantizedTraining,
    ::testing::Values(Path{"QwzWorld2", 2, ShardingStrategy::kFullShard, 0, 0, true, false},
                      Path{"QgzWorld3", 3, ShardingStrategy::kFullShard, 0, 0, false, true},
                      Path{"QwzQgzHpzWorld4", 4, ShardingStrategy::kFullShard, 0, 2},
                      Path{"QwzQgzInt4World4", 4, ShardingStrategy::kFullShard, 0, 2, true, true,
                           4},
                      Path{"HybridQwzQgzWorld4", 4, ShardingStrategy::kHybridShard, 2},
                      Path{"Zero2QwzQgzWorld2", 2, ShardingStrategy::kZero2},
                      Path{"NoShardQgzWorld2", 2, ShardingStrategy::kNoShard, 0, 0, false, true}),
    [](const ::testing::TestParamInfo<Path>& i) { return std::string(i.param.name); });

TEST(QuantizedCommunicationOptions, BadValuesNameTheFieldAndTheFix) {
  auto error = [](const QuantizedCommunication& q) {
    ShardingOptions o;
    o.quantized_communication = q;
    try {
      fully_shard(MlpNet(), o);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("<no error>");
  };
  QuantizedCommunication q;
  q.weights = true;
  q.weight_bits = 3;
  EXPECT_NE(error(q).find("QuantizedCommunication::weight_bits=3 is unsupported; use 8 (int8) "
                          "or 4 (int4)"),
            std::string::npos)
      << error(q);
  q = {};
  q.gradients = true;
  q.block_size = 0;
  EXPECT_NE(error(q).find("QuantizedCommunication::block_size=0 must be at least 1"),
            std::string::npos);
  q = {};
  q.gradients = true;
  q.scale_dtype = torch::kHalf;
  EXPECT_NE(error(q).find("QuantizedCommunication::scale_dtype=Half is unsupported"),
            std::string::npos);
  q = {};
  q.weight_bits = 3;  // ignored while nothing is quantized
  EXPECT_EQ(error(q), "<no error>");
}

// DeepSpeed's three ZeRO++ keys become the options, with a note each; at stage 2 they are
// noted as stage 3 only; a bad partition size names the value and the fix.
TEST(QuantizedCommunicationOptions, DeepSpeedKeysMapToTheOptions) {
  deepspeed::ProgramValues p;
  p.world_size = 4;
  p.micro_batch_per_rank = 2;
  const auto ds = deepspeed::parse_config(
      R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
          "zero_quantized_weights": true, "zero_quantized_gradients": true,
          "zero_hpz_partition_size": 2}})",
      p);
  EXPECT_TRUE(ds.sharding.quantized_communication.weights);
  EXPECT_TRUE(ds.sharding.quantized_communication.gradients);
  EXPECT_EQ(ds.sharding.reshard_after_forward_group_size, 2);
  const std::string text = ds.describe();
  EXPECT_NE(text.find("ShardingOptions::quantized_communication.weights = true"), std::string::npos)
      << text;
  EXPECT_NE(text.find("ShardingOptions::reshard_after_forward_group_size = 2"), std::string::npos);
  const auto stage2 = deepspeed::parse_config(
      R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2,
          "zero_quantized_weights": true, "zero_hpz_partition_size": 2}})",
      p);
  EXPECT_FALSE(stage2.sharding.quantized_communication.weights);
  EXPECT_EQ(stage2.sharding.reshard_after_forward_group_size, 0);
  EXPECT_NE(stage2.describe().find("stage 3 only"), std::string::npos);
  const auto one = deepspeed::parse_config(
      R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
          "zero_hpz_partition_size": 1}})",
      p);
  EXPECT_EQ(one.sharding.reshard_after_forward_group_size, 0);
  try {
    deepspeed::parse_config(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization":
                              {"stage": 3, "zero_hpz_partition_size": 3}})",
                            p);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("zero_optimization.zero_hpz_partition_size 3 must divide the "
                        "data-parallel world size 4"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace test_zero_plus_plus_cases
