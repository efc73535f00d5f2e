// Standalone activation checkpointing: gradients equal the plain ones bitwise (fp32, CPU),
// dropout included, and each input/output case of the utility behaves.
#include "support/counting_allocator.h"
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/activation_checkpoint.h>

#include <gtest/gtest.h>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_activation_checkpoint_cases {

namespace {

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters())
    g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << i;
    if (a[i].defined()) EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
  }
}

TEST(ActivationCheckpoint, GptBlockWithDropoutGivesBitwiseEqualGradients) {
  auto cfg = small_gpt_config();
  cfg.dropout = 0.1;
  torch::manual_seed(71);
  gpt::Block block(cfg);
  auto x0 = torch::randn({2, cfg.block_size, cfg.d_model});

  auto run = [&](bool ckpt) {
    block->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    torch::manual_seed(5);  // the same dropout masks in both runs
    auto y = ckpt ? activation_checkpoint([&](const torch::Tensor& t) { return block(t); }, x)
                  : block(x);
    y.pow(2).sum().backward();
    auto g = grads_of(*block);
    g.push_back(x.grad().clone());
    g.push_back(torch::rand({1}));  // the RNG stream after backward must match too
    return g;
  };
  expect_same(run(false), run(true));
}

TEST(ActivationCheckpoint, MlpGivesBitwiseEqualGradients) {
  torch::manual_seed(72);
  MlpNet mlp;
  auto x = torch::randn({6, 16});
  auto run = [&](bool ckpt) {
    mlp->zero_grad();
    auto y =
        ckpt ? activation_checkpoint([&](const torch::Tensor& t) { return mlp(t); }, x) : mlp(x);
    y.pow(2).mean().backward();
    return grads_of(*mlp);
  };
  expect_same(run(false), run(true));
}

TEST(ActivationCheckpoint, SeveralInputsAndOutputsSomeWithoutGradAndCapturedNonTensors) {
  torch::manual_seed(73);
  torch::nn::Linear lin(4, 4);
  const double factor = 3.0;  // a non-tensor argument, captured
  auto a0 = torch::randn({3, 4}), b0 = torch::randn({3, 4});
  auto region = [&](const std::vector<torch::Tensor>& in) {
    auto h = lin(in[0]) * factor + in[1];
    return std::vector<torch::Tensor>{h.tanh(), h.sum(1),
                                      in[1].argmax(1)};  // last: no grad (integer)
  };
  auto run = [&](bool ckpt) {
    lin->zero_grad();
    auto a = a0.clone().requires_grad_(true);
    auto b = b0.clone();  // does not require grad
    auto out = ckpt ? activation_checkpoint(region, {a, b}) : region({a, b});
    EXPECT_FALSE(out[2].requires_grad());
    (out[0].sum() + out[1].pow(2).sum()).backward();
    EXPECT_FALSE(b.grad().defined());
    auto g = grads_of(*lin);
    g.push_back(a.grad().clone());
    return g;
  };
  expect_same(run(false), run(true));
}

TEST(ActivationCheckpoint, NestedRegionsGiveEqualGradients) {
  torch::manual_seed(74);
  torch::nn::Linear l1(4, 4), l2(4, 4);
  auto x0 = torch::randn({2, 4});
  auto run = [&](bool ckpt) {
    l1->zero_grad();
    l2->zero_grad();
    auto x = x0.clone().requires_grad_(true);
    auto inner = [&](const torch::Tensor& t) { return torch::relu(l2(t)); };
    auto outer = [&](const torch::Tensor& t) {
      return ckpt ? activation_checkpoint(inner, l1(t)) : inner(l1(t));
    };
    auto y = ckpt ? activation_checkpoint(outer, x) : outer(x);
    y.sum().backward();
    auto g = grads_of(*l1);
    for (auto& t : grads_of(*l2)) g.push_back(t);
    g.push_back(x.grad().clone());
    return g;
  };
  expect_same(run(false), run(true));
}

// The names before the rename (CHANGELOG.md) still compile and do the same, for one
// release, with a deprecation warning (silenced here).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(ActivationCheckpoint, TheDeprecatedNamesStillWork) {
  torch::manual_seed(76);
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4});
  auto grads = [&](bool old) {
    lin->zero_grad();
    fsdp::CheckpointOptions o;
    auto f = [&](const torch::Tensor& t) { return lin(t).tanh(); };
    auto y = old ? fsdp::checkpoint(f, x, o) : fsdp::activation_checkpoint(f, x);
    fsdp::CheckpointFn many = [&](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{lin(in[0]).sin()};
    };
    auto z = old ? fsdp::checkpoint(many, {x})[0] : fsdp::activation_checkpoint(many, {x})[0];
    (y.sum() + z.sum()).backward();
    return lin->weight.grad().clone();
  };
  const int64_t before = activation_recomputes();
  EXPECT_TRUE(torch::equal(grads(true), grads(false)));
  EXPECT_EQ(activation_recomputes() - before, 4);  // each call recomputed once
}
#pragma GCC diagnostic pop

TEST(ActivationCheckpoint, RetainGraphRecomputesForASecondBackward) {
  torch::manual_seed(75);
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4});
  auto plain = lin(x).tanh().sum();
  plain.backward({}, /*retain_graph=*/true);
  plain.backward();
  auto expected = lin->weight.grad().clone();
  lin->zero_grad();
  auto y = activation_checkpoint([&](const torch::Tensor& t) { return lin(t).tanh(); }, x).sum();
  y.backward({}, /*retain_graph=*/true);
  y.backward();
  EXPECT_TRUE(torch::equal(lin->weight.grad(), expected));
}

TEST(ActivationCheckpoint, DoubleBackwardIsAClearError) {
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto y = activation_checkpoint([&](const torch::Tensor& t) { return lin(t).pow(2); }, x).sum();
  try {
    torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    EXPECT_NE(
        what.find(
            "activation_checkpoint: double backward (create_graph=true) through a checkpointed "
            "region is "
            "not supported, because its graph is rebuilt inside backward. Run that region "
            "without fsdp::activation_checkpoint, or take the gradient without create_graph."),
        std::string::npos)
        << what;
  }
}

}  // namespace

namespace {

struct ShardedRun {
  std::vector<torch::Tensor> grads;
  stats::CommStats comm;
};

// One training step of the GPT at dropout 0.1, sharded over `pg`, with or without
// checkpointing every block; returns the gradient shards and the step's traffic.
ShardedRun sharded_step(const ProcessGroup& pg, bool ckpt, torch::Dtype dtype,
                        ShardingStrategy strategy = ShardingStrategy::kFullShard) {
  auto cfg = small_gpt_config();
  cfg.dropout = 0.1;
  torch::manual_seed(81);
  ShardingOptions o;
  o.process_group = pg;
  o.mixed_precision.param_dtype = dtype;
  o.mixed_precision.output_dtype = torch::kFloat32;
  o.strategy = strategy;
  o.hybrid_group_size = 2;
  if (ckpt) o.checkpoint_policy = wrap::module_type_policy<gpt::Block>();
  auto model = fully_shard(gpt::GPT(cfg), o);
  for (auto& b : model->module()->blocks) EXPECT_EQ(b->checkpointed(), ckpt);
  torch::manual_seed(500 + pg.rank());  // the same dropout masks in both runs
  gpt::loss_on(model, my_rows(gpt_batch(0, 4, cfg.block_size), pg)).backward();
  ShardedRun r;
  for (auto& p : model.sharded_parameters()) r.grads.push_back(p.grad().clone());
  r.comm = model.comm_stats().step;
  return r;
}

TEST(ShardedCheckpoint, FullShardGradientsAreBitwiseEqualAndNoExtraGather) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto plain = sharded_step(pg, false, torch::kFloat32);
    auto ckpt = sharded_step(pg, true, torch::kFloat32);
    expect_same(plain.grads, ckpt.grads);
    // Recompute runs while the unit is gathered for backward: the same collectives.
    EXPECT_EQ(ckpt.comm.all_gather_bytes, plain.comm.all_gather_bytes);
    EXPECT_EQ(ckpt.comm.all_gather_calls, plain.comm.all_gather_calls);
    EXPECT_EQ(ckpt.comm.reduce_scatter_bytes, plain.comm.reduce_scatter_bytes);
  });
}

TEST(ShardedCheckpoint, EveryOtherStrategyGivesBitwiseEqualGradientsAndTheSameTraffic) {
  run_ranks(4, [](const ProcessGroup& pg) {
    for (auto s : {ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                   ShardingStrategy::kHybridShard}) {
      auto plain = sharded_step(pg, false, torch::kFloat32, s);
      auto ckpt = sharded_step(pg, true, torch::kFloat32, s);
      expect_same(plain.grads, ckpt.grads);
      EXPECT_EQ(ckpt.comm.total_bytes(), plain.comm.total_bytes());
      EXPECT_EQ(ckpt.comm.all_gather_calls, plain.comm.all_gather_calls);
    }
  });
}

TEST(ShardedCheckpoint, Bf16GradientsMatchWithinTolerance) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto plain = sharded_step(pg, false, torch::kBFloat16);
    auto ckpt = sharded_step(pg, true, torch::kBFloat16);
    ASSERT_EQ(plain.grads.size(), ckpt.grads.size());
    // The recompute repeats the same bf16 arithmetic, so the results agree to bf16 rounding.
    for (size_t i = 0; i < plain.grads.size(); ++i)
      EXPECT_LE(rel_diff(ckpt.grads[i], plain.grads[i], 1e-3), 1e-2) << i;
  });
}

TEST(ShardedCheckpoint, EveryKthPolicyPicksEveryKthWrapPoint) {
  auto cfg = small_gpt_config();
  cfg.n_layer = 5;
  ShardingOptions o;
  o.checkpoint_policy = wrap::every_kth_policy(2);
  auto model = fully_shard(gpt::GPT(cfg), o);
  std::vector<bool> picked;
  for (auto& b : model->module()->blocks) picked.push_back(b->checkpointed());
  EXPECT_EQ(picked, (std::vector<bool>{true, false, true, false, true}));
  try {
    wrap::every_kth_policy(0);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "every_kth_policy: k=0 must be at least 1 (1 picks every wrap point)");
  }
}

}  // namespace

namespace {
class CountingImpl : public torch::nn::Module {
 public:
  CountingImpl() : lin(register_module("lin", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    return torch::tanh(lin(x));
  }
  torch::nn::Linear lin;
  int calls = 0;
};
TORCH_MODULE(Counting);

class TwoCountingImpl : public torch::nn::Module {
 public:
  TwoCountingImpl()
      : a(register_module("a", FullyShardedModule<Counting>(Counting()))),
        b(register_module("b", FullyShardedModule<Counting>(Counting()))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(a(x)); }
  FullyShardedModule<Counting> a, b;
};
TORCH_MODULE(TwoCounting);

TEST(ShardedCheckpoint, CheckpointedWrapPointsRecomputeInBackwardAndOthersDoNot) {
  ShardingOptions o;
  o.checkpoint_policy = wrap::predicate_policy(
      [](const std::string& fqn, const torch::nn::Module&, int64_t) { return fqn == "a"; });
  auto model = fully_shard(TwoCounting(), o);
  model(torch::randn({2, 4})).sum().backward();
  EXPECT_EQ(model->module()->a->module()->calls, 2);  // forward, then recompute in backward
  EXPECT_EQ(model->module()->b->module()->calls, 1);
  {
    torch::NoGradGuard g;  // nothing to recompute without grad
    model(torch::randn({2, 4}));
  }
  EXPECT_EQ(model->module()->a->module()->calls, 3);
}
}  // namespace

namespace {
// Bytes a GPT forward keeps alive for backward (measured with a counting CPU allocator:
// live bytes after forward minus before), with every block checkpointed or none.
int64_t held_after_forward(bool ckpt, const gpt::Config& cfg, int64_t batch) {
  auto& counter = CountingCpuAllocator::install();
  torch::manual_seed(91);
  ShardingOptions o;
  if (ckpt) o.checkpoint_policy = wrap::module_type_policy<gpt::Block>();
  auto model = fully_shard(gpt::GPT(cfg), o);
  auto rows = gpt_batch(0, batch, cfg.block_size);
  auto x = rows.narrow(1, 0, cfg.block_size).contiguous();
  const int64_t before = counter.live();
  auto logits = model(x);
  const int64_t held = counter.live() - before;
  logits.sum().backward();  // the graph is usable
  return held;
}

TEST(ShardedCheckpoint, ForwardKeepsOnlyBlockInputsOfCheckpointedBlocks) {
  auto cfg = small_gpt_config();
  cfg.n_layer = 4;
  cfg.d_model = 64;
  cfg.n_head = 4;
  cfg.block_size = 32;
  const int64_t B = 4, T = cfg.block_size, d = cfg.d_model, V = cfg.vocab_size, L = cfg.n_layer;
  const int64_t plain = held_after_forward(false, cfg, B);
  const int64_t ckpt = held_after_forward(true, cfg, B);
  const int64_t act = B * T * d * 4;  // one fp32 activation of shape (B, T, d), bytes
  const int64_t rng = at::detail::getDefaultCPUGenerator().get_state().nbytes();  // 5056 here
  // Checkpointed, every term the forward keeps (measured 349184 bytes on LibTorch 1.13):
  const int64_t expected = L * act          // each block's input (the first is wte + wpe)
                           + L * rng        // each checkpoint's saved CPU RNG state
                           + act            // the last block's output, ln_f's input
                           + act            // ln_f's output, lm_head's input
                           + 2 * B * T * 4  // ln_f's per-row mean and rstd
                           + B * T * V * 4  // the logits
                           + T * 8;         // the position index wpe saved
  EXPECT_GE(ckpt, L * act);                 // block inputs must survive
  EXPECT_LE(ckpt, expected + 4096);         // and nothing else (4 KB slack)
  // Without checkpointing every block also keeps its intermediates: ln1/ln2 outputs,
  // q/k/v, the (B, heads, T, T) attention weights and softmax, the 4d-wide MLP hidden
  // and its GELU input, ... far more than the input alone.
  EXPECT_GT(plain, 4 * ckpt);
  std::cout << "held after forward: " << plain << " bytes without checkpointing, " << ckpt
            << " with every block checkpointed (block inputs: " << L * act << ")\n";
}
}  // namespace

// ---------------------------------------------------------------------------------
// Every wrap point takes one path: shard_sequential's entries are checkpointed like
// FullyShardedModule wrap points, and a policy that picks a forward checkpointing
// cannot handle is an error naming it.

namespace {

// Counting (above) counts its forward calls: a checkpointed one runs twice.
TEST(ShardedCheckpoint, ShardSequentialEntriesFollowTheCheckpointPolicy) {
  std::vector<std::vector<torch::Tensor>> grads;
  for (bool ckpt : {false, true}) {
    torch::manual_seed(3);
    Counting counting;
    torch::nn::Sequential seq(torch::nn::Linear(4, 4), counting, torch::nn::Linear(4, 2));
    ShardingOptions o;
    if (ckpt) {
      o.checkpoint_policy = wrap::predicate_policy(
          [](const std::string& fqn, const torch::nn::Module&, int64_t) { return fqn == "1"; });
    }
    auto model = shard_sequential(seq, o);
    model(torch::randn({3, 4}, at::detail::createCPUGenerator(9))).pow(2).sum().backward();
    EXPECT_EQ(counting->calls, ckpt ? 2 : 1)
        << (ckpt ? "checkpointed: forward, then recompute" : "plain");
    grads.emplace_back();
    for (const auto& p : model.sharded_parameters()) grads.back().push_back(p.grad().clone());
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_TRUE(torch::equal(grads[0][i], grads[1][i])) << i;
}

class TwoInputsImpl : public torch::nn::Module {
 public:
  TwoInputsImpl() : lin(register_module("lin", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) { return lin(x) + y; }
  torch::nn::Linear lin;
};
TORCH_MODULE(TwoInputs);

class TwoNetImpl : public torch::nn::Module {
 public:
  TwoNetImpl() : two(register_module("two", FullyShardedModule<TwoInputs>(TwoInputs()))) {}
  torch::Tensor forward(const torch::Tensor& x) { return two(x, x); }
  FullyShardedModule<TwoInputs> two;
};
TORCH_MODULE(TwoNet);

TEST(ShardedCheckpoint, APolicyPickingAForwardOfTwoInputsIsAnErrorNamingIt) {
  ShardingOptions o;
  o.checkpoint_policy = wrap::always_wrap_policy();
  auto model = fully_shard(TwoNet(), o);
  try {
    model(torch::randn({2, 4}));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "ShardingOptions::checkpoint_policy picked wrap point 'two', whose forward is not "
              "Tensor -> "
              "Tensor; activation checkpointing here recomputes a forward of one tensor to one "
              "tensor. Leave "
              "it out of the policy (e.g. predicate_policy), or call fsdp::activation_checkpoint "
              "inside its "
              "forward.");
  }
  torch::NoGradGuard no_grad;  // nothing is checkpointed without grad: the forward runs
  EXPECT_EQ(model(torch::randn({2, 4})).sizes(), (std::vector<int64_t>{2, 4}));
}

}  // namespace

// ---------------------------------------------------------------------------------
// Activation offload (ShardingOptions::offload_activations, Note [Activation offload]).

namespace {

// The GPT with every block checkpointed, trained 3 steps at world 2 with and without
// offloading the blocks' saved inputs: bit-identical losses, and the host bytes equal
// the formula: one (rows, T, d) fp32 input per block, held from forward to the end of
// backward.
TEST(ActivationOffload, TrainsBitIdenticallyAndHoldsEachBlockInputOnTheHost) {
  run_ranks(2, [](const ProcessGroup& pg) {
    auto cfg = small_gpt_config();
    cfg.n_layer = 3;
    const int64_t rows = 8, T = cfg.block_size, d = cfg.d_model;
    std::vector<double> losses[2];
    for (int offload = 0; offload < 2; ++offload) {
      ShardingOptions o;
      o.process_group = pg;
      o.checkpoint_policy = wrap::module_type_policy<gpt::Block>();
      o.offload_activations = offload == 1;
      torch::manual_seed(4);
      auto model = fully_shard(gpt::GPT(cfg), o);
      torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
      for (int64_t step = 0; step < 3; ++step) {
        model.reset_peak_memory();
        auto loss = gpt::loss_on(model, my_rows(gpt_batch(step, rows, T), pg));
        const auto held = model.memory_stats().offloaded_activations;
        loss.backward();
        losses[offload].push_back(loss.item<double>());
        loss = torch::Tensor();  // frees the graph and what it saved
        opt.step();
        opt.zero_grad();
        const int64_t per_block = (rows / pg.size()) * T * d * 4;
        EXPECT_EQ(held.current, offload ? cfg.n_layer * per_block : 0) << "after forward";
        EXPECT_EQ(model.memory_stats().offloaded_activations.current, 0) << "graph freed";
        EXPECT_EQ(model.memory_stats().offloaded_activations.peak,
                  offload ? cfg.n_layer * per_block : 0);
      }
    }
    EXPECT_EQ(losses[1], losses[0]);
  });
}

TEST(ActivationOffload, WithoutACheckpointPolicyIsAnErrorNamingTheFix) {
  ShardingOptions o;
  o.offload_activations = true;
  try {
    fully_shard(MlpNet(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(
        std::string(e.what_without_backtrace()),
        "ShardingOptions::offload_activations keeps the inputs that activation "
        "checkpointing saves in host memory, and no block is checkpointed; set "
        "ShardingOptions::checkpoint_policy (e.g. fsdp::wrap::module_type_policy<Block>()) too");
  }
}

// A region's offloaded inputs serve a second backward of a retained graph too.
TEST(ActivationOffload, RetainGraphBringsTheInputsBackForASecondBackward) {
  torch::manual_seed(1);
  auto lin = torch::nn::Linear(8, 8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  ActivationCheckpointOptions co;
  co.offload_inputs = true;
  stats::MemoryCounter counter;
  co.host_counter = &counter;
  auto y =
      activation_checkpoint([&](const torch::Tensor& t) { return torch::tanh(lin(t)); }, x, co);
  EXPECT_EQ(counter.current, 4 * 8 * 4);
  y.sum().backward({}, /*retain_graph=*/true);
  auto g1 = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  y.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), g1));
  y = torch::Tensor();
  EXPECT_EQ(counter.current, 0) << "released with the graph";
  EXPECT_EQ(counter.peak, 4 * 8 * 4);
}

}  // namespace

}  // namespace test_activation_checkpoint_cases
