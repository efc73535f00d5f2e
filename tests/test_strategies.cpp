// Sharding strategies and global gradient clipping, against unsharded training.
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/clip_grad.h>

#include <gtest/gtest.h>

#include <limits>
#include <set>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_strategies_cases {

namespace {

struct Case {
  ShardingStrategy strategy;
  const char* name;
};
// Names the case in test listings (ctest shows it).
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr int64_t kRows = 12;

// Trains the MLP for 10 AdamW steps sharded and unsharded (see Note [Adam and noise]
// in test_parity.cpp), optionally clipping, and checks losses, norms and parameters.
void train_and_compare(const ProcessGroup& pg, ShardingOptions o, double clip, double norm_type) {
  torch::manual_seed(11);
  MlpNet reference;
  torch::manual_seed(11);
  o.process_group = pg;
  auto model = fully_shard(MlpNet(), o);
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6);
  torch::optim::AdamW opt(model.sharded_parameters(), adamw);
  torch::optim::AdamW ref_opt(reference->parameters(), adamw);
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = mlp_batch(step, kRows);
    auto loss = torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg));
    loss.backward();
    double global = global_mean(loss, pg);
    double ref = 0;
    for (int s = 0; s < pg.size(); ++s) {
      auto l =
          torch::mse_loss(reference(share_rows(x, s, pg.size())), share_rows(y, s, pg.size())) /
          pg.size();
      l.backward();
      ref += l.item<double>();
    }
    EXPECT_NEAR(global, ref, 1e-5 * ref) << "step " << step;
    if (clip > 0) {
      double norm = clip_grad_norm_(model, clip, norm_type);
      double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), clip, norm_type);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "step " << step;
      // Every rank returns the same norm.
      auto t = torch::tensor({norm}, torch::kDouble);
      auto mx = t.clone();
      pg.all_reduce_max(mx);
      EXPECT_EQ(mx.item<double>(), norm);
    }
    opt.step();
    opt.zero_grad();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  expect_params_match(full_state_dict(model), *reference, 1e-5);

  // Communication of one more step against the theory for this strategy.
  auto [x, y] = mlp_batch(99, kRows);
  torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg)).backward();
  const auto& c = model.comm_stats().step;
  int64_t all = 0, non_root = 0, shards = 0;
  for (const auto& f : fsdp::detail::flat_params(model)) {
    all += f.padded_numel;
    if (!f.unit_fqn.empty()) non_root += f.padded_numel;
    shards += f.shard_numel;
  }
  if (pg.size() == 1) {
    EXPECT_EQ(c.total_bytes(), 0);  // a group of one moves nothing
    return;
  }
  switch (o.strategy) {
    case ShardingStrategy::kFullShard:
      EXPECT_EQ(c.all_gather_bytes, 4 * (all + non_root));
      EXPECT_EQ(c.reduce_scatter_bytes, 4 * all);
      EXPECT_EQ(c.all_reduce_bytes, 0);
      break;
    case ShardingStrategy::kShardGradOp:  // gathered once, kept through backward
    case ShardingStrategy::kZero2:        // kept across steps, gathered again once changed
    case ShardingStrategy::kZero1: {      // as kZero2, reduced after backward
      EXPECT_EQ(c.all_gather_bytes, 4 * all);
      EXPECT_EQ(c.reduce_scatter_bytes, 4 * all);
      // Units kept across the step agree on whether they changed: one int32 flag each
      // (Note [Writes the version counter misses]).
      std::set<std::string> units;
      for (const auto& f : fsdp::detail::flat_params(model)) units.insert(f.unit_fqn);
      const bool kept = o.strategy != ShardingStrategy::kShardGradOp;
      EXPECT_EQ(c.all_reduce_bytes, kept ? 4 * static_cast<int64_t>(units.size()) : 0);
      break;
    }
    case ShardingStrategy::kNoShard:  // replicated: no gathers, one all-reduce per unit
      EXPECT_EQ(c.all_gather_bytes, 0);
      EXPECT_EQ(c.reduce_scatter_bytes, 0);
      EXPECT_EQ(c.all_reduce_bytes, 4 * all);
      EXPECT_EQ(shards, all);
      break;
    case ShardingStrategy::kHybridShard:  // FULL_SHARD in the group, all-reduce of shards across
      EXPECT_EQ(c.all_gather_bytes, 4 * (all + non_root));
      EXPECT_EQ(c.reduce_scatter_bytes, 4 * all);
      EXPECT_EQ(c.all_reduce_bytes, 4 * shards);
      EXPECT_EQ(shards * o.hybrid_group_size, all);
      break;
  }
}

class StrategyAtWorld4 : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyAtWorld4, MatchesUnshardedTrainingAndMovesTheTheoreticalBytes) {
  const Case c = GetParam();
  run_ranks(4, [c](const ProcessGroup& pg) {
    ShardingOptions o;
    o.strategy = c.strategy;
    o.hybrid_group_size = 2;  // HYBRID_SHARD as 2 groups of 2
    train_and_compare(pg, o, 0, 2);
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, StrategyAtWorld4,
                         ::testing::Values(Case{ShardingStrategy::kFullShard, "full"},
                                           Case{ShardingStrategy::kShardGradOp, "grad_op"},
                                           Case{ShardingStrategy::kNoShard, "none"},
                                           Case{ShardingStrategy::kHybridShard, "hybrid"},
                                           Case{ShardingStrategy::kZero2, "zero2"},
                                           Case{ShardingStrategy::kZero1, "zero1"}),
                         [](const auto& info) { return std::string(info.param.name); });

class ClipAtWorld : public ::testing::TestWithParam<int> {};

TEST_P(ClipAtWorld, L2NormAndClippedParametersMatchUnshardedClipGradNorm) {
  run_ranks(GetParam(),
            [](const ProcessGroup& pg) { train_and_compare(pg, ShardingOptions(), 0.05, 2.0); });
}

TEST_P(ClipAtWorld, InfNormAndClippedParametersMatchUnshardedClipGradNorm) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) {
    train_and_compare(pg, ShardingOptions(), 0.01, std::numeric_limits<double>::infinity());
  });
}

INSTANTIATE_TEST_SUITE_P(World, ClipAtWorld, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(ClipGradNorm, UnsupportedNormTypeIsRejected) {
  auto model = fully_shard(MlpNet());
  try {
    clip_grad_norm_(model, 1.0, 1.0);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "clip_grad_norm_: norm_type=1 is unsupported; use 2.0 (L2) or "
              "std::numeric_limits<double>::infinity()");
  }
}

TEST(Strategies, HybridGroupSizeMustDivideTheWorld) {
  run_ranks(3, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_group_size = 2;
    try {
      fully_shard(MlpNet(), o);
      FAIL() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_EQ(std::string(e.what_without_backtrace()),
                "ShardingOptions::hybrid_group_size=2 must divide the world size 3 (e.g. the "
                "ranks per node), or be 0 for the whole world");
    }
  });
}

}  // namespace

namespace {
// Frozen parameters and two optimizer parameter groups (root unit vs the rest, each
// with its own learning rate), with clipping, against the same setup unsharded.
TEST(ClipGradNorm, WorksWithFrozenParametersAndSeveralParameterGroups) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto freeze = [](MlpNet& m) { m->inp->weight.set_requires_grad(false); };
    torch::manual_seed(13);
    MlpNet reference;
    freeze(reference);
    torch::manual_seed(13);
    MlpNet fresh;
    freeze(fresh);
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(fresh, o);

    // Sharded groups: the root unit's trainable shard, then every other unit's.
    std::vector<torch::Tensor> root_shards, other_shards;
    {
      auto shards = model.sharded_parameters();
      size_t k = 0;
      for (const auto& f : fsdp::detail::flat_params(model)) {
        if (!f.requires_grad) continue;
        (f.unit_fqn.empty() ? root_shards : other_shards).push_back(shards[k++]);
      }
    }
    std::set<std::string> root_fqns;
    for (const auto& p : model.param_table()) {
      if (p.unit_fqn.empty()) root_fqns.insert(p.fqn);
    }
    std::vector<torch::Tensor> ref_root, ref_other;
    for (auto& [n, p] : named_parameters_clean(*reference)) {
      if (!p.requires_grad()) continue;
      (root_fqns.count(n) ? ref_root : ref_other).push_back(p);
    }
    auto groups = [](std::vector<torch::Tensor> a, std::vector<torch::Tensor> b) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(a, std::make_unique<torch::optim::SGDOptions>(0.05));
      g.emplace_back(b, std::make_unique<torch::optim::SGDOptions>(0.2));
      return g;
    };
    torch::optim::SGD opt(groups(root_shards, other_shards), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(groups(ref_root, ref_other), torch::optim::SGDOptions(0.1));
    auto frozen_before = reference->inp->weight.detach().clone();
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = mlp_batch(step, 12);
      torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg)).backward();
      for (int s = 0; s < pg.size(); ++s) {
        (torch::mse_loss(reference(share_rows(x, s, pg.size())), share_rows(y, s, pg.size())) /
         pg.size())
            .backward();
      }
      double norm = clip_grad_norm_(model, 0.05);
      std::vector<torch::Tensor> trainable = ref_root;
      trainable.insert(trainable.end(), ref_other.begin(), ref_other.end());
      double ref_norm = torch::nn::utils::clip_grad_norm_(trainable, 0.05);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "step " << step;
      opt.step();
      opt.zero_grad();
      ref_opt.step();
      ref_opt.zero_grad();
    }
    expect_params_match(full_state_dict(model), *reference, 1e-5);
    for (auto& [n, t] : full_state_dict(model)) {
      if (n == "inp.weight") EXPECT_TRUE(torch::equal(t, frozen_before));
    }
  });
}
}  // namespace

}  // namespace test_strategies_cases
