// Pure bf16 (MixedPrecision::master_dtype = kBFloat16): shards, gradients and optimizer
// state in bf16, the bytes per parameter that gives, FusedAdamW's roundings (Note [Pure
// bf16 rounding]), the loss curve against fp32 masters, and checkpoints in fp32.
#include "support/models.h"
#include "support/multirank.h"

#include <fsdp/checkpoint.h>
#include <fsdp/fused_adamw.h>

#include <gtest/gtest.h>

#include <unistd.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <utility>
#include <vector>

#include "../src/internal/optim_key.h"
#include "../src/internal/sharded_model.h"  // flat-parameter sizes the assertions need

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_pure_bf16_cases {

namespace {

ShardingOptions bf16_options(const ProcessGroup& pg, bool pure) {
  ShardingOptions o;
  o.process_group = pg;
  o.mixed_precision.param_dtype = torch::kBFloat16;
  o.mixed_precision.reduce_dtype = torch::kBFloat16;
  o.mixed_precision.output_dtype = torch::kFloat32;
  if (pure) o.mixed_precision.master_dtype = torch::kBFloat16;
  return o;
}

int64_t padded_elements(const ShardedModel& model) {
  int64_t n = 0;
  for (const auto& f : fsdp::detail::flat_params(model)) n += f.padded_numel;
  return n;
}

int64_t adam_bytes(torch::optim::Optimizer& opt, const ShardedModel& model) {
  int64_t n = 0;
  for (const auto& p : model.sharded_parameters()) {
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(
        *opt.state().at(fsdp::detail::optim_state_key(opt.state(), p)));
    n += static_cast<int64_t>(st.exp_avg().nbytes() + st.exp_avg_sq().nbytes());
  }
  return n;
}

// Per parameter and rank: 2 bytes of bf16 shard, 2 of gradient, 4 of moments = 8 / N,
// against 4 + 4 + 8 = 16 / N with fp32 masters (both with bf16 compute).
TEST(PureBf16, BytesPerParameterAreHalfOfFp32Masters) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    for (const bool pure : {false, true}) {
      torch::manual_seed(1);
      auto model = fully_shard(gpt::GPT(cfg), bf16_options(pg, pure));
      FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
      const int64_t psi = padded_elements(model), N = pg.size();
      const int64_t e = pure ? 2 : 4;
      for (const auto& p : model.sharded_parameters())
        EXPECT_EQ(p.scalar_type(), pure ? torch::kBFloat16 : torch::kFloat);
      gpt::loss_on(model, my_rows(gpt_batch(0, 4, cfg.block_size), pg)).backward();
      const auto m = model.memory_stats();
      EXPECT_EQ(m.sharded_params.current, e * psi / N);
      EXPECT_EQ(m.grad_shards.current, e * psi / N);
      opt.step();
      EXPECT_EQ(adam_bytes(opt, model), 2 * e * psi / N);
      const int64_t per_param_times_n =
          (m.sharded_params.current + m.grad_shards.current + adam_bytes(opt, model)) * N / psi;
      EXPECT_EQ(per_param_times_n, pure ? 8 : 16) << "bytes per parameter, times N";
    }
  });
}

// Round-to-nearest loses updates below half an ulp; stochastic rounding keeps them on
// average and the compensated form keeps them exactly enough. A constant gradient on
// parameters at 1.0 (bf16 ulp 2^-7) with lr 1e-3: Adam's normalised step is lr, under
// half an ulp (3.9e-3), so nearest never moves while fp32 goes to 1 - 100 lr = 0.9.
TEST(PureBf16, SmallUpdatesStallUnderNearestAndSurviveStochasticOrCompensated) {
  const int64_t n = 4096;
  auto run = [&](torch::Dtype dtype, FusedAdamW::Bf16Rounding rounding) {
    auto p = torch::ones({n}, torch::TensorOptions().dtype(dtype)).requires_grad_(true);
    FusedAdamW opt({p}, torch::optim::AdamWOptions(1e-3).weight_decay(0));
    opt.set_bf16_rounding(rounding, /*seed=*/7);
    for (int s = 0; s < 100; ++s) {
      p.mutable_grad() = torch::ones_like(p);
      opt.step();
    }
    return p.detach().to(torch::kFloat);
  };
  const auto fp32 = run(torch::kFloat, FusedAdamW::Bf16Rounding::kNearest);
  EXPECT_NEAR(fp32.mean().item<double>(), 0.9, 1e-3);
  const auto nearest = run(torch::kBFloat16, FusedAdamW::Bf16Rounding::kNearest);
  EXPECT_TRUE(torch::equal(nearest, torch::ones({n}))) << "every update rounded away";
  const auto stochastic = run(torch::kBFloat16, FusedAdamW::Bf16Rounding::kStochastic);
  // Each element's error is a sum of 100 independent roundings of at most one ulp
  // (standard deviation about 0.04): their mean over 4096 elements lies within 6e-4 (one
  // standard deviation) of fp32's, bounded here at 8 of them; no element may be further
  // than 0.25 (over 6 of an element's). Nearest is 0.1 off everywhere.
  EXPECT_NEAR(stochastic.mean().item<double>(), fp32.mean().item<double>(), 5e-3);
  EXPECT_LT((stochastic - fp32).abs().max().item<double>(), 0.25);
  const auto compensated = run(torch::kBFloat16, FusedAdamW::Bf16Rounding::kCompensated);
  // Within one bf16 ulp at 0.9 (2^-8 = 3.9e-3) of fp32, element by element.
  EXPECT_LE((compensated - fp32).abs().max().item<double>(), 1.0 / 256);
}

// The ATen op chain step_bf16 was before its fused kernel (Note [Pure bf16 rounding]): the
// reference its kNearest and kCompensated results must equal bit for bit. One change:
// the square root is the correctly rounded one (through double, exact for floats), as
// in the kernel. ATen's float sqrt is MKL's vsSqrt where LibTorch has MKL (VML_HA: 1 ulp,
// off by one on about 16% of values here); without MKL it is the IEEE one, and this is
// the old chain to the bit.
struct ChainState {
  torch::Tensor m, v, comp;
  int64_t step = 0;
};

void chain_step(torch::Tensor& p, const torch::Tensor& grad, ChainState& s,
                const torch::optim::AdamWOptions& o, bool compensated) {
  if (!s.m.defined()) {
    s.m = torch::zeros_like(p);
    s.v = torch::zeros_like(p);
    s.comp = torch::zeros_like(p);
  }
  ++s.step;
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(s.step));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(s.step));
  at::Tensor w = p.to(torch::kFloat);
  if (compensated) w.add_(s.comp.to(torch::kFloat));
  const at::Tensor g = grad.to(torch::kFloat);
  at::Tensor m = s.m.to(torch::kFloat), v = s.v.to(torch::kFloat);
  if (o.weight_decay() != 0) w.mul_(1 - o.lr() * o.weight_decay());
  m.lerp_(g, 1 - beta1);
  v.mul_(beta2).addcmul_(g, g, 1 - beta2);
  const at::Tensor denom =
      (v.to(torch::kDouble).sqrt().to(torch::kFloat) / std::sqrt(bc2)).add_(o.eps());
  w.addcdiv_(m, denom, -o.lr() / bc1);
  s.m.copy_(m);
  s.v.copy_(v);
  p.copy_(w);
  if (compensated) s.comp.copy_(w - p.to(torch::kFloat));
}

const torch::optim::AdamWParamState& adam_state(torch::optim::Optimizer& opt,
                                                const torch::Tensor& p) {
  return static_cast<const torch::optim::AdamWParamState&>(
      *opt.state().at(fsdp::detail::optim_state_key(opt.state(), p)));
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::equal(a.view(torch::kShort), b.view(torch::kShort));
}

std::vector<FusedAdamW::Isa> supported_isas() {
  std::vector<FusedAdamW::Isa> isas;
  for (auto isa : {FusedAdamW::Isa::kScalar, FusedAdamW::Isa::kAvx2, FusedAdamW::Isa::kAvx512})
    if (FusedAdamW::isa_supported(isa)) isas.push_back(isa);
  return isas;
}

struct ForcedIsa {
  explicit ForcedIsa(FusedAdamW::Isa isa) { FusedAdamW::force_isa(isa); }
  ~ForcedIsa() { FusedAdamW::force_isa(FusedAdamW::Isa::kAuto); }
};

struct NumThreads {
  explicit NumThreads(int n) : before(at::get_num_threads()) { at::set_num_threads(n); }
  ~NumThreads() { at::set_num_threads(before); }
  int before;
};

// kNearest and kCompensated give the ATen chain's bits: parameters, both moments and
// (through the next steps) the compensation, over 4 steps with weight decay, at sizes
// that leave vector tails (1, 7, 65537), bf16 and fp32 gradients, every instruction set.
TEST(PureBf16, NearestAndCompensatedEqualTheAtenOpChainBitForBit) {
  const auto o = torch::optim::AdamWOptions(2e-2).weight_decay(0.1).betas({0.8, 0.95}).eps(1e-6);
  for (const auto isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{65537}}) {
      for (const auto grad_dtype : {torch::kBFloat16, torch::kFloat}) {
        for (const bool compensated : {false, true}) {
          SCOPED_TRACE(std::string(FusedAdamW::isa_name(isa)) + " n=" + std::to_string(n) +
                       (grad_dtype == torch::kFloat ? " fp32 grads" : " bf16 grads") +
                       (compensated ? " compensated" : " nearest"));
          torch::manual_seed(n);
          auto p = torch::randn({n}).to(torch::kBFloat16).requires_grad_(true);
          auto ref = p.detach().clone();
          const auto start = ref.clone();
          FusedAdamW opt({p}, o);
          opt.set_bf16_rounding(compensated ? FusedAdamW::Bf16Rounding::kCompensated
                                            : FusedAdamW::Bf16Rounding::kNearest);
          ChainState chain;
          for (int s = 0; s < 4; ++s) {
            const auto g = (torch::randn({n}) * std::pow(10.0, -s)).to(grad_dtype);
            p.mutable_grad() = g;
            opt.step();
            chain_step(ref, g, chain, o, compensated);
            ASSERT_TRUE(same_bits(p.detach(), ref)) << "step " << s;
            const auto& st = adam_state(opt, p);
            ASSERT_EQ(st.step(), s + 1);
            ASSERT_TRUE(same_bits(st.exp_avg(), chain.m)) << "step " << s;
            ASSERT_TRUE(same_bits(st.exp_avg_sq(), chain.v)) << "step " << s;
          }
          EXPECT_EQ(opt.compensation_bytes(), compensated ? 2 * n : 0);
          EXPECT_FALSE(same_bits(p.detach(), start)) << "the steps moved the parameter";
        }
      }
    }
  }
}

// kStochastic's random bits are a hash of (seed, parameter position, step, element): the
// same results with 1 and 2 threads and with every instruction set, other results with
// another seed, and other bits for a second parameter with the same values.
TEST(PureBf16, StochasticRoundingDependsOnTheSeedNotOnThreadsOrInstructionSet) {
  const int64_t n = 200003;  // 2 threads split it off a multiple of the vector widths
  auto run = [&](uint64_t seed, int threads, FusedAdamW::Isa isa) {
    NumThreads nt(threads);
    ForcedIsa forced(isa);
    torch::manual_seed(5);
    auto a = torch::randn({n}).to(torch::kBFloat16).requires_grad_(true);
    auto b = a.detach().clone().requires_grad_(true);
    FusedAdamW opt({a, b}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    opt.set_bf16_rounding(FusedAdamW::Bf16Rounding::kStochastic, seed);
    for (int s = 0; s < 3; ++s) {
      const auto g = torch::randn({n}).to(torch::kBFloat16);
      a.mutable_grad() = g;
      b.mutable_grad() = g.clone();
      opt.step();
    }
    return std::make_pair(a.detach().clone(), b.detach().clone());
  };
  const auto isas = supported_isas();
  const auto base = run(11, 1, isas.front());
  for (const auto isa : isas) {
    for (const int threads : {1, 2}) {
      SCOPED_TRACE(std::string(FusedAdamW::isa_name(isa)) + ", threads " + std::to_string(threads));
      const auto again = run(11, threads, isa);
      EXPECT_TRUE(same_bits(again.first, base.first));
      EXPECT_TRUE(same_bits(again.second, base.second));
    }
  }
  const auto other_seed = run(12, 2, isas.back());
  const double differ_seed = (other_seed.first != base.first).sum().item<double>() / n;
  const double differ_position = (base.second != base.first).sum().item<double>() / n;
  // Independent bits pick another value on about half of the elements (0.495 and 0.495
  // measured here); a key that ignored the seed or the position would give 0.
  EXPECT_GT(differ_seed, 0.4);
  EXPECT_GT(differ_position, 0.4);
}

// Unbiased: one step that moves 1.0 up by a known share f of a bf16 ulp (2^-7) rounds up
// in a share f of 2^16 elements, within 5 standard deviations of a binomial, and every
// element ends at 1 or 1 + 2^-7.
TEST(PureBf16, StochasticRoundingRoundsUpWithTheDroppedShareOfAnUlp) {
  const int64_t n = int64_t{1} << 16;
  const double ulp = 1.0 / 128;
  // Adam's first step with a constant gradient moves by lr / (1 + eps): a quarter of an ulp.
  const double lr = ulp / 4;
  auto p = torch::ones({n}, torch::TensorOptions().dtype(torch::kBFloat16)).requires_grad_(true);
  auto w = torch::ones({n}).requires_grad_(true);  // fp32: the exact target
  for (auto* t : {&p, &w}) t->mutable_grad() = -torch::ones({n}, t->options());
  FusedAdamW bf16_opt({p}, torch::optim::AdamWOptions(lr).weight_decay(0));
  bf16_opt.set_bf16_rounding(FusedAdamW::Bf16Rounding::kStochastic, 3);
  FusedAdamW fp32_opt({w}, torch::optim::AdamWOptions(lr).weight_decay(0));
  bf16_opt.step();
  fp32_opt.step();
  const double f = (w[0].item<double>() - 1) / ulp;
  ASSERT_NEAR(f, 0.25, 1e-4);
  const auto up = p.detach().to(torch::kFloat) == 1 + ulp;
  const auto down = p.detach().to(torch::kFloat) == 1;
  EXPECT_EQ((up | down).sum().item<int64_t>(), n) << "every element at one of the two";
  const double ups = up.sum().item<double>();
  const double sd = std::sqrt(n * f * (1 - f));
  EXPECT_NEAR(ups, n * f, 5 * sd) << "rounded up " << ups << " of " << n;  // 16422 here
}

// The small GPT memorising one batch for 60 steps (loss 5.56 to 0.0074) with fp32
// masters and with pure bf16 under each rounding, all with bf16 compute, at world 2. The
// relative gap to fp32 masters' loss at every step must stay within: 2% compensated
// (measured 0.9% here), 10% stochastic (4.0%), 50% nearest (26%, at the tail, where the
// updates that nearest rounds away are all that is left to learn). Twice the measured
// gaps or more, for other CPUs' kernels; nearest's bound only says it still trains.
double tolerance(FusedAdamW::Bf16Rounding r) {
  switch (r) {
    case FusedAdamW::Bf16Rounding::kCompensated:
      return 0.02;
    case FusedAdamW::Bf16Rounding::kStochastic:
      return 0.10;
    case FusedAdamW::Bf16Rounding::kNearest:
      return 0.50;
  }
  return 0;
}

TEST(PureBf16, LossCurveStaysNearFp32MastersWithinEachRoundingsTolerance) {
  run_ranks(2, [](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    auto train = [&](bool pure, FusedAdamW::Bf16Rounding rounding) {
      torch::manual_seed(21);
      auto model = fully_shard(gpt::GPT(cfg), bf16_options(pg, pure));
      FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-2).eps(1e-6));
      opt.set_bf16_rounding(rounding, /*seed=*/100 + pg.rank());
      std::vector<double> losses;
      // One batch, again and again: random tokens have nothing else to learn.
      const auto batch = my_rows(gpt_batch(0, 8, cfg.block_size), pg);
      for (int64_t step = 0; step < 60; ++step) {
        auto loss = gpt::loss_on(model, batch);
        loss.backward();
        losses.push_back(global_mean(loss, pg));
        opt.step();
        opt.zero_grad();
      }
      return losses;
    };
    const auto masters = train(false, FusedAdamW::Bf16Rounding::kNearest);
    for (const auto rounding :
         {FusedAdamW::Bf16Rounding::kNearest, FusedAdamW::Bf16Rounding::kStochastic,
          FusedAdamW::Bf16Rounding::kCompensated}) {
      const auto pure = train(true, rounding);
      double worst = 0;
      for (size_t s = 0; s < masters.size(); ++s) {
        const double rel = std::abs(pure[s] - masters[s]) / masters[s];
        worst = std::max(worst, rel);
        EXPECT_LE(rel, tolerance(rounding))
            << "step " << s << " rounding " << static_cast<int>(rounding);
      }
      if (pg.rank() == 0) {
        std::cout << "pure bf16, rounding " << static_cast<int>(rounding) << ":";
        for (size_t s = 0; s < pure.size(); s += 10)
          std::cout << " step " << s << " " << pure[s] << " (" << masters[s] << ")";
        std::cout << " last " << pure.back() << " (" << masters.back() << "), worst gap " << worst
                  << "\n";
      }
    }
    EXPECT_LT(masters.back(), masters.front()) << "it learns";
  });
}

TEST(PureBf16, BadCombinationsAreRefusedNamingTheFix) {
  ShardingOptions o;
  o.mixed_precision.master_dtype = torch::kBFloat16;  // param_dtype still fp32
  try {
    fully_shard(MlpNet(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "MixedPrecision::master_dtype=BFloat16 (pure bf16) needs "
              "MixedPrecision::param_dtype=BFloat16 too (got Float): the gathered parameters "
              "cannot be more precise than the shards");
  }
  o.mixed_precision.param_dtype = torch::kBFloat16;
  o.mixed_precision.keep_fp32_policy = wrap::always_wrap_policy();
  try {
    fully_shard(MlpNet(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "MixedPrecision::keep_fp32_policy keeps units in fp32, which pure bf16 "
              "(MixedPrecision::master_dtype=BFloat16) has no fp32 values for; drop one of them");
  }
  o.mixed_precision.keep_fp32_policy = nullptr;
  o.mixed_precision.master_dtype = torch::kHalf;
  try {
    fully_shard(MlpNet(), o);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "MixedPrecision::master_dtype=Half is unsupported; use Float (fp32 masters) or "
              "BFloat16 (pure bf16)");
  }
}

// A rounding FusedAdamW cannot apply is an error, not a silent round-to-nearest: a bf16
// parameter that ATen's kernel steps (on a GPU, or here set_kernel(kAten)) with
// kStochastic or kCompensated asked for.
TEST(PureBf16, ARoundingAtensKernelCannotApplyIsRefused) {
  if (!FusedAdamW::aten_kernel_available(torch::kCPU))
    GTEST_SKIP() << "this LibTorch has no at::_fused_adamw_ for the CPU";
  auto p = torch::ones({8}, torch::TensorOptions().dtype(torch::kBFloat16)).requires_grad_(true);
  p.mutable_grad() = torch::ones_like(p);
  FusedAdamW opt({p}, torch::optim::AdamWOptions(0.1));  // a step of 0.1: over half an ulp
  opt.set_kernel(FusedAdamW::Kernel::kAten);
  opt.set_bf16_rounding(FusedAdamW::Bf16Rounding::kStochastic, 1);
  try {
    opt.step();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "FusedAdamW: set_bf16_rounding(kStochastic) rounds in the host kernel, but a bf16 "
              "parameter on cpu under set_kernel(kAten) steps with ATen's fused kernel, which "
              "rounds to nearest; use Bf16Rounding::kNearest there, or step the shards on the "
              "host (offload_optimizer)");
  }
  opt.set_bf16_rounding(FusedAdamW::Bf16Rounding::kNearest);
  opt.step();
  EXPECT_LT(p.detach().to(torch::kFloat).max().item<float>(), 1.0f) << "nearest still steps";
}

#ifdef FSDP_TEST_HAVE_HDF5
// Checkpoints hold fp32 values: a pure bf16 run's checkpoint (world 2) loads into a run
// with fp32 masters at world 1 with the same values (bf16 widens exactly), Adam's moments
// too.
TEST(PureBf16, CheckpointsLoadIntoFp32MastersAtAnotherWorldSize) {
  const char* env = std::getenv("FSDP_TEST_PURE_BF16_DIR");
  const std::string dir = env ? env
                              : (std::filesystem::temp_directory_path() /
                                 ("fsdp_pure_bf16_" + std::to_string(getpid())))
                                    .string();
  const auto cfg = small_gpt_config();
  run_ranks(2,
            [&](const ProcessGroup& pg) {
              torch::manual_seed(3);
              auto model = fully_shard(gpt::GPT(cfg), bf16_options(pg, true));
              FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
              for (int64_t s = 0; s < 2; ++s) {
                gpt::loss_on(model, my_rows(gpt_batch(s, 4, cfg.block_size), pg)).backward();
                opt.step();
                opt.zero_grad();
              }
              ckpt::save_sharded_checkpoint(dir, model, &opt, ckpt::TrainingState{});
            },
            300, {"FSDP_TEST_PURE_BF16_DIR=" + dir});
  // World 1, fp32 masters: the values are the bf16 ones, exactly.
  torch::manual_seed(99);
  auto model = fully_shard(gpt::GPT(cfg), bf16_options(ProcessGroup(), false));
  FusedAdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-3));
  gpt::loss_on(model, gpt_batch(0, 4, cfg.block_size)).backward();
  opt.step();  // creates the state the load fills
  opt.zero_grad();
  ckpt::TrainingState st;
  ckpt::load_sharded_checkpoint(ckpt::latest_checkpoint(dir).value(), model, &opt, &st);
  for (const auto& p : model.sharded_parameters()) {
    EXPECT_TRUE(torch::equal(p, p.to(torch::kBFloat16).to(torch::kFloat)))
        << "every loaded value is a bf16 value";
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(
        *opt.state().at(fsdp::detail::optim_state_key(opt.state(), p)));
    EXPECT_EQ(s.step(), 2);
    EXPECT_TRUE(torch::equal(s.exp_avg(), s.exp_avg().to(torch::kBFloat16).to(torch::kFloat)));
  }
  std::filesystem::remove_all(dir);
}
#endif

}  // namespace

}  // namespace test_pure_bf16_cases
