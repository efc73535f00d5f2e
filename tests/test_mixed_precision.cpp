// Mixed precision over fp32 master weights: bf16 compute and communication.
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/loss_scaler.h>

#include <gtest/gtest.h>

#include <cmath>

#include <map>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_mixed_precision_cases {

namespace {

constexpr int64_t kRows = 8;  // divisible by 2 and 4

// The reference applies the same casts without the library: fp32 masters, a bf16 copy
// of them for compute, per-share bf16 gradients summed in fp32 and divided by the
// number of shares, AdamW on the masters.
void bf16_parity(const ProcessGroup& pg) {
  auto cfg = small_gpt_config();
  torch::manual_seed(21);
  gpt::GPT masters(cfg);
  torch::manual_seed(21);
  gpt::GPT compute(cfg);
  compute->to(torch::kBFloat16);
  torch::manual_seed(21);
  ShardingOptions o;
  o.process_group = pg;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  o.mixed_precision.reduce_dtype = torch::kFloat32;
  o.mixed_precision.output_dtype = torch::kFloat32;
  auto model = fully_shard(gpt::GPT(cfg), o);
  auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1).eps(1e-6);
  torch::optim::AdamW opt(model.sharded_parameters(), adamw);
  torch::optim::AdamW ref_opt(masters->parameters(), adamw);
  auto master_params = masters->parameters();
  auto compute_params = compute->parameters();
  for (int step = 0; step < 10; ++step) {
    auto batch = gpt_batch(step, kRows, cfg.block_size);
    auto loss = gpt::loss_on(model, my_rows(batch, pg));
    EXPECT_EQ(loss.scalar_type(), torch::kFloat32);
    loss.backward();
    opt.step();
    opt.zero_grad();
    double global = global_mean(loss, pg);

    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < master_params.size(); ++i) compute_params[i].copy_(master_params[i]);
    }
    std::vector<torch::Tensor> sums;
    for (auto& p : master_params) sums.push_back(torch::zeros_like(p));
    double ref = 0;
    for (int s = 0; s < pg.size(); ++s) {
      auto rows = share_rows(batch, s, pg.size());
      auto x = rows.narrow(1, 0, cfg.block_size), y = rows.narrow(1, 1, cfg.block_size);
      auto logits = compute->forward(x).to(torch::kFloat32);
      auto l = torch::nn::functional::cross_entropy(logits.reshape({-1, 256}), y.reshape({-1}));
      l.backward();
      ref += l.item<double>() / pg.size();
      torch::NoGradGuard g;
      for (size_t i = 0; i < sums.size(); ++i) {
        sums[i] += compute_params[i].grad().to(torch::kFloat32);
        compute_params[i].mutable_grad() = torch::Tensor();
      }
    }
    for (size_t i = 0; i < sums.size(); ++i) master_params[i].mutable_grad() = sums[i] / pg.size();
    ref_opt.step();
    ref_opt.zero_grad();
    // Same casts, same bf16 arithmetic per share; only the fp32 order of summing shares
    // may differ, and bf16 rounding can turn that into one-ulp (2^-8) differences.
    EXPECT_NEAR(global, ref, 1e-3 * ref) << "step " << step;
  }
  expect_params_match(full_state_dict(model), *masters, 1e-3);
}

TEST(MixedPrecision, Bf16MatchesAReferenceWithTheSameCastsAtWorld2) { run_ranks(2, bf16_parity); }
TEST(MixedPrecision, Bf16MatchesAReferenceWithTheSameCastsAtWorld4) { run_ranks(4, bf16_parity); }

int64_t step_bytes(const ProcessGroup& pg, torch::Dtype param, torch::Dtype reduce) {
  auto cfg = small_gpt_config();
  ShardingOptions o;
  o.process_group = pg;
  o.mixed_precision.param_dtype = param;
  o.mixed_precision.reduce_dtype = reduce;
  auto model = fully_shard(gpt::GPT(cfg), o);
  gpt::loss_on(model, my_rows(gpt_batch(0, kRows, cfg.block_size), pg)).backward();
  auto s = model.comm_stats().step;
  EXPECT_EQ(model.memory_stats().gathered_params.current, 0);
  return s.total_bytes();
}

TEST(MixedPrecision, Bf16MovesHalfTheBytesOfFp32) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const int64_t fp32 = step_bytes(pg, torch::kFloat32, torch::kFloat32);
    const int64_t bf16 = step_bytes(pg, torch::kBFloat16, torch::kBFloat16);
    EXPECT_GT(fp32, 0);
    EXPECT_EQ(2 * bf16, fp32);
  });
}

TEST(MixedPrecision, Bf16GatheredParametersTakeHalfTheBytes) {
  auto cfg = small_gpt_config();
  ShardingOptions o;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  auto model = fully_shard(gpt::GPT(cfg), o);
  model.reset_peak_memory();
  gpt::loss_on(model, gpt_batch(0, 2, cfg.block_size)).backward();
  int64_t padded = 0, largest_block = 0, root = 0;
  for (const auto& f : fsdp::detail::flat_params(model)) {
    padded += f.padded_numel;
    if (f.unit_fqn.empty())
      root = f.padded_numel;
    else
      largest_block = std::max(largest_block, f.padded_numel);
  }
  auto mem = model.memory_stats();
  EXPECT_EQ(mem.sharded_params.current, 4 * padded);                    // fp32 masters
  EXPECT_EQ(mem.gathered_params.peak, 2 * (root + 2 * largest_block));  // bf16: 2 bytes
  EXPECT_EQ(mem.grad_shards.current, 4 * padded);                       // fp32 gradient shards
}

// fp16 on CPU (LibTorch 2.x has the kernels): fp16 compute and communication with a
// loss scaler trains at world 2 and every rank takes the same steps.
TEST(MixedPrecision, Fp16OnCpuTrainsWithALossScaler) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.mixed_precision.param_dtype = torch::kHalf;
    o.mixed_precision.reduce_dtype = torch::kHalf;
    o.mixed_precision.output_dtype = torch::kFloat32;
    torch::manual_seed(3);
    auto model = fully_shard(MlpNet(), o);
    EXPECT_EQ(model.sharded_parameters()[0].scalar_type(), torch::kFloat);  // fp32 masters
    torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(3e-3));
    LossScalerOptions so;
    so.initial_scale_power = 30;  // 2^30 overflows fp16 gradients: the first steps are skipped
    LossScaler scaler(model, so);
    auto [x, y] = mlp_batch(0, 8);
    std::vector<double> losses;
    for (int step = 0; step < 60; ++step) {
      auto loss = torch::mse_loss(model(my_rows(x, pg)), my_rows(y, pg));
      ASSERT_EQ(loss.scalar_type(), torch::kFloat);
      ASSERT_TRUE(std::isfinite(loss.item<double>())) << "step " << step;
      losses.push_back(loss.item<double>());
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      opt.zero_grad();
    }
    const int64_t skipped = scaler.state().skipped_steps;
    EXPECT_GT(skipped, 0);
    EXPECT_LT(skipped, 30);
    EXPECT_LT(scaler.state().scale, std::ldexp(1.0, 30));
    EXPECT_LT(losses.back(), 0.5 * losses.front());
    // The same count and scale on every rank.
    auto mine = torch::tensor({static_cast<double>(skipped), scaler.state().scale}, torch::kDouble);
    auto mx = mine.clone(), sum = mine.clone();
    pg.all_reduce_max(mx);
    pg.all_reduce_sum(sum);
    EXPECT_TRUE(torch::equal(mx * pg.size(), sum)) << mine;
  });
}

TEST(MixedPrecision, ReduceDtypeBelowFp16IsRejected) {
  ShardingOptions o;
  o.mixed_precision.reduce_dtype = torch::kChar;
  try {
    fully_shard(MlpNet(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "MixedPrecision::reduce_dtype=Char is unsupported; use Float, BFloat16 or Half");
  }
}

}  // namespace

namespace {

class NormNetImpl : public torch::nn::Module {
 public:
  NormNetImpl()
      : a(register_module("a", torch::nn::Linear(8, 8))),
        norm(register_module("norm", FullyShardedModule<torch::nn::LayerNorm>(
                                         torch::nn::LayerNorm(torch::nn::LayerNormOptions({8}))))),
        b(register_module("b", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(norm(a(x))); }
  torch::nn::Linear a;
  FullyShardedModule<torch::nn::LayerNorm> norm;
  torch::nn::Linear b;
};
TORCH_MODULE(NormNet);

TEST(MixedPrecision, KeepFp32PolicyRunsNormLayersInTheirOwnFp32Units) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.auto_wrap_policy = wrap::never_wrap_policy();  // the policy alone would make no units
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.keep_fp32_policy = wrap::module_type_policy<torch::nn::LayerNorm>();
    torch::manual_seed(61);
    auto model = fully_shard(NormNet(), o);
    std::map<std::string, torch::Dtype> dtypes;
    for (const auto& f : fsdp::detail::flat_params(model)) dtypes[f.unit_fqn] = f.param_dtype;
    EXPECT_EQ(dtypes, (std::map<std::string, torch::Dtype>{{"", torch::kBFloat16},
                                                           {"norm", torch::kFloat32}}));

    auto x = torch::randn({4, 8}, at::detail::createCPUGenerator(5));
    auto out = model(x);
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    // The same casts by hand: bf16 linear, fp32 LayerNorm, back to bf16, bf16 linear.
    auto w = std::map<std::string, torch::Tensor>();
    for (auto& [n, t] : full_state_dict(model)) w[n] = t;
    auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
    auto h = torch::nn::functional::linear(bf(x), bf(w["a.weight"]), bf(w["a.bias"]));
    h = torch::layer_norm(h.to(torch::kFloat32), {8}, w["norm.weight"], w["norm.bias"], 1e-5)
            .to(torch::kBFloat16);
    auto expected = torch::nn::functional::linear(h, bf(w["b.weight"]), bf(w["b.bias"]));
    EXPECT_TRUE(torch::equal(out, expected));
    out.to(torch::kFloat32).sum().backward();
    for (const auto& p : model.sharded_parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_TRUE(p.grad().isfinite().all().item<bool>());
    }
  });
}

// shard_sequential's entries take the same path as FullyShardedModule wrap points:
// keep_fp32_policy and output_dtype give bit-identical results either way.
TEST(MixedPrecision, ShardSequentialKeepsFp32EntriesAndCastsOutputsLikeWrapPoints) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.auto_wrap_policy = wrap::never_wrap_policy();
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.output_dtype = torch::kFloat32;
    o.mixed_precision.keep_fp32_policy = wrap::module_type_policy<torch::nn::LayerNorm>();
    torch::manual_seed(61);
    auto wrapped = fully_shard(NormNet(), o);
    torch::manual_seed(61);  // the same weights: Linear, LayerNorm, Linear made in that order
    torch::nn::Linear first(8, 8);
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({8}));
    torch::nn::Linear last(8, 3);
    auto seq = shard_sequential(torch::nn::Sequential(first, norm, last), o);
    std::map<std::string, torch::Dtype> dtypes;
    for (const auto& f : fsdp::detail::flat_params(seq)) dtypes[f.unit_fqn] = f.param_dtype;
    EXPECT_EQ(dtypes, (std::map<std::string, torch::Dtype>{{"", torch::kBFloat16},
                                                           {"1", torch::kFloat32}}));
    auto x = torch::randn({4, 8}, at::detail::createCPUGenerator(5));
    auto a = wrapped(x), b = seq(x);
    EXPECT_EQ(a.scalar_type(), torch::kFloat32);
    EXPECT_EQ(b.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(a, b));
    a.sum().backward();
    b.sum().backward();
    auto ga = wrapped.sharded_parameters(), gb = seq.sharded_parameters();
    ASSERT_EQ(ga.size(), gb.size());
    for (size_t i = 0; i < ga.size(); ++i)
      EXPECT_TRUE(torch::equal(ga[i].grad(), gb[i].grad())) << i;
  });
}

}  // namespace

namespace {
TEST(MixedPrecision, BufferDtypeCastsFloatingBuffersOnly) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
  ShardingOptions o;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  o.mixed_precision.buffer_dtype = torch::kBFloat16;
  auto model = shard_sequential(seq, o);
  int floating = 0;
  for (const auto& b : model->named_buffers()) {
    if (b.key().find("num_batches_tracked") != std::string::npos) {
      EXPECT_EQ(b.value().scalar_type(), torch::kLong);  // integer buffers stay
    } else {
      EXPECT_EQ(b.value().scalar_type(), torch::kBFloat16) << b.key();
      ++floating;
    }
  }
  EXPECT_EQ(floating, 2);  // running_mean, running_var
}
}  // namespace

namespace {
// A root that scales its input by an fp32 buffer before a Linear (issue 41's example).
struct ScaledImpl : torch::nn::Module {
  ScaledImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    scale = register_buffer("scale", torch::full({4}, 2.0f));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x * scale); }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Scaled);
}  // namespace

// Note [Dtype errors under mixed precision]: the fp32 buffer turns the bf16 input into
// fp32 before a bf16 Linear. The error keeps LibTorch's words and adds the unit and the
// fix; with buffer_dtype set, the same model runs.
TEST(MixedPrecision, ADtypeMismatchInAUnitNamesItAndTheOptionsThatFixIt) {
  ShardingOptions o;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  auto model = fully_shard(Scaled(), o);
  std::string what = "<no error>";
  try {
    model(torch::ones({2, 4}));
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  }
  EXPECT_NE(what.find("[fsdp] unit '<root>' computes in BFloat16 (MixedPrecision::param_dtype) "
                      "and a tensor of another dtype met its parameters"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("MixedPrecision::buffer_dtype"), std::string::npos) << what;
  EXPECT_NE(what.find("cast_forward_inputs is true"), std::string::npos) << what;
  o.mixed_precision.buffer_dtype = torch::kBFloat16;
  auto fixed = fully_shard(Scaled(), o);
  EXPECT_EQ(fixed(torch::ones({2, 4})).scalar_type(), torch::kBFloat16);
  // In fp32 nothing is added to an error: the hint is for mixed precision only.
}

}  // namespace test_mixed_precision_cases
