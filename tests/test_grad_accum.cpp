// Gradient accumulation over micro-batches, both ways: reduce-scatter after every
// micro-batch (default), or keep unsharded gradients inside NoSyncScope and reduce once.
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_grad_accum_cases {

namespace {

constexpr int kMicro = 4;
constexpr int64_t kMicroRows = 12;  // per micro-batch, divisible by the world size

struct Outcome {
  stats::CommStats comm;  ///< last step
  int64_t comm_peak = 0;  ///< peak bytes of unsharded gradient buffers
  int64_t padded = 0;     ///< sum of padded flat sizes, elements
};

Outcome accumulate(const ProcessGroup& pg, bool no_sync) {
  torch::manual_seed(31);
  MlpNet reference;
  torch::manual_seed(31);
  ShardingOptions o;
  o.process_group = pg;
  auto model = fully_shard(MlpNet(), o);
  auto adamw = torch::optim::AdamWOptions(1e-2).eps(1e-6);
  torch::optim::AdamW opt(model.sharded_parameters(), adamw);
  torch::optim::AdamW ref_opt(reference->parameters(), adamw);
  Outcome out;
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = mlp_batch(step, kMicro * kMicroRows);
    model.reset_peak_memory();
    double global = 0;
    for (int m = 0; m < kMicro; ++m) {
      auto xm = x.narrow(0, m * kMicroRows, kMicroRows),
           ym = y.narrow(0, m * kMicroRows, kMicroRows);
      auto loss = torch::mse_loss(model(my_rows(xm, pg)), my_rows(ym, pg)) / kMicro;
      if (no_sync && m < kMicro - 1) {
        NoSyncScope scope(model);
        loss.backward();
      } else {
        loss.backward();
      }
      global += global_mean(loss, pg);
    }
    out.comm = model.comm_stats().step;  // the last micro-batch's step counters
    out.comm_peak = model.memory_stats().comm_buffers.peak;
    opt.step();
    opt.zero_grad();

    double ref = 0;  // the whole batch, in the same shares
    for (int m = 0; m < kMicro; ++m) {
      for (int s = 0; s < pg.size(); ++s) {
        auto xm = share_rows(x.narrow(0, m * kMicroRows, kMicroRows), s, pg.size());
        auto ym = share_rows(y.narrow(0, m * kMicroRows, kMicroRows), s, pg.size());
        auto l = torch::mse_loss(reference(xm), ym) / (kMicro * pg.size());
        l.backward();
        ref += l.item<double>();
      }
    }
    ref_opt.step();
    ref_opt.zero_grad();
    EXPECT_NEAR(global, ref, 1e-5 * ref) << "step " << step;
  }
  expect_params_match(full_state_dict(model), *reference, 1e-5);
  for (const auto& f : fsdp::detail::flat_params(model)) out.padded += f.padded_numel;
  return out;
}

TEST(GradientAccumulation, BothModesEqualUnshardedTrainingOnTheWholeBatch) {
  run_ranks(2, [](const ProcessGroup& pg) {
    Outcome every = accumulate(pg, false);
    Outcome once = accumulate(pg, true);
    // Step counters restart at each training forward, so they hold the last micro-batch:
    // the default reduce-scatters every unit's flat gradient after it; so does no_sync,
    // whose last backward reduces the sum of all four.
    EXPECT_EQ(every.comm.reduce_scatter_bytes, 4 * every.padded);
    EXPECT_EQ(once.comm.reduce_scatter_bytes, 4 * once.padded);
    // Memory: no_sync holds every unit's unsharded fp32 gradient at once; the default
    // frees each unit's buffer as soon as it is reduced.
    EXPECT_EQ(once.comm_peak, 4 * once.padded);
    EXPECT_LT(every.comm_peak, 4 * every.padded);
  });
}

TEST(GradientAccumulation, NoSyncCommunicatesOnceInsteadOfEveryMicroBatch) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto count = [&](bool no_sync) {
      torch::manual_seed(1);
      ShardingOptions o;
      o.process_group = pg;
      auto model = fully_shard(MlpNet(), o);
      int64_t before = model.comm_stats().total.reduce_scatter_bytes;
      for (int m = 0; m < kMicro; ++m) {
        auto loss = model(torch::randn({6, 16})).pow(2).mean();
        if (no_sync && m < kMicro - 1) {
          NoSyncScope scope(model);
          loss.backward();
        } else {
          loss.backward();
        }
      }
      return model.comm_stats().total.reduce_scatter_bytes - before;
    };
    const int64_t every = count(false), once = count(true);
    EXPECT_GT(once, 0);
    EXPECT_EQ(every, kMicro * once);
  });
}

TEST(GradientAccumulation, SetRequiresGradientSyncIsNoSyncScopeWithoutAScope) {
  run_ranks(2, [](const ProcessGroup& pg) {
    // The same micro-batches, skipping the sync of the first three through the scope or
    // through the verb: the same single reduction and bit-identical gradient shards.
    auto run = [&](bool verb) {
      torch::manual_seed(1);
      ShardingOptions o;
      o.process_group = pg;
      auto model = fully_shard(MlpNet(), o);
      EXPECT_TRUE(model.requires_gradient_sync());
      torch::manual_seed(2 + pg.rank());
      for (int m = 0; m < kMicro; ++m) {
        auto loss = model(torch::randn({6, 16})).pow(2).mean();
        const bool sync = m == kMicro - 1;
        if (verb) {
          model.set_requires_gradient_sync(sync);
          loss.backward();
        } else if (!sync) {
          NoSyncScope scope(model);
          EXPECT_FALSE(model.requires_gradient_sync());
          loss.backward();
        } else {
          loss.backward();
        }
      }
      EXPECT_TRUE(model.requires_gradient_sync());  // the scope restored it; the verb set it
      std::vector<torch::Tensor> grads;
      for (const auto& p : model.sharded_parameters()) grads.push_back(p.grad().clone());
      return std::make_pair(model.comm_stats().total.reduce_scatter_calls, grads);
    };
    auto [scope_calls, scope_grads] = run(false);
    auto [verb_calls, verb_grads] = run(true);
    EXPECT_EQ(verb_calls, scope_calls);
    ASSERT_EQ(verb_grads.size(), scope_grads.size());
    for (size_t i = 0; i < verb_grads.size(); ++i)
      EXPECT_TRUE(torch::equal(verb_grads[i], scope_grads[i])) << i;
  });
}

}  // namespace

}  // namespace test_grad_accum_cases
