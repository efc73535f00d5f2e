// Dynamic loss scaling with DeepSpeed's rules, on fp32 shards with injected overflows.
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/loss_scaler.h>

#include <gtest/gtest.h>

#include <limits>
#include <set>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_loss_scaler_cases {

namespace {

TEST(LossScaler, FollowsHysteresisWindowAndMinimumAndSkipsOverflowedStepsOnEveryRank) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    torch::manual_seed(41);
    auto model = fully_shard(MlpNet(), o);
    torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(0.01));
    LossScalerOptions so;
    so.initial_scale_power = 4;  // 16
    so.loss_scale_window = 3;
    so.hysteresis = 2;
    so.min_loss_scale = 2;
    LossScaler scaler(model, so);
    EXPECT_EQ(scaler.state().scale, 16);
    // Overflow injected on rank 1 only (its loss times infinity). The reduction carries
    // it into every shard, and the decision is all-reduced, so every rank skips alike.
    const std::set<int> overflow_steps = {3, 4, 8, 9, 10, 11, 12, 13};
    // Scale after each step, worked out by hand from DeepSpeed's rules:
    //  0-1 clean; 2 clean ends a window of 3 -> 32; 3 overflow uses hysteresis (2 -> 1);
    //  4 overflow halves -> 16; 5, 6 clean; 7 ends a window -> 32 (hysteresis back to 2);
    //  8 uses hysteresis; 9, 10, 11, 12 halve -> 16, 8, 4, 2; 13 overflows at the minimum.
    const std::vector<double> expected = {16, 16, 32, 32, 16, 16, 16, 32, 32, 16, 8, 4, 2};
    for (int step = 0; step < 14; ++step) {
      auto [x, y] = mlp_batch(step, 4);
      auto loss = torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg));
      if (overflow_steps.count(step) && pg.rank() == 1)
        loss = loss * std::numeric_limits<float>::infinity();
      scaler.scale(loss).backward();
      auto before = model.sharded_parameters()[0].detach().clone();
      bool stepped = scaler.step(opt);
      EXPECT_EQ(stepped, !overflow_steps.count(step)) << "step " << step;
      auto after = model.sharded_parameters()[0].detach();
      EXPECT_EQ(torch::equal(before, after), !stepped) << "step " << step;
      opt.zero_grad();
      if (step == 13) {
        try {
          scaler.update();
          FAIL() << "no error at the minimum scale";
        } catch (const c10::Error& e) {
          EXPECT_EQ(std::string(e.what_without_backtrace()),
                    "LossScaler: gradients overflowed (inf or nan) at the minimum loss scale 2 "
                    "(iteration 13), so the step cannot be saved by a smaller scale: training has "
                    "diverged or fp16 cannot represent these gradients. Try bf16 instead of fp16, "
                    "a lower learning rate, gradient clipping, or a lower min_loss_scale.");
        }
        break;
      }
      scaler.update();
      EXPECT_EQ(scaler.state().scale, expected[step]) << "step " << step;
    }
    EXPECT_EQ(scaler.state().skipped_steps, 8);
    EXPECT_EQ(scaler.state().last_overflow_iteration, 12);
  });
}

TEST(LossScaler, UnscaledGradientsEqualUnscaledTraining) {
  torch::manual_seed(42);
  auto a = fully_shard(MlpNet());
  torch::manual_seed(42);
  auto b = fully_shard(MlpNet());
  torch::optim::SGD opt_a(a.sharded_parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_b(b.sharded_parameters(), torch::optim::SGDOptions(0.1));
  LossScaler scaler(b);  // 2^16: exact in binary, so scaled gradients unscale exactly
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = mlp_batch(step, 8);
    torch::mse_loss(a(x), y).backward();
    opt_a.step();
    opt_a.zero_grad();
    scaler.scale(torch::mse_loss(b(x), y)).backward();
    EXPECT_TRUE(scaler.step(opt_b));
    scaler.update();
    opt_b.zero_grad();
  }
  auto pa = a.sharded_parameters(), pb = b.sharded_parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i]));
}

TEST(LossScaler, StaticScaleNeverChangesButStillSkipsOverflow) {
  auto model = fully_shard(MlpNet());
  torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(0.1));
  LossScalerOptions so;
  so.loss_scale = 128;
  LossScaler scaler(model, so);
  for (int step = 0; step < 4; ++step) {
    auto loss = model(torch::randn({4, 16})).pow(2).mean();
    if (step == 1) loss = loss * std::numeric_limits<float>::infinity();
    scaler.scale(loss).backward();
    EXPECT_EQ(scaler.step(opt), step != 1);
    scaler.update();
    opt.zero_grad();
    EXPECT_EQ(scaler.state().scale, 128);
  }
}

TEST(LossScaler, BadOptionsNameTheValue) {
  auto model = fully_shard(MlpNet());
  LossScalerOptions so;
  so.hysteresis = 0;
  try {
    LossScaler scaler(model, so);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "LossScalerOptions::hysteresis=0 must be at least 1");
  }
}

}  // namespace

}  // namespace test_loss_scaler_cases
