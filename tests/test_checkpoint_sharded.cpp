// Sharded checkpoints: exact resume, resharding across world sizes, wrap policies,
// strategies and optimizers, retention and names, and rank 0's failures agreed by every
// rank.
#include <fsdp/checkpoint.h>
#include <fsdp/full_params.h>

#include "support/checkpoint_helpers.h"
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include "../src/internal/sharded_model.h"  // set_save_hook

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_sharded_cases {

namespace {

void write_losses(const std::string& path, const std::vector<double>& losses) {
  std::ofstream out(path);
  out.precision(17);
  for (double l : losses) out << l << "\n";
}

std::vector<double> read_losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> v;
  for (double l; in >> l;) v.push_back(l);
  return v;
}

// ---------------------------------------------------------------------------------
// Exact resume: the loss trajectory after loading equals the uninterrupted one, bit for bit.

void exact_resume(const ProcessGroup& pg, const std::string& dir) {
  const auto cfg = small_gpt_config();
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(cfg), options_for(pg));
  auto opt = make_adamw(model);
  for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
  torch::manual_seed(42 + pg.rank());  // a per-rank RNG stream to restore
  const std::string path = ckpt::save_sharded_checkpoint(dir, model, &opt, sample_state(3));
  EXPECT_EQ(fs::path(path).filename().string(), "step_00000003");
  const auto rng_after_save = torch::rand({4});
  std::vector<double> uninterrupted;
  for (int64_t s = 3; s < 6; ++s) uninterrupted.push_back(train_step(model, opt, s, pg));

  // A fresh model, differently initialised, with another learning rate: the load
  // must restore all of it.
  torch::manual_seed(7);
  auto model2 = fully_shard(gpt::GPT(cfg), options_for(pg));
  torch::optim::AdamW opt2(model2.sharded_parameters(), torch::optim::AdamWOptions(1.0).eps(1e-6));
  ckpt::TrainingState st;
  torch::manual_seed(999);
  auto report = ckpt::load_sharded_checkpoint(dir, model2, &opt2, &st);
  EXPECT_EQ(report.path, path);
  EXPECT_TRUE(report.missing.empty() && report.unexpected.empty());
  EXPECT_TRUE(torch::equal(torch::rand({4}), rng_after_save))
      << "the CPU RNG state was not restored";
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.scheduler, sample_state(3).scheduler);
  EXPECT_EQ(st.extra, sample_state(3).extra);
  ASSERT_TRUE(st.loss_scaler.has_value());
  EXPECT_EQ(st.loss_scaler->scale, 1024);
  EXPECT_EQ(st.loss_scaler->skipped_steps, 2);
  EXPECT_EQ(st.loss_scaler->hysteresis_left, 1);
  EXPECT_EQ(std::get<int64_t>(st.model_attrs.at("d_model")), cfg.d_model);
  EXPECT_EQ(static_cast<torch::optim::AdamWOptions&>(opt2.param_groups()[0].options()).lr(), 3e-3);
  for (int64_t s = 3; s < 6; ++s) {
    const double l = train_step(model2, opt2, s, pg);
    EXPECT_EQ(l, uninterrupted[static_cast<size_t>(s - 3)])
        << "step " << s << " differs after resume";
  }
}

TEST(ShardedCheckpoint, ExactResumeIsBitwiseAtTwoRanks) {
  const std::string dir = scratch_dir("resume");
  run_ranks(2, [&](const ProcessGroup& pg) { exact_resume(pg, dir); });
}
TEST(ShardedCheckpoint, ExactResumeIsBitwiseAtOneRank) {
  const std::string dir = scratch_dir("resume");
  run_ranks(1, [&](const ProcessGroup& pg) { exact_resume(pg, dir); });
}

// ---------------------------------------------------------------------------------
// Resharding: saved at 4 ranks, loaded at 1, 2 and 3, and under another wrap policy.

void save_at_four(const ProcessGroup& pg, const std::string& dir, const ShardingOptions& o) {
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  auto opt = make_adamw(model);
  for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
  ckpt::save_sharded_checkpoint(dir + "/sharded", model, &opt, sample_state(3));
  ckpt::export_consolidated(dir + "/full.h5", model, nullptr, sample_state(3));
  std::vector<double> cont;
  for (int64_t s = 3; s < 6; ++s) cont.push_back(train_step(model, opt, s, pg));
  if (pg.rank() == 0) write_losses(dir + "/losses.txt", cont);
}

void load_and_continue(const ProcessGroup& pg, const std::string& dir, const ShardingOptions& o) {
  torch::manual_seed(5);
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  auto opt = make_adamw(model);
  ckpt::TrainingState st;
  ckpt::load_sharded_checkpoint(dir + "/sharded", model, &opt, &st);
  EXPECT_EQ(st.step, 3);
  // The parameters are exactly the saved ones (the consolidated export of the same moment).
  torch::manual_seed(6);
  gpt::GPT plain(small_gpt_config());
  ckpt::load_consolidated(dir + "/full.h5", *plain);
  auto loaded = full_state_dict(model);
  for (const auto& [name, p] : named_parameters_clean(*plain)) {
    EXPECT_TRUE(torch::equal(as_map(loaded).at(name), p)) << name;
  }
  const auto expected = read_losses(dir + "/losses.txt");
  ASSERT_EQ(expected.size(), 3u);
  for (int64_t s = 3; s < 6; ++s) {
    const double l = train_step(model, opt, s, pg), want = expected[static_cast<size_t>(s - 3)];
    EXPECT_LE(std::abs(l - want) / std::abs(want), 1e-6)
        << "step " << s << ": " << l << " vs " << want;
  }
}

TEST(ShardedCheckpoint, SavedAtFourRanksLoadsAtOneTwoAndThree) {
  const std::string dir = scratch_dir("reshard");
  run_ranks(4, [&](const ProcessGroup& pg) { save_at_four(pg, dir, options_for(pg)); });
  for (int m : {1, 2, 3}) {
    SCOPED_TRACE("load at " + std::to_string(m) + " ranks");
    run_ranks(m, [&](const ProcessGroup& pg) { load_and_continue(pg, dir, options_for(pg)); });
  }
}

TEST(ShardedCheckpoint, LoadsUnderAnotherWrapPolicyAndStrategy) {
  const std::string dir = scratch_dir("policy");
  // Saved with every block its own unit, as HYBRID_SHARD (2 groups of 2: replicas write nothing).
  run_ranks(4, [&](const ProcessGroup& pg) {
    auto o = options_for(pg);
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_group_size = 2;
    save_at_four(pg, dir, o);
  });
  // Loaded with one unit for the whole model (other flat layout), and with blocks but
  // only every second one a unit, at other world sizes.
  run_ranks(3, [&](const ProcessGroup& pg) {
    load_and_continue(pg, dir, options_for(pg, wrap::never_wrap_policy()));
  });
  run_ranks(2, [&](const ProcessGroup& pg) {
    load_and_continue(pg, dir, options_for(pg, wrap::every_kth_policy(2)));
  });
}

TEST(ShardedCheckpoint, SgdMomentumStateReshardsFromTwoRanksToThree) {
  const std::string dir = scratch_dir("sgd");
  auto make_sgd = [](const ShardedModel& m) {
    return torch::optim::SGD(m.sharded_parameters(),
                             torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
  };
  run_ranks(2, [&](const ProcessGroup& pg) {
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    auto opt = make_sgd(model);
    for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
    ckpt::save_sharded_checkpoint(dir, model, &opt, sample_state(3));
    std::vector<double> cont;
    for (int64_t s = 3; s < 6; ++s) cont.push_back(train_step(model, opt, s, pg));
    if (pg.rank() == 0) write_losses(dir + "/losses.txt", cont);
  });
  run_ranks(3, [&](const ProcessGroup& pg) {
    torch::manual_seed(9);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    torch::optim::SGD opt(model.sharded_parameters(), torch::optim::SGDOptions(1.0));
    ckpt::load_sharded_checkpoint(dir, model, &opt, nullptr);
    const auto& o = static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options());
    EXPECT_EQ(o.momentum(), 0.9);
    EXPECT_EQ(o.lr(), 0.05);
    const auto want = read_losses(dir + "/losses.txt");
    ASSERT_EQ(want.size(), 3u);
    for (int64_t s = 3; s < 6; ++s) {
      const double l = train_step(model, opt, s, pg);
      EXPECT_LE(std::abs(l - want[static_cast<size_t>(s - 3)]) / want[static_cast<size_t>(s - 3)],
                1e-6)
          << "step " << s;
    }
    // An Adam optimizer cannot take SGD state.
    auto adam = make_adamw(model);
    const std::string msg =
        error_of([&] { ckpt::load_sharded_checkpoint(dir, model, &adam, nullptr); });
    EXPECT_NE(msg.find("holds sgd state but the optimizer is adamw"), std::string::npos) << msg;
  });
}

// ---------------------------------------------------------------------------------
// Retention and names.

TEST(ShardedCheckpoint, KeepsTheNewestKAndNeverOverwrites) {
  const std::string dir = scratch_dir("keep");
  auto model = fully_shard(MlpNet());
  ckpt::SaveOptions so;
  so.keep_last = 2;
  for (int64_t s : {1, 2, 3, 4})
    ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(s), so);
  const std::string again = ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(4), so);
  EXPECT_EQ(fs::path(again).filename().string(), "step_00000004_2");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000004", "step_00000004_2"}));
  EXPECT_EQ(*ckpt::latest_checkpoint(dir), again);
  EXPECT_FALSE(ckpt::latest_checkpoint(dir + "/step_00000004").has_value());
  const std::string msg =
      error_of([&] { ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(-1)); });
  EXPECT_NE(msg.find("step -1 is negative"), std::string::npos) << msg;
}

// The short calls a newcomer writes compile and do what the long ones do: the optimizer,
// the training state and the options default where the API allows a null or an empty one.
TEST(ShardedCheckpoint, TheShortCallsUseTheirDefaults) {
  const std::string dir = scratch_dir("defaults");
  torch::manual_seed(0);
  auto model = fully_shard(MlpNet());
  torch::optim::AdamW opt(model.sharded_parameters(), torch::optim::AdamWOptions(1e-2));
  const std::string weights_only = ckpt::save_sharded_checkpoint(dir, model);
  EXPECT_EQ(fs::path(weights_only).filename().string(), "step_00000000");
  const std::string with_opt = ckpt::save_sharded_checkpoint(dir, model, &opt);
  EXPECT_EQ(fs::path(with_opt).filename().string(), "step_00000000_2");
  ckpt::export_consolidated(dir + "/model.h5", model);
  ckpt::export_safetensors(dir + "/hf", model);
  const auto saved = full_state_dict(model);
  torch::manual_seed(1);
  auto other = fully_shard(MlpNet());
  torch::optim::AdamW opt2(other.sharded_parameters(), torch::optim::AdamWOptions(1e-2));
  EXPECT_EQ(ckpt::load_sharded_checkpoint(with_opt, other, &opt2).path, with_opt);
  const auto loaded = full_state_dict(other);
  ASSERT_EQ(loaded.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i)
    EXPECT_TRUE(torch::equal(loaded[i].second, saved[i].second)) << saved[i].first;
  EXPECT_TRUE(fs::exists(dir + "/model.h5"));
  EXPECT_TRUE(fs::exists(dir + "/hf/model.safetensors"));
  auto job = ckpt::save_sharded_checkpoint_async(dir, model);
  EXPECT_EQ(fs::path(job.wait()).filename().string(), "step_00000000_3");
  fs::remove_all(dir);
}

// The names before fsdp::ckpt, fsdp::stats and fsdp::wrap stay one release, deprecated
// (CHANGELOG.md): a program that wrote them still compiles, with a warning naming the new
// one, and saves, loads and counts the same.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(ShardedCheckpoint, TheNamesBeforeTheNamespacesStillSaveLoadAndCount) {
  const std::string dir = scratch_dir("old_names");
  ShardingOptions o;
  o.auto_wrap_policy = fsdp::any_policy(
      {fsdp::size_based_policy(1 << 30), fsdp::module_type_policy<torch::nn::SequentialImpl>()});
  torch::manual_seed(0);
  auto model = fully_shard(MlpNet(), o);
  // The root and the three hidden Sequentials: one flat shard each.
  EXPECT_EQ(model.sharded_parameters().size(), 4u);
  fsdp::TrainingState state;
  state.step = 5;
  state.extra["k"] = "v";
  fsdp::SaveOptions save_options;
  const std::string path = fsdp::save_sharded_checkpoint(dir, model, nullptr, state, save_options);
  EXPECT_EQ(fsdp::latest_checkpoint(dir).value_or(""), ckpt::latest_checkpoint(dir).value_or("-"));
  const auto saved = full_state_dict(model);

  torch::manual_seed(1);
  auto other = fully_shard(MlpNet(), o);
  fsdp::TrainingState loaded_state;
  const fsdp::LoadReport report =
      fsdp::load_sharded_checkpoint(path, other, nullptr, &loaded_state, fsdp::LoadOptions{});
  EXPECT_EQ(report.path, path);
  EXPECT_EQ(loaded_state.step, 5);
  EXPECT_EQ(loaded_state.extra.at("k"), "v");
  const auto loaded = full_state_dict(other);
  ASSERT_EQ(loaded.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i)
    EXPECT_TRUE(torch::equal(loaded[i].second, saved[i].second)) << saved[i].first;

  const fsdp::MemoryStats old_memory = other.memory_stats();
  const stats::MemoryStats memory = other.memory_stats();
  EXPECT_EQ(old_memory.sharded_params.current, memory.sharded_params.current);
  EXPECT_GT(memory.sharded_params.current, 0);
  EXPECT_EQ(fsdp::kCheckpointFormatVersion, ckpt::kCheckpointFormatVersion);
  fs::remove_all(dir);
}
#pragma GCC diagnostic pop

// Note [Agreed outcomes]: what rank 0 alone does in a synchronous save (prepare the
// directory, publish) fails on every rank alike, rank 0 naming the cause, the others
// pointing at it; nothing is left behind and `latest` stays.
TEST(ShardedCheckpoint, RankZeroFailuresFailTheSaveOnEveryRank) {
  const std::string dir = scratch_dir("rank0_fails");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    if (pg.rank() == 0) {
      fs::create_directories(dir);
      std::ofstream(dir + "/file") << "not a directory";
    }
    pg.barrier();
    std::string msg = error_of(
        [&] { ckpt::save_sharded_checkpoint(dir + "/file/ck", model, nullptr, sample_state(1)); });
    EXPECT_NE(msg.find("save_sharded_checkpoint: preparing " + dir + "/file/ck failed" +
                       (pg.rank() == 0 ? ": " : " on rank 0 (see its error)")),
              std::string::npos)
        << msg;

    ckpt::save_sharded_checkpoint(dir + "/ck", model, nullptr, sample_state(1));
    fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string&) {
      if (step == "publish") throw std::runtime_error("rename: Input/output error (injected)");
    });
    msg = error_of(
        [&] { ckpt::save_sharded_checkpoint(dir + "/ck", model, nullptr, sample_state(2)); });
    fsdp::detail::set_save_hook(model, {});
    const std::string head =
        "save_sharded_checkpoint: publishing " + dir + "/ck/step_00000002 failed";
    EXPECT_NE(msg.find(pg.rank() == 0 ? head + ": rename: Input/output error (injected)"
                                      : head + " on rank 0 (see its error)"),
              std::string::npos)
        << msg;
    pg.barrier();
    EXPECT_EQ(*ckpt::latest_checkpoint(dir + "/ck"), dir + "/ck/step_00000001");
  });
}

}  // namespace

}  // namespace test_checkpoint_sharded_cases
