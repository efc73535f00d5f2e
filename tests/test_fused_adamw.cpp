// FusedAdamW against torch::optim::AdamW, on every instruction set, with weight decay,
// several parameter groups and 16-bit copy-out; and as the optimizer of a sharded model
// whose state checkpoints save and reshard.
#include <fsdp/checkpoint.h>
#include <fsdp/fused_adamw.h>

#include "support/models.h"
#include "support/multirank.h"

#include "../src/internal/optim_key.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

namespace fsdp {
// Names the ISA in test listings (ctest shows it); found by argument-dependent lookup.
void PrintTo(FusedAdamW::Isa isa, std::ostream* os) { *os << FusedAdamW::isa_name(isa); }
}  // namespace fsdp

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_fused_adamw_cases {

namespace {

// Two parameter groups with different hyperparameters (weight decay in the first only):
// the first two tensors of `ps`, then the rest.
std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::optim::OptimizerParamGroup> g;
  g.emplace_back(
      std::vector<torch::Tensor>{ps[0], ps[1]},
      std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas({0.9, 0.95}).eps(1e-8)));
  g.emplace_back(
      std::vector<torch::Tensor>(ps.begin() + 2, ps.end()),
      std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(3e-3).weight_decay(0.0).betas({0.8, 0.999}).eps(1e-6)));
  return g;
}

struct IsaGuard {
  explicit IsaGuard(FusedAdamW::Isa isa) { FusedAdamW::force_isa(isa); }
  ~IsaGuard() { FusedAdamW::force_isa(FusedAdamW::Isa::kAuto); }
};

double max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

class FusedAdamWIsa : public ::testing::TestWithParam<FusedAdamW::Isa> {};

TEST_P(FusedAdamWIsa, MatchesTorchAdamWOverHundredStepsWithGroupsDecayAndCopyOut) {
  if (!FusedAdamW::isa_supported(GetParam())) {
    GTEST_SKIP() << "this CPU has no " << FusedAdamW::isa_name(GetParam());
  }
  IsaGuard isa(GetParam());
  EXPECT_EQ(FusedAdamW::active_isa(), GetParam());
  torch::manual_seed(0);
  // Sizes that leave tails after every vector width and span several threads' chunks.
  std::vector<torch::Tensor> ref = {torch::randn({1000003}), torch::randn({17}),
                                    torch::randn({64, 33}), torch::randn({3})};
  std::vector<torch::Tensor> got;
  for (auto& t : ref) {
    t.requires_grad_(true);
    got.push_back(t.detach().clone().requires_grad_(true));
  }
  torch::optim::AdamW torch_opt(two_groups(ref));
  FusedAdamW fused(two_groups(got));
  auto bf16 = torch::empty({ref[0].numel()}, torch::kBFloat16);
  auto fp16 = torch::empty({ref[2].numel()}, torch::kFloat16);
  fused.set_copy_out(got[0], bf16);
  fused.set_copy_out(got[2], fp16);
  for (int step = 0; step < 100; ++step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      auto g = torch::randn(ref[i].sizes()) * (1.0 + step % 7);
      ref[i].mutable_grad() = g.clone();
      got[i].mutable_grad() = g.clone();
    }
    if (step == 50) fused.param_groups()[0].options().set_lr(5e-3);  // per-group lr changes
    if (step == 50) torch_opt.param_groups()[0].options().set_lr(5e-3);
    torch_opt.step();
    fused.step();
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_LE(max_rel(got[i].detach(), ref[i].detach()), 1e-6) << "parameter " << i;
  }
  // The copy-out is the updated parameter, rounded as torch rounds.
  EXPECT_TRUE(torch::equal(bf16, got[0].detach().reshape({-1}).to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(fp16, got[2].detach().reshape({-1}).to(torch::kFloat16)));
  // The state is AdamW's: same step and moments.
  for (size_t i = 0; i < ref.size(); ++i) {
    auto& a = static_cast<torch::optim::AdamWParamState&>(
        *torch_opt.state().at(fsdp::detail::optim_state_key(torch_opt.state(), ref[i])));
    auto& b = static_cast<torch::optim::AdamWParamState&>(
        *fused.state().at(fsdp::detail::optim_state_key(fused.state(), got[i])));
    EXPECT_EQ(a.step(), b.step());
    EXPECT_LE(max_rel(b.exp_avg_sq(), a.exp_avg_sq()), 1e-6) << "parameter " << i;
  }
}

TEST(FusedAdamW, AnUnknownIsaInTheEnvironmentIsNamed) {
  // The variable is read once per process: check it in a fresh one.
  auto r = run_command(
      {bin_dir() + "/test_training", "--gtest_filter=FusedAdamW.RejectsWhatItCannotStep"},
      {"FSDP_ADAMW_ISA=sse9"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("FSDP_ADAMW_ISA=sse9 is unknown; use avx512, avx2, scalar or auto"),
            std::string::npos)
      << r.output;
}

INSTANTIATE_TEST_SUITE_P(EveryPath, FusedAdamWIsa,
                         ::testing::Values(FusedAdamW::Isa::kAvx512, FusedAdamW::Isa::kAvx2,
                                           FusedAdamW::Isa::kScalar),
                         [](const auto& info) {
                           return std::string(FusedAdamW::isa_name(info.param));
                         });

TEST(FusedAdamW, RejectsWhatItCannotStep) {
  auto p = torch::randn({4}).requires_grad_(true);
  FusedAdamW opt({p}, torch::optim::AdamWOptions(1e-3).amsgrad(true));
  p.mutable_grad() = torch::ones({4});
  try {
    opt.step();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("FusedAdamW does not implement amsgrad"),
              std::string::npos);
  }
  FusedAdamW ok({p});
  auto expect_error = [](const std::function<void()>& f, const std::string& want) {
    try {
      f();
      ADD_FAILURE() << "no error; wanted: " << want;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(want), std::string::npos)
          << e.what_without_backtrace();
    }
  };
  expect_error([&] { ok.set_copy_out(p, torch::empty({3}, torch::kBFloat16)); },
               "the copy has 3 elements but the parameter has 4");
  expect_error([&] { ok.set_copy_out(p, torch::empty({4}, torch::kFloat)); },
               "the copy must be a contiguous CPU bf16 or fp16 tensor");
  auto d = torch::randn({4}, torch::kDouble).requires_grad_(true);
  FusedAdamW doubles({d});
  d.mutable_grad() = torch::ones({4}, torch::kDouble);
  expect_error([&] { doubles.step(); }, "FusedAdamW steps contiguous fp32 CPU parameters");
}

// As the optimizer of a sharded model: the same training as torch's AdamW, and its
// state goes through a sharded checkpoint saved at 2 ranks and loaded at 1.
TEST(FusedAdamW, TrainsAShardedModelLikeAdamWAndItsStateReshards) {
  std::string tmpl = "/tmp/fsdp_fused_XXXXXX";
  static const std::string dir =
      std::getenv("FSDP_FUSED_DIR") ? std::getenv("FSDP_FUSED_DIR") : mkdtemp(tmpl.data());
  setenv("FSDP_FUSED_DIR", dir.c_str(), 1);
  auto batch = [](int64_t s) { return gpt_batch(s, 8, small_gpt_config().block_size); };
  run_ranks(2, [&](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    torch::manual_seed(0);
    auto a = fully_shard(gpt::GPT(small_gpt_config()), o);
    torch::manual_seed(0);
    auto b = fully_shard(gpt::GPT(small_gpt_config()), o);
    // eps 1e-6, as the parity tests (Note [Adam and noise] in test_parity.cpp): with the
    // default 1e-8, the key bias (true gradient exactly zero) steps by ~lr on rounding
    // noise, which the two optimizers' one-ulp differences make differ (measured on
    // PyPI's torch 2.15 with eps 1e-8: 2.0e-5 on blocks.1.attn.qkv.bias).
    const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1).eps(1e-6);
    torch::optim::AdamW ref(a.sharded_parameters(), adamw);
    FusedAdamW fused(b.sharded_parameters(), adamw);
    for (int64_t s = 0; s < 5; ++s) {
      auto la = gpt::loss_on(a, my_rows(batch(s), pg)), lb = gpt::loss_on(b, my_rows(batch(s), pg));
      EXPECT_NEAR(global_mean(lb, pg), global_mean(la, pg), 1e-6 * std::abs(global_mean(la, pg)))
          << "step " << s;
      la.backward();
      lb.backward();
      ref.step();
      fused.step();
      ref.zero_grad();
      fused.zero_grad();
    }
    // One step agrees with torch to about one ulp; parameters are compared with the
    // parity tests' noise floor.
    auto fa = full_state_dict(a), fb = full_state_dict(b);
    for (size_t i = 0; i < fa.size(); ++i)
      EXPECT_LE(rel_diff(fb[i].second, fa[i].second), 1e-5) << fa[i].first;
    ckpt::TrainingState st;
    st.step = 5;
    ckpt::save_sharded_checkpoint(dir, b, &fused, st);
    ckpt::export_consolidated(dir + "/full.h5", b, &fused, st,
                              {torch::kFloat32, /*with_optimizer=*/true});
  });
  run_ranks(1, [&](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    auto m = fully_shard(gpt::GPT(small_gpt_config()), o);
    FusedAdamW fused(m.sharded_parameters(), torch::optim::AdamWOptions(1.0));
    ckpt::load_sharded_checkpoint(dir, m, &fused, nullptr);
    EXPECT_EQ(static_cast<torch::optim::AdamWOptions&>(fused.param_groups()[0].options()).lr(),
              1e-3);
    // The resharded state, exported again, equals the 2-rank export.
    ckpt::export_consolidated(dir + "/again.h5", m, &fused, {5}, {torch::kFloat32, true});
    gpt::GPT x(small_gpt_config()), y(small_gpt_config());
    ckpt::load_consolidated(dir + "/full.h5", *x);
    ckpt::load_consolidated(dir + "/again.h5", *y);
    auto px = named_parameters_clean(*x), py = named_parameters_clean(*y);
    for (size_t i = 0; i < px.size(); ++i)
      EXPECT_TRUE(torch::equal(px[i].second, py[i].second)) << px[i].first;
    std::ifstream f1(dir + "/full.h5", std::ios::binary), f2(dir + "/again.h5", std::ios::binary);
    std::string b1((std::istreambuf_iterator<char>(f1)), {}),
        b2((std::istreambuf_iterator<char>(f2)), {});
    EXPECT_EQ(b1, b2) << "parameters and optimizer state must survive resharding exactly";
  });
}

// ---- ATen's fused kernel (at::_fused_adamw_), the one device shards step with ------------

// Parameters and gradients for the kernel comparisons: sizes with tails, two groups with
// different hyperparameters (decay in one), the same gradients for every optimizer.
struct AtenCase {
  std::vector<torch::Tensor> ref, got;
  AtenCase() {
    torch::manual_seed(0);
    ref = {torch::randn({100003}), torch::randn({17}), torch::randn({64, 33})};
    for (auto& t : ref) {
      t.requires_grad_(true);
      got.push_back(t.detach().clone().requires_grad_(true));
    }
  }
  void set_grads(int step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      auto g = torch::randn(ref[i].sizes()) * (1.0 + step % 5);
      ref[i].mutable_grad() = g.clone();
      got[i].mutable_grad() = g.clone();
    }
  }
};

#define SKIP_WITHOUT_CPU_FUSED_ADAMW()                                                    \
  if (!FusedAdamW::aten_kernel_available(torch::kCPU))                                    \
  GTEST_SKIP() << "this LibTorch (" << TORCH_VERSION << ") has no CPU kernel of "         \
               << "at::_fused_adamw_ (added in PyTorch 2.4); the CUDA one is checked by " \
               << "Cuda.FusedAdamWOnTheGpuMatchesTorchAdamW_CUDA"

// Kernel::kAten on the CPU: the kernel that steps device shards, against
// torch::optim::AdamW over 20 steps, within 1e-6 relative (parameters and both moments),
// with the same AdamWParamState (step counts included).
TEST(FusedAdamWAten, CpuKernelMatchesTorchAdamWOverTwentySteps) {
  SKIP_WITHOUT_CPU_FUSED_ADAMW();
  AtenCase c;
  torch::optim::AdamW torch_opt(two_groups(c.ref));
  FusedAdamW fused(two_groups(c.got));
  fused.set_kernel(FusedAdamW::Kernel::kAten);
  double worst_param = 0, worst_moment = 0;
  for (int step = 0; step < 20; ++step) {
    c.set_grads(step);
    torch_opt.step();
    fused.step();
    for (size_t i = 0; i < c.ref.size(); ++i) {
      worst_param = std::max(worst_param, max_rel(c.got[i].detach(), c.ref[i].detach()));
    }
  }
  for (size_t i = 0; i < c.ref.size(); ++i) {
    const auto& a = static_cast<const torch::optim::AdamWParamState&>(
        *fused.state().at(fsdp::detail::optim_state_key(fused.state(), c.got[i])));
    const auto& b = static_cast<const torch::optim::AdamWParamState&>(
        *torch_opt.state().at(fsdp::detail::optim_state_key(torch_opt.state(), c.ref[i])));
    EXPECT_EQ(a.step(), b.step()) << "param " << i;
    EXPECT_EQ(a.step(), 20) << "param " << i;
    worst_moment = std::max(worst_moment, max_rel(a.exp_avg(), b.exp_avg()));
    worst_moment = std::max(worst_moment, max_rel(a.exp_avg_sq(), b.exp_avg_sq()));
  }
  std::cout << "[ aten fused ] max relative difference after 20 steps: parameters " << worst_param
            << ", moments " << worst_moment << std::endl;
  EXPECT_LE(worst_param, 1e-6);
  EXPECT_LE(worst_moment, 1e-6);
  // The comparison can fail: a step with another learning rate moves the parameters apart.
  c.set_grads(20);
  torch_opt.step();
  fused.param_groups()[0].options().set_lr(2e-2);
  fused.step();
  EXPECT_GT(max_rel(c.got[0].detach(), c.ref[0].detach()), 1e-6);
}

// The state either kernel leaves is AdamW's: an optimizer checkpoint written after
// at::_fused_adamw_ steps loads into torch::optim::AdamW and into FusedAdamW's SIMD
// kernel, and both continue like an AdamW that never stopped.
TEST(FusedAdamWAten, StateLoadsIntoTorchAdamWAndTheSimdKernel) {
  SKIP_WITHOUT_CPU_FUSED_ADAMW();
  AtenCase c;
  torch::optim::AdamW torch_opt(two_groups(c.ref));
  FusedAdamW fused(two_groups(c.got));
  fused.set_kernel(FusedAdamW::Kernel::kAten);
  for (int step = 0; step < 5; ++step) {
    c.set_grads(step);
    torch_opt.step();
    fused.step();
  }
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    fused.save(archive);
    archive.save_to(saved);
  }
  // Two resumed copies of the parameters: one under torch's AdamW, one under the SIMD kernel.
  std::vector<torch::Tensor> p_torch, p_simd;
  for (auto& t : c.got) {
    p_torch.push_back(t.detach().clone().requires_grad_(true));
    p_simd.push_back(t.detach().clone().requires_grad_(true));
  }
  torch::optim::AdamW resumed_torch(two_groups(p_torch));
  FusedAdamW resumed_simd(two_groups(p_simd));
  for (torch::optim::Optimizer* o :
       std::initializer_list<torch::optim::Optimizer*>{&resumed_torch, &resumed_simd}) {
    torch::serialize::InputArchive archive;
    std::stringstream copy(saved.str());
    archive.load_from(copy);
    o->load(archive);
  }
  for (int step = 5; step < 10; ++step) {
    c.set_grads(step);
    for (size_t i = 0; i < c.ref.size(); ++i) {
      p_torch[i].mutable_grad() = c.ref[i].grad().clone();
      p_simd[i].mutable_grad() = c.ref[i].grad().clone();
    }
    torch_opt.step();
    resumed_torch.step();
    resumed_simd.step();
  }
  for (size_t i = 0; i < c.ref.size(); ++i) {
    EXPECT_LE(max_rel(p_torch[i].detach(), c.ref[i].detach()), 1e-6) << "param " << i;
    EXPECT_LE(max_rel(p_simd[i].detach(), c.ref[i].detach()), 1e-6) << "param " << i;
  }
}

}  // namespace

}  // namespace test_fused_adamw_cases
