// Parameter groups by original parameter over the flat shards (ShardParamGroups): the
// segments each rank gets (also where a shard boundary splits a parameter), parity with
// unsharded torch::optim::AdamW over the same groups at 1, 2 and 3 ranks with FusedAdamW
// and with torch's AdamW over the views, gradient accumulation and zero_grad through the
// views, and checkpoints saved at 2 ranks that resume at 1 and 3 with the groups' state
// and hyperparameters.
#include <fsdp/checkpoint.h>
#include <fsdp/fused_adamw.h>
#include <fsdp/param_groups.h>

#include "support/models.h"
#include "support/multirank.h"

#include "../src/internal/optim_key.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_param_groups_cases {

namespace {

constexpr int kGroupSteps = 10;
constexpr int64_t kGroupRows = 12;  // divisible by 1, 2 and 3
// As test_parity.cpp (Note [Adam and noise]): losses within 1e-5 relative, parameters
// within 5e-5 of the largest value (floor 0.1): 2.21e-5 measured at 3 ranks with the fused
// attention kernel (blocks.0.mlp.fc.weight, each optimizer).
constexpr double kLossTol = 1e-5;
constexpr double kWeightTol = 5e-5;

// The groups of the parity runs: 0 decays; 1 ("no_decay") biases and 1-D parameters
// (LayerNorm weights); 2 ("embed") the embeddings, with 10x the learning rate.
ParamGroupSpec gpt_spec() {
  ParamGroupSpec spec = no_decay_groups(0.1);
  spec.groups.push_back(GroupOptions{"embed", std::nullopt, 10.0, std::nullopt});
  auto base = spec.rule;
  spec.rule = [base](const ParamInfo& p) -> size_t {
    if (p.fqn == "wte.weight" || p.fqn == "wpe.weight") return 2;
    return base(p);
  };
  return spec;
}

torch::optim::AdamWOptions group_adamw() {
  return torch::optim::AdamWOptions(1e-3).weight_decay(0.1).eps(1e-6);
}

// The same groups over an unsharded model's parameters, by clean FQN.
std::vector<torch::optim::OptimizerParamGroup> reference_groups(torch::nn::Module& m,
                                                                const ParamGroupSpec& spec,
                                                                torch::optim::AdamWOptions d) {
  std::vector<std::vector<torch::Tensor>> params(spec.groups.size());
  for (const auto& [name, p] : named_parameters_clean(m)) {
    ParamInfo info{name, "", true, 0, p.numel(), p.sizes().vec()};
    params.at(spec.rule(info)).push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    auto o = std::make_unique<torch::optim::AdamWOptions>(d);
    if (spec.groups[g].lr_scale) o->lr(d.lr() * *spec.groups[g].lr_scale);
    if (spec.groups[g].weight_decay) o->weight_decay(*spec.groups[g].weight_decay);
    out.emplace_back(params[g], std::move(o));
  }
  return out;
}

// kFusedAten: FusedAdamW through at::_fused_adamw_, the kernel of device shards (its CPU
// kernel here), over the same views.
enum class Opt { kFused, kFusedAten, kTorch };
const char* opt_name(Opt o) {
  return o == Opt::kFused ? "fused" : o == Opt::kFusedAten ? "fused_aten" : "torch";
}
void PrintTo(Opt o, std::ostream* os) { *os << opt_name(o); }

std::unique_ptr<torch::optim::AdamW> make_optimizer(Opt which, const ShardParamGroups& groups,
                                                    torch::optim::AdamWOptions d) {
  if (which == Opt::kFused) return std::make_unique<FusedAdamW>(groups, d);
  if (which == Opt::kFusedAten) {
    auto f = std::make_unique<FusedAdamW>(groups, d);
    f->set_kernel(FusedAdamW::Kernel::kAten);
    return f;
  }
  return std::make_unique<torch::optim::AdamW>(groups.param_groups(d), d);
}

void gpt_group_parity(const ProcessGroup& pg, Opt which) {
  auto cfg = small_gpt_config();
  torch::manual_seed(0);
  gpt::GPT reference(cfg);
  torch::manual_seed(0);
  ShardingOptions o;
  o.process_group = pg;
  auto model = fully_shard(gpt::GPT(cfg), o);
  const ParamGroupSpec spec = gpt_spec();
  ShardParamGroups groups(model, spec);
  // Every original parameter is in the group the rule names, at every world size.
  EXPECT_EQ(groups.group_of("wte.weight"), 2u);
  EXPECT_EQ(groups.group_of("blocks.0.ln1.weight"), 1u);
  EXPECT_EQ(groups.group_of("blocks.1.attn.qkv.bias"), 1u);
  EXPECT_EQ(groups.group_of("blocks.1.attn.qkv.weight"), 0u);
  // Whole-model sizes (d 32, 2 layers, vocab 256, block 16): embeddings 256*32 + 16*32;
  // no decay: per block ln1, ln2 (2*32 each), qkv bias 96, proj bias 32, fc bias 128,
  // mlp proj bias 32 = 416, and ln_f 64.
  EXPECT_EQ(groups.group_numel(2), 256 * 32 + 16 * 32);
  EXPECT_EQ(groups.group_numel(1), 2 * 416 + 64);
  int64_t local = 0;
  for (size_t g = 0; g < 3; ++g) local += groups.local_group_numel(g);
  auto sum = torch::tensor({static_cast<double>(local)}, torch::kDouble);
  pg.all_reduce_sum(sum);
  EXPECT_EQ(sum.item<double>(), static_cast<double>(groups.group_numel(0) + groups.group_numel(1) +
                                                    groups.group_numel(2)));

  auto opt = make_optimizer(which, groups, group_adamw());
  torch::optim::AdamW ref_opt(reference_groups(*reference, spec, group_adamw()), group_adamw());
  for (int step = 0; step < kGroupSteps; ++step) {
    auto batch = gpt_batch(step, kGroupRows, cfg.block_size);
    auto loss = gpt::loss_on(model, my_rows(batch, pg));
    loss.backward();
    opt->step();
    opt->zero_grad();
    double global = global_mean(loss, pg);
    double ref_loss = 0;
    for (int share = 0; share < pg.size(); ++share) {
      auto l = gpt::loss_on(reference, share_rows(batch, share, pg.size())) / pg.size();
      l.backward();
      ref_loss += l.item<double>();
    }
    ref_opt.step();
    ref_opt.zero_grad();
    EXPECT_NEAR(global, ref_loss, kLossTol * std::abs(ref_loss)) << "step " << step;
  }
  // The embeddings step with 10x the learning rate, and so 10x the noise of a different
  // reduction order (4.9e-5 measured on wte.weight at 3 ranks, with either optimizer).
  // A parameter in the wrong group would be off by ~1e-3 (wrong decay) or more (wrong lr).
  std::map<std::string, torch::Tensor> full;
  for (auto& [name, t] : full_state_dict(model)) full[name] = t;
  for (const auto& [name, value] : named_parameters_clean(*reference)) {
    const double tol = groups.group_of(name) == 2 ? 10 * kWeightTol : kWeightTol;
    ASSERT_TRUE(full.count(name)) << name;
    EXPECT_LE(rel_diff(full[name], value.detach()), tol) << name;
  }
}

class GroupParity : public ::testing::TestWithParam<std::tuple<int, Opt>> {};

TEST_P(GroupParity, GptWithNoDecayAndEmbeddingLrGroupsMatchesUnshardedAdamW) {
  const Opt which = std::get<1>(GetParam());
  if (which == Opt::kFusedAten && !FusedAdamW::aten_kernel_available(torch::kCPU))
    GTEST_SKIP() << "this LibTorch has no CPU kernel of at::_fused_adamw_ (PyTorch 2.4+)";
  run_ranks(std::get<0>(GetParam()), [&](const ProcessGroup& pg) { gpt_group_parity(pg, which); });
}

INSTANTIATE_TEST_SUITE_P(World, GroupParity,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(Opt::kFused, Opt::kFusedAten,
                                                              Opt::kTorch)),
                         [](const auto& info) {
                           return "w" + std::to_string(std::get<0>(info.param)) + "_" +
                                  opt_name(std::get<1>(info.param));
                         });

// One unit of 13 elements: a.weight (6), a.bias (3), b.weight (4). At 3 ranks the padded
// 15 split into shards of 5: rank 0 holds a.weight[0:5]; rank 1 a.weight[5], a.bias,
// b.weight[0]; rank 2 b.weight[1:4] and 2 padding elements.
class OddImpl : public torch::nn::Module {
 public:
  OddImpl()
      : a(register_module("a", torch::nn::Linear(2, 3))),
        b(register_module("b", torch::nn::Linear(torch::nn::LinearOptions(2, 2).bias(false)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(a(x).narrow(-1, 0, 2)).sum(); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Odd);

TEST(ParamGroups, SegmentsFollowShardBoundariesAndGroups) {
  run_ranks(3, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    torch::manual_seed(0);
    auto model = fully_shard(Odd(), o);
    ShardParamGroups groups(model, no_decay_groups(0.5));
    const auto& segs = groups.segments();
    std::ostringstream got;
    for (const auto& s : segs) {
      got << "[" << s.begin << "+" << s.numel << " g" << s.group;
      for (const auto& f : s.fqns) got << " " << f;
      got << "]";
    }
    const char* want[] = {"[0+5 g0 a.weight]", "[0+1 g0 a.weight][1+3 g1 a.bias][4+1 g0 b.weight]",
                          "[0+3 g0 b.weight]"};
    EXPECT_EQ(got.str(), want[pg.rank()]) << "rank " << pg.rank();
    EXPECT_EQ(groups.group_numel(0), 10);
    EXPECT_EQ(groups.group_numel(1), 3);
    const int64_t local1[] = {0, 3, 0};
    EXPECT_EQ(groups.local_group_numel(1), local1[pg.rank()]);
    // Each view is its range of the shard.
    const auto shard = model.sharded_parameters().at(0);
    for (const auto& s : segs) {
      EXPECT_TRUE(s.view.is_alias_of(shard));
      EXPECT_EQ(s.view.storage_offset() - shard.storage_offset(), s.begin);
      EXPECT_TRUE(s.view.is_leaf() && s.view.requires_grad());
    }
    // Gradients: after a backward each view's .grad() is its range of the gradient shard;
    // a second backward accumulates; zero_grad() on the views (set to none) makes the next
    // backward start from zero.
    auto x = torch::ones({4, 2});
    model(x).backward();
    const auto g1 = shard.grad().clone();
    for (const auto& s : segs) {
      ASSERT_TRUE(s.view.grad().defined());
      EXPECT_TRUE(torch::equal(s.view.grad(), g1.narrow(0, s.begin, s.numel)));
    }
    model(x).backward();
    for (const auto& s : segs)
      EXPECT_TRUE(torch::allclose(s.view.grad(), 2 * g1.narrow(0, s.begin, s.numel)));
    torch::optim::SGD sgd(groups.param_groups(torch::optim::SGDOptions(0.0)),
                          torch::optim::SGDOptions(0.0));
    sgd.zero_grad();
    if (!segs.empty()) EXPECT_FALSE(segs.front().view.grad().defined());
    model(x).backward();
    for (const auto& s : segs)
      EXPECT_TRUE(torch::equal(s.view.grad(), g1.narrow(0, s.begin, s.numel)));
    // An SGD step through the views moves the shard: lr 1, no decay on a.bias.
    const auto before = shard.detach().clone();
    torch::optim::SGD step_opt(groups.param_groups(torch::optim::SGDOptions(1.0)),
                               torch::optim::SGDOptions(1.0));
    step_opt.step();
    auto moved = before - shard.detach();
    for (const auto& s : segs) {
      const double decay = s.group == 0 ? 0.5 : 0.0;
      auto want_move = g1.narrow(0, s.begin, s.numel) + decay * before.narrow(0, s.begin, s.numel);
      EXPECT_TRUE(torch::allclose(moved.narrow(0, s.begin, s.numel), want_move, 1e-6, 1e-6));
    }
    // Padding is no optimizer's: it stays zero.
    if (pg.rank() == 2) EXPECT_EQ(shard.detach().narrow(0, 3, 2).abs().sum().item<float>(), 0.f);
  });
}

// With cpu_offload the gradient shard arrives through the host transfers (added when it
// lands), and with gradient accumulation over two micro-batches it is added to in place:
// the views follow both. Training equals training without offload bit for bit, and the
// same training on whole batches (one backward a step) within the parity tolerances (a
// step that saw only one micro-batch's gradient would be off by ~1e-3).
TEST(ParamGroups, ViewsFollowOffloadAndGradientAccumulation) {
  run_ranks(2, [](const ProcessGroup& pg) {
    std::vector<double> losses[3];
    std::vector<std::pair<std::string, torch::Tensor>> weights[3];
    for (int run = 0; run < 3; ++run) {  // 0: accumulate, 1: and offload, 2: whole batches
      ShardingOptions o;
      o.process_group = pg;
      o.offload_optimizer.device = o.offload_param.device =
          run == 1 ? fsdp::OffloadDevice::kCpu : fsdp::OffloadDevice::kNone;
      torch::manual_seed(0);
      auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
      ShardParamGroups groups(model, gpt_spec());
      torch::optim::AdamW opt(groups.param_groups(group_adamw()), group_adamw());
      const int micros = run == 2 ? 1 : 2;
      for (int step = 0; step < 4; ++step) {
        auto batch = my_rows(gpt_batch(step, kGroupRows, small_gpt_config().block_size), pg);
        const int64_t rows = batch.size(0) / micros;
        double sum = 0;
        for (int micro = 0; micro < micros; ++micro) {
          auto loss = gpt::loss_on(model, batch.narrow(0, micro * rows, rows)) / micros;
          loss.backward();
          sum += global_mean(loss, pg);
        }
        opt.step();
        opt.zero_grad();
        losses[run].push_back(sum);
      }
      weights[run] = full_state_dict(model);
    }
    for (size_t i = 0; i < losses[0].size(); ++i) {
      EXPECT_EQ(losses[1][i], losses[0][i]) << "step " << i;
      EXPECT_NEAR(losses[2][i], losses[0][i], kLossTol * losses[0][i]) << "step " << i;
    }
    ASSERT_EQ(weights[0].size(), weights[1].size());
    for (size_t i = 0; i < weights[0].size(); ++i) {
      const auto& [name, w] = weights[0][i];
      EXPECT_TRUE(torch::equal(weights[1][i].second, w)) << name;
      const double tol =
          name == "wte.weight" || name == "wpe.weight" ? 10 * kWeightTol : kWeightTol;
      EXPECT_LE(rel_diff(weights[2][i].second, w), tol) << name;
    }
  });
}

TEST(ParamGroups, BadSpecsAreNamed) {
  run_ranks(1, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(Odd(), o);
    ParamGroupSpec spec = no_decay_groups(0.1);
    spec.rule = [](const ParamInfo&) -> size_t { return 5; };
    try {
      ShardParamGroups g(model, spec);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace())
                    .find("the rule put parameter 'a.weight' in group 5 but the spec has 2 "
                          "groups (0 to 1)"),
                std::string::npos)
          << e.what_without_backtrace();
    }
    ShardParamGroups ok(model, no_decay_groups(0.1));
    try {
      ok.group_of("nope.weight");
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace())
                    .find("'nope.weight' is not a trainable parameter of the model"),
                std::string::npos);
    }
  });
}

// ---- checkpoints --------------------------------------------------------------------

std::string ckpt_dir() {
  std::string tmpl = "/tmp/fsdp_groups_XXXXXX";
  static const std::string dir =
      std::getenv("FSDP_GROUPS_DIR") ? std::getenv("FSDP_GROUPS_DIR") : mkdtemp(tmpl.data());
  setenv("FSDP_GROUPS_DIR", dir.c_str(), 1);
  return dir;
}

constexpr int kSaveAt = 4;
constexpr int kTotal = 8;

// Trains steps [from, to) and returns the global losses.
template <class Model>
std::vector<double> train(Model& model, torch::optim::Optimizer& opt, const ProcessGroup& pg,
                          int from, int to) {
  std::vector<double> out;
  for (int step = from; step < to; ++step) {
    auto loss = gpt::loss_on(
        model, my_rows(gpt_batch(step, kGroupRows, small_gpt_config().block_size), pg));
    loss.backward();
    opt.step();
    opt.zero_grad();
    out.push_back(global_mean(loss, pg));
  }
  return out;
}

// Saved at 2 ranks after 4 steps (group 2's lr changed by then, as a scheduler would),
// resumed at 1 and at 3 ranks with an optimizer built with other hyperparameters: the
// groups' hyperparameters come back, and the next 4 losses equal the uninterrupted run's.
class GroupResume : public ::testing::TestWithParam<int> {};

TEST_P(GroupResume, SavedAtTwoRanksResumesLikeTheUninterruptedRun) {
  const std::string dir = ckpt_dir() + "/w" + std::to_string(GetParam());
  run_ranks(2, [&](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
    ShardParamGroups groups(model, gpt_spec());
    FusedAdamW opt(groups, group_adamw());
    train(model, opt, pg, 0, kSaveAt);
    opt.param_groups()[2].options().set_lr(7e-3);
    ckpt::TrainingState st;
    st.step = kSaveAt;
    ckpt::save_sharded_checkpoint(dir, model, &opt, st);
    auto rest = train(model, opt, pg, kSaveAt, kTotal);
    if (pg.rank() == 0) {
      std::ofstream f(dir + "/losses.txt");
      f.precision(17);
      for (double l : rest) f << l << "\n";
    }
  });
  run_ranks(GetParam(), [&](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    torch::manual_seed(1);  // other weights: the checkpoint must replace them
    auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
    ShardParamGroups groups(model, gpt_spec());
    // torch's AdamW over the views at 1 rank, FusedAdamW at 3: the state is AdamW's.
    std::unique_ptr<torch::optim::AdamW> opt =
        make_optimizer(pg.size() == 1 ? Opt::kTorch : Opt::kFused, groups,
                       torch::optim::AdamWOptions(1.0).weight_decay(0.9).eps(1e-3));
    ckpt::load_sharded_checkpoint(dir, model, opt.get(), nullptr);
    auto opts = [&](size_t g) {
      return static_cast<torch::optim::AdamWOptions&>(opt->param_groups()[g].options());
    };
    EXPECT_DOUBLE_EQ(opts(0).lr(), 1e-3);
    EXPECT_DOUBLE_EQ(opts(0).weight_decay(), 0.1);
    EXPECT_DOUBLE_EQ(opts(1).weight_decay(), 0.0);
    EXPECT_DOUBLE_EQ(opts(2).lr(), 7e-3);
    EXPECT_DOUBLE_EQ(opts(2).eps(), 1e-6);
    for (size_t g = 0; g < 3; ++g) {
      for (const auto& p : opt->param_groups()[g].params()) {
        auto& s = static_cast<torch::optim::AdamWParamState&>(
            *opt->state().at(fsdp::detail::optim_state_key(opt->state(), p)));
        EXPECT_EQ(s.step(), kSaveAt);
      }
    }
    auto rest = train(model, *opt, pg, kSaveAt, kTotal);
    std::ifstream f(dir + "/losses.txt");
    for (size_t i = 0; i < rest.size(); ++i) {
      double want = 0;
      ASSERT_TRUE(static_cast<bool>(f >> want));
      EXPECT_NEAR(rest[i], want, kLossTol * std::abs(want)) << "step " << kSaveAt + i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(World, GroupResume, ::testing::Values(1, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

}  // namespace

}  // namespace test_param_groups_cases
