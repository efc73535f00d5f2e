// Behaviour of fully_shard: policies, nesting, reuse, eval, frozen and tied parameters,
// the Sequential helper. Numerical checks compare with the same model unsharded.
#include "support/models.h"
#include "support/multirank.h"
#include "support/toy_models.h"

#include <gtest/gtest.h>

#include <set>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_fully_shard_cases {

namespace {

std::set<std::string> unit_names(const ShardedModel& root) {
  std::set<std::string> out;
  for (const auto& f : fsdp::detail::flat_params(root)) out.insert(f.unit_fqn);
  return out;
}

std::string unit_of(const ShardedModel& root, const std::string& fqn) {
  for (const auto& p : root.param_table()) {
    if (p.fqn == fqn) return p.unit_fqn;
  }
  return "<none>";
}

// Trains `model` (sharded) and `reference` (plain) for `steps` SGD steps on the same
// global batch and checks losses and final parameters.
template <class Sharded, class Plain>
void expect_training_parity(Sharded& model, Plain& reference, const ProcessGroup& pg, int steps = 5,
                            int64_t in = 8) {
  torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<torch::Tensor> trainable;  // tied tensors once, as plain PyTorch would
  std::set<c10::TensorImpl*> seen;
  for (auto& p : reference->parameters()) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) trainable.push_back(p);
  }
  torch::optim::SGD ref_opt(trainable, torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    auto gen = at::detail::createCPUGenerator(99 + step);
    auto x = torch::randn({4 * pg.size(), in}, gen);
    torch::Tensor loss = model->forward(my_rows(x, pg)).pow(2).mean();
    loss.backward();
    opt.step();
    opt.zero_grad();
    double global = global_mean(loss, pg);
    double ref = 0;
    for (int s = 0; s < pg.size(); ++s) {
      torch::Tensor l = reference->forward(share_rows(x, s, pg.size())).pow(2).mean() / pg.size();
      l.backward();
      ref += l.item<double>();
    }
    ref_opt.step();
    ref_opt.zero_grad();
    EXPECT_NEAR(global, ref, 1e-5 * std::abs(ref)) << "step " << step;
  }
  expect_params_match(full_state_dict(model), *reference, 1e-5);
}

// --- policies ---------------------------------------------------------------

TEST(WrapPolicies, AlwaysAndNeverDecideEveryWrapPoint) {
  Nested m;
  EXPECT_TRUE(wrap::always_wrap_policy()(wrap::WrapContext{"x", *m, 10}));
  EXPECT_FALSE(wrap::never_wrap_policy()(wrap::WrapContext{"x", *m, 10}));
}

TEST(WrapPolicies, SizeBasedPolicyComparesUnclaimedParameterCount) {
  Nested m;
  auto p = wrap::size_based_policy(100);
  EXPECT_FALSE(p(wrap::WrapContext{"x", *m, 99}));
  EXPECT_TRUE(p(wrap::WrapContext{"x", *m, 100}));
}

TEST(WrapPolicies, SizeBasedPolicyRejectsNegativeMinimum) {
  try {
    wrap::size_based_policy(-1);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "size_based_policy: min_numel=-1 must not be negative; pass the least number of "
              "parameters a unit should own");
  }
}

TEST(WrapPolicies, ModuleTypePolicyMatchesClassesAndTypeNames) {
  torch::nn::Linear lin(2, 2);
  Inner inner;
  auto by_type = wrap::module_type_policy<Inner, torch::nn::Conv1d>();
  EXPECT_TRUE(by_type(wrap::WrapContext{"x", *inner, 0}));
  EXPECT_FALSE(by_type(wrap::WrapContext{"x", *lin, 0}));
  auto by_name = wrap::module_type_policy(std::vector<std::string>{"torch::nn::LinearImpl"});
  EXPECT_TRUE(by_name(wrap::WrapContext{"x", *lin, 0}));
  EXPECT_FALSE(by_name(wrap::WrapContext{"x", *inner, 0}));
}

TEST(WrapPolicies, PredicatePolicySeesFqnModuleAndCount) {
  Inner inner;
  std::string seen;
  auto p =
      wrap::predicate_policy([&](const std::string& fqn, const torch::nn::Module& m, int64_t n) {
        seen = fqn + "|" + std::to_string(n) + "|" +
               std::to_string(dynamic_cast<const InnerImpl*>(&m) != nullptr);
        return n > 5;
      });
  EXPECT_TRUE(p(wrap::WrapContext{"blocks.1", *inner, 6}));
  EXPECT_EQ(seen, "blocks.1|6|1");
}

TEST(WrapPolicies, AnyAndAllCompose) {
  Inner inner;
  auto yes = wrap::always_wrap_policy(), no = wrap::never_wrap_policy();
  EXPECT_TRUE(wrap::any_policy({no, yes})(wrap::WrapContext{"x", *inner, 0}));
  EXPECT_FALSE(wrap::any_policy({no, no})(wrap::WrapContext{"x", *inner, 0}));
  EXPECT_FALSE(wrap::any_policy({})(wrap::WrapContext{"x", *inner, 0}));
  EXPECT_TRUE(wrap::all_policy({yes, yes})(wrap::WrapContext{"x", *inner, 0}));
  EXPECT_FALSE(wrap::all_policy({yes, no})(wrap::WrapContext{"x", *inner, 0}));
  EXPECT_TRUE(wrap::all_policy({})(wrap::WrapContext{"x", *inner, 0}));
}

TEST(FullyShard, AlwaysPolicyMakesNestedUnitsAndRootTakesTheRest) {
  auto root = fully_shard(Nested());
  EXPECT_EQ(unit_names(root), (std::set<std::string>{"", "inner", "inner.b"}));
  EXPECT_EQ(unit_of(root, "head.weight"), "");
  EXPECT_EQ(unit_of(root, "inner.a.weight"), "inner");
  EXPECT_EQ(unit_of(root, "inner.b.bias"), "inner.b");
}

TEST(FullyShard, NeverPolicyPutsEverythingInTheRoot) {
  ShardingOptions o;
  o.auto_wrap_policy = wrap::never_wrap_policy();
  auto root = fully_shard(Nested(), o);
  EXPECT_EQ(unit_names(root), (std::set<std::string>{""}));
  // Registration order is kept: inner.a, inner.b, head.
  auto table = root.param_table();
  ASSERT_EQ(table.size(), 6u);
  EXPECT_EQ(table[0].fqn, "inner.a.weight");
  EXPECT_EQ(table[2].fqn, "inner.b.weight");
  EXPECT_EQ(table[4].fqn, "head.weight");
  EXPECT_EQ(table[4].offset, 64 + 8 + 64 + 8);
}

TEST(FullyShard, SizePolicyMergesSmallInnerUnitIntoItsParent) {
  ShardingOptions o;
  o.auto_wrap_policy = wrap::size_based_policy(100);  // inner.b owns 72 < 100; inner owns 144
  auto root = fully_shard(Nested(), o);
  EXPECT_EQ(unit_names(root), (std::set<std::string>{"", "inner"}));
  EXPECT_EQ(unit_of(root, "inner.b.weight"), "inner");
}

TEST(FullyShard, ModuleTypePolicyPicksOnlyThatClass) {
  ShardingOptions o;
  o.auto_wrap_policy = wrap::module_type_policy<Inner>();
  auto root = fully_shard(Nested(), o);
  EXPECT_EQ(unit_names(root), (std::set<std::string>{"", "inner"}));
}

// Whether fully_shard(const T&) compiles: the handle fully_shard returns must not.
template <class T, class = void>
struct CanFullyShard : std::false_type {};
template <class T>
struct CanFullyShard<T, std::void_t<decltype(fully_shard(std::declval<const T&>()))>>
    : std::true_type {};
static_assert(CanFullyShard<Nested>::value, "a module shards");
static_assert(CanFullyShard<FullyShardedModule<Nested>>::value, "a wrap point shards");
static_assert(!CanFullyShard<Sharded<Nested>>::value,
              "sharding the handle fully_shard returned must not compile");

TEST(FullyShard, ShardingTwiceIsAnError) {
  auto root = fully_shard(Nested());
  try {
    // Sharding the handle again does not compile (above); a wrap point sliced from it
    // reaches the engine, which refuses it.
    fully_shard(FullyShardedModule<Nested>(root));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "fully_shard: this model is already sharded; call fully_shard once");
  }
}

TEST(FullyShard, AnInnerUnitCalledAfterItsModelIsGoneSaysWhatToKeep) {
  ShardingOptions o;
  o.auto_wrap_policy = wrap::always_wrap_policy();
  FullyShardedModule<Inner> inner{nullptr};
  {
    auto root = fully_shard(Nested(), o);
    inner = root->module()->inner;
  }  // the handle, and with it the model's runtime, is gone; the inner unit is still held
  try {
    inner(torch::randn({2, 8}));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "FSDP unit 'inner': the sharded model it belonged to has been destroyed; keep the "
              "handle fully_shard() returned alive while its modules are used");
  }
}

TEST(FullyShard, AGradientForAParameterOfADestroyedModelSaysWhatToKeep) {
  torch::Tensor loss;
  {
    auto root = fully_shard(Nested());
    root.unshard();  // full parameters in place, used below past the wrap points
    loss = root->module()->head(torch::randn({2, 8})).sum();
  }  // the handle, and with it the model's runtime, is gone; the graph still holds head's
  try {
    loss.backward();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "FSDP: a gradient arrived for a sharded model that has been destroyed; keep the "
              "handle fully_shard() returned alive while its modules are used");
  }
}

TEST(FullyShard, AnEmptyHandleSaysWhatToAssign) {
  ShardedModel model;
  EXPECT_FALSE(model);
  try {
    model.sharded_parameters();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "this fsdp::ShardedModel is empty: assign it what fsdp::fully_shard returns");
  }
  auto sharded = fully_shard(Nested());
  EXPECT_TRUE(sharded) << "a Sharded<M> converts to bool like either base";
  model = sharded;
  EXPECT_TRUE(model);
  EXPECT_EQ(model.sharded_parameters().size(), 3u);  // the root, "inner" and "inner.b"
}

TEST(FullyShard, BadOptionsAreRejectedWithTheValue) {
  ShardingOptions o;
  o.max_gathered_units = 0;
  try {
    fully_shard(Nested(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(
        std::string(e.what_without_backtrace()),
        "ShardingOptions::max_gathered_units=0 must be at least 1 (the unit that computes; 1: "
        "no prefetch)");
  }
}

// --- runtime behaviour at world 2 -------------------------------------------

TEST(FullyShard, NestedUnitsTrainLikeTheUnshardedModel) {
  run_ranks(2, [](const ProcessGroup& pg) {
    torch::manual_seed(3);
    Nested reference;
    torch::manual_seed(3);
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(Nested(), o);
    expect_training_parity(model, reference, pg);
    EXPECT_EQ(model.memory_stats().gathered_params.current, 0);
  });
}

TEST(FullyShard, UnitCalledTwiceInForwardTrainsCorrectlyAndGathersTwice) {
  run_ranks(2, [](const ProcessGroup& pg) {
    torch::manual_seed(4);
    Reuse reference;
    torch::manual_seed(4);
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(Reuse(), o);
    expect_training_parity(model, reference, pg);
    model->forward(torch::randn({2, 8})).sum().backward();
    // Per step: root (head, 27 floats) gathered once; 'shared' (72 floats) gathered for
    // each of its two forward calls and once more for backward. All in fp32.
    const auto& s = model.comm_stats().step;
    const int64_t root = 27 + 1, shared = 72;  // root is padded 27 -> 28 for 2 ranks
    EXPECT_EQ(s.all_gather_bytes, 4 * (root + 3 * shared));
    EXPECT_EQ(s.reduce_scatter_bytes, 4 * (root + shared));
  });
}

TEST(FullyShard, EvalUnderNoGradGathersUnitByUnitAndLeavesNothingGathered) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto cfg = small_gpt_config();
    torch::manual_seed(5);
    gpt::GPT reference(cfg);
    torch::manual_seed(5);
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(gpt::GPT(cfg), o);
    auto x = gpt_batch(0, 2, cfg.block_size).narrow(1, 0, cfg.block_size);
    model.reset_peak_memory();
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      out = model(x);
    }
    EXPECT_FALSE(out.requires_grad());  // no graph, so no backward hooks
    EXPECT_LE(rel_diff(out, reference(x).detach()), 1e-5);
    auto mem = model.memory_stats().gathered_params;
    EXPECT_EQ(mem.current, 0);
    // Unit by unit: at most the root plus max_gathered_units blocks at once.
    int64_t root_bytes = 0, block_bytes = 0;
    for (const auto& f : fsdp::detail::flat_params(model)) {
      (f.unit_fqn.empty() ? root_bytes : block_bytes) = f.padded_numel * 4;
    }
    EXPECT_LE(mem.peak, root_bytes + 2 * block_bytes);
    EXPECT_GE(mem.peak, root_bytes + block_bytes);
  });
}

TEST(FullyShard, FrozenParametersGetNoGradientAndNeverChange) {
  run_ranks(2, [](const ProcessGroup& pg) {
    torch::manual_seed(6);
    Nested reference;
    reference->inner->module()->a->weight.set_requires_grad(false);
    reference->head->bias.set_requires_grad(false);
    torch::manual_seed(6);
    Nested fresh;
    fresh->inner->module()->a->weight.set_requires_grad(false);
    fresh->head->bias.set_requires_grad(false);
    auto frozen_before = fresh->inner->module()->a->weight.detach().clone();
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(fresh, o);
    expect_training_parity(model, reference, pg);
    for (const auto& [n, v] : full_state_dict(model)) {
      if (n == "inner.a.weight") EXPECT_TRUE(torch::equal(v, frozen_before));
    }
    // Gradient shards exist for trainable flat parameters only.
    int64_t trainable_shard_bytes = 0;
    for (const auto& f : fsdp::detail::flat_params(model)) {
      if (f.requires_grad) trainable_shard_bytes += 4 * f.shard_numel;
    }
    auto x = torch::randn({2, 8});
    model(x).sum().backward();
    EXPECT_EQ(model.memory_stats().grad_shards.current, trainable_shard_bytes);
    for (const auto& p : model.param_table()) {
      if (p.fqn == "inner.a.weight" || p.fqn == "head.bias") EXPECT_FALSE(p.requires_grad) << p.fqn;
    }
  });
}

TEST(FullyShard, TiedParametersInOneUnitTrainAsOneTensor) {
  run_ranks(2, [](const ProcessGroup& pg) {
    torch::manual_seed(7);
    auto w = torch::randn({8, 8}) * 0.3;
    torch::manual_seed(8);
    Tied reference(w.clone());
    torch::manual_seed(8);
    ShardingOptions o;
    o.process_group = pg;
    o.auto_wrap_policy = wrap::never_wrap_policy();  // a and b both in the root
    auto model = fully_shard(Tied(w.clone()), o);
    expect_training_parity(model, reference, pg);
    auto table = model.param_table();
    int64_t a_off = -1, b_off = -2;
    for (const auto& p : table) {
      if (p.fqn == "a.w") a_off = p.offset;
      if (p.fqn == "b.w") b_off = p.offset;
    }
    EXPECT_EQ(a_off, b_off);  // stored once
    EXPECT_EQ(fsdp::detail::flat_params(model)[0].numel, 64 + 24 + 3);
  });
}

TEST(FullyShard, TiedParametersAcrossUnitsNameBothFqnsAndTheFix) {
  try {
    fully_shard(Tied());
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "fully_shard: parameters 'a.w' and 'b.w' are the same tensor (tied) but fall in "
              "different units (unit 'a' and unit 'b'). Tied parameters must live in one unit: "
              "change the wrap policy so that the wrap points holding them are not units, or "
              "wrap their common parent.");
  }
}

TEST(FullyShard, SequentialHelperShardsEntriesKeepingTheirNames) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto make = [] {
      return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                                   torch::nn::Linear(16, 8));
    };
    torch::manual_seed(8);
    auto reference = make();
    torch::manual_seed(8);
    ShardingOptions o;
    o.process_group = pg;
    auto model = shard_sequential(make(), o);
    // Units without parameters (the root, the Tanh) hold no flat parameter.
    EXPECT_EQ(unit_names(model), (std::set<std::string>{"0", "2"}));
    EXPECT_EQ(unit_of(model, "2.weight"), "2");
    expect_training_parity(model, reference, pg);
  });
}

}  // namespace

}  // namespace test_fully_shard_cases
