// Asynchronous sharded saves (Note [Asynchronous saves]): the state of the call while
// training goes on, staging reuse, and failures while staging, writing or publishing,
// each reported on every rank.
#include <fsdp/checkpoint.h>
#include <fsdp/fused_adamw.h>

#include "support/checkpoint_helpers.h"
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>
#include "../src/internal/sharded_model.h"  // flat-parameter internals the assertions read

namespace fs = std::filesystem;
using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_async_cases {

namespace {

// ---------------------------------------------------------------------------------
// Asynchronous saves (Note [Asynchronous saves]).

// The error of the synchronous save of step 3 that follows the failed asynchronous save
// of step 2, checked to name that save.
std::string next_save_error(const std::string& dir, const ShardedModel& model) {
  const std::string next =
      error_of([&] { ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(3)); });
  EXPECT_NE(next.find("the asynchronous save of " + dir + "/step_00000002 failed"),
            std::string::npos)
      << next;
  return next;
}

// What the async save of step 3 must hold: the state at the call, though training goes
// on before the save is waited for. Rank r's flat shards and AdamW moments are staged,
// and rank 0's buffers: checkpoint_staging counts exactly those bytes until the wait.
void async_save_and_resume(const ProcessGroup& pg, const std::string& dir,
                           bool background_staging = false) {
  const auto cfg = small_gpt_config();
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(cfg), options_for(pg));
  auto opt = make_adamw(model);
  for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, pg);
  torch::manual_seed(42 + pg.rank());
  int64_t expected_staging = 0;
  for (const auto& ls : fsdp::detail::local_shards(model)) {
    const int64_t length = ls.writer ? ls.length : 0;
    expected_staging +=
        4 * length * (1 + (ls.info.requires_grad ? 2 : 0));  // param, exp_avg, exp_avg_sq
  }
  if (pg.rank() == 0) {
    for (const auto& b : model.as_module().buffers())
      expected_staging += static_cast<int64_t>(b.nbytes());
  }
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, 0);
  ckpt::SaveOptions so;
  so.background_staging = background_staging;
  ckpt::AsyncSave pending =
      ckpt::save_sharded_checkpoint_async(dir, model, &opt, sample_state(3), so);
  EXPECT_EQ(pending.path(), dir + "/step_00000003");
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, expected_staging);
  const auto rng_after_save = torch::rand({4});
  std::vector<double> uninterrupted;
  // Training changes every shard and moment while the thread may still be writing.
  for (int64_t s = 3; s < 6; ++s) uninterrupted.push_back(train_step(model, opt, s, pg));
  EXPECT_EQ(pending.wait(), dir + "/step_00000003");
  EXPECT_TRUE(pending.done());
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, expected_staging)
      << "kept for the next save";
  EXPECT_EQ(model.memory_stats().checkpoint_staging.peak, expected_staging);
  ckpt::release_checkpoint_staging(model);
  EXPECT_EQ(model.memory_stats().checkpoint_staging.current, 0);
  EXPECT_TRUE(fsdp::detail::checkpoint_staging_pool(model).empty());
  pg.barrier();  // rank 0's wait() returns once published; the others' once written
  EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000003");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir + "/step_00000003"))
    names.push_back(e.path().filename().string());
  EXPECT_EQ(names.size(), static_cast<size_t>(pg.size())) << "markers left in the checkpoint";

  torch::manual_seed(7);
  auto model2 = fully_shard(gpt::GPT(cfg), options_for(pg));
  torch::optim::AdamW opt2(model2.sharded_parameters(), torch::optim::AdamWOptions(1.0).eps(1e-6));
  ckpt::TrainingState st;
  torch::manual_seed(999);
  ckpt::load_sharded_checkpoint(dir, model2, &opt2, &st);
  EXPECT_TRUE(torch::equal(torch::rand({4}), rng_after_save))
      << "the RNG state of the call was not saved";
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.extra, sample_state(3).extra);
  for (int64_t s = 3; s < 6; ++s) {
    EXPECT_EQ(train_step(model2, opt2, s, pg), uninterrupted[static_cast<size_t>(s - 3)])
        << "step " << s << " differs after resuming from the asynchronous save";
  }
}

TEST(AsyncCheckpoint, SavesTheStateOfTheCallWhileTrainingGoesOnAtTwoRanks) {
  const std::string dir = scratch_dir("async");
  run_ranks(2, [&](const ProcessGroup& pg) { async_save_and_resume(pg, dir); });
}

// Note [Background staging]: the same, with the shards and moments copied by the thread
// while the next forward and backward run. The staging memory is still taken in the call.
TEST(AsyncCheckpoint, BackgroundStagingSavesTheStateOfTheCallAtTwoRanks) {
  const std::string dir = scratch_dir("async_bg");
  run_ranks(2, [&](const ProcessGroup& pg) { async_save_and_resume(pg, dir, true); });
}

// Note [Background staging]: the end of the backward waits for the copy. The thread is
// held until the forward has run and then for 200 ms more, so without the wait the
// optimizer step after this small model's backward would change the shards before the
// copy, and the save would fail (the version check) or hold them changed. With it, the
// save succeeds and holds the state of the call, and the time waited (0 when the
// backward was slower than the copy) is within the backward's.
TEST(AsyncCheckpoint, TheEndOfABackwardWaitsForTheBackgroundCopy) {
  const std::string dir = scratch_dir("async_bg_wait");
  run_ranks(2, [&](const ProcessGroup& pg) {
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    auto opt = make_adamw(model);
    train_step(model, opt, 0, pg);
    std::vector<at::Tensor> at_call;
    for (const auto& ls : fsdp::detail::local_shards(model)) at_call.push_back(ls.shard.clone());
    std::atomic<bool> forward_done{false};
    fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string&) {
      if (step == "background stage") {
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!forward_done && std::chrono::steady_clock::now() < give_up)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
    ckpt::SaveOptions so;
    so.background_staging = true;
    ckpt::AsyncSave pending =
        ckpt::save_sharded_checkpoint_async(dir, model, &opt, sample_state(1), so);
    auto batch = gpt_batch(1, kRows, small_gpt_config().block_size);
    opt.zero_grad();
    auto loss = gpt::loss_on(model, my_rows(batch, pg));
    forward_done = true;
    const auto t0 = std::chrono::steady_clock::now();
    loss.backward();
    const double backward_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(pending.staging_wait_s(), 0.0);
    EXPECT_LE(pending.staging_wait_s(), backward_s);
    opt.step();
    EXPECT_EQ(pending.wait(), dir + "/step_00000001");
    fsdp::detail::set_save_hook(model, {});
    pg.barrier();

    torch::manual_seed(7);
    auto model2 = fully_shard(gpt::GPT(small_gpt_config()), options_for(pg));
    auto opt2 = make_adamw(model2);
    ckpt::load_sharded_checkpoint(dir, model2, &opt2);
    const auto loaded = fsdp::detail::local_shards(model2);
    const auto stepped = fsdp::detail::local_shards(model);
    ASSERT_EQ(loaded.size(), at_call.size());
    for (size_t i = 0; i < loaded.size(); ++i) {
      EXPECT_TRUE(torch::equal(loaded[i].shard, at_call[i])) << "flat " << i;
      if (stepped[i].info.requires_grad && stepped[i].length > 0)
        EXPECT_FALSE(torch::equal(stepped[i].shard, at_call[i])) << "the step changed flat " << i;
    }
  });
}

// Note [Background staging]: a shard changed by hand before the copy (no backward in
// between, no wait_staged) fails the save on its rank, naming the tensor; the other rank's
// file is written, `latest` stays, and the next save says so on both. The same edit after
// wait_staged() is allowed: that save holds the state of its call.
TEST(AsyncCheckpoint, AChangeBeforeTheBackgroundCopyFailsTheSaveNamingTheTensor) {
  const std::string dir = scratch_dir("async_bg_change");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    ckpt::SaveOptions so;
    so.background_staging = true;
    const at::Tensor shard = fsdp::detail::local_shards(model).at(0).shard;
    const at::Tensor at_call = shard.clone();
    ckpt::AsyncSave first =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(1), so);
    first.wait_staged();
    {
      at::NoGradGuard no_grad;
      shard.add_(1.0);
    }
    EXPECT_EQ(first.wait(), dir + "/step_00000001");
    pg.barrier();
    {
      auto again = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
      ckpt::load_sharded_checkpoint(dir, again);
      EXPECT_TRUE(torch::equal(fsdp::detail::local_shards(again).at(0).shard, at_call));
    }

    std::atomic<bool> changed{false};
    fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string&) {
      while (step == "background stage" && pg.rank() == 1 && !changed)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    ckpt::AsyncSave second =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2), so);
    if (pg.rank() == 1) {
      at::NoGradGuard no_grad;
      shard.mul_(2.0);
    }
    changed = true;
    const std::string waited = error_of([&] { second.wait(); });
    fsdp::detail::set_save_hook(model, {});
    const std::string file1 = dir + "/.tmp-step_00000002/rank_00001.h5";
    const std::string unit = fsdp::detail::local_shards(model).at(0).info.unit_fqn;
    const std::string whose =
        unit.empty() ? "the root's shard" : "the shard of unit '" + unit + "'";
    EXPECT_NE(waited.find("staging " + file1 + " failed: " + whose +
                          " (flats/00000/param) changed after the asynchronous save's call, "
                          "before its background copy was done"),
              std::string::npos)
        << waited;
    EXPECT_NE(waited.find("call it before an optimizer step"), std::string::npos) << waited;
    pg.barrier();
    EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000001");
    next_save_error(dir, model);
    pg.barrier();
    EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000001");
    EXPECT_EQ(ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(3)),
              dir + "/step_00000003");
  });
}

// Note [Background staging]: FusedAdamW::step waits for the background copy by itself,
// with no backward before it (gradients set by hand). The thread is held for 200 ms
// before it copies; the step, called at once, must not change a shard before the copy
// (the save would fail its version check), and the checkpoint holds the state of the call.
TEST(AsyncCheckpoint, AFusedAdamWStepWaitsForTheBackgroundCopyWithoutABackward) {
  const std::string dir = scratch_dir("async_bg_fused");
  run_ranks(1, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    FusedAdamW opt(model, torch::optim::AdamWOptions(0.1));
    for (auto& p : model.sharded_parameters()) p.mutable_grad() = torch::ones_like(p);
    std::vector<at::Tensor> at_call;
    for (const auto& ls : fsdp::detail::local_shards(model)) at_call.push_back(ls.shard.clone());
    fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string&) {
      if (step == "background stage") std::this_thread::sleep_for(std::chrono::milliseconds(200));
    });
    ckpt::SaveOptions so;
    so.background_staging = true;
    ckpt::AsyncSave pending =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(1), so);
    opt.step();
    EXPECT_EQ(pending.wait(), dir + "/step_00000001");
    fsdp::detail::set_save_hook(model, {});
    auto again = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    ckpt::load_sharded_checkpoint(dir, again);
    const auto loaded = fsdp::detail::local_shards(again);
    const auto stepped = fsdp::detail::local_shards(model);
    for (size_t i = 0; i < loaded.size(); ++i) {
      EXPECT_TRUE(torch::equal(loaded[i].shard, at_call[i])) << "flat " << i;
      EXPECT_FALSE(torch::equal(stepped[i].shard, at_call[i])) << "the step changed flat " << i;
    }
  });
}

// Note [Staging reuse]: the second save copies into the first one's buffers (the same
// memory, so the counter never holds two snapshots) and still writes its own step's
// values; buffers a save no longer needs are freed; keep_staging = false and
// release_checkpoint_staging give the memory back.
TEST(AsyncCheckpoint, StagingBuffersAreReusedByTheNextSaveAndReleasedOnRequest) {
  const std::string dir = scratch_dir("async_reuse");
  run_ranks(2, [&](const ProcessGroup& pg) {
    const auto cfg = small_gpt_config();
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(cfg), options_for(pg));
    auto opt = make_adamw(model);
    train_step(model, opt, 0, pg);
    int64_t param_bytes = 0, optim_bytes = 0;
    for (const auto& ls : fsdp::detail::local_shards(model)) {
      const int64_t length = ls.writer ? ls.length : 0;
      param_bytes += 4 * length;
      if (ls.info.requires_grad) optim_bytes += 2 * 4 * length;  // exp_avg, exp_avg_sq
    }
    if (pg.rank() == 0) {
      for (const auto& b : model.as_module().buffers())
        param_bytes += static_cast<int64_t>(b.nbytes());
    }
    auto stats = [&] { return model.memory_stats().checkpoint_staging; };
    auto addresses = [&] {
      std::map<std::string, const void*> a;
      for (const auto& [key, t] : fsdp::detail::checkpoint_staging_pool(model))
        a[key] = t.data_ptr();
      return a;
    };

    // Without the optimizer: parameters (and rank 0's buffers) only.
    ckpt::AsyncSave first =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(1));
    first.wait();
    EXPECT_EQ(stats().current, param_bytes);
    const auto kept = addresses();
    EXPECT_FALSE(kept.empty());

    // With it: the parameters' buffers are reused, the moments' are new.
    train_step(model, opt, 1, pg);
    std::vector<torch::Tensor> expected;
    for (const auto& ls : fsdp::detail::local_shards(model))
      expected.push_back(ls.shard.narrow(0, 0, ls.length).clone());
    ckpt::AsyncSave second = ckpt::save_sharded_checkpoint_async(dir, model, &opt, sample_state(2));
    EXPECT_EQ(stats().current, param_bytes + optim_bytes);
    EXPECT_EQ(stats().peak, param_bytes + optim_bytes)
        << "the first save's buffers were not reused";
    train_step(model, opt, 2, pg);  // changes every shard while the second save may write
    second.wait();
    const auto now = addresses();
    for (const auto& [key, ptr] : kept) {
      ASSERT_TRUE(now.count(key)) << key;
      EXPECT_EQ(now.at(key), ptr) << key << " was allocated afresh";
    }
    EXPECT_GT(now.size(), kept.size());

    // The reused buffers held the second save's values.
    pg.barrier();
    torch::manual_seed(5);
    auto model2 = fully_shard(gpt::GPT(cfg), options_for(pg));
    ckpt::load_sharded_checkpoint(dir, model2, nullptr, nullptr);
    const auto loaded = fsdp::detail::local_shards(model2);
    ASSERT_EQ(loaded.size(), expected.size());
    for (size_t k = 0; k < expected.size(); ++k) {
      EXPECT_TRUE(torch::equal(loaded[k].shard.narrow(0, 0, loaded[k].length), expected[k])) << k;
    }

    // Without the optimizer again: its moments' buffers are freed.
    ckpt::AsyncSave third =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(3));
    third.wait();
    EXPECT_EQ(stats().current, param_bytes);

    ckpt::SaveOptions no_keep;
    no_keep.keep_staging = false;
    ckpt::AsyncSave fourth =
        ckpt::save_sharded_checkpoint_async(dir, model, &opt, sample_state(4), no_keep);
    EXPECT_EQ(stats().current, param_bytes + optim_bytes);
    fourth.wait();
    EXPECT_EQ(stats().current, 0);
    EXPECT_TRUE(fsdp::detail::checkpoint_staging_pool(model).empty());

    ckpt::AsyncSave fifth = ckpt::save_sharded_checkpoint_async(dir, model, &opt, sample_state(5));
    fifth.wait();
    EXPECT_EQ(stats().current, param_bytes + optim_bytes);
    ckpt::release_checkpoint_staging(model);
    EXPECT_EQ(stats().current, 0);
    EXPECT_TRUE(fsdp::detail::checkpoint_staging_pool(model).empty());
  });
}

TEST(AsyncCheckpoint, AnEmptyHandleHoldsNoSave) {
  ckpt::AsyncSave none;
  EXPECT_TRUE(none.done());
  EXPECT_EQ(none.path(), "");
  const std::string msg = error_of([&] { none.wait(); });
  EXPECT_NE(msg.find("AsyncSave::wait: this handle holds no save"), std::string::npos) << msg;
}

TEST(AsyncCheckpoint, SavesTheStateOfTheCallWhileTrainingGoesOnAtOneRank) {
  const std::string dir = scratch_dir("async");
  run_ranks(1, [&](const ProcessGroup& pg) { async_save_and_resume(pg, dir); });
}

// A write that fails in the background (a full disk, injected on rank 1): wait() says so
// on each rank, `latest` stays at the previous checkpoint, the next save throws on every
// rank naming the file and saves nothing, and the save after it works.
TEST(AsyncCheckpoint, ABackgroundFailureIsReportedByTheNextSaveOnEveryRank) {
  const std::string dir = scratch_dir("async_fail");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(1));
    fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string& file) {
      if (step == "write" && pg.rank() == 1)
        throw std::runtime_error("No space left on device (injected)");
      (void)file;
    });
    ckpt::AsyncSave pending =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2));
    const std::string waited = error_of([&] { pending.wait(); });
    const std::string file1 = dir + "/.tmp-step_00000002/rank_00001.h5";
    EXPECT_NE(waited.find("the asynchronous save of " + dir + "/step_00000002 failed"),
              std::string::npos)
        << waited;
    EXPECT_NE(waited.find("writing " + file1 + " failed: No space left on device (injected)"),
              std::string::npos)
        << waited;
    if (pg.rank() == 0) EXPECT_NE(waited.find("rank 1: "), std::string::npos) << waited;
    fsdp::detail::set_save_hook(model, {});
    pg.barrier();
    EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000001");
    EXPECT_FALSE(fs::exists(dir + "/step_00000002"));
    EXPECT_GT(model.memory_stats().checkpoint_staging.current, 0);
    EXPECT_EQ(model.memory_stats().checkpoint_staging.current,
              model.memory_stats().checkpoint_staging.peak);

    const std::string next =
        error_of([&] { ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(3)); });
    EXPECT_NE(next.find("save_sharded_checkpoint: the asynchronous save of " + dir +
                        "/step_00000002 failed"),
              std::string::npos)
        << next;
    EXPECT_NE(next.find("this call saved nothing"), std::string::npos) << next;
    pg.barrier();
    EXPECT_FALSE(fs::exists(dir + "/step_00000003"));
    EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000001");

    ckpt::AsyncSave again =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(3));
    EXPECT_EQ(again.wait(), dir + "/step_00000003");
    pg.barrier();
    EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000003");
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
    std::sort(left.begin(), left.end());
    EXPECT_EQ(left, (std::vector<std::string>{"latest", "step_00000001", "step_00000003"}));
  });
}

// Rank 1's background write stalls (its thread holds back until rank 0 has given up):
// rank 0's thread waits the process group's timeout (3 s here) without the files growing,
// says so naming the directory and the count, and removes the temporary directory; rank
// 1's write then fails; the next save throws on both and `latest` stays.
TEST(AsyncCheckpoint, RankZeroGivesUpOnAStalledRankAfterTheTimeout) {
  const std::string dir = scratch_dir("async_stall");
  const std::string tmp = dir + "/.tmp-step_00000002";
  run_ranks(
      2,
      [&](const ProcessGroup& pg) {
        ASSERT_EQ(pg.timeout_s(), 3.0);
        auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
        ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(1));
        fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string& file) {
          if (step != "write" || pg.rank() != 1) return;
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (fs::exists(tmp) && std::chrono::steady_clock::now() < give_up) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
          (void)file;
        });
        const auto t0 = std::chrono::steady_clock::now();
        ckpt::AsyncSave pending =
            ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2));
        const std::string waited = error_of([&] { pending.wait(); });
        const double waited_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (pg.rank() == 0) {
          EXPECT_NE(waited.find("waited 3 s (the process group's timeout, FSDP_TIMEOUT_S) for the "
                                "other ranks' files in " +
                                tmp + " without progress: 1 of 2 complete"),
                    std::string::npos)
              << waited;
          EXPECT_GE(waited_s, 3.0);
          EXPECT_LT(waited_s, 20.0);
        } else {
          EXPECT_NE(waited.find("writing " + tmp + "/rank_00001.h5 failed"), std::string::npos)
              << waited;
        }
        EXPECT_FALSE(fs::exists(tmp));
        fsdp::detail::set_save_hook(model, {});
        next_save_error(dir, model);
        pg.barrier();
        EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000001");
        EXPECT_FALSE(fs::exists(dir + "/step_00000002"));
      },
      300, {"FSDP_TIMEOUT_S=3"});
}

// Staging fails on rank 1 halfway (out of host memory, injected at its second flat, with
// the last save's buffers in hand): the call throws on both ranks before either goes on
// training, nothing is written, and rank 1 holds no staging memory afterwards (what it
// had staged and what it kept are both freed and uncounted). The next save works.
TEST(AsyncCheckpoint, AFailureWhileStagingFailsTheCallEverywhere) {
  const std::string dir = scratch_dir("async_stage");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(1)).wait();
    const int64_t snapshot_bytes = model.memory_stats().checkpoint_staging.current;
    ASSERT_GT(snapshot_bytes, 0);
    int staged = 0;
    fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string&) {
      if (step == "stage" && pg.rank() == 1 && ++staged == 2)
        throw std::runtime_error("out of host memory (injected)");
    });
    const std::string msg = error_of(
        [&] { (void)ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2)); });
    fsdp::detail::set_save_hook(model, {});
    EXPECT_NE(msg.find("save_sharded_checkpoint_async to " + dir + " failed"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find(pg.rank() == 1 ? "out of host memory (injected)"
                                      : "on another rank (see its error)"),
              std::string::npos)
        << msg;
    EXPECT_EQ(model.memory_stats().checkpoint_staging.current, pg.rank() == 1 ? 0 : snapshot_bytes);
    EXPECT_EQ(model.memory_stats().checkpoint_staging.peak, snapshot_bytes);
    pg.barrier();
    EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000001");
    EXPECT_FALSE(fs::exists(dir + "/.tmp-step_00000002"));
    pg.barrier();  // both have looked before the next save makes that directory again
    EXPECT_EQ(ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2)).wait(),
              dir + "/step_00000002");
    EXPECT_EQ(model.memory_stats().checkpoint_staging.current, snapshot_bytes);
  });
}

// Publishing fails on rank 0 (the rename or `latest`, injected): rank 0's wait() names
// the directory; rank 1, whose file was written, learns it at the next save, which throws
// on both; nothing of the save is left and `latest` stays.
TEST(AsyncCheckpoint, AFailedPublishLeavesLatestAndIsReportedEverywhere) {
  const std::string dir = scratch_dir("async_publish");
  run_ranks(2, [&](const ProcessGroup& pg) {
    auto model = fully_shard(MlpNet(16, 64, 2, 16), options_for(pg));
    ckpt::save_sharded_checkpoint(dir, model, nullptr, sample_state(1));
    fsdp::detail::set_save_hook(model, [&](const std::string& step, const std::string& what) {
      if (step == "publish" && what == dir + "/step_00000002")
        throw std::runtime_error("rename: Input/output error (injected)");
    });
    ckpt::AsyncSave pending =
        ckpt::save_sharded_checkpoint_async(dir, model, nullptr, sample_state(2));
    if (pg.rank() == 0) {
      const std::string waited = error_of([&] { pending.wait(); });
      EXPECT_NE(waited.find("publishing " + dir +
                            "/step_00000002 failed: rename: Input/output error (injected)"),
                std::string::npos)
          << waited;
      EXPECT_FALSE(fs::exists(dir + "/.tmp-step_00000002"));
    } else {
      EXPECT_EQ(pending.wait(), dir + "/step_00000002");  // its own file is on disk
    }
    fsdp::detail::set_save_hook(model, {});
    const std::string next = next_save_error(dir, model);
    if (pg.rank() == 1)
      EXPECT_NE(next.find("on another rank (see its error)"), std::string::npos) << next;
    pg.barrier();
    EXPECT_EQ(*ckpt::latest_checkpoint(dir), dir + "/step_00000001");
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
    std::sort(left.begin(), left.end());
    EXPECT_EQ(left, (std::vector<std::string>{"latest", "step_00000001"}));
  });
}

}  // namespace

}  // namespace test_checkpoint_async_cases
