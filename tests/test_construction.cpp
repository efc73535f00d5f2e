// Sharded construction (fsdp::make_sharded): the same weights and first loss as eager
// construction at any world size, host memory bounded by the shards plus the unit being
// built, the policy's say, and misuse refused.
#include "support/counting_allocator.h"
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_construction_cases {

namespace {

constexpr uint64_t kSeed = 7;

ShardingOptions options_for(const ProcessGroup& pg) {
  ShardingOptions so;
  so.process_group = pg;
  return so;
}

// The model as the seed makes it with no sharding at all: the reference every world
// size must reproduce bit for bit.
std::map<std::string, torch::Tensor> plain_weights(const gpt::Config& c, gpt::GPT& plain) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : named_parameters_clean(*plain)) out[name] = t.detach().clone();
  (void)c;
  return out;
}

}  // namespace

class ConstructionWorlds : public ::testing::TestWithParam<int> {};

// The same seed gives the same model, and so the same first loss, at worlds 1, 2 and 4,
// and the same as constructing the whole model first (fully_shard) or not sharding it.
TEST_P(ConstructionWorlds, SameWeightsAndFirstLossAsUnshardedFromTheSameSeed) {
  const int world = GetParam();
  run_ranks(world, [](const ProcessGroup& pg) {
    const gpt::Config c = small_gpt_config();
    torch::manual_seed(kSeed);
    gpt::GPT plain(c);
    const auto want = plain_weights(c, plain);

    torch::manual_seed(kSeed);
    auto sharded = make_sharded<gpt::GPT>(options_for(pg), c);
    torch::manual_seed(kSeed);
    auto eager = fully_shard(gpt::GPT(c), options_for(pg));

    const auto got = full_state_dict(sharded);
    const auto got_eager = full_state_dict(eager);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const auto& [name, t] = got[i];
      ASSERT_TRUE(want.count(name)) << name;
      EXPECT_TRUE(torch::equal(t, want.at(name))) << name << " differs from the unsharded model";
      EXPECT_TRUE(torch::equal(t, got_eager[i].second)) << name << " differs from eager's";
    }

    const torch::Tensor batch = gpt_batch(0, 4, c.block_size);
    torch::NoGradGuard no_grad;
    const double first = gpt::loss_on(sharded, batch).item<double>();
    const double reference = gpt::loss_on(plain, batch).item<double>();
    EXPECT_EQ(first, reference) << "world " << pg.size();
    if (pg.rank() == 0) {
      std::printf("world %d: first loss %.9f (sharded construction), %.9f (unsharded)\n", pg.size(),
                  first, reference);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, ConstructionWorlds, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "World" + std::to_string(info.param); });

// Training from a sharded construction is training from the eager one: three AdamW steps
// at world 2 give the same losses bit for bit.
TEST(ShardedConstruction, TrainsLikeEagerConstruction) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const gpt::Config c = small_gpt_config();
    torch::manual_seed(kSeed);
    auto sharded = make_sharded<gpt::GPT>(options_for(pg), c);
    torch::manual_seed(kSeed);
    auto eager = fully_shard(gpt::GPT(c), options_for(pg));
    torch::optim::AdamW opt_s(sharded.sharded_parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt_e(eager.sharded_parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      const torch::Tensor rows = my_rows(gpt_batch(step, 4, c.block_size), pg);
      auto ls = gpt::loss_on(sharded, rows);
      auto le = gpt::loss_on(eager, rows);
      ls.backward();
      le.backward();
      opt_s.step();
      opt_e.step();
      opt_s.zero_grad();
      opt_e.zero_grad();
      EXPECT_EQ(ls.item<double>(), le.item<double>()) << "step " << step;
    }
  });
}

// Host memory while constructing: each rank's peak is its shards, plus the root's own
// parameters (built first, sharded last), plus the one unit being built. Eager
// construction holds the whole model. Counted by the CPU allocator, byte for byte.
TEST(ShardedConstruction, PeakBytesAreTheShardsPlusTheUnitBeingBuilt) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto& counter = CountingCpuAllocator::install();
    gpt::Config c = small_gpt_config();
    c.n_layer = 8;
    c.d_model = 64;

    int64_t base = counter.live();
    counter.reset_peak();
    { auto eager = fully_shard(gpt::GPT(c), options_for(pg)); }
    const int64_t eager_peak = counter.peak() - base;

    base = counter.live();
    counter.reset_peak();
    auto model = make_sharded<gpt::GPT>(options_for(pg), c);
    const int64_t peak = counter.peak() - base;

    std::map<std::string, int64_t> unit_bytes;
    int64_t model_bytes = 0, largest_param = 0;
    for (const auto& p : model.param_table()) {
      unit_bytes[p.unit_fqn] += 4 * p.numel;
      model_bytes += 4 * p.numel;
      largest_param = std::max(largest_param, 4 * p.numel);
    }
    int64_t largest_block = 0;
    for (const auto& [unit, bytes] : unit_bytes) {
      if (!unit.empty()) largest_block = std::max(largest_block, bytes);
    }
    const int64_t shards = model.memory_stats().sharded_params.current;
    const int64_t bound = shards + unit_bytes.at("") + largest_block;
    if (pg.rank() == 0) {
      std::printf(
          "model %lld B in fp32; eager construction peak %lld B; sharded construction peak %lld B "
          "<= shards %lld + root unit %lld + largest block %lld = %lld B\n",
          static_cast<long long>(model_bytes), static_cast<long long>(eager_peak),
          static_cast<long long>(peak), static_cast<long long>(shards),
          static_cast<long long>(unit_bytes.at("")), static_cast<long long>(largest_block),
          static_cast<long long>(bound));
    }
    EXPECT_LE(peak, bound);
    EXPECT_GE(eager_peak, model_bytes) << "eager construction holds the whole model at once";
    EXPECT_LT(peak, model_bytes - largest_block) << "sharded construction must hold far less";
  });
}

// A wrap point the policy does not pick at construction passes its parameters to its
// parent's unit, as in fully_shard: with never_wrap_policy everything lands in the root.
TEST(ShardedConstruction, WrapPointsThePolicyDeclinesJoinTheirParentsUnit) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions so = options_for(pg);
    so.auto_wrap_policy = wrap::never_wrap_policy();
    torch::manual_seed(kSeed);
    auto model = make_sharded<gpt::GPT>(so, small_gpt_config());
    for (const auto& p : model.param_table()) EXPECT_EQ(p.unit_fqn, "") << p.fqn;
    torch::manual_seed(kSeed);
    gpt::GPT plain(small_gpt_config());
    const auto want = plain_weights(small_gpt_config(), plain);
    for (const auto& [name, t] : full_state_dict(model)) {
      EXPECT_TRUE(torch::equal(t, want.at(name))) << name;
    }
  });
}

namespace {
// A module whose constructor builds another sharded model: nesting is refused.
struct NestedImpl : torch::nn::Module {
  explicit NestedImpl(const ShardingOptions& so) {
    auto inner = make_sharded<gpt::GPT>(so, small_gpt_config());
  }
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Nested);
}  // namespace

TEST(ShardedConstruction, ANestedMakeShardedIsRefused) {
  try {
    make_sharded<Nested>(ShardingOptions{}, ShardingOptions{});
    FAIL() << "a make_sharded inside another was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("another make_sharded is already constructing a model on "
                                         "this thread; construct one sharded model at a time"),
              std::string::npos)
        << e.what();
  }
  // The failed construction left no scope behind: the next one works.
  auto model = make_sharded<gpt::GPT>(ShardingOptions{}, small_gpt_config());
  EXPECT_EQ(model.param_table().size(),
            named_parameters_clean(*gpt::GPT(small_gpt_config())).size());
}

namespace {
// A model whose constructor builds a block (sharded at construction, since make_sharded
// runs it) that it does not register but hands out, so that a test can put that block
// into another model.
fsdp::FullyShardedModule<gpt::Block> g_kept{nullptr};
struct KeepsBlockImpl : torch::nn::Module {
  explicit KeepsBlockImpl(const gpt::Config& c)
      : head(register_module("head", torch::nn::Linear(c.d_model, c.d_model))) {
    g_kept = fsdp::FullyShardedModule<gpt::Block>(gpt::Block(c));
  }
  torch::Tensor forward(torch::Tensor x) { return head(x); }
  torch::nn::Linear head;
};
TORCH_MODULE(KeepsBlock);

// Two blocks side by side, each built elsewhere.
struct PairImpl : torch::nn::Module {
  PairImpl(fsdp::FullyShardedModule<gpt::Block> a, fsdp::FullyShardedModule<gpt::Block> b)
      : a(register_module("a", std::move(a))), b(register_module("b", std::move(b))) {}
  torch::Tensor forward(torch::Tensor x) { return b(a(x)); }
  fsdp::FullyShardedModule<gpt::Block> a, b;
};
TORCH_MODULE(Pair);

// A module whose constructor shards a model while make_sharded is constructing.
struct ShardsInsideImpl : torch::nn::Module {
  ShardsInsideImpl() { auto m = fully_shard(gpt::GPT(small_gpt_config())); }
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(ShardsInside);

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}
}  // namespace

// Units built by make_sharded belong to its model: mixing them with another
// make_sharded's, sharding them over another process group, or calling fully_shard while
// make_sharded constructs are refused, each naming the fix.
TEST(ShardedConstruction, MisusedBuiltUnitsAreRefusedNamingTheFix) {
  const gpt::Config c = small_gpt_config();
  make_sharded<KeepsBlock>(ShardingOptions{}, c);
  auto one = g_kept;
  make_sharded<KeepsBlock>(ShardingOptions{}, c);
  auto other = g_kept;
  EXPECT_NE(error_of([&] { fully_shard(Pair(one, other)); })
                .find("was sharded by another fsdp::make_sharded than the rest of the model; build "
                      "the model in one make_sharded call"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { fully_shard(Pair(one, fsdp::FullyShardedModule<gpt::Block>(gpt::Block(c)))); })
          .find("the model's wrap points were sharded at construction over another process "
                "group than ShardingOptions::process_group; pass the same options"),
      std::string::npos);
  EXPECT_NE(error_of([&] { make_sharded<ShardsInside>(ShardingOptions{}); })
                .find("fully_shard: called while fsdp::make_sharded is constructing a model on "
                      "this thread; shard the model after its construction"),
            std::string::npos);
  g_kept = nullptr;
}

}  // namespace test_construction_cases
