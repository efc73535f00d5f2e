// Checkpoints of an NVMe-offloaded run (Note [NVMe optimizer state], Note [NVMe
// parameters]) are ordinary checkpoints: saved at world 2 with the optimizer state (and
// the parameters) in files, they load at world 1 without offload, and a checkpoint saved
// without offload loads into files at world 2; either way training goes on exactly as
// from the in-memory run's checkpoint.
#include <fsdp/fused_adamw.h>

#include "support/checkpoint_helpers.h"
#include "support/multirank.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_checkpoint_nvme_cases {

namespace {

ShardingOptions with_nvme(const ProcessGroup& pg, const std::string& dir) {
  ShardingOptions o = options_for(pg);
  o.offload_optimizer.device = OffloadDevice::kNvme;
  o.offload_optimizer.nvme_path = dir;
  o.offload_optimizer.buffer_bytes = 24 * 1024;  // several chunks per shard
  return o;
}

// Note [NVMe parameters]: the masters, gradients and 16-bit copies in files too.
ShardingOptions with_nvme_params(const ProcessGroup& pg, const std::string& dir) {
  ShardingOptions o = with_nvme(pg, dir);
  o.offload_param.device = OffloadDevice::kNvme;
  o.offload_param.nvme_path = dir;
  o.offload_optimizer.buffer_bytes =
      3 * (18 * 2048 + 6 * 4096);  // the smallest: several chunks per shard
  return o;
}

torch::optim::AdamWOptions adamw() {
  return torch::optim::AdamWOptions(3e-3).weight_decay(0.01).eps(1e-6);
}

// Loads `ckpt` into a model built with `o`, trains steps 3 and 4; the losses and the
// parameters after them.
std::pair<std::vector<double>, std::vector<std::pair<std::string, torch::Tensor>>> resume(
    const std::string& ckpt, const ShardingOptions& o) {
  torch::manual_seed(7);  // another initialisation: the load must overwrite it
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  FusedAdamW opt(model, adamw());
  ckpt::TrainingState st;
  ckpt::load_sharded_checkpoint(ckpt, model, &opt, &st);
  EXPECT_EQ(st.step, 3);
  std::vector<double> losses;
  for (int64_t s = 3; s < 5; ++s) losses.push_back(train_step(model, opt, s, o.process_group));
  return {losses, full_state_dict(model)};
}

// Trains steps 0-2 with a model built with `o` and saves under `dir`.
void train_and_save(const ShardingOptions& o, const std::string& dir) {
  torch::manual_seed(0);
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  FusedAdamW opt(model, adamw());
  for (int64_t s = 0; s < 3; ++s) train_step(model, opt, s, o.process_group);
  ckpt::TrainingState st;
  st.step = 3;
  ckpt::save_sharded_checkpoint(dir, model, &opt, st);
}

void expect_same(
    const std::pair<std::vector<double>, std::vector<std::pair<std::string, torch::Tensor>>>& a,
    const std::pair<std::vector<double>, std::vector<std::pair<std::string, torch::Tensor>>>& b) {
  ASSERT_EQ(a.first.size(), b.first.size());
  for (size_t i = 0; i < a.first.size(); ++i) EXPECT_EQ(a.first[i], b.first[i]) << "step " << 3 + i;
  ASSERT_EQ(a.second.size(), b.second.size());
  for (size_t i = 0; i < a.second.size(); ++i)
    EXPECT_TRUE(torch::equal(a.second[i].second, b.second[i].second)) << a.second[i].first;
}

}  // namespace

TEST(NvmeCheckpoint, SavedAtWorld2WithNvmeLoadsAtWorld1WithoutOffload) {
  const std::string nvme_ckpt = scratch_dir("nvme"), mem_ckpt = scratch_dir("mem"),
                    state_dir = scratch_dir("state");
  run_ranks(2, [&](const ProcessGroup& pg) {
    train_and_save(with_nvme(pg, state_dir), nvme_ckpt);
    train_and_save(options_for(pg), mem_ckpt);
  });
  // The saved optimizer state itself: the same bytes' worth of tensors in both.
  const auto from_nvme = resume(nvme_ckpt, options_for(ProcessGroup()));
  const auto from_mem = resume(mem_ckpt, options_for(ProcessGroup()));
  expect_same(from_nvme, from_mem);
  std::filesystem::remove_all(nvme_ckpt);
  std::filesystem::remove_all(mem_ckpt);
  std::filesystem::remove_all(state_dir);
}

TEST(NvmeCheckpoint, SavedWithoutOffloadLoadsIntoNvmeStateAtWorld2) {
  const std::string ckpt = scratch_dir("plain"), state_dir = scratch_dir("state");
  // In the test process only: code before run_ranks also runs in the rank processes.
  if (!is_rank_process()) train_and_save(options_for(ProcessGroup()), ckpt);
  run_ranks(2, [&](const ProcessGroup& pg) {
    const auto into_nvme = resume(ckpt, with_nvme(pg, state_dir));
    const auto into_mem = resume(ckpt, options_for(pg));
    expect_same(into_nvme, into_mem);
  });
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove_all(state_dir);
}

// Parameters in files (offload_param = nvme) save from the files and load into them:
// at world 2 into world 1 in memory, and from memory into files at world 2, training on
// exactly as the in-memory run's checkpoint does.
TEST(NvmeCheckpoint, ParametersInFilesSaveAtWorld2AndLoadAtWorld1InMemory) {
  const std::string nvme_ckpt = scratch_dir("nvme-params"), mem_ckpt = scratch_dir("mem"),
                    state_dir = scratch_dir("state");
  run_ranks(2, [&](const ProcessGroup& pg) {
    train_and_save(with_nvme_params(pg, state_dir), nvme_ckpt);
    train_and_save(options_for(pg), mem_ckpt);
  });
  expect_same(resume(nvme_ckpt, options_for(ProcessGroup())),
              resume(mem_ckpt, options_for(ProcessGroup())));
  std::filesystem::remove_all(nvme_ckpt);
  std::filesystem::remove_all(mem_ckpt);
  std::filesystem::remove_all(state_dir);
}

TEST(NvmeCheckpoint, SavedInMemoryLoadsIntoParameterFilesAtWorld2) {
  const std::string ckpt = scratch_dir("plain"), state_dir = scratch_dir("state");
  if (!is_rank_process()) train_and_save(options_for(ProcessGroup()), ckpt);
  run_ranks(2, [&](const ProcessGroup& pg) {
    const auto into_files = resume(ckpt, with_nvme_params(pg, state_dir));
    const auto into_mem = resume(ckpt, options_for(pg));
    expect_same(into_files, into_mem);
  });
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove_all(state_dir);
}

}  // namespace test_checkpoint_nvme_cases
