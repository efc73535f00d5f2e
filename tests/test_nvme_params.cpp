// Parameters on NVMe (Note [NVMe parameters]: ShardingOptions::offload_param with
// OffloadDevice::kNvme): training with the masters, gradients and 16-bit copies in files
// equals in-memory training bit for bit (worlds 1 and 2, fp32 and bf16, gradient
// accumulation, HYBRID_SHARD, both I/O engines); host memory does not grow with the
// model (exact counts); the files hold exactly what the note says; bad settings and a
// shared disk too small for all its ranks are refused before anything is reserved.
#include <fsdp/clip_grad.h>
#include <fsdp/fused_adamw.h>

#include "support/models.h"
#include "support/multirank.h"
#include "support/temp_dir.h"

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include "../src/internal/sharded_model.h"  // shard sizes for the expected bytes

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_nvme_params_cases {

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

int64_t round_up(int64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

// Pages of `t`'s bytes in the page cache (mincore over its mapping).
int64_t resident_pages(const torch::Tensor& t) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto a = reinterpret_cast<uintptr_t>(t.data_ptr()) / page * page;
  const auto e = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes();
  std::vector<unsigned char> in((e - a + page - 1) / page);
  EXPECT_EQ(mincore(reinterpret_cast<void*>(a), e - a, in.data()), 0) << std::strerror(errno);
  int64_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return n;
}

gpt::Config gpt_config(int64_t layers) {
  gpt::Config c = small_gpt_config();
  c.n_layer = layers;
  return c;
}

// `files`: offload_param = nvme (else the parameters stay in memory, with the optimizer
// state in files: the same arithmetic).
ShardingOptions options(const ProcessGroup& pg, const std::string& dir, bool bf16, bool files) {
  ShardingOptions o;
  o.process_group = pg;
  o.auto_wrap_policy = wrap::module_type_policy<gpt::Block>();
  o.offload_optimizer.device = OffloadDevice::kNvme;
  o.offload_optimizer.nvme_path = dir;
  o.offload_optimizer.buffer_bytes =
      3 * (18 * 2048 + 6 * 4096);  // the smallest: several chunks per shard
  if (files) {
    o.offload_param.device = OffloadDevice::kNvme;
    o.offload_param.nvme_path = dir;
  }
  if (bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  return o;
}

// Bytes of this rank's parameter files as the note lays them out.
int64_t expected_file_bytes(const ShardedModel& model) {
  int64_t bytes = 0;
  for (const auto& f : fsdp::detail::flat_params(model)) {
    const int64_t master = round_up(4 * f.shard_numel);
    bytes += master;
    if (!f.requires_grad) continue;
    bytes += master;
    if (f.param_dtype != torch::kFloat) bytes += round_up(2 * f.shard_numel);
  }
  return bytes;
}

// Steps 0..steps-1 of both models on the same rows; step 1 in two micro-batches (the
// second gradient is added to the first in the file); gradients clipped. Equal losses
// and norms at every step, and equal parameters after.
template <class Model>
void train_side_by_side(const ProcessGroup& pg, Model& mem, Model& files, FusedAdamW& opt_mem,
                        FusedAdamW& opt_files, int64_t steps) {
  EXPECT_NE(opt_files.state_offload_info().find("with the parameters"), std::string::npos)
      << opt_files.state_offload_info();
  EXPECT_EQ(opt_mem.state_offload_info().find("with the parameters"), std::string::npos);
  const int64_t block = small_gpt_config().block_size;
  for (int64_t s = 0; s < steps; ++s) {
    auto rows = my_rows(gpt_batch(s, 8, block), pg);
    const int64_t parts = s == 1 ? 2 : 1;
    for (int64_t k = 0; k < parts; ++k) {
      auto part = rows.chunk(parts, 0)[static_cast<size_t>(k)];
      torch::Tensor lm = gpt::loss_on(mem, part), lf = gpt::loss_on(files, part);
      EXPECT_EQ(lm.item<double>(), lf.item<double>()) << "step " << s << " part " << k;
      lm.backward();
      lf.backward();
    }
    // Clipped every step (the norm is far above 1e-3): read and scaled in the files.
    EXPECT_EQ(clip_grad_norm_(mem, 1e-3), clip_grad_norm_(files, 1e-3)) << "step " << s;
    opt_mem.step();
    opt_files.step();
    opt_mem.zero_grad();
    opt_files.zero_grad();
  }
  auto a = full_state_dict(mem), b = full_state_dict(files);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
}

void parity(const ProcessGroup& pg, bool bf16, const char* io, bool hybrid) {
  if (*io != 0) {
    setenv("FSDP_NVME_IO", io, 1);
  } else {
    unsetenv("FSDP_NVME_IO");  // io_uring where allowed, else the thread pool
  }
  TempDir dir;
  ShardingOptions mem_opts = options(pg, dir.path, bf16, false);
  ShardingOptions file_opts = options(pg, dir.path, bf16, true);
  if (hybrid) {
    for (auto* o : {&mem_opts, &file_opts}) {
      o->strategy = ShardingStrategy::kHybridShard;
      o->hybrid_group_size = 1;  // shard over one rank, replicate over the others
    }
  }
  // Four blocks: beyond the two units prefetch gathers, a third reads ahead.
  torch::manual_seed(0);
  auto mem = fully_shard(gpt::GPT(gpt_config(4)), mem_opts);
  torch::manual_seed(0);
  auto files = fully_shard(gpt::GPT(gpt_config(4)), file_opts);
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
  FusedAdamW opt_mem(mem, adamw), opt_files(files, adamw);
  train_side_by_side(pg, mem, files, opt_mem, opt_files, 4);
  const stats::MemoryStats m = files.memory_stats();
  EXPECT_EQ(m.sharded_params.peak, 0);
  EXPECT_EQ(m.grad_shards.peak, 0);
  EXPECT_EQ(m.nvme_params.current, expected_file_bytes(files));
  const stats::CommStats c = files.comm_stats().total;
  EXPECT_GT(c.nvme_read_bytes, 0);
  EXPECT_GT(c.nvme_write_bytes, 0);
  // Gathers found their inputs read ahead (queued while the unit before computed).
  EXPECT_GT(c.nvme_reads_ahead, 0);
  EXPECT_EQ(mem.comm_stats().total.nvme_read_bytes, 0);
  unsetenv("FSDP_NVME_IO");
}

}  // namespace

class NvmeParamsAtWorld : public ::testing::TestWithParam<int> {};
TEST_P(NvmeParamsAtWorld, TrainBitIdenticallyToParametersInMemoryFp32) {
  run_ranks(GetParam(), [](const ProcessGroup& pg) { parity(pg, false, "threads", false); });
}
TEST_P(NvmeParamsAtWorld, TrainBitIdenticallyToParametersInMemoryBf16) {
  // io_uring where the kernel allows it (make_io_engine falls back to the thread pool).
  run_ranks(GetParam(), [](const ProcessGroup& pg) { parity(pg, true, "", false); });
}
INSTANTIATE_TEST_SUITE_P(World, NvmeParamsAtWorld, ::testing::Values(1, 2));

TEST(NvmeParams, HybridShardTrainsBitIdentically) {
  run_ranks(2, [](const ProcessGroup& pg) { parity(pg, true, "threads", true); });
}

// The bound of Note [NVMe parameters]: with the parameters in files, every host counter
// peaks at the same bytes for 6 and 16 blocks of the same width (what computes, not the
// model; from 6 blocks on, kGradWritesInFlight gradients are being written while one unit
// reads ahead and two are gathered: 4 blocks peak lower), while with the parameters in
// memory the shards grow with the blocks.
TEST(NvmeParams, HostMemoryDoesNotGrowWithTheModel) {
  auto peaks = [](int64_t layers, bool files) {
    TempDir dir;
    torch::manual_seed(0);
    auto model = fully_shard(gpt::GPT(gpt_config(layers)),
                             options(ProcessGroup(), dir.path, /*bf16=*/true, files));
    FusedAdamW opt(model, torch::optim::AdamWOptions(1e-3));
    for (int64_t s = 0; s < 2; ++s) {
      gpt::loss_on(model, gpt_batch(s, 4, small_gpt_config().block_size)).backward();
      opt.step();
      opt.zero_grad();
    }
    if (files && opt.state_offload_info().find("O_DIRECT") != std::string::npos) {
      // Training moved the bytes with O_DIRECT, never through the mapping: none of the
      // masters is in the page cache.
      for (const auto& p : model.sharded_parameters())
        EXPECT_EQ(resident_pages(p), 0) << "a master was read or written through its mapping";
    }
    const stats::MemoryStats m = model.memory_stats();
    return std::vector<int64_t>{m.sharded_params.peak,  m.grad_shards.peak,
                                m.gathered_params.peak, m.comm_buffers.peak,
                                m.offload_buffers.peak, m.nvme_params.current};
  };
  const auto small = peaks(6, true), large = peaks(16, true);
  const char* names[] = {"sharded_params", "grad_shards", "gathered_params", "comm_buffers",
                         "offload_buffers"};
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(small[i], large[i]) << names[i];
  EXPECT_EQ(small[0], 0);
  EXPECT_EQ(small[1], 0);
  EXPECT_GT(small[2], 0);
  EXPECT_GT(large[5], 2 * small[5]) << "the files grow with the model instead";
  // In memory, the same models' shards grow: the test can tell the two apart.
  const auto small_mem = peaks(4, false), large_mem = peaks(12, false);
  EXPECT_GT(large_mem[0], 2 * small_mem[0]);
  EXPECT_EQ(small_mem[5], 0);
}

TEST(NvmeParams, NeedsTheOptimizerStateInFilesToo) {
  TempDir dir;
  ShardingOptions o = options(ProcessGroup(), dir.path, false, true);
  o.offload_optimizer.device = OffloadDevice::kCpu;
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); }),
            "ShardingOptions::offload_param.device=nvme needs "
            "ShardingOptions::offload_optimizer.device=nvme too (got cpu): the optimizer steps the "
            "fp32 masters where they are, streaming them from the files with its moments. Offload "
            "the optimizer to NVMe too, or the parameters to cpu");
}

TEST(NvmeParams, PureBf16HasNoMastersToOffload) {
  TempDir dir;
  ShardingOptions o = options(ProcessGroup(), dir.path, true, true);
  o.mixed_precision.master_dtype = torch::kBFloat16;
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); }),
            "ShardingOptions::offload_param.device=nvme keeps fp32 masters in files; "
            "MixedPrecision::master_dtype=BFloat16 (pure bf16) has none. Use "
            "MixedPrecision::master_dtype=Float, or ShardingOptions::offload_param.device=cpu");
}

TEST(NvmeParams, PersistentStrategiesAreRefused) {
  TempDir dir;
  ShardingOptions o = options(ProcessGroup(), dir.path, false, true);
  o.strategy = ShardingStrategy::kZero2;
  EXPECT_NE(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); })
                .find("ShardingOptions::offload_param.device=nvme needs a strategy that frees "
                      "parameters after use (ShardingOptions::strategy=kFullShard, ZeRO-3, or "
                      "kHybridShard)"),
            std::string::npos);
}

TEST(NvmeParams, EmptyAndMissingPathsAreRefused) {
  TempDir dir;
  ShardingOptions o = options(ProcessGroup(), dir.path, false, true);
  o.offload_param.nvme_path = "";
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); }),
            "ShardingOptions::offload_param.nvme_path is empty: set it to a directory on the NVMe "
            "disk (e.g. /local_nvme/fsdp), in which each rank makes its own files");
  o.offload_param.nvme_path = dir.path + "/absent";
  EXPECT_EQ(error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); })
                .rfind("ShardingOptions::offload_param.nvme_path='" + dir.path +
                           "/absent' cannot be used: No such file or directory",
                       0),
            0u);
}

// Note [Shared NVMe disk], for the parameter files: two ranks on one disk with room for
// one rank's files and a half. Both refuse at fully_shard, naming the ranks, the bytes
// they need together and the bytes free, before either reserved anything.
TEST(NvmeParams, RanksSharingADiskAreCheckedTogetherBeforeReserving) {
  std::unique_ptr<TempDir> dir;
  if (!is_rank_process()) {
    // A rank's files at world 2: half of each flat parameter (rounded up), as laid out.
    ShardingOptions whole;
    whole.auto_wrap_policy = wrap::never_wrap_policy();
    auto one = fully_shard(gpt::GPT(small_gpt_config()), whole);
    int64_t per_rank = 0;
    for (const auto& f : fsdp::detail::flat_params(one)) {
      const int64_t shard = (f.numel + 1) / 2;
      per_rank += round_up(4 * shard) * (f.requires_grad ? 2 : 1);
    }
    dir = std::make_unique<TempDir>();
    const int64_t kib = (per_rank + per_rank / 2) / 1024;
    if (!dir->mount_tmpfs(std::to_string(kib) + "k"))
      GTEST_SKIP() << "mount -t tmpfs failed (" << std::strerror(errno)
                   << "): a small shared disk needs root to mount a tmpfs";
    struct statvfs vfs {};
    ASSERT_EQ(statvfs(dir->path.c_str(), &vfs), 0);
    const int64_t avail = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
    ASSERT_GE(avail, per_rank) << "one rank's files must fit";
    ASSERT_LT(avail, 2 * per_rank) << "two ranks' files must not";
  }
  run_ranks(
      2,
      [](const ProcessGroup& pg) {
        const std::string path = std::getenv("FSDP_TEST_SHARED_DISK");
        ShardingOptions o = options(pg, path, false, true);
        o.auto_wrap_policy = wrap::never_wrap_policy();
        const std::string what = error_of([&] { fully_shard(gpt::GPT(small_gpt_config()), o); });
        EXPECT_EQ(what.rfind("not enough free space in ShardingOptions::offload_param."
                             "nvme_path='" +
                                 path +
                                 "' on the disk that ranks 0, 1 share (one machine, one file "
                                 "system): together they need ",
                             0),
                  0u)
            << what;
        EXPECT_NE(what.find(", each rank its parameter files for the model (the fp32 master "
                            "shards and their gradients, 8 bytes for each trainable shard "
                            "element"),
                  std::string::npos)
            << what;
        struct statvfs vfs {};
        ASSERT_EQ(statvfs(path.c_str(), &vfs), 0);
        EXPECT_EQ(vfs.f_bfree, vfs.f_blocks) << "a rank reserved its files before the check";
        // Built sharded (make_sharded), each unit is checked as it is built: the
        // unit that no longer fits for both ranks is refused the same way on both,
        // not by ENOSPC on one.
        o.auto_wrap_policy = wrap::module_type_policy<gpt::Block>();
        const std::string built = error_of([&] { make_sharded<gpt::GPT>(o, small_gpt_config()); });
        EXPECT_EQ(built.rfind("not enough free space in ShardingOptions::offload_param."
                              "nvme_path='" +
                                  path + "' on the disk that ranks 0, 1 share",
                              0),
                  0u)
            << built;
      },
      300, {"FSDP_TEST_SHARED_DISK=" + (dir ? dir->path : std::string())});
}

// Parameter groups (train_gpt's no-decay recipe) step segments of the shards: ranges that
// start and end inside pages shared with their neighbours. Their whole pages stream by
// O_DIRECT and the partial ones through the mapping (Note [NVMe parameters]); training
// still equals memory bit for bit.
TEST(NvmeParams, ParameterGroupsStreamSegmentsOfTheShardsExactly) {
  run_ranks(2, [](const ProcessGroup& pg) {
    TempDir dir;
    torch::manual_seed(0);
    auto mem = fully_shard(gpt::GPT(small_gpt_config()), options(pg, dir.path, true, false));
    torch::manual_seed(0);
    auto files = fully_shard(gpt::GPT(small_gpt_config()), options(pg, dir.path, true, true));
    const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
    ShardParamGroups gm(mem, no_decay_groups(0.1)), gf(files, no_decay_groups(0.1));
    FusedAdamW opt_mem(gm, adamw), opt_files(gf, adamw);
    train_side_by_side(pg, mem, files, opt_mem, opt_files, 4);
  });
}

TEST(NvmeParams, TooSmallBufferIsRefusedNamingTheLeast) {
  TempDir dir;
  ShardingOptions o = options(ProcessGroup(), dir.path, false, true);
  // The parameters stream through both sections' buffers: together too small.
  o.offload_optimizer.buffer_bytes = 64 * 1024;
  o.offload_param.buffer_bytes = 32 * 1024;
  auto model = fully_shard(gpt::GPT(small_gpt_config()), o);
  EXPECT_EQ(error_of([&] { FusedAdamW opt(model); }),
            "ShardingOptions::offload_optimizer.buffer_bytes=65536 with "
            "offload_param.buffer_bytes=32768 is too small: with "
            "offload_param=nvme the optimizer streams three chunks of the masters, gradients, "
            "exp_avg, exp_avg_sq and 16-bit copies through it, at least 2048 elements each "
            "(184320 bytes); use 64 MiB (the default)");
}

// fully_shard's host-memory check counts what each mode keeps in RAM: with the optimizer
// state in files, 8 bytes per element (shard and gradient); a model that needs 8 bytes per
// element beyond what is available is refused with that count in the message.
struct HugeImpl : torch::nn::Module {
  explicit HugeImpl(int64_t n) { register_parameter("w", torch::empty({n})); }
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Huge);

TEST(NvmeParams, HostMemoryCheckCountsEightBytesWithTheStateInFiles) {
  int64_t avail = -1;
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) avail = std::stoll(line.substr(13)) * 1024;
  }
  ASSERT_GT(avail, 0);
  const int64_t n = avail / 6;  // 8 bytes each: 4/3 of what is available
  TempDir dir;
  const std::string msg =
      error_of([&] { fully_shard(Huge(n), options(ProcessGroup(), dir.path, false, false)); });
  EXPECT_NE(msg.find("fully_shard: not enough host memory. " + std::to_string(n) +
                     " parameters sharded over 1 ranks need"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find(" per rank in host RAM (fp32 shard and gradient, the Adam state being in "
                     "files: 8 bytes per element)"),
            std::string::npos)
      << msg;
}

}  // namespace test_nvme_params_cases
