// Full parameters on demand, and identical starting weights across ranks.
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>
#include "../src/internal/sharded_model.h"  // flat sizes, for the exact byte count

#include <map>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_full_params_cases {

namespace {

std::map<std::string, torch::Tensor> as_map(
    const std::vector<std::pair<std::string, torch::Tensor>>& v) {
  return {v.begin(), v.end()};
}

TEST(FullParams, ScopeShowsFullValuesUnderOriginalNamesAndWritesBack) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto cfg = small_gpt_config();
    torch::manual_seed(51);
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(gpt::GPT(cfg), o);
    auto full = as_map(full_state_dict(model));
    {
      FullParamsScope scope(model);
      auto live = named_parameters_clean(*model);
      ASSERT_EQ(live.size(), full.size());
      for (auto& [name, p] : live) {
        EXPECT_EQ(p.sizes(), full[name].sizes()) << name;
        EXPECT_TRUE(torch::equal(p.detach(), full[name])) << name;
      }
      torch::NoGradGuard g;
      model->module()->lm_head->weight.fill_(0.5);  // an edit made through the original parameter
    }
    EXPECT_EQ(model.memory_stats().gathered_params.current, 0);
    auto after = as_map(full_state_dict(model));
    EXPECT_TRUE(
        torch::equal(after["lm_head.weight"], torch::full_like(after["lm_head.weight"], 0.5)));
    EXPECT_TRUE(torch::equal(after["wte.weight"], full["wte.weight"]));
  });
}

TEST(FullParams, UnshardHoldsFullValuesUntilReshardAndNeverWritesBack) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto cfg = small_gpt_config();
    torch::manual_seed(52);
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(gpt::GPT(cfg), o);
    auto full = as_map(full_state_dict(model));
    auto idx = torch::randint(0, cfg.vocab_size, {2, 8}, torch::kLong);
    torch::Tensor expected;
    {
      torch::NoGradGuard g;
      expected = model(idx);
    }
    int64_t full_bytes = 0;  // every unit's padded fp32 flat parameters
    for (const auto& f : fsdp::detail::flat_params(model)) full_bytes += f.padded_numel * 4;

    model.unshard();
    EXPECT_EQ(model.memory_stats().gathered_params.current, full_bytes);
    auto live = named_parameters_clean(*model);
    ASSERT_EQ(live.size(), full.size());
    for (auto& [name, p] : live) EXPECT_TRUE(torch::equal(p.detach(), full[name])) << name;
    {
      torch::NoGradGuard g;
      model->module()->lm_head->weight.fill_(0.5);
    }
    model.reshard();
    EXPECT_EQ(model.memory_stats().gathered_params.current, 0);
    model.reshard();  // idempotent
    EXPECT_TRUE(
        torch::equal(as_map(full_state_dict(model))["lm_head.weight"], full["lm_head.weight"]))
        << "reshard wrote the edit back";

    // A forward finds the parameters in place; an eval forward frees them after.
    model.unshard();
    torch::NoGradGuard g;
    EXPECT_TRUE(torch::equal(model(idx), expected));
    EXPECT_EQ(model.memory_stats().gathered_params.current, 0);
  });
}

TEST(FullParams, Rank0OnlyKeepsTheParametersOnRankZeroAlone) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(MlpNet(), o);
    FullParamsOptions fo;
    fo.rank0_only = true;
    {
      FullParamsScope scope(model, fo);
      const int64_t gathered = model.memory_stats().gathered_params.current;
      if (pg.rank() == 0) {
        EXPECT_GT(gathered, 0);
      } else {
        EXPECT_EQ(gathered, 0);
      }
    }
    auto sd = full_state_dict(model, fo);
    EXPECT_EQ(sd.empty(), pg.rank() != 0);
    fo.offload_to_cpu = true;
    for (auto& [n, t] : full_state_dict(model, fo)) EXPECT_TRUE(t.device().is_cpu()) << n;
  });
}

TEST(FullParams, SyncModuleStatesStartsEveryRankFromRankZerosWeights) {
  run_ranks(3, [](const ProcessGroup& pg) {
    torch::manual_seed(0);
    MlpNet rank0_model;  // what rank 0 builds
    for (bool sync : {true, false}) {
      torch::manual_seed(100 + pg.rank());
      MlpNet mine;  // different weights on every rank
      if (pg.rank() == 0) {
        torch::NoGradGuard g;
        auto src = named_parameters_clean(*rank0_model);
        auto dst = named_parameters_clean(*mine);
        for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second);
      }
      ShardingOptions o;
      o.process_group = pg;
      o.sync_module_states = sync;
      auto model = fully_shard(mine, o);
      auto full = full_state_dict(model);
      bool all_equal = true;
      auto ref = as_map(named_parameters_clean(*rank0_model));
      for (auto& [n, t] : full) all_equal = all_equal && torch::equal(t, ref[n].detach());
      // With sync every shard holds rank 0's values; without it, ranks 1 and 2 keep
      // their own slices, so the gathered model differs.
      EXPECT_EQ(all_equal, sync);
    }
  });
}

}  // namespace

}  // namespace test_full_params_cases
